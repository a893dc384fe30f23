"""The dataset manifest: which shards, in which order, with a content fingerprint of each.

Its hash identifies the dataset in a loader state. It covers each shard's name (not its full URL: a corpus
copied from tmpfs to S3 is the same dataset), sizes and the crc32 of its ``.idx``; so re-tokenizing, adding,
removing or reordering shards changes the hash, moving them does not.
"""

from __future__ import annotations

import hashlib
import json
import posixpath
from dataclasses import asdict, dataclass

from .errors import ManifestFormatError, ManifestMismatchError, ShardNotFoundError
from .fetch import IOStats
from .indexed import IndexInfo, parse_index

MANIFEST_NAME = "manifest.json"


@dataclass(frozen=True)
class ShardInfo:
    name: str  # the shard's prefix relative to its dataset directory (or its basename)
    url: str  # full prefix URL, without .bin/.idx; not part of the hash
    num_sequences: int
    num_documents: int
    num_tokens: int
    dtype: str
    idx_size: int
    idx_crc32: int

    def fingerprint(self) -> dict:
        d = asdict(self)
        del d["url"]
        return d

    @classmethod
    def from_index(cls, name: str, url: str, info: IndexInfo) -> ShardInfo:
        return cls(
            name=name,
            url=url,
            num_sequences=info.num_sequences,
            num_documents=info.num_documents,
            num_tokens=info.num_tokens,
            dtype=str(info.dtype),
            idx_size=info.idx_size,
            idx_crc32=info.idx_crc32,
        )


@dataclass(frozen=True)
class Manifest:
    shards: tuple[ShardInfo, ...]

    @property
    def hash(self) -> str:
        blob = json.dumps([s.fingerprint() for s in self.shards], sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(blob.encode()).hexdigest()[:32]

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.shards)

    def to_json(self) -> dict:
        return {"version": 1, "hash": self.hash, "shards": [s.fingerprint() for s in self.shards]}


def _strip_suffix(url: str) -> str:
    for suffix in (".idx", ".bin"):
        if url.endswith(suffix):
            return url[: -len(suffix)]
    return url


def resolve_shards(fs, sources: list[str], stats: IOStats | None = None) -> list[tuple[str, str, dict | None]]:
    """Expand sources (paths within ``fs``) into ``(name, prefix_path, recorded_fingerprint)`` in dataset order.

    A source is a shard prefix (``foo`` for ``foo.bin``/``foo.idx``, the suffix may be given), or a directory:
    with a ``manifest.json`` (written by ``prepare``) its shard order is used, else its ``*.idx`` sorted by name.
    """
    stats = stats if stats is not None else IOStats()
    out: list[tuple[str, str, dict | None]] = []
    for src in sources:
        src = _strip_suffix(src.rstrip("/"))
        stats.metadata()
        if fs.exists(src + ".idx"):
            out.append((posixpath.basename(src), src, None))
            continue
        man_path = posixpath.join(src, MANIFEST_NAME)
        stats.metadata()
        if fs.exists(man_path):
            raw = fs.cat_file(man_path)
            stats.add(man_path, 0, len(raw), index=True)
            out.extend((rec["name"], posixpath.join(src, rec["name"]), rec) for rec in _shard_records(raw, man_path))
            continue
        stats.metadata()
        if fs.isdir(src):
            stats.metadata()
            idxs = sorted(p for p in fs.ls(src, detail=False) if p.endswith(".idx"))
            if not idxs:
                raise ShardNotFoundError(f"no .idx shards in directory {src}")
            out.extend((posixpath.basename(p)[:-4], p[:-4], None) for p in idxs)
            continue
        raise ShardNotFoundError(f"shard {src}.idx not found (nor a dataset directory {src})")
    return out


def _shard_records(raw: bytes, where: str) -> list[dict]:
    """The shard records of a dataset's manifest.json, each naming a shard inside the dataset's directory."""
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError) as e:  # (UnicodeDecodeError is a ValueError)
        raise ManifestFormatError(f"{where} is not JSON (damaged or cut short?): {str(e)[:200]}") from None
    records = doc.get("shards") if isinstance(doc, dict) else None
    if not isinstance(records, list) or not all(isinstance(r, dict) for r in records):
        raise ManifestFormatError(f"{where}: not a dataset manifest (no list of shard records under 'shards')")
    for rec in records:
        name = rec.get("name")
        if not isinstance(name, str) or not name or name.startswith("/") or ".." in name.split("/"):
            raise ManifestFormatError(f"{where}: a shard record names {name!r:.80}, not a shard of this dataset")
    return records


def _read_all(fs, paths: list[str]) -> dict[str, bytes | Exception]:
    """Each path's bytes, or the error reading it: together where fsspec can (`cat` of a list, concurrent on remote
    stores), but a path with a glob character fsspec would expand (`run[1]` matches only `run1`) on its own."""
    magic = [p for p in paths if any(c in p for c in "*?[")]
    plain = [p for p in paths if p not in set(magic)]
    datas = fs.cat(plain, on_error="return") if plain else {}
    datas = dict(datas) if isinstance(datas, dict) else {plain[0]: datas}
    for path in magic:
        try:
            datas[path] = fs.cat_file(path)
        except Exception as e:  # noqa: BLE001 -- as `cat`'s on_error="return" gives it
            datas[path] = e
    return datas


def build_manifest(
    fs, sources: list[str], url_of=lambda p: p, stats: IOStats | None = None
) -> tuple[Manifest, list[IndexInfo]]:
    """Read every shard's ``.idx`` (concurrently on remote stores) and build the manifest; ``stats`` counts the
    reads (``.idx`` files and ``manifest.json`` as index bytes)."""
    stats = stats if stats is not None else IOStats()
    resolved = resolve_shards(fs, sources, stats)
    datas = _read_all(fs, [p + ".idx" for _, p, _ in resolved])
    infos, shards = [], []
    for name, prefix, recorded in resolved:
        path = prefix + ".idx"
        data = datas.get(path)
        if data is None:  # some filesystems normalise keys; fall back to a direct read
            data = fs.cat_file(path)
        if isinstance(data, FileNotFoundError):
            raise ShardNotFoundError(f"shard index {url_of(path)} not found")
        if isinstance(data, Exception):
            raise data
        stats.add(path, 0, len(data), index=True)
        info = parse_index(data, url_of(path))
        shard = ShardInfo.from_index(name, url_of(prefix), info)
        if recorded is not None and recorded != shard.fingerprint():
            raise ManifestMismatchError(
                f"shard {url_of(prefix)} changed since its manifest was written: "
                f"recorded {recorded}, found {shard.fingerprint()}"
            )
        infos.append(info)
        shards.append(shard)
    return Manifest(tuple(shards)), infos
