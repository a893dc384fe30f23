"""Megatron-LM's indexed dataset (MMIDIDX): a ``.bin`` of raw tokens and a ``.idx`` that locates sequences.

``.idx`` layout, little-endian: magic ``b"MMIDIDX\\x00\\x00"``, version u64 (=1), dtype code u8, sequence count
u64, document-index count u64, then int32 sequence lengths (tokens), int64 sequence byte offsets into ``.bin``,
int64 document indices (starts at 0; one entry past each document's last sequence). Megatron's multimodal
variant appends one int8 mode per sequence, which is accepted and ignored.

The ``.idx`` is read whole (it is small: 12 bytes per sequence); ``.bin`` bytes go through a
:class:`~dataloaders.blockcache.BlockCache` so only the blocks that samples touch are fetched.
"""

from __future__ import annotations

import os
import struct
import tempfile
import zlib
from dataclasses import dataclass
from typing import Self

import crc32c
import numpy as np

from .blockcache import BlockCache
from .errors import IndexFormatError, ShardNotFoundError
from .fetch import IOStats, file_version, filesystem

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
_HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, sequence count, document-index count

DTYPE_CODES: dict[int, np.dtype] = {
    1: np.dtype(np.uint8),
    2: np.dtype(np.int8),
    3: np.dtype(np.int16),
    4: np.dtype(np.int32),
    5: np.dtype(np.int64),
    6: np.dtype(np.float64),
    7: np.dtype(np.float32),
    8: np.dtype(np.uint16),
}
CODE_OF_DTYPE = {v: k for k, v in DTYPE_CODES.items()}


def optimal_dtype(vocab_size: int) -> np.dtype:
    """Megatron's choice: uint16 while the vocabulary fits, else int32."""
    return np.dtype(np.uint16) if vocab_size < 65500 else np.dtype(np.int32)


def idx_url(prefix: str) -> str:
    return prefix + ".idx"


def bin_url(prefix: str) -> str:
    return prefix + ".bin"


@dataclass(frozen=True)
class IndexInfo:
    """The parsed content of one ``.idx``."""

    dtype: np.dtype
    sequence_lengths: np.ndarray  # int32 [S]
    sequence_pointers: np.ndarray  # int64 [S], byte offsets into .bin
    document_indices: np.ndarray  # int64 [D+1]
    idx_size: int
    idx_crc32: int

    @property
    def num_sequences(self) -> int:
        return int(self.sequence_lengths.shape[0])

    @property
    def num_documents(self) -> int:
        return int(self.document_indices.shape[0]) - 1

    @property
    def num_tokens(self) -> int:
        return int(self.sequence_lengths.sum(dtype=np.int64))

    @property
    def expected_bin_size(self) -> int:
        return self.num_tokens * self.dtype.itemsize


def encode_index(dtype: np.dtype, lengths: np.ndarray, document_indices: np.ndarray) -> bytes:
    """Serialise an ``.idx`` for contiguous sequences of ``lengths`` tokens."""
    dtype = np.dtype(dtype)
    if dtype not in CODE_OF_DTYPE:
        raise ValueError(f"dtype {dtype} has no MMIDIDX code; use one of {sorted(map(str, CODE_OF_DTYPE))}")
    lengths = np.asarray(lengths, dtype=np.int32)
    pointers = np.zeros(lengths.shape[0], dtype=np.int64)
    if lengths.shape[0] > 1:
        np.cumsum(lengths[:-1].astype(np.int64) * dtype.itemsize, out=pointers[1:])
    docs = np.asarray(document_indices, dtype=np.int64)
    header = _HEADER.pack(MAGIC, VERSION, CODE_OF_DTYPE[dtype], lengths.shape[0], docs.shape[0])
    return header + lengths.tobytes() + pointers.tobytes() + docs.tobytes()


