"""The DeepSeek-V3 family (ucp.sharding.families.deepseek): a random tiny transformers DeepseekV3ForCausalLM (multi-head latent
attention with and without q compression, first-k dense layers, shared experts, the router's correction bias) goes
through every path and gives identical logits; the reshaper moves it between layouts; what it cannot hold is
refused."""

from __future__ import annotations

import json
import random
import subprocess
import sys

import pytest
import torch

import ucp
from ucp.interop.errors import SourceMismatchError
from ucp.interop.hf import export_hf, import_hf
from ucp.interop.megatron.convert import convert
from ucp.sharding.families.deepseek import DeepseekV3Config

from .helpers import DRAW, assert_reshards, hf_logits, perturb_parameters

transformers = pytest.importorskip("transformers")

SHAPE = {
    "vocab_size": 100,
    "hidden_size": 32,
    "intermediate_size": 40,
    "moe_intermediate_size": 16,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "n_group": 2,
    "topk_group": 1,
    "kv_lora_rank": 16,
    "qk_nope_head_dim": 8,
    "qk_rope_head_dim": 8,
    "v_head_dim": 8,
    "max_position_embeddings": 64,
}


def hf_model(tmp_path, **overrides):
    """A random DeepSeek-V3, saved; structure and non-default hyperparameters drawn at random (each changes the
    logits, or the atoms)."""
    rng = random.Random()
    drawn = {
        "q_lora_rank": rng.choice([None, 24]),
        "first_k_dense_replace": rng.choice([0, 1, 2]),
        "n_shared_experts": rng.choice([1, 2]),
        "routed_scaling_factor": rng.choice([1.0, 2.5]),
        "norm_topk_prob": rng.choice([True, False]),
        "rope_theta": rng.choice([1e4, 5e4]),
        "rms_norm_eps": rng.choice([1e-6, 1e-5]),
        "tie_word_embeddings": rng.choice([True, False]),
    }
    config = transformers.DeepseekV3Config(**{**SHAPE, **drawn, **overrides})
    torch.manual_seed(rng.randrange(1000))
    model = transformers.DeepseekV3ForCausalLM(config).eval()
    perturb_parameters(model)
    with torch.no_grad():  # (the correction bias, a buffer, starts at zero: make it count)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.add_(torch.rand_like(b))
    model.save_pretrained(tmp_path / "hf")
    return model


def logits(model):
    return hf_logits(model, SHAPE["vocab_size"])


def back_in_transformers(out, model):
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "deepseek_v3" and config["architectures"] == ["DeepseekV3ForCausalLM"]
    for key in ("q_lora_rank", "first_k_dense_replace", "n_shared_experts", "routed_scaling_factor", "norm_topk_prob"):
        assert config[key] == getattr(model.config, key), key
    return transformers.DeepseekV3ForCausalLM.from_pretrained(out).eval()


def test_import_holds_every_tensor_as_an_atom_of_its_layer(tmp_path):
    model = hf_model(tmp_path, first_k_dense_replace=1, q_lora_rank=24)
    report = import_hf(tmp_path / "hf", str(tmp_path / "u"))
    atoms = ucp.open_checkpoint(str(tmp_path / "u")).atoms
    assert "model/model.layers.0.mlp.gate_proj.weight" in atoms  # layer 0: dense
    assert "model/model.layers.0.mlp.gate.weight" not in atoms
    assert "model/model.layers.1.mlp.gate.e_score_correction_bias" in atoms  # layer 1: MoE
    assert "model/model.layers.2.mlp.experts.3.down_proj.weight" in atoms
    assert "model/model.layers.1.mlp.shared_experts.up_proj.weight" in atoms
    assert "model/model.layers.1.self_attn.q_b_proj.weight" in atoms
    from safetensors import safe_open

    with safe_open(str(tmp_path / "hf" / "model.safetensors"), framework="pt") as f:
        on_disk = set(f.keys()) - ({"lm_head.weight"} if model.config.tie_word_embeddings else set())
    assert {a.removeprefix("model/") for a in atoms} == on_disk
    assert report.atoms == len(on_disk)
    shown = subprocess.run(
        [sys.executable, "-m", "ucp", "inspect", str(tmp_path / "u")], capture_output=True, text=True, check=True
    ).stdout
    assert "model       deepseek_v3:" in shown and "first_k_dense_replace 1, q_lora_rank 24, kv_lora_rank 16" in shown


