"""A save killed with SIGKILL at any stage leaves the previous step loadable and the partial one invisible."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import ucp
from ucp.format import step_dirname

from .crash_saver import state
from .helpers import assert_same_state

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("stage", ["chunks", "before_commit", "during_commit"])
def test_kill_during_save(tmp_path, stage):
    root = str(tmp_path / "ckpt")
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.crash_saver", root, stage],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        line = proc.stdout.readline().strip()
        assert line == "READY", f"the saver did not reach stage {stage}: {line!r}"
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()

    partial = tmp_path / "ckpt" / step_dirname(2)
    assert partial.exists(), "the killed save should have left a partial step behind"

    reader_view = ucp.open_checkpoint(root)  # no manager: nothing is collected yet
    assert reader_view.step == 1
    assert_same_state(state(1), reader_view.load_state())
    with pytest.raises(ucp.CheckpointNotFoundError, match="step 2 .* is not committed"):
        ucp.load(root, step=2)

    watcher = ucp.CheckpointManager(root)  # a step above the latest commit may still be in progress: kept
    assert watcher.steps() == [1] and partial.exists()
    restarted = ucp.CheckpointManager(root)
    assert restarted.gc(all_uncommitted=True) == [2]  # the restarted job is the only writer
    assert not partial.exists() and restarted.steps() == [1]
    restarted.save(2, state(2))
    assert_same_state(state(2), restarted.restore())
