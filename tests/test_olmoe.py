"""OLMoE (the Qwen MoE family with q and k norms over all heads, `QwenMoeConfig.qk_norm_full`): a random tiny
transformers OlmoeForCausalLM goes through import, DCP and export with identical logits and every hyperparameter
(`clip_qkv` included); the weights loader fills transformers' own model; the reshaper moves it between TP/PP/EP/ZeRO
layouts (the full-width norms split over TP with their heads); a Megatron conversion is refused, naming why."""

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

from .helpers import DRAW, assert_reshards, hf_logits, random_hf_model

SHAPE = {
    "vocab_size": 100,
    "hidden_size": 32,
    "intermediate_size": 24,  # (OLMoE's experts' FFN size: it has no other MLP)
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_experts": 4,
    "num_experts_per_tok": 2,
}


def hf_model(tmp_path, **overrides) -> torch.nn.Module:
    """A random OLMoE, saved; non-default hyperparameters drawn at random (each changes the logits)."""
    rng = random.Random()
    extra = {
        "norm_topk_prob": rng.choice([True, False]),
        "rope_theta": rng.choice([1e4, 5e5]),
        "rms_norm_eps": rng.choice([1e-6, 1e-5]),
        "clip_qkv": rng.choice([None, 0.05]),
        "tie_word_embeddings": rng.choice([True, False]),
    }
    model = random_hf_model("OlmoeForCausalLM", **{**SHAPE, **extra, **overrides})
    model.save_pretrained(tmp_path / "hf")
    return model


def logits(model: torch.nn.Module) -> torch.Tensor:
    return hf_logits(model, SHAPE["vocab_size"])


def test_import_dcp_and_export_give_the_same_logits(tmp_path):
    from ucp.interop.dcp import export_dcp, import_dcp

    model = hf_model(tmp_path)
    import_hf(tmp_path / "hf", str(tmp_path / "u1"))
    reader = ucp.open_checkpoint(str(tmp_path / "u1"))
    assert reader.atoms["model/model.layers.1.self_attn.q_norm.weight"].shape == (32,)  # (all 4 heads x 8)
    assert reader.atoms["model/model.layers.1.self_attn.k_norm.weight"].shape == (16,)
    export_dcp(str(tmp_path / "u1"), tmp_path / "dcp")
    import_dcp(tmp_path / "dcp", str(tmp_path / "u2"))
    export_hf(str(tmp_path / "u2"), tmp_path / "out")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["model_type"] == "olmoe" and config["architectures"] == ["OlmoeForCausalLM"]
    for key in ("clip_qkv", "norm_topk_prob", "rms_norm_eps", "intermediate_size", "num_experts"):
        assert config[key] == getattr(model.config, key), key
    back = type(model).from_pretrained(tmp_path / "out", attn_implementation="eager").eval()
    assert torch.equal(logits(back), logits(model))


def test_inspect_shows_the_architecture_and_its_hyperparameters(tmp_path):
    from ucp.engine.inspection import describe, format_table

    hf_model(tmp_path, clip_qkv=0.05)
    import_hf(tmp_path / "hf", str(tmp_path / "u"))
    shown = format_table(describe(ucp.open_checkpoint(str(tmp_path / "u"))))
    assert "model       qwen_moe (olmoe):" in shown and "qk_norm_full True" in shown and "clip_qkv 0.05" in shown


def test_the_weights_loader_fills_transformers_own_model(tmp_path):
    from ucp.interop.weights import load_into_module

    model = hf_model(tmp_path)
    import_hf(tmp_path / "hf", str(tmp_path / "u"))
    fresh = type(model)(model.config).eval()
    load_into_module(str(tmp_path / "u"), fresh)
    assert torch.equal(logits(fresh), logits(model))


@pytest.mark.parametrize("source", DRAW.sample(["tp2pp2", "tp1pp2ep2dp2", "tp2pp1ep2dp2", "tp4"], 1))
def test_the_reshaper_saves_in_one_layout_and_loads_in_others(tmp_path, source):
    config = QwenMoeConfig(
        vocab_size=100, hidden_size=32, moe_intermediate_size=24, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=4, num_local_experts=4, qk_norm=False, qk_norm_full=True, make_vocab_size_divisible_by=8,
    )  # fmt: skip
    assert_reshards(config, str(tmp_path), source, ["tp1pp1", "tp2pp1dp2zero1", "tp4pp1ep2dp2", "tp1pp4ep2dp2"])


def test_a_megatron_conversion_is_refused(tmp_path):
    hf_model(tmp_path)
    import_hf(tmp_path / "hf", str(tmp_path / "u"))
    for target in ("tp1", "torch_dist"):
        with pytest.raises(SourceMismatchError, match="OLMoE model, whose q and k norms span all heads"):
            convert(str(tmp_path / "u"), str(tmp_path / target), from_layout="universal", to_layout=target)
        assert not (tmp_path / target).exists()


def test_attention_biases_have_no_atom_and_are_refused(tmp_path):
    hf_model(tmp_path, attention_bias=True)
    with pytest.raises(SourceMismatchError, match="attention_bias=True"):
        import_hf(tmp_path / "hf", str(tmp_path / "u"))
    assert not (tmp_path / "u").exists()
