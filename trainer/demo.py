"""The demo: train, lose the job, resume in another layout on fewer processes, and see the loss curve go on.

    python -m trainer.demo                # ./ucp-demo-run: checkpoints, metrics, logs, loss.png

1. trains the tiny MoE (trainer/configs/tiny-moe.yaml) on 4 processes in layout tp2pp2, with an asynchronous
   checkpoint every 5 steps into a local directory (any fsspec URL works the same: --ckpt s3://...);
2. once step 15 is committed, kills every process with SIGKILL, as a failed node would (no cleanup runs);
3. resumes on 2 processes in layout tp1pp1ep2dp2 (no TP, no PP; experts split over 2 ranks) from the last
   committed step: model, Adam state, LR schedule and data position, resharded while they load;
4. prints the losses of both runs with the resume point, writes loss.png, and shows `ucp inspect` of the last
   checkpoint.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

from ucp import commit
from ucp.checkpoint import CheckpointReader
from ucp.inspection import describe, format_table
from ucp.storage import open_storage

from . import launch
from .parallel.mesh import parse_layout

CONFIG = Path(__file__).resolve().parent / "configs" / "tiny-moe.yaml"
MARKER = ".ucp-trainer-demo"  # the demo only ever deletes a directory that it made


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m trainer.demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", default="ucp-demo-run", help="run directory (replaced if a previous demo made it)")
    p.add_argument("--ckpt", help="checkpoint URL (default: DIR/checkpoints; e.g. s3://bucket/run)")
    p.add_argument("--first-layout", default="tp2pp2", help="layout of the first run (world size = tp*pp*dp)")
    p.add_argument("--second-layout", default="tp1pp1ep2dp2", help="layout the run resumes in")
    p.add_argument("--steps", type=int, default=30, help="the step both runs train towards")
    p.add_argument("--save-interval", type=int, default=5)
    p.add_argument("--kill-after", type=int, default=15, help="kill the first run once this step is committed")
    p.add_argument("--mode", default="async", choices=("sync", "async", "lazy"), help="checkpoint mode")
    return p.parse_args(argv)


def prepare_dir(run_dir: Path) -> None:
    if run_dir.exists():
        if not (run_dir / MARKER).exists():
            raise SystemExit(f"{run_dir} exists and was not made by this demo: give another --dir")
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    (run_dir / MARKER).touch()


def trainer_argv(layout: str, steps: int, ckpt: str, interval: int, mode: str, metrics: Path) -> list[str]:
    return ["-m", "trainer", "--config", str(CONFIG), "--layout", layout, "--steps", str(steps), "--ckpt", ckpt,
            "--save-interval", str(interval), "--ckpt-mode", mode, "--metrics-file", str(metrics)]


def read_metrics(path: Path) -> tuple[dict[int, float], list[dict]]:
    if not path.exists():
        return {}, []
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {r["step"]: r["loss"] for r in lines if "event" not in r}, [r for r in lines if "event" in r]


def first_run(args: argparse.Namespace, run_dir: Path, ckpt: str) -> int:
    """Train in the first layout until `kill_after` is committed, then SIGKILL every rank; returns the
    last committed step."""
    world = parse_layout(args.first_layout).world_size
    print(f"== run 1: {world} processes, layout {args.first_layout}, {args.mode} checkpoint every "
          f"{args.save_interval} steps to {ckpt}", flush=True)
    procs = launch.start(trainer_argv(args.first_layout, args.steps, ckpt, args.save_interval, args.mode,
                                      run_dir / "run1.jsonl"), world, run_dir / "logs-run1", rank0_to_terminal=True)
    storage = open_storage(ckpt)
    try:
        while not [s for s in commit.committed_steps(storage) if s >= args.kill_after]:
            if any(p.poll() is not None for p in procs):
                launch.wait(procs, run_dir / "logs-run1")  # raises with the logs if a rank failed
                raise SystemExit(f"run 1 ended before step {args.kill_after} was committed: lower --kill-after")
            time.sleep(0.05)
    finally:
        launch.kill(procs)
    committed = commit.committed_steps(storage)
    logged, _ = read_metrics(run_dir / "run1.jsonl")
    print(f"== SIGKILL to all {world} processes: step {max(logged, default=0)} was the last logged, "
          f"committed steps {committed}", flush=True)
    return committed[-1]


def second_run(args: argparse.Namespace, run_dir: Path, ckpt: str) -> None:
    world = parse_layout(args.second_layout).world_size
    print(f"== run 2: {world} processes, layout {args.second_layout}, resuming from {ckpt}", flush=True)
    procs = launch.start(trainer_argv(args.second_layout, args.steps, ckpt, args.save_interval, args.mode,
                                      run_dir / "run2.jsonl"), world, run_dir / "logs-run2", rank0_to_terminal=True)
    launch.wait(procs, run_dir / "logs-run2")


def report(args: argparse.Namespace, run_dir: Path, resumed_from: int) -> None:
    run1, events1 = read_metrics(run_dir / "run1.jsonl")
    run2, events2 = read_metrics(run_dir / "run2.jsonl")
    resume = next(e for e in events2 if e["event"] == "resume")
    assert resume["from_step"] == resumed_from, (resume, resumed_from)
    print(f"\n== loss per step ({args.first_layout} on the left, {args.second_layout} on the right)")
    print(f"{'step':>4}  {args.first_layout:>14}  {args.second_layout:>14}")
    for step in range(1, args.steps + 1):
        left = f"{run1[step]:.6f}" if step in run1 else ""
        right = f"{run2[step]:.6f}" if step in run2 else ""
        mark = "  <- resumed after this step" if step == resumed_from else ""
        mark += "  (redone: lost when run 1 died)" if step in run1 and step in run2 else ""
        print(f"{step:>4}  {left:>14}  {right:>14}{mark}")
    redone = [s for s in run2 if s in run1]
    worst = max((abs(run1[s] - run2[s]) / abs(run1[s]) for s in redone), default=0.0)
    print(f"resumed from step {resumed_from} saved in {resume['saved_layout']}; first step after the resume "
          f"{resume['time_to_first_step_s']:.1f} s after start; read {resume['bytes_read'] / 2**20:.1f} MiB")
    if redone:
        print(f"steps {redone[0]}..{redone[-1]} ran in both layouts: largest relative loss difference {worst:.1e}")
    blocking = [e["blocking_s"] for e in events1 + events2 if e["event"] == "checkpoint"]
    print(f"checkpoints: {len(blocking)} saves, training blocked {1e3 * sum(blocking) / len(blocking):.0f} ms "
          f"per save on average ({args.mode})")
    plot(args, run_dir, run1, run2, events1 + events2, resumed_from)


def plot(args: argparse.Namespace, run_dir: Path, run1: dict[int, float], run2: dict[int, float],
         events: list[dict], resumed_from: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for step in sorted({e["step"] for e in events if e["event"] == "checkpoint"}):
        ax.axvline(step, color="0.85", lw=1, zorder=0)
    ax.plot(list(run1), list(run1.values()), "o-", ms=3, label=f"run 1: {args.first_layout} (killed)")
    ax.plot(list(run2), list(run2.values()), "s-", ms=3, label=f"run 2: {args.second_layout} (resumed)")
    ax.axvline(resumed_from, color="C3", ls="--", label=f"resume from step {resumed_from}")
    ax.plot([], [], color="0.85", label="checkpoints")
    ax.set(xlabel="step", ylabel="LM loss", title="tiny MoE: killed, resumed in another layout")
    ax.legend()
    fig.tight_layout()
    fig.savefig(run_dir / "loss.png", dpi=120)
    print(f"wrote {run_dir / 'loss.png'}")


def inspect(ckpt: str) -> None:
    """What `ucp inspect` shows for the last checkpoint (the table is long: its head and its totals here)."""
    table = format_table(describe(CheckpointReader(open_storage(ckpt), "latest"))).splitlines()
    print(f"\n== ucp inspect {ckpt}")
    print("\n".join(table[:16] + ["  ..."] + table[-1:]))


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    run_dir = Path(args.dir).resolve()
    prepare_dir(run_dir)
    ckpt = args.ckpt or str(run_dir / "checkpoints")
    if commit.committed_steps(open_storage(ckpt)):
        raise SystemExit(f"{ckpt} already holds checkpoints: the demo starts from an empty URL")
    started = time.perf_counter()
    resumed_from = first_run(args, run_dir, ckpt)
    second_run(args, run_dir, ckpt)
    report(args, run_dir, resumed_from)
    inspect(ckpt)
    print(f"\ndemo done in {time.perf_counter() - started:.0f} s; everything is in {run_dir}")


if __name__ == "__main__":
    main()
