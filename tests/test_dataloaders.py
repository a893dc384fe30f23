"""Tests of the dataloaders package: MMIDIDX shards, prepare CLI, elastic pretraining / SFT loaders, blending,
bad input, and ranged reads from a real (moto) S3 server."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dataloaders import (
    BatchSizeError,
    BlockCache,
    IndexedDataset,
    IndexedDatasetWriter,
    IndexFormatError,
    InputFormatError,
    ManifestMismatchError,
    PretrainLoader,
    SFTLoader,
    ShardNotFoundError,
    StateError,
    open_corpus,
    parse_index,
    prepare,
)
from dataloaders.fetch import filesystem
from dataloaders.sft import IGNORE_INDEX, pack_best_fit

from .helpers import DRAW

REPO = Path(__file__).resolve().parents[1]


def make_corpus(root, n_shards=3, docs_per_shard=40, max_len=60, seed=0, storage_options=None):
    """Random uint16 documents in ``n_shards`` shards under ``root``; returns the concatenated token stream."""
    rng = np.random.default_rng(seed)
    stream = []
    for s in range(n_shards):
        with IndexedDatasetWriter(f"{root}/shard_{s:02d}", np.uint16, storage_options) as w:
            for _ in range(docs_per_shard):
                doc = rng.integers(0, 60000, rng.integers(1, max_len))
                w.add_document(doc)
                stream.append(doc)
    return np.concatenate(stream).astype(np.int64)


def take(loader, n):
    return [next(loader) for _ in range(n)]


def global_ids(batches_per_rank):
    """Concatenate the ranks' slices of each global batch: ``[(epoch, sample id), ...]`` in global order."""
    out = []
    for per_rank in zip(*batches_per_rank, strict=True):
        for b in per_rank:
            out.extend(zip(b.epochs.tolist(), b.sample_ids.tolist(), strict=True))
    return out


# --- MMIDIDX -----------------------------------------------------------------------------------------------------


def test_parse_index_reads_the_megatron_layout_built_by_hand():
    # An .idx assembled field by field from the MMIDIDX spec, independently of our writer.
    lengths = [3, 0, 5]
    pointers = [0, 6, 6]  # int16 tokens: 2 bytes each
    docs = [0, 2, 3]  # two documents: sequences [0, 2) and [2, 3)
    raw = b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", 3)
    raw += struct.pack("<Q", 3) + struct.pack("<Q", 3)
    raw += struct.pack("<3i", *lengths) + struct.pack("<3q", *pointers) + struct.pack("<3q", *docs)
    info = parse_index(raw, "hand.idx")
    assert info.dtype == np.int16
    assert info.sequence_lengths.tolist() == lengths
    assert info.sequence_pointers.tolist() == pointers
    assert info.document_indices.tolist() == docs
    assert info.num_documents == 2 and info.num_tokens == 8


@pytest.mark.parametrize("dtype", [np.uint8, np.uint16, np.int32, np.int64])
def test_mmidx_round_trip(tmp_path, dtype):
    rng = np.random.default_rng(1)
    seqs = [rng.integers(0, 200, n) for n in (5, 0, 17, 1, 9)]
    with IndexedDatasetWriter(str(tmp_path / "d"), dtype) as w:
        w.add_sequence(seqs[0])
        w.add_sequence(seqs[1])
        w.end_document()
        for s in seqs[2:]:
            w.add_document(s)
    raw = (tmp_path / "d.idx").read_bytes()
    assert raw[:9] == b"MMIDIDX\x00\x00"
    assert struct.unpack_from("<QBQQ", raw, 9)[0] == 1
    info = parse_index(raw)
    assert info.document_indices.tolist() == [0, 2, 3, 4, 5]
    assert (tmp_path / "d.bin").stat().st_size == sum(len(s) for s in seqs) * np.dtype(dtype).itemsize
    fs, path = filesystem(str(tmp_path / "d"))
    ds = IndexedDataset(path, BlockCache(fs, block_size=16, capacity_bytes=64))
    assert len(ds) == 5
    for i, s in enumerate(seqs):
        np.testing.assert_array_equal(ds[i], s)


