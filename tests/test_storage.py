"""LocalStorage's choices that depend on the file system under the root."""

from __future__ import annotations

import errno
import os
import random
import shutil
import tempfile
import threading
import time
from pathlib import Path

import pytest
import torch

import ucp.storage.local
from ucp.errors import StorageError
from ucp.storage import (
    DEFAULT_IO_THREADS,
    MEMORY_FILE_SYSTEMS,
    PREFETCH_AHEAD,
    PREFETCH_GIVE_UP_CACHED,
    PREFETCH_MIN_KEYS,
    LocalStorage,
    file_system_type,
)


def test_file_system_type_of_a_path_not_yet_made_is_its_parents(tmp_path):
    assert file_system_type(str(tmp_path / "a" / "b" / "c")) == file_system_type(str(tmp_path))
    assert file_system_type("/proc/self") == "proc"


@pytest.mark.skipif(file_system_type("/dev/shm") not in MEMORY_FILE_SYSTEMS, reason="no tmpfs at /dev/shm")
def test_memory_backed_root_takes_fewer_threads_than_a_disk():
    # in memory a write is a CPU's copy: more threads than two per core only contend for the GIL and the cores
    shm = LocalStorage(f"/dev/shm/ucp-test-{os.getpid()}/root")
    assert shm.capabilities.io_threads == min(DEFAULT_IO_THREADS, 2 * (os.cpu_count() or 1))


def test_disk_root_keeps_the_default(tmp_path):
    if file_system_type(str(tmp_path)) in MEMORY_FILE_SYSTEMS:
        pytest.skip("tmp_path is in memory here")
    assert LocalStorage(str(tmp_path)).capabilities.io_threads == DEFAULT_IO_THREADS


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


def _advised(monkeypatch, cached: bool = False) -> list[str]:
    """The paths LocalStorage.prefetching asks the kernel for, in order (the real posix_fadvise still runs), with
    every object taken as `cached` in the page cache or not (the files a test has just written are)."""
    asked: list[str] = []
    real = os.posix_fadvise

    def spy(fd: int, offset: int, length: int, advice: int) -> None:
        asked.append(os.readlink(f"/proc/self/fd/{fd}"))
        real(fd, offset, length, advice)

    monkeypatch.setattr(os, "posix_fadvise", spy)
    monkeypatch.setattr(ucp.storage.local, "_in_page_cache", lambda fd: cached)
    return asked


def _wait_for(predicate, seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def _prefetchers_alive() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "ucp-prefetch"]


@pytest.mark.parametrize("seed", range(3))
def test_prefetching_asks_for_the_keys_in_order_and_stays_its_lead_ahead_of_the_reader(tmp_path, monkeypatch, seed):
    rng = random.Random(seed)
    storage = LocalStorage(str(tmp_path / "root"))
    storage.in_memory = False  # (a disk's behaviour, wherever the test's temporary directory is)
    keys = [f"step/a{i}/c.0" for i in range(PREFETCH_AHEAD + rng.randint(1, 2 * PREFETCH_AHEAD))]
    for key in keys:
        storage.write(key, [os.urandom(rng.randint(0, 4096))])
    rng.shuffle(keys)  # (the order of the reads, not of the writes)
    asked = _advised(monkeypatch)
    with storage.prefetching(keys) as advance:
        _wait_for(lambda: len(asked) >= PREFETCH_AHEAD)
        time.sleep(0.05)
        assert len(asked) == PREFETCH_AHEAD  # no further until the reader has read some
        read = rng.randint(1, len(keys) - PREFETCH_AHEAD)
        for _ in range(read):
            advance()
        _wait_for(lambda: len(asked) >= PREFETCH_AHEAD + read)
        time.sleep(0.05)
        assert len(asked) == PREFETCH_AHEAD + read
    assert asked == [os.path.join(storage.root, k) for k in keys[: len(asked)]]
    assert not _prefetchers_alive()  # the context stopped and joined it, with keys left


