"""The trainer's device logic that runs without a GPU: where each rank trains and on which backend (`placement`),
the collectives through host copies that gloo with CUDA tensors takes (checked here with CPU tensors, bit for bit
against the direct path), and the peer watch that aborts NCCL collectives blocked on a dead peer (its ring, with
real processes killed). tests/test_gpu.py runs the trainer on a GPU."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from trainer import launch
from trainer.config import TrainConfig
from trainer.parallel.mesh import parse_layout
from trainer.train import placement

from .helpers import load_factor

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "trainer" / "configs" / "tiny-moe.yaml"


@pytest.mark.parametrize(
    ("device", "backend", "local_rank", "local_world", "gpus", "expected"),
    [
        ("auto", "auto", 0, 1, 0, ("cpu", "gloo")),
        ("auto", "auto", 3, 4, 8, ("cuda:3", "nccl")),
        ("auto", "auto", 1, 4, 1, ("cpu", "gloo")),  # (fewer GPUs than ranks, nothing asked: the CPU)
        ("auto", "gloo", 3, 4, 1, ("cuda:0", "gloo")),  # (asked for gloo on a GPU machine: ranks share the GPU)
        ("auto", "gloo", 3, 4, 2, ("cuda:1", "gloo")),
        ("cuda", "auto", 1, 2, 2, ("cuda:1", "nccl")),
        ("cpu", "auto", 0, 2, 8, ("cpu", "gloo")),
        ("auto", "nccl", 1, 2, 2, ("cuda:1", "nccl")),
    ],
)
def test_placement(device, backend, local_rank, local_world, gpus, expected):
    got = placement(TrainConfig(device=device, backend=backend), local_rank, local_world, gpus)
    assert (str(got[0]), got[1]) == expected


@pytest.mark.parametrize(
    ("device", "backend", "local_world", "gpus", "error"),
    [
        ("cpu", "nccl", 1, 8, "nccl needs GPUs"),
        ("auto", "nccl", 1, 0, "nccl needs GPUs"),
        ("cuda", "auto", 1, 0, "torch sees no GPU"),
        ("cuda", "nccl", 4, 2, "4 ranks on this node but 2 GPUs: NCCL needs a GPU per rank"),
    ],
)
def test_placements_that_cannot_be(device, backend, local_world, gpus, error):
    with pytest.raises(ValueError, match=error):
        placement(TrainConfig(device=device, backend=backend), 0, local_world, gpus)


def test_device_and_backend_are_checked():
    with pytest.raises(ValueError, match="train.device must be one of auto, cpu, cuda"):
        TrainConfig(device="gpu")
    with pytest.raises(ValueError, match="train.backend must be one of auto, nccl, gloo"):
        TrainConfig(backend="mpi")


def _ring(tmp_path: Path, world: int) -> list[subprocess.Popen]:
    port = launch.free_port()
    procs = [
        subprocess.Popen([sys.executable, "-m", "tests.peerwatch_worker", str(r), str(world), str(port), str(tmp_path)])
        for r in range(world)
    ]
    _wait_for(tmp_path, [f"ready{r}" for r in range(world)], 60)
    return procs


def _wait_for(directory: Path, names: list[str], timeout: float) -> float:
    start = time.monotonic()
    while not all((directory / n).exists() for n in names):
        assert time.monotonic() - start < timeout, f"not all of {names} appeared in {timeout} s"
        time.sleep(0.01)
    return time.monotonic() - start


def test_the_peer_watch_notices_a_killed_rank_around_the_ring(tmp_path):
    """A rank killed outright: every survivor's watch fires (the rank before it directly, the others as the ring
    closes behind it), within a second."""
    procs = _ring(tmp_path, 4)
    try:
        procs[2].send_signal(signal.SIGKILL)
        took = _wait_for(tmp_path, ["lost0", "lost1", "lost3"], 10)
        assert took < 1.0 * load_factor(), f"the survivors noticed in {took:.2f} s (load factor {load_factor():.1f})"
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_ranks_that_end_normally_raise_no_alarm(tmp_path):
    procs = _ring(tmp_path, 3)
    (tmp_path / "stop").write_text("")
    for p in procs:
        assert p.wait(60) == 0
    assert all((tmp_path / f"stopped{r}").exists() for r in range(3))
    assert not list(tmp_path.glob("lost*"))


def _losses(layout: str, tmp: Path, env: dict[str, str] | None) -> list[tuple[float, float]]:
    metrics = tmp / f"{layout}-{launch.free_port()}.jsonl"
    argv = launch.trainer_argv(TINY, layout, 3, metrics, "--set", "data.source=synthetic")
    logs = metrics.with_suffix("")
    launch.wait(launch.start(argv, parse_layout(layout).world_size, logs, env=env), logs, 300)
    lines = [json.loads(line) for line in metrics.read_text().splitlines()]
    return [(r["loss"], r["grad_norm"]) for r in lines if "event" not in r]


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["tp2pp2", "tp1pp1ep2dp2zero1"])
def test_collectives_through_host_copies_give_the_same_bits(tmp_path, layout):
    """Every collective of the trainer (TP all-reduce, PP send/recv, EP all-to-all, DP all-reduce, ZeRO all-gather,
    the profile's all-gather) through host copies, as gloo with CUDA tensors runs them, gives the direct path's
    losses and gradient norms bit for bit."""
    direct = _losses(layout, tmp_path, None)
    via_host = _losses(layout, tmp_path, {"UCP_TRAINER_COLLECTIVES_VIA_HOST": "1"})
    assert len(direct) == 3 and via_host == direct
