"""Hugging Face checkpoints to and from ucp: Mixtral, Qwen2-MoE and Qwen3-MoE, and the dense Llama, Mistral, Qwen2
and Qwen3 (`HF_ARCHS`).

The on-disk Hugging Face format is config.json plus safetensors files named in model.safetensors.index.json. Its
tensor names are exactly ucp's canonical atom names (for Mixtral the per-expert
`model.layers.{L}.block_sparse_moe.experts.{X}.w1/w2/w3.weight`, for the Qwen MoEs `mlp.experts.{X}.gate_proj/up_proj/
down_proj.weight`), so export and import are renames of nothing: the work is the config, sharding into files of
bounded size, and refusing what the atoms cannot hold. transformers >= 5 keeps a MoE's experts fused in memory
(`mlp.experts.gate_up_proj`, `down_proj`) but still reads and writes the per-expert form on disk; import accepts
both (the family's `ExpertNames` say which atoms a fused tensor holds).

HF fields the family config does not model (norm epsilon, rope parameters, token ids, sliding window, ...; the
model_type too) travel in the checkpoint's extra state under "hf_config", so an import followed by an export (or
by any other path: Megatron files, DCP) gives back the same config.

Both directions stream within a memory budget (`ucp.interop.streaming`): import reads atoms a group at a time out
of the safetensors files; export writes each file tensor by tensor (`SafetensorsWriter`).

DeepSeek-V3's fp8 checkpoints (`quantization_config` with `quant_method` fp8, `fmt` e4m3, `weight_block_size`) import
as they are: each quantised weight a float8_e4m3fn atom, its `weight_scale_inv` a float32 atom (`ucp.sharding.quantization`);
an export writes them back bitwise, or with `dtype` dequantised (no scales, no quantization_config).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self

import torch

from ..base.workpool import pack
from ..distributed.sharded_model import AtomKey, ShardedModel, atom_path, extra_state, model_config_of
from ..engine.checkpoint import CheckpointReader, open_checkpoint
from ..errors import UcpError
from ..format.manifest import AtomMeta
from ..sharding.families import (
    DeepseekV3Config,
    FamilyConfig,
    LlamaConfig,
    MixtralConfig,
    QwenMoeConfig,
    block_scales,
    canonical_atoms,
    expert_names_of,
)
from ..sharding.families.table import block_size
from ..sharding.layout import Layout
from ..sharding.quantization import SCALE_DTYPES, WEIGHT_DTYPE, dequantize
from .dtypes import kept_param_dtypes, most_common, parse_dtype, short_name
from .errors import InteropError, SourceMismatchError
from .paths import file_beside
from .staging import staged_dir
from .streaming import DEFAULT_MEMORY_BUDGET, DEFAULT_WORKERS, group_limit, nbytes, pipelined, progress_bar, save_atoms

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
DEFAULT_SHARD_BYTES = 1 << 30

# Keys that describe the file, not the model: never carried over.
FILE_KEYS = ("dtype", "torch_dtype", "transformers_version", "_name_or_path")
_DENSE_KEYS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "tie_word_embeddings",
)


@dataclass(frozen=True)
class HfArch:
    """One Hugging Face architecture: the family whose atoms hold it, the config.json keys that are the family
    config's fields of the same name, the config fields it implies, the values it must have for the atoms to hold
    everything it computes with, and what an export says when the checkpoint carries no HF config."""

    model_type: str
    architecture: str
    config_cls: type
    keys: tuple[str, ...]
    implies: dict[str, Any] = dataclasses.field(default_factory=dict)
    requires: dict[str, Any] = dataclasses.field(default_factory=dict)
    defaults: dict[str, Any] = dataclasses.field(default_factory=dict)
    aliases: dict[str, str] = dataclasses.field(default_factory=dict)  # another config.json spelling -> the key
    aliases_only: bool = False  # an export writes the aliases alone (else both spellings, for readers of either)
    copies: dict[str, str] = dataclasses.field(default_factory=dict)  # config field -> the config.json key it copies
    optional: tuple[str, ...] = ()  # keys an export leaves out where the config has None (HF's default stands)
    # What transformers computes with where config.json says nothing (its config class's defaults), for the fields
    # that change the model and that `defaults` says otherwise or not at all: an import records them (an export and
    # a Megatron conversion then say them), so that a config.json relying on them comes back as the same model.
    assumed: dict[str, Any] = dataclasses.field(default_factory=dict)

    def refuses(self, config: FamilyConfig) -> list[str]:
        """The settings of `config` this architecture cannot hold (`implies` and `requires` on the config's own
        fields): an export as it would drop their weights, or compute another model."""
        wanted = {**self.requires, **self.implies}
        return [
            f"{k}={getattr(config, k)!r}" for k, v in wanted.items() if hasattr(config, k) and getattr(config, k) != v
        ]


_COMMON_DEFAULTS = {"hidden_act": "silu", "rms_norm_eps": 1e-5, "attention_dropout": 0.0}
_QWEN_MOE_KEYS = (*_DENSE_KEYS, "moe_intermediate_size", "num_local_experts", "num_experts_per_tok", "attention_bias")
# every layer a MoE layer: dense MLP layers (mlp_only_layers, decoder_sparse_step > 1) have no atoms here
_QWEN_MOE_REQUIRES = {"hidden_act": "silu", "decoder_sparse_step": 1, "mlp_only_layers": []}
_QWEN_MOE_DEFAULTS = {**_COMMON_DEFAULTS, "rms_norm_eps": 1e-6, "rope_theta": 1e6}
_DENSE_ASSUMED = {"rms_norm_eps": 1e-6, "rope_theta": 1e4}  # (Llama's, Mistral's, Qwen2's and Qwen3's)
HF_ARCHS: dict[str, HfArch] = {
    a.model_type: a
    for a in (
        HfArch(
            "mixtral",
            "MixtralForCausalLM",
            MixtralConfig,
            (*_DENSE_KEYS, "num_local_experts", "num_experts_per_tok"),
            requires={"hidden_act": "silu"},
            defaults={**_COMMON_DEFAULTS, "rope_theta": 1e6, "max_position_embeddings": 4096},
            assumed={"rms_norm_eps": 1e-5, "rope_theta": 1e6},
        ),
        HfArch(
            "qwen3_moe",
            "Qwen3MoeForCausalLM",
            QwenMoeConfig,
            _QWEN_MOE_KEYS,
            implies={"qk_norm": True, "shared_expert_intermediate_size": 0},
            # (its attention_bias puts biases on q, k, v and o: ucp's atoms have none on o_proj)
            requires={**_QWEN_MOE_REQUIRES, "attention_bias": False},
            defaults={**_QWEN_MOE_DEFAULTS, "max_position_embeddings": 40960, "norm_topk_prob": True},
            assumed={"rms_norm_eps": 1e-6, "rope_theta": 1e4, "norm_topk_prob": False},
            aliases={"num_experts": "num_local_experts"},  # (transformers < 5 writes num_experts)
            optional=("intermediate_size",),
        ),
        HfArch(
            "qwen2_moe",
            "Qwen2MoeForCausalLM",
            QwenMoeConfig,
            (*_QWEN_MOE_KEYS, "shared_expert_intermediate_size"),
            implies={"qk_norm": False},
            requires=_QWEN_MOE_REQUIRES,
            defaults={**_QWEN_MOE_DEFAULTS, "max_position_embeddings": 32768, "norm_topk_prob": False},
            assumed={"rms_norm_eps": 1e-6, "rope_theta": 1e4, "norm_topk_prob": False},
            aliases={"num_experts": "num_local_experts", "qkv_bias": "attention_bias"},
            optional=("intermediate_size",),
        ),
        HfArch(
            "olmoe",
            "OlmoeForCausalLM",
            QwenMoeConfig,
            (*_DENSE_KEYS, "num_local_experts", "num_experts_per_tok"),
            implies={"qk_norm": False, "qk_norm_full": True, "shared_expert_intermediate_size": 0},
            requires={"hidden_act": "silu", "attention_bias": False},
            defaults={
                **_COMMON_DEFAULTS,
                "rope_theta": 1e4,
                "max_position_embeddings": 4096,
                "norm_topk_prob": False,
                "clip_qkv": None,
            },
            aliases={"num_experts": "num_local_experts"},
            aliases_only=True,
            copies={"moe_intermediate_size": "intermediate_size"},
            assumed={
                "rms_norm_eps": 1e-5,
                "rope_theta": 1e4,
                "norm_topk_prob": False,
            },  # (OLMoE's experts are its only MLPs)
        ),
        HfArch(
            "deepseek_v3",
            "DeepseekV3ForCausalLM",
            DeepseekV3Config,
            (
                # (not head_dim: DeepSeek's is the RoPE part's size; it travels with the fields not modelled)
                *(k for k in _DENSE_KEYS if k != "head_dim"),
                "moe_intermediate_size",
                "num_local_experts",
                "num_experts_per_tok",
                "n_shared_experts",
                "first_k_dense_replace",
                "q_lora_rank",
                "kv_lora_rank",
                "qk_nope_head_dim",
                "qk_rope_head_dim",
                "v_head_dim",
            ),
            requires={"hidden_act": "silu", "attention_bias": False},
            defaults={
                **_COMMON_DEFAULTS,
                "rms_norm_eps": 1e-6,
                "rope_theta": 1e4,
                "rope_interleave": True,
                "max_position_embeddings": 4096,
                "n_group": 1,
                "topk_group": 1,
                "routed_scaling_factor": 1.0,
                "norm_topk_prob": True,
            },
            aliases={"n_routed_experts": "num_local_experts"},
            aliases_only=True,
            assumed={
                "rms_norm_eps": 1e-6,
                "rope_theta": 1e4,
                "n_group": 8,
                "topk_group": 4,
                "routed_scaling_factor": 2.5,
                "norm_topk_prob": True,
            },
        ),
        HfArch(
            "llama",
            "LlamaForCausalLM",
            LlamaConfig,
            _DENSE_KEYS,
            requires={"hidden_act": "silu", "attention_bias": False, "mlp_bias": False},
            defaults={**_COMMON_DEFAULTS, "rope_theta": 5e5, "max_position_embeddings": 8192},
            assumed=_DENSE_ASSUMED,
        ),
        HfArch(
            "mistral",
            "MistralForCausalLM",
            LlamaConfig,
            _DENSE_KEYS,
            requires={"hidden_act": "silu"},
            defaults={**_COMMON_DEFAULTS, "rope_theta": 1e6, "max_position_embeddings": 32768},
            assumed=_DENSE_ASSUMED,
        ),
        HfArch(
            "qwen2",
            "Qwen2ForCausalLM",
            LlamaConfig,
            _DENSE_KEYS,
            implies={"attention_bias": True},
            requires={"hidden_act": "silu"},
            defaults={**_COMMON_DEFAULTS, "rope_theta": 1e6, "max_position_embeddings": 32768},
            assumed=_DENSE_ASSUMED,
        ),
        HfArch(
            "qwen3",
            "Qwen3ForCausalLM",
            LlamaConfig,
            _DENSE_KEYS,
            implies={"qk_norm": True},
            requires={"hidden_act": "silu", "attention_bias": False},
            defaults={**_COMMON_DEFAULTS, "rope_theta": 1e6, "max_position_embeddings": 40960},
            assumed=_DENSE_ASSUMED,
        ),
    )
}


@dataclass(frozen=True)
class ExportReport:
    files: int
    tensors: int
    bytes_written: int


@dataclass(frozen=True)
class ImportReport:
    step: int
    atoms: int
    bytes_read: int


# ---------------------------------------------------------------------------------------------- configs


def arch_of(config: FamilyConfig, hf_extra: dict[str, Any] | None) -> HfArch:
    """The HF architecture to export a model as: the one it was imported from (its stored config says), else the
    one its family config implies; refused where that architecture cannot hold every setting of the model (a
    Megatron model with q/k norms and q/k/v biases, say: no architecture here has both)."""
    stored = HF_ARCHS.get(str((hf_extra or {}).get("model_type")))
    if stored is not None and isinstance(config, stored.config_cls) and not stored.refuses(config):
        return stored
    arch = _implied_arch(config)
    refused = arch.refuses(config)
    if refused:
        raise SourceMismatchError(
            f"a {type(config).__name__} model with {', '.join(refused)} has no Hugging Face architecture here: "
            f"{arch.model_type} ({arch.architecture}), the nearest, would drop weights or compute another model"
        )
    return arch


def _implied_arch(config: FamilyConfig) -> HfArch:
    if isinstance(config, MixtralConfig):
        return HF_ARCHS["mixtral"]
    if isinstance(config, DeepseekV3Config):
        return HF_ARCHS["deepseek_v3"]
    if isinstance(config, QwenMoeConfig):
        return HF_ARCHS["olmoe" if config.qk_norm_full else "qwen3_moe" if config.qk_norm else "qwen2_moe"]
    if isinstance(config, LlamaConfig):
        return HF_ARCHS["qwen3" if config.qk_norm else "qwen2" if config.attention_bias else "llama"]
    raise SourceMismatchError(f"a {type(config).__name__} model has no Hugging Face architecture here")


def hf_config_from_ucp(config: FamilyConfig, hf_extra: dict[str, Any] | None, dtype: torch.dtype) -> dict[str, Any]:
    """config.json for transformers: the architecture, its defaults, the stored HF fields, the model's shape."""
    arch = arch_of(config, hf_extra)
    doc: dict[str, Any] = {"architectures": [arch.architecture], "model_type": arch.model_type}
    doc.update(arch.defaults)
    if hf_extra and "rope_parameters" in hf_extra:
        doc.pop("rope_theta", None)
    doc.update(hf_extra or {})
    doc.update({"architectures": [arch.architecture], "model_type": arch.model_type})
    doc.update({k: getattr(config, k) for k in arch.keys if not (k in arch.optional and getattr(config, k) is None)})
    doc.update({key: getattr(config, f) for f, key in arch.copies.items()})
    doc.update({alias: doc[key] for alias, key in arch.aliases.items()})  # (readers of either spelling)
    if arch.aliases_only:
        for key in arch.aliases.values():
            del doc[key]
    block = block_size(config)
    if block is None:
        doc.pop("quantization_config", None)  # (a dequantised export)
    else:
        doc["quantization_config"] = {
            **_FP8_DEFAULTS,
            **doc.get("quantization_config", {}),
            "weight_block_size": list(block),
        }
    doc["dtype"] = short_name(dtype)
    return doc


