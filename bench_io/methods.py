"""The ways of moving a state to storage and back, behind one interface, so each is timed the same way.

Every method's save makes its bytes durable (fsync of each file, and of new directories) before it
returns, and its load returns tensors whose bytes are in process memory (no lazy mmap), since that is what
a training job resuming from a checkpoint needs. Loads return the flat view ('a/b/c' -> tensor) so the
runner can verify any method against the saved state.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
from abc import ABC, abstractmethod
from pathlib import Path
from typing import ClassVar

import torch

import ucp
from ucp.checkpoint import DEFAULT_IO_THREADS

from .state import SyntheticState, flatten

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

    def __init__(self, io_threads: int = DEFAULT_IO_THREADS):
        self.io_threads = io_threads

    @abstractmethod
    def save(self, state: SyntheticState, directory: Path) -> None:
        """Write `state` under the (empty) `directory`; durable on return."""

    @abstractmethod
    def load(self, directory: Path) -> dict[str, torch.Tensor]:
        """Read back what `save` wrote: the flat tensors, in memory."""


METHODS: dict[str, type[Method]] = {}


def register(cls: type[Method]) -> type[Method]:
    METHODS[cls.name] = cls
    return cls


# ------------------------------------------------------------------------------------------- raw (the limit)


def _as_bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


@register
class Raw(Method):
    """The limit: one file per tensor, os.write + fsync, read with os.readv straight into preallocated
    tensors; as many threads as ucp uses. No format, no checksums, no copies."""

    name = "raw"
    description = "one file per tensor, os.write+fsync / os.readv into preallocated tensors"
    INDEX = "index.json"

    @staticmethod
    def _write(path: Path, t: torch.Tensor) -> None:
        view = _as_bytes(t.contiguous())
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            while view.nbytes:
                view = view[os.write(fd, view[:MAX_IO]) :]
            os.fsync(fd)
        finally:
            os.close(fd)

    @staticmethod
    def _read(path: Path, out: torch.Tensor) -> None:
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

    def save(self, state: SyntheticState, directory: Path) -> None:
        index = {
            p: [f"{i}.bin", str(t.dtype).removeprefix("torch."), list(t.shape)]
            for i, (p, t) in enumerate(state.flat.items())
        }
        with cf.ThreadPoolExecutor(self.io_threads) as pool:
            list(pool.map(lambda p: self._write(directory / index[p][0], state.flat[p]), index))
        (directory / self.INDEX).write_text(json.dumps(index))
        fsync_path(directory / self.INDEX)
        fsync_path(directory)

    def load(self, directory: Path) -> dict[str, torch.Tensor]:
        index = json.loads((directory / self.INDEX).read_text())
        out = {p: torch.empty(shape, dtype=getattr(torch, dtype)) for p, (_, dtype, shape) in index.items()}
        with cf.ThreadPoolExecutor(self.io_threads) as pool:
            list(pool.map(lambda p: self._read(directory / index[p][0], out[p]), index))
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

    def __init__(self, io_threads: int = DEFAULT_IO_THREADS):
        super().__init__(io_threads)
        self.options = ucp.SaveOptions(fsync=True, io_threads=io_threads)

    def save(self, state: SyntheticState, directory: Path) -> None:
        ucp.save(state.tree, str(directory / "ckpt"), step=0, options=self.options)

    def load(self, directory: Path) -> dict[str, torch.Tensor]:
        return flatten(ucp.load(str(directory / "ckpt"), step=0))


# ---------------------------------------------------------------------------------------------------- torch


@register
class TorchSave(Method):
    name = "torch"
    description = "torch.save of the nested state / torch.load(weights_only=True), one file"

    def save(self, state: SyntheticState, directory: Path) -> None:
        with open(directory / "state.pt", "wb") as f:
            torch.save(state.tree, f)
            f.flush()
            os.fsync(f.fileno())
        fsync_path(directory)

    def load(self, directory: Path) -> dict[str, torch.Tensor]:
        return flatten(torch.load(directory / "state.pt", weights_only=True))


# ---------------------------------------------------------------------------------------------- safetensors


@register
class Safetensors(Method):
    """safetensors' default load_file maps the file and reads nothing until a tensor is touched; timing
    that would measure mmap(2), not IO. The eager 'pread' backend reads every byte before returning."""

    name = "safetensors"
    description = "safetensors save_file / load_file(backend='pread'), one file"
    backend = "pread"

    def save(self, state: SyntheticState, directory: Path) -> None:
        from safetensors.torch import save_file

        save_file(state.flat, directory / "state.safetensors")
        fsync_path(directory / "state.safetensors")
        fsync_path(directory)

    def load(self, directory: Path) -> dict[str, torch.Tensor]:
        from safetensors.torch import load_file

        try:
            return load_file(directory / "state.safetensors", backend=self.backend)
        except TypeError:  # safetensors < 0.8 has no backend choice: map, then fault every page in
            return touch_pages(load_file(directory / "state.safetensors"))


def touch_pages(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Read one byte of every page (and the last byte) of each tensor, so mapped files are really read."""
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

    def load(self, directory: Path) -> dict[str, torch.Tensor]:
        from safetensors.torch import load_file

        return touch_pages(load_file(directory / "state.safetensors"))


DEFAULT_METHODS = ("raw", "ucp", "torch", "safetensors")
