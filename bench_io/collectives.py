"""`python -m bench_io collectives` (or `ucp bench collectives`): the collectives a checkpoint's pieces move over,
timed as nccl-tests times them.

For each world size given, that many local processes form one torch.distributed group (NCCL when CUDA has a GPU
per rank, gloo otherwise; `--backend` to choose) and sweep all-reduce (sum), reduce-scatter, all-gather,
broadcast and all-to-all over message sizes from --min-bytes to --max-bytes, doubling. Each (collective, size):

1. correctness, untimed: every rank fills its input with values that depend on its rank and the position, and
   every element of every rank's output is compared with what the collective must give (exact: small integers);
2. --warmup untimed iterations, then --iters timed back to back, between two barriers (and CUDA synchronisation
   with NCCL); a rank's time is the mean per iteration and the reported time the slowest rank's (nccl-tests
   takes the maximum over ranks);
3. algorithm bandwidth = size / time, and bus bandwidth = algbw times nccl-tests' factor for the collective (its
   doc/PERFORMANCE.md): all-reduce 2(n-1)/n, reduce-scatter, all-gather and all-to-all (n-1)/n, broadcast 1.

"size" is nccl-tests' too: all-reduce and broadcast the buffer; all-gather the gathered output (n chunks);
reduce-scatter the input (n chunks); all-to-all the buffer each rank sends (n chunks). Sizes are rounded down to a
multiple of n elements. Prints a table per world size; --json writes every row, --chart a picture of bus
bandwidth against size (one panel per world size, one line per collective).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from trainer.launch import free_port

from .args import output_file, parse_list, parse_size

COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "all_to_all")


def bus_factor(collective: str, n: int) -> float:
    """nccl-tests' bus bandwidth factor (doc/PERFORMANCE.md): what each rank's links carry, per byte of size."""
    if collective == "all_reduce":
        return 2 * (n - 1) / n
    if collective in ("reduce_scatter", "all_gather", "all_to_all"):
        return (n - 1) / n
    if collective == "broadcast":
        return 1.0
    raise ValueError(f"unknown collective {collective!r}")


def _pattern(numel: int, device: torch.device) -> torch.Tensor:
    """0..6 repeating: makes a misplaced element visible, and sums of a few ranks stay exact."""
    return (torch.arange(numel, device=device) % 7).to(torch.float32)


def _op(
    collective: str, numel: int, rank: int, n: int, device: torch.device
) -> tuple[Callable[[], Any], Callable[[], bool]]:
    """(run once, check the result) for a collective over a `numel`-element (size) message."""
    chunk = numel // n
    if collective == "all_reduce":
        buf = torch.empty(numel, device=device)
        base = _pattern(numel, device)

        def run() -> None:
            dist.all_reduce(buf)

        def check() -> bool:
            buf.copy_(base + rank + 1)
            dist.all_reduce(buf)
            return bool(torch.equal(buf, base * n + n * (n + 1) / 2))

        return run, check
    if collective == "reduce_scatter":
        src = _pattern(numel, device) + rank + 1
        out = torch.empty(chunk, device=device)
        rs = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

        def run() -> None:
            rs(out, src)

        def check() -> bool:
            rs(out, src)
            mine = _pattern(numel, device)[rank * chunk : (rank + 1) * chunk]
            return bool(torch.equal(out, mine * n + n * (n + 1) / 2))

        return run, check
    if collective == "all_gather":
        src = _pattern(chunk, device) + rank
        out = torch.empty(chunk * n, device=device)
        ag = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

        def run() -> None:
            ag(out, src)

        def check() -> bool:
            ag(out, src)
            want = torch.cat([_pattern(chunk, device) + r for r in range(n)])
            return bool(torch.equal(out, want))

        return run, check
    if collective == "broadcast":
        buf = _pattern(numel, device) + 0.5 if rank == 0 else torch.zeros(numel, device=device)

        def run() -> None:
            dist.broadcast(buf, src=0)

        def check() -> bool:
            if rank != 0:
                buf.zero_()
            dist.broadcast(buf, src=0)
            return bool(torch.equal(buf, _pattern(numel, device) + 0.5))

        return run, check
    if collective == "all_to_all":
        # rank r sends chunk j the value r*n + j; it receives from rank j that chunk: j*n + r
        src = torch.cat([_pattern(chunk, device) + rank * n + j for j in range(n)])
        out = torch.empty(chunk * n, device=device)

        def run() -> None:
            dist.all_to_all_single(out, src)

        def check() -> bool:
            dist.all_to_all_single(out, src)
            want = torch.cat([_pattern(chunk, device) + j * n + rank for j in range(n)])
            return bool(torch.equal(out, want))

        return run, check
    raise ValueError(f"unknown collective {collective!r}")


def sizes(min_bytes: int, max_bytes: int) -> list[int]:
    out, s = [], max(4, min_bytes)
    while s <= max_bytes:
        out.append(s)
        s *= 2
    return out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _worker(rank: int, n: int, port: int, backend: str, cfg: dict[str, Any], out: str) -> None:
    warnings.filterwarnings("ignore", category=FutureWarning)
    device = torch.device(f"cuda:{rank}") if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=n)
    rows = []
    try:
        for collective in cfg["collectives"]:
            for size in sizes(cfg["min_bytes"], cfg["max_bytes"]):
                numel = size // 4 // n * n  # float32, a multiple of n elements
                if numel == 0:
                    continue
                run, check = _op(collective, numel, rank, n, device)
                ok = torch.tensor([1.0 if check() else 0.0], device=device)
                for _ in range(cfg["warmup"]):
                    run()
                _sync(device)
                dist.barrier()
                t0 = time.perf_counter()
                for _ in range(cfg["iters"]):
                    run()
                _sync(device)
                elapsed = torch.tensor([(time.perf_counter() - t0) / cfg["iters"]], device=device)
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
                dist.all_reduce(ok, op=dist.ReduceOp.MIN)
                seconds, nbytes = float(elapsed.item()), numel * 4
                algbw = nbytes / seconds / 1e9
                rows.append(
                    {
                        "collective": collective,
                        "world": n,
                        "bytes": nbytes,
                        "time_us": seconds * 1e6,
                        "algbw_gbps": algbw,
                        "busbw_gbps": algbw * bus_factor(collective, n),
                        "correct": bool(ok.item() == 1.0),
                    }
                )
                del run, check
        if rank == 0:
            Path(out).write_text(json.dumps(rows))
    finally:
        dist.destroy_process_group()


def choose_backend(asked: str, world: int) -> str:
    if asked != "auto":
        return asked
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return "nccl" if dist.is_nccl_available() and gpus >= world else "gloo"


def sweep(world: int, backend: str, cfg: dict[str, Any]) -> list[dict[str, Any]]:
    """One world size's rows (rank processes spawned, joined)."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.json")
        mp.start_processes(
            _worker, args=(world, free_port(), backend, cfg, out), nprocs=world, start_method="spawn", join=True
        )
        return json.loads(Path(out).read_text())


