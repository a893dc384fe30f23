"""What a saver is told is what the store holds. A proxy in front of the S3 server fails one request of a save at a
time, of every kind a save sends (chunks, zarr.json, the owner record, the commit marker, deletes, listings, other
reads), before forwarding it (the store unchanged), after (the store changed, the client sees an error and its retry
meets its own first success) or by resetting the connection after forwarding it. Each save either commits and says
so and loads bitwise, or fails and leaves no committed step, and the next save of that step then succeeds. The
commit marker's lost answer is also run deterministically (it once left a committed step that could never load)."""

from __future__ import annotations

import random
import time

import pytest
import torch

import ucp
from ucp.errors import StepExistsError, StorageError, UcpError
from ucp.format.manifest import ATTEMPT_RECORD, StepManifest
from ucp.protocol import commit
from ucp.protocol.session import SaveSession
from ucp.storage import LocalStorage, open_storage

from .helpers import DRAW, assert_same_state
from .s3_proxy import KINDS, MODES, FaultProxy

TRIALS = 20  # per kind of request
OPTIONS = ucp.SaveOptions(chunking=ucp.ChunkingPolicy(object_bytes=4096, inner_bytes=1024), io_threads=8)


def state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"model": {f"w{i}": torch.randn(16, 64, generator=g) for i in range(3)}, "seed": seed}


def through(options: dict, proxy: FaultProxy) -> dict:
    """`options` with every request going through the proxy; 3 tries a request, as ucp's default, but quick ones."""
    config = {"retries": {"max_attempts": 3, "mode": "standard"}, "connect_timeout": 5, "read_timeout": 20}
    return {**options, "endpoint_url": proxy.url, "config_kwargs": config}


def committed(url: str, options: dict) -> list[int]:
    return commit.committed_steps(open_storage(url, options))


def test_a_lost_answer_to_the_commit_is_a_commit(s3_bucket, proxy):
    """The marker's put reaches the store, but the client sees a 500 (or a reset connection) and retries: the retry
    is refused (412, the marker exists), and the save reads the marker back and finds its own."""
    bucket, options = s3_bucket
    for mode in ("after", "reset"):
        url = f"s3://{bucket}/lost-{mode}"
        manager = ucp.CheckpointManager(url, keep_last=2, storage_options=through(options, proxy), options=OPTIONS)
        proxy.arm("marker", 1, mode)
        record = manager.save(7, state(7)).result()
        assert proxy.fired and proxy.fired[0][0] == "marker", "the fault was not injected"
        assert record is not None and record.step == 7
        assert manager.after_commit_errors == []
        assert committed(url, options) == [7]
        assert_same_state(state(7), ucp.load(url, storage_options=options))
        with pytest.raises(StepExistsError):
            manager.save(7, state(8))
        assert manager.gc() == []
        assert_same_state(state(7), ucp.load(url, storage_options=options))
        manager.close()


def test_a_store_error_on_a_key_holding_412_is_not_a_step_that_exists(s3_bucket, proxy):
    """Errors are told apart by the status botocore parsed, not by the text: a failed create of step 412's marker
    (every try answered 500) is a StorageError with its cause, never StepExistsError."""
    bucket, options = s3_bucket
    url = f"s3://{bucket}/status"
    proxy.arm("marker", 1, "before", times=1000)  # (every try of every create)
    with pytest.raises(StorageError) as failure:
        ucp.save(state(1), url, step=412, storage_options=through(options, proxy), options=OPTIONS)
    assert not isinstance(failure.value, StepExistsError)
    assert "injected by the test's proxy" in str(failure.value) and failure.value.__cause__ is not None
    assert committed(url, options) == []
    ucp.save(state(1), url, step=412, storage_options=options, options=OPTIONS)
    assert_same_state(state(1), ucp.load(url, storage_options=options))


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_work_after_a_commit_never_fails_the_save(s3_bucket, proxy, mode, caplog):
    """Retention cannot delete (every delete refused): the save that committed says so, and what failed after it
    is logged and kept on the handle and the manager."""
    bucket, options = s3_bucket
    url = f"s3://{bucket}/after-{mode}"
    manager = ucp.CheckpointManager(
        url, keep_last=1, mode=mode, writer="threads", storage_options=through(options, proxy), options=OPTIONS
    )
    manager.save(0, state(0)).result()
    proxy.arm("delete", 1, "before", times=1000)
    handle = manager.save(1, state(1))
    record = handle.result()
    manager.close()
    assert record is not None and record.step == 1
    assert proxy.fired, "no delete was refused"
    assert handle.after_commit_errors and all(isinstance(e, UcpError) for e in handle.after_commit_errors)
    assert manager.after_commit_errors == handle.after_commit_errors
    assert "is committed, but the work after its commit failed" in caplog.text
    assert committed(url, options) == [0, 1]  # (retention will try again after the next commit)
    assert_same_state(state(1), ucp.load(url, storage_options=options))


