"""Token loaders on object storage: what one data-parallel rank reads, and how fast, beside MosaicML Streaming.

Writes a synthetic corpus of random (incompressible) uint16 tokens twice to each target, as MMIDIDX shards (ucp's
loaders) and as Streaming's MDS shards of the same samples (sample ``i`` = tokens ``[iL, iL + L + 1)``, one
``bytes`` column; Streaming's default 64 MiB shards), then, for each repeat and each loader, builds a fresh loader
(cold caches, another seed) as rank 0 of ``--dp-size`` and consumes batches:

- ``ucp``: ``PretrainLoader`` in its default windowed order, over a whole epoch of the rank (``--batches 0``);
- ``ucp-global``: the exact global order (``shuffle="global"``, 1 MiB blocks, a 256 MiB cache), over
  ``--global-batches`` batches only (it reads nearly the whole corpus for a few MB of samples: the "before");
- ``streaming``: ``StreamingDataset`` (0.13; shuffled, py1e) through a torch ``DataLoader`` (no worker processes:
  its downloads run in its own threads), as node 0 of ``--dp-size`` one-rank nodes, over the same number of batches
  as ``ucp``.

Reported per loader (medians): tokens/s from the first batch asked for to the last, bytes read from storage
(ucp: ``io_stats``, the ``.idx`` files included; Streaming: every GET body botocore received, ``index.json``
included), GET requests, and ``amplification`` = bytes read / the sample bytes consumed (L uint16 tokens a sample).
Targets: ``tmpfs``, ``moto`` and ``radosgw`` (bench_io.s3_servers: a throwaway one-node Ceph where installed).

    python -m bench_io.dataloader_bench --size-mb 256 --targets moto,radosgw --repeats 3 --out dl.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
import uuid
from contextlib import contextmanager

import numpy as np

from bench_io.args import at_least, output_file
from bench_io.methods import environment
from bench_io.s3_servers import start_s3_server
from dataloaders import IndexedDatasetWriter, PretrainLoader, open_corpus
from dataloaders.fetch import filesystem
from trainer.launch import free_port


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


def write_mds(ucp_url: str, mds_url: str, seq_len: int, storage_options: dict | None) -> int:
    """Streaming's MDS shards of the ucp corpus's samples (written locally, then uploaded); returns the samples."""
    from streaming import MDSWriter

    corpus = open_corpus(ucp_url, storage_options)
    n = (corpus.num_tokens - 1) // seq_len
    local = tempfile.mkdtemp(prefix="dlbench-mds-")
    try:
        with MDSWriter(out=local, columns={"tokens": "bytes"}) as w:
            chunk = 1024
            for first in range(0, n, chunk):
                stop = min(n, first + chunk)
                tokens = corpus.read([(first * seq_len, stop * seq_len + 1)])[0].astype(np.uint16)
                for i in range(stop - first):
                    w.write({"tokens": tokens[i * seq_len : (i + 1) * seq_len + 1].tobytes()})
        fs, path = filesystem(mds_url, storage_options)
        if "file" in fs.protocol or "local" in fs.protocol:
            shutil.copytree(local, path)
        else:
            fs.put(local.rstrip("/") + "/", path, recursive=True)
    finally:
        shutil.rmtree(local, ignore_errors=True)
    return n


class GetCounter:
    """The GETs botocore sends while counting (Streaming's downloads), and the body bytes they received."""

    def __init__(self) -> None:
        self.requests = 0
        self.bytes = 0
        self._lock = threading.Lock()

    @contextmanager
    def counting(self):
        import botocore.endpoint

        orig = botocore.endpoint.Endpoint._send

        def send(endpoint, request):
            response = orig(endpoint, request)
            if request.method == "GET":
                with self._lock:
                    self.requests += 1
                    self.bytes += int(response.headers.get("Content-Length", 0))
            return response

        botocore.endpoint.Endpoint._send = send
        try:
            yield self
        finally:
            botocore.endpoint.Endpoint._send = orig


def seed_of_run() -> int:
    return int(time.time_ns() % 100_000)  # another order each repeat: no help from a warm OS or server cache


def run_ucp(url: str, args, storage_options: dict | None, shuffle: str, batches: int) -> dict:
    t0 = time.perf_counter()
    kw: dict = {"cache_bytes": 256 << 20} if shuffle == "global" else {"span_windows": args.span_windows}
    loader = PretrainLoader(
        url, seq_len=args.seq_len, global_batch_size=args.global_batch, dp_rank=0, dp_size=args.dp_size,
        seed=seed_of_run(), storage_options=storage_options, shuffle=shuffle, prefetch=args.prefetch,
        num_threads=args.threads, **kw,
    )  # fmt: skip
    t1 = time.perf_counter()
    tokens = rows = 0
    for _ in range(batches):
        x = next(loader)["input_ids"]
        tokens += x.numel()
        rows += x.shape[0]
    t2 = time.perf_counter()
    loader.close(wait=True)  # reads of batches prefetched but not consumed count too
    stats = loader.io_stats
    return {"open_s": t1 - t0, "loader_s": t2 - t1, "tokens": tokens, "samples": rows,
            "bytes_read": stats.bytes_read, "index_bytes": stats.index_bytes, "requests": stats.requests}  # fmt: skip


def run_streaming(mds_url: str, args, storage_options: dict | None, batches: int) -> dict:
    import torch
    from streaming import StreamingDataset
    from streaming.base.util import clean_stale_shared_memory

    L = args.seq_len

    def collate(rows: list[dict]) -> dict:
        tokens = torch.from_numpy(
            np.stack([np.frombuffer(r["tokens"], dtype=np.uint16) for r in rows]).astype(np.int64)
        )
        return {"input_ids": tokens[:, :L], "labels": tokens[:, 1:]}

    # Node 0 of dp_size one-rank nodes, without the other ranks: Streaming reads its world from these variables, and
    # its barriers go through torch.distributed when it is initialized, here as a group of this process alone.
    env = {"WORLD_SIZE": str(args.dp_size), "RANK": "0", "LOCAL_WORLD_SIZE": "1", "LOCAL_RANK": "0"}
    if storage_options and "endpoint_url" in storage_options:
        env |= {"S3_ENDPOINT_URL": storage_options["endpoint_url"], "AWS_ACCESS_KEY_ID": storage_options["key"],
                "AWS_SECRET_ACCESS_KEY": storage_options["secret"]}  # fmt: skip
    local = tempfile.mkdtemp(prefix="dlbench-streaming-")
    counter = GetCounter()
    try:
        clean_stale_shared_memory()
        torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
        with environment(env), counter.counting():
            micro = args.global_batch // args.dp_size
            t0 = time.perf_counter()
            ds = StreamingDataset(
                remote=mds_url, local=local, shuffle=True, shuffle_seed=seed_of_run(), batch_size=micro
            )
            dl = torch.utils.data.DataLoader(ds, batch_size=micro, num_workers=0, collate_fn=collate)
            t1 = time.perf_counter()
            tokens = rows = 0
            it = iter(dl)
            for _ in range(batches):
                x = next(it)["input_ids"]
                tokens += x.numel()
                rows += x.shape[0]
            t2 = time.perf_counter()
            del it, dl, ds
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        shutil.rmtree(local, ignore_errors=True)
    return {"open_s": t1 - t0, "loader_s": t2 - t1, "tokens": tokens, "samples": rows,
            "bytes_read": counter.bytes, "index_bytes": 0, "requests": counter.requests}  # fmt: skip


def summarize(target: str, loader: str, runs: list[dict], seq_len: int) -> dict:
    med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    return {
        "target": target,
        "loader": loader,
        "tokens_per_s": statistics.median(r["tokens"] / r["loader_s"] for r in runs),
        "samples": med["samples"],
        "sample_MB": med["samples"] * seq_len * 2 / 1e6,
        "read_MB": med["bytes_read"] / 1e6,
        "amplification": statistics.median(r["bytes_read"] / (r["samples"] * seq_len * 2) for r in runs),
        "requests": med["requests"],
        "open_s": med["open_s"],
        "runs": runs,
    }


def target_url(target: str, servers: dict, tmp_dirs: list, tmpfs_dir: str) -> tuple[str, dict | None]:
    """The root URL of a fresh corpus on ``target`` and its storage options (starting its server the first time)."""
    if target == "tmpfs":
        root = tempfile.mkdtemp(prefix="dlbench-", dir=tmpfs_dir)
        tmp_dirs.append(root)
        return root, None
    if target not in servers:
        servers[target] = start_s3_server(target)
    opts = dict(servers[target].endpoint.storage_options) | {"config_kwargs": {"max_pool_connections": 32}}
    bucket = f"dlbench-{uuid.uuid4().hex[:8]}"
    fs, _ = filesystem(f"s3://{bucket}", opts)
    fs.mkdir(bucket)
    return f"s3://{bucket}", opts


def probe_ranges(target: str, servers: dict) -> dict:
    """What one ranged GET costs on ``target``: 1 MiB of a 1 MiB object and of a 64 MiB one (a shard), 32 such
    ranges at once, one 8 MiB range (a Streaming download part): medians of 10 in ms, and seconds."""
    root, opts = target_url(target, servers, [], tempfile.gettempdir())
    fs, path = filesystem(root, opts)
    rng = np.random.default_rng(0)
    fs.pipe_file(f"{path}/small", rng.bytes(1 << 20))
    fs.pipe_file(f"{path}/big", rng.bytes(64 << 20))
    out: dict = {"target": target}
    for name in ("small", "big"):
        times = []
        for _ in range(10):
            t = time.perf_counter()
            fs.cat_file(f"{path}/{name}", start=0, end=1 << 20)
            times.append(time.perf_counter() - t)
        out[f"1MiB_of_{name}_ms"] = statistics.median(times) * 1e3
    t = time.perf_counter()
    fs.cat_ranges([f"{path}/big"] * 32, [i << 20 for i in range(32)], [(i + 1) << 20 for i in range(32)])
    out["32_ranges_of_big_s"] = time.perf_counter() - t
    t = time.perf_counter()
    fs.cat_file(f"{path}/big", start=0, end=8 << 20)
    out["8MiB_of_big_s"] = time.perf_counter() - t
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench_io.dataloader_bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument(
        "--size-mb", type=at_least(1), default=256, help="corpus size in MiB of uint16 tokens (default 256)"
    )
    ap.add_argument("--shards", type=at_least(1), default=4)
    ap.add_argument("--seq-len", type=at_least(1), default=2048)
    ap.add_argument("--global-batch", type=at_least(1), default=64)
    ap.add_argument("--dp-size", type=at_least(1), default=8, help="the measured rank is rank 0 of this many")
    ap.add_argument("--batches", type=at_least(0), default=0, help="batches per run of ucp and streaming (0: an epoch)")
    ap.add_argument("--global-batches", type=at_least(1), default=100, help="batches per run of ucp-global")
    ap.add_argument("--repeats", type=at_least(1), default=3)
    ap.add_argument(
        "--span-windows", type=at_least(1), default=4, help="ucp's windowed order: windows a span (default 4)"
    )
    ap.add_argument("--prefetch", type=at_least(0), default=2)
    ap.add_argument("--threads", type=at_least(1), default=2)
    ap.add_argument("--loaders", default="ucp,ucp-global,streaming", help="comma-separated: ucp, ucp-global, streaming")
    ap.add_argument("--targets", default="moto,radosgw", help="comma-separated: tmpfs, moto, radosgw")
    ap.add_argument("--tmpfs-dir", default="/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir())
    ap.add_argument("--out", type=output_file, default=None, help="write the results as JSON here")
    ap.add_argument("--probe-ranges", action="store_true", help="only time ranged GETs on each S3 target")
    args = ap.parse_args(argv)
    if args.probe_ranges:
        servers: dict = {}
        try:
            for target in [t.strip() for t in args.targets.split(",") if t.strip() and t.strip() != "tmpfs"]:
                print(json.dumps(probe_ranges(target, servers)))
        finally:
            for server in servers.values():
                server.close()
        return 0
    loaders = [x.strip() for x in args.loaders.split(",") if x.strip()]
    if "streaming" in loaders and importlib.util.find_spec("streaming") is None:
        ap.error("the streaming loader needs mosaicml-streaming installed; or pass --loaders ucp,ucp-global")
    batches = args.batches

    results = []
    servers = {}
    tmp_dirs: list[str] = []
    try:
        for target in [t.strip() for t in args.targets.split(",") if t.strip()]:
            root, opts = target_url(target, servers, tmp_dirs, args.tmpfs_dir)
            url = root + "/corpus"
            t = time.perf_counter()
            n_tokens = write_corpus(url, args.size_mb, args.shards, opts)
            n_samples = (n_tokens - 1) // args.seq_len
            if "streaming" in loaders:
                write_mds(url, root + "/mds", args.seq_len, opts)
            print(f"[{target}] wrote {n_tokens} tokens in {time.perf_counter() - t:.1f} s", file=sys.stderr)
            # An epoch of rank 0: whole global batches, the same count for every loader.
            epoch = batches or n_samples // args.global_batch
            for _ in range(args.repeats):
                for name in loaders:
                    if name == "ucp":
                        run = run_ucp(url, args, opts, "windows", epoch)
                    elif name == "ucp-global":
                        run = run_ucp(url, args, opts, "global", args.global_batches)
                    elif name == "streaming":
                        run = run_streaming(root + "/mds", args, opts, epoch)
                    else:
                        ap.error(f"unknown loader {name!r}")
                    print(f"[{target}] {name}: {json.dumps(run)}", file=sys.stderr)
                    results.append((target, name, run))
    finally:
        for server in servers.values():
            server.close()
        for d in tmp_dirs:
            shutil.rmtree(d, ignore_errors=True)

    table = []
    for target in dict.fromkeys(t for t, _, _ in results):
        for name in loaders:
            runs = [r for t, n, r in results if t == target and n == name]
            if runs:
                table.append(summarize(target, name, runs, args.seq_len))
    print(
        f"\ncorpus {args.size_mb} MiB uint16, seq_len {args.seq_len}, global batch {args.global_batch}, rank 0 of dp "
        f"{args.dp_size} ({args.global_batch // args.dp_size} samples a batch); median of {args.repeats}"
    )
    print(f"{'target':<9}{'loader':<12}{'tokens/s':>12}{'samples':>9}{'sample MB':>11}{'read MB':>10}{'ampl.':>8}"
          f"{'GETs':>7}{'open s':>8}")  # fmt: skip
    for r in table:
        print(f"{r['target']:<9}{r['loader']:<12}{r['tokens_per_s']:>12,.0f}{r['samples']:>9.0f}{r['sample_MB']:>11.1f}"
              f"{r['read_MB']:>10.1f}{r['amplification']:>8.2f}{r['requests']:>7.0f}{r['open_s']:>8.2f}")  # fmt: skip
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "results": table}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
