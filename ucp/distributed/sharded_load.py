"""A distributed load: the local state of one rank in any layout, read straight from the atoms (`load_sharded`):
only the regions the rank needs, every read one stored object, many in flight. What to read is planned as data
(`ucp.distributed.read_plan`); this module executes the plan (`run_plan`)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..base import dtypes
from ..base.boxes import Box, box_shape
from ..base.devices import load_device
from ..base.heap import collector_paused
from ..base.workpool import ObjectCall
from ..engine.checkpoint import CheckpointReader
from ..errors import StateError
from ..format.manifest import AtomMeta
from ..sharding.quantization import dequantize
from ..sharding.reshard import LocalTensor, local_tensor, piece_view, put_local
from .read_plan import LocalRead, ReadItem, ReadPlan, given_tensor, plan_reads
from .sharded_model import ShardedModel


@dataclass
class LoadReport:
    """What one rank read: bytes its tensors needed, and chunk bytes read from storage (amplification = ratio)."""

    bytes_needed: int
    bytes_read: int

    @property
    def amplification(self) -> float:
        return self.bytes_read / self.bytes_needed if self.bytes_needed else 1.0


@collector_paused()
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
    a GPU is read and verified in page-locked host memory and copied asynchronously (`ucp.engine.landing`).

    A block-quantised weight atom (docs/FORMAT.md section 2.1) is dequantised where the model has no such scales (its
    config's `weight_block_size` None: the model dequantised), or where it has and the weight's local tensor is
    asked for in a dtype other than float8 (its `into` tensor's, else `dtype`): each piece is read as stored with the
    scales of the blocks it falls in, two ranks sharing a block where a split does not fall on block edges, and its
    float32 product rounded once into the local tensor (that dtype; float32 when none says), in place in an `into`
    tensor, the same bits as `ucp.sharding.quantization.dequantize` gives those elements of the whole atom.

    The reads are planned first (`ucp.distributed.read_plan.plan_reads`: every refusal comes before any read), then executed
    (`run_plan`)."""
    plan = plan_reads(reader.atoms, model, rank, dtype=dtype, into=into, step=reader.step)
    return run_plan(reader, plan, into=into, device=device)


@collector_paused()
def run_plan(
    reader: CheckpointReader,
    plan: ReadPlan,
    *,
    into: Mapping[str, Any] | None = None,
    device: torch.device | str | None = None,
) -> tuple[dict[str, Any], LoadReport]:
    """Execute `plan` (made from `reader`'s atoms, and with `into` if given): make or take each local tensor, read
    every item's chunks into it (many in flight; through a `ucp.engine.landing.Landing` where the tensor is on a device),
    convert what is read in another dtype, and cast the parameters it made to the plan's dtype."""
    device = load_device(device)
    local: dict[str, Any] = {}
    jobs: list[ObjectCall] = []
    direct: list[tuple[AtomMeta, Box, torch.Tensor]] = []  # read in the stored dtype, straight into the tensor
    casts: list[tuple[torch.Tensor, torch.Tensor]] = []  # (read in the plan's dtype, the caller's tensor)
    finishes: list[Callable[[], object]] = []  # once read: items read in another dtype, put into their tensors
    for t in plan.tensors:
        given = given_tensor(into, t.key, t.shape)
        if (None if given is None else given.dtype) != t.given:
            raise StateError(
                f"cannot load into {'/'.join(t.key)}: the read plan was made for "
                f"{'no tensor' if t.given is None else f'a {t.given} tensor'} there"
            )
        # (detached: a parameter that requires grad is filled as `load_state_dict` fills it, its memory and not its
        # autograd history; torch refuses an in-place change of a leaf that requires grad, and no_grad is per thread)
        target = None if given is None else given.detach()
        if target is not None and target.dtype == t.dtype:
            tensor = target.zero_() if t.padded else target  # padding: 0
        else:
            make = torch.zeros if t.padded else torch.empty
            tensor = make(t.shape, dtype=t.dtype, device=target.device if target is not None else device)
            if target is not None:
                casts.append((tensor, target))
        put_local(local, t.key, tensor if given is None else given)
        for item in t.items:
            view = piece_view(tensor, item.piece)
            meta = reader.atoms[item.atom]
            if item.convert:
                jobs += _converted_reads(reader, meta, item, view, finishes)
            else:
                direct.append((meta, item.box, view))
    read = reader.read_regions(direct, also=jobs)
    for finish in finishes:
        finish()
    for tensor, given in casts:
        given.copy_(tensor)
    if plan.dtype is not None:  # (the caller's own tensors keep their dtype)
        local = _cast_params(local, [t for t in plan.tensors if t.given is None], plan.dtype)
    return local, LoadReport(plan.bytes_needed, read)