@pytest.mark.slow
@pytest.mark.parametrize("kind", [k for k in KINDS if k != "clock"])
def test_every_outcome_a_saver_is_told_is_true(s3_bucket, proxy, kind):
    bucket, options = s3_bucket
    proxied = through(options, proxy)
    rng = random.Random(DRAW.randrange(2**32))
    # How many requests of this kind a save with retention sends, to draw which one fails
    calibration = f"s3://{bucket}/{kind}-calibration"
    manager = ucp.CheckpointManager(calibration, keep_last=1, storage_options=proxied, options=OPTIONS)
    manager.save(0, state(0))
    proxy.counts.clear()
    manager.save(1, state(1))
    manager.close()
    sent = proxy.counts[kind]
    assert sent > 0, f"a save sends no {kind} request: {dict(proxy.counts)}"
    told = {"committed": 0, "failed": 0}
    for trial in range(TRIALS):
        url = f"s3://{bucket}/{kind}-{trial}"
        manager = ucp.CheckpointManager(url, keep_last=1, storage_options=proxied, options=OPTIONS)
        manager.save(0, state(0))
        mode, nth, times = rng.choice(MODES), rng.randint(1, sent), rng.choice([1, 2, 3])
        proxy.arm(kind, nth, mode, times)
        what = f"trial {trial}: the {nth}th {kind} request failed {times}x {mode} forwarding"
        try:
            manager.save(1, state(100 + trial))
            outcome = "committed"
        except UcpError as e:
            outcome = "failed"
            assert not isinstance(e, StepExistsError), f"{what}: {e}"
        finally:
            proxy.disarm()
            manager.close()
        told[outcome] += 1
        steps = committed(url, options)
        for step in steps:  # whatever is committed loads
            ucp.load(url, step=step, storage_options=options)
        if outcome == "committed":
            assert steps == [1], f"{what}: told committed, the store holds {steps}"
            assert_same_state(state(100 + trial), ucp.load(url, storage_options=options))
        else:
            assert 1 not in steps, f"{what}: told it failed, but step 1 is committed"
            ucp.save(state(200 + trial), url, step=1, storage_options=options, options=OPTIONS)
            assert_same_state(state(200 + trial), ucp.load(url, storage_options=options))
    assert sum(told.values()) == TRIALS


# ------------------------------------------------------------------------------------ the same rules, locally


class LandsThenFails(LocalStorage):
    """A store whose first exclusive create of a marker lands and then reports an error (the answer lost)."""

    lost = 0

    def create_exclusive(self, key: str, data: bytes) -> None:
        super().create_exclusive(key, data)
        if key.endswith("ucp-commit.json") and self.lost < 1:
            self.lost += 1
            raise StorageError(f"cannot create {key}: connection reset (the request had reached the store)")


def test_a_commit_whose_answer_is_lost_locally_is_a_commit(tmp_path):
    storage = LandsThenFails(str(tmp_path))
    record = ucp.save(state(3), str(tmp_path), step=3, storage=storage)
    assert storage.lost == 1 and record.step == 3
    assert_same_state(state(3), ucp.load(str(tmp_path)))


