"""Megatron-Core on CPU as the oracle of the DeepSeek-V3 family's Megatron names and TP slicing (tests/test_deepseek.py):
its GPT model with multi-latent attention (local spec; q compressed when Q_LORA > 0), the first K_DENSE layers dense
and the rest MoE layers (sigmoid router with expert bias, grouped top-k, shared experts), built in TP 2, loads the
rank files that `ucp convert` wrote strictly (every name and shape as Megatron's own) and writes its logits.

Megatron's MLA asks its core attention for keys and values of different head sizes, which only Transformer Engine's
kernel takes (and this machine has no Transformer Engine); the worker puts a plain causal softmax attention in its place (`CoreAttention`: no weights, so what
is checked, every weight's name, shape and TP slice, is all Megatron's).

    python tests/megatron_deepseek_worker.py CKPT OUT Q_LORA K_DENSE SHARED SCALING   as the ranks of a TP 2 world
"""

from __future__ import annotations

import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.megatron_worker import setup, write_tp2_logits

# the shape of tests/test_deepseek.py's SHAPE
H, FFN, MOE_FFN, L, HEADS, EXPERTS, KV_LORA, NOPE, ROPE, V_DIM = 32, 40, 16, 3, 4, 4, 16, 8, 8, 8


class CoreAttention(torch.nn.Module):
    """softmax(q k^T * scale, causal) v over [seq, batch, heads, dim] inputs; [seq, batch, heads * v_dim] out."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type, softmax_scale=None, **_):
        super().__init__()
        self.scale = softmax_scale

    def forward(self, query, key, value, attention_mask, **_):
        scores = torch.einsum("sbhd,tbhd->bhst", query, key).float() * self.scale
        s = scores.shape[-1]
        scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
        out = torch.einsum("bhst,tbhd->sbhd", scores.softmax(-1).to(value.dtype), value)
        return out.reshape(out.shape[0], out.shape[1], -1)


def main(ckpt: str, out: str, q_lora: int, k_dense: int, shared: int, scaling: float) -> None:
    rank = int(os.environ["RANK"])
    setup(rank, 2, tp=2)
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer import multi_latent_attention
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    # (without Transformer Engine its module imports, but its TELinear is None, which MLA's isinstance check
    # cannot take: tell MLA there is no TE)
    multi_latent_attention.HAVE_TE = False

    cfg = MLATransformerConfig(
        num_layers=L,
        hidden_size=H,
        num_attention_heads=HEADS,
        ffn_hidden_size=FFN,
        multi_latent_attention=True,
        q_lora_rank=q_lora or None,
        kv_lora_rank=KV_LORA,
        qk_head_dim=NOPE,
        qk_pos_emb_head_dim=ROPE,
        v_head_dim=V_DIM,
        rope_type="rope",
        rotary_base=10000,
        qk_layernorm=True,  # (MLA's q and kv norms)
        num_moe_experts=EXPERTS,
        moe_layer_freq=[0] * k_dense + [1] * (L - k_dense),
        moe_ffn_hidden_size=MOE_FFN,
        moe_shared_expert_intermediate_size=MOE_FFN * shared,
        moe_router_topk=2,
        moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True,
        moe_router_num_groups=2,
        moe_router_group_topk=1,
        moe_router_topk_scaling_factor=scaling,
        moe_token_dispatcher_type="allgather",
        gated_linear_unit=True,
        activation_func=F.silu,
        normalization="RMSNorm",
        layernorm_epsilon=1e-6,
        add_bias_linear=False,
        use_cpu_initialization=True,
        params_dtype=torch.float32,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        apply_rope_fusion=False,
        tensor_model_parallel_size=2,
    )
    spec = get_gpt_decoder_block_spec(cfg, use_transformer_engine=False, normalization="RMSNorm")
    for layer in spec.layer_specs:
        layer.submodules.self_attention.submodules.core_attention = CoreAttention
    write_tp2_logits(cfg, spec, ckpt, out, rank)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), float(sys.argv[6]))
