"""A save killed with SIGKILL at any stage leaves the previous step loadable and the partial one invisible; the
killed saver's attempt is kept while it lives and collected once it is dead, without anyone's help."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import ucp
from ucp.format.manifest import is_attempt_dirname, step_dirname

from .crash_saver import state
from .helpers import assert_same_state

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("stage", ["chunks", "before_commit", "during_commit"])
def test_kill_during_save(tmp_path, stage):
    root = str(tmp_path / "ckpt")
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.crash_saver", root, stage], cwd=REPO, stdout=subprocess.PIPE, text=True
    )
    try:
        line = proc.stdout.readline().strip()
        assert line == "READY", f"the saver did not reach stage {stage}: {line!r}"
        partial = tmp_path / "ckpt" / step_dirname(2)
        attempts = [p for p in partial.iterdir() if is_attempt_dirname(p.name)]
        assert len(attempts) == 1, "the frozen save should have its attempt directory"
        watcher = ucp.CheckpointManager(root)  # the saver is alive: its save may still finish, so it is kept
        assert watcher.steps() == [1] and attempts[0].exists()
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()

    reader_view = ucp.open_checkpoint(root)  # no manager: nothing is collected yet
    assert reader_view.step == 1
    assert_same_state(state(1), reader_view.load_state())
    with pytest.raises(ucp.CheckpointNotFoundError, match="step 2 .* is not committed"):
        ucp.load(root, step=2)

    restarted = ucp.CheckpointManager(root)  # its owner is dead now: the attempt goes when a manager starts
    assert not attempts[0].exists() and restarted.steps() == [1]
    restarted.save(2, state(2))
    assert_same_state(state(2), restarted.restore())
    assert restarted.gc() == []