# What DeepSeek-V3's fp8 checkpoints say in config.json's quantization_config (besides weight_block_size); an export
# of a checkpoint that carries no HF config says the same.
_FP8_DEFAULTS = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8"}


def _fp8_block_size(quant: Any, arch: HfArch, where: str) -> list[int]:
    """The block size of a config.json's quantization_config, which must be fp8 block quantisation as DeepSeek-V3's
    checkpoints have it (float8_e4m3fn weights with float32 scales per block, activations quantised on the fly)."""
    if "weight_block_size" not in {f.name for f in dataclasses.fields(arch.config_cls)}:
        raise SourceMismatchError(
            f"{where}: a quantization_config, but ucp imports block-quantised fp8 weights for deepseek_v3 only, "
            f"not {arch.model_type}"
        )
    if not isinstance(quant, dict):
        raise InteropError(f"{where}: quantization_config is {quant!r}, not an object")
    expected = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic"}
    for key, value in expected.items():
        if quant.get(key, value if key == "activation_scheme" else None) != value:
            raise InteropError(
                f"{where}: quantization_config {key}={quant.get(key)!r}; ucp imports {key}={value!r} only "
                "(fp8 e4m3 weights with block scales, DeepSeek-V3's)"
            )
    block = quant.get("weight_block_size")
    if not (isinstance(block, list) and len(block) == 2 and all(type(b) is int and b > 0 for b in block)):
        raise InteropError(
            f"{where}: quantization_config weight_block_size={block!r}; expected two positive integers [rows, cols]"
        )
    return block


