"""The Qwen MoE family: Qwen3-MoE (an RMSNorm over each head's q and k) and Qwen2-MoE (biases on q, k and v, and a
shared expert with a sigmoid gate beside the routed ones): the dense family's attention with a mixture of SwiGLU
experts in every layer. Atoms take Hugging Face's names (`mlp.gate.weight` for the router,
`mlp.experts.{X}.gate_proj/up_proj/down_proj.weight` per expert, `mlp.shared_expert.*_proj.weight` and
`mlp.shared_expert_gate.weight`); Megatron-Core's GPT model (local spec, SequentialMLP experts) holds the experts as
the Mixtral family does, the norms as the dense family's `q_layernorm`/`k_layernorm`, and the shared expert as
`mlp.shared_experts.linear_fc1` (gate and up fused, TP-split like a dense MLP), `linear_fc2` and `gate_weight`.
Layers whose MLP is dense (`mlp_only_layers`, `decoder_sparse_step` > 1) are not modelled: an import of such a
config is refused (ucp.interop.hf).

OLMoE is the same mixture with q and k norms that span all heads (`qk_norm_full`: an RMSNorm over q's
num_heads x head_dim values and one over k's num_kv_heads x head_dim, before the heads are split), which
Megatron-Core has no layer for: its atoms are TP-split with their heads (rows of q and k), and a Megatron conversion
of it is refused (its Megatron names, below, say why)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ...errors import UcpError
from . import llama
from .config import FamilyConfig
from .megatron_names import MegatronNames, arg, check_router, experts, latent_attention, required
from .table import Family, Rule, column_split, gate_up_spec, replicated, row_split


@dataclass
class QwenMoeConfig(FamilyConfig):
    vocab_size: int
    hidden_size: int
    moe_intermediate_size: int  # each expert's FFN size
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    num_local_experts: int
    num_experts_per_tok: int = 8
    intermediate_size: int | None = None  # a dense MLP's size (HF's config has it; no layer here has one)
    shared_expert_intermediate_size: int = 0  # the shared expert's FFN size (Qwen2-MoE); 0: none
    head_dim: int | None = None  # None: hidden_size // num_attention_heads
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # biases on q, k and v (Qwen2-MoE)
    qk_norm: bool = True  # an RMSNorm over each head's q and k (Qwen3-MoE)
    qk_norm_full: bool = False  # an RMSNorm over all of q and one over all of k (OLMoE; then qk_norm is False)
    make_vocab_size_divisible_by: int = 128
    stage_layers: list[int] | None = None  # layers per PP model chunk (c = v*P + p); None: even split


_L = "model.layers.{L}."
_D = "decoder.layers.{i}."
_X = "mlp.experts.{X}."
_E = "mlp.experts.local_experts.{e}."


def _ffn(c: QwenMoeConfig) -> int:
    return c.moe_intermediate_size


def _shared(c: QwenMoeConfig) -> int:
    return c.shared_expert_intermediate_size


def _has_shared(c: QwenMoeConfig) -> bool:
    return c.shared_expert_intermediate_size > 0


_S = "mlp.shared_expert."
_SD = "mlp.shared_experts."


def _full_norms(c: QwenMoeConfig) -> bool:
    return c.qk_norm_full


RULES = (
    *(r for r in llama.RULES if r.place == "first"),
    *(r for r in llama.RULES if r.place == "layer" and ".mlp." not in r.canonical),  # attention and the two norms
    # OLMoE's q and k norms over all heads: their rows are q's and k's, split over TP with the heads
    Rule(
        _L + "self_attn.q_norm.weight",
        _D + "self_attention.q_layernorm.weight",
        "layer",
        lambda c: (llama.q_rows(c),),
        column_split,
        present=_full_norms,
    ),
    Rule(
        _L + "self_attn.k_norm.weight",
        _D + "self_attention.k_layernorm.weight",
        "layer",
        lambda c: (llama.kv_rows(c),),
        column_split,
        present=_full_norms,
    ),
    Rule(
        _L + "mlp.gate.weight",
        _D + "mlp.router.weight",
        "layer",
        lambda c: (c.num_local_experts, c.hidden_size),
        replicated,
    ),
    Rule(
        _L + _S + "gate_proj.weight",
        _D + _SD + "linear_fc1.weight",
        "layer",
        lambda c: (_shared(c), c.hidden_size),
        gate_up_spec("gate"),
        present=_has_shared,
    ),
    Rule(
        _L + _S + "up_proj.weight",
        _D + _SD + "linear_fc1.weight",
        "layer",
        lambda c: (_shared(c), c.hidden_size),
        gate_up_spec("up"),
        present=_has_shared,
    ),
    Rule(
        _L + _S + "down_proj.weight",
        _D + _SD + "linear_fc2.weight",
        "layer",
        lambda c: (c.hidden_size, _shared(c)),
        row_split,
        present=_has_shared,
    ),
    Rule(
        _L + "mlp.shared_expert_gate.weight",
        _D + _SD + "gate_weight",
        "layer",
        lambda c: (1, c.hidden_size),
        replicated,
        present=_has_shared,
    ),
    Rule(
        _L + _X + "gate_proj.weight",
        _D + _E + "linear_fc1.weight",
        "expert",
        lambda c: (_ffn(c), c.hidden_size),
        gate_up_spec("gate"),
    ),
    Rule(
        _L + _X + "up_proj.weight",
        _D + _E + "linear_fc1.weight",
        "expert",
        lambda c: (_ffn(c), c.hidden_size),
        gate_up_spec("up"),
    ),
    Rule(
        _L + _X + "down_proj.weight",
        _D + _E + "linear_fc2.weight",
        "expert",
        lambda c: (c.hidden_size, _ffn(c)),
        row_split,
    ),
    *(r for r in llama.RULES if r.place == "last"),
)


def _megatron_claims(args: Any) -> bool:
    """A MoE GPT model with what sets this family apart from Mixtral's: q/k layer norms, q/k/v biases or a shared
    expert."""
    own = arg(args, "qk_layernorm") or arg(args, "add_qkv_bias") or arg(args, "moe_shared_expert_intermediate_size")
    return bool(experts(args)) and not latent_attention(args) and bool(own)


def _from_megatron(args: Any, shape: dict[str, Any]) -> QwenMoeConfig:
    shared = arg(args, "moe_shared_expert_intermediate_size", 0)
    if shared and not arg(args, "moe_shared_expert_gate", False):
        raise UcpError("a shared expert without its gate (moe_shared_expert_gate) has no Qwen MoE atom")
    # (either softmax: before the top-k is HF's norm_topk_prob=False, `_hf_from_megatron`)
    check_router(args, "Qwen MoE", score="softmax", pre_softmax=None, scaled=False, grouped=False)
    ffn = required(args, "ffn_hidden_size")
    return QwenMoeConfig(
        moe_intermediate_size=arg(args, "moe_ffn_hidden_size") or ffn,
        intermediate_size=ffn,
        shared_expert_intermediate_size=shared,
        num_local_experts=experts(args),
        num_experts_per_tok=arg(args, "moe_router_topk", 2),
        attention_bias=bool(arg(args, "add_qkv_bias", False)),
        qk_norm=bool(arg(args, "qk_layernorm", False)),
        **shape,
    )


def _megatron_args(c: QwenMoeConfig, hf: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "ffn_hidden_size": c.intermediate_size if c.intermediate_size is not None else c.moe_intermediate_size,
        "moe_ffn_hidden_size": c.moe_intermediate_size,
        "num_experts": c.num_local_experts,
        "moe_router_topk": c.num_experts_per_tok,
        "add_qkv_bias": c.attention_bias,
        "qk_layernorm": c.qk_norm,
        "moe_shared_expert_intermediate_size": c.shared_expert_intermediate_size or None,
        "moe_shared_expert_gate": c.shared_expert_intermediate_size > 0,
        # HF's top-k weights renormalised = Megatron's softmax over the top-k; not renormalised = pre-softmax
        "moe_router_pre_softmax": not hf.get("norm_topk_prob", c.qk_norm),
    }


def _hf_from_megatron(args: Any, hf: dict[str, Any]) -> dict[str, Any]:
    # Megatron's router: softmax over the top-k scores (= HF's renormalised top-k), or with pre-softmax over all
    return hf if "norm_topk_prob" in hf else {**hf, "norm_topk_prob": not arg(args, "moe_router_pre_softmax", False)}


def _megatron_refuses(c: QwenMoeConfig, hf: Mapping[str, Any]) -> str | None:
    if c.qk_norm_full:
        return (
            "an OLMoE model, whose q and k norms span all heads: Megatron-Core has no such layer (its q/k layernorms "
            "are per head), so no Megatron checkpoint computes the same model"
        )
    return None


MEGATRON = MegatronNames(
    _megatron_claims, _from_megatron, _megatron_args, hf_fields=_hf_from_megatron, refuses=_megatron_refuses
)

FAMILY = Family("qwen_moe", QwenMoeConfig, RULES, MEGATRON)
