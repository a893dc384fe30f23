"""Bounded in-memory caches: a generic LRU of byte-sized values, and the block cache of ranged shard reads.

Object stores pay per request, local files per syscall: reading aligned blocks (or, in the windowed order,
whole windows) and keeping the recent ones amortises both, while the bound keeps memory flat however large the
corpus. A key that another thread is already fetching is waited for, not fetched twice.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable
from concurrent.futures import Future
from typing import Any

import fsspec

from .fetch import Fetcher, IOStats

DEFAULT_BLOCK_SIZE = 1 << 20
DEFAULT_CACHE_BYTES = 256 << 20


def _nbytes(value: Any) -> int:
    return memoryview(value).nbytes


class MemoryCache:
    """A thread-safe LRU of values (bytes or numpy arrays) bounded by their total size in bytes.

    ``get_many(keys, fetch)`` returns every key's value; the missing ones are fetched with one call of ``fetch``
    (which returns them in order), while keys that another thread is fetching are waited for.
    """

    def __init__(self, capacity_bytes: int, stats: IOStats) -> None:
        self.capacity_bytes = capacity_bytes
        self.stats = stats
        self._values: OrderedDict[Hashable, Any] = OrderedDict()
        self._size = 0
        self._inflight: dict[Hashable, Future] = {}
        self._lock = threading.Lock()

    def get_many(self, keys: Iterable[Hashable], fetch: Callable[[list[Hashable]], list[Any]]) -> dict[Hashable, Any]:
        have: dict[Hashable, Any] = {}
        waiting: dict[Hashable, Future] = {}  # keys another thread is fetching right now
        mine: dict[Hashable, Future] = {}
        with self._lock:
            for key in dict.fromkeys(keys):
                value = self._values.get(key)
                if value is not None:
                    self._values.move_to_end(key)
                    have[key] = value
                elif key in self._inflight:
                    waiting[key] = self._inflight[key]
                else:
                    mine[key] = self._inflight[key] = Future()
        if have or waiting:
            self.stats.hit(len(have) + len(waiting))
        if mine:
            try:
                got = fetch(list(mine))
            except BaseException as e:
                with self._lock:
                    for key, fut in mine.items():
                        del self._inflight[key]
                        fut.set_exception(e)
                raise
            with self._lock:
                for (key, fut), value in zip(mine.items(), got, strict=True):
                    del self._inflight[key]
                    fut.set_result(value)
                    have[key] = value
                    if key not in self._values:
                        self._values[key] = value
                        self._size += _nbytes(value)
                while self._size > self.capacity_bytes and self._values:
                    _, old = self._values.popitem(last=False)
                    self._size -= _nbytes(old)
        for key, fut in waiting.items():
            have[key] = fut.result()
        return have

    @property
    def cached_bytes(self) -> int:
        return self._size


class BlockCache:
    """``block_size``-aligned blocks of several files in a :class:`MemoryCache` bounded by ``capacity_bytes``.

    Missing blocks of one request are fetched with a single :class:`~dataloaders.fetch.Fetcher` call (concurrent
    for remote stores, through the node's disk cache when there is one). ``block_size=0`` reads exactly the
    ranges asked for, uncached.
    """

    def __init__(
        self,
        fs: fsspec.AbstractFileSystem,
        block_size: int = DEFAULT_BLOCK_SIZE,
        capacity_bytes: int = DEFAULT_CACHE_BYTES,
        stats: IOStats | None = None,
        fetcher: Fetcher | None = None,
    ) -> None:
        if block_size < 0:
            raise ValueError(f"block_size must be positive (or 0: exact ranges, no cache), got {block_size}")
        self.fs = fs
        self.fetcher = fetcher if fetcher is not None else Fetcher(fs, stats)
        self.stats = self.fetcher.stats
        self.block_size = block_size
        # At least one block must fit; a bound below one block would thrash on every read.
        self.capacity_bytes = max(capacity_bytes, block_size)
        self._cache = MemoryCache(self.capacity_bytes, self.stats)

    def read_many(self, requests: list[tuple[str, int, int, int]]) -> list[bytes]:
        """Read byte ranges ``(path, start, end, file_size)``; returns the bytes of each, in order."""
        bs = self.block_size
        for path, start, end, size in requests:
            if start < 0 or end > size or start > end:
                raise ValueError(f"range [{start}, {end}) outside {path} of {size} bytes")
        if bs == 0:
            # Random samples over a corpus far larger than any cache would otherwise pull a whole block each.
            return self.fetcher.read([(p, s, e) for p, s, e, _ in requests], cache=False)
        sizes: dict[tuple[str, int], int] = {}  # block key -> file size, in first-seen order
        for path, start, end, size in requests:
            if end > start:
                for b in range(start // bs, (end - 1) // bs + 1):
                    sizes.setdefault((path, b), size)

        def fetch(keys: list) -> list[bytes]:
            return self.fetcher.read([(p, b * bs, min((b + 1) * bs, sizes[(p, b)])) for p, b in keys])

        have = self._cache.get_many(sizes, fetch)
        out = []
        for path, start, end, _ in requests:
            if end == start:
                out.append(b"")
                continue
            first, last = start // bs, (end - 1) // bs
            if first == last:
                out.append(have[(path, first)][start - first * bs : end - first * bs])
            else:
                joined = b"".join(have[(path, b)] for b in range(first, last + 1))
                out.append(joined[start - first * bs : end - first * bs])
        return out

    def read(self, path: str, start: int, end: int, size: int) -> bytes:
        return self.read_many([(path, start, end, size)])[0]

    @property
    def cached_bytes(self) -> int:
        return self._cache.cached_bytes
