"""Every hyperparameter that changes what a model computes survives every path: Hugging Face -> ucp -> HF, through
Megatron rank files (tp2, ep2) and back, and through DCP and back, with the same logits in transformers at the end."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ucp.interop.dcp import export_dcp, import_dcp
from ucp.interop.hf import export_hf, import_hf
from ucp.interop.megatron.convert import convert

transformers = pytest.importorskip("transformers")

# Non-default values of every field that changes what a Mixtral computes or how it is used.
FIELDS = {
    "rope_theta": 5e5,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 777,
    "bos_token_id": 3,
    "eos_token_id": 4,
    "pad_token_id": 5,
    "router_aux_loss_coef": 0.123,
    "sliding_window": 64,
    "router_jitter_noise": 0.01,
    "output_router_logits": True,
    "attention_dropout": 0.0,
    "initializer_range": 0.05,
}
FILE_KEYS = ("transformers_version", "dtype", "torch_dtype")


def source(tmp_path: Path) -> tuple[Path, torch.nn.Module]:
    torch.manual_seed(0)
    cfg = transformers.MixtralConfig(
        vocab_size=100,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        **FIELDS,
    )
    model = transformers.MixtralForCausalLM(cfg).eval()
    model.save_pretrained(tmp_path / "hf")
    return tmp_path / "hf", model


def config_of(directory: Path) -> dict:
    doc = json.loads((directory / "config.json").read_text())
    doc.pop("head_dim", None)  # (absent means hidden_size // heads, which an export writes out)
    return {k: v for k, v in doc.items() if k not in FILE_KEYS}


def same_model(directory: Path, model: torch.nn.Module) -> None:
    back = transformers.MixtralForCausalLM.from_pretrained(directory).eval()
    tokens = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(back(tokens).logits, model(tokens).logits)
    assert back.config.rope_parameters["rope_theta"] == 5e5 and back.config.max_position_embeddings == 777


def test_through_ucp(tmp_path):
    src, model = source(tmp_path)
    import_hf(src, str(tmp_path / "u"))
    shown = subprocess.run(
        [sys.executable, "-m", "ucp", "inspect", str(tmp_path / "u")], capture_output=True, text=True, check=True
    )
    assert "model       mixtral: num_hidden_layers 2" in shown.stdout and "rope_theta 500000.0" in shown.stdout, (
        shown.stdout
    )
    export_hf(str(tmp_path / "u"), tmp_path / "out")
    assert config_of(tmp_path / "out") == config_of(src)
    same_model(tmp_path / "out", model)


@pytest.mark.parametrize("layout", ["tp2", "tp1ep2"])
def test_through_megatron_rank_files(tmp_path, layout):
    src, model = source(tmp_path)
    import_hf(src, str(tmp_path / "u1"))
    convert(str(tmp_path / "u1"), str(tmp_path / "megatron"), from_layout="universal", to_layout=layout)
    convert(str(tmp_path / "megatron"), str(tmp_path / "u2"), from_layout=layout, to_layout="universal")
    export_hf(str(tmp_path / "u2"), tmp_path / "out")
    assert config_of(tmp_path / "out") == config_of(src)
    same_model(tmp_path / "out", model)


def test_through_dcp(tmp_path):
    src, model = source(tmp_path)
    import_hf(src, str(tmp_path / "u1"))
    export_dcp(str(tmp_path / "u1"), tmp_path / "dcp")
    import_dcp(tmp_path / "dcp", str(tmp_path / "u2"))  # its config.json came with the export
    export_hf(str(tmp_path / "u2"), tmp_path / "out")
    assert config_of(tmp_path / "out") == config_of(src)
    same_model(tmp_path / "out", model)
