"""Megatron-LM torch checkpoints (`iter_NNNNNNN/mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt`) through atoms.

A rank file's "model" dict is, name for name, the local state docs/LOCAL_STATE.md specifies (Megatron-Core GPT
naming: fused QKV per query group, gate/up in linear_fc1, padded vocabulary), so the file of (tp t, pp p, ep e)
is the local state of ucp rank (tp=t, dp=e, pp=p) in the layout tp{T}pp{P}ep{E}dp{E}: DP replicas other than the
expert ones are not saved by Megatron, and dp=E is the smallest DP that holds every expert rank.

Conversion never holds the model, nor a whole rank file: every target tensor is filled piece by piece from the
source tensors that hold the same atom box (`ucp.reshard.local_plan` gives both sides' boxes), each source
tensor read from its file only when needed (torch_file.TorchFile) and dropped after, and each target file is
written tensor by tensor (torch_file.save), a few files at a time within the memory budget. Files are untrusted
input: they are unpickled with torch's weights-only unpickler and an allowlist of the few non-tensor types
Megatron stores.

The optimizer's state reshards the same way: its per-parameter tensors are ucp local optimizer states, taken from
the rank file's numbered entries (megatron_optimizer.py) or, for the distributed optimizer, from views of the flat
buffers in distrib_optim.pt beside it (megatron_distrib_optim.py); the scheduler and the iteration are global and
go to every file; the RNG states are per rank and are carried only into the same layout.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import enum
import functools
import io
import json
import math
import pickle
import re
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from ucp import dtypes
from ucp.boxes import Box, intersect, relative, to_slices
from ucp.checkpoint import CheckpointReader, open_checkpoint
from ucp.errors import CheckpointNotFoundError, FormatError, LayoutError, UcpError
from ucp.families import (
    DeepseekV3Config,
    LlamaConfig,
    MixtralConfig,
    QwenMoeConfig,
    block_scales,
    buffer_atoms,
    canonical_atoms,
)
from ucp.format import AtomMeta
from ucp.interop import torch_file
from ucp.interop.dtypes import kept_param_dtypes, most_common
from ucp.interop.errors import InteropError, SourceMismatchError
from ucp.interop.megatron_dist import TORCH_DIST, open_torch_dist, write_torch_dist
from ucp.interop.megatron_distrib_optim import read_distributed, write_distributed
from ucp.interop.megatron_optimizer import (
    DistributedBuffers,
    LocalOptimState,
    OptimizerMeta,
    read_optimizer,
    write_optimizer,
)
from ucp.interop.staging import staged_dir
from ucp.interop.streaming import group_limit, save_atoms
from ucp.interop.torch_file import Deferred, TorchFile, TorchFiles
from ucp.layout import Layout
from ucp.reshard import LocalTensor, Piece, local_plan, local_tensor, owned_pieces, piece_view, put_local
from ucp.sharded_load import piece_reads
from ucp.sharded_model import AtomKey, ShardedModel, atom_path, check_atom, model_config_of
from ucp.workpool import pack

TRACKER = "latest_checkpointed_iteration.txt"
RANK_FILE = "model_optim_rng.pt"
DISTRIB_OPTIM_FILE = "distrib_optim.pt"  # the distributed optimizer's state, beside the rank file
CHECKPOINT_VERSION = 3.0
UNIVERSAL = "universal"
# Megatron-Core linear layers carry an `_extra_state` entry (None with the local spec, FP8 metadata with TE);
# a strict load_state_dict needs it present.
EXTRA_STATE_OWNERS = (
    "self_attention.linear_qkv",
    "self_attention.linear_proj",
    *(f"self_attention.linear_{x}" for x in ("q_proj", "q_down_proj", "q_up_proj", "kv_down_proj", "kv_up_proj")),
    "linear_fc1",
    "linear_fc2",
    "output_layer",
)

# ------------------------------------------------------------------------------------------- safe loading


@dataclass(frozen=True)
class ForeignEnum:
    """An enum member from Megatron's args (e.g. AttnBackend.auto), kept by qualified name and value so that
    loading never imports Megatron."""

    qualname: str
    value: Any


def _foreign_enum(qualname: str) -> Callable[[Any], ForeignEnum]:
    def make(value: Any) -> ForeignEnum:
        return ForeignEnum(qualname, value)

    return make


_ENUMS = (
    "megatron.core.transformer.enums.AttnBackend",
    "megatron.core.enums.ModelType",
    "megatron.core.transformer.enums.AttnMaskType",
)


def _allowlist() -> list[Any]:
    """The only globals a rank file may name: argparse.Namespace (args), BytesIO (TE extra state), NumPy's
    array reconstruction (the NumPy RNG state) and a few Megatron enums, rebuilt as ForeignEnum."""
    import numpy as np

    try:
        from numpy._core.multiarray import _reconstruct
    except ImportError:  # numpy < 2
        from numpy.core.multiarray import _reconstruct  # type: ignore[no-redef]
    allowed: list[Any] = [
        argparse.Namespace,
        io.BytesIO,
        (_reconstruct, "numpy.core.multiarray._reconstruct"),
        _reconstruct,
        np.ndarray,
        np.dtype,
        type(np.dtype(np.uint32)),
        type(np.dtype(np.float64)),
    ]
    allowed += [(_foreign_enum(q), q) for q in _ENUMS]
    return allowed


def _is_chunk(key: Any) -> bool:
    """A model chunk's entry of a rank file: "model", or "model0", "model1", ... with virtual pipelining."""
    return isinstance(key, str) and (key == "model" or re.fullmatch(r"model\d+", key) is not None)


def _per_element(path: tuple[Any, ...], t: torch.Tensor) -> bool:
    """Whether a tensor at `path` of a rank file is per-element state (weights, optimizer states, master weights),
    whose size grows with the model; everything else (0-d steps, grad scaler, RNG states) is small."""
    return _is_chunk(path[0]) or (path[0] == "optimizer" and t.dim() > 0 and "grad_scaler" not in path)


def _resolve(
    tree: Any, file: TorchFile, lazy: Callable[[tuple[Any, ...], torch.Tensor], bool], path: tuple[Any, ...] = ()
) -> Any:
    """`tree` with every meta tensor that `lazy` does not keep read from `file`."""
    if isinstance(tree, torch.Tensor):
        return file.read(tree) if tree.device.type == "meta" and not lazy(path, tree) else tree
    if isinstance(tree, dict):
        return type(tree)((k, _resolve(v, file, lazy, (*path, k))) for k, v in tree.items())
    if isinstance(tree, (list, tuple)) and type(tree) in (list, tuple):
        return type(tree)(_resolve(v, file, lazy, (*path, i)) for i, v in enumerate(tree))
    return tree


def open_torch_file(
    path: Path, lazy: Callable[[tuple[Any, ...], torch.Tensor], bool] = _per_element
) -> tuple[Any, TorchFile]:
    """Unpickle a torch.save file of Megatron's with weights_only=True (nothing outside the allowlist is executed).
    The tensors `lazy` picks (by default the per-element ones) stay meta tensors, read on demand with
    `TorchFile.read`; the rest is read now."""
    try:
        with torch.serialization.safe_globals(_allowlist()):
            file = TorchFile(path)
        data = _resolve(file.obj, file, lazy) if isinstance(file.obj, (dict, list)) else file.obj
    except pickle.UnpicklingError as e:
        first = str(e).strip().splitlines()
        unsupported = next((line for line in first if "Unsupported global" in line), first[0] if first else "")
        raise InteropError(
            f"{path}: refused to unpickle a type outside the allowlist ({unsupported.strip()})"
        ) from None
    except (RuntimeError, EOFError, OSError, ValueError) as e:
        raise InteropError(f"{path} is not a readable torch checkpoint: {e}") from None
    return data, file


