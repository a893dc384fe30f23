"""How Megatron-LM's arguments name a family's models (the GPT model, local spec, that the rules' `local` names are
the tensors of).

Each family's `MegatronNames` says which jobs' args describe one of its models, builds its config from them and
the args back from its config; the shape every family shares (layers, hidden size, heads, vocabulary, and the
SwiGLU / RMSNorm / RoPE decoder that all of them are) is read and written here once (`gpt_shape`, `gpt_args`).
Pure functions of the args: ucp.interop.megatron.args applies them to a checkpoint's args (naming the file at
fault) and adds what is the job's and not the model's (its layout, its grad buffers, the HF fields its args carry).
A problem with the args is a UcpError naming the argument.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from ...errors import UcpError
from .config import FamilyConfig

C = TypeVar("C", bound=FamilyConfig)


def arg(args: Any, name: str, default: Any = None) -> Any:
    """An argument of Megatron-LM's (an argparse.Namespace, or any object with its attributes); absent or None:
    `default`."""
    value = getattr(args, name, default)
    return default if value is None else value


def required(args: Any, name: str) -> int:
    """A size the model's shape cannot do without: a positive integer (args given as JSON may say anything)."""
    value = arg(args, name)
    if value is None:
        raise UcpError(f"args has no {name}: cannot tell the model's shape")
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise UcpError(f"args' {name} is {value!r:.40}, not a positive integer")
    return int(value)


def experts(args: Any) -> int:
    """The routed experts of a MoE job (0: a dense model)."""
    return int(arg(args, "num_experts", 0))


def latent_attention(args: Any) -> bool:
    """Whether the job's attention is multi-latent (MLA, DeepSeek's)."""
    return bool(arg(args, "multi_latent_attention", False))


def rope_scaling(hf: Mapping[str, Any]) -> dict[str, Any]:
    """An HF config's RoPE scaling in either spelling (transformers 5's rope_parameters, 4's rope_scaling), with its
    rope_type ("default": none)."""
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    params = dict(params) if isinstance(params, Mapping) else {}
    params["rope_type"] = params.get("rope_type") or params.get("type") or "default"
    return params


def check_router(args: Any, family: str, *, score: str, pre_softmax: bool | None, scaled: bool, grouped: bool) -> None:
    """Refuse a MoE router whose weights `family`'s Hugging Face model computes otherwise, naming the argument:
    `score` the function it scores experts with, `pre_softmax` whether it takes the top-k of the softmax over all
    experts (None: either, as the family's config says), `scaled` / `grouped` whether it has a scaling of the
    weights / group-limited routing (megatron-core's `topk_routing_with_score_function`)."""
    balancing = arg(args, "moe_router_load_balancing_type", "aux_loss")
    scores = arg(args, "moe_router_score_function", "softmax")
    pre = bool(arg(args, "moe_router_pre_softmax", False))
    scaling = arg(args, "moe_router_topk_scaling_factor", 1.0)
    groups = arg(args, "moe_router_group_topk")
    wrong = [
        ("moe_router_load_balancing_type", balancing, balancing == "sinkhorn"),
        ("moe_router_score_function", scores, scores != score),
        ("moe_router_pre_softmax", pre, pre_softmax is not None and pre != pre_softmax),
        ("moe_router_topk_scaling_factor", scaling, not scaled and scaling != 1.0),
        ("moe_router_group_topk", groups, not grouped and bool(groups)),
    ]
    for name, value, is_wrong in wrong:
        if is_wrong:
            raise UcpError(
                f"{name}={value!r}: the {family} family's router (as Hugging Face computes it) weighs the experts "
                "otherwise; converting would change the model"
            )


def _hf_as_is(args: Any, hf: dict[str, Any]) -> dict[str, Any]:
    return hf


def _holds(config: FamilyConfig, hf: Mapping[str, Any]) -> str | None:
    return None


