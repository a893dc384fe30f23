"""`python -m trainer.report RUN`: one self-contained HTML page (and its PNGs) from a run's metrics file.

    python -m trainer.report ucp-demo-run              # RUN: a metrics JSONL file, or a directory holding one
    python -m trainer.report run/metrics.jsonl --out report-dir

The page shows loss and learning rate over the steps (restarts and resumes marked), where each step's time
went (data, forward, backward, pipeline wait, optimizer, checkpoint; the mean over ranks, stacked), the same per
pipeline stage, peak memory per rank grouped by stage, the checkpoint events (blocking time per save) and the
restarts, and a table naming every rank with its coordinates, mean phase times and peak memory. The plots are
embedded as base64 PNGs, so the page is one file; the PNGs are also written beside it.
"""

from __future__ import annotations

import argparse
import base64
import html
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

from .profile import PHASES

COLORS = {
    "data": "#8c8c8c",
    "forward": "#4c72b0",
    "backward": "#55a868",
    "pipeline_wait": "#c44e52",
    "optimizer": "#8172b2",
    "checkpoint": "#ccb974",
    "other": "#dddddd",
}


def find_metrics(run: Path) -> Path:
    if run.is_file():
        return run
    if not run.is_dir():
        raise SystemExit(f"trainer.report: {run} is neither a metrics file nor a run directory")
    if (run / "metrics.jsonl").is_file():
        return run / "metrics.jsonl"
    found = sorted(run.glob("*.jsonl"))
    if len(found) != 1:
        raise SystemExit(f"trainer.report: {run} holds {len(found)} .jsonl files; name the metrics file")
    return found[0]


