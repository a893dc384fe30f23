"""Data-loader throughput: tokens/s delivered to one data-parallel rank, against a raw read of the same bytes.

Prepares a synthetic corpus of random (incompressible) uint16 tokens in MMIDIDX shards on each target
(tmpfs: /dev/shm; S3: a moto server on 127.0.0.1, started in a child process unless --endpoint-url is given),
then for each repeat builds a fresh PretrainLoader (cold block cache) as rank 0 of --dp-size and consumes
--batches batches. The baseline reads exactly the block ranges that loader run fetched, with fsspec
``cat_ranges`` and the same block size, so the ratio is the loader's own overhead (sampling, copies, threads).
``amplification`` is bytes read / token bytes delivered: random samples pull whole blocks
(``--block-size 0`` reads exact sample ranges, uncached).

    python -m bench_io.dataloader_bench --size-mb 64 --repeats 3 --out dl.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid

import numpy as np

from dataloaders import IndexedDatasetWriter, PretrainLoader
from dataloaders.fetch import filesystem
from trainer.launch import free_port


def start_moto() -> tuple[subprocess.Popen, str]:
    """moto's ThreadedMotoServer in a child process, so its Python threads do not share the loader's GIL."""
    port = free_port()
    code = (
        "import time; from moto.server import ThreadedMotoServer; "
        f"s = ThreadedMotoServer(ip_address='127.0.0.1', port={port}, verbose=False); s.start(); "
        "print('ready', flush=True); time.sleep(10**9)"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    if proc.stdout.readline().strip() != "ready":
        proc.kill()
        raise RuntimeError("moto server did not start")
    return proc, f"http://127.0.0.1:{port}"


def write_corpus(root: str, size_mb: int, n_shards: int, storage_options: dict | None, seed: int = 0) -> int:
    """Random uint16 documents (lengths 100..8000 tokens) totalling ``size_mb``; returns the token count."""
    rng = np.random.default_rng(seed)
    per_shard = size_mb * (1 << 20) // 2 // n_shards
    total = 0
    for s in range(n_shards):
        with IndexedDatasetWriter(f"{root}/shard_{s:03d}", np.uint16, storage_options) as w:
            left = per_shard
            while left > 0:
                n = int(min(left, rng.integers(100, 8000)))
                w.add_document(rng.integers(0, 65000, n, dtype=np.uint16))
                left -= n
        total += per_shard
    return total


def run_loader(url: str, args, storage_options: dict | None) -> dict:
    t0 = time.perf_counter()
    loader = PretrainLoader(
        url,
        seq_len=args.seq_len,
        global_batch_size=args.global_batch,
        dp_rank=0,
        dp_size=args.dp_size,
        seed=int(time.time_ns() % 1000),  # another order each repeat: no help from a warm OS or server cache
        storage_options=storage_options,
        block_size=args.block_size,
        cache_bytes=args.cache_mb << 20,
        prefetch=args.prefetch,
        num_threads=args.threads,
    )
    loader.io_stats.record_ranges = True
    t1 = time.perf_counter()
    tokens = 0
    for _ in range(args.batches):
        tokens += next(loader)["input_ids"].numel()
    t2 = time.perf_counter()
    loader.close(wait=True)  # reads of batches prefetched but not consumed count too, in both columns
    stats = loader.io_stats
    ranges = list(stats.ranges)
    fs, _ = filesystem(url, storage_options)
    t3 = time.perf_counter()
    raw = fs.cat_ranges([p for p, _, _ in ranges], [s for _, s, _ in ranges], [e for _, _, e in ranges])
    t4 = time.perf_counter()
    assert sum(len(r) for r in raw) == stats.bytes_read
    return {
        "open_s": t1 - t0,
        "loader_s": t2 - t1,
        "tokens": tokens,
        "bytes_read": stats.bytes_read,
        "requests": stats.requests,
        "raw_s": t4 - t3,
    }


def summarize(target: str, runs: list[dict]) -> dict:
    med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    tok_s = statistics.median(r["tokens"] / r["loader_s"] for r in runs)
    raw_tok_s = statistics.median(r["tokens"] / r["raw_s"] for r in runs)
    return {
        "target": target,
        "loader_tokens_per_s": tok_s,
        "loader_read_MBps": statistics.median(r["bytes_read"] / r["loader_s"] / 1e6 for r in runs),
        "raw_tokens_per_s": raw_tok_s,
        "raw_read_MBps": statistics.median(r["bytes_read"] / r["raw_s"] / 1e6 for r in runs),
        "ratio": tok_s / raw_tok_s,
        "amplification": med["bytes_read"] / (med["tokens"] * 2),
        "open_s": med["open_s"],
        "requests": med["requests"],
        "runs": runs,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench_io.dataloader_bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--size-mb", type=int, default=128, help="corpus size in MiB of uint16 tokens (default 128)")
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--global-batch", type=int, default=64)
    ap.add_argument("--dp-size", type=int, default=8, help="the measured rank is rank 0 of this many")
    ap.add_argument("--batches", type=int, default=50, help="batches consumed per repeat")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--block-size", type=int, default=1 << 20, help="cache block in bytes; 0: exact ranges")
    ap.add_argument("--cache-mb", type=int, default=256)
    ap.add_argument("--prefetch", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--targets", default="tmpfs,s3", help="comma-separated: tmpfs, s3")
    ap.add_argument("--tmpfs-dir", default="/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir())
    ap.add_argument("--endpoint-url", default=None, help="an S3 endpoint to use instead of starting moto")
    ap.add_argument("--bucket", default=None, help="existing bucket (default: a new one)")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args(argv)

    results = []
    moto = None
    tmp_root = None
    try:
        for target in [t.strip() for t in args.targets.split(",") if t.strip()]:
            if target == "tmpfs":
                tmp_root = tempfile.mkdtemp(prefix="dlbench-", dir=args.tmpfs_dir)
                url, opts = os.path.join(tmp_root, "corpus"), None
            elif target == "s3":
                endpoint = args.endpoint_url
                if endpoint is None:
                    moto, endpoint = start_moto()
                    os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
                    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
                opts = {"endpoint_url": endpoint, "config_kwargs": {"max_pool_connections": 32}}
                if moto is not None:
                    opts.update(key="testing", secret="testing")
                bucket = args.bucket or f"dlbench-{uuid.uuid4().hex[:8]}"
                fs, _ = filesystem(f"s3://{bucket}", opts)
                if not fs.exists(bucket):
                    fs.mkdir(bucket)
                url = f"s3://{bucket}/corpus"
            else:
                ap.error(f"unknown target {target!r}")
            t = time.perf_counter()
            n_tokens = write_corpus(url, args.size_mb, args.shards, opts)
            print(f"[{target}] wrote {n_tokens} tokens in {time.perf_counter() - t:.1f} s", file=sys.stderr)
            runs = [run_loader(url, args, opts) for _ in range(args.repeats)]
            results.append(summarize(target, runs))
    finally:
        if moto is not None:
            moto.kill()
            moto.wait()
        if tmp_root is not None:
            shutil.rmtree(tmp_root, ignore_errors=True)

    micro = args.global_batch // args.dp_size
    print(
        f"\ncorpus {args.size_mb} MiB uint16, seq_len {args.seq_len}, global batch {args.global_batch}, "
        f"dp {args.dp_size} (rank 0: {micro} samples/batch), {args.batches} batches, block {args.block_size} B, "
        f"median of {args.repeats}"
    )
    header = f"{'target':<8}{'loader tok/s/rank':>19}{'raw tok/s':>14}{'ratio':>7}{'loader MB/s':>13}"
    header += f"{'raw MB/s':>10}{'ampl.':>7}{'open s':>8}"
    print(header)
    for r in results:
        print(
            f"{r['target']:<8}{r['loader_tokens_per_s']:>19,.0f}{r['raw_tokens_per_s']:>14,.0f}{r['ratio']:>7.2f}"
            f"{r['loader_read_MBps']:>13.1f}{r['raw_read_MBps']:>10.1f}{r['amplification']:>7.1f}{r['open_s']:>8.2f}"
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
