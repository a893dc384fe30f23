"""Save and load one step: plan the atoms, move the chunks (many in flight), commit, verify on read.

Planning (which atoms, how they are chunked) is separate from storage (how bytes move, `ucp.storage`); a save
runs as one attempt of the protocol in `ucp.protocol.session`, the commit lives in `ucp.protocol.commit`, the on-disk documents in
`ucp.format.manifest`.
"""

from __future__ import annotations

import concurrent.futures as cf
import functools
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import torch

from ..base import dtypes
from ..base.boxes import Box, full_box, intersect, relative, to_slices
from ..base.chunking import ChunkingPolicy, choose_chunks
from ..base.devices import load_device, on_host
from ..base.heap import collector_paused
from ..base.workpool import ObjectCall, run_sized
from ..errors import (
    CheckpointNotFoundError,
    FormatError,
    ObjectMissingError,
    StateError,
    StepRemovedError,
    UcpError,
)
from ..format import tree
from ..format.index import IndexedManifest
from ..format.index import parse as parse_manifest
from ..format.manifest import (
    MAX_DOCUMENT_BYTES,
    PACKS_GROUP,
    ZARR_JSON,
    AtomMeta,
    ObjectSum,
    PackedChunk,
    StepManifest,
    check_step,
    chunk_indices,
    is_attempt_dirname,
    loads,
    parse_step_dirname,
)
from ..format.packs import pack_object_key
from ..protocol import codec, commit
from ..protocol.session import SaveSession
from ..storage import ReadableStorage, Storage, open_storage
from ..version import __version__
from .landing import Landing, open_landing
from .pipeline import ChunkJob, SavePipeline, SavePlan, one_shot_staging


@dataclass(frozen=True)
class SaveOptions:
    chunking: ChunkingPolicy = field(default_factory=ChunkingPolicy)
    io_threads: int | None = None  # requests in flight; None: the storage's default (16 local, 2/core tmpfs, 64 S3)
    fsync: bool = True  # local files: fsync every object and new directory before the commit

    def __post_init__(self) -> None:
        threads = self.io_threads
        if threads is not None and (not isinstance(threads, int) or isinstance(threads, bool) or threads < 1):
            raise ValueError(
                f"SaveOptions.io_threads must be at least 1 (or None: the storage's default), got {threads!r}"
            )


def io_threads_for(options: SaveOptions, storage: Storage) -> int:
    return options.io_threads or storage.capabilities.io_threads


def default_role(path: str) -> str:
    """The role an atom plays, from the conventional top-level keys (docs/FORMAT.md)."""
    if path.startswith("model/"):
        return "param"
    if path.startswith("optimizer/"):
        return "optimizer_state"
    if path.startswith("rng/"):
        return "rng"
    return "tensor"


def _values(t: torch.Tensor) -> torch.Tensor:
    """A tensor's values as a save reads them: without autograd history, contiguous in host memory (a tensor on a
    device is copied to staging memory whatever its strides: no copy of it is made here)."""
    if t.requires_grad:
        t = t.detach()
    return t.contiguous() if t.is_cpu else t


def plan_atoms(
    tensors: Mapping[str, torch.Tensor],
    policy: ChunkingPolicy,
    attributes: Mapping[str, Mapping[str, Any]] | None = None,
) -> list[AtomMeta]:
    """Describe every tensor as an atom; raises StateError for unsupported dtypes before anything is written."""
    metas = []
    for path, t in tensors.items():
        extra = (attributes or {}).get(path)
        shape = tuple(t.shape)
        metas.append(
            _describe(path, shape, t.dtype, policy, extra) if extra else _described(path, shape, t.dtype, policy)
        )
    return metas


def _describe(
    path: str, shape: tuple[int, ...], dtype: torch.dtype, policy: ChunkingPolicy, extra: Mapping[str, Any]
) -> AtomMeta:
    packed = policy.packs(math.prod(shape) * dtype.itemsize)
    chunk_shape, inner = choose_chunks(shape, dtype.itemsize, policy, packed=packed)
    attrs = {"role": default_role(path), **dict(extra)}
    return checked(AtomMeta(path, shape, dtypes.zarr_name(dtype), chunk_shape, inner, attrs, packed=packed))


@functools.lru_cache(maxsize=1 << 17)
def _described(path: str, shape: tuple[int, ...], dtype: torch.dtype, policy: ChunkingPolicy) -> AtomMeta:
    """An atom with only its role for attributes, described once per process: a job saves the same atoms every
    time, and describing and checking 20,000 small ones took ~0.4 s of each save's blocking time. (AtomMeta is
    frozen and nothing changes its attributes after planning, so one object serves every save.)"""
    return _describe(path, shape, dtype, policy, {})


