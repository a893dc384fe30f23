"""A Megatron-LM job's arguments (the `args` Namespace its checkpoints carry) and ucp's model configs, both ways.

Which family a job's model is, and its config, is each family's to say (`ucp.sharding.families.megatron_names`: its
`MegatronNames`); here that is applied to a checkpoint's args, a problem named with the file it came from, and what
is the job's rather than the model's is added: the layout the files are split by, the distributed optimizer's grad
buffers, and the Hugging Face fields the args carry (RoPE's base, the norm's epsilon, ..., and the whole HF config
a ucp export stores in them).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping
from typing import Any

import torch

from ...errors import UcpError
from ...sharding.families import FamilyConfig, family_for, megatron_family
from ...sharding.families.megatron_names import arg, gpt_args, gpt_shape, latent_attention, required, rope_scaling
from ...sharding.layout import Layout
from ..errors import InteropError
from .files import ForeignEnum, real_enum
from .optimizer import DistributedBuffers


def config_from_args(args: Any, where: str, vocab_size: int | None = None) -> tuple[FamilyConfig, dict[str, Any]]:
    """The family config from Megatron's args (the family whose Megatron names claim them: Llama for a dense GPT
    model, Mixtral or the Qwen MoE family for a MoE one, DeepSeek-V3 with multi-latent attention), and the HF fields
    the config does not model (rope base, norm eps, ...). `where`: the file the args came from, named in errors."""
    if args is None:
        raise InteropError(f"{where} has no 'args': cannot tell the model's shape")
    try:
        names = megatron_family(args).megatron
        assert names is not None  # (a family claims args by its Megatron names)
        config = names.config(args, gpt_shape(args, vocab_size))
        hf = names.hf_fields(args, hf_fields_from_args(args, where))
    except UcpError as e:
        raise InteropError(f"{where}: {e}") from None
    except (TypeError, ValueError) as e:  # (a value of another type than Megatron writes: "2" layers, [4] experts)
        raise InteropError(f"{where}: the args do not describe a model: {type(e).__name__}: {e}") from None
    return config, hf


# Hugging Face config fields that Megatron's args carry, by their Megatron names (RoPE's base is handled apart: HF
# keeps it as rope_theta or, with transformers >= 5, in rope_parameters).
_HF_ARGS = {
    "rms_norm_eps": "norm_epsilon",
    "max_position_embeddings": "max_position_embeddings",
    "router_aux_loss_coef": "moe_aux_loss_coeff",
}
# Where a Megatron checkpoint written by ucp keeps the whole Hugging Face config, JSON in one string argument, so
# that what Megatron's args have no name for (token ids, sliding window, router jitter, ...) comes back too.
HF_CONFIG_ARG = "ucp_hf_config"


# RoPE scaling as megatron-core's GPT model computes it (`RotaryEmbedding`): Llama 3's with these settings fixed
# (use_rope_scaling, rope_scaling_factor), or positions linearly interpolated (rotary_seq_len_interpolation_factor).
# Multi-latent attention has RoPE of its own (YaRN: the DeepSeek-V3 family's args) and ignores both.
MEGATRON_LLAMA3 = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def _rope_from_args(args: Any, where: str) -> dict[str, Any]:
    """RoPE's scaling as a (non-MLA) job's args set it, as HF's rope_parameters say it (without the base)."""
    llama3, linear = arg(args, "use_rope_scaling", False), arg(args, "rotary_seq_len_interpolation_factor")
    if llama3 and linear:
        raise InteropError(
            f"{where}: use_rope_scaling and rotary_seq_len_interpolation_factor together have no Hugging Face config"
        )
    if llama3:
        return {"rope_type": "llama3", "factor": float(arg(args, "rope_scaling_factor", 8.0)), **MEGATRON_LLAMA3}
    if linear:
        return {"rope_type": "linear", "factor": float(linear)}
    return {"rope_type": "default"}


