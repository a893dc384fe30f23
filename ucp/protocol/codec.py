"""Chunk encoding: how one stored object of an atom is laid out, written and verified.

An object is either a plain chunk (the chunk's little-endian bytes, then its crc32c) or a shard
(`sharding_indexed`, index at the start): an index of (offset, nbytes) uint64 pairs, one per inner chunk in
C order, followed by the index's crc32c, then (format 2) a table of every inner chunk's crc32c, then the inner
chunks, each its bytes and its crc32c. Edge chunks are padded to the full chunk shape, as Zarr's regular grid
requires; inner chunks wholly outside the array are absent (index entry all ones, table entry 0).

Every object has a checksum that the committed manifest records with its size (`ObjectSum`): a plain chunk's
crc32c, or the crc32c of a shard's head (index, its crc32c and the table). A reader holds each object to it, so
an object that is stale, moved or swapped fails as surely as a flipped bit, also when only some inner chunks of
a shard are read: each one read must carry the checksum that the (verified) table lists for its place. Zarr
readers locate inner chunks by the index alone and never read the table. `ShardIndex` is a shard's head as a value:
parsed and checked, laid out for a write, encoded.
"""

from __future__ import annotations

import functools
import math
import struct
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import crc32c
import torch

from ..base import dtypes
from ..base.boxes import Box, box_shape, intersect, relative, to_slices
from ..errors import FormatError, IntegrityError, ObjectMissingError
from ..format.manifest import (
    CRC_BYTES,
    EMPTY_INDEX_ENTRY,
    INDEX_ENTRY_BYTES,
    AtomMeta,
    ObjectSum,
    PackedChunk,
    chunk_indices,
)
from ..storage import ReadableStorage, scatter_into


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
    chunk's checksum (always the last part). An edge chunk short of rows only gets a shared zero tail."""
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


def _nbytes(parts: Sequence[memoryview | bytes]) -> int:
    return sum(len(p) if isinstance(p, bytes) else p.nbytes for p in parts)


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
    """Bytes of a shard's index with its checksum."""
    return _index_nbytes(math.prod(meta.inner_grid))


def head_nbytes(meta: AtomMeta) -> int:
    """Bytes of a shard's head: its index, the index's checksum and (format 2) the inner chunks' checksum table."""
    return _head_nbytes(math.prod(meta.inner_grid), meta.crc_table)


def _index_nbytes(count: int) -> int:
    return count * INDEX_ENTRY_BYTES + CRC_BYTES


def _head_nbytes(count: int, crc_table: bool) -> int:
    return _index_nbytes(count) + (count * CRC_BYTES if crc_table else 0)


class InnerChunk(NamedTuple):
    """Where one inner chunk of a shard lies in the shard's object (`number`: its place in C order of the shard's
    inner grid) and the checksum the shard's table lists for it (None for a format 1.0 shard, which has no table).
    (A tuple: a shard of a thousand inner chunks makes a thousand of them, on every write and read of it.)"""

    number: int
    offset: int
    nbytes: int
    crc: bytes | None = None


