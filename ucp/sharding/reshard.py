"""Resharding: map canonical atoms to and from the local state of any rank of any layout.

Everything here is a pure function of (model config, layout, rank): no collectives, no IO. The local plan of
one rank is derived from its own coordinates only (never by iterating over the world), and pieces are boxes,
so planning cost scales with the number of tensors a rank holds, not with the world or with element counts.
The local-state contract (names, shapes, fused layouts, ZeRO flat buffers) is docs/LOCAL_STATE.md.
"""

from __future__ import annotations

import functools
import itertools
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ..base.boxes import (
    Box,
    box_numel,
    box_shape,
    contains,
    contiguous_boxes,
    flat_range_boxes,
    flat_start,
    full_box,
    intersect,
    to_slices,
    translate,
)
from ..errors import LayoutError, StateError, UcpError
from .families import FAMILIES, family_for
from .families.table import Rule, atom_name, atom_spec, block_size, buffer_atoms, iter_atoms, local_name
from .layout import Layout, RankCoords, chunk_layer_counts, validate_for_model
from .partition import PartitionSpec, tp_shard

DEFAULT_STATES = ("exp_avg", "exp_avg_sq")
ZERO_GROUPS = ("dense", "expert")


@dataclass(frozen=True)
class Piece:
    """A region of a local tensor that holds the box ``atom_box`` of atom ``atom``.

    The region is ``local_box`` (an n-D box of the local tensor, same shape as the atom box) or, for ZeRO flat
    buffers, the segment [flat_offset, flat_offset + numel) holding the atom box flattened in C order.
    """

    atom: str
    atom_box: Box
    local_box: Box | None = None
    flat_offset: int | None = None
    tied_copy: bool = False  # a copy of a tied atom: filled on load, never written

    @property
    def box(self) -> Box:
        """The local box of a piece held in an n-D local tensor (not in a flat buffer)."""
        assert self.local_box is not None, "a piece of a flat buffer has an offset, not a local box"
        return self.local_box

    @property
    def numel(self) -> int:
        return box_numel(self.atom_box)


@dataclass(frozen=True)
class LocalTensor:
    """One tensor of a rank's local state: where it sits (``key``, a path of dict keys), its shape, whose
    values it holds (``state`` None: the parameters; else that optimizer state) and its pieces. Regions outside
    every piece are padding (zero on load, ignored on save)."""

    key: tuple[str, ...]
    shape: tuple[int, ...]
    state: str | None
    pieces: tuple[Piece, ...]
    flat: bool = False


@dataclass(frozen=True)
class LocalParam:
    """One local parameter (possibly fused from several atoms) of a rank, before ZeRO flattening."""

    chunk_key: str  # "model" or "model{v}"
    name: str  # local Megatron-Core name
    shape: tuple[int, ...]
    pieces: tuple[Piece, ...]  # local_box pieces
    zero_group: str
    tp_replicated: bool  # every TP rank holds the same values
    parameter: bool = True  # False: a buffer (the router's expert bias): no optimizer state, outside ZeRO's buffers

    @property
    def numel(self) -> int:
        return box_numel(full_box(self.shape))


@dataclass(frozen=True)
class _AtomInfo:
    index: int
    shape: tuple[int, ...]
    spec: PartitionSpec
    place: str
    parameter: bool  # False: a buffer (no optimizer state, outside ZeRO's flat buffers)


@functools.lru_cache(maxsize=16)
def _atom_table_cached(family_name: str, config_json: str) -> dict[str, _AtomInfo]:
    family = FAMILIES[family_name]
    config = family.config_cls.from_json(json.loads(config_json))
    buffers = buffer_atoms(family, config)
    return {
        name: _AtomInfo(i, shape, spec, place, name not in buffers)
        for i, (name, shape, spec, place) in enumerate(iter_atoms(family, config))
    }


