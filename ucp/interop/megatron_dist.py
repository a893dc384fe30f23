"""Megatron's torch_dist format (megatron-core `dist_checkpointing`, Megatron-LM's default `--ckpt-format`), read
and written by `ucp convert --from torch_dist` / `--to torch_dist`.

An iteration directory of this format holds `metadata.json` ({"sharded_backend": "torch_dist", ...}),
`common.pt` (torch.save of what is not sharded: args, iteration, checkpoint_version, opt_param_scheduler) and a
torch.distributed.checkpoint: `.metadata` and `__R_I.distcp` files whose items are torch.save blobs, one per
saved chunk of a global tensor. The global tensors are named by megatron-core's sharded state dict keys and are
layout-free: a decoder tensor has the layer axis prepended (global layer numbers, whatever PP and VPP were), an
expert tensor the expert axis too (`decoder.layers.mlp.experts.experts.*`, [layers, experts, ...]); TP shards
are placed in TP order, so QKV holds its query groups in order and SwiGLU's fc1 holds gate then up. Slicing a
global tensor at (layer[, expert]) therefore gives exactly the tensor of a tp1pp1 rank file of the legacy torch
format, and that is how this module reads one: as a Megatron source in layout tp1pp1 whose tensors are those
slices, so every conversion of the legacy format (to another layout, to ucp, back) applies unchanged. A slice
is read from the bytes of the chunks it overlaps only (a layer of a chunk [layers, ...] is one byte range).

Layer norms have two spellings, by layer spec: the local spec keeps `input_layernorm` / `pre_mlp_layernorm`
in the file under the TE spec's fused names (`self_attention.linear_qkv.layer_norm_weight`,
`mlp.linear_fc1.layer_norm_weight`), while TE's MoE layers keep `pre_mlp_layernorm`. Reading takes whichever is
there; writing writes both, so that a job of either spec loads the result.

Nothing here unpickles without an allowlist: `.metadata` goes through ucp.interop.dcp's metadata unpickler,
`common.pt` and every tensor blob through torch's weights-only unpickler. The distributed optimizer's state is
read when saved `fully_reshardable` (model space: each state a global tensor keyed and sharded like its parameter);
in its other forms it is not carried, nor are the RNG states (named in the report's `dropped`).
"""

from __future__ import annotations

import io
import json
import os
import pickle
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ucp.boxes import Box, box_numel, box_shape, intersect, relative, to_slices
from ucp.families import DeepseekV3Config
from ucp.interop.dcp import METADATA, read_metadata
from ucp.interop.errors import InteropError, SourceMismatchError
from ucp.interop.megatron_distrib_optim import MOMENTS, STATE_OF
from ucp.interop.megatron_optimizer import LocalOptimState, OptimizerMeta, identifier
from ucp.interop.torch_file import TorchFile
from ucp.layout import Layout
from ucp.reshard import LocalTensor, local_params, local_plan

TORCH_DIST = "torch_dist"
METADATA_JSON = "metadata.json"
COMMON = "common.pt"
DATA_FILE = "__0_0.distcp"  # what ucp writes: one file, one chunk per layer (and expert)
BACKEND = {
    "sharded_backend": TORCH_DIST,
    "sharded_backend_version": 1,
    "common_backend": "torch",
    "common_backend_version": 1,
}

_LAYER = re.compile(r"decoder\.layers\.(\d+)\.(.+)")
_EXPERT = re.compile(r"mlp\.experts\.local_experts\.(\d+)\.(.+)")
_NORMS = (  # legacy (local spec) name prefix -> the fused spelling megatron-core's local spec saves it under
    ("input_layernorm.", "self_attention.linear_qkv.layer_norm_"),
    ("pre_mlp_layernorm.", "mlp.linear_fc1.layer_norm_"),
)


def is_torch_dist(iter_dir: Path) -> bool:
    return (iter_dir / METADATA_JSON).is_file()