@dataclass(frozen=True)
class ShardIndex:
    """A shard's head as a value (zarr-python's `_ShardIndex`, with ucp's checksum table): of the `count` inner chunks
    of the shard, in C order, those inside the array (`chunks`, each where it lies and its checksum); the others are
    absent. `crc_table`: the head has the table of the inner chunks' checksums (format 2; not format 1.0).

    `parse` reads and checks the head of a stored shard, `laid_out` is the index of a shard that ucp writes, and
    `head` is its bytes: `parse` of `head` gives the index back."""

    count: int
    chunks: tuple[InnerChunk, ...]
    crc_table: bool = True

    @classmethod
    def laid_out(cls, meta: AtomMeta, sums: Sequence[tuple[int, bytes] | None]) -> ShardIndex:
        """The index of a shard of `meta` whose inner chunks (C order) are stored with these (bytes, checksum), None
        for those outside the array: back to back after the head, as ucp writes shards (format 2)."""
        chunks = []
        offset = head_nbytes(meta)
        for number, stored in enumerate(sums):
            if stored is not None:
                chunks.append(InnerChunk(number, offset, stored[0], stored[1]))
                offset += stored[0]
        return cls(len(sums), tuple(chunks), crc_table=True)

    @classmethod
    def parse(
        cls,
        meta: AtomMeta,
        outer: tuple[int, ...],
        data: bytes | memoryview,
        where: str,
        recorded: ObjectSum | None = None,
    ) -> ShardIndex:
        """The index of shard `outer` of `meta` from its head (`data`, at least `head_nbytes(meta)` bytes), checked:
        the index's own checksum, the head's against the one the commit `recorded` for the object, and every inner
        chunk inside the array present with the size the metadata gives it, after the head (IntegrityError naming
        `where`)."""
        n, head = index_nbytes(meta), head_nbytes(meta)
        if len(data) < head:
            raise IntegrityError(f"{where}: truncated shard ({len(data)} bytes, its head alone needs {head})")
        raw = memoryview(data)[: n - CRC_BYTES]
        _verify([raw], memoryview(data)[n - CRC_BYTES : n], f"{where} (shard index)")
        if recorded is not None and _crc(memoryview(data)[:head]) != _crc_bytes(recorded[1]):
            raise _not_recorded(where)
        values = struct.unpack(f"<{len(raw) // 8}Q", raw)
        table = bytes(memoryview(data)[n:head]) if meta.crc_table else None
        expected = meta.stored_chunk_bytes() + CRC_BYTES
        chunks: list[InnerChunk] = []
        boxes = _inner_boxes(meta, outer)  # (those outside the array are absent: their entries are not read)
        # No entry points past the largest shard of this atom (or its recorded size): an edited offset must never
        # become a read, or an allocation, of its size.
        end = recorded[0] if recorded is not None else head + len(boxes) * expected
        for i, box in enumerate(boxes):
            offset, nbytes = values[2 * i], values[2 * i + 1]
            if box is None:
                continue
            if offset == EMPTY_INDEX_ENTRY:
                raise IntegrityError(f"{where}: inner chunk {i} is missing from the shard index")
            if nbytes != expected or not head <= offset <= end - nbytes:
                raise IntegrityError(
                    f"{where}: inner chunk {i} has a bad index entry (offset {offset}, {nbytes} bytes)"
                )
            crc = table[i * CRC_BYTES : (i + 1) * CRC_BYTES] if table is not None else None
            chunks.append(InnerChunk(i, offset, nbytes, crc))
        # (The head's recorded checksum cannot tell one index from another that carries its own CRC: the CRC of a
        # message followed by its CRC is a constant. What holds the index is these bounds and the table: an inner
        # chunk read from any place but its own fails the checksum the table lists for its place.)
        return cls(len(boxes), tuple(chunks), crc_table=meta.crc_table)

    def head(self) -> list[bytes]:
        """The head's bytes: the index ((offset, nbytes) per inner chunk, all ones where absent), its checksum and,
        with `crc_table`, the table (zeros where absent)."""
        entries = [EMPTY_INDEX_ENTRY] * (2 * self.count)
        table = [bytes(CRC_BYTES)] * self.count
        for number, offset, nbytes, crc in self.chunks:
            entries[2 * number] = offset
            entries[2 * number + 1] = nbytes
            if crc is not None:
                table[number] = crc
        index = struct.pack(f"<{len(entries)}Q", *entries)
        return [index, _crc(index), b"".join(table)] if self.crc_table else [index, _crc(index)]

    @property
    def head_nbytes(self) -> int:
        return _head_nbytes(self.count, self.crc_table)

    def is_dense(self) -> bool:
        """Whether the inner chunks lie back to back right after the head, in C order: as ucp writes shards, so that
        a reader that assumed it (one read of a whole shard) read each where it lies."""
        pos = self.head_nbytes
        for c in self.chunks:
            if c.offset != pos:
                return False
            pos += c.nbytes
        return True

    def by_offset(self) -> list[InnerChunk]:
        """The inner chunks in the order they lie in the object (a scatter read takes them so)."""
        return sorted(self.chunks, key=lambda c: c.offset)


