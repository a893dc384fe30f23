"""Mixed precision in the reference trainer (`train.precision: bf16`): bf16 parameters and activations, fp32
master weights, Adam states and gradient accumulation, and checkpoints that hold all three.

Tolerance between layouts: bf16 keeps 8 significant bits, and each layout rounds to bf16 at different points (a
TP row-parallel layer sums bf16 partial outputs, DP and EP sum fp32 gradients in another order, and a master that
moves by less than half a bf16 step leaves its parameter unchanged in one layout but not in another). So two
layouts' logits differ by about one bf16 rounding (2^-8 relative) from the first step on. The losses, means over
every token, differ far less: over the first 6 steps they stay within 4e-3 relative (bf16's unit roundoff; seen
here: at most 5e-4). Later steps of this tiny MoE run into a router instability (a gradient-norm spike at step 8,
in fp32 too) that amplifies any rounding difference, so they are not compared across layouts.
"""

from __future__ import annotations

import functools
import shutil
from pathlib import Path

import pytest
import torch

import ucp
from trainer.config import load_config
from trainer.parallel.mesh import parse_layout
from trainer.weights import ucp_config
from ucp.sharding.layout import parse_layout as ucp_parse_layout
from ucp.sharding.reshard import assemble

from .helpers import DRAW, train_records
from .launch import spawn

pytestmark = pytest.mark.slow  # (scenario tests: multi-process bf16 training runs)

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "trainer" / "configs" / "tiny-moe.yaml"
N = 4  # steps before the checkpoint, and after it
COMPARED = 6  # steps compared across layouts (module doc)
BF16 = ("--set", "train.precision=bf16")
# The EP layout of this run (ZeRO-1 included where it fits: flat master weights, an expert group of its own).
EP_LAYOUT = DRAW.choice(["tp1pp1ep2dp2zero1", "tp2pp1ep2dp2zero1", "tp1pp2ep2dp2zero1", "tp1pp1ep2dp2"])


@pytest.fixture(scope="module")
def tmp(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("bf16"))


def train(layout: str, steps: int, tmp: Path, *extra: str) -> list[dict]:
    """Rank 0's per-step records of `python -m trainer` run in `layout` up to `steps`."""
    return [r for r in train_records(TINY, layout, steps, tmp, *extra) if "event" not in r]


@functools.cache
def reference(layout: str, tmp: str) -> tuple[tuple[float, float], ...]:
    """(loss, grad_norm) of 2N uninterrupted bf16 steps in `layout`."""
    steps = train(layout, 2 * N, Path(tmp), *BF16)
    assert [r["step"] for r in steps] == list(range(1, 2 * N + 1))
    return tuple((r["loss"], r["grad_norm"]) for r in steps)


@functools.cache
def first_half(layout: str, precision: str, tmp: str) -> Path:
    """A checkpoint root holding step N of a run in `layout` at `precision`."""
    root = Path(tmp) / f"ckpt-{layout}-{precision}"
    train(layout, N, Path(tmp), "--ckpt", str(root), "--set", f"train.precision={precision}")
    return root


@pytest.mark.parametrize("layout", ["tp2pp2", EP_LAYOUT])
def test_bf16_layouts_train_like_tp1pp1(layout, tmp):
    expected = reference("tp1pp1", tmp)[:COMPARED]
    for step, ((loss, _), (want, _)) in enumerate(zip(reference(layout, tmp), expected), start=1):
        assert abs(loss - want) <= 4e-3 * abs(want), f"step {step}: loss {loss!r} vs tp1pp1's {want!r}"
    # bf16 is really what ran: an fp32 run's losses are not the same bits
    fp32 = train("tp1pp1", 2, Path(tmp))
    assert [r["loss"] for r in fp32] != [loss for loss, _ in reference("tp1pp1", tmp)[:2]]


def test_bf16_checkpoint_holds_bf16_parameters_and_fp32_masters_and_adam_states(tmp):
    reader = ucp.open_checkpoint(str(first_half(EP_LAYOUT, "bf16", tmp)))
    params = [p for p in reader.atoms if p.startswith("model/")]
    masters = [p for p in reader.atoms if p.endswith("/master")]
    assert params and len(masters) == len(params)
    assert {reader.atoms[p].dtype for p in params} == {"bfloat16"}
    for state in ("master", "exp_avg", "exp_avg_sq"):
        assert {m.dtype for p, m in reader.atoms.items() if p.endswith("/" + state)} == {"float32"}, state
    # every parameter is its master rounded to bf16
    values = reader.read_atoms(params + masters)
    for p in params:
        master = values[f"optimizer/state/{p.removeprefix('model/')}/master"]
        assert torch.equal(values[p], master.to(torch.bfloat16)), p
        assert not torch.equal(master, values[p].float()), f"{p}: the master holds no more than bf16"


