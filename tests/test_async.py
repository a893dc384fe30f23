"""Async and lazy saves: the snapshot is consistent, errors surface, staging memory is bounded and reused."""

from __future__ import annotations

import threading

import pytest
import torch

import ucp
from ucp.pipeline import StagingPool
from ucp.storage import LocalStorage

from .helpers import assert_same_state

OPTIONS = ucp.SaveOptions(chunking=ucp.ChunkingPolicy(object_bytes=64 * 1024, inner_bytes=16 * 1024), fsync=False, io_threads=4)


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
    manager = ucp.CheckpointManager(storage.root, options=OPTIONS, **kwargs)
    manager.storage = storage
    return manager


@pytest.mark.parametrize("mode", ["async", "lazy"])
def test_snapshot_is_taken_before_training_changes_the_tensors(tmp_path, mode):
    storage = SlowStorage(str(tmp_path))
    manager = manager_with(storage, mode=mode)
    state = make_state()
    expected = {"model": {k: v.clone() for k, v in state["model"].items()}, "step": 0}
    handle = manager.save(1, state)
    handle.wait_snapshot()
    assert not handle.done(), "writes are held, so the save cannot have finished"
    assert manager.steps() == []
    for t in state["model"].values():  # the optimizer step
        t.add_(1.0)
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


class FailingStorage(LocalStorage):
    def write(self, key, parts):
        if "/c." in key:
            raise OSError(28, "No space left on device", key)
        super().write(key, parts)


@pytest.mark.parametrize("mode", ["async", "lazy"])
def test_a_failed_background_write_is_never_silent(tmp_path, mode):
    manager = manager_with(FailingStorage(str(tmp_path), fsync=False), mode=mode)
    manager.save(1, make_state())
    with pytest.raises(OSError, match="No space left"):
        manager.wait()
    assert manager.steps() == []
    manager.save(2, make_state())
    with pytest.raises(OSError, match="No space left"):
        manager.save(3, make_state())  # the error of step 2 surfaces at the next save
    assert manager.steps() == []
    manager.storage = LocalStorage(str(tmp_path), fsync=False)
    manager.save(4, make_state(4))
    manager.wait()
    assert manager.steps() == [4]  # the failed steps never became visible
    manager.close()


def test_staging_memory_is_bounded_and_reused(tmp_path):
    chunk_bytes = 64 * 1024
    manager = ucp.CheckpointManager(str(tmp_path), options=OPTIONS, mode="async", staging_bytes=3 * chunk_bytes)
    for step in (1, 2, 3):
        manager.save(step, make_state(step))
        manager.wait()
        assert 0 < manager.pipeline.staging.allocated_bytes <= 3 * chunk_bytes
    assert manager.steps() == [1, 2, 3]
    assert_same_state(make_state(3), manager.restore())
    manager.close()


def test_staging_pool_reuses_buffers_and_refuses_oversized_chunks():
    pool = StagingPool(capacity=1000)
    a = pool.acquire(600, pinned=False)
    pool.release(a)
    assert pool.acquire(600, pinned=False).data_ptr() == a.data_ptr()
    with pytest.raises(ucp.UcpError, match="smaller than one chunk"):
        pool.acquire(2000, pinned=False)


def test_unknown_mode_is_refused(tmp_path):
    manager = ucp.CheckpointManager(str(tmp_path))
    with pytest.raises(ucp.UcpError, match="save mode"):
        manager.save(1, make_state(), mode="eventually")
    manager.close()