def _inner_chunk_parts(
    meta: AtomMeta, outer: tuple[int, ...], chunk: torch.Tensor
) -> Iterator[list[memoryview | bytes] | None]:
    """`_chunk_parts` of each inner chunk of shard `outer` in C order; None for those outside the array."""
    inner = meta.inner_chunk_shape
    assert inner is not None
    if (
        chunk.dim()
        and all(g == 1 for g in meta.inner_grid[1:])
        and chunk.shape[1:] == inner[1:]
        and chunk.is_contiguous()
    ):
        # Inner chunks of whole rows (what a save without a split dimension cuts): each is a byte range of the
        # chunk, taken without a tensor per inner chunk (~15 us of the GIL each, ~1,000 of them in 1 GiB).
        data = dtypes.as_bytes(chunk)
        row_bytes = data.nbytes // chunk.shape[0] if chunk.shape[0] else 0
        for start in range(0, meta.inner_grid[0] * inner[0], inner[0]):
            if start >= chunk.shape[0]:
                yield None
                continue
            part = data[start * row_bytes : (start + inner[0]) * row_bytes]
            padding = _zeros(inner[0] * row_bytes - part.nbytes)  # (the array's edge, padded as _chunk_parts pads)
            yield [part, padding, _crc(part, padding)] if padding else [part, _crc(part)]
        return
    origin = tuple(a for a, _ in meta.chunk_box(outer))
    for box in _inner_boxes(meta, outer):
        if box is None:
            yield None
        else:
            local = tuple((a - o, b - o) for (a, b), o in zip(box, origin))
            yield _chunk_parts(chunk[to_slices(local)], inner)


@dataclass(frozen=True)
class Encoded:
    """One object ready to write: its parts (back to back) and its checksum for the manifest; for a pack, also the
    CRC-32C of each chunk it holds, in member order."""

    parts: list[memoryview | bytes]
    sum: ObjectSum
    members: tuple[int, ...] = ()


def encode(meta: AtomMeta, outer: tuple[int, ...], chunk: torch.Tensor) -> Encoded:
    """The object for chunk `outer`, whose values are `chunk` (the chunk's region of the array, clipped at the
    edge), laid out as format 2 writes it."""
    if meta.inner_chunk_shape is None:
        plain = _chunk_parts(chunk, meta.chunk_shape)
        return Encoded(plain, (_nbytes(plain), struct.unpack("<I", plain[-1])[0]))
    assert meta.crc_table, "ucp writes format 2 shards only"
    parts: list[memoryview | bytes] = []
    sums: list[tuple[int, bytes] | None] = []
    for inner_parts in _inner_chunk_parts(meta, outer, chunk):
        if inner_parts is None:
            sums.append(None)
            continue
        parts += inner_parts
        sums.append((_nbytes(inner_parts), inner_parts[-1]))  # type: ignore[arg-type]  # (the checksum part is bytes)
    index = ShardIndex.laid_out(meta, sums)
    head = index.head()
    head_sum = struct.unpack("<I", _crc(*head))[0]
    return Encoded([*head, *parts], (index.head_nbytes + sum(s[0] for s in sums if s is not None), head_sum))


def encode_pack(
    spans: Sequence[tuple[int, int]], data_bytes: int, values: torch.Tensor | Sequence[torch.Tensor]
) -> Encoded:
    """The object of a pack (a plain chunk of bytes: the data, then its CRC-32C) whose members lie at `spans`
    ((offset, nbytes) each, ascending), from its staged bytes (one uint8 tensor of `data_bytes`, the alignment
    gaps zero) or from each member's values (its chunk's region of the atom) in member order, written where they
    lie, the gaps between them from shared zeros. `members` are the members' CRC-32Cs."""
    crcs = []
    if isinstance(values, torch.Tensor):
        data = dtypes.as_bytes(values)
        for offset, nbytes in spans:
            crcs.append(crc32c.crc32c(data[offset : offset + nbytes]))
        parts: list[memoryview | bytes] = [data, _crc(data)]
    else:
        parts, running, pos = [], 0, 0
        for (offset, nbytes), value in zip(spans, values, strict=True):
            if offset > pos:
                gap = _zeros(offset - pos)
                parts.append(gap)
                running = crc32c.crc32c(gap, running)
            data = dtypes.as_bytes(value.contiguous())
            assert data.nbytes == nbytes, "a packed chunk's values are its region of the atom"
            crcs.append(crc32c.crc32c(data))
            running = crc32c.crc32c(data, running)
            parts.append(data)
            pos = offset + nbytes
        parts.append(_crc_bytes(running))
    return Encoded(parts, (data_bytes + CRC_BYTES, struct.unpack("<I", parts[-1])[0]), tuple(crcs))