@dataclass(frozen=True)
class DistName:
    """Where a tensor of a tp1pp1 rank file lives in torch_dist: the global key (spellings, the first preferred
    for reading) and its index on the prepended axes (layer, or layer and expert; () for the others)."""

    keys: tuple[str, ...]
    index: tuple[int, ...]


def per_layer_keys(config: Any) -> bool:
    """Whether ucp writes the model's layers under keys of their own (`decoder.layers.{L}.…`) instead of stacked on a
    prepended layer axis, as megatron-core does when the layers differ (a `moe_layer_freq` list, which ucp's args
    give DeepSeek-V3 for its dense first layers). A reader goes by the keys it finds."""
    return isinstance(config, DeepseekV3Config)


def dist_name(name: str, per_layer: bool = False) -> DistName:
    """The torch_dist key(s) and index of a tensor of a tp1pp1 legacy rank file (e.g. decoder.layers.3.mlp...);
    `per_layer`: the layers are keyed each on its own (`per_layer_keys`), only experts on a prepended axis."""
    m = _LAYER.fullmatch(name)
    if m is None:
        return DistName((name,), ())
    index: tuple[int, ...] = () if per_layer else (int(m[1]),)
    rest = m[2]
    expert = _EXPERT.fullmatch(rest)
    if expert is not None:
        index, rest = (*index, int(expert[1])), f"mlp.experts.experts.{expert[2]}"
    spellings = [rest]
    for legacy, fused in _NORMS:
        if rest.startswith(legacy):
            spellings = [fused + rest[len(legacy) :], rest]
    prefix = f"decoder.layers.{m[1]}." if per_layer else "decoder.layers."
    return DistName(tuple(prefix + s for s in spellings), index)


# ------------------------------------------------------------------------------------------- reading


def _check_item_path(root: Path, relative_path: Any, key: str) -> Path:
    """A .distcp file named by the metadata: a plain file name in the iteration directory, nothing else."""
    if (
        not isinstance(relative_path, str)
        or not re.fullmatch(r"[A-Za-z0-9_.-]+", relative_path)
        or relative_path in (".", "..")
    ):
        raise InteropError(f"{root / METADATA}: {key} names the data file {relative_path!r:.80}, not a file beside it")
    return root / relative_path


