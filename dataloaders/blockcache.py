"""Ranged reads of shard files through a bounded LRU cache of aligned blocks.

Object stores pay per request, local files per syscall: reading aligned blocks and keeping the recent ones
amortises both, while the cache bound keeps memory flat however large the corpus. Files are never
``open()``-ed, because s3fs would then pull 50 MiB of readahead per seek; every byte comes from
``cat_ranges`` and is counted in :class:`IOStats`, so tests and benchmarks can check what was read.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass, field

import fsspec

from .errors import IndexFormatError, ShardNotFoundError

DEFAULT_BLOCK_SIZE = 1 << 20
DEFAULT_CACHE_BYTES = 256 << 20


@dataclass
class IOStats:
    """Counters of the bytes and requests that actually went to storage (cache hits excluded)."""

    bytes_read: int = 0
    requests: int = 0
    cache_hits: int = 0
    ranges: list[tuple[str, int, int]] = field(default_factory=list)  # kept only when ``record_ranges``
    record_ranges: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, path: str, start: int, end: int) -> None:
        with self._lock:
            self.bytes_read += end - start
            self.requests += 1
            if self.record_ranges:
                self.ranges.append((path, start, end))

    def hit(self, n: int = 1) -> None:
        with self._lock:
            self.cache_hits += n


def filesystem(url: str, storage_options: dict | None = None) -> tuple[fsspec.AbstractFileSystem, str]:
    """The fsspec filesystem of ``url`` and the path within it."""
    fs, path = fsspec.core.url_to_fs(url, **(storage_options or {}))
    return fs, path


class BlockCache:
    """A thread-safe LRU cache of ``block_size``-aligned blocks of several files, bounded by ``capacity_bytes``.

    Missing blocks of one request are fetched with a single ``cat_ranges`` call (concurrent for remote stores);
    a block that another thread is already fetching is waited for, not fetched twice.
    """

    def __init__(
        self,
        fs: fsspec.AbstractFileSystem,
        block_size: int = DEFAULT_BLOCK_SIZE,
        capacity_bytes: int = DEFAULT_CACHE_BYTES,
        stats: IOStats | None = None,
    ) -> None:
        if block_size < 0:
            raise ValueError(f"block_size must be positive (or 0: exact ranges, no cache), got {block_size}")
        self.fs = fs
        self.block_size = block_size
        # At least one block must fit; a bound below one block would thrash on every read.
        self.capacity_bytes = max(capacity_bytes, block_size)
        self.stats = stats if stats is not None else IOStats()
        self._blocks: OrderedDict[tuple[str, int], bytes] = OrderedDict()
        self._size = 0
        self._inflight: dict[tuple[str, int], Future] = {}
        self._lock = threading.Lock()

    def read_many(self, requests: list[tuple[str, int, int, int]]) -> list[bytes]:
        """Read byte ranges ``(path, start, end, file_size)``; returns the bytes of each, in order."""
        bs = self.block_size
        needed: dict[tuple[str, int], int] = {}  # block key -> file size, in first-seen order
        for path, start, end, size in requests:
            if start < 0 or end > size or start > end:
                raise ValueError(f"range [{start}, {end}) outside {path} of {size} bytes")
        if bs == 0:
            return self._read_exact(requests)
        for path, start, end, size in requests:
            if end > start:
                for b in range(start // bs, (end - 1) // bs + 1):
                    needed.setdefault((path, b), size)
        have: dict[tuple[str, int], bytes] = {}
        waiting: dict[tuple[str, int], Future] = {}  # blocks another thread is fetching right now
        mine: dict[tuple[str, int], Future] = {}
        with self._lock:
            for key in needed:
                blk = self._blocks.get(key)
                if blk is not None:
                    self._blocks.move_to_end(key)
                    have[key] = blk
                elif key in self._inflight:
                    waiting[key] = self._inflight[key]
                else:
                    mine[key] = self._inflight[key] = Future()
        if have or waiting:
            self.stats.hit(len(have) + len(waiting))
        if mine:
            try:
                self._fetch(list(mine), needed, have)
            except BaseException as e:
                with self._lock:
                    for key, fut in mine.items():
                        del self._inflight[key]
                        fut.set_exception(e)
                raise
            with self._lock:
                for key, fut in mine.items():
                    del self._inflight[key]
                    fut.set_result(have[key])
                    if key not in self._blocks:
                        self._blocks[key] = have[key]
                        self._size += len(have[key])
                while self._size > self.capacity_bytes and self._blocks:
                    _, old = self._blocks.popitem(last=False)
                    self._size -= len(old)
        for key, fut in waiting.items():
            have[key] = fut.result()
        out = []
        for path, start, end, _ in requests:
            if end == start:
                out.append(b"")
                continue
            first, last = start // bs, (end - 1) // bs
            if first == last:
                blk = have[(path, first)]
                out.append(blk[start - first * bs : end - first * bs])
            else:
                parts = [have[(path, b)] for b in range(first, last + 1)]
                joined = b"".join(parts)
                out.append(joined[start - first * bs : end - first * bs])
        return out

    def _fetch(self, keys: list[tuple[str, int]], sizes: dict, into: dict) -> None:
        bs = self.block_size
        paths = [p for p, _ in keys]
        starts = [b * bs for _, b in keys]
        ends = [min((b + 1) * bs, sizes[(p, b)]) for p, b in keys]
        try:
            datas = self.fs.cat_ranges(paths, starts, ends, on_error="raise")
        except FileNotFoundError as e:
            raise ShardNotFoundError(f"shard data vanished while reading: {e}") from e
        for (p, b), s, e, data in zip(keys, starts, ends, datas, strict=True):
            if isinstance(data, Exception):
                raise data
            if len(data) != e - s:
                raise IndexFormatError(f"{p}: short read at offset {s}: expected {e - s} bytes, got {len(data)}")
            self.stats.add(p, s, e)
            into[(p, b)] = data

    def _read_exact(self, requests: list[tuple[str, int, int, int]]) -> list[bytes]:
        """``block_size=0``: fetch exactly the requested ranges, uncached (random samples over a corpus far
        larger than any cache would otherwise pull a whole block per sample)."""
        todo = [(p, s, e) for p, s, e, _ in requests if e > s]
        try:
            datas = self.fs.cat_ranges([p for p, _, _ in todo], [s for _, s, _ in todo], [e for _, _, e in todo])
        except FileNotFoundError as e:
            raise ShardNotFoundError(f"shard data vanished while reading: {e}") from e
        got = iter(datas)
        out = []
        for p, s, e, _ in requests:
            if e == s:
                out.append(b"")
                continue
            data = next(got)
            if isinstance(data, Exception):
                raise data
            if len(data) != e - s:
                raise IndexFormatError(f"{p}: short read at offset {s}: expected {e - s} bytes, got {len(data)}")
            self.stats.add(p, s, e)
            out.append(data)
        return out

    def read(self, path: str, start: int, end: int, size: int) -> bytes:
        return self.read_many([(path, start, end, size)])[0]

    @property
    def cached_bytes(self) -> int:
        return self._size
