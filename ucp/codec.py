"""Chunk encoding: how one stored object of an atom is laid out, written and verified.

An object is either a plain chunk (the chunk's little-endian bytes, then its crc32c) or a shard
(`sharding_indexed`, index at the start): an index of (offset, nbytes) uint64 pairs, one per inner chunk in
C order, followed by the index's crc32c, then the inner chunks, each its bytes and its crc32c. Edge chunks
are padded to the full chunk shape, as Zarr's regular grid requires; inner chunks wholly outside the array
are absent (index entry all ones).
"""

from __future__ import annotations

import functools
import math
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import crc32c
import torch

from . import dtypes
from .boxes import Box, to_slices
from .errors import IntegrityError
from .format import CRC_BYTES, EMPTY_INDEX_ENTRY, INDEX_ENTRY_BYTES, AtomMeta, chunk_indices
from .storage import Storage, scatter_into


def _crc(*bufs: memoryview | bytes | bytearray) -> bytes:
    """CRC-32C of the buffers laid back to back, as the 4 little-endian bytes the crc32c codec stores."""
    value = 0
    for buf in bufs:
        value = crc32c.crc32c(buf, value)
    return struct.pack("<I", value)


@functools.lru_cache(maxsize=16)
def _zeros(nbytes: int) -> bytes:
    return bytes(nbytes)


def _tail_padded(part: torch.Tensor, full_shape: tuple[int, ...]) -> bool:
    """True when `part` lacks only trailing rows of `full_shape`: its padding is one zero tail in C order."""
    return tuple(part.shape[1:]) == full_shape[1:] and part.is_contiguous()


def _chunk_parts(part: torch.Tensor, full_shape: tuple[int, ...]) -> list[memoryview | bytes]:
    """The bytes of `part` laid out in a chunk of `full_shape` (zero padding at the array's edge), then the
    chunk's checksum. An edge chunk short of rows only gets a shared zero tail, not a padded copy."""
    if tuple(part.shape) == full_shape:
        data = dtypes.as_bytes(part.contiguous())
        return [data, _crc(data)]
    if _tail_padded(part, full_shape):
        data = dtypes.as_bytes(part)
        tail = _zeros(math.prod(full_shape) * part.element_size() - data.nbytes)
        return [data, tail, _crc(data, tail)]
    padded = torch.zeros(full_shape, dtype=part.dtype)
    padded[tuple(slice(0, n) for n in part.shape)] = part
    data = dtypes.as_bytes(padded)
    return [data, _crc(data)]


def _inner_boxes(meta: AtomMeta, outer: tuple[int, ...]) -> list[Box | None]:
    """Absolute boxes of the inner chunks of shard `outer` in C order; None for those outside the array."""
    assert meta.inner_chunk_shape is not None
    boxes: list[Box | None] = []
    for inner in chunk_indices(meta.inner_grid):
        start = [o * c + i * s for o, c, i, s in zip(outer, meta.chunk_shape, inner, meta.inner_chunk_shape)]
        if any(a >= n for a, n in zip(start, meta.shape)):
            boxes.append(None)
        else:
            boxes.append(tuple((a, min(a + s, n)) for a, s, n in zip(start, meta.inner_chunk_shape, meta.shape)))
    return boxes


def index_nbytes(meta: AtomMeta) -> int:
    return math.prod(meta.inner_grid) * INDEX_ENTRY_BYTES + CRC_BYTES


def encode(meta: AtomMeta, outer: tuple[int, ...], chunk: torch.Tensor) -> list[memoryview | bytes]:
    """The parts (to be written back to back) of the object for chunk `outer`, whose values are `chunk`
    (the chunk's region of the array, clipped at the edge)."""
    if meta.inner_chunk_shape is None:
        return _chunk_parts(chunk, meta.chunk_shape)
    origin = tuple(a for a, _ in meta.chunk_box(outer))
    parts: list[memoryview | bytes] = []
    entries: list[int] = []
    offset = index_nbytes(meta)
    for box in _inner_boxes(meta, outer):
        if box is None:
            entries += [EMPTY_INDEX_ENTRY, EMPTY_INDEX_ENTRY]
            continue
        local = tuple((a - o, b - o) for (a, b), o in zip(box, origin))
        inner_parts = _chunk_parts(chunk[to_slices(local)], meta.inner_chunk_shape)
        nbytes = sum(len(p) if isinstance(p, bytes) else p.nbytes for p in inner_parts)
        parts += inner_parts
        entries += [offset, nbytes]
        offset += nbytes
    index = struct.pack(f"<{len(entries)}Q", *entries)
    return [index, _crc(index), *parts]


