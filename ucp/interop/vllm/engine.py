"""What a vLLM worker does with a ucp step: load it into the model it builds (the loader), or into the model it serves
(a refresh), reading only the region of each weight that its tensor-parallel rank keeps.

Both rest on vLLM's own `model.load_weights`, which takes (HF name, full tensor) pairs and puts each where the model
keeps it: every weight loader cuts its rank's share out of the full tensor itself (`narrow` along the split dimension
by the rank; q/k/v and gate/up each into their part of the fused parameter; the vocabulary by its padded ranges;
experts by expert and by their split). Which region of each tensor a rank keeps, and where it goes, is therefore
vLLM's to say, and `dry_run` asks vLLM: it runs the model's `load_weights` once on meta tensors of the full shapes (no
data), with every copy out of them intercepted and recorded instead of done (the region of the weight copied, and the
view of the parameter it was copied into). Each weight's share is the bounding box of what was copied; the real load
reads only that box. Where the answer is not a plain box (a weight the model converts before copying, or copies
nothing of), the weight is read whole, as every rank reads it with vLLM's own loaders of safetensors files.

At start-up, a weight whose every copy went unconverted into a view of a parameter (same dtype, same shape, the box
the right way up) is read straight into those views: one pass over its bytes, as vLLM's mmap-then-copy of
safetensors makes, where handing it to `load_weights` would be two (ucp's read into a tensor of its own, then
vLLM's copy). The others go through `load_weights` with their data, after the reads, as do weights whose destinations
overlap another's or memory those later copies write (so that what lands last is what the model's order leaves). A
model whose loading code does anything with a parameter's data during the dry run beyond views of it and fills with a
constant apart from every copy (scales a weight after copying it, computes a scale from it, re-lays it with
`param.data = ...`, zeroes rows a weight is copied into) has every weight go through `load_weights`: what it computed
came from memory the dry run never filled, or its order matters.

The dry run happens while the engine builds its model, before vLLM turns its parameters into its kernels' formats
(after which `load_weights` cannot run outside vLLM's reload); the shares are kept on the model for the refreshes to
come, which go through vLLM's `reload_weights`.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import json
import logging
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
from torch.overrides import TorchFunctionMode

from ...base.boxes import Box
from ...format.manifest import AtomMeta
from ..errors import InteropError
from ..streaming import DEFAULT_MEMORY_BUDGET
from .source import Pointer, StepWeights, check_same_model, check_same_settings, open_weights, served_config

log = logging.getLogger("ucp")

EXTRA_KEYS = ("url", "step", "storage_options", "memory_budget", "into_parameters")
SHARES = "_ucp_shares"  # the model's attribute: {HF name: box this rank keeps} (absent: read every weight whole)


@dataclass(frozen=True)
class Request:
    """Which step an engine loads, as it crosses to the workers (a JSON string: vLLM's RPC over HTTP passes only
    strings)."""

    url: str
    step: int | str | None = None
    storage_options: dict[str, Any] | None = None
    memory_budget: int = DEFAULT_MEMORY_BUDGET
    into_parameters: bool = True  # (at start-up: read weights straight into the parameters where the dry run shows how)

    def dumps(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def loads(cls, text: str) -> Request:
        try:
            doc = json.loads(text)
            return cls(
                str(doc["url"]),
                doc.get("step"),
                doc.get("storage_options"),
                int(doc["memory_budget"]),
                bool(doc.get("into_parameters", True)),
            )
        except (ValueError, KeyError, TypeError) as e:
            raise InteropError(f"a malformed ucp request {text[:200]!r} ({type(e).__name__}: {e})") from None


def request_of(extra: Mapping[str, Any], model_path: str) -> Request:
    """The step an engine starts from: `model_loader_extra_config`'s url (and step), else the model directory's
    `ucp-checkpoint.json`."""
    for key, kinds, what in (
        ("url", (str,), "a checkpoint's URL"),
        ("memory_budget", (int,), "an integer number of bytes"),
        ("storage_options", (dict, type(None)), "a dict"),
        ("into_parameters", (bool,), "true or false"),
    ):  # (were coerced: a budget "1GiB" was a ValueError at start-up, into_parameters "false" true)
        value = extra.get(key)
        if key in extra and (not isinstance(value, kinds) or (key == "memory_budget" and isinstance(value, bool))):
            raise InteropError(
                f"model_loader_extra_config for load_format 'ucp': {key} is {json.dumps(value, default=repr)[:100]}, "
                f"not {what}"
            )
    pointer = None if extra.get("url") else Pointer.read(model_path)
    return Request(
        str(extra["url"]) if pointer is None else pointer.url,
        extra.get("step") if pointer is None else extra.get("step", pointer.step),
        extra.get("storage_options"),
        int(extra.get("memory_budget", DEFAULT_MEMORY_BUDGET)),
        bool(extra.get("into_parameters", True)),
    )


@dataclass
class LoadReport:
    """What one worker read: the step, the bytes read from storage, how long it took, and the weights it read whole
    for want of knowing its share (`dry_run`: none where the engine started from ucp, unless its model converts a
    weight before keeping it; every one where it started from other files)."""

    url: str
    step: int
    bytes_read: int
    seconds: float
    unknown_shares: list[str] = field(default_factory=list)
    in_place: int = 0  # (weights read straight into the model's parameters: at start-up, `load_step`)

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
            int(doc.get("in_place", 0)),
        )


def engine_name(model_config: Any) -> str:
    """How messages name the engine of vLLM's `model_config`."""
    return f"the engine of {model_config.model}"


