"""Format 3.1: a step's atom records in index parts, so that a reader reads and decodes only the records of the atoms
it needs (docs/FORMAT.md section 3.1).

A format 3.0 manifest held every atom's description and every chunk's record in one JSON document, which every
reader read and parsed whole before its first byte of data (a DeepSeek-V3-sized training state: ~190,000 atoms, a
50-240 MB document, seconds per rank, and one object read by every rank of the job). In 3.1 the manifest (the step
group's `zarr.json`) is a small document: the step's facts, the state tree (its large subtrees in tree parts of their
own) and a directory of **atom parts**: objects below `ucp-index/` that each hold the records of a run of atoms, in
the order of their paths, laid out as columns (JSON lists) that decode with little work per atom. The directory
gives each part's first path, its atom count and bytes, and its object's size and CRC-32C, so the commit marker,
which covers the manifest, covers every part too (invariant 5), and a reader finds the part of any path by a binary
search, reads it (checked against its size and checksum) and checks every bound of what it declares before anything
is sized from it (invariant 8).

`encode` lays out the manifest and its parts from a writer's `StepManifest`; `IndexedManifest` is the reader's
view, which reads parts when asked for an atom (`atoms`, a mapping), and `IndexPart` one decoded part.
"""

from __future__ import annotations

import bisect
import functools
import itertools
import math
import re
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..base import dtypes
from ..base.heap import collector_paused
from ..errors import FormatError
from .manifest import (
    CRC_BYTES,
    FORMAT_VERSION,
    INDEX_DIR,
    MAX_ATOM_BYTES,
    MAX_DOCUMENT_BYTES,
    MAX_INNER_PER_OBJECT,
    MAX_MANIFEST_BYTES,
    MAX_NDIM,
    MAX_OBJECT_BYTES,
    MAX_OBJECTS_PER_ATOM,
    AtomMeta,
    ObjectSum,
    PackedChunk,
    StepManifest,
    WholePacked,
    check_atom_path,
    check_format_version,
    chunk_indices,
    dumps,
    is_pack_name,
    json_int,
    loads,
    plain_paths,
)

# Records (atoms and their chunks) per atom part: ~100 KiB of JSON, so that a reader that needs one atom reads little
# more, and a step of a million atoms has ~500 parts (a directory of ~40 KB in the manifest).
PART_RECORDS = 2048
# A child of the state tree's root whose JSON is larger than this goes to a tree part of its own (a training state's
# "model" and "optimizer"), so that the manifest stays small; the small ones (model_config, extra) stay inline.
TREE_INLINE_BYTES = 64 << 10
MAX_PART_BYTES = MAX_DOCUMENT_BYTES  # an atom part
MAX_TREE_PART_BYTES = MAX_MANIFEST_BYTES


def atoms_part_name(number: int) -> str:
    """The name (below the attempt) of the `number`-th atom part."""
    return f"{INDEX_DIR}/atoms-{number}.json"


def tree_part_name(number: int) -> str:
    return f"{INDEX_DIR}/tree-{number}.json"


# ------------------------------------------------------------------------------------------------- the order


_DIGITS = re.compile(r"(\d+)")


@functools.lru_cache(maxsize=1 << 17)  # (a job saves and loads the same atoms every time)
def path_key(path: str) -> tuple[Any, ...]:
    """The order of atoms in the index (docs/FORMAT.md 3.1): a path as its runs of ASCII digits and of the rest, the
    digits compared as numbers (then by length: "01" after "1"), the rest as text. So `layers.2` comes before
    `layers.10` and the experts of one rank of an expert-parallel layout (0 to 31 of 256, say) lie together, where a
    text order would scatter them over every part of their layer."""
    pieces: list[Any] = _DIGITS.split(path)
    pieces[1::2] = [(int(p), len(p)) for p in pieces[1::2]]
    return tuple(pieces)


# ------------------------------------------------------------------------------------------------- writing


@collector_paused()
def encode(manifest: StepManifest) -> tuple[bytes, list[tuple[str, bytes]]]:
    """The format 3.1 manifest of `manifest` (its objects, packed chunks and packs filled in by the commit): the step
    group's `zarr.json`, and the index parts (name below the attempt, bytes) to write before it."""
    import crc32c

    paths = sorted(manifest.atoms, key=path_key)
    parts: list[tuple[str, bytes]] = []
    directory: list[list[Any]] = []
    start = 0
    while start < len(paths):
        end, records = start, 0
        while end < len(paths) and (records < PART_RECORDS or end == start):
            meta = manifest.atoms[paths[end]]
            records += 1 + (1 if meta.single_chunk else math.prod(meta.grid))
            end += 1
        doc, nbytes = _part_doc(manifest, paths[start:end])
        data = dumps(doc)
        directory.append([paths[start], end - start, nbytes, len(data), crc32c.crc32c(data)])
        parts.append((atoms_part_name(len(directory) - 1), data))
        start = end
    tree, trees = _split_tree(manifest.tree)
    tree_sums = []
    for number, node in enumerate(trees):
        data = dumps(node)
        tree_sums.append([len(data), crc32c.crc32c(data)])
        parts.append((tree_part_name(number), data))
    attrs = {
        "format_version": FORMAT_VERSION,
        "step": manifest.step,
        "layout": manifest.layout,
        "created_at": manifest.created_at,
        "writer": manifest.writer,
        "tree": tree,
        "index": {
            "atoms": len(paths),
            "bytes": sum(d[2] for d in directory),
            "parts": directory,
            "trees": tree_sums,
        },
    }
    return dumps({"zarr_format": 3, "node_type": "group", "attributes": {"ucp": attrs}}), parts