# ------------------------------------------------------------------------------------------ decoding


@dataclass(frozen=True)
class InnerChunk:
    """Where one inner chunk lies in its shard object, and which part of the array it holds."""

    box: Box
    offset: int
    nbytes: int


def _verify(payload: Sequence[memoryview | bytes | bytearray], stored_crc: memoryview | bytes | bytearray, where: str) -> None:
    """Check the CRC-32C of the payload (its parts back to back) against the stored checksum."""
    if _crc(*payload) != bytes(stored_crc):
        raise IntegrityError(f"{where}: checksum mismatch (crc32c), the stored bytes are damaged")


def parse_index(meta: AtomMeta, outer: tuple[int, ...], data: bytes | memoryview, where: str) -> list[InnerChunk]:
    """Verify a shard's index and return the inner chunks it lists (boxes in array coordinates)."""
    n = index_nbytes(meta)
    if len(data) < n:
        raise IntegrityError(f"{where}: truncated shard ({len(data)} bytes, its index alone needs {n})")
    raw = memoryview(data)[: n - CRC_BYTES]
    _verify([raw], memoryview(data)[n - CRC_BYTES : n], f"{where} (shard index)")
    values = struct.unpack(f"<{len(raw) // 8}Q", raw)
    expected = meta.stored_chunk_bytes() + CRC_BYTES
    chunks: list[InnerChunk] = []
    for i, box in enumerate(_inner_boxes(meta, outer)):
        offset, nbytes = values[2 * i], values[2 * i + 1]
        if box is None:
            continue
        if offset == EMPTY_INDEX_ENTRY:
            raise IntegrityError(f"{where}: inner chunk {i} is missing from the shard index")
        if nbytes != expected or offset < n:
            raise IntegrityError(f"{where}: inner chunk {i} has a bad index entry (offset {offset}, {nbytes} bytes)")
        chunks.append(InnerChunk(box, offset, nbytes))
    return chunks


class ChunkSink:
    """Receives one stored chunk: straight into `dest` when `dest` is the chunk (or the chunk short of only its
    padding rows) and contiguous, otherwise into scratch memory from which the wanted part is copied once the
    checksum is verified."""

    def __init__(self, dest: torch.Tensor, chunk_shape: tuple[int, ...], offset: tuple[int, ...]):
        self.dest = dest
        self.offset = offset
        direct = not any(offset) and (tuple(dest.shape) == chunk_shape or _tail_padded(dest, chunk_shape))
        direct = direct and dest.is_contiguous()
        self.scratch = None if direct else torch.empty(chunk_shape, dtype=dest.dtype)
        self.data = dtypes.as_bytes(dest if direct else self.scratch)
        padding = math.prod(chunk_shape) * dest.element_size() - self.data.nbytes
        self.tail = memoryview(bytearray(padding))  # the edge chunk's padding rows: read, checked, dropped
        self.crc = bytearray(CRC_BYTES)

    def buffers(self) -> list[memoryview]:
        return [self.data, self.tail, memoryview(self.crc)]

    def finish(self, where: str) -> None:
        _verify([self.data, self.tail], self.crc, where)
        if self.scratch is not None:
            self.dest.copy_(self.scratch[tuple(slice(o, o + n) for o, n in zip(self.offset, self.dest.shape))])


DestFn = Callable[[Box], "tuple[torch.Tensor, tuple[int, ...]] | None"]


def full_region(out: torch.Tensor) -> DestFn:
    """Destination callback for reading whole atoms into `out`: every stored chunk is wanted whole."""
    return lambda box: (out[to_slices(box)], tuple(0 for _ in box))