@pytest.mark.parametrize("layout", DRAW.sample(["tp2ep2", "tp2pp3ep2", "tp1pp3", "tp2pp1ep4", "tp4"], 2))
def test_through_megatron_and_back_gives_the_same_logits(tmp_path, layout):
    model = hf_model(tmp_path, norm_topk_prob=True)  # (as Megatron's router computes: below)
    import_hf(tmp_path / "hf", str(tmp_path / "u1"))
    convert(str(tmp_path / "u1"), str(tmp_path / "megatron"), from_layout="universal", to_layout=layout)
    convert(str(tmp_path / "megatron"), str(tmp_path / "u2"), from_layout=layout, to_layout="universal")
    export_hf(str(tmp_path / "u2"), tmp_path / "out")
    assert torch.equal(logits(back_in_transformers(tmp_path / "out", model)), logits(model))


def test_a_hidden_size_that_does_not_split_into_heads_goes_through_megatron_and_back(tmp_path):
    """MLA needs no hidden_size // heads (each projection has its own head dims): such a model converted to Megatron
    was refused on the way back ("give head_dim", which the command line cannot)."""
    model = hf_model(tmp_path, hidden_size=36, num_attention_heads=8, num_key_value_heads=8, norm_topk_prob=True)
    import_hf(tmp_path / "hf", str(tmp_path / "u1"))
    convert(str(tmp_path / "u1"), str(tmp_path / "megatron"), from_layout="universal", to_layout="tp2")
    convert(str(tmp_path / "megatron"), str(tmp_path / "u2"), from_layout="tp2", to_layout="universal")
    export_hf(str(tmp_path / "u2"), tmp_path / "out")
    assert torch.equal(logits(back_in_transformers(tmp_path / "out", model)), logits(model))


def test_through_dcp_and_the_weights_loader_gives_the_same_logits(tmp_path):
    from ucp.interop.dcp import export_dcp, import_dcp
    from ucp.interop.weights import load_into_module

    model = hf_model(tmp_path)
    import_hf(tmp_path / "hf", str(tmp_path / "u1"))
    export_dcp(str(tmp_path / "u1"), tmp_path / "dcp")
    import_dcp(tmp_path / "dcp", str(tmp_path / "u2"))
    export_hf(str(tmp_path / "u2"), tmp_path / "out")
    assert torch.equal(logits(back_in_transformers(tmp_path / "out", model)), logits(model))
    fresh = transformers.DeepseekV3ForCausalLM(model.config).eval()
    load_into_module(str(tmp_path / "u1"), fresh)
    assert torch.equal(logits(fresh), logits(model))


@pytest.mark.parametrize("q_lora_rank", [None, 24])
def test_the_reshaper_saves_in_one_layout_and_loads_in_others(tmp_path, q_lora_rank):
    config = DeepseekV3Config(
        vocab_size=100, hidden_size=32, intermediate_size=40, moe_intermediate_size=16, num_hidden_layers=4,
        num_attention_heads=4, num_local_experts=4, n_shared_experts=2, first_k_dense_replace=random.choice([1, 2]),
        q_lora_rank=q_lora_rank, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
        make_vocab_size_divisible_by=8,
    )  # fmt: skip
    source = random.choice(["tp2pp2", "tp1pp2ep2dp2", "tp2pp1ep2dp2"])
    assert_reshards(config, str(tmp_path), source, ["tp1pp1", "tp2pp1dp2zero1", "tp1pp4ep2dp2", "tp1pp2vpp2"])


@pytest.mark.parametrize("setting", [{"hidden_act": "gelu"}, {"attention_bias": True}])
def test_settings_whose_weights_have_no_atom_are_refused(tmp_path, setting):
    hf_model(tmp_path, **setting)
    key = next(iter(setting))
    with pytest.raises(SourceMismatchError, match=f"{key}="):
        import_hf(tmp_path / "hf", str(tmp_path / "u"))
    assert not (tmp_path / "u").exists()


