"""The ways of moving a state to storage and back, behind one interface, so each is timed the same way.

Every method's save makes its bytes durable (fsync of each file, and of new directories) before it
returns, and its load returns tensors whose bytes are in process memory (no lazy mmap), since that is what
a training job resuming from a checkpoint needs. Loads return the flat view ('a/b/c' -> tensor) so the
runner can verify any method against the saved state.

On the s3 target a method gets a `RemoteDir` instead of a Path; methods with `remote = False` are skipped
there. A save may return extra figures ({"blocking_s": ...} for async saves: how long the caller was held
before it could go on; the save's time is always the end-to-end time to durable/committed).
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import io
import json
import math
import os
import sys
import time
import warnings
from abc import ABC, abstractmethod
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import crc32c

import ucp

from .targets import RemoteDir, is_remote

if TYPE_CHECKING:  # (torch is imported where a method runs: `ucp bench --help` and its argument errors need none)
    import torch

    from .state import SyntheticState

Where = Path | RemoteDir

MAX_IO = 1 << 30  # bytes per write/readv call: Linux moves at most ~2 GiB per call


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class Method(ABC):
    """One way to checkpoint. `io_threads` is the parallelism a method may use (those that have a knob)."""

    name: ClassVar[str]
    description: ClassVar[str]
    remote: ClassVar[bool] = False  # runs on the s3 target too
    local: ClassVar[bool] = True  # runs on local targets (False: a peer that only reads and writes object stores)
    paired_copy: ClassVar[bool] = False  # async: the runner times a plain copy of the state just before the save
    storage: ClassVar[bool] = True  # False: an in-memory baseline, run once per state, not per target
    needs: ClassVar[tuple[str, ...]] = ()  # modules of a peer that is installed apart (a run without them reports it)

    @classmethod
    def installed(cls) -> bool:
        import importlib.util

        return all(importlib.util.find_spec(m) is not None for m in cls.needs)

    def __init__(self, io_threads: int | None = None):
        if io_threads is None:
            from ucp.storage import DEFAULT_IO_THREADS

            io_threads = DEFAULT_IO_THREADS
        self.io_threads = io_threads

    @abstractmethod
    def save(self, state: SyntheticState, directory: Any) -> dict[str, float] | None:
        """Write `state` under the (empty) `directory`; durable on return. May return extra figures."""

    @abstractmethod
    def load(self, directory: Any) -> dict[str, torch.Tensor]:
        """Read back what `save` wrote: the flat tensors, in memory."""


METHODS: dict[str, type[Method]] = {}


def register(cls: type[Method]) -> type[Method]:
    METHODS[cls.name] = cls
    return cls


# ------------------------------------------------------------------------------------------- raw (the limit)


def _as_bytes(t: torch.Tensor) -> memoryview:
    import torch

    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


@register
class Raw(Method):
    """The limit: one file per tensor, os.write + fsync, read with os.readv straight into preallocated
    tensors; as many threads as ucp uses. No format, no checksums, no copies."""

    name = "raw"
    description = (
        "one file per tensor, os.write+fsync / os.readv into preallocated tensors;"
        " on S3 one object per tensor, all s3fs pipe/cat requests in flight at once (64-connection pool)"
    )
    INDEX = "index.json"
    remote = True

    def _write(self, path: Path, t: torch.Tensor) -> list[Any]:
        """Write one tensor's file (contiguous `t`); returns what the index keeps of it beyond name, dtype, shape."""
        view = _as_bytes(t)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            while view.nbytes:
                view = view[os.write(fd, view[:MAX_IO]) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        return []

    def _read(self, path: Path, out: torch.Tensor, kept: list[Any]) -> None:
        """Read one tensor's file into `out`; `kept` is what `_write` returned for it."""
        view = _as_bytes(out)
        fd = os.open(path, os.O_RDONLY)
        try:
            while view.nbytes:
                n = os.readv(fd, [view[:MAX_IO]])
                if n == 0:
                    raise EOFError(f"{path}: {view.nbytes} bytes short")
                view = view[n:]
        finally:
            os.close(fd)

    def save(self, state: SyntheticState, directory: Any) -> None:
        index = {
            p: [f"{i}.bin", str(t.dtype).removeprefix("torch."), list(t.shape)]
            for i, (p, t) in enumerate(state.flat.items())
        }
        if is_remote(directory):
            # botocore takes bytes, not a memoryview: one copy per object, as every s3fs user pays
            blobs = {(directory / index[p][0]).path: bytes(_as_bytes(t.contiguous())) for p, t in state.flat.items()}
            blobs[(directory / self.INDEX).path] = json.dumps(index).encode()
            directory.fs.pipe(blobs, batch_size=-1)
            return
        with cf.ThreadPoolExecutor(self.io_threads) as pool:
            kept = pool.map(lambda p: self._write(directory / index[p][0], state.flat[p].contiguous()), index)
            index = {p: entry + more for (p, entry), more in zip(index.items(), kept)}
        (directory / self.INDEX).write_text(json.dumps(index))
        fsync_path(directory / self.INDEX)
        fsync_path(directory)

    def load(self, directory: Any) -> dict[str, torch.Tensor]:
        import torch

        if is_remote(directory):
            fs = directory.fs
            index = json.loads(fs.cat_file((directory / self.INDEX).path))
            blobs = fs.cat([(directory / f).path for f, _, _ in index.values()], batch_size=-1)
            return {
                p: torch.frombuffer(bytearray(blobs[(directory / f).path]), dtype=getattr(torch, dtype)).reshape(shape)
                if shape and math.prod(shape)
                else torch.empty(shape, dtype=getattr(torch, dtype))
                for p, (f, dtype, shape) in index.items()
            }
        index = json.loads((directory / self.INDEX).read_text())
        out = {p: torch.empty(shape, dtype=getattr(torch, dtype)) for p, (_, dtype, shape, *_) in index.items()}
        with cf.ThreadPoolExecutor(self.io_threads) as pool:
            list(pool.map(lambda p: self._read(directory / index[p][0], out[p], index[p][3:]), index))
        return out


@register
class RawCrc(Raw):
    """Raw, checksummed: the floor for any format that checksums every byte. Each tensor's CRC-32C is taken as it
    is written and kept in the index, and checked after it is read (local targets only)."""

    name = "raw-crc"
    description = "raw, plus a CRC-32C of every tensor taken on save (kept in the index) and checked on load"
    remote = False

    def _write(self, path: Path, t: torch.Tensor) -> list[Any]:
        crc = crc32c.crc32c(_as_bytes(t))
        return [crc, *super()._write(path, t)]

    def _read(self, path: Path, out: torch.Tensor, kept: list[Any]) -> None:
        super()._read(path, out, kept[1:])
        if crc32c.crc32c(_as_bytes(out)) != kept[0]:
            raise ValueError(f"{path}: checksum mismatch")


@register
class RawObjects(Raw):
    """Raw, checksummed, writing the objects ucp's unpacked layout holds (every atom a Zarr array: format 2, and
    `ucp-unpacked`): per tensor a directory with a small Zarr array document and one chunk file (the tensor, then its
    CRC-32C), a group document per dict level, every file and directory fsynced (on S3 the same objects, put at
    once). What ucp adds over this is its own work; the rest of its gap to raw is that layout's object count."""

    name = "raw-objects"
    description = (
        "raw-crc laid out as ucp-unpacked's objects: per tensor a directory, a zarr.json and a chunk; per level a"
        " zarr.json"
    )
    DOC = b'{"zarr_format":3,"node_type":"group","attributes":{}}'
    INDEX = "ucp-index/atoms-0.json"  # (where ucp's manifest keeps its atoms' records, format 3.1: one more object)

    @staticmethod
    def _array_doc(t: torch.Tensor) -> bytes:
        return json.dumps(
            {"zarr_format": 3, "node_type": "array", "shape": list(t.shape), "data_type": str(t.dtype)[6:],
             "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(t.shape)}},
             "codecs": [{"name": "bytes"}, {"name": "crc32c"}]}
        ).encode()  # fmt: skip

    def _objects(self, state: SyntheticState) -> Iterator[tuple[str, list[Any]]]:
        """(key, parts) of every object: an index (as ucp's manifest, what a load reads first), the groups'
        documents, then each tensor's document and chunk."""
        index = {p: [str(t.dtype).removeprefix("torch."), list(t.shape)] for p, t in state.flat.items()}
        yield self.INDEX, [json.dumps(index).encode()]
        groups = {"/".join(p.split("/")[:i]) for p in state.flat for i in range(len(p.split("/")))}
        for g in sorted(groups):
            yield (f"{g}/zarr.json" if g else "zarr.json"), [self.DOC]
        for p, t in state.flat.items():
            data = _as_bytes(t.contiguous())
            yield f"{p}/zarr.json", [self._array_doc(t)]
            yield f"{p}/c", [data, crc32c.crc32c(data).to_bytes(4, "little")]

    def save(self, state: SyntheticState, directory: Any) -> None:
        if is_remote(directory):
            blobs = {(directory / k).path: b"".join(bytes(x) for x in parts) for k, parts in self._objects(state)}
            directory.fs.pipe(blobs, batch_size=-1)
            return
        dirs = sorted({os.path.dirname(k) for k, _ in self._objects(state)}, key=len)
        for d in dirs:
            (directory / d).mkdir(exist_ok=True)

        def write(item: tuple[str, list[Any]]) -> None:
            fd = os.open(directory / item[0], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                os.writev(fd, item[1])  # (a tensor of the bench's states is far under MAX_IO)
                os.fsync(fd)
            finally:
                os.close(fd)

        with cf.ThreadPoolExecutor(self.io_threads) as pool:
            list(pool.map(write, self._objects(state)))
            list(pool.map(lambda d: fsync_path(directory / d), dirs))
        fsync_path(directory)

    def load(self, directory: Any) -> dict[str, torch.Tensor]:
        import torch

        if is_remote(directory):
            index = json.loads(directory.fs.cat_file((directory / self.INDEX).path))
            blobs = directory.fs.cat([(directory / f"{p}/c").path for p in index], batch_size=-1)
            out = {}
            for p, (dtype, shape) in index.items():
                blob = blobs[(directory / f"{p}/c").path]
                if crc32c.crc32c(blob[:-4]) != int.from_bytes(blob[-4:], "little"):
                    raise ValueError(f"{p}: checksum mismatch")
                out[p] = torch.frombuffer(bytearray(blob[:-4]), dtype=getattr(torch, dtype)).reshape(shape)
            return out
        index = json.loads((directory / self.INDEX).read_text())
        out = {p: torch.empty(shape, dtype=getattr(torch, dtype)) for p, (dtype, shape) in index.items()}

        def read(p: str) -> None:
            view, crc = _as_bytes(out[p]), bytearray(4)
            fd = os.open(directory / p / "c", os.O_RDONLY)
            try:
                if os.preadv(fd, [view, crc], 0) != view.nbytes + 4:
                    raise EOFError(f"{directory / p / 'c'}: short read")
            finally:
                os.close(fd)
            if crc32c.crc32c(view) != int.from_bytes(crc, "little"):
                raise ValueError(f"{p}: checksum mismatch")

        with cf.ThreadPoolExecutor(self.io_threads) as pool:
            list(pool.map(read, index))
        return out


@register
class RawOneFile(Method):
    """Raw without per-file costs: every tensor back to back in one file (4 KiB aligned), written with
    pwrite and read with preadv in <= 16 MiB pieces from the thread pool, one fsync. It shows how much of
    the gap between raw and a single-file format is file creation and per-file fsync."""

    name = "raw-1file"
    description = "one file, tensors back to back, parallel pwrite+one fsync / preadv into preallocated tensors"
    PIECE = 16 << 20
    ALIGN = 4096

    def _pieces(self, offset: int, view: memoryview) -> list[tuple[int, memoryview]]:
        return [(offset + i, view[i : i + self.PIECE]) for i in range(0, view.nbytes, self.PIECE)]

    def save(self, state: SyntheticState, directory: Path) -> None:
        index, offset = {}, 0
        for p, t in state.flat.items():
            index[p] = [offset, str(t.dtype).removeprefix("torch."), list(t.shape)]
            offset += -(-t.nbytes // self.ALIGN) * self.ALIGN
        fd = os.open(directory / "state.bin", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.ftruncate(fd, offset)

            def write(piece: tuple[int, memoryview]) -> None:
                at, view = piece
                while view.nbytes:
                    n = os.pwrite(fd, view, at)
                    at, view = at + n, view[n:]

            pieces = [x for p, t in state.flat.items() for x in self._pieces(index[p][0], _as_bytes(t.contiguous()))]
            with cf.ThreadPoolExecutor(self.io_threads) as pool:
                list(pool.map(write, pieces))
            os.fsync(fd)
        finally:
            os.close(fd)
        (directory / "index.json").write_text(json.dumps(index))
        fsync_path(directory / "index.json")
        fsync_path(directory)

    def load(self, directory: Path) -> dict[str, torch.Tensor]:
        import torch

        index = json.loads((directory / "index.json").read_text())
        out = {p: torch.empty(shape, dtype=getattr(torch, dtype)) for p, (_, dtype, shape) in index.items()}
        fd = os.open(directory / "state.bin", os.O_RDONLY)
        try:

            def read(piece: tuple[int, memoryview]) -> None:
                at, view = piece
                while view.nbytes:
                    n = os.preadv(fd, [view], at)
                    if n == 0:
                        raise EOFError(f"{directory / 'state.bin'}: short read at {at}")
                    at, view = at + n, view[n:]

            pieces = [x for p, t in out.items() for x in self._pieces(index[p][0], _as_bytes(t))]
            with cf.ThreadPoolExecutor(self.io_threads) as pool:
                list(pool.map(read, pieces))
        finally:
            os.close(fd)
        return out


# ------------------------------------------------------------------------------------------------------ ucp


@register
class Ucp(Method):
    name = "ucp"
    description = "ucp.save / ucp.load (Zarr v3, crc32c per chunk, fsync, commit marker)"
    remote = True

    def __init__(self, io_threads: int | None = None):
        super().__init__(io_threads)
        self.options = ucp.SaveOptions(fsync=True, io_threads=io_threads)

    @staticmethod
    def _url(directory: Any) -> tuple[str, dict[str, Any] | None]:
        if is_remote(directory):
            return (directory / "ckpt").url, directory.storage_options
        return str(directory / "ckpt"), None

    def save(self, state: SyntheticState, directory: Any) -> dict[str, float] | None:
        url, options = self._url(directory)
        ucp.save(state.tree, url, step=0, options=self.options, storage_options=options)
        return None

    def load(self, directory: Any) -> dict[str, torch.Tensor]:
        from .state import flatten

        url, options = self._url(directory)
        return flatten(ucp.load(url, step=0, storage_options=options))


@register
class UcpUnpacked(Ucp):
    """ucp with packing off: every atom a Zarr array of its own (the objects format 2 had), to set beside `ucp`."""

    name = "ucp-unpacked"
    description = "ucp.save / ucp.load with ChunkingPolicy(pack_below=0): no packs, a directory and zarr.json per atom"

    def __init__(self, io_threads: int | None = None):
        super().__init__(io_threads)
        self.options = ucp.SaveOptions(chunking=ucp.ChunkingPolicy(pack_below=0), fsync=True, io_threads=io_threads)


def timed_copy(state: SyntheticState) -> tuple[float, dict[str, torch.Tensor]]:
    """Seconds to copy_ every tensor of `state` into preallocated, pre-faulted tensors (the floor for an async
    save's blocking time), and the copies."""
    import torch

    dest = {p: torch.empty_like(t) for p, t in state.flat.items()}
    for t in dest.values():
        if t.numel():
            t.view(-1).view(torch.uint8)[::4096].zero_()  # fault the pages in, outside the timing
    t0 = time.perf_counter()
    for p, t in state.flat.items():
        dest[p].copy_(t)
    return time.perf_counter() - t0, dest


def plain_copy_s(state: SyntheticState) -> float:
    """`timed_copy`'s seconds. The runner times it right before each async save (outside the save's timing and
    RSS), so that the ratio pairs two figures taken under the same machine load."""
    return timed_copy(state)[0]


@register
class UcpAsync(Ucp):
    """CheckpointManager(mode="async"): save returns once the snapshot is in the staging pool; the time
    reported as save is the end-to-end time from the save call to the commit, `blocking_s` the time the caller
    was held.

    A trainer keeps one manager, so its staging pool and writer process are warm after the first save. Each
    measurement here needs a fresh root (a fresh manager), so the method keeps one SavePipeline (staging pool +
    writer process or threads) across its measurements and hands it to each manager: the first measurement of a
    run is a cold pool (memory allocated and faulted in), the later repeats are the steady state."""

    name = "ucp-async"
    paired_copy = True
    description = (
        "CheckpointManager(mode='async').save (writer process): blocking time (snapshot) and end-to-end time to commit"
    )
    writer = "process"

    def __init__(self, io_threads: int | None = None):
        super().__init__(io_threads)
        self._pipeline: Any = None

    def save(self, state: SyntheticState, directory: Any) -> dict[str, float] | None:
        from ucp.engine.pipeline import SavePipeline

        url, options = self._url(directory)
        if self._pipeline is None:
            self._pipeline = SavePipeline(self.io_threads, writer=self.writer)
            self._pipeline.start_writer()
        # a sync manager starts no writer process of its own; the shared pipeline runs its saves in async mode
        manager = ucp.CheckpointManager(url, mode="sync", options=self.options, storage_options=options)
        manager.pipeline.close()
        manager.pipeline = self._pipeline
        t0 = time.perf_counter()
        handle = manager.save(0, state.tree, mode="async")
        blocking = time.perf_counter() - t0
        manager.wait()
        return {"time_s": time.perf_counter() - t0, "blocking_s": blocking, "blocking_reported_s": handle.blocking_s}


@register
class UcpAsyncThreads(UcpAsync):
    """The same async save with writer threads in this process instead of the writer process."""

    name = "ucp-async-threads"
    description = "CheckpointManager(mode='async', writer='threads').save: blocking time and end-to-end time"
    writer = "threads"


# ---------------------------------------------------------------------------------------------------- torch


@register
class TorchSave(Method):
    name = "torch"
    description = "torch.save of the nested state / torch.load(weights_only=True), one file (S3: one object)"
    remote = True

    def save(self, state: SyntheticState, directory: Any) -> None:
        import torch

        if is_remote(directory):
            buf = io.BytesIO()
            torch.save(state.tree, buf)
            directory.fs.pipe_file((directory / "state.pt").path, buf.getbuffer().tobytes())
            return
        with open(directory / "state.pt", "wb") as f:
            torch.save(state.tree, f)
            f.flush()
            os.fsync(f.fileno())
        fsync_path(directory)

    def load(self, directory: Any) -> dict[str, torch.Tensor]:
        import torch

        from .state import flatten

        if is_remote(directory):
            data = directory.fs.cat_file((directory / "state.pt").path)
            return flatten(torch.load(io.BytesIO(data), weights_only=True))
        return flatten(torch.load(directory / "state.pt", weights_only=True))


# ---------------------------------------------------------------------------------------------- safetensors


@register
class Safetensors(Method):
    """safetensors' default load_file maps the file and reads nothing until a tensor is touched; timing
    that would measure mmap(2), not IO. The eager 'pread' backend reads every byte before returning."""

    name = "safetensors"
    description = "safetensors save_file / load_file(backend='pread'), one file (S3: save()/load() bytes, one object)"
    backend = "pread"
    remote = True

    def save(self, state: SyntheticState, directory: Any) -> None:
        from safetensors.torch import save, save_file

        if is_remote(directory):
            directory.fs.pipe_file((directory / "state.safetensors").path, save(state.flat))
            return

        save_file(state.flat, directory / "state.safetensors")
        fsync_path(directory / "state.safetensors")
        fsync_path(directory)

    def load(self, directory: Any) -> dict[str, torch.Tensor]:
        from safetensors.torch import load, load_file

        if is_remote(directory):
            return load(directory.fs.cat_file((directory / "state.safetensors").path))
        try:
            return load_file(directory / "state.safetensors", backend=self.backend)
        except TypeError:  # safetensors < 0.8 has no backend choice: map, then fault every page in
            return touch_pages(load_file(directory / "state.safetensors"))


def touch_pages(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Read one byte of every page (and the last byte) of each tensor, so mapped files are really read."""
    import torch

    page = os.sysconf("SC_PAGE_SIZE")
    for t in tensors.values():
        if t.numel():
            flat = t.reshape(-1).view(torch.uint8)
            flat[::page].sum().item()  # a read of every page faults it in
            flat[-1].item()
    return tensors


@register
class SafetensorsMmap(Safetensors):
    """The default (mmap) load, with every page touched inside the timing so all bytes are really read."""

    name = "safetensors-mmap"
    description = "safetensors load_file (default mmap backend), every page touched"
    backend = "mmap"
    remote = False

    def load(self, directory: Path) -> dict[str, torch.Tensor]:
        from safetensors.torch import load_file

        return touch_pages(load_file(directory / "state.safetensors"))


# --------------------------------------------------------------------------------------------- PyTorch DCP


_DCP_NOISE = r"torch\.distributed is disabled"
warnings.filterwarnings("ignore", message=_DCP_NOISE, category=UserWarning)  # also async_save's writer thread


@contextlib.contextmanager
def _dcp() -> Iterator[None]:
    """Around a DCP call. no_dist=True is what we mean: DCP's 'assuming the intent is to save in a single process' is
    noise. DCP raises its failures as CheckpointException, a BaseException that would end the whole run rather than
    one measurement: it is raised as the RuntimeError of the first failing rank's own exception."""
    from torch.distributed.checkpoint.api import CheckpointException

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_DCP_NOISE, category=UserWarning)
        try:
            yield
        except CheckpointException as e:
            cause = next((exc for exc, _ in e.failures.values()), None)
            raise RuntimeError(one_line(cause) if cause is not None else "CheckpointException") from cause


def one_line(e: BaseException) -> str:
    """An exception as one line: its type and the first line of its message."""
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0] if text else ''}"[:300]


@register
class Dcp(Method):
    """torch.distributed.checkpoint in one process with no process group (no_dist=True): FileSystemWriter
    (fsync on, `io_threads` writer threads) locally, its fsspec writer/reader on S3. DCP loads in place, so the
    load allocates empty tensors of the saved shapes (timed, as raw's are) and fills them."""

    name = "dcp"
    description = "torch.distributed.checkpoint save/load, no_dist; FileSystemWriter(sync_files, thread_count) / FsspecWriter on S3"
    remote = True

    def _writer(self, directory: Any) -> Any:
        if is_remote(directory):
            from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

            return FsspecWriter(
                (directory / "dcp").url, thread_count=self.io_threads, sync_files=False, **directory.fsspec_options
            )
        from torch.distributed.checkpoint import FileSystemWriter

        return FileSystemWriter(directory / "dcp", sync_files=True, thread_count=self.io_threads)

    def _reader(self, directory: Any) -> Any:
        if is_remote(directory):
            from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

            return FsspecReader((directory / "dcp").url, **directory.fsspec_options)
        from torch.distributed.checkpoint import FileSystemReader

        return FileSystemReader(directory / "dcp")

    def save(self, state: SyntheticState, directory: Any) -> dict[str, float] | None:
        import torch.distributed.checkpoint as dcp

        self._shapes = {p: (t.shape, t.dtype) for p, t in state.flat.items()}
        with _dcp():
            dcp.save(dict(state.flat), storage_writer=self._writer(directory), no_dist=True)
        if not is_remote(directory):
            fsync_path(directory)
        return None

    def load(self, directory: Any) -> dict[str, torch.Tensor]:
        import torch
        import torch.distributed.checkpoint as dcp

        out = {p: torch.empty(shape, dtype=dtype) for p, (shape, dtype) in self._shapes.items()}
        with _dcp():
            dcp.load(out, storage_reader=self._reader(directory), no_dist=True)
        return out


@register
class DcpAsync(Dcp):
    """dcp.async_save (thread checkpointer, default stager: a copy of the state to CPU memory before it
    returns); save time is the end-to-end time to the finished future."""

    name = "dcp-async"
    paired_copy = True
    description = "torch.distributed.checkpoint async_save (no_dist): blocking time and end-to-end time"

    def save(self, state: SyntheticState, directory: Any) -> dict[str, float] | None:
        import torch.distributed.checkpoint as dcp

        self._shapes = {p: (t.shape, t.dtype) for p, t in state.flat.items()}
        t0 = time.perf_counter()
        with _dcp():
            future = dcp.async_save(dict(state.flat), storage_writer=self._writer(directory), no_dist=True)
        blocking = time.perf_counter() - t0
        result = getattr(future, "upload_completion", future)  # AsyncSaveResponse in some versions
        result.result()
        if not is_remote(directory):
            fsync_path(directory)
        return {"blocking_s": blocking}


# ------------------------------------------------------------------------------------- S3 peers (optional)


@contextlib.contextmanager
def aws_environment(options: dict[str, Any]) -> Iterator[None]:
    """The S3 peers' clients (AWS's CRT, in s3torchconnector and runai-model-streamer) take no storage options: the
    endpoint and keys of `options` go in the AWS variables for the call, and the instance-metadata lookup is off (on a
    machine outside EC2 it only waits). The variables as they were are put back."""
    wanted = {"AWS_ENDPOINT_URL": options.get("endpoint_url"), "AWS_EC2_METADATA_DISABLED": "true"}
    wanted |= {"AWS_ACCESS_KEY_ID": options.get("key"), "AWS_SECRET_ACCESS_KEY": options.get("secret")}
    wanted.setdefault("AWS_DEFAULT_REGION", os.environ.get("AWS_DEFAULT_REGION") or "us-east-1")
    with environment(wanted):
        yield


@contextlib.contextmanager
def runai_environment(options: dict[str, Any]) -> Iterator[None]:
    """runai-model-streamer's settings for an S3 server of `options` (its own and vLLM's runai_streamer loader's),
    with the AWS variables (`aws_environment`): its C++ client's endpoint named for the call (vLLM's loader copies
    AWS_ENDPOINT_URL into RUNAI_STREAMER_S3_ENDPOINT when that is unset, and leaves it set: a second server would be
    read at the first's address); a request timeout of a minute instead of its 1 s (moto, a Python server, takes longer
    than that for its 8 MiB ranges on 2 busy cores, and the load fails with "File access error"); and boto3's default
    session, with which vLLM lists the bucket, made anew (it keeps the keys it first resolved: a second server refuses
    the first's, InvalidAccessKeyId)."""
    runai = {"RUNAI_STREAMER_S3_ENDPOINT": options.get("endpoint_url"), "RUNAI_STREAMER_S3_REQUEST_TIMEOUT_MS": "60000"}
    _forget_boto3_session()
    try:
        with aws_environment(options), environment(runai):
            yield
    finally:
        _forget_boto3_session()


def _forget_boto3_session() -> None:
    boto3 = sys.modules.get("boto3")  # (not imported: no session to forget)
    if boto3 is not None:
        boto3.DEFAULT_SESSION = None


@contextlib.contextmanager
def environment(values: dict[str, str | None]) -> Iterator[None]:
    """The variables of `values` set for the call (a None leaves that one as it is): for a peer that reads its
    configuration from the environment. The variables as they were are put back."""
    before = {k: os.environ.get(k) for k in values}
    os.environ.update({k: v for k, v in values.items() if v is not None})
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


_QUIET_HOOK: list[Any] = []


def _quiet_threads() -> None:
    """DCP's writer threads print each failure of s3torchconnector's client (64 of them, some after DCP has raised
    the first): once, in the measurement's error, is enough. Other threads' failures are printed as before."""
    import threading

    if _QUIET_HOOK:
        return
    previous = threading.excepthook

    def hook(args: Any) -> None:
        if type(args.exc_value).__name__ != "S3Exception":
            previous(args)

    _QUIET_HOOK.append(hook)
    threading.excepthook = hook


def _region() -> str:
    return os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"


@register
class DcpS3Torch(Dcp):
    """PyTorch DCP through AWS's s3torchconnector (`pip install 's3torchconnector[dcp]'`): its S3StorageWriter and
    S3StorageReader on its own CRT client (path-style addressing, `io_threads` writer threads, the endpoint from
    AWS_ENDPOINT_URL). Where its save fails after writing every file (radosgw 16 answers a multipart upload's
    completion without the ETag header that its client requires), the save is reported failed with that error and the
    same checkpoint is written by DCP's own fsspec writer, so that its load is still measured."""

    name = "dcp-s3torch"
    description = "DCP through s3torchconnector's S3StorageWriter/S3StorageReader (AWS CRT client), no_dist; S3 only"
    remote = True
    local = False
    needs = ("s3torchconnector",)

    def _config(self) -> Any:
        from s3torchconnector import S3ClientConfig

        return S3ClientConfig(force_path_style=True)

    def save(self, state: SyntheticState, directory: Any) -> dict[str, Any] | None:
        import torch.distributed.checkpoint as dcp
        from s3torchconnector.dcp import S3StorageWriter

        self._shapes = {p: (t.shape, t.dtype) for p, t in state.flat.items()}
        _quiet_threads()
        try:
            with aws_environment(directory.storage_options), _dcp():
                writer = S3StorageWriter(
                    _region(), (directory / "dcp").url, s3client_config=self._config(), thread_count=self.io_threads
                )
                dcp.save(dict(state.flat), storage_writer=writer, no_dist=True)
        except RuntimeError as e:
            super().save(state, directory)  # (DCP's fsspec writer: the same checkpoint, for the load)
            return {"save_error": str(e)}
        return None

    def load(self, directory: Any) -> dict[str, torch.Tensor]:
        import torch
        import torch.distributed.checkpoint as dcp
        from s3torchconnector.dcp import S3StorageReader

        out = {p: torch.empty(shape, dtype=dtype) for p, (shape, dtype) in self._shapes.items()}
        with aws_environment(directory.storage_options), _dcp():
            reader = S3StorageReader(_region(), (directory / "dcp").url, s3client_config=self._config())
            dcp.load(out, storage_reader=reader, no_dist=True)
        return out


@register
class Runai(Safetensors):
    """Run:ai's model streamer (`pip install runai-model-streamer runai-model-streamer-s3`) streaming one safetensors
    file from S3 (its own CRT client, its default concurrency and memory limit; the endpoint from AWS_ENDPOINT_URL),
    every tensor its own (owned=True): an inference engine's cold start (vLLM's load_format=runai_streamer). The
    file is put as `safetensors` puts it."""

    name = "runai"
    description = "safetensors file put by s3fs / streamed by runai-model-streamer's SafetensorsStreamer; S3 only"
    local = False
    needs = ("runai_model_streamer",)

    def load(self, directory: Any) -> dict[str, torch.Tensor]:
        from runai_model_streamer import SafetensorsStreamer

        with runai_environment(directory.storage_options), SafetensorsStreamer() as streamer:
            streamer.stream_file((directory / "state.safetensors").url)
            return dict(streamer.get_tensors())


# ---------------------------------------------------------------------------------------- plain copy


@register
class PlainCopy(Method):
    """The floor for an async save's blocking time: copy_ of every tensor into preallocated tensors of the
    same shapes (allocated, and touched, before the timing), with `io_threads` threads as ucp's snapshot may
    use. No storage: run once per state; its 'save' time is the copy, its blocking time the same."""

    name = "copy"
    description = "copy_ into preallocated tensors (the floor for an async save's blocking time); no storage"
    storage = False
    remote = True

    def save(self, state: SyntheticState, directory: Any) -> dict[str, float] | None:
        timed_copy(state)  # warm, as before the copies paired with the async saves (runner.measure)
        elapsed, self._dest = timed_copy(state)
        return {"blocking_s": elapsed, "time_s": elapsed}

    def load(self, directory: Any) -> dict[str, torch.Tensor]:
        dest, self._dest = self._dest, {}
        return dest


DEFAULT_METHODS = ("raw", "ucp", "ucp-async", "torch", "safetensors", "dcp", "dcp-async", "copy")
