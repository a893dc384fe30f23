"""A save that runs out of space: a StorageError naming the path and the step, the earlier step untouched and
loadable bitwise, the failed attempt's space freed, and the next save (once there is room) commits with no
manual cleanup.

Where it runs: a real tmpfs mount too small for the state when the tests run as root (CI does; the test is skipped
where mounting is not allowed); everywhere, RLIMIT_FSIZE in a subprocess stands in for a full disk (each write
past the limit fails with EFBIG, as a write past the free space fails with ENOSPC).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import ucp
from ucp.format.manifest import is_attempt_dirname, step_dirname

from .helpers import assert_same_state

REPO = Path(__file__).resolve().parents[1]
OPTIONS = ucp.SaveOptions(chunking=ucp.ChunkingPolicy(object_bytes=256 << 10, inner_bytes=64 << 10))


def state(seed: int, mib: float) -> dict:
    g = torch.Generator().manual_seed(seed)
    n = int(mib * (1 << 20)) // (4 * 1024)
    return {"model": {"w": torch.randn(n, 1024, generator=g), "b": torch.randn(1024, generator=g)}, "seed": seed}


@pytest.fixture
def small_tmpfs(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root (the RLIMIT_FSIZE test stands in)")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    if subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=6m", "tmpfs", str(mnt)], capture_output=True, check=False
    ).returncode:
        pytest.skip("this machine does not allow mounting a tmpfs")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def used_bytes(path: Path) -> int:
    st = os.statvfs(path)
    return (st.f_blocks - st.f_bfree) * st.f_frsize


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_full_file_system(small_tmpfs, mode):
    root = small_tmpfs / "ckpt"
    manager = ucp.CheckpointManager(str(root), mode=mode, options=OPTIONS)  # async: the writer process writes
    manager.save(1, state(1, 1.5))
    manager.wait()
    used = used_bytes(small_tmpfs)
    with pytest.raises(ucp.StorageError) as failure:
        manager.save(2, state(2, 8))
        manager.wait()
    message = str(failure.value)
    assert "No space left" in message and "step 2" in message and f"{root}/{step_dirname(2)}/attempt-" in message, (
        message
    )
    assert "\n" not in message
    assert used_bytes(small_tmpfs) <= used + (64 << 10), "the failed attempt's space was not freed"
    assert manager.steps() == [1]
    assert_same_state(state(1, 1.5), ucp.load(str(root)))
    manager.save(2, state(3, 1.5))  # there is room again: no gc, no cleanup by hand
    manager.wait()
    assert manager.steps() == [1, 2]
    assert_same_state(state(3, 1.5), ucp.load(str(root)))
    assert [n for n in os.listdir(root / step_dirname(2)) if is_attempt_dirname(n)] == [
        ucp.open_checkpoint(str(root)).record.attempt
    ]
    manager.close()


SAVER = textwrap.dedent("""
    import resource, signal, sys
    import ucp
    from tests.test_disk_full import OPTIONS, state
    root = sys.argv[1]
    ucp.save(state(1, 0.5), root, step=1, options=OPTIONS)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead of killing us
    resource.setrlimit(resource.RLIMIT_FSIZE, (128 << 10, resource.RLIM_INFINITY))
    try:
        ucp.save(state(2, 2), root, step=2, options=OPTIONS)
    except ucp.StorageError as e:
        print(e)
    """)


def test_a_file_size_limit_stands_in_for_a_full_disk(tmp_path):
    root = tmp_path / "ckpt"
    out = subprocess.run(
        [sys.executable, "-c", SAVER, str(root)], cwd=REPO, capture_output=True, text=True, timeout=120, check=False
    )
    assert out.returncode == 0, out.stderr
    assert "File too large" in out.stdout and "step 2" in out.stdout and f"{step_dirname(2)}/attempt-" in out.stdout, (
        out.stdout
    )
    assert not (root / step_dirname(2)).exists() or not any(
        is_attempt_dirname(n) for n in os.listdir(root / step_dirname(2))
    )
    assert_same_state(state(1, 0.5), ucp.load(str(root)))
    ucp.save(state(3, 2), str(root), step=2, options=OPTIONS)
    assert_same_state(state(3, 2), ucp.load(str(root)))


def fill(mnt: Path, leave: int = 0) -> Path:
    """A file that takes all of the file system's free space but `leave` bytes."""
    st = os.statvfs(mnt)
    filler = mnt / "filler"
    with open(filler, "wb") as f:
        f.write(b"\0" * max(0, st.f_bavail * st.f_frsize - leave))
    return filler


def test_a_save_whose_first_write_finds_the_disk_full_leaves_nothing(small_tmpfs, caplog):
    """The owner record is an attempt's first write: where it fails, the attempt is removed at once as any failed
    save's is (an empty record stayed, which gc took for a damaged one and left alone for ever)."""
    root = small_tmpfs / "ckpt"
    ucp.save(state(1, 0.5), str(root), step=1, options=OPTIONS)
    filler = fill(small_tmpfs)
    with pytest.raises(
        ucp.StorageError,
        match=r"step 2 was not saved .* what this attempt wrote was removed: .*"
        r"ucp-attempt\.json: No space left",
    ):
        ucp.save(state(2, 0.5), str(root), step=2, options=OPTIONS)
    assert not (root / step_dirname(2)).exists(), os.listdir(root / step_dirname(2))
    filler.unlink()
    with caplog.at_level("WARNING", logger="ucp"):
        assert ucp.CheckpointManager(str(root)).gc() == []
    assert not [r for r in caplog.records if r.levelname == "WARNING"], caplog.text
    ucp.save(state(2, 0.5), str(root), step=2, options=OPTIONS)
    assert_same_state(state(2, 0.5), ucp.load(str(root)))


def test_an_exclusive_create_on_a_full_disk_leaves_no_temporary_file(small_tmpfs):
    """A commit marker's create (a temporary file linked to its name) that finds the disk full: a StorageError, and
    neither the marker nor its temporary file stays (three of them stayed, one a retry, that gc never removed)."""
    from ucp.storage import LocalStorage

    storage = LocalStorage(str(small_tmpfs / "store"))
    storage.write("step/kept", [b"x"])
    filler = fill(small_tmpfs)
    with pytest.raises(ucp.StorageError, match="No space left"):
        storage.create_exclusive("step/ucp-commit.json", os.urandom(64 << 10))
    assert os.listdir(small_tmpfs / "store" / "step") == ["kept"]
    with pytest.raises(ucp.StorageError, match="No space left"):
        storage.write("step/other", [os.urandom(64 << 10)])
    assert os.listdir(small_tmpfs / "store" / "step") == ["kept"], "a failed write left a torn object"
    filler.unlink()
    storage.create_exclusive("step/ucp-commit.json", b"{}")
    assert sorted(os.listdir(small_tmpfs / "store" / "step")) == ["kept", "ucp-commit.json"]
