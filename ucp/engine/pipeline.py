"""The save data path: snapshot into staging memory, encode, many writes in flight, commit.

A save is a `SavePlan` (which objects this process writes, each chunk's values behind a callable) run by a
`SavePipeline` in one of three modes:

- "sync": chunks are encoded straight from the live tensors by writer threads (a chunk on a device is first copied
  into staging memory, its write starting as soon as it is there); `submit` returns once the step is committed.
- "async": the caller's thread copies every chunk into staging memory and returns as soon as that snapshot is
  complete; writes and the commit go on in the background. Training may then change the tensors. The writes
  start when the copy ends (a writer running during the copy would compete with it), or earlier, overlapping
  the copy, when a bounded staging pool is full.
- "lazy": the snapshot copy itself runs in the background, while the next forward/backward runs, and the
  write of each chunk starts as soon as it is copied (copy i+1 overlaps the encode and write of i); only
  code that changes the saved tensors (the optimizer step) calls `handle.wait_snapshot()` first.

Who encodes and writes the staged chunks of an async or lazy save: a writer process (`ucp.engine.writer_process`,
the default where the platform has memfd, Linux) that maps the staging memory, so that checksums, encoding
and IO calls do not hold the trainer's GIL; or writer threads in this process (`writer="threads"`, and for
storages that live in this process, such as memory:// or a Storage subclass).

One save is in flight at a time: `submit` first waits for the previous save and raises its error, so a
failed background write is never silent (it is also logged, `ucp` logger, when it fails). A save still in flight
when the interpreter exits (a run's last, with no `wait` or `close`) is waited for: it commits before the exit.
Staging memory is a pool of arenas reused from save to save (`ucp.engine.staging`; page-locked host memory, filled
on a side stream of each device, where the process uses CUDA), bounded by `staging_bytes`: when it is full, the
snapshot waits for writes to free memory. `prepare` makes the arenas a state's saves need before the first save, so
that it does not allocate and page-lock them.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import functools
import logging
import math
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal, NamedTuple, NoReturn, Protocol

import torch

from ..base.chunking import ChunkingPolicy
from ..base.devices import Copies, SideStreams, cuda_in_use, on_host
from ..base.heap import collector_paused
from ..base.workpool import ObjectCall, SizedPool, submit_sized, wait_all, when_all_done
from ..errors import UcpError
from ..format.manifest import ZARR_JSON, AtomMeta, StepManifest, dumps, group_json
from ..format.packs import Pack, PackMember, lay_out
from ..protocol import codec
from ..protocol.commit import CommitRecord
from ..protocol.session import SaveSession
from ..storage import Storage
from .staging import Arena, Slot, StagingPool, close_arena, host_arena, shared_arena
from .writer_process import SUPPORTED as PROCESS_WRITER_SUPPORTED
from .writer_process import ChunkRef, WriterProcess

log = logging.getLogger("ucp")

Mode = Literal["sync", "async", "lazy"]
Writer = Literal["process", "threads"]
MODES = ("sync", "async", "lazy")
WRITERS = ("process", "threads")
DEFAULT_WRITER: Writer = "process" if PROCESS_WRITER_SUPPORTED else "threads"


def check_mode(mode: object) -> Mode:
    """A save mode, checked before a save begins (a save refused later would leave its attempt begun)."""
    if mode not in MODES:
        raise UcpError(f"save mode must be one of {MODES}, got {mode!r:.80}")
    return mode  # type: ignore[return-value]


_BATCH_BYTES = 4 << 20  # chunks go to the writers in batches of about this size...
_BATCH_CALLS = 64  # ...or this many: small objects do not pay one message (or hand-over) each; the writers split
# each batch into pool tasks by `workpool.submit_sized`
# Staging memory of a one-shot sync save (`ucp.save`, `save_sharded`): only its chunks on a device are staged, each
# written as soon as it is there, so a little memory serves any state (page-locked memory stays in torch's cache).
ONE_SHOT_STAGING_BYTES = 512 << 20


def one_shot_staging(metas: Sequence[AtomMeta]) -> int:
    """The staging bytes of a one-shot sync save of atoms `metas`: ONE_SHOT_STAGING_BYTES, or room for two of its
    largest chunk objects."""
    return max(ONE_SHOT_STAGING_BYTES, 2 * max((m.object_bytes for m in metas), default=0))


class ChunkJob(NamedTuple):
    """One chunk object to write: its atom, grid position, and a callable giving its values (the chunk's
    region of the atom, clipped at the edge; may be a view of live state). (A tuple: one per atom of a save.)"""

    meta: AtomMeta
    index: tuple[int, ...]  # type: ignore[assignment]  # (the field hides tuple.index, which nothing calls)
    source: Callable[[], torch.Tensor]

    def key(self, prefix: str) -> str:
        return self.meta.object_key(prefix, self.index)


@dataclass(frozen=True)
class PackJob:
    """One pack object to write (`ucp.format.packs`): its layout, and a callable giving each member chunk's values."""

    pack: Pack
    sources: tuple[Callable[[], torch.Tensor], ...]
    index: tuple[int, ...] = (0,)

    @property
    def meta(self) -> AtomMeta:
        return self.pack.meta

    def key(self, prefix: str) -> str:
        return self.pack.key(prefix)


