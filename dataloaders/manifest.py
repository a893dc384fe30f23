"""The dataset manifest: which shards, in which order, with a content fingerprint of each.

Its hash identifies the dataset in a loader state. It covers each shard's name (not its full URL: a corpus
copied from tmpfs to S3 is the same dataset), sizes and the crc32 of its ``.idx``, and (manifests of version 2,
which ``prepare`` writes) the CRC-32C of its ``.bin`` and the tokenizer's identity; so re-tokenizing, editing,
adding, removing or reordering shards changes the hash, moving them does not. The ``.bin`` CRC is the one
``prepare`` recorded (reading the whole corpus at every start would cost what an epoch does):
:meth:`~dataloaders.corpus.Corpus.verify` checks the data against it. A version 1 manifest (written before) and
shards opened without a manifest hash as they always did, from the ``.idx`` alone. Version 2 keeps the shard
records of version 1 and lists the CRCs beside them (``"bin_crc32c": [...]``, one per shard), so that code older
than it still reads it (as a version 1 manifest).
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
# 2: a list of the CRC-32C of each shard's .bin beside the shard records (``bin_crc32c``), and the hash covers
# them and the tokenizer's identity
MANIFEST_VERSION = 2


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
    bin_crc32c: int | None = None  # recorded by prepare (manifest version 2); None: unknown. Not in the record
    tokenizer: str | None = None  # the identity of the tokenizer that made it (version 2); not in the record

    def fingerprint(self) -> dict:
        """The shard's record in ``manifest.json`` (the same in both versions)."""
        d = asdict(self)
        del d["url"], d["bin_crc32c"], d["tokenizer"]
        return d

    def hashed(self) -> dict:
        """What the manifest hash covers of this shard: its record, and where they are known (version 2) its
        ``.bin`` CRC and the tokenizer. (Where not, the hash is the one of a version 1 manifest, as it was.)"""
        d = self.fingerprint()
        if self.bin_crc32c is not None:
            d["bin_crc32c"] = self.bin_crc32c
        if self.tokenizer is not None:
            d["tokenizer"] = self.tokenizer
        return d

    @classmethod
    def from_index(
        cls, name: str, url: str, info: IndexInfo, bin_crc32c: int | None = None, tokenizer: str | None = None
    ) -> ShardInfo:
        return cls(
            name=name,
            url=url,
            num_sequences=info.num_sequences,
            num_documents=info.num_documents,
            num_tokens=info.num_tokens,
            dtype=str(info.dtype),
            idx_size=info.idx_size,
            idx_crc32=info.idx_crc32,
            bin_crc32c=bin_crc32c,
            tokenizer=tokenizer,
        )


@dataclass(frozen=True)
class Manifest:
    shards: tuple[ShardInfo, ...]

    @property
    def hash(self) -> str:
        blob = json.dumps([s.hashed() for s in self.shards], sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(blob.encode()).hexdigest()[:32]

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.shards)

    def to_json(self) -> dict:
        doc = {"version": 1, "hash": self.hash, "shards": [s.fingerprint() for s in self.shards]}
        if all(s.bin_crc32c is not None for s in self.shards):
            doc["version"], doc["bin_crc32c"] = MANIFEST_VERSION, [s.bin_crc32c for s in self.shards]
        return doc


def _strip_suffix(url: str) -> str:
    for suffix in (".idx", ".bin"):
        if url.endswith(suffix):
            return url[: -len(suffix)]
    return url


