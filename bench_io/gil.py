"""`python -m bench_io.gil` (or `python -m bench_io gil`): does a writer *process* beat writer *threads*?

An async save's writer threads share the trainer's GIL: while they checksum, encode and issue writes, the
training loop's Python (op dispatch, autograd, the optimizer) waits for the lock. A writer process that maps the
staging memory (ucp.engine.writer_process) takes the GIL out of the picture at the cost of a process.

The experiment, on a training-like loop (a small MLP's forward, backward and SGD step on CPU: many small torch
ops, dominated by Python and dispatch, as a GPU trainer's host side is; torch on 1 intra-op thread):

1. alone: the loop's steps/s with nothing else running;
2. threads: CheckpointManager(mode="async", writer="threads").save of the state (~--size): the snapshot, then
   encoding and writes by writer threads in this process, the loop running until the commit;
3. process: the same with writer="process" (the default): the snapshot goes to shared staging arenas, a
   writer process encodes and writes, the loop runs until the commit.
Both managers are warm (one untimed save each first), as a trainer's manager is after its first checkpoint.

Reported: the loop's slowdown (steps/s alone / steps/s during the save), its p50 / p99 step time, the save's
blocking time and its end-to-end time. Medians over --repeats.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from .args import at_least, output_file, positive_float, positive_size


def make_loop(seed: int = 0) -> Any:
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(128, 256), torch.nn.GELU(), torch.nn.LayerNorm(256),
        torch.nn.Linear(256, 256), torch.nn.GELU(), torch.nn.LayerNorm(256),
        torch.nn.Linear(256, 128),
    )  # fmt: skip
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    x = torch.randn(32, 128, generator=g)
    y = torch.randn(32, 128, generator=g)

    def step() -> None:
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    return step


def run_steps(step: Any, until: Any) -> list[float]:
    """Step times (s) while `until()` is false (at least one step)."""
    times = []
    while True:
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
        if until():
            return times


def _stats(times: list[float], wall: float) -> dict[str, float]:
    ordered = sorted(times)
    return {
        "steps": len(times),
        "steps_per_s": len(times) / wall,
        "p50_ms": 1e3 * ordered[len(ordered) // 2],
        "p99_ms": 1e3 * ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))],
    }


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="bench_io gil", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--size", type=positive_size, default=256 << 20, help="bytes of state saved (default 256MiB)")
    p.add_argument("--repeats", type=at_least(1), default=2)
    p.add_argument("--alone-s", type=positive_float, default=2.0, help="seconds of the loop alone (default 2)")
    p.add_argument("--dir", help="parent directory (default /var/tmp: disk)")
    p.add_argument("--io-threads", type=at_least(1), default=16)
    p.add_argument("--json", type=output_file, help="write the figures to this file")
    return p


def run(args: argparse.Namespace, log: Any = None) -> dict[str, Any]:
    import ucp

    from .state import transformer_state
    from .targets import fs_type

    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    torch.set_num_threads(1)
    state = transformer_state(args.size)
    step = make_loop()
    for _ in range(50):
        step()  # warm
    root = Path(tempfile.mkdtemp(prefix="bench_io-gil-", dir=args.dir or "/var/tmp"))
    options = ucp.SaveOptions(fsync=True, io_threads=args.io_threads)
    rows: dict[str, list[dict[str, float]]] = {"alone": [], "threads": [], "process": []}
    managers = {
        w: ucp.CheckpointManager(str(root / w), mode="async", options=options, writer=w) for w in ("threads", "process")
    }
    try:
        for manager in managers.values():
            manager.save(0, state.tree)  # warm: staging allocated, writer process started
            manager.wait()
        for r in range(args.repeats):
            t0 = time.perf_counter()
            times = run_steps(step, lambda t0=t0: time.perf_counter() - t0 >= args.alone_s)
            rows["alone"].append(_stats(times, time.perf_counter() - t0))
            log(f"r{r} alone:   {rows['alone'][-1]['steps_per_s']:.0f} steps/s")
            for writer, manager in managers.items():
                t0 = time.perf_counter()
                handle = manager.save(r + 1, state.tree)
                t1 = time.perf_counter()
                times = run_steps(step, handle.done)
                manager.wait()
                wall = time.perf_counter() - t1
                e2e = time.perf_counter() - t0
                rows[writer].append({**_stats(times, wall), "blocking_s": t1 - t0, "save_s": e2e})
                log(
                    f"r{r} {writer}: {rows[writer][-1]['steps_per_s']:.0f} steps/s, save {e2e:.2f} s, blocking {t1 - t0:.3f} s"
                )
    finally:
        for manager in managers.values():
            manager.close()
        shutil.rmtree(root, ignore_errors=True)

    def med(mode: str, key: str) -> float | None:
        values = [row[key] for row in rows[mode] if key in row]
        return statistics.median(values) if values else None

    alone = med("alone", "steps_per_s") or 0.0
    summary = {
        mode: {
            "steps_per_s": med(mode, "steps_per_s"),
            "slowdown": alone / med(mode, "steps_per_s") if mode != "alone" else 1.0,  # type: ignore[operator]
            "p50_ms": med(mode, "p50_ms"),
            "p99_ms": med(mode, "p99_ms"),
            "blocking_s": med(mode, "blocking_s"),
            "save_s": med(mode, "save_s"),
        }
        for mode in rows
    }
    return {
        "config": {**vars(args), "state_bytes": state.nbytes, "fstype": fs_type(root.parent)},
        "runs": rows,
        "summary": summary,
    }


def table(doc: dict[str, Any]) -> str:
    def f(v: float | None, spec: str) -> str:
        return "-" if v is None else format(v, spec)

    lines = [
        (
            f"training loop vs a {doc['config']['state_bytes'] / 2**20:.0f} MiB ucp save on {doc['config']['fstype']}"
            f" (median of {doc['config']['repeats']})"
        ),
        f"{'mode':<8}  {'steps/s':>8}  {'slowdown':>8}  {'p50 ms':>7}  {'p99 ms':>7}  {'blocking s':>10}  {'save s':>7}",
    ]
    for mode, s in doc["summary"].items():
        lines.append(
            f"{mode:<8}  {f(s['steps_per_s'], '.0f'):>8}  {f(s['slowdown'], '.2f'):>8}  {f(s['p50_ms'], '.2f'):>7}"
            f"  {f(s['p99_ms'], '.2f'):>7}  {f(s['blocking_s'], '.3f'):>10}  {f(s['save_s'], '.2f'):>7}"
        )
    t, p = doc["summary"]["threads"], doc["summary"]["process"]
    better = "process" if p["slowdown"] < t["slowdown"] else "threads"
    lines.append(f"less slowdown of the loop: writer {better}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    doc = run(args)
    print(table(doc))
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
