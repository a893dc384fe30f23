"""The read plan of a rank's load, as data: which region of which atom goes into which part of which local tensor,
in which dtype, through which chunk objects (`plan_reads`; DCP's `LoadPlan` of `ReadItem`s is the same idea).

A plan is a pure function of the step's manifest (its atoms), the model, its layout and the rank, and of what the
caller asks for (a dtype; tensors of its own to fill, of which only their dtypes and shapes count). It does no IO.
`ucp.distributed.sharded_load.load_sharded` executes it; `ReadPlan.objects` projects it onto the chunk objects a load reads,
which the hot tier gathers from the nodes that hold them before the load (`ucp.distributed.tiers`): both come from the one plan,
so what is fetched is what is read. A plan is frozen and compares by value: the same inputs give an equal plan.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ..base import dtypes
from ..base.boxes import Box, box_numel
from ..engine.checkpoint import chunks_touching
from ..errors import FormatError, StateError
from ..format.manifest import AtomMeta, quantization_of
from ..format.tree import tree_atoms
from ..sharding.families import canonical_atoms
from ..sharding.layout import Layout
from ..sharding.quantization import FLOAT8, scale_box
from ..sharding.reshard import Piece, local_plan
from .sharded_model import ShardedModel, atom_path, check_atom, states_held

ChunkIndex = tuple[int, ...]  # a chunk's place in its atom's grid (of a packed atom: a byte range of a pack)
ObjectRef = tuple[str, ChunkIndex]  # (atom path, chunk index): one chunk object, or one packed chunk


@dataclass(frozen=True, slots=True)
class ScaleRead:
    """The scales a dequantised region is multiplied by: region `box` of scale atom `atom` (the blocks of `block`
    that the weight's region falls in; a block a split cuts is read by the ranks on both sides)."""

    atom: str
    block: tuple[int, int]
    box: Box
    chunks: tuple[ChunkIndex, ...]


@dataclass(frozen=True, slots=True)
class ReadItem:
    """Region `box` of atom `atom`, read from the chunks `chunks` of its grid into the part of the local tensor that
    holds `piece` (`ucp.sharding.reshard.piece_view`). Straight into it where the tensor has the atom's dtype (`convert`
    False); else into host memory in the atom's dtype, then cast into it, or with `scales` dequantised (each
    element times its block's scale in float32, rounded once). `nbytes`: what the region and its scales need."""

    atom: str
    box: Box
    piece: Piece
    chunks: tuple[ChunkIndex, ...]
    convert: bool
    scales: ScaleRead | None
    nbytes: int


@dataclass(frozen=True, slots=True)
class LocalRead:
    """One tensor of the rank's local state (at `key`, of `shape`) and the reads that fill it, in `dtype` (the
    atoms' stored dtype, or the one a dequantised weight is asked for). `padded`: its pieces leave parts of it
    uncovered, which are zero. `given`: the dtype of the caller's own tensor that the load fills (in place when it
    is `dtype`, else through a tensor of `dtype` copied into it), None when the load makes the tensor."""

    key: tuple[str, ...]
    shape: tuple[int, ...]
    state: str | None
    dtype: torch.dtype
    padded: bool
    given: torch.dtype | None
    items: tuple[ReadItem, ...]


@dataclass(frozen=True, slots=True)
class ReadPlan:
    """Every read of one rank's load (`plan_reads`): its local tensors in the layout's order. `dtype`: what the
    parameters the load makes are cast to once read (None: kept as stored)."""

    layout: Layout
    rank: int
    dtype: torch.dtype | None
    tensors: tuple[LocalRead, ...]

    def objects(self) -> set[ObjectRef]:
        """The chunk objects (atom path, chunk index) the load reads: every one it reads, and no other."""
        out: set[ObjectRef] = set()
        for t in self.tensors:
            for item in t.items:
                out.update((item.atom, index) for index in item.chunks)
                if item.scales is not None:
                    out.update((item.scales.atom, index) for index in item.scales.chunks)
        return out

    @property
    def bytes_needed(self) -> int:
        """Bytes of the atoms' regions (and scales) that the local tensors need (`LoadReport.bytes_needed`)."""
        return sum(item.nbytes for t in self.tensors for item in t.items)


def plan_reads(
    atoms: Mapping[str, AtomMeta],
    model: ShardedModel,
    rank: int,
    *,
    dtype: torch.dtype | None = None,
    into: Mapping[str, Any] | None = None,
    step: int | None = None,
) -> ReadPlan:
    """The read plan of `rank` of `model.layout` from a step whose manifest holds `atoms` (`step`: its number, for
    errors). `dtype` and `into` are `load_sharded`'s: the tensors of `into` (the same nested keys as the local state)
    are the ones the load will fill, and only their dtypes and shapes are read here.

    Refused before anything is read: an atom the step lacks or of another shape than the model's (FormatError), a
    malformed block quantisation (FormatError), an `into` tensor that cannot hold its local tensor or a dequantised
    weight asked for in float8 (StateError)."""
    model = states_held(model, atoms)
    shapes = canonical_atoms(model.config)
    wanted = []  # every local tensor with the atoms of its pieces (all looked up before any tensor is planned)
    kind_dtypes: dict[str | None, str] = {}  # the dtype of each kind (parameters, or a state) in the rank's atoms
    for lt in local_plan(model.config, model.layout, rank, model.optim_states):
        metas = []
        for p in lt.pieces:
            path = atom_path(p.atom, lt.state)
            meta = atoms.get(path)
            if meta is None:
                what = "optimizer state" if lt.state else "parameter"
                raise FormatError(
                    f"{'the step' if step is None else f'step {step}'} has no atom {path!r} ({what} {p.atom} needed "
                    f"by rank {rank} of {model.layout})"
                )
            check_atom(meta, shapes[p.atom][0])
            metas.append(meta)
            kind_dtypes.setdefault(lt.state, meta.dtype)
        wanted.append((lt, metas))
    tensors = []
    for lt, metas in wanted:
        given = given_tensor(into, lt.key, lt.shape)
        wanted_dtype = given.dtype if given is not None else dtype
        scaled = [dequantised(atoms, meta, shapes, wanted_dtype) for meta in metas]
        kind = kind_dtypes.get(lt.state) or _kind_dtype(atoms, lt.state)
        stored = dtypes.torch_dtype(metas[0].dtype if metas else kind)
        if any(scaled):  # dequantised straight into the dtype asked for (float32 if none)
            stored = wanted_dtype or torch.float32
            if stored in FLOAT8:
                raise StateError(f"{'/'.join(lt.key)} is loaded dequantised: it cannot be {stored}")
        items = tuple(_item(p, meta, scales, stored) for p, meta, scales in zip(lt.pieces, metas, scaled))
        padded = sum(p.numel for p in lt.pieces) != math.prod(lt.shape)
        tensors.append(
            LocalRead(lt.key, lt.shape, lt.state, stored, padded, None if given is None else given.dtype, items)
        )
    return ReadPlan(model.layout, rank, dtype, tuple(tensors))


def plan_paths(model: ShardedModel, rank: int, extra: Any = None) -> list[str]:
    """The atom paths a load of `rank` of `model.layout` reads (without the manifest: from the model alone), those of
    the optional states included, and those of the state tree node `extra` (the extra state every rank reads): what a
    distributed load shares the index of (`ucp.distributed.shared_manifest`)."""
    states = model.optim_states + tuple(s for s in model.optional_states if s not in model.optim_states)
    paths = {
        atom_path(p.atom, lt.state) for lt in local_plan(model.config, model.layout, rank, states) for p in lt.pieces
    }
    if extra is not None:
        paths.update(tree_atoms(extra))
    return sorted(paths)


def _kind_dtype(atoms: Mapping[str, AtomMeta], state: str | None) -> str:
    """The dtype of a local tensor that holds padding only (a padded vocabulary's last rows on the last TP ranks): that
    of the step's other atoms of its kind (the parameters, or that optimizer state), float32 where it has none.
    (Asked only where the rank holds no other atom of that kind: it may read the step's whole index.)"""
    prefix, suffix = ("model/", "") if state is None else ("optimizer/state/", f"/{state}")
    return next((m.dtype for p, m in atoms.items() if p.startswith(prefix) and p.endswith(suffix)), "float32")


def _item(piece: Piece, meta: AtomMeta, scales: Scales | None, dtype: torch.dtype) -> ReadItem:
    """The read of `piece` from `meta` into a local tensor of `dtype`, with `scales` where it is dequantised."""
    box = piece.atom_box
    nbytes = box_numel(box) * meta.itemsize
    scale_read = None
    if scales is not None:
        scale_meta, block = scales
        covering = scale_box(box, block)
        scale_read = ScaleRead(scale_meta.path, block, covering, tuple(chunks_touching(scale_meta, covering)))
        nbytes += box_numel(covering) * scale_meta.itemsize
    convert = scales is not None or dtypes.torch_dtype(meta.dtype) != dtype
    return ReadItem(meta.path, box, piece, tuple(chunks_touching(meta, box)), convert, scale_read, nbytes)


def given_tensor(into: Mapping[str, Any] | None, key: tuple[str, ...], shape: tuple[int, ...]) -> torch.Tensor | None:
    """The caller's tensor at `key` of `into` to fill in place, if it has one; a StateError if it cannot hold the
    local tensor (of `shape`)."""
    node: Any = into
    for k in key:
        if not isinstance(node, Mapping) or k not in node:
            return None
        node = node[k]
    where = "/".join(key)
    if not isinstance(node, torch.Tensor):
        raise StateError(f"cannot load into {where}: it is a {type(node).__name__}, not a tensor")
    if tuple(node.shape) != shape:
        raise StateError(
            f"cannot load into {where}: it has shape {list(node.shape)}, the layout's local tensor {list(shape)}"
        )
    if node.device.type == "meta":
        raise StateError(f"cannot load into {where}: it is on the meta device, which holds no values")
    return node


Scales = tuple[AtomMeta, tuple[int, int]]  # a block-quantised weight's scale atom and block


def dequantised(
    atoms: Mapping[str, AtomMeta], meta: AtomMeta, shapes: Mapping[str, Any], wanted: torch.dtype | None = None
) -> Scales | None:
    """The scale atom and block of a block-quantised weight atom (docs/FORMAT.md section 2.1) that the load
    dequantises: the model being loaded holds it dequantised (its config has no such scales: `shapes`, its canonical
    atoms), or holds its scales but the weight is `wanted` in a dtype that is not float8; None for any other."""
    found = quantization_of(meta, atoms)
    if found is None:
        return None
    scales, block = found
    if scales.path.removeprefix("model/") in shapes and (wanted is None or wanted in FLOAT8):
        return None  # (held as stored, beside its scales)
    return scales, block
