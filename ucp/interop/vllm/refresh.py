"""Refresh a running vLLM engine's weights in place from a newer step (reinforcement learning: the rollout engine
follows the trainer), from storage or from tensors in this process's memory.

`refresh(llm, url, step)` checks the step on every worker first (`UcpWorkerExtension.ucp_check`): a step of another
model, or one that cannot be read, is refused in one line (its ucp error) before any weight changes, and the engine
goes on serving what it served. Then every worker reads its share of each weight and puts it in place through vLLM's
own `reload_weights`, and the prefix cache, whose entries were computed with the old weights, is emptied.

The engine must have been built with ucp's worker extension (`LLM(..., worker_extension_cls=WORKER_EXTENSION)`); it
may have started from any weights (a ucp step, or a Hugging Face directory), and in any mode (workers in this
process or in their own). A `vllm serve` process takes the same two rounds over HTTP: `refresh_server`.

`refresh_from_memory` takes the tensors a trainer holds in this process (the colocated RL setup): its ranks' local
states in its layout (ucp.interop.weights.load_weights' `.local`, Megatron-Core names: docs/LOCAL_STATE.md), or full
tensors by HF name. It needs an engine whose worker runs in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, one
worker), since tensors cannot cross to another process through vLLM's RPC; for an engine in other processes, save the
state where both can read it (`ucp.save(state, "/dev/shm/...")`, or the trainer's hot tier) and refresh from there,
each worker then reading only its share.
"""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ...errors import UcpError, error_kind
from ...sharding.families import FamilyConfig, canonical_atoms
from ...sharding.layout import Layout, parse_layout
from ...sharding.reshard import assemble
from ..errors import InteropError, ModelMismatchError
from ..streaming import DEFAULT_MEMORY_BUDGET
from .engine import LoadReport, Request, engine_name
from .source import served_config


@dataclass(frozen=True)
class RefreshReport:
    """What a refresh did: where the weights came from (a checkpoint's URL, or "memory"), the step now served (None
    from memory), what each worker read from storage (in rank order; none from memory), and the time it took."""

    source: str
    step: int | None
    workers: list[LoadReport]
    seconds: float

    @property
    def bytes_read(self) -> list[int]:
        return [w.bytes_read for w in self.workers]


def refresh(
    llm: Any,
    url: str,
    step: int | str | None = None,
    *,
    storage_options: dict[str, Any] | None = None,
    memory_budget: int = DEFAULT_MEMORY_BUDGET,
) -> RefreshReport:
    """Replace every weight of the running `llm` (a `vllm.LLM` built with ucp's worker extension) with step `step`
    (default: the latest) of checkpoint `url`, in place; refuses a step of another model before changing anything."""
    start = time.perf_counter()
    request = Request(url, step, storage_options, memory_budget).dumps()
    _raise_first(_rpc(llm, "ucp_check", request))
    results = _rpc(llm, "ucp_refresh", request)
    llm.reset_prefix_cache()
    _raise_first([r if "kind" in r else None for r in results])
    reports = [LoadReport.from_json(r) for r in results]
    return RefreshReport(url, reports[0].step, reports, time.perf_counter() - start)


def refresh_server(
    base_url: str,
    url: str,
    step: int | str | None = None,
    *,
    storage_options: dict[str, Any] | None = None,
    memory_budget: int = DEFAULT_MEMORY_BUDGET,
    timeout: float = 600.0,
) -> RefreshReport:
    """`refresh` for a `vllm serve` process at `base_url` (e.g. "http://127.0.0.1:8000"), started with
    `--worker-extension-cls ucp.interop.vllm.worker.UcpWorkerExtension` and `VLLM_SERVER_DEV_MODE=1` (which opens its
    `/collective_rpc` and `/reset_prefix_cache`: endpoints for a trusted network only)."""
    start = time.perf_counter()
    request = Request(url, step, storage_options, memory_budget).dumps()

    def post(path: str, body: dict[str, Any] | None = None) -> Any:
        data = json.dumps(body).encode() if body is not None else b""
        req = urllib.request.Request(
            base_url.rstrip("/") + path, data=data, headers={"Content-Type": "application/json"}, method="POST"
        )
        try:
            with urllib.request.urlopen(req, timeout=timeout) as answer:
                text = answer.read().decode()
        except OSError as e:  # (urllib's HTTPError and URLError are OSErrors)
            raise InteropError(f"vLLM server {base_url}{path} failed: {e}") from None
        return json.loads(text) if text else None

    _raise_first(post("/collective_rpc", {"method": "ucp_check", "args": [request]})["results"])
    results = post("/collective_rpc", {"method": "ucp_refresh", "args": [request]})["results"]
    post("/reset_prefix_cache")
    _raise_first([r if "kind" in r else None for r in results])
    reports = [LoadReport.from_json(r) for r in results]
    return RefreshReport(url, reports[0].step, reports, time.perf_counter() - start)


