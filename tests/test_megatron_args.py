"""Megatron-LM's args and ucp's model configs, both ways (ucp.interop.megatron.args, through each family's
`MegatronNames`): a random config of every family comes back from the args written for it, with the HF fields the
args carry; exactly one family claims any args; args that no family holds are refused naming the file and the
argument; and `ConvertOptions` refuses what means nothing before anything is read."""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import random

import pytest

from ucp.errors import UcpError
from ucp.interop.errors import InteropError
from ucp.interop.megatron.args import (
    HF_CONFIG_ARG,
    MEGATRON_LLAMA3,
    UNEVEN_STAGE_ARGS,
    args_for,
    args_layout,
    check_even_stages,
    config_from_args,
)
from ucp.interop.megatron.convert import ConvertOptions, convert
from ucp.sharding.families import (
    FAMILIES,
    DeepseekV3Config,
    FamilyConfig,
    LlamaConfig,
    MixtralConfig,
    QwenMoeConfig,
    megatron_family,
)
from ucp.sharding.layout import Layout

from .helpers import DRAW

SEEDS = [DRAW.randrange(2**32) for _ in range(6)]


def _attention(rng: random.Random) -> dict:
    heads = rng.choice([2, 4, 8])
    head_dim = rng.choice([4, 8, 16])
    return {
        "vocab_size": rng.randrange(50, 300),
        "hidden_size": heads * head_dim * rng.choice([1, 2]),
        "num_hidden_layers": rng.randrange(1, 5),
        "num_attention_heads": heads,
        "num_key_value_heads": rng.choice([k for k in (1, 2, heads) if heads % k == 0]),
        "head_dim": head_dim,
        "tie_word_embeddings": rng.random() < 0.5,
        "make_vocab_size_divisible_by": rng.choice([8, 128]),
    }


def draw_config(family: str, rng: random.Random) -> FamilyConfig:
    """A random config of `family`, as a Megatron job can compute it."""
    shape = _attention(rng)
    experts = rng.randrange(2, 9)
    if family == "llama":
        return LlamaConfig(
            intermediate_size=rng.randrange(8, 96),
            attention_bias=rng.random() < 0.5,
            qk_norm=rng.random() < 0.5,
            **shape,
        )
    if family == "mixtral":
        return MixtralConfig(
            intermediate_size=rng.randrange(8, 96),
            num_local_experts=experts,
            num_experts_per_tok=rng.randrange(1, experts + 1),
            **shape,
        )
    if family == "qwen_moe":
        # (at least one of what sets it apart from Mixtral: without any, Megatron's args are Mixtral's)
        bias, norm, shared = rng.choice([c for c in itertools.product([False, True], repeat=3) if any(c)])
        return QwenMoeConfig(
            moe_intermediate_size=rng.randrange(8, 64),
            intermediate_size=rng.randrange(8, 96),
            shared_expert_intermediate_size=rng.randrange(8, 64) if shared else 0,
            num_local_experts=experts,
            num_experts_per_tok=rng.randrange(1, experts + 1),
            attention_bias=bias,
            qk_norm=norm,
            **shape,
        )
    assert family == "deepseek_v3"
    ffn = rng.randrange(8, 64)
    return DeepseekV3Config(
        intermediate_size=rng.randrange(8, 96),
        moe_intermediate_size=ffn,
        num_local_experts=experts,
        num_experts_per_tok=rng.randrange(1, experts + 1),
        n_shared_experts=rng.randrange(0, 3),
        first_k_dense_replace=rng.randrange(0, shape["num_hidden_layers"] + 1),
        q_lora_rank=rng.choice([None, 16, 24]),
        kv_lora_rank=rng.choice([8, 16]),
        qk_nope_head_dim=rng.choice([4, 8]),
        qk_rope_head_dim=rng.choice([2, 4]),
        v_head_dim=rng.choice([4, 8]),
        num_hidden_layers=shape["num_hidden_layers"],
        vocab_size=shape["vocab_size"],
        hidden_size=shape["num_attention_heads"] * 8,
        num_attention_heads=shape["num_attention_heads"],
        tie_word_embeddings=shape["tie_word_embeddings"],
        make_vocab_size_divisible_by=shape["make_vocab_size_divisible_by"],
    )


