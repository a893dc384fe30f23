"""The DeepSeek-V3 family (DeepSeek-V3, V3.1, R1, and V2's layout where it has no aux-free bias): multi-head latent
attention (MLA), the first `first_k_dense_replace` layers with a dense SwiGLU MLP and every later one a mixture of
routed experts beside shared experts, with a sigmoid router and its aux-free correction bias.

Atoms take Hugging Face's names. MLA compresses q (unless `q_lora_rank` is None: then `q_proj` projects it directly)
and kv through low-rank down projections, each followed by an RMSNorm; per head, q holds the no-RoPE part then the
RoPE part, and the kv up projection the key's no-RoPE part then the value; the kv down projection's output is the
compressed kv then the shared RoPE key. Megatron-Core's GPT model (local spec, `multi_latent_attention`) holds them
as `linear_q_down_proj`, `q_layernorm`, `linear_q_up_proj` (or `linear_q_proj`), `linear_kv_down_proj`,
`kv_layernorm`, `linear_kv_up_proj` and `linear_proj`, in the same row order; its column-parallel linears split the
output rows over TP (the down projections too: their outputs are gathered before the norms), the norms are
replicated. The router's correction bias is Megatron's `mlp.router.expert_bias`; the shared experts are
`mlp.shared_experts.linear_fc1` (gate and up fused) and `linear_fc2`, with no gate. The multi-token-prediction
layers of the released checkpoints (`num_nextn_predict_layers`) are not part of the model that transformers and
Megatron's GPT model run, and have no atoms here (ucp.interop.hf refuses them rather than drop them).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from ucp.dtypes import zarr_name
from ucp.errors import UcpError
from ucp.families import llama, qwen_moe
from ucp.families.table import (
    Family,
    FamilyConfig,
    Rule,
    block_scaled,
    column_split,
    gate_up_spec,
    replicated,
    row_split,
)
from ucp.quantization import SCALE_DTYPES

SCALE_DTYPE_NAMES = tuple(zarr_name(d) for d in SCALE_DTYPES)


@dataclass
class DeepseekV3Config(FamilyConfig):
    vocab_size: int
    hidden_size: int
    intermediate_size: int  # the dense layers' MLP
    moe_intermediate_size: int  # each routed expert's FFN size (and each shared expert's)
    num_hidden_layers: int
    num_attention_heads: int
    num_local_experts: int  # HF's n_routed_experts
    num_experts_per_tok: int = 8
    n_shared_experts: int = 1
    first_k_dense_replace: int = 3  # layers before this one have a dense MLP
    q_lora_rank: int | None = None  # None: no q compression (q_proj, as in V2-Lite); V3 has 1536
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    num_key_value_heads: int = 0  # (MLA has no GQA: HF's config repeats num_attention_heads; 0 says the same)
    head_dim: int | None = None  # (unused by the atoms: HF's config says qk_rope_head_dim)
    tie_word_embeddings: bool = False
    make_vocab_size_divisible_by: int = 128
    stage_layers: list[int] | None = None  # layers per PP model chunk (c = v*P + p); None: even split
    # [rows, cols]: the linear weights are float8 with float32 scales per block of this size (the released
    # checkpoints' fp8, HF's quantization_config.weight_block_size; ucp.quantization); None: not quantised
    weight_block_size: list[int] | None = None
    # the scales' dtype: "float32", or "float8_e8m0fnu" (powers of two, as transformers holds DeepSeek-V3.1's)
    weight_scale_dtype: str = "float32"

    def __post_init__(self) -> None:
        if not self.num_key_value_heads:
            self.num_key_value_heads = self.num_attention_heads
        super().__post_init__()
        block = self.weight_block_size
        if block is not None:
            if not (
                isinstance(block, list | tuple) and len(block) == 2 and all(type(b) is int and b > 0 for b in block)
            ):
                raise UcpError(f"weight_block_size={block!r}: expected two positive integers [rows, cols]")
            self.weight_block_size = list(block)
        if self.weight_scale_dtype not in SCALE_DTYPE_NAMES:
            raise UcpError(f"weight_scale_dtype={self.weight_scale_dtype!r}: expected one of {SCALE_DTYPE_NAMES}")

    def to_json(self) -> dict[str, Any]:
        doc = super().to_json()
        # (so that readers that predate fp8 weights, or e8m0 scales, read the others' configs)
        if doc["weight_block_size"] is None:
            del doc["weight_block_size"]
        if doc["weight_scale_dtype"] == "float32":
            del doc["weight_scale_dtype"]
        return doc

    @property
    def q_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


_L = "model.layers.{L}."
_D = "decoder.layers.{i}."
_A = "self_attn."
_M = "self_attention."


def _dense(c: DeepseekV3Config, layer: int) -> bool:
    return layer < c.first_k_dense_replace


def _moe(c: DeepseekV3Config, layer: int) -> bool:
    return layer >= c.first_k_dense_replace


def _shared(c: DeepseekV3Config) -> int:
    return c.moe_intermediate_size * c.n_shared_experts


def q_rows(c: DeepseekV3Config) -> int:
    return c.num_attention_heads * c.q_head_dim


def _lora_q(c: DeepseekV3Config) -> bool:
    return c.q_lora_rank is not None


_ATTENTION = (
    Rule(
        _L + _A + "q_a_proj.weight",
        _D + _M + "linear_q_down_proj.weight",
        "layer",
        lambda c: (c.q_lora_rank, c.hidden_size),
        column_split,
        present=_lora_q,
    ),
    Rule(
        _L + _A + "q_a_layernorm.weight",
        _D + _M + "q_layernorm.weight",
        "layer",
        lambda c: (c.q_lora_rank,),
        replicated,
        present=_lora_q,
    ),
    Rule(
        _L + _A + "q_b_proj.weight",
        _D + _M + "linear_q_up_proj.weight",
        "layer",
        lambda c: (q_rows(c), c.q_lora_rank),
        column_split,
        present=_lora_q,
    ),
    Rule(
        _L + _A + "q_proj.weight",
        _D + _M + "linear_q_proj.weight",
        "layer",
        lambda c: (q_rows(c), c.hidden_size),
        column_split,
        present=lambda c: not _lora_q(c),
    ),
    Rule(
        _L + _A + "kv_a_proj_with_mqa.weight",
        _D + _M + "linear_kv_down_proj.weight",
        "layer",
        lambda c: (c.kv_lora_rank + c.qk_rope_head_dim, c.hidden_size),
        column_split,
    ),
    Rule(
        _L + _A + "kv_a_layernorm.weight",
        _D + _M + "kv_layernorm.weight",
        "layer",
        lambda c: (c.kv_lora_rank,),
        replicated,
    ),
    Rule(
        _L + _A + "kv_b_proj.weight",
        _D + _M + "linear_kv_up_proj.weight",
        "layer",
        lambda c: (c.num_attention_heads * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank),
        column_split,
    ),
    Rule(
        _L + _A + "o_proj.weight",
        _D + _M + "linear_proj.weight",
        "layer",
        lambda c: (c.hidden_size, c.num_attention_heads * c.v_head_dim),
        row_split,
    ),
)

_S = "mlp.shared_experts."

_MLP = (
    # the first k layers: the dense family's MLP, with the dense intermediate size
    *(Rule(r.canonical, r.local, r.place, r.shape, r.spec, in_layer=_dense) for r in llama.RULES if ".mlp." in r.canonical),
    # every later layer: router, its correction bias, the shared experts (then the routed experts, place "expert")
    Rule(_L + "mlp.gate.weight", _D + "mlp.router.weight", "layer", lambda c: (c.num_local_experts, c.hidden_size), replicated, in_layer=_moe),
    Rule(
        _L + "mlp.gate.e_score_correction_bias",
        _D + "mlp.router.expert_bias",
        "layer",
        lambda c: (c.num_local_experts,),
        replicated,
        in_layer=_moe,
        parameter=False,
    ),
    Rule(_L + _S + "gate_proj.weight", _D + _S + "linear_fc1.weight", "layer", lambda c: (_shared(c), c.hidden_size), gate_up_spec("gate"), in_layer=_moe),
    Rule(_L + _S + "up_proj.weight", _D + _S + "linear_fc1.weight", "layer", lambda c: (_shared(c), c.hidden_size), gate_up_spec("up"), in_layer=_moe),
    Rule(_L + _S + "down_proj.weight", _D + _S + "linear_fc2.weight", "layer", lambda c: (c.hidden_size, _shared(c)), row_split, in_layer=_moe),
)  # fmt: skip

_RULES = (
    *(r for r in llama.RULES if r.place == "first"),
    *(r for r in llama.RULES if r.canonical.endswith("input_layernorm.weight")),
    *_ATTENTION,
    *(r for r in llama.RULES if r.canonical.endswith("post_attention_layernorm.weight")),
    *_MLP,
    *(Rule(r.canonical, r.local, r.place, r.shape, r.spec, in_layer=_moe) for r in qwen_moe.RULES if r.place == "expert"),
    *(r for r in llama.RULES if r.place == "last"),
)  # fmt: skip

# The released fp8 checkpoints quantise every linear weight of attention, dense MLPs, shared and routed experts
# (the `*_proj.weight`s and `kv_a_proj_with_mqa.weight`), not the embedding, the norms, the router or the output layer.
RULES = block_scaled(_RULES, lambda r: re.search(r"_proj(_with_mqa)?\.weight$", r.canonical) is not None)

FAMILY = Family("deepseek_v3", DeepseekV3Config, RULES)
