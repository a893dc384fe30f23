"""Megatron-Core on CPU as the oracle of its own parameter order (tests/test_megatron_order.py): builds GPT models of
each family's kind in one process (tp1) and writes their named_parameters() and named_buffers() names as JSON.

    python tests/megatron_order_worker.py OUT.json   as rank 0 of a world of one
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.megatron_deepseek_worker import CoreAttention
from tests.megatron_worker import exit_now, setup

COMMON = {
    "num_layers": 2,
    "hidden_size": 32,
    "num_attention_heads": 4,
    "ffn_hidden_size": 40,
    "gated_linear_unit": True,
    "activation_func": F.silu,
    "normalization": "RMSNorm",
    "add_bias_linear": False,
    "use_cpu_initialization": True,
    "hidden_dropout": 0.0,
    "attention_dropout": 0.0,
}
MOE = {"num_moe_experts": 2, "moe_ffn_hidden_size": 16, "moe_token_dispatcher_type": "allgather"}


def build(kind: str, tp: int = 1):
    """megatron-core's GPT model of one kind (tests/test_megatron_order.py's CONFIGS), this rank's part of TP `tp`."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_layer_local_spec
    from megatron.core.transformer import multi_latent_attention
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    multi_latent_attention.HAVE_TE = False  # (see megatron_deepseek_worker.py)
    common = {**COMMON, "tensor_model_parallel_size": tp}
    if kind == "qwen2_qk_norm":
        cfg = TransformerConfig(**common, num_query_groups=2, qk_layernorm=True, add_qkv_bias=True)
        spec = get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=True)
    elif kind == "qwen_moe_shared":
        cfg = TransformerConfig(
            **common, **MOE, num_query_groups=2, qk_layernorm=True,
            moe_shared_expert_intermediate_size=16, moe_shared_expert_gate=True,
        )  # fmt: skip
        spec = get_gpt_layer_local_spec(
            num_experts=2, moe_grouped_gemm=False, normalization="RMSNorm", qk_layernorm=True
        )
    else:
        q_lora = {"deepseek_q_lora_None": None, "deepseek_q_lora_24": 24}[kind]
        cfg = MLATransformerConfig(
            **common, **MOE, multi_latent_attention=True, q_lora_rank=q_lora, kv_lora_rank=16, qk_head_dim=8,
            qk_pos_emb_head_dim=8, v_head_dim=8, rope_type="rope", qk_layernorm=True, moe_layer_freq=[0, 1],
            moe_shared_expert_intermediate_size=16, moe_router_score_function="sigmoid",
            moe_router_enable_expert_bias=True,
        )  # fmt: skip
        spec = get_gpt_decoder_block_spec(cfg, use_transformer_engine=False, normalization="RMSNorm")
        for layer in spec.layer_specs:
            layer.submodules.self_attention.submodules.core_attention = CoreAttention
    torch.manual_seed(0)
    return GPTModel(
        cfg,
        spec,
        vocab_size=128 * tp,
        max_sequence_length=64,
        position_embedding_type="rope",
        share_embeddings_and_output_weights=False,
        parallel_output=False,
    )


KINDS = ("qwen2_qk_norm", "qwen_moe_shared", "deepseek_q_lora_None", "deepseek_q_lora_24")


def main(out: str) -> None:
    setup(0, 1)
    models = {}
    for kind in KINDS:
        model = build(kind)
        models[kind] = {
            "parameters": [n for n, _ in model.named_parameters()],
            "buffers": [n for n, _ in model.named_buffers()],
        }
    with open(out, "w") as f:
        json.dump(models, f)
    print("ok", flush=True)
    exit_now()  # (megatron_worker.exit_now: no teardown, no process left behind)


if __name__ == "__main__":
    main(sys.argv[1])
