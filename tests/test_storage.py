"""LocalStorage's choices that depend on the file system under the root."""

from __future__ import annotations

import os

import pytest

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