@dataclass
class SavePlan:
    """What this process writes in a save attempt (`session`): array metadata, group metadata, chunk objects.
    Once every write is done and durable, the pipeline ends the attempt (`session.finish`: the commit, with the
    coordinator's `manifest`), unless `commit` is False: then the caller writes more plans and finishes it.
    The chunks of packed atoms go into packs of up to `pack_bytes` (`jobs`)."""

    session: SaveSession
    metadata: list[AtomMeta]
    groups: list[str]
    chunks: list[ChunkJob]
    manifest: StepManifest | None = None
    commit: bool = True
    pack_bytes: int = ChunkingPolicy().pack_bytes
    _jobs: list[ChunkJob | PackJob] | None = field(default=None, init=False, repr=False)

    @property
    def storage(self) -> Storage:
        return self.session.storage

    @property
    def step(self) -> int:
        return self.session.step

    def jobs(self) -> list[ChunkJob | PackJob]:
        """Every object this process writes: the chunk objects of unpacked atoms, then the packs that hold the
        packed atoms' chunks (laid out, and named in the session, once)."""
        if self._jobs is None:
            plain: list[ChunkJob | PackJob] = [j for j in self.chunks if not j.meta.packed]
            packed = [j for j in self.chunks if j.meta.packed]
            packs = lay_out([(j.meta, j.index) for j in packed], self.pack_bytes, self.session.new_pack_name)
            members = iter(packed)
            self._jobs = plain + [PackJob(p, tuple(next(members).source for _ in p.members)) for p in packs]
        return self._jobs

    def documents(self) -> list[tuple[str, Callable[[], dict]]]:
        """The zarr.json of every unpacked atom, pack and group this process writes."""
        prefix = self.session.prefix
        docs = [(f"{prefix}/{m.path}/{ZARR_JSON}", m.zarr_json) for m in self.metadata if not m.packed]
        docs += [
            (f"{prefix}/{j.pack.name}/{ZARR_JSON}", j.meta.zarr_json) for j in self.jobs() if isinstance(j, PackJob)
        ]
        return docs + [(f"{prefix}/{g}/{ZARR_JSON}", group_json) for g in self.groups]


@dataclass
class _Staged:
    """A chunk to write: its values in a staging slot (with the CUDA event that marks the copy done), or, in
    sync mode, no slot: the values are the live tensor's (or taken from the job's source when written)."""

    job: ChunkJob | PackJob
    values: torch.Tensor | None = None
    slot: Slot | None = None
    ready: torch.cuda.Event | None = None

    @property
    def nbytes(self) -> int:
        if self.values is not None:
            return self.values.numel() * self.values.element_size()
        return math.prod(self.job.meta.chunk_shape) * self.job.meta.itemsize

    def wait_ready(self) -> None:
        if self.ready is not None:
            self.ready.synchronize()


def _batches(staged: Sequence[_Staged]) -> list[Sequence[_Staged]]:
    out, start, nbytes = [], 0, 0
    for i, s in enumerate(staged):
        nbytes += s.nbytes
        if nbytes >= _BATCH_BYTES or i + 1 - start >= _BATCH_CALLS:
            out.append(staged[start : i + 1])
            start, nbytes = i + 1, 0
    if start < len(staged):
        out.append(staged[start:])
    return out