@dataclass
class DistTensors:
    """The reader of a torch_dist source (megatron.TensorFile): each meta tensor it hands out is the slice at
    `index` of a global tensor; `read` assembles it from the bytes of the chunks it overlaps."""

    root: Path
    metadata: Any
    where: dict[int, tuple[str, tuple[int, ...], torch.Tensor]] = field(default_factory=dict)  # id -> key, index, t
    blobs: dict[tuple[str, tuple[int, ...]], TorchFile] = field(default_factory=dict)  # chunks opened and checked

    def tensor(self, key: str, index: tuple[int, ...], shape: tuple[int, ...]) -> torch.Tensor:
        dtype = self.metadata.state_dict_metadata[key].properties.dtype
        t = torch.empty(shape, dtype=dtype, device="meta")
        self.where[id(t)] = (key, index, t)
        return t

    def read(self, t: torch.Tensor) -> torch.Tensor:
        key, index, _ = self.where[id(t)]
        entry = self.metadata.state_dict_metadata[key]
        rest = entry.size[len(index) :]
        # rows past the stored ones (a vocabulary padded further than the saving job's) stay zero
        box: Box = tuple((i, i + 1) for i in index) + tuple((0, min(n, g)) for n, g in zip(t.shape, rest))
        out = torch.zeros(t.shape, dtype=t.dtype)
        covered = 0
        for chunk in entry.chunks:
            chunk_box: Box = tuple((o, o + n) for o, n in zip(chunk.offsets, chunk.sizes))
            part = intersect(box, chunk_box)
            if part is None:
                continue
            blob = self._blob(key, chunk, t.dtype)
            values = blob.read(blob.obj[to_slices(relative(part, chunk_box))])
            target = relative(part, box)[len(index) :]
            out[to_slices(target)] = values.reshape(box_shape(target))
            covered += values.numel()
        if covered != box_numel(box):
            raise InteropError(
                f"{self.root}: the chunks of {key} do not cover its slice {list(index)} ({covered} of {box_numel(box)} elements)"
            )
        return out

    def _blob(self, key: str, chunk: Any, dtype: torch.dtype) -> TorchFile:
        """A chunk's torch.save blob, opened (its pickle read) and checked against the metadata once."""
        from torch.distributed.checkpoint.metadata import MetadataIndex

        at = (key, tuple(chunk.offsets))
        if at in self.blobs:
            return self.blobs[at]
        info = self.metadata.storage_data.get(MetadataIndex(key, chunk.offsets))
        if info is None:
            raise InteropError(f"{self.root / METADATA}: no data file is named for a chunk of {key}")
        if getattr(info, "transform_descriptors", None):
            raise InteropError(
                f"{self.root / METADATA}: {key} is stored with transforms {info.transform_descriptors}, which ucp does not read"
            )
        path = _check_item_path(self.root, info.relative_path, key)
        try:
            blob = TorchFile(path, info.offset, info.length)
        except (RuntimeError, ValueError, OSError, pickle.UnpicklingError) as e:
            raise InteropError(f"{path}: the chunk of {key} at {list(chunk.offsets)} is unreadable: {e}") from None
        stored = blob.obj
        if not isinstance(stored, torch.Tensor) or tuple(stored.shape) != tuple(chunk.sizes) or stored.dtype != dtype:
            raise InteropError(
                f"{path}: the chunk of {key} at {list(chunk.offsets)} is not the {list(chunk.sizes)} "
                f"{dtype} tensor the metadata says"
            )
        self.blobs[at] = blob
        return blob


def read_common(iter_dir: Path) -> dict[str, Any]:
    from ucp.interop.megatron import open_torch_file

    path = iter_dir / COMMON
    if not path.is_file():
        raise InteropError(f"{iter_dir} is not a whole torch_dist checkpoint: no {COMMON}")
    data, file = open_torch_file(path)
    if not isinstance(data, dict):
        raise InteropError(f"{path} holds a {type(data).__name__}, not Megatron's common state dict")
    return {
        k: (file.read(v) if isinstance(v, torch.Tensor) and v.device.type == "meta" else v) for k, v in data.items()
    }


def _check_backend(iter_dir: Path) -> None:
    path = iter_dir / METADATA_JSON
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise InteropError(f"{path} is unreadable: {e}") from None
    backend = doc.get("sharded_backend") if isinstance(doc, dict) else None
    if backend != TORCH_DIST:
        raise InteropError(f"{path}: sharded backend {backend!r}; ucp reads Megatron's torch_dist format only")


