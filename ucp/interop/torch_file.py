"""torch.save / torch.load files a tensor at a time, so that a file never needs to be wholly in memory.

A torch.save file is a zip archive (torch/serialization.py `_save`): `data.pkl`, the object pickled with every
tensor storage replaced by a persistent id ("storage", storage type, key, location, numel), then the records
`.format_version`, `.storage_alignment`, `byteorder`, and one uncompressed, aligned record `data/<key>` per
storage (the writer adds `version` and the serialization id on close).

`save` writes the same records, but a tensor may be a `Deferred` placeholder: the pickle needs only its dtype
and shape, and its values are produced just before its record is written and freed right after.

`TorchFile` is the reading side: `data.pkl` is unpickled by torch's weights-only unpickler (the caller's
`torch.serialization.safe_globals` apply, as in `torch.load(weights_only=True)`), with every tensor on the meta
device; `read` then fetches one tensor's bytes from its record with a positioned read into a fresh tensor.
"""

from __future__ import annotations

import collections
import io
import os
import pickle
import struct
import sys
import zipfile
import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import _weights_only_unpickler

from ..base import heap

PICKLE_PROTOCOL = 2  # torch.save's default


@dataclass(frozen=True, eq=False)
class Deferred:
    """A tensor whose values are made only when `save` writes its record (C-contiguous on load): whole, by
    `produce()`, or part by part, by `parts()` (a 1-D tensor too large to hold at once, e.g. a distributed
    optimizer's flat buffer): (element offset, values) in increasing offsets, elements no part covers zero, one part
    in memory at a time."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    produce: Callable[[], torch.Tensor] | None = None
    parts: Callable[[], Iterable[tuple[int, torch.Tensor]]] | None = None

    @property
    def nbytes(self) -> int:
        return torch.Size(self.shape).numel() * self.dtype.itemsize


@dataclass(frozen=True, eq=False)
class _DeferredStorage:
    """What a Deferred tensor's pickle names as its storage (the pickler turns it into a persistent id)."""

    tensor: Deferred


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


class _Pickler(pickle.Pickler):
    """torch.save's pickler (same persistent ids, same keys in order of first use), plus Deferred tensors,
    pickled as a real tensor would be: `_rebuild_tensor_v2` of a storage of their own."""

    def __init__(self, buffer: io.BytesIO):
        super().__init__(buffer, protocol=PICKLE_PROTOCOL)
        self.keys: dict[tuple[str, int], str] = {}  # storage identity -> record key
        self.storages: dict[str, torch.UntypedStorage | Deferred] = {}

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, Deferred):
            args: tuple = (
                _DeferredStorage(obj),
                0,
                tuple(obj.shape),
                _contiguous_strides(obj.shape),
                False,
                collections.OrderedDict(),
            )
            return torch._utils._rebuild_tensor_v2, args
        return NotImplemented

    def persistent_id(self, obj: Any) -> Any:
        storage: Any
        if isinstance(obj, _DeferredStorage):
            identity, storage, dtype, numel = (
                ("deferred", id(obj.tensor)),
                obj.tensor,
                obj.tensor.dtype,
                torch.Size(obj.tensor.shape).numel(),
            )
        elif isinstance(obj, torch.storage.TypedStorage):
            if obj._untyped_storage.device.type != "cpu":
                raise ValueError(f"torch_file.save writes CPU tensors, not {obj._untyped_storage.device}")
            identity, storage, dtype, numel = (
                ("storage", obj._untyped_storage._cdata),
                obj._untyped_storage,
                obj.dtype,
                obj._size(),
            )
        elif torch.is_storage(obj):
            raise ValueError("torch_file.save writes tensors, not bare untyped storages")
        else:
            return None
        key = self.keys.setdefault(identity, str(len(self.keys)))
        self.storages[key] = storage
        storage_type = getattr(torch, torch.storage._dtype_to_storage_type_map()[dtype])
        return ("storage", storage_type, key, "cpu", numel)


def save(obj: Any, path: str | Path) -> None:
    """torch.save(obj, path), with `Deferred` tensors produced one at a time while their records are written
    (those made part by part: after the archive is written, into the space it reserved for them)."""
    buffer = io.BytesIO()
    pickler = _Pickler(buffer)
    pickler.dump(obj)
    data = buffer.getvalue()
    in_parts: dict[str, Deferred] = {}
    with torch.serialization._open_zipfile_writer(str(path)) as writer:  # torch.save's own writer and alignment
        writer.write_record("data.pkl", data, len(data))
        writer.write_record(".format_version", "1", len("1"))
        alignment = str(torch.serialization._get_storage_alignment())
        writer.write_record(".storage_alignment", alignment, len(alignment))
        writer.write_record("byteorder", sys.byteorder, len(sys.byteorder))
        for key, storage in pickler.storages.items():
            if isinstance(storage, Deferred) and storage.parts is not None:
                writer.write_record_metadata(f"data/{key}", storage.nbytes)  # (space only)
                in_parts[f"data/{key}"] = storage
            elif isinstance(storage, Deferred):
                _write_deferred(writer, f"data/{key}", storage)
            else:
                writer.write_record(f"data/{key}", storage, storage.nbytes())
    if in_parts:
        _fill_records(Path(path), in_parts)