def checked(meta: AtomMeta) -> AtomMeta:
    """An atom to write, within the bounds that every reader holds metadata to (refused before any write)."""
    try:
        meta.validate()
    except FormatError as e:
        raise StateError(f"cannot save {e} (the format's bounds, docs/FORMAT.md section 8)") from None
    return meta


# ------------------------------------------------------------------------------------------------ write


def next_step(storage: Storage) -> int:
    steps = commit.committed_steps(storage)
    return steps[-1] + 1 if steps else 0


def chunk_jobs(metas: Iterable[AtomMeta], tensors: Mapping[str, torch.Tensor]) -> list[ChunkJob]:
    """Every chunk object of atoms held whole in `tensors` (keyed by atom path)."""
    jobs = []
    for m in metas:
        tensor = tensors[m.path]
        if m.single_chunk:  # (most atoms of a state of many small ones: the chunk is the tensor)
            jobs.append(ChunkJob(m, (0,) * len(m.shape), functools.partial(_whole, tensor)))
        else:
            jobs += [ChunkJob(m, i, functools.partial(tensor.__getitem__, s)) for i, s in m.chunk_slices]
    return jobs


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def group_paths(metas: Iterable[AtomMeta]) -> list[str]:
    """The groups a Zarr reader walks to reach every Zarr array of a step, parents first: every intermediate group
    (dict level) above an atom that is an array of its own, and the packs' group if any atom is packed. A level
    that holds only packed atoms is no Zarr node (its atoms are found through the manifest)."""
    paths, packed = [], False
    for m in metas:
        if m.packed:
            packed = True
        else:
            paths.append(m.path)
    if packed:
        paths.append(f"{PACKS_GROUP}/pack")  # (a pack's name is one level below the group)
    groups = {"/".join(p.split("/")[:i]) for p in paths for i in range(1, p.count("/") + 1)}
    return sorted(groups, key=lambda g: (g.count("/"), g))


@collector_paused()
def plan_save(
    state: dict[str, Any],
    storage: Storage,
    step: int | None,
    options: SaveOptions,
    *,
    layout: str | None = None,
    atom_attributes: Mapping[str, Mapping[str, Any]] | None = None,
) -> SavePlan:
    """The plan of a single-process save: every atom and chunk, then the commit. Bad states are refused here,
    before anything is written."""
    json_tree, tensors = tree.flatten(state)
    tensors = {p: _values(t) for p, t in tensors.items()}
    metas = plan_atoms(tensors, options.chunking, atom_attributes)
    step = next_step(storage) if step is None else check_step(step)
    manifest = StepManifest(
        step=step,
        tree=json_tree,
        atoms={m.path: m for m in metas},
        layout=layout,
        created_at=datetime.now(UTC).isoformat(timespec="seconds"),
        writer=f"ucp {__version__}",
    )
    jobs = chunk_jobs(metas, tensors)
    session = SaveSession.begin(storage, step)
    return SavePlan(session, metas, group_paths(metas), jobs, manifest, pack_bytes=options.chunking.pack_bytes)


@collector_paused()
def save(
    state: dict[str, Any],
    url: str,
    *,
    step: int | None = None,
    storage_options: dict[str, Any] | None = None,
    layout: str | None = None,
    options: SaveOptions | None = None,
    atom_attributes: Mapping[str, Mapping[str, Any]] | None = None,
    storage: Storage | None = None,
) -> commit.CommitRecord:
    """Save `state` (nested dict of tensors and JSON values) as step `step` of the checkpoint root `url`.

    `step=None` takes the step after the latest committed one (0 for an empty root). The step becomes
    visible only when its commit marker is created, after all its data is durable; if another save commits
    the same step first, this one raises StepExistsError and removes what it wrote.
    """
    options = options or SaveOptions()
    storage = storage or open_storage(url, storage_options, fsync=options.fsync)
    plan = plan_save(state, storage, step, options, layout=layout, atom_attributes=atom_attributes)
    # (a sync save needs no writer process; it stages only what is on a device)
    pipeline = SavePipeline(io_threads_for(options, storage), one_shot_staging(plan.metadata), writer="threads")
    try:
        record = pipeline.submit(plan, "sync").result()
    finally:
        pipeline.close()
    assert record is not None
    return record


# ------------------------------------------------------------------------------------------------- read


def removed_or(storage: ReadableStorage, record: commit.CommitRecord, missing: ObjectMissingError) -> UcpError:
    """What an object of the committed step `record` missing from `storage` means: the step was removed meanwhile
    (retention, `delete`) if its commit marker no longer names this attempt, else damage (`missing` itself). A reader
    of a step that is being deleted is told so, not that its checkpoint is damaged."""
    if record.attempt is not None:  # (a format 1.0 step has no attempt to tell apart)
        try:
            now = commit.read_marker(storage, record.step)
        except UcpError:
            now = None
        if now is None or now.attempt != record.attempt:
            return StepRemovedError(
                f"step {record.step} at {storage.url} was removed while it was being read ({missing})"
            )
    elif not storage.exists(commit.marker_key(record.step)):
        return StepRemovedError(f"step {record.step} at {storage.url} was removed while it was being read")
    return missing