@dataclass
class SaveHandle:
    """A save in progress: `blocking_s` is how long `submit` held the caller; `result()` waits for the commit."""

    step: int
    mode: str
    writer: str = "threads"
    blocking_s: float = 0.0
    snapshot_s: float = 0.0
    snapshot_done: threading.Event = field(default_factory=threading.Event)
    _future: cf.Future | None = None
    _record: CommitRecord | None = None
    _error: BaseException | None = None  # the save's failure, once `result` has raised it
    _session: SaveSession | None = None  # (abandon cancels it)
    _snapshot_error: BaseException | None = None  # why the snapshot failed (set before `snapshot_done`)
    _abandoned: bool = False  # (its failure is expected: not logged as one)

    def wait_snapshot(self) -> None:
        """Block until the snapshot is complete (lazy mode: before changing the saved tensors); raise why it failed,
        if it did (the save fails with it: `result`)."""
        self.snapshot_done.wait()
        if self._snapshot_error is not None:
            raise self._snapshot_error
        future = self._future  # (read once: `result` in another thread may drop it)
        if future is not None and future.done() and future.exception() is not None:
            raise future.exception()  # type: ignore[misc]

    def done(self) -> bool:
        future = self._future
        return future is None or future.done()

    @property
    def after_commit_errors(self) -> list[Exception]:
        """What failed after the step committed (retention, gc, the hot tier's drain to the durable URL): logged
        with the `ucp` logger and kept here, never raised as the save's failure (the step is committed)."""
        return [] if self._session is None else list(self._session.after_commit_errors)

    def result(self, timeout: float | None = None) -> CommitRecord | None:
        """Wait for the commit (None on processes that do not commit); raise the save's error if it failed (again
        at each call: once raised here, the next save and `wait` no longer raise it). Any thread may call it (the
        caller's, and the release thread of `abandon`)."""
        future = self._future  # (read once: another caller may drop it once it is done)
        if future is not None:
            try:
                self._record = future.result(timeout)
            except cf.TimeoutError:
                raise
            except BaseException as e:
                self._error = e
                raise
            finally:
                if future.done():
                    self._future = None
        if self._error is not None:
            raise self._error
        return self._record

    @property
    def reported(self) -> bool:
        """Whether the caller has been handed the save's outcome (`result` returned or raised)."""
        return self._future is None


# ------------------------------------------------------------------------------- who encodes and writes


class Writes(Protocol):
    """Who encodes and writes one save's objects: writer threads here (`_ThreadWrites`) or the writer process
    (`_ProcessWrites`). `write_chunks` takes the staged chunks over (their slots are its to release); every method
    returns futures the pipeline waits for; `flush` makes what was written durable; `close` ends the save's use."""

    def write_documents(self, documents: list[tuple[str, bytes]]) -> list[cf.Future]: ...

    def write_chunks(self, staged: Sequence[_Staged]) -> list[cf.Future]: ...

    def flush(self) -> None: ...

    def close(self) -> None: ...


class _ThreadWrites:
    """One save's writes by writer threads of this process."""

    def __init__(self, pool: SizedPool, staging: StagingPool, plan: SavePlan):
        self.pool, self.staging, self.plan = pool, staging, plan
        self.serial_small = plan.storage.capabilities.serial_small_writes

    def write_documents(self, documents: list[tuple[str, bytes]]) -> list[cf.Future]:
        calls = [ObjectCall(functools.partial(self.plan.storage.write, key, [data]), 0) for key, data in documents]
        return submit_sized(self.pool, calls, self.serial_small)  # (documents are small)

    def write_chunks(self, staged: Sequence[_Staged]) -> list[cf.Future]:
        """Queue the writes, split into pool tasks as the writer process splits what it is sent (`submit_sized`: on
        an object store, where a request waits milliseconds, every small object a task of its own, many in flight);
        from here on the staged chunks are theirs: each batch's slots are released once its writes end, fail or
        are cancelled, and at once if they cannot be queued."""
        futures = []
        batches = _batches(staged)
        for i, batch in enumerate(batches):
            try:
                calls = [ObjectCall(functools.partial(self._write, s), s.nbytes) for s in batch]
                submitted = submit_sized(self.pool, calls, self.serial_small)
            except BaseException:
                _release_all(self.staging, batches[i:])
                raise
            when_all_done(submitted, functools.partial(_release, self.staging, batch))
            futures += submitted
        return futures

    def _write(self, staged: _Staged) -> None:
        staged.wait_ready()
        job = staged.job
        key = job.key(self.plan.session.prefix)
        if isinstance(job, PackJob):
            members = staged.values if staged.values is not None else [source() for source in job.sources]
            encoded = codec.encode_pack(job.pack.spans, job.pack.data_bytes, members)
            self.plan.storage.write(key, encoded.parts)
            self.plan.session.record_pack(job.pack, *encoded.sum, list(encoded.members))
            return
        values = staged.values if staged.values is not None else job.source()
        encoded = codec.encode(job.meta, job.index, values)
        self.plan.storage.write(key, encoded.parts)
        self.plan.session.record(key, *encoded.sum)

    def flush(self) -> None:
        self.plan.storage.flush()

    def close(self) -> None:
        pass


