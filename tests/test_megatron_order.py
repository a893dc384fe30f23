"""The order in which Megatron-Core registers a model's parameters (its named_parameters(): the order of its
optimizer's param groups and of its distributed optimizer's buffers), which ucp rebuilds to read and write Megatron's
optimizer state (ucp.interop.megatron.optimizer), checked against megatron-core's own GPT models: a dense model with
q/k/v biases and q/k norms, a MoE with q/k norms and a gated shared expert, and DeepSeek-V3's multi-latent attention
(with and without q compression) with a dense first layer and a MoE layer whose router has an expert bias."""

from __future__ import annotations

import json

import pytest
import torch

from ucp.interop.megatron.optimizer import param_groups
from ucp.sharding.families import DeepseekV3Config, LlamaConfig, QwenMoeConfig
from ucp.sharding.layout import parse_layout

from .helpers import DRAW
from .launch import spawn

SHAPE = {"vocab_size": 100, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4}
CONFIGS = {
    "qwen2_qk_norm": LlamaConfig(
        **SHAPE, intermediate_size=40, num_key_value_heads=2, attention_bias=True, qk_norm=True
    ),
    "qwen_moe_shared": QwenMoeConfig(
        **SHAPE,
        moe_intermediate_size=16,
        num_key_value_heads=2,
        num_local_experts=2,
        shared_expert_intermediate_size=16,
    ),
    **{
        f"deepseek_q_lora_{q}": DeepseekV3Config(
            **SHAPE,
            intermediate_size=40,
            moe_intermediate_size=16,
            num_local_experts=2,
            first_k_dense_replace=1,
            q_lora_rank=q,
            kv_lora_rank=16,
            qk_nope_head_dim=8,
            qk_rope_head_dim=8,
            v_head_dim=8,
        )
        for q in (None, 24)
    },
}


@pytest.fixture(scope="module")
def megatron_names(tmp_path_factory) -> dict:
    pytest.importorskip("megatron.core")
    out = tmp_path_factory.mktemp("order") / "names.json"
    spawn(["tests/megatron_order_worker.py", str(out)], 1, timeout=300, env={"PYTHONWARNINGS": "ignore"})
    return json.loads(out.read_text())


@pytest.mark.parametrize("model", list(CONFIGS))
def test_parameter_order_and_buffers_are_megatrons(megatron_names, model):
    groups = [
        p for optimizer in param_groups(CONFIGS[model], parse_layout("tp1pp1"), 0) for _, ps in optimizer for p in ps
    ]
    # every parameter of Megatron's is in ucp's groups, and nothing else (its buffers have no optimizer state)
    assert sorted(p.name for p in groups) == sorted(megatron_names[model]["parameters"])
    # inside each group, in Megatron's registration order
    position = {name: i for i, name in enumerate(megatron_names[model]["parameters"])}
    for optimizer in param_groups(CONFIGS[model], parse_layout("tp1pp1"), 0):
        for _, params in optimizer:
            assert [position[p.name] for p in params] == sorted(position[p.name] for p in params), model


@pytest.mark.parametrize("model", DRAW.sample(list(CONFIGS), 2))
def test_megatrons_optimizer_state_goes_to_tp2_and_back_into_megatron(tmp_path, model):
    """Adam's state after a step of megatron-core's own optimizer, converted by ucp tp1 -> tp2 -> tp1 and loaded by
    Megatron's optimizer (which takes it by position in its param groups), is the same, parameter by parameter."""
    pytest.importorskip("megatron.core")
    from ucp.sharding.families import family_for

    config = CONFIGS[model]
    (tmp_path / "config.json").write_text(json.dumps({"family": family_for(config).name, **config.to_json()}))
    out = tmp_path / "states.pt"
    argv = ["tests/megatron_optim_worker.py", model, str(tmp_path / "config.json"), str(tmp_path), str(out)]
    spawn(argv, 1, timeout=300, env={"PYTHONWARNINGS": "ignore"})
    states = torch.load(out, weights_only=True)
    assert set(states["loaded"]) == set(states["saved"])
    for name, saved in states["saved"].items():
        assert saved, name  # (a step was taken: every parameter has its Adam state)
        for key, value in saved.items():
            assert torch.equal(states["loaded"][name][key], value), (name, key)
