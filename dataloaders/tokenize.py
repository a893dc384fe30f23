"""Tokenizers for ``prepare`` and the SFT loader, and the ``prepare`` pipeline (text / JSONL, or token ids already
made: JSONL of integer lists or ``.npy`` arrays -> MMIDIDX shards)."""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import posixpath
import re
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import fsspec
import numpy as np

from .errors import DataLoaderError, InputFormatError
from .indexed import IndexedDatasetWriter, optimal_dtype
from .manifest import MANIFEST_NAME, Manifest, ShardInfo, shard_records

DEFAULT_SHARD_TOKENS = 1 << 28  # 512 MiB of uint16 tokens per shard


# The widest token dtype of a shard is int32 (``optimal_dtype``): an id must fit it.
MAX_TOKEN_ID = int(np.iinfo(np.int32).max)

# A lone surrogate: what a JSON escape such as "\ud800" decodes to, and no UTF-8 (nor tokenizer) can encode.
_SURROGATE = re.compile("[\ud800-\udfff]")
_JSONL_SUFFIXES = (".jsonl", ".json", ".jsonl.gz", ".json.gz")
_NPY_MAGIC = b"\x93NUMPY"
_SHARD_FILE = re.compile(r"shard_\d{5,}\.(bin|idx)")  # what prepare names its shards


def decode_line(line: bytes, where: str, first: bool = False) -> str:
    """A JSON Lines line as text: strict UTF-8 (a byte-order mark allowed on the first line), else an
    :class:`InputFormatError` naming ``where`` and the byte. (``json.loads`` of bytes would guess UTF-16 or -32, and
    let UTF-8-encoded surrogates through.)"""
    try:
        return line.decode("utf-8-sig" if first else "utf-8")
    except UnicodeDecodeError as e:
        raise InputFormatError(f"{where}: not UTF-8 text at byte {e.start}") from e


def check_text(text: str, where: str) -> str:
    """``text``, unless it holds a lone surrogate (an escape such as ``"\\ud800"`` that is half of a pair):
    then an :class:`InputFormatError` naming ``where`` and the character."""
    if not text.isascii() and (m := _SURROGATE.search(text)):
        raise InputFormatError(
            f"{where}: lone surrogate {m.group()!r} at character {m.start()}: not Unicode text a tokenizer can encode"
        )
    return text