def _atom_table(config: Any) -> dict[str, _AtomInfo]:
    return _atom_table_cached(family_for(config).name, json.dumps(config.to_json(), sort_keys=True))


# ----------------------------------------------------------------------------------------------------------
# Local parameters of one rank


def _chunk_starts(layout: Layout, config: Any) -> tuple[list[int], list[int]]:
    counts = chunk_layer_counts(layout, config.num_hidden_layers, getattr(config, "stage_layers", None))
    return counts, list(itertools.accumulate([0] + counts[:-1]))


def _fused_groups(rules: list[Rule]) -> list[list[Rule]]:
    """Rules that name the same local tensor, in table order of first appearance."""
    groups: dict[str, list[Rule]] = {}
    for rule in rules:
        groups.setdefault(rule.local, []).append(rule)
    return list(groups.values())


def local_params(config: Any, layout: Layout, coords: RankCoords) -> list[LocalParam]:
    """The local parameters of a rank at ``coords``, in local-state order: chunk by chunk (v = 0..V-1); in a
    chunk, first-chunk tensors, then layer by layer the layer's tensors then its local experts' tensors expert
    by expert, then last-chunk tensors. (Remembered for the last coordinates asked: the writers of a chunk are found
    from the layouts of the ranks that write it, asked again for every atom they share.)"""
    return list(
        _local_params_cached(family_for(config).name, json.dumps(config.to_json(), sort_keys=True), layout, coords)
    )


@functools.lru_cache(maxsize=1024)
def _local_params_cached(
    family_name: str, config_json: str, layout: Layout, coords: RankCoords
) -> tuple[LocalParam, ...]:
    family = FAMILIES[family_name]
    config = family.config_cls.from_json(json.loads(config_json))
    return tuple(_local_params(family, config, layout, coords))


def _local_params(family: Any, config: Any, layout: Layout, coords: RankCoords) -> list[LocalParam]:
    counts, starts = _chunk_starts(layout, config)
    n_experts = getattr(config, "num_local_experts", 0) or 0
    per_ep = n_experts // layout.ep
    groups = {place: _fused_groups(family.rules_at(place, config)) for place in ("first", "layer", "expert", "last")}
    out: list[LocalParam] = []
    held: set[str] = set()

    def emit(
        place: str,
        chunk_key: str,
        layer: int | None = None,
        i: int | None = None,
        expert: int | None = None,
        e: int | None = None,
    ) -> None:
        for group in groups[place]:
            if layer is not None:
                group = [r for r in group if r.in_layer(config, layer)]
                if not group:
                    continue  # (not in this layer)
            if all(r.tied_copy for r in group) and atom_name(group[0], layer, expert) in held:
                continue  # the rank holds the original of this tied copy
            shape: tuple[int, ...] | None = None
            pieces: list[Piece] = []
            replicated = True
            for rule in group:
                atom = atom_name(rule, layer, expert)
                spec = atom_spec(rule, config, layer, expert)
                try:
                    sh = tp_shard(spec, tuple(rule.shape(config)), layout.tp, coords.tp)
                except LayoutError as error:
                    raise LayoutError(f"{atom} in {layout}: {error}") from None
                if shape is not None and sh.local_shape != shape:
                    raise UcpError(
                        f"fused parts of {rule.local} disagree on the local shape: {shape} vs {sh.local_shape}"
                    )
                shape = sh.local_shape
                pieces += [Piece(atom, a, local_box=lb, tied_copy=rule.tied_copy) for lb, a in sh.pieces]
                replicated &= spec.kind == "replicated"
                if not rule.tied_copy:
                    held.add(atom)
            assert shape is not None  # (every group has a rule)
            out.append(
                LocalParam(
                    chunk_key,
                    local_name(group[0], i, e),
                    shape,
                    tuple(pieces),
                    "expert" if place == "expert" else "dense",
                    replicated,
                    all(r.parameter for r in group),
                )
            )

    last_chunk = layout.num_chunks - 1
    for v in range(layout.vpp):
        c = v * layout.pp + coords.pp
        key = "model" if layout.vpp == 1 else f"model{v}"
        if c == 0:
            emit("first", key)
        for i in range(counts[c]):
            layer = starts[c] + i
            emit("layer", key, layer, i)
            for e in range(per_ep):
                emit("expert", key, layer, i, coords.ep * per_ep + e, e)
        if c == last_chunk:
            emit("last", key)
    return out


