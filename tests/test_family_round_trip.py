"""Every GQA family, tried as a user would: a random tiny transformers model (KV heads drawn below the TP degree as
often as not) -> `ucp import` -> a Megatron layout -> ucp's format -> `ucp export` gives transformers' logits bitwise.
Which layout and how many KV heads each case takes is drawn at collection (helpers.DRAW, UCP_TEST_SEED); the
weights, the RoPE base and the tie are drawn per run."""

from __future__ import annotations

import random

import pytest
import torch

from ucp.interop.hf import export_hf, import_hf
from ucp.interop.megatron.convert import convert

from .helpers import DRAW, hf_logits, perturb_parameters
from .test_families import SHAPE as FAMILY_SHAPE

transformers = pytest.importorskip("transformers")

# the dense tests' model, its KV heads drawn here
SHAPE = {k: v for k, v in FAMILY_SHAPE.items() if k != "num_key_value_heads"} | {"max_position_embeddings": 64}
MOE = {"moe_intermediate_size": 24, "num_experts": 4, "num_experts_per_tok": 2}
# architecture -> (config class, model class, fields of its own)
ARCHS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 8}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 16}),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {"num_local_experts": 4, "intermediate_size": 64}),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", {**MOE, "shared_expert_intermediate_size": 56}),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", {**MOE, "head_dim": 16}),
}
MOE_ARCHS = ("mixtral", "qwen2_moe", "qwen3_moe")


def draw_case(arch: str) -> tuple[str, int, str]:
    """(arch, KV heads, Megatron layout): TP 2 or 4 over 1, 2 or 4 KV heads (TP a multiple of them, or dividing
    them), PP 1 or 2, EP 1 or 2 for a MoE."""
    kv, tp = DRAW.choice([(1, 2), (1, 4), (2, 4), (2, 2), (4, 2), (4, 4)])
    pp = DRAW.choice([1, 2])
    ep = DRAW.choice([1, 2]) if arch in MOE_ARCHS else 1
    return arch, kv, f"tp{tp}" + (f"pp{pp}" if pp > 1 else "") + (f"ep{ep}" if ep > 1 else "")


@pytest.mark.parametrize(("arch", "kv", "layout"), [draw_case(arch) for arch in ARCHS])
def test_hf_import_megatron_universal_export_gives_the_same_logits(tmp_path, arch, kv, layout):
    config_name, model_name, own = ARCHS[arch]
    rng = random.Random()
    config = getattr(transformers, config_name)(
        **{**SHAPE, **own},
        num_key_value_heads=kv,
        rope_theta=rng.choice([1e4, 1e6]),
        tie_word_embeddings=rng.choice([True, False]),
    )
    torch.manual_seed(rng.randrange(1000))
    model = getattr(transformers, model_name)(config).eval()
    perturb_parameters(model)
    model.save_pretrained(tmp_path / "hf")
    import_hf(tmp_path / "hf", str(tmp_path / "u1"))
    convert(str(tmp_path / "u1"), str(tmp_path / "megatron"), from_layout="universal", to_layout=layout)
    convert(str(tmp_path / "megatron"), str(tmp_path / "u2"), from_layout=layout, to_layout="universal")
    export_hf(str(tmp_path / "u2"), tmp_path / "out")
    back = type(model).from_pretrained(tmp_path / "out").eval()
    assert back.config.num_key_value_heads == kv
    assert torch.equal(hf_logits(back, SHAPE["vocab_size"]), hf_logits(model, SHAPE["vocab_size"]))
