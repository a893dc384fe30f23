"""Distributed save and load: every rank writes the chunks it owns and reads only what its layout needs.

Planning is local: each rank derives what it writes and reads from (model config, layout, rank) alone
(`ucp.reshard`), so no rank gathers another's plan. Coordination is the attempt id (broadcast), one fragment
exchange (only where ZeRO ranges cut a chunk), and the end of the save attempt (`ucp.session`): the size and
checksum of every object written go to rank 0, which commits once every rank's data is durable.

Collectives go through a small `Comm` interface (`ucp.comm`): `TorchComm` runs over torch.distributed (gloo;
checkpoint traffic is host memory even when training runs on NCCL); `VirtualWorld` runs every rank of a layout
in one process (for tests, offline tools and benchmarks).
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import functools
import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from functools import lru_cache
from typing import Any

import torch

from . import __version__, dtypes, tree
from .boxes import Box, box_numel, box_shape, intersect, relative, to_slices
from .checkpoint import (
    CheckpointReader,
    SaveOptions,
    checked,
    chunk_jobs,
    group_paths,
    io_threads_for,
    plan_atoms,
)
from .chunking import ChunkingPolicy, choose_chunks
from .comm import Comm, LocalComm, TorchComm  # noqa: F401 -- LocalComm, TorchComm: re-exported for callers
from .commit import CommitRecord
from .errors import FormatError, LayoutError, StateError
from .families import FAMILIES, canonical_atoms, family_for
from .format import AtomMeta, StepManifest
from .layout import Layout, parse_layout
from .partition import PartitionSpec, tp_shard
from .pipeline import ChunkJob, SavePipeline, SavePlan
from .reshard import DEFAULT_STATES, LocalTensor, Piece, Transfer, chunk_write_plan, local_plan, owned_pieces, put_local
from .session import SaveSession
from .storage import Storage, open_storage
from .workpool import run_tasks


@dataclass(frozen=True)
class ShardedModel:
    """What a distributed save or load needs to know about the model: its family config, the parallel layout,
    and the names of the per-parameter optimizer states (empty: parameters only)."""

    config: Any
    layout: Layout
    optim_states: tuple[str, ...] = DEFAULT_STATES

    def __post_init__(self) -> None:
        if isinstance(self.layout, str):
            object.__setattr__(self, "layout", parse_layout(self.layout))
        if not isinstance(self.layout, Layout):
            raise LayoutError(
                f"ShardedModel needs a ucp.layout.Layout or a layout string, got {type(self.layout).__name__}"
            )
        object.__setattr__(self, "optim_states", tuple(self.optim_states))


AtomKey = tuple[str, "str | None"]  # (canonical atom name, optimizer state name or None for the parameter)


def atom_path(atom: str, state: str | None) -> str:
    """Where an atom lives in the checkpoint: parameters under model/, states under optimizer/state/."""
    return f"model/{atom}" if state is None else f"optimizer/state/{atom}/{state}"


def _tp_periods(spec: PartitionSpec, shape: tuple[int, ...], tp: int) -> list[int | None]:
    """Per dimension, the spacing of the boundaries between TP ranks' parts of an atom (None: no boundary)."""
    cuts: list[set[int]] = [set() for _ in shape]
    for t in range(tp):
        for _, atom_box in tp_shard(spec, shape, tp, t).pieces:
            for d, (a, b) in enumerate(atom_box):
                cuts[d].update(c for c in (a, b) if 0 < c < shape[d])
    return [math.gcd(*c) if c else None for c in cuts]


@lru_cache(maxsize=8)
def _atom_metas_cached(
    family: str, config_json: str, tp: int, optim_states: tuple[str, ...], dtype_items: tuple, policy: ChunkingPolicy
) -> dict[AtomKey, AtomMeta]:
    config = FAMILIES[family].config_cls.from_json(json.loads(config_json))
    dtype_of = dict(dtype_items)
    metas: dict[AtomKey, AtomMeta] = {}
    for name, (shape, spec) in canonical_atoms(config).items():
        periods = _tp_periods(spec, shape, tp)
        split = next((d for d, p in enumerate(periods) if p), None)
        for state in (None, *optim_states):
            dtype = dtype_of[state]
            chunk, inner = choose_chunks(shape, dtypes.itemsize(dtype), policy, periods, split)
            attrs: dict[str, Any] = {"role": "param" if state is None else "optimizer_state"}
            if state is not None:
                attrs.update(state=state, param=name)
            attrs.update(partition=spec.to_json(), family=family)
            metas[(name, state)] = checked(AtomMeta(atom_path(name, state), shape, dtype, chunk, inner, attrs))
    return metas