# Non-default values of the fields that change what a DeepSeek-V3 computes (YaRN RoPE, the grouped sigmoid router,
# norms, token ids) or how it is used.
FIELDS = {
    "rope_parameters": {
        "rope_type": "yarn",
        "rope_theta": 5e4,
        "factor": 4.0,
        "original_max_position_embeddings": 32,
        "beta_fast": 16.0,
        "beta_slow": 2.0,
        "mscale": 0.9,
        "mscale_all_dim": 0.9,
    },
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 128,
    "n_group": 2,
    "topk_group": 1,
    "routed_scaling_factor": 2.5,
    "norm_topk_prob": False,
    "bos_token_id": 3,
    "eos_token_id": 4,
    "initializer_range": 0.05,
}
FILE_KEYS = ("transformers_version", "dtype", "torch_dtype")


def config_of(directory) -> dict:
    doc = json.loads((directory / "config.json").read_text())
    return {k: v for k, v in doc.items() if k not in FILE_KEYS}


@pytest.mark.parametrize("path", ["megatron", "dcp"])
def test_every_hyperparameter_survives_megatron_and_dcp(tmp_path, path):
    from ucp.interop.dcp import export_dcp, import_dcp

    # (RoPE on halves instead of interleaved pairs, the top-k weights not renormalised: DCP carries them, Megatron
    # cannot run them, see below)
    unlike_megatron = {"rope_interleave": False, "norm_topk_prob": False}
    model = hf_model(tmp_path, **{**FIELDS, **(unlike_megatron if path == "dcp" else {"norm_topk_prob": True})})
    import_hf(tmp_path / "hf", str(tmp_path / "u1"))
    if path == "megatron":
        convert(str(tmp_path / "u1"), str(tmp_path / "m"), from_layout="universal", to_layout="tp2ep2")
        args = torch.load(
            tmp_path / "m" / "iter_0000000" / "mp_rank_00_000" / "model_optim_rng.pt", weights_only=False
        )["args"]  # (a file this test wrote)
        # Megatron's own names for what they have one for, so that Megatron runs the same router
        assert args.multi_latent_attention and args.moe_router_enable_expert_bias
        assert args.moe_router_score_function == "sigmoid"
        assert (args.moe_router_num_groups, args.moe_router_group_topk) == (2, 1)
        assert args.moe_router_topk_scaling_factor == 2.5
        k = model.config.first_k_dense_replace
        assert args.moe_layer_freq == [0] * k + [1] * (SHAPE["num_hidden_layers"] - k)
        assert (args.q_lora_rank, args.kv_lora_rank, args.qk_pos_emb_head_dim) == (model.config.q_lora_rank, 16, 8)
        assert (args.rope_type, args.rotary_scaling_factor, args.mscale, args.beta_fast) == ("yarn", 4.0, 0.9, 16.0)
        convert(str(tmp_path / "m"), str(tmp_path / "u2"), from_layout="tp2ep2", to_layout="universal")
    else:
        export_dcp(str(tmp_path / "u1"), tmp_path / "dcp")
        import_dcp(tmp_path / "dcp", str(tmp_path / "u2"))
    export_hf(str(tmp_path / "u2"), tmp_path / "out")
    assert config_of(tmp_path / "out") == config_of(tmp_path / "hf")
    assert torch.equal(logits(back_in_transformers(tmp_path / "out", model)), logits(model))


def test_a_megatron_checkpoint_says_its_router_and_rope_settings_in_its_own_args(tmp_path):
    """A checkpoint Megatron wrote (no HF config of ucp's in its args): the router's groups and scaling and YaRN's
    settings come back into the HF config from Megatron's own arguments."""
    hf_model(tmp_path, **{**FIELDS, "norm_topk_prob": True})
    import_hf(tmp_path / "hf", str(tmp_path / "u1"))
    convert(str(tmp_path / "u1"), str(tmp_path / "m"), from_layout="universal", to_layout="tp2")
    for path in (tmp_path / "m").glob("iter_*/mp_rank_*/model_optim_rng.pt"):
        state = torch.load(path, weights_only=False)  # (a file this test wrote)
        del state["args"].ucp_hf_config
        torch.save(state, path)
    convert(str(tmp_path / "m"), str(tmp_path / "u2"), from_layout="tp2", to_layout="universal")
    export_hf(str(tmp_path / "u2"), tmp_path / "out")
    got = config_of(tmp_path / "out")
    for key in ("n_group", "topk_group", "routed_scaling_factor", "rms_norm_eps", "max_position_embeddings"):
        assert got[key] == FIELDS[key], key
    assert got["norm_topk_prob"] is True  # (Megatron's router renormalises the top 2)
    assert got["rope_parameters"] == FIELDS["rope_parameters"]


