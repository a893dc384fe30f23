"""Async and lazy saves: the snapshot is consistent, errors surface, staging memory is bounded and reused.

The tests that hold or fail writes with a Storage subclass run on writer threads (a subclass's behaviour stays
in this process); the writer process is held and failed for real: SIGSTOP/SIGKILL, a directory in the way.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import random
import signal
import threading
import time

import pytest
import torch

import ucp
from ucp.engine import staging
from ucp.engine.staging import StagingPool
from ucp.engine.writer_process import SUPPORTED as PROCESS_WRITER_SUPPORTED
from ucp.protocol import commit
from ucp.storage import LocalStorage

from .helpers import assert_same_state

OPTIONS = ucp.SaveOptions(
    chunking=ucp.ChunkingPolicy(object_bytes=64 * 1024, inner_bytes=16 * 1024), fsync=False, io_threads=4
)


def make_state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"model": {f"w{i}": torch.randn(128, 256, generator=g) for i in range(6)}, "step": seed}


class SlowStorage(LocalStorage):
    """Real files, with every chunk write held until the test opens the gate."""

    def __init__(self, root: str):
        super().__init__(root, fsync=False)
        self.gate = threading.Event()

    def write(self, key, parts):
        if "/c." in key:
            self.gate.wait(timeout=30)
        super().write(key, parts)


def manager_with(storage: LocalStorage, **kwargs) -> ucp.CheckpointManager:
    manager = ucp.CheckpointManager(storage.root, options=OPTIONS, writer="threads", **kwargs)
    manager.storage = storage
    return manager


@pytest.mark.parametrize("mode", ["async", "lazy"])
def test_snapshot_is_taken_before_training_changes_the_tensors(tmp_path, mode):
    """The tensors and the JSON values (a loader's position, a scheduler's groups: kept by reference before, so an
    async save wrote what training had made of them by its commit)."""
    storage = SlowStorage(str(tmp_path))
    manager = manager_with(storage, mode=mode)
    state = make_state()
    state["loader"] = {"position": 100, "history": [1, 2], "groups": [{"lr": 0.1}], "order": (3, [4])}
    expected = {
        "model": {k: v.clone() for k, v in state["model"].items()},
        "step": 0,
        "loader": {"position": 100, "history": [1, 2], "groups": [{"lr": 0.1}], "order": [3, [4]]},
    }
    handle = manager.save(1, state)
    handle.wait_snapshot()
    assert not handle.done(), "writes are held, so the save cannot have finished"
    assert manager.steps() == []
    for t in state["model"].values():  # the optimizer step
        t.add_(1.0)
    state["loader"]["position"] = 200  # the data loader and the scheduler move on, in place
    state["loader"]["history"].append(3)
    state["loader"]["groups"][0]["lr"] = 0.05
    state["loader"]["order"][1].append(5)
    storage.gate.set()
    record = manager.wait()
    assert record.step == 1 and manager.steps() == [1]
    assert_same_state(expected, manager.restore())
    manager.close()


def test_async_save_blocks_for_the_snapshot_only(tmp_path):
    storage = SlowStorage(str(tmp_path))
    manager = manager_with(storage, mode="async")
    handle = manager.save(1, make_state())
    assert handle.mode == "async" and handle.blocking_s < 10 and not handle.done()
    storage.gate.set()
    assert handle.result().step == 1
    manager.close()


def test_a_new_save_waits_for_the_one_in_flight(tmp_path):
    storage = SlowStorage(str(tmp_path))
    manager = manager_with(storage, mode="async")
    first = manager.save(1, make_state(1))
    threading.Timer(0.5, storage.gate.set).start()
    second = manager.save(2, make_state(2))  # waits for step 1 to commit first
    assert first.done() and manager.steps()[0] == 1
    second.result()
    assert manager.steps() == [1, 2]
    assert_same_state(make_state(2), manager.restore())
    manager.close()


def wait_until(condition, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_an_abandoned_save_returns_at_once_and_never_commits(tmp_path):
    # A job that lost a peer abandons its save in flight (its collectives could not complete) and goes on from an
    # earlier step: that save must not commit later, behind the job's back.
    storage = SlowStorage(str(tmp_path))
    manager = manager_with(storage, mode="async")
    handle = manager.save(1, make_state())
    start = time.monotonic()
    manager.abandon()  # the writes are held: it must not wait for them
    assert time.monotonic() - start < 5 and not handle.done()
    storage.gate.set()  # the save now runs to its end, and removes its attempt instead of committing
    wait_until(handle.done)
    with pytest.raises(ucp.UcpError, match="step 1 was abandoned"):
        handle.result()
    assert ucp.CheckpointManager(str(tmp_path), options=OPTIONS).steps() == []
    step_dir = tmp_path / commit.step_dirname(1)
    assert not step_dir.exists() or not any(step_dir.iterdir()), "the attempt is removed"


class FailingStorage(LocalStorage):
    def write(self, key, parts):
        if "/c." in key:
            raise OSError(28, "No space left on device", key)
        super().write(key, parts)


@pytest.mark.parametrize("mode", ["async", "lazy"])
def test_a_failed_background_write_is_never_silent(tmp_path, mode):
    manager = manager_with(FailingStorage(str(tmp_path), fsync=False), mode=mode)
    manager.save(1, make_state())
    with pytest.raises(ucp.StorageError, match="step 1 was not saved .*No space left"):
        manager.wait()
    assert manager.steps() == []
    manager.save(2, make_state())
    with pytest.raises(ucp.StorageError, match="step 2 was not saved .*No space left"):
        manager.save(3, make_state())  # the error of step 2 surfaces at the next save
    assert manager.steps() == []
    manager.storage = LocalStorage(str(tmp_path), fsync=False)
    manager.save(4, make_state(4))
    manager.wait()
    assert manager.steps() == [4]  # the failed steps never became visible
    manager.close()


@pytest.mark.parametrize("mode", ["async", "lazy"])
def test_a_failure_the_caller_was_handed_fails_nothing_after_it(tmp_path, mode):
    """A save's error raised by `handle.result()` is the caller's now: the next save and `close` do not raise it
    again (they did: the next save failed with the previous one's error, and `close` raised it once more)."""
    manager = manager_with(FailingStorage(str(tmp_path), fsync=False), mode=mode)
    handle = manager.save(1, make_state())
    with pytest.raises(ucp.StorageError, match="step 1 was not saved"):
        handle.result()
    with pytest.raises(ucp.StorageError, match="step 1 was not saved"):
        handle.result()  # (the handle itself keeps saying so)
    manager.storage = LocalStorage(str(tmp_path), fsync=False)
    manager.save(2, make_state(2)).result()
    manager.close()
    assert manager.steps() == [2]


WRITERS = ["threads", "process"] if PROCESS_WRITER_SUPPORTED else ["threads"]
needs_process_writer = pytest.mark.skipif(not PROCESS_WRITER_SUPPORTED, reason="the writer process needs Linux memfd")


@pytest.mark.parametrize("writer", WRITERS)
def test_staging_memory_is_bounded_and_reused(tmp_path, writer):
    chunk_bytes = 64 * 1024
    manager = ucp.CheckpointManager(
        str(tmp_path), options=OPTIONS, mode="async", staging_bytes=3 * chunk_bytes, writer=writer
    )
    arenas = None
    for step in (1, 2, 3):
        handle = manager.save(step, make_state(step))
        manager.wait()
        assert handle.writer == writer
        assert 0 < manager.pipeline.staging.allocated_bytes <= 3 * chunk_bytes
        arenas = arenas or list(manager.pipeline.staging.arenas)
        assert manager.pipeline.staging.arenas == arenas, "the same memory serves every save"
    assert manager.steps() == [1, 2, 3]
    assert_same_state(make_state(3), manager.restore())
    manager.close()


class WaitingStorage(LocalStorage):
    """Real files, each write waiting as a request to an object store does (and small writes not sent to one lane,
    as such a store declares); counts the writes of each kind in flight at once."""

    def __init__(self, root: str, wait_s: float):
        super().__init__(root, fsync=False)
        self.capabilities = dataclasses.replace(self.capabilities, serial_small_writes=False)
        self.wait_s = wait_s
        self.lock = threading.Lock()
        self.now = {"chunk": 0, "document": 0}
        self.most = {"chunk": 0, "document": 0}

    def write(self, key, parts):
        kind = "document" if key.endswith("zarr.json") else "chunk" if "/c." in key else None
        if kind is not None:
            with self.lock:
                self.now[kind] += 1
                self.most[kind] = max(self.most[kind], self.now[kind])
        try:
            time.sleep(self.wait_s)
            super().write(key, parts)
        finally:
            if kind is not None:
                with self.lock:
                    self.now[kind] -= 1


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_writer_threads_keep_small_objects_in_flight_many_at_once(tmp_path, mode):
    # Where each write waits (a request to an object store), small objects written one after another in a task
    # (batched as for a disk) left the save's tail to a few threads: the documents of 300 atoms, 64 to a task, took
    # five requests' time for every one the pool could have had in flight
    threads, atoms = random.choice([8, 16]), random.randint(150, 300)
    storage = WaitingStorage(str(tmp_path), wait_s=0.01)
    options = dataclasses.replace(OPTIONS, io_threads=threads, chunking=ucp.ChunkingPolicy(pack_below=0))
    manager = ucp.CheckpointManager(storage.root, options=options, writer="threads", mode=mode)
    manager.storage = storage
    state = {"model": {f"w{i}": torch.randn(16, 16) for i in range(atoms)}}
    manager.save(1, state)
    manager.wait()
    assert min(storage.most.values()) >= 3 * threads // 4, storage.most
    assert_same_state(state, manager.restore())
    manager.close()


def test_staging_pool_reuses_arenas_and_refuses_oversized_chunks():
    pool = StagingPool(capacity=1000)
    a, b = pool.acquire(300), pool.acquire(300)
    assert b.offset >= a.offset + 300 and b.memory.data_ptr() != a.memory.data_ptr()
    assert pool.acquire(600, wait=False) is None, "full until the arena's slots are released"
    pool.release(a)
    pool.release(b)
    c = pool.acquire(600)
    assert c.memory.data_ptr() == a.memory.data_ptr() and pool.allocated_bytes == 1000
    with pytest.raises(ucp.UcpError, match="smaller than one chunk"):
        pool.acquire(2000)


def test_staging_pool_gives_up_empty_arenas_for_a_larger_chunk(monkeypatch):
    monkeypatch.setattr(staging, "ARENA_BYTES", 400)
    dropped = []
    pool = StagingPool(capacity=1000, on_drop=dropped.append)
    a, b = pool.acquire(300), pool.acquire(300)
    assert a.arena is not b.arena and pool.allocated_bytes == 800
    pool.release(a)
    pool.release(b)
    c = pool.acquire(700)  # fits only once both empty arenas are given up
    assert dropped == [a.arena, b.arena] and pool.arenas == [c.arena] and pool.allocated_bytes == 700


def test_unknown_mode_is_refused(tmp_path):
    manager = ucp.CheckpointManager(str(tmp_path))
    with pytest.raises(ucp.UcpError, match="save mode"):
        manager.save(1, make_state(), mode="eventually")
    manager.close()


# ------------------------------------------------------------------------------------ the writer process


@contextlib.contextmanager
def writer_stopped(manager: ucp.CheckpointManager):
    """SIGSTOP the manager's writer process for the block: nothing is written until it ends."""
    pid = manager.pipeline.writer_pid
    os.kill(pid, signal.SIGSTOP)
    try:
        yield pid
    finally:
        os.kill(pid, signal.SIGCONT)


def process_manager(url: str, **kwargs) -> ucp.CheckpointManager:
    manager = ucp.CheckpointManager(url, options=OPTIONS, mode="async", writer="process", **kwargs)
    assert manager.pipeline.writer_pid is not None, "an async manager starts its writer process at once"
    return manager


@needs_process_writer
def test_writer_process_writes_the_snapshot_while_training_changes_the_tensors(tmp_path):
    manager = process_manager(str(tmp_path))
    manager.storage.stats.write_log = []
    with writer_stopped(manager):
        state = make_state()
        expected = {"model": {k: v.clone() for k, v in state["model"].items()}, "step": 0}
        handle = manager.save(1, state)
        assert handle.writer == "process" and not handle.done()
        for t in state["model"].values():
            t.add_(1.0)
    assert manager.wait().step == 1
    assert_same_state(expected, manager.restore())
    chunk_keys = [k for k in manager.storage.stats.write_log if "/c." in k]
    objects = ucp.open_checkpoint(str(tmp_path)).chunk_count()  # (its chunk objects and packs)
    assert len(chunk_keys) == objects >= 1 and len(set(chunk_keys)) == len(chunk_keys), (
        "the child's writes are counted here"
    )
    manager.close()


@contextlib.contextmanager
def file_size_limit(nbytes: int):
    """Processes started inside inherit a limit on the size of a file they write (EFBIG past it, as ENOSPC on a
    full disk); this process gets its own limit back on leaving."""
    import resource

    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # (an ignored signal stays ignored across exec)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, old_handler)


@needs_process_writer
def test_a_failed_write_in_the_writer_process_surfaces_and_commits_nothing(tmp_path):
    with file_size_limit(4096):  # the writer process starts here: its chunk writes fail, this process's do not
        manager = process_manager(str(tmp_path))
    manager.save(1, make_state())
    with pytest.raises(ucp.StorageError, match="step 1 was not saved .*step_00000001/attempt-.*/c.* File too large"):
        manager.wait()
    assert manager.steps() == [] and not (tmp_path / "step_00000001").exists()
    manager.pipeline.stop_writer()  # a writer without the limit next
    manager.save(2, make_state(2))
    manager.wait()
    assert manager.steps() == [2]
    assert_same_state(make_state(2), manager.restore())
    manager.close()


@needs_process_writer
def test_a_killed_writer_process_fails_the_save_and_the_next_save_restarts_it(tmp_path):
    chunk_bytes = 64 * 1024
    manager = process_manager(str(tmp_path), staging_bytes=16 * chunk_bytes)  # one save fits; a leak would not
    with writer_stopped(manager) as first_pid:
        manager.save(1, make_state(1))
        os.kill(first_pid, signal.SIGKILL)
    with pytest.raises(ucp.WriterProcessError, match=r"writer process \(pid \d+\) died"):
        manager.wait()
    assert manager.steps() == []
    assert [a.live for a in manager.pipeline.staging.arenas] == [0] * len(manager.pipeline.staging.arenas)
    handle = manager.save(2, make_state(2))
    assert handle.result(timeout=60).step == 2
    assert handle.writer == "process" and manager.pipeline.writer_pid != first_pid
    assert manager.steps() == [2]
    assert_same_state(make_state(2), manager.restore())
    manager.close()


@needs_process_writer
def test_abandoning_kills_the_writer_process_and_commits_nothing(tmp_path):
    manager = process_manager(str(tmp_path))
    pid = manager.pipeline.writer_pid
    os.kill(pid, signal.SIGSTOP)  # nothing is written (the kill ends a stopped process too)
    handle = manager.save(1, make_state(1))
    start = time.monotonic()
    manager.abandon()
    assert time.monotonic() - start < 5
    wait_until(lambda: not os.path.exists(f"/proc/{pid}"))
    wait_until(handle.done)
    with pytest.raises(ucp.WriterProcessError):
        handle.result()
    assert ucp.CheckpointManager(str(tmp_path), options=OPTIONS).steps() == []


@needs_process_writer
def test_writer_process_saves_to_s3(s3_bucket):
    bucket, options = s3_bucket
    manager = ucp.CheckpointManager(
        f"s3://{bucket}/run", options=OPTIONS, mode="lazy", writer="process", storage_options=options
    )
    handle = manager.save(1, make_state(1))
    handle.wait_snapshot()
    manager.wait()
    assert handle.writer == "process" and manager.steps() == [1]
    assert_same_state(make_state(1), manager.restore())
    manager.close()


def test_memory_storage_stays_on_writer_threads():
    manager = ucp.CheckpointManager("memory://ucp-async-test", options=OPTIONS, mode="async")
    handle = manager.save(1, make_state(1))
    manager.wait()
    assert handle.writer == "threads"
    assert_same_state(make_state(1), manager.restore())
    manager.close()


@pytest.mark.parametrize("abandon", [False, True])
def test_a_save_s_result_can_be_asked_from_two_threads(tmp_path, abandon):
    """`result()` from the caller and from another thread (abandon's release thread is one): both get the outcome.
    Before, the second could find the future dropped by the first between its check and its use (AttributeError)."""
    manager = ucp.CheckpointManager(str(tmp_path), mode="async", writer="threads", options=OPTIONS)
    for step in range(20):
        handle = manager.save(step, make_state(step))
        outcomes: list = []

        def outcome(handle=handle, outcomes=outcomes) -> None:
            try:
                outcomes.append(handle.result())
            except Exception as e:  # noqa: BLE001 -- what it raised is the outcome
                outcomes.append(e)

        other = threading.Thread(target=outcome)
        other.start()
        if abandon and step == 19:
            manager.abandon()
        outcome()
        other.join()
        assert not [o for o in outcomes if isinstance(o, AttributeError)], outcomes
        if not (abandon and step == 19):
            assert [o.step for o in outcomes] == [step, step]
    if not abandon:
        manager.close()


def test_a_lazy_snapshot_that_fails_is_reported_by_wait_snapshot(tmp_path):
    """(wait_snapshot returned as if the snapshot were complete: the failure reached the future only later.)"""
    manager = ucp.CheckpointManager(str(tmp_path), mode="lazy", writer="threads", staging_bytes=1 << 20)
    handle = manager.save(0, {"w": torch.randn(1000, 1000)})  # (a 4 MB chunk: more than the staging pool holds)
    with pytest.raises(ucp.UcpError, match="staging"):
        handle.wait_snapshot()
    with pytest.raises(ucp.UcpError, match="staging"):
        handle.result()
    assert manager.steps() == []
    manager.close()