def _rope_args(hf: Mapping[str, Any]) -> dict[str, Any]:
    """Megatron's args for an HF config's RoPE scaling (of a model without multi-latent attention); a scaling
    megatron-core does not compute is a UcpError."""
    params = rope_scaling(hf)
    kind = params["rope_type"]
    if kind == "default":
        return {}
    if kind == "linear":
        return {"rotary_seq_len_interpolation_factor": params["factor"]}
    if kind == "llama3" and all(float(params.get(k, v)) == v for k, v in MEGATRON_LLAMA3.items()):
        return {"use_rope_scaling": True, "rope_scaling_factor": float(params["factor"])}
    raise UcpError(
        f"the model's RoPE scaling ({params}) is not one Megatron's GPT model computes (linear, or llama3 with "
        f"{MEGATRON_LLAMA3}): Megatron would compute another model"
    )


def sliding_windows(hf: Mapping[str, Any], layers: int) -> list[int | None]:
    """Each layer's sliding attention window as transformers computes it from an HF config (None: full attention),
    where a token attends to itself and the window - 1 before it: `layer_types` where the config has them (Qwen's),
    else every layer of a Mistral or Mixtral with a `sliding_window`. A Qwen config that turns the window on
    without saying its layers is a UcpError (transformers derives them per architecture)."""
    window = hf.get("sliding_window")
    types = hf.get("layer_types")
    if isinstance(types, list) and len(types) == layers:
        return [window if t == "sliding_attention" and window else None for t in types]
    if hf.get("model_type") in ("mistral", "mixtral"):
        return [window] * layers
    if hf.get("use_sliding_window") and window:
        raise UcpError(f"use_sliding_window with sliding_window {window} but no layer_types: say which layers slide")
    return [None] * layers


def _window_args(hf: Mapping[str, Any], layers: int) -> dict[str, Any]:
    """Megatron's args for the HF config's sliding windows (`sliding_windows`): megatron-core attends, with
    `window_size` (left, right), to the `left` tokens before and `right` after, so HF's window W is (W - 1, 0);
    `window_attn_skip_freq` (a list, 1 per window layer) where only some layers slide. Without them Megatron's model
    attends to every earlier token: another model past the window."""
    windows = sliding_windows(hf, layers)
    sizes = {w for w in windows if w is not None}
    if not sizes:
        return {}
    if len(sizes) > 1 or any(not isinstance(w, int) or isinstance(w, bool) or w < 1 for w in sizes):
        raise UcpError(f"the model's sliding windows ({windows}) are not one window Megatron's args can say")
    out: dict[str, Any] = {"window_size": (sizes.pop() - 1, 0)}
    if None in windows:
        out["window_attn_skip_freq"] = [0 if w is None else 1 for w in windows]
    return out


def _windows_from_args(args: Any, layers: int) -> list[int | None]:
    """Each layer's sliding window (as HF counts it) that a job's `window_size` / `window_attn_skip_freq` give it."""
    size = arg(args, "window_size")
    if not size:
        return [None] * layers
    left, right = (int(x) for x in size)  # (a ValueError if not two numbers: config_from_args says it in one line)
    if right != 0 or left < 0:
        raise UcpError(
            f"window_size={tuple(size)!r}: attention to later tokens or an unbounded window has no Hugging Face "
            "config in ucp's families"
        )
    skip = arg(args, "window_attn_skip_freq")
    if skip is None:
        return [left + 1] * layers
    if isinstance(skip, int) and skip > 0:  # (megatron-core: every skip-th layer, 1-indexed, attends fully)
        return [None if (i + 1) % skip == 0 else left + 1 for i in range(layers)]
    if not isinstance(skip, (list, tuple)) or len(skip) != layers:
        raise UcpError(f"window_attn_skip_freq={skip!r} is neither a positive number nor one entry per layer")
    return [left + 1 if flag else None for flag in skip]


def check_windows(args: Any, hf: Mapping[str, Any], where: str) -> None:
    """Refuse a job whose sliding-window attention (`window_size`) the model's HF config (the one ucp stored in its
    args, if any) does not say, on its way into a ucp checkpoint: its HF config is what every later export or
    Megatron conversion says the model is, so the window would be dropped and another model handed over. (Megatron
    to Megatron keeps the args as they are.)"""
    layers = required(args, "num_layers")
    try:
        ours = _windows_from_args(args, layers)
    except (TypeError, ValueError) as e:  # (not two numbers: a value of another type than Megatron writes)
        raise InteropError(f"{where}: window_size={arg(args, 'window_size')!r}: {type(e).__name__}: {e}") from None
    except UcpError as e:
        raise InteropError(f"{where}: {e}") from None
    if not any(ours):
        return
    try:
        theirs = sliding_windows(hf, layers)
    except UcpError:
        theirs = []
    if theirs != ours:
        raise InteropError(
            f"{where}: window_size={tuple(arg(args, 'window_size'))!r}: sliding-window attention (per layer {ours}) "
            "that no Hugging Face config here says; ucp carries a window only where the config.json ucp stored in the args "
            "(a Mistral's, Mixtral's or Qwen's) says the same"
        )


