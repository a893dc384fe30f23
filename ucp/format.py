"""What is on disk: names, the metadata documents, and the state tree (docs/FORMAT.md is the spec).

A checkpoint root holds one directory per step. A step is a Zarr v3 group whose `zarr.json` carries the
ucp manifest (format version, step, layout, the state tree, every atom's description); each atom is a Zarr
v3 array below it; the step's commit marker is written last.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

from . import dtypes
from .errors import FormatError, UnsupportedVersionError

FORMAT_VERSION = "1.0"
FORMAT_MAJOR = 1
ZARR_JSON = "zarr.json"
COMMIT_MARKER = "ucp-commit.json"
CRC_BYTES = 4  # the crc32c codec appends a 4-byte little-endian checksum
INDEX_ENTRY_BYTES = 16  # sharding index: (offset, nbytes) as two little-endian uint64
EMPTY_INDEX_ENTRY = 2**64 - 1

_STEP_DIR = re.compile(r"^step_(\d{8,})$")
# Names a state key may not take: they would collide with Zarr's or ucp's own files.
RESERVED_NAMES = frozenset({ZARR_JSON, COMMIT_MARKER})


def step_dirname(step: int) -> str:
    return f"step_{step:08d}"


def parse_step_dirname(name: str) -> int | None:
    m = _STEP_DIR.match(name)
    return int(m.group(1)) if m else None


def check_format_version(version: object, where: str) -> None:
    """Refuse a newer major version (or a malformed one) with a clear error."""
    if not isinstance(version, str) or not re.fullmatch(r"\d+\.\d+", version):
        raise FormatError(f"{where}: format_version {version!r} is not of the form MAJOR.MINOR")
    major = int(version.split(".")[0])
    if major > FORMAT_MAJOR:
        raise UnsupportedVersionError(
            f"{where} was written in UCP format {version}; this ucp reads major version {FORMAT_MAJOR} "
            "and older. Upgrade ucp to read it."
        )


def dumps(doc: Any) -> bytes:
    """Strict JSON (no NaN/Infinity), so that every Zarr reader can parse what ucp writes."""
    return json.dumps(doc, allow_nan=False, separators=(",", ":")).encode()  # compact: the C encoder


def loads(data: bytes, where: str) -> Any:
    try:
        return json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise FormatError(f"{where} is not valid JSON ({e})") from None


# ---------------------------------------------------------------------------------------------- atoms


@dataclass(frozen=True)
class AtomMeta:
    """One atom: a Zarr v3 array holding one full logical tensor.

    `chunk_shape` is the regular grid of stored objects (one writer each). With `inner_chunk_shape`, each
    object is a shard (`sharding_indexed` codec) of inner chunks that can be read one by one.
    """

    path: str
    shape: tuple[int, ...]
    dtype: str
    chunk_shape: tuple[int, ...]
    inner_chunk_shape: tuple[int, ...] | None = None
    attributes: dict[str, Any] = field(default_factory=dict, compare=False)

    @property
    def itemsize(self) -> int:
        return dtypes.itemsize(self.dtype)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.itemsize

    @property
    def grid(self) -> tuple[int, ...]:
        """Number of chunks (objects) along each dimension."""
        return tuple(-(-s // c) for s, c in zip(self.shape, self.chunk_shape))

    @property
    def inner_grid(self) -> tuple[int, ...]:
        """Inner chunks per shard along each dimension (all ones when not sharded)."""
        if self.inner_chunk_shape is None:
            return tuple(1 for _ in self.shape)
        return tuple(c // i for c, i in zip(self.chunk_shape, self.inner_chunk_shape))

    def to_manifest(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"shape": list(self.shape), "dtype": self.dtype, "chunk_shape": list(self.chunk_shape)}
        if self.inner_chunk_shape is not None:
            doc["inner_chunk_shape"] = list(self.inner_chunk_shape)
        doc["attributes"] = self.attributes
        return doc

    @classmethod
    def from_manifest(cls, path: str, doc: Any) -> AtomMeta:
        where = f"manifest entry of atom {path!r}"
        try:
            shape = tuple(int(s) for s in doc["shape"])
            chunk_shape = tuple(int(c) for c in doc["chunk_shape"])
            inner = doc.get("inner_chunk_shape")
            inner_shape = None if inner is None else tuple(int(c) for c in inner)
            meta = cls(path, shape, str(doc["dtype"]), chunk_shape, inner_shape, dict(doc.get("attributes", {})))
        except (KeyError, TypeError, ValueError) as e:
            raise FormatError(f"{where} is malformed ({e!r})") from None
        meta.validate()
        return meta

    def validate(self) -> None:
        where = f"atom {self.path!r}"
        dtypes.torch_dtype(self.dtype)
        if len(self.chunk_shape) != len(self.shape) or any(s < 0 for s in self.shape):
            raise FormatError(f"{where}: chunk_shape {list(self.chunk_shape)} does not fit shape {list(self.shape)}")
        if any(c < 1 for c in self.chunk_shape):
            raise FormatError(f"{where}: chunk_shape {list(self.chunk_shape)} has a non-positive extent")
        if self.inner_chunk_shape is not None:
            inner = self.inner_chunk_shape
            if len(inner) != len(self.shape) or any(i < 1 or c % i for c, i in zip(self.chunk_shape, inner)):
                raise FormatError(f"{where}: inner_chunk_shape {list(inner)} does not divide {list(self.chunk_shape)}")

    def zarr_json(self) -> dict[str, Any]:
        """The array's Zarr v3 metadata document."""
        chunk_codecs: list[dict[str, Any]] = [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c"}]
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
        for key in ("node_type", "shape", "data_type", "chunk_grid", "chunk_key_encoding", "codecs"):
            if doc.get(key) != expected[key]:
                raise FormatError(
                    f"atom {self.path!r}: zarr.json says {key} = {json.dumps(doc.get(key))}, but the committed "
                    f"manifest says {json.dumps(expected[key])} (the metadata was edited after the save)"
                )

    def chunk_key(self, index: tuple[int, ...]) -> str:
        """Object key of the chunk at grid position `index`, relative to the atom's directory."""
        return ".".join(["c", *map(str, index)])

    def chunk_box(self, index: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
        """The region [start, stop) per dimension of the array that chunk `index` holds (clipped at the edge)."""
        return tuple((i * c, min((i + 1) * c, s)) for i, c, s in zip(index, self.chunk_shape, self.shape))

    def stored_chunk_bytes(self) -> int:
        """Bytes of data in one stored (unsharded or inner) chunk, padding included."""
        shape = self.inner_chunk_shape or self.chunk_shape
        return math.prod(shape) * self.itemsize


def chunk_indices(grid: tuple[int, ...]) -> list[tuple[int, ...]]:
    """All positions of a grid in C order (one empty position for a 0-d grid; none if any extent is 0)."""
    out: list[tuple[int, ...]] = [()]
    for n in grid:
        out = [(*prefix, i) for prefix in out for i in range(n)]
    return out


# ------------------------------------------------------------------------------------------ step manifest


@dataclass
class StepManifest:
    """The ucp attributes of a step's root group."""

    step: int
    tree: dict[str, Any]
    atoms: dict[str, AtomMeta]
    layout: str | None = None
    created_at: str = ""
    writer: str = ""
    format_version: str = FORMAT_VERSION

    def to_group_json(self) -> dict[str, Any]:
        ucp_attrs = {
            "format_version": self.format_version,
            "step": self.step,
            "layout": self.layout,
            "created_at": self.created_at,
            "writer": self.writer,
            "tree": self.tree,
            "atoms": {path: atom.to_manifest() for path, atom in self.atoms.items()},
        }
        return {"zarr_format": 3, "node_type": "group", "attributes": {"ucp": ucp_attrs}}

    @classmethod
    def from_group_json(cls, doc: Any, where: str) -> StepManifest:
        try:
            attrs = doc["attributes"]["ucp"]
        except (KeyError, TypeError):
            raise FormatError(f"{where} is not a ucp step (its zarr.json has no 'ucp' attributes)") from None
        check_format_version(attrs.get("format_version"), where)
        try:
            atoms = {p: AtomMeta.from_manifest(p, a) for p, a in attrs["atoms"].items()}
            return cls(
                step=int(attrs["step"]),
                tree=attrs["tree"],
                atoms=atoms,
                layout=attrs.get("layout"),
                created_at=attrs.get("created_at", ""),
                writer=attrs.get("writer", ""),
                format_version=attrs["format_version"],
            )
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise FormatError(f"{where}: the ucp manifest is malformed ({e!r})") from None


def group_json() -> dict[str, Any]:
    """Metadata of an intermediate group (a dict level of the state)."""
    return {"zarr_format": 3, "node_type": "group", "attributes": {}}
