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
import os
import threading
import time
import urllib.request
import weakref
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ...errors import UcpError, error_kind
from ...sharding.families import FamilyConfig, canonical_atoms
from ...sharding.layout import Layout, parse_layout
from ...sharding.reshard import assemble, owned_pieces
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
    url: str | os.PathLike[str],
    step: int | str | None = None,
    *,
    storage_options: dict[str, Any] | None = None,
    memory_budget: int = DEFAULT_MEMORY_BUDGET,
) -> RefreshReport:
    """Replace every weight of the running `llm` (a `vllm.LLM` built with ucp's worker extension) with step `step`
    (default: the latest) of checkpoint `url`, in place; refuses a step of another model before changing anything."""
    start = time.perf_counter()
    url = os.fspath(url)  # (a Path too: the request crosses to the workers as JSON)
    request = Request(url, step, storage_options, memory_budget).dumps()
    with _refreshing(llm):
        _raise_first(_rpc(llm, "ucp_check", request))
        results = _rpc(llm, "ucp_refresh", request)
        llm.reset_prefix_cache()
    _raise_first([r if "kind" in r else None for r in results])
    reports = [LoadReport.from_json(r) for r in results]
    return RefreshReport(url, reports[0].step, reports, time.perf_counter() - start)


def refresh_server(
    base_url: str,
    url: str | os.PathLike[str],
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
    url = os.fspath(url)  # (a Path too: the request crosses to the workers as JSON)
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
    model other than the engine's, tensors missing or misshapen, or not floating point, or not on the host or the
    engine's device, are refused before any weight changes."""
    start = time.perf_counter()
    engine = _in_process_engine(llm)
    serving = served_config(llm.llm_engine.model_config.hf_config.to_dict(), engine)
    if serving != config:
        raise ModelMismatchError(
            f"the tensors are of another model ({type(config).__name__}) than {engine} serves; nothing was changed"
        )
    devices = {"cpu", _engine_device(llm)}
    if layout is None:
        if not isinstance(state, Mapping):
            raise InteropError(
                f"refresh_from_memory of {engine}: a list of rank states needs the layout they are in "
                "(layout='tp2pp1', ...); without one, state is {HF name: full tensor}; nothing was changed"
            )
        tensors = _checked(state.items(), engine, devices)
    else:
        lay = layout if isinstance(layout, Layout) else parse_layout(layout)
        states = None if isinstance(state, Mapping) else list(state)
        if states is None or not all(isinstance(r, Mapping) for r in states):
            raise InteropError(
                f"refresh_from_memory of {engine}: with a layout, state is the list of every rank's local state "
                '(each {"model": {Megatron-Core name: tensor}}, as load_weights(...).local gives it); nothing was changed'
            )
        if len(states) == lay.world_size:  # (else assemble says so)
            for rank, local in enumerate(states):
                _checked(_read_by_assemble(local, config, lay, rank, f"rank {rank}: "), engine, devices)
        tensors = assemble(states, config, lay, optim_states=())["model"]
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
    with _refreshing(llm):
        llm.collective_rpc("ucp_refresh_tensors", args=(tensors,))
        llm.reset_prefix_cache()
    return RefreshReport("memory", None, [], time.perf_counter() - start)


# One refresh at a time per engine: an engine in this process runs each worker method in the calling thread, and two
# of vLLM's layer-by-layer reloads at once take each other's layers apart (an AttributeError in one, and an engine
# serving neither step after). Weak keys: an engine shut down and dropped takes its lock with it.
_LOCKS: weakref.WeakKeyDictionary[Any, threading.Lock] = weakref.WeakKeyDictionary()
_LOCKS_GUARD = threading.Lock()


def _refreshing(llm: Any) -> threading.Lock:
    """The lock that refreshes of `llm` hold."""
    with _LOCKS_GUARD:
        return _LOCKS.setdefault(llm, threading.Lock())


def _checked(items: Iterable[tuple[str, Any]], engine: str, devices: set[str]) -> dict[str, torch.Tensor]:
    """{name: tensor} of `items`, each refused unless a floating-point tensor with data where the engine can copy
    from (an integer or bool tensor would be converted to the engine's dtype and served as such; a meta tensor stops
    the engine half-way through the reload), detached from any autograd graph (a trainer's parameters)."""
    out: dict[str, torch.Tensor] = {}
    for name, t in items:
        problem = (
            f"a {type(t).__name__}, not a tensor"
            if not isinstance(t, torch.Tensor)
            else f"dtype {t.dtype}, not floating point"
            if not t.is_floating_point()
            else f"on device {t.device}, not {' or '.join(sorted(devices))}"
            if t.device.type not in devices
            else None
        )
        if problem:
            raise InteropError(f"refresh_from_memory of {engine}: tensor {name} is {problem}; nothing was changed")
        out[name] = t.detach()
    return out


def _read_by_assemble(
    local: Mapping[str, Any], config: FamilyConfig, layout: Layout, rank: int, prefix: str
) -> Iterator[tuple[str, Any]]:
    """(path, value) of each entry of rank `rank`'s local state that `assemble` takes the weights from (what else the
    state holds, Transformer Engine's `_extra_state` say, is not read; a missing entry is left to assemble to name)."""
    for piece in owned_pieces(config, layout, rank, ()):
        node: Any = local
        for key in piece.key:
            node = node.get(key) if isinstance(node, Mapping) else None
        if node is not None:
            yield prefix + "/".join(piece.key), node


def _engine_device(llm: Any) -> str:
    """The type of the device the engine computes on ("cpu", "cuda", ...)."""
    device = getattr(getattr(llm.llm_engine.vllm_config, "device_config", None), "device", None)
    return torch.device(device).type if device is not None and str(device) != "auto" else "cpu"


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