def open_for(model_config: Any, request: Request) -> StepWeights:
    """Open the requested step and refuse it if it holds another model than the engine's `model_config` (vLLM's:
    its `hf_config`, and `model`, the directory it started from) describes."""
    engine = engine_name(model_config)
    weights = open_weights(request.url, request.step, storage_options=request.storage_options)
    check_same_model(served_config(model_config.hf_config.to_dict(), engine), weights, engine)
    check_same_settings(model_config.hf_config, str(model_config.model), weights, engine)
    return weights


def load_step(model: torch.nn.Module, model_config: Any, request: Request) -> LoadReport:
    """Load the requested step into `model` while the engine builds it. A dry run of the model's `load_weights`
    (`dry_run`) finds first which box of each weight this worker keeps (kept on the model for its refreshes) and where
    it goes: the weights that go straight into parameters are read into them (no tensor of their own in between, and
    no copy after: one pass over the bytes, as vLLM's mmap of safetensors makes), the others read (their boxes only)
    and handed to `load_weights`."""
    start = time.perf_counter()
    weights = open_for(model_config, request)
    run = dry_run(model, weights)
    setattr(model, SHARES, run.shares)
    targets = run.targets if request.into_parameters else {}
    rest = [n for n in weights.plan.names if n not in targets]
    stream = weights.tensors(run.shares, memory_budget=request.memory_budget, names=rest, into=targets)
    with torch.no_grad():
        if rest:
            loaded = load_weights_of(model)(stream)
        else:  # (every weight read into place: nothing to hand over)
            collections.deque(stream, maxlen=0)
            loaded = run.loaded
    if targets and loaded is not None:  # (the weights read into place were loaded in the dry run)
        loaded = set(loaded) | (run.loaded or set())
    if loaded is not None and model_config.quantization is None:
        missing = sorted({n for n, _ in model.named_parameters()} - set(loaded))
        if missing:
            raise InteropError(
                f"step {weights.step} of {weights.url} left {len(missing)} parameters of the model unloaded: "
                f"{missing[:5]}"
            )
    return report_of(weights, run.shares, start, len(targets))


def report_of(weights: StepWeights, regions: Mapping[str, Box], start: float, in_place: int = 0) -> LoadReport:
    unknown = [n for n in weights.plan.names if n not in regions]
    seconds = time.perf_counter() - start
    log.info(
        "loaded step %d of %s into vLLM: %d bytes read in %.2f s (%d of %d weights read straight into the parameters)",
        weights.step,
        weights.url,
        weights.bytes_read,
        seconds,
        in_place,
        len(weights.plan.names),
    )
    return LoadReport(weights.url, weights.step, weights.bytes_read, seconds, unknown, in_place)


def tensors_for(model: torch.nn.Module, weights: StepWeights, request: Request) -> Iterator[tuple[str, torch.Tensor]]:
    """The step's weights for a refresh of `model`: each read in the region this rank keeps (found at its build)."""
    return weights.tensors(kept_shares(model), memory_budget=request.memory_budget)


def kept_shares(model: torch.nn.Module) -> dict[str, Box]:
    """The shares `dry_run` found when the engine built `model` ({} for an engine that did not start from ucp: every
    weight is then read whole, the share of each unknown)."""
    return getattr(model, SHARES, None) or {}


def load_weights_of(model: torch.nn.Module) -> Callable[[Iterable[tuple[str, torch.Tensor]]], set[str] | None]:
    """vLLM's `model.load_weights`: (HF name, full tensor) pairs in, the names of the parameters loaded out."""
    return model.load_weights  # type: ignore[return-value]


# ------------------------------------------------------------------------------------------------ the dry run


