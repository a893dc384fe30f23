"""Two processes racing to save one step: exactly one commits, the other gets StepExistsError, and the step holds
exactly the winner's tensors; the loser leaves nothing behind. Locally and on S3 (moto), 20 trials each, with
`ucp.save` and through a CheckpointManager of each mode, whose gc after every commit once removed the live loser's
attempt as it wrote (and told the winner its committed save had failed)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ucp
from ucp.engine.inspection import verify
from ucp.format.manifest import is_attempt_dirname, step_dirname

from .helpers import assert_same_state
from .race_saver import state

REPO = Path(__file__).resolve().parents[1]
TRIALS = 20


def race(url: str, sync_dir: Path, env: dict | None = None, how: str = "save") -> list[dict[int, str]]:
    sync_dir.mkdir()
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "tests.race_saver", url, str(w), str(TRIALS), str(sync_dir), how],
            cwd=REPO,
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, **(env or {})},
        )
        for w in (0, 1)
    ]
    outcomes: list[dict[int, str]] = []
    for proc in procs:
        out, _ = proc.communicate(timeout=240)
        assert proc.returncode == 0
        for r in map(json.loads, out.splitlines()):
            assert r.get("after_commit") in (None, []), f"trial {r['trial']}: {r['after_commit']}"
        outcomes.append({r["trial"]: r["outcome"] for r in map(json.loads, out.splitlines())})
    return outcomes


def check(url: str, outcomes: list[dict[int, str]], storage_options: dict | None = None, how: str = "save") -> None:
    from ucp.storage import open_storage

    for trial in range(TRIALS):
        got = sorted(o[trial] for o in outcomes)
        assert got == ["committed", "exists"], f"trial {trial}: {got}"
        winner = next(w for w in (0, 1) if outcomes[w][trial] == "committed")
        root, step = (f"{url}/trial{trial}", 5) if how == "save" else (url, trial)
        reader = ucp.open_checkpoint(root, step, storage_options=storage_options)
        assert_same_state(state(winner, trial), reader.load_state())
        assert verify(reader).ok
        storage = open_storage(root, storage_options)
        attempts = [n for n in storage.listdir(step_dirname(step)) if is_attempt_dirname(n)]
        assert attempts == [reader.record.attempt], f"trial {trial}: the loser left {attempts}"


def test_two_local_processes_race_to_save_one_step(tmp_path):
    url = str(tmp_path / "ckpt")
    check(url, race(url, tmp_path / "sync"))


@pytest.mark.slow
def test_two_processes_race_to_save_one_step_on_s3(s3_bucket, tmp_path):
    bucket, options = s3_bucket
    url = f"s3://{bucket}/race"
    outcomes = race(url, tmp_path / "sync", {"UCP_TEST_STORAGE_OPTIONS": json.dumps(options)})
    check(url, outcomes, options)


@pytest.mark.slow
@pytest.mark.parametrize("how", ["sync", "async"])
def test_two_managers_race_to_save_one_step(tmp_path, how):
    url = str(tmp_path / "ckpt")
    check(url, race(url, tmp_path / "sync", how=how), how=how)


@pytest.mark.slow
@pytest.mark.parametrize("how", ["sync", "async"])
def test_two_managers_race_to_save_one_step_on_s3(s3_bucket, tmp_path, how):
    bucket, options = s3_bucket
    url = f"s3://{bucket}/race-{how}"
    outcomes = race(url, tmp_path / "sync", {"UCP_TEST_STORAGE_OPTIONS": json.dumps(options)}, how=how)
    check(url, outcomes, options, how=how)


def _during_first_chunk_write(manager: ucp.CheckpointManager, then) -> None:
    """Run `then()` once, right after `manager`'s save wrote its first chunk object (its attempt is live)."""
    write, fired = manager.storage.write, []

    def write_then(key, parts):
        write(key, parts)
        if "/c." in key and not fired:
            fired.append(key)
            then()

    manager.storage.write = write_then  # type: ignore[method-assign]


def test_another_jobs_retention_leaves_a_save_in_progress_alone(tmp_path):
    """Two jobs on one root: while job B saves step 5, job A commits steps 5-7 and its retention removes step 5.
    B's attempt, live, is kept: B commits its step 5 whole (before, it committed a step whose first objects
    retention had removed, and no load of it could succeed)."""
    retention_beside_a_save(str(tmp_path / "ckpt"), None)


def test_another_jobs_retention_leaves_a_save_in_progress_alone_on_s3(s3_bucket):
    bucket, options = s3_bucket
    retention_beside_a_save(f"s3://{bucket}/run", options)


def retention_beside_a_save(url: str, options: dict | None) -> None:
    unpacked = ucp.SaveOptions(chunking=ucp.ChunkingPolicy(object_bytes=1 << 16, pack_below=0), io_threads=1)
    a = ucp.CheckpointManager(url, keep_last=2, storage_options=options)
    b = ucp.CheckpointManager(url, storage_options=options, options=unpacked)
    state_a = {"x": torch.zeros(64, 1024), "y": torch.zeros(64, 1024)}
    state_b = {"x": torch.randn(64, 1024), "y": torch.randn(64, 1024)}
    _during_first_chunk_write(b, lambda: [a.save(step, state_a) for step in (5, 6, 7)])
    b.save(5, state_b).result()
    assert b.steps() == [5, 6, 7]
    reader = ucp.open_checkpoint(url, 5, storage_options=options)
    assert_same_state(state_b, reader.load_state())
    assert verify(reader).ok


def test_a_save_whose_attempt_was_removed_meanwhile_is_not_committed(tmp_path):
    """Whatever removed a live attempt (another process's gc that judged it dead), its save never commits a step
    that names objects that are gone."""
    from ucp.protocol import attempt

    url = str(tmp_path / "ckpt")
    # (one writer thread: no other write races the removal, which runs inside the first chunk's write)
    options = ucp.SaveOptions(chunking=ucp.ChunkingPolicy(pack_below=0), io_threads=1)
    manager = ucp.CheckpointManager(url, options=options)

    def remove_the_attempt() -> None:
        (name,) = manager.storage.listdir(step_dirname(3))
        attempt.remove(manager.storage, 3, name)

    _during_first_chunk_write(manager, remove_the_attempt)
    with pytest.raises(ucp.StorageError, match=r"step 3 .* not committed: its attempt attempt-\w+ was removed while"):
        manager.save(3, {"x": torch.randn(64, 1024), "y": torch.randn(64, 1024)}).result()
    assert manager.steps() == []
