"""What a Megatron job is told by the args ucp writes, checked against megatron-core 0.16.1 on CPU: a model built from
nothing but the converted files' args (as Megatron-LM's `--use-checkpoint-args` builds it) takes the rank files strictly
and computes transformers' logits, for the cases where the args once said another model:

- sliding-window attention (Mistral, Mixtral: every layer; Qwen2: the layers its `layer_types` say): Megatron's
  `window_size` (W - 1, 0) and `window_attn_skip_freq`; without them megatron-core attends to every earlier token;
- DeepSeek-V3's multi-latent attention: its q/kv norms exist in Megatron's layer spec only with `qk_layernorm`.

The layout (TP, EP) and the window of each case are drawn at collection (helpers.DRAW), the weights per run. A Megatron
checkpoint whose args say a window that no HF config says is refused on its way out (an export would drop it).

This file is also the megatron-core worker of its oracle test:

    python tests/test_interop_hunt.py CKPT OUT      as the TP x EP ranks of the files' layout (tests.launch.spawn)
"""

from __future__ import annotations

import argparse
import glob
import os
import sys

import pytest
import torch

SEQ = 12  # tokens: longer than every drawn window


def _tokens(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (2, SEQ), generator=torch.Generator().manual_seed(5))


def _draw_cases() -> list[tuple[str, str, int]]:
    if not __package__:  # (run as the worker: nothing to draw)
        return []
    from .helpers import DRAW

    # (arch, Megatron layout, window)
    return [
        ("mistral", DRAW.choice(["tp1", "tp2"]), DRAW.randrange(2, SEQ)),
        ("mixtral", DRAW.choice(["tp2", "tp1ep2"]), DRAW.randrange(2, SEQ)),
        ("qwen2", DRAW.choice(["tp1", "tp2"]), DRAW.randrange(2, SEQ)),
        ("deepseek_v3", DRAW.choice(["tp2", "tp1ep2"]), 0),
    ]


def _hf_model(arch: str, window: int, seed: int) -> torch.nn.Module:
    import random

    import transformers

    rng = random.Random(seed)
    shape = {
        "vocab_size": rng.choice([97, 100, 131]),
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "tie_word_embeddings": rng.choice([True, False]),
        "max_position_embeddings": 64,
    }
    if arch == "mistral":
        config = transformers.MistralConfig(**shape, sliding_window=window)
    elif arch == "mixtral":
        config = transformers.MixtralConfig(**shape, num_local_experts=4, sliding_window=window)
    elif arch == "qwen2":  # some layers slide (those from max_window_layers on), the others attend to all
        config = transformers.Qwen2Config(
            **shape, use_sliding_window=True, sliding_window=window, max_window_layers=rng.choice([1, 2])
        )
    else:
        shape.update(num_key_value_heads=4, intermediate_size=40)
        config = transformers.DeepseekV3Config(
            **shape,
            moe_intermediate_size=16,
            n_routed_experts=4,
            num_experts_per_tok=2,
            n_group=2,
            topk_group=1,
            kv_lora_rank=16,
            qk_nope_head_dim=8,
            qk_rope_head_dim=8,
            v_head_dim=8,
            q_lora_rank=rng.choice([None, 24]),
            first_k_dense_replace=1,
        )
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


@pytest.mark.slow
@pytest.mark.parametrize(("arch", "layout", "window"), _draw_cases())
def test_megatron_core_built_from_the_converted_args_computes_transformers_logits(tmp_path, arch, layout, window):
    pytest.importorskip("megatron.core")
    pytest.importorskip("transformers")
    import random

    from ucp.interop.hf import import_hf
    from ucp.interop.megatron.convert import convert
    from ucp.interop.megatron.save import parse_megatron_layout

    from .launch import spawn

    model = _hf_model(arch, window, random.randrange(1000))
    model.save_pretrained(tmp_path / "hf")
    import_hf(tmp_path / "hf", str(tmp_path / "u"))
    convert(str(tmp_path / "u"), str(tmp_path / "megatron"), from_layout="universal", to_layout=layout)
    lay = parse_megatron_layout(layout)
    out = tmp_path / "logits"
    spawn(
        [__file__, str(tmp_path / "megatron"), str(out)], lay.tp * lay.ep, timeout=300, env={"PYTHONWARNINGS": "ignore"}
    )
    with torch.no_grad():
        expected = model(_tokens(model.config.vocab_size)).logits
    for rank in range(lay.tp * lay.ep):
        got = torch.load(f"{out}.{rank}", weights_only=True)
        assert torch.allclose(got, expected, atol=1e-4, rtol=1e-4), (arch, layout, rank, (got - expected).abs().max())