def _part_doc(manifest: StepManifest, paths: list[str]) -> tuple[dict[str, Any], int]:
    """The columns of one atom part (docs/FORMAT.md 3.1) and the bytes of its atoms. (One pass with each column's
    `append` at hand: a save of 5,000 atoms encodes them all.)"""
    dtype_codes: dict[str, int] = {}
    attr_codes: dict[str, int] = {}
    attributes: list[Any] = []
    pack_codes: dict[str, int] = {}
    dtype: list[int] = []
    ndim: list[int] = []
    shape: list[int] = []
    chunk_shape: list[int] = []
    sharded: list[int] = []
    inner: list[int] = []
    attrs: list[int] = []
    packed: list[int] = []
    chunks: list[int] = []
    pack: list[int] = []
    offset: list[int] = []
    nbytes: list[int] = []
    crc: list[int] = []
    atoms, records, objects = manifest.atoms, manifest.packed, manifest.objects
    total = 0
    for number, path in enumerate(paths):
        meta = atoms[path]
        total += meta.nbytes
        dtype.append(dtype_codes.setdefault(meta.dtype, len(dtype_codes)))
        ndim.append(len(meta.shape))
        shape += meta.shape
        chunk_shape += meta.chunk_shape
        if meta.inner_chunk_shape is not None:
            sharded.append(number)
            inner += meta.inner_chunk_shape
        key = repr(meta.attributes)  # (equal reprs: equal JSON; attributes alike are stored once)
        code = attr_codes.get(key)
        if code is None:
            code = attr_codes[key] = len(attributes)
            attributes.append(meta.attributes)
        attrs.append(code)
        if meta.packed:
            packed.append(1)
            held = records[path]
            chunks.append(len(held))
            for c in held:
                code = pack_codes.get(c.pack)
                if code is None:
                    code = pack_codes[c.pack] = len(pack_codes)
                pack.append(code)
                offset.append(c.offset)
                nbytes.append(c.nbytes)
                crc.append(c.crc)
        else:
            packed.append(0)
            sums = objects[path] if objects is not None else []
            chunks.append(len(sums))
            pack += [-1] * len(sums)
            offset += [0] * len(sums)
            nbytes += [n for n, _ in sums]
            crc += [c for _, c in sums]
    doc = {
        "paths": paths,
        "dtypes": list(dtype_codes),
        "dtype": dtype,
        "ndim": ndim,
        "shape": shape,
        "chunk_shape": chunk_shape,
        "sharded": sharded,
        "inner_chunk_shape": inner,
        "attrs": attrs,
        "packed": packed,
        "chunks": chunks,
        "pack": pack,
        "offset": offset,
        "nbytes": nbytes,
        "crc": crc,
        "attributes": attributes,
        "packs": [[name, *manifest.packs[name]] for name in pack_codes],
    }
    return doc, total


def _split_tree(tree: dict[str, Any]) -> tuple[dict[str, Any], list[Any]]:
    """The state tree with each large child of its root replaced by {"part": n}, and the parts' nodes."""
    body = tree.get("dict")
    if not isinstance(body, dict):
        return tree, []
    out: dict[str, Any] = {}
    parts: list[Any] = []
    for key, node in body.items():
        if len(dumps(node)) > TREE_INLINE_BYTES:
            out[key] = {"part": len(parts)}
            parts.append(node)
        else:
            out[key] = node
    return {"dict": out}, parts


# ------------------------------------------------------------------------------------------------- reading

Fetch = Callable[[str, int], bytes]  # (name below the attempt, its recorded size) -> its bytes, at most size + 1


class PartEntry:
    """One atom part as the manifest's directory lists it."""

    __slots__ = ("atoms", "bytes", "crc", "first", "size")

    def __init__(self, first: str, atoms: int, nbytes: int, size: int, crc: int):
        self.first, self.atoms, self.bytes, self.size, self.crc = first, atoms, nbytes, size, crc


