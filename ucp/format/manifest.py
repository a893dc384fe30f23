"""What is on disk: names, the metadata documents, and the bounds a reader holds them to (docs/FORMAT.md).

A checkpoint root holds one directory per step. Each save attempt of a step writes its own directory inside it
(`step_N/attempt-<id>/`): a Zarr v3 group whose `zarr.json` carries the ucp manifest (format version, step,
layout, the state tree, every atom's description and every object's size and checksum), with each atom a Zarr
v3 array below it. The step's commit marker (`step_N/ucp-commit.json`) names the one attempt that committed.
Format 1.0 steps (no attempts: the group is `step_N/` itself) are still read.

Everything read from metadata is bounded here before anything is sized from it, so a hostile or damaged
document gets a FormatError, never an allocation, an overflow or a Python error.
"""

from __future__ import annotations

import itertools
import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple, NoReturn

from ..base import dtypes
from ..errors import FormatError, StateError, UnsupportedVersionError

FORMAT_VERSION = "3.1"  # 3.1: the manifest's atom records in index parts (ucp.format.index)
FORMAT_MAJOR = 3
ZARR_JSON = "zarr.json"
COMMIT_MARKER = "ucp-commit.json"
ATTEMPT_RECORD = "ucp-attempt.json"  # an attempt's owner (who saves it, until when), written first
PACKS_GROUP = "ucp-packs"  # format 3: the group of an attempt's packs (ucp.format.packs)
INDEX_DIR = "ucp-index"  # format 3.1: the manifest's index parts, below the attempt (ucp.format.index)
CRC_BYTES = 4  # the crc32c codec appends a 4-byte little-endian checksum
INDEX_ENTRY_BYTES = 16  # sharding index: (offset, nbytes) as two little-endian uint64
EMPTY_INDEX_ENTRY = 2**64 - 1

_STEP_DIR = re.compile(r"^step_(\d{8,})$")
_ATTEMPT_DIR = re.compile(r"^attempt-[0-9a-f]{32}$")
_PACK_NAME = re.compile(rf"^{PACKS_GROUP}/p[0-9]{{1,9}}-[0-9]{{1,9}}$")
# An atom path whose components are all plain names: none empty, ".", ".." or with a backslash or NUL.
_PLAIN_PATH = re.compile(r"(?!\.\.?(?:/|$))[^/\\\x00]+(?:/(?!\.\.?(?:/|$))[^/\\\x00]+)*\Z")
# Names a state key may not take: they would collide with Zarr's or ucp's own files.
RESERVED_NAMES = frozenset({ZARR_JSON, COMMIT_MARKER, ATTEMPT_RECORD, PACKS_GROUP, INDEX_DIR})

# Bounds on what metadata may declare (docs/FORMAT.md section 8). Writers stay inside them; readers refuse more.
MAX_NDIM = 32
MAX_ATOM_BYTES = 1 << 46  # 64 TiB
MAX_OBJECT_BYTES = 1 << 32  # one stored object (plain chunk or shard): 4 GiB
MAX_OBJECTS_PER_ATOM = 1 << 24
MAX_INNER_PER_OBJECT = 1 << 20
MAX_MARKER_BYTES = 1 << 16  # a commit marker or an attempt record
MAX_DOCUMENT_BYTES = 1 << 24  # an atom's or group's zarr.json
MAX_MANIFEST_BYTES = 1 << 30
MAX_TREE_DEPTH = 64  # nesting of the state: dicts and lists (and JSON values) inside each other
MAX_JSON_DEPTH = 2 * MAX_TREE_DEPTH + 32  # brackets inside each other in any document ucp parses
MAX_KEY_BYTES = 255  # a state key is a file or object name
MAX_ATOM_PATH_BYTES = 768  # leaves room for the root, step and attempt in a 1,024-byte S3 key


def step_dirname(step: int) -> str:
    return f"step_{step:08d}"


MAX_INT = (1 << 63) - 1  # every integer of the format's JSON is a signed 64-bit one (a step number too)
MAX_STEP = MAX_INT


def check_step(step: object) -> int:
    """A step number to save: an integer in [0, MAX_STEP] (step directories hold at least 8 digits, more if
    needed)."""
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step <= MAX_STEP:
        raise StateError(f"a step must be an integer in [0, 2^63 - 1], got {step!r:.80}")
    return step


def parse_step_dirname(name: str) -> int | None:
    m = _STEP_DIR.match(name)
    return int(m.group(1)) if m else None


def is_attempt_dirname(name: object) -> bool:
    return isinstance(name, str) and _ATTEMPT_DIR.match(name) is not None


