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
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ...base.dtypes import zarr_name
from ...errors import UcpError
from ..quantization import SCALE_DTYPES
from . import llama, qwen_moe
from .config import FamilyConfig
from .megatron_names import MegatronNames, arg, check_router, experts, latent_attention, required, rope_scaling
from .table import Family, Rule, block_scaled, column_split, gate_up_spec, replicated, row_split

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
    # checkpoints' fp8, HF's quantization_config.weight_block_size; ucp.sharding.quantization); None: not quantised
    weight_block_size: list[int] | None = None
    # the scales' dtype: "float32", or "float8_e8m0fnu" (powers of two, as transformers holds DeepSeek-V3.1's)
    weight_scale_dtype: str = "float32"

    def __post_init__(self) -> None:
        if not self.num_key_value_heads:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None and self.hidden_size % self.num_attention_heads:
            # (MLA does not need hidden_size to split into heads, and no atom uses head_dim: HF's config says
            # qk_rope_head_dim there; where it does split, hidden_size // heads as before, for the configs saved so)
            self.head_dim = self.qk_rope_head_dim
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


# The router's settings: HF name -> Megatron's (sigmoid scores, grouped top-k, the scaling of the weights)
_ROUTER_ARGS = {
    "n_group": "moe_router_num_groups",
    "topk_group": "moe_router_group_topk",
    "routed_scaling_factor": "moe_router_topk_scaling_factor",
}
# YaRN's RoPE settings: HF's rope_parameters field -> Megatron's MLA arg
_YARN_ARGS = {
    "factor": "rotary_scaling_factor",
    "original_max_position_embeddings": "original_max_position_embeddings",
    "beta_fast": "beta_fast",
    "beta_slow": "beta_slow",
    "mscale": "mscale",
    "mscale_all_dim": "mscale_all_dim",
}


def _from_megatron(args: Any, shape: dict[str, Any]) -> DeepseekV3Config:
    """From Megatron's MLA MoE args: its MoE layers must be the last ones (moe_layer_freq [0]*k + [1]*(n-k), or 1),
    its router sigmoid with the expert bias (the atom of HF's correction bias)."""
    if not experts(args):
        raise UcpError("multi-latent attention without experts has no DeepSeek-V3 atoms here")
    layers = shape["num_hidden_layers"]
    freq = arg(args, "moe_layer_freq", 1)
    pattern = [1] * layers if freq == 1 else list(freq) if isinstance(freq, (list, tuple)) else None
    k = next((i for i, x in enumerate(pattern or []) if x), layers)
    if pattern is None or len(pattern) != layers or any(x != (i >= k) for i, x in enumerate(pattern)):
        raise UcpError(
            f"moe_layer_freq={freq!r}; ucp's DeepSeek-V3 family has dense layers first, then MoE layers only"
        )
    check_router(args, "DeepSeek-V3", score="sigmoid", pre_softmax=None, scaled=True, grouped=True)
    if not arg(args, "moe_router_enable_expert_bias", False):
        raise UcpError(
            "moe_router_enable_expert_bias is off; ucp's DeepSeek-V3 family holds the router's expert bias "
            "(HF's e_score_correction_bias)"
        )
    dense = required(args, "ffn_hidden_size")
    ffn = arg(args, "moe_ffn_hidden_size") or dense
    shared = arg(args, "moe_shared_expert_intermediate_size", 0)
    if shared % ffn:
        raise UcpError(f"moe_shared_expert_intermediate_size={shared} is not a multiple of {ffn}")
    return DeepseekV3Config(
        intermediate_size=dense,
        moe_intermediate_size=ffn,
        num_local_experts=experts(args),
        num_experts_per_tok=arg(args, "moe_router_topk", 2),
        n_shared_experts=shared // ffn,
        first_k_dense_replace=k,
        q_lora_rank=arg(args, "q_lora_rank"),
        kv_lora_rank=required(args, "kv_lora_rank"),
        qk_nope_head_dim=required(args, "qk_head_dim"),
        qk_rope_head_dim=required(args, "qk_pos_emb_head_dim"),
        v_head_dim=required(args, "v_head_dim"),
        **{k: v for k, v in shape.items() if k != "head_dim"},
    )


