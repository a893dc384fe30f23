"""Checkpointing cost in the reference trainer: step time with a checkpoint every step vs none, the time a
checkpoint blocks training (sync / async / lazy), and the time from process start to the first step after a
resume. Runs `python -m trainer` processes (gloo, CPU); prints a markdown table and writes JSON.

    python scripts/trainer_bench.py --steps 12 --out trainer-bench.json
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from trainer import launch
from trainer.parallel.mesh import parse_layout

TINY = REPO / "trainer" / "configs" / "tiny-moe.yaml"
CONFIGS = {
    "tiny": [],
    # A larger model that still trains on a few CPU cores: ~14M parameters, ~0.2 GB of checkpoint per step.
    "h256-l4-e8": [
        "--set",
        "model.hidden_size=256",
        "--set",
        "model.num_heads=8",
        "--set",
        "model.num_kv_heads=4",
        "--set",
        "model.ffn_hidden_size=512",
    ],
}


def run(work: Path, name: str, layout: str, steps: int, extra: list[str]) -> list[dict]:
    metrics = work / f"{name}.jsonl"
    argv = launch.trainer_argv(TINY, layout, steps, metrics, *extra)
    procs = launch.start(argv, parse_layout(layout).world_size, work / f"logs-{name}")
    launch.wait(procs, work / f"logs-{name}")
    return [json.loads(line) for line in metrics.read_text().splitlines()]


def step_times(records: list[dict], skip: int) -> list[float]:
    """Wall time per step as the loop sees it: the step itself plus the checkpoint call after it."""
    calls = {r["step"]: r["call_s"] for r in records if r.get("event") == "checkpoint"}
    steps = [r for r in records if "event" not in r][skip:]
    return [r["step_time_s"] + calls.get(r["step"], 0.0) for r in steps]


def bench(config: str, args: argparse.Namespace, work: Path) -> dict:
    extra = CONFIGS[config]
    result: dict = {"config": config, "layout": args.layout, "steps": args.steps}
    base = step_times(run(work, f"{config}-none", args.layout, args.steps, extra), args.skip)
    result["step_s_no_ckpt"] = statistics.median(base)
    for mode in args.modes:
        ckpt = work / f"{config}-{mode}-ckpt"
        records = run(
            work,
            f"{config}-{mode}",
            args.layout,
            args.steps,
            [*extra, "--ckpt", str(ckpt), "--save-interval", "1", "--ckpt-mode", mode],
        )
        events = [r for r in records if r.get("event") == "checkpoint"][args.skip :]
        result[mode] = {
            "step_s": statistics.median(step_times(records, args.skip)),
            "blocking_s": statistics.median(e["blocking_s"] for e in events),  # inside save_sharded's submit
            "call_s": statistics.median(e["call_s"] for e in events),  # the whole call, planning included
        }
        result[mode]["overhead_pct"] = 100 * (result[mode]["step_s"] / result["step_s_no_ckpt"] - 1)
    # Resume: a fresh job (another layout when given) from the last checkpoint of the first mode.
    ckpt = work / f"{config}-{args.modes[0]}-ckpt"
    records = run(work, f"{config}-resume", args.resume_layout, args.steps + 1, [*extra, "--ckpt", str(ckpt)])
    resume = next(r for r in records if r.get("event") == "resume")
    result["resume"] = {
        "layout": args.resume_layout,
        "time_to_first_step_s": resume["time_to_first_step_s"],
        "bytes_read": resume["bytes_read"],
    }
    return result


def table(results: list[dict], modes: list[str]) -> str:
    head = ["config", "layout", "step (no ckpt)"]
    for m in modes:
        head += [f"step ({m}, every step)", f"overhead {m}", f"blocking {m}: call / submit"]
    head += ["resume: start to first step", "read at resume"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results:
        row = [r["config"], r["layout"], f"{1e3 * r['step_s_no_ckpt']:.0f} ms"]
        for m in modes:
            row += [
                f"{1e3 * r[m]['step_s']:.0f} ms",
                f"{r[m]['overhead_pct']:+.0f}%",
                f"{1e3 * r[m]['call_s']:.0f} / {1e3 * r[m]['blocking_s']:.0f} ms",
            ]
        row += [
            f"{r['resume']['time_to_first_step_s']:.2f} s ({r['resume']['layout']})",
            f"{r['resume']['bytes_read'] / 2**20:.1f} MiB",
        ]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    p.add_argument("--layout", default="tp1pp1ep2dp2", help="layout of the measured runs")
    p.add_argument("--resume-layout", default="tp2pp1", help="layout of the resumed run")
    p.add_argument("--modes", nargs="+", default=["async", "lazy", "sync"], choices=["sync", "async", "lazy"])
    p.add_argument("--steps", type=int, default=12, help="steps per run")
    p.add_argument("--skip", type=int, default=2, help="first steps left out of the medians (warm-up)")
    p.add_argument("--out", default="trainer-bench.json", help="JSON results")
    p.add_argument("--work-dir", help="checkpoints and logs (default: a temporary directory, deleted)")
    args = p.parse_args(argv)
    work = Path(args.work_dir) if args.work_dir else Path(tempfile.mkdtemp(prefix="trainer-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        results = [bench(c, args, work) for c in args.configs]
    finally:
        if not args.work_dir:
            shutil.rmtree(work, ignore_errors=True)
    Path(args.out).write_text(json.dumps(results, indent=1))
    print(
        "medians; step = the training step + the checkpoint call after it (lazy: + the snapshot wait before the "
        "update); call = the whole save_sharded call (waiting for the previous save, planning, fragment exchange, "
        "snapshot), submit = handle.blocking_s (the snapshot)"
    )
    print(table(results, args.modes))


if __name__ == "__main__":
    main()