def is_pack_name(name: object) -> bool:
    """A pack's name below its attempt: `ucp-packs/p<writer>-<number>` (section 4.1)."""
    return isinstance(name, str) and _PACK_NAME.match(name) is not None


def check_format_version(version: object, where: str) -> None:
    """Refuse a newer major version (or a malformed one) with a clear error."""
    if not isinstance(version, str) or not re.fullmatch(r"[0-9]{1,6}\.[0-9]{1,6}", version):
        raise FormatError(f"{where}: format_version {version!r:.80} is not of the form MAJOR.MINOR")
    major = int(version.split(".")[0])
    if major > FORMAT_MAJOR:
        raise UnsupportedVersionError(
            f"{where} was written in UCP format {version}; this ucp reads major version {FORMAT_MAJOR} "
            "and older. Upgrade ucp to read it."
        )


def dumps(doc: Any) -> bytes:
    """Strict JSON (no NaN/Infinity), so that every Zarr reader can parse what ucp writes."""
    return json.dumps(doc, allow_nan=False, separators=(",", ":")).encode()  # compact: the C encoder


def loads(data: bytes | bytearray | memoryview, where: str, limit: int = MAX_MANIFEST_BYTES) -> Any:
    """Parse a metadata document: at most `limit` bytes, nested at most MAX_JSON_DEPTH deep, strict JSON."""
    if len(data) > limit:
        raise FormatError(f"{where} is {len(data)} bytes, more than the {limit} a ucp document may take")
    if _nesting(data) > MAX_JSON_DEPTH:
        raise FormatError(f"{where} is nested more than {MAX_JSON_DEPTH} levels deep")
    try:
        return json.loads(bytes(data), parse_constant=_no_constant)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise FormatError(f"{where} is not valid JSON ({e})") from None


def _no_constant(name: str) -> NoReturn:
    raise ValueError(f"{name} is not strict JSON")


_NOT_BRACKETS = bytes(c for c in range(256) if c not in b"[]{}")


def _nesting(data: bytes | bytearray | memoryview) -> int:
    """The deepest bracket nesting of a JSON text (brackets inside strings counted too: an upper bound), found
    without recursion, so that a deeply nested document is refused before the parser recurses into it. Only the
    brackets are looked at (a columnar index part of 100 KiB has a few dozen)."""
    brackets = bytes(data).translate(None, _NOT_BRACKETS)
    if len(brackets) <= MAX_JSON_DEPTH:
        return len(brackets)  # (an upper bound, under the limit)
    import numpy as np

    opens = np.frombuffer(brackets, dtype=np.uint8) & 2 != 0  # ("[" and "{" have bit 1 set, "]" and "}" not)
    return max(0, int(np.cumsum(np.where(opens, 1, -1), dtype=np.int64).max()))


def json_int(value: object, where: str, what: str, low: int = 0, high: int = MAX_INT) -> int:
    """A JSON integer (not a bool, float or string) within [low, high], or a FormatError naming it."""
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise FormatError(f"{where}: {what} must be an integer in [{low}, {high}], got {value!r:.80}")
    return value


def json_ints(value: object, where: str, what: str, low: int = 0, high: int = MAX_INT) -> tuple[int, ...]:
    if not isinstance(value, list) or len(value) > MAX_NDIM:
        raise FormatError(f"{where}: {what} must be a list of at most {MAX_NDIM} integers, got {value!r:.80}")
    if all(type(v) is int and low <= v <= high for v in value):  # (the common case, without a call per value)
        return tuple(value)
    return tuple(json_int(v, where, what, low, high) for v in value)


# ------------------------------------------------------------------------------------- quantised atoms

# What a block-quantised weight's scales may be stored as (section 2.1)
SCALE_DTYPE_NAMES = ("float32", "float8_e8m0fnu")


