"""`python -m bench_io.gil` (or `python -m bench_io gil`): does a writer *process* beat writer *threads*?

An async save's writer threads share the trainer's GIL: while they checksum, encode and issue writes, the
training loop's Python (op dispatch, autograd, the optimizer) waits for the lock. A writer process, fed through
shared memory, takes the GIL out of the picture at the cost of a copy into shared memory and a process.

The experiment, on a training-like loop (a small MLP's forward, backward and SGD step on CPU: many small torch
ops, dominated by Python and dispatch, as a GPU trainer's host side is; torch on 1 intra-op thread):

1. alone: the loop's steps/s with nothing else running;
2. threads: ucp CheckpointManager(mode="async").save of the state (~--size) in the background (ucp's writer
   threads, in this process), the loop running until the commit;
3. process: the same bytes saved by a separate writer process (spawned once, warm) with ucp.save, from
   tensors in shared memory (share_memory_()): the trainer's snapshot is a copy_ into those shared tensors,
   then a message; the loop runs until the child reports the commit.

Reported: the loop's slowdown (steps/s alone / steps/s during the save), its p50 / p99 step time, the save's
blocking time and its end-to-end time. Medians over --repeats.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch


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


def _writer(shared: dict[str, Any], io_threads: int, conn: Any) -> None:
    """The writer process: saves the shared tensors whenever told, reports the time."""
    import ucp

    torch.set_num_threads(1)
    options = ucp.SaveOptions(fsync=True, io_threads=io_threads)
    conn.send("ready")
    while True:
        msg = conn.recv()
        if msg is None:
            return
        url, step = msg
        t0 = time.perf_counter()
        try:
            ucp.save(shared, url, step=step, options=options)
            conn.send({"save_s": time.perf_counter() - t0})
        except Exception as e:  # noqa: BLE001
            conn.send({"error": f"{type(e).__name__}: {e}"})


def _share_like(tree: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out[k] = _share_like(v)
        elif isinstance(v, torch.Tensor):
            out[k] = torch.empty_like(v).share_memory_()
        else:
            out[k] = v
    return out


def _copy_into(dst: dict[str, Any], src: dict[str, Any]) -> None:
    for k, v in src.items():
        if isinstance(v, dict):
            _copy_into(dst[k], v)
        elif isinstance(v, torch.Tensor):
            dst[k].copy_(v)


def build_parser() -> argparse.ArgumentParser:
    from .__main__ import parse_size

    p = argparse.ArgumentParser(
        prog="bench_io gil", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--size", type=parse_size, default=256 << 20, help="bytes of state saved (default 256MiB)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--alone-s", type=float, default=2.0, help="seconds of the loop alone (default 2)")
    p.add_argument("--dir", help="parent directory (default /var/tmp: disk)")
    p.add_argument("--io-threads", type=int, default=16)
    p.add_argument("--json", help="write the figures to this file")
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
    ctx = mp.get_context("spawn")
    shared = _share_like(state.tree)
    parent, child = ctx.Pipe()
    writer = ctx.Process(target=_writer, args=(shared, args.io_threads, child), daemon=True)
    writer.start()
    assert parent.recv() == "ready"
    options = ucp.SaveOptions(fsync=True, io_threads=args.io_threads)
    rows: dict[str, list[dict[str, float]]] = {"alone": [], "threads": [], "process": []}
    # one manager for the whole run, as a trainer keeps one: its staging pool and threads are warm after the
    # first save, which is untimed (and so is the writer process's first save)
    manager = ucp.CheckpointManager(str(root / "threads"), mode="async", options=options)
    try:
        manager.save(10_000, state.tree)
        manager.wait()
        _copy_into(shared, state.tree)
        parent.send((str(root / "process-warmup"), 0))
        if "error" in (reply := parent.recv()):
            raise RuntimeError(f"writer process: {reply['error']}")
        for r in range(args.repeats):
            # alone
            t0 = time.perf_counter()
            times = run_steps(step, lambda t0=t0: time.perf_counter() - t0 >= args.alone_s)
            rows["alone"].append(_stats(times, time.perf_counter() - t0))
            log(f"r{r} alone:   {rows['alone'][-1]['steps_per_s']:.0f} steps/s")

            # writer threads: ucp's async save in this process
            t0 = time.perf_counter()
            handle = manager.save(r, state.tree)
            t1 = time.perf_counter()
            times = run_steps(step, handle.done)
            manager.wait()
            wall = time.perf_counter() - t1
            e2e = time.perf_counter() - t0
            rows["threads"].append({**_stats(times, wall), "blocking_s": t1 - t0, "save_s": e2e})
            log(
                f"r{r} threads: {rows['threads'][-1]['steps_per_s']:.0f} steps/s, save {e2e:.2f} s, blocking {t1 - t0:.3f} s"
            )

            # writer process, fed by shared memory
            t0 = time.perf_counter()
            _copy_into(shared, state.tree)
            parent.send((str(root / f"process-{r}"), 0))
            t1 = time.perf_counter()
            times = run_steps(step, parent.poll)
            reply = parent.recv()
            wall = time.perf_counter() - t1
            e2e = time.perf_counter() - t0
            if "error" in reply:
                raise RuntimeError(f"writer process: {reply['error']}")
            rows["process"].append(
                {**_stats(times, wall), "blocking_s": t1 - t0, "save_s": e2e, "child_save_s": reply["save_s"]}
            )
            log(
                f"r{r} process: {rows['process'][-1]['steps_per_s']:.0f} steps/s, save {e2e:.2f} s, blocking {t1 - t0:.3f} s"
            )
            shutil.rmtree(root / f"process-{r}", ignore_errors=True)
    finally:
        manager.close()
        parent.send(None)
        writer.join(30)
        if writer.is_alive():
            writer.terminate()
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
