"""LocalStorage's choices that depend on the file system under the root."""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
from pathlib import Path

import pytest

from ucp.errors import StorageError
from ucp.storage import MEMORY_FILE_SYSTEMS, LocalStorage, Storage, file_system_type


def test_file_system_type_of_a_path_not_yet_made_is_its_parents(tmp_path):
    assert file_system_type(str(tmp_path / "a" / "b" / "c")) == file_system_type(str(tmp_path))
    assert file_system_type("/proc/self") == "proc"


@pytest.mark.skipif(file_system_type("/dev/shm") not in MEMORY_FILE_SYSTEMS, reason="no tmpfs at /dev/shm")
def test_memory_backed_root_takes_fewer_threads_than_a_disk():
    # in memory a write is a CPU's copy: more threads than two per core only contend for the GIL and the cores
    shm = LocalStorage(f"/dev/shm/ucp-test-{os.getpid()}/root")
    assert shm.default_io_threads == min(Storage.default_io_threads, 2 * (os.cpu_count() or 1))


def test_disk_root_keeps_the_default(tmp_path):
    if file_system_type(str(tmp_path)) in MEMORY_FILE_SYSTEMS:
        pytest.skip("tmp_path is in memory here")
    assert LocalStorage(str(tmp_path)).default_io_threads == Storage.default_io_threads


def test_flush_syncs_every_directory_that_gained_an_entry_and_skips_removed_ones(tmp_path, monkeypatch):
    storage = LocalStorage(str(tmp_path / "root"))
    storage.in_memory = False  # (a disk's behaviour, wherever the test's temporary directory is)
    for i in range(100):  # more than one flush syncs in the calling thread: they go to a pool
        storage.write(f"step/atom{i}/c0", [b"x" * 10])
    for i in (3, 50, 97):  # a failed attempt's directories, removed before the flush
        shutil.rmtree(tmp_path / "root" / "step" / f"atom{i}")
    synced: list[str] = []
    real_fsync = os.fsync

    def recording_fsync(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    storage.flush()
    expected = {str(tmp_path / "root" / "step" / f"atom{i}") for i in range(100) if i not in (3, 50, 97)}
    expected |= {str(tmp_path / "root"), str(tmp_path / "root" / "step"), str(tmp_path)}
    assert sorted(synced) == sorted(expected), set(synced) ^ expected
    synced.clear()
    storage.flush()  # nothing new since
    assert synced == []


def test_a_memory_file_system_has_no_directory_to_sync(tmp_path, monkeypatch):
    """On tmpfs an fsync does nothing; a flush there makes no calls (a save of many atoms made hundreds)."""
    shm = tmp_path if file_system_type(str(tmp_path)) == "tmpfs" else Path("/dev/shm")
    if file_system_type(str(shm)) != "tmpfs":
        pytest.skip("no tmpfs on this machine")
    root = Path(tempfile.mkdtemp(dir=shm)) / "root"
    try:
        storage = LocalStorage(str(root))
        assert storage.in_memory
        for i in range(40):
            storage.write(f"atom{i}/c0", [b"x"])
        synced: list[int] = []
        monkeypatch.setattr(os, "fsync", synced.append)
        storage.flush()
        assert synced == []
    finally:
        shutil.rmtree(root.parent)


def test_a_failing_directory_sync_names_the_root(tmp_path, monkeypatch):
    storage = LocalStorage(str(tmp_path / "root"))
    storage.in_memory = False
    for i in range(40):
        storage.write(f"atom{i}/c0", [b"x"])

    def failing_fsync(fd: int) -> None:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "fsync", failing_fsync)
    with pytest.raises(StorageError, match=r"cannot make .*root durable \(fsync\): Input/output error"):
        storage.flush()
