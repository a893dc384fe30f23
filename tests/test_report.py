"""The run report (trainer/report.py) from a real run: the metrics file's per-step breakdown and per-rank memory,
and one self-contained HTML page that embeds its plots and names every rank; its headline is the time training
waited for its checkpoints (the metrics' sum of save call time), and the demo prints the recovery times it shows."""

from __future__ import annotations

import html
import json
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest

from trainer import report
from trainer.parallel.mesh import parse_layout
from trainer.profile import PHASES

from .test_train_resume import finish, start

pytestmark = pytest.mark.slow  # (scenario tests: a real multi-process run and its report)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_a_real_runs_report_breaks_each_step_down_per_rank_and_names_every_rank(tmp_path):
    layout = random.choice(["tp1pp2", "tp2pp2", "tp1pp2dp2zero1", "tp2pp1"])
    world = parse_layout(layout).world_size
    metrics = tmp_path / "metrics.jsonl"
    finish(start(layout, 5, metrics, "--ckpt", str(tmp_path / "ckpt"), "--save-interval", "2"))
    steps = [r for r in map(json.loads, metrics.read_text().splitlines()) if "event" not in r]
    assert len(steps) == 5
    for record in steps:
        ranks = record["ranks"]
        assert [r["rank"] for r in ranks] == list(range(world))
        assert {r["pp"] for r in ranks} == set(range(parse_layout(layout).pp))
        for r in ranks:
            assert all(r[p] >= 0 for p in PHASES) and r["forward"] > 0 and r["backward"] > 0
            assert r["peak_rss_bytes"] > 50 * 2**20
            # (each rank's own step: a rank that starts its first step early waits for the others in it)
            assert sum(r[p] for p in PHASES if p != "checkpoint") <= r["step_s"] * 1.05
        if parse_layout(layout).pp > 1:  # a pipeline's stages wait for each other
            assert max(r["pipeline_wait"] for r in ranks) > 0
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "trainer.report", str(tmp_path), "--out", str(out)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    page = (out / "report.html").read_text()
    images = re.findall(r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"', page)
    assert len(images) == 3 and all(len(i) > 5000 for i in images)
    for rank in range(world):
        assert f"<td>rank {rank}</td>" in page
    assert page.count("<td>checkpoint</td>") == 3  # saves at steps 2, 4 and the last
    assert sorted(p.name for p in out.glob("*.png")) == ["loss.png", "stages.png", "step_time.png"]
    assert_headline_is_the_save_call_time(page, metrics)


def assert_headline_is_the_save_call_time(page: str, metrics: Path) -> None:
    """The report's first figure: what training waited for its checkpoints, the sum of every save call's time."""
    saves = [r for r in map(json.loads, metrics.read_text().splitlines()) if r.get("event") == "checkpoint"]
    waited = re.search(r"<td>checkpoints</td><td>training waited ([0-9.]+) s for (\d+) saves", page)
    assert waited, page[:3000]
    assert waited.group(1) == f"{sum(r['call_s'] for r in saves):.2f}" and int(waited.group(2)) == len(saves)
    blocked = re.search(r"of it, ([0-9.]+) s blocked on the snapshot", page)
    assert blocked and blocked.group(1) == f"{sum(r['blocking_s'] for r in saves):.2f}"
    assert float(blocked.group(1)) <= float(waited.group(1))  # (blocking is a part of the call)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_the_demo_and_its_report_give_the_same_recovery_times_and_the_plot_names_each_recovery(tmp_path):
    """A short demo (a node lost after step 4 is in its hot tier, back after step 8): the recovery lines it prints
    are the report's, measured from the node events it recorded; the loss plot names the layouts, the in-place
    re-forming and the restart apart."""
    run = tmp_path / "run"
    demo = subprocess.run(
        [sys.executable, "-m", "trainer.demo", "--dir", str(run), "--steps", "14", "--kill-after", "4",
         "--rejoin-after", "8"],
        capture_output=True, text=True, timeout=900, check=False,
    )  # fmt: skip
    assert demo.returncode == 0, demo.stdout[-3000:] + demo.stderr[-3000:]
    printed = [line.split("; the ranks read")[0] for line in demo.stdout.splitlines() if " s later, resumed " in line]
    page = html.unescape((run / "report" / "report.html").read_text())
    shown = re.search(r"<td>restarts</td><td>(.*?)</td>", page)
    assert shown and shown.group(1).split("; ") == printed, (printed, shown)
    assert [line.split(" -> ")[0] for line in printed] == ["node b lost", "node b back"]
    records = report.read(run / "metrics.jsonl")
    nodes = [r for r in records if r.get("event") == "node"]
    assert [(n["node"], n["change"]) for n in nodes] == [("b", "lost"), ("b", "back")]
    for recovery, node in zip(report.recoveries(records), nodes):
        first = next(r for r in records if "event" not in r and r["time"] > recovery.restart["time"] - 1e-9)
        assert f"{first['time'] - node['time']:.1f} s later" in recovery.describe()
    labels = report.plot_loss(records, tmp_path / "loss.png")
    assert labels == [
        "tp2pp2 (4 processes)",
        "tp2pp1 (2 processes)",
        "re-formed in place (after the step)",
        "restarted (after the step)",
    ]
    assert_headline_is_the_save_call_time(page, run / "metrics.jsonl")


def test_report_errors_are_one_line(tmp_path):
    bad = subprocess.run(
        [sys.executable, "-m", "trainer.report", str(tmp_path)], capture_output=True, text=True, check=False
    )
    assert bad.returncode != 0 and "holds 0 .jsonl files" in bad.stderr
    (tmp_path / "metrics.jsonl").write_text('{"event": "resume"}\nnot json\n')
    bad = subprocess.run(
        [sys.executable, "-m", "trainer.report", str(tmp_path)], capture_output=True, text=True, check=False
    )
    assert bad.returncode != 0 and "metrics.jsonl:2 is not JSON" in bad.stderr