# ----------------------------------------------------------------------------------------------------------
# ZeRO flat buffers


@dataclass(frozen=True)
class FlatLayout:
    """One ZeRO group's flat buffer on a rank: its parameters at their offsets, the padded length, and the
    range [lo, hi) that this rank's member index owns."""

    group: str
    params: tuple[tuple[LocalParam, int], ...]
    padded: int
    members: int
    index: int

    @property
    def per_member(self) -> int:
        return self.padded // self.members

    @property
    def lo(self) -> int:
        return self.index * self.per_member

    @property
    def hi(self) -> int:
        return self.lo + self.per_member


def flat_layouts(params: list[LocalParam], layout: Layout, coords: RankCoords) -> list[FlatLayout]:
    """The "dense" (over DP) and "expert" (over expert-DP) flat buffers of a rank."""
    out = []
    for group in ZERO_GROUPS:
        members, index = (layout.dp, coords.dp) if group == "dense" else (layout.expert_dp, coords.expert_dp)
        placed, offset = [], 0
        for p in params:
            if p.zero_group == group and p.parameter:
                placed.append((p, offset))
                offset += p.numel
        padded = -(-offset // members) * members
        out.append(FlatLayout(group, tuple(placed), padded, members, index))
    return out


def _flat_pieces(param: LocalParam, offset: int, lo: int, hi: int) -> list[Piece]:
    """Pieces of ``param`` (placed at ``offset`` of a flat buffer) inside the buffer range [lo, hi), with
    flat offsets relative to lo: each piece's local box is cut into regular boxes along flat boundaries."""
    out: list[Piece] = []
    if offset >= hi or offset + param.numel <= lo:
        return out
    for piece in param.pieces:
        delta = tuple(a[0] - b[0] for a, b in zip(piece.atom_box, piece.box, strict=True))
        for cb in contiguous_boxes(piece.box, param.shape):
            start = offset + flat_start(cb, param.shape)
            a, b = max(start, lo), min(start + box_numel(cb), hi)
            for box in flat_range_boxes(a - offset, b - offset, param.shape):
                out.append(
                    Piece(
                        piece.atom,
                        translate(box, delta),
                        flat_offset=offset + flat_start(box, param.shape) - lo,
                        tied_copy=piece.tied_copy,
                    )
                )
    return out


def _flat_range_pieces(flat: FlatLayout, lo: int, hi: int) -> tuple[Piece, ...]:
    pieces: list[Piece] = []
    for param, offset in flat.params:
        pieces += _flat_pieces(param, offset, lo, hi)
    return tuple(pieces)


# ----------------------------------------------------------------------------------------------------------
# The local plan


def local_plan(
    config: Any, layout: Layout, rank: int, optim_states: tuple[str, ...] = DEFAULT_STATES
) -> list[LocalTensor]:
    """Every tensor of ``rank``'s local state (docs/LOCAL_STATE.md) with the atom boxes it holds.

    Keys: ("model"|"model{v}", local_name) or ("model_flat", group) for parameters; ("optimizer", "state",
    chunk_key, local_name, state) without ZeRO, ("optimizer", "flat", group, state) with ZeRO.
    """
    validate_for_model(layout, config)
    if layout.zero == 3 and block_size(config) is not None:
        raise LayoutError(
            f"{layout}: ZeRO-3 keeps the parameters in flat buffers of one dtype, and this model's block-quantised "
            "weights are float8 beside parameters of another dtype; use ZeRO 0 to 2, or load the weights dequantised: "
            "`ucp.interop.weights.load_weights(..., dtype=torch.bfloat16)`"
        )
    coords = layout.coords(rank)
    params = local_params(config, layout, coords)
    out: list[LocalTensor] = []
    flats = flat_layouts(params, layout, coords) if layout.zero else []
    flat_pieces = {f.group: _flat_range_pieces(f, f.lo, f.hi) for f in flats}
    if layout.zero == 3:
        out += [LocalTensor(("model_flat", f.group), (f.per_member,), None, flat_pieces[f.group], True) for f in flats]
        out += [LocalTensor((p.chunk_key, p.name), p.shape, None, p.pieces) for p in params if not p.parameter]
    else:
        out += [LocalTensor((p.chunk_key, p.name), p.shape, None, p.pieces) for p in params]
    for state in optim_states:
        if layout.zero:
            out += [
                LocalTensor(("optimizer", "flat", f.group, state), (f.per_member,), state, flat_pieces[f.group], True)
                for f in flats
            ]
        else:
            out += [
                LocalTensor(("optimizer", "state", p.chunk_key, p.name, state), p.shape, state, p.pieces)
                for p in params
                if p.parameter
            ]
    return out


# ----------------------------------------------------------------------------------------------------------
# Writers: exactly one rank writes each element of each atom


def _writer_choice(
    info: _AtomInfo, state_index: int, n_states: int, flat: bool, layout: Layout
) -> tuple[int | None, int | None]:
    """Which replica writes an atom: (tp rank or None if each TP rank writes its own part, DP-group member
    index or None if ZeRO partitions it). Round-robin by atom index (and state), so replicated work is spread
    over replicas instead of piling on rank 0."""
    n_tp = layout.tp if info.spec.kind == "replicated" else 1
    n_dp = 1 if flat else (layout.dp if info.spec.zero_group == "dense" else layout.expert_dp)
    k = (info.index * n_states + state_index) % (n_tp * n_dp)
    return (k % n_tp if n_tp > 1 else None), (None if flat else k // n_tp)


def _member(coords: RankCoords, group: str) -> int:
    return coords.dp if group == "dense" else coords.expert_dp


def _state_index(state: str | None, optim_states: tuple[str, ...]) -> int:
    return 0 if state is None else 1 + optim_states.index(state)


def owned_pieces(
    config: Any, layout: Layout, rank: int, optim_states: tuple[str, ...] = DEFAULT_STATES
) -> list[LocalTensor]:
    """The plan of ``rank`` cut down to the pieces it writes in a distributed save. Over the world, every
    element of every atom (parameter and optimizer state) is written by exactly one rank; tied copies never."""
    coords = layout.coords(rank)
    table = _atom_table(config)
    n_states = 1 + len(optim_states)
    out = []
    for lt in local_plan(config, layout, rank, optim_states):
        s = _state_index(lt.state, optim_states)
        kept = []
        for p in lt.pieces:
            if p.tied_copy:
                continue
            info = table[p.atom]
            tp_choice, dp_choice = _writer_choice(info, s, n_states, lt.flat, layout)
            if tp_choice not in (None, coords.tp) or dp_choice not in (None, _member(coords, info.spec.zero_group)):
                continue
            kept.append(p)
        if kept:
            out.append(LocalTensor(lt.key, lt.shape, lt.state, tuple(kept), lt.flat))
    return out


def _atom_chunk(info: _AtomInfo, layout: Layout, config: Any) -> int:
    if info.place == "first":
        return 0
    if info.place == "last":
        return layout.num_chunks - 1
    _counts, starts = _chunk_starts(layout, config)
    layer = info.spec.layer
    assert layer is not None, "a layer atom names its layer"
    return max(c for c in range(layout.num_chunks) if starts[c] <= layer)


class AtomOwners:
    """Who writes which box of one atom (state None: the parameter; else that optimizer state), asked of a region:
    `within(box)` costs what the region touches, not the atom's writers over the world. Built from the atom's stage,
    EP rank and the layouts of the TP ranks that write it (at most T representative ranks, never the world); a ZeRO
    state's writers are found from the region's flat extent in each TP rank's buffer, so a chunk that DP members cut
    asks only the members whose ranges it crosses (a dense state at DP 768 had every member's piece listed for every
    chunk of the atom)."""

    def __init__(
        self,
        config: Any,
        layout: Layout,
        atom: str,
        state: str | None = None,
        optim_states: tuple[str, ...] = DEFAULT_STATES,
    ):
        table = _atom_table(config)
        if atom not in table:
            raise UcpError(f"unknown atom {atom!r}")
        info = table[atom]
        if state is not None and not info.parameter:
            raise UcpError(f"atom {atom!r} is a buffer: it has no optimizer state {state!r}")
        self.atom, self.layout, self.group = atom, layout, info.spec.zero_group
        self.stage = _atom_chunk(info, layout, config) % layout.pp
        self.ep = info.spec.expert // (config.num_local_experts // layout.ep) if self.group == "expert" else 0
        self.flat = info.parameter and (layout.zero == 3 if state is None else layout.zero >= 1)
        n_states = 1 + len(optim_states)
        tp_choice, self.dp_choice = _writer_choice(info, _state_index(state, optim_states), n_states, self.flat, layout)
        # per writing TP rank: its parameters holding the atom, and (ZeRO) their places in its flat buffer
        self.parts: list[tuple[int, list[tuple[LocalParam, int]], FlatLayout | None]] = []
        for t in range(layout.tp):
            if tp_choice not in (None, t):
                continue
            coords = layout.coords(layout.rank(t, layout.dp_rank_of(self.ep, 0), self.stage))
            params = local_params(config, layout, coords)
            if not self.flat:
                held = [(prm, 0) for prm in params if any(pc.atom == atom and not pc.tied_copy for pc in prm.pieces)]
                self.parts.append((t, held, None))
                continue
            fl = next(f for f in flat_layouts(params, layout, coords) if f.group == self.group)
            held = [(prm, o) for prm, o in fl.params if any(pc.atom == atom and not pc.tied_copy for pc in prm.pieces)]
            self.parts.append((t, held, fl))

    def _dp_rank(self, member: int) -> int:
        return member if self.group == "dense" else self.layout.dp_rank_of(self.ep, member)

    def within(self, box: Box | None = None) -> list[tuple[int, Box]]:
        """(rank, box) pairs, the writers' boxes that overlap `box` (the whole atom: None), each whole: over the
        whole atom they partition it."""
        out: list[tuple[int, Box]] = []
        for t, held, fl in self.parts:
            for prm, offset in held:
                members: set[int] = set()  # (ZeRO: the members whose ranges the box's flat extent crosses)
                for pc in prm.pieces:
                    if pc.atom != self.atom or pc.tied_copy:
                        continue
                    part = pc.atom_box if box is None else intersect(pc.atom_box, box)
                    if part is None:
                        continue
                    if fl is None:
                        assert self.dp_choice is not None  # (a parameter held whole has one writing replica)
                        out.append((self.layout.rank(t, self._dp_rank(self.dp_choice), self.stage), pc.atom_box))
                        continue
                    local = translate(part, tuple(b[0] - a[0] for a, b in zip(pc.atom_box, pc.box, strict=True)))
                    first = offset + flat_start(local, prm.shape)
                    last = offset + flat_start(tuple((b - 1, b) for _, b in local), prm.shape)
                    members.update(range(first // fl.per_member, last // fl.per_member + 1))
                for m in sorted(members):
                    assert fl is not None
                    lo = m * fl.per_member
                    out += [
                        (self.layout.rank(t, self._dp_rank(m), self.stage), fp.atom_box)
                        for fp in _flat_pieces(prm, offset, lo, lo + fl.per_member)
                        if fp.atom == self.atom and (box is None or intersect(fp.atom_box, box) is not None)
                    ]
        return out


def atom_owners(
    config: Any, layout: Layout, atom: str, state: str | None = None, optim_states: tuple[str, ...] = DEFAULT_STATES
) -> list[tuple[int, Box]]:
    """Who writes which box of one atom (state None: the parameter; else that optimizer state): (rank, box)
    pairs that partition the atom (`AtomOwners`, asked of the whole atom)."""
    return AtomOwners(config, layout, atom, state, optim_states).within()


def write_grid(
    config: Any, layout: Layout, atom: str, state: str | None = None, optim_states: tuple[str, ...] = DEFAULT_STATES
) -> tuple[tuple[int, ...], ...]:
    """Per dim, the sorted coordinates at which different writers' boxes meet (including 0 and the size).

    A storage layer whose chunk boundaries include these never has a chunk spanning two writers. TP splits
    give coarse grids; ZeRO flat ranges cut rows, so their grid reaches single rows/elements near range ends:
    for those atoms use ``chunk_write_plan``, which keeps coarse chunks and moves boundary fragments instead.
    """
    shape = _atom_table(config)[atom].shape
    cuts: list[set[int]] = [{0, n} for n in shape]
    for _, box in atom_owners(config, layout, atom, state, optim_states):
        for d, (a, b) in enumerate(box):
            cuts[d].update((a, b))
    return tuple(tuple(sorted(c)) for c in cuts)


# ----------------------------------------------------------------------------------------------------------
# Chunk writers: one writer per storage chunk, even when ZeRO ranges cut a chunk


@dataclass(frozen=True)
class Transfer:
    """A fragment of one atom (state None: the parameter) that moves between ``peer`` and this rank."""

    peer: int
    atom: str
    state: str | None
    atom_box: Box


@dataclass
class ChunkWritePlan:
    """What one rank does in a chunked save: the chunks it writes whole (``writes``: (atom, state, chunk
    box)), the fragments of its owned pieces that belong to chunks others write (``sends``), and the
    fragments it receives for its own chunks (``recvs``)."""

    writes: list[tuple[str, str | None, Box]] = field(default_factory=list)
    sends: list[Transfer] = field(default_factory=list)
    recvs: list[Transfer] = field(default_factory=list)


def _chunks_of(box: Box, chunk: tuple[int, ...], shape: tuple[int, ...]) -> list[Box]:
    ranges = [range(a // c, (b - 1) // c + 1) for (a, b), c in zip(box, chunk, strict=True)]
    return [
        tuple((i * c, min((i + 1) * c, n)) for i, c, n in zip(idx, chunk, shape, strict=True))
        for idx in itertools.product(*ranges)
    ]


def chunk_write_plan(
    config: Any,
    layout: Layout,
    rank: int,
    chunk_shape: Callable[[str, str | None], tuple[int, ...]],
    optim_states: tuple[str, ...] = DEFAULT_STATES,
) -> ChunkWritePlan:
    """Assign every storage chunk one writer (invariant 6) when writer boundaries fall inside chunks.

    The scheme: the writer of a chunk is the owner of its first element (C order). Every other owner of part
    of that chunk sends its fragment to the writer (point to point), which writes the chunk whole once all
    fragments have arrived. Chunks inside one rank's owned boxes (all of them under TP/PP/EP splits whose
    boundaries the chunk grid respects) need no exchange; with ZeRO only chunks that straddle a flat-range
    boundary do, a few per rank. ``chunk_shape(atom, state)`` gives the regular chunk grid of the atom
    (state None) and of each of its optimizer states: each has its own, since states of another dtype than the
    parameter's (fp32 moments of bf16 weights) cut the same bytes into more elements.

    Cost: the rank's own plan, plus the writers of the chunks it shares (``AtomOwners.within``: T representative
    ranks' layouts, then only the pieces that cross those chunks).
    """
    table = _atom_table(config)
    owned = owned_pieces(config, layout, rank, optim_states)
    mine: dict[tuple[str, str | None], list[Box]] = {}
    for lt in owned:
        for p in lt.pieces:
            mine.setdefault((p.atom, lt.state), []).append(p.atom_box)
    owners_cache: dict[tuple[str, str | None], AtomOwners] = {}

    def owners(atom: str, state: str | None) -> AtomOwners:
        if (atom, state) not in owners_cache:
            owners_cache[(atom, state)] = AtomOwners(config, layout, atom, state, optim_states)
        return owners_cache[(atom, state)]

    plan = ChunkWritePlan()
    written: set[tuple[str, str | None, Box]] = set()
    for (atom, state), boxes in mine.items():
        shape = table[atom].shape
        grid = tuple(chunk_shape(atom, state))
        for box in boxes:
            for chunk in _chunks_of(box, grid, shape):
                first = tuple((a, a + 1) for a, _ in chunk)
                if any(contains(b, first) for b in boxes):
                    if (atom, state, chunk) in written:
                        continue
                    written.add((atom, state, chunk))
                    plan.writes.append((atom, state, chunk))
                    covered = sum(box_numel(x) for b in boxes if (x := intersect(b, chunk)) is not None)
                    if covered < box_numel(chunk):
                        for peer, ob in owners(atom, state).within(chunk):
                            if peer != rank and (frag := intersect(ob, chunk)) is not None:
                                plan.recvs.append(Transfer(peer, atom, state, frag))
                else:
                    writer = owners(atom, state).within(first)[0][0]
                    part = intersect(box, chunk)
                    assert part is not None  # (the chunk was chosen for overlapping the box)
                    plan.sends.append(Transfer(writer, atom, state, part))
    return plan


# ----------------------------------------------------------------------------------------------------------
# shard / assemble on in-memory tensors


def _get(tree: Mapping[str, Any], key: tuple[str, ...], what: str) -> Any:
    node: Any = tree
    for k in key:
        if not isinstance(node, Mapping) or k not in node:
            raise UcpError(f"{what}: missing {'/'.join(key)}")
        node = node[k]
    return node


def put_local(tree: dict[str, Any], key: tuple[str, ...], value: Any) -> None:
    """Set `value` at a LocalTensor key (nested dicts, made as needed)."""
    for k in key[:-1]:
        tree = tree.setdefault(k, {})
    tree[key[-1]] = value


def shard(
    full_state: Mapping[str, Any],
    config: Any,
    layout: Layout,
    rank: int,
    optim_states: tuple[str, ...] = DEFAULT_STATES,
) -> dict[str, Any]:
    """The local state of ``rank`` cut from a full (canonical) state.

    full_state = {"model": {atom: tensor}, "optimizer": {"state": {atom: {state_name: tensor}}}} (optimizer
    optional; without it no optimizer state is produced). Padding is zero.
    """
    model = full_state["model"]
    opt = full_state.get("optimizer", {}).get("state")
    if opt is None:
        optim_states = ()
    # a local tensor of padding only (a vocabulary's padded rows on the last TP ranks) has the dtype of its kind
    default_dtype: dict[str | None, torch.dtype] = {None: next(iter(model.values())).dtype if model else torch.float32}
    for states in (opt or {}).values():
        for name, t in states.items():
            default_dtype.setdefault(name, t.dtype)
    local: dict[str, Any] = {}
    for lt in local_plan(config, layout, rank, optim_states):

        def source(atom: str, lt: LocalTensor = lt) -> torch.Tensor:
            return _get(model, (atom,), "full state") if lt.state is None else _get(opt, (atom, lt.state), "full state")

        dtype = source(lt.pieces[0].atom).dtype if lt.pieces else default_dtype.get(lt.state, torch.float32)
        out = torch.zeros(lt.shape, dtype=dtype)
        for p in lt.pieces:
            block = source(p.atom)[to_slices(p.atom_box)]
            if p.flat_offset is None:
                out[to_slices(p.box)] = block
            else:
                out[p.flat_offset : p.flat_offset + p.numel] = block.reshape(-1)
        put_local(local, lt.key, out)
    return local


def _infer_states(local_state: Mapping[str, Any]) -> tuple[str, ...]:
    opt = local_state.get("optimizer")
    if not opt:
        return ()
    if "flat" in opt:
        return tuple(opt["flat"]["dense"])
    for chunk in opt["state"].values():
        for states in chunk.values():  # 0-d entries (e.g. a "step" counter) are not per-element state
            return tuple(k for k, v in states.items() if getattr(v, "dim", lambda: 0)() > 0)
    return ()


def assemble(
    local_states: list[Mapping[str, Any]], config: Any, layout: Layout, optim_states: tuple[str, ...] | None = None
) -> dict[str, Any]:
    """The full (canonical) state from the local states of every rank of the world (list index = rank).

    Each atom box is taken from its one writer (``owned_pieces``); optimizer state names are inferred from
    rank 0's state when not given.
    """
    if len(local_states) != layout.world_size:
        raise LayoutError(
            f"assemble: got {len(local_states)} local states for layout {layout} of world size {layout.world_size}"
        )
    if optim_states is None:
        optim_states = _infer_states(local_states[0])
    table = _atom_table(config)
    model: dict[str, torch.Tensor] = {}
    opt: dict[str, dict[str, torch.Tensor]] = {}
    for rank, local in enumerate(local_states):
        for lt in owned_pieces(config, layout, rank, optim_states):
            src = _get(local, lt.key, f"local state of rank {rank}")
            if tuple(src.shape) != lt.shape:
                raise UcpError(f"rank {rank}: {'/'.join(lt.key)} has shape {tuple(src.shape)}, expected {lt.shape}")
            for p in lt.pieces:
                target = model if lt.state is None else opt.setdefault(p.atom, {})
                name = p.atom if lt.state is None else lt.state
                if name not in target:
                    target[name] = torch.empty(table[p.atom].shape, dtype=src.dtype)
                if p.flat_offset is None:
                    block = src[to_slices(p.box)]
                else:
                    block = src[p.flat_offset : p.flat_offset + p.numel].reshape(box_shape(p.atom_box))
                target[name][to_slices(p.atom_box)] = block
    order = list(table)
    full: dict[str, Any] = {"model": {a: model[a] for a in order if a in model}}
    if optim_states:
        full["optimizer"] = {
            "state": {a: {s: opt[a][s] for s in optim_states if s in opt.get(a, {})} for a in order if a in opt}
        }
    return full


def local_tensor(local_state: Mapping[str, Any], key: tuple[str, ...]) -> torch.Tensor:
    """The tensor at a LocalTensor key of a rank's local state (docs/LOCAL_STATE.md), or a StateError naming it."""
    node: Any = local_state
    for k in key:
        if not isinstance(node, Mapping) or k not in node:
            raise StateError(f"the local state has no {'/'.join(key)} (docs/LOCAL_STATE.md lists what a rank holds)")
        node = node[k]
    if not isinstance(node, torch.Tensor):
        raise StateError(f"the local state's {'/'.join(key)} is a {type(node).__name__}, not a tensor")
    return node  # (a meta tensor is a shape only: interop plans with them)


def piece_view(tensor: torch.Tensor, piece: Piece) -> torch.Tensor:
    """The part of a local tensor that holds `piece`, shaped like its atom box (a view, never a copy)."""
    if piece.flat_offset is None:
        return tensor[to_slices(piece.box)]
    return tensor[piece.flat_offset : piece.flat_offset + piece.numel].view(box_shape(piece.atom_box))
