"""Token loaders on object storage (issue 40.3): the windowed order (a pure function of seed, epoch and dataset,
the same on any number of ranks, resumed exactly across DP 8 -> 4 -> 2, reading each window once), the node's disk
cache (bounded and whole under several processes), ``io_stats`` counting the ``.idx`` reads, ``prepare`` of token
ids, and all of it on each S3 server."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from dataloaders import (
    DiskCache,
    InputFormatError,
    PretrainLoader,
    StateError,
    TokenIds,
    WindowOrder,
    open_corpus,
    prepare,
)
from trainer.data import PretrainTokens

from .helpers import DRAW
from .test_dataloaders import global_ids, make_corpus, take

REPO = Path(__file__).resolve().parents[1]


def draw_order() -> tuple[int, int, int, int, int]:
    """``(num_samples, seed, lanes, window, span)`` as a user's corpus and options vary them."""
    n = DRAW.choice([1, 2, 7, DRAW.randint(10, 300), DRAW.randint(300, 5000)])
    window = DRAW.choice([1, 3, DRAW.randint(1, 64)])
    return (
        n,
        DRAW.randrange(2**32),
        DRAW.choice([1, 2, 8, 64, DRAW.randint(1, 40)]),
        window,
        window * DRAW.randint(1, 6),
    )


