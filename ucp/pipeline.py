"""The save data path: snapshot into staging buffers, encode, many writes in flight, commit.

A save is a `SavePlan` (which objects this process writes, each chunk's values behind a callable) run by a
`SavePipeline` in one of three modes:

- "sync": chunks are encoded straight from the live tensors; `submit` returns once the step is committed.
- "async": the caller's thread copies every chunk into staging memory and returns as soon as that snapshot
  is complete; writes and the commit go on in the background. Training may then change the tensors. The
  writes start when the copy ends (writer threads would slow the copy down by holding the GIL), or earlier,
  overlapping the copy, when a bounded staging pool is full.
- "lazy": the snapshot copy itself runs in the background, while the next forward/backward runs, and the
  write of each chunk starts as soon as it is copied (copy i+1 overlaps the encode and write of i); only
  code that changes the saved tensors (the optimizer step) calls `handle.wait_snapshot()` first.

One save is in flight at a time: `submit` first waits for the previous save and raises its error, so a
failed background write is never silent. Staging memory is a pool of buffers reused from save to save
(pinned host memory, filled on a side CUDA stream, when the tensors are on a GPU), bounded by
`staging_bytes`: when it is full, the snapshot waits for writes to free buffers.
"""

from __future__ import annotations

import concurrent.futures as cf
import functools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import torch

from . import codec
from .commit import CommitRecord
from .errors import UcpError
from .format import ZARR_JSON, AtomMeta, dumps, group_json, step_dirname
from .storage import Storage
from .workpool import submit_batched, wait_all

Mode = Literal["sync", "async", "lazy"]
_BATCH_BYTES = 4 << 20  # staged chunks are handed to the writers in batches of about this size...
_BATCH_CALLS = 64  # ...or this many, so that small objects do not pay one pool task each
MODES = ("sync", "async", "lazy")


@dataclass(frozen=True)
class ChunkJob:
    """One chunk object to write: its atom, grid position, and a callable giving its values (the chunk's
    region of the atom, clipped at the edge; may be a view of live state)."""

    meta: AtomMeta
    index: tuple[int, ...]
    source: Callable[[], torch.Tensor]


@dataclass
class SavePlan:
    """What this process writes for one step: array metadata, group metadata, chunk objects; then `finish`
    (make durable, coordinate, commit) runs once every write is done."""

    storage: Storage
    step: int
    metadata: list[AtomMeta]
    groups: list[str]
    chunks: list[ChunkJob]
    finish: Callable[[], CommitRecord | None]


class StagingPool:
    """Host buffers reused across saves, at most `capacity` bytes in all (None: as many as a save needs)."""

    def __init__(self, capacity: int | None = None):
        self.capacity = capacity
        self._free: dict[tuple[int, bool], list[torch.Tensor]] = {}
        self._allocated = 0
        self._cond = threading.Condition()

    def acquire(self, nbytes: int, pinned: bool, wait: bool = True) -> torch.Tensor | None:
        """A buffer of `nbytes`; when the pool is full, wait for a release (or return None if not `wait`)."""
        if self.capacity is not None and nbytes > self.capacity:
            raise UcpError(f"staging capacity {self.capacity} bytes is smaller than one chunk object ({nbytes} bytes)")
        with self._cond:
            while True:
                free = self._free.get((nbytes, pinned))
                if free:
                    return free.pop()
                if self.capacity is None or self._allocated + nbytes <= self.capacity:
                    self._allocated += nbytes
                    break
                if not self._drop_one_free_buffer():
                    if not wait:
                        return None
                    self._cond.wait()
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)

    def _drop_one_free_buffer(self) -> bool:
        for key, buffers in self._free.items():
            if buffers:
                buffers.pop()
                self._allocated -= key[0]
                return True
        return False

    def release(self, buffer: torch.Tensor) -> None:
        with self._cond:
            self._free.setdefault((buffer.numel(), buffer.is_pinned()), []).append(buffer)
            self._cond.notify_all()

    @property
    def allocated_bytes(self) -> int:
        return self._allocated


@dataclass
class _Staged:
    values: torch.Tensor
    buffer: torch.Tensor | None = None
    ready: torch.cuda.Event | None = None

    def wait_ready(self) -> None:
        if self.ready is not None:
            self.ready.synchronize()


@dataclass
class SaveHandle:
    """A save in progress: `blocking_s` is how long `submit` held the caller; `result()` waits for the commit."""

    step: int
    mode: str
    blocking_s: float = 0.0
    snapshot_s: float = 0.0
    snapshot_done: threading.Event = field(default_factory=threading.Event)
    _future: cf.Future | None = None
    _record: CommitRecord | None = None

    def wait_snapshot(self) -> None:
        """Block until the snapshot is complete (lazy mode: before changing the saved tensors)."""
        self.snapshot_done.wait()
        if self._future is not None and self._future.done() and self._future.exception() is not None:
            raise self._future.exception()  # type: ignore[misc]

    def done(self) -> bool:
        return self._future is None or self._future.done()

    def result(self, timeout: float | None = None) -> CommitRecord | None:
        """Wait for the commit (None on processes that do not commit); raise the save's error if it failed."""
        if self._future is not None:
            self._record = self._future.result(timeout)
            self._future = None
        return self._record