def parse_index(data: bytes, name: str = "<idx>") -> IndexInfo:
    """Parse and validate ``.idx`` bytes; raises :class:`IndexFormatError` naming what is wrong and where."""
    if len(data) < _HEADER.size:
        raise IndexFormatError(f"{name}: truncated header: {len(data)} bytes, expected at least {_HEADER.size}")
    magic, version, code, n_seq, n_doc = _HEADER.unpack_from(data, 0)
    if magic != MAGIC:
        raise IndexFormatError(f"{name}: not an MMIDIDX index: magic at offset 0 is {magic!r}, expected {MAGIC!r}")
    if version != VERSION:
        raise IndexFormatError(f"{name}: unsupported MMIDIDX version {version} at offset 9, expected {VERSION}")
    if code not in DTYPE_CODES:
        raise IndexFormatError(f"{name}: unknown dtype code {code} at offset 17, expected one of 1..8")
    if DTYPE_CODES[code].kind == "f":  # (valid in Megatron's format, for other data; a token is an integer)
        raise IndexFormatError(f"{name}: dtype code {code} at offset 17 is {DTYPE_CODES[code]}, not token ids")
    expected = _HEADER.size + 12 * n_seq + 8 * n_doc
    if len(data) < expected:
        raise IndexFormatError(
            f"{name}: truncated: {len(data)} bytes, expected {expected} for {n_seq} sequences and {n_doc} "
            "document indices"
        )
    if len(data) not in (expected, expected + n_seq):  # + n_seq: Megatron's multimodal sequence modes
        raise IndexFormatError(f"{name}: {len(data) - expected} unexpected trailing bytes after offset {expected}")
    off = _HEADER.size
    lengths = np.frombuffer(data, dtype="<i4", count=n_seq, offset=off)
    off += 4 * n_seq
    pointers = np.frombuffer(data, dtype="<i8", count=n_seq, offset=off)
    off += 8 * n_seq
    docs = np.frombuffer(data, dtype="<i8", count=n_doc, offset=off)
    dtype = DTYPE_CODES[code]
    if n_seq and lengths.min() < 0:
        i = int(np.argmin(lengths))
        raise IndexFormatError(f"{name}: negative length {int(lengths[i])} for sequence {i}")
    expected_ptr = np.zeros(n_seq, dtype=np.int64)
    if n_seq > 1:
        np.cumsum(lengths[:-1].astype(np.int64) * dtype.itemsize, out=expected_ptr[1:])
    bad = np.nonzero(pointers != expected_ptr)[0]
    if bad.size:
        i = int(bad[0])
        raise IndexFormatError(
            f"{name}: sequence {i} pointer is {int(pointers[i])}, expected {int(expected_ptr[i])} "
            "(sequences must be contiguous in .bin)"
        )
    if n_doc == 0 or docs[0] != 0:
        raise IndexFormatError(f"{name}: document indices must start with 0, found {docs[:1].tolist()}")
    if np.any(np.diff(docs) < 0) or docs[-1] != n_seq:
        raise IndexFormatError(
            f"{name}: document indices must be non-decreasing and end at the sequence count {n_seq}, "
            f"found last {int(docs[-1])}"
        )
    return IndexInfo(dtype, lengths, pointers, docs, len(data), zlib.crc32(data))


class IndexedDatasetWriter:
    """Write one MMIDIDX shard to ``prefix.bin`` / ``prefix.idx`` at any fsspec URL.

    Local targets are written in place; remote ones are staged in a temporary file and uploaded whole with
    ``put_file`` (s3fs uploads parts of an ``open(..., "wb")`` stream serially). ``bin_crc32c``: the CRC-32C of the
    ``.bin`` bytes written so far (what ``prepare`` records in the manifest).
    """

    def __init__(self, prefix: str, dtype: np.dtype | str = np.uint16, storage_options: dict | None = None) -> None:
        self.prefix = prefix
        self.dtype = np.dtype(dtype)
        if self.dtype not in CODE_OF_DTYPE:
            raise ValueError(f"dtype {self.dtype} has no MMIDIDX code")
        self.fs, self._bin_path = filesystem(bin_url(prefix), storage_options)
        self._idx_path = filesystem(idx_url(prefix), storage_options)[1]
        self._local = "file" in self.fs.protocol or "local" in self.fs.protocol
        if self._local:
            self.fs.makedirs(self.fs._parent(self._bin_path), exist_ok=True)
            self._bin = open(self._bin_path, "wb")  # noqa: SIM115 - closed in close()
            self._tmp = None
        else:
            self._tmp = tempfile.NamedTemporaryFile(suffix=".bin", delete=False)  # noqa: SIM115
            self._bin = self._tmp
        self._lengths: list[int] = []
        self._docs: list[int] = [0]
        self.num_tokens = 0
        self.bin_crc32c = 0

    def add_sequence(self, tokens) -> None:
        arr = np.asarray(tokens)
        if arr.size and self.dtype.kind in "iu":
            info = np.iinfo(self.dtype)
            lo, hi = int(arr.min()), int(arr.max())
            if lo < info.min or hi > info.max:
                raise ValueError(f"tokens in [{lo}, {hi}] do not fit {self.dtype} of shard {self.prefix}")
        data = arr.astype(self.dtype.newbyteorder("<")).tobytes()
        self.bin_crc32c = crc32c.crc32c(data, self.bin_crc32c)
        self._bin.write(data)
        self._lengths.append(int(arr.size))
        self.num_tokens += int(arr.size)

    def end_document(self) -> None:
        self._docs.append(len(self._lengths))

    def add_document(self, tokens) -> None:
        """One document of one sequence (the usual case for pretraining text)."""
        self.add_sequence(tokens)
        self.end_document()

    @property
    def num_sequences(self) -> int:
        return len(self._lengths)

    def close(self) -> IndexInfo:
        if self._docs[-1] != len(self._lengths):
            self.end_document()
        self._bin.close()
        idx = encode_index(self.dtype, np.array(self._lengths, dtype=np.int32), np.array(self._docs))
        if self._tmp is not None:
            tmp, self._tmp = self._tmp, None  # (removed here whatever the upload does: `abort` must not again)
            try:
                self.fs.put_file(tmp.name, self._bin_path)
            finally:
                os.unlink(tmp.name)
        # The .idx last: a reader that finds it finds a complete .bin.
        self.fs.pipe_file(self._idx_path, idx)
        return parse_index(idx, self._idx_path)

    def __enter__(self) -> Self:
        return self

    def abort(self) -> None:
        """Stop without writing the ``.idx`` (a shard without one is no shard); the caller removes the ``.bin``."""
        self._bin.close()
        if self._tmp is not None:
            os.unlink(self._tmp.name)
            self._tmp = None

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


