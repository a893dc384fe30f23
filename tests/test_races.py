"""Two processes racing to save one step: exactly one commits, the other gets StepExistsError, and the step holds
exactly the winner's tensors; the loser leaves nothing behind. Locally and on S3 (moto), 20 trials each."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import ucp
from ucp.format import is_attempt_dirname, step_dirname
from ucp.inspection import verify

from .helpers import assert_same_state
from .race_saver import state

REPO = Path(__file__).resolve().parents[1]
TRIALS = 20


def race(url: str, sync_dir: Path, env: dict | None = None) -> list[dict[int, str]]:
    sync_dir.mkdir()
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "tests.race_saver", url, str(w), str(TRIALS), str(sync_dir)],
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
        outcomes.append({r["trial"]: r["outcome"] for r in map(json.loads, out.splitlines())})
    return outcomes


def check(url: str, outcomes: list[dict[int, str]], storage_options: dict | None = None) -> None:
    from ucp.storage import open_storage

    for trial in range(TRIALS):
        got = sorted(o[trial] for o in outcomes)
        assert got == ["committed", "exists"], f"trial {trial}: {got}"
        winner = next(w for w in (0, 1) if outcomes[w][trial] == "committed")
        root = f"{url}/trial{trial}"
        reader = ucp.open_checkpoint(root, storage_options=storage_options)
        assert reader.step == 5
        assert_same_state(state(winner, trial), reader.load_state())
        assert verify(reader).ok
        storage = open_storage(root, storage_options)
        attempts = [n for n in storage.listdir(step_dirname(5)) if is_attempt_dirname(n)]
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