def read_hf_config(path: Path) -> tuple[FamilyConfig, dict[str, Any]]:
    """`ucp_config_from_hf` of the config.json at `path`; one that is not a JSON object is an InteropError."""
    try:
        doc = json.loads(path.read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise InteropError(f"{path} is not valid JSON: {e}") from None
    except OSError as e:
        raise InteropError(f"cannot read {path}: {e.strerror or e}") from None
    if not isinstance(doc, dict):
        raise InteropError(f"{path} is not a config (a JSON object), but a {type(doc).__name__}")
    return ucp_config_from_hf(doc, str(path))


# config.json's sizes: integers, positive but for those a model may have none of
_SIZES = frozenset(
    {"vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
     "num_key_value_heads", "head_dim", "moe_intermediate_size", "num_local_experts", "num_experts_per_tok",
     "shared_expert_intermediate_size", "n_shared_experts", "first_k_dense_replace", "q_lora_rank", "kv_lora_rank",
     "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"}
)  # fmt: skip
_MAY_BE_ZERO = frozenset({"shared_expert_intermediate_size", "n_shared_experts", "first_k_dense_replace"})


def ucp_config_from_hf(doc: dict[str, Any], where: str) -> tuple[FamilyConfig, dict[str, Any]]:
    """The family config from an HF config.json, and the HF fields it does not model; refuses architectures, and
    settings of them, whose weights ucp's atoms cannot hold."""
    arch = HF_ARCHS.get(str(doc.get("model_type")))
    if arch is not None:
        doc = {arch.aliases.get(k, k): v for k, v in doc.items()}
    names = doc.get("architectures") or []
    if arch is None or (names and arch.architecture not in names):
        known = ", ".join(f"{a.model_type} ({a.architecture})" for a in HF_ARCHS.values())
        raise SourceMismatchError(
            f"{where} describes model_type={doc.get('model_type')!r} architectures={names}; "
            f"ucp imports Hugging Face {known}"
        )
    for key, value in arch.requires.items():
        if doc.get(key, value) != value:
            raise SourceMismatchError(
                f"{where}: {key}={doc[key]!r}, but ucp's {arch.model_type} atoms hold {key}={value!r} "
                "only (the weights that setting adds have no atom)"
            )
    required = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
    missing = [k for k in required if k not in doc]
    if missing:
        raise InteropError(f"{where} lacks {missing}")
    fields = {k: doc[k] for k in arch.keys if doc.get(k) is not None}
    fields.setdefault("num_key_value_heads", doc["num_attention_heads"])
    for key in _SIZES.intersection(fields):
        value = fields[key]
        if isinstance(value, bool) or not isinstance(value, int) or value < (0 if key in _MAY_BE_ZERO else 1):
            least = "a non-negative" if key in _MAY_BE_ZERO else "a positive"
            raise InteropError(f"{where}: {key} is {value!r:.40}, not {least} integer")
    fields.update({f: doc[key] for f, key in arch.copies.items() if key in doc})
    fields.update(arch.implies)
    if doc.get("quantization_config") is not None:  # (it travels on with the fields not modelled, for export)
        fields["weight_block_size"] = _fp8_block_size(doc["quantization_config"], arch, where)
    try:
        config = arch.config_cls(**fields)
    except (TypeError, ValueError, UcpError) as e:
        raise InteropError(f"{where}: {e}") from None
    extra = {k: v for k, v in doc.items() if k not in arch.keys and k not in FILE_KEYS}
    rope_said = any(k in doc for k in ("rope_theta", "rope_parameters", "rope_scaling"))
    extra.update({k: v for k, v in arch.assumed.items() if k not in doc and not (k == "rope_theta" and rope_said)})
    return config, extra


# ---------------------------------------------------------------------------------------------- export

# safetensors' dtype names (the header's "dtype" field)
_SAFETENSORS_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.float8_e8m0fnu: "F8_E8M0",
}
_TORCH_DTYPES = {name: dtype for dtype, name in _SAFETENSORS_DTYPES.items()}
TensorSpec = tuple[str, torch.dtype, tuple[int, ...]]  # name, dtype, shape


