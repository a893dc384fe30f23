"""Megatron-Core on CPU as the oracle of a family's Megatron names and TP slicing (tests/test_families.py,
tests/test_qwen_moe.py): a GPT model with the local layer spec, q/k/v biases (Qwen2) or q/k layer norms (Qwen3),
and with EXPERTS > 0 a mixture of experts in every layer (Qwen3-MoE: q/k norms and experts; Qwen2-MoE: biases,
experts and a gated shared expert of SHARED_FFN; PRE_SOFTMAX is Megatron's moe_router_pre_softmax), built in TP 2,
loads the rank files that `ucp convert` wrote strictly (every name and shape as Megatron's own) and writes its
logits. UCP_FAMILY_TP and UCP_FAMILY_KV set another TP degree (the world size) and number of query groups (KV
heads: fewer than the TP ranks too, tests/test_megatron_kv_heads.py).

    python tests/megatron_family_worker.py CKPT OUT BIAS QK_NORM HEAD_DIM [EXPERTS FFN PRE_SOFTMAX SHARED_FFN]
        as the ranks of a TP 2 world (or UCP_FAMILY_TP)
"""

from __future__ import annotations

import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.megatron_worker import setup, write_tp2_logits

V, H, FFN, L, HEADS = 100, 32, 48, 2, 4
KV, TP = int(os.environ.get("UCP_FAMILY_KV", "2")), int(os.environ.get("UCP_FAMILY_TP", "2"))


def main(
    ckpt: str,
    out: str,
    bias: bool,
    qk_norm: bool,
    head_dim: int,
    experts: int = 0,
    ffn: int = FFN,
    pre_softmax: bool = False,
    shared_ffn: int = 0,
) -> None:
    rank = int(os.environ["RANK"])
    setup(rank, TP, tp=TP)
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    cfg = TransformerConfig(
        num_layers=L,
        hidden_size=H,
        num_attention_heads=HEADS,
        num_query_groups=KV,
        ffn_hidden_size=ffn,
        **(
            {
                "num_moe_experts": experts,
                "moe_router_topk": 2,
                "moe_ffn_hidden_size": ffn,
                "moe_token_dispatcher_type": "allgather",
                "moe_router_pre_softmax": pre_softmax,
                "moe_shared_expert_intermediate_size": shared_ffn or None,
                "moe_shared_expert_gate": shared_ffn > 0,
            }
            if experts
            else {}
        ),
        kv_channels=head_dim,
        gated_linear_unit=True,
        activation_func=F.silu,
        normalization="RMSNorm",
        layernorm_epsilon=1e-6,
        add_bias_linear=False,
        add_qkv_bias=bias,
        qk_layernorm=qk_norm,
        use_cpu_initialization=True,
        params_dtype=torch.float32,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=TP,
    )
    spec = get_gpt_layer_local_spec(
        num_experts=experts or None, moe_grouped_gemm=False, normalization="RMSNorm", qk_layernorm=qk_norm
    )
    write_tp2_logits(cfg, spec, ckpt, out, rank)


if __name__ == "__main__":
    moe = (int(sys.argv[6]), int(sys.argv[7]), sys.argv[8] == "1", int(sys.argv[9])) if len(sys.argv) > 6 else ()
    main(sys.argv[1], sys.argv[2], sys.argv[3] == "1", sys.argv[4] == "1", int(sys.argv[5]), *moe)