def test_bf16_resume_in_the_same_layout_is_bitwise_exact(tmp):
    root = first_half(EP_LAYOUT, "bf16", tmp)
    resumed = Path(tmp) / "resumed-same-layout"
    shutil.copytree(root, resumed)
    steps = train(EP_LAYOUT, 2 * N, Path(tmp), "--ckpt", str(resumed), *BF16)
    assert [r["step"] for r in steps] == list(range(N + 1, 2 * N + 1))
    assert [(r["loss"], r["grad_norm"]) for r in steps] == list(reference(EP_LAYOUT, tmp)[N:])


# Restores the latest step under --ckpt like `python -m trainer` and saves the trainer's local state to argv[1]
# (torch.save between test processes), without training.
RESTORE_AND_SAVE = """
import sys, torch, torch.distributed as dist
from trainer.checkpoint import Checkpointer
from trainer.train import build_config, build_trainer, parse_args

trainer = build_trainer(build_config(parse_args(sys.argv[2:])))
checkpointer = Checkpointer(trainer.cfg, trainer)
assert checkpointer.restore() is not None
torch.save(trainer.local_state(), f"{sys.argv[1]}/rank{dist.get_rank()}.pt")
checkpointer.close()
dist.destroy_process_group()
"""


def restored(root: Path, layout: str, precision: str, out: Path) -> dict:
    """The canonical state (model, optimizer states) of a trainer in `layout` at `precision` that restored the
    latest step under `root`, assembled from its ranks' local states."""
    out.mkdir()
    argv = ["--config", str(TINY), "--layout", layout, "--ckpt", str(root), "--set", f"train.precision={precision}"]
    world = parse_layout(layout).world_size
    spawn(["-c", RESTORE_AND_SAVE, str(out), *argv], world)
    locals_ = [torch.load(out / f"rank{r}.pt") for r in range(world)]
    return assemble(locals_, ucp_config(load_config(TINY).model), ucp_parse_layout(layout))


@pytest.mark.parametrize("layout", DRAW.sample(["tp2pp1", "tp1pp2dp2zero1", "tp1pp1", "tp1pp1ep2dp2zero1"], 1))
def test_an_fp32_run_resumes_from_the_master_weights_of_a_bf16_checkpoint(layout, tmp):
    root = first_half(EP_LAYOUT, "bf16", tmp)
    state = restored(root, layout, "fp32", Path(tmp) / f"fp32-from-bf16-{layout}")
    saved = ucp.open_checkpoint(str(root))
    names = list(state["model"])
    values = saved.read_atoms([f"optimizer/state/{n}/{s}" for n in names for s in ("master", "exp_avg", "exp_avg_sq")])
    for name, param in state["model"].items():
        assert param.dtype == torch.float32
        assert torch.equal(param, values[f"optimizer/state/{name}/master"]), name
        for s in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(state["optimizer"]["state"][name][s], values[f"optimizer/state/{name}/{s}"]), (name, s)
        assert "master" not in state["optimizer"]["state"][name], "an fp32 run keeps no masters"


@pytest.mark.parametrize("layout", DRAW.sample(["tp2pp1", "tp1pp2dp2zero1", "tp1pp1ep2dp2zero1"], 1))
def test_a_bf16_run_makes_its_masters_from_the_weights_of_an_fp32_checkpoint(layout, tmp):
    root = first_half("tp2pp1", "fp32", tmp)
    state = restored(root, layout, "bf16", Path(tmp) / f"bf16-from-fp32-{layout}")
    saved = ucp.open_checkpoint(str(root))
    weights = saved.read_atoms([f"model/{n}" for n in state["model"]])
    for name, param in state["model"].items():
        fp32 = weights[f"model/{name}"]
        assert fp32.dtype == torch.float32
        assert torch.equal(state["optimizer"]["state"][name]["master"], fp32), name
        assert param.dtype == torch.bfloat16 and torch.equal(param, fp32.to(torch.bfloat16)), name
