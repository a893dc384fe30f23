"""The Mixtral family: the dense family's attention (GQA, no biases, no q/k norms) with a mixture of SwiGLU experts in
every layer, under Mixtral's Hugging Face names (`block_sparse_moe.gate` for the router,
`block_sparse_moe.experts.{X}.w1/w3/w2` per expert). Megatron-Core's GPT MoE (local spec, SequentialMLP) holds the
experts as `mlp.experts.local_experts.{e}.linear_fc1` (w1 and w3 fused) and `linear_fc2`."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from . import llama, qwen_moe
from .config import FamilyConfig
from .megatron_names import MegatronNames, arg, check_router, experts, latent_attention, required
from .table import Family, Rule, gate_up_spec, replicated, row_split


@dataclass
class MixtralConfig(FamilyConfig):
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    num_local_experts: int
    num_experts_per_tok: int = 2
    head_dim: int | None = None  # None: hidden_size // num_attention_heads
    tie_word_embeddings: bool = False
    make_vocab_size_divisible_by: int = 128
    stage_layers: list[int] | None = None  # layers per PP model chunk (c = v*P + p); None: even split

    attention_bias = False  # (no q/k/v biases, no q/k norms: what the dense family's attention rules ask)
    qk_norm = False


_L = "model.layers.{L}."
_D = "decoder.layers.{i}."
_X = "block_sparse_moe.experts.{X}."
_E = "mlp.experts.local_experts.{e}."

RULES = (
    *(r for r in llama.RULES if r.place == "first"),
    *(r for r in llama.RULES if r.place == "layer" and ".mlp." not in r.canonical),  # attention and the two norms
    Rule(
        _L + "block_sparse_moe.gate.weight",
        _D + "mlp.router.weight",
        "layer",
        lambda c: (c.num_local_experts, c.hidden_size),
        replicated,
    ),
    Rule(
        _L + _X + "w1.weight",
        _D + _E + "linear_fc1.weight",
        "expert",
        lambda c: (c.intermediate_size, c.hidden_size),
        gate_up_spec("gate"),
    ),
    Rule(
        _L + _X + "w3.weight",
        _D + _E + "linear_fc1.weight",
        "expert",
        lambda c: (c.intermediate_size, c.hidden_size),
        gate_up_spec("up"),
    ),
    Rule(
        _L + _X + "w2.weight",
        _D + _E + "linear_fc2.weight",
        "expert",
        lambda c: (c.hidden_size, c.intermediate_size),
        row_split,
    ),
    *(r for r in llama.RULES if r.place == "last"),
)


def _from_megatron(args: Any, shape: dict[str, Any]) -> MixtralConfig:
    # (Mixtral: the softmax over the top-k logits, which is HF's renormalised top-k of the softmax over all)
    check_router(args, "Mixtral", score="softmax", pre_softmax=False, scaled=False, grouped=False)
    return MixtralConfig(
        intermediate_size=arg(args, "moe_ffn_hidden_size") or required(args, "ffn_hidden_size"),
        num_local_experts=experts(args),
        num_experts_per_tok=arg(args, "moe_router_topk", 2),
        **shape,
    )


def _megatron_args(c: MixtralConfig, hf: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "ffn_hidden_size": c.intermediate_size,
        "moe_ffn_hidden_size": c.intermediate_size,
        "num_experts": c.num_local_experts,
        "moe_router_topk": c.num_experts_per_tok,
    }


# Megatron-LM's MoE GPT model with none of what the Qwen MoE family adds (q/k norms, q/k/v biases, a shared expert)
MEGATRON = MegatronNames(
    lambda args: bool(experts(args)) and not latent_attention(args) and not qwen_moe.MEGATRON.claims(args),
    _from_megatron,
    _megatron_args,
)

FAMILY = Family("mixtral", MixtralConfig, RULES, MEGATRON)