class SafetensorsWriter:
    """One safetensors file written tensor by tensor, so that only the tensors being written are in memory
    (safetensors' own save needs them all at once). The header (names, dtypes, shapes, byte ranges) is known
    up front; the layout is safetensors': the header's length as 8 little-endian bytes, the JSON header padded
    with spaces to a multiple of 8, then each tensor's bytes in header order."""

    def __init__(self, path: Path, specs: Sequence[TensorSpec], metadata: dict[str, str]):
        header: dict[str, Any] = {"__metadata__": metadata}
        offset = 0
        for name, dtype, shape in specs:
            end = offset + math.prod(shape) * dtype.itemsize
            header[name] = {"dtype": _SAFETENSORS_DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, end]}
            offset = end
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        self.path, self.specs, self.written = path, list(specs), 0
        self.file = open(path, "wb")  # noqa: SIM115 (closed by __exit__)
        self.file.write(len(raw).to_bytes(8, "little") + raw)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """The next tensor of the header, in order."""
        if (name, tensor.dtype, tuple(tensor.shape)) != self.specs[self.written]:
            raise AssertionError(
                f"{self.path}: got {name} {tensor.dtype}{list(tensor.shape)}, expected {self.specs[self.written]}"
            )
        self.file.write(tensor.contiguous().reshape(-1).view(torch.uint8).cpu().numpy().data)
        self.written += 1

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *_: object) -> None:
        self.file.close()
        if exc_type is None and self.written != len(self.specs):
            raise AssertionError(f"{self.path}: {len(self.specs) - self.written} tensors never written")