def draw_hf(family: str, rng: random.Random) -> dict:
    """HF fields a config does not model, as an export of the family carries them (each one the args name)."""
    hf = {"rms_norm_eps": rng.choice([1e-5, 1e-6]), "max_position_embeddings": rng.choice([2048, 4096])}
    hf["rope_theta"] = rng.choice([1e4, 5e5, 1e6])
    if family in ("mixtral", "qwen_moe", "deepseek_v3"):
        hf["router_aux_loss_coef"] = rng.choice([0.001, 0.02])
    if family == "qwen_moe":
        hf["norm_topk_prob"] = rng.random() < 0.5
    if family != "deepseek_v3" and rng.random() < 0.5:  # RoPE scaled, as Megatron's GPT model scales it
        theta = hf.pop("rope_theta")
        factor = rng.choice([2.0, 8.0, 32.0])
        hf["rope_parameters"] = rng.choice(
            [
                {"rope_type": "llama3", "rope_theta": theta, "factor": factor, **MEGATRON_LLAMA3},
                {"rope_type": "linear", "rope_theta": theta, "factor": factor},
            ]
        )
    if family == "deepseek_v3":
        hf.update(n_group=rng.choice([1, 2]), topk_group=1, routed_scaling_factor=rng.choice([1.0, 2.5]))
        if rng.random() < 0.5:  # YaRN, in transformers >= 5's spelling
            theta = hf.pop("rope_theta")
            hf["rope_parameters"] = {
                "rope_type": "yarn",
                "rope_theta": theta,
                "factor": 40.0,
                "original_max_position_embeddings": 4096,
                "beta_fast": 32,
                "beta_slow": 1,
                "mscale": 1.0,
                "mscale_all_dim": 1.0,
            }
    return hf


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("seed", SEEDS)
def test_every_family_s_config_comes_back_from_the_args_written_for_it(family, seed):
    rng = random.Random(seed)
    config, hf = draw_config(family, rng), draw_hf(family, rng)
    ep, pp = rng.choice([1, 2]), rng.choice([1, 2])  # (Megatron's files hold DP = EP)
    layout = Layout(tp=rng.choice([1, 2, 4]), pp=pp, vpp=rng.choice([1, 2]) if pp > 1 else 1, ep=ep, dp=ep)
    args = args_for(config, layout, hf=hf)
    assert megatron_family(args).name == family
    assert args_layout(args) == layout
    back, hf_back = config_from_args(args, "args.pt")
    assert back == config
    assert {k: hf_back[k] for k in hf} == hf  # (the whole HF config travels in the args)
    # ... and what the args themselves name comes back without it (as from a job of Megatron-LM's own)
    delattr(args, HF_CONFIG_ARG)
    back, hf_back = config_from_args(args, "args.pt")
    assert back == config
    assert {k: hf_back[k] for k in hf} == hf


FLAGS = ("num_experts", "multi_latent_attention", "qk_layernorm", "add_qkv_bias", "moe_shared_expert_intermediate_size")


@pytest.mark.parametrize("values", list(itertools.product([0, 1], repeat=len(FLAGS))))
def test_exactly_one_family_claims_any_args(values):
    args = argparse.Namespace(
        **{flag: value * 4 if flag != "multi_latent_attention" else bool(value) for flag, value in zip(FLAGS, values)}
    )
    claims = [name for name, f in FAMILIES.items() if f.megatron is not None and f.megatron.claims(args)]
    assert len(claims) == 1, claims
    assert megatron_family(args).name == claims[0]


def _moe_args(**changes) -> argparse.Namespace:
    args = args_for(draw_config("deepseek_v3", random.Random(0)), Layout())
    vars(args).update(changes)
    return args