def test_writer_refuses_tokens_that_do_not_fit(tmp_path):
    w = IndexedDatasetWriter(str(tmp_path / "d"), np.uint8)
    with pytest.raises(ValueError, match="do not fit uint8"):
        w.add_document([1, 300])


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    lengths=st.lists(st.lists(st.integers(0, 40), min_size=1, max_size=5), min_size=1, max_size=4),
    block=st.sampled_from([0, 2, 6, 64, 4096]),
    data=st.data(),
)
def test_corpus_reads_any_range_across_shards(tmp_path_factory, lengths, block, data):
    root = tmp_path_factory.mktemp("c")
    rng = np.random.default_rng(0)
    stream = []
    for s, docs in enumerate(lengths):
        with IndexedDatasetWriter(f"{root}/s{s}", np.int32) as w:
            for n in docs:
                doc = rng.integers(-(2**31), 2**31 - 1, n)
                w.add_document(doc)
                stream.append(doc)
    stream = np.concatenate(stream)
    corpus = open_corpus([f"{root}/s{s}" for s in range(len(lengths))], block_size=block, cache_bytes=3 * block)
    ranges = data.draw(st.lists(st.tuples(st.integers(0, len(stream)), st.integers(0, len(stream))), max_size=6))
    ranges = [(min(a, b), max(a, b)) for a, b in ranges]
    for (a, b), got in zip(ranges, corpus.read(ranges), strict=True):
        np.testing.assert_array_equal(got, stream[a:b])


def test_block_cache_is_bounded_and_counts_bytes(tmp_path):
    data = bytes(range(256)) * 64  # 16 KiB
    (tmp_path / "f").write_bytes(data)
    fs, path = filesystem(str(tmp_path / "f"))
    cache = BlockCache(fs, block_size=1024, capacity_bytes=4096)
    cache.stats.record_ranges = True
    assert cache.read(path, 1000, 3000, len(data)) == data[1000:3000]
    assert cache.stats.bytes_read == 3072 and cache.stats.requests == 3
    assert cache.read(path, 1500, 2500, len(data)) == data[1500:2500]  # all hits
    assert cache.stats.bytes_read == 3072 and cache.stats.cache_hits == 2
    for start in range(0, len(data), 1024):
        assert cache.read(path, start, start + 10, len(data)) == data[start : start + 10]
    assert cache.cached_bytes <= 4096
    assert all(s % 1024 == 0 and e - s <= 1024 for _, s, e in cache.stats.ranges)


# --- prepare -----------------------------------------------------------------------------------------------------


def test_prepare_cli_byte_tokenizer(tmp_path):
    (tmp_path / "a.txt").write_text("héllo world\n")
    lines = [{"text": f"document number {i}"} for i in range(30)]
    (tmp_path / "b.jsonl").write_text("\n".join(json.dumps(r) for r in lines) + "\n")
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "dataloaders", "prepare", str(tmp_path / "a.txt"), str(tmp_path / "b.jsonl"),
         "--out", str(out), "--shard-tokens", "200"],
        cwd=REPO, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "31 documents" in proc.stdout
    assert "prepare" in proc.stderr  # the progress bar
    manifest = json.loads((out / "manifest.json").read_text())
    assert len(manifest["shards"]) > 1 and manifest["tokenizer"]["name"] == "byte"
    corpus = open_corpus(str(out))
    assert corpus.manifest.hash == manifest["hash"]
    stream = corpus.read([(0, corpus.num_tokens)])[0]
    texts = ["héllo world\n"] + [r["text"] for r in lines]
    expected = np.concatenate([np.array([*t.encode(), 256]) for t in texts])
    np.testing.assert_array_equal(stream, expected)