# ------------------------------------------------------------------------------------------ decoding


def _verify(
    payload: Sequence[memoryview | bytes | bytearray],
    stored_crc: memoryview | bytes | bytearray,
    where: str,
    recorded: bytes | None = None,
) -> None:
    """Check the CRC-32C of the payload (its parts back to back) against the stored checksum and, where the
    commit recorded one, that the stored checksum is the recorded one."""
    if _crc(*payload) != bytes(stored_crc):
        raise IntegrityError(f"{where}: checksum mismatch (crc32c), the stored bytes are damaged")
    if recorded is not None and bytes(stored_crc) != recorded:
        raise _not_recorded(where)


def _not_recorded(where: str) -> IntegrityError:
    return IntegrityError(
        f"{where}: the object is not the one the commit recorded (its checksum differs): it was "
        "moved, swapped, copied from another step or left by another save"
    )


def _crc_bytes(value: int) -> bytes:
    return struct.pack("<I", value)


class ChunkSink:
    """Receives one stored chunk: straight into `dest` when `dest` is the chunk (or the chunk short of only its
    padding rows) and contiguous, otherwise into scratch memory from which the wanted part is copied once the
    checksum is verified."""

    def __init__(self, dest: torch.Tensor, chunk_shape: tuple[int, ...], offset: tuple[int, ...], padded: bool = True):
        """`padded`: the stored chunk is padded to `chunk_shape` at the array's edge (a packed chunk is not)."""
        self.dest = dest
        self.offset = offset
        whole = tuple(dest.shape) == chunk_shape
        direct = not any(offset) and (whole or (padded and _tail_padded(dest, chunk_shape)))
        direct = direct and dest.is_contiguous()
        self.scratch = None if direct else torch.empty(chunk_shape, dtype=dest.dtype)
        self.data = dtypes.as_bytes(dest if self.scratch is None else self.scratch)
        padding = math.prod(chunk_shape) * dest.element_size() - self.data.nbytes
        self.tail = memoryview(bytearray(padding))  # the edge chunk's padding rows: read, checked, dropped
        self.crc = bytearray(CRC_BYTES)

    @classmethod
    def whole(cls, dest: torch.Tensor) -> ChunkSink:
        """A sink for an unpadded chunk that is all of the contiguous `dest` (a packed atom read whole): its
        bytes go straight there."""
        sink = cls.__new__(cls)
        sink.dest, sink.offset, sink.scratch = dest, (), None
        sink.data = dtypes.as_bytes(dest)
        sink.tail = memoryview(b"")
        sink.crc = bytearray(CRC_BYTES)
        return sink

    def buffers(self) -> list[memoryview]:
        return [self.data, self.tail, memoryview(self.crc)]

    def finish(self, where: str, recorded: bytes | None) -> None:
        """Verify the chunk (and that its checksum is the one recorded for its place), then deliver it."""
        _verify([self.data, self.tail], self.crc, where, recorded)
        self.deliver()

    def deliver(self) -> None:
        """Copy what was read into scratch memory to the destination (nothing to do when read in place)."""
        if self.scratch is not None:  # (by numpy in this thread, not torch's spinning OpenMP threads: copy_strided)
            dtypes.copy_strided(
                self.dest, self.scratch[tuple(slice(o, o + n) for o, n in zip(self.offset, self.dest.shape))]
            )


DestFn = Callable[[Box], "tuple[torch.Tensor, tuple[int, ...]] | None"]