GOOD = {"num_layers": 2, "hidden_size": 16, "num_attention_heads": 2, "ffn_hidden_size": 32, "vocab_size": 64}
REFUSED = [
    ({**GOOD, "swiglu": False}, "args.swiglu is off"),
    ({**GOOD, "swiglu": True, "add_bias_linear": True}, "add_bias_linear"),
    ({**GOOD, "swiglu": True, "normalization": "LayerNorm"}, "normalization='LayerNorm'"),
    ({**GOOD, "swiglu": True, "num_layers": None}, "args has no num_layers"),
    # args given as JSON (--config) may say anything: a size of another type, or not positive
    ({**GOOD, "swiglu": True, "num_layers": "2"}, "args' num_layers is '2', not a positive integer"),
    ({**GOOD, "swiglu": True, "hidden_size": 16.0}, "args' hidden_size is 16.0, not a positive integer"),
    ({**GOOD, "swiglu": True, "num_attention_heads": -2}, "args' num_attention_heads is -2, not a positive integer"),
    ({**GOOD, "swiglu": True, "num_experts": [4]}, "the args do not describe a model: TypeError"),
    ({**GOOD, "swiglu": True, "vocab_size": None}, "neither vocab_size nor padded_vocab_size"),
    ({**GOOD, "swiglu": True, "multi_latent_attention": True}, "multi-latent attention without experts"),
    ({**GOOD, "swiglu": True, "num_experts": 4, "moe_shared_expert_intermediate_size": 8}, "without its gate"),
    (
        {**GOOD, "swiglu": True, "num_attention_heads": 4, "num_query_groups": 3, "group_query_attention": True},
        "num_key_value_heads=3",
    ),
    # what changes the model's math and no family's HF config says: refused, not dropped
    ({**GOOD, "swiglu": True, "apply_layernorm_1p": True}, "apply_layernorm_1p: norm weights kept less one"),
    ({**GOOD, "swiglu": True, "position_embedding_type": "learned_absolute"}, "learned_absolute'; ucp's families"),
    ({**GOOD, "swiglu": True, "rotary_percent": 0.5}, "rotary_percent=0.5: RoPE over part of each head"),
    ({**GOOD, "swiglu": True, "rotary_interleaved": True}, "rotary_interleaved: RoPE on interleaved pairs"),
    (
        {**GOOD, "swiglu": True, "use_rope_scaling": True, "rotary_seq_len_interpolation_factor": 2},
        "use_rope_scaling and rotary_seq_len_interpolation_factor together",
    ),
    *(
        ({**GOOD, "swiglu": True, "num_experts": 4, **router}, f"{match}: the {family} family's router")
        for family, moe in (("Mixtral", {}), ("Qwen MoE", {"qk_layernorm": True}))
        for router, match in (
            ({"moe_router_score_function": "sigmoid"}, "moe_router_score_function='sigmoid'"),
            ({"moe_router_topk_scaling_factor": 2.5}, "moe_router_topk_scaling_factor=2.5"),
            ({"moe_router_num_groups": 2, "moe_router_group_topk": 1}, "moe_router_group_topk=1"),
            ({"moe_router_load_balancing_type": "sinkhorn"}, "moe_router_load_balancing_type='sinkhorn'"),
            *([({"moe_router_pre_softmax": True}, "moe_router_pre_softmax=True")] if family == "Mixtral" else []),
        )
        for router in [{**router, **moe}]
    ),
]


@pytest.mark.parametrize(("given", "match"), REFUSED)
def test_args_that_no_family_holds_are_refused_naming_the_file(given, match):
    with pytest.raises(InteropError, match=f"^iter_0000001/mp_rank_00/model_optim_rng.pt: .*{match}"):
        config_from_args(argparse.Namespace(**given), "iter_0000001/mp_rank_00/model_optim_rng.pt")


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"moe_layer_freq": [1, 0]}, r"moe_layer_freq=\[1, 0\]; .* dense layers first"),
        ({"moe_router_enable_expert_bias": False}, "moe_router_enable_expert_bias is off"),
        ({"moe_shared_expert_intermediate_size": 7}, "moe_shared_expert_intermediate_size=7 is not a multiple"),
        ({"kv_lora_rank": None}, "args has no kv_lora_rank"),
        ({"moe_router_score_function": "softmax"}, "moe_router_score_function='softmax': the DeepSeek-V3 family"),
    ],
)
def test_deepseek_args_it_cannot_hold_are_refused(changes, match):
    args = _moe_args(**{"num_layers": 2, "moe_layer_freq": [0, 1], **changes})
    with pytest.raises(InteropError, match=f"^common.pt: {match}"):
        config_from_args(args, "common.pt")


