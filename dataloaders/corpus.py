"""A corpus: the shards of a manifest read as one concatenated token stream through one block cache."""

from __future__ import annotations

from dataclasses import dataclass

import crc32c
import numpy as np

from .blockcache import DEFAULT_BLOCK_SIZE, DEFAULT_CACHE_BYTES, BlockCache
from .diskcache import DiskCache
from .errors import DataLoaderError, ManifestMismatchError
from .fetch import Fetcher, IOStats, filesystem
from .indexed import IndexedDataset
from .manifest import Manifest, build_manifest


@dataclass
class Corpus:
    manifest: Manifest
    shards: list[IndexedDataset]
    cache: BlockCache
    offsets: np.ndarray  # int64 [n_shards + 1]: the stream offset where each shard starts

    @property
    def num_tokens(self) -> int:
        return int(self.offsets[-1])

    @property
    def stats(self) -> IOStats:
        return self.cache.stats

    @property
    def fetcher(self) -> Fetcher:
        return self.cache.fetcher

    @property
    def dtype(self) -> np.dtype:
        """The token dtype of every shard (int64 if they differ)."""
        dtypes = {s.dtype for s in self.shards}
        return dtypes.pop() if len(dtypes) == 1 else np.dtype(np.int64)

    def read(
        self, ranges: list[tuple[int, int]], exact: bool = False, dtype: np.dtype | type = np.int64
    ) -> list[np.ndarray]:
        """Tokens ``[start, end)`` of the stream for each range, as ``dtype``; all fetched in one call: through
        the block cache, or (``exact``) as exactly these byte ranges, through the disk cache when there is one."""
        requests, pieces = [], []  # pieces[i] = number of requests of range i
        for start, end in ranges:
            if not 0 <= start <= end <= self.num_tokens:
                raise IndexError(f"token range [{start}, {end}) outside a stream of {self.num_tokens} tokens")
            first = int(np.searchsorted(self.offsets, start, side="right")) - 1
            n = 0
            pos = start
            s = first
            while pos < end:
                while self.offsets[s + 1] <= pos:  # skip empty shards
                    s += 1
                stop = min(end, int(self.offsets[s + 1]))
                base = int(self.offsets[s])
                requests.append((s, pos - base, stop - base))
                n += 1
                pos = stop
            pieces.append(n)
        byte_ranges = [self.shards[s].range_request(a, b) for s, a, b in requests]
        if exact:
            datas = self.fetcher.read([(p, a, b) for p, a, b, _ in byte_ranges])
        else:
            datas = self.cache.read_many(byte_ranges)
        out, k = [], 0
        for n in pieces:
            parts = [
                np.frombuffer(datas[k + j], dtype=self.shards[requests[k + j][0]].dtype.newbyteorder("<"))
                for j in range(n)
            ]
            out.append(np.concatenate(parts).astype(dtype) if parts else np.zeros(0, dtype=dtype))
            k += n
        return out

    def verify(self, chunk_bytes: int = 64 << 20) -> int:
        """Read every ``.bin`` whose CRC-32C the manifest recorded (``prepare`` does) and check it: a shard whose
        data changed since is a :class:`ManifestMismatchError` naming it. Returns how many shards were checked
        (shards opened without a version 2 manifest have no CRC to check)."""
        checked = 0
        for info, shard in zip(self.manifest.shards, self.shards, strict=True):
            if info.bin_crc32c is None:
                continue
            crc = 0
            for start in range(0, shard.bin_size, chunk_bytes):
                end = min(shard.bin_size, start + chunk_bytes)
                crc = crc32c.crc32c(self.fetcher.read([(shard.bin_path, start, end)], cache=False)[0], crc)
            if crc != info.bin_crc32c:
                raise ManifestMismatchError(
                    f"shard {shard.name}.bin changed since its manifest was written: CRC-32C {crc:08x}, "
                    f"recorded {info.bin_crc32c:08x}"
                )
            checked += 1
        return checked


def open_corpus(
    sources: str | list[str],
    storage_options: dict | None = None,
    block_size: int = DEFAULT_BLOCK_SIZE,
    cache_bytes: int = DEFAULT_CACHE_BYTES,
    stats: IOStats | None = None,
    disk_cache: DiskCache | None = None,
) -> Corpus:
    """Open shards (prefix URLs or dataset directories, all on one filesystem) as one stream; ``stats`` counts
    every read, the ``.idx`` files' included."""
    urls = [sources] if isinstance(sources, str) else list(sources)
    if not urls:
        raise DataLoaderError("no shard sources given")
    fs, first = filesystem(urls[0], storage_options)
    paths = [first]
    for u in urls[1:]:
        other, p = filesystem(u, storage_options)
        if other.protocol != fs.protocol:
            raise DataLoaderError(f"shards must share one filesystem: {urls[0]} and {u}")
        paths.append(p)
    fetcher = Fetcher(fs, stats, disk_cache)
    manifest, infos = build_manifest(fs, paths, url_of=fs.unstrip_protocol, stats=fetcher.stats)
    cache = BlockCache(fs, block_size=block_size, capacity_bytes=cache_bytes, fetcher=fetcher)
    shards = [
        IndexedDataset(fs._strip_protocol(s.url), cache, index=info, name=s.url)
        for s, info in zip(manifest.shards, infos, strict=True)
    ]
    offsets = np.zeros(len(shards) + 1, dtype=np.int64)
    np.cumsum([s.num_tokens for s in shards], out=offsets[1:])
    return Corpus(manifest, shards, cache, offsets)