def _fill_records(path: Path, records: dict[str, Deferred]) -> None:
    """Write the values of records whose space the archive reserved, part by part, and their CRC-32 into the
    record's local header and central directory entry (the writer left 0 there), so the file is a valid zip."""
    with zipfile.ZipFile(path) as z:
        infos = {info.filename.partition("/")[2]: info for info in z.infolist()}
        central = z.start_dir  # (where the central directory starts)
    with open(path, "r+b") as f:
        fd = f.fileno()
        crcs: dict[str, int] = {}
        for name, d in records.items():
            info = infos[name]
            name_len, extra_len = struct.unpack("<HH", os.pread(fd, 4, info.header_offset + 26))
            start = info.header_offset + _LOCAL_HEADER + name_len + extra_len
            if info.file_size != d.nbytes:
                raise ValueError(f"{path}: record {name} has {info.file_size} bytes reserved, not {d.nbytes}")
            crcs[info.filename] = crc = _write_parts(fd, start, d, f"{path}: {name}")
            os.pwrite(fd, struct.pack("<I", crc), info.header_offset + 14)
        at = central
        while os.pread(fd, 4, at) == _CENTRAL_SIGNATURE:
            name_len, extra_len, comment_len = struct.unpack("<HHH", os.pread(fd, 6, at + 28))
            filename = os.pread(fd, name_len, at + _CENTRAL_HEADER).decode()
            if filename in crcs:
                os.pwrite(fd, struct.pack("<I", crcs[filename]), at + 16)
            at += _CENTRAL_HEADER + name_len + extra_len + comment_len


_LOCAL_HEADER = 30  # bytes of a zip local file header before its name (CRC-32 at 14)
_CENTRAL_HEADER = 46  # bytes of a central directory entry before its name (CRC-32 at 16)
_CENTRAL_SIGNATURE = b"PK\x01\x02"
_ZEROS = bytes(1 << 20)
TRIM_EVERY = 8 << 20  # bytes of parts written between two heap trims (each costs a walk of the heap)


def _write_parts(fd: int, start: int, d: Deferred, where: str) -> int:
    """A 1-D Deferred's parts written at `start` (the gaps as zeros); returns the CRC-32 of its bytes."""
    assert d.parts is not None
    numel, itemsize = d.nbytes // d.dtype.itemsize, d.dtype.itemsize
    crc, at = 0, 0  # (at: the next element to write)
    untrimmed = 0  # bytes of parts freed since the heap was last trimmed

    def zeros(until: int) -> int:
        nonlocal crc, at
        while at < until:
            block = _ZEROS[: min(len(_ZEROS), (until - at) * itemsize)]
            os.pwrite(fd, block, start + at * itemsize)
            crc = zlib.crc32(block, crc)
            at += len(block) // itemsize
        return crc

    for offset, values in d.parts():
        n = values.numel()
        if values.dtype != d.dtype or offset < at or offset + n > numel:
            raise ValueError(
                f"{where}: a part of {n} {values.dtype} elements at {offset} does not fit a {d.dtype} tensor of "
                f"{numel} whose parts up to {at} are written"
            )
        zeros(offset)
        data = values.reshape(-1).contiguous().view(torch.uint8).numpy().data
        os.pwrite(fd, data, start + offset * itemsize)
        crc = zlib.crc32(data, crc)
        at = offset + n
        del values, data
        untrimmed += n * itemsize
        if untrimmed >= TRIM_EVERY:  # (a record of many parts: freed parts' pages, up to a file's worth, stay resident)
            heap.trim()
            untrimmed = 0
    zeros(numel)
    heap.trim()
    return crc


def _write_deferred(writer: Any, name: str, d: Deferred) -> None:
    assert d.produce is not None
    t = d.produce()
    if tuple(t.shape) != tuple(d.shape) or t.dtype != d.dtype or t.device.type != "cpu":
        raise ValueError(
            f"{name}: produced a {t.dtype} {list(t.shape)} tensor on {t.device}, promised {d.dtype} {list(d.shape)} on cpu"
        )
    t = t.contiguous()
    if t.storage_offset() != 0 or t.untyped_storage().nbytes() != d.nbytes:
        t = t.clone()  # a view into a larger storage: write only its own bytes
    writer.write_record(name, t.untyped_storage(), d.nbytes)
    del t
    heap.trim()  # the freed tensor's pages, or a file's worth of them can stay resident