class ByteTokenizer:
    """UTF-8 bytes as token ids 0..255, end-of-document 256. Needs no vocabulary file."""

    name = "byte"
    vocab_size = 257
    eos_id = 256

    def encode(self, text: str) -> list[int]:
        return list(check_text(text, "text").encode("utf-8"))

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
        try:
            with fsspec.open(path, "rb") as f:
                self._raw = f.read()
        except FileNotFoundError as e:
            raise InputFormatError(f"tokenizer {path} not found") from e
        except IsADirectoryError as e:
            raise InputFormatError(f"tokenizer {path} is a directory, expected a tokenizer.json file") from e
        try:
            self._tok = Tokenizer.from_str(self._raw.decode("utf-8"))
        except Exception as e:  # (`tokenizers` raises a bare Exception for a file it cannot read)
            raise InputFormatError(f"tokenizer {path}: not a tokenizers tokenizer.json: {str(e)[:200]}") from e
        self.name = path
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.eos_id = next((i for t in _EOS_CANDIDATES if (i := self._tok.token_to_id(t)) is not None), None)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(check_text(text, "text"), add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        texts = [check_text(t, f"text {i}") for i, t in enumerate(texts)]
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def identity(self) -> str:
        return "sha256:" + hashlib.sha256(self._raw).hexdigest()[:32]


class TokenIds:
    """Inputs that are token ids already: ``.jsonl`` lines that are lists of integers (or objects whose text field
    is one), ``.npy`` integer arrays (1-D: one document; 2-D: one document per row). ``vocab_size=None``: one more
    than the largest id in the inputs (a first pass over them); ``eos_id``: appended to each document if given."""

    name = "ids"

    def __init__(self, vocab_size: int | None = None, eos_id: int | None = None) -> None:
        if vocab_size is not None and not 0 < vocab_size <= MAX_TOKEN_ID + 1:
            raise InputFormatError(f"vocab_size must be in [1, {MAX_TOKEN_ID + 1}] (int32 tokens), got {vocab_size}")
        if eos_id is not None and not 0 <= eos_id <= MAX_TOKEN_ID:
            raise InputFormatError(f"eos_id must be in [0, {MAX_TOKEN_ID}] (int32 tokens), got {eos_id}")
        if eos_id is not None and vocab_size is not None and eos_id >= vocab_size:
            raise InputFormatError(f"eos_id {eos_id} is outside the vocabulary [0, {vocab_size})")
        self.vocab_size = vocab_size
        self.eos_id = eos_id

    def identity(self) -> str:
        return f"ids:{self.vocab_size}"


def load_tokenizer(spec: str | None = None):
    """``None`` or ``"byte"``: :class:`ByteTokenizer`; else the path/URL of a ``tokenizer.json``."""
    if spec is None or spec == "byte":
        return ByteTokenizer()
    return HFTokenizer(spec)


def iter_documents(url: str, text_key: str = "text", storage_options: dict | None = None) -> Iterator[tuple[str, int]]:
    """Yield ``(text, bytes consumed)``: one document per JSONL record (``.jsonl``/``.json``), else per file."""
    is_jsonl = url.endswith(_JSONL_SUFFIXES)
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
            where = f"{url}:{lineno}"
            try:
                rec = json.loads(decode_line(line, where, lineno == 1))
            except json.JSONDecodeError as e:
                raise InputFormatError(f"{where}: invalid JSON: {e.msg} at column {e.colno}") from e
            if not isinstance(rec, dict) or not isinstance(rec.get(text_key), str):
                hint = " (token ids? prepare them with --tokenized)" if isinstance(rec, list) else ""
                raise InputFormatError(f"{where}: expected an object with a string field {text_key!r}{hint}")
            yield check_text(rec[text_key], f"{where}: field {text_key!r}"), len(line)


def _check_ids(ids: np.ndarray, vocab_size: int | None, where: str) -> None:
    """Refuse ids outside ``[0, vocab_size)`` (without one: negative, or too large for a shard's int32), naming
    the first one and its index."""
    top = MAX_TOKEN_ID + 1 if vocab_size is None else vocab_size
    bad = (ids < 0) | (ids >= top)
    if bad.any():
        j = int(np.argmax(bad))
        limit = f"outside the vocabulary [0, {vocab_size})" if vocab_size is not None else (
            "negative" if ids[j] < 0 else f"too large for a shard's int32 tokens (at most {MAX_TOKEN_ID})"
        )  # fmt: skip
        raise InputFormatError(f"{where}: token id {int(ids[j])} at index {j} is {limit}")


def _load_npy(url: str, storage_options: dict | None) -> np.ndarray:
    fs, path = fsspec.core.url_to_fs(url, **(storage_options or {}))
    local = "file" in fs.protocol or "local" in fs.protocol
    try:
        if local:
            with open(path, "rb") as f:
                magic = f.read(len(_NPY_MAGIC))
        else:
            data = fs.cat_file(path)
            magic = data[: len(_NPY_MAGIC)]
        if magic != _NPY_MAGIC:  # (np.load would take it for a pickle, refused as "Python objects")
            raise InputFormatError(f"{url}: not a .npy file (its first bytes are {magic!r}, not {_NPY_MAGIC!r})")
        if local:
            arr = np.load(path, mmap_mode="r", allow_pickle=False)  # no pickle, and no copy of a large file
        else:
            arr = np.load(io.BytesIO(data), allow_pickle=False)
    except FileNotFoundError as e:
        raise InputFormatError(f"input {url} not found") from e
    except (ValueError, OSError, EOFError) as e:
        if "object" in str(e).lower():  # numpy's words for an array of Python objects
            raise InputFormatError(
                f"{url}: an array of Python objects (ragged rows?), expected one integer array of token ids"
            ) from e
        raise InputFormatError(f"{url}: not a .npy array of token ids: {e}") from e
    if arr.dtype.kind not in "iu":
        raise InputFormatError(f"{url}: dtype {arr.dtype}, expected integer token ids")
    if arr.ndim not in (1, 2):
        raise InputFormatError(f"{url}: {arr.ndim}-D array, expected 1-D (one document) or 2-D (a document per row)")
    return arr


def iter_token_documents(
    url: str, text_key: str = "text", storage_options: dict | None = None, vocab_size: int | None = None
) -> Iterator[tuple[np.ndarray, int]]:
    """Yield ``(token ids as int64, bytes consumed)`` of inputs that are token ids already (:class:`TokenIds`);
    an id that is not an integer, negative, or not below ``vocab_size`` is an :class:`InputFormatError` naming
    the file and its line (a ``.npy`` file: its row)."""
    if url.endswith(".npy"):
        arr = _load_npy(url, storage_options)
        rows = arr.reshape(1, -1) if arr.ndim == 1 else arr
        row_bytes = rows.shape[1] * rows.dtype.itemsize
        for r in range(rows.shape[0]):
            row = np.asarray(rows[r])
            _check_ids(row, vocab_size, f"{url}: row {r}" if arr.ndim == 2 else url)  # before a cast could wrap
            yield row.astype(np.int64), row_bytes
        return
    if not url.endswith(_JSONL_SUFFIXES):
        raise InputFormatError(f"{url}: token ids come in .jsonl (a list of integers per line) or .npy files")
    with fsspec.open(url, "rb", compression="infer", **(storage_options or {})) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{url}:{lineno}"
            try:
                rec = json.loads(decode_line(line, where, lineno == 1))
            except json.JSONDecodeError as e:
                raise InputFormatError(f"{where}: invalid JSON: {e.msg} at column {e.colno}") from e
            seq = rec.get(text_key) if isinstance(rec, dict) else rec
            if not isinstance(seq, list):
                raise InputFormatError(f"{where}: expected a list of token ids, or an object whose {text_key!r} is one")
            for j, x in enumerate(seq):
                if type(x) is not int:
                    raise InputFormatError(f"{where}: token {j} is {x!r}, not an integer id")
                if not 0 <= x <= MAX_TOKEN_ID:  # (checked here: past int64, numpy raises an OverflowError of its own)
                    raise InputFormatError(
                        f"{where}: token id {str(x)[:80]} at index {j} is "
                        + ("negative" if x < 0 else "too large for a shard's int32 tokens")
                    )
            ids = np.asarray(seq, dtype=np.int64)
            _check_ids(ids, vocab_size, where)
            yield ids, len(line)


def _prepare_inputs(inputs, ids_input, tok, text_key, storage_options, batch_docs, emit, bar) -> None:
    """Hand every input's documents to ``emit`` as token ids, in order."""
    for url in inputs:
        if ids_input:
            for ids, nbytes in iter_token_documents(url, text_key, storage_options, tok.vocab_size):
                emit([ids])
                bar.update(nbytes)
            continue
        pending: list[str] = []
        for text, nbytes in iter_documents(url, text_key, storage_options):
            if text:
                pending.append(text)
            bar.update(nbytes)
            if len(pending) >= batch_docs:
                emit(tok.encode_batch(pending))
                pending = []
        emit(tok.encode_batch(pending))


@dataclass
class PrepareResult:
    manifest: Manifest
    num_documents: int
    out: str


def _in_the_way(fs, out_path: str, out: str) -> list[str] | None:
    """The names in ``out_path`` that a new dataset would overwrite (``manifest.json``, ``shard_NNNNN.{bin,idx}``),
    or None where there are none (a new or empty directory, or one of other files: no staging needed)."""
    try:
        info = fs.info(out_path)
    except FileNotFoundError:
        return None
    if info.get("type") != "directory":
        raise InputFormatError(f"output {out} is a file, expected a directory (new or holding a dataset)")
    names = [posixpath.basename(p.rstrip("/")) for p in fs.ls(out_path, detail=False)]
    found = sorted(n for n in names if n == MANIFEST_NAME or _SHARD_FILE.fullmatch(n))
    return found or None


def _old_shards(fs, out_path: str) -> set[str]:
    """The shard names the dataset in ``out_path`` names in its manifest (none if it has no readable one)."""
    path = posixpath.join(out_path, MANIFEST_NAME)
    try:
        records, _, _ = shard_records(fs.cat_file(path), path)
    except (OSError, DataLoaderError):
        return set()
    return {r["name"] for r in records}


def _switch(fs, stage: str, out_path: str, names: list[str], manifest: bytes) -> None:
    """Put the dataset staged in ``stage`` in place of the one in ``out_path``: its shards (each ``.idx`` after its
    ``.bin``), then its ``manifest.json`` (one rename or PUT: readers see the old manifest or the new one, never
    none), then remove the old dataset's shards that the new one does not have, and the staging directory."""
    old = _old_shards(fs, out_path)
    for name in names:
        for ext in (".bin", ".idx"):
            fs.mv(posixpath.join(stage, name + ext), posixpath.join(out_path, name + ext))
    fs.pipe_file(posixpath.join(stage, MANIFEST_NAME), manifest)
    fs.mv(posixpath.join(stage, MANIFEST_NAME), posixpath.join(out_path, MANIFEST_NAME))
    for name in sorted(old - set(names)):
        for ext in (".bin", ".idx"):
            with contextlib.suppress(OSError):  # (gone already: nothing left to remove)
                fs.rm_file(posixpath.join(out_path, name + ext))
    with contextlib.suppress(OSError):  # (on object stores a directory is nothing once its files are gone)
        fs.rm(stage, recursive=True)


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
    """Tokenize inputs into ``out/shard_NNNNN.{bin,idx}`` plus ``out/manifest.json``; one document per sequence.

    ``tokenizer``: a tokenizer of text (default: bytes), or :class:`TokenIds` for inputs that are token ids.

    Where ``out`` holds a dataset already, the new one is written beside it (``out/.prepare-XXXX/``) and put in its
    place only once it is complete: a prepare that fails leaves the old dataset as it was."""
    from tqdm import tqdm

    if not isinstance(shard_tokens, int | np.integer) or isinstance(shard_tokens, bool) or shard_tokens <= 0:
        raise InputFormatError(f"shard_tokens must be a positive number of tokens, got {shard_tokens!r}")
    tok = tokenizer if tokenizer is not None else ByteTokenizer()
    ids_input = isinstance(tok, TokenIds)
    fs, out_path = fsspec.core.url_to_fs(out, **(storage_options or {}))
    out_path = out_path.rstrip("/") or out_path
    total = 0
    for u in inputs:
        in_fs, p = fsspec.core.url_to_fs(u, **(storage_options or {}))
        try:
            info = in_fs.info(p)
        except FileNotFoundError:
            raise InputFormatError(f"input {u} not found") from None
        if info.get("type") == "directory":
            raise InputFormatError(f"input {u} is a directory: give the files in it")
        if u.endswith(".npy") and not ids_input:
            raise InputFormatError(f"{u}: a .npy file holds token ids: prepare it with --tokenized (TokenIds)")
        total += int(info.get("size") or 0)
    staged = _in_the_way(fs, out_path, out) is not None
    stage_name = f".prepare-{uuid.uuid4().hex[:12]}"  # (where a dataset is replaced: the new one, until complete)
    stage = posixpath.join(out_path, stage_name) if staged else out_path
    stage_url = posixpath.join(out.rstrip("/"), stage_name) if staged else out.rstrip("/")
    if ids_input and tok.vocab_size is None:  # one pass for the largest id: the shards' dtype depends on it
        top = max((int(ids.max()) for u in inputs for ids, _ in iter_token_documents(u, text_key, storage_options)
                   if ids.size), default=0)  # fmt: skip
        tok = TokenIds(max(top, tok.eos_id or 0) + 1, tok.eos_id)
    dtype = optimal_dtype(tok.vocab_size)
    identity = tok.identity()
    shards: list[ShardInfo] = []
    written: list[str] = []  # the prefix of every shard begun
    writer: IndexedDatasetWriter | None = None
    n_docs = 0

    def finish() -> None:
        nonlocal writer
        if writer is not None and writer.num_sequences:
            info = writer.close()
            name = posixpath.basename(writer.prefix)
            url = posixpath.join(out.rstrip("/"), name)
            shards.append(ShardInfo.from_index(name, url, info, bin_crc32c=writer.bin_crc32c, tokenizer=identity))
        writer = None

    def emit(documents: list) -> None:
        nonlocal writer, n_docs
        for doc in documents:
            ids = np.asarray(doc, dtype=np.int64)
            if append_eos and tok.eos_id is not None:
                ids = np.append(ids, tok.eos_id)
            if ids.size == 0:
                continue
            if writer is None:
                prefix = posixpath.join(stage_url, f"shard_{len(shards):05d}")
                writer = IndexedDatasetWriter(prefix, dtype, storage_options)
                written.append(prefix)
            writer.add_document(ids)
            n_docs += 1
            if writer.num_tokens >= shard_tokens:
                finish()

    try:
        with tqdm(total=total, unit="B", unit_scale=True, desc="prepare", disable=not progress) as bar:
            _prepare_inputs(inputs, ids_input, tok, text_key, storage_options, batch_docs, emit, bar)
            finish()
        if not n_docs:  # (a manifest of no shards is a dataset no loader can take a sample from)
            raise InputFormatError(f"{', '.join(inputs)}: no document with a token in it: nothing to prepare")
    except BaseException:
        # Bad input (or an interrupt) half way: remove the shards written so far, so that no directory of shards
        # without a manifest is left to be read as a smaller dataset (and an old dataset in `out` is untouched).
        if writer is not None:
            with contextlib.suppress(OSError):  # (the cleanup never hides what failed)
                writer.abort()
        for prefix in written:
            for path in (prefix + ".bin", prefix + ".idx"):
                with contextlib.suppress(OSError):  # (not there, or the store as broken as what failed)
                    fs.rm_file(fs._strip_protocol(path))
        if staged:
            with contextlib.suppress(OSError):
                fs.rm(stage, recursive=True)
        raise
    manifest = Manifest(tuple(shards))

    doc = manifest.to_json()
    doc["tokenizer"] = {
        "name": tok.name,
        "identity": identity,
        "vocab_size": tok.vocab_size,
        "eos_id": tok.eos_id,
    }
    doc["num_documents"] = n_docs
    raw = json.dumps(doc, indent=1).encode()
    if staged:
        _switch(fs, stage, out_path, [s.name for s in shards], raw)
    else:
        fs.pipe_file(posixpath.join(out_path, MANIFEST_NAME), raw)
    return PrepareResult(manifest, n_docs, out)