def _read_cast(
    reader: CheckpointReader,
    names: list[str],
    dtype_of: dict[str, torch.dtype],
    dequantised: dict[str, str],
    block: tuple[int, int] | None,
) -> dict[str, torch.Tensor]:
    """Atoms as an export writes them: cast to `dtype_of`, and the weights in `dequantised` (weight -> its scales)
    dequantised with their scales."""
    scales = [dequantised[n] for n in names if n in dequantised]
    tensors = reader.read_atoms([atom_path(n, None) for n in [*names, *scales]])
    out = {}
    for n in names:
        t = tensors.pop(atom_path(n, None))
        if n in dequantised:
            assert block is not None  # (only a quantised model has scales)
            out[n] = dequantize(t, tensors.pop(atom_path(dequantised[n], None)), block, dtype_of[n])
        else:
            out[n] = t.to(dtype_of[n])
    return out


@dataclass(frozen=True)
class ExportPlan:
    """What an export of a step writes, decided from its manifest alone: the tensors (HF names, which are the atom
    names) with their dtypes and sizes, the weights dequantised with their scales, and config.json."""

    names: list[str]
    metas: dict[str, AtomMeta]  # every name's parameter atom (of a dequantised weight: the weight's)
    dtype_of: dict[str, torch.dtype]
    dequantised: dict[str, str]  # weight -> the atom of its scales, for the weights written dequantised
    block: tuple[int, int] | None  # the quantisation block, of a block-quantised model
    config_json: dict[str, Any]

    def sizes(self) -> dict[str, int]:
        return {n: math.prod(self.metas[n].shape) * self.dtype_of[n].itemsize for n in self.names}

    def read(self, reader: CheckpointReader, names: list[str]) -> dict[str, torch.Tensor]:
        """Tensors `names` of the plan as they are written: read (every chunk verified), cast, dequantised."""
        return _read_cast(reader, names, self.dtype_of, self.dequantised, self.block)


def plan_export(reader: CheckpointReader, dtype: str | torch.dtype | None = None) -> ExportPlan:
    """What `export_hf` writes for the step `reader` opened (`dtype`: every tensor cast to it, block-quantised weights
    dequantised; default: as stored); no tensor is read. Refuses a model with no HF architecture, or a step that
    lacks a parameter atom."""
    config = model_config_of(reader)
    hf_extra = stored_hf_config(reader)
    arch_of(config, hf_extra)  # (a model with no HF architecture is refused before any write)
    target = parse_dtype(dtype)
    names = list(canonical_atoms(config))
    metas = {n: reader.atoms[atom_path(n, None)] for n in names if atom_path(n, None) in reader.atoms}
    missing = [n for n in names if n not in metas]
    if missing:
        raise InteropError(f"step {reader.step} at {reader.storage.url} lacks parameter atoms {missing[:5]}")
    quantised = block_scales(config)
    scales = frozenset(quantised.values())
    block = block_size(config)
    dequantised = quantised if target is not None else {}
    if dequantised:  # (the scales go into their weights; config.json says no quantisation)
        names = [n for n in names if n not in scales]
        config = dataclasses.replace(config, weight_block_size=None)
    # each tensor as stored (a bf16 model's fp32 router bias stays fp32), or all cast to `dtype`
    dtype_of = {n: target or _torch_dtype_of(metas[n].dtype) for n in names}
    # (what config.json says the model is: fp8 weights and their scales do not count)
    unquantised = [d for n, d in dtype_of.items() if n not in quantised and n not in scales]
    config_json = hf_config_from_ucp(config, hf_extra, most_common(unquantised))
    return ExportPlan(names, metas, dtype_of, dequantised, block, config_json)


