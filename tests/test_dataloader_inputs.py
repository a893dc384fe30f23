"""What users get wrong, and data that changes under a saved state (the data loaders' bug hunt): JSONL that is not
UTF-8 or holds a lone surrogate, ``prepare``'s edge cases, a ``prepare`` over a dataset that fails half way, a
corpus edited (same lengths) or grown under a saved state, hostile manifests, malformed blended counters,
``weights`` with one dataset given as a string, and the disk cache's count of its bytes."""

from __future__ import annotations

import hashlib
import json
import random
import re
import string
from pathlib import Path

import fsspec
import numpy as np
import pytest

from dataloaders import (
    ByteTokenizer,
    DiskCache,
    InputFormatError,
    ManifestFormatError,
    ManifestMismatchError,
    PretrainLoader,
    SFTLoader,
    StateError,
    TokenIds,
    open_corpus,
    prepare,
)
from dataloaders.__main__ import main

from .helpers import DRAW
from .test_dataloaders import make_corpus, take, write_jsonl


def rng_of() -> random.Random:
    return random.Random(DRAW.randrange(2**32))


def texts(rng: random.Random, n: int, lo: int = 5, hi: int = 80) -> list[str]:
    return ["".join(rng.choices(string.ascii_letters + " ", k=rng.randint(lo, hi))) for _ in range(n)]


def run_cli(capsys, *argv: str) -> tuple[int, str]:
    rc = main(list(argv))
    return rc, capsys.readouterr().err


def one_line(err: str) -> str:
    assert err.count("\n") == 1 and err.startswith("error: "), err
    return err


# --- 1. JSONL that is not UTF-8, or holds a lone surrogate ----------------------------------------------------------


def not_utf8(rng: random.Random) -> bytes:
    """Bytes that are no UTF-8: a lone continuation byte, an overlong lead, a byte UTF-8 never uses, a sequence cut
    short, or a surrogate encoded (which ``json.loads`` of bytes let through)."""
    return rng.choice([
        bytes([rng.randint(0x80, 0xBF)]),
        bytes([rng.choice([0xC0, 0xC1]), rng.randint(0x80, 0xBF)]),
        bytes([rng.randint(0xF5, 0xFF)]),
        bytes([rng.randint(0xE1, 0xEC)]) + b"x",
        bytes([0xED, rng.randint(0xA0, 0xBF), rng.randint(0x80, 0xBF)]),
    ])  # fmt: skip


def lone_surrogate(rng: random.Random) -> str:
    """A JSON escape of half a surrogate pair, in either case."""
    escape = f"{rng.randint(0xD800, 0xDFFF):04x}"
    return "\\u" + (escape.upper() if rng.random() < 0.5 else escape)


def jsonl_with_a_bad_line(path: Path, good: list[bytes], bad: bytes, rng: random.Random) -> int:
    """``good`` lines with ``bad`` among them, at a random place; returns its line number."""
    at = rng.randint(0, len(good))
    path.write_bytes(b"".join(line + b"\n" for line in [*good[:at], bad, *good[at:]]))
    return at + 1