def _directory(index: Any, where: str) -> tuple[int, int, list[PartEntry], list[ObjectSum]]:
    """The manifest's `index`: (atoms, bytes, its atom parts, its tree parts), every field checked."""
    if not isinstance(index, dict):
        raise FormatError(f"{where}: a format 3.1 manifest needs an 'index' object")
    atoms = json_int(index.get("atoms"), where, "index atoms")
    nbytes = json_int(index.get("bytes"), where, "index bytes")
    parts, trees = index.get("parts"), index.get("trees", [])
    if not isinstance(parts, list) or not isinstance(trees, list):
        raise FormatError(f"{where}: the index's parts and trees must be lists")
    entries: list[PartEntry] = []
    for entry in parts:
        if not (isinstance(entry, list) and len(entry) == 5 and isinstance(entry[0], str)):
            raise FormatError(
                f"{where}: index part entry {entry!r:.100} is not [first path, atoms, bytes, size, crc32c]"
            )
        first = check_atom_path(entry[0], f"{where}: index part")
        if entries and not path_key(entries[-1].first) < path_key(first):
            raise FormatError(f"{where}: the index's parts are not in the order of their first paths at {first!r:.200}")
        entries.append(
            PartEntry(
                first,
                json_int(entry[1], where, f"part {len(entries)}'s atoms", 1, MAX_PART_BYTES),
                json_int(entry[2], where, f"part {len(entries)}'s bytes", 0, MAX_ATOM_BYTES * MAX_PART_BYTES),
                json_int(entry[3], where, f"part {len(entries)}'s size", 2, MAX_PART_BYTES),
                json_int(entry[4], where, f"part {len(entries)}'s crc32c", 0, 2**32 - 1),
            )
        )
    if sum(e.atoms for e in entries) != atoms or sum(e.bytes for e in entries) != nbytes:
        raise FormatError(f"{where}: the index's parts do not add up to its {atoms} atoms of {nbytes} bytes")
    sums = []
    for entry in trees:
        if not (isinstance(entry, list) and len(entry) == 2):
            raise FormatError(f"{where}: index tree entry {entry!r:.100} is not [size, crc32c]")
        sums.append(
            (
                json_int(entry[0], where, "a tree part's size", 2, MAX_TREE_PART_BYTES),
                json_int(entry[1], where, "a tree part's crc32c", 0, 2**32 - 1),
            )
        )
    return atoms, nbytes, entries, sums


def _ints(doc: dict[str, Any], key: str, where: str, count: int | None = None) -> np.ndarray:
    """Column `key` of a part: a list of JSON integers (no float, bool or string) of `count` entries, as int64."""
    col = doc.get(key)
    if type(col) is not list or (count is not None and len(col) != count):
        want = f"of {count} integers" if count is not None else "of integers"
        raise FormatError(f"{where}: column {key!r} must be a list {want}")
    if col and not set(map(type, col)) <= {int}:
        bad = next(v for v in col if type(v) is not int)
        raise FormatError(f"{where}: every entry of column {key!r} must be an integer, not {bad!r:.40}")
    try:
        return np.array(col, dtype=np.int64)
    except OverflowError:
        raise FormatError(f"{where}: column {key!r} holds an integer beyond 64 bits") from None