class _CopyRecorder(TorchFunctionMode):
    """Intercepts every `copy_` whose source is a view of one of the probe tensors: records the region of the probe
    it views and where it was going, and skips the copy (the destination, the model's real parameter, is left as it
    is). Everything else loading code does runs as it is, and is sorted by what it does to the model's real tensors:
    views and shapes of them (`_VIEWS`, `_FACTS`) change nothing; a fill with a constant (`fill_(0)` of the
    vocabulary's padding rows) is noted by the memory it changed (`fills`), which no copy of a weight may overlap (the
    order of the two is then the model's to keep); any other use of a real tensor's data or change to it (a weight
    scaled after its copy, a scale computed from it, `param.data = ...`) makes the run `unsafe`: what it computed came
    from memory the dry run never filled, and every weight must then be loaded with its data, in the model's order."""

    def __init__(self, probes: Mapping[int, str], memory: set[int]):
        super().__init__()
        self.probes = probes  # id(probe tensor) -> HF name
        self.memory = memory  # the addresses of the storages of the model's parameters and buffers
        self.copied: dict[str, list[Copy]] = {}
        self.fills: list[Span] = []
        self.unsafe: str | None = None  # (the first call that used or changed real data otherwise)

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.Tensor.copy_ and len(args) >= 2 and isinstance(args[1], torch.Tensor):
            name, copy = self._copy(args[0], args[1])
            if name is not None:
                self.copied.setdefault(name, []).append(copy)
                return args[0]
        called = getattr(func, "__name__", repr(func))
        real = [t for t in _tensors(args, kwargs) if not t.is_meta]
        if not real or called in _FACTS:
            return func(*args, **kwargs)
        if called in _FILLS and not kwargs and all(isinstance(a, (int, float, bool)) for a in args[1:]):
            if args[0].numel():
                self.fills.append(_span(args[0]))
            return func(*args, **kwargs)
        out = func(*args, **kwargs)
        if called not in _VIEWS or not all(_shares_memory(o, real[0]) for o in _tensors((out,), {})):
            self.unsafe = self.unsafe or called
        return out

    def _copy(self, target: torch.Tensor, view: torch.Tensor) -> tuple[str | None, Copy]:
        base = view if view._base is None else view._base
        name = self.probes.get(id(base))
        if name is None:
            return None, Copy(None, None, None)
        box = view_box(base, view)
        upright = (  # (the box as the view holds it: same dimensions, same order; a size-1 dimension's stride says
            # nothing, so the box's extents must be the view's shape as well)
            box is not None
            and view.dim() == base.dim()
            and tuple(b - a for a, b in box) == tuple(view.shape)
            and all(n == 1 or s == t for n, s, t in zip(view.shape, view.stride(), base.stride()))
        )
        written = _span(target) if not target.is_meta and target.numel() else None
        direct = (
            upright
            and target.dtype == view.dtype
            and target.shape == view.shape
            and written is not None
            and target.untyped_storage().data_ptr() in self.memory
        )
        return name, Copy(box, target if direct else None, written)


@dataclass(frozen=True)
class Copy:
    """One copy out of a probe in a dry run of `load_weights`: the box of the weight copied (None: not a box of it);
    the tensor it went to where the box can be read straight into it (a view of a parameter of the weight's dtype and
    the box's shape and orientation), else None; and the memory it writes (None: none, or not the model's)."""

    box: Box | None
    target: torch.Tensor | None
    written: Span | None


_FACTS = frozenset(
    {
        "__get__",
        "dim",
        "ndimension",
        "numel",
        "nelement",
        "size",
        "stride",
        "storage_offset",
        "is_contiguous",
        "element_size",
        "data_ptr",
        "untyped_storage",
        "get_device",
        "is_floating_point",
        "__len__",
    }
)  # (what a tensor is, not what it holds)
_VIEWS = frozenset(
    {
        "__getitem__",
        "narrow",
        "select",
        "unbind",
        "split",
        "chunk",
        "unsqueeze",
        "squeeze",
        "view",
        "view_as",
        "t",
        "transpose",
        "permute",
        "expand",
        "reshape",
        "flatten",
        "contiguous",
        "detach",
        "as_strided",
    }
)  # (a view of the same memory where they return one: checked, as indexing by a tensor and a reshape may copy)
_FILLS = frozenset({"fill_", "zero_"})