@pytest.mark.parametrize("unreadable", [1, commit.COMMIT_TRIES, commit.COMMIT_TRIES + 1, commit.COMMIT_TRIES + 3])
def test_a_commit_whose_answer_and_read_backs_are_lost_is_told_as_the_store_holds_it(tmp_path, unreadable):
    """The marker lands, its create's answer is lost, and the next `unreadable` reads of it fail: the save reads it
    again while it may (each try of the create, then once more) and reports the commit it finds. Before, the first
    failed read-back failed the save, whose clean-up then found the step committed (and only logged it)."""

    class Unreadable(LandsThenFails):
        failing = 0

        def create_exclusive(self, key: str, data: bytes) -> None:
            if key.endswith("ucp-commit.json") and not self.lost:
                self.failing = unreadable
            super().create_exclusive(key, data)

        def read(self, key: str, start: int = 0, end: int | None = None) -> memoryview:
            if key.endswith("ucp-commit.json") and self.failing:
                self.failing -= 1
                raise StorageError(f"cannot read {key}: connection reset")
            return super().read(key, start, end)

    storage = Unreadable(str(tmp_path))
    try:
        told = ucp.save(state(3), str(tmp_path), step=3, storage=storage).step
    except StorageError as e:
        assert "is unknown" in str(e), e
        told = None
    assert storage.lost == 1
    if unreadable <= commit.COMMIT_TRIES:
        assert told == 3  # (what the store holds, read back in time)
    assert ucp.CheckpointManager(str(tmp_path)).steps() == [3]  # (what it holds: told, or said to be unknown)
    assert_same_state(state(3), ucp.load(str(tmp_path)))


def test_create_once_tells_its_own_object_from_anothers(tmp_path):
    storage = LandsThenFails(str(tmp_path))
    assert commit.create_once(storage, "a/ucp-commit.json", b"mine")  # landed, answer lost, read back: ours
    assert not commit.create_once(storage, "a/ucp-commit.json", b"theirs")
    assert bytes(storage.read("a/ucp-commit.json")) == b"mine"


def test_an_abort_never_removes_the_attempt_a_marker_names(tmp_path):
    """Even when the save's own bookkeeping failed after its commit landed."""
    storage = open_storage(str(tmp_path))
    session = SaveSession.begin(storage, 4)
    storage.write(f"{session.prefix}/zarr.json", [b"{}"])
    commit.commit(storage, 4, session.attempt, b"{}", 0, 0)
    session.abort(RuntimeError("a failure after the commit landed"))
    assert storage.exists(f"{session.prefix}/zarr.json")


def test_a_save_whose_lease_ran_out_does_not_commit(tmp_path):
    """A saver cut off from the store cannot renew its lease; once gc may judge it dead, it must not commit (gc
    may have removed its attempt): the save fails, and the step stays uncommitted."""

    class Unrenewable(LocalStorage):
        def write(self, key, parts):
            if key.endswith(ATTEMPT_RECORD) and self.exists(key):
                raise StorageError(f"cannot write {key}: the store is unreachable")
            super().write(key, parts)

    storage = Unrenewable(str(tmp_path))
    session = SaveSession.begin(storage, 5, lease_s=0.3)
    time.sleep(0.45)
    with pytest.raises(StorageError, match="lease"):
        session.finish(StepManifest(step=5, tree={}, atoms={}))
    assert commit.committed_steps(storage) == []


@pytest.mark.parametrize("removable", [True, False])
def test_a_failed_save_says_whether_what_it_wrote_was_removed(tmp_path, removable):
    """(It said "removed" whatever its removal did: a store that refused the deletes too kept the attempt.)"""

    class Refusing(LocalStorage):
        def write(self, key, parts):
            if "/c." in key:
                raise StorageError(f"cannot write {key}: InternalError")
            super().write(key, parts)

        def delete(self, key):
            if not removable:
                raise StorageError(f"cannot delete {key}: InternalError")
            super().delete(key)

    storage = Refusing(str(tmp_path))
    said = "was removed" if removable else "is left to garbage collection"
    with pytest.raises(StorageError, match=f"step 3 was not saved at .*, and what this attempt wrote {said}"):
        ucp.save(state(3), str(tmp_path), step=3, storage=storage, options=OPTIONS)
    left = [p for p in tmp_path.glob("step_*/attempt-*")]
    assert (left == []) == removable, left