def packed_sink(meta: AtomMeta, index: tuple[int, ...], dest_for: DestFn) -> ChunkSink | None:
    """Where a packed chunk that `dest_for` wants is read to (None if it is not wanted): the chunk is its region
    of the atom, unpadded."""
    box = meta.chunk_box(index)
    wanted = dest_for(box)
    return None if wanted is None else ChunkSink(wanted[0], box_shape(box), wanted[1], padded=False)


class PackedRead(NamedTuple):
    """One packed chunk to read (bytes [offset, offset + nbytes) of its pack, whose CRC-32C is `crc`) into `data`:
    straight into its destination tensor, or into a `sink`'s scratch memory, delivered once verified (a part of the
    chunk wanted). `atom` and `chunk` name it in an error. (A tuple: a load of many small atoms makes one per atom.)"""

    offset: int
    nbytes: int
    crc: int
    data: memoryview
    atom: str
    chunk: str
    sink: ChunkSink | None = None

    @classmethod
    def of(cls, chunk: PackedChunk, sink: ChunkSink, meta: AtomMeta, index: tuple[int, ...]) -> PackedRead:
        return cls(chunk.offset, chunk.nbytes, chunk.crc, sink.data, meta.path, meta.chunk_key(index), sink)


# Wanted packed chunks of one pack are read in one request, unwanted bytes between them into scratch, unless such a
# gap is longer than this: then the read is split there (a weights-only load skips the optimizer state packed
# beside the weights).
GAP_READ_BYTES = 1 << 20
_ALIGNMENT_GAP = memoryview(bytearray(16))  # where alignment gaps are read to (never looked at: threads may share it)


def read_packed(
    storage: ReadableStorage, key: str, pack: str, reads: Sequence[PackedRead], step: int, holds: Callable[[], str]
) -> None:
    """Read packed chunks of one pack (the object at `key`) in scatter reads, one per run of them (GAP_READ_BYTES),
    and verify each against its recorded checksum. A pack that is missing, shorter than its chunks or whose bytes
    differ fails with an IntegrityError that names the chunk (of step `step`) and, from `holds()`, the atoms the pack
    holds."""
    reads = sorted(reads, key=lambda r: r.offset)
    try:
        start = pos = reads[0].offset
        buffers: list[memoryview] = []
        for r in reads:
            gap = r.offset - pos
            if gap < 0:  # (the records of different index parts: each part's own are checked when it is read)
                raise FormatError(
                    f"atom {r.atom!r} chunk {r.chunk} (step {step}): bytes [{r.offset}, {r.offset + r.nbytes}) of pack "
                    f"{pack} overlap another chunk's: the step's records are not ones a save writes"
                )
            if gap > GAP_READ_BYTES:  # (a long run of chunks not wanted: split the read there)
                _read_run(storage, key, pack, start, buffers, pos, r, step)
                start, buffers = r.offset, []
            elif gap:
                buffers.append(_ALIGNMENT_GAP[:gap] if gap <= _ALIGNMENT_GAP.nbytes else memoryview(bytearray(gap)))
            buffers.append(r.data)
            pos = r.offset + r.nbytes
        _read_run(storage, key, pack, start, buffers, pos, reads[-1], step)
        for r in reads:
            if crc32c.crc32c(r.data) != r.crc:
                raise IntegrityError(
                    f"atom {r.atom!r} chunk {r.chunk} (step {step}): checksum mismatch (crc32c), its bytes are not the "
                    "ones the commit recorded: the pack is damaged, truncated, swapped or stale"
                )
            if r.sink is not None:
                r.sink.deliver()
    except FileNotFoundError:
        raise ObjectMissingError(
            f"atom {reads[0].atom!r} chunk {reads[0].chunk} (step {step}): pack {pack} is missing; {holds()}"
        ) from None
    except IntegrityError as e:
        raise IntegrityError(f"{e}; {holds()}") from None


def _read_run(
    storage: ReadableStorage,
    key: str,
    pack: str,
    start: int,
    buffers: list[memoryview],
    end: int,
    last: PackedRead,
    step: int,
) -> None:
    """One scatter read of [start, end) of a pack into `buffers` (its chunks' and the gaps' between them)."""
    if storage.read_into(key, start, buffers) < end - start:
        raise IntegrityError(
            f"atom {last.atom!r} chunk {last.chunk} (step {step}): pack {pack} is truncated (its chunks need {end} "
            "bytes of data)"
        )


