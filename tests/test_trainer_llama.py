"""The reference trainer on a dense family (Llama): its math against transformers, its layouts against each other,
its local state against ucp's reshaper, and a checkpoint resumed in another layout through ucp.

The same checks as tests/test_trainer.py and tests/test_train_resume.py make of Mixtral, on
trainer/configs/tiny-llama.yaml; the layouts of each run are drawn at random from those the trainer supports.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest

from trainer.config import load_config
from trainer.launch import trainer_argv
from trainer.model import DecoderStage, DenseMLP, StageSpec
from trainer.parallel.mesh import parse_layout
from trainer.weights import canonical_shapes, load_canonical, ucp_config
from ucp.protocol import commit
from ucp.sharding.families.llama import LlamaConfig
from ucp.storage import open_storage

from .helpers import DRAW, assert_same_logits, random_hf_model
from .launch import free_port, spawn
from .test_trainer import assert_initial_params_equal_ucp_shard, hf_fields

pytestmark = pytest.mark.slow  # (scenario tests: multi-process training runs of the dense family)

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "trainer" / "configs" / "tiny-llama.yaml"
STEPS = 8
# every layout of the tiny model on up to 4 processes (no EP: a dense model has no experts)
LAYOUTS = ["tp2pp1", "tp1pp2", "tp1pp1dp2", "tp1pp1dp2zero1", "tp2pp2", "tp1pp2dp2zero1", "tp2pp1dp2zero1"]


def train(layout: str, tmp: Path, steps: int, *extra: str) -> list[dict]:
    """Rank 0's per-step metrics (events left out) of `python -m trainer` in `layout` on tiny-llama."""
    metrics = tmp / f"{layout}-{free_port()}.jsonl"
    spawn(trainer_argv(TINY, layout, steps, metrics, *extra), parse_layout(layout).world_size, timeout=240)
    return [r for r in map(json.loads, metrics.read_text().splitlines()) if "event" not in r]


def losses(records: list[dict]) -> list[float]:
    return [r["loss"] for r in records]


def assert_close(got: list[float], want: list[float], rel: float = 1e-5) -> None:
    assert len(got) == len(want)
    for step, (a, b) in enumerate(zip(got, want), start=1):
        assert abs(a - b) <= rel * abs(b), f"loss {step}: {a!r} vs {b!r}"


@pytest.mark.parametrize("tied", [False, True])
def test_logits_match_transformers_llama(tied):
    cfg = load_config(TINY, [f"model.tie_word_embeddings={str(tied).lower()}"]).model
    hf = random_hf_model("LlamaForCausalLM", **hf_fields(cfg))
    state = {k: v.detach() for k, v in hf.state_dict().items()}  # Llama's HF names are the atoms' names
    assert set(canonical_shapes(cfg)) <= set(state)
    stage = DecoderStage(cfg, StageSpec(layers=list(range(cfg.num_layers)), first=True, last=True))
    assert all(isinstance(layer.mlp, DenseMLP) for layer in stage.decoder.layers)
    load_canonical(stage, state.__getitem__, tp_rank=0)
    aux = assert_same_logits(stage, hf, cfg.vocab_size)
    assert aux.item() == 0.0  # no router, no load-balancing loss


@pytest.mark.parametrize("layout", DRAW.sample(["tp1pp1", "tp2pp2", "tp1pp2dp2zero1", "tp2pp1dp2"], 2))
def test_initial_local_params_equal_ucp_shard_of_the_initial_atoms(layout):
    cfg = load_config(TINY).model
    assert isinstance(ucp_config(cfg), LlamaConfig)
    assert_initial_params_equal_ucp_shard(cfg, layout, None)


def test_layouts_train_like_tp1pp1(tmp_path):
    reference = losses(train("tp1pp1", tmp_path, STEPS))
    assert reference[-1] < reference[0], "the tiny model should learn in a few steps"
    for layout in random.sample(LAYOUTS, 2):
        assert_close(losses(train(layout, tmp_path, STEPS)), reference)


def test_resume_in_another_layout_continues_the_same_losses(tmp_path):
    """Half the steps in one layout, checkpointed through ucp; the other half resumed in another: the losses are
    those of an uninterrupted run (the same bits when the layout is the same)."""
    saved_in, resumed_in = random.sample(LAYOUTS, 2)
    half = STEPS // 2
    root = tmp_path / "ckpt"
    train(saved_in, tmp_path, half, "--ckpt", str(root))
    assert commit.committed_steps(open_storage(str(root))) == [half]
    same = tmp_path / "same"
    shutil.copytree(root, same)

    uninterrupted = train(saved_in, tmp_path, STEPS)[half:]
    resumed = train(resumed_in, tmp_path, STEPS, "--ckpt", str(root))
    assert [r["step"] for r in resumed] == list(range(half + 1, STEPS + 1))
    assert_close(losses(resumed), losses(uninterrupted))
    again = train(saved_in, tmp_path, STEPS, "--ckpt", str(same))
    assert [(r["loss"], r["grad_norm"]) for r in again] == [(r["loss"], r["grad_norm"]) for r in uninterrupted]


def test_expert_parallelism_is_refused_for_a_dense_model(tmp_path):
    with pytest.raises(AssertionError, match="ep > 1 needs a mixture of experts"):
        train("tp1pp1ep2dp2", tmp_path, 1)