# --- the windowed order ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", range(12))
def test_window_order_is_a_pure_function_of_seed_epoch_and_dataset(case):
    n, seed, lanes, window, span = draw_order()
    a = WindowOrder(n, seed, "ab" * 16, lanes, window, span)
    epochs = 3
    positions = np.arange(epochs * n)
    e, ids = a.samples(positions)
    np.testing.assert_array_equal(e, positions // n)
    for k in range(epochs):
        assert sorted(ids[e == k].tolist()) == list(range(n))  # each epoch: every sample once
    # Asked by another process in pieces of any size and order (ranks, prefetch, a resume): the same answer.
    b = WindowOrder(n, seed, "ab" * 16, lanes, window, span)
    cuts = sorted(DRAW.sample(range(1, len(positions)), min(5, len(positions) - 1)))
    pieces = np.split(positions, cuts)
    DRAW.shuffle(pieces)
    for piece in pieces:
        np.testing.assert_array_equal(b.samples(piece)[1], ids[piece])
        np.testing.assert_array_equal(b.lanes(piece), (piece % n) % lanes)
    if n >= 50 and n // window >= 4:
        # It depends on the seed, the epoch and the dataset; and it is a shuffle.
        assert not np.array_equal(WindowOrder(n, seed + 1, "ab" * 16, lanes, window, span).samples(positions)[1], ids)
        assert not np.array_equal(WindowOrder(n, seed, "cd" * 16, lanes, window, span).samples(positions)[1], ids)
        assert not np.array_equal(ids[:n], ids[n : 2 * n])
        assert not np.array_equal(ids[:n], np.arange(n))


@pytest.mark.parametrize("shuffle", ["windows", "global", "none"])
def test_a_global_batch_is_the_same_on_any_number_of_ranks(tmp_path, shuffle):
    seed = DRAW.randrange(2**31)
    make_corpus(tmp_path, n_shards=DRAW.randint(1, 3), docs_per_shard=40, max_len=80, seed=seed % 1000)
    G = 8 * DRAW.randint(1, 4)
    kw = {"seq_len": DRAW.choice([4, 8, 16]), "global_batch_size": G, "seed": seed, "shuffle": shuffle, "prefetch": 1}
    kw |= {"lanes": DRAW.choice([1, 4, 8, 16, 64, 5]), "window_bytes": DRAW.choice([64, 256, 4096])}
    per_dp = {}
    for dp in (1, 2, 4, 8):
        loaders = [PretrainLoader(str(tmp_path), dp_rank=r, dp_size=dp, **kw) for r in range(dp)]
        per_dp[dp] = global_ids([take(ld, 6) for ld in loaders])
        for ld in loaders:
            ld.close()
    assert per_dp[1] == per_dp[2] == per_dp[4] == per_dp[8], kw


def test_resume_exact_across_dp_8_4_2(tmp_path):
    seed = DRAW.randrange(2**31)
    make_corpus(tmp_path, n_shards=3, docs_per_shard=50, max_len=80, seed=seed % 1000)
    G, L = 16, DRAW.choice([4, 8])
    kw = {"seq_len": L, "global_batch_size": G, "seed": seed, "prefetch": 2}
    kw |= {"lanes": DRAW.choice([8, 16, 64]), "window_bytes": DRAW.choice([64, 200, 1024]), "span_windows": 2}
    steps = {8: DRAW.randint(5, 30), 4: DRAW.randint(5, 30), 2: DRAW.randint(5, 30)}
    total = sum(steps.values())

    ref = PretrainLoader(str(tmp_path), **kw)
    n = ref.sources[0].num_samples
    ref_batches = take(ref, total)
    ref.close()
    ref_ids = global_ids([ref_batches])
    ref_tokens = np.concatenate([b["input_ids"].numpy() for b in ref_batches])

    ids, tokens, state = [], [], None
    for dp, k in steps.items():
        loaders = [PretrainLoader(str(tmp_path), dp_rank=r, dp_size=dp, **kw) for r in range(dp)]
        for ld in loaders:
            if state is not None:
                ld.load_state_dict(state)
        per_rank = [take(ld, k) for ld in loaders]
        ids.extend(global_ids(per_rank))
        for step in zip(*per_rank, strict=True):
            tokens.extend(b["input_ids"].numpy() for b in step)
        state = json.loads(json.dumps(loaders[0].state_dict()))
        for ld in loaders:
            ld.close()
    assert ids == ref_ids, kw
    np.testing.assert_array_equal(np.concatenate(tokens), ref_tokens)
    assert state["consumed_samples"] == total * G and state["shuffle"]["mode"] == "windows"
    if total * G >= n:  # each whole epoch: every sample exactly once
        assert sorted(i for e, i in ids if e == 0) == list(range(n))


def test_a_state_of_one_order_is_refused_by_another(tmp_path):
    make_corpus(tmp_path)
    a = PretrainLoader(str(tmp_path), seq_len=8, global_batch_size=4, shuffle="windows")
    next(a)
    b = PretrainLoader(str(tmp_path), seq_len=8, global_batch_size=4, shuffle="global")
    with pytest.raises(StateError, match="resume it with shuffle='windows'"):
        b.load_state_dict(a.state_dict())
    # A state written before the order was recorded meant the global order.
    next(b)
    old = {k: v for k, v in b.state_dict().items() if k != "shuffle"}
    c = PretrainLoader(str(tmp_path), seq_len=8, global_batch_size=4, shuffle="global")
    c.load_state_dict(old)
    assert next(c).sample_ids.tolist() == next(b).sample_ids.tolist()
    with pytest.raises(StateError, match="resume it with shuffle='global'"):
        a.load_state_dict(old)
    # ... which is how the trainer resumes a run saved then (data.shuffle: global)
    tokens = PretrainTokens(tmp_path, seq_len=8, global_batch=4, dp_rank=0, dp_size=1, seed=0, shuffle="global")
    tokens.load_state_dict(old)
    assert tokens.loader.consumed_samples == old["consumed_samples"]
    c.close()
    a.close()
    b.close()


def epoch_reads(url: str, storage_options: dict | None, **kw) -> tuple[PretrainLoader, int]:
    """Rank 0 of dp 8 over one epoch (no read-ahead past it); returns the loader and the sample bytes it used."""
    loader = PretrainLoader(url, storage_options=storage_options, dp_rank=0, dp_size=8, prefetch=0, **kw)
    n = loader.sources[0].num_samples
    batches = n // kw["global_batch_size"]
    rows = sum(next(loader)["input_ids"].shape[0] for _ in range(batches))
    loader.close(wait=True)
    return loader, rows * kw["seq_len"] * 2  # uint16 tokens


@pytest.mark.parametrize("case", range(3))
def test_windowed_epoch_reads_each_window_once(tmp_path, case):
    """The IO aim: over an epoch, rank 0 of dp 8 reads at most 1.5x the sample bytes it consumes (here in windows
    of 1-4 KiB over a 0.5 MB corpus; the benchmark measures the defaults at 256 MiB)."""
    make_corpus(tmp_path, n_shards=2, docs_per_shard=400, max_len=600, seed=case)
    kw = {
        "seq_len": DRAW.choice([16, 32, 64]),
        "global_batch_size": [64, 128, 256][case],
        "seed": DRAW.randrange(2**31),
    }
    kw |= {"window_bytes": DRAW.choice([1024, 2048, 4096]), "span_windows": DRAW.choice([1, 2, 4])}
    kw |= {"lanes": DRAW.choice([16, 32, 64])}
    loader, used = epoch_reads(str(tmp_path), None, **kw)
    stats = loader.io_stats
    data = stats.bytes_read - stats.index_bytes
    assert used <= data <= 1.5 * used, (kw, data / used)
    # The exact global order reads blocks all over the corpus for the same samples.
    glob, used_g = epoch_reads(str(tmp_path), None, shuffle="global", block_size=4096, cache_bytes=64 << 10, **kw)
    assert glob.io_stats.bytes_read - glob.io_stats.index_bytes > 3 * used_g


# --- io_stats and the disk cache ---------------------------------------------------------------------------------


def index_sizes(fs, root: str) -> int:
    return sum(fs.size(p) for p in fs.ls(root, detail=False) if p.endswith((".idx", "manifest.json")))


def test_s3_windowed_reads_disk_cache_and_index_stats(tmp_path, s3_bucket):
    bucket, opts = s3_bucket
    url = f"s3://{bucket}/corpus"
    stream = make_corpus(url, n_shards=3, docs_per_shard=300, max_len=400, storage_options=opts)
    from dataloaders.fetch import filesystem

    fs, root = filesystem(url, opts)
    kw = {"seq_len": 32, "global_batch_size": 16, "seed": DRAW.randrange(2**31), "window_bytes": 2048}
    disk = tmp_path / "cache"
    first, used = epoch_reads(url, opts, disk_cache=str(disk), disk_cache_bytes=64 << 20, **kw)
    stats = first.io_stats
    assert stats.index_bytes == index_sizes(fs, root) and stats.index_requests == 3  # every .idx, read once
    assert used <= stats.bytes_read - stats.index_bytes <= 1.5 * used
    assert stats.disk_hits == 0 and first.disk_cache.size_bytes > 0

    # Another process of the node (here: another loader on the same directory) reads the epoch from local disk.
    again, _ = epoch_reads(url, opts, disk_cache=str(disk), disk_cache_bytes=64 << 20, **kw)
    s2 = again.io_stats
    assert (
        s2.bytes_read == s2.index_bytes and s2.disk_hits > 0 and s2.disk_bytes == stats.bytes_read - stats.index_bytes
    )

    # The same samples as from local files, and each sample is its tokens of the stream.
    check = PretrainLoader(url, storage_options=opts, disk_cache=str(disk), dp_rank=0, dp_size=8, **kw)
    b = next(check)
    for row, i in enumerate(b.sample_ids):
        np.testing.assert_array_equal(b["input_ids"][row].numpy(), stream[i * 32 : i * 32 + 32])
        np.testing.assert_array_equal(b["labels"][row].numpy(), stream[i * 32 + 1 : i * 32 + 33])
    check.close()


def test_damaged_disk_cache_file_is_read_again(tmp_path):
    stream = make_corpus(tmp_path / "data", n_shards=1, docs_per_shard=100, max_len=100)
    kw = {"seq_len": 8, "global_batch_size": 8, "window_bytes": 256, "seed": 3, "prefetch": 0}
    cache = tmp_path / "cache"
    a = PretrainLoader(str(tmp_path / "data"), disk_cache=str(cache), **kw)
    want = [b["input_ids"].numpy() for b in take(a, 4)]
    a.close()
    files = [p for p in cache.rglob("*") if p.is_file() and p.parent.name not in ("tmp",) and len(p.name) == 64]
    assert files
    for p in files:  # flip a byte of every data file (past the header), and cut one short
        raw = bytearray(p.read_bytes())
        raw[-1] ^= 0xFF
        p.write_bytes(bytes(raw))
    files[0].write_bytes(files[0].read_bytes()[:10])
    b = PretrainLoader(str(tmp_path / "data"), disk_cache=str(cache), **kw)
    got = [x for x in take(b, 4)]
    b.close()
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g["input_ids"].numpy(), w)
        for row, i in enumerate(g.sample_ids):
            np.testing.assert_array_equal(g["input_ids"][row].numpy(), stream[i * 8 : i * 8 + 8])
    assert b.io_stats.disk_damaged >= len(files) - 1 and b.io_stats.disk_hits == 0


