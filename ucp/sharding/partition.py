"""Partition specs: how one canonical atom maps onto tensor-parallel local tensors.

A spec is stored (as JSON) in each atom's attributes, so any tool can shard the atom for any layout without
model code. It says how TP splits the atom (``kind``), where the atom's layer and expert live (PP and EP),
which other logical tensors are tied copies of it, and which ZeRO group its optimizer state belongs to.

Kinds:

- ``replicated``: every TP rank holds the whole atom.
- ``split``: TP splits ``split_dim`` evenly (0 = column-parallel, 1 = row-parallel).
- ``vocab``: vocab-parallel (split dim 0) after padding the rows to a multiple of ``pad_to_multiple_of * T``;
  ``unpadded`` is the atom's row count. Padding rows are zero on load and dropped on save.
- ``fused_qkv``: one of ``part`` q/k/v of Megatron's fused QKV with GQA: the global fused tensor is, group by
  group, the group's ``num_heads/num_kv_heads`` query heads, its key head, its value head (``head_dim`` rows each),
  and TP rank t holds the t-th of T equal runs of its rows: whole query groups where T divides ``num_kv_heads``,
  a share of one group where T is a multiple of it (as megatron-core lays it out).
- ``fused_gate_up``: ``part`` gate or up of a SwiGLU fc1; the local tensor is [gate rows of rank t; up rows of t].

``block`` (a block-quantised weight, ``ucp.sharding.quantization``): the TP split of ``replicated``, ``split`` and
``fused_gate_up`` atoms must fall on the boundaries of these blocks, so that each rank's scales (an atom of their own,
split alike) are whole blocks of its part; any other split is a ``LayoutError``.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from ..base.boxes import Box, full_box
from ..errors import LayoutError, UcpError

KINDS = ("replicated", "split", "vocab", "fused_qkv", "fused_gate_up")
ZERO_GROUPS = ("dense", "expert")
_PARTS = {"fused_qkv": ("q", "k", "v"), "fused_gate_up": ("gate", "up")}


@dataclass(frozen=True)
class PartitionSpec:
    kind: str = "replicated"
    split_dim: int | None = None  # split: the TP-split dim
    part: str | None = None  # fused kinds: which part of the fused local tensor
    num_heads: int | None = None  # fused_qkv
    num_kv_heads: int | None = None  # fused_qkv
    head_dim: int | None = None  # fused_qkv
    pad_to_multiple_of: int | None = None  # vocab: rows padded to a multiple of this times T
    unpadded: int | None = None  # vocab: the real row count
    layer: int | None = None  # global layer index (PP placement); None: not in a layer
    expert: int | None = None  # global expert index (EP placement); None: not an expert
    tied_to: tuple[str, ...] = ()  # logical tensors that are copies of this atom and have no atom of their own
    zero_group: str = "dense"  # ZeRO flat buffer: "dense", or "expert" (sharded over the expert-DP group)
    block: tuple[int, ...] | None = None  # a block-quantised weight's block [rows, cols]: TP splits fall on its edges

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise UcpError(f"unknown partition kind {self.kind!r}; known kinds: {', '.join(KINDS)}")
        if self.zero_group not in ZERO_GROUPS:
            raise UcpError(f"unknown zero_group {self.zero_group!r}; expected one of {ZERO_GROUPS}")
        if not isinstance(self.tied_to, tuple):
            object.__setattr__(self, "tied_to", tuple(self.tied_to))
        if self.block is not None:
            object.__setattr__(self, "block", tuple(self.block))
            if self.kind not in ("replicated", "split", "fused_gate_up") or not (
                len(self.block) == 2 and all(type(b) is int and b > 0 for b in self.block)
            ):
                raise UcpError(f"partition kind {self.kind!r}: block {list(self.block)} is not a quantisation block")
        need = {
            "split": ("split_dim",),
            "vocab": ("pad_to_multiple_of", "unpadded"),
            "fused_qkv": ("part", "num_heads", "num_kv_heads", "head_dim"),
            "fused_gate_up": ("part",),
        }
        for name in need.get(self.kind, ()):
            if getattr(self, name) is None:
                raise UcpError(f"partition kind {self.kind!r} needs {name}")
        if self.kind in _PARTS and self.part not in _PARTS[self.kind]:
            raise UcpError(f"partition kind {self.kind!r}: part {self.part!r} is not one of {_PARTS[self.kind]}")
        if self.kind == "fused_qkv" and _given(self.num_heads) % _given(self.num_kv_heads):
            raise UcpError(f"fused_qkv: num_kv_heads={self.num_kv_heads} does not divide num_heads={self.num_heads}")

    def to_json(self) -> dict[str, Any]:
        """The fields that differ from their defaults, plus ``kind``; JSON types only."""
        out: dict[str, Any] = {"kind": self.kind}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name != "kind" and value != f.default:
                out[f.name] = list(value) if isinstance(value, tuple) else value
        return out

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> PartitionSpec:
        if not isinstance(d, dict) or "kind" not in d:
            raise UcpError(f"partition spec must be an object with a 'kind', got {d!r}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise UcpError(f"partition spec {d!r} has unknown fields {unknown}")
        tuples = ("tied_to", "block")
        return cls(**{k: tuple(v) if k in tuples and isinstance(v, list) else v for k, v in d.items()})  # type: ignore[arg-type]


def _given(value: int | None) -> int:
    """A field that the spec's kind requires (checked in __post_init__), as an int."""
    assert value is not None
    return value


@dataclass(frozen=True)
class TpShard:
    """What TP rank t holds of one atom: the shape of its (possibly fused) local tensor and the
    (local box, atom box) pairs it holds. Regions of the local tensor outside every pair are padding
    or belong to other parts of the fused tensor."""

    local_shape: tuple[int, ...]
    pieces: tuple[tuple[Box, Box], ...]