def rope_theta(hf: Mapping[str, Any]) -> float | None:
    """RoPE's base in an HF config, in either spelling."""
    params = hf.get("rope_parameters")
    if isinstance(params, dict) and params.get("rope_theta") is not None:
        return float(params["rope_theta"])
    return float(hf["rope_theta"]) if hf.get("rope_theta") is not None else None


def hf_fields_from_args(args: Any, where: str) -> dict[str, Any]:
    """The model's HF config fields as Megatron's args say them: the HF config a ucp export stored in the args, with
    what the args themselves set (RoPE base, norm epsilon, positions, router loss) over it."""
    hf: dict[str, Any] = {}
    stored = arg(args, HF_CONFIG_ARG)
    if stored is not None:
        try:
            hf = json.loads(stored)
        except (TypeError, ValueError):
            raise InteropError(f"{where}: args.{HF_CONFIG_ARG} is not JSON") from None
        if not isinstance(hf, dict):
            raise InteropError(f"{where}: args.{HF_CONFIG_ARG} is not a JSON object")
    base = float(arg(args, "rotary_base", 10000))  # (Megatron's default)
    scaling = None if latent_attention(args) else _rope_from_args(args, where)  # (MLA's: its family's)
    if scaling is not None:  # the args say what RoPE the model computes, whatever a stored config says
        hf.pop("rope_scaling", None)
        if scaling["rope_type"] != "default" or isinstance(hf.get("rope_parameters"), dict):
            hf.pop("rope_theta", None)
            hf["rope_parameters"] = {**scaling, "rope_theta": base}
        else:
            hf["rope_theta"] = base
    elif isinstance(hf.get("rope_parameters"), dict):
        hf["rope_parameters"] = {**hf["rope_parameters"], "rope_theta": base}
    else:
        hf["rope_theta"] = base
    for hf_name, name in _HF_ARGS.items():
        if arg(args, name) is not None:
            hf[hf_name] = arg(args, name)
    return hf