def atom_metas(
    model: ShardedModel, dtype_of: Mapping[str | None, str], policy: ChunkingPolicy
) -> dict[AtomKey, AtomMeta]:
    """Every atom of a distributed checkpoint, chunked so that chunk boundaries fall on TP boundaries of the
    writing layout; identical on every rank (a pure function), so no rank needs another's description."""
    config_json = json.dumps(model.config.to_json(), sort_keys=True)
    dtype_items = tuple(sorted(dtype_of.items(), key=lambda kv: kv[0] or ""))
    return _atom_metas_cached(
        family_for(model.config).name, config_json, model.layout.tp, model.optim_states, dtype_items, policy
    )


def local_tensor(local_state: Mapping[str, Any], key: tuple[str, ...]) -> torch.Tensor:
    """The tensor at a LocalTensor key of a rank's local state (docs/LOCAL_STATE.md), or a StateError naming it."""
    node: Any = local_state
    for k in key:
        if not isinstance(node, Mapping) or k not in node:
            raise StateError(f"the local state has no {'/'.join(key)} (docs/LOCAL_STATE.md lists what a rank holds)")
        node = node[k]
    if not isinstance(node, torch.Tensor):
        raise StateError(f"the local state's {'/'.join(key)} is a {type(node).__name__}, not a tensor")
    return node


def piece_view(tensor: torch.Tensor, piece: Piece) -> torch.Tensor:
    """The part of a local tensor that holds `piece`, shaped like its atom box (a view, never a copy)."""
    if piece.flat_offset is None:
        return tensor[to_slices(piece.box)]
    return tensor[piece.flat_offset : piece.flat_offset + piece.numel].view(box_shape(piece.atom_box))


def _local_dtypes(local_state: Mapping[str, Any], plan: list[LocalTensor]) -> dict[str | None, str]:
    """The dtype of the parameters and of each optimizer state, as this rank holds them."""
    out: dict[str | None, str] = {}
    for lt in plan:
        if lt.state not in out:
            out[lt.state] = dtypes.zarr_name(local_tensor(local_state, lt.key).dtype)
    return out


# ----------------------------------------------------------------------------------------------- comm
# (Comm, TorchComm and LocalComm live in ucp.comm; imported above, so ucp.distributed.TorchComm keeps working)