def open_torch_dist(src: str | Path, *, iteration: int | None = None, vocab_size: int | None = None) -> Any:
    """A Megatron torch_dist checkpoint, opened as a MegatronSource in layout tp1pp1 (see the module docstring).
    The layout it was saved in is not needed: its args name it, and the metadata's global shapes are checked
    against the model the args describe."""
    from ucp.interop import megatron as m

    root = Path(src)
    if (root / "zarr.json").is_file():
        raise SourceMismatchError(f"{root} is a ucp checkpoint, not a Megatron one: use --from universal")
    it, iter_dir = m.iteration_dir(root, iteration)
    if not iter_dir.is_dir():
        raise InteropError(f"{iter_dir} does not exist (iteration {it} of {root})")
    if not is_torch_dist(iter_dir):
        raise SourceMismatchError(
            f"{iter_dir} is not in the torch_dist format (no {METADATA_JSON}): give the layout of its rank files to --from"
        )
    _check_backend(iter_dir)
    metadata = read_metadata(iter_dir)
    common = read_common(iter_dir)
    args = common.get("args")
    if args is None:
        raise InteropError(f"{iter_dir / COMMON} holds no args: ucp needs them for the model's shape")
    config, hf = m.config_from_args(args, str(iter_dir / COMMON), vocab_size)
    tensors = DistTensors(iter_dir, metadata)
    entries = metadata.state_dict_metadata
    chunk: dict[str, torch.Tensor] = {}
    used: set[str] = set()
    per_layer = any(k.startswith("decoder.layers.0.") for k in entries)
    for lt in local_plan(config, Layout(), 0, ()):
        name = lt.key[1]
        where = dist_name(name, per_layer)
        key = next((k for k in where.keys if k in entries), None)
        if key is None:
            raise InteropError(f"{iter_dir}: no tensor {' or '.join(where.keys)} (for {name}) in its metadata")
        chunk[name] = tensors.tensor(key, where.index, lt.shape)
        used.update(where.keys)  # (a second spelling, as ucp writes norms, is the same tensor)
        _check_global(iter_dir, key, entries[key], where.index, lt, config, per_layer)
    unknown = sorted(
        k
        for k, e in entries.items()
        if hasattr(e, "size") and k not in used and not _OPTIMIZER.match(k) and not k.startswith("rng_state")
    )
    if unknown:
        raise InteropError(f"{iter_dir}: tensors ucp cannot map to {type(config).__name__} atoms: {unknown[:4]}")
    optimizer = _read_optimizer(iter_dir, common, config, tensors, chunk)
    has_optimizer = any(_OPTIMIZER.match(k) for k in entries)
    not_carried = tuple(
        name
        for name, present in (
            ("optimizer", has_optimizer and optimizer is None),
            ("rng_state", any(k.startswith("rng_state") for k in entries)),
        )
        if present
    )
    files = {0: {"model": chunk} | {k: common[k] for k in ("args", "iteration", "opt_param_scheduler") if k in common}}
    source = m.MegatronSource(
        root, it, Layout(), config, args, hf, files, {0: iter_dir / METADATA}, {0: tensors}, not_carried=not_carried
    )
    if optimizer is not None:
        source.optimizer, source.optim_state[0] = optimizer[1], optimizer[0]
    return source


_OPTIMIZER = re.compile(r"(chained_\d+\.)?optimizer\.")
FULLY_RESHARDABLE = "fully_reshardable"


def _read_optimizer(
    iter_dir: Path, common: dict[str, Any], config: Any, tensors: DistTensors, chunk: dict[str, torch.Tensor]
) -> tuple[LocalOptimState, OptimizerMeta] | None:
    """The distributed optimizer's state saved `fully_reshardable` (megatron-core's model-space form: per
    parameter `[chained_I.]optimizer.state.{param,exp_avg,exp_avg_sq}.<the parameter's key>`, sharded exactly like
    the parameter) as the tp1pp1 view's local optimizer state; None when the checkpoint has no optimizer or saved it
    in another form (`dp_reshardable`, Megatron-LM's default, keeps each source rank's flat buckets and is listed
    as not carried)."""
    entry = common.get("optimizer")
    if not isinstance(entry, dict):
        return None
    # a ChainedOptimizer of several (dense, expert) keeps each under its index
    chained = bool(entry) and all(isinstance(k, int) for k in entry)
    subs: list[dict[str, Any]] = [entry[k] for k in sorted(entry)] if chained else [entry]
    if any(not isinstance(sub, dict) or sub.get("param_state_sharding_type") != FULLY_RESHARDABLE for sub in subs):
        return None
    entries = tensors.metadata.state_dict_metadata
    # each state's key without the ChainedOptimizer's "chained_I." (one optimizer holds each parameter)
    optimizer_keys = {re.sub(r"^chained_\d+\.", "", k): k for k in entries if _OPTIMIZER.match(k)}
    state: LocalOptimState = {}
    for p in local_params(config, Layout(), Layout().coords(0)):
        if not p.parameter:
            continue  # (a buffer: no optimizer state)
        model_key, index, _ = tensors.where[id(chunk[p.name])]
        for stored, name in STATE_OF.items():
            unprefixed = f"optimizer.state.{stored}.{model_key}"
            key = optimizer_keys.get(unprefixed)
            if key is None:
                raise InteropError(
                    f"{iter_dir}: no {unprefixed} in its metadata, but its optimizer is {FULLY_RESHARDABLE}"
                )
            if tuple(entries[key].size) != tuple(entries[model_key].size):
                raise InteropError(
                    f"{iter_dir}: {key} has global shape {list(entries[key].size)}, its parameter "
                    f"{list(entries[model_key].size)}"
                )
            state.setdefault(p.chunk_key, {}).setdefault(p.name, {})[name] = tensors.tensor(key, index, p.shape)
    groups: dict[Any, dict[str, Any]] = {}
    scaler = None
    for one in subs:
        inner = one.get("optimizer")
        saved = inner.get("param_groups") if isinstance(inner, dict) else None
        if not isinstance(saved, list):
            raise InteropError(f"{iter_dir / COMMON}: its optimizer entry has no param groups")
        groups.update({identifier(g): dict(g) for g in saved})
        scaler = one.get("grad_scaler", scaler)
    from ucp.interop.megatron import distributed_buffers

    meta = OptimizerMeta(
        True, MOMENTS, groups=groups, grad_scaler=scaler, distributed=distributed_buffers(common["args"])
    )
    return state, meta


