"""ucp's methods on vLLM's workers, for refreshing the weights of a running engine in place (reinforcement learning:
the rollout engine follows the trainer's steps).

vLLM adds the methods of `worker_extension_cls` to every worker it starts (`LLM(..., worker_extension_cls=
WORKER_EXTENSION)`, `vllm serve ... --worker-extension-cls ucp.interop.vllm.worker.UcpWorkerExtension`), and runs one
on every worker at once through `collective_rpc` by its name: no code crosses processes, and over HTTP (`vllm serve`'s
`/collective_rpc`) only strings do, so each method takes its request as a JSON string (`engine.Request`).

A refresh goes in two rounds (`ucp.interop.vllm.refresh`): every worker first checks the new step (`ucp_check`: it
exists, holds the model the worker serves, every weight there), and only when every worker agrees does any of them
load it (`ucp_refresh`, through vLLM's own `reload_weights`, which puts each weight back into the kernels' formats).

vLLM's `reload_weights` (0.32, its CPU build) leaves two of the kernels' own copies of the weights as they were, and
the engine then computes with the old step's weights there (a silent wrong output; its own `reload_weights
(weights_path=...)` of safetensors does the same): a tied LM head, whose weight is the embedding's and is reloaded
through it, so that the head's own `process_weights_after_loading` never runs again and its packed copy
(`cpu_linear`, made from the weight at start-up) stays; and the experts of an MoE layer, which vLLM sets up for a
weight update without the experts' own step (`fused_experts.process_weights_after_loading`: the CPU experts' prepack
into their grouped-GEMM layout), so that the new weights land unpacked where the kernel reads packed ones.
`kernels_rebuilt` redoes both around every reload.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator, Mapping
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
        it is read leaves each layer with the new step's weights or its old ones (`reload_abandoned`), which the
        message says (nothing changed if it failed before vLLM had any weight of it)."""
        start = time.perf_counter()
        parsed = Request.loads(request)
        handed = [0]  # (weights handed to vLLM before a failure: with none, every layer is as it was)
        try:
            weights = open_for(self.vllm_config.model_config, parsed)
            model = self.get_model()
            _reload(self, model, _counted(tensors_for(model, weights, parsed), handed))
        except UcpError as e:
            return refusal(
                e,
                "; nothing was changed"
                if not handed[0]
                else f"; {self._engine_name()} now holds some of step {parsed.step}'s weights and the rest of what it "
                "served: refresh again from a readable step",
            )
        return report_of(weights, kept_shares(model), start).to_json()

    def ucp_refresh_tensors(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Replace every weight with `tensors` ({HF name: full tensor}, checked by the caller): only for an engine in
        the caller's own process, where the tensors arrive as themselves."""
        _reload(self, self.get_model(), iter(tensors.items()))


def _reload(worker: Any, model: torch.nn.Module, weights: Iterator[tuple[str, torch.Tensor]]) -> None:
    """vLLM's `reload_weights` of `weights` into `model`, the kernels' own copies rebuilt (`kernels_rebuilt`), and, if
    it fails part-way, every layer not yet reloaded put back as it was (`reload_abandoned`). (A module function: vLLM
    refuses an extension whose names its worker has.)"""
    with kernels_rebuilt(model), reload_abandoned(model, worker.vllm_config.model_config):
        worker.reload_weights(weights_iterator=weights)


def _counted(items: Iterator[tuple[str, torch.Tensor]], count: list[int]) -> Iterator[tuple[str, torch.Tensor]]:
    for item in items:
        count[0] += 1
        yield item


@contextlib.contextmanager
def reload_abandoned(model: torch.nn.Module, model_config: Any) -> Iterator[None]:
    """Around a `reload_weights` of `model`: if it raises (a chunk found damaged, a store gone, part-way through the
    weights), the layers it had not finished are put back as they were before it. vLLM's layer-by-layer reload
    (0.32) first moves every layer's parameters to the meta device, and puts each back only once all its weights are
    in (or in its `finalize_layerwise_reload`, which an exception skips): an engine whose reload failed then computed
    on meta tensors (`NotImplementedError: _C::onednn_mm: ... Meta tensors` at its next generate). vLLM's own
    finalize, with every unfinished layer's partial weights dropped, puts their kernel tensors back: each layer then
    holds either the new step's weights (finished) or the old ones."""
    try:
        yield
    except BaseException:
        # (vLLM imported here, in its worker only: this package imports without it)
        from vllm.model_executor.model_loader.reload import layerwise

        for layer in model.modules():
            info = layerwise.LAYERWISE_INFO.get(layer)
            if info is not None and info.can_load():
                info.loaded_weights.clear()
                info.load_numel = 0
        quiet = _DropRecords()  # (its "Failed to load weights" for each layer put back: the refusal says it once)
        logging.getLogger(layerwise.__name__).addFilter(quiet)
        try:
            layerwise.finalize_layerwise_reload(model, model_config)
        finally:
            logging.getLogger(layerwise.__name__).removeFilter(quiet)
        raise


class _DropRecords(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return False


@contextlib.contextmanager
def kernels_rebuilt(model: torch.nn.Module) -> Iterator[None]:
    """Around a `reload_weights` of `model`: every MoE layer whose experts have a set-up step of their own (vLLM's CPU
    experts prepack their weights) is processed as at its first load (its kernel dropped before, so that vLLM builds
    it again, the experts' step included), and every layer with a packed copy of its weight (`cpu_linear`) that the
    reload did not process (a tied LM head) is processed again after, from its reloaded weight."""
    experts: list[tuple[Any, Any]] = []
    packed: list[tuple[torch.nn.Module, Any, Any]] = []
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        kernel = getattr(method, "moe_kernel", None)
        if kernel is not None and _own_step(getattr(kernel, "fused_experts", None)):
            experts.append((method, kernel))
        if getattr(module, "cpu_linear", None) is not None and method is not None:
            packed.append((module, method, module.cpu_linear))
    for method, _ in experts:
        method.moe_kernel = None
    try:
        yield
    finally:
        for method, kernel in experts:
            if method.moe_kernel is None:  # (a layer the reload did not reach: it still holds its old weights)
                method.moe_kernel = kernel
    for module, method, before in packed:
        weight = getattr(module, "weight", None)
        if module.cpu_linear is before and isinstance(weight, torch.Tensor) and weight.numel() and not weight.is_meta:
            method.process_weights_after_loading(module)


def _own_step(experts: Any) -> bool:
    """Whether the experts' class has a `process_weights_after_loading` of its own (its base's does nothing)."""
    return experts is not None and sum("process_weights_after_loading" in vars(c) for c in type(experts).__mro__) > 1


def refusal(error: UcpError, more: str = "") -> dict[str, str]:
    """A worker's ucp error as {"kind": its class's name, "message": ...}, returned rather than raised: an exception
    in a worker process takes the whole engine down."""
    return {"kind": type(error).__name__, "message": str(error) + more}
