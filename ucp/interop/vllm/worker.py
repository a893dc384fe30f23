"""ucp's methods on vLLM's workers, for refreshing the weights of a running engine in place (reinforcement learning:
the rollout engine follows the trainer's steps).

vLLM adds the methods of `worker_extension_cls` to every worker it starts (`LLM(..., worker_extension_cls=
WORKER_EXTENSION)`, `vllm serve ... --worker-extension-cls ucp.interop.vllm.worker.UcpWorkerExtension`), and runs one
on every worker at once through `collective_rpc` by its name: no code crosses processes, and over HTTP (`vllm serve`'s
`/collective_rpc`) only strings do, so each method takes its request as a JSON string (`engine.Request`).

A refresh goes in two rounds (`ucp.interop.vllm.refresh`): every worker first checks the new step (`ucp_check`: it
exists, holds the model the worker serves, every weight there), and only when every worker agrees does any of them
load it (`ucp_refresh`, through vLLM's own `reload_weights`, which puts each weight back into the kernels' formats).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import torch

from ...errors import UcpError
from .engine import Request, engine_name, kept_shares, open_for, report_of, tensors_for

WORKER_EXTENSION = "ucp.interop.vllm.worker.UcpWorkerExtension"


class UcpWorkerExtension:
    """Mixed into vLLM's worker class, which provides `vllm_config`, `get_model()` and `reload_weights(...)` (vLLM
    refuses an extension that defines a name its worker has, so they are only declared here)."""

    vllm_config: Any
    get_model: Any
    reload_weights: Any

    def _engine_name(self) -> str:
        return engine_name(self.vllm_config.model_config)

    def ucp_check(self, request: str) -> dict[str, str] | None:
        """None if the requested step can replace this worker's weights, else the reason (`refusal`)."""
        try:
            open_for(self.vllm_config.model_config, Request.loads(request))
        except UcpError as e:
            return refusal(e)
        return None

    def ucp_refresh(self, request: str) -> dict[str, Any]:
        """Replace every weight with the requested step's (checked first by `ucp_check`, on every worker); returns
        what this worker read (`engine.LoadReport`, as JSON), or why it failed (`refusal`): a step found damaged while
        it is read leaves the weights read so far in place, which the message says."""
        start = time.perf_counter()
        parsed = Request.loads(request)
        try:
            weights = open_for(self.vllm_config.model_config, parsed)
            model = self.get_model()
            self.reload_weights(weights_iterator=tensors_for(model, weights, parsed))
        except UcpError as e:
            return refusal(
                e,
                f"; {self._engine_name()} now holds some of step {parsed.step}'s weights and the rest of what it "
                "served: refresh again from a readable step",
            )
        return report_of(weights, kept_shares(model), start).to_json()

    def ucp_refresh_tensors(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Replace every weight with `tensors` ({HF name: full tensor}, checked by the caller): only for an engine in
        the caller's own process, where the tensors arrive as themselves."""
        self.reload_weights(weights_iterator=iter(tensors.items()))


def refusal(error: UcpError, more: str = "") -> dict[str, str]:
    """A worker's ucp error as {"kind": its class's name, "message": ...}, returned rather than raised: an exception
    in a worker process takes the whole engine down."""
    return {"kind": type(error).__name__, "message": str(error) + more}
