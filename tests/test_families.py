"""The dense decoder family (Llama, Mistral, Qwen2 with q/k/v biases, Qwen3 with q/k norms) on every path a Mixtral
takes: a random tiny transformers model imported, converted to Megatron rank files (tp2, and pp2) and back, exported,
gives identical logits in transformers; and the reshaper alone saves it in one layout and loads it in others."""

from __future__ import annotations

import json

import pytest
import torch

from ucp.interop.hf import export_hf, import_hf
from ucp.interop.megatron.args import MEGATRON_LLAMA3
from ucp.interop.megatron.convert import convert
from ucp.sharding.families import LlamaConfig

from .helpers import assert_reshards, perturb_parameters

transformers = pytest.importorskip("transformers")

SHAPE = {
    "vocab_size": 100,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}
ARCHS = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {"rope_theta": 5e5, "rms_norm_eps": 1e-6}),
    "llama-tied": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {"tie_word_embeddings": True}),
    # RoPE scaled as Megatron's args say it (use_rope_scaling, rotary_seq_len_interpolation_factor); the base large
    # enough that llama3's scaling moves a frequency (one wavelength over 8192)
    "llama-llama3": (
        transformers.LlamaConfig,
        transformers.LlamaForCausalLM,
        {"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, **MEGATRON_LLAMA3}},
    ),
    "llama-linear": (
        transformers.LlamaConfig,
        transformers.LlamaForCausalLM,
        {"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}},
    ),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM, {"sliding_window": 8}),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, {}),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, {"head_dim": 16}),
}


def hf_model(arch: str, tmp_path):
    config_cls, model_cls, extra = ARCHS[arch]
    torch.manual_seed(0)
    model = model_cls(config_cls(**SHAPE, **extra)).eval()
    perturb_parameters(model)
    model.save_pretrained(tmp_path / "hf")
    return model


def logits(model, tokens):
    with torch.no_grad():
        return model(tokens).logits


@pytest.mark.parametrize("arch", list(ARCHS))
@pytest.mark.parametrize("layout", ["tp2", "tp2pp2"])
def test_through_megatron_and_back_gives_the_same_logits(tmp_path, arch, layout):
    model = hf_model(arch, tmp_path)
    import_hf(tmp_path / "hf", str(tmp_path / "u1"))
    convert(str(tmp_path / "u1"), str(tmp_path / "megatron"), from_layout="universal", to_layout=layout)
    convert(str(tmp_path / "megatron"), str(tmp_path / "u2"), from_layout=layout, to_layout="universal")
    export_hf(str(tmp_path / "u2"), tmp_path / "out")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["model_type"] == arch.split("-")[0]
    back = type(model).from_pretrained(tmp_path / "out").eval()
    tokens = torch.randint(0, SHAPE["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(1))
    assert torch.equal(logits(back, tokens), logits(model, tokens))


@pytest.mark.parametrize(
    "flags", [{}, {"attention_bias": True}, {"qk_norm": True, "head_dim": 16}, {"tie_word_embeddings": True}]
)
def test_the_reshaper_saves_in_one_layout_and_loads_in_others(tmp_path, flags):
    config = LlamaConfig(**SHAPE, make_vocab_size_divisible_by=8, **flags)
    assert_reshards(config, str(tmp_path), "tp2pp2", ["tp1pp1", "tp2pp1dp2zero1", "tp1pp2dp2"])


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "llama-llama3", "llama-linear"])
@pytest.mark.slow
def test_megatron_core_loads_the_rank_files_strictly_and_computes_the_same(tmp_path, arch):
    """megatron-core's own GPT model (TP 2, local spec) takes ucp's tp2 files with strict=True, names and shapes as
    its own, and with RoPE as their args say it computes the logits transformers computes (within float tolerance:
    another kernel order)."""
    pytest.importorskip("megatron.core")
    from .launch import spawn

    _, _, extra = ARCHS[arch]
    model = hf_model(arch, tmp_path)
    import_hf(tmp_path / "hf", str(tmp_path / "u"))
    convert(str(tmp_path / "u"), str(tmp_path / "megatron"), from_layout="universal", to_layout="tp2")
    out = tmp_path / "logits"
    head_dim = extra.get("head_dim", SHAPE["hidden_size"] // SHAPE["num_attention_heads"])
    spawn(
        [
            "tests/megatron_family_worker.py",
            str(tmp_path / "megatron"),
            str(out),
            "1" if arch == "qwen2" else "0",
            "1" if arch == "qwen3" else "0",
            str(head_dim),
        ],
        2,
        timeout=300,
        env={"PYTHONWARNINGS": "ignore"},
    )
    from .megatron_worker import tokens

    expected = logits(model, tokens())
    for rank in range(2):
        got = torch.load(f"{out}.{rank}", weights_only=True)
        assert torch.allclose(got, expected, atol=1e-4, rtol=1e-4), (rank, (got - expected).abs().max())


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_through_dcp_and_back_gives_the_same_logits(tmp_path, arch):
    from ucp.interop.dcp import export_dcp, import_dcp

    model = hf_model(arch, tmp_path)
    import_hf(tmp_path / "hf", str(tmp_path / "u1"))
    export_dcp(str(tmp_path / "u1"), tmp_path / "dcp")
    import_dcp(tmp_path / "dcp", str(tmp_path / "u2"))
    export_hf(str(tmp_path / "u2"), tmp_path / "out")
    back = type(model).from_pretrained(tmp_path / "out").eval()
    tokens = torch.randint(0, SHAPE["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(1))
    assert torch.equal(logits(back, tokens), logits(model, tokens))
