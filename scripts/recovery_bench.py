"""Elastic recovery: from a lost node to the first step of the shrunk job, by where the checkpoint is read from.

    python scripts/recovery_bench.py [--size-gib 1] [--tiers hot-in-place,hot,disk,s3] [--repeats 1] [--overhead-steps 6]

(A script, not a bench_io command: it runs the trainer, and bench_io imports only ucp.)

The reference trainer runs a Mixtral sized so that its training state (fp32 parameters and Adam's two moments)
is about --size-gib, as an elastic job of two simulated nodes (trainer/elastic.py: torchrun agents, c10d
rendezvous) of two processes each, layout tp2pp2, checkpointing every 2 steps. Once a step is committed, node b
is lost (SIGKILL to its agent and processes); node a's agent re-forms the job on two processes (tp2pp1), which
restore and train one step. Per tier:

- hot:  the hot tier in /dev/shm (`--ckpt-local`, the durable URL never drained to): node b's pieces from their
        replica in node a's memory;
- TIER-in-place (hot-in-place, disk-in-place, s3-in-place): the same read, with no restart: node a's processes
        re-form the job among themselves (`--regroup-store`, trainer/regroup.py) and restore in the same processes;
- disk: the durable URL on the local disk (--dir), page cache dropped before the restore (posix_fadvise);
- s3:   the durable URL on a moto S3 server on 127.0.0.1.

Reported: seconds from the kill to the first new step, split into failure detection and restart (kill -> new
worker processes; in place: kill -> the survivors' failed step), process start and group formation (in place:
agreeing on the survivors, the new group and the model), the restore itself and the first step; bytes the job
read from each tier; steps lost (trained after the checkpoint, trained again).

Then the cost of a checkpoint every step: median step time of the 4-process job without checkpoints, with a
checkpoint every step to the durable URL alone (disk, or s3 with --overhead-target s3), and with the hot tier
(durable every 1000th: never in the run); the stall is the step time over the no-checkpoint run's.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench_io.s3_servers import MotoServer
from bench_io.targets import drop_page_cache, s3_filesystem
from trainer import elastic
from ucp.distributed.tiers import run_directory
from ucp.protocol import commit
from ucp.storage import LocalStorage, open_storage

CONFIG = REPO / "trainer" / "configs" / "tiny-moe.yaml"


def model_overrides(size_gib: float) -> list[str]:
    """`--set` overrides for a Mixtral whose fp32 parameters and Adam state take about size_gib: h=512, 8 experts
    of ffn 1024, as many layers (a multiple of 2, for pp2) as the size needs."""
    h, ffn, experts, vocab = 512, 1024, 8, 4096
    per_layer = 4 * h * h + 2 * h + experts * h + experts * 3 * h * ffn
    layers = max(2, round((size_gib * 2**30 / 12 - 2 * vocab * h) / per_layer))
    layers += layers % 2
    return [
        f"model.hidden_size={h}",
        f"model.ffn_hidden_size={ffn}",
        f"model.num_experts={experts}",
        f"model.vocab_size={vocab}",
        f"model.num_layers={layers}",
        "model.num_heads=8",
        "model.num_kv_heads=4",
        "data.source=synthetic",
        "data.global_batch_size=4",
        "data.micro_batch_size=1",
        "data.seq_len=32",
    ]


def read_metrics(path: Path) -> list[dict]:
    out = []
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                pass
    return out


def node_dir(work: Path, name: str) -> Path:
    return Path("/dev/shm") / f"{work.name}-node-{name}"


def job_of(work: Path, argv: list[str], local: bool, env: dict[str, str], in_place: bool = False) -> elastic.Job:
    node_args = (lambda name: ["--ckpt-local", str(node_dir(work, name))]) if local else None
    return elastic.Job(argv, work.name, work, node_args=node_args, env=env, in_place=in_place)


def stop(job: elastic.Job, work: Path) -> None:
    job.stop()
    for name in ("a", "b"):
        shutil.rmtree(node_dir(work, name), ignore_errors=True)


def first_new_step(records: list[dict]) -> dict | None:
    """The first step the restarted job logged (an old worker may log a step after the kill: it comes before)."""
    restart = next((i for i, r in enumerate(records) if r.get("event") == "restart"), None)
    return None if restart is None else next((r for r in records[restart:] if "event" not in r), None)


def recover(tier: str, work: Path, base: list[str], url: str, env: dict[str, str], page_cache: str) -> dict[str, Any]:
    """One failure and recovery with the checkpoint read from `tier`; returns the figures."""
    metrics = work / "metrics.jsonl"
    argv = [
        *base,
        "--layout",
        "tp2pp2,tp2pp1",
        "--steps",
        "1000",
        "--save-interval",
        "2",
        "--ckpt",
        url,
        "--ckpt-mode",
        "sync",
        "--metrics-file",
        str(metrics),
    ]
    where, in_place = tier.removesuffix("-in-place"), tier.endswith("-in-place")
    hot = where == "hot"
    if hot:
        argv += ["--durable-every", "1000"]
    job = job_of(work, argv, hot, env, in_place=in_place)
    # (hot: node b's directory, which gets the step only once its replicas are in place and the step is published)
    storage = LocalStorage(run_directory(str(node_dir(work, "b")), url)) if hot else open_storage(url)

    def committed() -> list[int]:
        try:
            return commit.committed_steps(storage)
        except Exception:  # noqa: BLE001 -- a directory being written: nothing yet
            return []

    try:
        job.start("a")
        job.start("b")
        job.wait_for(lambda: max(committed(), default=0) >= 2, "step 2 committed", timeout=1800)
        before = [r["step"] for r in read_metrics(metrics) if "event" not in r]
        if where == "disk":
            drop_page_cache(Path(url), page_cache)
        killed_at = job.lose("b")
        job.wait_for(lambda: first_new_step(read_metrics(metrics)) is not None, "the first new step", timeout=1800)
    finally:
        stop(job, work)
    records = read_metrics(metrics)
    restart = next(r for r in records if r.get("event") == "restart")
    first = first_new_step(records)
    assert first is not None
    last_before = max((s for s in before), default=0)
    process_start = first["time"] - restart["time_to_first_step_s"]
    return {
        "tier": tier,
        "to_first_step_s": first["time"] - killed_at,
        "detect_and_restart_s": process_start - killed_at,
        "start_and_group_s": restart["time_to_first_step_s"] - restart["restore_s"] - first["step_time_s"],
        "restore_s": restart["restore_s"],
        "first_step_s": first["step_time_s"],
        "bytes_by_tier": restart["bytes_by_tier"],
        "resumed_from": restart["from_step"],
        "steps_lost": max(0, last_before - restart["from_step"]),
        "in_place": restart.get("in_place", False),  # (hot-in-place falls back to a restart where it cannot)
    }


def overhead(kind: str, work: Path, base: list[str], url: str, steps: int, env: dict[str, str]) -> float:
    """Median step time (steps 3..) of the 4-process job: no checkpoints, a checkpoint every step to `url`, or every
    step to the hot tier."""
    metrics = work / "metrics.jsonl"
    argv = [*base, "--layout", "tp2pp2", "--steps", str(steps + 2), "--metrics-file", str(metrics)]
    if kind != "none":
        argv += ["--ckpt", url, "--save-interval", "1"]
    if kind == "hot":
        argv += ["--durable-every", "1000"]
    job = job_of(work, argv, kind == "hot", env)
    try:
        job.start("a")
        job.start("b")
        job.wait(3600)
    finally:
        stop(job, work)
    times = [r["step_time_s"] for r in read_metrics(metrics) if "event" not in r and r["step"] > 2]
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="scripts/recovery_bench.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--size-gib", type=float, default=1.0, help="training state size (fp32 params + Adam), GiB")
    p.add_argument(
        "--tiers", default="hot-in-place,hot,disk,s3", help="comma list of hot, disk, s3, each also as TIER-in-place"
    )
    p.add_argument("--repeats", type=int, default=1, help="recoveries per tier (medians reported)")
    p.add_argument("--overhead-steps", type=int, default=6, help="steps timed per overhead run (0: skip)")
    p.add_argument("--overhead-target", default="disk", choices=("disk", "s3"), help="durable URL of the overhead runs")
    p.add_argument("--dir", default="/var/tmp", help="parent of the disk checkpoints")
    p.add_argument("--page-cache", default="auto", help="how the disk tier's page cache is dropped (bench_io --cache)")
    p.add_argument("--json", help="write the figures here")
    p.add_argument("--keep", action="store_true", help="keep each job's logs and metrics (the path is printed)")
    args = p.parse_args(argv)
    tiers = [t.strip() for t in args.tiers.split(",") if t.strip()]
    base = [
        "-m",
        "trainer",
        "--config",
        str(CONFIG),
        *(x for o in model_overrides(args.size_gib) for x in ("--set", o)),
    ]
    server = MotoServer() if any(t.startswith("s3") for t in tiers) or args.overhead_target == "s3" else None
    env = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1"}
    if server is not None:
        env["AWS_ENDPOINT_URL"] = server.url
        os.environ.update(env)
        s3_filesystem({"endpoint_url": server.url}).mkdir("recovery")
    results: dict[str, Any] = {"size_gib": args.size_gib, "recovery": [], "overhead": {}}
    root = Path(tempfile.mkdtemp(prefix="bench-recovery-", dir=args.dir))
    try:
        for tier in tiers:
            for repeat in range(args.repeats):
                work = root / f"{tier}-{repeat}"
                work.mkdir()
                url = f"s3://recovery/{tier}-{repeat}" if tier.startswith("s3") else str(work / "ckpt")
                row = recover(tier, work, base, url, env, args.page_cache)
                results["recovery"].append(row)
                gib = {k: v / 2**30 for k, v in row["bytes_by_tier"].items()}
                print(
                    f"[recovery] {tier:<12} kill -> first step {row['to_first_step_s']:6.1f} s  (detect+restart "
                    f"{row['detect_and_restart_s']:.1f}, start+group {row['start_and_group_s']:.1f}, restore "
                    f"{row['restore_s']:.1f}, step {row['first_step_s']:.1f})  read GiB: node {gib['local']:.2f} peers "
                    f"{gib['peers']:.2f} durable {gib['durable']:.2f}  steps lost {row['steps_lost']}"
                    + ("  (in place)" if row["in_place"] else ""),
                    flush=True,
                )
        if args.overhead_steps:
            for kind in ("none", "durable", "hot"):
                work = root / f"overhead-{kind}"
                work.mkdir()
                url = f"s3://recovery/overhead-{kind}" if args.overhead_target == "s3" else str(work / "ckpt")
                results["overhead"][kind] = overhead(kind, work, base, url, args.overhead_steps, env)
                print(f"[overhead] {kind:<8} median step {results['overhead'][kind]:.2f} s", flush=True)
    finally:
        if args.keep:
            print(f"logs and metrics kept under {root}", flush=True)
        else:
            shutil.rmtree(root, ignore_errors=True)
        if server is not None:
            server.close()
    summarize(results)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


def summarize(results: dict[str, Any]) -> None:
    by_tier: dict[str, list[dict]] = {}
    for row in results["recovery"]:
        by_tier.setdefault(row["tier"], []).append(row)
    medians = {t: statistics.median(r["to_first_step_s"] for r in rows) for t, rows in by_tier.items()}
    print(f"\nrecovery, {results['size_gib']:g} GiB of training state, 4 -> 2 processes (medians):")
    for tier, seconds in medians.items():
        restore = statistics.median(r["restore_s"] for r in by_tier[tier])
        print(f"  {tier:<12} {seconds:6.1f} s to the first new step, of which restore {restore:5.1f} s")
    for hot in ("hot-in-place", "hot"):
        for other in ("hot", "disk", "s3", "disk-in-place", "s3-in-place"):
            if hot in medians and other in medians and other != hot:
                print(f"  {hot} vs {other}: {medians[other] / medians[hot]:.2f}x faster")
    o = results["overhead"]
    if o:
        durable_stall, hot_stall = o["durable"] - o["none"], o["hot"] - o["none"]
        print(
            f"checkpoint every step: step {o['none']:.2f} s without, stall {durable_stall:+.2f} s to the durable URL "
            f"alone, {hot_stall:+.2f} s with the hot tier ({hot_stall / durable_stall if durable_stall > 0 else float('nan'):.2f}x)"
        )


if __name__ == "__main__":
    sys.exit(main())
