"""What a vLLM worker does with a ucp step: load it into the model it builds (the loader), or into the model it serves
(a refresh), reading only the region of each weight that its tensor-parallel rank keeps.

Both go through vLLM's own `model.load_weights`, which takes (HF name, full tensor) pairs and puts each where the model
keeps it: every weight loader cuts its rank's share out of the full tensor itself (`narrow` along the split dimension
by the rank; q/k/v and gate/up each into their part of the fused parameter; the vocabulary by its padded ranges;
experts by expert and by their split). Which region of each tensor a rank keeps is therefore vLLM's to say, and
`shares` asks vLLM: it runs the model's `load_weights` once on meta tensors of the full shapes (no data), with every
copy out of them intercepted and recorded instead of done, and takes each weight's bounding box of what was copied.
The real load then reads only that box (the tensor handed over has the full shape; the rest is never looked at).
Where the answer is not a plain box (a weight the model converts before copying, or copies nothing of), the weight is
read whole, as every rank reads it with vLLM's own loaders of safetensors files.

The shares are found while the engine builds its model, before vLLM turns its parameters into its kernels' formats
(after which `load_weights` cannot run outside vLLM's reload), and kept on the model for the refreshes to come.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from ...base.boxes import Box
from ...format.manifest import AtomMeta
from ..errors import InteropError
from ..streaming import DEFAULT_MEMORY_BUDGET
from .source import Pointer, StepWeights, check_same_model, open_weights, served_config

log = logging.getLogger("ucp")

EXTRA_KEYS = ("url", "step", "storage_options", "memory_budget")
SHARES = "_ucp_shares"  # the model's attribute: {HF name: box this rank keeps} (absent: read every weight whole)


@dataclass(frozen=True)
class Request:
    """Which step an engine loads, as it crosses to the workers (a JSON string: vLLM's RPC over HTTP passes only
    strings)."""

    url: str
    step: int | str | None = None
    storage_options: dict[str, Any] | None = None
    memory_budget: int = DEFAULT_MEMORY_BUDGET

    def dumps(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def loads(cls, text: str) -> Request:
        try:
            doc = json.loads(text)
            return cls(str(doc["url"]), doc.get("step"), doc.get("storage_options"), int(doc["memory_budget"]))
        except (ValueError, KeyError, TypeError) as e:
            raise InteropError(f"a malformed ucp request {text[:200]!r} ({type(e).__name__}: {e})") from None


def request_of(extra: Mapping[str, Any], model_path: str) -> Request:
    """The step an engine starts from: `model_loader_extra_config`'s url (and step), else the model directory's
    `ucp-checkpoint.json`."""
    pointer = None if extra.get("url") else Pointer.read(model_path)
    return Request(
        str(extra["url"]) if pointer is None else pointer.url,
        extra.get("step") if pointer is None else extra.get("step", pointer.step),
        extra.get("storage_options"),
        int(extra.get("memory_budget", DEFAULT_MEMORY_BUDGET)),
    )


@dataclass
class LoadReport:
    """What one worker read: the step, the bytes read from storage, how long it took, and the weights it read whole
    for want of knowing its share (`shares`: none where the engine started from ucp, unless its model converts a
    weight before keeping it; every one where it started from other files)."""

    url: str
    step: int
    bytes_read: int
    seconds: float
    unknown_shares: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> LoadReport:
        return cls(
            str(doc["url"]),
            int(doc["step"]),
            int(doc["bytes_read"]),
            float(doc["seconds"]),
            list(doc["unknown_shares"]),
        )


def open_for(hf_config: Any, request: Request, engine: str) -> StepWeights:
    """Open the requested step and refuse it if it holds another model than `hf_config` (the engine's) describes."""
    weights = open_weights(request.url, request.step, storage_options=request.storage_options)
    check_same_model(served_config(hf_config.to_dict(), engine), weights, engine)
    return weights


def load_step(model: torch.nn.Module, model_config: Any, request: Request) -> LoadReport:
    """Load the requested step into `model` while the engine builds it: the shares of this worker found first
    (`shares`) and kept on the model for its refreshes, then only they read."""
    start = time.perf_counter()
    weights = open_for(model_config.hf_config, request, f"the engine of {model_config.model}")
    setattr(model, SHARES, shares(model, weights))
    regions = kept_shares(model)
    with torch.no_grad():
        loaded = load_weights_of(model)(weights.tensors(regions, memory_budget=request.memory_budget))
    if loaded is not None and model_config.quantization is None:
        missing = sorted({n for n, _ in model.named_parameters()} - set(loaded))
        if missing:
            raise InteropError(
                f"step {weights.step} of {weights.url} left {len(missing)} parameters of the model unloaded: "
                f"{missing[:5]}"
            )
    return report_of(weights, regions, start)


def report_of(weights: StepWeights, regions: Mapping[str, Box], start: float) -> LoadReport:
    unknown = [n for n in weights.plan.names if n not in regions]
    seconds = time.perf_counter() - start
    log.info(
        "loaded step %d of %s into vLLM: %d bytes read in %.2f s",
        weights.step,
        weights.url,
        weights.bytes_read,
        seconds,
    )
    return LoadReport(weights.url, weights.step, weights.bytes_read, seconds, unknown)


def tensors_for(model: torch.nn.Module, weights: StepWeights, request: Request) -> Iterator[tuple[str, torch.Tensor]]:
    """The step's weights for a refresh of `model`: each read in the region this rank keeps (found at its build)."""
    return weights.tensors(kept_shares(model), memory_budget=request.memory_budget)


def kept_shares(model: torch.nn.Module) -> dict[str, Box]:
    """The shares `shares` found when the engine built `model` ({} for an engine that did not start from ucp: every
    weight is then read whole, the share of each unknown)."""
    return getattr(model, SHARES, None) or {}


def load_weights_of(model: torch.nn.Module) -> Callable[[Iterable[tuple[str, torch.Tensor]]], set[str] | None]:
    """vLLM's `model.load_weights`: (HF name, full tensor) pairs in, the names of the parameters loaded out."""
    return model.load_weights  # type: ignore[return-value]


# ------------------------------------------------------------------------------------------------ shares


class _CopyRecorder(TorchFunctionMode):
    """Intercepts every `copy_` whose source is a view of one of the probe tensors: records the region of the probe
    it views, and skips the copy (the destination, the model's real parameter, is left as it is)."""

    def __init__(self, probes: Mapping[int, str]):
        super().__init__()
        self.probes = probes  # id(probe tensor) -> HF name
        self.copied: dict[str, list[Box | None]] = {}  # None: a copy whose region is not a box of the probe

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func is torch.Tensor.copy_ and len(args) >= 2 and isinstance(args[1], torch.Tensor):
            name, box = self._region(args[1])
            if name is not None:
                self.copied.setdefault(name, []).append(box)
                return args[0]
        return func(*args, **(kwargs or {}))

    def _region(self, view: torch.Tensor) -> tuple[str | None, Box | None]:
        base = view if view._base is None else view._base
        name = self.probes.get(id(base))
        if name is None:
            return None, None
        return name, view_box(base, view)


def view_box(base: torch.Tensor, view: torch.Tensor) -> Box | None:
    """The box of contiguous `base` that `view` (a view of it made by slicing, narrowing, transposing or adding unit
    dimensions) covers; None if it is no such view (a reshape that merges dimensions, a step of more than one)."""
    strides = base.stride()
    start = []
    offset = view.storage_offset() - base.storage_offset()
    for s in strides:  # (contiguous: each index is the quotient by its stride, largest first)
        start.append(offset // s if s else 0)
        offset = offset % s if s else offset
    stop = [a + 1 for a in start]
    seen = set()
    for size, stride in zip(view.shape, view.stride()):
        if size == 1:
            continue
        dims = [d for d, s in enumerate(strides) if s == stride and base.shape[d] > 1 and d not in seen]
        if not dims:
            return None
        seen.add(dims[0])
        stop[dims[0]] = start[dims[0]] + size
    if any(b > n for b, n in zip(stop, base.shape)):
        return None
    return tuple((a, b) for a, b in zip(start, stop))


def _union(boxes: Iterable[Box]) -> Box:
    boxes = list(boxes)
    return tuple((min(b[d][0] for b in boxes), max(b[d][1] for b in boxes)) for d in range(len(boxes[0])))


def shares(model: torch.nn.Module, weights: StepWeights) -> dict[str, Box]:
    """{HF name: the box of it that this worker's model keeps (the whole of a weight it does not split)}, for every
    weight whose share vLLM's loaders show (see the module docstring); the others are read whole. {} when vLLM's
    `load_weights` cannot run on meta tensors."""
    probes = {n: torch.empty(m.shape, dtype=_dtype(m), device="meta") for n, m in weights.plan.metas.items()}
    recorder = _CopyRecorder({id(t): n for n, t in probes.items()})
    try:
        with torch.no_grad(), recorder:
            load_weights_of(model)(iter(probes.items()))
    except Exception as e:  # noqa: BLE001 -- a model's loading code raises anything on meta tensors: it only costs bytes
        log.info(
            "vLLM's load_weights does not run on meta tensors (%s: %s): every weight is read whole", type(e).__name__, e
        )
        return {}
    return {
        name: _union(b for b in boxes if b is not None)
        for name, boxes in recorder.copied.items()
        if boxes and all(b is not None for b in boxes)
    }


def _dtype(meta: AtomMeta) -> torch.dtype:
    from ...base import dtypes

    return dtypes.torch_dtype(meta.dtype)