@pytest.mark.parametrize("kind", ["text-bytes", "text-surrogate", "ids-bytes", "sft-bytes", "sft-surrogate"])
def test_jsonl_that_is_not_utf8_or_holds_a_lone_surrogate_is_one_line_naming_its_line(tmp_path, capsys, kind):
    """(A UnicodeDecodeError or UnicodeEncodeError traceback, naming neither the file nor the line.)"""
    rng = rng_of()
    what, fault = kind.split("-")
    bad = not_utf8(rng) if fault == "bytes" else lone_surrogate(rng).encode()
    good_texts = texts(rng, rng.randint(0, 30))
    src = tmp_path / "in.jsonl"
    if what == "text":
        good = [json.dumps({"text": t}).encode() for t in good_texts]
        line = jsonl_with_a_bad_line(src, good, b'{"text": "' + b"caf" + bad + b' au lait"}', rng)
    elif what == "ids":
        good = [json.dumps([rng.randrange(1000) for _ in range(rng.randint(1, 9))]).encode() for _ in good_texts]
        line = jsonl_with_a_bad_line(src, good, b'[1, 2, "' + bad + b'"]', rng)
    else:
        good = [json.dumps({"prompt": t, "completion": t[::-1]}).encode() for t in good_texts]
        field = rng.choice(["prompt", "completion", "content"])
        text = b'"x' + bad + b'y"'
        rec = (b'{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": ' + text + b"}]}"
               if field == "content" else
               b'{"prompt": ' + (text if field == "prompt" else b'"p"') + b', "completion": '
               + (text if field == "completion" else b'"c"') + b"}")  # fmt: skip
        line = jsonl_with_a_bad_line(src, good, rec, rng)
    message = "not UTF-8 text at byte" if fault == "bytes" else "lone surrogate"
    where = re.escape(f"{src}:{line}: ")
    if what == "sft":
        with pytest.raises(InputFormatError, match=f"^{where}.*{message}"):
            SFTLoader(str(src), seq_len=64, global_batch_size=1)
        return
    out = tmp_path / "out"
    rc, err = run_cli(capsys, "prepare", str(src), "--out", str(out), "--quiet", *(["--tokenized"] * (what == "ids")))
    assert rc == 2 and re.search(where, one_line(err)) and message in err, err
    assert not (out / "manifest.json").exists()
    with pytest.raises(InputFormatError, match=f"^{where}.*{message}"):
        prepare([str(src)], str(tmp_path / "api"), TokenIds() if what == "ids" else None, progress=False)


def test_a_byte_order_mark_and_surrogate_pairs_are_still_text(tmp_path):
    """(The lines are decoded as strict UTF-8 now: a first line's byte-order mark, which ``json.loads`` of bytes
    skipped, and an escaped pair, which is one character, still read as before.)"""
    (tmp_path / "t.jsonl").write_bytes(b'\xef\xbb\xbf{"text": "a"}\n{"text": "\\ud83d\\ude00"}\n')
    stream = open_corpus(prepare([str(tmp_path / "t.jsonl")], str(tmp_path / "o"), progress=False).out)
    assert stream.read([(0, stream.num_tokens)])[0].tolist() == [97, 256, *"😀".encode(), 256]
    (tmp_path / "s.jsonl").write_bytes(b'\xef\xbb\xbf{"prompt": "a", "completion": "\\ud83d\\ude00"}\n')
    assert SFTLoader(str(tmp_path / "s.jsonl"), seq_len=16, global_batch_size=1).sources[0].num_documents == 1
    with pytest.raises(InputFormatError, match="lone surrogate"):
        ByteTokenizer().encode("x" + chr(DRAW.randint(0xD800, 0xDFFF)))


# --- 2, 3. a corpus that changed under a saved state -----------------------------------------------------------------


def test_a_grown_small_corpus_is_another_dataset_not_another_window(tmp_path):
    """(The windowed order's window follows from a small corpus's size: the state's window was compared first, and
    refused with a StateError whose hint no parameter could follow.)"""
    rng = rng_of()
    docs = texts(rng, rng.randint(150, 250), 200, 400)
    write_jsonl(tmp_path / "a.jsonl", [{"text": t} for t in docs])
    prepare([str(tmp_path / "a.jsonl")], str(tmp_path / "ds"), progress=False)
    a = PretrainLoader(str(tmp_path / "ds"), seq_len=64, global_batch_size=8)
    take(a, rng.randint(1, 4))
    state = a.state_dict()
    write_jsonl(tmp_path / "b.jsonl", [{"text": t} for t in docs + texts(rng, len(docs) * rng.randint(2, 4), 200, 400)])
    prepare([str(tmp_path / "b.jsonl")], str(tmp_path / "ds"), progress=False)
    b = PretrainLoader(str(tmp_path / "ds"), seq_len=64, global_batch_size=8)
    assert b.sources[0].describe()["shuffle"] != state["shuffle"]  # (the window grew with the corpus)
    with pytest.raises(ManifestMismatchError, match=f"saved for dataset {state['manifest_hash']}"):
        b.load_state_dict(state)
    b.load_state_dict(state, allow_manifest_change=True)
    assert next(b).position == state["consumed_samples"]
    for ld in (a, b):
        ld.close()