def export_hf(
    url: str,
    out_dir: str | Path,
    *,
    dtype: str | torch.dtype | None = None,
    step: int | str = "latest",
    storage_options: dict[str, Any] | None = None,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
    memory_budget: int = DEFAULT_MEMORY_BUDGET,
    workers: int = DEFAULT_WORKERS,
    progress: bool = False,
) -> ExportReport:
    """Write the parameters of a ucp checkpoint as a Hugging Face Mixtral directory (config.json, safetensors
    files of at most `max_shard_bytes` and their index). Tensors stream through in groups that fit
    `memory_budget` (`workers` reads at once; each file is written tensor by tensor, the next group read
    meanwhile); the directory appears whole or not at all. `dtype` casts every tensor (default: as stored); it
    dequantises block-quantised weights (`ucp.sharding.quantization.dequantize`: no scales, no quantization_config)."""
    reader = open_checkpoint(url, step, storage_options=storage_options)
    reader.io_threads = workers
    plan = plan_export(reader, dtype)
    sizes = plan.sizes()
    # read, then cast or dequantise (through a float32 copy, beside the scales)
    in_memory = {
        n: max(plan.metas[n].nbytes, sizes[n]) + (4 * math.prod(plan.metas[n].shape) if n in plan.dequantised else 0)
        for n in plan.names
    }
    files = pack(sizes, max_shard_bytes)
    limit = group_limit(memory_budget)
    weight_map: dict[str, str] = {}
    with staged_dir(out_dir) as tmp, progress_bar(sum(sizes.values()), "export hf", progress) as bar:
        for k, file_names in enumerate(files):
            fname = f"model-{k + 1:05d}-of-{len(files):05d}.safetensors"
            specs = [(n, plan.dtype_of[n], plan.metas[n].shape) for n in file_names]
            with SafetensorsWriter(tmp / fname, specs, {"format": "pt"}) as out:

                def write(tensors: dict[str, torch.Tensor], out: SafetensorsWriter = out) -> None:
                    for name, t in tensors.items():
                        out.write(name, t)
                        bar.update(nbytes(t))

                groups = pack({n: in_memory[n] for n in file_names}, limit)
                pipelined([functools.partial(plan.read, reader, g) for g in groups], write)
            weight_map.update(dict.fromkeys(file_names, fname))
        written = sum(sizes.values())
        index = {"metadata": {"total_size": written}, "weight_map": weight_map}
        (tmp / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
        (tmp / "config.json").write_text(json.dumps(plan.config_json, indent=2) + "\n")
    return ExportReport(len(files), len(weight_map), written)


def _torch_dtype_of(zarr_name: str) -> torch.dtype:
    from ..base import dtypes

    return dtypes.torch_dtype(zarr_name)


def stored_hf_config(reader: Any) -> dict[str, Any] | None:
    """The Hugging Face config fields a checkpoint carries beside its model config (its extra state's hf_config)."""
    hf = extra_state(reader).get("hf_config")
    return hf if isinstance(hf, dict) else None


# ---------------------------------------------------------------------------------------------- import

_FUSED = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)")
_ROUTER = re.compile(r"model\.layers\.(\d+)\.mlp\.gate\.weight")
_LAYER = re.compile(r"model\.layers\.(\d+)\.")
_IGNORED = re.compile(r"(.*\.rotary_emb\.inv_freq|.*\._extra_state)$")


@dataclass(frozen=True)
class HfSource:
    """An HF checkpoint directory: its config and where each tensor lives."""

    root: Path
    config: FamilyConfig
    hf_extra: dict[str, Any]
    weight_map: dict[str, str]  # tensor name -> file name


def open_hf(src_dir: str | Path) -> HfSource:
    root = Path(src_dir)
    cfg_path = root / "config.json"
    if not cfg_path.is_file():
        raise InteropError(f"{root} is not a Hugging Face checkpoint directory (no config.json)")
    config, extra = read_hf_config(cfg_path)
    if (root / INDEX_NAME).is_file():
        try:
            weight_map = json.loads((root / INDEX_NAME).read_text())["weight_map"]
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
            raise InteropError(f"{root / INDEX_NAME} is not a safetensors index ({type(e).__name__}: {e})") from None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise InteropError(f"{root / INDEX_NAME}: its weight_map is not a map of tensor names to file names")
    elif (root / SINGLE_NAME).is_file():
        with open_safetensors(root / SINGLE_NAME) as f:
            weight_map = dict.fromkeys(f.keys(), SINGLE_NAME)
    else:
        raise InteropError(
            f"{root} has neither {INDEX_NAME} nor {SINGLE_NAME} (only safetensors are imported, never pickles)"
        )
    for fname in sorted(set(weight_map.values())):
        if not file_beside(root / INDEX_NAME, fname, "its weight_map").is_file():
            raise InteropError(f"{root}/{INDEX_NAME} names {fname}, which is missing")
    return HfSource(root, config, extra, weight_map)