def needed_objects(
    atoms: Mapping[str, AtomMeta],
    model: ShardedModel,
    rank: int,
    *,
    dtype: torch.dtype | None = None,
    into: Mapping[str, Any] | None = None,
) -> set[tuple[str, tuple[int, ...]]]:
    """The chunk objects (atom path, grid index) that `load_sharded` reads for `rank` (with this `dtype` and
    `into`): its plan's (`ReadPlan.objects`), a pure function of the manifest, the model and the rank, so no rank
    needs to ask another what it will read."""
    return plan_reads(atoms, model, rank, dtype=dtype, into=into).objects()


def _cast_params(local: dict[str, Any], made: list[LocalRead], dtype: torch.dtype) -> dict[str, Any]:
    for t in made:
        if t.state is None:
            put_local(local, t.key, local_tensor(local, t.key).to(dtype))
    return local


def piece_reads(
    reader: CheckpointReader,
    lt: LocalTensor,
    metas: Sequence[AtomMeta],
    tensor: torch.Tensor,
    finishes: list[Callable[[], object]],
) -> list[ObjectCall]:
    """The reads that fill `tensor` (local tensor `lt`, in host memory) from the chunks its pieces overlap, each with
    the bytes of its object; `metas` are the pieces' atoms. Each read is one stored object; run them in any order, at
    once, then `finishes`: a piece of an atom stored in another dtype than `tensor`'s (a fused tensor of atoms stored
    in several) is read into a buffer of its own dtype, and cast into `tensor` by the step added there."""
    reads: list[ObjectCall] = []
    for p, meta in zip(lt.pieces, metas):
        view = piece_view(tensor, p)
        stored = dtypes.torch_dtype(meta.dtype)
        if stored != tensor.dtype:
            part = torch.empty(view.shape, dtype=stored)
            finishes.append(functools.partial(view.copy_, part))
            view = part
        reads += reader.region_reads(meta, p.atom_box, view)
    return reads


def _converted_reads(
    reader: CheckpointReader,
    meta: AtomMeta,
    item: ReadItem,
    view: torch.Tensor,
    finishes: list[Callable[[], object]],
) -> list[ObjectCall]:
    """The reads of `item` (of atom `meta`) for `view`, which has another dtype: into a buffer of the atom's dtype
    (and, dequantised, one of the scales of the blocks the region falls in); the step that then puts it into `view`
    (cast, or dequantised: each element times its block's scale in float32, rounded once) goes to `finishes`."""
    part = torch.empty(box_shape(item.box), dtype=dtypes.torch_dtype(meta.dtype))  # (host memory: converted there)
    reads = [reader.region_read(meta, index, item.box, part) for index in item.chunks]
    if item.scales is None:
        finishes.append(functools.partial(view.copy_, part))
        return reads
    scales = item.scales
    scale_meta = reader.atoms[scales.atom]
    factors = torch.empty(box_shape(scales.box), dtype=dtypes.torch_dtype(scale_meta.dtype))
    reads += [reader.region_read(scale_meta, index, scales.box, factors) for index in scales.chunks]
    start = (item.box[-2][0], item.box[-1][0])

    def finish() -> None:
        view.copy_(dequantize(part, factors, scales.block, view.dtype, start))

    finishes.append(finish)
    return reads