@pytest.mark.parametrize("q_lora_rank", [None, 24])
def test_megatron_core_loads_the_rank_files_strictly_and_computes_the_same(tmp_path, q_lora_rank):
    """megatron-core's own GPT model with multi-latent attention (TP 2, local spec), dense first layers, then MoE
    layers with the sigmoid router, its expert bias, grouped top-k and shared experts, takes ucp's tp2 files with
    strict=True and computes the logits transformers computes (within float tolerance: another kernel order)."""
    pytest.importorskip("megatron.core")
    from .launch import spawn
    from .megatron_worker import tokens

    # (the worker's model: RoPE base 1e4 on interleaved pairs as Megatron's MLA applies it, norm epsilon 1e-6 (HF's q/kv norms have it
    # fixed), weights renormalised over the top-k as Megatron's sigmoid router does)
    k, shared, scaling = random.choice([0, 1, 2]), random.choice([1, 2]), random.choice([1.0, 2.5])
    model = hf_model(
        tmp_path,
        q_lora_rank=q_lora_rank,
        first_k_dense_replace=k,
        n_shared_experts=shared,
        routed_scaling_factor=scaling,
        norm_topk_prob=True,
        rope_theta=1e4,
        rope_interleave=True,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    )
    import_hf(tmp_path / "hf", str(tmp_path / "u"))
    convert(str(tmp_path / "u"), str(tmp_path / "megatron"), from_layout="universal", to_layout="tp2")
    out = tmp_path / "logits"
    argv = ["tests/megatron_deepseek_worker.py", str(tmp_path / "megatron"), str(out), str(q_lora_rank or 0)]
    spawn([*argv, str(k), str(shared), str(scaling)], 2, timeout=300, env={"PYTHONWARNINGS": "ignore"})
    with torch.no_grad():
        expected = model(tokens()).logits
    for rank in range(2):
        got = torch.load(f"{out}.{rank}", weights_only=True)
        assert torch.allclose(got, expected, atol=1e-4, rtol=1e-4), (rank, (got - expected).abs().max())


@pytest.mark.parametrize(
    "setting",
    [{"rope_interleave": False}, {"norm_topk_prob": False}, {"num_experts_per_tok": 1, "norm_topk_prob": True}],
)
def test_a_model_megatron_would_compute_differently_is_not_converted_to_megatron(tmp_path, setting):
    hf_model(tmp_path, **{"norm_topk_prob": True, **setting})  # (one refusal at a time)
    import_hf(tmp_path / "hf", str(tmp_path / "u"))
    with pytest.raises(SourceMismatchError, match=f"{list(setting)[-1]}={list(setting.values())[-1]}"):
        convert(str(tmp_path / "u"), str(tmp_path / "m"), from_layout="universal", to_layout="tp2")
    assert not (tmp_path / "m").exists()


def test_layers_past_the_models_are_refused_with_what_they_are(tmp_path):
    """A released DeepSeek-V3 holds a multi-token-prediction layer after its last one: not part of the model that
    transformers runs, so not imported (and not silently dropped)."""
    hf_model(tmp_path, num_hidden_layers=3)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 2}))
    with pytest.raises(SourceMismatchError, match="in layers past num_hidden_layers=2: .*multi-token-prediction"):
        import_hf(tmp_path / "hf", str(tmp_path / "u"))
    assert not (tmp_path / "u").exists()