def padded_rows(spec: PartitionSpec, tp: int) -> int:
    """Vocab rows after padding to a multiple of ``pad_to_multiple_of * tp``."""
    m = _given(spec.pad_to_multiple_of) * tp
    return -(-_given(spec.unpadded) // m) * m


def _check_blocks(spec: PartitionSpec, shape: tuple[int, ...], dim: int, part: int, tp: int) -> None:
    """A split of a block-quantised atom into TP parts of `part` along `dim` falls on block boundaries."""
    if spec.block is not None and tp > 1 and part % spec.block[dim]:
        raise LayoutError(
            f"tp={tp} splits dim {dim} (size {shape[dim]}) of a block-quantised atom of shape {list(shape)} into "
            f"parts of {part}, which is not a multiple of its block {list(spec.block)}: each rank's scales would "
            "not be whole blocks of its part (use a TP degree whose parts are whole blocks, or load the weights "
            "dequantised, which any TP degree can: `ucp.interop.weights.load_weights(..., dtype=torch.bfloat16)`)"
        )


def _rows(lo: int, hi: int, rest: tuple[int, ...]) -> Box:
    return ((lo, hi),) + full_box(rest)


def tp_shard(spec: PartitionSpec, shape: tuple[int, ...], tp: int, tp_rank: int) -> TpShard:
    """Map an atom of ``shape`` onto TP rank ``tp_rank`` of ``tp``; pure arithmetic, no tensors."""
    kind, rest = spec.kind, tuple(shape[1:])
    if kind == "replicated":
        return TpShard(tuple(shape), ((full_box(shape), full_box(shape)),))
    if kind == "split":
        d = _given(spec.split_dim)
        if shape[d] % tp:
            raise LayoutError(f"tp={tp} does not divide dim {d} (size {shape[d]}) of an atom of shape {shape}")
        s = shape[d] // tp
        _check_blocks(spec, shape, d, s, tp)
        local = tuple(s if i == d else n for i, n in enumerate(shape))
        atom = tuple((tp_rank * s, (tp_rank + 1) * s) if i == d else (0, n) for i, n in enumerate(shape))
        return TpShard(local, ((full_box(local), atom),))
    if kind == "vocab":
        if shape[0] != spec.unpadded:
            raise UcpError(f"vocab spec says {spec.unpadded} rows but the atom has shape {shape}")
        rows = padded_rows(spec, tp) // tp
        lo, hi = tp_rank * rows, min((tp_rank + 1) * rows, shape[0])
        held = ((_rows(0, hi - lo, rest), _rows(lo, hi, rest)),) if hi > lo else ()
        return TpShard((rows,) + rest, held)
    if kind == "fused_gate_up":
        if shape[0] % tp:
            raise LayoutError(f"tp={tp} does not divide the {shape[0]} rows of a gate/up atom")
        s = shape[0] // tp
        _check_blocks(spec, shape, 0, s, tp)
        k = _PARTS[kind].index(spec.part)
        return TpShard(
            (2 * s,) + rest, ((_rows(k * s, (k + 1) * s, rest), _rows(tp_rank * s, (tp_rank + 1) * s, rest)),)
        )
    return _qkv_shard(spec, shape, tp, tp_rank)


def _qkv_shard(spec: PartitionSpec, shape: tuple[int, ...], tp: int, tp_rank: int) -> TpShard:
    """One part of Megatron-Core's fused QKV. Its global tensor is the query groups one after another, each [its
    query heads; its key head; its value head], and TP rank t holds the t-th of T equal runs of its rows (a
    ColumnParallelLinear). With T dividing the query groups a run is whole groups; with fewer groups than ranks
    (megatron-core allows T a multiple of them) T/groups ranks share a group, each a run of its rows that may end
    inside a head (the ranks gather the group's output before splitting heads: megatron-core's attention.py)."""
    heads, kv, hd = _given(spec.num_heads), _given(spec.num_kv_heads), _given(spec.head_dim)
    if kv % tp and tp % kv:
        raise LayoutError(
            f"tp={tp} neither divides nor is a multiple of num_kv_heads={kv} (Megatron-Core's fused QKV needs one)"
        )
    qh = heads // kv  # query heads per group
    rows = (heads if spec.part == "q" else kv) * hd
    if shape[0] != rows:
        raise UcpError(f"fused_qkv part {spec.part} needs {rows} rows (heads*head_dim), the atom has shape {shape}")
    group_rows = (qh + 2) * hd
    if (kv * group_rows) % tp:
        raise LayoutError(
            f"tp={tp} does not divide the {kv * group_rows} rows of the fused QKV ({kv} query groups of {qh} query "
            f"heads, a key and a value head of {hd} rows)"
        )
    local = kv * group_rows // tp
    lo, hi = tp_rank * local, (tp_rank + 1) * local  # this rank's rows of the global fused tensor
    # where the part sits in a group's rows, and how many rows of it a group has
    at, size = {"q": (0, qh * hd), "k": (qh * hd, hd), "v": ((qh + 1) * hd, hd)}[str(spec.part)]
    rest = tuple(shape[1:])
    pieces: list[tuple[Box, Box]] = []
    for g in range(lo // group_rows, -(-hi // group_rows)):
        start = g * group_rows + at  # the part's first row of group g in the global fused tensor
        a, b = max(start, lo), min(start + size, hi)
        if a < b:
            pieces.append((_rows(a - lo, b - lo, rest), _rows(g * size + a - start, g * size + b - start, rest)))
    return TpShard((local,) + rest, tuple(pieces))