def test_a_corpus_edited_with_the_same_lengths_is_another_dataset(tmp_path):
    """(The hash covered the .idx alone: the same document lengths gave the same hash, and a saved state resumed
    silently on other data.)"""
    rng = rng_of()
    docs = texts(rng, rng.randint(20, 60), 20, 120)
    kw = {"shard_tokens": rng.randint(200, 2000), "progress": False}
    write_jsonl(tmp_path / "a.jsonl", [{"text": t} for t in docs])
    first = prepare([str(tmp_path / "a.jsonl")], str(tmp_path / "ds"), **kw).manifest
    idx = {p.name: p.read_bytes() for p in (tmp_path / "ds").glob("*.idx")}
    a = PretrainLoader(str(tmp_path / "ds"), seq_len=16, global_batch_size=4, shuffle=rng.choice(["windows", "global"]))
    take(a, 2)
    state = a.state_dict()
    a.close()
    j = rng.randrange(len(docs))
    k = rng.randrange(len(docs[j]))
    docs[j] = docs[j][:k] + rng.choice([c for c in string.ascii_letters if c != docs[j][k]]) + docs[j][k + 1 :]
    write_jsonl(tmp_path / "a.jsonl", [{"text": t} for t in docs])
    second = prepare([str(tmp_path / "a.jsonl")], str(tmp_path / "ds"), **kw).manifest
    assert {p.name: p.read_bytes() for p in (tmp_path / "ds").glob("*.idx")} == idx  # (only a .bin differs)
    assert second.hash != first.hash
    b = PretrainLoader(str(tmp_path / "ds"), seq_len=16, global_batch_size=4, shuffle=state["shuffle"]["mode"])
    with pytest.raises(ManifestMismatchError, match=f"saved for dataset {state['manifest_hash']}"):
        b.load_state_dict(state)
    b.close()


def test_the_hash_covers_the_tokenizer(tmp_path):
    """The same token ids (same .bin, same .idx) made by another tokenizer are another dataset."""
    rng = np.random.default_rng(DRAW.randrange(2**32))
    np.save(tmp_path / "ids.npy", rng.integers(0, 300, (rng.integers(2, 9), rng.integers(5, 50))))
    vocabs = sorted(int(v) for v in rng.choice(np.arange(300, 65000), 2, replace=False))
    hashes = {prepare([str(tmp_path / "ids.npy")], str(tmp_path / f"v{v}"), TokenIds(v), progress=False).manifest.hash
              for v in vocabs}  # fmt: skip
    assert (tmp_path / f"v{vocabs[0]}" / "shard_00000.bin").read_bytes() == (
        tmp_path / f"v{vocabs[1]}" / "shard_00000.bin"
    ).read_bytes()
    assert len(hashes) == 2
    assert {open_corpus(str(tmp_path / f"v{v}")).manifest.hash for v in vocabs} == hashes