def test_disk_cache_refuses_a_bad_bound_and_directory(tmp_path):
    from dataloaders import DataLoaderError

    with pytest.raises(DataLoaderError, match="bound"):
        DiskCache(tmp_path / "c", 0)
    (tmp_path / "file").write_text("x")
    with pytest.raises(DataLoaderError, match="file"):
        DiskCache(tmp_path / "file", 1 << 20)


@pytest.mark.slow
def test_disk_cache_bounded_and_whole_under_several_processes(tmp_path):
    """Four processes of a node share one disk cache far smaller than what they read: random ranges of shared keys
    (so that they race on the same files, on eviction and on the count), each value checked as it comes back; then
    four loader ranks at once through a small cache, their samples checked against a loader without one."""
    cap = 256 << 10
    cache = tmp_path / "cache"
    seeds = [DRAW.randrange(2**31) for _ in range(4)]
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "tests.diskcache_worker", "keys", str(cache), str(cap), str(s)], cwd=REPO
        )
        for s in seeds
    ]
    assert [p.wait(timeout=300) for p in procs] == [0] * 4, seeds
    dc = DiskCache(cache, cap)
    assert 0 < dc.size_bytes <= cap
    assert not list((cache / "tmp").iterdir())  # no file left half written

    make_corpus(tmp_path / "data", n_shards=2, docs_per_shard=300, max_len=300, seed=seeds[0] % 1000)
    out = tmp_path / "out"
    out.mkdir()
    ranks = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.diskcache_worker",
                "ranks",
                str(cache),
                str(cap),
                str(seeds[0]),
                str(tmp_path / "data"),
                str(out),
                str(r),
            ],
            cwd=REPO,
        )
        for r in range(4)
    ]
    assert [p.wait(timeout=300) for p in ranks] == [0] * 4
    assert 0 < DiskCache(cache, cap).size_bytes <= cap
    for r in range(4):
        ref = PretrainLoader(str(tmp_path / "data"), **worker_loader_kw(seeds[0]), dp_rank=r, dp_size=4)
        want = np.stack([b["input_ids"].numpy() for b in take(ref, 30)])
        ref.close()
        np.testing.assert_array_equal(np.load(out / f"rank{r}.npy"), want)


