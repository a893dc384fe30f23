"""Save attempts and their owners: which uncommitted attempts the manager's start and `gc()` remove (no live
owner), and which they keep (a save that may still be running, here or on another host)."""

from __future__ import annotations

import dataclasses
import json
import os
import random
import subprocess
import sys
import time

import torch

import ucp
from ucp.format.manifest import COMMIT_MARKER, StepManifest, step_dirname
from ucp.protocol import attempt
from ucp.protocol.session import SaveSession
from ucp.storage import open_storage


def make_attempt(root, step: int, **changes) -> str:
    """An uncommitted attempt of `step` with one chunk written, owned as `changes` say (default: this process)."""
    storage = open_storage(str(root))
    record = dataclasses.replace(attempt.OwnerRecord.mine(step, attempt.new_attempt_id(), 300.0), **changes)
    attempt.write_owner(storage, record)
    storage.write(f"{step_dirname(step)}/{record.attempt}/model/w/c.0", [b"partial"])
    return f"{step_dirname(step)}/{record.attempt}"


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def age(root, key: str, seconds: float) -> None:
    """Make everything at and below `key` look last written `seconds` ago (what the store's clock says)."""
    then = time.time() - seconds
    os.utime(root / key, (then, then))
    for directory, _, files in os.walk(root / key):
        for name in [*files, "."]:
            os.utime(os.path.join(directory, name), (then, then))


def test_what_gc_removes_and_what_it_keeps(tmp_path):
    ucp.save({"w": torch.ones(2)}, str(tmp_path), step=1)
    elsewhere = {"host": "another-host", "boot_id": "another-boot", "pid": 1}
    dead = make_attempt(tmp_path, 2, pid=dead_pid())
    reused_pid = make_attempt(tmp_path, 3, pid_start=1)  # our pid, but a process that started at another time
    alive = make_attempt(tmp_path, 4)  # this process: a save in progress
    # Another host's lease is judged by when the store last saw its record written, never by that host's clock:
    expired = make_attempt(tmp_path, 5, renewed_at=time.time() + 86400, **elsewhere)  # its clock a day ahead
    age(tmp_path, expired + "/ucp-attempt.json", 301)
    leased = make_attempt(tmp_path, 6, renewed_at=time.time() - 86400, **elsewhere)  # its clock a day behind
    loser_alive = make_attempt(tmp_path, 1)  # its step was committed by another attempt, but it may still write
    loser_dead = make_attempt(tmp_path, 1, pid=dead_pid())
    orphan_old, orphan_new, orphan_written = (
        make_attempt(tmp_path, 7),
        make_attempt(tmp_path, 8),
        make_attempt(tmp_path, 9),
    )
    for orphan in (orphan_old, orphan_new, orphan_written):  # writes that outlived their attempt's removal
        os.remove(tmp_path / orphan / "ucp-attempt.json")
    age(tmp_path, orphan_old, 120)
    age(tmp_path, orphan_written, 120)
    (tmp_path / orphan_written / "model" / "w" / "c.1").write_bytes(b"late")  # a write just now, deep below it

    removed = attempt.collect_garbage(open_storage(str(tmp_path)))
    assert sorted(removed) == sorted([dead, reused_pid, expired, loser_dead, orphan_old])
    assert ucp.CheckpointManager(str(tmp_path)).gc() == []  # (a manager collects on start: nothing is left)
    for key in (alive, leased, loser_alive, orphan_new, orphan_written):
        assert (tmp_path / key).exists(), key
    assert not (tmp_path / step_dirname(2)).exists(), "an empty step directory goes with its last attempt"
    assert ucp.load(str(tmp_path))["w"].tolist() == [1.0, 1.0]


def test_gc_never_removes_the_attempt_a_marker_names(tmp_path):
    """Even with its owner gone: a commit whose answer was lost may have landed after its saver gave up."""
    ucp.save({"w": torch.ones(2)}, str(tmp_path), step=1)
    storage = open_storage(str(tmp_path))
    reader = ucp.open_checkpoint(str(tmp_path))
    record = dataclasses.replace(attempt.OwnerRecord.mine(1, reader.record.attempt, 300.0), pid=dead_pid())
    attempt.write_owner(storage, record)
    assert attempt.collect_garbage(storage) == []
    assert ucp.load(str(tmp_path))["w"].tolist() == [1.0, 1.0]