@dataclass(frozen=True)
class _IndexObjects:
    """Reads the index objects of a format 3.1 step for its manifest (those given, from the hot tier's peers, first).
    The manifest holds this, not its reader: a bound method of the reader there made the two a reference cycle, which
    kept a reader, its manifest and its storage alive after their last user dropped them, until the cyclic GC ran."""

    storage: ReadableStorage
    record: commit.CommitRecord
    given: Mapping[str, bytes]

    def __call__(self, name: str, size: int) -> bytes:
        given = self.given.get(name)
        if given is not None:
            return given
        key = f"{self.record.prefix}/{name}"
        try:
            return bytes(self.storage.read(key, 0, size + 1))
        except FileNotFoundError:
            missing = ObjectMissingError(
                f"{self.storage.url}/{key} (an index part of step {self.record.step}) is missing"
            )
            raise removed_or(self.storage, self.record, missing) from None


class CheckpointReader:
    """One committed step, opened for reading: its manifest, and verified reads of its atoms."""

    @collector_paused()
    def __init__(
        self,
        storage: ReadableStorage,
        step: int | str | None = "latest",
        *,
        io_threads: int | None = None,
        committed: tuple[commit.CommitRecord, bytes]
        | tuple[commit.CommitRecord, bytes, Mapping[str, bytes]]
        | None = None,
    ):
        """`committed`: the step's commit record and manifest bytes (and, in format 3.1, its index parts by name below
        the attempt), when they came from elsewhere than `storage` (the hot tier's peers); they are checked against each
        other as when read. Index parts not given are read from `storage` when an atom of theirs is asked for."""
        self.storage = storage
        if committed is None:
            self.step, self.record = commit.resolve_step(storage, step)
        else:
            self.record = committed[0]
            self.step = self.record.step
        self.prefix = self.record.prefix  # the committed attempt's directory (the step directory in format 1.0)
        where = f"{storage.url}/{self.prefix}/{ZARR_JSON}"
        if committed is None:
            try:
                manifest_bytes = commit.read_manifest_bytes(storage, self.record)
            except ObjectMissingError as e:
                raise self._removed_or(e) from None
        else:
            manifest_bytes = commit.check_manifest_bytes(committed[1], self.record, where)
        self._index = _IndexObjects(
            storage, self.record, committed[2] if committed is not None and len(committed) > 2 else {}
        )
        self.manifest_bytes = len(manifest_bytes)
        self.manifest = parse_manifest(loads(manifest_bytes, where), where, self._index)
        if self.manifest.step != self.step:
            raise FormatError(f"{where} describes step {self.manifest.step}, not {self.step}")
        if self.manifest.format_version.split(".")[0] != self.record.format_version.split(".")[0]:
            raise FormatError(
                f"{where} is format {self.manifest.format_version}, its commit marker {self.record.format_version}"
            )
        if isinstance(self.manifest, IndexedManifest):  # (its atoms and tree are read when asked for)
            count, nbytes = self.manifest.total_atoms, self.manifest.total_bytes
            tree.check_root(self.manifest.tree_at())
        else:
            count, nbytes = len(self.manifest.atoms), sum(m.nbytes for m in self.manifest.atoms.values())
        if (self.record.atoms, self.record.nbytes) != (count, nbytes):
            raise FormatError(
                f"{where} describes {count} atoms of {nbytes} bytes, but its commit recorded "
                f"{self.record.atoms} atoms of {self.record.nbytes} bytes"
            )
        self.io_threads = io_threads or storage.capabilities.reads_in_flight
        self._tree_atoms: list[str] | None = None
        if not isinstance(self.manifest, IndexedManifest):
            self._check_tree()

    @property
    def atoms(self) -> Mapping[str, AtomMeta]:
        """Every atom of the step, by path (in format 3.1 each atom's record is read when first asked for)."""
        return self.manifest.atoms

    @property
    def tree_atoms(self) -> list[str]:
        """Every atom the state tree names, in tree order (checked once: each one is in the manifest)."""
        if self._tree_atoms is None:
            self._check_tree()
        assert self._tree_atoms is not None
        return self._tree_atoms

    def _check_tree(self) -> None:
        where = f"{self.storage.url}/{self.prefix}/{ZARR_JSON}"
        state_tree = self.manifest.tree
        tree.check_root(state_tree)
        paths = tree.tree_atoms(state_tree)
        missing = self.manifest.lacking(paths)
        if missing:
            raise FormatError(f"{where}: the state tree names atoms the manifest lacks: {sorted(missing)[:5]}")
        self._tree_atoms = paths

    def read_index_object(self, name: str, size: int) -> bytes:
        """One of a format 3.1 step's index objects (`name` below the attempt), at most `size` + 1 bytes (the manifest
        checks it against its size and checksum)."""
        return self._index(name, size)

    def index_parts(self) -> dict[str, bytes]:
        """Every index object of a format 3.1 step, by name below the attempt (none before 3.1): what a copy of the
        step needs beside its manifest (the hot tier's)."""
        if not isinstance(self.manifest, IndexedManifest):
            return {}
        return {name: self.read_index_object(name, size) for name, size in self.manifest.index_objects()}

    def _atom_key(self, meta: AtomMeta, name: str) -> str:
        return f"{self.prefix}/{meta.path}/{name}"

    def check_atom_metadata(self, meta: AtomMeta) -> None:
        """The atom's zarr.json must exist and agree with the committed manifest (what other Zarr readers see). A
        packed atom has none; each pack's is checked as a pack's (`ucp.engine.inspection`)."""
        if meta.packed:
            return
        try:
            raw = self.storage.read(self._atom_key(meta, ZARR_JSON), 0, MAX_DOCUMENT_BYTES + 1)
        except FileNotFoundError:
            raise self._removed_or(
                ObjectMissingError(f"atom {meta.path!r} is missing from step {self.step} (no {meta.path}/{ZARR_JSON})")
            ) from None
        meta.check_zarr_json(loads(raw, f"atom {meta.path!r} {ZARR_JSON}", MAX_DOCUMENT_BYTES))

    def object_key(self, meta: AtomMeta, index: tuple[int, ...]) -> str:
        """The storage key of the object that holds chunk `index` of `meta` in this step (of a packed atom: its
        pack's)."""
        if meta.packed:
            return pack_object_key(self.prefix, self.packed_chunk(meta, index).pack)
        return meta.object_key(self.prefix, index)

    def recorded(self, meta: AtomMeta, index: tuple[int, ...]) -> ObjectSum | None:
        """The size and checksum the commit recorded for the object that holds chunk `index` of `meta` (of a packed
        atom: its pack's; None in format 1.0)."""
        if meta.packed:
            return self.manifest.pack_sum(self.packed_chunk(meta, index).pack)
        objects = self.manifest.objects_of(meta.path)
        return None if objects is None else objects[meta.object_number(index)]

    def read_key(self, meta: AtomMeta, index: tuple[int, ...]) -> str:
        """The storage key that a read of chunk `index` of `meta` reads from: its object, or its pack."""
        return (
            pack_object_key(self.prefix, self.packed_chunk(meta, index).pack)
            if meta.packed
            else self.object_key(meta, index)
        )

    def packed_chunk(self, meta: AtomMeta, index: tuple[int, ...]) -> PackedChunk:
        """Where chunk `index` of a packed atom lies (format 3)."""
        return self.manifest.packed_of(meta.path)[meta.object_number(index)]

    def pack_holds(self, name: str) -> str:
        """What pack `name` holds, for an error: its atoms (the first ones by name) and how many (in format 3.1, of
        the index parts read)."""
        atoms = self.manifest.atoms_in_pack(name)
        more = f" and {len(atoms) - 8} more" if len(atoms) > 8 else ""
        return f"pack {name} of step {self.step} holds the atoms {', '.join(map(repr, atoms[:8]))}{more}"

    def read_object(self, meta: AtomMeta, index: tuple[int, ...], dest_for: codec.DestFn) -> None:
        """Read, verify (against the commit's record too) and deliver the wanted parts of one stored object (of a
        packed atom: its chunk's byte range of a pack)."""
        if meta.packed:
            sink = codec.packed_sink(meta, index, dest_for)
            if sink is not None:
                chunk = self.packed_chunk(meta, index)
                self._read_packed(chunk.pack, [codec.PackedRead.of(chunk, sink, meta, index)])
            return
        try:
            codec.read_object(
                self.storage,
                self.object_key(meta, index),
                meta,
                index,
                dest_for,
                self._where(meta, index),
                self.recorded(meta, index),
            )
        except ObjectMissingError as e:
            raise self._removed_or(e) from None

    def _removed_or(self, missing: ObjectMissingError) -> UcpError:
        return removed_or(self.storage, self.record, missing)

    def _where(self, meta: AtomMeta, index: tuple[int, ...]) -> str:
        """What to call a chunk in an error."""
        return f"atom {meta.path!r} chunk {meta.chunk_key(index)} (step {self.step})"

    def _read_packed(self, pack: str, reads: list[codec.PackedRead]) -> None:
        """Read packed chunks of one pack in one request (a run of them), each verified."""
        key = pack_object_key(self.prefix, pack)
        try:
            codec.read_packed(self.storage, key, pack, reads, self.step, functools.partial(self.pack_holds, pack))
        except ObjectMissingError as e:
            raise self._removed_or(e) from None

    def read_chunk_into(self, meta: AtomMeta, index: tuple[int, ...], out: torch.Tensor) -> None:
        """Read, verify and decode one stored object into `out` (the full atom's tensor, in host memory)."""
        self.read_object(meta, index, codec.full_region(out))

    def read_region(
        self, meta: AtomMeta, index: tuple[int, ...], box: Box, view: torch.Tensor, landing: Landing | None = None
    ) -> None:
        """Read the part of chunk object `index` that falls in region `box` of the atom into `view` (shaped like
        `box`): straight into it, or, for a `view` on a device, through `landing` (the load path to a device: read and
        verified in page-locked host memory, then copied asynchronously)."""
        if landing is None:
            assert on_host(view), "a read into a device's memory goes through a Landing"
            self.read_object(meta, index, codec.region(box, view))
            return
        part = intersect(meta.chunk_box(index), box)
        if part is not None:
            target = view[to_slices(relative(part, box))]
            landing.land(target, lambda host: self.read_object(meta, index, codec.region(part, host)))

    def region_read(
        self, meta: AtomMeta, index: tuple[int, ...], box: Box, view: torch.Tensor, landing: Landing | None = None
    ) -> ObjectCall:
        """The read of the part of chunk object `index` that falls in region `box` of an atom into `view`
        (`read_region`), as a call to run with others, with its object's bytes and key. `view` has the atom's dtype:
        the bytes are copied, never converted (a caller with another dtype reads into a buffer and casts)."""
        if view.dtype != dtypes.torch_dtype(meta.dtype):
            raise TypeError(f"atom {meta.path!r} is {meta.dtype}: read into a {view.dtype} tensor it would be garbled")
        if meta.packed and landing is None:  # (merged with the other chunks of its pack read at once: run_reads)
            return ObjectCall(
                PackedRegionRead(self, meta, index, box, view), meta.object_bytes, self.read_key(meta, index)
            )
        return ObjectCall(
            functools.partial(self.read_region, meta, index, box, view, landing),
            meta.object_bytes,
            self.read_key(meta, index),
        )

    def region_reads(
        self, meta: AtomMeta, box: Box, view: torch.Tensor, landing: Landing | None = None
    ) -> list[ObjectCall]:
        """The reads that fill `view` (shaped like `box`, in the atom's stored dtype) with region `box` of an atom, one
        per chunk object it overlaps (`region_read`; `landing` for a `view` on a device); run them in any order, at
        once."""
        return [self.region_read(meta, i, box, view, landing) for i in chunks_touching(meta, box)]

    def read_regions(
        self, regions: Iterable[tuple[AtomMeta, Box, torch.Tensor]], also: Sequence[ObjectCall] = ()
    ) -> int:
        """Fill each view (shaped like its box, in its atom's stored dtype; in host memory, or on a device through a
        `Landing`) with that region of its atom, every read at once, `also` (other object reads) among them; returns
        the bytes read from storage."""
        regions = list(regions)
        off_host = [(meta, view) for meta, _, view in regions if not on_host(view)]
        with open_landing([view for _, view in off_host], [meta for meta, _ in off_host]) as landing:
            reads = list(also)
            for meta, box, view in regions:
                reads += self.region_reads(meta, box, view, None if on_host(view) else landing)
            return self.run_reads(reads)

    def run_reads(self, reads: list[ObjectCall]) -> int:
        """Run object reads, many in flight; returns the bytes read from storage. The reads of packed chunks
        (`PackedRegionRead`) are merged: one request per run of a pack's wanted chunks (`codec.read_packed`), not one
        per chunk."""
        before = self.storage.stats.bytes_read
        with cf.ThreadPoolExecutor(self.io_threads) as pool:
            run_sized(
                pool, self._packs_merged(reads), self.storage.capabilities.serial_small_reads, self.storage.prefetching
            )
        return self.storage.stats.bytes_read - before

    def _packs_merged(self, reads: list[ObjectCall]) -> list[ObjectCall]:
        """`reads` with its `PackedRegionRead`s of each pack merged into one call per run of chunks no more than
        `codec.GAP_READ_BYTES` apart (each such call is one request; runs further apart still go in parallel). A chunk
        wanted twice (two regions of it, for two tensors) starts a new run: a run reads each of its chunks once."""
        merged = [r for r in reads if not isinstance(r.call, PackedRegionRead)]
        packed = sorted(
            (r.call for r in reads if isinstance(r.call, PackedRegionRead)),
            key=lambda r: (r.chunk.pack, r.chunk.offset),
        )
        run: list[PackedRegionRead] = []
        for r in packed:
            last = run[-1].chunk if run else None
            if last is not None and (
                r.chunk.pack != last.pack or not 0 <= r.chunk.offset - run[-1].end <= codec.GAP_READ_BYTES
            ):
                merged.append(self._pack_run(run))
                run = []
            run.append(r)
        if run:
            merged.append(self._pack_run(run))
        return merged

    def _pack_run(self, run: list[PackedRegionRead]) -> ObjectCall:
        pack = run[0].chunk.pack
        return ObjectCall(
            functools.partial(self._read_pack_regions, pack, run),
            run[-1].end - run[0].chunk.offset,
            self._pack_key(pack),
        )

    def _read_pack_regions(self, pack: str, run: list[PackedRegionRead]) -> None:
        reads = [r for r in map(PackedRegionRead.packed_read, run) if r is not None]
        if reads:
            self._read_packed(pack, reads)

    @collector_paused()
    def read_atoms(
        self,
        paths: Iterable[str],
        *,
        device: torch.device | str | None = None,
        into: Mapping[str, torch.Tensor] | None = None,
    ) -> dict[str, torch.Tensor]:
        """Read whole atoms, every chunk verified; many objects in flight. Each tensor is made for the load (a storage
        of its own), in host memory or on `device` (e.g. "cuda": the objects land in it through page-locked host
        memory, `ucp.engine.landing`); or, with `into` (by atom path: exactly the atoms asked for, each a tensor of its
        dtype and shape, on any device), the caller's tensors are filled in place and returned. What `into` holds is
        checked before anything is read or changed (StateError naming the atom); a read that fails after that (a
        damaged or missing object) leaves them partly filled, as a failed `dcp.load` does, and its error says so.

        Reads are planned from the committed manifest alone (its checksum is in the commit marker), so an atom's
        own zarr.json, which only other Zarr readers need, is not read here: `ucp verify` checks that it agrees."""
        paths = list(paths)
        manifest = self.manifest
        if isinstance(manifest, IndexedManifest):  # (the index parts of these atoms, read together)
            manifest.load(manifest.parts(paths), 1 if self.storage.capabilities.serial_small_reads else self.io_threads)
        place = load_device(device)
        given = self._destinations(paths, into, device)
        aliases = self._aliases(given)  # (one tensor given for two atoms: the second read aside, then copied)
        given.update(aliases)
        out: dict[str, torch.Tensor] = {}
        packs: dict[str, list[codec.PackedRead]] = {}  # packed atoms read whole into host memory, by pack
        others: list[AtomMeta] = []
        for path in paths:
            try:
                whole = manifest.whole_packed(path)
            except KeyError:
                raise StateError(f"step {self.step} at {self.storage.url} has no atom {path!r}") from None
            dest = given.get(path)
            if whole is not None and (_direct(dest) if dest is not None else place is None):
                # (most atoms of a state of many small ones: its one chunk read straight into its tensor, with no
                # description of it made)
                if dest is None:
                    dest = _allocate(whole.shape, dtypes.facts(whole.dtype).torch, path, None)
                out[path] = dest
                reads = packs.setdefault(whole.pack, [])
                reads.append(codec.PackedRead(whole.offset, whole.nbytes, whole.crc, dtypes.as_bytes(dest), path, "c"))
                continue
            meta = self.atoms[path]
            out[path] = dest if dest is not None else allocate(meta, device=place)
            others.append(meta)
        tasks = [
            ObjectCall(
                functools.partial(self._read_packed, pack, reads), manifest.pack_sum(pack)[0], self._pack_key(pack)
            )
            for pack, reads in packs.items()
        ]
        with open_landing([out[m.path] for m in others], others) as landing:
            for m in others:
                lands = landing if landing is not None and not on_host(out[m.path]) else None
                tasks += [
                    ObjectCall(
                        functools.partial(self.read_chunk_into, m, i, out[m.path])
                        if lands is None  # (whole chunks straight into host memory: the least work per object)
                        else functools.partial(self.read_region, m, i, full_box(m.shape), out[m.path], lands),
                        m.object_bytes,
                        self.read_key(m, i),
                    )
                    for i in chunk_indices(m.grid)
                ]
            try:
                self.run_reads(tasks)
            except UcpError as e:
                if into is None:
                    raise
                # (the reads land in place: what they filled before the failure stays; every ucp error is its message)
                raise type(e)(
                    f"{e}; the tensors given (into=) are partly overwritten: load them from a good step"
                ) from e
        if into is not None:
            for path in paths:
                if path in aliases:
                    into[path].detach().copy_(aliases[path])  # (a tied parameter that requires grad: `_destinations`)
            out = {p: into[p] for p in paths}
        return out

    def _pack_key(self, pack: str) -> str:
        return pack_object_key(self.prefix, pack)

    def _destinations(
        self, paths: list[str], into: Mapping[str, torch.Tensor] | None, device: torch.device | str | None
    ) -> dict[str, torch.Tensor]:
        """The caller's tensors to fill (`read_atoms`'s `into`), every one checked: exactly the atoms asked for, each
        a dense tensor of its atom's dtype and shape; a StateError naming the first that is not."""
        if into is None:
            return {}
        missing = [p for p in paths if p not in self.atoms]
        if missing:
            raise StateError(f"step {self.step} at {self.storage.url} has no atom {missing[0]!r}")
        if device is not None:
            raise StateError("a load into the caller's tensors (into=) takes their devices: give no device= with it")
        wanted = set(paths)
        extra = [p for p in into if p not in wanted]
        if extra:
            raise StateError(f"cannot load into {extra[0]!r}: step {self.step} has no such atom to load")
        for path in paths:
            dest = into.get(path)
            if dest is None:
                raise StateError(f"cannot load atom {path!r} of step {self.step}: the tensors given (into=) lack it")
            meta = self.atoms[path]
            if not isinstance(dest, torch.Tensor):
                raise StateError(f"cannot load atom {path!r} into a {type(dest).__name__}: it needs a tensor")
            if dest.layout != torch.strided or dest.device.type == "meta":
                kind = "on the meta device" if dest.device.type == "meta" else str(dest.layout).removeprefix("torch.")
                raise StateError(f"cannot load atom {path!r} into a tensor {kind}: it needs a dense one with memory")
            if tuple(dest.shape) != meta.shape or dest.dtype != dtypes.torch_dtype(meta.dtype):
                raise StateError(
                    f"cannot load atom {path!r} ({meta.dtype} {list(meta.shape)}) into a tensor of "
                    f"{str(dest.dtype).removeprefix('torch.')} {list(dest.shape)}"
                )
            if any(stride == 0 and n > 1 for n, stride in zip(dest.shape, dest.stride())):
                raise StateError(  # (an expanded tensor: every element of a row is one; torch's copy_ refuses it too)
                    f"cannot load atom {path!r} into a tensor whose elements share memory (strides {dest.stride()}, "
                    "an expanded tensor): give one with memory of its own for each element"
                )
        # (detached: a parameter that requires grad is filled as `load_state_dict` fills it, under no_grad, which is
        # thread-local and so would not reach the reading threads; a detached tensor shares its memory and version)
        return {p: into[p].detach() for p in paths}

    def _aliases(self, given: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Of the caller's tensors, those that are another one given already (tied weights: one tensor under two
        keys), each mapped to a fresh tensor to read into and copy from afterwards, in order, as load_state_dict
        copies (the last one wins); tensors that share memory otherwise are a StateError (two reads would race)."""
        spans = sorted(
            ((t.device, t.data_ptr(), t.data_ptr() + _extent(t), p) for p, t in given.items()),
            key=lambda s: (str(s[0]), s[1], s[2]),
        )
        aliases: dict[str, torch.Tensor] = {}
        reach: tuple[Any, int, int, str] | None = None
        for span in spans:
            device, start, end, path = span
            if start == end:
                continue
            if reach is not None and device == reach[0] and start < reach[2]:
                first, dest = reach[3], given[path]
                if (start, end) != (reach[1], reach[2]) or dest.stride() != given[first].stride():
                    raise StateError(f"cannot load atoms {first!r} and {path!r} into tensors that share memory")
                aliases[path] = torch.empty_like(dest)
                continue
            reach = span
        return aliases

    @collector_paused()
    def load_state(
        self, *, device: torch.device | str | None = None, into: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        """The step's state as it was saved; its tensors on `device` (default: host memory). With `into` (a state of
        the structure saved: the same keys at every level, a tensor of each atom's dtype and shape where it is one),
        its tensors are filled in place, on whatever devices they are, its other values set to the saved ones, and
        `into` itself is returned; anything that does not match is a StateError naming its key, before anything of
        `into` is changed."""
        state_tree = self.manifest.tree
        if into is None:  # (the tree was checked with its atoms: `tree_atoms`)
            return tree.unflatten(state_tree, self.read_atoms(self.tree_atoms, device=device), checked=True)
        matched = tree.match(state_tree, into)
        self.read_atoms(self.tree_atoms, device=device, into=matched.tensors)
        matched.set_values()
        return into

    def total_bytes(self) -> int:
        return sum(m.nbytes for m in self.atoms.values())

    def chunk_count(self) -> int:
        """Objects that hold the atoms' data: the chunk objects of unpacked atoms, and the packs."""
        return sum(math.prod(m.grid) for m in self.atoms.values() if not m.packed) + len(self.manifest.packs)


