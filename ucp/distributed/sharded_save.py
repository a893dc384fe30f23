"""A distributed save: every rank writes the chunks it owns (`RankSaver`), rank 0 adds the manifest and the
extra state, and `SaveSession` commits once every rank's data is durable (`plan_sharded_save`, `save_sharded`);
`VirtualWorld` runs every rank of a layout in one process (tests, offline tools, benchmarks)."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import torch

from ..base import dtypes
from ..base.boxes import Box, box_numel, box_shape, intersect, relative, to_slices
from ..base.chunking import ChunkingPolicy
from ..base.devices import on_host
from ..engine.checkpoint import SaveOptions, chunk_jobs, group_paths, io_threads_for, plan_atoms
from ..engine.pipeline import ChunkJob, SavePipeline, SavePlan, one_shot_staging
from ..errors import StateError
from ..format import tree
from ..format.manifest import AtomMeta, StepManifest
from ..protocol.comm import Comm
from ..protocol.commit import CommitRecord
from ..protocol.session import SaveSession
from ..sharding.families import family_for
from ..sharding.reshard import (
    LocalTensor,
    Transfer,
    chunk_write_plan,
    local_plan,
    local_tensor,
    owned_pieces,
    piece_view,
)
from ..storage import Storage, open_storage
from ..version import __version__
from .sharded_model import AtomKey, ShardedModel, atom_metas, quantised_dtypes


def _local_dtypes(
    local_state: Mapping[str, Any], plan: list[LocalTensor], model: ShardedModel, rank: int
) -> dict[str | None, str]:
    """The dtype of the parameters and of each optimizer state, as this rank holds them, and of the atoms whose
    dtype is their own (`ShardedModel.atom_dtypes`, block-quantised weights and their scales), as every rank knows
    them. A parameter of another dtype that the model does not say would have another dtype on each rank: an error;
    so is a tensor of another shape than the layout gives it."""
    own = {**quantised_dtypes(model.config), **model.atom_dtypes}
    out: dict[str | None, str] = {}
    for lt in plan:
        tensor = local_tensor(local_state, lt.key)
        if tuple(tensor.shape) != lt.shape:  # (a save cuts its pieces by position: another shape saved wrong values)
            raise StateError(
                f"local tensor {'/'.join(lt.key)} has shape {list(tensor.shape)}, but rank {rank} of {model.layout} "
                f"holds {list(lt.shape)} there (docs/LOCAL_STATE.md)"
            )
        dtype = dtypes.zarr_name(tensor.dtype)
        said = {own[p.atom] for p in lt.pieces if lt.state is None and p.atom in own}
        if said and said != {dtype}:
            raise StateError(f"local tensor {'/'.join(lt.key)} is {dtype}, but its atoms are {sorted(said)}")
        if not said and out.setdefault(lt.state, dtype) != dtype:
            raise StateError(
                f"local tensor {'/'.join(lt.key)} is {dtype}, other {lt.state or 'parameter'}s {out[lt.state]}: "
                "say the atoms of another dtype in ShardedModel.atom_dtypes"
            )
    for atom, dtype in model.atom_dtypes.items():
        out[atom] = dtype
    return out


def _as_uint8(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


# Each fragment in a peer's byte buffer starts at a multiple of this, so that the receiver views it as its dtype in
# place: a bf16 parameter's fragment of an odd number of elements left the fp32 state after it at an offset of
# 2 mod 4, which a view refuses (ZeRO-3 with bf16 parameters and fp32 optimizer states).
FRAGMENT_ALIGN = 16


def _aligned(nbytes: int) -> int:
    return -(-nbytes // FRAGMENT_ALIGN) * FRAGMENT_ALIGN


class RankSaver:
    """One rank's part of a distributed save: what it sends, what it writes. The local state may be on a device:
    chunks are then views of it (or assembled on it), copied to staging memory by the pipeline; only the fragments
    sent to other ranks come to host memory here."""

    def __init__(self, local_state: Mapping[str, Any], model: ShardedModel, rank: int, options: SaveOptions):
        self.model, self.rank, self.options = model, rank, options
        plan = local_plan(model.config, model.layout, rank, model.optim_states)
        self.dtypes = _local_dtypes(local_state, plan, model, rank)
        self.metas = atom_metas(model, self.dtypes, options.chunking)
        # (atom, state) -> [(atom box, view of the local data holding it)] for the pieces this rank writes
        self.owned: dict[AtomKey, list[tuple[Box, torch.Tensor]]] = {}
        self.on_host = True  # whether every tensor this rank writes from is in host memory
        for lt in owned_pieces(model.config, model.layout, rank, model.optim_states):
            tensor = local_tensor(local_state, lt.key).detach()
            self.on_host = self.on_host and on_host(tensor)
            for p in lt.pieces:
                self.owned.setdefault((p.atom, lt.state), []).append((p.atom_box, piece_view(tensor, p)))
        self.transfers = chunk_write_plan(
            model.config, model.layout, rank, lambda a, s: self.metas[(a, s)].chunk_shape, model.optim_states
        )

    def _region(self, key: AtomKey, box: Box) -> torch.Tensor:
        """A box of an atom that lies inside one piece this rank owns."""
        for owned_box, view in self.owned[key]:
            if intersect(owned_box, box) == box:
                return view[to_slices(relative(box, owned_box))]
        raise AssertionError(f"rank {self.rank} does not hold {key} {box}")  # the plan guarantees it

    @staticmethod
    def _order(transfers: list[Transfer]) -> list[Transfer]:
        return sorted(transfers, key=lambda t: (t.peer, t.atom, t.state or "", t.atom_box))

    def outgoing(self) -> dict[int, torch.Tensor]:
        """Fragments of this rank's pieces that other ranks' chunks need, one byte buffer per peer."""
        buffers: dict[int, list[torch.Tensor]] = {}
        for t in self._order(self.transfers.sends):
            fragment = _as_uint8(self._region((t.atom, t.state), t.atom_box))
            parts = buffers.setdefault(t.peer, [])
            parts.append(fragment)
            padding = _aligned(fragment.numel()) - fragment.numel()
            if padding:
                parts.append(torch.zeros(padding, dtype=torch.uint8, device=fragment.device))
        return {peer: torch.cat(parts).to("cpu") for peer, parts in buffers.items()}  # (the comm sends host memory)

    def incoming_sizes(self) -> dict[int, int]:
        sizes: dict[int, int] = {}
        for t in self.transfers.recvs:
            n = box_numel(t.atom_box) * self.metas[(t.atom, t.state)].itemsize
            sizes[t.peer] = sizes.get(t.peer, 0) + _aligned(n)
        return sizes

    def _received_fragments(self, incoming: dict[int, torch.Tensor]) -> dict[AtomKey, list[tuple[Box, torch.Tensor]]]:
        fragments: dict[AtomKey, list[tuple[Box, torch.Tensor]]] = {}
        offsets = dict.fromkeys(incoming, 0)
        for t in self._order(self.transfers.recvs):
            meta = self.metas[(t.atom, t.state)]
            n = box_numel(t.atom_box) * meta.itemsize
            raw = incoming[t.peer][offsets[t.peer] : offsets[t.peer] + n]
            offsets[t.peer] += _aligned(n)
            values = raw.view(dtypes.torch_dtype(meta.dtype)).view(box_shape(t.atom_box))
            fragments.setdefault((t.atom, t.state), []).append((t.atom_box, values))
        return fragments

    def _chunk_values(
        self, key: AtomKey, box: Box, fragments: dict[AtomKey, list[tuple[Box, torch.Tensor]]]
    ) -> torch.Tensor:
        """A chunk's values: a view when one piece holds it, else assembled from pieces and received fragments (on
        the device of this rank's pieces, where they are on one)."""
        sources = [*self.owned.get(key, []), *fragments.get(key, [])]
        for src_box, view in sources:
            if intersect(src_box, box) == box:
                return view[to_slices(relative(box, src_box))]
        out = torch.empty(box_shape(box), dtype=sources[0][1].dtype, device=sources[0][1].device)
        for src_box, view in sources:
            part = intersect(src_box, box)
            if part is not None:
                out[to_slices(relative(part, box))] = view[to_slices(relative(part, src_box))]
        return out

    def chunk_nbytes(self) -> list[int]:
        """The bytes of every chunk this rank writes, in the order of its plan's chunks."""
        return [box_numel(box) * self.metas[(atom, state)].itemsize for atom, state, box in self.transfers.writes]

    def plan(
        self,
        incoming: dict[int, torch.Tensor],
        session: SaveSession,
        manifest: StepManifest | None = None,
        *,
        commit: bool = True,
    ) -> SavePlan:
        """This rank's writes in `session`: its share of the atom metadata and every chunk it writes, whole."""
        fragments = self._received_fragments(incoming)
        chunks = []
        for atom, state, box in self.transfers.writes:
            meta = self.metas[(atom, state)]
            index = tuple(a // c for (a, _), c in zip(box, meta.chunk_shape))
            chunks.append(ChunkJob(meta, index, functools.partial(self._chunk_values, (atom, state), box, fragments)))
        metadata = list(self.metas.values())[self.rank :: self.model.layout.world_size]
        return SavePlan(session, metadata, [], chunks, manifest, commit, self.options.chunking.pack_bytes)


def extra_atoms(
    extra: dict[str, Any] | None, chunking: ChunkingPolicy
) -> tuple[dict[str, Any], list[AtomMeta], list[ChunkJob]]:
    """The extra state's tree, atoms and chunks (its tensors are small: copied to host memory here)."""
    extra_tree, extra_tensors = tree.flatten({"extra": extra}) if extra else ({"dict": {}}, {})
    extra_tensors = {p: t.detach().to("cpu").contiguous() for p, t in extra_tensors.items()}
    extra_metas = plan_atoms(extra_tensors, chunking)
    return extra_tree, extra_metas, chunk_jobs(extra_metas, extra_tensors)


def manifest_for(
    model: ShardedModel, metas: Mapping[AtomKey, AtomMeta], extra: dict[str, Any], step: int, chunking: ChunkingPolicy
) -> tuple[StepManifest, list[ChunkJob]]:
    """The step manifest (canonical atoms, model config, the caller's extra state), and the chunks of the
    extra state's tensors (small, replicated: rank 0 writes them)."""
    extra_tree, extra_metas, extra_chunks = extra_atoms(extra, chunking)
    model_tree: dict[str, Any] = {}
    states: dict[str, Any] = {}
    for (atom, state), meta in metas.items():
        if state is None:
            model_tree[atom] = {"atom": meta.path}
        else:
            states.setdefault(atom, {"dict": {}})["dict"][state] = {"atom": meta.path}
    root = {
        "model": {"dict": model_tree},
        **({"optimizer": {"dict": {"state": {"dict": states}}}} if states else {}),
        "model_config": {"value": {"family": family_for(model.config).name, **model.config.to_json()}},
        "optim_states": {"value": list(model.optim_states)},
        **extra_tree["dict"],
    }
    manifest = StepManifest(
        step=step,
        tree={"dict": root},
        atoms={m.path: m for m in [*metas.values(), *extra_metas]},
        layout=str(model.layout),
        created_at=datetime.now(UTC).isoformat(timespec="seconds"),
        writer=f"ucp {__version__}",
    )
    return manifest, extra_chunks


@dataclass(frozen=True)
class Planned:
    """One rank to the coordinator once it has planned its part of a save: the dtypes its tensors have
    (`RankSaver.dtypes`). Each rank chunks every atom and sizes the fragments it exchanges by its own, so the ranks
    must agree on them: a rank that held its parameters in bf16 where rank 0 held fp32 wrote chunks of another size
    than the manifest says, and the step committed could not be loaded."""

    dtypes: tuple[tuple[str | None, str], ...]

    @classmethod
    def of(cls, saver: RankSaver) -> Planned:
        return cls(tuple(sorted(saver.dtypes.items(), key=lambda kv: (kv[0] is not None, kv[0] or ""))))

    def to_json(self) -> list:
        return [list(pair) for pair in self.dtypes]

    @classmethod
    def from_json(cls, doc: Any) -> Planned:
        return cls(tuple((None if k is None else str(k), str(v)) for k, v in doc))


@dataclass(frozen=True)
class Agreed:
    """The coordinator to every rank: every rank's plan agrees (`Planned`)."""

    def to_json(self) -> dict:
        return {}

    @classmethod
    def from_json(cls, doc: Any) -> Agreed:
        return cls()


def _agreed(session: SaveSession, ranks: list[Planned]) -> Agreed:
    """Every rank holds its tensors in the dtypes the first rank holding them does, or a StateError naming the first
    rank that does not. (A rank may hold none of a kind: a stage whose weights all have dtypes of their own, fp8 with
    their scales, says no parameter dtype.)"""
    first: dict[str | None, tuple[int, str]] = {}  # kind -> (the first rank holding it, its dtype there)
    for rank, planned in enumerate(ranks):
        what = []
        for kind, dtype in planned.dtypes:
            seen = first.setdefault(kind, (rank, dtype))
            if seen[1] != dtype:
                what.append((kind, dtype, *seen))
        if what:
            said = "; ".join(f"{k or 'parameters'}: {d} on rank {rank}, {d0} on rank {r0}" for k, d, r0, d0 in what)
            raise StateError(
                f"step {session.step} was not saved at {session.storage.url}: the ranks hold their tensors in other "
                f"dtypes ({said}); every rank must save the same dtypes"
            )
    return Agreed()


def _add_rank0_writes(plan: SavePlan, manifest: StepManifest, extra_chunks: list[ChunkJob]) -> None:
    """Rank 0 also writes the group metadata and the extra state's atoms."""
    plan.metadata += list({id(job.meta): job.meta for job in extra_chunks}.values())
    plan.groups = group_paths(manifest.atoms.values())
    plan.chunks += extra_chunks


def plan_sharded_save(
    local_state: Mapping[str, Any],
    storage: Storage,
    *,
    step: int,
    model: ShardedModel,
    comm: Comm,
    extra: dict[str, Any] | None = None,
    options: SaveOptions | None = None,
) -> SavePlan:
    """This rank's plan of a distributed save. Every rank calls it together: it starts the save attempt (rank 0
    creates it, every rank learns it) and exchanges the fragments of the chunks that ZeRO ranges cut. When the
    plan's writes are durable, its session gathers what every rank wrote and rank 0 commits (`ucp.protocol.session`)."""
    options = options or SaveOptions()
    session = SaveSession.begin(storage, step, comm)
    saver: RankSaver | None = None
    rank0: tuple[StepManifest, list[ChunkJob]] | None = None  # (the manifest and the extra state's chunks)

    def planned() -> Planned:
        nonlocal saver, rank0
        saver = RankSaver(local_state, model, comm.rank, options)
        if comm.rank == 0:  # (here: an extra state it refuses must fail every rank, not rank 0 alone)
            rank0 = manifest_for(model, saver.metas, extra or {}, step, options.chunking)
        return Planned.of(saver)

    # A rank whose part cannot be planned (a local state that lacks a tensor, or holds one of another shape or
    # dtype) fails the save on every rank here, before the exchange, and the attempt is removed: raised on that
    # rank alone, it left the others waiting for it until the process group's timeout.
    session.agree(planned, functools.partial(_agreed, session), Planned, Agreed)
    assert saver is not None
    incoming = comm.exchange(saver.outgoing(), saver.incoming_sizes())
    if rank0 is None:
        return saver.plan(incoming, session)
    manifest, extra_chunks = rank0
    plan = saver.plan(incoming, session, manifest)
    _add_rank0_writes(plan, manifest, extra_chunks)
    return plan


def save_sharded(
    local_state: Mapping[str, Any],
    url: str,
    *,
    step: int,
    model: ShardedModel,
    comm: Comm,
    extra: dict[str, Any] | None = None,
    storage_options: dict[str, Any] | None = None,
    options: SaveOptions | None = None,
    storage: Storage | None = None,
) -> CommitRecord | None:
    """Save this rank's local state (docs/LOCAL_STATE.md) as part of a universal checkpoint; every rank calls it.

    Each chunk object has exactly one writer and is written whole; replicated atoms are written once, by
    replicas chosen round-robin; `extra` (scheduler, data position, ...: JSON and small tensors) is taken from
    rank 0. Returns after rank 0 has committed the step (the commit record on rank 0, None elsewhere).
    """
    options = options or SaveOptions()
    storage = storage or open_storage(url, storage_options, fsync=options.fsync)
    plan = plan_sharded_save(local_state, storage, step=step, model=model, comm=comm, extra=extra, options=options)
    staging = one_shot_staging([c.meta for c in plan.chunks])  # (a sync save stages only what is on a device)
    pipeline = SavePipeline(io_threads_for(options, storage), staging, writer="threads")
    try:
        return pipeline.submit(plan, "sync").result()
    finally:
        pipeline.close()


class VirtualWorld:
    """Every rank of a layout in one process (tests, offline tools, benchmarks): the ranks' plans run one
    after another, then the commit."""

    def __init__(self, world_size: int):
        self.world_size = world_size

    def save(
        self,
        local_states: list[Mapping[str, Any]],
        url: str,
        *,
        step: int,
        model: ShardedModel,
        extra: dict[str, Any] | None = None,
        storage: Storage | None = None,
        options: SaveOptions | None = None,
        storage_options: dict[str, Any] | None = None,
    ) -> CommitRecord:
        options = options or SaveOptions()
        storage = storage or open_storage(url, storage_options, fsync=options.fsync)
        savers = [RankSaver(s, model, r, options) for r, s in enumerate(local_states)]
        outgoing = [s.outgoing() for s in savers]
        manifest, extra_chunks = manifest_for(model, savers[0].metas, extra or {}, step, options.chunking)
        staging = one_shot_staging(list(savers[0].metas.values()))
        pipeline = SavePipeline(io_threads_for(options, storage), staging, writer="threads")
        try:
            with SaveSession.begin(storage, step) as session:  # one attempt for all ranks, removed if any fails
                _agreed(session, [Planned.of(saver) for saver in savers])
                for rank, saver in enumerate(savers):
                    plan = saver.plan(
                        {peer: out[rank] for peer, out in enumerate(outgoing) if rank in out}, session, commit=False
                    )
                    if rank == 0:
                        _add_rank0_writes(plan, manifest, extra_chunks)
                    pipeline.submit(plan, "sync")
                record = session.finish(manifest)
        finally:
            pipeline.close()
        assert record is not None
        return record