def test_verify_finds_a_bin_changed_in_place(tmp_path, capsys):
    """A loader trusts the CRC-32C that prepare recorded (it reads no whole .bin when it starts); ``info --verify``
    reads them all and names a shard changed since."""
    rng = rng_of()
    write_jsonl(tmp_path / "a.jsonl", [{"text": t} for t in texts(rng, 40)])
    res = prepare([str(tmp_path / "a.jsonl")], str(tmp_path / "ds"), shard_tokens=rng.randint(200, 900), progress=False)
    n = len(res.manifest.shards)
    assert open_corpus(str(tmp_path / "ds")).verify() == n
    rc, err = run_cli(capsys, "info", str(tmp_path / "ds"), "--verify")
    assert rc == 0 and f"verified {n} of {n} shard(s)" in err
    victim = tmp_path / "ds" / f"shard_{rng.randrange(n):05d}.bin"
    raw = bytearray(victim.read_bytes())
    raw[rng.randrange(len(raw))] ^= 1 << rng.randrange(8)
    victim.write_bytes(bytes(raw))
    corpus = open_corpus(str(tmp_path / "ds"))  # (opens: the .idx is what it was)
    with pytest.raises(ManifestMismatchError, match=f"{victim.stem}.bin changed since its manifest was written"):
        corpus.verify()
    rc, err = run_cli(capsys, "info", str(tmp_path / "ds"), "--verify")
    assert rc == 2 and victim.stem in one_line(err)


def test_a_version_1_manifest_opens_and_hashes_as_before(tmp_path):
    """A manifest written before the .bin CRC (no ``bin_crc32c``, no version 2) keeps its hash: the .idx records
    alone, as the states saved on it hold."""
    rng = rng_of()
    write_jsonl(tmp_path / "a.jsonl", [{"text": t} for t in texts(rng, 30)])
    prepare([str(tmp_path / "a.jsonl")], str(tmp_path / "ds"), shard_tokens=rng.randint(200, 900), progress=False)
    doc = json.loads((tmp_path / "ds" / "manifest.json").read_text())
    assert doc["version"] == 2 and len(doc.pop("bin_crc32c")) == len(doc["shards"])
    v1_keys = {"name", "num_sequences", "num_documents", "num_tokens", "dtype", "idx_size", "idx_crc32"}
    assert all(set(r) == v1_keys for r in doc["shards"])  # (the records of version 1: older code reads them)
    blob = json.dumps(doc["shards"], sort_keys=True, separators=(",", ":"))
    old_hash = hashlib.sha256(blob.encode()).hexdigest()[:32]  # (the hash as the code before version 2 computed it)
    doc["version"], doc["hash"] = 1, old_hash
    (tmp_path / "ds" / "manifest.json").write_text(json.dumps(doc))
    corpus = open_corpus(str(tmp_path / "ds"))
    assert corpus.manifest.hash == old_hash and corpus.verify() == 0
    assert open_corpus([str(p.with_suffix("")) for p in sorted((tmp_path / "ds").glob("*.idx"))]).manifest.hash == (
        old_hash
    )  # (shards named by their prefixes, without the manifest: the same)


# --- 4. prepare over a dataset ---------------------------------------------------------------------------------------


def files_of(url: str, storage_options: dict | None = None) -> dict[str, bytes]:
    fs, root = fsspec.core.url_to_fs(url, **(storage_options or {}))
    fs.invalidate_cache()
    return {p[len(root) :]: fs.cat_file(p) for p in fs.find(root)}


