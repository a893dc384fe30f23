"""The SFT loader: JSONL records -> packed fixed-length sequences with loss masks and per-document positions.

Records are ``{"prompt": ..., "completion": ...}`` or ``{"messages": [{"role": ..., "content": ...}, ...]}``.
Only completion / assistant tokens (and the end-of-document token) are trained on.

Packing is a pure function of the dataset, the tokenizer and ``seq_len`` (best-fit decreasing over all
documents, done once when the loader is built), so a pack is a sample like any other and the state holds no
rank-local buffer of leftover documents: elastic resume is the same as for pretraining.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import logging
import posixpath
import zlib

import fsspec
import numpy as np

from .errors import DataLoaderError, InputFormatError, ShardNotFoundError
from .loader import ElasticLoader, datasets_of
from .order import EpochOrder
from .tokenize import check_text, decode_line, load_tokenizer

IGNORE_INDEX = -100

log = logging.getLogger(__name__)


def _encode_record(rec: dict, tok, where: str) -> tuple[list[int], list[bool]]:
    ids: list[int] = []
    mask: list[bool] = []

    def add(text: str, trained: bool, field: str) -> None:
        t = tok.encode(check_text(text, f"{where}: {field}"))
        ids.extend(t)
        mask.extend([trained] * len(t))

    if isinstance(rec.get("messages"), list):
        for k, msg in enumerate(rec["messages"]):
            if (
                not isinstance(msg, dict)
                or not isinstance(msg.get("content"), str)
                or not isinstance(msg.get("role"), str)
            ):
                raise InputFormatError(f"{where}: message {k} needs string 'role' and 'content'")
            add(f"<|{msg['role']}|>\n", False, f"message {k} 'role'")
            add(msg["content"] + "\n", msg["role"] == "assistant", f"message {k} 'content'")
    elif isinstance(rec.get("prompt"), str) and isinstance(rec.get("completion"), str):
        add(rec["prompt"], False, "'prompt'")
        add(rec["completion"], True, "'completion'")
    else:
        raise InputFormatError(f"{where}: expected 'prompt' and 'completion' strings, or a 'messages' list")
    if tok.eos_id is not None:
        ids.append(tok.eos_id)
        mask.append(True)
    return ids, mask


def pack_best_fit(lengths: np.ndarray, capacity: int) -> list[list[int]]:
    """Best-fit decreasing: each document (longest first, ties by index) goes to the fullest pack it fits."""
    order = sorted(range(len(lengths)), key=lambda i: (-int(lengths[i]), i))
    packs: list[list[int]] = []
    free: list[tuple[int, int]] = []  # sorted (remaining capacity, pack index)
    for i in order:
        n = int(lengths[i])
        k = bisect.bisect_left(free, (n, -1))
        if k < len(free):
            rem, p = free.pop(k)
            packs[p].append(i)
            if rem - n > 0:
                bisect.insort(free, (rem - n, p))
        else:
            packs.append([i])
            if capacity - n > 0:
                bisect.insort(free, (capacity - n, len(packs) - 1))
    return packs


class SFTSource:
    kind = "sft"

    def __init__(
        self,
        data: str | list[str],
        tokenizer=None,
        seq_len: int = 2048,
        seed: int = 0,
        storage_options: dict | None = None,
        pad_id: int = 0,
        shuffle: bool = True,
    ) -> None:
        if seq_len <= 1:
            raise DataLoaderError(f"seq_len must be at least 2, got {seq_len}")
        self.tok = tokenizer if tokenizer is not None else load_tokenizer()
        self.seq_len = seq_len
        self.pad_id = pad_id
        urls = [data] if isinstance(data, str) else list(data)
        h = hashlib.sha256(self.tok.identity().encode())
        ids_all: list[np.ndarray] = []
        mask_all: list[np.ndarray] = []
        self.truncated = 0
        for url in urls:
            fs, path = fsspec.core.url_to_fs(url, **(storage_options or {}))
            try:
                raw = fs.cat_file(path)
            except FileNotFoundError as e:
                raise ShardNotFoundError(f"SFT data {url} not found") from e
            h.update(f"{posixpath.basename(path)}:{len(raw)}:{zlib.crc32(raw)};".encode())
            for lineno, line in enumerate(raw.splitlines(), 1):
                if not line.strip():
                    continue
                try:
                    rec = json.loads(decode_line(line, f"{url}:{lineno}", lineno == 1))
                except json.JSONDecodeError as e:
                    raise InputFormatError(f"{url}:{lineno}: invalid JSON: {e.msg} at column {e.colno}") from e
                if not isinstance(rec, dict):
                    raise InputFormatError(f"{url}:{lineno}: expected a JSON object")
                ids, mask = _encode_record(rec, self.tok, f"{url}:{lineno}")
                if len(ids) > seq_len:  # a document longer than a pack is cut; its tail is lost
                    ids, mask = ids[:seq_len], mask[:seq_len]
                    self.truncated += 1
                if ids:
                    ids_all.append(np.asarray(ids, dtype=np.int64))
                    mask_all.append(np.asarray(mask, dtype=bool))
        if not ids_all:
            raise DataLoaderError(f"no SFT records in {urls}")
        if self.truncated:
            log.warning("%d SFT documents longer than seq_len %d were truncated", self.truncated, seq_len)
        self.manifest_hash = h.hexdigest()[:32]
        lengths = np.array([a.shape[0] for a in ids_all], dtype=np.int64)
        self.doc_offsets = np.zeros(len(ids_all) + 1, dtype=np.int64)
        np.cumsum(lengths, out=self.doc_offsets[1:])
        self.tokens = np.concatenate(ids_all)
        self.trained = np.concatenate(mask_all)
        self.packs = pack_best_fit(lengths, seq_len)
        self.num_documents = len(ids_all)
        self.num_samples = len(self.packs)
        self.order = EpochOrder(self.num_samples, seed, self.manifest_hash, shuffle)

    def samples(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return self.order.samples(positions)

    def lanes(self, positions: np.ndarray) -> np.ndarray:
        return self.order.lanes(positions)

    def pack(self, p: int) -> dict[str, np.ndarray]:
        L = self.seq_len
        input_ids = np.full(L, self.pad_id, dtype=np.int64)
        labels = np.full(L, IGNORE_INDEX, dtype=np.int64)
        loss_mask = np.zeros(L, dtype=np.int64)
        position_ids = np.zeros(L, dtype=np.int64)
        doc_ids = np.full(L, -1, dtype=np.int64)  # -1: padding; lets a model build a block-diagonal mask
        pos = 0
        for j, d in enumerate(self.packs[p]):
            a, b = int(self.doc_offsets[d]), int(self.doc_offsets[d + 1])
            n = b - a
            input_ids[pos : pos + n] = self.tokens[a:b]
            position_ids[pos : pos + n] = np.arange(n)
            doc_ids[pos : pos + n] = j
            # Position k predicts token k+1 of the same document, and only where that token is trained.
            nxt = self.trained[a + 1 : b]
            loss_mask[pos : pos + n - 1] = nxt
            labels[pos : pos + n - 1] = np.where(nxt, self.tokens[a + 1 : b], IGNORE_INDEX)
            pos += n
        return {
            "input_ids": input_ids,
            "labels": labels,
            "loss_mask": loss_mask,
            "position_ids": position_ids,
            "document_ids": doc_ids,
        }

    def fetch(self, sample_ids: np.ndarray) -> dict[str, np.ndarray]:
        rows = [self.pack(int(i)) for i in sample_ids]
        return {k: np.stack([r[k] for r in rows]) for k in rows[0]} if rows else {}

    def describe(self) -> dict:
        return {"seq_len": self.seq_len, "shuffle": self.order.describe()}


class SFTLoader(ElasticLoader):
    """Batches ``{"input_ids", "labels", "loss_mask", "position_ids", "document_ids"}`` (torch int64
    ``[G/D, seq_len]``) of this rank's slice. ``data``: a JSONL URL or a list of them; or, with ``weights``, a
    list of such datasets to blend."""

    def __init__(
        self,
        data: str | list,
        seq_len: int,
        global_batch_size: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        seed: int = 0,
        tokenizer=None,
        weights: list[float] | None = None,
        storage_options: dict | None = None,
        pad_id: int = 0,
        prefetch: int = 2,
        num_threads: int = 1,
        shuffle: bool = True,
    ) -> None:
        tok = load_tokenizer(tokenizer) if tokenizer is None or isinstance(tokenizer, str) else tokenizer
        datasets = datasets_of(data, weights)
        sources = [SFTSource(d, tok, seq_len, seed, storage_options, pad_id, shuffle) for d in datasets]
        self.seq_len = seq_len
        super().__init__(sources, global_batch_size, dp_rank, dp_size, weights, seed, prefetch, num_threads)