def open_rank_file(path: Path) -> tuple[dict[str, Any], TorchFile]:
    """One rank file (`open_torch_file`), checked to hold a model state dict."""
    data, file = open_torch_file(path)
    if not isinstance(data, dict) or not any(_is_chunk(k) for k in data):
        raise InteropError(
            f"{path} holds no 'model' state dict (keys: {sorted(data) if isinstance(data, dict) else type(data).__name__})"
        )
    return data, file


def load_rank_file(path: Path) -> dict[str, Any]:
    """One rank file read whole, like torch.load(weights_only=True) with the allowlist."""
    data, file = open_rank_file(path)
    return _resolve(data, file, lambda _path, _t: False)


# ------------------------------------------------------------------------------------------- layouts


_MEGATRON_LAYOUT = re.compile(r"tp(\d+)(?:pp(\d+))?(?:vpp(\d+))?(?:ep(\d+))?")


def parse_megatron_layout(text: str) -> Layout:
    """tp{T}[pp{P}][vpp{V}][ep{E}]: what a Megatron torch checkpoint's files are split by (DP is not saved)."""
    m = _MEGATRON_LAYOUT.fullmatch(text.strip().lower())
    if m is None:
        raise LayoutError(
            f"malformed Megatron layout {text!r}: expected tp{{T}}[pp{{P}}][vpp{{V}}][ep{{E}}] (e.g. tp4pp8, tp2ep4) or 'universal'"
        )
    tp, pp, vpp, ep = (int(g) if g else 1 for g in m.groups())
    return Layout(tp=tp, pp=pp, vpp=vpp, ep=ep, dp=ep)


def args_layout(args: Any) -> Layout:
    """The layout a Megatron checkpoint was saved in, from its args (one file per TP, PP and EP rank: DP = EP)."""
    tp, pp, vpp, ep = (
        _arg(args, k, 1)
        for k in (
            "tensor_model_parallel_size",
            "pipeline_model_parallel_size",
            "virtual_pipeline_model_parallel_size",
            "expert_model_parallel_size",
        )
    )
    return Layout(tp=tp, pp=pp, vpp=vpp, ep=ep, dp=ep)


def megatron_name(layout: Layout) -> str:
    return (
        f"tp{layout.tp}pp{layout.pp}"
        + (f"vpp{layout.vpp}" if layout.vpp > 1 else "")
        + (f"ep{layout.ep}" if layout.ep > 1 else "")
    )


def rank_dirname(layout: Layout, tp: int, pp: int, ep: int) -> str:
    """Megatron's get_checkpoint_name: _PPP only when pp > 1, _EEE only with expert parallelism."""
    name = f"mp_rank_{tp:02d}"
    if layout.pp > 1:
        name += f"_{pp:03d}"
    if layout.ep > 1:
        name += f"_{ep:03d}"
    return name


def rank_files(layout: Layout) -> dict[str, int]:
    """Rank directory name -> ucp rank (tp=t, dp=e, pp=p) for every file of a layout."""
    return {
        rank_dirname(layout, t, p, e): layout.rank(t, e, p)
        for p in range(layout.pp)
        for e in range(layout.ep)
        for t in range(layout.tp)
    }


# ------------------------------------------------------------------------------------------- config


def _arg(args: Any, name: str, default: Any = None) -> Any:
    value = getattr(args, name, default)
    return default if value is None else value


def config_from_args(args: Any, where: str, vocab_size: int | None = None) -> tuple[Any, dict[str, Any]]:
    """The family config from Megatron's args (a MoE GPT model: Mixtral, or the Qwen MoE family when it has q/k
    norms, q/k/v biases or a shared expert; a dense one: the Llama family, with q/k/v biases and q/k norms as the
    args say), and the HF fields the config does not model (rope base, norm eps, ...)."""
    if args is None:
        raise InteropError(f"{where} has no 'args': cannot tell the model's shape")
    experts = _arg(args, "num_experts", 0)
    qk_norm = bool(_arg(args, "qk_layernorm", False))
    qkv_bias = bool(_arg(args, "add_qkv_bias", False))
    shared = _arg(args, "moe_shared_expert_intermediate_size") or 0
    mla = bool(_arg(args, "multi_latent_attention", False))
    qwen = experts and not mla and (qk_norm or qkv_bias or shared)
    family = "DeepSeek-V3" if mla else ("Qwen MoE" if qwen else "Mixtral") if experts else "Llama"
    if mla and not experts:
        raise InteropError(f"{where}: multi-latent attention without experts has no {family} atoms here")
    if shared and not mla and not _arg(args, "moe_shared_expert_gate", False):
        raise InteropError(f"{where}: a shared expert without its gate (moe_shared_expert_gate) has no {family} atom")
    if not _arg(args, "swiglu", False):
        raise InteropError(
            f"{where}: args.swiglu is off; ucp's {family} family is SwiGLU (gate/up fused in linear_fc1)"
        )
    if _arg(args, "add_bias_linear", False):
        raise InteropError(f"{where}: linear biases (add_bias_linear) have no {family} atom")
    if _arg(args, "normalization", "RMSNorm") != "RMSNorm":
        raise InteropError(f"{where}: normalization={args.normalization!r}; ucp's {family} family uses RMSNorm")
    heads = args.num_attention_heads
    groups = _arg(args, "num_query_groups", heads) if _arg(args, "group_query_attention", False) else heads
    vocab = vocab_size or _arg(args, "vocab_size") or _arg(args, "padded_vocab_size")
    if vocab is None:
        raise InteropError(f"{where}: args has neither vocab_size nor padded_vocab_size")
    shape = {
        "vocab_size": int(vocab),
        "hidden_size": args.hidden_size,
        "num_hidden_layers": args.num_layers,
        "num_attention_heads": heads,
        "num_key_value_heads": groups,
        "head_dim": _arg(args, "kv_channels") or args.hidden_size // heads,
        "tie_word_embeddings": not _arg(args, "untie_embeddings_and_output_weights", False),
        "make_vocab_size_divisible_by": _arg(args, "make_vocab_size_divisible_by", 128),
    }
    if mla:
        config: Any = _deepseek_config_from_args(args, where, shape)
    elif qwen:
        config = QwenMoeConfig(
            moe_intermediate_size=_arg(args, "moe_ffn_hidden_size") or args.ffn_hidden_size,
            intermediate_size=args.ffn_hidden_size,
            shared_expert_intermediate_size=shared,
            num_local_experts=experts,
            num_experts_per_tok=_arg(args, "moe_router_topk", 2),
            attention_bias=qkv_bias,
            qk_norm=qk_norm,
            **shape,
        )
    elif experts:
        config = MixtralConfig(
            intermediate_size=_arg(args, "moe_ffn_hidden_size") or args.ffn_hidden_size,
            num_local_experts=experts,
            num_experts_per_tok=_arg(args, "moe_router_topk", 2),
            **shape,
        )
    else:
        config = LlamaConfig(
            intermediate_size=args.ffn_hidden_size,
            attention_bias=bool(_arg(args, "add_qkv_bias", False)),
            qk_norm=bool(_arg(args, "qk_layernorm", False)),
            **shape,
        )
    hf = hf_fields_from_args(args, where)
    if isinstance(config, DeepseekV3Config):
        hf.update({h: _arg(args, m) for h, m in _DEEPSEEK_ROUTER_ARGS.items() if _arg(args, m) is not None})
        if _arg(args, "rope_type") == "yarn":
            rope = hf.pop("rope_parameters", None) or {}
            rope.update(rope_type="yarn", rope_theta=hf.pop("rope_theta", rope.get("rope_theta")))
            rope.update({h: _arg(args, m) for h, m in _YARN_ARGS.items() if _arg(args, m) is not None})
            hf["rope_parameters"] = rope
    if isinstance(config, QwenMoeConfig) and "norm_topk_prob" not in hf:
        # Megatron's router: softmax over the top-k scores (= HF's renormalised top-k), or with pre-softmax over all
        hf["norm_topk_prob"] = not _arg(args, "moe_router_pre_softmax", False)
    return config, hf