def check_prepare_over_a_dataset(tmp_path: Path, url: str, storage_options: dict | None = None) -> None:
    """A prepare into ``url``, which holds a dataset, that fails half way leaves that dataset as it was; one that
    succeeds replaces it, leaving no shard of the old one behind (here: fewer, larger shards)."""
    rng = rng_of()
    kw = {"storage_options": storage_options, "progress": False}
    old_docs = texts(rng, rng.randint(20, 60))
    write_jsonl(tmp_path / "old.jsonl", [{"text": t} for t in old_docs])
    prepare([str(tmp_path / "old.jsonl")], url, shard_tokens=rng.randint(100, 400), **kw)
    before = files_of(url, storage_options)
    bad = tmp_path / "bad.jsonl"
    new_docs = texts(rng, rng.randint(60, 120))
    at = rng.randint(len(new_docs) // 2, len(new_docs))  # (past a few shards of the new dataset)
    bad.write_text("".join(json.dumps({"text": t}) + "\n" for t in new_docs[:at]) + "{broken\n")
    with pytest.raises(InputFormatError, match=f"bad.jsonl:{at + 1}: invalid JSON"):  # (shards written before it)
        prepare([str(bad)], url, shard_tokens=rng.randint(50, 200), batch_docs=rng.randint(1, 8), **kw)
    assert files_of(url, storage_options) == before  # (the old dataset, and nothing beside it)
    corpus = open_corpus(url, storage_options)
    assert corpus.read([(0, corpus.num_tokens)])[0].tolist() == [x for t in old_docs for x in [*t.encode(), 256]]
    write_jsonl(tmp_path / "new.jsonl", [{"text": t} for t in new_docs])
    res = prepare([str(tmp_path / "new.jsonl")], url, shard_tokens=10**6, **kw)
    assert sorted(files_of(url, storage_options)) == ["/manifest.json", "/shard_00000.bin", "/shard_00000.idx"]
    corpus = open_corpus(url, storage_options)
    assert corpus.manifest.hash == res.manifest.hash and corpus.verify() == 1
    assert corpus.read([(0, corpus.num_tokens)])[0].tolist() == [x for t in new_docs for x in [*t.encode(), 256]]


@pytest.mark.parametrize("store", ["local", "memory"])
def test_a_failed_prepare_leaves_the_dataset_it_would_replace(tmp_path, store):
    """(A prepare into a directory holding a dataset overwrote its shards as it went: bad input half way removed
    them, and the old dataset was gone.) The new dataset replaces the old one only once it is complete."""
    url = str(tmp_path / "ds") if store == "local" else f"memory://prepare-over-{DRAW.randrange(1 << 30)}/ds"
    check_prepare_over_a_dataset(tmp_path, url)
    assert not list((tmp_path / "ds").glob(".prepare-*"))


def test_a_failed_prepare_on_s3_leaves_the_dataset_it_would_replace(tmp_path, s3_bucket):
    """The same on object storage, where the switch copies and deletes."""
    bucket, opts = s3_bucket
    check_prepare_over_a_dataset(tmp_path, f"s3://{bucket}/ds", opts)


# --- 5. prepare's edge cases -----------------------------------------------------------------------------------------

EDGES = ["dir-input", "options-not-json", "options-not-object", "tokenizer-missing", "tokenizer-garbage",
         "npy-not-npy", "eos-past-int32", "shard-tokens", "out-is-a-file"]  # fmt: skip


@pytest.mark.parametrize("edge", EDGES)
def test_prepare_edge_cases_are_one_line(tmp_path, capsys, edge):
    """(A traceback for a directory as input, options that are not JSON or a tokenizer.json that is missing; a file
    that is no .npy reported as ragged rows; --eos-id past int32 blamed on vocab_size; --shard-tokens 0 replaced by
    the default.)"""
    rng = rng_of()
    src = tmp_path / "in.jsonl"
    write_jsonl(src, [{"text": t} for t in texts(rng, 5)])
    out = tmp_path / "out"
    args, expect = [str(src)], ""
    if edge == "dir-input":
        (tmp_path / "adir").mkdir()
        args, expect = [str(tmp_path / "adir")], "is a directory"
    elif edge == "options-not-json":
        args += ["--storage-options", rng.choice(["{bad", "{'a': 1}", "", "[1,"])]
        expect = "--storage-options is not JSON"
    elif edge == "options-not-object":
        args += ["--storage-options", rng.choice(["[1]", "3", '"anon"', "null"])]
        expect = "--storage-options must be a JSON object"
    elif edge == "tokenizer-missing":
        args += ["--tokenizer", str(tmp_path / "nope.json")]
        expect = "nope.json not found"
    elif edge == "tokenizer-garbage":
        (tmp_path / "tok.json").write_bytes(rng.randbytes(rng.randint(0, 64)))
        args += ["--tokenizer", str(tmp_path / "tok.json")]
        expect = "not a tokenizers tokenizer.json"
    elif edge == "npy-not-npy":
        (tmp_path / "x.npy").write_bytes(b"\x80" + rng.randbytes(rng.randint(0, 200)))  # (pickle's first byte too)
        args, expect = [str(tmp_path / "x.npy"), "--tokenized"], "not a .npy file"
    elif edge == "eos-past-int32":
        args += ["--tokenized", "--eos-id", str(rng.randint(2**31, 2**40))]
        args[0] = str(tmp_path / "ids.jsonl")
        (tmp_path / "ids.jsonl").write_text("[1, 2]\n")
        expect = "eos_id must be in [0, 2147483647]"
    elif edge == "shard-tokens":
        args += ["--shard-tokens", str(rng.choice([0, -rng.randint(1, 10**6)]))]
        expect = "shard_tokens must be a positive number of tokens"
    elif edge == "out-is-a-file":
        out.write_text("not a directory")
        expect = "is a file"
    rc, err = run_cli(capsys, "prepare", *args, "--out", str(out), "--quiet")
    assert rc == 2 and expect in one_line(err), err
    assert "ragged" not in err and "vocab_size" not in err
    assert not (out / "manifest.json").exists()


# --- 6. hostile manifests --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ('{"shards": []}', "names no shard"),
        ('{"shards": [{"name": "shard\\u000000000"}]}', r"names 'shard\\x0000000', not a shard of this dataset"),
        ('{"version": 99, "shards": [{"name": "shard_00000"}]}', "manifest version 99, this reader knows 1 to 2"),
        ('{"version": 2, "shards": [{"name": "shard_00000"}]}', "bin_crc32c is None, expected a list of 1 CRC-32C"),
        ('{"version": 2, "shards": [{"name": "x"}], "bin_crc32c": [1, 2]}', r"bin_crc32c is \[1, 2\], expected a list"),
        ('{"version": 2, "shards": [{"name": "x"}], "bin_crc32c": [-1]}', "shard 'x' has bin_crc32c -1, not a CRC-32C"),
        ('{"version": 2, "shards": [{"name": "x"}], "bin_crc32c": [1]}', "no tokenizer identity"),
    ],
)
def test_a_hostile_manifest_is_refused_naming_it(tmp_path, text, match):
    """(A shard name with a NUL was a ValueError; a manifest of no shards was refused as a dataset too small for a
    sample, naming neither the manifest nor the problem.)"""
    make_corpus(tmp_path / "ds", n_shards=1)
    (tmp_path / "ds" / "manifest.json").write_text(text)
    with pytest.raises(ManifestFormatError, match=f"manifest.json: .*{match}"):
        PretrainLoader(str(tmp_path / "ds"), seq_len=8, global_batch_size=2)