def resolve_shards(
    fs, sources: list[str], stats: IOStats | None = None
) -> list[tuple[str, str, dict | None, int | None, str | None]]:
    """Expand sources (paths within ``fs``) into ``(name, prefix_path, recorded_fingerprint, .bin CRC-32C,
    tokenizer identity)`` in dataset order (the last two from a version 2 manifest, else None).

    A source is a shard prefix (``foo`` for ``foo.bin``/``foo.idx``, the suffix may be given), or a directory:
    with a ``manifest.json`` (written by ``prepare``) its shard order is used, else its ``*.idx`` sorted by name.
    """
    stats = stats if stats is not None else IOStats()
    out: list[tuple[str, str, dict | None, int | None, str | None]] = []
    for src in sources:
        src = _strip_suffix(src.rstrip("/"))
        stats.metadata()
        if fs.exists(src + ".idx"):
            out.append((posixpath.basename(src), src, None, None, None))
            continue
        man_path = posixpath.join(src, MANIFEST_NAME)
        stats.metadata()
        if fs.exists(man_path):
            try:
                raw = fs.cat_file(man_path)
            except (IsADirectoryError, NotADirectoryError, FileNotFoundError) as e:  # (a directory on object stores)
                raise ManifestFormatError(f"{man_path} is not a file (a directory?): {e}") from None
            stats.add(man_path, 0, len(raw), index=True)
            records, crcs, tokenizer = shard_records(raw, man_path)
            for rec, crc in zip(records, crcs or [None] * len(records), strict=True):
                out.append((rec["name"], posixpath.join(src, rec["name"]), rec, crc, tokenizer))
            continue
        stats.metadata()
        if fs.isdir(src):
            stats.metadata()
            idxs = sorted(p for p in fs.ls(src, detail=False) if p.endswith(".idx"))
            if not idxs:
                raise ShardNotFoundError(f"no .idx shards in directory {src}")
            out.extend((posixpath.basename(p)[:-4], p[:-4], None, None, None) for p in idxs)
            continue
        raise ShardNotFoundError(f"shard {src}.idx not found (nor a dataset directory {src})")
    return out


def shard_records(raw: bytes, where: str) -> tuple[list[dict], list[int] | None, str | None]:
    """The shard records of a dataset's manifest.json, each naming a shard inside the dataset's directory, then
    (version 2; None for a version 1 manifest, whose hash leaves them out) the CRC-32C of each shard's ``.bin`` and
    the identity of the tokenizer that made them."""
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError) as e:  # (UnicodeDecodeError is a ValueError)
        raise ManifestFormatError(f"{where} is not JSON (damaged or cut short?): {str(e)[:200]}") from None
    records = doc.get("shards") if isinstance(doc, dict) else None
    if not isinstance(records, list) or not all(isinstance(r, dict) for r in records):
        raise ManifestFormatError(f"{where}: not a dataset manifest (no list of shard records under 'shards')")
    if not records:
        raise ManifestFormatError(f"{where}: names no shard (an empty dataset)")
    version = doc.get("version", 1)
    if type(version) is not int or not 1 <= version <= MANIFEST_VERSION:
        raise ManifestFormatError(
            f"{where}: manifest version {version!r:.40}, this reader knows 1 to {MANIFEST_VERSION}"
        )
    for rec in records:
        name = rec.get("name")
        if (
            not isinstance(name, str) or not name or name.startswith("/") or ".." in name.split("/")
            or "\x00" in name
        ):  # fmt: skip
            raise ManifestFormatError(f"{where}: a shard record names {name!r:.80}, not a shard of this dataset")
    if version < 2:
        return records, None, None
    crcs = doc.get("bin_crc32c")
    if not isinstance(crcs, list) or len(crcs) != len(records):
        raise ManifestFormatError(f"{where}: bin_crc32c is {crcs!r:.60}, expected a list of {len(records)} CRC-32C")
    for rec, crc in zip(records, crcs, strict=True):
        if type(crc) is not int or not 0 <= crc < 1 << 32:
            raise ManifestFormatError(f"{where}: shard {rec['name']!r:.80} has bin_crc32c {crc!r:.40}, not a CRC-32C")
    tok = doc.get("tokenizer")
    identity = tok.get("identity") if isinstance(tok, dict) else None
    if not isinstance(identity, str):
        raise ManifestFormatError(f"{where}: no tokenizer identity (a string under 'tokenizer': 'identity')")
    return records, crcs, identity


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
    datas = _read_all(fs, [p + ".idx" for _, p, *_ in resolved])
    infos, shards = [], []
    for name, prefix, recorded, crc, tokenizer in resolved:
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
        shard = ShardInfo.from_index(name, url_of(prefix), info, crc, tokenizer)
        if recorded is not None and recorded != shard.fingerprint():
            raise ManifestMismatchError(
                f"shard {url_of(prefix)} changed since its manifest was written: "
                f"recorded {recorded}, found {shard.fingerprint()}"
            )
        infos.append(info)
        shards.append(shard)
    return Manifest(tuple(shards)), infos