def _segment_prod(flat: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """The product of each run of `flat` (runs of `lengths` back to back), as float64 (1 for an empty run): exact up
    to 2^53, and any larger product is past every bound it is held to."""
    out = np.ones(len(lengths))
    full = lengths > 0
    if full.any():
        starts = (np.cumsum(lengths) - lengths)[full]
        out[full] = np.multiply.reduceat(flat.astype(np.float64), starts)
    return out


@dataclass(frozen=True, slots=True)
class _Atoms:
    """A part's atom columns, decoded and checked: per atom its path, data type, extents (runs of `shape` and
    `chunk`, from `starts`), inner chunk shape where sharded, attributes (a code into the table) and packing."""

    paths: list[str]
    dtype: list[str]
    shape: list[int]
    chunk: list[int]
    starts: list[int]
    inner: dict[int, tuple[int, ...]]
    attributes: list[dict[str, Any]]
    attrs: list[int]
    packed: list[bool]

    def meta(self, i: int) -> AtomMeta:
        a, b = self.starts[i], self.starts[i + 1]
        return AtomMeta(
            self.paths[i],
            tuple(self.shape[a:b]),
            self.dtype[i],
            tuple(self.chunk[a:b]),
            self.inner.get(i),
            self.attributes[self.attrs[i]],
            True,
            self.packed[i],
        )


@dataclass(frozen=True, slots=True)
class _Records:
    """A part's chunk records, decoded and checked: atom i's are [first[i], first[i + 1]); a packed chunk's pack by
    name ("" for a chunk object of the atom's own), its offset, size and CRC-32C."""

    first: list[int]
    pack: list[str]
    offset: list[int]
    nbytes: list[int]
    crc: list[int]


class IndexPart:
    """One decoded atom part (`decode`: every bound checked): `meta(i)` and `records(i)` make the i-th atom's
    description and chunk records; `packs` the packs its packed chunks lie in, with their size and checksum."""

    __slots__ = ("_atoms", "_records", "packs", "paths")

    def __init__(self, atoms: _Atoms, records: _Records, packs: dict[str, ObjectSum]):
        self._atoms, self._records, self.packs = atoms, records, packs
        self.paths = atoms.paths

    def find(self, path: str) -> int | None:
        i = bisect.bisect_left(self.paths, path_key(path), key=path_key)
        return i if i < len(self.paths) and self.paths[i] == path else None

    def meta(self, i: int) -> AtomMeta:
        return self._atoms.meta(i)

    def records(self, i: int) -> list[PackedChunk] | list[ObjectSum]:
        """The i-th atom's chunk records in C order over its grid: where each packed chunk lies, or each chunk
        object's size and checksum."""
        rec = self._records
        a, b = rec.first[i], rec.first[i + 1]
        if self._atoms.packed[i]:
            return [PackedChunk(*r) for r in zip(rec.pack[a:b], rec.offset[a:b], rec.nbytes[a:b], rec.crc[a:b])]
        return list(zip(rec.nbytes[a:b], rec.crc[a:b]))

    def whole_packed(self, i: int) -> WholePacked | None:
        """The i-th atom's one packed chunk if it has one chunk and is packed (most atoms of a state of many small
        ones), with what its tensor needs; None for any other."""
        atoms, rec = self._atoms, self._records
        r = rec.first[i]
        if not atoms.packed[i] or rec.first[i + 1] - r != 1:
            return None
        a, b = atoms.starts[i], atoms.starts[i + 1]
        return WholePacked(
            tuple(atoms.shape[a:b]), atoms.dtype[i], rec.pack[r], rec.offset[r], rec.nbytes[r], rec.crc[r]
        )

    def holding(self, pack: str) -> list[str]:
        """The atoms of the part with a chunk in `pack`."""
        first = self._records.first
        return sorted(
            {self.paths[bisect.bisect_right(first, r) - 1] for r, p in enumerate(self._records.pack) if p == pack}
        )

    @classmethod
    def decode(cls, doc: Any, entry: PartEntry, end: tuple[Any, ...] | None, where: str) -> IndexPart:
        """A part from its document, checked: every column of the right length and type, the paths plain, ascending
        and inside [entry.first, end) (`end`: the next part's first path's `path_key`), every declared size within the format's bounds (section 8), every chunk
        record consistent with its atom and every packed chunk inside its pack, aligned and overlapping no other of
        the part; its atoms and bytes as the directory lists them. Anything else is a FormatError."""
        if type(doc) is not dict:
            raise FormatError(f"{where} is not a JSON object")
        paths = doc.get("paths")
        if type(paths) is not list or len(paths) != entry.atoms:
            raise FormatError(f"{where}: paths must list the part's {entry.atoms} atoms")
        n = len(paths)
        if not plain_paths(paths):
            for p in paths:
                check_atom_path(p, where)
        # (each path found through a dict once its part is read: only the part's bounds must hold for the directory's
        # search, and no path may appear twice)
        if paths[0] != entry.first or len(set(paths)) != n:
            raise FormatError(f"{where}: its paths do not start at {entry.first!r:.200} or one appears twice")
        if end is not None and not path_key(paths[-1]) < end:
            raise FormatError(f"{where}: path {paths[-1]!r:.200} belongs to the next part")
        names = doc.get("dtypes")
        if type(names) is not list:
            raise FormatError(f"{where}: dtypes must be a list of data type names")
        try:
            facts = [dtypes.facts(name) for name in names]
        except FormatError as e:
            raise FormatError(f"{where}: {e}") from None
        dtype = _ints(doc, "dtype", where, n)
        ndim = _ints(doc, "ndim", where, n)
        if n and (dtype.min() < 0 or dtype.max() >= len(facts)):
            raise FormatError(f"{where}: a dtype code is not one of its {len(facts)} dtypes")
        if n and (ndim.min() < 0 or ndim.max() > MAX_NDIM):
            raise FormatError(f"{where}: an atom's shape must list at most {MAX_NDIM} extents")
        dims = int(ndim.sum())
        shape = _ints(doc, "shape", where, dims)
        chunk = _ints(doc, "chunk_shape", where, dims)
        starts = np.concatenate(([0], np.cumsum(ndim)))

        def atom_of(position: int) -> str:  # the atom whose extent is at flat position `position`
            return repr(paths[int(np.searchsorted(starts, position, side="right")) - 1])[:200]

        for name, col, low in (("shape", shape, 0), ("chunk_shape", chunk, 1)):
            bad = np.nonzero((col < low) | (col > MAX_ATOM_BYTES))[0]
            if len(bad):
                raise FormatError(
                    f"{where}: atom {atom_of(bad[0])}: {name} must be an integer in [{low}, {MAX_ATOM_BYTES}], "
                    f"got {int(col[bad[0]])}"
                )
        itemsize = np.array([f.itemsize for f in facts], dtype=np.int64)[dtype] if n else np.zeros(0, np.int64)
        nbytes = _segment_prod(shape, ndim) * itemsize
        over = np.nonzero(nbytes > MAX_ATOM_BYTES)[0]
        if len(over):
            i = int(over[0])
            raise FormatError(
                f"{where}: atom {paths[i]!r:.200}: shape declares {nbytes[i]:.0f} bytes, more than the format's "
                f"{MAX_ATOM_BYTES}"
            )
        chunk_bytes = _segment_prod(chunk, ndim) * itemsize
        over = np.nonzero(chunk_bytes > MAX_OBJECT_BYTES)[0]
        if len(over):
            raise FormatError(
                f"{where}: atom {paths[int(over[0])]!r:.200}: chunk_shape declares objects larger than "
                f"{MAX_OBJECT_BYTES} bytes"
            )
        grid = _segment_prod((shape + chunk - 1) // chunk, ndim)
        over = np.nonzero(grid > MAX_OBJECTS_PER_ATOM)[0]
        if len(over):
            i = int(over[0])
            raise FormatError(
                f"{where}: atom {paths[i]!r:.200}: {grid[i]:.0f} chunk objects, more than the format's "
                f"{MAX_OBJECTS_PER_ATOM}"
            )
        packed = _ints(doc, "packed", where, n)
        if n and (packed.min() < 0 or packed.max() > 1):
            raise FormatError(f"{where}: column 'packed' must hold 0 or 1")
        sharded = _ints(doc, "sharded", where)
        if len(sharded) and (
            sharded.min() < 0 or sharded.max() >= n or (len(sharded) > 1 and (np.diff(sharded) <= 0).any())
        ):
            raise FormatError(f"{where}: column 'sharded' must list atoms of the part, ascending")
        inner_flat = _ints(doc, "inner_chunk_shape", where, int(ndim[sharded].sum()) if len(sharded) else 0)
        chunk_list, starts_list = chunk.tolist(), starts.tolist()
        inner: dict[int, tuple[int, ...]] = {}
        pos = 0
        for i in sharded.tolist():
            a, b = starts_list[i], starts_list[i + 1]
            extents = tuple(inner_flat[pos : pos + b - a].tolist())
            pos += b - a
            outer = chunk_list[a:b]
            if packed[i]:
                raise FormatError(f"{where}: packed atom {paths[i]!r:.200} lists inner_chunk_shape")
            if any(e < 1 or c % e for c, e in zip(outer, extents)):
                raise FormatError(
                    f"{where}: atom {paths[i]!r:.200}: inner_chunk_shape {list(extents)} does not divide {outer}"
                )
            if math.prod(c // e for c, e in zip(outer, extents)) > MAX_INNER_PER_OBJECT:
                raise FormatError(
                    f"{where}: atom {paths[i]!r:.200}: more inner chunks per shard than the format's "
                    f"{MAX_INNER_PER_OBJECT}"
                )
            inner[i] = extents
        attributes = doc.get("attributes")
        if type(attributes) is not list or not all(type(a) is dict for a in attributes):
            raise FormatError(f"{where}: dtype must be a string and attributes an object (attributes: a list of them)")
        attrs = _ints(doc, "attrs", where, n)
        if n and (attrs.min() < 0 or attrs.max() >= len(attributes)):
            raise FormatError(f"{where}: an attributes code is not one of its {len(attributes)} attributes")
        chunks = _ints(doc, "chunks", where, n)
        wrong = np.nonzero(chunks != grid)[0]
        if len(wrong):
            i = int(wrong[0])
            raise FormatError(f"{where}: atom {paths[i]!r:.200} must list {grid[i]:.0f} chunks, it lists {chunks[i]}")
        atoms = _Atoms(
            paths,
            [names[c] for c in dtype.tolist()],
            shape.tolist(),
            chunk_list,
            starts_list,
            inner,
            attributes,
            attrs.tolist(),
            packed.astype(bool).tolist(),
        )
        first = np.concatenate(([0], np.cumsum(chunks))).tolist()
        records, packs = _records(doc, atoms, first, chunks, chunk_bytes, nbytes, itemsize, where)
        if int(sum(nbytes.astype(np.int64).tolist())) != entry.bytes:
            raise FormatError(f"{where}: its atoms hold {nbytes.sum():.0f} bytes, the index says {entry.bytes}")
        return cls(atoms, records, packs)


def _records(
    doc: dict[str, Any],
    atoms: _Atoms,
    first: list[int],
    chunks: np.ndarray,
    chunk_bytes: np.ndarray,
    nbytes: np.ndarray,
    itemsize: np.ndarray,
    where: str,
) -> tuple[_Records, dict[str, ObjectSum]]:
    """A part's chunk records and packs, checked: an unpacked atom's objects of the size its chunks take (a shard's
    within the bounds), a packed atom's chunks in a listed pack, of the chunk's size, inside the pack's data, on an
    element boundary and overlapping no other of the part; every checksum a CRC-32C."""
    packs_doc = doc.get("packs")
    if type(packs_doc) is not list:
        raise FormatError(f"{where}: packs must be a list of [pack name, nbytes, crc32c]")
    packs: dict[str, ObjectSum] = {}
    table: list[str] = []
    for entry in packs_doc:
        if not (type(entry) is list and len(entry) == 3 and is_pack_name(entry[0])) or entry[0] in packs:
            raise FormatError(f"{where}: pack entry {entry!r:.100} is not a pack name with [nbytes, crc32c]")
        total = json_int(entry[1], where, f"pack {entry[0]}'s nbytes", CRC_BYTES + 1, MAX_OBJECT_BYTES + CRC_BYTES)
        packs[entry[0]] = (total, json_int(entry[2], where, f"pack {entry[0]}'s crc32c", 0, 2**32 - 1))
        table.append(entry[0])
    count = first[-1]
    pack = _ints(doc, "pack", where, count)
    offset = _ints(doc, "offset", where, count)
    size = _ints(doc, "nbytes", where, count)
    crc = _ints(doc, "crc", where, count)
    atom = np.repeat(np.arange(len(chunks)), chunks)  # (count is bounded by the columns' lengths, checked above)
    is_packed = np.array(atoms.packed, dtype=bool)[atom]
    paths = atoms.paths

    def fail(mask: np.ndarray, what: str) -> None:
        bad = np.nonzero(mask)[0]
        if len(bad):
            r = int(bad[0])
            raise FormatError(
                f"{where}: atom {paths[int(atom[r])]!r:.200} records a chunk {what} "
                f"(pack {int(pack[r])}, offset {int(offset[r])}, nbytes {int(size[r])}, crc32c {int(crc[r])})"
            )

    fail((crc < 0) | (crc >= 2**32), "whose crc32c is not an integer of 32 bits")
    fail(~is_packed & ((pack != -1) | (offset != 0)), "of its own object that names a pack")
    sharded = np.zeros(len(chunks), dtype=bool)
    sharded[list(atoms.inner)] = True
    plain = ~is_packed & ~sharded[atom]
    fail(plain & (size != chunk_bytes[atom] + CRC_BYTES), "whose size is not its chunk's (with its checksum)")
    fail(
        (size < 0) | (size > MAX_OBJECT_BYTES + (1 << 24)) | (offset < 0) | (offset > MAX_OBJECT_BYTES),
        f"whose offset or size is not an integer in [0, {MAX_OBJECT_BYTES}]",
    )
    fail(is_packed & ((pack < 0) | (pack >= len(table))), "in no listed pack of the part")
    if is_packed.any():
        data_bytes = np.array([packs[name][0] - CRC_BYTES for name in table], dtype=np.int64)
        limit = data_bytes[np.where(is_packed, pack, 0)]
        single = chunks[atom] == 1
        fail(is_packed & single & (size != nbytes[atom]), "of another size than the atom")
        fail(is_packed & (offset + size > limit), "outside its pack's data")
        fail(is_packed & (offset % itemsize[atom] != 0), "not on an element boundary")
        grids: dict[int, tuple[AtomMeta, list[tuple[int, ...]]]] = {}  # (each split atom's chunks listed once)
        for r in np.nonzero(is_packed & ~single)[0].tolist():  # (atoms a writer split: their chunks' sizes)
            i = int(atom[r])
            if i not in grids:
                meta = atoms.meta(i)
                grids[i] = meta, chunk_indices(meta.grid)
            meta, indices = grids[i]
            box = meta.chunk_box(indices[r - first[i]])
            if int(size[r]) != math.prod(b - a for a, b in box) * meta.itemsize:
                fail(np.arange(count) == r, "of another size than the chunk's region")
        order = np.lexsort((offset, pack))
        order = order[is_packed[order]]
        same = pack[order[1:]] == pack[order[:-1]]
        overlap = same & (offset[order[1:]] < offset[order[:-1]] + size[order[:-1]])
        if overlap.any():
            k = int(np.nonzero(overlap)[0][0])
            a, b = int(atom[order[k]]), int(atom[order[k + 1]])
            raise FormatError(
                f"{where}: packed atoms {paths[a]!r:.200} and {paths[b]!r:.200} overlap in {table[int(pack[order[k]])]}"
            )
    names = [table[c] if c >= 0 else "" for c in pack.tolist()]
    return _Records(first, names, offset.tolist(), size.tolist(), crc.tolist()), packs


class AtomIndex(Mapping[str, AtomMeta]):
    """Every atom of an indexed step, by path (a mapping, as a 3.0 manifest's `atoms` dict): an atom's record is read
    and decoded when first asked for, with the rest of its part; iterating reads every part. A view of its manifest
    (`IndexedManifest.atoms`), made when asked for: the manifest does not hold it, so that the two make no reference
    cycle (which would keep every atom's description alive after the last user of the manifest, until the cyclic GC
    ran)."""

    def __init__(self, manifest: IndexedManifest):
        self._manifest = manifest

    def __getitem__(self, path: str) -> AtomMeta:
        meta = self._manifest.meta(path)
        if meta is None:
            raise KeyError(path)
        return meta

    def __contains__(self, path: object) -> bool:
        return type(path) is str and self._manifest.meta(path) is not None

    def __len__(self) -> int:
        return self._manifest.total_atoms

    def __iter__(self) -> Iterator[str]:
        for number in range(len(self._manifest.entries)):
            yield from self._manifest.part(number).paths


class IndexedManifest:
    """The reader's view of a format 3.1 manifest: the step's facts, its tree and atom index read in part. `fetch`
    reads one of the step's index objects (it is checked here against the size and checksum the manifest gives it).
    It answers what a reader asks of any manifest (`StepManifest`'s `objects_of`, `packed_of`, `pack_sum`,
    `tree_at`); `tree`, `objects`, `packed` and `packs` read every part."""

    def __init__(self, attrs: dict[str, Any], where: str, fetch: Fetch):
        version = attrs.get("format_version")
        check_format_version(version, where)
        self.format_version: str = version  # type: ignore[assignment]
        self.step = json_int(attrs.get("step"), where, "step")
        for name in ("layout", "created_at", "writer"):
            if attrs.get(name) is not None and not isinstance(attrs[name], str):
                raise FormatError(f"{where}: {name} must be a string")
        self.layout: str | None = attrs.get("layout")
        self.created_at: str = attrs.get("created_at") or ""
        self.writer: str = attrs.get("writer") or ""
        head = attrs.get("tree")
        if not isinstance(head, dict):
            raise FormatError(f"{where}: the ucp manifest needs a 'tree' object")
        self._head = head
        self.total_atoms, self.total_bytes, self.entries, self._tree_sums = _directory(attrs.get("index"), where)
        self._firsts = [path_key(e.first) for e in self.entries]
        self._where, self._fetch = where, fetch
        self._parts: dict[int, IndexPart] = {}
        self._raw: dict[int, bytes] = {}  # each part's bytes as read (a distributed load sends them on)
        self._located: dict[str, tuple[IndexPart, int]] = {}  # every atom of the parts read: its part and place
        self._trees: dict[int, Any] = {}
        self._lock = threading.Lock()
        self._metas: dict[str, AtomMeta] = {}  # every atom described so far (`meta`)
        self.index_bytes = 0  # bytes of the index parts this reader holds, read or received (the manifest not counted)

    @property
    def atoms(self) -> AtomIndex:
        """Every atom of the step, by path (`AtomIndex`)."""
        return AtomIndex(self)

    def meta(self, path: str) -> AtomMeta | None:
        """The description of atom `path` (its part read if it was not), or None if the step has no such atom."""
        meta = self._metas.get(path)
        if meta is None:
            found = self.locate(path)
            if found is None:
                return None
            meta = self._metas[path] = found[0].meta(found[1])
        return meta

    # -- parts

    def part_of(self, path: str) -> int | None:
        """The number of the part that holds `path` if the step has it (by the directory alone: nothing read)."""
        number = bisect.bisect_right(self._firsts, path_key(path)) - 1
        return number if number >= 0 else None

    def locate(self, path: str) -> tuple[IndexPart, int] | None:
        """The part that holds `path` and its place there (its part read if it was not), or None."""
        found = self._located.get(path)
        if found is None:
            number = self.part_of(path)
            if number is None or number in self._parts:
                return None
            self.part(number)
            found = self._located.get(path)
        return found

    def part(self, number: int) -> IndexPart:
        part = self._parts.get(number)
        if part is None:
            entry = self.entries[number]
            part = self.add_part(number, self._fetch(atoms_part_name(number), entry.size))
        return part

    def add_part(self, number: int, data: bytes) -> IndexPart:
        """Part `number` from its bytes (read here, or received from the rank that read them), checked against its
        size and checksum and decoded."""
        import crc32c

        entry = self.entries[number]
        where = f"{self._where}: index part {atoms_part_name(number)}"
        if len(data) != entry.size or crc32c.crc32c(data) != entry.crc:
            raise FormatError(
                f"{where} is not the one the manifest records (its size or checksum differs): it was modified after "
                "the step was committed"
            )
        end = self._firsts[number + 1] if number + 1 < len(self._firsts) else None
        part = IndexPart.decode(loads(data, where, MAX_PART_BYTES), entry, end, where)
        with self._lock:
            if number not in self._parts:
                twice = next((p for p in part.paths if p in self._located), None)
                if twice is not None:  # (each part's paths are its own: a load that read the other would differ)
                    raise FormatError(f"{where}: atom {twice!r:.200} is listed by another index part too")
                self.index_bytes += len(data)
                self._raw[number] = data
                self._located.update(zip(part.paths, zip(itertools.repeat(part), range(len(part.paths)))))
                self._parts[number] = part
            return self._parts[number]

    def check_placement(self) -> None:
        """Read every part and check that each atom lies in the part the directory finds it in (what a load that
        reads only the parts of its atoms relies on); decoding checks a part's first and last paths only."""
        self.load(list(range(len(self.entries))))
        for number, part in sorted(self._parts.items()):
            for path in part.paths:
                if self.part_of(path) != number:
                    raise FormatError(
                        f"{self._where}: atom {path!r:.200} is listed by index part {atoms_part_name(number)}, "
                        "out of the order of its paths: a load of it alone would not find it there"
                    )

    def has_part(self, number: int) -> bool:
        return number in self._parts

    def part_bytes(self, number: int) -> bytes:
        """Part `number`'s bytes as they were read (checked): what a rank that read it sends the others."""
        self.part(number)
        return self._raw[number]

    def load(self, numbers: list[int], threads: int = 1) -> None:
        """Read and decode the parts `numbers` not read yet, `threads` at a time (a whole load's: on an object store
        each is a request's latency)."""
        missing = [n for n in numbers if n not in self._parts]
        if len(missing) > 1 and threads > 1:
            import concurrent.futures as cf

            with cf.ThreadPoolExecutor(min(threads, len(missing))) as pool:
                list(pool.map(self.part, missing))
        else:
            for n in missing:
                self.part(n)

    def index_objects(self) -> list[tuple[str, int]]:
        """Every index object of the step (atom parts, then tree parts): its name below the attempt and its size."""
        return [(atoms_part_name(n), e.size) for n, e in enumerate(self.entries)] + [
            (tree_part_name(n), size) for n, (size, _) in enumerate(self._tree_sums)
        ]

    def parts(self, paths: list[str] | None = None) -> list[int]:
        """The parts that hold `paths` (every part if None, or if they are a good share of the step's atoms: then
        reading every part costs less than finding each path's), each once, ascending."""
        if paths is None or len(paths) * 4 > self.total_atoms:
            return list(range(len(self.entries)))
        found = {self.part_of(p) for p in paths}
        return sorted(n for n in found if n is not None)

    # -- what a reader asks of any manifest

    def whole_packed(self, path: str) -> WholePacked | None:
        part, i = self._located.get(path) or self._found(path)
        return part.whole_packed(i)

    def lacking(self, paths: list[str]) -> list[str]:
        """Those of `paths` the step has no atom of (their parts read)."""
        self.load(self.parts(paths))
        return [p for p in paths if p not in self._located]

    def objects_of(self, path: str) -> list[ObjectSum] | None:
        part, i = self._found(path)
        return part.records(i)  # type: ignore[return-value]

    def packed_of(self, path: str) -> list[PackedChunk]:
        part, i = self._found(path)
        return part.records(i)  # type: ignore[return-value]

    def pack_sum(self, name: str) -> ObjectSum:
        for part in self._parts.values():  # (a pack is listed by every loaded part that holds one of its chunks)
            found = part.packs.get(name)
            if found is not None:
                return found
        return self.packs[name]

    def atoms_in_pack(self, name: str) -> list[str]:
        """The atoms with a chunk in pack `name`, of the parts read so far (for an error: no part is read for it)."""
        with self._lock:
            parts = list(self._parts.values())
        return sorted({p for part in parts for p in part.holding(name)})

    def _found(self, path: str) -> tuple[IndexPart, int]:
        found = self.locate(path)
        if found is None:
            raise KeyError(path)
        return found

    @property
    def objects(self) -> dict[str, list[ObjectSum]]:
        """Every unpacked atom's objects (reads every part)."""
        return {p: self.objects_of(p) for p, m in self.atoms.items() if not m.packed}  # type: ignore[misc]

    @property
    def packed(self) -> dict[str, list[PackedChunk]]:
        """Every packed atom's chunks (reads every part)."""
        return {p: self.packed_of(p) for p, m in self.atoms.items() if m.packed}

    @property
    def packs(self) -> dict[str, ObjectSum]:
        """Every pack (reads every part); a pack that two parts list with another size or checksum is a
        FormatError."""
        out: dict[str, ObjectSum] = {}
        for number in range(len(self.entries)):
            for name, sums in self.part(number).packs.items():
                if out.setdefault(name, sums) != sums:
                    raise FormatError(f"{self._where}: pack {name} is listed with two sizes or checksums")
        return dict(sorted(out.items()))

    # -- the state tree

    @property
    def tree(self) -> dict[str, Any]:
        """The whole state tree (its parts read)."""
        body = self._head.get("dict")
        if not isinstance(body, dict):
            return self._head
        return {"dict": {key: self._resolved(node) for key, node in body.items()}}

    def tree_at(self, *keys: str) -> Any:
        """The node of the state tree at `keys` (dict keys from the root), or None: only the tree part on the way is
        read, if any."""
        node: Any = self._head
        for key in keys:
            body = node.get("dict") if isinstance(node, dict) else None
            if not isinstance(body, dict) or key not in body:
                return None
            node = self._resolved(body[key])
        return node

    def _resolved(self, node: Any) -> Any:
        """A child of the tree's root, or the tree part it refers to ({"part": n})."""
        if not (isinstance(node, dict) and len(node) == 1 and "part" in node):
            return node
        number = node["part"]
        if type(number) is not int or not 0 <= number < len(self._tree_sums):
            raise FormatError(f"{self._where}: state tree node {node!r:.100} names no tree part of the index")
        if number not in self._trees:
            import crc32c

            size, crc = self._tree_sums[number]
            where = f"{self._where}: index part {tree_part_name(number)}"
            data = self._fetch(tree_part_name(number), size)
            if len(data) != size or crc32c.crc32c(data) != crc:
                raise FormatError(
                    f"{where} is not the one the manifest records (its size or checksum differs): it was modified "
                    "after the step was committed"
                )
            with self._lock:
                self.index_bytes += len(data)
            self._trees[number] = loads(data, where, MAX_TREE_PART_BYTES)
        return self._trees[number]


def parse(doc: Any, where: str, fetch: Fetch) -> StepManifest | IndexedManifest:
    """A step group's zarr.json as a manifest: format 3.1's (an index read in part, through `fetch`) or an older
    one's (read whole)."""
    attrs = doc.get("attributes") if isinstance(doc, dict) else None
    attrs = attrs.get("ucp") if isinstance(attrs, dict) else None
    if isinstance(attrs, dict) and "index" in attrs and "atoms" not in attrs:
        return IndexedManifest(attrs, where, fetch)
    return StepManifest.from_group_json(doc, where)