def read_object(storage: Storage, key: str, meta: AtomMeta, outer: tuple[int, ...], dest_for: DestFn, where: str) -> None:
    """Read, verify and deliver the stored chunks of one object that `dest_for` wants.

    `dest_for(box)` gets the array region a stored chunk holds and returns (destination view of the wanted part,
    offset of that part inside the chunk), or None to skip the chunk. A plain object is one read. A shard whose
    inner chunks are all wanted is one read too, laid out as ucp writes shards (index, then the inner chunks back
    to back in C order) and checked against its index, falling back to the general path if the index says
    otherwise. Otherwise a shard is a read of its index, then one scatter read over the wanted inner chunks (gaps
    land in scratch); where each request is costly (`storage.whole_object_reads`) and every inner chunk is
    wanted, it is one whole-object read.
    """
    chunk_shape = meta.inner_chunk_shape or meta.chunk_shape
    try:
        if meta.inner_chunk_shape is None:
            wanted = dest_for(meta.chunk_box(outer))
            if wanted is not None:
                _read_extents(storage, key, meta, [(0, ChunkSink(wanted[0], chunk_shape, wanted[1]))], None, where)
            return
        boxes = [b for b in _inner_boxes(meta, outer) if b is not None]
        all_wanted = all(dest_for(b) is not None for b in boxes)
        if all_wanted and not storage.whole_object_reads and _read_dense_shard(storage, key, meta, outer, boxes, dest_for, where):
            return
        whole = storage.read(key) if all_wanted and storage.whole_object_reads else None
        index_bytes = whole if whole is not None else storage.read(key, 0, index_nbytes(meta))
        extents = []
        for inner in sorted(parse_index(meta, outer, index_bytes, where), key=lambda c: c.offset):
            wanted = dest_for(inner.box)
            if wanted is not None:
                extents.append((inner.offset, ChunkSink(wanted[0], chunk_shape, wanted[1])))
        if extents:
            _read_extents(storage, key, meta, extents, whole, where)
    except FileNotFoundError:
        raise IntegrityError(f"{where} is missing") from None


def _read_extents(storage: Storage, key: str, meta: AtomMeta, extents: list[tuple[int, ChunkSink]],
                  whole: memoryview | None, where: str) -> None:
    """One scatter read of the stored chunks at `extents` (offset, sink; ascending) into their sinks (or a copy
    out of `whole`, the object already read), then their checksums."""
    stored = meta.stored_chunk_bytes()
    start, end = extents[0][0], extents[-1][0] + stored + CRC_BYTES
    buffers: list[memoryview] = []
    pos = start
    for offset, sink in extents:
        if offset > pos:
            buffers.append(memoryview(bytearray(offset - pos)))  # a gap we do not need
        buffers += sink.buffers()
        pos = offset + stored + CRC_BYTES
    buffers.append(memoryview(bytearray(1)))  # a sentinel: catches objects longer than their metadata says
    got = scatter_into(whole[start:], buffers) if whole is not None else storage.read_into(key, start, buffers)
    _check_length(meta, start, got, end, where)
    for _, sink in extents:
        sink.finish(where)


def _check_length(meta: AtomMeta, start: int, got: int, end: int, where: str) -> None:
    if got < end - start:
        raise IntegrityError(f"{where}: truncated object ({start + got} bytes, expected at least {end})")
    if meta.inner_chunk_shape is None and got > end - start:
        raise IntegrityError(f"{where}: object is longer than its chunk ({start + got}+ bytes, expected {end})")


def _read_dense_shard(storage: Storage, key: str, meta: AtomMeta, outer: tuple[int, ...], boxes: list[Box],
                      dest_for: DestFn, where: str) -> bool:
    """Read a shard whose inner chunks are all wanted in one request, assuming ucp's layout (index, then the
    present inner chunks back to back in C order). True when done; False when the verified index places the
    chunks elsewhere: nothing was verified, and the caller's read by the index rewrites every destination."""
    chunk_shape = meta.inner_chunk_shape or meta.chunk_shape
    step = meta.stored_chunk_bytes() + CRC_BYTES
    first = index_nbytes(meta)
    index = memoryview(bytearray(first))
    sinks = []
    for box in boxes:
        wanted = dest_for(box)
        assert wanted is not None
        sinks.append(ChunkSink(wanted[0], chunk_shape, wanted[1]))
    buffers = [index, *(b for sink in sinks for b in sink.buffers()), memoryview(bytearray(1))]
    got = storage.read_into(key, 0, buffers)
    listed = parse_index(meta, outer, index[: min(got, first)], where)
    if [c.offset for c in listed] != [first + i * step for i in range(len(boxes))]:
        return False
    _check_length(meta, 0, got, first + len(boxes) * step, where)
    for sink in sinks:
        sink.finish(where)
    return True