def test_a_manifest_that_is_a_directory_is_refused_naming_it(tmp_path):
    """(An IsADirectoryError traceback.)"""
    make_corpus(tmp_path / "ds", n_shards=1)
    (tmp_path / "ds" / "manifest.json").mkdir()
    with pytest.raises(ManifestFormatError, match=r"ds/manifest.json is not a file \(a directory\?\)"):
        open_corpus(str(tmp_path / "ds"))


# --- 7. blended counters ---------------------------------------------------------------------------------------------

BAD_COUNTERS = ["negative", "float", "string", "bool", "missing", "not-a-record", "total-bool", "total-negative"]


@pytest.mark.parametrize("bad", BAD_COUNTERS)
def test_malformed_counters_are_refused_when_the_state_is_loaded(tmp_path, bad):
    """(A negative per-source counter that made the total add up was accepted, and the next batch failed in numpy;
    a string one was taken as its number.)"""
    rng = rng_of()
    make_corpus(tmp_path / "a", seed=1)
    make_corpus(tmp_path / "b", seed=2)
    urls = [str(tmp_path / "a"), str(tmp_path / "b")]
    kw = {"seq_len": 8, "global_batch_size": 4, "weights": [rng.randint(1, 5), rng.randint(1, 5)], "prefetch": 0,
          "shuffle": rng.choice(["windows", "global"])}  # fmt: skip
    a = PretrainLoader(urls, **kw)
    take(a, rng.randint(1, 5))
    state = a.state_dict()
    a.close()
    i = rng.randrange(2)
    rec, other = state["sources"][i], state["sources"][1 - i]
    if bad == "negative":  # (the two still add up)
        d = rec["consumed_samples"] + rng.randint(1, 100)
        rec["consumed_samples"] -= d
        other["consumed_samples"] += d
    elif bad == "float":
        rec["consumed_samples"] += 0.5
        other["consumed_samples"] -= 0.5
    elif bad == "string":
        rec["consumed_samples"] = str(rec["consumed_samples"])
    elif bad == "bool":
        state["consumed_samples"] -= rec["consumed_samples"] - 1
        rec["consumed_samples"] = True
    elif bad == "missing":
        del rec["consumed_samples"]
    elif bad == "not-a-record":
        state["sources"][i] = rec["consumed_samples"]
    elif bad == "total-bool":
        state["consumed_samples"] = True
    else:
        state["consumed_samples"] = -rng.randint(1, 100)
    b = PretrainLoader(urls, **kw)
    with pytest.raises(StateError, match="must be a non-negative int|not a record of its counters"):
        b.load_state_dict(state)
    assert next(b).position == 0  # (refused whole: nothing of it was taken)
    b.close()