def worker_loader_kw(seed: int) -> dict:
    """The loader options of tests/diskcache_worker.py's ranks (a cache bound below the corpus: evictions)."""
    return {"seq_len": 16, "global_batch_size": 16, "seed": seed, "window_bytes": 1024, "prefetch": 2}


# --- prepare from token ids --------------------------------------------------------------------------------------


def corpus_tokens(url: str, storage_options: dict | None = None) -> np.ndarray:
    c = open_corpus(url, storage_options)
    return c.read([(0, c.num_tokens)])[0]


def test_prepare_token_ids_jsonl_and_npy(tmp_path):
    from dataloaders.__main__ import main

    rng = np.random.default_rng(DRAW.randrange(2**31))
    big = DRAW.choice([False, True])
    vocab = 200_000 if big else 50_000
    docs = [rng.integers(0, vocab, rng.integers(1, 50)).tolist() for _ in range(30)]
    (tmp_path / "ids.jsonl").write_text(
        "".join(json.dumps(d if i % 2 else {"ids": d}) + "\n" for i, d in enumerate(docs))
    )
    rows = rng.integers(0, vocab, (7, 33)).astype(np.int32)
    np.save(tmp_path / "rows.npy", rows)
    one = rng.integers(0, vocab, 91).astype(np.uint32)
    np.save(tmp_path / "one.npy", one)
    inputs = [str(tmp_path / n) for n in ("ids.jsonl", "rows.npy", "one.npy")]
    res = prepare(
        inputs, str(tmp_path / "a"), TokenIds(vocab, eos_id=0), text_key="ids", progress=False, shard_tokens=300
    )
    want = [*docs, *rows.tolist(), one.tolist()]
    assert res.num_documents == len(want) and len(res.manifest.shards) > 1
    np.testing.assert_array_equal(corpus_tokens(str(tmp_path / "a")), np.concatenate([[*d, 0] for d in want]))
    assert json.loads((tmp_path / "a" / "manifest.json").read_text())["shards"][0]["dtype"] == (
        "int32" if big else "uint16"
    )
    # The CLI, without a vocabulary: the largest id decides the dtype; no eos appended.
    argv = ["prepare", *inputs, "--out", str(tmp_path / "b"), "--tokenized", "--text-key", "ids", "--quiet"]
    assert main(argv) == 0
    np.testing.assert_array_equal(corpus_tokens(str(tmp_path / "b")), np.concatenate([np.asarray(d) for d in want]))


def bad_npy(path: Path, kind: str) -> None:
    if kind == "ragged":
        np.save(path, np.array([[1, 2], [3]], dtype=object), allow_pickle=True)
    elif kind == "float":
        np.save(path, np.ones(4, dtype=np.float32))
    elif kind == "3d":
        np.save(path, np.ones((2, 2, 2), dtype=np.int32))
    elif kind == "negative":
        np.save(path, np.array([[1, 2], [3, -4]], dtype=np.int64))
    elif kind == "huge":
        np.save(path, np.array([1, 2**40], dtype=np.uint64))
    elif kind == "garbage":
        path.write_bytes(b"not an array")