def _check_global(
    iter_dir: Path, key: str, entry: Any, index: tuple[int, ...], lt: LocalTensor, config: Any, per_layer: bool
) -> None:
    """The metadata's global shape is the model's: prepended axes that hold the index, then the tp1 tensor's
    shape (rows of a vocabulary-sized tensor: at least the real vocabulary)."""
    size = tuple(entry.size)
    lead, rest = size[: len(index)], size[len(index) :]
    vocab = key in ("embedding.word_embeddings.weight", "output_layer.weight")
    fits = (
        len(size) == len(index) + len(lt.shape)
        and all(0 <= i < n for i, n in zip(index, lead))
        and (rest[1:] == lt.shape[1:] and rest[0] >= config.vocab_size if vocab else rest == lt.shape)
        and lead == _prepended(config, index, per_layer)
    )
    if not fits:
        raise InteropError(
            f"{iter_dir}: {key} has global shape {list(size)}, but the args describe a model whose "
            f"{lt.key[1]} is {list(lt.shape)} (in {config.num_hidden_layers} layers)"
        )


# ------------------------------------------------------------------------------------------- writing


@dataclass
class _DataFile:
    """`__0_0.distcp` being written: torch.save blobs appended, their places recorded for `.metadata`."""

    f: Any
    state_dict_metadata: dict[str, Any] = field(default_factory=dict)
    storage_data: dict[Any, Any] = field(default_factory=dict)

    def _append(self, data: bytes) -> tuple[int, int]:
        offset = self.f.tell()
        self.f.write(data)
        return offset, len(data)

    def tensor(self, key: str, global_shape: tuple[int, ...], offsets: tuple[int, ...], t: torch.Tensor) -> None:
        from torch.distributed.checkpoint.filesystem import _StorageInfo
        from torch.distributed.checkpoint.metadata import (
            ChunkStorageMetadata,
            MetadataIndex,
            TensorProperties,
            TensorStorageMetadata,
        )

        buf = io.BytesIO()
        torch.save(t.contiguous(), buf)
        offset, length = self._append(buf.getvalue())
        entry = self.state_dict_metadata.setdefault(
            key, TensorStorageMetadata(TensorProperties(dtype=t.dtype), torch.Size(global_shape), [])
        )
        entry.chunks.append(ChunkStorageMetadata(torch.Size(offsets), t.shape))
        self.storage_data[MetadataIndex(key, torch.Size(offsets))] = _StorageInfo(DATA_FILE, offset, length)

    def obj(self, key: str, value: Any) -> None:
        from torch.distributed.checkpoint.filesystem import _StorageInfo
        from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

        buf = io.BytesIO()
        torch.save(value, buf)
        offset, length = self._append(buf.getvalue())
        self.state_dict_metadata[key] = BytesStorageMetadata()
        self.storage_data[MetadataIndex(key)] = _StorageInfo(DATA_FILE, offset, length)