def test_a_megatron_window_that_no_hf_config_says_is_refused_not_dropped(tmp_path):
    """A Megatron-LM job trained with --window-size (its args; no HF config stored by ucp) is refused on its way into
    ucp's format in one line naming window_size: an HF export of the Llama family would attend to every earlier
    token."""
    pytest.importorskip("transformers")
    from ucp.errors import UcpError
    from ucp.interop.hf import import_hf
    from ucp.interop.megatron.args import HF_CONFIG_ARG
    from ucp.interop.megatron.convert import convert

    model = _hf_model("mistral", 4, 0)
    model.save_pretrained(tmp_path / "hf")
    import_hf(tmp_path / "hf", str(tmp_path / "u"))
    convert(str(tmp_path / "u"), str(tmp_path / "m"), from_layout="universal", to_layout="tp1")
    # (what ucp writes for a window of 4, read back as a model of the same window)
    convert(str(tmp_path / "m"), str(tmp_path / "u2"), from_layout="tp1", to_layout="universal")
    (path,) = glob.glob(str(tmp_path / "m" / "iter_*" / "mp_rank_00" / "model_optim_rng.pt"))
    state = torch.load(path, weights_only=False)
    assert tuple(state["args"].window_size) == (3, 0)
    delattr(state["args"], HF_CONFIG_ARG)  # a Megatron-LM job's own args
    torch.save(state, path)
    with pytest.raises(UcpError, match=r"window_size=\(3, 0\)") as e:
        convert(str(tmp_path / "m"), str(tmp_path / "u3"), from_layout="tp1", to_layout="universal")
    assert "\n" not in str(e.value)
    assert not (tmp_path / "u3").exists()
    # Megatron to Megatron keeps the job's args as they are: its window goes with them
    convert(str(tmp_path / "m"), str(tmp_path / "tp2"), from_layout="tp1", to_layout="tp2")
    (path,) = glob.glob(str(tmp_path / "tp2" / "iter_*" / "mp_rank_01" / "model_optim_rng.pt"))
    assert tuple(torch.load(path, weights_only=False)["args"].window_size) == (3, 0)


# ---- the worker: megatron-core's GPT model from the files' args alone ----


def _sliding_window_mask_on_cpu() -> None:
    """megatron-core 0.16.1 makes its sliding-window mask on device "cuda" (transformer/utils.py
    get_sliding_window_causal_mask); the same mask, its own formula, on the CPU."""
    from megatron.core.fusions import fused_softmax
    from megatron.core.transformer import utils

    def mask(sq: int, skv: int, window_size: tuple[int, int]) -> torch.Tensor:
        m = torch.ones(sq, skv, dtype=torch.bool)
        return ~torch.tril(torch.triu(m, diagonal=skv - sq - window_size[0]), diagonal=skv - sq + window_size[1])

    utils.get_sliding_window_causal_mask = fused_softmax.get_sliding_window_causal_mask = mask