class SavePipeline:
    """Runs save plans: a writer thread pool, a reused staging pool, and one background save at a time."""

    def __init__(self, io_threads: int = 16, staging_bytes: int | None = None):
        self.writers = cf.ThreadPoolExecutor(io_threads, thread_name_prefix="ucp-write")
        self.background = cf.ThreadPoolExecutor(1, thread_name_prefix="ucp-save")
        self.staging = StagingPool(staging_bytes)
        self._side_stream = torch.cuda.Stream() if torch.cuda.is_available() else None
        self._inflight: SaveHandle | None = None

    def wait(self) -> CommitRecord | None:
        """Wait for the save in flight, if any; raises its error."""
        handle, self._inflight = self._inflight, None
        return handle.result() if handle is not None else None

    def submit(self, plan: SavePlan, mode: Mode = "sync") -> SaveHandle:
        if mode not in MODES:
            raise UcpError(f"save mode must be one of {MODES}, got {mode!r}")
        self.wait()
        start = time.perf_counter()
        handle = SaveHandle(plan.step, mode)
        if mode == "sync":
            handle._record = self._run(plan, handle)
        elif mode == "async":
            writes = self._snapshot(plan, handle, overlap=False)
            handle._future = self.background.submit(self._complete, plan, writes)
        else:
            handle._future = self.background.submit(lambda: self._complete(plan, self._snapshot(plan, handle, overlap=True)))
        handle.blocking_s = time.perf_counter() - start
        self._inflight = handle if handle._future is not None else None
        return handle

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self.writers.shutdown(wait=True)
            self.background.shutdown(wait=True)

    # -- stages

    def _run(self, plan: SavePlan, handle: SaveHandle) -> CommitRecord | None:
        return self._complete(plan, self._write_from_source(plan, handle))

    def _metadata_writes(self, plan: SavePlan) -> list[cf.Future]:
        prefix = step_dirname(plan.step)
        docs = [(f"{prefix}/{m.path}/{ZARR_JSON}", m.zarr_json) for m in plan.metadata]
        docs += [(f"{prefix}/{g}/{ZARR_JSON}", group_json) for g in plan.groups]
        return submit_batched(self.writers, [functools.partial(_write_json, plan.storage, key, doc) for key, doc in docs])

    def _write_from_source(self, plan: SavePlan, handle: SaveHandle) -> list[cf.Future]:
        """Sync mode: encode straight from the live tensors (no copy)."""
        futures = self._metadata_writes(plan)
        writes = [functools.partial(self._write_chunk, plan, job, None) for job in plan.chunks]
        futures += submit_batched(self.writers, writes)
        handle.snapshot_done.set()
        return futures

    def _snapshot(self, plan: SavePlan, handle: SaveHandle, overlap: bool) -> list[cf.Future]:
        """Copy every chunk into staging; queue the writes as chunks are copied (`overlap`, small ones in
        batches), or all at once when the copy is done. Writer threads running during the copy hold the GIL
        often enough to make the copy several times slower, so the async mode, where training waits for the
        copy, defers them; it still hands over what it has whenever the staging pool is full."""
        start = time.perf_counter()
        futures: list[cf.Future] = []
        batch: list[functools.partial] = []
        batch_bytes = 0

        def flush() -> None:
            nonlocal batch, batch_bytes
            if batch:
                futures.extend(submit_batched(self.writers, batch, per_task=len(batch)))
            batch, batch_bytes = [], 0

        try:
            if overlap:
                futures += self._metadata_writes(plan)
            for job in plan.chunks:
                staged = self._stage(job.source(), before_waiting=flush)
                batch.append(functools.partial(self._write_chunk, plan, job, staged))
                batch_bytes += staged.values.numel() * staged.values.element_size()
                if overlap and (batch_bytes >= _BATCH_BYTES or len(batch) >= _BATCH_CALLS):
                    flush()
        except BaseException:
            _cancel(futures)
            raise
        finally:
            handle.snapshot_s = time.perf_counter() - start
            handle.snapshot_done.set()
        if overlap:
            flush()
            return futures
        futures += self._metadata_writes(plan)
        futures += submit_batched(self.writers, batch)
        return futures

    def _stage(self, values: torch.Tensor, before_waiting: Callable[[], None]) -> _Staged:
        """Copy `values` into a staging buffer; if the pool is full, hand queued writes to the writers
        (`before_waiting`) so that they can free buffers, then wait."""
        pinned = values.is_cuda and self._side_stream is not None
        nbytes = values.numel() * values.element_size()
        buffer = self.staging.acquire(nbytes, pinned, wait=False)
        if buffer is None:
            before_waiting()
            buffer = self.staging.acquire(nbytes, pinned)
        staged = buffer.view(values.dtype).view(values.shape)
        if not pinned:
            staged.copy_(values)
            return _Staged(staged, buffer)
        self._side_stream.wait_stream(torch.cuda.current_stream(values.device))
        with torch.cuda.stream(self._side_stream):
            staged.copy_(values, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        return _Staged(staged, buffer, event)

    def _write_chunk(self, plan: SavePlan, job: ChunkJob, staged: _Staged | None) -> None:
        staged = staged or _Staged(job.source())
        try:
            staged.wait_ready()
            key = f"{step_dirname(plan.step)}/{job.meta.path}/{job.meta.chunk_key(job.index)}"
            plan.storage.write(key, codec.encode(job.meta, job.index, staged.values))
        finally:
            if staged.buffer is not None:
                self.staging.release(staged.buffer)

    def _complete(self, plan: SavePlan, writes: list[cf.Future]) -> CommitRecord | None:
        wait_all(writes)
        return plan.finish()


def _write_json(storage: Storage, key: str, doc: Callable[[], dict]) -> None:
    storage.write(key, [dumps(doc())])


def _cancel(futures: list[cf.Future]) -> None:
    for f in futures:
        f.cancel()
    cf.wait(futures)  # let running writes end before the caller reuses their buffers