@dataclass(frozen=True)
class MegatronNames(Generic[C]):
    """A family's Megatron-LM arguments, both ways. `claims`: whether a job's args describe a model of the family
    (the families' claims exclude each other: `ucp.sharding.families.megatron_family`); `config`: its config from the args
    and the shared shape (`gpt_shape`); `args`: the family's own arguments for a config, with the HF fields the
    config does not model (`hf`, e.g. a router's settings); `hf_fields`: those HF fields as the args say them, added
    to what every family's args carry; `refuses`: why no Megatron job computes a model of this config (None: one
    does); `layers_apart`: the args `args` writes make megatron-core's layers differ (a `moe_layer_freq` list), so
    that its torch_dist format keys each layer on its own."""

    claims: Callable[[Any], bool]
    config: Callable[[Any, dict[str, Any]], C]
    args: Callable[[C, Mapping[str, Any]], dict[str, Any]]
    hf_fields: Callable[[Any, dict[str, Any]], dict[str, Any]] = _hf_as_is
    refuses: Callable[[C, Mapping[str, Any]], str | None] = _holds
    layers_apart: bool = False


def gpt_shape(args: Any, vocab_size: int | None = None) -> dict[str, Any]:
    """The config fields every family shares, from a job's args (`vocab_size`: the true vocabulary, where the args
    know only the padded one); refuses a decoder that no family is (not SwiGLU, linear biases, not RMSNorm, norm
    weights kept less one, positions other than RoPE over whole heads), rather than convert it to another model."""
    if not arg(args, "swiglu", False):
        raise UcpError("args.swiglu is off; ucp's families are SwiGLU (gate/up fused in linear_fc1)")
    if arg(args, "add_bias_linear", False):
        raise UcpError("linear biases (add_bias_linear) have no atom in ucp's families")
    if arg(args, "normalization", "RMSNorm") != "RMSNorm":
        raise UcpError(f"normalization={args.normalization!r}; ucp's families use RMSNorm")
    if arg(args, "apply_layernorm_1p", False):
        raise UcpError("apply_layernorm_1p: norm weights kept less one have no atom in ucp's families")
    if arg(args, "position_embedding_type", "rope") != "rope":
        raise UcpError(f"position_embedding_type={args.position_embedding_type!r}; ucp's families use RoPE")
    if arg(args, "rotary_percent", 1.0) != 1.0:
        raise UcpError(
            f"rotary_percent={args.rotary_percent}: RoPE over part of each head has no Hugging Face config in "
            "ucp's families"
        )
    if arg(args, "rotary_interleaved", False) and not latent_attention(args):
        raise UcpError("rotary_interleaved: RoPE on interleaved pairs has no Hugging Face config in ucp's families")
    heads, hidden = required(args, "num_attention_heads"), required(args, "hidden_size")
    said, padded = arg(args, "vocab_size"), arg(args, "padded_vocab_size")
    if vocab_size is not None and said is not None and vocab_size != said:
        raise UcpError(
            f"the vocabulary size given ({vocab_size}) is not the args' vocab_size ({said}): it is for args that know "
            "only the padded size"
        )
    if vocab_size is not None and padded is not None and not 0 < vocab_size <= padded:
        raise UcpError(f"the vocabulary size given ({vocab_size}) is not within the args' padded_vocab_size ({padded})")
    vocab = vocab_size or said or padded
    if vocab is None:
        raise UcpError("args has neither vocab_size nor padded_vocab_size")
    return {
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "num_hidden_layers": required(args, "num_layers"),
        "num_attention_heads": heads,
        "num_key_value_heads": arg(args, "num_query_groups", heads) if arg(args, "group_query_attention") else heads,
        "head_dim": arg(args, "kv_channels") or hidden // heads,
        "tie_word_embeddings": not arg(args, "untie_embeddings_and_output_weights", False),
        "make_vocab_size_divisible_by": arg(args, "make_vocab_size_divisible_by", 128),
    }


def gpt_args(config: FamilyConfig) -> dict[str, Any]:
    """The arguments of the shape every family shares (`gpt_shape`, the other way)."""
    return {
        "num_layers": config.num_hidden_layers,
        "hidden_size": config.hidden_size,
        "num_attention_heads": config.num_attention_heads,
        "group_query_attention": config.num_key_value_heads != config.num_attention_heads,
        "num_query_groups": config.num_key_value_heads,
        "kv_channels": config.head_dim,
        "swiglu": True,
        "add_bias_linear": False,
        "normalization": "RMSNorm",
        "position_embedding_type": "rope",
        "untie_embeddings_and_output_weights": not config.tie_word_embeddings,
        "vocab_size": config.vocab_size,
        "make_vocab_size_divisible_by": config.make_vocab_size_divisible_by,
    }