def scale_shape(shape: tuple[int, ...], block: tuple[int, ...] | list[int]) -> tuple[int, ...]:
    """The scales' shape of a weight of `shape` in blocks of `block` (a partial block at the end of a dim counts)."""
    return tuple(-(-n // b) for n, b in zip(shape, block, strict=True))


def quantization_of(meta: AtomMeta, atoms: Mapping[str, AtomMeta]) -> tuple[AtomMeta, tuple[int, int]] | None:
    """The scale atom and block of a block-quantised weight atom (section 2.1: its `quantization` attribute), checked
    against the step's atoms; None for an atom that is not one. A FormatError names what is wrong."""
    quantised = meta.attributes.get("quantization")
    if not isinstance(quantised, dict) or "scales" not in quantised:
        return None
    path, block = quantised["scales"], quantised.get("block")
    if type(path) is not str:
        raise FormatError(f"atom {meta.path!r}: quantization scales {path!r:.100} is not the path of an atom")
    if not (isinstance(block, list) and len(block) == 2 and all(type(b) is int and b > 0 for b in block)):
        raise FormatError(f"atom {meta.path!r}: quantization block {block!r:.100} is not two positive integers")
    if len(meta.shape) != 2:
        raise FormatError(f"atom {meta.path!r}: block-quantised, but not a matrix ({list(meta.shape)})")
    expected = scale_shape(meta.shape, block)
    scales = atoms.get(path)
    if scales is None or scales.dtype not in SCALE_DTYPE_NAMES or scales.shape != expected:
        found = "absent" if scales is None else f"{scales.dtype} {list(scales.shape)}"
        raise FormatError(
            f"atom {meta.path!r} is block-quantised ({block}), but its scale atom {path!r:.200} is {found}, not "
            f"{' or '.join(SCALE_DTYPE_NAMES)} {list(expected)}"
        )
    return scales, (block[0], block[1])


# ---------------------------------------------------------------------------------------------- atoms


@dataclass(frozen=True, slots=True)
class AtomMeta:
    """One atom: a Zarr v3 array holding one full logical tensor.

    `chunk_shape` is the regular grid of stored objects (one writer each). With `inner_chunk_shape`, each
    object is a shard (`sharding_indexed` codec) of inner chunks that can be read one by one.

    What a save or load of many small atoms asks per object (`itemsize`, `nbytes`, `grid`, `single_chunk`) is worked
    out once, when the atom is made: fields, not properties (a property cached per instance took a lock per access).
    Making one raises FormatError for a data type ucp does not know.
    """

    path: str
    shape: tuple[int, ...]
    dtype: str
    chunk_shape: tuple[int, ...]
    inner_chunk_shape: tuple[int, ...] | None = None
    attributes: dict[str, Any] = field(default_factory=dict, compare=False)
    # Format 2 shards carry a table of their inner chunks' checksums after the index (section 4); 1.0 shards do not.
    crc_table: bool = field(default=True, compare=False)
    # Format 3: the atom's chunks are byte ranges of packs (ucp.format.packs), not objects of its own; it has no zarr.json.
    packed: bool = field(default=False, compare=False)
    itemsize: int = field(init=False, repr=False, compare=False)
    nbytes: int = field(init=False, repr=False, compare=False)
    grid: tuple[int, ...] = field(init=False, repr=False, compare=False)  # chunks (objects) along each dimension
    single_chunk: bool = field(init=False, repr=False, compare=False)  # one chunk object holds the whole array

    def __post_init__(self) -> None:
        itemsize = dtypes.facts(self.dtype).itemsize
        shape, chunk = self.shape, self.chunk_shape
        if chunk == shape:  # (most atoms: one chunk, the whole atom)
            grid = (1,) * len(shape) if all(shape) else tuple(0 if s == 0 else 1 for s in shape)
        else:
            grid = tuple(-(-s // c) if c > 0 else 0 for s, c in zip(shape, chunk))
        put = object.__setattr__
        put(self, "itemsize", itemsize)
        put(self, "nbytes", math.prod(shape) * itemsize)
        put(self, "grid", grid)
        put(self, "single_chunk", bool(all(shape)) and all(n == 1 for n in grid))

    @property
    def inner_grid(self) -> tuple[int, ...]:
        """Inner chunks per shard along each dimension (all ones when not sharded)."""
        if self.inner_chunk_shape is None:
            return tuple(1 for _ in self.shape)
        return tuple(c // i for c, i in zip(self.chunk_shape, self.inner_chunk_shape))

    @property
    def chunk_slices(self) -> tuple[tuple[tuple[int, ...], tuple[slice, ...]], ...]:
        """Every chunk object's index and the slices of the array it holds, in C order."""
        return tuple((i, tuple(slice(a, b) for a, b in self.chunk_box(i))) for i in chunk_indices(self.grid))

    def to_manifest(self) -> dict[str, Any]:
        """The atom's entry in a format 3.0 manifest (the caller adds its objects)."""
        doc: dict[str, Any] = {"shape": list(self.shape), "dtype": self.dtype, "chunk_shape": list(self.chunk_shape)}
        if self.inner_chunk_shape is not None:
            doc["inner_chunk_shape"] = list(self.inner_chunk_shape)
        doc["attributes"] = self.attributes
        return doc

    @classmethod
    def from_manifest(cls, path: str, doc: Any, crc_table: bool = True) -> AtomMeta:
        if type(doc) is dict and "inner_chunk_shape" not in doc:
            # Most atoms are one chunk, the whole atom, of a known dtype: checked at once (a state of many small
            # atoms has 20,000 of them); anything else takes the full checks below, which name the problem.
            shape, dtype, attributes = doc.get("shape"), doc.get("dtype"), doc.get("attributes", {})
            if (
                type(shape) is list
                and shape == doc.get("chunk_shape")
                and len(shape) <= MAX_NDIM
                and all(type(s) is int and 1 <= s <= MAX_ATOM_BYTES for s in shape)
                and dtype in dtypes.SUPPORTED_DTYPES
                and type(attributes) is dict
                and _plain_path(path)
            ):
                meta = cls(path, tuple(shape), dtype, tuple(shape), None, attributes, crc_table, "packed" in doc)
                if meta.nbytes <= MAX_OBJECT_BYTES:
                    return meta
        where = f"manifest entry of atom {path!r:.200}"
        if not isinstance(doc, dict):
            raise FormatError(f"{where} is not a JSON object")
        check_atom_path(path, where)
        shape = json_ints(doc.get("shape"), where, "shape", 0, MAX_ATOM_BYTES)
        chunk_shape = json_ints(doc.get("chunk_shape"), where, "chunk_shape", 1, MAX_ATOM_BYTES)
        inner = doc.get("inner_chunk_shape")
        inner_shape = None if inner is None else json_ints(inner, where, "inner_chunk_shape", 1, MAX_ATOM_BYTES)
        dtype, attributes = doc.get("dtype"), doc.get("attributes", {})
        if not isinstance(dtype, str) or not isinstance(attributes, dict):
            raise FormatError(f"{where}: dtype must be a string and attributes an object")
        try:
            meta = cls(path, shape, dtype, chunk_shape, inner_shape, attributes, crc_table, "packed" in doc)
        except FormatError as e:  # (an unknown data type)
            raise FormatError(f"{where}: {e}") from None
        meta.validate()
        return meta

    def validate(self) -> None:
        """Refuse a description that is inconsistent or exceeds the format's bounds, before anything is sized by it."""
        where = f"atom {self.path!r:.200}"  # (its data type is known: making it checked that)
        if (
            self.inner_chunk_shape is None
            and self.chunk_shape == self.shape
            and len(self.shape) <= MAX_NDIM
            and min(self.shape, default=1) >= 1
            and self.nbytes <= MAX_OBJECT_BYTES
        ):
            return  # one chunk, the whole atom, within every bound (most atoms of a state of many small ones)
        if len(self.shape) > MAX_NDIM or len(self.chunk_shape) != len(self.shape) or any(s < 0 for s in self.shape):
            raise FormatError(f"{where}: chunk_shape {list(self.chunk_shape)} does not fit shape {list(self.shape)}")
        if any(c < 1 for c in self.chunk_shape):
            raise FormatError(f"{where}: chunk_shape {list(self.chunk_shape)} has a non-positive extent")
        if self.nbytes > MAX_ATOM_BYTES:
            raise FormatError(
                f"{where}: shape {list(self.shape)} declares {self.nbytes} bytes, more than the format's {MAX_ATOM_BYTES}"
            )
        if math.prod(self.chunk_shape) * self.itemsize > MAX_OBJECT_BYTES:
            raise FormatError(
                f"{where}: chunk_shape {list(self.chunk_shape)} declares objects larger than {MAX_OBJECT_BYTES} bytes"
            )
        if math.prod(self.grid) > MAX_OBJECTS_PER_ATOM:
            raise FormatError(
                f"{where}: {math.prod(self.grid)} chunk objects, more than the format's {MAX_OBJECTS_PER_ATOM}"
            )
        if self.packed and self.inner_chunk_shape is not None:
            raise FormatError(f"{where}: a packed atom has no inner chunks (it lists inner_chunk_shape)")
        if self.inner_chunk_shape is not None:
            inner = self.inner_chunk_shape
            if len(inner) != len(self.shape) or any(i < 1 or c % i for c, i in zip(self.chunk_shape, inner)):
                raise FormatError(f"{where}: inner_chunk_shape {list(inner)} does not divide {list(self.chunk_shape)}")
            if math.prod(self.inner_grid) > MAX_INNER_PER_OBJECT:
                raise FormatError(
                    f"{where}: {math.prod(self.inner_grid)} inner chunks per shard, more than the format's {MAX_INNER_PER_OBJECT}"
                )

    def zarr_json(self) -> dict[str, Any]:
        """The array's Zarr v3 metadata document."""
        chunk_codecs: list[dict[str, Any]] = [
            {"name": "bytes", "configuration": {"endian": "little"}},
            {"name": "crc32c"},
        ]
        if self.inner_chunk_shape is None:
            codecs = chunk_codecs
        else:
            codecs = [
                {
                    "name": "sharding_indexed",
                    "configuration": {
                        "chunk_shape": list(self.inner_chunk_shape),
                        "codecs": chunk_codecs,
                        "index_codecs": chunk_codecs,
                        "index_location": "start",
                    },
                }
            ]
        return {
            "zarr_format": 3,
            "node_type": "array",
            "shape": list(self.shape),
            "data_type": self.dtype,
            "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(self.chunk_shape)}},
            # "." keeps every chunk object of an atom in the atom's own directory (fewer directories to create)
            "chunk_key_encoding": {"name": "default", "configuration": {"separator": "."}},
            "fill_value": dtypes.fill_value(self.dtype),
            "codecs": codecs,
            "attributes": {"ucp": self.attributes},
        }

    def check_zarr_json(self, doc: Any) -> None:
        """Raise FormatError naming what an atom's zarr.json says differently from the committed manifest."""
        expected = self.zarr_json()
        if not isinstance(doc, dict):
            raise FormatError(f"atom {self.path!r}: zarr.json is not a JSON object")
        # (every key: what a Zarr reader takes from it, fill value and attributes too, and nothing it does not know)
        for key in sorted(expected.keys() | doc.keys(), key=lambda k: (k not in expected, k)):
            if doc.get(key) != expected.get(key):
                said = "has no " + key if key not in doc else f"says {key} = {json.dumps(doc[key])[:200]}"
                should = f"says {json.dumps(expected[key])[:200]}" if key in expected else f"has no {key}"
                raise FormatError(
                    f"atom {self.path!r}: zarr.json {said}, but the committed manifest {should} (the metadata was "
                    "edited after the save)"
                )

    def chunk_key(self, index: tuple[int, ...]) -> str:
        """Object key of the chunk at grid position `index`, relative to the atom's directory."""
        return ".".join(["c", *map(str, index)])

    def object_key(self, prefix: str, index: tuple[int, ...]) -> str:
        """Storage key of chunk object `index` of this atom in the step directory `prefix`."""
        return f"{prefix}/{self.path}/{self.chunk_key(index)}"

    def object_number(self, index: tuple[int, ...]) -> int:
        """Position of chunk `index` in C order over the grid (its entry in the manifest's `objects`)."""
        number = 0
        for i, n in zip(index, self.grid):
            number = number * n + i
        return number

    def chunk_box(self, index: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
        """The region [start, stop) per dimension of the array that chunk `index` holds (clipped at the edge)."""
        return tuple((i * c, min((i + 1) * c, s)) for i, c, s in zip(index, self.chunk_shape, self.shape))

    @property
    def object_bytes(self) -> int:
        """Bytes of data in one stored object (a whole chunk, padding included; a shard's head not counted)."""
        return math.prod(self.chunk_shape) * self.itemsize

    def stored_chunk_bytes(self) -> int:
        """Bytes of data in one stored (unsharded or inner) chunk, padding included."""
        shape = self.inner_chunk_shape or self.chunk_shape
        return math.prod(shape) * self.itemsize


def check_atom_path(path: object, where: str) -> str:
    """An atom path: '/'-separated state keys, none empty, '.', '..' or longer than a file name may be."""
    if not isinstance(path, str) or not path or len(path.encode(errors="replace")) > MAX_ATOM_PATH_BYTES:
        raise FormatError(
            f"{where}: atom path {path!r:.100} is empty, not a string or longer than {MAX_ATOM_PATH_BYTES} bytes"
        )
    if _plain_path(path):
        return path  # (the common case, checked at once)
    if not is_utf8(path):  # (a lone surrogate, which JSON's "\ud800" gives: no file or object can be named by it)
        raise FormatError(f"{where}: atom path {path!r:.100} is not Unicode text (it holds a lone surrogate)")
    for name in path.split("/"):
        if (
            name in ("", ".", "..")
            or "\\" in name
            or "\x00" in name
            or len(name.encode(errors="replace")) > MAX_KEY_BYTES
        ):
            raise FormatError(f"{where}: atom path {path!r:.100} has a component that is not a plain name")
    return path


# What no path of plain names holds, among many joined by newlines and wrapped in newlines: an empty path or component,
# a "." or ".." component, a backslash or NUL (each looked for in one pass of str.__contains__).
_NOT_PLAIN = (
    "\n\n",
    "\n/",
    "/\n",
    "//",
    "\\",
    "\x00",
    "\n./",
    "\n../",
    "/./",
    "/../",
    "/.\n",
    "/..\n",
    "\n.\n",
    "\n..\n",
)


def plain_paths(paths: list[Any]) -> bool:
    """Whether every one of `paths` is plainly a good atom path (ASCII strings of plain names, no longer than a file
    name may be): many checked at once (an index part's 2,000); False says only that one of them needs
    `check_atom_path`."""
    if not paths or set(map(type, paths)) != {str} or max(map(len, paths)) > MAX_KEY_BYTES:
        return False
    joined = "\n".join(paths)
    if not joined.isascii() or joined.count("\n") != len(paths) - 1:
        return False
    wrapped = f"\n{joined}\n"
    return not any(bad in wrapped for bad in _NOT_PLAIN)


def is_utf8(text: str) -> bool:
    """Whether `text` has a UTF-8 encoding: no lone surrogate (which Python's str and JSON's escapes hold, and no
    file system or object store names)."""
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


def _plain_path(path: object) -> bool:
    """An atom path that is plainly fine: ASCII, every component a plain name and, the whole being no longer than a
    key may be, every component short enough."""
    return type(path) is str and 0 < len(path) <= MAX_KEY_BYTES and path.isascii() and bool(_PLAIN_PATH.match(path))


def chunk_indices(grid: tuple[int, ...]) -> list[tuple[int, ...]]:
    """All positions of a grid in C order (one empty position for a 0-d grid; none if any extent is 0)."""
    if 0 in grid:  # (an empty atom's extents before its 0 may be 2^46: never build the positions over them)
        return []
    out: list[tuple[int, ...]] = [()]
    for n in grid:
        out = [(*prefix, i) for prefix in out for i in range(n)]
    return out


# ------------------------------------------------------------------------------------------ step manifest


ObjectSum = tuple[int, int]  # a stored object's (size in bytes, CRC-32C), as the writer recorded it (section 4)


class PackedChunk(NamedTuple):
    """Where a packed atom's chunk lies (section 4.1): bytes [offset, offset + nbytes) of the pack's data, whose
    CRC-32C is `crc`. (A tuple: a load of many small atoms makes one per atom.)"""

    pack: str
    offset: int
    nbytes: int
    crc: int

    def to_json(self) -> list:
        return [self.pack, self.offset, self.nbytes, self.crc]


class WholePacked(NamedTuple):
    """A packed atom of one chunk (most atoms of a state of many small ones): what reading it whole into a tensor of
    its own needs, without making its description (a load of many small atoms asks this per atom)."""

    shape: tuple[int, ...]
    dtype: str
    pack: str
    offset: int
    nbytes: int
    crc: int


@dataclass
class StepManifest:
    """The ucp attributes of a step's root group. `objects` gives, per atom, every chunk object's size and
    checksum in C order over its grid (format 2; None for a 1.0 step, which did not record them). In format 3,
    a packed atom's chunks are in `packed` instead (C order too), and `packs` gives each pack object's size and
    checksum."""

    step: int
    tree: dict[str, Any]
    atoms: dict[str, AtomMeta]
    layout: str | None = None
    created_at: str = ""
    writer: str = ""
    format_version: str = FORMAT_VERSION
    objects: dict[str, list[ObjectSum]] | None = None
    packed: dict[str, list[PackedChunk]] = field(default_factory=dict)
    packs: dict[str, ObjectSum] = field(default_factory=dict)

    # What a reader asks of any manifest, this one (format 3.0 and older, read whole) or an indexed one (format 3.1,
    # `ucp.format.index.IndexedManifest`, read in part).

    def whole_packed(self, path: str) -> WholePacked | None:
        """The atom's one packed chunk, if it is packed and of one chunk; None for any other."""
        meta = self.atoms[path]
        if not (meta.packed and meta.single_chunk):
            return None
        (c,) = self.packed[path]
        return WholePacked(meta.shape, meta.dtype, *c)

    def objects_of(self, path: str) -> list[ObjectSum] | None:
        """The size and checksum of each chunk object of an unpacked atom, C order over its grid (None in 1.0)."""
        return None if self.objects is None else self.objects[path]

    def packed_of(self, path: str) -> list[PackedChunk]:
        """Where each chunk of a packed atom lies, C order over its grid."""
        return self.packed[path]

    def pack_sum(self, name: str) -> ObjectSum:
        """The size and checksum of a pack's object."""
        return self.packs[name]

    def lacking(self, paths: list[str]) -> list[str]:
        """Those of `paths` the step has no atom of."""
        return [p for p in paths if p not in self.atoms]

    def atoms_in_pack(self, name: str) -> list[str]:
        """The atoms with a chunk in pack `name`."""
        return sorted(path for path, chunks in self.packed.items() if any(c.pack == name for c in chunks))

    def tree_at(self, *keys: str) -> Any:
        """The node of the state tree at `keys` (dict keys from the root), or None."""
        node: Any = self.tree
        for key in keys:
            body = node.get("dict") if isinstance(node, dict) else None
            if not isinstance(body, dict) or key not in body:
                return None
            node = body[key]
        return node

    def to_group_json(self) -> dict[str, Any]:
        """The step group's zarr.json in format 3.0 (what 3.0 writers wrote; ucp writes 3.1,
        `ucp.format.index.encode`)."""
        atoms = {}
        for path, atom in self.atoms.items():
            atoms[path] = atom.to_manifest()
            if atom.packed:
                atoms[path]["packed"] = [c.to_json() for c in self.packed[path]]
            elif self.objects is not None:
                atoms[path]["objects"] = [list(o) for o in self.objects[path]]
        ucp_attrs = {
            "format_version": self.format_version,
            "step": self.step,
            "layout": self.layout,
            "created_at": self.created_at,
            "writer": self.writer,
            "tree": self.tree,
            "atoms": atoms,
        }
        if self.packs:
            ucp_attrs["packs"] = {name: list(s) for name, s in self.packs.items()}
        return {"zarr_format": 3, "node_type": "group", "attributes": {"ucp": ucp_attrs}}

    @classmethod
    def from_group_json(cls, doc: Any, where: str) -> StepManifest:
        attrs = doc.get("attributes") if isinstance(doc, dict) else None
        attrs = attrs.get("ucp") if isinstance(attrs, dict) else None
        if not isinstance(attrs, dict):
            raise FormatError(f"{where} is not a ucp step (its zarr.json has no 'ucp' attributes)")
        version = attrs.get("format_version")
        check_format_version(version, where)
        major = int(str(version).split(".")[0])
        atoms_doc, tree = attrs.get("atoms"), attrs.get("tree")
        if not isinstance(atoms_doc, dict) or not isinstance(tree, dict):
            raise FormatError(f"{where}: the ucp manifest needs an 'atoms' object and a 'tree' object")
        for name in ("layout", "created_at", "writer"):
            if attrs.get(name) is not None and not isinstance(attrs[name], str):
                raise FormatError(f"{where}: {name} must be a string")
        atoms = {p: AtomMeta.from_manifest(p, a, crc_table=major >= 2) for p, a in atoms_doc.items()}
        if major < 3 and any(m.packed for m in atoms.values()):
            raise FormatError(f"{where}: format {version} has no packed atoms")
        objects = (
            {p: _object_sums(atoms[p], a.get("objects"), where) for p, a in atoms_doc.items() if not atoms[p].packed}
            if major >= 2
            else None
        )
        packs = _pack_sums(attrs.get("packs", {}), where)
        packed = _packed_chunks(atoms, {p: a["packed"] for p, a in atoms_doc.items() if atoms[p].packed}, packs, where)
        return cls(
            step=json_int(attrs.get("step"), where, "step"),
            tree=tree,
            atoms=atoms,
            layout=attrs.get("layout"),
            created_at=attrs.get("created_at") or "",
            writer=attrs.get("writer") or "",
            format_version=version,  # type: ignore[arg-type]
            objects=objects,
            packed=packed,
            packs=packs,
        )


def _object_sums(meta: AtomMeta, doc: object, where: str) -> list[ObjectSum]:
    """An atom's `objects` list: one [nbytes, crc32c] pair per chunk object (the grid's size was bounded first)."""
    count = math.prod(meta.grid)
    if not isinstance(doc, list) or len(doc) != count:
        raise FormatError(f"{where}: atom {meta.path!r:.200} must list {count} objects as [nbytes, crc32c] pairs")
    plain = None if meta.inner_chunk_shape is not None else meta.stored_chunk_bytes() + CRC_BYTES
    sums = []
    for entry in doc:
        if not isinstance(entry, list) or len(entry) != 2:
            raise FormatError(f"{where}: atom {meta.path!r:.200} has an object entry that is not [nbytes, crc32c]")
        nbytes = json_int(entry[0], where, "an object's nbytes", 0, MAX_OBJECT_BYTES + (1 << 24))
        if plain is not None and nbytes != plain:
            raise FormatError(
                f"{where}: atom {meta.path!r:.200} records an object of {nbytes} bytes; its chunks take {plain}"
            )
        sums.append((nbytes, json_int(entry[1], where, "an object's crc32c", 0, 2**32 - 1)))
    return sums


def _pack_sums(doc: object, where: str) -> dict[str, ObjectSum]:
    """The manifest's `packs`: {name: [nbytes, crc32c]} of each pack's one chunk object (data, then CRC-32C)."""
    if not isinstance(doc, dict):
        raise FormatError(f"{where}: packs must be an object of [nbytes, crc32c] pairs")
    sums = {}
    for name, entry in doc.items():
        if not is_pack_name(name) or not isinstance(entry, list) or len(entry) != 2:
            raise FormatError(f"{where}: pack entry {name!r:.100} is not a pack name with [nbytes, crc32c]")
        nbytes = json_int(entry[0], where, f"pack {name}'s nbytes", CRC_BYTES + 1, MAX_OBJECT_BYTES + CRC_BYTES)
        sums[name] = (nbytes, json_int(entry[1], where, f"pack {name}'s crc32c", 0, 2**32 - 1))
    return sums


def _packed_chunks(
    atoms: dict[str, AtomMeta], docs: dict[str, Any], packs: dict[str, ObjectSum], where: str
) -> dict[str, list[PackedChunk]]:
    """Each packed atom's chunks, checked: one per chunk of its grid, each in a listed pack, inside its data, on an
    element boundary, of the chunk's size, and no two overlapping, so that no read goes outside a pack."""
    out: dict[str, list[PackedChunk]] = {}
    spans: list[tuple[str, int, int, str]] = []
    for path, doc in docs.items():
        meta = atoms[path]
        single = meta.single_chunk  # (most packed atoms: one chunk, the whole atom)
        count = 1 if single else math.prod(meta.grid)
        if not isinstance(doc, list) or len(doc) != count:
            raise FormatError(f"{where}: packed atom {path!r:.200} must list {count} [pack, offset, nbytes, crc32c]")
        chunks = []
        for index, entry in zip([()] if single else chunk_indices(meta.grid), doc):
            if type(entry) is not list or len(entry) != 4 or type(entry[0]) is not str or entry[0] not in packs:
                raise FormatError(
                    f"{where}: packed atom {path!r:.200} has an entry {entry!r:.100} that is not "
                    "[a listed pack, offset, nbytes, crc32c]"
                )
            name, offset, nbytes, crc = entry
            data_bytes = packs[name][0] - CRC_BYTES
            if not (_small_int(offset) and _small_int(nbytes) and type(crc) is int and 0 <= crc < 2**32):
                json_int(offset, where, f"atom {path!r:.200}'s offset in {name}", 0, MAX_OBJECT_BYTES)
                json_int(nbytes, where, f"atom {path!r:.200}'s nbytes in {name}", 0, MAX_OBJECT_BYTES)
                json_int(crc, where, f"atom {path!r:.200}'s crc32c", 0, 2**32 - 1)
            expected = meta.nbytes if single else math.prod(b - a for a, b in meta.chunk_box(index)) * meta.itemsize
            if nbytes != expected:
                raise FormatError(
                    f"{where}: packed atom {path!r:.200} records {nbytes} bytes in {name} for a chunk of {expected}"
                )
            if offset + nbytes > data_bytes:
                raise FormatError(
                    f"{where}: packed atom {path!r:.200} lies at [{offset}, {offset + nbytes}) of {name}, outside its "
                    f"{data_bytes} bytes of data"
                )
            if offset % meta.itemsize:
                raise FormatError(
                    f"{where}: packed atom {path!r:.200} starts at offset {offset} of {name}, not on an element "
                    f"boundary of {meta.dtype} ({meta.itemsize} bytes)"
                )
            chunks.append(PackedChunk(name, offset, nbytes, crc))
            spans.append((name, offset, offset + nbytes, path))
        out[path] = chunks
    spans.sort()
    for (name, _, end, path), (other, start, _, other_path) in itertools.pairwise(spans):
        if name == other and start < end:
            raise FormatError(f"{where}: packed atoms {path!r:.200} and {other_path!r:.200} overlap in {name}")
    return out


def _small_int(value: object) -> bool:
    """A JSON integer within an object's bounds (the common case of json_int, without its error message)."""
    return type(value) is int and 0 <= value <= MAX_OBJECT_BYTES  # (type, not isinstance: a bool is no integer)


def group_json() -> dict[str, Any]:
    """Metadata of an intermediate group (a dict level of the state)."""
    return {"zarr_format": 3, "node_type": "group", "attributes": {}}
