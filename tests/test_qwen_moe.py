"""The Qwen MoE family (ucp.sharding.families.qwen_moe): a random tiny transformers Qwen3MoeForCausalLM or
Qwen2MoeForCausalLM (shared expert, q/k/v biases) goes through every path and gives identical logits; the reshaper
moves it between layouts; megatron-core computes the same; configs it cannot hold are refused."""

from __future__ import annotations

import json
import random

import pytest
import torch

import ucp
from ucp.interop.errors import SourceMismatchError
from ucp.interop.hf import export_hf, import_hf
from ucp.interop.megatron.convert import convert
from ucp.sharding.families.qwen_moe import QwenMoeConfig

from .helpers import assert_reshards, hf_logits, perturb_parameters

transformers = pytest.importorskip("transformers")

SHAPE = {
    "vocab_size": 100,
    "hidden_size": 32,
    "intermediate_size": 40,
    "moe_intermediate_size": 24,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "max_position_embeddings": 64,
}
ARCHS = {
    "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM, {"head_dim": 16}),
    "qwen2_moe": (
        transformers.Qwen2MoeConfig,
        transformers.Qwen2MoeForCausalLM,
        {"shared_expert_intermediate_size": 56},
    ),
}
HEAD_DIM = {"qwen3_moe": 16, "qwen2_moe": 8}


def hf_model(tmp_path, arch, **overrides):
    """A random Qwen MoE, saved; non-default hyperparameters drawn at random (each changes the logits)."""
    rng = random.Random()
    config_cls, model_cls, shape = ARCHS[arch]
    extra = {
        "norm_topk_prob": rng.choice([True, False]),
        "rope_theta": rng.choice([1e4, 1e6]),
        "rms_norm_eps": rng.choice([1e-6, 1e-5]),
        "tie_word_embeddings": rng.choice([True, False]),
    }
    config = config_cls(**{**SHAPE, **shape, **extra, **overrides})
    torch.manual_seed(rng.randrange(1000))
    model = model_cls(config).eval()
    perturb_parameters(model)
    model.save_pretrained(tmp_path / "hf")
    return model


def logits(model):
    return hf_logits(model, SHAPE["vocab_size"])


def back_in_transformers(out, model):
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == model.config.model_type
    assert config["architectures"] == [type(model).__name__]
    return type(model).from_pretrained(out).eval()


@pytest.mark.parametrize("arch", list(ARCHS))
@pytest.mark.parametrize("layout", ["tp2ep2", "tp2pp2ep2", "tp1pp2"])
def test_through_megatron_and_back_gives_the_same_logits(tmp_path, arch, layout):
    model = hf_model(tmp_path, arch)
    import_hf(tmp_path / "hf", str(tmp_path / "u1"))
    cfg = ucp.open_checkpoint(str(tmp_path / "u1"))
    assert any("mlp.experts.3.down_proj" in a for a in cfg.atoms)
    convert(str(tmp_path / "u1"), str(tmp_path / "megatron"), from_layout="universal", to_layout=layout)
    convert(str(tmp_path / "megatron"), str(tmp_path / "u2"), from_layout=layout, to_layout="universal")
    export_hf(str(tmp_path / "u2"), tmp_path / "out")
    assert torch.equal(logits(back_in_transformers(tmp_path / "out", model)), logits(model))


@pytest.mark.parametrize("arch", list(ARCHS))
def test_through_torch_dist_and_dcp_and_back_gives_the_same_logits(tmp_path, arch):
    from ucp.interop.dcp import export_dcp, import_dcp

    model = hf_model(tmp_path, arch)
    import_hf(tmp_path / "hf", str(tmp_path / "u1"))
    convert(str(tmp_path / "u1"), str(tmp_path / "td"), from_layout="universal", to_layout="torch_dist")
    convert(str(tmp_path / "td"), str(tmp_path / "u2"), from_layout="torch_dist", to_layout="universal")
    export_dcp(str(tmp_path / "u2"), tmp_path / "dcp")
    import_dcp(tmp_path / "dcp", str(tmp_path / "u3"))
    export_hf(str(tmp_path / "u3"), tmp_path / "out")
    assert torch.equal(logits(back_in_transformers(tmp_path / "out", model)), logits(model))