@contextlib.contextmanager
def open_safetensors(path: Path) -> Iterator[Any]:
    """safetensors' `safe_open` of `path`; what it raises on a damaged file (a header that is not one, offsets past
    its end, a short file), while opening it or reading from it, is an InteropError naming the file."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            yield f
    except (SafetensorError, OSError) as e:
        first = (str(e).strip().splitlines() or [""])[0][:200]
        raise InteropError(f"{path} is not a readable safetensors file ({type(e).__name__}: {first})") from None


@dataclass(frozen=True)
class StoredAtom:
    """Where one atom lies in an HF checkpoint: a tensor of a file, or one expert's part of a fused tensor."""

    file: str
    name: str  # the stored tensor
    index: tuple[int | slice, ...]  # the atom's part of it; () for the whole tensor
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    def part(self, index: tuple[int | slice, ...]) -> StoredAtom:
        """The atom that is `index` of this whole stored tensor."""
        return dataclasses.replace(self, index=index, shape=tuple(torch.empty(self.shape, device="meta")[index].shape))


def _stored_atoms(src: HfSource) -> Iterator[tuple[str, StoredAtom]]:
    """(canonical name, where it lies) for every stored tensor, file by file, fused expert tensors split per
    expert. Reads the files' headers only."""
    by_file: dict[str, list[str]] = {}
    for name, fname in src.weight_map.items():
        by_file.setdefault(fname, []).append(name)
    moe = expert_names_of(src.config)
    for fname, names in by_file.items():
        with open_safetensors(src.root / fname) as f:
            for name in names:
                if _IGNORED.match(name):
                    continue
                header = f.get_slice(name)
                dtype = _TORCH_DTYPES.get(header.get_dtype())
                if dtype is None:
                    raise InteropError(
                        f"{src.root / fname}: tensor {name} has dtype {header.get_dtype()}, which ucp does not import"
                    )
                whole = StoredAtom(fname, name, (), tuple(header.get_shape()), dtype)
                if moe is not None and (m := _ROUTER.fullmatch(name)):
                    yield moe.router_atom(m[1]), whole
                elif moe is not None and (m := _FUSED.fullmatch(name)):
                    if len(whole.shape) != 3:
                        raise InteropError(
                            f"{src.root}: tensor {name} has shape {list(whole.shape)}, but fused experts are 3-d"
                        )
                    experts = whole.shape[0]
                    if m[2] == "gate_up_proj":
                        ffn = whole.shape[1] // 2
                        for i, atom in enumerate(moe.gate_up_atoms(m[1], experts)):
                            yield atom, whole.part((i // 2, slice(0, ffn) if i % 2 == 0 else slice(ffn, None)))
                    else:
                        for x, atom in enumerate(moe.down_atoms(m[1], experts)):
                            yield atom, whole.part((x,))
                else:
                    yield name, whole


def locate_hf_atoms(src: HfSource) -> tuple[FamilyConfig, dict[str, StoredAtom]]:
    """(the model's config, where every canonical atom lies, in file order), checked against `src.config` (names
    and shapes) from the files' headers, before any tensor is read; a block-quantised model's config says the dtype
    its scales have."""
    expected = {n: shape for n, (shape, _) in canonical_atoms(src.config).items()}
    dtypes = QuantisedDtypes(src.config)
    located: dict[str, StoredAtom] = {}
    unexpected = []
    for name, stored in _stored_atoms(src):
        if name not in expected:
            if name == "lm_head.weight" and src.config.tie_word_embeddings:
                continue  # a tied copy saved anyway: the embedding is the atom
            unexpected.append(name)
            continue
        if stored.shape != expected[name]:
            raise InteropError(
                f"{src.root / stored.file}: tensor {name} has shape {list(stored.shape)}, but config.json implies "
                f"{list(expected[name])}{_scales_note(src.config, name)}"
            )
        dtypes.check(name, stored.dtype, str(src.root / stored.file))
        if name in located:  # (a fused tensor and its split names both given: which one is the model?)
            raise InteropError(
                f"{src.root}: atom {name} is given twice (by tensor {located[name].name} in {located[name].file} and "
                f"by tensor {stored.name} in {stored.file}); a checkpoint holds each weight once"
            )
        located[name] = stored
    if unexpected:
        layers = src.config.num_hidden_layers
        beyond = [n for n in unexpected if (m := _LAYER.match(n)) and int(m[1]) >= layers]
        raise SourceMismatchError(
            f"{src.root} holds tensors a {type(src.config).__name__} model does not have: {unexpected[:5]}"
            f"{' ...' if len(unexpected) > 5 else ''}"
            + (
                f" ({len(beyond)} in layers past num_hidden_layers={layers}: extra layers such as DeepSeek-V3's "
                "multi-token-prediction ones are not part of the model transformers runs, and have no atoms here)"
                if beyond
                else ""
            )
        )
    missing = [n for n in expected if n not in located]
    if missing:
        raise InteropError(
            f"{src.root} lacks tensors {missing[:5]}{' ...' if len(missing) > 5 else ''} "
            f"({len(missing)} of {len(expected)} missing)"
        )
    return dtypes.config(src.config), located


def _scales_note(config: FamilyConfig, name: str) -> str:
    """What a scale tensor's expected shape means (an empty string for any other tensor)."""
    weight = {s: w for w, s in block_scales(config).items()}.get(name)
    if weight is None:
        return ""
    return f" (one scale per {list(block_size(config) or ())} block of {weight}, a partial last block counted)"


class QuantisedDtypes:
    """Checks that a block-quantised model's weights are float8_e4m3fn and its scales float32 or float8_e8m0fnu, all
    of one dtype (what the checkpoint's config then says: `config`), and that no other tensor is float8 (an fp8
    tensor without scales has no value ucp could give it)."""

    def __init__(self, config: FamilyConfig):
        self.weights = block_scales(config)
        self.scales = frozenset(self.weights.values())
        self.scale_dtypes: dict[torch.dtype, str] = {}  # the scales' dtypes found, with a tensor of each

    def check(self, name: str, dtype: torch.dtype, where: str) -> None:
        """`where`: the file that holds the tensor."""
        want = (WEIGHT_DTYPE,) if name in self.weights else SCALE_DTYPES if name in self.scales else None
        fp8 = dtype in (torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e8m0fnu)
        if (want is None or dtype in want) and (want is not None or not fp8):
            if name in self.scales:
                self.scale_dtypes.setdefault(dtype, f"{where}: {name}")
            return
        what = "a block-quantised weight" if name in self.weights else "scales" if want is not None else "not quantised"
        raise InteropError(
            f"{where}: tensor {name} has dtype {dtype}, but the model's config makes it {what}"
            + (f" ({' or '.join(map(str, want))})" if want is not None else " (it has no weight_scale_inv)")
        )

    def config(self, config: FamilyConfig) -> FamilyConfig:
        """`config` with its scales' dtype as the tensors checked have it (one for all)."""
        if len(self.scale_dtypes) > 1:
            raise InteropError(
                f"block scales of several dtypes ({'; '.join(f'{t} {d}' for d, t in self.scale_dtypes.items())}): "
                "ucp holds all of a model's scales in one dtype"
            )
        if not self.scale_dtypes:
            return config
        from ..base import dtypes

        return dataclasses.replace(config, weight_scale_dtype=dtypes.zarr_name(next(iter(self.scale_dtypes))))


def refuse_cast_of_quantised(config: FamilyConfig, dtype: str | torch.dtype | None, where: str) -> None:
    """An import keeps block-quantised weights as they are: casting them would drop their scales."""
    if dtype is not None and block_scales(config):
        raise InteropError(
            f"{where}: the linear weights are fp8 with block scales (quantization_config); import keeps them as "
            "they are (a cast would drop their scales): dequantise on export (ucp export --to hf --dtype bf16) or "
            "when loading (ucp.interop.weights.load_weights(..., dtype='bf16'))"
        )


def read_stored_atoms(root: Path, atoms: dict[str, StoredAtom]) -> dict[AtomKey, torch.Tensor]:
    """The values of some atoms, each copied out of its file's mapping (which closes with the file, so that
    the file's pages stop counting as this process's memory)."""
    out: dict[AtomKey, torch.Tensor] = {}
    for fname in dict.fromkeys(s.file for s in atoms.values()):
        with open_safetensors(root / fname) as f:
            for name, s in atoms.items():
                if s.file == fname:
                    out[(name, None)] = (f.get_slice(s.name)[s.index] if s.index else f.get_tensor(s.name)).clone()
    return out


def import_hf(
    src_dir: str | Path,
    url: str,
    *,
    step: int = 0,
    dtype: str | torch.dtype | None = None,
    storage_options: dict[str, Any] | None = None,
    memory_budget: int = DEFAULT_MEMORY_BUDGET,
    workers: int = DEFAULT_WORKERS,
    progress: bool = False,
) -> ImportReport:
    """Write an HF Mixtral checkpoint as a weights-only ucp checkpoint (layout tp1pp1, no optimizer state) that
    any layout can load with ucp.distributed.load_sharded or ucp.interop.weights.load_weights.

    Names and shapes are checked before anything is written; the tensors then stream through in groups that
    fit `memory_budget`. A failed write leaves no committed step."""
    src = open_hf(src_dir)
    config, located = locate_hf_atoms(src)
    refuse_cast_of_quantised(config, dtype, str(src.root))
    dtype_of = kept_param_dtypes({n: s.dtype for n, s in located.items()}, parse_dtype(dtype))
    groups = pack({n: s.nbytes for n, s in located.items()}, group_limit(memory_budget))
    loads = [functools.partial(read_stored_atoms, src.root, {n: located[n] for n in g}) for g in groups]
    extra = {"hf_config": src.hf_extra, "source": {"format": "huggingface", "path": str(src.root.absolute())}}
    written = save_atoms(
        url,
        loads,
        step=step,
        model=ShardedModel(config, Layout(), optim_states=()),
        dtype_of=dtype_of,
        extra=extra,
        storage_options=storage_options,
        workers=workers,
        progress=progress,
    )
    return ImportReport(step, len(located), written)
