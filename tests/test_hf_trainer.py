"""The HF export against the reference trainer's own model: same tokens, same logits (fp32, <= 1e-5 relative)."""

from __future__ import annotations

import pytest
import torch

from ucp.interop.hf import export_hf
from ucp.interop.weights import load_weights

from .test_hf import assert_close_rel, random_full_state, save_in_layout, tiny_config

transformers = pytest.importorskip("transformers")


def test_transformers_on_the_export_matches_the_trainer_model(tmp_path):
    from trainer.config import ModelConfig
    from trainer.model import DecoderStage, StageSpec

    cfg = tiny_config()
    save_in_layout(random_full_state(cfg), cfg, "tp2pp2", str(tmp_path / "ckpt"))
    export_hf(str(tmp_path / "ckpt"), tmp_path / "hf")
    hf = transformers.MixtralForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    trainer_cfg = ModelConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        num_layers=cfg.num_hidden_layers,
        num_heads=cfg.num_attention_heads,
        num_kv_heads=cfg.num_key_value_heads,
        ffn_hidden_size=cfg.intermediate_size,
        num_experts=cfg.num_local_experts,
        top_k=cfg.num_experts_per_tok,
        rope_theta=hf.config.rope_parameters["rope_theta"],
        rms_norm_eps=hf.config.rms_norm_eps,
    )
    stage = DecoderStage(
        trainer_cfg, StageSpec(layers=list(range(cfg.num_hidden_layers)), first=True, last=True)
    ).eval()
    # the trainer's parameter names are ucp's local names: the weights-only loader fills it directly
    stage.load_state_dict(load_weights(str(tmp_path / "ckpt"), "tp1", 0).params, strict=True)
    tokens = torch.randint(0, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        ours = stage(tokens)[0][..., : cfg.vocab_size]
        theirs = hf(input_ids=tokens).logits
    assert_close_rel(theirs, ours)