# DeepSeek-V3's router settings: HF name -> Megatron's (sigmoid scores, grouped top-k, the scaling of the weights)
_DEEPSEEK_ROUTER_ARGS = {
    "n_group": "moe_router_num_groups",
    "topk_group": "moe_router_group_topk",
    "routed_scaling_factor": "moe_router_topk_scaling_factor",
}
# YaRN's RoPE settings (DeepSeek-V3's): HF's rope_parameters field -> Megatron's MLA arg
_YARN_ARGS = {
    "factor": "rotary_scaling_factor",
    "original_max_position_embeddings": "original_max_position_embeddings",
    "beta_fast": "beta_fast",
    "beta_slow": "beta_slow",
    "mscale": "mscale",
    "mscale_all_dim": "mscale_all_dim",
}


def _deepseek_config_from_args(args: Any, where: str, shape: dict[str, Any]) -> DeepseekV3Config:
    """DeepSeek-V3's config from Megatron's MLA MoE args: its MoE layers must be the last ones (moe_layer_freq
    [0]*k + [1]*(n-k), or 1), its router sigmoid with the expert bias (the atom of HF's correction bias)."""
    layers = shape["num_hidden_layers"]
    freq = _arg(args, "moe_layer_freq", 1)
    pattern = [1] * layers if freq == 1 else list(freq) if isinstance(freq, (list, tuple)) else None
    k = next((i for i, x in enumerate(pattern or []) if x), layers)
    if pattern is None or len(pattern) != layers or any(x != (i >= k) for i, x in enumerate(pattern)):
        raise InteropError(
            f"{where}: moe_layer_freq={freq!r}; ucp's DeepSeek-V3 family has dense layers first, then MoE layers only"
        )
    if not _arg(args, "moe_router_enable_expert_bias", False):
        raise InteropError(
            f"{where}: moe_router_enable_expert_bias is off; ucp's DeepSeek-V3 family holds the router's expert bias "
            "(HF's e_score_correction_bias)"
        )
    ffn = _arg(args, "moe_ffn_hidden_size") or args.ffn_hidden_size
    shared = _arg(args, "moe_shared_expert_intermediate_size") or 0
    if shared % ffn:
        raise InteropError(f"{where}: moe_shared_expert_intermediate_size={shared} is not a multiple of {ffn}")
    return DeepseekV3Config(
        intermediate_size=args.ffn_hidden_size,
        moe_intermediate_size=ffn,
        num_local_experts=args.num_experts,
        num_experts_per_tok=_arg(args, "moe_router_topk", 2),
        n_shared_experts=shared // ffn,
        first_k_dense_replace=k,
        q_lora_rank=_arg(args, "q_lora_rank"),
        kv_lora_rank=args.kv_lora_rank,
        qk_nope_head_dim=args.qk_head_dim,
        qk_rope_head_dim=args.qk_pos_emb_head_dim,
        v_head_dim=args.v_head_dim,
        **{k: v for k, v in shape.items() if k != "head_dim"},
    )


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
    stored = _arg(args, HF_CONFIG_ARG)
    if stored is not None:
        try:
            hf = json.loads(stored)
        except (TypeError, ValueError):
            raise InteropError(f"{where}: args.{HF_CONFIG_ARG} is not JSON") from None
        if not isinstance(hf, dict):
            raise InteropError(f"{where}: args.{HF_CONFIG_ARG} is not a JSON object")
    base = float(_arg(args, "rotary_base", 10000))  # (Megatron's default)
    if isinstance(hf.get("rope_parameters"), dict):
        hf["rope_parameters"] = {**hf["rope_parameters"], "rope_theta": base}
    else:
        hf["rope_theta"] = base
    for hf_name, name in _HF_ARGS.items():
        if _arg(args, name) is not None:
            hf[hf_name] = _arg(args, name)
    return hf