def read(path: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(step records, event records); a restarted run logs a step again: the last record of a step wins."""
    steps: dict[int, dict[str, Any]] = {}
    events = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            raise SystemExit(f"trainer.report: {path}:{n} is not JSON") from None
        if "event" in record:
            events.append(record)
        elif "step" in record:
            steps[record["step"]] = record
    if not steps:
        raise SystemExit(f"trainer.report: {path} holds no step records")
    return [steps[s] for s in sorted(steps)], events


def breakdown(record: dict[str, Any]) -> dict[str, float]:
    """The mean over ranks of each phase of a step, and "other": the rest of the step time (the loss's all-reduce,
    Python between phases). The step time does not count the save's hand-off after the step, the checkpoint
    phase does: then other is clipped at zero."""
    ranks = record.get("ranks") or []
    out = {p: statistics.fmean(r[p] for r in ranks) if ranks else 0.0 for p in PHASES}
    out["other"] = max(0.0, record["step_time_s"] - sum(out.values()))
    return out


def _plots(steps: list[dict[str, Any]], events: list[dict[str, Any]], out: Path) -> dict[str, Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [r["step"] for r in steps]
    marks = [(e, e["event"]) for e in events if e["event"] in ("restart", "resume")]
    saves = [e for e in events if e["event"] == "checkpoint"]
    paths = {}

    fig, ax = plt.subplots(figsize=(8, 3.6))
    ax.plot(xs, [r["loss"] for r in steps], color="#4c72b0", label="loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    lr_ax = ax.twinx()
    lr_ax.plot(xs, [r["lr"] for r in steps], color="#dd8452", label="learning rate")
    lr_ax.set_ylabel("learning rate")
    for e, kind in marks:
        step = e.get("from_step", 0) + 0.5
        ax.axvline(step, color="#c44e52" if kind == "restart" else "#999999", ls="--", lw=1)
    ax.set_title("loss and learning rate (dashed: resumes; red: restarts)")
    fig.tight_layout()
    paths["loss"] = out / "loss.png"
    fig.savefig(paths["loss"], dpi=100)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(8, 3.6))
    parts = [breakdown(r) for r in steps]
    bottom = [0.0] * len(steps)
    for phase in (*PHASES, "other"):
        values = [p[phase] for p in parts]
        ax.bar(xs, values, bottom=bottom, color=COLORS[phase], label=phase, width=0.9)
        bottom = [b + v for b, v in zip(bottom, values)]
    for e in saves:
        ax.plot(e["step"], 0, marker="^", color="#ccb974", ms=7, clip_on=False)
    ax.set_xlabel("step")
    ax.set_ylabel("seconds (mean over ranks)")
    ax.set_title("step time breakdown (triangles: checkpoint saves)")
    ax.legend(fontsize=7, ncol=4)
    fig.tight_layout()
    paths["step_time"] = out / "step_time.png"
    fig.savefig(paths["step_time"], dpi=100)
    plt.close(fig)

    last_ranks = steps[-1].get("ranks") or []
    by_stage: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for r in last_ranks:
        by_stage[r["pp"]].append(r)
    fig, (mem, stage_ax) = plt.subplots(1, 2, figsize=(10, 3.6))
    cmap = plt.get_cmap("tab10")
    mem.bar(
        [f"r{r['rank']}" for r in last_ranks],
        [r["peak_rss_bytes"] / 2**20 for r in last_ranks],
        color=[cmap(r["pp"] % 10) for r in last_ranks],
    )
    if any("cuda_peak_allocated_bytes" in r for r in last_ranks):
        mem.plot(
            [f"r{r['rank']}" for r in last_ranks],
            [r.get("cuda_peak_allocated_bytes", 0) / 2**20 for r in last_ranks],
            "k^",
            label="CUDA peak allocated",
        )
        mem.legend(fontsize=7)
    mem.set_ylabel("peak RSS (MiB)")
    mem.set_title("peak memory per rank (colour: pipeline stage)")
    stages = sorted(by_stage)
    bottom = [0.0] * len(stages)
    for phase in PHASES:
        values = [
            statistics.fmean(r[phase] for s in steps for r in (s.get("ranks") or []) if r["pp"] == st) for st in stages
        ]
        stage_ax.bar([f"stage {st}" for st in stages], values, bottom=bottom, color=COLORS[phase], label=phase)
        bottom = [b + v for b, v in zip(bottom, values)]
    stage_ax.set_ylabel("seconds per step (mean)")
    stage_ax.set_title("time per pipeline stage")
    stage_ax.legend(fontsize=7)
    fig.tight_layout()
    paths["stages"] = out / "stages.png"
    fig.savefig(paths["stages"], dpi=100)
    plt.close(fig)
    return paths


def _table(header: list[str], rows: list[list[Any]]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def write(run: Path, out: Path | None = None) -> Path:
    """Build the report of RUN into OUT (default: a `report` directory beside the metrics file); its HTML path."""
    metrics = find_metrics(run)
    steps, events = read(metrics)
    out = out or metrics.parent / "report"
    out.mkdir(parents=True, exist_ok=True)
    plots = _plots(steps, events, out)
    saves = [e for e in events if e["event"] == "checkpoint"]
    restarts = [e for e in events if e["event"] == "restart"]
    layouts = list(dict.fromkeys(r.get("layout", "?") for r in steps))
    summary = [
        ["steps", f"{steps[0]['step']}..{steps[-1]['step']} ({len(steps)})"],
        ["layouts", ", ".join(layouts)],
        ["final loss", f"{steps[-1]['loss']:.6f}"],
        ["median step time", f"{statistics.median(r['step_time_s'] for r in steps):.3f} s"],
        [
            "checkpoint saves",
            f"{len(saves)}"
            + (f", median blocking {statistics.median(e.get('blocking_s', 0) for e in saves):.3f} s" if saves else ""),
        ],
        [
            "restarts",
            f"{len(restarts)}"
            + "".join(
                f"; step {e['from_step']} in {e['layout']} after {e['failure_to_first_step_s']:.1f} s"
                + (" (in place)" if e.get("in_place") else "")
                for e in restarts
            ),
        ],
    ]
    ranks: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for s in steps:
        for r in s.get("ranks") or []:
            ranks[r["rank"]].append(r)
    rank_rows = []
    for rank in sorted(ranks):
        rs = ranks[rank]
        last = rs[-1]
        rank_rows.append(
            [f"rank {rank}", last["tp"], last["pp"], last["dp"], last["ep"]]
            + [f"{statistics.fmean(r[p] for r in rs) * 1e3:.1f}" for p in PHASES]
            + [f"{max(r['peak_rss_bytes'] for r in rs) / 2**20:.0f}"]
            + (
                [f"{max(r.get('cuda_peak_allocated_bytes', 0) for r in rs) / 2**20:.0f}"]
                if "cuda_peak_allocated_bytes" in last
                else [""]
            )
        )
    event_rows = [
        [
            e["event"],
            e.get("step", e.get("from_step", "")),
            e.get("layout", ""),
            f"{e.get('blocking_s', e.get('restore_s', 0)):.3f}",
        ]
        for e in events
    ]
    images = "".join(
        f'<h2>{html.escape(name.replace("_", " "))}</h2><img alt="{name}" src="data:image/png;base64,'
        f'{base64.b64encode(path.read_bytes()).decode()}">'
        for name, path in plots.items()
    )
    page = f"""<!doctype html>
<html><head><meta charset="utf-8"><title>run report: {html.escape(str(metrics))}</title>
<style>body{{font-family:sans-serif;max-width:1100px;margin:2em auto}}table{{border-collapse:collapse;margin:1em 0}}
td,th{{border:1px solid #ccc;padding:3px 8px;text-align:right}}img{{max-width:100%}}</style></head><body>
<h1>run report</h1><p>{html.escape(str(metrics))}</p>
{_table(["", ""], summary)}
{images}
<h2>ranks</h2><p>mean milliseconds per step of each phase, peak memory in MiB</p>
{_table(["rank", "tp", "pp", "dp", "ep", *PHASES, "peak RSS", "CUDA peak"], rank_rows)}
<h2>events</h2>
{_table(["event", "step", "layout", "blocking / restore s"], event_rows)}
</body></html>
"""
    path = out / "report.html"
    path.write_text(page)
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m trainer.report", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("run", help="a metrics JSONL file, or a run directory holding one")
    p.add_argument("--out", help="directory for report.html and its PNGs (default: RUN's report/)")
    args = p.parse_args(argv)
    path = write(Path(args.run), Path(args.out) if args.out else None)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
