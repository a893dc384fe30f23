"""Tokenizers for ``prepare`` and the SFT loader, and the ``prepare`` pipeline (text / JSONL -> MMIDIDX shards)."""

from __future__ import annotations

import hashlib
import json
import posixpath
from collections.abc import Iterator
from dataclasses import dataclass

import fsspec
import numpy as np

from .errors import InputFormatError
from .indexed import IndexedDatasetWriter, optimal_dtype
from .manifest import MANIFEST_NAME, Manifest, ShardInfo

DEFAULT_SHARD_TOKENS = 1 << 28  # 512 MiB of uint16 tokens per shard


class ByteTokenizer:
    """UTF-8 bytes as token ids 0..255, end-of-document 256. Needs no vocabulary file."""

    name = "byte"
    vocab_size = 257
    eos_id = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def identity(self) -> str:
        return "byte"


_EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|eot_id|>")


class HFTokenizer:
    """A Hugging Face ``tokenizers`` tokenizer loaded from a ``tokenizer.json`` path."""

    def __init__(self, path: str) -> None:
        try:
            from tokenizers import Tokenizer
        except ImportError as e:  # optional dependency
            raise InputFormatError(f"tokenizer {path} needs the 'tokenizers' package (pip install tokenizers)") from e
        with fsspec.open(path, "rb") as f:
            self._raw = f.read()
        self._tok = Tokenizer.from_str(self._raw.decode("utf-8"))
        self.name = path
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.eos_id = next((i for t in _EOS_CANDIDATES if (i := self._tok.token_to_id(t)) is not None), None)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def identity(self) -> str:
        return "sha256:" + hashlib.sha256(self._raw).hexdigest()[:32]


def load_tokenizer(spec: str | None = None):
    """``None`` or ``"byte"``: :class:`ByteTokenizer`; else the path/URL of a ``tokenizer.json``."""
    if spec is None or spec == "byte":
        return ByteTokenizer()
    return HFTokenizer(spec)


def iter_documents(url: str, text_key: str = "text", storage_options: dict | None = None) -> Iterator[tuple[str, int]]:
    """Yield ``(text, bytes consumed)``: one document per JSONL record (``.jsonl``/``.json``), else per file."""
    is_jsonl = url.endswith((".jsonl", ".json", ".jsonl.gz", ".json.gz"))
    with fsspec.open(url, "rb", compression="infer", **(storage_options or {})) as f:
        if not is_jsonl:
            data = f.read()
            try:
                yield data.decode("utf-8"), len(data)
            except UnicodeDecodeError as e:
                raise InputFormatError(f"{url}: not UTF-8 text at byte {e.start}") from e
            return
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                yield "", len(line)
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise InputFormatError(f"{url}:{lineno}: invalid JSON: {e.msg} at column {e.colno}") from e
            if not isinstance(rec, dict) or not isinstance(rec.get(text_key), str):
                raise InputFormatError(f"{url}:{lineno}: expected an object with a string field {text_key!r}")
            yield rec[text_key], len(line)


@dataclass
class PrepareResult:
    manifest: Manifest
    num_documents: int
    out: str


def prepare(
    inputs: list[str],
    out: str,
    tokenizer=None,
    text_key: str = "text",
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    append_eos: bool = True,
    storage_options: dict | None = None,
    progress: bool = True,
    batch_docs: int = 256,
) -> PrepareResult:
    """Tokenize inputs into ``out/shard_NNNNN.{bin,idx}`` plus ``out/manifest.json``; one document per sequence."""
    from tqdm import tqdm

    tok = tokenizer if tokenizer is not None else ByteTokenizer()
    dtype = optimal_dtype(tok.vocab_size)
    fs, out_path = fsspec.core.url_to_fs(out, **(storage_options or {}))
    total = 0
    for u in inputs:
        in_fs, p = fsspec.core.url_to_fs(u, **(storage_options or {}))
        if not in_fs.exists(p):
            raise InputFormatError(f"input {u} not found")
        total += in_fs.size(p)
    shards: list[ShardInfo] = []
    writer: IndexedDatasetWriter | None = None
    n_docs = 0

    def finish() -> None:
        nonlocal writer
        if writer is not None and writer.num_sequences:
            info = writer.close()
            name = posixpath.basename(writer.prefix)
            shards.append(ShardInfo.from_index(name, writer.prefix, info))
        writer = None

    def emit(texts: list[str]) -> None:
        nonlocal writer, n_docs
        for ids in tok.encode_batch(texts):
            if append_eos and tok.eos_id is not None:
                ids = [*ids, tok.eos_id]
            if not ids:
                continue
            if writer is None:
                prefix = posixpath.join(out.rstrip("/"), f"shard_{len(shards):05d}")
                writer = IndexedDatasetWriter(prefix, dtype, storage_options)
            writer.add_document(np.asarray(ids, dtype=np.int64))
            n_docs += 1
            if writer.num_tokens >= shard_tokens:
                finish()

    with tqdm(total=total, unit="B", unit_scale=True, desc="prepare", disable=not progress) as bar:
        for url in inputs:
            pending: list[str] = []
            for text, nbytes in iter_documents(url, text_key, storage_options):
                if text:
                    pending.append(text)
                bar.update(nbytes)
                if len(pending) >= batch_docs:
                    emit(pending)
                    pending = []
            emit(pending)
        finish()
    manifest = Manifest(tuple(shards))
    doc = manifest.to_json()
    doc["tokenizer"] = {
        "name": tok.name,
        "identity": tok.identity(),
        "vocab_size": tok.vocab_size,
        "eos_id": tok.eos_id,
    }
    doc["num_documents"] = n_docs
    fs.pipe_file(posixpath.join(out_path, MANIFEST_NAME), json.dumps(doc, indent=1).encode())
    return PrepareResult(manifest, n_docs, out)
