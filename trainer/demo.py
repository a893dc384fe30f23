"""The demo: an elastic job loses a node, shrinks, gets the node back and grows, and its loss curve goes on.

    python -m trainer.demo                # ./ucp-demo-run: checkpoints, metrics, logs, loss.png, report/report.html

1. two simulated nodes (trainer/elastic.py: two torchrun elastic agents on this machine, c10d rendezvous, two
   processes each) train the tiny MoE (trainer/configs/tiny-moe.yaml) in layout tp2pp2, with an asynchronous
   checkpoint every 2 steps into each node's hot tier (a directory per node, standing in for its /dev/shm) and
   every 3rd of those drained to the durable URL (a local directory; any fsspec URL works the same);
2. node b is lost: its agent and every process under it are SIGKILLed and its directory deleted;
3. node a's two processes see their step fail, agree through the rendezvous store that they are what is left and
   re-form the job among themselves without a restart (trainer/regroup.py; `--restart` leaves it to node a's agent,
   which restarts them): they take layout tp2pp1 and resume from the newest step in the hot tier (node b's pieces
   from their replica on node a, nothing from the durable URL);
4. node b comes back, empty; the agents restart the job on four processes in tp2pp2, node b's ranks receiving their
   pieces from node a over the process group;
5. prints the loss per step with the layout that trained it and the restarts, the recovery times, writes loss.png
   and shows `ucp inspect` of the durable checkpoint.

The node lost and the node back are recorded in the metrics file as they happen (`report.log_node_event`), so that
the recovery times the demo prints and those of the run report are one figure, computed once (`report.recoveries`),
and the loss plot is the report's (`report.plot_loss`).
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

import torch

from ucp.distributed.tiers import run_directory
from ucp.engine.checkpoint import CheckpointReader
from ucp.engine.inspection import describe, format_table
from ucp.errors import UcpError
from ucp.protocol import commit
from ucp.sharding.layout import parse_layout
from ucp.storage import LocalStorage, open_storage

from . import elastic
from . import report as run_report
from .launch import trainer_argv

CONFIG = Path(__file__).resolve().parent / "configs" / "tiny-moe.yaml"
MARKER = ".ucp-trainer-demo"  # the demo only ever deletes a directory that it made


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m trainer.demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", default="ucp-demo-run", help="run directory (replaced if a previous demo made it)")
    p.add_argument("--ckpt", help="durable checkpoint URL (default: DIR/checkpoints; e.g. s3://bucket/run)")
    p.add_argument("--layouts", default="tp2pp2,tp2pp1", help="layouts the job may take, by world size")
    p.add_argument("--steps", type=int, default=36, help="the step the job trains to")
    p.add_argument("--save-interval", type=int, default=2)
    p.add_argument("--durable-every", type=int, default=3, help="drain every K-th save to the durable URL")
    p.add_argument("--kill-after", type=int, default=10, help="lose node b once this step is in its hot tier")
    p.add_argument("--rejoin-after", type=int, default=22, help="bring node b back once this step is saved again")
    p.add_argument(
        "--restart",
        action="store_true",
        help="on the loss, let node a's agent restart its processes instead of their re-forming the job in place",
    )
    args = p.parse_args(argv)
    check_args(p, args)
    return args


def check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse, before any process starts, what would leave the job waiting for a step it never reaches: the job
    runs on 4 processes and, once node b is lost, on 2 (node a's alone, re-formed or restarted)."""
    try:
        sizes = {parse_layout(name.strip()).world_size for name in args.layouts.split(",") if name.strip()}
    except UcpError as e:
        p.error(f"--layouts: {e}")
    if not {4, 2} <= sizes:
        p.error(f"--layouts {args.layouts}: give one layout of 4 processes and one of 2 (the job after node b's loss)")
    for name in ("steps", "save_interval", "durable_every", "kill_after", "rejoin_after"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if not args.kill_after < args.rejoin_after < args.steps:
        p.error(
            f"--kill-after {args.kill_after} < --rejoin-after {args.rejoin_after} < --steps {args.steps} must hold: "
            "node b is lost, comes back, then the job trains on"
        )


def prepare_dir(run_dir: Path) -> None:
    if run_dir.exists():
        if not (run_dir / MARKER).exists():
            raise SystemExit(f"{run_dir} exists and was not made by this demo: give another --dir")
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    (run_dir / MARKER).touch()


def read_metrics(path: Path) -> list[dict]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            pass  # (a line cut short by a kill)
    return out


def hot_steps(node_dir: Path, ckpt: str) -> list[int]:
    """The steps committed in a node's hot tier."""
    try:
        return commit.committed_steps(LocalStorage(run_directory(str(node_dir), open_storage(ckpt).url)))
    except Exception:  # noqa: BLE001 -- a directory being written: nothing to say yet
        return []


def run(args: argparse.Namespace, run_dir: Path, ckpt: str) -> None:
    def node_dir(name: str) -> Path:
        return run_dir / f"node-{name}-shm"

    # On a GPU machine the ranks train on its GPUs with gloo: the two simulated nodes' ranks share the GPUs, which
    # NCCL (a GPU per rank) cannot do.
    devices = ("--set", "train.backend=gloo") if torch.cuda.is_available() else ()
    argv = trainer_argv(
        CONFIG,
        args.layouts,
        args.steps,
        run_dir / "metrics.jsonl",
        *("--ckpt", ckpt, "--save-interval", str(args.save_interval), "--durable-every", str(args.durable_every)),
        *devices,
    )
    job = elastic.Job(
        argv,
        "ucp-demo",
        run_dir,
        node_args=lambda name: ["--ckpt-local", str(node_dir(name))],
        in_place=not args.restart,
    )
    try:
        for name in ("a", "b"):
            print(f"== node {name}: a torchrun agent with 2 processes, hot tier in {node_dir(name)}", flush=True)
            job.start(name)
        job.wait_for(
            lambda: max(hot_steps(node_dir("b"), ckpt), default=0) >= args.kill_after, f"step {args.kill_after}"
        )
        run_report.log_node_event(run_dir / "metrics.jsonl", "b", "lost", job.lose("b"))
        shutil.rmtree(node_dir("b"), ignore_errors=True)
        print(
            f"== node b lost: SIGKILL to its agent and processes, its hot tier deleted (hot steps of node a: "
            f"{hot_steps(node_dir('a'), ckpt)})",
            flush=True,
        )
        job.wait_for(
            lambda: max(hot_steps(node_dir("a"), ckpt), default=0) >= args.rejoin_after, f"step {args.rejoin_after}"
        )
        run_report.log_node_event(run_dir / "metrics.jsonl", "b", "back", time.time())
        print(f"== node b is back (empty): a torchrun agent with 2 processes, hot tier in {node_dir('b')}", flush=True)
        job.join("b")
        job.wait(900)
    except RuntimeError as e:
        raise SystemExit(f"the demo failed: {e}") from None
    finally:
        job.stop()


def report(run_dir: Path) -> None:
    records = read_metrics(run_dir / "metrics.jsonl")
    print(
        "\n== loss per step, with the layout that trained it (after a restart, the steps since the checkpoint it "
        "resumed from are trained again, on the same data)"
    )
    trained: dict[int, list[float]] = {}
    for r in records:
        if r.get("event") == "restart":
            how = "re-formed in place (no restart)" if r.get("in_place") else "restart"
            print(
                f"      -- {how}: {r['world_size']} processes, layout {r['layout']}, resumed from step "
                f"{r['from_step']} ({r['source']} tier)"
            )
        elif "event" not in r:
            again = "  (again)" if r["step"] in trained else ""
            trained.setdefault(r["step"], []).append(r["loss"])
            print(f"{r['step']:>4}  {r['loss']:.6f}  {r['layout']}{again}")
    twice = [v for v in trained.values() if len(v) > 1]
    worst = max((abs(max(v) - min(v)) / abs(v[0]) for v in twice), default=0.0)
    print(f"{len(twice)} steps trained twice: largest relative loss difference {worst:.1e} (same data, another layout)")
    for recovery in run_report.recoveries(records):
        tiers = recovery.restart["bytes_by_tier"]
        print(
            f"{recovery.describe()}; the ranks read {tiers['local'] / 2**20:.1f} MiB from their own node's memory, "
            f"{tiers['peers'] / 2**20:.1f} from other nodes, {tiers['durable'] / 2**20:.1f} from the durable URL"
        )
    run_report.plot_loss(records, run_dir / "loss.png", "tiny MoE under torchrun: a node lost, then back")
    print(f"wrote {run_dir / 'loss.png'}")


def inspect(ckpt: str) -> None:
    """What `ucp inspect` shows for the last durable checkpoint (its head and its totals)."""
    print(f"\n== ucp inspect {ckpt}")
    if not commit.committed_steps(open_storage(ckpt)):  # (a short run may have drained no save: --durable-every)
        print("no step reached the durable URL (every --durable-every-th save is drained there)")
        return
    table = format_table(describe(CheckpointReader(open_storage(ckpt), "latest"))).splitlines()
    print("\n".join(table[:16] + ["  ..."] + table[-1:]))


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    run_dir = Path(args.dir).resolve()
    prepare_dir(run_dir)
    ckpt = args.ckpt or str(run_dir / "checkpoints")
    if commit.committed_steps(open_storage(ckpt)):
        raise SystemExit(f"{ckpt} already holds checkpoints: the demo starts from an empty URL")
    started = time.perf_counter()
    run(args, run_dir, ckpt)
    report(run_dir)
    inspect(ckpt)
    page = run_report.write(run_dir / "metrics.jsonl", run_dir / "report")
    print(f"\nrun report (step time per phase, memory per rank and stage, restarts): {page}")
    print(f"demo done in {time.perf_counter() - started:.0f} s; everything is in {run_dir}")


if __name__ == "__main__":
    main()
