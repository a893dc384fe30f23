"""`python -m trainer.report RUN`: one self-contained HTML page (and its PNGs) from a run's metrics file.

    python -m trainer.report ucp-demo-run              # RUN: a metrics JSONL file, or a directory holding one
    python -m trainer.report run/metrics.jsonl --out report-dir

The page opens with what the run cost: the time training waited for its checkpoints (each whole `save` call, which
also waits for the previous save, with the snapshot's blocking time as a part of it) and each restart's recovery
time (`recoveries`, which the demo prints too). Then loss and learning rate over the steps, coloured by the layout
that trained them (`plot_loss`: restarts and in-place re-formings marked apart, as the demo's loss.png), where each
step's time went (data, forward, backward, pipeline wait, optimizer, checkpoint; the mean over ranks, stacked), the
same per pipeline stage, peak memory per rank grouped by stage, the checkpoint and restart events, and a table
naming every rank with its coordinates, mean phase times and peak memory. The plots are embedded as base64 PNGs, so
the page is one file; the PNGs are also written beside it.

Recovery times come from the metrics file alone: a restart's is the time from its cause to the end of the first step
trained after it. The cause is what a launcher recorded there (`{"event": "node", "node", "change", "time"}`: the
demo records a node lost and a node back, `log_node_event`), else the last step logged before the restart (so, for
a failure nobody recorded, an upper bound).
"""

from __future__ import annotations

import argparse
import base64
import html
import json
import statistics
import sys
from collections import defaultdict
from dataclasses import dataclass
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


def read(path: Path) -> list[dict[str, Any]]:
    """Every record of a metrics file, in the order written (a restarted run logs the steps since its checkpoint
    again: `last_per_step` keeps the last record of each)."""
    records = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except ValueError:
            raise SystemExit(f"trainer.report: {path}:{n} is not JSON") from None
    if not any("event" not in r and "step" in r for r in records):
        raise SystemExit(f"trainer.report: {path} holds no step records")
    return records