@pytest.mark.parametrize("path", ["hf", "megatron", "dcp"])
def test_a_bf16_checkpoint_keeps_its_fp32_router_bias_through_every_path(tmp_path, path):
    """Released DeepSeek-V3 checkpoints keep the router's correction bias in fp32 beside bf16 weights: every tensor
    keeps its own dtype, bit for bit, where nothing asked for a cast (Megatron holds the bias in an fp32 buffer)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    hf_model(tmp_path, norm_topk_prob=True)
    weights = tmp_path / "hf" / "model.safetensors"
    with safe_open(str(weights), framework="pt") as f:
        names = f.keys()
        tensors = {n: f.get_tensor(n) for n in names}
    mixed = {n: t if n.endswith("e_score_correction_bias") else t.to(torch.bfloat16) for n, t in tensors.items()}
    save_file(mixed, str(weights), metadata={"format": "pt"})
    import_hf(tmp_path / "hf", str(tmp_path / "u"))
    atoms = ucp.open_checkpoint(str(tmp_path / "u")).atoms
    assert {m.dtype for p, m in atoms.items() if p.endswith("e_score_correction_bias")} == {"float32"}
    assert {m.dtype for p, m in atoms.items() if not p.endswith("e_score_correction_bias")} == {"bfloat16"}
    if path == "megatron":
        convert(str(tmp_path / "u"), str(tmp_path / "m"), from_layout="universal", to_layout="tp2ep2")
        rank_file = torch.load(
            next((tmp_path / "m").glob("iter_*/mp_rank_00_000/model_optim_rng.pt")), weights_only=False
        )
        biases = [t for n, t in rank_file["model"].items() if n.endswith("router.expert_bias")]
        assert biases and {t.dtype for t in biases} == {torch.float32}
        assert rank_file["model"]["embedding.word_embeddings.weight"].dtype == torch.bfloat16
        convert(str(tmp_path / "m"), str(tmp_path / "m2"), from_layout="tp2ep2", to_layout="tp1pp3ep2")  # resharded
        convert(str(tmp_path / "m2"), str(tmp_path / "u2"), from_layout="tp1pp3ep2", to_layout="universal")
        (tmp_path / "u").rename(tmp_path / "u-imported")
        (tmp_path / "u2").rename(tmp_path / "u")
    elif path == "dcp":
        from ucp.interop.dcp import export_dcp, import_dcp

        export_dcp(str(tmp_path / "u"), tmp_path / "dcp")
        (tmp_path / "u").rename(tmp_path / "u-imported")
        import_dcp(tmp_path / "dcp", str(tmp_path / "u"))
    export_hf(str(tmp_path / "u"), tmp_path / "out")
    back = {}
    for out in (tmp_path / "out").glob("*.safetensors"):
        with safe_open(str(out), framework="pt") as f:
            names = f.keys()
            back.update({n: f.get_tensor(n) for n in names})
    assert set(back) == set(mixed)
    for name, t in mixed.items():
        assert back[name].dtype == t.dtype and torch.equal(back[name], t), name
    assert json.loads((tmp_path / "out" / "config.json").read_text())["dtype"] == "bfloat16"
    # asked for, a cast applies to every tensor
    export_hf(str(tmp_path / "u"), tmp_path / "fp32", dtype="fp32")
    with safe_open(str(next((tmp_path / "fp32").glob("*.safetensors"))), framework="pt") as f:
        names = f.keys()
        assert {f.get_tensor(n).dtype for n in names} == {torch.float32}


@pytest.mark.slow
def test_megatron_core_loads_what_ucp_converts_from_its_own_torch_dist(tmp_path):
    """megatron-core saves its MLA GPT (a dense layer, then a MoE layer with the router's expert bias) at TP 2 with its
    own dist_checkpointing (torch_dist); ucp converts that to ucp, to tp1 rank files and back to torch_dist, and
    megatron-core at TP 1 loads each (torch_dist strictly) to the very parameters it loads from its own save."""
    pytest.importorskip("megatron.core")
    from ucp.sharding.families import family_for

    from .launch import spawn
    from .test_megatron_order import CONFIGS

    kind = random.choice(["deepseek_q_lora_None", "deepseek_q_lora_24"])
    config = CONFIGS[kind]
    env = {
        "UCP_MEGATRON_KIND": kind,
        "UCP_MEGATRON_CONFIG": json.dumps({"family": family_for(config).name, **config.to_json()}),
        "PYTHONWARNINGS": "ignore",
    }
    src, out = tmp_path / "src", tmp_path / "params"
    spawn(["tests/megatron_dist_worker.py", "save", "2", "1", str(src)], 2, timeout=300, env=env)
    convert(str(src), str(tmp_path / "u"), from_layout="torch_dist", to_layout="universal")
    convert(str(tmp_path / "u"), str(tmp_path / "tp1"), from_layout="universal", to_layout="tp1")
    convert(str(tmp_path / "u"), str(tmp_path / "td"), from_layout="universal", to_layout="torch_dist")
    ckpts = [str(src), str(tmp_path / "tp1"), str(tmp_path / "td")]
    spawn(["tests/megatron_dist_worker.py", "load", "1", "1", str(out), *ckpts], 1, timeout=300, env=env)
    own, *ours = torch.load(f"{out}.0", weights_only=True)
    for loaded in ours:
        assert set(loaded) == set(own)
        for name, value in own.items():
            assert torch.equal(loaded[name], value), name