class _ProcessWrites:
    """One save's writes by the writer process; what it wrote is counted in the plan storage's stats."""

    def __init__(self, process: WriterProcess, staging: StagingPool, plan: SavePlan):
        self.process, self.staging, self.plan = process, staging, plan
        assert plan.storage.capabilities.writer_process, "only storages that a writer process can write go to one"
        self.sid = process.open_storage(plan.storage)
        self.packs: dict[str, Pack] = {}  # the packs sent to the child, by key

    def write_documents(self, documents: list[tuple[str, bytes]]) -> list[cf.Future]:
        return [self._counted(self.process.write_documents(self.sid, documents))]

    def write_chunks(self, staged: Sequence[_Staged]) -> list[cf.Future]:
        """Send the writes; from here on the staged chunks are theirs (as in `_ThreadWrites.write_chunks`): each
        batch's slots are released once the child no longer reads them, or at once if it cannot be sent."""
        futures = []
        batches = _batches(staged)
        for i, batch in enumerate(batches):
            try:
                refs = [self._ref(s) for s in batch]
            except BaseException:
                _release_all(self.staging, batches[i:])
                raise
            try:
                future = self.process.write_chunks(self.sid, refs, functools.partial(_release, self.staging, batch))
            except BaseException:
                _release_all(self.staging, batches[i + 1 :])  # (the failed batch was released by write_chunks)
                raise
            futures.append(self._counted(future))
        return futures

    def _ref(self, staged: _Staged) -> ChunkRef:
        staged.wait_ready()  # the child cannot wait on a CUDA event
        assert staged.slot is not None and staged.values is not None
        job = staged.job
        key = job.key(self.plan.session.prefix)
        if isinstance(job, PackJob):
            self.packs[key] = job.pack
        return ChunkRef(
            key,
            job.meta,
            job.index,
            staged.slot.arena.id,
            staged.slot.offset,
            staged.values.dtype,
            tuple(staged.values.shape),
            job.pack.spans if isinstance(job, PackJob) else None,
        )

    def _counted(self, future: cf.Future) -> cf.Future:
        """Count what the child wrote in this process's stats, and record each chunk object's checksum."""

        def count(f: cf.Future) -> None:
            if f.exception() is None:
                for key, nbytes, crc, members in f.result():
                    self.plan.storage.stats.record_write(key, nbytes)
                    if key in self.packs:
                        self.plan.session.record_pack(self.packs[key], nbytes, crc, members)
                    elif crc is not None:
                        self.plan.session.record(key, nbytes, crc)

        future.add_done_callback(count)
        return future

    def flush(self) -> None:
        self.process.flush(self.sid).result()

    def close(self) -> None:
        self.process.close_storage(self.sid)


def _release(staging: StagingPool, batch: Sequence[_Staged]) -> None:
    """Give the batch's slots back, each once its copy from a device has ended: a chunk whose write was cancelled or
    never handed over (a failed snapshot) may still have a copy queued, which would otherwise write into memory
    given to another chunk, or unmapped and unregistered with its arena."""
    for s in batch:
        if s.slot is not None:
            try:
                s.wait_ready()
            except BaseException as e:  # noqa: BLE001 -- the save has failed already; its memory goes back anyway
                log.debug("a failed save's copy to staging memory: %s", e)
            staging.release(s.slot)


def _release_all(staging: StagingPool, batches: Sequence[Sequence[_Staged]]) -> None:
    for batch in batches:
        _release(staging, batch)


# ---------------------------------------------------------------------------------------- the pipeline


