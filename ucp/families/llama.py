"""The dense decoder family: Llama (2, 3.x), Mistral, Qwen2 (biases on q, k and v) and Qwen3 (RMSNorm on each head's
q and k): attention with GQA, a SwiGLU MLP, RMSNorm. Atoms take Hugging Face's names; Megatron-Core's GPT model
(local spec) holds them as below: q, k, v fused per query group in linear_qkv (weights and, with biases, biases),
gate and up fused in linear_fc1, the q/k norms as q_layernorm and k_layernorm."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ucp.families.table import Family, FamilyConfig, Rule
from ucp.partition import PartitionSpec


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

    @property
    def num_local_experts(self) -> int:
        return 0  # (a dense model: the reshaper asks)


def _vocab(c: LlamaConfig) -> PartitionSpec:
    return PartitionSpec("vocab", pad_to_multiple_of=c.make_vocab_size_divisible_by, unpadded=c.vocab_size)


def _embed(c: LlamaConfig) -> PartitionSpec:
    return dataclasses.replace(_vocab(c), tied_to=("lm_head.weight",) if c.tie_word_embeddings else ())


def _qkv(part: str):
    def spec(c: LlamaConfig) -> PartitionSpec:
        return PartitionSpec(
            "fused_qkv",
            part=part,
            num_heads=c.num_attention_heads,
            num_kv_heads=c.num_key_value_heads,
            head_dim=c.head_dim,
        )

    return spec


def _replicated(c: LlamaConfig) -> PartitionSpec:
    return PartitionSpec()


def _row(c: LlamaConfig) -> PartitionSpec:
    return PartitionSpec("split", split_dim=1)


def _gate_up(part: str):
    def spec(c: LlamaConfig) -> PartitionSpec:
        return PartitionSpec("fused_gate_up", part=part)

    return spec


def _q_rows(c: LlamaConfig) -> int:
    return c.num_attention_heads * c.head_dim  # type: ignore[operator]


def _kv_rows(c: LlamaConfig) -> int:
    return c.num_key_value_heads * c.head_dim  # type: ignore[operator]


_L = "model.layers.{L}."
_D = "decoder.layers.{i}."

RULES = (
    Rule(
        "model.embed_tokens.weight",
        "embedding.word_embeddings.weight",
        "first",
        lambda c: (c.vocab_size, c.hidden_size),
        _embed,
    ),
    Rule(
        _L + "input_layernorm.weight", _D + "input_layernorm.weight", "layer", lambda c: (c.hidden_size,), _replicated
    ),
    Rule(
        _L + "self_attn.q_proj.weight",
        _D + "self_attention.linear_qkv.weight",
        "layer",
        lambda c: (_q_rows(c), c.hidden_size),
        _qkv("q"),
    ),
    Rule(
        _L + "self_attn.k_proj.weight",
        _D + "self_attention.linear_qkv.weight",
        "layer",
        lambda c: (_kv_rows(c), c.hidden_size),
        _qkv("k"),
    ),
    Rule(
        _L + "self_attn.v_proj.weight",
        _D + "self_attention.linear_qkv.weight",
        "layer",
        lambda c: (_kv_rows(c), c.hidden_size),
        _qkv("v"),
    ),
    Rule(
        _L + "self_attn.q_proj.bias",
        _D + "self_attention.linear_qkv.bias",
        "layer",
        lambda c: (_q_rows(c),),
        _qkv("q"),
        present=lambda c: c.attention_bias,
    ),
    Rule(
        _L + "self_attn.k_proj.bias",
        _D + "self_attention.linear_qkv.bias",
        "layer",
        lambda c: (_kv_rows(c),),
        _qkv("k"),
        present=lambda c: c.attention_bias,
    ),
    Rule(
        _L + "self_attn.v_proj.bias",
        _D + "self_attention.linear_qkv.bias",
        "layer",
        lambda c: (_kv_rows(c),),
        _qkv("v"),
        present=lambda c: c.attention_bias,
    ),
    Rule(
        _L + "self_attn.q_norm.weight",
        _D + "self_attention.q_layernorm.weight",
        "layer",
        lambda c: (c.head_dim,),
        _replicated,
        present=lambda c: c.qk_norm,
    ),
    Rule(
        _L + "self_attn.k_norm.weight",
        _D + "self_attention.k_layernorm.weight",
        "layer",
        lambda c: (c.head_dim,),
        _replicated,
        present=lambda c: c.qk_norm,
    ),
    Rule(
        _L + "self_attn.o_proj.weight",
        _D + "self_attention.linear_proj.weight",
        "layer",
        lambda c: (c.hidden_size, _q_rows(c)),
        _row,
    ),
    Rule(
        _L + "post_attention_layernorm.weight",
        _D + "pre_mlp_layernorm.weight",
        "layer",
        lambda c: (c.hidden_size,),
        _replicated,
    ),
    Rule(
        _L + "mlp.gate_proj.weight",
        _D + "mlp.linear_fc1.weight",
        "layer",
        lambda c: (c.intermediate_size, c.hidden_size),
        _gate_up("gate"),
    ),
    Rule(
        _L + "mlp.up_proj.weight",
        _D + "mlp.linear_fc1.weight",
        "layer",
        lambda c: (c.intermediate_size, c.hidden_size),
        _gate_up("up"),
    ),
    Rule(
        _L + "mlp.down_proj.weight",
        _D + "mlp.linear_fc2.weight",
        "layer",
        lambda c: (c.hidden_size, c.intermediate_size),
        _row,
    ),
    Rule("model.norm.weight", "decoder.final_layernorm.weight", "last", lambda c: (c.hidden_size,), _replicated),
    Rule(
        "lm_head.weight",
        "output_layer.weight",
        "last",
        lambda c: (c.vocab_size, c.hidden_size),
        _vocab,
        present=lambda c: not c.tie_word_embeddings,
    ),
    # Tied: the last stage's output layer is a copy of the embedding atom (only where the rank lacks the original).
    Rule(
        "model.embed_tokens.weight",
        "output_layer.weight",
        "last",
        lambda c: (c.vocab_size, c.hidden_size),
        _embed,
        present=lambda c: c.tie_word_embeddings,
        tied_copy=True,
    ),
)

FAMILY = Family("llama", LlamaConfig, RULES)