def test_a_step_with_a_damaged_marker_is_never_touched(tmp_path):
    ucp.save({"w": torch.ones(2)}, str(tmp_path), step=1)
    dead = make_attempt(tmp_path, 2, pid=dead_pid())
    (tmp_path / step_dirname(2) / COMMIT_MARKER).write_text('{"torn')
    assert ucp.CheckpointManager(str(tmp_path)).gc() == []
    assert (tmp_path / dead).exists()
    assert ucp.CheckpointManager(str(tmp_path)).steps() == [1]


def test_format_1_leftovers_go_below_the_latest_commit_only(tmp_path):
    ucp.save({"w": torch.ones(2)}, str(tmp_path), step=5)
    for step in (3, 7):  # an interrupted 1.0 save: data straight in the step directory, no marker
        (tmp_path / step_dirname(step) / "w").mkdir(parents=True)
        (tmp_path / step_dirname(step) / "zarr.json").write_text("{}")
    removed = attempt.collect_garbage(open_storage(str(tmp_path)))
    assert sorted(removed) == [f"{step_dirname(3)}/w", f"{step_dirname(3)}/zarr.json"]
    assert not (tmp_path / step_dirname(3)).exists() and (tmp_path / step_dirname(7) / "w").exists()


def test_the_owner_renews_its_lease_while_it_saves(tmp_path):
    storage = open_storage(str(tmp_path))
    session = SaveSession.begin(storage, 1, lease_s=0.3)
    key = attempt.record_key(1, session.attempt)
    first = json.loads(bytes(storage.read(key)))["renewed_at"]
    time.sleep(0.5)
    second = json.loads(bytes(storage.read(key)))["renewed_at"]
    assert second > first
    session.abort(RuntimeError("done"))
    assert not storage.exists(key)


def test_no_renewal_lands_after_the_attempt_ends(tmp_path):
    """A lease renewed every 67 ms, the attempt aborted or committed at a random moment: no owner record is written
    back into the removed attempt, nor rewritten in the committed one after its commit. (A commit that finds its
    lease out of date, as a machine loaded enough to delay the renewal thread may, is refused and removed: that
    path must not see a late renewal either.)"""
    rng = random.Random()
    storage = open_storage(str(tmp_path))
    for trial in range(40):
        session = SaveSession.begin(storage, trial, lease_s=0.2)
        key = attempt.record_key(trial, session.attempt)
        time.sleep(rng.uniform(0, 0.3))
        committed = False
        if trial % 2:
            session.abort(RuntimeError("done"))
        else:
            try:
                session.finish(StepManifest(step=trial, tree={}, atoms={}))
                committed = True
            except ucp.StorageError as e:
                assert "lease" in str(e), e
        if committed:
            ended = storage.mtime(key)
            time.sleep(0.1)
            assert storage.mtime(key) == ended, f"trial {trial}: a renewal rewrote the owner record after the commit"
        else:
            time.sleep(0.1)
            assert not storage.exists(key), f"trial {trial}: a renewal wrote the owner record after the abort"


def test_a_committed_step_holds_one_attempt_and_a_failed_save_none(tmp_path):
    class Boom(Exception):
        pass

    state = {"w": torch.randn(8, 8)}
    ucp.save(state, str(tmp_path), step=1)
    storage = open_storage(str(tmp_path))
    try:
        with SaveSession.begin(storage, 2) as session:
            storage.write(f"{session.prefix}/w/c.0.0", [b"x" * 100])
            raise Boom()
    except Boom:
        pass
    assert not (tmp_path / step_dirname(2)).exists()
    assert [n for n in os.listdir(tmp_path / step_dirname(1)) if n.startswith("attempt-")] == [
        ucp.open_checkpoint(str(tmp_path)).record.attempt
    ]
