"""Packs: small atoms' chunks laid back to back in shared objects (format 3, docs/FORMAT.md section 4.1).

A directory, a `zarr.json` and a chunk object per small atom made per-object costs (file creation, fsync, an S3
request each) decide the speed of a save of many small atoms. So the chunks of atoms below a size threshold
(`ChunkingPolicy.pack_below`) are written into packs: each pack is a Zarr v3 array of bytes (`uint8`, one plain
chunk: the bytes, then their CRC-32C), and the manifest says for each packed chunk which pack holds it, at which
offset, how many bytes, and their CRC-32C. A packed chunk is the chunk's region of the atom (clipped at the
array's edge, no padding) in C order, little-endian, starting on an element boundary of its dtype.

This module is the layout only (which chunk goes where); the engine fills and writes packs, the reader reads
byte ranges of them.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import NamedTuple

from .manifest import PACKS_GROUP, AtomMeta


def pack_name(rank: int, number: int) -> str:
    """The name (path below the attempt) of a writer's `number`-th pack: writers never share a name."""
    return f"{PACKS_GROUP}/p{rank}-{number}"


def pack_meta(name: str, data_bytes: int) -> AtomMeta:
    """A pack as a Zarr array: `data_bytes` bytes, one chunk (so its object is `<name>/c.0`: data, then CRC-32C)."""
    return AtomMeta(name, (data_bytes,), "uint8", (data_bytes,), None, {"role": "pack"})


def pack_object_key(prefix: str, name: str) -> str:
    """The storage key of pack `name`'s one chunk object in the attempt directory `prefix`."""
    return f"{prefix}/{name}/c.0"


def chunk_nbytes(meta: AtomMeta, index: tuple[int, ...]) -> int:
    """Bytes of a packed chunk: its region of the atom, clipped at the edge (no padding)."""
    if meta.single_chunk:
        return meta.nbytes
    return math.prod(b - a for a, b in meta.chunk_box(index)) * meta.itemsize


class PackMember(NamedTuple):
    """One chunk of a packed atom inside a pack: where it starts and how many bytes it takes. (A tuple: a save of
    many small atoms makes one per atom.)"""

    meta: AtomMeta
    index: tuple[int, ...]  # type: ignore[assignment]  # (the field hides tuple.index, which nothing calls)
    offset: int
    nbytes: int


@dataclass(frozen=True)
class Pack:
    """One pack object to write: its name, its members in offset order, and its bytes of data."""

    name: str
    members: tuple[PackMember, ...]
    data_bytes: int

    @functools.cached_property
    def meta(self) -> AtomMeta:
        return pack_meta(self.name, self.data_bytes)

    @functools.cached_property
    def spans(self) -> tuple[tuple[int, int], ...]:
        """(offset, nbytes) of each member, in member order."""
        return tuple((m.offset, m.nbytes) for m in self.members)

    def key(self, prefix: str) -> str:
        return pack_object_key(prefix, self.name)


def lay_out(
    chunks: Iterable[tuple[AtomMeta, tuple[int, ...]]], pack_bytes: int, new_name: Callable[[], str]
) -> list[Pack]:
    """Packs of at most `pack_bytes` bytes (a chunk larger than that gets a pack of its own) holding `chunks` in
    the order given, each aligned to its element size; each pack named by `new_name()`."""
    packs: list[Pack] = []
    members: list[PackMember] = []
    end = 0

    def close() -> None:
        nonlocal members, end
        if members:
            packs.append(Pack(new_name(), tuple(members), end))
        members, end = [], 0

    for meta, index in chunks:
        nbytes = chunk_nbytes(meta, index)
        offset = -(-end // meta.itemsize) * meta.itemsize
        if members and offset + nbytes > pack_bytes:
            close()
            offset = 0
        members.append(PackMember(meta, index, offset, nbytes))
        end = offset + nbytes
    close()
    return packs
