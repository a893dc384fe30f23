"""`python -m bench_io collectives`: nccl-tests' bandwidth definitions, result checks that catch a wrong
collective, and a small sweep over real gloo process groups."""

from __future__ import annotations

import json
import random

import pytest
import torch
import torch.distributed as dist

from bench_io import collectives
from bench_io.__main__ import main as bench_main

from .launch import free_port

pytestmark = pytest.mark.slow  # (scenario tests: a gloo collectives sweep)

# nccl-tests doc/PERFORMANCE.md: busBw = algBw * factor, with these factors for n ranks
NCCL_TESTS = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1,
    "all_to_all": lambda n: (n - 1) / n,
}


def test_bus_bandwidth_factors_are_nccl_tests():
    for n in (2, 3, 4, 8, 64, random.randint(2, 4096)):
        for c in collectives.COLLECTIVES:
            assert collectives.bus_factor(c, n) == pytest.approx(NCCL_TESTS[c](n))
    assert collectives.bus_factor("all_reduce", 8) == 1.75 and collectives.bus_factor("all_gather", 8) == 0.875
    with pytest.raises(ValueError):
        collectives.bus_factor("reduce", 2)


@pytest.fixture
def one_rank():
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.parametrize("collective", collectives.COLLECTIVES)
def test_the_result_check_catches_a_wrong_element(one_rank, monkeypatch, collective):
    numel = random.choice([7, 64, 1000])
    _, check = collectives._op(collective, numel, 0, 1, torch.device("cpu"))
    assert check()
    names = {
        "all_reduce": ["all_reduce"],
        "reduce_scatter": ["reduce_scatter_single", "reduce_scatter_tensor"],
        "all_gather": ["all_gather_single", "all_gather_into_tensor"],
        "broadcast": ["broadcast"],
        "all_to_all": ["all_to_all_single"],
    }[collective]
    at = random.randrange(numel)
    for name in names:
        real = getattr(dist, name, None)
        if real is None:
            continue

        def corrupt(*args, _real=real, **kwargs):
            _real(*args, **kwargs)
            args[0].view(-1)[at] += 1  # one element of the output off by one

        monkeypatch.setattr(dist, name, corrupt)
    _, check = collectives._op(collective, numel, 0, 1, torch.device("cpu"))
    assert not check()


def test_a_small_sweep_over_gloo_checks_every_result_and_writes_table_json_and_chart(tmp_path, capsys):
    out, png = tmp_path / "c.json", tmp_path / "c.png"
    argv = ["collectives", "--worlds", "2,3", "--max-bytes", "16KiB", "--iters", "2", "--warmup", "1"]
    assert bench_main([*argv, "--json", str(out), "--chart", str(png)]) == 0
    table = capsys.readouterr().out
    assert "world size 2" in table and "world size 3" in table and " NO" not in table
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 2 * len(collectives.COLLECTIVES) * len(collectives.sizes(1024, 16 << 10))
    for r in rows:
        assert r["correct"] and r["backend"] == "gloo" and r["time_us"] > 0
        assert r["bytes"] % (4 * r["world"]) == 0 and r["bytes"] <= 16 << 10
        assert r["algbw_gbps"] == pytest.approx(r["bytes"] / (r["time_us"] * 1e-6) / 1e9)
        assert r["busbw_gbps"] == pytest.approx(r["algbw_gbps"] * NCCL_TESTS[r["collective"]](r["world"]))
    assert png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"


def test_bad_arguments_are_one_line_errors():
    for argv in (
        ["--worlds", "1"],
        ["--worlds", "two"],
        ["--iters", "0"],
        ["--min-bytes", "1MiB", "--max-bytes", "1KiB"],
    ):
        with pytest.raises(SystemExit) as e:
            collectives.main(argv)
        assert "bench_io collectives" in str(e.value)