# --- 8. weights with one dataset given as a string -------------------------------------------------------------------


def test_weights_with_one_dataset_given_as_a_string(tmp_path):
    """(The string was taken as a list of datasets: its characters.)"""
    rng = rng_of()
    make_corpus(tmp_path / "ds", seed=rng.randrange(100))
    w = [rng.uniform(0.1, 3)]
    kw = {"seq_len": 8, "global_batch_size": 4, "weights": w, "seed": rng.randrange(100)}
    one, listed = PretrainLoader(str(tmp_path / "ds"), **kw), PretrainLoader([str(tmp_path / "ds")], **kw)
    for x, y in zip(take(one, 3), take(listed, 3), strict=True):
        assert x.sample_ids.tolist() == y.sample_ids.tolist()
        assert x["input_ids"].tolist() == y["input_ids"].tolist()
    recs = [{"prompt": t, "completion": t[::-1]} for t in texts(rng, 20)]
    url = write_jsonl(tmp_path / "sft.jsonl", recs)
    sft_one, sft_listed = SFTLoader(url, 64, 2, weights=w), SFTLoader([url], 64, 2, weights=w)
    assert next(sft_one)["input_ids"].tolist() == next(sft_listed)["input_ids"].tolist()
    for ld in (one, listed, sft_one, sft_listed):
        ld.close()


# --- 9. the disk cache's count ---------------------------------------------------------------------------------------


def test_disk_cache_count_is_what_the_directory_holds(tmp_path):
    """(The first put into a new cache counted its file twice, a put over another process's copy of the same range
    counted both, and a damaged file removed by a read was never taken off the count.)"""
    rng = rng_of()
    cache = DiskCache(tmp_path / "c", 1 << 30)
    size_file = tmp_path / "c" / "size"
    keys: dict[str, int] = {}
    for step in range(rng.randint(20, 60)):
        op = "put" if step == 0 or not keys else rng.choice(["put", "put", "again", "damage"])
        if op == "put":
            key = f"file|{rng.randrange(1 << 20)}|{step}"
            keys[key] = rng.randint(0, 5000)
            cache.put(key, rng.randbytes(keys[key]))
        elif op == "again":  # (two processes caching one range: the second replaces the first's file)
            key = rng.choice(sorted(keys))
            cache.put(key, rng.randbytes(keys[key]))
        else:
            key = rng.choice(sorted(keys))
            path = Path(cache._path(key))
            raw = path.read_bytes()
            path.write_bytes(raw[: rng.randrange(len(raw))] if rng.random() < 0.5 else b"garbage!" + raw[8:])
            assert cache.get(key, keys.pop(key)) is None and not path.exists()
        assert int(size_file.read_text()) == cache.size_bytes, (step, op)