def args_for(config: Any, layout: Layout, base: Any = None, hf: Mapping[str, Any] | None = None) -> argparse.Namespace:
    """Megatron args for a target layout: the source's args with the parallel sizes replaced, or (from a ucp
    checkpoint) the model-shape arguments Megatron-LM checks on load."""
    family_args: dict[str, Any]
    if isinstance(config, DeepseekV3Config):
        family_args = {
            "multi_latent_attention": True,
            "q_lora_rank": config.q_lora_rank,
            "kv_lora_rank": config.kv_lora_rank,
            "qk_head_dim": config.qk_nope_head_dim,
            "qk_pos_emb_head_dim": config.qk_rope_head_dim,
            "v_head_dim": config.v_head_dim,
            "moe_ffn_hidden_size": config.moe_intermediate_size,
            "num_experts": config.num_local_experts,
            "moe_router_topk": config.num_experts_per_tok,
            "moe_shared_expert_intermediate_size": config.moe_intermediate_size * config.n_shared_experts,
            "moe_layer_freq": [0] * config.first_k_dense_replace
            + [1] * (config.num_hidden_layers - config.first_k_dense_replace),
            "moe_router_enable_expert_bias": True,
            "moe_router_score_function": "sigmoid",
            **{m: (hf or {})[h] for h, m in _DEEPSEEK_ROUTER_ARGS.items() if h in (hf or {})},
        }
        rope = (hf or {}).get("rope_parameters") or {}
        if rope.get("rope_type") == "yarn":
            family_args.update(rope_type="yarn", **{m: rope[h] for h, m in _YARN_ARGS.items() if h in rope})
    elif isinstance(config, QwenMoeConfig):
        family_args = {
            "moe_ffn_hidden_size": config.moe_intermediate_size,
            "num_experts": config.num_local_experts,
            "moe_router_topk": config.num_experts_per_tok,
            "add_qkv_bias": config.attention_bias,
            "qk_layernorm": config.qk_norm,
            "moe_shared_expert_intermediate_size": config.shared_expert_intermediate_size or None,
            "moe_shared_expert_gate": config.shared_expert_intermediate_size > 0,
            # HF's top-k weights renormalised = Megatron's softmax over the top-k; not renormalised = pre-softmax
            "moe_router_pre_softmax": not (hf or {}).get("norm_topk_prob", config.qk_norm),
        }
    elif isinstance(config, MixtralConfig):
        family_args = {
            "moe_ffn_hidden_size": config.intermediate_size,
            "num_experts": config.num_local_experts,
            "moe_router_topk": config.num_experts_per_tok,
        }
    else:
        family_args = {"num_experts": None, "add_qkv_bias": config.attention_bias, "qk_layernorm": config.qk_norm}
    ffn = config.intermediate_size if config.intermediate_size is not None else config.moe_intermediate_size
    out = (
        argparse.Namespace(**vars(base))
        if base is not None
        else argparse.Namespace(
            num_layers=config.num_hidden_layers,
            hidden_size=config.hidden_size,
            ffn_hidden_size=ffn,
            num_attention_heads=config.num_attention_heads,
            group_query_attention=config.num_key_value_heads != config.num_attention_heads,
            num_query_groups=config.num_key_value_heads,
            kv_channels=config.head_dim,
            **family_args,
            swiglu=True,
            add_bias_linear=False,
            normalization="RMSNorm",
            position_embedding_type="rope",
            untie_embeddings_and_output_weights=not config.tie_word_embeddings,
            vocab_size=config.vocab_size,
            make_vocab_size_divisible_by=config.make_vocab_size_divisible_by,
            rotary_base=rope_theta(hf or {}) or 10000,
            norm_epsilon=(hf or {}).get("rms_norm_eps", 1e-5),
            **{
                name: (hf or {})[hf_name]
                for hf_name, name in _HF_ARGS.items()
                if hf_name != "rms_norm_eps" and hf_name in (hf or {})
            },
        )
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
            setattr(out, k, _real_enum(v))
    return out


DEFAULT_BUCKET_MIN = 40_000_000  # DistributedDataParallel's default bucket: max(40M, 1M x DP) elements


def bucket_size_of(args: Any) -> int | None:
    """DDP's bucket size as Megatron-LM's args set it (None: one bucket per buffer, without overlap_grad_reduce)."""
    if not _arg(args, "overlap_grad_reduce", False) or _arg(args, "overlap_param_gather_with_optimizer_step", False):
        return None
    size = _arg(args, "ddp_bucket_size")
    return int(size) if size is not None else max(DEFAULT_BUCKET_MIN, 1_000_000 * _arg(args, "data_parallel_size", 1))


def distributed_buffers(args: Any) -> DistributedBuffers:
    """The grad buffers of a distributed optimizer that Megatron-LM's args describe: (param dtype, grad dtype), bf16
    training accumulating and reducing gradients in fp32 unless told otherwise, and the bucket size."""
    param = "bfloat16" if _arg(args, "bf16", False) else "float16" if _arg(args, "fp16", False) else "float32"
    fp32_grads = _arg(args, "accumulate_allreduce_grads_in_fp32", param == "bfloat16")
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


def _real_enum(e: ForeignEnum) -> Any:
    """Give Megatron its enum back when it is importable (already imported); else the plain value."""
    module, _, name = e.qualname.rpartition(".")
    cls = getattr(sys.modules.get(module), name, None)
    return cls(e.value) if isinstance(cls, type) and issubclass(cls, enum.Enum) else e.value


# ------------------------------------------------------------------------------------------- source


class TensorFile(Protocol):
    """Where a source's meta tensors are read from: a rank file (TorchFile), or a torch_dist checkpoint."""

    def read(self, t: torch.Tensor) -> torch.Tensor: ...


@dataclass
class MegatronSource:
    """A Megatron torch checkpoint opened for reading: layout, model config, and the rank files, whose per-element
    tensors are meta tensors until `read` fetches them (so no file is ever wholly in memory)."""

    root: Path
    iteration: int
    layout: Layout
    config: Any  # the family config
    args: Any
    hf: dict[str, Any]
    files: dict[int, dict[str, Any]]  # ucp rank -> unpickled rank file (per-element tensors on the meta device)
    paths: dict[int, Path]
    readers: dict[int, TensorFile]
    optimizer: OptimizerMeta | None = None  # None: the files hold no optimizer state
    optim_state: dict[int, LocalOptimState] = field(default_factory=dict)  # ucp rank -> its local optimizer state
    not_carried: tuple[str, ...] = ()  # what the source holds that no conversion carries (named in reports)

    @property
    def states(self) -> tuple[str, ...]:
        """The per-parameter optimizer states the files hold (ucp names), () without optimizer."""
        return self.optimizer.states if self.optimizer is not None else ()

    @property
    def scheduler(self) -> Any:
        """Megatron's opt_param_scheduler state (global: every rank saves the same), or None."""
        return self.files[0].get("opt_param_scheduler")

    def local_state(self, rank: int) -> dict[str, Any]:
        """The ucp local state of a rank: its model chunk dicts without Megatron's _extra_state entries, and its
        optimizer state when the files hold one."""
        data = self.files[rank]
        local: dict[str, Any] = {
            k: {n: t for n, t in data[k].items() if not n.endswith("._extra_state")} for k in data if _is_chunk(k)
        }
        if self.optimizer is not None:
            local["optimizer"] = {"state": self.optim_state[rank]}
        return local

    def read(self, rank: int, key: tuple[str, ...]) -> torch.Tensor:
        """The values of a rank's local tensor (a LocalTensor key), read from its file."""
        tree = {"optimizer": {"state": self.optim_state.get(rank, {})}} if key[0] == "optimizer" else self.files[rank]
        return self.readers[rank].read(local_tensor(tree, key))


_ITERATION_DIR = re.compile(r"iter_(\d+)")


def iteration_dir(root: Path, iteration: int | None) -> tuple[int, Path]:
    """(the iteration, its directory) of a Megatron-LM save root (the tracker names the latest, `iteration` another),
    or of an iteration directory given itself (`iter_NNNNNNN`, `release`), as users point at one."""
    named = _ITERATION_DIR.fullmatch(root.name)
    if (named or root.name == "release") and root.is_dir() and not (root / TRACKER).is_file():
        it = int(named[1]) if named else 0
        if iteration is not None and iteration != it:
            raise InteropError(f"--iteration {iteration}, but {root} is the directory of iteration {it}")
        return it, root
    if iteration is None:
        tracker = root / TRACKER
        if not tracker.is_file():
            raise InteropError(
                f"{root} is not a Megatron checkpoint directory (no {TRACKER}, and not an iter_NNNNNNN directory)"
            )
        text = tracker.read_text().strip()
        if text == "release":
            return 0, root / "release"
        try:
            iteration = int(text)
        except ValueError:
            raise InteropError(f"{tracker} holds {text!r}, not an iteration number") from None
    return iteration, root / f"iter_{iteration:07d}"


def _guess_layout(names: set[str], args: Any) -> str:
    return f"args say {megatron_name(args_layout(args))}; {len(names)} rank directories"


def open_megatron(
    src: str | Path, layout: str | Layout, *, iteration: int | None = None, vocab_size: int | None = None
) -> MegatronSource:
    """Open a Megatron torch checkpoint that `layout` (e.g. "tp2pp2ep2") must describe exactly."""
    root = Path(src)
    if (root / "zarr.json").is_file():
        raise SourceMismatchError(f"{root} is a ucp checkpoint, not a Megatron one: use --from universal")
    want = layout if isinstance(layout, Layout) else parse_megatron_layout(layout)
    asked = layout if isinstance(layout, str) else megatron_name(want)  # (named as the user wrote it)
    it, iter_dir = iteration_dir(root, iteration)
    if not iter_dir.is_dir():
        raise InteropError(f"{iter_dir} does not exist (iteration {it} of {root})")
    if (iter_dir / "metadata.json").is_file():
        raise SourceMismatchError(
            f"{iter_dir} is in Megatron's torch_dist format (it has metadata.json): use --from torch_dist"
        )
    present = {d.name for d in iter_dir.iterdir() if d.name.startswith("mp_rank_")}
    expected = rank_files(want)
    if not present:
        raise InteropError(f"{iter_dir} holds no mp_rank_* directories")
    # --from is checked against the files' own args before anything else, then against the directory names
    probe = iter_dir / min(present) / RANK_FILE
    if not probe.is_file():
        raise InteropError(f"missing rank file {probe}")
    first, first_reader = open_rank_file(probe)
    args = first.get("args")
    saved = args_layout(args) if args is not None else None
    if saved is not None and saved != want:
        raise SourceMismatchError(f"--from {asked} does not match {root}: its args say {megatron_name(saved)}")
    stray = sorted(present - set(expected))
    if stray:
        raise SourceMismatchError(
            f"--from {asked} does not match {iter_dir}: unexpected rank directories "
            f"{stray[:4]} ({_guess_layout(present, args)})"
        )
    missing = sorted(set(expected) - present) + sorted(n for n in present if not (iter_dir / n / RANK_FILE).is_file())
    if missing:
        raise InteropError(
            f"{iter_dir} is incomplete: missing rank file(s) {[f'{n}/{RANK_FILE}' for n in missing[:4]]}"
            f"{' ...' if len(missing) > 4 else ''} of the {len(expected)} that {asked} has"
        )
    config, hf = config_from_args(args, str(probe), vocab_size)
    paths = {rank: iter_dir / name / RANK_FILE for name, rank in expected.items()}
    opened = {rank: ((first, first_reader) if path == probe else open_rank_file(path)) for rank, path in paths.items()}
    distrib = _open_distrib_optim(paths)
    extra_files = [f for _, f in distrib.values()]
    source = MegatronSource(
        root,
        it,
        want,
        config,
        args,
        hf,
        {r: d for r, (d, _) in opened.items()},
        paths,
        {r: TorchFiles([f, *extra_files]) if extra_files else f for r, (_, f) in opened.items()},
    )
    _check_shapes(source)
    _read_optimizer(source, {r: (data, str(f.path)) for r, (data, f) in distrib.items()})
    return source


def _open_distrib_optim(paths: dict[int, Path]) -> dict[int, tuple[Any, TorchFile]]:
    """Every rank directory's distrib_optim.pt (a distributed optimizer's state; all directories have one, or
    none), its flat tensors left on disk until read."""
    found = {rank: p.parent / DISTRIB_OPTIM_FILE for rank, p in paths.items()}
    present = {rank for rank, p in found.items() if p.exists()}
    if present and present != set(found):
        missing = found[min(set(found) - present)]
        raise InteropError(f"{missing} is missing, but other rank directories have a {DISTRIB_OPTIM_FILE}")
    return {rank: open_torch_file(found[rank], lazy=lambda _path, t: t.dim() > 0) for rank in sorted(present)}


def _read_optimizer(source: MegatronSource, distrib: dict[int, tuple[Any, str]]) -> None:
    """Map every rank's "optimizer" entry (and with a distributed optimizer, the distrib_optim.pt files: `distrib`,
    ucp rank -> content and path) to ucp local optimizer state (all ranks have one, or none)."""
    has = {rank for rank, f in source.files.items() if f.get("optimizer") is not None}
    if not has:
        if distrib:
            raise InteropError(
                f"{source.paths[min(source.files)]} has no 'optimizer' entry beside its {DISTRIB_OPTIM_FILE}"
            )
        return
    if len(has) != len(source.files):
        lacking = source.paths[min(set(source.files) - has)]
        raise InteropError(f"{lacking} has no 'optimizer' entry, but other rank files have one")
    bucket_size = bucket_size_of(source.args)
    for rank in sorted(source.files):
        entry, where = source.files[rank]["optimizer"], str(source.paths[rank])
        if distrib:
            state, meta = read_distributed(entry, distrib, source.config, source.layout, rank, bucket_size, where)
        else:
            state, meta = read_optimizer(entry, source.config, source.layout, rank, where)
        source.optim_state[rank] = state
        source.optimizer = meta if source.optimizer is None else source.optimizer.merge(meta, str(source.paths[rank]))


def _check_shapes(source: MegatronSource) -> None:
    """Every rank holds exactly the tensors (names and shapes) the layout and the args imply."""
    for rank, path in source.paths.items():
        local = source.local_state(rank)
        plan = local_plan(source.config, source.layout, rank, ())
        names = {lt.key for lt in plan}
        for lt in plan:
            chunk, name = lt.key
            t = local.get(chunk, {}).get(name)
            if t is None:
                raise InteropError(f"{path}: missing tensor {chunk}/{name}")
            if tuple(t.shape) != lt.shape:
                raise InteropError(
                    f"{path}: {chunk}/{name} has shape {list(t.shape)}, but the other ranks and the args "
                    f"imply {list(lt.shape)} for {megatron_name(source.layout)}"
                )
        extra = sorted(f"{c}/{n}" for c, tensors in local.items() for n in tensors if (c, n) not in names)
        if extra:
            raise InteropError(f"{path}: tensors ucp cannot map to {type(source.config).__name__} atoms: {extra[:4]}")


# ------------------------------------------------------------------------------------------- filling targets


@dataclass(frozen=True)
class _Region:
    """Where a source file holds part of an atom: the atom box, and the piece of which rank's local tensor."""

    box: Box
    rank: int
    key: tuple[str, ...]  # LocalTensor key in the rank's local state
    piece: Piece


SourceCache = dict[tuple[int, tuple[str, ...]], torch.Tensor]  # (rank, key) -> source tensor read from its file


@dataclass
class _PieceIndex:
    """For each (atom, state), the source regions holding it. Filling reads the source tensors it needs from
    their files into a cache the caller drops when done (one target tensor, or one group of atoms)."""

    source: MegatronSource
    regions: dict[tuple[str, str | None], list[_Region]] = field(default_factory=dict)

    @classmethod
    def of(cls, source: MegatronSource) -> _PieceIndex:
        index = cls(source)
        for rank in source.files:
            for lt in owned_pieces(source.config, source.layout, rank, source.states):  # every element exactly once
                for p in lt.pieces:
                    index.regions.setdefault((p.atom, lt.state), []).append(_Region(p.atom_box, rank, lt.key, p))
        return index

    def fill_box(self, atom: str, state: str | None, box: Box, dst: torch.Tensor, cache: SourceCache) -> None:
        """Copy the elements of `box` of an atom (state) into `dst`, shaped like the box."""
        for region in self.regions[(atom, state)]:
            part = intersect(region.box, box)
            if part is None:
                continue
            at = (region.rank, region.key)
            if at not in cache:
                cache[at] = self.source.read(*at)
            view = piece_view(cache[at], region.piece)
            dst[to_slices(relative(part, box))] = view[to_slices(relative(part, region.box))]

    def local(self, lt: LocalTensor, dtype: torch.dtype) -> torch.Tensor:
        """A target rank's local tensor, read from the source files (padding zero)."""
        out = torch.zeros(lt.shape, dtype=dtype)
        cache: SourceCache = {}
        for p in lt.pieces:
            self.fill_box(p.atom, lt.state, p.atom_box, piece_view(out, p), cache)
        return out

    def atom(
        self, atom: str, state: str | None, shape: tuple[int, ...], dtype: torch.dtype, cache: SourceCache
    ) -> torch.Tensor:
        """A whole atom (or one optimizer state of it), read from the source files."""
        out = torch.empty(shape, dtype=dtype)
        self.fill_box(atom, state, tuple((0, n) for n in shape), out, cache)
        return out


def _with_extra_state(chunk: dict[str, torch.Tensor]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, t in chunk.items():
        out[name] = t
        owner = name.removesuffix(".weight")
        if name.endswith(".weight") and owner.endswith(EXTRA_STATE_OWNERS):
            out[owner + "._extra_state"] = None
    return out


@dataclass
class _TargetFiles:
    """What the rank files of a target layout hold besides each rank's local tensors."""

    config: Any  # the family config
    layout: Layout
    args: argparse.Namespace
    iteration: int
    optimizer: OptimizerMeta | None = None
    scheduler: Any = None  # opt_param_scheduler: global, the same in every file
    rng: dict[str, Any] | None = None  # rank directory -> rng_state: only when the layout is the source's own
    format: str = "torch"  # or "torch_dist" (megatron_dist.TORCH_DIST: layout tp1pp1)
    expert_parallel: bool = False  # torch_dist: the optimizer entry is for a job with EP > 1 (megatron_dist)
    # torch_dist: the layout whose grad buffers the optimizer is written in (dp_reshardable); None: fully_reshardable
    optimizer_layout: Layout | None = None

    def __post_init__(self) -> None:
        if self.optimizer is not None and self.optimizer.distributed is not None:
            mark_distributed(self.args, self.optimizer.distributed)
            if self.format == TORCH_DIST:
                self.args.dist_ckpt_optim_fully_reshardable = self.optimizer_layout is None

    @property
    def states(self) -> tuple[str, ...]:
        return self.optimizer.states if self.optimizer is not None else ()

    def content(self, name: str, rank: int, local: dict[str, Any], optimizer: Any = None) -> dict[str, Any]:
        """A rank file; `optimizer`: its "optimizer" entry (`optimizer_files`), when the target has one."""
        data: dict[str, Any] = {
            "args": self.args,
            "checkpoint_version": CHECKPOINT_VERSION,
            "iteration": self.iteration,
        }
        data.update({k: _with_extra_state(v) for k, v in local.items() if k != "optimizer"})
        if self.optimizer is not None:
            data["optimizer"] = optimizer
        if self.scheduler is not None:
            data["opt_param_scheduler"] = self.scheduler
        if self.rng is not None:
            data["rng_state"] = self.rng[name]
        return data

    def optimizer_files(self, rank: int, local: dict[str, Any]) -> tuple[Any, Any]:
        """(the rank file's "optimizer" entry, the content of the rank directory's distrib_optim.pt): None where the
        target has no optimizer, or no distributed one, or none of whose optimizers' data-parallel rank 0 is here."""
        if self.optimizer is None:
            return None, None
        state = local.get("optimizer", {}).get("state", {})  # none before the optimizer's first step
        if self.optimizer.distributed is not None:
            return write_distributed(state, self.optimizer, self.config, self.layout, rank)
        return write_optimizer(state, self.optimizer, self.config, self.layout, rank), None


Produce = Callable[[int, LocalTensor], torch.Tensor]  # (target rank, local tensor) -> its values


def _deferred_local(
    target: _TargetFiles, rank: int, produce: Produce, dtype_of: Callable[[LocalTensor], torch.dtype]
) -> dict[str, Any]:
    """A target rank's local state whose tensors are produced only when their records are written."""
    local: dict[str, Any] = {}
    for lt in local_plan(target.config, target.layout, rank, target.states):
        put_local(local, lt.key, Deferred(lt.shape, dtype_of(lt), functools.partial(produce, rank, lt)))
    return local


def _write_megatron(
    dst: str | Path,
    target: _TargetFiles,
    produce: Produce,
    dtype_of: Callable[[LocalTensor], torch.dtype],
    memory_budget: int,
    workers: int,
    progress: bool,
) -> tuple[int, int]:
    """Write every rank file of the target layout, tensor by tensor (torch_file.save); DST appears only when
    whole. A file being written holds one target tensor and the source tensors it is made from, so as many files
    are written at once as groups of the largest tensor fit in the budget (streaming.group_limit).
    Returns (files, bytes of tensors written)."""
    from tqdm import tqdm

    if target.format == TORCH_DIST:
        return write_torch_dist(dst, target, produce, dtype_of, progress)
    files = rank_files(target.layout)
    locals_ = {rank: _deferred_local(target, rank, produce, dtype_of) for rank in files.values()}
    optimizers = {rank: target.optimizer_files(rank, locals_[rank]) for rank in files.values()}
    biggest = max(d.nbytes for tree in (*locals_.values(), *optimizers.values()) for d in _deferred(tree))
    parallel = max(1, min(workers, group_limit(memory_budget) // max(biggest, 1)))
    with (
        staged_dir(dst) as tmp,
        tqdm(total=len(files), desc="write rank files", unit="file", disable=not progress) as bar,
    ):
        iter_dir = tmp / f"iter_{target.iteration:07d}"

        def one(name: str, rank: int) -> None:
            (iter_dir / name).mkdir(parents=True)
            entry, distrib = optimizers[rank]
            torch_file.save(target.content(name, rank, locals_[rank], entry), iter_dir / name / RANK_FILE)
            if distrib is not None:
                torch_file.save(distrib, iter_dir / name / DISTRIB_OPTIM_FILE)
            bar.update(1)

        with cf.ThreadPoolExecutor(parallel) as pool:
            for f in cf.as_completed([pool.submit(one, n, r) for n, r in files.items()]):
                f.result()
        (tmp / TRACKER).write_text(f"{target.iteration}\n")  # last: Megatron finds the iteration only once it is whole
    return len(files), sum(d.nbytes for local in locals_.values() for d in _deferred(local))


def _deferred(tree: Any) -> list[Deferred]:
    if isinstance(tree, Deferred):
        return [tree]
    if isinstance(tree, (dict, list, tuple)):
        return [d for v in (tree.values() if isinstance(tree, dict) else tree) for d in _deferred(v)]
    return []


# ------------------------------------------------------------------------------------------- convert


@dataclass(frozen=True)
class ConvertReport:
    source: str
    destination: str
    atoms: int
    files: int
    bytes_written: int
    dropped: tuple[str, ...] = ()  # source entries not carried (e.g. "rng_state" into another layout)


def _jsonable(args: Any) -> dict[str, Any]:
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


def _universal_extra(source: MegatronSource) -> dict[str, Any]:
    """The JSON (and small tensors) a Megatron -> ucp conversion stores beside the atoms. `optimizer_step` is
    where ucp's trainer keeps the optimizer's step counter; `megatron_optimizer` holds what writing the optimizer
    entry back needs (kind, per-parameter entries, param-group hyperparameters, grad scaler)."""
    extra: dict[str, Any] = {
        "hf_config": source.hf,
        "megatron_args": _jsonable(source.args),
        "source": {
            "format": "megatron",
            "path": str(source.root.absolute()),
            "iteration": source.iteration,
            "layout": megatron_name(source.layout),
        },
    }
    if source.scheduler is not None:
        extra["opt_param_scheduler"] = source.scheduler
    if source.optimizer is not None:
        extra["megatron_optimizer"] = source.optimizer.to_json()
        if source.optimizer.step is not None:
            extra["optimizer_step"] = source.optimizer.step
    return extra


@dataclass(frozen=True)
class Dtypes:
    """The dtypes of a checkpoint's tensors: each optimizer state's (and the parameters' most common, key None), and
    each parameter atom's own (a bf16 model's fp32 router bias stays fp32 through every conversion)."""

    of_state: dict[str | None, torch.dtype]
    of_atom: dict[str, torch.dtype]

    def of(self, lt: LocalTensor) -> torch.dtype:
        """A local tensor's dtype: its first atom's for a parameter, its state's for an optimizer state."""
        if lt.state is None and lt.pieces:
            return self.of_atom.get(lt.pieces[0].atom, self.of_state[None])
        return self.of_state[lt.state]

    def atom(self, atom: str, state: str | None) -> torch.dtype:
        return self.of_atom.get(atom, self.of_state[None]) if state is None else self.of_state[state]

    def save_dtypes(self) -> dict[str | None, torch.dtype]:
        """`streaming.save_atoms`' dtype_of: the states', and the parameter atoms' kept as they are."""
        return {**self.of_state, **kept_param_dtypes(self.of_atom)}


def _source_dtypes(source: MegatronSource) -> Dtypes:
    """The dtypes of the source files' tensors (from their headers: no tensor is read)."""
    of_state: dict[str | None, torch.dtype] = {}
    of_atom: dict[str, torch.dtype] = {}
    for rank in source.files:
        local = source.local_state(rank)
        for lt in local_plan(source.config, source.layout, rank, source.states):
            dtype = local_tensor(local, lt.key).dtype
            of_state.setdefault(lt.state, dtype)
            if lt.state is None:
                of_atom.update({p.atom: dtype for p in lt.pieces if p.atom not in of_atom})
    of_state[None] = most_common(of_atom.values())
    return Dtypes(of_state, of_atom)


def _to_universal(
    source: MegatronSource,
    url: str,
    step: int,
    storage_options: dict[str, Any] | None,
    memory_budget: int,
    workers: int,
    progress: bool,
) -> ConvertReport:
    """Megatron -> ucp, written in layout tp1pp1 by `streaming.save_atoms`: atoms move in groups within the
    budget, each atom filled from the source regions holding it; a group's source tensors are read from their
    files and dropped with the group."""
    index = _PieceIndex.of(source)
    dtypes_ = _source_dtypes(source)
    shapes = {name: tuple(shape) for name, (shape, _) in canonical_atoms(source.config).items()}
    keys = [(a, s) for a in shapes for s in ((None,) if a in buffer_atoms(source.config) else (None, *source.states))]
    sizes = {(a, s): math.prod(shapes[a]) * dtypes_.atom(a, s).itemsize for a, s in keys}

    def load(keys: list[AtomKey]) -> dict[AtomKey, torch.Tensor]:
        cache: SourceCache = {}
        return {(a, s): index.atom(a, s, shapes[a], dtypes_.atom(a, s), cache) for a, s in keys}

    written = save_atoms(
        url,
        [functools.partial(load, keys) for keys in pack(sizes, group_limit(memory_budget))],
        step=step,
        model=ShardedModel(source.config, Layout(), optim_states=source.states),
        dtype_of=dtypes_.save_dtypes(),
        extra=_universal_extra(source),
        storage_options=storage_options,
        workers=workers,
        progress=progress,
    )
    dropped = ("rng_state",) if "rng_state" in source.files[0] else ()  # per rank: no layout-free form
    return ConvertReport(str(source.root), url, len(shapes), 0, written, dropped + source.not_carried)


def convert(
    src: str,
    dst: str,
    *,
    from_layout: str,
    to_layout: str,
    step: int | None = None,
    iteration: int | None = None,
    memory_budget: int = 4 << 30,
    workers: int = 8,
    storage_options: dict[str, Any] | None = None,
    progress: bool = False,
    vocab_size: int | None = None,
    target_ep: int | None = None,
    model_config: str | Path | None = None,
    target_layout: str | None = None,
) -> ConvertReport:
    """Reshard a Megatron torch checkpoint into another TP/PP/EP layout, or convert it to (`to_layout="universal"`)
    or from (`from_layout="universal"`) a ucp checkpoint; "torch_dist" on either side is Megatron's
    dist_checkpointing format (ucp.interop.megatron_dist), which needs no layout. Carried: model weights, the
    optimizer's state (into torch_dist: a distributed optimizer's, in Megatron-LM's default form for the job of
    `target_layout`, or else in the form any layout loads, made for a job of expert parallelism `target_ep`, by
    default the source's: `DistJob`), opt_param_scheduler and the iteration; rng_state only into the source's own
    layout. What is not carried is listed in `dropped`. `model_config`: with `from_layout="torch_dist"`, the
    model's shape of a checkpoint saved without Megatron-LM's args (megatron_dist.model_shape)."""
    job = DistJob.of(to_layout, target_ep, target_layout)
    # (torch_dist into torch_dist for a job: its optimizer in another form or entry)
    if from_layout == to_layout and from_layout in (UNIVERSAL, TORCH_DIST) and job == DistJob():
        raise UcpError(f"--from {from_layout} --to {to_layout}: nothing to convert (it loads in any layout as it is)")
    if model_config is not None and from_layout != TORCH_DIST:
        raise UcpError(
            f"--config {model_config}: it gives the model's shape of a torch_dist checkpoint saved without "
            f"Megatron-LM's args; --from {from_layout} "
            + ("has its own config" if from_layout == UNIVERSAL else "files have their args")
        )
    if from_layout == UNIVERSAL:
        return _from_universal(src, dst, to_layout, step, storage_options, memory_budget, workers, progress, job)
    if from_layout == TORCH_DIST:
        source = open_torch_dist(src, iteration=iteration, vocab_size=vocab_size, model_config=model_config)
    else:
        source = open_megatron(src, from_layout, iteration=iteration, vocab_size=vocab_size)
    if to_layout == UNIVERSAL:
        return _to_universal(
            source, dst, source.iteration if step is None else step, storage_options, memory_budget, workers, progress
        )
    return _reshard(source, dst, to_layout, memory_budget, workers, progress, job)


@dataclass(frozen=True)
class DistJob:
    """The job a --to torch_dist checkpoint's distributed optimizer is written for. With `layout`: Megatron-LM's
    default form (`dp_reshardable`: each model-parallel rank's grad buffer buckets, which that job loads in its
    TP, PP, VPP and EP with any DP, and Megatron-LM's loader refuses in another TP or PP); without: the form every
    layout loads (`fully_reshardable`), its entry made for a job of expert parallelism `ep` (None: the source's),
    since megatron-core chains a dense and an expert optimizer only with EP > 1."""

    layout: Layout | None = None
    ep: int | None = None

    @classmethod
    def of(cls, to_layout: str, target_ep: int | None, target_layout: str | None) -> DistJob:
        """From convert's arguments, checked: they name a job only for --to torch_dist, and one way."""
        for flag, value in (("--target-ep", target_ep), ("--target-layout", target_layout)):
            if value is not None and to_layout != TORCH_DIST:
                raise UcpError(
                    f"{flag} {value}: it says which job loads a --to torch_dist checkpoint; --to {to_layout} names "
                    "its own layout"
                )
        if target_ep is not None and target_layout is not None:
            raise UcpError(f"--target-ep {target_ep} and --target-layout {target_layout}: the layout names its EP")
        if target_ep is not None and target_ep < 1:
            raise UcpError(f"--target-ep {target_ep}: an expert-parallel size is 1 or more")
        return cls(parse_megatron_layout(target_layout) if target_layout is not None else None, target_ep)

    def expert_parallel(self, meta: OptimizerMeta) -> bool:
        """Whether the job chains a dense and an expert optimizer (EP > 1)."""
        if self.layout is not None:
            return self.layout.ep > 1
        return self.ep > 1 if self.ep is not None else any(key[2] for key in meta.groups)


def _target_layout(to_layout: str) -> tuple[Layout, str]:
    """The layout and format a --to names: a Megatron layout (torch format), or torch_dist (layout-free: written
    as tp1pp1, which Megatron's loader reshards to any layout)."""
    if to_layout == TORCH_DIST:
        return Layout(), TORCH_DIST
    return parse_megatron_layout(to_layout), "torch"


def _target_optimizer(meta: OptimizerMeta | None, fmt: str, job: DistJob) -> tuple[OptimizerMeta | None, bool]:
    """(the optimizer a target of format `fmt` gets, whether its torch_dist entry is for a job with EP > 1).
    torch_dist holds a distributed optimizer's state only (another kind of optimizer keeps its own form there,
    which ucp does not write); its entry is for the job `job` names, by default one like the source (expert param
    groups of their own: EP > 1)."""
    if meta is None or (fmt == TORCH_DIST and meta.distributed is None):
        return None, False
    return meta, job.expert_parallel(meta)


def _dist_args(config: Any, layout: Layout, job: DistJob, **kwargs: Any) -> argparse.Namespace:
    """A target's args: its layout's, or for a torch_dist written for one job's layout (`job.layout`, the
    dp_reshardable form) that job's, which Megatron-LM's loader compares with its own TP and PP."""
    return args_for(config, job.layout if job.layout is not None else layout, **kwargs)


def _reshard(
    source: MegatronSource,
    dst: str,
    to_layout: str,
    memory_budget: int,
    workers: int,
    progress: bool,
    job: DistJob = DistJob(),
) -> ConvertReport:
    """Megatron -> Megatron: each target tensor (parameter or optimizer state) filled from the source regions."""
    layout, fmt = _target_layout(to_layout)
    for fits in (layout, job.layout or layout):  # the layouts fit the model, before anything is written
        local_plan(source.config, fits, 0, ())
    index = _PieceIndex.of(source)
    dtypes_ = _source_dtypes(source)
    # RNG states are per rank: a file of the same layout is the same rank, any other has no source to take them from
    has_rng = all("rng_state" in f for f in source.files.values())
    same = megatron_name(layout) == megatron_name(source.layout) and fmt == "torch"
    rng = {name: source.files[r]["rng_state"] for name, r in rank_files(layout).items()} if has_rng and same else None
    args = _dist_args(source.config, layout, job, base=source.args)
    args.ckpt_format = fmt
    optimizer, expert_parallel = _target_optimizer(source.optimizer, fmt, job)
    target = _TargetFiles(
        source.config,
        layout,
        args,
        source.iteration,
        optimizer,
        source.scheduler,
        rng,
        fmt,
        expert_parallel,
        job.layout,
    )
    files, written = _write_megatron(
        dst,
        target,
        lambda _rank, lt: index.local(lt, dtypes_.of(lt)),
        dtypes_.of,
        memory_budget,
        workers,
        progress,
    )
    dropped: tuple[str, ...] = ("rng_state",) if has_rng and not same else ()
    dropped += ("optimizer",) if source.optimizer is not None and optimizer is None else ()
    return ConvertReport(
        str(source.root), str(dst), len(canonical_atoms(source.config)), files, written, dropped + source.not_carried
    )


def _from_universal(
    src: str,
    dst: str,
    to_layout: str,
    step: int | None,
    storage_options: dict[str, Any] | None,
    memory_budget: int,
    workers: int,
    progress: bool,
    job: DistJob = DistJob(),
) -> ConvertReport:
    """ucp -> Megatron: each target rank's local state read straight from the atoms. The optimizer entry is
    written when the checkpoint came from Megatron with one (its `megatron_optimizer` says how to build it);
    optimizer state without it (e.g. from ucp's trainer: no Megatron param groups to rebuild) is dropped."""
    reader = _open_universal(src, step, storage_options)
    config = model_config_of(reader)
    if not isinstance(config, (MixtralConfig, QwenMoeConfig, LlamaConfig, DeepseekV3Config)):
        raise SourceMismatchError(
            f"{src} holds a {type(config).__name__} model; Megatron conversion writes Mixtral, the Qwen MoEs, "
            "DeepSeek-V3 and Llama"
        )
    if isinstance(config, QwenMoeConfig) and config.qk_norm_full:
        raise SourceMismatchError(
            f"{src} holds an OLMoE model, whose q and k norms span all heads: Megatron-Core has no such layer "
            "(its q/k layernorms are per head), so no Megatron checkpoint computes the same model"
        )
    quantised = list(block_scales(config))
    if quantised:  # (Megatron-LM trains and saves bf16 parameters: its loaders have no place for fp8 blocks' scales)
        raise SourceMismatchError(
            f"{src}: {quantised[0]} and {len(quantised) - 1} more are fp8 weights with block scales, which Megatron "
            "checkpoints do not hold; dequantise first: ucp export SRC --to hf DIR --dtype bf16, ucp import DIR URL, "
            "then convert URL"
        )
    layout, fmt = _target_layout(to_layout)
    for fits in (layout, job.layout or layout):  # the layouts fit the model, before anything is written
        local_plan(config, fits, 0, ())
    extra = _extra(reader)
    hf = extra.get("hf_config")
    if isinstance(config, DeepseekV3Config) and isinstance(hf, dict) and hf.get("rope_interleave") is False:
        raise SourceMismatchError(
            f"{src}: rope_interleave=False, but Megatron's multi-latent attention applies RoPE to interleaved pairs "
            "(HF's default, rope_interleave=True): Megatron would compute another model"
        )
    meta = OptimizerMeta.from_json(extra["megatron_optimizer"]) if "megatron_optimizer" in extra else None
    args = _dist_args(config, layout, job, hf=hf if isinstance(hf, dict) else None)
    args.ckpt_format = fmt
    optimizer, expert_parallel = _target_optimizer(meta, fmt, job)
    target = _TargetFiles(
        config,
        layout,
        args,
        reader.step,
        optimizer,
        extra.get("opt_param_scheduler"),
        format=fmt,
        expert_parallel=expert_parallel,
        optimizer_layout=job.layout,
    )
    atom_meta = _atom_metas(reader, config, layout, target.states)
    of_state = {state: dtypes.torch_dtype(meta.dtype) for (_, state), meta in reversed(atom_meta.items())}
    stored = Dtypes(of_state, {a: dtypes.torch_dtype(m.dtype) for (a, s), m in atom_meta.items() if s is None})
    files, written = _write_megatron(
        dst,
        target,
        lambda _rank, lt: _read_local(reader, atom_meta, lt, stored.of(lt)),
        stored.of,
        memory_budget,
        workers,
        progress,
    )
    has_optimizer = any(p.startswith("optimizer/") for p in reader.atoms)
    dropped = ("optimizer",) if target.optimizer is None and has_optimizer else ()
    return ConvertReport(src, str(dst), len(canonical_atoms(config)), files, written, dropped)


def _atom_metas(
    reader: CheckpointReader, config: Any, layout: Layout, states: tuple[str, ...]
) -> dict[AtomKey, AtomMeta]:
    """The stored atoms every rank of `layout` needs, checked to exist with the config's shapes."""
    shapes = canonical_atoms(config)
    out: dict[AtomKey, AtomMeta] = {}
    for atom, (shape, _) in shapes.items():
        for state in (None, *states):
            path = atom_path(atom, state)
            if path not in reader.atoms:
                raise FormatError(
                    f"step {reader.step} has no atom {path!r}, which the {megatron_name(layout)} files need"
                )
            check_atom(reader.atoms[path], tuple(shape))
            out[(atom, state)] = reader.atoms[path]
    return out


def _read_local(
    reader: CheckpointReader, atom_meta: Mapping[AtomKey, AtomMeta], lt: LocalTensor, dtype: torch.dtype
) -> torch.Tensor:
    """One local tensor of a target rank, read from the atom chunks it overlaps (load_sharded, for one tensor;
    padding zero)."""
    out = torch.zeros(lt.shape, dtype=dtype)
    for read in piece_reads(reader, lt, [atom_meta[(p.atom, lt.state)] for p in lt.pieces], out):
        read.call()
    return out


def _open_universal(src: str, step: int | None, storage_options: dict[str, Any] | None) -> CheckpointReader:
    if (Path(src) / TRACKER).is_file():
        raise SourceMismatchError(
            f"{src} is a Megatron checkpoint (it has {TRACKER}), not a ucp one: give its layout to --from"
        )
    try:
        return open_checkpoint(src, "latest" if step is None else step, storage_options=storage_options)
    except CheckpointNotFoundError as e:
        raise SourceMismatchError(f"--from universal, but {src} holds no committed ucp checkpoint: {e}") from None


def _extra(reader: CheckpointReader) -> dict[str, Any]:
    from ucp.sharded_model import extra_state

    return extra_state(reader)
