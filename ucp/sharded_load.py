"""A distributed load: the local state of one rank in any layout, read straight from the atoms (`load_sharded`):
only the regions the rank needs, every read one stored object, many in flight."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from . import dtypes
from .boxes import Box, box_shape
from .checkpoint import CheckpointReader, chunks_touching
from .devices import load_device, on_host
from .errors import FormatError, StateError
from .families import canonical_atoms
from .format import AtomMeta
from .landing import open_landing
from .quantization import FLOAT8, SCALE_DTYPES, dequantize, scale_box, scale_shape
from .reshard import LocalTensor, local_plan, local_tensor, piece_view, put_local
from .sharded_model import ShardedModel, atom_path, check_atom, states_held
from .workpool import ObjectCall


@dataclass
class LoadReport:
    """What one rank read: bytes its tensors needed, and chunk bytes read from storage (amplification = ratio)."""

    bytes_needed: int
    bytes_read: int

    @property
    def amplification(self) -> float:
        return self.bytes_read / self.bytes_needed if self.bytes_needed else 1.0


def load_sharded(
    reader: CheckpointReader,
    model: ShardedModel,
    rank: int,
    *,
    dtype: torch.dtype | None = None,
    into: Mapping[str, Any] | None = None,
    device: torch.device | str | None = None,
) -> tuple[dict[str, Any], LoadReport]:
    """The local state of `rank` in `model.layout`, read straight from the atoms: only the regions this rank
    needs, many reads in flight, every inner chunk verified. Parameters are cast to `dtype` when given.

    `into`: a local state (the same nested keys) whose tensors are filled in place, as a job's own parameters
    and optimizer state are by `load_state_dict`, on whatever device they are; the tensors it lacks are made, on
    `device` (default: host memory). Memory a process already uses fills several times faster than memory it has
    never touched (each new page is a fault), so a job that has built its model loads fastest this way. A tensor of
    another shape is refused; of another dtype, cast. A load that fails may have filled part of them. What lands on
    a GPU is read and verified in page-locked host memory and copied asynchronously (`ucp.landing`).

    A block-quantised weight atom (docs/FORMAT.md section 2.1) is dequantised where the model has no such scales (its
    config's `weight_block_size` None: the model dequantised), or where it has and the weight's local tensor is
    asked for in a dtype other than float8 (its `into` tensor's, else `dtype`): each piece is read as stored with the
    scales of the blocks it falls in, two ranks sharing a block where a split does not fall on block edges, and its
    float32 product rounded once into the local tensor (that dtype; float32 when none says), in place in an `into`
    tensor, the same bits as `ucp.quantization.dequantize` gives those elements of the whole atom."""
    device = load_device(device)
    model = states_held(model, reader.atoms)
    plan = local_plan(model.config, model.layout, rank, model.optim_states)
    shapes = canonical_atoms(model.config)
    local: dict[str, Any] = {}
    jobs: list[ObjectCall] = []
    regions: list[tuple[AtomMeta, Box, torch.Tensor]] = []  # read in the stored dtype, straight into the local tensor
    casts: list[tuple[torch.Tensor, torch.Tensor]] = []  # (read in the stored dtype, the caller's tensor)
    made: list[LocalTensor] = []  # the local tensors not from `into`
    finishes: list[Callable[[], object]] = []  # once read: pieces read in another dtype, put into their local tensors
    bytes_needed = 0
    for lt in plan:
        metas = []
        for p in lt.pieces:
            path = atom_path(p.atom, lt.state)
            if path not in reader.atoms:
                what = "optimizer state" if lt.state else "parameter"
                raise FormatError(
                    f"step {reader.step} has no atom {path!r} ({what} {p.atom} needed by rank {rank} of {model.layout})"
                )
            meta = reader.atoms[path]
            check_atom(meta, shapes[p.atom][0])
            metas.append(meta)
        given = _given(into, lt)
        scaled = [
            dequantised(reader.atoms, meta, shapes, given.dtype if given is not None else dtype) for meta in metas
        ]
        stored = dtypes.torch_dtype(metas[0].dtype) if metas else torch.float32
        covered = sum(p.numel for p in lt.pieces) == math.prod(lt.shape)
        if given is None:
            made.append(lt)
        if any(scaled):  # dequantised straight into the dtype asked for (float32 if none)
            stored = given.dtype if given is not None else dtype or torch.float32
            if stored in FLOAT8:
                raise StateError(f"{'/'.join(lt.key)} is loaded dequantised: it cannot be {stored}")
        if given is not None and given.dtype == stored:
            tensor = given if covered else given.zero_()  # padding: 0
        else:
            place = given.device if given is not None else device
            make = torch.empty if covered else torch.zeros
            tensor = make(lt.shape, dtype=stored, device=place)
            if given is not None:
                casts.append((tensor, given))
        put_local(local, lt.key, tensor if given is None else given)
        for p, meta, scales in zip(lt.pieces, metas, scaled):
            view = piece_view(tensor, p)
            if scales is None and dtypes.torch_dtype(meta.dtype) == stored:
                regions.append((meta, p.atom_box, view))
                bytes_needed += p.numel * view.element_size()
            else:
                reads, finish, nbytes = _converted_reads(reader, meta, p.atom_box, view, scales)
                jobs += reads
                finishes.append(finish)
                bytes_needed += nbytes
    # (only a load given a device or tensors of the caller's can land anywhere but in host memory)
    off_host = [view for _, _, view in regions if not on_host(view)] if device is not None or into is not None else []
    with open_landing(
        off_host, [meta for meta, _, view in regions if not on_host(view)] if off_host else []
    ) as landing:
        for meta, box, view in regions:
            jobs += reader.region_reads(meta, box, view, landing if off_host and not on_host(view) else None)
        read = reader.run_reads(jobs)
    for finish in finishes:
        finish()
    for tensor, given in casts:
        given.copy_(tensor)
    if dtype is not None:  # (the caller's own tensors keep their dtype)
        local = _cast_params(local, made, dtype)
    return local, LoadReport(bytes_needed, read)


def _given(into: Mapping[str, Any] | None, lt: LocalTensor) -> torch.Tensor | None:
    """The caller's tensor for `lt` to fill in place, if `into` has one; a StateError if it cannot hold it."""
    node: Any = into
    for k in lt.key:
        if not isinstance(node, Mapping) or k not in node:
            return None
        node = node[k]
    where = "/".join(lt.key)
    if not isinstance(node, torch.Tensor):
        raise StateError(f"cannot load into {where}: it is a {type(node).__name__}, not a tensor")
    if tuple(node.shape) != lt.shape:
        raise StateError(
            f"cannot load into {where}: it has shape {list(node.shape)}, the layout's local tensor {list(lt.shape)}"
        )
    if node.device.type == "meta":
        raise StateError(f"cannot load into {where}: it is on the meta device, which holds no values")
    return node


def needed_objects(atoms: Mapping[str, AtomMeta], model: ShardedModel, rank: int) -> set[tuple[str, tuple[int, ...]]]:
    """The chunk objects (atom path, grid index) that `load_sharded` reads for `rank`: a pure function of the
    manifest, the model and the rank, so no rank needs to ask another what it will read."""
    out: set[tuple[str, tuple[int, ...]]] = set()
    model = states_held(model, atoms)
    shapes = canonical_atoms(model.config)
    for lt in local_plan(model.config, model.layout, rank, model.optim_states):
        for p in lt.pieces:
            meta = atoms.get(atom_path(p.atom, lt.state))
            if meta is not None:
                out.update((meta.path, index) for index in chunks_touching(meta, p.atom_box))
                scales = dequantised(atoms, meta, shapes)
                if scales is not None:
                    box = scale_box(p.atom_box, scales[1])
                    out.update((scales[0].path, index) for index in chunks_touching(scales[0], box))
    return out


def _cast_params(local: dict[str, Any], plan: list[LocalTensor], dtype: torch.dtype) -> dict[str, Any]:
    for lt in plan:
        if lt.state is None:
            put_local(local, lt.key, local_tensor(local, lt.key).to(dtype))
    return local


def piece_reads(
    reader: CheckpointReader, lt: LocalTensor, metas: Sequence[AtomMeta], tensor: torch.Tensor
) -> list[ObjectCall]:
    """The reads that fill `tensor` (local tensor `lt`, in the atoms' stored dtype) from the chunks its pieces
    overlap, each with the bytes of its object; `metas` are the pieces' atoms. Each read is one stored object; run
    them in any order, at once."""
    reads: list[ObjectCall] = []
    for p, meta in zip(lt.pieces, metas):
        reads += reader.region_reads(meta, p.atom_box, piece_view(tensor, p))
    return reads


Scales = tuple[AtomMeta, tuple[int, int]]  # a block-quantised weight's scale atom and block


def dequantised(
    atoms: Mapping[str, AtomMeta], meta: AtomMeta, shapes: Mapping[str, Any], wanted: torch.dtype | None = None
) -> Scales | None:
    """The scale atom and block of a block-quantised weight atom (docs/FORMAT.md section 2.1) that the load
    dequantises: the model being loaded holds it dequantised (its config has no such scales: `shapes`, its canonical
    atoms), or holds its scales but the weight is `wanted` in a dtype that is not float8; None for any other."""
    quantised = meta.attributes.get("quantization")
    if not isinstance(quantised, dict) or "scales" not in quantised:
        return None
    path = quantised["scales"]
    if path.removeprefix("model/") in shapes and (wanted is None or wanted in FLOAT8):
        return None  # (held as stored, beside its scales)
    block = quantised.get("block")
    scales = atoms.get(path)
    if not (isinstance(block, list) and len(block) == 2 and all(type(b) is int and b > 0 for b in block)):
        raise FormatError(f"atom {meta.path!r}: quantization block {block!r} is not two positive integers")
    expected = scale_shape(meta.shape, block)
    scale_dtypes = [dtypes.zarr_name(d) for d in SCALE_DTYPES]
    if scales is None or scales.dtype not in scale_dtypes or scales.shape != expected:
        found = "absent" if scales is None else f"{scales.dtype} {list(scales.shape)}"
        raise FormatError(
            f"atom {meta.path!r} is block-quantised ({block}), but its scale atom {path!r} is {found}, not "
            f"{' or '.join(scale_dtypes)} {list(expected)}"
        )
    return scales, (block[0], block[1])


def _converted_reads(
    reader: CheckpointReader, meta: AtomMeta, box: Box, view: torch.Tensor, scales: Scales | None
) -> tuple[list[ObjectCall], Callable[[], object], int]:
    """Region `box` of an atom for `view`, which has another dtype: the reads into a buffer of the atom's dtype (and
    with `scales`, of the scales of the blocks the region falls in), the step that then puts it into `view` (cast, or
    dequantised: each element times its block's scale in float32, rounded once) and the bytes they read for it."""
    part = torch.empty(box_shape(box), dtype=dtypes.torch_dtype(meta.dtype))  # (host memory: converted there)
    reads = reader.region_reads(meta, box, part)
    nbytes = part.numel() * part.element_size()
    if scales is None:
        return reads, functools.partial(view.copy_, part), nbytes
    scale_meta, block = scales
    covering = scale_box(box, block)
    factors = torch.empty(box_shape(covering), dtype=dtypes.torch_dtype(scale_meta.dtype))
    reads += reader.region_reads(scale_meta, covering, factors)
    start = (box[-2][0], box[-1][0])

    def finish() -> None:
        view.copy_(dequantize(part, factors, block, view.dtype, start))

    return reads, finish, nbytes + factors.numel() * factors.element_size()