def full_region(out: torch.Tensor) -> DestFn:
    """Destination callback for reading whole atoms into `out`: every stored chunk is wanted whole."""
    return lambda box: (out[to_slices(box)], tuple(0 for _ in box))


def region(box: Box, view: torch.Tensor) -> DestFn:
    """Destination callback for reading region `box` of an atom into `view` (shaped like `box`): of each stored chunk
    the part inside `box`."""

    def dest_for(chunk_box: Box) -> tuple[torch.Tensor, tuple[int, ...]] | None:
        part = intersect(chunk_box, box)
        if part is None:
            return None
        return view[to_slices(relative(part, box))], tuple(a - c for (a, _), (c, _) in zip(part, chunk_box))

    return dest_for


def read_object(
    storage: ReadableStorage,
    key: str,
    meta: AtomMeta,
    outer: tuple[int, ...],
    dest_for: DestFn,
    where: str,
    recorded: ObjectSum | None,
) -> None:
    """Read, verify and deliver the stored chunks of one object that `dest_for` wants; `recorded` is the size and
    checksum the commit recorded for the object (None for a format 1.0 step).

    `dest_for(box)` gets the array region a stored chunk holds and returns (destination view of the wanted part,
    offset of that part inside the chunk), or None to skip the chunk. A plain object is one read. A shard whose
    inner chunks are all wanted is one read too, laid out as ucp writes shards (index, then the inner chunks back
    to back in C order) and checked against its index, falling back to the general path if the index says
    otherwise; a shard wanted whole inside the array is delivered with one copy (`_read_whole_shard`). Otherwise
    a shard is a read of its index, then one scatter read over the wanted inner chunks (gaps land in scratch);
    where each request is costly (`storage.capabilities.whole_object_reads`) and every inner chunk is wanted, it is one
    whole-object read.
    """
    chunk_shape = meta.inner_chunk_shape or meta.chunk_shape
    try:
        if meta.inner_chunk_shape is None:
            wanted = dest_for(meta.chunk_box(outer))
            if wanted is not None:
                crc = None if recorded is None else _crc_bytes(recorded[1])
                _read_extents(storage, key, meta, [(0, ChunkSink(wanted[0], chunk_shape, wanted[1]), crc)], None, where)
            return
        whole_dest = _whole_shard_dest(meta, outer, dest_for)
        if whole_dest is not None and _read_whole_shard(storage, key, meta, outer, whole_dest, where, recorded):
            return
        inner_boxes = _inner_boxes(meta, outer)
        boxes = [b for b in inner_boxes if b is not None]
        all_wanted = all(dest_for(b) is not None for b in boxes)
        if (
            whole_dest is None
            and all_wanted
            and not storage.capabilities.whole_object_reads
            and _read_dense_shard(storage, key, meta, outer, boxes, dest_for, where, recorded)
        ):
            return
        # (a whole read: never more than the object's recorded size, or the largest shard of this atom, and one byte)
        largest = (
            recorded[0]
            if recorded is not None
            else head_nbytes(meta) + len(boxes) * (meta.stored_chunk_bytes() + CRC_BYTES)
        )
        whole = storage.read(key, 0, largest + 1) if all_wanted and storage.capabilities.whole_object_reads else None
        head = whole if whole is not None else storage.read(key, 0, head_nbytes(meta))
        extents = []
        for inner in ShardIndex.parse(meta, outer, head, where, recorded).by_offset():
            box = inner_boxes[inner.number]
            assert box is not None  # (the index lists the inner chunks inside the array only)
            wanted = dest_for(box)
            if wanted is not None:
                extents.append((inner.offset, ChunkSink(wanted[0], chunk_shape, wanted[1]), inner.crc))
        if extents:
            _read_extents(storage, key, meta, extents, whole, where)
    except FileNotFoundError:
        raise ObjectMissingError(f"{where} is missing") from None


