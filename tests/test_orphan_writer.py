"""A trainer SIGKILLed with an async save in flight, and a new job saving the same step at once: the committed
step is bitwise the new job's, and the dead trainer's writer process is gone within a second of its parent,
quietly (no traceback of a broken connection).

Before format 2 the orphaned writer kept draining its queue into the step directory after the new job committed
(valid checksums, `ucp verify` green, another job's tensors on the next restore). Now it dies with its parent and,
writing in its own attempt directory, could not reach the new job's step anyway. TRIALS trials with random timing;
in every other one the manager was made from a thread other than the main one (no parent-death signal: the watchdog
stops it), and in half of the others the writer is stopped (SIGSTOP) at the kill, as a writer stuck in IO would be.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import ucp
from ucp.engine.inspection import verify

from .helpers import assert_same_state, load_factor
from .orphan_saver import OPTIONS, state

REPO = Path(__file__).resolve().parents[1]
TRIALS = 20  # (each ~3 s: two interpreters start)


def gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")  # a zombie has stopped running
    except OSError:
        return True


class DeathWatch:
    """Polls a process from a thread of its own until it is gone (at most 5 s): how long it outlived `since`."""

    def __init__(self, pid: int, since: float):
        self.lived = float("inf")
        self._thread = threading.Thread(target=self._poll, args=(pid, since), daemon=True)
        self._thread.start()

    def _poll(self, pid: int, since: float) -> None:
        while time.monotonic() - since < 5:
            if gone(pid):
                self.lived = time.monotonic() - since
                return
            time.sleep(0.005)

    def wait(self) -> float:
        self._thread.join()
        return self.lived


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the writer process is Linux only")
def test_a_killed_trainers_writer_never_reaches_the_new_jobs_step(tmp_path):
    rng = random.Random()
    dead_job_won = 0
    for trial in range(TRIALS):
        root = str(tmp_path / f"trial{trial}")
        proc = subprocess.Popen(
            [sys.executable, "-m", "tests.orphan_saver", root, *(["--thread"] if trial % 2 else [])],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            writer_pid = json.loads(proc.stdout.readline())["writer_pid"]
            assert proc.stdout.readline().strip() == "SAVING"
            time.sleep(rng.uniform(0, 0.15))
            # (a writer made from another thread has no parent-death signal: stopped, its watchdog could not run)
            stopped = trial % 2 == 0 and rng.random() < 0.5
            if stopped:
                os.kill(writer_pid, signal.SIGSTOP)
        finally:
            proc.kill()
            killed_at = time.monotonic()
            proc.wait()
        death = DeathWatch(writer_pid, killed_at)  # (timed beside the new job's save, which may take longer)
        new_job = ucp.CheckpointManager(root, options=OPTIONS)  # at once, while the old writer may still run
        try:
            new_job.save(2, state(20 + trial, n=8))
            winner = state(20 + trial, n=8)
        except ucp.StepExistsError:  # the dead job committed step 2 before it died: then that one stands, whole
            winner = state(2, n=192)
            dead_job_won += 1
        lived = death.wait()
        if stopped and not gone(writer_pid):
            os.kill(writer_pid, signal.SIGCONT)
        bound = load_factor()  # (1 s on cores of its own; its watchdog looks every 0.1 s)
        assert lived < bound, f"trial {trial}: the writer outlived its parent by {lived:.2f} s (bound {bound:.1f} s)"
        printed = proc.stderr.read()  # (to its end: the writer, which shares it, is gone)
        assert "Traceback" not in printed, f"trial {trial}: the orphaned writer printed\n{printed[-2000:]}"
        time.sleep(0.05)  # (had it lived, its late writes would land now)
        reader = ucp.open_checkpoint(root)
        assert reader.step == 2
        assert_same_state(winner, reader.load_state())
        assert verify(reader).ok
        assert_same_state(state(1, n=8), ucp.load(root, step=1))
    assert dead_job_won <= 2, (
        f"the dead job's save finished first in {dead_job_won} of {TRIALS} trials: the race was not run"
    )