def _host_arena(arena_id: int, size: int) -> Arena:
    """A staging arena of the writer threads (page-locked where CUDA is in use)."""
    return host_arena(arena_id, size, pinned=cuda_in_use())


class SavePipeline:
    """Runs save plans: writers (a process or threads), a reused staging pool, one background save at a time."""

    def __init__(self, io_threads: int = 16, staging_bytes: int | None = None, writer: Writer = DEFAULT_WRITER):
        if writer not in WRITERS:
            raise UcpError(f"writer must be one of {WRITERS}, got {writer!r}")
        if writer == "process" and not PROCESS_WRITER_SUPPORTED:
            raise UcpError("a writer process needs Linux (memfd shared memory); use writer='threads'")
        self.io_threads = io_threads
        self.writer = writer
        self.threads = SizedPool(io_threads, "ucp-write")
        self.background = cf.ThreadPoolExecutor(1, thread_name_prefix="ucp-save")
        self._streams = SideStreams()  # (made per device when a chunk on it is first copied)
        if writer == "process":
            self.staging = StagingPool(staging_bytes, self._shared_arena, self._unmap_arena)
        else:
            self.staging = StagingPool(staging_bytes, _host_arena)  # (no method of self: that would be a cycle)
        self._process: WriterProcess | None = None
        self._process_lock = threading.RLock()
        self._inflight: SaveHandle | None = None
        _finish_at_exit(self)  # (after its executors were made: see there why the order matters)

    def start_writer(self) -> None:
        """Start the writer process now (it takes a second or two to import), not at the first save."""
        if self.writer == "process":
            self._writer_process()

    def prepare(self, sizes: Sequence[int]) -> None:
        """Make the staging memory of a save whose staged chunks have `sizes` (bytes, in the plan's order) now, with
        the writer process: the first such save then allocates and page-locks nothing (measured on an H200: 2.8 s
        of a 6 GiB save's blocking time when done inside it)."""
        self.start_writer()
        self.staging.reserve(sizes)

    @property
    def writer_pid(self) -> int | None:
        """The writer process's pid while one is started (None with writer threads)."""
        with self._process_lock:
            return self._process.pid if self._process is not None else None

    def stop_writer(self) -> None:
        """Stop the writer process, if one runs; the next async save starts a fresh one."""
        with self._process_lock:
            process, self._process = self._process, None
        if process is not None:
            process.close()

    def wait(self) -> CommitRecord | None:
        """Wait for the save in flight, if any; raises its error, unless the caller had it from `handle.result()`
        already (a failure the caller has seen fails nothing after it)."""
        handle = self._inflight
        if handle is None or handle.reported:
            self._inflight = None
            return None
        try:
            return handle.result()
        finally:
            if handle.done():  # (a wait interrupted by a signal, KeyboardInterrupt, leaves the save in flight: the
                self._inflight = None  # next save must still wait for it, and raise its error)

    def fit_packs(self, plan: SavePlan) -> None:
        """Make the plan's packs small enough for bounded staging memory (a quarter of it, so that packs are copied
        while others are written), before they are laid out."""
        if self.staging.capacity is not None and plan._jobs is None:
            plan.pack_bytes = max(1, min(plan.pack_bytes, self.staging.capacity // 4))

    @collector_paused()
    def submit(self, plan: SavePlan, mode: Mode = "sync") -> SaveHandle:
        try:
            check_mode(mode)
        except UcpError as e:  # (the caller checks it before it plans: this ends the plan's attempt all the same)
            self._fail(plan, e)
        self.fit_packs(plan)
        try:
            self.wait()
        except BaseException as e:  # noqa: BLE001 -- _fail raises it, after ending the attempt
            self._fail(plan, e)  # the previous save's failure ends this attempt too (no rank waits for it)
        start = time.perf_counter()
        try:
            writes = self._writes_for(plan, mode)
        except BaseException as e:  # noqa: BLE001 -- _fail raises it, after ending the attempt
            self._fail(plan, e)
        handle = SaveHandle(plan.step, mode, "process" if isinstance(writes, _ProcessWrites) else "threads")
        handle._session = plan.session
        copies = Copies(self._streams)  # (marks, in this thread, what the caller's stream has queued)
        if mode == "lazy":
            handle._future = self.background.submit(self._lazy, plan, writes, handle, copies)
            handle._future.add_done_callback(functools.partial(_log_failure, handle))
        else:
            try:
                futures, staged = self._snapshot(plan, writes, handle, copies, overlap=mode == "sync")
            except BaseException as e:  # noqa: BLE001 -- _fail raises it, after ending the attempt
                self._fail(plan, e)
            if mode == "sync":
                handle._record = self._write_rest(plan, writes, futures, staged)
            else:
                handle._future = self.background.submit(self._write_rest, plan, writes, futures, staged)
                handle._future.add_done_callback(functools.partial(_log_failure, handle))
        handle.blocking_s = time.perf_counter() - start
        self._inflight = handle if handle._future is not None else None
        return handle

    def _wait_at_exit(self) -> None:
        """At interpreter exit: let the save in flight, which nobody waited for, commit (its failure is logged)."""
        handle = self._inflight
        if handle is None or handle.reported:
            return
        log.info("waiting for the save of step %d to end before the interpreter exits", handle.step)
        with contextlib.suppress(Exception):  # (logged when it failed, `_log_failure`: there is no caller to raise to)
            self.wait()

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self.threads.shutdown(wait=True)
            self.background.shutdown(wait=True)
            if self._process is not None:
                self._process.close()
                self._process = None
            self.staging.close()

    def abandon(self) -> None:
        """Stop without waiting for the save in flight: for a process whose job lost a peer, where that save's
        collectives cannot complete (it fails uncommitted once its process group is gone, and `gc` collects what
        it wrote). The writer process is killed now; a thread releases the staging memory once that save ends."""
        handle, self._inflight = self._inflight, None
        if handle is not None:
            handle._abandoned = True
        if handle is not None and handle._session is not None:
            handle._session.cancel()  # (it commits nothing after this: the job goes on from an earlier step)
        with self._process_lock:
            process, self._process = self._process, None
        if process is not None:
            process.close(timeout=0)

        def release() -> None:
            if handle is not None:
                try:
                    handle.result()
                except BaseException as e:  # noqa: BLE001 -- expected: nobody waits for an abandoned save
                    log.info("the abandoned save of step %d ended uncommitted: %s", handle.step, e)
            self.threads.shutdown(wait=True)
            self.background.shutdown(wait=True)
            self.staging.close()

        threading.Thread(target=release, name="ucp-abandon", daemon=True).start()

    # -- writers

    def _writes_for(self, plan: SavePlan, mode: Mode) -> Writes:
        if mode != "sync" and self.writer == "process" and plan.storage.capabilities.writer_process:
            return _ProcessWrites(self._writer_process(), self.staging, plan)
        return _ThreadWrites(self.threads, self.staging, plan)

    def _writer_process(self) -> WriterProcess:
        """The writer process, (re)started if needed; a new one maps every arena of the pool."""
        with self._process_lock:
            if self._process is None or not self._process.alive:
                if self._process is not None:
                    self._process.close(timeout=5)
                self._process = WriterProcess(self.io_threads)
                for arena in self.staging.arenas:
                    self._process.map_arena(arena)
            return self._process

    def _shared_arena(self, arena_id: int, size: int) -> Arena:
        arena = shared_arena(arena_id, size, pin_for_cuda=cuda_in_use())
        try:
            self._writer_process().map_arena(arena)  # (a process started just now mapped only the older arenas)
        except BaseException:
            close_arena(arena)
            raise
        return arena

    def _unmap_arena(self, arena: Arena) -> None:
        if self._process is not None:
            self._process.unmap_arena(arena)

    # -- stages

    def _write_rest(
        self, plan: SavePlan, writes: Writes, futures: list[cf.Future], staged: list[_Staged]
    ) -> CommitRecord | None:
        """After the snapshot: hand over the chunks not yet handed over and the zarr.json documents, wait for
        every write and make them durable, then end the attempt. On a failure the writes already handed over end
        before the attempt is ended with the error."""
        error = None
        try:
            futures = futures + writes.write_chunks(staged)  # the chunks are the writes' from here, even if this raises
            futures += writes.write_documents([(key, dumps(doc())) for key, doc in plan.documents()])
            wait_all(futures)
            writes.flush()
        except BaseException as e:  # noqa: BLE001 -- _fail raises it, after ending the attempt
            _cancel(futures)
            error = e
        finally:
            writes.close()
        if error is not None:
            self._fail(plan, error)
        return self._end(plan)

    def _end(self, plan: SavePlan) -> CommitRecord | None:
        """End the plan's attempt, every write of this process durable (the commit), unless the caller finishes it."""
        return plan.session.finish(plan.manifest) if plan.commit else None

    def _fail(self, plan: SavePlan, error: BaseException) -> NoReturn:
        """End the plan's attempt with this process's `error` (every rank of the save raises one error naming every
        failing rank, and the attempt is removed), or raise `error` where the caller finishes the attempt. It never
        returns: `submit` goes on only with what its failed step would have made."""
        if plan.commit:
            plan.session.fail(error)
        raise error

    def _lazy(self, plan: SavePlan, writes: Writes, handle: SaveHandle, copies: Copies) -> CommitRecord | None:
        try:
            futures, staged = self._snapshot(plan, writes, handle, copies, overlap=True)
        except BaseException as e:  # noqa: BLE001 -- _fail raises it, after ending the attempt
            self._fail(plan, e)
        finally:
            handle.snapshot_done.set()  # (also set by _snapshot; here too, so that no failure leaves a waiter)
        return self._write_rest(plan, writes, futures, staged)

    def _snapshot(
        self, plan: SavePlan, writes: Writes, handle: SaveHandle, copies: Copies, overlap: bool
    ) -> tuple[list[cf.Future], list[_Staged]]:
        """Copy every chunk into staging (in sync mode only those on a device: the others are written from the live
        tensors). Returns the writes already handed over and the staged chunks not yet handed over. With `overlap`,
        chunks are handed over in batches as they are copied; without, only when the staging pool is full (a writer
        running during the copy slows the copy the caller waits for)."""
        start = time.perf_counter()
        futures: list[cf.Future] = []
        batch: list[_Staged] = []
        batch_bytes = 0

        def hand_over() -> None:
            nonlocal batch, batch_bytes
            handed, batch, batch_bytes = batch, [], 0  # the writes own them now, even if write_chunks raises
            if handed:
                futures.extend(writes.write_chunks(handed))

        copy_host = handle.mode != "sync"
        try:
            with copies.sourcing():
                for job in plan.jobs():
                    if isinstance(job, PackJob):
                        staged = self._stage_pack(job, hand_over, copies, copy_host)
                    else:
                        staged = self._stage(job, hand_over, copies, copy_host)
                    batch.append(staged)
                    batch_bytes += staged.nbytes
                    if overlap and (batch_bytes >= _BATCH_BYTES or len(batch) >= _BATCH_CALLS):
                        hand_over()
            # work queued after the snapshot (the optimizer step) must not change a tensor before its copy ran
            copies.order_after()
        except BaseException as e:
            _release(self.staging, batch)
            _cancel(futures)
            writes.close()
            handle._snapshot_error = e
            raise
        finally:
            handle.snapshot_s = time.perf_counter() - start
            handle.snapshot_done.set()
        return futures, batch

    def _acquire(self, nbytes: int, before_waiting: Callable[[], None]) -> Slot:
        """A staging slot of `nbytes`; if the pool is full, `before_waiting` first (it hands queued chunks to the
        writers, which free memory), then wait for one."""
        slot = self.staging.acquire(nbytes, wait=False)
        if slot is None:
            before_waiting()
            slot = self.staging.acquire(nbytes)
            assert slot is not None  # (waiting acquires always give one)
        return slot

    def _stage(self, job: ChunkJob, before_waiting: Callable[[], None], copies: Copies, copy_host: bool) -> _Staged:
        """Copy the job's values into a staging slot (unless `copy_host` is False and they are in host memory: a sync
        save writes them from there); if the pool is full, hand queued chunks to the writers (`before_waiting`) so
        that they can free memory, then wait."""
        values = job.source()
        if not copy_host and on_host(values):
            return _Staged(job, values)
        slot = self._acquire(values.numel() * values.element_size(), before_waiting)
        try:
            # (the plan holds the source tensors until its writes end, after their copies: no record_stream needed)
            staged = slot.memory.view(values.dtype).view(values.shape)
            return _Staged(job, staged, slot, copies.to_host(staged, values))
        except BaseException:
            self.staging.release(slot)
            raise

    def _stage_pack(self, job: PackJob, before_waiting: Callable[[], None], copies: Copies, copy_host: bool) -> _Staged:
        """Copy a pack's members into one staging slot at their offsets (the gaps zeroed), as `_stage` copies a
        chunk: the pack is then one contiguous buffer for the writer. (A sync save of members all in host memory
        stages nothing: the writer takes them from their sources.)"""
        members = [source() for source in job.sources]
        if not copy_host and all(on_host(v) for v in members):
            return _Staged(job)
        nbytes = job.pack.data_bytes
        slot = self._acquire(nbytes, before_waiting)
        try:
            staged = slot.memory[:nbytes]
            if all(on_host(v) for v in members):
                # one copy for the whole pack (each member's bytes and the zeros of the gaps between them, in order):
                # a copy per member cost Python per atom, ~4 us each, in the time the caller waits
                torch.cat(_pack_pieces(job.pack.members, members), out=staged)
                return _Staged(job, staged, slot)
            done: dict[torch.device, torch.cuda.Event] = {}  # the last copy queued from each device
            pos = 0
            for member, values in zip(job.pack.members, members):
                if member.offset > pos:
                    staged[pos : member.offset].zero_()
                region = staged[member.offset : member.offset + member.nbytes].view(values.dtype).view(values.shape)
                event = copies.to_host(region, values)
                if event is not None:
                    done[values.device] = event
                pos = member.offset + member.nbytes
            events = list(done.values())
            for event in events[:-1]:  # (members from several devices: rare; the writer waits for one event)
                event.synchronize()
            return _Staged(job, staged, slot, events[-1] if events else None)
        except BaseException:
            self.staging.release(slot)
            raise


def _log_failure(handle: SaveHandle, future: cf.Future) -> None:
    """Log a background save's failure when it happens: it is raised only at the caller's next save, wait or close,
    which may come much later, or never (a process that ends first). An abandoned save's is expected (`abandon`)."""
    error = None if future.cancelled() else future.exception()
    if error is not None and not handle._abandoned:
        log.error("background save of step %d: %s", handle.step, error)


# Pipelines whose save in flight is waited for when the interpreter exits (`_finish_at_exit`).
_LIVE_PIPELINES: weakref.WeakSet[SavePipeline] = weakref.WeakSet()
_exit_hook_lock = threading.Lock()
_exit_hook_registered = False


def _finish_at_exit(pipeline: SavePipeline) -> None:
    """Have the interpreter's exit wait for `pipeline`'s save in flight. An async save that its process returned from
    without `wait` or `close` (the run's last save) failed at exit otherwise, silently: concurrent.futures' exit hook
    makes every executor refuse new work, and the save still had writes and the commit to submit. Threading's exit
    hooks run last registered first, before the interpreter joins its threads: this one, registered after
    concurrent.futures' (its executors exist by now), runs while the executors still take work."""
    global _exit_hook_registered
    register = getattr(threading, "_register_atexit", None)  # (CPython's, since 3.9; concurrent.futures uses it)
    with _exit_hook_lock:
        _LIVE_PIPELINES.add(pipeline)
        if _exit_hook_registered or register is None:
            return
        try:
            register(_wait_for_saves_at_exit)
            _exit_hook_registered = True
        except RuntimeError:  # (the interpreter is exiting already)
            pass


def _wait_for_saves_at_exit() -> None:
    for pipeline in list(_LIVE_PIPELINES):
        pipeline._wait_at_exit()


_GAP_ZEROS = torch.zeros(64, dtype=torch.uint8)  # (alignment gaps: fewer bytes than an element)


def _pack_pieces(members: Sequence[PackMember], values: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """A pack's bytes as pieces laid back to back: each member's values as bytes, the gaps before them zeros."""
    pieces: list[torch.Tensor] = []
    pos = 0
    for member, v in zip(members, values, strict=True):
        if member.offset > pos:
            gap = member.offset - pos
            pieces.append(_GAP_ZEROS[:gap] if gap <= _GAP_ZEROS.numel() else torch.zeros(gap, dtype=torch.uint8))
        flat = v.detach().reshape(-1)
        if flat.numel() == 1 and flat.stride(0) != 1:  # (one element of a larger tensor keeps its row's stride)
            flat = flat.as_strided((1,), (1,))
        pieces.append(flat.view(torch.uint8) if flat.numel() else _GAP_ZEROS[:0])
        pos = member.offset + member.nbytes
    return pieces


def _cancel(futures: list[cf.Future]) -> None:
    for f in futures:
        f.cancel()
    cf.wait(futures)  # let running writes end before the caller reuses their memory