@dataclass(frozen=True, eq=False)
class PackedRegionRead:
    """The read of the part of packed chunk `index` of atom `meta` inside region `box` into `view` (in host memory):
    a call of its own, which `CheckpointReader.run_reads` merges with the other chunks of its pack it reads, so that
    a load of many small atoms packed together makes a request per pack (per run of the chunks it wants), not one per
    chunk."""

    reader: CheckpointReader
    meta: AtomMeta
    index: tuple[int, ...]
    box: Box
    view: torch.Tensor

    @functools.cached_property
    def chunk(self) -> PackedChunk:
        return self.reader.packed_chunk(self.meta, self.index)

    @property
    def end(self) -> int:
        return self.chunk.offset + self.chunk.nbytes

    def packed_read(self) -> codec.PackedRead | None:
        """The chunk's read into its sink (None where no part of it falls in `box`)."""
        sink = codec.packed_sink(self.meta, self.index, codec.region(self.box, self.view))
        return None if sink is None else codec.PackedRead.of(self.chunk, sink, self.meta, self.index)

    def __call__(self) -> None:
        self.reader.read_region(self.meta, self.index, self.box, self.view)


def chunks_touching(meta: AtomMeta, box: Box) -> list[tuple[int, ...]]:
    """The grid indices of the chunk objects of `meta` that region `box` overlaps."""
    if meta.single_chunk and all(b > a for a, b in box):  # (most atoms of a state of many small ones)
        return [(0,) * len(box)]
    if any(b <= a for a, b in box):  # (an empty region touches nothing: its other extents may be 2^46 chunks long)
        return []
    ranges = [range(a // c, (b - 1) // c + 1) if b > a else range(0) for (a, b), c in zip(box, meta.chunk_shape)]
    out: list[tuple[int, ...]] = [()]
    for r in ranges:
        out = [(*prefix, i) for prefix in out for i in r]
    return out


def allocate(meta: AtomMeta, *, zero: bool = False, device: torch.device | str | None = None) -> torch.Tensor:
    """The tensor an atom is read into (on `device`, default host memory); a size the machine (or the device)
    cannot give is a StateError naming the atom."""
    return _allocate(meta.shape, dtypes.torch_dtype(meta.dtype), meta.path, device, zero)


def _allocate(
    shape: tuple[int, ...], dtype: torch.dtype, path: str, device: torch.device | str | None, zero: bool = False
) -> torch.Tensor:
    try:
        return (torch.zeros if zero else torch.empty)(shape, dtype=dtype, device=device)
    except (RuntimeError, MemoryError) as e:
        where = f" on {device}" if device is not None else ""
        raise StateError(
            f"cannot allocate {math.prod(shape) * dtype.itemsize} bytes{where} for atom {path!r}: {e}"
        ) from None


def _extent(t: torch.Tensor) -> int:
    """Bytes from a tensor's first element to the end of its last (0 if it has none): the memory its elements lie
    in, whatever its strides. (Not `numel * element_size`: a strided view, `x[::2]`, reaches past that, and a tensor
    lying there, `x[6:8]`, would have shared an element with it unseen, two reads racing to fill it.)"""
    if t.numel() == 0:
        return 0
    return (1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))) * t.element_size()


