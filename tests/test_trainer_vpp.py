"""Interleaved pipelines (virtual stages, vpp > 1) in the reference trainer: Megatron's interleaved 1F1B schedule,
layout equivalence with tp1pp1, and checkpoints that resume into and out of an interleaved layout.

The schedule is first run on its own, every stage a thread exchanging messages through queues, so that what each
model chunk receives can be checked message by message; then the trainer runs it over gloo for real.
"""

from __future__ import annotations

import functools
import queue
import random
import shutil
import threading
from pathlib import Path

import pytest
import torch

from trainer.config import load_config
from trainer.parallel.mesh import parse_layout
from trainer.parallel.pipeline import ACTIVATION, GRADIENT, StageOutput, interleaved_one_f_one_b
from trainer.weights import ucp_config
from ucp.sharding.layout import parse_layout as ucp_parse_layout
from ucp.sharding.reshard import assemble

from .helpers import DRAW, train_records
from .launch import spawn

pytestmark = pytest.mark.slow  # (scenario tests: multi-process training runs with interleaved pipelines)

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "trainer" / "configs" / "tiny-moe.yaml"
N = 4  # steps before the checkpoint, and after it

# --- the schedule alone ---------------------------------------------------------------------------------


class QueueP2P:
    """P2P.communicate over in-process queues, for one stage of a ring of `stages` threads."""

    def __init__(self, stage: int, stages: int, queues: dict):
        self.stage, self.stages, self.queues = stage, stages, queues
        self.prev, self.next = (stage - 1) % stages, (stage + 1) % stages

    def communicate(self, send_next=None, send_prev=None, recv_prev=False, recv_next=False):
        if send_next is not None:
            self.queues[(self.stage, self.next, ACTIVATION)].put(send_next.detach())
        if send_prev is not None:
            self.queues[(self.stage, self.prev, GRADIENT)].put(send_prev.detach())
        x = self.queues[(self.prev, self.stage, ACTIVATION)].get(timeout=10) if recv_prev else None
        dy = self.queues[(self.next, self.stage, GRADIENT)].get(timeout=10) if recv_next else None
        return (x.requires_grad_() if x is not None else None), dy