def _read_extents(
    storage: ReadableStorage,
    key: str,
    meta: AtomMeta,
    extents: list[tuple[int, ChunkSink, bytes | None]],
    whole: memoryview | None,
    where: str,
) -> None:
    """One scatter read of the stored chunks at `extents` (offset, sink, recorded checksum; ascending) into their
    sinks (or a copy out of `whole`, the object already read), then their checksums."""
    stored = meta.stored_chunk_bytes()
    start, end = extents[0][0], extents[-1][0] + stored + CRC_BYTES
    buffers: list[memoryview] = []
    pos = start
    for offset, sink, _ in extents:
        if offset > pos:
            buffers.append(memoryview(bytearray(offset - pos)))  # a gap we do not need
        buffers += sink.buffers()
        pos = offset + stored + CRC_BYTES
    buffers.append(memoryview(bytearray(1)))  # a sentinel: catches objects longer than their metadata says
    got = scatter_into(whole[start:], buffers) if whole is not None else storage.read_into(key, start, buffers)
    _check_length(meta, start, got, end, where)
    for _, sink, crc in extents:
        sink.finish(where, crc)


def _check_length(meta: AtomMeta, start: int, got: int, end: int, where: str) -> None:
    if got < end - start:
        raise IntegrityError(f"{where}: truncated object ({start + got} bytes, expected at least {end})")
    if meta.inner_chunk_shape is None and got > end - start:
        raise IntegrityError(f"{where}: object is longer than its chunk ({start + got}+ bytes, expected {end})")


def _read_dense_shard(
    storage: ReadableStorage,
    key: str,
    meta: AtomMeta,
    outer: tuple[int, ...],
    boxes: list[Box],
    dest_for: DestFn,
    where: str,
    recorded: ObjectSum | None,
) -> bool:
    """Read a shard whose inner chunks are all wanted in one request, assuming ucp's layout (head, then the
    present inner chunks back to back in C order). True when done; False when the verified index places the
    chunks elsewhere: nothing was verified, and the caller's read by the index rewrites every destination."""
    chunk_shape = meta.inner_chunk_shape or meta.chunk_shape
    step = meta.stored_chunk_bytes() + CRC_BYTES
    first = head_nbytes(meta)
    head = memoryview(bytearray(first))
    sinks = []
    for box in boxes:
        wanted = dest_for(box)
        assert wanted is not None
        sinks.append(ChunkSink(wanted[0], chunk_shape, wanted[1]))
    buffers = [head, *(b for sink in sinks for b in sink.buffers()), memoryview(bytearray(1))]
    got = storage.read_into(key, 0, buffers)
    index = ShardIndex.parse(meta, outer, head[: min(got, first)], where, recorded)
    if not index.is_dense():
        return False
    _check_length(meta, 0, got, first + len(boxes) * step, where)
    for sink, inner in zip(sinks, index.chunks, strict=True):
        sink.finish(where, inner.crc)
    return True


@functools.lru_cache(maxsize=256)
def _dense_index(count: int, first: int, step: int) -> bytes:
    """The index of a shard of `count` inner chunks, none absent, each of `step` bytes (data and checksum) back to back
    after a head of `first` bytes: the index ucp writes for a shard inside the array."""
    return struct.pack(f"<{2 * count}Q", *(v for i in range(count) for v in (first + i * step, step)))


def _verify_dense_head(head: memoryview, count: int, crc_table: bool, recorded: ObjectSum | None, where: str) -> None:
    """The checks `ShardIndex.parse` makes of a head whose index is `_dense_index`: the index's own checksum, and the
    head's against the one the commit recorded for the object."""
    n = _index_nbytes(count)
    _verify([head[: n - CRC_BYTES]], head[n - CRC_BYTES : n], f"{where} (shard index)")
    if recorded is not None and crc32c.crc32c(head[: _head_nbytes(count, crc_table)]) != recorded[1]:
        raise _not_recorded(where)


