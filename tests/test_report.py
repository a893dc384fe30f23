"""The run report (trainer/report.py) from a real run: the metrics file's per-step breakdown and per-rank memory,
and one self-contained HTML page that embeds its plots and names every rank."""

from __future__ import annotations

import json
import random
import re
import subprocess
import sys

import pytest

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