def last_per_step(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The step records, one per step (the last one written), by step."""
    steps = {r["step"]: r for r in records if "event" not in r and "step" in r}
    return [steps[s] for s in sorted(steps)]


def log_node_event(metrics: Path, node: str, change: str, when: float) -> None:
    """Record in the metrics file that a node was lost or came back (`change`), at `when` (time.time()): the cause
    `recoveries` measures the next restart from. (One short appended line: rank 0's lines stay whole.)"""
    with open(metrics, "a") as f:
        f.write(json.dumps({"event": "node", "node": node, "change": change, "time": when}) + "\n")


@dataclass(frozen=True)
class Recovery:
    """A restart (its metrics event), what caused it and the seconds from the cause to the end of the first step
    trained after it."""

    restart: dict[str, Any]
    cause: str
    seconds: float

    def describe(self) -> str:
        r = self.restart
        how = "re-formed in place" if r.get("in_place") else "restarted"
        return (
            f"{self.cause} -> first step on {r['world_size']} processes ({r['layout']}, {how}) {self.seconds:.1f} s "
            f"later, resumed from step {r['from_step']}"
        )


def recoveries(records: list[dict[str, Any]]) -> list[Recovery]:
    """Each restart of a run, measured from the node event recorded before it (the demo's), or else from the last
    step logged before it, to the first step logged after it (the one the job resumed with)."""
    out = []
    cause: dict[str, Any] | None = None
    last_step: dict[str, Any] | None = None
    for i, record in enumerate(records):
        kind = record.get("event")
        if kind == "node":
            cause = record
        elif kind is None and "step" in record:
            last_step = record
        elif kind == "restart":
            first = next((r for r in records[i + 1 :] if "event" not in r and "step" in r), None)
            if first is None or (cause is None and last_step is None):
                continue
            if cause is not None:
                since, what = cause["time"], f"node {cause['node']} {cause['change']}"
            else:
                assert last_step is not None
                since, what = last_step["time"], f"a failure after step {last_step['step']} (measured from that step)"
            out.append(Recovery(record, what, first["time"] - since))
            cause = None
    return out


def breakdown(record: dict[str, Any]) -> dict[str, float]:
    """The mean over ranks of each phase of a step, and "other": the rest of the step time (the loss's all-reduce,
    Python between phases). The step time does not count the save's hand-off after the step, the checkpoint
    phase does: then other is clipped at zero."""
    ranks = record.get("ranks") or []
    out = {p: statistics.fmean(r[p] for r in ranks) if ranks else 0.0 for p in PHASES}
    out["other"] = max(0.0, record["step_time_s"] - sum(out.values()))
    return out


def plot_loss(records: list[dict[str, Any]], path: Path, title: str = "loss per step") -> list[str]:
    """Every step's loss as logged (a step trained again after a restart shows twice), coloured by the layout that
    trained it, the learning rate beside it, and where the job restarted, re-formed in place or resumed (after the
    step it resumed from), each named apart, with the layout it went on in. Returns the legend's labels."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r for r in records if "event" not in r and "step" in r]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    trained_by = list(dict.fromkeys((r.get("layout", "?"), r.get("world_size")) for r in steps))
    for i, (layout, world) in enumerate(trained_by):
        mine = [r for r in steps if (r.get("layout", "?"), r.get("world_size")) == (layout, world)]
        label = f"{layout} ({world} processes)" if world else layout
        ax.plot(
            [r["step"] for r in mine], [r["loss"] for r in mine], "os^dv"[i % 5], ms=3.5, color=f"C{i}", label=label
        )
    lr = last_per_step(records)
    lr_ax = ax.twinx()
    lr_ax.plot([r["step"] for r in lr], [r["lr"] for r in lr], color="#bbbbbb", lw=1)
    lr_ax.set_ylabel("learning rate (grey)")
    kinds = {
        "in place": ("C2", ":", "re-formed in place"),
        "restart": ("C3", "--", "restarted"),
        "resume": ("#999999", "-.", "resumed"),
    }
    named: set[str] = set()
    for i, r in enumerate(records):
        if r.get("event") == "restart":
            kind = "in place" if r.get("in_place") else "restart"
        elif r.get("event") == "resume" and not (i + 1 < len(records) and records[i + 1].get("event") == "restart"):
            kind = "resume"  # (a new run from a checkpoint: no earlier incarnation logged steps)
        else:
            continue
        color, style, label = kinds[kind]
        x = r["from_step"] + 0.5
        ax.axvline(x, color=color, ls=style, lw=1.2, label=None if label in named else f"{label} (after the step)")
        named.add(label)
        ax.annotate(f" {r['layout']}", (x, 1), xycoords=("data", "axes fraction"), va="top", fontsize=8, color=color)
    ax.set(xlabel="step", ylabel="loss", title=title)
    legend = ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [text.get_text() for text in legend.get_texts()]


def _plots(records: list[dict[str, Any]], out: Path) -> dict[str, Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = last_per_step(records)
    xs = [r["step"] for r in steps]
    saves = [e for e in records if e.get("event") == "checkpoint"]
    paths = {"loss": out / "loss.png"}
    plot_loss(records, paths["loss"], "loss and learning rate")

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


def checkpoint_headline(records: list[dict[str, Any]]) -> str:
    """What the checkpoints cost the training: the time its save calls took in all (each waits for the previous
    save too, so this is what training waited), and the snapshot's blocking time as a part of it."""
    saves = [r for r in records if r.get("event") == "checkpoint"]
    if not saves:
        return "none"
    calls = [r.get("call_s", r["blocking_s"]) for r in saves]
    blocking = [r["blocking_s"] for r in saves]
    return (
        f"training waited {sum(calls):.2f} s for {len(saves)} saves (the whole save call, which also waits for the "
        f"previous save: median {statistics.median(calls):.3f} s); of it, {sum(blocking):.2f} s blocked on the "
        f"snapshot (median {statistics.median(blocking):.3f} s)"
    )


def _seconds(value: float | None) -> str:
    return "" if value is None else f"{value:.3f}"


def _table(header: list[str], rows: list[list[Any]]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def write(run: Path, out: Path | None = None) -> Path:
    """Build the report of RUN into OUT (default: a `report` directory beside the metrics file); its HTML path."""
    metrics = find_metrics(run)
    records = read(metrics)
    steps = last_per_step(records)
    events = [r for r in records if "event" in r]
    out = out or metrics.parent / "report"
    out.mkdir(parents=True, exist_ok=True)
    plots = _plots(records, out)
    layouts = list(dict.fromkeys(r.get("layout", "?") for r in steps))
    summary = [
        ["checkpoints", checkpoint_headline(records)],
        ["restarts", "; ".join(r.describe() for r in recoveries(records)) or "none"],
        ["steps", f"{steps[0]['step']}..{steps[-1]['step']} ({len(steps)})"],
        ["layouts", ", ".join(layouts)],
        ["final loss", f"{steps[-1]['loss']:.6f}"],
        ["median step time", f"{statistics.median(r['step_time_s'] for r in steps):.3f} s"],
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
            e.get("step", e.get("from_step", e.get("node", ""))),
            e.get("layout", e.get("change", "")),
            _seconds(e.get("call_s")),
            _seconds(e.get("blocking_s", e.get("restore_s"))),
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
{_table(["event", "step (node)", "layout (change)", "save call s", "blocking / restore s"], event_rows)}
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