def read_index(prefix: str, fs, name: str | None = None, stats: IOStats | None = None) -> IndexInfo:
    """Read and parse ``prefix.idx`` with ``fs`` (a path within it); missing -> :class:`ShardNotFoundError`."""
    path = idx_url(prefix)
    try:
        data = fs.cat_file(path)
    except FileNotFoundError as e:
        raise ShardNotFoundError(f"shard index {name or path} not found") from e
    if stats is not None:
        stats.add(path, 0, len(data), index=True)
    return parse_index(data, name or path)


class IndexedDataset:
    """Read access to one MMIDIDX shard through a shared block cache.

    The shard's token stream is its sequences concatenated in order, which (sequences being contiguous) is
    the ``.bin`` itself: tokens ``[a, b)`` are one byte range.
    """

    def __init__(self, prefix_path: str, cache: BlockCache, index: IndexInfo | None = None, name: str = "") -> None:
        self.path = prefix_path
        self.name = name or prefix_path
        self.cache = cache
        fs = cache.fs
        self.index = index if index is not None else read_index(prefix_path, fs, self.name + ".idx", cache.stats)
        self.bin_path = bin_url(prefix_path)
        try:
            info = fs.info(self.bin_path)
        except FileNotFoundError as e:
            raise ShardNotFoundError(f"shard data {self.name}.bin not found") from e
        cache.stats.metadata()
        self.bin_size = int(info["size"])
        if self.bin_size != self.index.expected_bin_size:
            raise IndexFormatError(
                f"{self.name}.bin: size {self.bin_size} bytes, but its .idx describes "
                f"{self.index.num_tokens} tokens of {self.index.dtype} = {self.index.expected_bin_size} bytes"
            )
        self.dtype = self.index.dtype
        cache.fetcher.register(self.bin_path, self.bin_size, file_version(info))

    def __len__(self) -> int:
        return self.index.num_sequences

    @property
    def num_tokens(self) -> int:
        return self.index.num_tokens

    def range_request(self, start_token: int, end_token: int) -> tuple[str, int, int, int]:
        """The byte range of stream tokens ``[start_token, end_token)`` as a cache request."""
        isz = self.dtype.itemsize
        return (self.bin_path, start_token * isz, end_token * isz, self.bin_size)

    def tokens(self, start_token: int, end_token: int) -> np.ndarray:
        data = self.cache.read(*self.range_request(start_token, end_token))
        return np.frombuffer(data, dtype=self.dtype.newbyteorder("<"))

    def __getitem__(self, i: int) -> np.ndarray:
        """Sequence ``i``."""
        if not -len(self) <= i < len(self):
            raise IndexError(f"sequence {i} out of range for {self.name} with {len(self)} sequences")
        i %= len(self)
        isz = self.dtype.itemsize
        start = int(self.index.sequence_pointers[i]) // isz
        return self.tokens(start, start + int(self.index.sequence_lengths[i]))