def _tensors(args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensors among a call's arguments (and in the lists and tuples among them)."""
    found: list[torch.Tensor] = []
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            found.append(a)
        elif isinstance(a, (list, tuple)):
            found += _tensors(tuple(a), {})
    return found


def _shares_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.device == b.device and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


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


@dataclass
class DryRun:
    """What a dry run of the model's `load_weights` on meta tensors showed (`dry_run`): the box of each weight this
    worker keeps (`shares`), and, for the weights whose every copy went straight into a parameter, where each box goes
    (`targets`: those weights can be read into the model's memory directly, with no tensor of their own in between);
    the names `load_weights` reported loaded."""

    shares: dict[str, Box] = field(default_factory=dict)
    targets: dict[str, list[tuple[Box, torch.Tensor]]] = field(default_factory=dict)
    loaded: set[str] | None = None


def dry_run(model: torch.nn.Module, weights: StepWeights) -> DryRun:
    """Run the model's `load_weights` on meta tensors of the step's weights, every copy out of them recorded instead of
    done (see the module docstring). An empty answer when vLLM's `load_weights` cannot run on meta tensors; no
    `targets` when it changed a tensor otherwise than by copying a weight into it (the data must then be in hand)."""
    probes = {n: torch.empty(m.shape, dtype=_dtype(m), device="meta") for n, m in weights.plan.metas.items()}
    memory = {t.untyped_storage().data_ptr() for t in itertools.chain(model.parameters(), model.buffers())}
    recorder = _CopyRecorder({id(t): n for n, t in probes.items()}, memory)
    try:
        with torch.no_grad(), recorder:
            loaded = load_weights_of(model)(iter(probes.items()))
    except Exception as e:  # noqa: BLE001 -- a model's loading code raises anything on meta tensors: it only costs bytes
        log.info(
            "vLLM's load_weights does not run on meta tensors (%s: %s): every weight is read whole", type(e).__name__, e
        )
        return DryRun()
    copied = recorder.copied
    shares = {
        name: _union(c.box for c in copies if c.box is not None)
        for name, copies in copied.items()
        if copies and all(c.box is not None for c in copies)
    }
    targets = {
        name: [(c.box, c.target) for c in copies if c.box is not None and c.target is not None]
        for name, copies in copied.items()
        if name in shares and all(c.target is not None for c in copies)
    }
    writes = [(c.written, name) for name, copies in copied.items() for c in copies if c.written is not None]
    if recorder.unsafe is None and any(
        len({kind for _, kind in run}) > 1
        for run in _runs([(span, "copy") for span, _ in writes] + [(span, "fill") for span in recorder.fills])
    ):
        recorder.unsafe = "a fill of memory a weight is copied into"
    if recorder.unsafe is not None:
        log.info(
            "vLLM's load_weights uses or changes a parameter's data beyond copying weights into it (%s): every weight"
            " is loaded through it",
            recorder.unsafe,
        )
        targets = {}
    later = [span for span, name in writes if name not in targets]  # (what load_weights writes after the reads)
    return DryRun(shares, _apart(targets, later), None if loaded is None else set(loaded))


Span = tuple[tuple[str, int], int, int]  # (a storage: its device and address; first byte; one past the last byte)


def _span(t: torch.Tensor) -> Span:
    """The bytes of its storage that `t` covers (all between its first and its last element)."""
    first = int(t.storage_offset()) * t.element_size()
    last = first + (sum((int(n) - 1) * s for n, s in zip(t.shape, t.stride())) + 1) * t.element_size()
    return (str(t.device), t.untyped_storage().data_ptr()), first, last


L = TypeVar("L")


def _runs(spans: list[tuple[Span, L]]) -> list[list[tuple[Span, L]]]:
    """The labelled spans in runs that overlap one another in a chain (for intervals, the connected components of
    their overlaps): one sweep in order of storage and first byte."""
    runs: list[list[tuple[Span, L]]] = []
    end: tuple[tuple[str, int], int] | None = None  # (the run's storage, the furthest byte it reaches)
    for span, label in sorted(spans, key=lambda item: (item[0][0], item[0][1])):
        storage, first, last = span
        if end is None or end[0] != storage or first >= end[1]:
            runs.append([])
            end = (storage, last)
        runs[-1].append((span, label))
        end = (storage, max(end[1], last))
    return runs


def _apart(
    targets: dict[str, list[tuple[Box, torch.Tensor]]], later: list[Span]
) -> dict[str, list[tuple[Box, torch.Tensor]]]:
    """`targets` less the weights whose destinations overlap another weight's (read in parallel, which lands last
    would be left to chance, where `load_weights` puts them in its order), another box of the same weight, or memory
    that `load_weights` writes `later` (the weights not read into place: their copies would land after the reads,
    whatever the model's order). A run of overlapping spans (`_runs`) with more than one (weight, box, span) in it
    drops every weight in it."""
    spans: list[tuple[Span, tuple[str | None, Box | None]]] = [
        (_span(t), (name, box)) for name, places in targets.items() for box, t in places
    ]
    spans += [(span, (None, None)) for span in later]
    dropped: set[str] = set()
    for run in _runs(spans):
        if len(set(run)) > 1:
            dropped.update(name for _, (name, _) in run if name is not None)
    return {n: places for n, places in targets.items() if n not in dropped}


def _dtype(meta: AtomMeta) -> torch.dtype:
    from ...base import dtypes

    return dtypes.torch_dtype(meta.dtype)