def _as_uint8(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


# ----------------------------------------------------------------------------------------------- save


class RankSaver:
    """One rank's part of a distributed save: what it sends, what it writes."""

    def __init__(self, local_state: Mapping[str, Any], model: ShardedModel, rank: int, options: SaveOptions):
        self.model, self.rank, self.options = model, rank, options
        plan = local_plan(model.config, model.layout, rank, model.optim_states)
        self.metas = atom_metas(model, _local_dtypes(local_state, plan), options.chunking)
        # (atom, state) -> [(atom box, view of the local data holding it)] for the pieces this rank writes
        self.owned: dict[AtomKey, list[tuple[Box, torch.Tensor]]] = {}
        for lt in owned_pieces(model.config, model.layout, rank, model.optim_states):
            tensor = local_tensor(local_state, lt.key).detach().to("cpu")
            for p in lt.pieces:
                self.owned.setdefault((p.atom, lt.state), []).append((p.atom_box, piece_view(tensor, p)))
        self.transfers = chunk_write_plan(
            model.config, model.layout, rank, lambda a, _s: self.metas[(a, None)].chunk_shape, model.optim_states
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
            buffers.setdefault(t.peer, []).append(_as_uint8(self._region((t.atom, t.state), t.atom_box)))
        return {peer: torch.cat(parts) for peer, parts in buffers.items()}

    def incoming_sizes(self) -> dict[int, int]:
        sizes: dict[int, int] = {}
        for t in self.transfers.recvs:
            sizes[t.peer] = sizes.get(t.peer, 0) + box_numel(t.atom_box) * self.metas[(t.atom, t.state)].itemsize
        return sizes

    def _received_fragments(self, incoming: dict[int, torch.Tensor]) -> dict[AtomKey, list[tuple[Box, torch.Tensor]]]:
        fragments: dict[AtomKey, list[tuple[Box, torch.Tensor]]] = {}
        offsets = dict.fromkeys(incoming, 0)
        for t in self._order(self.transfers.recvs):
            meta = self.metas[(t.atom, t.state)]
            n = box_numel(t.atom_box) * meta.itemsize
            raw = incoming[t.peer][offsets[t.peer] : offsets[t.peer] + n]
            offsets[t.peer] += n
            values = raw.view(dtypes.torch_dtype(meta.dtype)).view(box_shape(t.atom_box))
            fragments.setdefault((t.atom, t.state), []).append((t.atom_box, values))
        return fragments

    def _chunk_values(
        self, key: AtomKey, box: Box, fragments: dict[AtomKey, list[tuple[Box, torch.Tensor]]]
    ) -> torch.Tensor:
        """A chunk's values: a view when one piece holds it, else assembled from pieces and received fragments."""
        sources = [*self.owned.get(key, []), *fragments.get(key, [])]
        for src_box, view in sources:
            if intersect(src_box, box) == box:
                return view[to_slices(relative(box, src_box))]
        out = torch.empty(box_shape(box), dtype=sources[0][1].dtype)
        for src_box, view in sources:
            part = intersect(src_box, box)
            if part is not None:
                out[to_slices(relative(part, box))] = view[to_slices(relative(part, src_box))]
        return out

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
        return SavePlan(session, metadata, [], chunks, manifest, commit)


def manifest_for(
    model: ShardedModel, metas: Mapping[AtomKey, AtomMeta], extra: dict[str, Any], step: int, chunking: ChunkingPolicy
) -> tuple[StepManifest, list[ChunkJob]]:
    """The step manifest (canonical atoms, model config, the caller's extra state), and the chunks of the
    extra state's tensors (small, replicated: rank 0 writes them)."""
    extra_tree, extra_tensors = tree.flatten({"extra": extra}) if extra else ({"dict": {}}, {})
    extra_tensors = {p: t.detach().to("cpu").contiguous() for p, t in extra_tensors.items()}
    extra_metas = plan_atoms(extra_tensors, chunking)
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
    return manifest, chunk_jobs(extra_metas, extra_tensors)


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
    plan's writes are durable, its session gathers what every rank wrote and rank 0 commits (`ucp.session`)."""
    options = options or SaveOptions()
    session = SaveSession.begin(storage, step, comm)
    saver = RankSaver(local_state, model, comm.rank, options)
    incoming = comm.exchange(saver.outgoing(), saver.incoming_sizes())
    if comm.rank != 0:
        return saver.plan(incoming, session)
    manifest, extra_chunks = manifest_for(model, saver.metas, extra or {}, step, options.chunking)
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
    pipeline = SavePipeline(io_threads_for(options, storage))
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
        pipeline = SavePipeline(io_threads_for(options, storage))
        try:
            with SaveSession.begin(storage, step) as session:  # one attempt for all ranks, removed if any fails
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


# ----------------------------------------------------------------------------------------------- load


@dataclass
class LoadReport:
    """What one rank read: bytes its tensors needed, and chunk bytes read from storage (amplification = ratio)."""

    bytes_needed: int
    bytes_read: int

    @property
    def amplification(self) -> float:
        return self.bytes_read / self.bytes_needed if self.bytes_needed else 1.0


def model_config_of(reader: CheckpointReader) -> Any:
    """The model family config a distributed checkpoint was written with."""

    try:
        doc = dict(reader.manifest.tree["dict"]["model_config"]["value"])
        family = FAMILIES[doc.pop("family")]
    except (KeyError, TypeError):
        raise FormatError(
            f"step {reader.step} at {reader.storage.url} carries no model_config (not written by a distributed save)"
        ) from None
    return family.config_cls.from_json(doc)


def check_atom(meta: AtomMeta, shape: tuple[int, ...]) -> None:
    """The stored atom has the shape the model config gives it."""
    if meta.shape != shape:
        raise FormatError(
            f"atom {meta.path!r} has shape {list(meta.shape)} in the checkpoint, but the model config needs {list(shape)}"
        )


def load_sharded(
    reader: CheckpointReader, model: ShardedModel, rank: int, *, dtype: torch.dtype | None = None
) -> tuple[dict[str, Any], LoadReport]:
    """The local state of `rank` in `model.layout`, read straight from the atoms: only the regions this rank
    needs, many reads in flight, every inner chunk verified. Parameters are cast to `dtype` when given."""
    plan = local_plan(model.config, model.layout, rank, model.optim_states)
    shapes = canonical_atoms(model.config)
    local: dict[str, Any] = {}
    jobs: list[Callable[[], None]] = []
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
        stored = dtypes.torch_dtype(metas[0].dtype) if metas else torch.float32
        covered = sum(p.numel for p in lt.pieces) == math.prod(lt.shape)
        tensor = torch.empty(lt.shape, dtype=stored) if covered else torch.zeros(lt.shape, dtype=stored)  # padding: 0
        put_local(local, lt.key, tensor)
        bytes_needed += sum(p.numel for p in lt.pieces) * tensor.element_size()
        jobs += piece_reads(reader, lt, metas, tensor)
    with cf.ThreadPoolExecutor(reader.io_threads) as pool:
        before = reader.storage.stats.bytes_read
        run_tasks(pool, jobs)
        read = reader.storage.stats.bytes_read - before
    if dtype is not None:
        local = _cast_params(local, plan, dtype)
    return local, LoadReport(bytes_needed, read)


def needed_objects(atoms: Mapping[str, AtomMeta], model: ShardedModel, rank: int) -> set[tuple[str, tuple[int, ...]]]:
    """The chunk objects (atom path, grid index) that `load_sharded` reads for `rank`: a pure function of the
    manifest, the model and the rank, so no rank needs to ask another what it will read."""
    out: set[tuple[str, tuple[int, ...]]] = set()
    for lt in local_plan(model.config, model.layout, rank, model.optim_states):
        for p in lt.pieces:
            meta = atoms.get(atom_path(p.atom, lt.state))
            if meta is not None:
                out.update((meta.path, index) for index in _chunks_touching(meta, p.atom_box))
    return out


def _cast_params(local: dict[str, Any], plan: list[LocalTensor], dtype: torch.dtype) -> dict[str, Any]:
    for lt in plan:
        if lt.state is None:
            put_local(local, lt.key, local_tensor(local, lt.key).to(dtype))
    return local


def _chunks_touching(meta: AtomMeta, box: Box) -> list[tuple[int, ...]]:
    ranges = [range(a // c, (b - 1) // c + 1) if b > a else range(0) for (a, b), c in zip(box, meta.chunk_shape)]
    out: list[tuple[int, ...]] = [()]
    for r in ranges:
        out = [(*prefix, i) for prefix in out for i in r]
    return out


def piece_reads(
    reader: CheckpointReader, lt: LocalTensor, metas: Sequence[AtomMeta], tensor: torch.Tensor
) -> list[Callable[[], None]]:
    """The reads that fill `tensor` (local tensor `lt`, in the atoms' stored dtype) from the chunks its pieces
    overlap; `metas` are the pieces' atoms. Each read is one stored object; run them in any order, at once."""
    reads: list[Callable[[], None]] = []
    for p, meta in zip(lt.pieces, metas):
        view = piece_view(tensor, p)
        reads += [
            functools.partial(_read_region, reader, meta, i, p.atom_box, view)
            for i in _chunks_touching(meta, p.atom_box)
        ]
    return reads


def _read_region(
    reader: CheckpointReader, meta: AtomMeta, index: tuple[int, ...], box: Box, view: torch.Tensor
) -> None:
    """Read the part of chunk object `index` that falls in `box` of the atom into `view` (shaped like `box`)."""

    def dest_for(chunk_box: Box) -> tuple[torch.Tensor, tuple[int, ...]] | None:
        part = intersect(chunk_box, box)
        if part is None:
            return None
        return view[to_slices(relative(part, box))], tuple(a - c for (a, _), (c, _) in zip(part, chunk_box))

    reader.read_object(meta, index, dest_for)


def extra_state(reader: CheckpointReader) -> dict[str, Any]:
    """The `extra` state a distributed save stored (JSON, and tensors read whole)."""
    node = reader.manifest.tree["dict"].get("extra")
    if node is None:
        return {}
    paths = tree.tree_atoms(node)
    return tree.unflatten({"dict": {"extra": node}}, reader.read_atoms(paths))["extra"]


def with_layout(model: ShardedModel, layout: Layout) -> ShardedModel:
    return dataclasses.replace(model, layout=layout)