@pytest.mark.parametrize(
    ("family", "hf", "match"),
    [
        ("llama", {"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "RoPE scaling .*'yarn'"),
        ("mixtral", {"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "RoPE scaling .*'dynamic'"),
        (
            "qwen_moe",
            {"rope_parameters": {"rope_type": "llama3", "factor": 8.0, **MEGATRON_LLAMA3, "low_freq_factor": 2.0}},
            "RoPE scaling .*'low_freq_factor': 2.0",
        ),
    ],
)
def test_a_rope_scaling_megatron_does_not_compute_is_refused(family, hf, match):
    with pytest.raises(UcpError, match=f"{match}.*Megatron would compute another model"):
        args_for(draw_config(family, random.Random(0)), Layout(), hf=hf)


@pytest.mark.parametrize("topk", [1, 2])
def test_deepseek_s_top_k_weights_are_renormalised_as_megatron_does(topk):
    """Megatron's sigmoid router renormalises the top-k weights exactly when k > 1 (HF's norm_topk_prob)."""
    config = dataclasses.replace(draw_config("deepseek_v3", random.Random(0)), num_experts_per_tok=topk)
    names = FAMILIES["deepseek_v3"].megatron
    assert names is not None
    assert config_from_args(args_for(config, Layout()), "args.pt")[1]["norm_topk_prob"] == (topk > 1)
    assert names.refuses(config, {"norm_topk_prob": topk > 1}) is None
    assert "norm_topk_prob" in str(names.refuses(config, {"norm_topk_prob": topk == 1}))


@pytest.mark.parametrize("name", UNEVEN_STAGE_ARGS)
def test_files_of_pipeline_stages_split_unevenly_are_refused_naming_the_argument(name):
    args = argparse.Namespace(pipeline_model_parallel_size=2, **{name: 1})
    with pytest.raises(InteropError, match=f"^mp_rank_00_000/model_optim_rng.pt: {name}=1: .* even split"):
        check_even_stages(args, "mp_rank_00_000/model_optim_rng.pt")
    check_even_stages(argparse.Namespace(pipeline_model_parallel_size=1, **{name: 1}), "x")  # (one stage: all)


def test_no_args_is_refused():
    with pytest.raises(InteropError, match="common.pt has no 'args'"):
        config_from_args(None, "common.pt")


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"from_layout": "tp2", "to_layout": "tp4", "target_ep": 2}, "--target-ep 2: it says which job"),
        ({"from_layout": "tp2", "to_layout": "universal", "target_layout": "tp2"}, "--target-layout tp2: it says"),
        (
            {"from_layout": "tp2", "to_layout": "torch_dist", "target_ep": 2, "target_layout": "tp2"},
            "the layout names its EP",
        ),
        (
            {"from_layout": "tp2", "to_layout": "torch_dist", "target_ep": 0},
            "--target-ep 0: an expert-parallel size is 1",
        ),
        (
            {"from_layout": "tp2", "to_layout": "torch_dist", "target_layout": "tp2x"},
            "^--target-layout tp2x: malformed Megatron layout 'tp2x'",
        ),
        # a layout refused names the flag that gave it
        ({"from_layout": "tp2", "to_layout": "tp1pp1vpp2"}, r"^--to tp1pp1vpp2: .*vpp=2 needs pp > 1"),
        ({"from_layout": "tp2", "to_layout": "pp2"}, r"^--to pp2: malformed .*, universal or torch_dist$"),
        ({"from_layout": "tp0", "to_layout": "universal"}, r"^--from tp0: .*tp=0 must be a positive integer"),
        (
            {"from_layout": "tp2", "to_layout": "torch_dist", "target_layout": "universal"},
            r"^--target-layout universal: malformed Megatron layout 'universal': expected .*tp2ep4\)$",
        ),
        ({"from_layout": "universal", "to_layout": "universal"}, "nothing to convert"),
        ({"from_layout": "torch_dist", "to_layout": "torch_dist"}, "nothing to convert"),
        (
            {"from_layout": "tp2", "to_layout": "universal", "model_config": "c.json"},
            "--config c.json: .*files have their args",
        ),
    ],
)
def test_convert_options_refuse_what_means_nothing_before_anything_is_read(tmp_path, options, match):
    with pytest.raises(UcpError, match=match):
        ConvertOptions(**options)
    with pytest.raises(UcpError, match=match):  # (convert's keywords are the options')
        convert(tmp_path / "absent", tmp_path / "out", **options)
    assert not (tmp_path / "out").exists()


def test_convert_takes_options_or_keywords_not_both(tmp_path):
    options = ConvertOptions(from_layout="tp2", to_layout="universal")
    with pytest.raises(TypeError, match=r"not both"):
        convert(tmp_path / "absent", tmp_path / "out", options, step=3)
    with pytest.raises(TypeError, match="unexpected keyword argument 'stepp'"):
        convert(tmp_path / "absent", tmp_path / "out", from_layout="tp2", to_layout="universal", stepp=3)


@pytest.mark.parametrize(
    ("given", "vocab", "match"),
    [
        ({"vocab_size": 64}, 50, r"the vocabulary size given \(50\) is not the args' vocab_size \(64\)"),
        (
            {"vocab_size": None, "padded_vocab_size": 128},
            129,
            r"given \(129\) is not within the args' padded_vocab_size",
        ),
    ],
)
def test_a_vocabulary_size_that_contradicts_the_args_is_refused(given, vocab, match):
    args = argparse.Namespace(**{**GOOD, "swiglu": True, **given})
    with pytest.raises(InteropError, match=f"^common.pt: .*{match}"):
        config_from_args(args, "common.pt", vocab)
    if given.get("vocab_size") is None:  # (what the flag is for: args that know only the padded size)
        assert config_from_args(args, "common.pt", 100)[0].vocab_size == 100
