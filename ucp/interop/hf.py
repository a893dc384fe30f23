"""Hugging Face Mixtral checkpoints to and from ucp.

The on-disk Hugging Face format is config.json plus safetensors files named in model.safetensors.index.json,
with per-expert tensors `model.layers.{L}.block_sparse_moe.experts.{X}.w1/w2/w3.weight`. Those names are
exactly ucp's canonical atom names (docs/LOCAL_STATE.md), so export and import are renames of nothing: the
work is the config, sharding into files of bounded size, and refusing what is not a Mixtral. transformers >= 5
keeps experts fused in memory (`mlp.experts.gate_up_proj`, `down_proj`) but still reads and writes the per-expert
form on disk; import accepts both.

HF fields ucp's MixtralConfig does not model (rms_norm_eps, rope parameters, token ids, ...) travel in the
checkpoint's extra state under "hf_config", so an import followed by an export gives back the same config.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ucp.checkpoint import open_checkpoint
from ucp.distributed import ShardedModel, VirtualWorld, atom_path, extra_state, model_config_of
from ucp.families import MixtralConfig, canonical_atoms
from ucp.format import step_dirname
from ucp.interop.dtypes import parse_dtype, short_name
from ucp.interop.errors import InteropError, SourceMismatchError
from ucp.interop.staging import staged_dir
from ucp.layout import Layout
from ucp.reshard import shard
from ucp.storage import open_storage

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
DEFAULT_SHARD_BYTES = 1 << 30

# HF config keys that map one to one onto MixtralConfig fields.
_SHARED_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "num_local_experts", "num_experts_per_tok", "head_dim", "tie_word_embeddings")
# Keys that describe the file, not the model: never carried over.
_FILE_KEYS = ("architectures", "model_type", "dtype", "torch_dtype", "transformers_version", "_name_or_path")
# What an HF export says when the checkpoint carries no hf_config (the values of the reference trainer and of
# transformers' MixtralConfig defaults).
DEFAULT_HF_FIELDS: dict[str, Any] = {"hidden_act": "silu", "rms_norm_eps": 1e-5, "rope_theta": 1e6,
                                     "max_position_embeddings": 4096, "attention_dropout": 0.0}


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


def hf_config_from_ucp(config: MixtralConfig, hf_extra: dict[str, Any] | None, dtype: torch.dtype) -> dict[str, Any]:
    """config.json for transformers' MixtralForCausalLM."""
    doc: dict[str, Any] = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral"}
    doc.update(DEFAULT_HF_FIELDS)
    if hf_extra and "rope_parameters" in hf_extra:
        doc.pop("rope_theta")
    doc.update(hf_extra or {})
    doc.update({k: getattr(config, k) for k in _SHARED_KEYS})
    doc["dtype"] = short_name(dtype)
    return doc


def ucp_config_from_hf(doc: dict[str, Any], where: str) -> tuple[MixtralConfig, dict[str, Any]]:
    """MixtralConfig from an HF config.json, and the HF fields it does not model; refuses other architectures."""
    arch = doc.get("architectures") or []
    if doc.get("model_type") != "mixtral" or (arch and "MixtralForCausalLM" not in arch):
        raise SourceMismatchError(f"{where} describes model_type={doc.get('model_type')!r} architectures={arch}; "
                                  "ucp imports Hugging Face Mixtral checkpoints (model_type 'mixtral', MixtralForCausalLM)")
    if doc.get("hidden_act", "silu") != "silu":
        raise SourceMismatchError(f"{where}: hidden_act={doc['hidden_act']!r}, but ucp's Mixtral family is SwiGLU (silu)")
    missing = [k for k in _SHARED_KEYS if k not in doc and k not in ("head_dim", "tie_word_embeddings", "num_experts_per_tok")]
    if missing:
        raise InteropError(f"{where} lacks {missing}")
    fields = {k: doc[k] for k in _SHARED_KEYS if doc.get(k) is not None}
    try:
        config = MixtralConfig(**fields)
    except (TypeError, ValueError) as e:
        raise InteropError(f"{where}: {e}") from None
    extra = {k: v for k, v in doc.items() if k not in _SHARED_KEYS and k not in _FILE_KEYS}
    return config, extra


# ---------------------------------------------------------------------------------------------- export