def test_prefetching_passes_over_what_it_cannot_open_and_stops_when_the_reader_fails(tmp_path, monkeypatch):
    storage = LocalStorage(str(tmp_path / "root"))
    storage.in_memory = False
    storage.write("s/ok/c.0", [b"x" * 100])
    storage.write("s/last/c.0", [b"y"])
    os.mkfifo(tmp_path / "root" / "s" / "fifo")  # would block a plain open: never waited on
    os.symlink("/etc/passwd", tmp_path / "root" / "s" / "link")  # never followed
    (tmp_path / "outside").write_bytes(b"z")  # (there to be asked for, were ".." taken)
    os.mkdir(tmp_path / "elsewhere")
    storage.write("elsewhere-data/c.0", [b"w"])
    os.rename(tmp_path / "root" / "elsewhere-data", tmp_path / "elsewhere" / "data")
    os.symlink(tmp_path / "elsewhere", tmp_path / "root" / "linked")  # a directory: the read refuses it
    keys = ["s/missing/c.0", "s/fifo", "s/link", "../outside", "s", "/dev/zero", "s/ok/c.0"]
    keys += [f"s/pad{i}/c.0" for i in range(PREFETCH_MIN_KEYS)] + ["s/last/c.0"]
    asked = _advised(monkeypatch)
    with pytest.raises(OSError, match="the reader's own failure"), storage.prefetching(keys) as advance:
        for _ in keys:
            advance()
        _wait_for(lambda: any(p.endswith("last/c.0") for p in asked))
        raise OSError("the reader's own failure")
    assert not any("passwd" in p or "outside" in p or "zero" in p for p in asked)
    assert [p.removeprefix(storage.root) for p in asked] == ["/s/ok/c.0", "/s/last/c.0"]
    assert not _prefetchers_alive()