def args_for(
    config: FamilyConfig, layout: Layout, base: Any = None, hf: Mapping[str, Any] | None = None
) -> argparse.Namespace:
    """Megatron args for a target layout: the source's args with the parallel sizes replaced, or (from a ucp
    checkpoint) the model-shape arguments Megatron-LM checks on load, as the model's family names them."""
    if base is not None:
        out = argparse.Namespace(**vars(base))
    else:
        names = family_for(config).megatron
        if names is None:
            raise UcpError(f"a {family_for(config).name} model has no Megatron-LM arguments here")
        fields = hf or {}
        own = names.args(config, fields)
        out = argparse.Namespace(
            **gpt_args(config),
            **own,
            **({} if own.get("multi_latent_attention") else _rope_args(fields)),  # (MLA's RoPE: its family's)
            **_window_args(fields, config.num_hidden_layers),
            rotary_base=rope_theta(fields) or 10000,
            norm_epsilon=fields.get("rms_norm_eps", 1e-5),
            **{name: fields[h] for h, name in _HF_ARGS.items() if h != "rms_norm_eps" and h in fields},
        )
    if hf is not None:
        out.ucp_hf_config = json.dumps(hf, sort_keys=True)  # everything, for the way back (HF_CONFIG_ARG)
    m = config.make_vocab_size_divisible_by * layout.tp
    out.padded_vocab_size = -(-config.vocab_size // m) * m
    out.tensor_model_parallel_size = layout.tp
    out.pipeline_model_parallel_size = layout.pp
    out.virtual_pipeline_model_parallel_size = layout.vpp if layout.vpp > 1 else None
    out.expert_model_parallel_size = layout.ep
    for k, v in vars(out).items():
        if isinstance(v, ForeignEnum):
            setattr(out, k, real_enum(v))
    return out


DEFAULT_BUCKET_MIN = 40_000_000  # DistributedDataParallel's default bucket: max(40M, 1M x DP) elements


def bucket_size_of(args: Any) -> int | None:
    """DDP's bucket size as Megatron-LM's args set it (None: one bucket per buffer, without overlap_grad_reduce)."""
    if not arg(args, "overlap_grad_reduce", False) or arg(args, "overlap_param_gather_with_optimizer_step", False):
        return None
    size = arg(args, "ddp_bucket_size")
    return int(size) if size is not None else max(DEFAULT_BUCKET_MIN, 1_000_000 * arg(args, "data_parallel_size", 1))


def distributed_buffers(args: Any) -> DistributedBuffers:
    """The grad buffers of a distributed optimizer that Megatron-LM's args describe: (param dtype, grad dtype), bf16
    training accumulating and reducing gradients in fp32 unless told otherwise, and the bucket size."""
    param = "bfloat16" if arg(args, "bf16", False) else "float16" if arg(args, "fp16", False) else "float32"
    fp32_grads = arg(args, "accumulate_allreduce_grads_in_fp32", param == "bfloat16")
    return DistributedBuffers((param, "float32" if fp32_grads else param), bucket_size_of(args))


def mark_distributed(args: Any, buffers: DistributedBuffers) -> None:
    """Say in a target's args how its distributed optimizer's buffers were laid out (what `bucket_size_of` and
    `distributed_buffers` read back: bucketing, and the dtypes, which args made from a ucp checkpoint lack)."""
    args.use_distributed_optimizer = True
    args.overlap_grad_reduce = buffers.bucket_size is not None
    args.ddp_bucket_size = buffers.bucket_size
    param, grad = buffers.dtypes
    args.bf16, args.fp16 = param == "bfloat16", param == "float16"
    args.accumulate_allreduce_grads_in_fp32 = grad == "float32"


def args_json(args: Any) -> dict[str, Any]:
    """The args that JSON holds (enums by value, dtypes by name; what else they hold is left out)."""
    out = {}
    for k, v in vars(args).items():
        if isinstance(v, ForeignEnum):
            v = v.value
        if (
            v is None
            or isinstance(v, (bool, int, float, str))
            or (isinstance(v, list) and all(isinstance(x, (int, float, str)) for x in v))
        ):
            out[k] = v
        elif isinstance(v, torch.dtype):
            out[k] = str(v)
    return out


# Megatron-LM's arguments that give the pipeline's first or last stages other numbers of layers than the rest
UNEVEN_STAGE_ARGS = (
    "decoder_first_pipeline_num_layers",
    "decoder_last_pipeline_num_layers",
    "num_layers_in_first_pipeline_stage",
    "num_layers_in_last_pipeline_stage",
    "account_for_embedding_in_pipeline_split",
    "account_for_loss_in_pipeline_split",
    "pipeline_model_parallel_layout",
    "standalone_embedding_stage",
)


def check_even_stages(args: Any, where: str) -> None:
    """Refuse the files of a job whose pipeline stages hold different numbers of layers: ucp maps Megatron's
    stages as Megatron's default split does (layers evenly over PP x VPP model chunks)."""
    if arg(args, "pipeline_model_parallel_size", 1) == 1:
        return
    for name in UNEVEN_STAGE_ARGS:
        if arg(args, name, False):
            raise InteropError(
                f"{where}: {name}={getattr(args, name)!r}: the pipeline's stages hold different numbers of layers, "
                "and ucp maps Megatron's files by the even split only"
            )


def args_layout(args: Any) -> Layout:
    """The layout a Megatron checkpoint was saved in, from its args (one file per TP, PP and EP rank: DP = EP)."""
    tp, pp, vpp, ep = (
        arg(args, k, 1)
        for k in (
            "tensor_model_parallel_size",
            "pipeline_model_parallel_size",
            "virtual_pipeline_model_parallel_size",
            "expert_model_parallel_size",
        )
    )
    return Layout(tp=tp, pp=pp, vpp=vpp, ep=ep, dp=ep)