def _megatron_args(c: DeepseekV3Config, hf: Mapping[str, Any]) -> dict[str, Any]:
    out = {
        "ffn_hidden_size": c.intermediate_size,
        "multi_latent_attention": True,
        # MLA's q_layernorm (with q compression) and kv_layernorm exist in Megatron's layer spec only with
        # qk_layernorm; the files hold them, so a job built from these args must have them (strict load)
        "qk_layernorm": True,
        "q_lora_rank": c.q_lora_rank,
        "kv_lora_rank": c.kv_lora_rank,
        "qk_head_dim": c.qk_nope_head_dim,
        "qk_pos_emb_head_dim": c.qk_rope_head_dim,
        "v_head_dim": c.v_head_dim,
        "moe_ffn_hidden_size": c.moe_intermediate_size,
        "num_experts": c.num_local_experts,
        "moe_router_topk": c.num_experts_per_tok,
        "moe_shared_expert_intermediate_size": c.moe_intermediate_size * c.n_shared_experts,
        "moe_layer_freq": [0] * c.first_k_dense_replace + [1] * (c.num_hidden_layers - c.first_k_dense_replace),
        "moe_router_enable_expert_bias": True,
        "moe_router_score_function": "sigmoid",
        **{m: hf[h] for h, m in _ROUTER_ARGS.items() if h in hf},
    }
    rope = hf.get("rope_parameters") or {}
    if rope.get("rope_type") == "yarn":
        out.update(rope_type="yarn", **{m: rope[h] for h, m in _YARN_ARGS.items() if h in rope})
    return out


def _hf_from_megatron(args: Any, hf: dict[str, Any]) -> dict[str, Any]:
    """The router's settings and YaRN's (in rope_parameters, beside RoPE's base) as the args say them."""
    out = {**hf, **{h: arg(args, m) for h, m in _ROUTER_ARGS.items() if arg(args, m) is not None}}
    out["norm_topk_prob"] = _normalises(arg(args, "moe_router_topk", 2))
    if arg(args, "rope_type") == "yarn":
        rope = dict(out.pop("rope_parameters", None) or {})
        rope.update(rope_type="yarn", rope_theta=out.pop("rope_theta", rope.get("rope_theta")))
        rope.update({h: arg(args, m) for h, m in _YARN_ARGS.items() if arg(args, m) is not None})
        out["rope_parameters"] = rope
    return out


def _normalises(topk: int) -> bool:
    """Whether Megatron's sigmoid router renormalises the top-k weights (HF's norm_topk_prob): only for k > 1."""
    return topk > 1


def _megatron_refuses(c: DeepseekV3Config, hf: Mapping[str, Any]) -> str | None:
    if hf.get("norm_topk_prob", True) != _normalises(c.num_experts_per_tok):
        return (
            f"norm_topk_prob={hf.get('norm_topk_prob', True)} with {c.num_experts_per_tok} experts a token, but "
            "Megatron's sigmoid router renormalises the top-k weights exactly when it takes more than one: Megatron "
            "would compute another model"
        )
    rope = rope_scaling(hf)["rope_type"]
    if rope not in ("default", "yarn"):
        return f"RoPE of type {rope!r}; Megatron's multi-latent attention has RoPE plain or with YaRN only"
    if hf.get("rope_interleave") is False:
        return (
            "rope_interleave=False, but Megatron's multi-latent attention applies RoPE to interleaved pairs (HF's "
            "default, rope_interleave=True): Megatron would compute another model"
        )
    return None


# Megatron-LM's GPT model with multi-latent attention; its layers differ (dense, then MoE: a moe_layer_freq list)
MEGATRON = MegatronNames(
    lambda args: latent_attention(args),
    _from_megatron,
    _megatron_args,
    hf_fields=_hf_from_megatron,
    refuses=_megatron_refuses,
    layers_apart=True,
)

FAMILY = Family("deepseek_v3", DeepseekV3Config, RULES, MEGATRON)