class _Slice(io.RawIOBase):
    """Bytes [start, start + length) of a file, as a seekable file of their own (a torch.save blob inside a
    torch.distributed.checkpoint .distcp file)."""

    def __init__(self, f: io.BufferedReader, start: int, length: int):
        self._f, self._start, self._length, self._pos = f, start, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = 0) -> int:
        self._pos = {0: 0, 1: self._pos, 2: self._length}[whence] + offset
        return self._pos

    def readinto(self, b: Any) -> int:
        view = memoryview(b).cast("B")[: max(0, self._length - self._pos)]
        got = os.preadv(self._f.fileno(), [view], self._start + self._pos) if len(view) else 0
        self._pos += got
        return got


class TorchFile:
    """A torch.save file opened for reading tensor by tensor: `obj` holds meta tensors, `read` fills one.
    `start` and `length` open a torch.save blob stored at that byte range of a larger file."""

    def __init__(self, path: str | Path, start: int = 0, length: int | None = None):
        self.path = Path(path)
        self._start = start
        with open(self.path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if length is None:
                length = size - start
            if start < 0 or length < 0 or start + length > size:
                raise ValueError(f"{self.path}: bytes [{start}, {start + length}) lie outside its {size} bytes")
            whole = (start, length) == (0, size)
            opener: Any = torch._C.PyTorchFileReader  # (its stubs lack has_record, get_record_offset, file objects)
            reader = opener(str(self.path) if whole else _Slice(f, start, length))
            if reader.has_record("byteorder") and reader.get_record("byteorder").decode() != sys.byteorder:
                raise ValueError(
                    f"{self.path} was written on a {reader.get_record('byteorder').decode()}-endian machine"
                )
            self._offsets = {
                name: reader.get_record_offset(name) for name in reader.get_all_records() if name.startswith("data/")
            }
            with zipfile.ZipFile(self.path if whole else _Slice(f, start, length)) as z:
                self._sizes = {info.filename.partition("/")[2]: info.file_size for info in z.infolist()}
            for name, offset in self._offsets.items():
                if offset + self._sizes.get(name, 0) > length:
                    raise ValueError(f"{self.path}: record {name} runs past the end of its archive")
            pkl = reader.get_record("data.pkl")
        self._keys: dict[int, tuple[str, torch.UntypedStorage]] = {}  # meta storage -> its record key (kept alive)
        unpickler = _weights_only_unpickler.Unpickler(io.BytesIO(pkl), encoding="utf-8")
        unpickler.persistent_load = self._persistent_load  # type: ignore[method-assign]
        self.obj = unpickler.load()

    def _persistent_load(self, pid: tuple[Any, ...]) -> torch.storage.TypedStorage:
        _, storage_type, key, _location, numel = pid
        dtype = torch.uint8 if storage_type is torch.UntypedStorage else storage_type.dtype
        if self._sizes.get(f"data/{key}") != numel * dtype.itemsize:
            raise ValueError(f"{self.path}: storage {key} of {numel} {dtype} elements has no record of that size")
        storage = torch.UntypedStorage(numel * dtype.itemsize, device="meta")
        self._keys[storage._cdata] = (key, storage)
        return torch.storage.TypedStorage(wrap_storage=storage, dtype=dtype, _internal=True)

    def holds(self, t: torch.Tensor) -> bool:
        """Whether meta tensor `t` is (a view of) one of this file's tensors."""
        return t.untyped_storage()._cdata in self._keys

    def read(self, t: torch.Tensor) -> torch.Tensor:
        """The values of meta tensor `t` of `obj`, read from its record into a fresh CPU tensor."""
        key, _ = self._keys[t.untyped_storage()._cdata]
        offset = t.storage_offset() * t.element_size()
        span = 0 if t.numel() == 0 else 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
        raw = torch.empty(span * t.element_size(), dtype=torch.uint8)
        view, position = raw.numpy().data, self._start + self._offsets[f"data/{key}"] + offset
        with open(self.path, "rb", buffering=0) as f:
            while view:  # one pread returns at most ~2 GiB
                got = os.preadv(f.fileno(), [view], position)
                if got == 0:
                    raise EOFError(f"{self.path}: record data/{key} is truncated")
                view, position = view[got:], position + got
        return raw.view(t.dtype).as_strided(t.shape, t.stride())


class TorchFiles:
    """Several opened files read as one: `read` fetches a meta tensor from the file that holds it."""

    def __init__(self, files: list[TorchFile]):
        self.files = files

    def read(self, t: torch.Tensor) -> torch.Tensor:
        for f in self.files:
            if f.holds(t):
                return f.read(t)
        raise KeyError(f"no file of {[str(f.path) for f in self.files]} holds this tensor")