def _whole_shard_dest(meta: AtomMeta, outer: tuple[int, ...], dest_for: DestFn) -> torch.Tensor | None:
    """The destination of the whole of shard `outer` when it is wanted whole and lies inside the array (so no
    inner chunk is padded or absent), as bytes shaped like the chunk (the last dimension in bytes); else None.
    Such a shard is delivered with one copy instead of one per inner chunk: the per-chunk work is what bounds a
    load of many inner chunks (Python, small allocations), not the bytes."""
    box = meta.chunk_box(outer)
    if tuple(b - a for a, b in box) != tuple(meta.chunk_shape) or not meta.shape:
        return None
    wanted = dest_for(box)
    if wanted is None or any(wanted[1]) or tuple(wanted[0].shape) != tuple(meta.chunk_shape):
        return None
    view = wanted[0]
    if view.stride(-1) != 1 or view.element_size() != meta.itemsize:
        return None
    return view.view(torch.uint8)


def _read_whole_shard(
    storage: ReadableStorage,
    key: str,
    meta: AtomMeta,
    outer: tuple[int, ...],
    dest: torch.Tensor,
    where: str,
    recorded: ObjectSum | None,
) -> bool:
    """`_read_dense_shard` of a shard wanted whole into `dest` (`_whole_shard_dest`). Inner chunks that are
    consecutive bands of a contiguous `dest` are read straight into it; otherwise the shard's chunks are read into
    one scratch buffer and, once verified, moved into place by one strided copy."""
    assert meta.inner_chunk_shape is not None
    grid, inner = meta.inner_grid, meta.inner_chunk_shape
    n, size = math.prod(grid), meta.stored_chunk_bytes()
    step, first = size + CRC_BYTES, head_nbytes(meta)
    head = memoryview(bytearray(first))
    direct = dest.is_contiguous() and all(g == 1 for g in grid[1:])
    if direct:
        data = dtypes.as_bytes(dest)
        crcs = memoryview(bytearray(n * CRC_BYTES))
        body = [
            b for i in range(n) for b in (data[i * size : (i + 1) * size], crcs[i * CRC_BYTES : (i + 1) * CRC_BYTES])
        ]
    else:
        scratch = torch.empty(n * step, dtype=torch.uint8)
        stored = dtypes.as_bytes(scratch)
        body = [stored]
    got = storage.read_into(key, 0, [head, *body, memoryview(bytearray(1))])
    if got >= first and head[: n * INDEX_ENTRY_BYTES] == _dense_index(n, first, step):
        # (ucp's own layout, told by one comparison of the index: its checksum, the head's against the commit's
        # record and each inner chunk against the table then suffice, with no index parsed entry by entry)
        _verify_dense_head(head, n, meta.crc_table, recorded, where)
        table = head[_index_nbytes(n) :] if meta.crc_table else None
    else:
        index = ShardIndex.parse(meta, outer, head[: min(got, first)], where, recorded)
        if not index.is_dense():
            return False
        table = None if index.chunks[0].crc is None else memoryview(b"".join(c.crc for c in index.chunks))  # type: ignore[misc]
    _check_length(meta, 0, got, first + n * step, where)
    for i in range(n):
        if direct:
            payload, crc = data[i * size : (i + 1) * size], crcs[i * CRC_BYTES : (i + 1) * CRC_BYTES]
        else:
            payload, crc = stored[i * step : i * step + size], stored[i * step + size : (i + 1) * step]
        if crc32c.crc32c(payload) != int.from_bytes(crc, "little"):
            raise IntegrityError(f"{where}: checksum mismatch (crc32c), the stored bytes are damaged")
        if table is not None and crc != table[i * CRC_BYTES : (i + 1) * CRC_BYTES]:
            raise _not_recorded(where)
    if not direct:
        # the stored chunks, C order of the inner grid, each C order inside: (g0, .., gk, i0, .., ik * itemsize)
        # interleaved to (g0, i0, .., gk, ik * itemsize), which is the destination's shape split chunk-wise
        k = len(grid)
        chunks = scratch.view(n, step)[:, :size].reshape(*grid, *inner[:-1], inner[-1] * meta.itemsize)
        order = [d for pair in zip(range(k), range(k, 2 * k)) for d in pair]
        split = [e for g, i in zip(grid, (*inner[:-1], inner[-1] * meta.itemsize)) for e in (g, i)]
        dtypes.copy_strided(dest.view(split), chunks.permute(order))
    return True