def test_prepare_cli_reports_bad_jsonl(tmp_path):
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{"txt": "no text key"}\n')
    proc = subprocess.run(
        [sys.executable, "-m", "dataloaders", "prepare", str(tmp_path / "bad.jsonl"), "--out", str(tmp_path / "o"),
         "--quiet"],
        cwd=REPO, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert proc.returncode == 2
    assert "bad.jsonl:2" in proc.stderr and "'text'" in proc.stderr


def test_prepare_with_a_tokenizers_json(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    from dataloaders.tokenize import HFTokenizer

    tok = tokenizers.Tokenizer(WordLevel({"<unk>": 0, "</s>": 1, "hello": 2, "world": 3}, unk_token="<unk>"))
    tok.pre_tokenizer = Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "d.jsonl").write_text('{"text": "hello world"}\n{"text": "world hello foo"}\n')
    res = prepare([str(tmp_path / "d.jsonl")], str(tmp_path / "o"), HFTokenizer(str(tmp_path / "tokenizer.json")),
                  progress=False)  # fmt: skip
    assert res.num_documents == 2
    stream = open_corpus(str(tmp_path / "o")).read([(0, 7)])[0]
    assert stream.tolist() == [2, 3, 1, 3, 2, 0, 1]


# --- pretraining loader ------------------------------------------------------------------------------------------


def test_pretrain_samples_are_megatron_windows(tmp_path):
    stream = make_corpus(tmp_path)
    L = 16
    loader = PretrainLoader(str(tmp_path), seq_len=L, global_batch_size=4, block_size=512, cache_bytes=4096)
    assert loader.sources[0].num_samples == (len(stream) - 1) // L
    for b in take(loader, 5):
        for row, i in enumerate(b.sample_ids):
            np.testing.assert_array_equal(b["input_ids"][row].numpy(), stream[i * L : i * L + L])
            np.testing.assert_array_equal(b["labels"][row].numpy(), stream[i * L + 1 : i * L + L + 1])
    loader.close()


def test_elastic_300_batches_dp1_equals_dp1_dp2_dp4(tmp_path):
    make_corpus(tmp_path, n_shards=2, docs_per_shard=60, max_len=80)
    G, L = 8, 8
    kw = {"seq_len": L, "global_batch_size": G, "seed": 7, "block_size": 1024, "prefetch": 3}

    ref = PretrainLoader(str(tmp_path), **kw)
    n = ref.sources[0].num_samples
    assert 300 * G > 2 * n  # the run crosses epoch boundaries
    ref_batches = take(ref, 300)
    ref_ids = global_ids([ref_batches])
    ref_tokens = np.concatenate([b["input_ids"].numpy() for b in ref_batches])
    ref.close()

    ids, tokens = [], []
    state = None
    for dp in (1, 2, 4):
        loaders = [PretrainLoader(str(tmp_path), dp_rank=r, dp_size=dp, **kw) for r in range(dp)]
        for ld in loaders:
            if state is not None:
                ld.load_state_dict(state)
        per_rank = [take(ld, 100) for ld in loaders]
        assert all(b["input_ids"].shape == (G // dp, L) for b in per_rank[0])
        ids.extend(global_ids(per_rank))
        for step in zip(*per_rank, strict=True):
            tokens.extend(b["input_ids"].numpy() for b in step)
        states = [ld.state_dict() for ld in loaders]
        assert all(s == states[0] for s in states)  # a state is global, the same on every rank
        state = json.loads(json.dumps(states[0]))  # and plain JSON
        for ld in loaders:
            ld.close()

    assert ids == ref_ids
    np.testing.assert_array_equal(np.concatenate(tokens), ref_tokens)
    assert state["consumed_samples"] == 300 * G and state["epoch"] == 300 * G // n
    # Within each epoch: every sample exactly once, none skipped.
    for e in range(300 * G // n):
        assert sorted(i for ep, i in ids if ep == e) == list(range(n))


def test_state_counts_consumed_not_prefetched(tmp_path):
    make_corpus(tmp_path)
    loader = PretrainLoader(str(tmp_path), seq_len=8, global_batch_size=4, prefetch=5, block_size=256)
    first = next(loader)
    assert loader.state_dict()["consumed_samples"] == 4
    rest = take(loader, 3)
    fresh = PretrainLoader(str(tmp_path), seq_len=8, global_batch_size=4, prefetch=0, block_size=256)
    fresh.load_state_dict({**loader.state_dict(), "consumed_samples": 4})
    assert [b.sample_ids.tolist() for b in take(fresh, 3)] == [b.sample_ids.tolist() for b in rest]
    assert first.position == 0 and rest[0].position == 4
    loader.close()
    fresh.close()


def test_order_depends_on_seed_and_not_on_dp(tmp_path):
    make_corpus(tmp_path)
    a = PretrainLoader(str(tmp_path), seq_len=8, global_batch_size=4, seed=1)
    b = PretrainLoader(str(tmp_path), seq_len=8, global_batch_size=4, seed=2)
    assert next(a).sample_ids.tolist() != next(b).sample_ids.tolist()
    a.close()
    b.close()


# --- blending ----------------------------------------------------------------------------------------------------


def test_blend_deterministic_weighted_and_elastic(tmp_path):
    make_corpus(tmp_path / "x", n_shards=1, seed=1)
    make_corpus(tmp_path / "y", n_shards=2, seed=2)
    data = [str(tmp_path / "x"), str(tmp_path / "y")]
    kw = {"seq_len": 8, "global_batch_size": 10, "weights": [0.7, 0.3], "seed": 3, "block_size": 512}
    a, b = PretrainLoader(data, **kw), PretrainLoader(data, **kw)
    run_a, run_b = take(a, 20), take(b, 20)
    key = [(x.sources.tolist(), x.sample_ids.tolist()) for x in run_a]
    assert key == [(x.sources.tolist(), x.sample_ids.tolist()) for x in run_b]
    counts = np.zeros(2)
    for x in run_a:
        counts += np.bincount(x.sources, minlength=2)
        total = counts.sum()
        assert abs(counts[0] - 0.7 * total) <= 1 and abs(counts[1] - 0.3 * total) <= 1
    state = a.state_dict()
    assert [s["consumed_samples"] for s in state["sources"]] == counts.astype(int).tolist()
    more_a = take(a, 6)
    # Resume the blend on dp=2.
    ranks = [PretrainLoader(data, dp_rank=r, dp_size=2, **kw) for r in range(2)]
    for r in ranks:
        r.load_state_dict(json.loads(json.dumps(state)))
    assert global_ids([take(r, 6) for r in ranks]) == global_ids([more_a])
    with pytest.raises(ManifestMismatchError):  # other weights: another dataset
        PretrainLoader(data, **{**kw, "weights": [0.5, 0.5]}).load_state_dict(state)
    for ld in (a, b, *ranks):
        ld.close()


# --- SFT ---------------------------------------------------------------------------------------------------------


def sft_records(n=40, seed=0):
    rng = np.random.default_rng(seed)
    recs = []
    for i in range(n):
        if i % 3 == 0:
            recs.append({"messages": [{"role": "user", "content": f"q{i}" * int(rng.integers(1, 4))},
                                      {"role": "assistant", "content": f"A{i}" * int(rng.integers(1, 6))}]})  # fmt: skip
        else:
            recs.append({"prompt": f"p{i}:" * int(rng.integers(1, 5)), "completion": f"C{i}" * int(rng.integers(1, 8))})
    return recs


def render(rec):
    if "messages" in rec:
        return "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in rec["messages"])
    return rec["prompt"] + rec["completion"]


def write_jsonl(path, recs):
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return str(path)


def test_pack_best_fit_fills_packs():
    lengths = np.array([5, 3, 7, 2, 8, 1, 4])
    packs = pack_best_fit(lengths, 10)
    assert sorted(i for p in packs for i in p) == list(range(7))
    assert all(lengths[p].sum() <= 10 for p in packs)
    assert len(packs) == 3  # 30 tokens in 10-token packs


def test_sft_packing_masks_and_positions(tmp_path):
    recs = sft_records()
    url = write_jsonl(tmp_path / "sft.jsonl", recs)
    L = 64
    loader = SFTLoader(url, seq_len=L, global_batch_size=4, seed=0)
    src = loader.sources[0]
    seen_docs = []
    for p in range(src.num_samples):
        row = src.pack(p)
        ids, labels, mask, pos, doc = (row[k] for k in ("input_ids", "labels", "loss_mask", "position_ids",
                                                         "document_ids"))  # fmt: skip
        assert ids.shape == (L,)
        assert np.array_equal(mask == 1, labels != IGNORE_INDEX)
        for j in range(doc.max() + 1):
            where = np.nonzero(doc == j)[0]
            assert np.array_equal(pos[where], np.arange(len(where)))  # positions restart per document
            text = bytes(t for t in ids[where] if t < 256).decode()
            trained = bytes(t for t in labels[where] if 0 <= t < 256).decode()
            rec = next(r for r in recs if text == render(r))
            seen_docs.append(json.dumps(rec))
            target = rec["messages"][1]["content"] + "\n" if "messages" in rec else rec["completion"]
            assert trained == target  # exactly the completion is trained, never the prompt
            assert labels[where[-2]] == 256 and labels[where[-1]] == IGNORE_INDEX  # EOS trained; no cross-doc label
        assert np.all(labels[doc == -1] == IGNORE_INDEX)
    assert sorted(seen_docs) == sorted(json.dumps(r) for r in recs)  # each record packed exactly once
    b = next(loader)
    assert set(b.keys()) == {"input_ids", "labels", "loss_mask", "position_ids", "document_ids"}
    assert b["input_ids"].shape == (4, L)
    loader.close()


def test_sft_elastic_resume(tmp_path):
    url = write_jsonl(tmp_path / "sft.jsonl", sft_records(60))
    kw = {"seq_len": 48, "global_batch_size": 4, "seed": 5}
    ref = SFTLoader(url, **kw)
    ref_ids = global_ids([take(ref, 30)])
    ref.close()
    ids, state = [], None
    for dp in (1, 2, 4):
        loaders = [SFTLoader(url, dp_rank=r, dp_size=dp, **kw) for r in range(dp)]
        for ld in loaders:
            if state is not None:
                ld.load_state_dict(state)
        ids.extend(global_ids([take(ld, 10) for ld in loaders]))
        state = loaders[0].state_dict()
        for ld in loaders:
            ld.close()
    assert ids == ref_ids


def test_sft_bad_record(tmp_path):
    url = write_jsonl(tmp_path / "s.jsonl", [{"prompt": "a", "completion": "b"}, {"question": "?"}])
    with pytest.raises(InputFormatError, match=r"s\.jsonl:2"):
        SFTLoader(url, seq_len=16, global_batch_size=1)


# --- bad input ---------------------------------------------------------------------------------------------------


def test_damaged_idx_magic(tmp_path):
    make_corpus(tmp_path, n_shards=1)
    p = tmp_path / "shard_00.idx"
    raw = bytearray(p.read_bytes())
    raw[0:3] = b"XXX"
    p.write_bytes(bytes(raw))
    with pytest.raises(IndexFormatError, match=r"shard_00\.idx: not an MMIDIDX index: magic at offset 0"):
        PretrainLoader(str(tmp_path), seq_len=8, global_batch_size=2)


@pytest.mark.parametrize(("code", "dtype"), [(6, "float64"), (7, "float32"), (9, "")])
def test_an_idx_of_another_dtype_than_token_ids_is_refused(tmp_path, code, dtype):
    """(Megatron's format holds floats too: a float shard loaded as truncated token ids.)"""
    make_corpus(tmp_path, n_shards=1)
    p = tmp_path / "shard_00.idx"
    raw = bytearray(p.read_bytes())
    raw[17] = code
    p.write_bytes(bytes(raw))
    match = f"dtype code {code} at offset 17 is {dtype}, not token ids" if dtype else "unknown dtype code 9"
    with pytest.raises(IndexFormatError, match=rf"shard_00\.idx: {match}"):
        open_corpus(str(tmp_path))


def test_truncated_idx(tmp_path):
    make_corpus(tmp_path, n_shards=1)
    p = tmp_path / "shard_00.idx"
    p.write_bytes(p.read_bytes()[:-5])
    with pytest.raises(IndexFormatError, match=r"shard_00\.idx: truncated: \d+ bytes, expected \d+ for 40 sequences"):
        open_corpus(str(tmp_path))
    p.write_bytes(b"MMIDIDX")
    with pytest.raises(IndexFormatError, match="truncated header"):
        open_corpus(str(tmp_path))


def test_damaged_idx_pointer_and_truncated_bin(tmp_path):
    make_corpus(tmp_path, n_shards=1)
    p = tmp_path / "shard_00.idx"
    good = p.read_bytes()
    raw = bytearray(good)
    off = 34 + 4 * 40 + 8 * 3  # the pointer of sequence 3
    raw[off : off + 8] = struct.pack("<q", 12345)
    p.write_bytes(bytes(raw))
    with pytest.raises(IndexFormatError, match="sequence 3 pointer is 12345, expected"):
        open_corpus(str(tmp_path))
    p.write_bytes(good)
    b = tmp_path / "shard_00.bin"
    b.write_bytes(b.read_bytes()[:-2])
    with pytest.raises(IndexFormatError, match=r"shard_00\.bin: size \d+ bytes, but its \.idx describes"):
        open_corpus(str(tmp_path))


def test_missing_shard(tmp_path):
    make_corpus(tmp_path)
    with pytest.raises(ShardNotFoundError, match=r"nothere\.idx not found"):
        open_corpus([str(tmp_path / "shard_00"), str(tmp_path / "nothere")])
    os.remove(tmp_path / "shard_01.bin")
    with pytest.raises(ShardNotFoundError, match=r"shard_01\.bin not found"):
        open_corpus(str(tmp_path))


def test_missing_shard_named_by_manifest(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", [{"text": f"some text {i} " * 5} for i in range(20)])
    prepare([str(tmp_path / "a.jsonl")], str(tmp_path / "o"), shard_tokens=100, progress=False)
    os.remove(tmp_path / "o" / "shard_00002.idx")
    with pytest.raises(ShardNotFoundError, match=r"shard_00002\.idx not found"):
        open_corpus(str(tmp_path / "o"))


def test_shard_changed_since_manifest(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", [{"text": f"some text {i} " * 5} for i in range(20)])
    prepare([str(tmp_path / "a.jsonl")], str(tmp_path / "o"), shard_tokens=100, progress=False)
    with IndexedDatasetWriter(str(tmp_path / "o" / "shard_00001")) as w:
        w.add_document([1, 2, 3])
    with pytest.raises(ManifestMismatchError, match="shard_00001 changed since its manifest was written"):
        open_corpus(str(tmp_path / "o"))


def test_resume_on_another_dataset_is_refused_unless_overridden(tmp_path):
    make_corpus(tmp_path / "a", seed=1)
    make_corpus(tmp_path / "b", seed=2)
    a = PretrainLoader(str(tmp_path / "a"), seq_len=8, global_batch_size=4)
    take(a, 3)
    state = a.state_dict()
    b = PretrainLoader(str(tmp_path / "b"), seq_len=8, global_batch_size=4)
    with pytest.raises(ManifestMismatchError, match=f"saved for dataset {state['manifest_hash']}"):
        b.load_state_dict(state)
    b.load_state_dict(state, allow_manifest_change=True)
    assert next(b).position == 12
    with pytest.raises(StateError, match="seq_len=8, this loader has seq_len=16"):
        PretrainLoader(str(tmp_path / "a"), seq_len=16, global_batch_size=4).load_state_dict(state)
    with pytest.raises(StateError, match="unknown loader state version"):
        a.load_state_dict({**state, "version": 99})
    for ld in (a, b):
        ld.close()


@pytest.mark.parametrize("shuffle", ["windows", "global"])
def test_resume_on_a_grown_dataset_keeps_the_counters_in_either_order(tmp_path, shuffle):
    """(With the windowed order, a window's size follows from the corpus: a grown dataset's state was refused for
    its other window, allow_manifest_change or not.)"""
    make_corpus(tmp_path / "a", n_shards=1, docs_per_shard=30)
    make_corpus(tmp_path / "b", n_shards=DRAW.choice([3, 5]), docs_per_shard=60, seed=3)
    a = PretrainLoader(str(tmp_path / "a"), seq_len=8, global_batch_size=4, shuffle=shuffle)
    take(a, 3)
    b = PretrainLoader(str(tmp_path / "b"), seq_len=8, global_batch_size=4, shuffle=shuffle)
    b.load_state_dict(a.state_dict(), allow_manifest_change=True)
    assert next(b).position == 12
    other = PretrainLoader(str(tmp_path / "b"), seq_len=8, global_batch_size=4, shuffle="none")
    with pytest.raises(StateError, match=f"state has shuffle='{shuffle}', this loader has shuffle='none'"):
        other.load_state_dict(a.state_dict(), allow_manifest_change=True)  # (the kind of order still counts)
    for ld in (a, b, other):
        ld.close()


def test_an_sft_state_of_another_shuffle_is_refused(tmp_path):
    """(The SFT loader's state said nothing of its order: one of shuffle=False resumed a shuffled loader.)"""
    url = write_jsonl(tmp_path / "sft.jsonl", sft_records(40))
    plain = SFTLoader(url, seq_len=48, global_batch_size=4, shuffle=False)
    take(plain, 1)
    shuffled = SFTLoader(url, seq_len=48, global_batch_size=4)
    with pytest.raises(StateError, match=r"state has shuffle=\{'mode': 'none'\}.*resume it with shuffle=False"):
        shuffled.load_state_dict(plain.state_dict())
    again = SFTLoader(url, seq_len=48, global_batch_size=4, shuffle=False)
    again.load_state_dict(plain.state_dict())
    assert next(again).sample_ids.tolist() == next(plain).sample_ids.tolist()
    for ld in (plain, shuffled, again):
        ld.close()


def test_a_dataset_whose_path_has_glob_characters_opens(tmp_path):
    """(fsspec's `cat` of a list expands globs: `run[1]` matched only `run1`, and the shards were not found.)"""
    write_jsonl(tmp_path / "a.jsonl", [{"text": f"some text {i} " * 5} for i in range(20)])
    ds = tmp_path / "sweep" / "run[1]" / "ds*?"
    prepare([str(tmp_path / "a.jsonl")], str(ds), shard_tokens=100, progress=False)
    for source in (str(ds), str(ds / "shard_00000")):
        loader = PretrainLoader(source, seq_len=8, global_batch_size=2)
        assert next(loader)["input_ids"].shape == (2, 8)
        loader.close()


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ('{"version": 1, "shards": [{"name": "shard_00000"', "is not JSON"),
        ("[]", "not a dataset manifest"),
        ('{"shards": {"name": "x"}}', "not a dataset manifest"),
        ('{"shards": [{"name": "../../etc/x"}]}', "names '../../etc/x', not a shard of this dataset"),
        ('{"shards": [{"name": "/abs/x"}]}', "names '/abs/x', not a shard of this dataset"),
        ('{"shards": [{"nom": "x"}]}', "names None"),
    ],
)
def test_a_damaged_dataset_manifest_is_refused_naming_it(tmp_path, text, match):
    from dataloaders.errors import ManifestFormatError

    write_jsonl(tmp_path / "a.jsonl", [{"text": f"some text {i} " * 5} for i in range(20)])
    prepare([str(tmp_path / "a.jsonl")], str(tmp_path / "o"), shard_tokens=100, progress=False)
    (tmp_path / "o" / "manifest.json").write_text(text)
    with pytest.raises(ManifestFormatError, match=f"manifest.json.*{match}"):
        open_corpus(str(tmp_path / "o"))


def test_a_failed_upload_of_prepare_raises_its_error_and_leaves_no_shard(tmp_path, monkeypatch):
    """(The failed upload's temporary file was removed twice: a FileNotFoundError of it hid the upload's error, and
    the shards uploaded before stayed, without a manifest.)"""
    import fsspec
    from fsspec.implementations.memory import MemoryFileSystem

    put_file, calls = MemoryFileSystem.put_file, []

    def failing_put_file(self, lpath, rpath, *args, **kwargs):
        calls.append(rpath)
        if len(calls) == 2:
            raise ConnectionError(f"connection reset while uploading {rpath}")
        return put_file(self, lpath, rpath, *args, **kwargs)

    monkeypatch.setattr(MemoryFileSystem, "put_file", failing_put_file)
    write_jsonl(tmp_path / "a.jsonl", [{"text": f"some text {i} " * 5} for i in range(40)])
    url = f"memory://prepare-{DRAW.randrange(1 << 30)}/ds"
    with pytest.raises(ConnectionError, match="connection reset while uploading .*shard_00001.bin"):
        prepare([str(tmp_path / "a.jsonl")], url, shard_tokens=100, progress=False)
    fs = fsspec.filesystem("memory")
    assert not fs.exists(url) or fs.find(url) == []


def test_global_batch_not_divisible_by_dp(tmp_path):
    make_corpus(tmp_path)
    with pytest.raises(BatchSizeError, match="global batch size 8 is not divisible by the data-parallel size 3"):
        PretrainLoader(str(tmp_path), seq_len=8, global_batch_size=8, dp_rank=0, dp_size=3)
    with pytest.raises(BatchSizeError, match="dp rank 4 is not in"):
        PretrainLoader(str(tmp_path), seq_len=8, global_batch_size=8, dp_rank=4, dp_size=4)
    with pytest.raises(BatchSizeError, match=r"dp rank 0 is not in \[0, dp size 0\)"):  # (a ZeroDivisionError)
        PretrainLoader(str(tmp_path), seq_len=8, global_batch_size=8, dp_rank=0, dp_size=0)


@pytest.mark.parametrize("lines", ["", "[]\n[]\n"])
def test_a_corpus_without_tokens_is_refused_in_one_line_wherever_it_goes(tmp_path, lines):
    """Into a new directory it was a FileNotFoundError traceback; into an existing one a manifest of no shards."""
    src = tmp_path / "ids.jsonl"
    src.write_text(lines)
    for out in (tmp_path / "new", tmp_path / "existing"):
        if out.name == "existing":
            out.mkdir()
        result = subprocess.run(
            [sys.executable, "-m", "dataloaders", "prepare", str(src), "--out", str(out), "--tokenized", "--quiet"],
            capture_output=True,
            text=True,
            check=False,
            cwd=Path(__file__).resolve().parents[1],
        )
        assert result.returncode == 2 and result.stderr.strip().count("\n") == 0, result.stderr
        assert "no document with a token in it" in result.stderr
        assert not (out / "manifest.json").exists()


# --- S3 ----------------------------------------------------------------------------------------------------------


def test_s3_ranged_reads(tmp_path, s3_bucket):
    bucket, opts = s3_bucket
    url = f"s3://{bucket}/corpus"
    stream = make_corpus(url, n_shards=2, docs_per_shard=1000, max_len=400, storage_options=opts)
    make_corpus(tmp_path, n_shards=2, docs_per_shard=1000, max_len=400)  # the same bytes, locally
    bin_bytes = 2 * len(stream)
    kw = {"seq_len": 32, "global_batch_size": 4, "block_size": 4096, "cache_bytes": 64 * 1024, "seed": 11,
          "shuffle": "global"}  # fmt: skip
    s3 = PretrainLoader(url, storage_options=opts, **kw)
    local = PretrainLoader(str(tmp_path), **kw)
    assert s3.manifest_hash == local.manifest_hash  # the hash names content, not location
    s3.io_stats.record_ranges = True
    for x, y in zip(take(s3, 5), take(local, 5), strict=True):
        np.testing.assert_array_equal(x["input_ids"].numpy(), y["input_ids"].numpy())
        for row, i in enumerate(x.sample_ids):
            np.testing.assert_array_equal(x["input_ids"][row].numpy(), stream[i * 32 : i * 32 + 32])
    stats = s3.io_stats
    # At most two blocks per sample of the 5 batches taken and the 2 prefetched: ranges, not whole files.
    assert 0 < stats.bytes_read <= 7 * 4 * 2 * 4096 < bin_bytes / 3
    assert all(s % 4096 == 0 and e - s <= 4096 for _, s, e in stats.ranges)
    assert all(p.endswith(".bin") for p, _, _ in stats.ranges)
    s3.close()
    local.close()


def test_prepare_to_s3_and_info_cli(tmp_path, s3_bucket, capsys):
    from dataloaders.__main__ import main

    bucket, opts = s3_bucket
    write_jsonl(tmp_path / "d.jsonl", [{"text": f"doc {i}"} for i in range(10)])
    url = f"s3://{bucket}/prep"
    res = prepare([str(tmp_path / "d.jsonl")], url, shard_tokens=30, storage_options=opts, progress=False)
    assert len(res.manifest.shards) > 1
    assert main(["info", url, "--storage-options", json.dumps(opts)]) == 0
    assert json.loads(capsys.readouterr().out)["hash"] == res.manifest.hash
    assert main(["info", f"s3://{bucket}/nothing", "--storage-options", json.dumps(opts)]) == 2
    assert "not found" in capsys.readouterr().err


def test_failed_read_consumes_nothing_and_is_retried(tmp_path):
    make_corpus(tmp_path, n_shards=1)
    kw = {"seq_len": 8, "global_batch_size": 4, "block_size": 64, "cache_bytes": 64}
    loader = PretrainLoader(str(tmp_path), prefetch=3, **kw)
    take(loader, 2)
    os.rename(tmp_path / "shard_00.bin", tmp_path / "moved.bin")
    with pytest.raises(ShardNotFoundError, match="vanished"):  # once the read-ahead batches run out
        for _ in range(5):
            consumed = loader.state_dict()["consumed_samples"]
            next(loader)
    assert loader.state_dict()["consumed_samples"] == consumed
    os.rename(tmp_path / "moved.bin", tmp_path / "shard_00.bin")
    expected = PretrainLoader(str(tmp_path), prefetch=0, **kw)
    expected.load_state_dict(loader.state_dict())
    assert next(loader).sample_ids.tolist() == next(expected).sample_ids.tolist()
    loader.close()
    expected.close()


def test_exact_range_mode_reads_only_sample_bytes(tmp_path):
    make_corpus(tmp_path)
    loader = PretrainLoader(str(tmp_path), seq_len=8, global_batch_size=4, block_size=0, prefetch=0, shuffle="global")
    batches = take(loader, 3)
    loader.close(wait=True)
    stats = loader.io_stats
    idx_bytes = sum(p.stat().st_size for p in tmp_path.glob("*.idx"))
    assert stats.index_bytes == idx_bytes and stats.index_requests == 3  # the .idx files are counted, read once
    assert stats.bytes_read - stats.index_bytes == 3 * 4 * 9 * 2  # exactly (8 + 1) uint16 tokens per sample
    assert stats.requests - stats.index_requests == 3 * 4
    ref = PretrainLoader(str(tmp_path), seq_len=8, global_batch_size=4, shuffle="global")
    for a, b in zip(batches, take(ref, 3), strict=True):
        np.testing.assert_array_equal(a["input_ids"].numpy(), b["input_ids"].numpy())
    ref.close()


def test_block_cache_threads_share_inflight_blocks(tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    data = os.urandom(64 * 1024)
    (tmp_path / "f").write_bytes(data)
    fs, path = filesystem(str(tmp_path / "f"))
    cache = BlockCache(fs, block_size=4096, capacity_bytes=1 << 20)
    reqs = [(path, i * 1000, i * 1000 + 3000, len(data)) for i in range(60)]
    with ThreadPoolExecutor(8) as pool:
        outs = list(pool.map(lambda r: cache.read(*r), reqs * 4))
    assert all(o == data[s:e] for o, (_, s, e, _) in zip(outs, reqs * 4, strict=True))
    assert cache.stats.bytes_read == len(data)  # every block fetched exactly once