def _direct(dest: torch.Tensor) -> bool:
    """Whether a read can put an atom's bytes straight into `dest` (contiguous, in host memory)."""
    return dest.is_contiguous() and on_host(dest)


def open_checkpoint(
    url: str, step: int | str | None = "latest", *, storage_options: dict[str, Any] | None = None
) -> CheckpointReader:
    """Open a committed step for reading. `url` is a checkpoint root, or a step directory inside one (whose step is
    the one read: `step` may say it again)."""
    root, _, last = url.rstrip("/").rpartition("/")
    attempt = None
    if is_attempt_dirname(last):  # the committed attempt's group: its step directory names the step
        attempt = last
        root, _, last = root.rpartition("/")
    named = parse_step_dirname(last) if root else None
    if named is not None and (step in (None, "latest") or (type(step) is int and step == named)):
        url, step = root, named
    reader = CheckpointReader(open_storage(url, storage_options), step)
    if attempt is not None and named is not None and reader.record.attempt != attempt:
        # (another attempt of the step: an interrupted save's, a race's loser; never read in its place)
        raise CheckpointNotFoundError(
            f"{url}/{last}/{attempt} is not the committed attempt of step {named} (that is {reader.record.attempt})"
        )
    return reader


def load(
    url: str,
    *,
    step: int | str | None = "latest",
    storage_options: dict[str, Any] | None = None,
    device: torch.device | str | None = None,
    into: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Load a committed step as the nested dict it was saved from, bitwise identical: its tensors in host memory, or
    on `device` (e.g. "cuda", "cuda:1"), where they land straight from page-locked read buffers. With `into` (a state
    of the structure saved, as a resuming job holds it), its tensors are filled in place on whatever devices they are
    and its other values set, and `into` is returned (`CheckpointReader.load_state`)."""
    return open_checkpoint(url, step, storage_options=storage_options).load_state(device=device, into=into)