def _prepended(config: Any, index: tuple[int, ...], per_layer: bool = False) -> tuple[int, ...]:
    """The global sizes of the prepended axes: layers (unless each layer has keys of its own), then experts."""
    axes = (() if per_layer else (config.num_hidden_layers,)) + (getattr(config, "num_local_experts", 0),)
    return axes[: len(index)]


def write_torch_dist(
    dst: str | Path,
    target: Any,  # megatron._TargetFiles of layout tp1pp1
    produce: Callable[[int, LocalTensor], torch.Tensor],
    dtype_of: Callable[[LocalTensor], torch.dtype],
    progress: bool,
) -> tuple[int, int]:
    """A torch_dist checkpoint at DST (which appears only when whole): one chunk per tp1 tensor (a layer, an expert
    of a layer, or a whole tensor), each produced and written in turn, so memory holds one at a time. Megatron
    loads it in any layout (its reader reshards). Returns (files, bytes of tensors written)."""
    from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
    from tqdm import tqdm

    from ucp.interop.megatron import CHECKPOINT_VERSION, EXTRA_STATE_OWNERS, TRACKER
    from ucp.interop.staging import staged_dir

    plan = local_plan(target.config, Layout(), 0, ())
    written = 0
    with staged_dir(dst) as tmp:
        iter_dir = tmp / f"iter_{target.iteration:07d}"
        iter_dir.mkdir(parents=True)
        with (
            open(iter_dir / DATA_FILE, "wb") as f,
            tqdm(total=len(plan), desc="write torch_dist", unit="tensor", disable=not progress) as bar,
        ):
            data = _DataFile(f)
            per_layer = per_layer_keys(target.config)
            for lt in plan:
                where = dist_name(lt.key[1], per_layer)
                t = produce(0, lt).to(dtype_of(lt))
                lead = _prepended(target.config, where.index, per_layer)
                for key in where.keys:
                    data.tensor(
                        key,
                        lead + tuple(t.shape),
                        where.index + (0,) * t.dim(),
                        t.reshape((1,) * len(lead) + tuple(t.shape)),
                    )
                written += t.numel() * t.element_size()
                owner = where.keys[0].removesuffix(".weight")
                if lt.key[1].endswith(".weight") and owner.endswith(EXTRA_STATE_OWNERS):
                    # megatron-core's ShardedObject for the layer's extra state (None without Transformer Engine)
                    shard = (where.index, lead) if where.index else ((0,), (1,))
                    data.obj(
                        f"{owner}._extra_state/shard_{'.'.join(map(str, shard[0]))}_{'.'.join(map(str, shard[1]))}",
                        [None],
                    )
                del t
                bar.update(1)
            f.flush()
            os.fsync(f.fileno())
        metadata = Metadata(data.state_dict_metadata, storage_data=data.storage_data, storage_meta=StorageMeta())
        (iter_dir / METADATA).write_bytes(pickle.dumps(metadata))
        common: dict[str, Any] = {
            "args": target.args,
            "checkpoint_version": CHECKPOINT_VERSION,
            "iteration": target.iteration,
        }
        if target.scheduler is not None:
            common["opt_param_scheduler"] = target.scheduler
        torch.save(common, iter_dir / COMMON)
        (iter_dir / METADATA_JSON).write_text(json.dumps(BACKEND))
        (tmp / TRACKER).write_text(f"{target.iteration}\n")  # last: Megatron finds the iteration only once it is whole
    return 1, written