BAD_JSONL = {
    "float": ("[1, 2.5, 3]", "2.5, not an integer"),
    "string": ('{"text": [1, "7"]}', "'7', not an integer"),
    "bool": ("[1, true]", "True, not an integer"),
    "negative": ("[3, -1]", "-1 at index 1 is negative"),
    "past-int64": (f"[1, {2**70}]", "too large"),
    "below-int64": (f"[1, {-(2**70)}]", "is negative"),
    "past-int32": (f"[{2**31}]", "too large"),
    "not-a-list": ('{"text": "hello"}', "expected a list of token ids"),
}


@pytest.mark.parametrize("kind", [*(f"npy-{k}" for k in ("ragged", "float", "3d", "negative", "huge", "garbage")),
                                  *(f"jsonl-{k}" for k in BAD_JSONL), "jsonl-vocab"])  # fmt: skip
def test_prepare_token_ids_bad_input(tmp_path, kind, capsys):
    from dataloaders.__main__ import main

    good = tmp_path / "good.jsonl"
    good.write_text("[1, 2, 3]\n" * 50)
    fmt, what = kind.split("-", 1)
    bad = tmp_path / f"bad.{fmt}"
    extra = []
    if fmt == "npy":
        bad_npy(bad, what)
    elif what == "vocab":
        bad.write_text("[1, 2]\n[5, 99]\n")
        extra = ["--vocab-size", "50"]
    else:
        bad.write_text("[4, 5]\n" + BAD_JSONL[what][0] + "\n")
    out = tmp_path / "out"
    rc = main(
        ["prepare", str(good), str(bad), "--out", str(out), "--tokenized", "--shard-tokens", "20", "--quiet", *extra]
    )
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and str(bad) in err, err
    if what == "ragged":
        assert "ragged" in err
    if fmt == "jsonl":
        assert ":2:" in err and (what == "vocab" or BAD_JSONL[what][1] in err), err
    assert not out.exists() or not [p for p in out.iterdir() if p.suffix in (".bin", ".idx", ".json")]
    with pytest.raises(InputFormatError):
        prepare([str(bad)], str(tmp_path / "api"), TokenIds(50 if extra else None), progress=False)


def test_prepare_token_ids_to_s3(tmp_path, s3_bucket):
    bucket, opts = s3_bucket
    ids = np.random.default_rng(DRAW.randrange(2**31)).integers(0, 1000, (20, 64)).astype(np.int16)
    np.save(tmp_path / "ids.npy", ids)
    url = f"s3://{bucket}/tok"
    prepare([str(tmp_path / "ids.npy")], url, TokenIds(), storage_options=opts, progress=False, shard_tokens=500)
    np.testing.assert_array_equal(corpus_tokens(url, opts), ids.reshape(-1))
    loader = PretrainLoader(url, storage_options=opts, seq_len=63, global_batch_size=4, shuffle="none", prefetch=0)
    flat = ids.reshape(-1)
    np.testing.assert_array_equal(next(loader)["input_ids"].numpy(), [flat[i * 63 : i * 63 + 63] for i in range(4)])
    loader.close()


def test_dataloader_bench_runs(tmp_path, capsys):
    """bench_io.dataloader_bench end to end on a small corpus on tmpfs (Streaming is not installed here)."""
    from bench_io.dataloader_bench import main

    out = tmp_path / "dl.json"
    argv = ["--size-mb", "8", "--seq-len", "256", "--targets", "tmpfs", "--loaders", "ucp,ucp-global"]
    assert (
        main([*argv, "--repeats", "1", "--global-batches", "5", "--tmpfs-dir", str(tmp_path), "--out", str(out)]) == 0
    )
    rows = {r["loader"]: r for r in json.loads(out.read_text())["results"]}
    n = 8 * (1 << 20) // 2 // 256
    assert rows["ucp"]["samples"] == (n - 1) // 64 * 8  # an epoch of rank 0 of 8
    assert 1.0 <= rows["ucp"]["amplification"] <= 1.5 < rows["ucp-global"]["amplification"]
    assert "ucp-global" in capsys.readouterr().out


@pytest.mark.parametrize("bad", [{"lanes": 0}, {"window_bytes": 0}, {"span_windows": -1}, {"shuffle": "py1e"}])
def test_windowed_order_options_refused(tmp_path, bad):
    from dataloaders import DataLoaderError

    make_corpus(tmp_path)
    with pytest.raises(DataLoaderError, match=next(iter(bad))):
        PretrainLoader(str(tmp_path), seq_len=8, global_batch_size=4, **bad)
