"""The Mixtral family (also covers dense Llama-like GQA models with SwiGLU experts): config and rules table."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ucp.families.table import Family, FamilyConfig, Rule
from ucp.partition import PartitionSpec


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


def _vocab(c: MixtralConfig) -> PartitionSpec:
    return PartitionSpec("vocab", pad_to_multiple_of=c.make_vocab_size_divisible_by, unpadded=c.vocab_size)


def _embed(c: MixtralConfig) -> PartitionSpec:
    return dataclasses.replace(_vocab(c), tied_to=("lm_head.weight",) if c.tie_word_embeddings else ())


def _qkv(part: str):
    def spec(c: MixtralConfig) -> PartitionSpec:
        return PartitionSpec(
            "fused_qkv",
            part=part,
            num_heads=c.num_attention_heads,
            num_kv_heads=c.num_key_value_heads,
            head_dim=c.head_dim,
        )

    return spec


def _replicated(c: MixtralConfig) -> PartitionSpec:
    return PartitionSpec()


def _column(c: MixtralConfig) -> PartitionSpec:
    return PartitionSpec("split", split_dim=0)


def _row(c: MixtralConfig) -> PartitionSpec:
    return PartitionSpec("split", split_dim=1)


def _gate_up(part: str):
    def spec(c: MixtralConfig) -> PartitionSpec:
        return PartitionSpec("fused_gate_up", part=part)

    return spec


def _tied(c: MixtralConfig) -> bool:
    return c.tie_word_embeddings


def _untied(c: MixtralConfig) -> bool:
    return not c.tie_word_embeddings


_L = "model.layers.{L}."
_D = "decoder.layers.{i}."
_X = "block_sparse_moe.experts.{X}."
_E = "mlp.experts.local_experts.{e}."

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
        lambda c: (c.num_attention_heads * c.head_dim, c.hidden_size),
        _qkv("q"),
    ),
    Rule(
        _L + "self_attn.k_proj.weight",
        _D + "self_attention.linear_qkv.weight",
        "layer",
        lambda c: (c.num_key_value_heads * c.head_dim, c.hidden_size),
        _qkv("k"),
    ),
    Rule(
        _L + "self_attn.v_proj.weight",
        _D + "self_attention.linear_qkv.weight",
        "layer",
        lambda c: (c.num_key_value_heads * c.head_dim, c.hidden_size),
        _qkv("v"),
    ),
    Rule(
        _L + "self_attn.o_proj.weight",
        _D + "self_attention.linear_proj.weight",
        "layer",
        lambda c: (c.hidden_size, c.num_attention_heads * c.head_dim),
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
        _L + "block_sparse_moe.gate.weight",
        _D + "mlp.router.weight",
        "layer",
        lambda c: (c.num_local_experts, c.hidden_size),
        _replicated,
    ),
    Rule(
        _L + _X + "w1.weight",
        _D + _E + "linear_fc1.weight",
        "expert",
        lambda c: (c.intermediate_size, c.hidden_size),
        _gate_up("gate"),
    ),
    Rule(
        _L + _X + "w3.weight",
        _D + _E + "linear_fc1.weight",
        "expert",
        lambda c: (c.intermediate_size, c.hidden_size),
        _gate_up("up"),
    ),
    Rule(
        _L + _X + "w2.weight",
        _D + _E + "linear_fc2.weight",
        "expert",
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
        present=_untied,
    ),
    # Tied: the last stage's output layer is a copy of the embedding atom (only where the rank lacks the original).
    Rule(
        "model.embed_tokens.weight",
        "output_layer.weight",
        "last",
        lambda c: (c.vocab_size, c.hidden_size),
        _embed,
        present=_tied,
        tied_copy=True,
    ),
)

FAMILY = Family("mixtral", MixtralConfig, RULES)