@pytest.mark.parametrize("arch", list(ARCHS))
def test_the_weights_loader_fills_transformers_own_fused_experts(tmp_path, arch):
    from ucp.interop.weights import load_into_module

    model = hf_model(tmp_path, arch)
    import_hf(tmp_path / "hf", str(tmp_path / "u"))
    fresh = type(model)(model.config).eval()
    load_into_module(str(tmp_path / "u"), fresh)
    assert torch.equal(logits(fresh), logits(model))


@pytest.mark.parametrize(
    "flags", [{}, {"qk_norm": False, "attention_bias": True, "shared_expert_intermediate_size": 56}]
)
def test_the_reshaper_saves_in_one_layout_and_loads_in_others(tmp_path, flags):
    config = QwenMoeConfig(
        vocab_size=100, hidden_size=32, moe_intermediate_size=24, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, head_dim=16, make_vocab_size_divisible_by=8, **flags,
    )  # fmt: skip
    source = random.choice(["tp2pp2", "tp1pp2ep2dp2", "tp2pp1ep2dp2"])
    assert_reshards(config, str(tmp_path), source, ["tp1pp1", "tp2pp1dp2zero1", "tp1pp4ep2dp2"])


@pytest.mark.parametrize("setting", [{"decoder_sparse_step": 2}, {"mlp_only_layers": [1]}, {"hidden_act": "gelu"}])
def test_settings_whose_weights_have_no_atom_are_refused(tmp_path, setting):
    hf_model(tmp_path, random.choice(list(ARCHS)), **setting)
    key = next(iter(setting))
    with pytest.raises(SourceMismatchError, match=f"{key}="):
        import_hf(tmp_path / "hf", str(tmp_path / "u"))
    assert not (tmp_path / "u").exists()


@pytest.mark.parametrize("arch", list(ARCHS))
@pytest.mark.parametrize("norm_topk_prob", [True, False])
@pytest.mark.slow
def test_megatron_core_loads_the_rank_files_strictly_and_computes_the_same(tmp_path, arch, norm_topk_prob):
    """megatron-core's own MoE GPT model (TP 2, local spec, SequentialMLP experts; q/k layer norms for Qwen3-MoE,
    q/k/v biases and a gated shared expert for Qwen2-MoE) takes ucp's tp2 files with strict=True and computes the
    logits transformers computes (within float tolerance: another kernel order; HF's renormalised top-k is
    Megatron's softmax over the top-k, the other its pre-softmax router)."""
    pytest.importorskip("megatron.core")
    from .launch import spawn
    from .megatron_worker import tokens

    # (the worker's model has RoPE base 1e4 and norm epsilon 1e-6)
    model = hf_model(
        tmp_path, arch, norm_topk_prob=norm_topk_prob, tie_word_embeddings=False, rope_theta=1e4, rms_norm_eps=1e-6
    )
    import_hf(tmp_path / "hf", str(tmp_path / "u"))
    convert(str(tmp_path / "u"), str(tmp_path / "megatron"), from_layout="universal", to_layout="tp2")
    out = tmp_path / "logits"
    qwen2 = arch == "qwen2_moe"
    argv = ["tests/megatron_family_worker.py", str(tmp_path / "megatron"), str(out)]
    argv += ["1" if qwen2 else "0", "0" if qwen2 else "1", str(HEAD_DIM[arch])]
    argv += [str(SHAPE["num_experts"]), str(SHAPE["moe_intermediate_size"]), "0" if norm_topk_prob else "1"]
    argv += [str(ARCHS[arch][2].get("shared_expert_intermediate_size", 0))]
    spawn(argv, 2, timeout=300, env={"PYTHONWARNINGS": "ignore"})
    with torch.no_grad():
        expected = model(tokens()).logits
    for rank in range(2):
        got = torch.load(f"{out}.{rank}", weights_only=True)
        assert torch.allclose(got, expected, atol=1e-4, rtol=1e-4), (rank, (got - expected).abs().max())
