"""The dense decoder family: Llama (2, 3.x), Mistral, Qwen2 (biases on q, k and v) and Qwen3 (RMSNorm on each head's
q and k): attention with GQA, a SwiGLU MLP, RMSNorm. Atoms take Hugging Face's names; Megatron-Core's GPT model
(local spec) holds them as below: q, k, v fused per query group in linear_qkv (weights and, with biases, biases),
gate and up fused in linear_fc1, the q/k norms as q_layernorm and k_layernorm."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .config import FamilyConfig
from .megatron_names import MegatronNames, arg, experts, latent_attention, required
from .table import Family, Rule, embedding_spec, gate_up_spec, qkv_spec, replicated, row_split, vocab_spec


@dataclass
class LlamaConfig(FamilyConfig):
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int | None = None  # None: hidden_size // num_attention_heads
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # biases on q, k and v (Qwen2); o_proj never has one here
    qk_norm: bool = False  # an RMSNorm over each head's q and k (Qwen3)
    make_vocab_size_divisible_by: int = 128
    stage_layers: list[int] | None = None  # layers per PP model chunk (c = v*P + p); None: even split

    num_local_experts = 0  # (a dense model; not a field)


def q_rows(c: LlamaConfig) -> int:
    return c.num_attention_heads * c.head_dim  # type: ignore[operator]


def kv_rows(c: LlamaConfig) -> int:
    return c.num_key_value_heads * c.head_dim  # type: ignore[operator]


_L = "model.layers.{L}."
_D = "decoder.layers.{i}."

RULES = (
    Rule(
        "model.embed_tokens.weight",
        "embedding.word_embeddings.weight",
        "first",
        lambda c: (c.vocab_size, c.hidden_size),
        embedding_spec,
    ),
    Rule(_L + "input_layernorm.weight", _D + "input_layernorm.weight", "layer", lambda c: (c.hidden_size,), replicated),
    Rule(
        _L + "self_attn.q_proj.weight",
        _D + "self_attention.linear_qkv.weight",
        "layer",
        lambda c: (q_rows(c), c.hidden_size),
        qkv_spec("q"),
    ),
    Rule(
        _L + "self_attn.k_proj.weight",
        _D + "self_attention.linear_qkv.weight",
        "layer",
        lambda c: (kv_rows(c), c.hidden_size),
        qkv_spec("k"),
    ),
    Rule(
        _L + "self_attn.v_proj.weight",
        _D + "self_attention.linear_qkv.weight",
        "layer",
        lambda c: (kv_rows(c), c.hidden_size),
        qkv_spec("v"),
    ),
    Rule(
        _L + "self_attn.q_proj.bias",
        _D + "self_attention.linear_qkv.bias",
        "layer",
        lambda c: (q_rows(c),),
        qkv_spec("q"),
        present=lambda c: c.attention_bias,
    ),
    Rule(
        _L + "self_attn.k_proj.bias",
        _D + "self_attention.linear_qkv.bias",
        "layer",
        lambda c: (kv_rows(c),),
        qkv_spec("k"),
        present=lambda c: c.attention_bias,
    ),
    Rule(
        _L + "self_attn.v_proj.bias",
        _D + "self_attention.linear_qkv.bias",
        "layer",
        lambda c: (kv_rows(c),),
        qkv_spec("v"),
        present=lambda c: c.attention_bias,
    ),
    Rule(
        _L + "self_attn.q_norm.weight",
        _D + "self_attention.q_layernorm.weight",
        "layer",
        lambda c: (c.head_dim,),
        replicated,
        present=lambda c: c.qk_norm,
    ),
    Rule(
        _L + "self_attn.k_norm.weight",
        _D + "self_attention.k_layernorm.weight",
        "layer",
        lambda c: (c.head_dim,),
        replicated,
        present=lambda c: c.qk_norm,
    ),
    Rule(
        _L + "self_attn.o_proj.weight",
        _D + "self_attention.linear_proj.weight",
        "layer",
        lambda c: (c.hidden_size, q_rows(c)),
        row_split,
    ),
    Rule(
        _L + "post_attention_layernorm.weight",
        _D + "pre_mlp_layernorm.weight",
        "layer",
        lambda c: (c.hidden_size,),
        replicated,
    ),
    Rule(
        _L + "mlp.gate_proj.weight",
        _D + "mlp.linear_fc1.weight",
        "layer",
        lambda c: (c.intermediate_size, c.hidden_size),
        gate_up_spec("gate"),
    ),
    Rule(
        _L + "mlp.up_proj.weight",
        _D + "mlp.linear_fc1.weight",
        "layer",
        lambda c: (c.intermediate_size, c.hidden_size),
        gate_up_spec("up"),
    ),
    Rule(
        _L + "mlp.down_proj.weight",
        _D + "mlp.linear_fc2.weight",
        "layer",
        lambda c: (c.hidden_size, c.intermediate_size),
        row_split,
    ),
    Rule("model.norm.weight", "decoder.final_layernorm.weight", "last", lambda c: (c.hidden_size,), replicated),
    Rule(
        "lm_head.weight",
        "output_layer.weight",
        "last",
        lambda c: (c.vocab_size, c.hidden_size),
        vocab_spec,
        present=lambda c: not c.tie_word_embeddings,
    ),
    # Tied: the last stage's output layer is a copy of the embedding atom (only where the rank lacks the original).
    Rule(
        "model.embed_tokens.weight",
        "output_layer.weight",
        "last",
        lambda c: (c.vocab_size, c.hidden_size),
        embedding_spec,
        present=lambda c: c.tie_word_embeddings,
        tied_copy=True,
    ),
)


def _from_megatron(args: Any, shape: dict[str, Any]) -> LlamaConfig:
    return LlamaConfig(
        intermediate_size=required(args, "ffn_hidden_size"),
        attention_bias=bool(arg(args, "add_qkv_bias", False)),
        qk_norm=bool(arg(args, "qk_layernorm", False)),
        **shape,
    )


def _megatron_args(c: LlamaConfig, hf: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "ffn_hidden_size": c.intermediate_size,
        "num_experts": None,
        "add_qkv_bias": c.attention_bias,
        "qk_layernorm": c.qk_norm,
    }


# Megatron-LM's dense GPT model: q/k/v biases and q/k layer norms as the args say
MEGATRON = MegatronNames(lambda args: not experts(args) and not latent_attention(args), _from_megatron, _megatron_args)

FAMILY = Family("llama", LlamaConfig, RULES, MEGATRON)