def simulate(stages: int, chunks: int, microbatches: int) -> list[list[tuple[str, int, int]]]:
    """Run the interleaved schedule on `stages` threads; every forward checks that its input is the output of the
    model chunk before it for the same microbatch, every backward that its gradient comes from the chunk after
    it. Returns each stage's ("F" or "B", model chunk, microbatch) in the order it ran them."""
    queues = {(a, b, tag): queue.Queue() for a in range(stages) for b in range(stages) for tag in (0, 1)}
    logs: list[list[tuple[str, int, int]]] = [[] for _ in range(stages)]
    errors: list[BaseException] = []
    last = stages * chunks - 1

    def run(stage: int) -> None:
        # An activation is [model chunk, microbatch]; y = x + [1, 0] (a leaf on the first chunk). The loss of
        # microbatch i is y . [last, i], so the gradient that comes back to every chunk for microbatch i is [last, i].
        leaf = torch.zeros(2, requires_grad=True)

        def forward_step(v: int, i: int, x):
            c = v * stages + stage
            if c == 0:
                assert x is None
                y = leaf + torch.tensor([0.0, i])
            else:
                assert x.tolist() == [c - 1, i], f"chunk {c} microbatch {i} got {x.tolist()}"
                y = x + torch.tensor([1.0, 0.0])
            logs[stage].append(("F", c, i))

            def backward_hook(g, c=c, i=i):
                assert g.tolist() == [last, i], f"chunk {c} microbatch {i} got gradient {g.tolist()}"
                logs[stage].append(("B", c, i))

            y.register_hook(backward_hook)
            if c == last:
                return StageOutput(None, (y * torch.tensor([float(last), float(i)])).sum())
            return StageOutput(y, y.sum() * 0)

        try:
            interleaved_one_f_one_b(microbatches, forward_step, QueueP2P(stage, stages, queues), stage, stages, chunks)
        except BaseException as e:  # noqa: BLE001 (reported by the test)
            errors.append(e)

    threads = [threading.Thread(target=run, args=(s,)) for s in range(stages)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    return logs


@pytest.mark.parametrize("stages, chunks, microbatches", [(2, 2, 4), (2, 2, 2), (4, 2, 8), (2, 3, 6), (4, 3, 4)])
def test_interleaved_schedule_passes_every_microbatch_through_every_chunk_in_order(stages, chunks, microbatches):
    logs = simulate(stages, chunks, microbatches)
    for stage, log in enumerate(logs):
        mine = [v * stages + stage for v in range(chunks)]
        forwards = [(c, i) for kind, c, i in log if kind == "F"]
        assert sorted(forwards) == [(c, i) for c in mine for i in range(microbatches)]
        # Megatron's order: groups of P microbatches, chunk by chunk, so a stage starts its second chunk before its
        # first has seen every microbatch (what shrinks the bubble)
        expected = [
            (v * stages + stage, g * stages + j)
            for g in range(microbatches // stages)
            for v in range(chunks)
            for j in range(stages)
        ]
        assert forwards == expected, f"stage {stage}"
        if microbatches > stages:  # (1F1B: backwards start before the last forward; with M == P they cannot)
            first_backward = next(n for n, (kind, _, _) in enumerate(log) if kind == "B")
            last_forward = max(n for n, (kind, _, _) in enumerate(log) if kind == "F")
            assert first_backward < last_forward, f"stage {stage}"
    # every (chunk, microbatch) ran its backward once, with the gradient of its own microbatch
    backwards = sorted((c, i) for log in logs for kind, c, i in log if kind == "B")
    assert backwards == [(c, i) for c in range(stages * chunks) for i in range(microbatches)]


def test_an_interleaved_pipeline_needs_microbatches_a_multiple_of_pp():
    with pytest.raises(ValueError, match="multiple of pp"):
        interleaved_one_f_one_b(3, None, None, 0, 2, 2)


# --- the trainer, for real ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tmp(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("vpp"))


def train(layout: str, steps: int, tmp: Path, *extra: str) -> list[dict]:
    """Rank 0's records of `python -m trainer` run in `layout` up to `steps`."""
    return train_records(TINY, layout, steps, tmp, *extra)


def losses(records: list[dict]) -> list[tuple[float, float]]:
    return [(r["loss"], r["grad_norm"]) for r in records if "event" not in r]


@functools.cache
def reference(layout: str, tmp: str) -> tuple[tuple[float, float], ...]:
    """(loss, grad_norm) of 2N uninterrupted steps."""
    return tuple(losses(train(layout, 2 * N, Path(tmp))))


def assert_close(got, want, rel: float = 1e-5) -> None:
    assert len(got) == len(want)
    for step, ((loss, _), (expected, _)) in enumerate(zip(got, want), start=1):
        assert abs(loss - expected) <= rel * abs(expected), f"step {step}: {loss!r} vs {expected!r}"


# tiny-moe has 4 layers: pp2 vpp2 is one layer per model chunk; 2 microbatches per DP rank at dp2 (M == P: every
# forward in the warm-up), 4 at dp1
VPP_LAYOUTS = ["tp1pp2vpp2", "tp2pp2vpp2", "tp1pp2vpp2dp2zero1", "tp1pp2vpp2ep2dp2"]


@pytest.mark.parametrize("layout", DRAW.sample(VPP_LAYOUTS, 2))
def test_interleaved_layouts_train_like_tp1pp1(layout, tmp):
    assert_close(reference(layout, tmp), reference("tp1pp1", tmp))


def test_tied_embeddings_over_an_interleaved_pipeline_train_like_tp1pp1(tmp_path):
    """The embedding lives in stage 0's first model chunk, its copy in the last stage's last chunk: their gradients
    are summed over the two, as without virtual stages."""
    tied = ("--set", "model.tie_word_embeddings=true")
    layout = random.choice(["tp1pp2vpp2", "tp2pp2vpp2"])
    assert_close(losses(train(layout, N, tmp_path, *tied)), losses(train("tp1pp1", N, tmp_path, *tied)))


@functools.cache
def checkpointed(layout: str, tmp: str) -> Path:
    root = Path(tmp) / f"ckpt-{layout}"
    train(layout, N, Path(tmp), "--ckpt", str(root))
    return root


def resume(saved_in: str, layout: str, tmp: str) -> list[tuple[float, float]]:
    root = Path(tmp) / f"resume-{saved_in}-to-{layout}"
    shutil.copytree(checkpointed(saved_in, tmp), root)
    records = train(layout, 2 * N, Path(tmp), "--ckpt", str(root))
    (resumed,) = [r for r in records if r.get("event") == "resume"]
    assert resumed["from_step"] == N and resumed["saved_layout"] == saved_in and resumed["layout"] == layout
    return losses(records)


@pytest.mark.parametrize(
    "saved_in, resumed_in",
    [
        (DRAW.choice(VPP_LAYOUTS), DRAW.choice(["tp1pp1", "tp2pp1", "tp1pp2", "tp1pp1ep2dp2"])),
        (DRAW.choice(["tp1pp2dp2zero1", "tp2pp1", "tp1pp4"]), DRAW.choice(VPP_LAYOUTS)),
    ],
)
def test_resume_into_and_out_of_an_interleaved_layout_continues_the_same_losses(saved_in, resumed_in, tmp):
    assert_close(resume(saved_in, resumed_in, tmp), reference("tp1pp1", tmp)[N:])


def test_resume_in_the_same_interleaved_layout_is_bitwise_exact(tmp):
    layout = "tp1pp2vpp2dp2zero1"  # (ZeRO-1 flat buffers over two model chunks)
    assert resume(layout, layout, tmp) == list(reference(layout, tmp)[N:])


# Trains like `python -m trainer` and saves the local state of every rank to argv[1] (torch.save between test
# processes).
RUN_AND_SAVE = """
import sys, torch, torch.distributed as dist
from trainer.train import build_config, build_trainer, parse_args, train

trainer = build_trainer(build_config(parse_args(sys.argv[2:])))
train(trainer)
torch.save(trainer.local_state(), f"{sys.argv[1]}/rank{dist.get_rank()}.pt")
dist.destroy_process_group()
"""


def test_trained_interleaved_state_is_docs_local_state_and_assembles_to_tp1pp1s_atoms(tmp_path):
    """The local state of an interleaved layout ("model0", "model1", flat ZeRO buffers over both chunks) is what
    ucp's reshaper says it is: assembled, it gives the atoms that tp1pp1 trained."""
    states = {}
    for layout in ("tp1pp1", "tp1pp2vpp2dp2zero1"):
        out = tmp_path / layout
        out.mkdir()
        world = parse_layout(layout).world_size
        spawn(["-c", RUN_AND_SAVE, str(out), "--config", str(TINY), "--layout", layout, "--steps", "3"], world)
        local = [torch.load(out / f"rank{r}.pt") for r in range(world)]
        if layout != "tp1pp1":
            assert [k for k in local[0] if k.startswith("model")] == ["model0", "model1"]
        states[layout] = assemble(local, ucp_config(load_config(TINY).model), ucp_parse_layout(layout))
    reference, other = states["tp1pp1"], states["tp1pp2vpp2dp2zero1"]
    assert list(other["model"]) == list(reference["model"])
    for name, value in reference["model"].items():
        assert ((other["model"][name] - value).norm() / value.norm()).item() <= 1e-4, name
    for name, per_state in reference["optimizer"]["state"].items():
        for state, value in per_state.items():
            got = other["optimizer"]["state"][name][state]
            assert ((got - value).norm() / value.norm()).item() <= 1e-4, (name, state)
