"""The Qwen3-MoE family: the dense family's attention (GQA, an RMSNorm over each head's q and k, optionally q/k/v
biases) with a mixture of SwiGLU experts in every layer. Atoms take Hugging Face's names
(`mlp.gate.weight` for the router, `mlp.experts.{X}.gate_proj/up_proj/down_proj.weight` per expert); Megatron-Core's
GPT model (local spec, SequentialMLP experts) holds them as the Mixtral family does, with `q_layernorm` and
`k_layernorm` as the dense family's. Layers whose MLP is dense (`mlp_only_layers`, `decoder_sparse_step` > 1) are
not modelled: an import of such a config is refused (ucp.interop.hf)."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from ucp.errors import UcpError
from ucp.families import llama, mixtral
from ucp.families.table import Family, Rule


@dataclass
class Qwen3MoeConfig:
    vocab_size: int
    hidden_size: int
    moe_intermediate_size: int  # each expert's FFN size
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    num_local_experts: int
    num_experts_per_tok: int = 8
    intermediate_size: int | None = None  # a dense MLP's size (HF's config has it; no layer here has one)
    head_dim: int | None = None  # None: hidden_size // num_attention_heads
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    make_vocab_size_divisible_by: int = 128
    stage_layers: list[int] | None = None  # layers per PP model chunk (c = v*P + p); None: even split

    qk_norm = True  # (always: the dense family's attention rules ask)

    def __post_init__(self) -> None:
        if self.head_dim is None:
            if self.hidden_size % self.num_attention_heads:
                raise UcpError(
                    f"hidden_size={self.hidden_size} is not a multiple of "
                    f"num_attention_heads={self.num_attention_heads}; give head_dim"
                )
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_attention_heads % self.num_key_value_heads:
            raise UcpError(
                f"num_key_value_heads={self.num_key_value_heads} does not divide "
                f"num_attention_heads={self.num_attention_heads}"
            )
        if self.stage_layers is not None:
            self.stage_layers = [int(x) for x in self.stage_layers]

    def to_json(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Qwen3MoeConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise UcpError(f"Qwen3MoeConfig: unknown fields {unknown}")
        return cls(**d)


_L = "model.layers.{L}."
_D = "decoder.layers.{i}."
_X = "mlp.experts.{X}."
_E = "mlp.experts.local_experts.{e}."


def _ffn(c: Qwen3MoeConfig) -> int:
    return c.moe_intermediate_size


RULES = (
    *(r for r in llama.RULES if r.place == "first"),
    *(r for r in llama.RULES if r.place == "layer" and ".mlp." not in r.canonical),  # attention and the two norms
    Rule(
        _L + "mlp.gate.weight",
        _D + "mlp.router.weight",
        "layer",
        lambda c: (c.num_local_experts, c.hidden_size),
        mixtral._replicated,
    ),
    Rule(
        _L + _X + "gate_proj.weight",
        _D + _E + "linear_fc1.weight",
        "expert",
        lambda c: (_ffn(c), c.hidden_size),
        mixtral._gate_up("gate"),
    ),
    Rule(
        _L + _X + "up_proj.weight",
        _D + _E + "linear_fc1.weight",
        "expert",
        lambda c: (_ffn(c), c.hidden_size),
        mixtral._gate_up("up"),
    ),
    Rule(
        _L + _X + "down_proj.weight",
        _D + _E + "linear_fc2.weight",
        "expert",
        lambda c: (c.hidden_size, _ffn(c)),
        mixtral._row,
    ),
    *(r for r in llama.RULES if r.place == "last"),
)

FAMILY = Family("qwen3_moe", Qwen3MoeConfig, RULES)