def _plan_files(sizes: dict[str, int], max_bytes: int) -> list[list[str]]:
    """Consecutive atoms packed into files of at most max_bytes (an atom larger than that gets a file alone)."""
    files: list[list[str]] = [[]]
    used = 0
    for name, n in sizes.items():
        if files[-1] and used + n > max_bytes:
            files.append([])
            used = 0
        files[-1].append(name)
        used += n
    return [f for f in files if f]


def _progress(total: int, desc: str, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, disable=not enabled)


def export_hf(url: str, out_dir: str | Path, *, dtype: str | torch.dtype | None = None, step: int | str = "latest",
              storage_options: dict[str, Any] | None = None, max_shard_bytes: int = DEFAULT_SHARD_BYTES,
              progress: bool = False) -> ExportReport:
    """Write the parameters of a ucp checkpoint as a Hugging Face Mixtral directory (config.json, sharded
    safetensors and their index). Memory holds one safetensors file at a time; the directory appears whole
    or not at all. `dtype` casts every tensor (default: the stored dtype)."""
    from safetensors.torch import save_file

    reader = open_checkpoint(url, step, storage_options=storage_options)
    config = model_config_of(reader)
    if not isinstance(config, MixtralConfig):
        raise SourceMismatchError(f"{url} holds a {type(config).__name__} model; the HF export writes Mixtral")
    target = parse_dtype(dtype)
    names = list(canonical_atoms(config))
    metas = {n: reader.atoms[atom_path(n, None)] for n in names if atom_path(n, None) in reader.atoms}
    missing = [n for n in names if n not in metas]
    if missing:
        raise InteropError(f"step {reader.step} at {url} lacks parameter atoms {missing[:5]}")
    stored = {m.dtype for m in metas.values()}
    out_dtype = target or _torch_dtype_of(stored.pop() if len(stored) == 1 else "float32")
    itemsize = torch.empty((), dtype=out_dtype).element_size()
    sizes = {n: m.nbytes // m.itemsize * itemsize for n, m in metas.items()}
    files = _plan_files(sizes, max_shard_bytes)
    hf_extra = _hf_extra(reader)
    weight_map: dict[str, str] = {}
    written = 0
    with staged_dir(out_dir) as tmp, _progress(sum(sizes.values()), "export hf", progress) as bar:
        for k, group in enumerate(files):
            fname = f"model-{k + 1:05d}-of-{len(files):05d}.safetensors"
            tensors = reader.read_atoms([atom_path(n, None) for n in group])
            out = {n: tensors[atom_path(n, None)].to(out_dtype).contiguous() for n in group}
            del tensors
            save_file(out, str(tmp / fname), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(group, fname))
            written += sum(t.numel() * t.element_size() for t in out.values())
            bar.update(sum(sizes[n] for n in group))
            del out
        index = {"metadata": {"total_size": written}, "weight_map": weight_map}
        (tmp / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
        (tmp / "config.json").write_text(json.dumps(hf_config_from_ucp(config, hf_extra, out_dtype), indent=2) + "\n")
    return ExportReport(len(files), len(weight_map), written)


def _torch_dtype_of(zarr_name: str) -> torch.dtype:
    from ucp import dtypes

    return dtypes.torch_dtype(zarr_name)


def _hf_extra(reader: Any) -> dict[str, Any] | None:
    hf = extra_state(reader).get("hf_config")
    return hf if isinstance(hf, dict) else None


# ---------------------------------------------------------------------------------------------- import

_FUSED = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)")
_ROUTER = re.compile(r"model\.layers\.(\d+)\.mlp\.gate\.weight")
_IGNORED = re.compile(r"(.*\.rotary_emb\.inv_freq|.*\._extra_state)$")


@dataclass(frozen=True)
class HfSource:
    """An HF checkpoint directory: its config and where each tensor lives."""

    root: Path
    config: MixtralConfig
    hf_extra: dict[str, Any]
    weight_map: dict[str, str]  # tensor name -> file name


def open_hf(src_dir: str | Path) -> HfSource:
    root = Path(src_dir)
    cfg_path = root / "config.json"
    if not cfg_path.is_file():
        raise InteropError(f"{root} is not a Hugging Face checkpoint directory (no config.json)")
    try:
        doc = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise InteropError(f"{cfg_path} is not valid JSON: {e}") from None
    config, extra = ucp_config_from_hf(doc, str(cfg_path))
    if (root / INDEX_NAME).is_file():
        weight_map = json.loads((root / INDEX_NAME).read_text()).get("weight_map", {})
    elif (root / SINGLE_NAME).is_file():
        from safetensors import safe_open

        with safe_open(str(root / SINGLE_NAME), framework="pt") as f:
            weight_map = dict.fromkeys(f.keys(), SINGLE_NAME)
    else:
        raise InteropError(f"{root} has neither {INDEX_NAME} nor {SINGLE_NAME} (only safetensors are imported, never pickles)")
    for fname in sorted(set(weight_map.values())):
        if not (root / fname).is_file():
            raise InteropError(f"{root}/{INDEX_NAME} names {fname}, which is missing")
    return HfSource(root, config, extra, weight_map)


def _iter_tensors(src: HfSource) -> Iterator[tuple[str, torch.Tensor]]:
    """(canonical name, tensor) of every stored tensor, file by file, fused expert tensors split per expert."""
    from safetensors import safe_open

    by_file: dict[str, list[str]] = {}
    for name, fname in src.weight_map.items():
        by_file.setdefault(fname, []).append(name)
    ffn = src.config.intermediate_size
    for fname, names in by_file.items():
        with safe_open(str(src.root / fname), framework="pt") as f:
            for name in names:
                if _IGNORED.match(name):
                    continue
                if m := _ROUTER.fullmatch(name):
                    yield f"model.layers.{m[1]}.block_sparse_moe.gate.weight", f.get_tensor(name)
                elif m := _FUSED.fullmatch(name):
                    t = f.get_tensor(name)
                    base = f"model.layers.{m[1]}.block_sparse_moe.experts."
                    for x in range(t.shape[0]):
                        if m[2] == "gate_up_proj":
                            yield f"{base}{x}.w1.weight", t[x, :ffn]
                            yield f"{base}{x}.w3.weight", t[x, ffn:]
                        else:
                            yield f"{base}{x}.w2.weight", t[x]
                else:
                    yield name, f.get_tensor(name)


def read_hf_atoms(src: HfSource, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Every canonical atom of the model, checked against the config (names and shapes), in canonical order."""
    expected = {n: shape for n, (shape, _) in canonical_atoms(src.config).items()}
    atoms: dict[str, torch.Tensor] = {}
    unexpected = []
    for name, t in _iter_tensors(src):
        if name not in expected:
            if name == "lm_head.weight" and src.config.tie_word_embeddings:
                continue  # a tied copy saved anyway: the embedding is the atom
            unexpected.append(name)
            continue
        if tuple(t.shape) != expected[name]:
            raise InteropError(f"{src.root}: tensor {name} has shape {list(t.shape)}, but config.json implies {list(expected[name])}")
        atoms[name] = t.to(dtype) if dtype is not None else t
    if unexpected:
        raise SourceMismatchError(f"{src.root} holds tensors a Mixtral model does not have: {unexpected[:5]}"
                                  f"{' ...' if len(unexpected) > 5 else ''}")
    missing = [n for n in expected if n not in atoms]
    if missing:
        raise InteropError(f"{src.root} lacks tensors {missing[:5]}{' ...' if len(missing) > 5 else ''} "
                           f"({len(missing)} of {len(expected)} missing)")
    return {n: atoms[n].contiguous() for n in expected}


def import_hf(src_dir: str | Path, url: str, *, step: int = 0, dtype: str | torch.dtype | None = None,
              storage_options: dict[str, Any] | None = None) -> ImportReport:
    """Write an HF Mixtral checkpoint as a weights-only ucp checkpoint (layout tp1pp1, no optimizer state) that
    any layout can load with ucp.distributed.load_sharded or ucp.interop.weights.load_weights.

    Everything is read and checked before anything is written; a failed write leaves no committed step."""
    src = open_hf(src_dir)
    atoms = read_hf_atoms(src, parse_dtype(dtype))
    layout = Layout()
    model = ShardedModel(src.config, layout, optim_states=())
    local = shard({"model": atoms}, src.config, layout, 0, ())
    nbytes = sum(t.numel() * t.element_size() for t in atoms.values())
    del atoms
    storage = open_storage(url, storage_options)
    extra = {"hf_config": src.hf_extra, "source": {"format": "huggingface", "path": str(src.root.absolute())}}
    try:
        VirtualWorld(1).save([local], url, step=step, model=model, extra=extra, storage=storage)
    except BaseException:
        from ucp import commit

        if commit.read_marker(storage, step) is None:
            storage.delete(step_dirname(step))  # never committed: leave nothing behind
        raise
    return ImportReport(step, len(canonical_atoms(src.config)), nbytes)
