"""How long an async save holds the caller, against a plain copy of the same bytes, with nothing else running.

    python scripts/async_blocking.py [--size 1GiB] [--small N] [--saves 5] [--dir /dev/shm]

For each writer (threads, process): one CheckpointManager(mode="async"), `--saves` saves of the same synthetic
state (bench_io's "mixed" transformer state; with --small N, N tensors of 1-64 KiB instead), each preceded by a
timed copy of the state into preallocated, pre-faulted memory (the floor). The first save of each manager (staging
allocated, pages faulted in) is dropped; the table gives medians of the rest: the copy, the blocking time, the
snapshot alone, blocking / copy, and the whole save (to its commit).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import ucp
from bench_io.args import parse_size
from bench_io.methods import timed_copy
from bench_io.state import make_state, small_specs, transformer_state


def measure(writer: str, state, saves: int, parent: str) -> dict[str, float]:
    root = tempfile.mkdtemp(prefix="ucp-blocking-", dir=parent)
    manager = ucp.CheckpointManager(root, mode="async", keep_last=1, writer=writer)
    rows = []
    try:
        for step in range(saves):
            copy_s, _ = timed_copy(state)
            t0 = time.perf_counter()
            handle = manager.save(step, state.tree)
            blocking_s = time.perf_counter() - t0
            manager.wait()
            rows.append((copy_s, blocking_s, handle.snapshot_s, time.perf_counter() - t0))
    finally:
        manager.close()
        shutil.rmtree(root, ignore_errors=True)
    warm = rows[1:]
    return {
        "copy_s": statistics.median(r[0] for r in warm),
        "blocking_s": statistics.median(r[1] for r in warm),
        "snapshot_s": statistics.median(r[2] for r in warm),
        "ratio": statistics.median(r[1] / r[0] for r in warm),
        "save_s": statistics.median(r[3] for r in warm),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", type=parse_size, default=1 << 30)
    p.add_argument("--small", type=int, default=0, help="N tensors of 1-64 KiB instead of the --size state")
    p.add_argument("--saves", type=int, default=5)
    p.add_argument("--dir", default="/dev/shm", help="where the checkpoints go (default /dev/shm)")
    args = p.parse_args()
    state = make_state("small", small_specs(args.small)) if args.small else transformer_state(args.size)
    print(
        f"{state.nbytes / 2**20:.0f} MiB, {len(state.flat)} tensors, {args.saves - 1} warm saves per writer (medians)"
    )
    print(f"{'writer':<8} {'copy s':>7} {'blocking s':>10} {'snapshot s':>10} {'blocking/copy':>13} {'save s':>7}")
    for writer in ("threads", "process"):
        r = measure(writer, state, args.saves, args.dir)
        print(
            f"{writer:<8} {r['copy_s']:>7.3f} {r['blocking_s']:>10.3f} {r['snapshot_s']:>10.3f} {r['ratio']:>13.2f}"
            f" {r['save_s']:>7.2f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