def refresh_from_memory(
    llm: Any,
    state: Sequence[Mapping[str, Any]] | Mapping[str, torch.Tensor],
    config: FamilyConfig,
    layout: str | Layout | None = None,
) -> RefreshReport:
    """Replace every weight of `llm` (its worker in this process) with tensors this process holds: with `layout`,
    `state` is the local state of every rank of a job in that layout, in rank order (each as `load_weights(...).local`
    gives it: {"model": {Megatron-Core name: tensor}}); without, {HF name: full tensor}. `config` is the model's; a
    model other than the engine's, or tensors missing or misshapen, are refused before any weight changes."""
    start = time.perf_counter()
    engine = _in_process_engine(llm)
    serving = served_config(llm.llm_engine.model_config.hf_config.to_dict(), engine)
    if serving != config:
        raise ModelMismatchError(
            f"the tensors are of another model ({type(config).__name__}) than {engine} serves; nothing was changed"
        )
    if layout is None:
        tensors = dict(state)  # type: ignore[arg-type]
    else:
        lay = layout if isinstance(layout, Layout) else parse_layout(layout)
        tensors = assemble(list(state), config, lay, optim_states=())["model"]  # type: ignore[arg-type]
    expected = canonical_atoms(config)
    wrong = [
        f"{n}: {'missing' if n not in tensors else tuple(tensors[n].shape)} (expected {shape})"
        for n, (shape, _) in expected.items()
        if n not in tensors or tuple(tensors[n].shape) != tuple(shape)
    ]
    if wrong or set(tensors) - set(expected):
        extra = sorted(set(tensors) - set(expected))
        raise ModelMismatchError(
            f"the tensors do not hold {engine}'s weights ({'; '.join(wrong[:3])}{'; unknown ' + str(extra[:3]) if extra else ''}); "
            "nothing was changed"
        )
    llm.collective_rpc("ucp_refresh_tensors", args=(tensors,))
    llm.reset_prefix_cache()
    return RefreshReport("memory", None, [], time.perf_counter() - start)


def _rpc(llm: Any, method: str, request: str) -> list[Any]:
    try:
        return list(llm.collective_rpc(method, args=(request,)))
    except AttributeError as e:
        if method in str(e):
            raise InteropError(
                "this engine was built without ucp's worker extension: build it with "
                "LLM(..., worker_extension_cls=ucp.interop.vllm.WORKER_EXTENSION)"
            ) from None
        raise


def _raise_first(problems: Sequence[dict[str, str] | None]) -> None:
    """Raise the first worker's refusal as its own ucp error class."""
    for problem in problems:
        if problem:
            raise (error_kind(problem["kind"]) or UcpError)(problem["message"])


def _in_process_engine(llm: Any) -> str:
    """The engine's name, if its one worker runs in this process; else a refusal saying what to do instead."""
    engine = engine_name(llm.llm_engine.model_config)
    executor = getattr(getattr(llm.llm_engine.engine_core, "engine_core", None), "model_executor", None)
    if type(executor).__name__ != "UniProcExecutor":
        raise InteropError(
            f"{engine} runs its workers in other processes, which tensors in this one cannot reach through vLLM's "
            "RPC: build it with VLLM_ENABLE_V1_MULTIPROCESSING=0 and one worker, or save the state "
            "(ucp.save(state, '/dev/shm/...')) and refresh(llm, url) from there"
        )
    return engine