def _config(args: argparse.Namespace):
    """megatron-core's config of the model the args say (what Megatron-LM's core_transformer_config_from_args
    copies of them for ucp's families), in the args' TP and EP."""
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    def a(name, default=None):
        value = getattr(args, name, None)
        return default if value is None else value

    common = {
        "num_layers": args.num_layers,
        "hidden_size": args.hidden_size,
        "num_attention_heads": args.num_attention_heads,
        "ffn_hidden_size": args.ffn_hidden_size,
        "gated_linear_unit": args.swiglu,
        "activation_func": F.silu,
        "normalization": args.normalization,
        "layernorm_epsilon": a("norm_epsilon", 1e-5),
        "add_bias_linear": args.add_bias_linear,
        "qk_layernorm": a("qk_layernorm", False),
        "window_size": tuple(args.window_size) if a("window_size") else None,
        "window_attn_skip_freq": a("window_attn_skip_freq"),
        "use_cpu_initialization": True,
        "params_dtype": torch.float32,
        "hidden_dropout": 0.0,
        "attention_dropout": 0.0,
        "tensor_model_parallel_size": args.tensor_model_parallel_size,
        "expert_model_parallel_size": a("expert_model_parallel_size", 1),
    }
    if a("num_experts"):
        common.update(
            num_moe_experts=args.num_experts,
            moe_router_topk=args.moe_router_topk,
            moe_ffn_hidden_size=args.moe_ffn_hidden_size,
            moe_token_dispatcher_type="allgather",
            moe_router_pre_softmax=a("moe_router_pre_softmax", False),
            moe_shared_expert_intermediate_size=a("moe_shared_expert_intermediate_size"),
            moe_shared_expert_gate=a("moe_shared_expert_gate", False),
            **{
                k: getattr(args, k)
                for k in (
                    "moe_layer_freq",
                    "moe_router_score_function",
                    "moe_router_enable_expert_bias",
                    "moe_router_num_groups",
                    "moe_router_group_topk",
                    "moe_router_topk_scaling_factor",
                )
                if a(k) is not None
            },
        )
    if a("multi_latent_attention", False):
        return MLATransformerConfig(
            **common,
            multi_latent_attention=True,
            q_lora_rank=a("q_lora_rank"),
            kv_lora_rank=args.kv_lora_rank,
            qk_head_dim=args.qk_head_dim,
            qk_pos_emb_head_dim=args.qk_pos_emb_head_dim,
            v_head_dim=args.v_head_dim,
            rope_type="rope",
            rotary_base=a("rotary_base", 10000),
            apply_rope_fusion=False,
        )
    return TransformerConfig(
        **common,
        num_query_groups=a("num_query_groups") if a("group_query_attention", False) else None,
        kv_channels=a("kv_channels"),
        add_qkv_bias=a("add_qkv_bias", False),
    )


def _worker(ckpt: str, out: str) -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    first = min(glob.glob(os.path.join(ckpt, "iter_*", "mp_rank_*", "model_optim_rng.pt")))
    args = torch.load(first, weights_only=False)["args"]
    tp, ep = args.tensor_model_parallel_size, args.expert_model_parallel_size
    assert world == tp * ep and args.pipeline_model_parallel_size == 1
    from tests.megatron_deepseek_worker import CoreAttention
    from tests.megatron_worker import exit_now, setup

    setup(rank, world, tp=tp, ep=ep)
    _sliding_window_mask_on_cpu()
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_layer_local_spec
    from megatron.core.transformer import multi_latent_attention

    multi_latent_attention.HAVE_TE = False  # (see megatron_deepseek_worker.py)
    cfg = _config(args)
    if getattr(args, "multi_latent_attention", False):
        spec = get_gpt_decoder_block_spec(cfg, use_transformer_engine=False, normalization="RMSNorm")
        for layer in spec.layer_specs:  # (see megatron_deepseek_worker.py: a plain attention kernel, no weights)
            layer.submodules.self_attention.submodules.core_attention = CoreAttention
    else:
        spec = get_gpt_layer_local_spec(
            num_experts=cfg.num_moe_experts,
            moe_grouped_gemm=False,
            normalization="RMSNorm",
            qk_layernorm=cfg.qk_layernorm,
        )
    model = GPTModel(
        cfg,
        spec,
        vocab_size=args.padded_vocab_size,
        max_sequence_length=64,
        position_embedding_type="rope",
        rotary_base=getattr(args, "rotary_base", 10000),
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        parallel_output=False,
    )
    name = f"mp_rank_{parallel_state.get_tensor_model_parallel_rank():02d}"
    name += f"_{parallel_state.get_expert_model_parallel_rank():03d}" if ep > 1 else ""
    (path,) = glob.glob(os.path.join(ckpt, "iter_*", name, "model_optim_rng.pt"))
    model.load_state_dict(torch.load(path, weights_only=False)["model"], strict=True)
    model.eval()
    toks = _tokens(args.vocab_size)
    pos = torch.arange(SEQ).unsqueeze(0).expand(toks.shape[0], -1)
    mask = torch.triu(torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool), diagonal=1)
    with torch.no_grad():
        torch.save(model(toks, pos, mask)[..., : args.vocab_size], f"{out}.{rank}")
    torch.distributed.destroy_process_group()
    print("ok", flush=True)
    exit_now()


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    _worker(sys.argv[1], sys.argv[2])