@pytest.mark.parametrize("seed", range(3))
def test_prefetching_looks_at_few_objects_where_they_are_in_the_page_cache_and_resumes_after(
    tmp_path, monkeypatch, seed
):
    """A checkpoint whose first objects are warm and the rest cold: through the warm stretch it looks at one object
    in PREFETCH_GIVE_UP_CACHED; from the first cold one it sees on, it asks for every cold one again."""
    rng = random.Random(seed)
    storage = LocalStorage(str(tmp_path / "root"))
    storage.in_memory = False
    warm = rng.randint(PREFETCH_GIVE_UP_CACHED + 1, 6 * PREFETCH_GIVE_UP_CACHED)
    keys = [f"s/a{i}/c.0" for i in range(warm + rng.randint(PREFETCH_GIVE_UP_CACHED, 160))]  # (a sample among the cold)
    for key in keys:
        storage.write(key, [b"x"])
    asked = _advised(monkeypatch)
    looked: list[str] = []

    def in_cache(fd: int) -> bool:
        looked.append(os.readlink(f"/proc/self/fd/{fd}"))
        return int(looked[-1].split("/a")[-1].split("/")[0]) < warm

    monkeypatch.setattr(ucp.storage.local, "_in_page_cache", in_cache)
    with storage.prefetching(keys) as advance:
        for _ in keys:
            advance()
        _wait_for(lambda: any(p.endswith(keys[-1]) for p in asked))
    index = [int(p.split("/a")[-1].split("/")[0]) for p in looked]
    resumed = -(-warm // PREFETCH_GIVE_UP_CACHED) * PREFETCH_GIVE_UP_CACHED  # the first sample at or after `warm`
    sampled = list(range(PREFETCH_GIVE_UP_CACHED, warm, PREFETCH_GIVE_UP_CACHED))
    assert index == list(range(PREFETCH_GIVE_UP_CACHED)) + sampled + list(range(resumed, len(keys)))
    assert [p.removeprefix(storage.root + "/") for p in asked] == keys[resumed:]


def test_prefetching_starts_no_thread_for_a_few_objects_or_where_none_can_start(tmp_path, monkeypatch):
    storage = LocalStorage(str(tmp_path / "root"))
    storage.in_memory = False
    keys = [f"s/a{i}/c.0" for i in range(PREFETCH_MIN_KEYS)]
    for key in keys:
        storage.write(key, [b"x"])
    asked = _advised(monkeypatch)
    with storage.prefetching(keys[:-1]) as advance:
        advance()
        assert not _prefetchers_alive()

    def no_thread(self: threading.Thread) -> None:
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(threading.Thread, "start", no_thread)
    with storage.prefetching(keys) as advance:
        for _ in keys:
            advance()
    assert asked == []


def test_in_page_cache_tells_a_file_just_read_from_one_dropped_from_memory(tmp_path):
    if file_system_type(str(tmp_path)) in MEMORY_FILE_SYSTEMS or not hasattr(os, "RWF_NOWAIT"):
        pytest.skip("a memory file system keeps every file in memory; or no RWF_NOWAIT here")
    path = tmp_path / "f"
    path.write_bytes(os.urandom(1 << 16))
    fd = os.open(path, os.O_RDONLY)
    try:
        os.pread(fd, 1 << 16, 0)
        if not ucp.storage.local._in_page_cache(fd):
            pytest.skip("this file system cannot tell (RWF_NOWAIT fails even for a file just read)")
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        assert not ucp.storage.local._in_page_cache(fd)
    finally:
        os.close(fd)


def test_prefetching_does_nothing_in_memory(tmp_path, monkeypatch):
    storage = LocalStorage(str(tmp_path / "root"))
    storage.in_memory = True
    storage.write("s/a/c.0", [b"x"])
    asked = _advised(monkeypatch)
    with storage.prefetching(["s/a/c.0"]) as advance:
        advance()
        assert not _prefetchers_alive()
    assert asked == []


def test_loads_tell_the_storage_the_small_objects_they_read_one_after_another(tmp_path, monkeypatch):
    """ucp.load and a sharded load (load_weights) hand the disk the keys of the small objects they read in the
    calling thread, in the order they read them, and read the same bits as without reading ahead."""
    import ucp
    from ucp.base.workpool import SMALL_OBJECT_BYTES
    from ucp.interop.weights import load_weights

    from .test_hf import random_full_state, save_in_layout, tiny_config

    rng = random.Random()
    told: list[list[str]] = []
    real = LocalStorage.prefetching

    def recording(self: LocalStorage, keys):
        told.append(list(keys))
        self.in_memory = False  # (read ahead wherever the test's temporary directory is)
        return real(self, keys)

    state = {"small": {f"t{i}": torch.randn(rng.randint(1, 2000)) for i in range(rng.randint(20, 60))}}
    state["big"] = torch.randn(SMALL_OBJECT_BYTES // 2)  # 2x the lane's limit: read on the pool
    url = str(tmp_path / "plain")
    unpacked = ucp.SaveOptions(chunking=ucp.ChunkingPolicy(pack_below=0))  # (objects of their own: packs are few)
    ucp.save(state, url, step=0, options=unpacked)
    plain = ucp.load(url)
    monkeypatch.setattr(LocalStorage, "prefetching", recording)
    again = ucp.load(url)
    assert all(torch.equal(again["small"][k], plain["small"][k]) for k in state["small"])
    assert torch.equal(again["big"], plain["big"])
    prefix = ucp.open_checkpoint(url).prefix
    assert sorted(told[-1]) == sorted(f"{prefix}/small/{k}/c.0" for k in state["small"])

    cfg = tiny_config(num_hidden_layers=2)
    sharded = str(tmp_path / "sharded")
    save_in_layout(
        random_full_state(cfg), cfg, rng.choice(["tp2pp2", "tp1pp2dp2zero1"]), sharded, step=1, options=unpacked
    )
    layout, rank = rng.choice([("tp2", 1), ("tp1", 0), ("tp2pp2", 2)])
    told.clear()
    got = load_weights(sharded, layout, rank).params
    reader = ucp.open_checkpoint(sharded)
    small = told[-1]
    assert small and all(k.startswith(reader.prefix + "/model/") for k in small)
    assert all(
        reader.atoms[k.removeprefix(reader.prefix + "/").rsplit("/", 1)[0]].object_bytes < SMALL_OBJECT_BYTES
        for k in small
    )
    monkeypatch.setattr(LocalStorage, "prefetching", real)
    want = load_weights(sharded, layout, rank).params
    assert all(torch.equal(got[n], want[n]) for n in want)


def test_a_file_in_the_middle_of_a_key_is_nothing_there(tmp_path):
    storage = LocalStorage(str(tmp_path / "root"))
    storage.write("f", [b"a file"])
    assert storage.listdir("f/sub") == []
    storage.delete("f/a/b")
    storage.remove_empty_dir("f/a/b")
    assert storage.read("f").tobytes() == b"a file"


def test_a_directory_moved_while_it_is_opened_is_named_as_moved(tmp_path, monkeypatch):
    """A directory renamed between the open and the check (an operator's mv during a load): the read is refused as
    moved, not as a link, and nothing is listed or removed in its new place."""
    storage = LocalStorage(str(tmp_path / "root"))
    storage.write("step/a/c.0", [b"x"])
    real_open = os.open

    def open_then_move(path, flags, *args, **kwargs):
        fd = real_open(path, flags, *args, **kwargs)
        if os.path.exists(tmp_path / "root" / "step"):
            os.rename(tmp_path / "root" / "step", tmp_path / "root" / "moved")
        return fd

    for call in (
        lambda: storage.read("step/a/c.0"),
        lambda: storage.listdir("step/a"),
        lambda: storage.delete("step/a/c.0"),
    ):
        monkeypatch.setattr(os, "open", open_then_move)
        with pytest.raises(StorageError, match="was moved or replaced while it was opened"):
            call()
        monkeypatch.setattr(os, "open", real_open)
        os.rename(tmp_path / "root" / "moved", tmp_path / "root" / "step")
    assert storage.read("step/a/c.0").tobytes() == b"x"


def test_an_unknown_or_uninstalled_protocol_is_a_storage_error():
    import importlib.util

    from ucp.storage import open_storage

    with pytest.raises(StorageError, match=r"nosuch://x: no storage for nosuch://"):
        open_storage("nosuch://x")
    if importlib.util.find_spec("gcsfs") is None:
        with pytest.raises(StorageError, match=r"gcs://bucket/x: no storage for gcs://"):
            open_storage("gcs://bucket/x")


# -- what each store declares it can do (Capabilities), and stores that can only be read


def test_a_local_store_declares_what_its_file_system_and_fsync_allow(tmp_path):
    from dataclasses import FrozenInstanceError

    from ucp.storage import Capabilities

    disk = LocalStorage(str(tmp_path / "root"))
    if disk.in_memory:
        pytest.skip("tmp_path is in memory here")
    want = Capabilities(
        io_threads=DEFAULT_IO_THREADS,
        read_threads=min(DEFAULT_IO_THREADS, 4 * (os.cpu_count() or 1)),  # (a load's reads are CPU work: few per core)
        whole_object_reads=False,
        serial_small_reads=True,  # (CPU only once `prefetching` has asked for them)
        serial_small_writes=False,  # (each waits for its fsync: many in flight hide it)
        exclusive_creates=True,
        writer_process=True,
    )
    assert disk.capabilities == want
    assert disk.capabilities.reads_in_flight == want.read_threads
    assert LocalStorage(str(tmp_path / "root"), fsync=False).capabilities == Capabilities(
        **{**vars(want), "serial_small_writes": True}
    )
    with pytest.raises(FrozenInstanceError):
        disk.capabilities.io_threads = 1  # type: ignore[misc]

    class Injecting(LocalStorage):  # (behaviour that a copy in the writer process would lack)
        pass

    assert Injecting(str(tmp_path / "root")).capabilities == Capabilities(**{**vars(want), "writer_process": False})


@pytest.mark.skipif(file_system_type("/dev/shm") not in MEMORY_FILE_SYSTEMS, reason="no tmpfs at /dev/shm")
def test_a_local_store_in_memory_declares_few_threads_and_serial_small_writes():
    from ucp.storage import Capabilities

    shm = LocalStorage(f"/dev/shm/ucp-test-{os.getpid()}/root")
    assert shm.capabilities == Capabilities(
        io_threads=min(DEFAULT_IO_THREADS, 2 * (os.cpu_count() or 1)),
        serial_small_reads=True,
        serial_small_writes=True,
        exclusive_creates=True,
        writer_process=True,
    )
    assert shm.capabilities.reads_in_flight == shm.capabilities.io_threads


def test_fsspec_stores_declare_whole_object_reads_and_where_creates_are_exclusive(tmp_path, caplog):
    import fsspec
    from fsspec.implementations.dirfs import DirFileSystem

    from ucp.storage import FSSPEC_IO_THREADS, Capabilities, FsspecStorage, open_storage

    memory = open_storage(f"memory://ucp-caps-{os.getpid()}")
    assert memory.capabilities == Capabilities(
        io_threads=FSSPEC_IO_THREADS,
        whole_object_reads=True,
        exclusive_creates=True,
        writer_process=False,  # (a copy in another process would have a memory of its own)
    )
    # a file system whose creates are a check, then a write: declared; its creates are refused (two savers of one step
    # could both commit) unless it is opened for a single writer, and then a create still refuses an existing key
    (tmp_path / "dir").mkdir()
    dirfs = DirFileSystem(str(tmp_path / "dir"), fsspec.filesystem("file"))
    plain = FsspecStorage(dirfs, "", "dir://x")
    assert plain.capabilities == Capabilities(
        io_threads=FSSPEC_IO_THREADS, whole_object_reads=True, writer_process=True
    )
    with pytest.raises(ucp.NonExclusiveStoreError, match="dir://x/marker exclusively: .*single_writer=true"):
        plain.create_exclusive("marker", b"first")
    assert not plain.exists("marker")
    caplog.set_level("INFO", logger="ucp")
    single = FsspecStorage(dirfs, "", "dir://x", single_writer=True)
    single.create_exclusive("marker", b"first")
    with pytest.raises(FileExistsError):
        single.create_exclusive("marker", b"second")
    assert single.read("marker").tobytes() == b"first"
    assert "cannot create objects exclusively" in caplog.text


def test_a_read_only_source_serves_a_load_and_is_refused_by_a_save(tmp_path):
    """A hot tier's restore source implements reads only (no Storage): a CheckpointReader reads through it, and a
    save handed it fails with a ReadOnlyStorageError naming it before anything is written; the committed step
    stays as it was."""
    import ucp
    from ucp.distributed.tiers import TierSource
    from ucp.engine.checkpoint import CheckpointReader
    from ucp.errors import ReadOnlyStorageError
    from ucp.protocol import commit
    from ucp.storage import Capabilities, ReadableStorage, Storage

    rng = random.Random()
    url = str(tmp_path / "root")
    state = {f"t{i}": torch.randn(rng.randint(1, 500)) for i in range(rng.randint(1, 8))}
    ucp.save(state, url, step=3)
    local = LocalStorage(url)
    record = commit.read_marker(local, 3)
    assert record is not None
    manifest = commit.read_manifest_bytes(local, record)
    source = TierSource(local, set(_files_below(Path(url))), {}, None)  # (every copy here taken as verified)
    assert isinstance(source, ReadableStorage) and not isinstance(source, Storage)
    assert source.capabilities == Capabilities()
    got = CheckpointReader(source, committed=(record, manifest)).load_state()
    assert all(torch.equal(got[k], v) for k, v in state.items())

    before = sorted(str(p.relative_to(url)) for p in Path(url).rglob("*"))
    for step in (None, 4):
        with pytest.raises(
            ReadOnlyStorageError, match=rf"cannot save step {step or 4} at {url}: .*TierSource.* read-only"
        ):
            ucp.save({"w": torch.ones(3)}, url, step=step, storage=source)  # type: ignore[arg-type]
    assert sorted(str(p.relative_to(url)) for p in Path(url).rglob("*")) == before
    assert all(torch.equal(ucp.load(url)[k], v) for k, v in state.items())


def _files_below(directory: Path) -> list[str]:
    return [str(p.relative_to(directory)) for p in directory.rglob("*") if p.is_file()]


def test_an_object_rewritten_while_read_is_never_seen_torn(tmp_path):
    """An attempt's owner record is rewritten every third of its lease while gc may read it: on local files a rewrite
    replaces the file whole (a reader took a truncated file for an unreadable record before)."""
    import threading

    storage = LocalStorage(str(tmp_path), fsync=False)
    storage.write("record.json", [b'{"renewed_at": 0}'])
    stop = threading.Event()

    def rewrite() -> None:
        n = 0
        while not stop.is_set():
            n += 1
            storage.write("record.json", [b'{"renewed_at": %d}' % n])

    writer = threading.Thread(target=rewrite)
    writer.start()
    try:
        seen = {bytes(storage.read("record.json")) for _ in range(3000)}
    finally:
        stop.set()
        writer.join()
    assert all(s.startswith(b'{"renewed_at": ') and s.endswith(b"}") for s in seen), sorted(seen)[:3]
    assert [p.name for p in tmp_path.iterdir()] == ["record.json"]  # (no temporary file left beside it)


def test_a_reader_runs_as_many_reads_at_once_as_its_store_declares_for_loads(tmp_path):
    disk = LocalStorage(str(tmp_path / "ck"))
    ucp.save({"w": torch.arange(10)}, str(tmp_path / "ck"), step=1)
    assert ucp.open_checkpoint(str(tmp_path / "ck")).io_threads == disk.capabilities.reads_in_flight
    assert ucp.CheckpointReader(disk, 1, io_threads=3).io_threads == 3  # (the caller's word wins)