def table(rows: list[dict[str, Any]]) -> str:
    lines = []
    for world in sorted({r["world"] for r in rows}):
        lines.append(f"world size {world}")
        lines.append(
            f"{'collective':<15}{'size (B)':>12}{'time (us)':>14}{'algbw GB/s':>12}{'busbw GB/s':>12}  correct"
        )
        for r in (r for r in rows if r["world"] == world):
            lines.append(
                f"{r['collective']:<15}{r['bytes']:>12}{r['time_us']:>14.1f}{r['algbw_gbps']:>12.3f}"
                f"{r['busbw_gbps']:>12.3f}  {'yes' if r['correct'] else 'NO'}"
            )
    return "\n".join(lines)


def chart(rows: list[dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    worlds = sorted({r["world"] for r in rows})
    fig, axes = plt.subplots(1, len(worlds), figsize=(5.5 * len(worlds), 4), squeeze=False)
    for ax, world in zip(axes[0], worlds):
        for collective in COLLECTIVES:
            mine = [r for r in rows if r["world"] == world and r["collective"] == collective]
            if mine:
                ax.plot([r["bytes"] for r in mine], [r["busbw_gbps"] for r in mine], marker="o", ms=3, label=collective)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("message size (bytes)")
        ax.set_ylabel("bus bandwidth (GB/s)")
        ax.set_title(f"{world} ranks ({rows[0].get('backend', '')})")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="bench_io collectives", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--worlds", default="2,4", help="world sizes, comma-separated (default 2,4)")
    p.add_argument("--collectives", type=parse_list(list(COLLECTIVES)), default=list(COLLECTIVES))
    p.add_argument("--min-bytes", type=parse_size, default=1 << 10, help="smallest message (default 1KiB)")
    p.add_argument("--max-bytes", type=parse_size, default=256 << 20, help="largest message (default 256MiB)")
    p.add_argument("--iters", type=int, default=20, help="timed iterations per size (default 20, as nccl-tests)")
    p.add_argument("--warmup", type=int, default=5, help="untimed iterations first (default 5, as nccl-tests)")
    p.add_argument(
        "--backend", choices=("auto", "gloo", "nccl"), default="auto", help="default: NCCL with a GPU per rank"
    )
    p.add_argument("--json", type=output_file, help="write every row here")
    p.add_argument("--chart", help="write a PNG of bus bandwidth against size here")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        worlds = [int(w) for w in args.worlds.split(",") if w.strip()]
    except ValueError:
        raise SystemExit(f"bench_io collectives: --worlds {args.worlds!r}: expected sizes like 2,4") from None
    if not worlds or min(worlds) < 2 or args.iters < 1 or args.warmup < 0 or args.min_bytes > args.max_bytes:
        raise SystemExit("bench_io collectives: world sizes >= 2, --iters >= 1, --warmup >= 0, min <= max bytes")
    cfg = {k: getattr(args, k) for k in ("collectives", "min_bytes", "max_bytes", "iters", "warmup")}
    rows: list[dict[str, Any]] = []
    for world in worlds:
        backend = choose_backend(args.backend, world)
        print(f"bench_io collectives: {world} ranks over {backend} ...", file=sys.stderr, flush=True)
        rows += [dict(r, backend=backend) for r in sweep(world, backend, cfg)]
    print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps({"config": cfg, "rows": rows}, indent=1))
    if args.chart:
        chart(rows, args.chart)
    bad = [r for r in rows if not r["correct"]]
    if bad:
        print(f"bench_io collectives: WRONG RESULTS in {len(bad)} rows (first: {bad[0]})", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
