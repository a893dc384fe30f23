"""The save engine and the manager as a trainer meets them: a run that ends with an async save in flight, a
background failure nobody waits for yet, a wait cut short by a signal, and a saver killed at random moments.

Real processes and real files throughout: the writer process is stopped and killed with signals, the savers with
SIGKILL."""

from __future__ import annotations

import logging
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

import ucp
from ucp.engine.writer_process import SUPPORTED as PROCESS_WRITER_SUPPORTED
from ucp.format.manifest import COMMIT_MARKER, is_attempt_dirname, step_dirname
from ucp.protocol import attempt
from ucp.storage import open_storage

from .helpers import assert_same_state

REPO = Path(__file__).resolve().parents[1]
OPTIONS = ucp.SaveOptions(
    chunking=ucp.ChunkingPolicy(object_bytes=64 * 1024, inner_bytes=16 * 1024), fsync=False, io_threads=4
)
needs_process_writer = pytest.mark.skipif(not PROCESS_WRITER_SUPPORTED, reason="the writer process is Linux only")


def make_state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"model": {f"w{i}": torch.randn(128, 256, generator=g) for i in range(6)}, "step": seed}


def wait_until(predicate, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


# A script whose last act is an async save: it returns (or raises) without wait() or close().
LAST_SAVE = textwrap.dedent("""
    import sys
    from tests.test_engine_hunt import OPTIONS, make_state
    import ucp
    root, mode, writer, end = sys.argv[1:]
    manager = ucp.CheckpointManager(root, options=OPTIONS, mode=mode, writer=writer)
    manager.save(7, make_state(7))
    if end == "raise":
        raise RuntimeError("the training loop failed after the save returned")
    """)


@pytest.mark.parametrize(
    "mode, writer, end",
    [("async", "process", "return"), ("lazy", "threads", "return"), ("async", "threads", "raise")],
)
def test_a_save_in_flight_when_the_process_ends_is_committed(tmp_path, mode, writer, end):
    """The run's last save, in flight when the script ends: its snapshot was taken, so the step is committed before
    the interpreter exits. (Before, concurrent.futures' exit hook made the executors refuse the save's writes: the
    attempt was removed and the step silently lost, with exit status 0.)"""
    if writer == "process" and not PROCESS_WRITER_SUPPORTED:
        pytest.skip("the writer process is Linux only")
    root = str(tmp_path / "ckpt")
    out = subprocess.run(
        [sys.executable, "-c", LAST_SAVE, root, mode, writer, end],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == (1 if end == "raise" else 0), out.stderr
    assert ucp.CheckpointManager(root, options=OPTIONS).steps() == [7], out.stderr
    assert_same_state(make_state(7), ucp.load(root))


@needs_process_writer
def test_a_background_failure_is_logged_when_it_happens(tmp_path, caplog):
    """A failed background save is raised at the next save, wait or close (which may be long after, or never); the
    `ucp` logger says so at once, naming the step and the root. An abandoned save's failure is expected: not an
    error."""
    manager = ucp.CheckpointManager(str(tmp_path), options=OPTIONS, mode="async", writer="process")
    with caplog.at_level(logging.INFO, logger="ucp"):
        pid = manager.pipeline.writer_pid
        os.kill(pid, signal.SIGSTOP)
        handle = manager.save(1, make_state(1))
        os.kill(pid, signal.SIGKILL)
        wait_until(handle.done)
        errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
        assert len(errors) == 1 and "step 1" in errors[0] and str(tmp_path) in errors[0], errors
        assert "writer process" in errors[0] and "died" in errors[0], errors
        with pytest.raises(ucp.WriterProcessError, match=r"step 1 was not saved"):
            manager.wait()

        caplog.clear()
        manager.save(2, make_state(2))  # (starts a new writer process)
        manager.wait()
        os.kill(manager.pipeline.writer_pid, signal.SIGSTOP)
        handle = manager.save(3, make_state(3))
        manager.abandon()
        wait_until(handle.done)
        time.sleep(0.1)  # (the done callbacks run in the save's thread: let them end)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
    assert ucp.CheckpointManager(str(tmp_path), options=OPTIONS).steps() == [2]


class Interrupted(Exception):
    """What a signal handler raises, as Ctrl-C raises KeyboardInterrupt."""


@needs_process_writer
def test_a_wait_cut_short_by_a_signal_leaves_the_save_in_flight(tmp_path):
    """A wait interrupted by a signal (Ctrl-C) returns before the save ends: the save is still in flight, so the next
    save waits for it and raises its failure. (Before, the interrupted wait forgot it: the next save ran beside it and
    its failure was never raised.)"""
    manager = ucp.CheckpointManager(str(tmp_path), options=OPTIONS, mode="async", writer="process")
    pid = manager.pipeline.writer_pid
    os.kill(pid, signal.SIGSTOP)  # the save cannot end until the writer is killed

    def interrupt(signum, frame):
        raise Interrupted

    old = signal.signal(signal.SIGALRM, interrupt)
    try:
        manager.save(1, make_state(1))
        signal.setitimer(signal.ITIMER_REAL, random.uniform(0.05, 0.3))
        with pytest.raises(Interrupted):
            manager.wait()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(ucp.WriterProcessError, match=r"step 1 was not saved .* writer process \(pid \d+\) died"):
        manager.save(2, make_state(2))
    manager.save(2, make_state(2))
    manager.wait()
    assert manager.steps() == [2]
    manager.close()


def age(path: Path, seconds: float) -> None:
    then = time.time() - seconds
    os.utime(path, (then, then))


def test_an_empty_step_directory_left_by_a_kill_is_collected(tmp_path):
    """A process killed between removing a step's last attempt and the step's directory (a failed save's removal,
    gc's or retention's) left an empty directory that nothing ever removed; once it stayed empty for the orphan grace,
    gc removes it. One made just now (a save starting: its attempt's directory comes a moment later) stays."""
    manager = ucp.CheckpointManager(str(tmp_path), options=OPTIONS)
    manager.save(1, make_state(1))
    left, starting = tmp_path / step_dirname(2), tmp_path / step_dirname(3)
    left.mkdir()
    starting.mkdir()
    age(left, attempt.ORPHAN_GRACE_S + 60)
    assert attempt.collect_garbage(open_storage(str(tmp_path))) == [step_dirname(2)]
    assert not left.exists() and starting.exists()
    assert manager.steps() == [1]
    manager.close()


def test_an_attempt_with_an_empty_owner_record_is_collected(tmp_path):
    """A saver killed (or its host crashed) after its owner record's file was created, before its bytes landed: an
    empty record names no owner, so the attempt is an orphan, removed after the grace, not a damaged record left
    alone for ever."""
    ucp.save(make_state(1), str(tmp_path), step=1, options=OPTIONS)
    torn = tmp_path / step_dirname(2) / attempt.new_attempt_id()
    torn.mkdir(parents=True)
    (torn / "ucp-attempt.json").write_bytes(b"")
    fresh = tmp_path / step_dirname(3) / attempt.new_attempt_id()
    fresh.mkdir(parents=True)
    (fresh / "ucp-attempt.json").write_bytes(b"")
    for path in (torn / "ucp-attempt.json", torn):
        age(path, attempt.ORPHAN_GRACE_S + 60)
    removed = attempt.collect_garbage(open_storage(str(tmp_path)))
    assert removed == [f"{step_dirname(2)}/{torn.name}"]
    assert not (tmp_path / step_dirname(2)).exists() and fresh.exists()
    assert ucp.CheckpointManager(str(tmp_path), options=OPTIONS).steps() == [1]


def children_of(pid: int) -> list[int]:
    children = []
    for entry in os.listdir("/proc"):
        try:
            stat = Path(f"/proc/{entry}/stat").read_bytes()
        except (OSError, ValueError):
            continue
        if entry.isdigit() and int(stat[stat.rindex(b")") + 2 :].split()[1]) == pid:
            children.append(int(entry))
    return children


# A saver that saves step after step (random mode and writer) until it is killed.
SAVER = textwrap.dedent("""
    import sys
    from tests.test_engine_hunt import OPTIONS, make_state
    import ucp
    root, mode, writer = sys.argv[1:]
    manager = ucp.CheckpointManager(root, options=OPTIONS, mode=mode, writer=writer, keep_last=2)
    first = (manager.latest_step() or 0) + 1
    print("READY", flush=True)
    for step in range(first, first + 100000):
        manager.save(step, make_state(step))
    """)


@pytest.mark.slow
def test_savers_killed_at_random_moments_leave_loadable_steps_and_collectable_garbage(tmp_path):
    """A saver (sync, async or lazy; writer threads or process) killed with SIGKILL at a random moment, or its writer
    process killed first: every committed step loads bitwise, a restarted manager saves the next step, and what the
    killed saves left is all garbage that gc removes once the orphan grace is over (store time moved on)."""
    rng = random.Random()
    seed = rng.randrange(2**32)
    rng.seed(seed)
    root = str(tmp_path / "ckpt")
    for trial in range(8):
        mode = rng.choice(["sync", "async", "lazy"])
        writer = rng.choice(["process", "threads"]) if PROCESS_WRITER_SUPPORTED else "threads"
        proc = subprocess.Popen(
            [sys.executable, "-c", SAVER, root, mode, writer], cwd=REPO, stdout=subprocess.PIPE, text=True
        )
        try:
            assert proc.stdout.readline().strip() == "READY"
            time.sleep(rng.uniform(0.0, 1.5))
            if writer == "process" and mode != "sync" and rng.random() < 0.5:
                for child in children_of(proc.pid):  # (its writer process)
                    os.kill(child, signal.SIGKILL)
                time.sleep(rng.uniform(0.0, 0.3))
        finally:
            proc.kill()
            proc.wait()
            proc.stdout.close()
        where = f"trial {trial} ({mode}, {writer}; seed {seed})"
        manager = ucp.CheckpointManager(root, options=OPTIONS, keep_last=2)
        steps = manager.steps()
        for step in steps:
            assert_same_state(make_state(step), manager.restore(step))
        following = (steps[-1] if steps else 0) + 1
        manager.save(following, make_state(following))
        assert manager.steps()[-1] == following, where
        manager.close()
    time.sleep(0.3)  # (a killed saver's writer process exits within a tenth of a second of its parent)
    attempt.collect_garbage(open_storage(root), now=time.time() + 2 * attempt.ORPHAN_GRACE_S)
    committed = ucp.CheckpointManager(root, options=OPTIONS).steps()
    for name in os.listdir(root):
        if not name.startswith("step_"):
            continue
        step = int(name.split("_")[1])
        assert step in committed, f"{name} is left over ({sorted(os.listdir(Path(root) / name))}; seed {seed})"
        entries = os.listdir(Path(root) / name)
        assert sorted(entries) == sorted([COMMIT_MARKER, *[e for e in entries if is_attempt_dirname(e)]])
        assert len([e for e in entries if is_attempt_dirname(e)]) == 1, f"{name}: {entries} (seed {seed})"
