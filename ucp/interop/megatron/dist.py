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
`common.pt` and every tensor blob or object through torch's weights-only unpickler. The distributed optimizer's
state is read in both forms megatron-core 0.16 saves: `fully_reshardable` (model space: each state a global tensor
keyed and sharded like its parameter) and `dp_reshardable` (Megatron-LM's default: each model-parallel rank's grad
buffer buckets as flat tensors, placed by megatron-core's buffer layout rebuilt from the saving layout). Other,
deprecated forms are not carried, nor are the RNG states (named in the report's `dropped`). Written, a distributed
optimizer takes the `fully_reshardable` form (`write_torch_dist`, `common_optimizer_entry`).
"""

from __future__ import annotations

import argparse
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

from ...base.boxes import Box, box_numel, box_shape, full_box, intersect, relative, to_slices, translate
from ...errors import UcpError
from ...sharding.families import FamilyConfig, family_for
from ...sharding.families.megatron_names import arg
from ...sharding.layout import Layout
from ...sharding.reshard import LocalParam, LocalTensor, Piece, local_params, local_plan
from ..dcp import METADATA, read_metadata
from ..errors import InteropError, SourceMismatchError
from ..paths import file_beside
from ..staging import staged_dir
from ..torch_file import TorchFile
from .args import args_for, args_layout, bucket_size_of, check_even_stages, config_from_args, distributed_buffers
from .distrib_optim import BUCKET_ALIGNMENT, MOMENTS, STATE_OF, grad_buffers, optimizer_entry
from .files import open_torch_file
from .optimizer import (
    LocalOptimState,
    OptimizerMeta,
    check_known_groups,
    check_param_groups,
    identifier,
    model_param_groups,
    param_groups,
)
from .save import (
    CHECKPOINT_VERSION,
    METADATA_JSON,
    TORCH_DIST,
    TRACKER,
    extra_state_owner,
    is_torch_dist,
    iteration_dir,
)
from .source import MegatronSource
from .target import Produce, TargetFiles

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


@dataclass(frozen=True)
class DistName:
    """Where a tensor of a tp1pp1 rank file lives in torch_dist: the global key (spellings, the first preferred
    for reading) and its index on the prepended axes (layer, or layer and expert; () for the others)."""

    keys: tuple[str, ...]
    index: tuple[int, ...]


def per_layer_keys(config: FamilyConfig) -> bool:
    """Whether ucp writes the model's layers under keys of their own (`decoder.layers.{L}.…`) instead of stacked on a
    prepended layer axis, as megatron-core does when the layers differ (a `moe_layer_freq` list, which ucp's args
    give DeepSeek-V3 for its dense first layers). A reader goes by the keys it finds."""
    names = family_for(config).megatron
    return names is not None and names.layers_apart


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


@dataclass(frozen=True)
class FlatPart:
    """Where some of a tensor lies in a flat global tensor (a bucket of the dp_reshardable optimizer form): a
    source rank's parameter of `shape` starts at element `start` of `key`; each (region, target) of `moves` copies
    that region of it to that box of the tensor."""

    key: str
    start: int
    shape: tuple[int, ...]
    moves: tuple[tuple[Box, Box], ...]


@dataclass
class DistTensors:
    """The reader of a torch_dist source (source.TensorFile): each meta tensor it hands out is the slice at
    `index` of a global tensor (`tensor`) or is assembled from parts of flat ones (`assembled`); `read` fills it
    from the bytes of the chunks it overlaps."""

    root: Path
    metadata: Any
    where: dict[int, tuple[str, tuple[int, ...], torch.Tensor]] = field(default_factory=dict)  # id -> key, index, t
    parts: dict[int, tuple[tuple[FlatPart, ...], torch.Tensor]] = field(default_factory=dict)  # id -> parts, t
    blobs: dict[tuple[str, tuple[int, ...]], TorchFile] = field(default_factory=dict)  # chunks opened and checked

    def tensor(self, key: str, index: tuple[int, ...], shape: tuple[int, ...]) -> torch.Tensor:
        dtype = self.metadata.state_dict_metadata[key].properties.dtype
        t = torch.empty(shape, dtype=dtype, device="meta")
        self.where[id(t)] = (key, index, t)
        return t

    def assembled(self, shape: tuple[int, ...], parts: tuple[FlatPart, ...]) -> torch.Tensor:
        t = torch.empty(shape, dtype=torch.float32, device="meta")
        self.parts[id(t)] = (parts, t)
        return t

    def read(self, t: torch.Tensor) -> torch.Tensor:
        if id(t) in self.parts:
            out = torch.zeros(t.shape, dtype=t.dtype)
            for part in self.parts[id(t)][0]:
                numel = box_numel(full_box(part.shape))
                span = (part.start, part.start + numel)
                flat = self._region(part.key, (span,), (numel,), t.dtype, f"elements [{span[0]}, {span[1]})")
                for region, target in part.moves:
                    out[to_slices(target)] = flat.view(part.shape)[to_slices(region)]
            return out
        key, index, _ = self.where[id(t)]
        rest = self.metadata.state_dict_metadata[key].size[len(index) :]
        # rows past the stored ones (a vocabulary padded further than the saving job's) stay zero
        box: Box = tuple((i, i + 1) for i in index) + tuple((0, min(n, g)) for n, g in zip(t.shape, rest))
        out = torch.zeros(t.shape, dtype=t.dtype)
        shape = box_shape(box[len(index) :])
        out[to_slices(box[len(index) :])] = self._region(key, box, shape, t.dtype, f"slice {list(index)}")
        return out

    def _region(self, key: str, box: Box, shape: tuple[int, ...], dtype: torch.dtype, what: str) -> torch.Tensor:
        """The values of `box` of global tensor `key` (`what` names it), assembled from the chunks it overlaps,
        shaped `shape`."""
        out = torch.empty(box_shape(box), dtype=dtype)
        covered = 0
        for chunk in self.metadata.state_dict_metadata[key].chunks:
            chunk_box: Box = tuple((o, o + n) for o, n in zip(chunk.offsets, chunk.sizes))
            part = intersect(box, chunk_box)
            if part is None:
                continue
            blob = self._blob(key, chunk, dtype)
            out[to_slices(relative(part, box))] = blob.read(blob.obj[to_slices(relative(part, chunk_box))])
            covered += box_numel(part)
        if covered != box_numel(box):
            raise InteropError(
                f"{self.root}: the chunks of {key} do not cover its {what} ({covered} of {box_numel(box)} elements)"
            )
        return out.view(shape)

    def obj(self, key: str) -> Any:
        """A ShardedObject's value (its torch.save blob, through the weights-only unpickler); None if absent."""
        from torch.distributed.checkpoint.metadata import MetadataIndex

        info = self.metadata.storage_data.get(MetadataIndex(key))
        if info is None:
            return None
        path = file_beside(self.root / METADATA, info.relative_path, key)
        try:
            value = TorchFile(path, info.offset, info.length).obj
        except (RuntimeError, ValueError, OSError, pickle.UnpicklingError) as e:
            raise InteropError(f"{path}: the object {key} is unreadable: {e}") from None
        # (megatron-core's torch_dist strategy stores a ShardedObject's value in a list of one)
        return value[0] if isinstance(value, list) and len(value) == 1 else value

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
        path = file_beside(self.root / METADATA, info.relative_path, key)
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


def open_torch_dist(
    src: str | Path,
    *,
    iteration: int | None = None,
    vocab_size: int | None = None,
    model_config: str | Path | None = None,
) -> MegatronSource:
    """A Megatron torch_dist checkpoint, opened as a MegatronSource in layout tp1pp1 (see the module docstring).
    `src`: a Megatron-LM save root (its tracker names the latest iteration, `iteration` another) or one
    dist_checkpointing directory itself (`iter_NNNNNNN`, or any directory with metadata.json). The layout it was
    saved in is not needed: its args name it, and the metadata's global shapes are checked against the model the
    args describe. A directory saved without Megatron-LM's args (megatron-core's dist_checkpointing alone) needs the
    model's shape from `model_config` (`model_shape`)."""
    root = Path(src)
    if (root / "zarr.json").is_file():
        raise SourceMismatchError(f"{root} is a ucp checkpoint, not a Megatron one: use --from universal")
    if is_torch_dist(root) and not (root / TRACKER).is_file():  # (the iteration's directory itself)
        named = re.fullmatch(r"iter_(\d+)", root.name)
        it, iter_dir = int(named[1]) if named else -1, root
        if iteration is not None and iteration != it:
            raise InteropError(f"--iteration {iteration}, but {root} is a torch_dist checkpoint of its own")
    else:
        it, iter_dir = iteration_dir(root, iteration)
    if not iter_dir.is_dir():
        raise InteropError(f"{iter_dir} does not exist (iteration {it} of {root})")
    if not is_torch_dist(iter_dir):
        raise SourceMismatchError(
            f"{iter_dir} is not in the torch_dist format (no {METADATA_JSON}): give the layout of its rank files to --from"
        )
    _check_backend(iter_dir)
    metadata = read_metadata(iter_dir)
    common = read_common(iter_dir)
    if it < 0:  # (a directory of another name: the iteration its common state says, else 0)
        saved = common.get("iteration")
        it = saved if isinstance(saved, int) else 0
        common.setdefault("iteration", it)
    args, config, hf = model_shape(common.get("args"), iter_dir / COMMON, model_config, vocab_size)
    common["args"] = args
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
    source = MegatronSource(
        root, it, Layout(), config, args, hf, files, {0: iter_dir / METADATA}, {0: tensors}, not_carried=not_carried
    )
    if optimizer is not None:
        source.optimizer, source.optim_state[0] = optimizer[1], optimizer[0]
    return source


def model_shape(
    args: Any, common: Path, model_config: str | Path | None, vocab_size: int | None
) -> tuple[Any, FamilyConfig, dict[str, Any]]:
    """(Megatron args, family config, HF fields) of a torch_dist checkpoint: from the args Megatron-LM saves in
    common.pt or, for one saved without them (megatron-core's dist_checkpointing alone), from `model_config`: a
    Hugging Face config.json of the model, or a JSON object of the job's Megatron-LM arguments (`num_layers`,
    `hidden_size`, ...: what `args.config_from_args` reads)."""
    from ..hf import ucp_config_from_hf

    if model_config is None:
        if args is None:
            raise InteropError(
                f"{common} holds no Megatron-LM args (a dist_checkpointing save outside Megatron-LM), so the model's "
                "shape is unknown: give it with --config FILE, the model's Hugging Face config.json or a JSON object "
                "of the job's Megatron-LM arguments (num_layers, hidden_size, num_attention_heads, ...)"
            )
        config, hf = config_from_args(args, str(common), vocab_size)
        return args, config, hf
    if args is not None:
        raise InteropError(
            f"--config {model_config}: {common} holds Megatron-LM's args, which give the model's shape already"
        )
    path = Path(model_config)
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise InteropError(f"--config {path}: not a readable JSON file ({e})") from None
    if isinstance(doc, dict) and ("model_type" in doc or "architectures" in doc):
        config, hf = ucp_config_from_hf(doc, str(path))
        try:
            return args_for(config, Layout(), hf=hf), config, hf
        except UcpError as e:
            raise InteropError(f"--config {path}: {e}") from None
    if isinstance(doc, dict) and {"num_layers", "hidden_size"} <= set(doc):
        args = argparse.Namespace(**doc)
        config, hf = config_from_args(args, str(path), vocab_size)
        return args, config, hf
    raise InteropError(
        f"--config {path}: neither a Hugging Face config.json (model_type) nor Megatron-LM arguments (num_layers, "
        "hidden_size)"
    )


_OPTIMIZER = re.compile(r"(chained_\d+\.)?optimizer\.")
FULLY_RESHARDABLE = "fully_reshardable"
DP_RESHARDABLE = "dp_reshardable"


def _read_optimizer(
    iter_dir: Path, common: dict[str, Any], config: FamilyConfig, tensors: DistTensors, chunk: dict[str, torch.Tensor]
) -> tuple[LocalOptimState, OptimizerMeta] | None:
    """The distributed optimizer's state as the tp1pp1 view's local optimizer state, from either form megatron-core
    0.16 saves: `fully_reshardable` (model space) or `dp_reshardable` (each source rank's flat buckets, Megatron-LM's
    default). None when the checkpoint has no optimizer or saved it in another form (listed as not carried)."""
    entry = common.get("optimizer")
    if not isinstance(entry, dict):
        return None
    # a ChainedOptimizer of several (dense, expert) keeps each under its index
    chained = bool(entry) and all(isinstance(k, int) for k in entry)
    subs: list[dict[str, Any]] = [entry[k] for k in sorted(entry)] if chained else [entry]
    kinds = {sub.get("param_state_sharding_type") if isinstance(sub, dict) else None for sub in subs}
    if kinds == {FULLY_RESHARDABLE}:
        state, groups, scaler = _read_fully_reshardable(iter_dir, subs, config, tensors, chunk)
    elif kinds == {DP_RESHARDABLE}:
        state, groups, scaler = _read_dp_reshardable(iter_dir, common["args"], len(subs), chained, config, tensors)
    else:
        return None
    meta = OptimizerMeta(
        True, MOMENTS, groups=groups, grad_scaler=scaler, distributed=distributed_buffers(common["args"])
    )
    return state, meta


def _read_fully_reshardable(
    iter_dir: Path,
    subs: list[dict[str, Any]],
    config: FamilyConfig,
    tensors: DistTensors,
    chunk: dict[str, torch.Tensor],
) -> tuple[LocalOptimState, dict[Any, dict[str, Any]], Any]:
    """megatron-core's model-space form: per parameter `[chained_I.]optimizer.state.{param,exp_avg,exp_avg_sq}.<the
    parameter's key>`, sharded exactly like the parameter; param groups in common.pt."""
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
    # (a ChainedOptimizer of a dense and an expert optimizer: a job with expert parallelism)
    standard = model_param_groups(config, expert_parallel=len(subs) > 1)
    if len(standard) != len(subs):
        raise InteropError(
            f"{iter_dir / COMMON}: its optimizer entry holds {len(subs)} optimizer(s), but Megatron-Core builds "
            f"{len(standard)} for this model"
        )
    for one, known in zip(subs, standard):
        inner = one.get("optimizer")
        saved = inner.get("param_groups") if isinstance(inner, dict) else None
        if not isinstance(saved, list):
            raise InteropError(f"{iter_dir / COMMON}: its optimizer entry has no param groups")
        check_known_groups(saved, known, str(iter_dir / COMMON))
        groups.update({identifier(g): dict(g) for g in saved})
        scaler = one.get("grad_scaler", scaler)
    return state, groups, scaler


def _saved_layout(args: Any, where: Path) -> Layout:
    """The layout a torch_dist checkpoint was saved in (args.args_layout), of a job whose experts have the
    dense layers' TP and that has no context parallelism: the dp_reshardable buckets of any other are not mapped."""
    saved = args_layout(args)
    check_even_stages(args, str(where))
    # (expert TP unset: the dense layers' TP, as megatron-core takes it)
    etp = arg(args, "expert_tensor_parallel_size", saved.tp)
    cp = arg(args, "context_parallel_size", 1)
    if etp != saved.tp or cp != 1:
        raise InteropError(
            f"{where}: saved with expert TP {etp} and context parallelism {cp}; ucp reads the {DP_RESHARDABLE} "
            f"optimizer of jobs whose experts have the dense layers' TP and no context parallelism"
        )
    return saved


def _read_dp_reshardable(
    iter_dir: Path, args: Any, optimizers: int, chained: bool, config: FamilyConfig, tensors: DistTensors
) -> tuple[LocalOptimState, dict[Any, dict[str, Any]], Any]:
    """Megatron-LM's default form: for each model-parallel rank of the saving layout (`dp_group_idx`, its rank in
    the TP x PP group, or the expert optimizer's in the TP x EP x PP group), each grad buffer's bucket is a flat
    global tensor `[chained_I.]optimizer.distributed.dp_group_idx_<I>.gbuf_idx_<G>.dtype_<(param, grad)>.bucket_idx_
    <B>.{param,exp_avg,exp_avg_sq}`, the DP ranks' shards concatenated without the bucket's end padding; the
    param groups and grad scaler are objects `....dp_group_idx_<I>.optimizer` / `.grad_scaler`. Where each
    parameter sits in a bucket is megatron-core's grad buffer layout, rebuilt from the saving layout
    (distrib_optim.grad_buffers) and checked against every bucket's stored size; each tp1pp1 parameter's
    state is assembled from its TP pieces' byte ranges when read."""
    saved = _saved_layout(args, iter_dir / COMMON)
    bucket_size = bucket_size_of(args)
    entries = tensors.metadata.state_dict_metadata
    buckets = _bucket_index(entries)
    view = Layout()
    # each atom's places in the tp1pp1 view's parameters (a fused QKV holds each atom in a piece per query group)
    owner: dict[str, list[tuple[LocalParam, Piece]]] = {}
    for q in local_params(config, view, view.coords(0)):
        for piece in q.pieces if q.parameter else ():
            if not piece.tied_copy:
                owner.setdefault(piece.atom, []).append((q, piece))
    parts: dict[tuple[str, str], dict[str, list[FlatPart]]] = {}
    groups: dict[Any, dict[str, Any]] = {}
    scaler = None
    for rank in range(saved.world_size):
        c = saved.coords(rank)
        buffers_of = grad_buffers(config, saved, rank, bucket_size)
        groups_of = param_groups(config, saved, rank)
        if len(buffers_of) != optimizers:
            raise InteropError(
                f"{iter_dir / COMMON}: {optimizers} distributed optimizer(s), but a {saved} job of this model "
                f"has {len(buffers_of)} (dense{', expert' if len(buffers_of) > 1 else ''})"
            )
        for i, buffers in enumerate(buffers_of):
            expert = i == 1
            if not expert and c.ep != 0:
                continue  # (the dense optimizer's DP group spans the EP ranks: one copy per TP and PP rank)
            idx = c.tp + saved.tp * ((c.ep + saved.ep * c.pp) if expert else c.pp)
            base = (f"chained_{i}." if chained else "") + f"optimizer.distributed.dp_group_idx_{idx}"
            inner = tensors.obj(f"{base}.optimizer/shard_0_1")
            saved_groups = inner.get("param_groups") if isinstance(inner, dict) else None
            if not isinstance(saved_groups, list):
                raise InteropError(f"{iter_dir}: no param groups in {base}.optimizer (the {DP_RESHARDABLE} form)")
            check_param_groups(saved_groups, groups_of[i], f"{iter_dir}: {base}.optimizer", sized=False)
            groups.update({identifier(g): dict(g) for g in saved_groups})
            scaler = tensors.obj(f"{base}.grad_scaler/shard_0_1") or scaler
            for g, buffer in enumerate(buffers):
                prefix = f"{base}.gbuf_idx_{g}"
                bucket = _bucket_keys(iter_dir, entries, prefix, buckets.get(prefix, {}), buffer.bucket_numels)
                for slot in buffer.slots:
                    p = slot.param
                    if p.tp_replicated and c.tp != 0:
                        continue  # (every TP rank holds the same values)
                    moves = []
                    for piece in p.pieces:
                        for q, at in owner.get(piece.atom, []) if not piece.tied_copy else ():
                            common = intersect(piece.atom_box, at.atom_box)
                            if common is not None:
                                moves.append((_local(common, piece), _local(common, at)))
                    if not moves:
                        continue  # (a tied copy: the first stage's embedding holds its state)
                    # (every piece of p lies in the same tp1 parameter q: the same Megatron tensor at TP 1)
                    for stored, name in STATE_OF.items():
                        key = f"{bucket[slot.bucket]}.{stored}"
                        flat = FlatPart(key, slot.bucket_offset, p.shape, tuple(moves))
                        parts.setdefault((q.chunk_key, q.name), {}).setdefault(name, []).append(flat)
    state: LocalOptimState = {}
    for q in {(q.chunk_key, q.name): q for places in owner.values() for q, _ in places}.values():
        for name in STATE_OF.values():
            found = parts.get((q.chunk_key, q.name), {}).get(name, [])
            covered = sum(box_numel(target) for part in found for _, target in part.moves)
            held = sum(piece.numel for piece in q.pieces if not piece.tied_copy)  # (not the vocabulary's padding)
            if covered != held:
                raise InteropError(
                    f"{iter_dir}: the {DP_RESHARDABLE} buckets hold {covered} of the {held} elements of "
                    f"{q.name}'s {name} that a {saved} job's buffers place"
                )
            state.setdefault(q.chunk_key, {}).setdefault(q.name, {})[name] = tensors.assembled(q.shape, tuple(found))
    return state, groups, scaler


def _local(atom_box: Box, piece: Piece) -> Box:
    """Where part `atom_box` of a piece's atom box lies in the piece's local tensor."""
    return translate(relative(atom_box, piece.atom_box), tuple(lo for lo, _ in piece.box))


_BUCKET = re.compile(r"(.+\.gbuf_idx_\d+)\.(dtype_.+)\.bucket_idx_(\d+)\.param")


def _bucket_index(entries: dict[str, Any]) -> dict[str, dict[int, str]]:
    """Every dp_reshardable bucket of the metadata, by its grad buffer's key prefix
    (`....dp_group_idx_<I>.gbuf_idx_<G>`): bucket index -> the bucket's key prefix (without the state)."""
    index: dict[str, dict[int, str]] = {}
    for key in entries:
        m = _BUCKET.fullmatch(key)
        if m is not None:
            index.setdefault(m.group(1), {})[int(m.group(3))] = key.removesuffix(".param")
    return index


def _bucket_keys(
    iter_dir: Path, entries: dict[str, Any], prefix: str, found: dict[int, str], numels: tuple[int, ...]
) -> list[str]:
    """Each bucket's key prefix (`<prefix>.dtype_<(param, grad)>.bucket_idx_<B>`) of one grad buffer (`found`: its
    entry of `_bucket_index`), checked: exactly the buckets the rebuilt layout has, of its sizes, each state an
    fp32 tensor."""
    for b in sorted(found):
        key = f"{found[b]}.param"
        if b >= len(numels):
            raise InteropError(f"{iter_dir}: {key} is of bucket {b}, past the {len(numels)} this layout's buffer has")
        for stored in STATE_OF:
            state_key = f"{found[b]}.{stored}"
            e: Any = entries.get(state_key)
            if not hasattr(e, "size"):
                raise InteropError(f"{iter_dir}: no tensor {state_key} beside {key}")
            if (tuple(e.size), e.properties.dtype) != ((numels[b],), torch.float32):
                raise InteropError(
                    f"{iter_dir}: {state_key} is a tensor of {list(e.size)} "
                    f"{str(e.properties.dtype).removeprefix('torch.')}, but a bucket of {numels[b]} fp32 elements "
                    f"in megatron-core's buffer for this layout (check the args' overlap_grad_reduce, "
                    f"ddp_bucket_size and data_parallel_size)"
                )
    if sorted(found) != list(range(len(numels))):
        raise InteropError(
            f"{iter_dir}: {prefix} has buckets {sorted(found)}, but megatron-core's buffer for this layout has "
            f"{len(numels)} (check the args' overlap_grad_reduce and ddp_bucket_size)"
        )
    return [found[b] for b in range(len(numels))]


def _check_global(
    iter_dir: Path, key: str, entry: Any, index: tuple[int, ...], lt: LocalTensor, config: FamilyConfig, per_layer: bool
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


def _prepended(config: FamilyConfig, index: tuple[int, ...], per_layer: bool = False) -> tuple[int, ...]:
    """The global sizes of the prepended axes: layers (unless each layer has keys of its own), then experts."""
    axes = (() if per_layer else (config.num_hidden_layers,)) + (config.num_local_experts,)
    return axes[: len(index)]


def common_optimizer_entry(meta: OptimizerMeta, config: FamilyConfig, expert_parallel: bool) -> dict[Any, Any]:
    """common.pt's "optimizer" of a distributed optimizer saved `fully_reshardable`: per Megatron optimizer its
    state dict (distrib_optim.optimizer_entry) and sharding type. A job with expert parallelism chains a
    dense and an expert optimizer (kept under their indices), one without has one: megatron-core's ChainedOptimizer
    loads only the count it has, so this entry is made for the loading job's `expert_parallel`. Each optimizer lists
    the groups of the whole model; each loading rank takes those it has (DistributedOptimizer.load_state_dict
    matches them by their identifier)."""
    entries = [
        {**optimizer_entry(meta, groups), "param_state_sharding_type": FULLY_RESHARDABLE}
        for groups in model_param_groups(config, expert_parallel)
    ]
    return entries[0] if len(entries) == 1 else dict(enumerate(entries))


def _write_buckets(data: _DataFile, target: TargetFiles, produce: Produce) -> int:
    """The distributed optimizer in Megatron-LM's default form (dp_reshardable) for the job of layout
    `target.optimizer_layout`, as megatron-core's `sharded_param_state_dp_reshardable` saves it: for each optimizer
    (dense; expert under EP) of each of the job's model-parallel ranks (`dp_group_idx`: TP x PP ranks, the
    expert optimizer's TP x EP x PP), each grad buffer bucket's master weights and moments as flat fp32 tensors
    `[chained_I.]optimizer.distributed.dp_group_idx_<I>.gbuf_idx_<G>.dtype_<(param, grad)>.bucket_idx_<B>.<state>` of
    the bucket's size without its end padding (a chunk per parameter, zeros between them: memory holds one
    parameter's state at a time), and as objects the rank's param groups (`.optimizer`), grad scaler, and bucket
    sizes (`per_bucket_numel_unpadded`, which megatron-core checks on load; `per_bucket_numel`, with the end
    padding a DP that divides 128 gives). The layout comes from distrib_optim.grad_buffers, as the
    reader's. Returns the bytes of tensors written."""
    layout, meta, config = target.optimizer_layout, target.optimizer, target.config
    assert layout is not None and meta is not None and meta.distributed is not None
    pair = tuple(getattr(torch, d) for d in meta.distributed.dtypes)
    written = 0
    for rank in (layout.rank(t, e, p) for p in range(layout.pp) for e in range(layout.ep) for t in range(layout.tp)):
        c = layout.coords(rank)
        plan = {lt.key[2:]: lt for lt in local_plan(config, layout, rank, meta.states) if lt.state is not None}
        buffers_of = grad_buffers(config, layout, rank, meta.distributed.bucket_size)
        groups_of = param_groups(config, layout, rank)
        for i, (buffers, groups) in enumerate(zip(buffers_of, groups_of, strict=True)):
            expert = i == 1
            if not expert and c.ep != 0:
                continue  # (the dense optimizer's DP group spans the EP ranks: one copy per TP and PP rank)
            idx = c.tp + layout.tp * ((c.ep + layout.ep * c.pp) if expert else c.pp)
            base = (f"chained_{i}." if len(buffers_of) > 1 else "") + f"optimizer.distributed.dp_group_idx_{idx}"
            entry = optimizer_entry(meta, groups)
            for key, value in entry.items():
                data.obj(f"{base}.{key}/shard_0_1", [value])
            sizes = [{pair: list(b.bucket_numels)} for b in buffers]
            padded = [{pair: [-(-n // BUCKET_ALIGNMENT) * BUCKET_ALIGNMENT for n in b.bucket_numels]} for b in buffers]
            data.obj(f"{base}.per_bucket_numel/shard_0_1", [padded])
            data.obj(f"{base}.per_bucket_numel_unpadded/shard_0_1", [sizes])
            for g, buffer in enumerate(buffers):
                for b, numel in enumerate(buffer.bucket_numels):
                    prefix = f"{base}.gbuf_idx_{g}.dtype_{pair}.bucket_idx_{b}"
                    slots = sorted((s for s in buffer.slots if s.bucket == b), key=lambda s: s.bucket_offset)
                    for stored, state in STATE_OF.items():
                        at = 0
                        for slot in slots:
                            if slot.bucket_offset > at:  # (the alignment padding before a parameter)
                                data.tensor(f"{prefix}.{stored}", (numel,), (at,), torch.zeros(slot.bucket_offset - at))
                            p = slot.param
                            value = produce(rank, plan[(p.chunk_key, p.name, state)]).reshape(-1).float()
                            data.tensor(f"{prefix}.{stored}", (numel,), (slot.bucket_offset,), value)
                            written += value.numel() * value.element_size()
                            at = slot.bucket_offset + p.numel
                        if at < numel:
                            data.tensor(f"{prefix}.{stored}", (numel,), (at,), torch.zeros(numel - at))
    return written


def write_torch_dist(
    dst: str | Path,
    target: TargetFiles,  # of layout tp1pp1
    produce: Produce,
    dtype_of: Callable[[LocalTensor], torch.dtype],
    progress: bool,
) -> tuple[int, int]:
    """A torch_dist checkpoint at DST (which appears only when whole): one chunk per tp1 tensor (a layer, an expert
    of a layer, or a whole tensor), each produced and written in turn, so memory holds one at a time. Megatron
    loads it in any layout (its reader reshards). A distributed optimizer's state is written in megatron-core's
    `fully_reshardable` form (each state a global tensor keyed `optimizer.state.{param,exp_avg,exp_avg_sq}.<the
    parameter's key>` and sharded like it; no ChainedOptimizer prefix, as content_metadata says), its param groups
    by `common_optimizer_entry`. Returns (files, bytes of tensors written)."""
    from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
    from tqdm import tqdm

    buckets = target.optimizer is not None and target.optimizer_layout is not None  # (the dp_reshardable form)
    plan = local_plan(target.config, Layout(), 0, () if buckets else target.states)
    stored_as = {state: stored for stored, state in STATE_OF.items()}  # ucp state -> fully_reshardable key
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
                name = lt.key[1] if lt.state is None else lt.key[3]  # (an optimizer state: its parameter's name)
                where = dist_name(name, per_layer)
                t = produce(0, lt).to(dtype_of(lt))
                lead = _prepended(target.config, where.index, per_layer)
                keys = (
                    where.keys
                    if lt.state is None
                    else [f"optimizer.state.{stored_as[lt.state]}.{k}" for k in where.keys]
                )
                for key in keys:
                    data.tensor(
                        key,
                        lead + tuple(t.shape),
                        where.index + (0,) * t.dim(),
                        t.reshape((1,) * len(lead) + tuple(t.shape)),
                    )
                written += t.numel() * t.element_size()
                owner = extra_state_owner(where.keys[0]) if lt.state is None else None
                if owner is not None:
                    # megatron-core's ShardedObject for the layer's extra state (None without Transformer Engine)
                    shard = (where.index, lead) if where.index else ((0,), (1,))
                    data.obj(
                        f"{owner}._extra_state/shard_{'.'.join(map(str, shard[0]))}_{'.'.join(map(str, shard[1]))}",
                        [None],
                    )
                del t
                bar.update(1)
            if buckets:
                written += _write_buckets(data, target, produce)
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
        # how the sharded state dict was made, which Megatron-LM's loader reads back to make its own the same way
        content: dict[str, Any] = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}
        if buckets:
            # (per optimizer only its form: the param groups are objects of each model-parallel rank)
            kind = {"param_state_sharding_type": DP_RESHARDABLE}
            assert target.optimizer_layout is not None  # (buckets)
            count = len(param_groups(target.config, target.optimizer_layout, 0))
            common["optimizer"] = kind if count == 1 else {i: dict(kind) for i in range(count)}
            content |= {"distrib_optim_sharding_type": DP_RESHARDABLE}
        elif target.optimizer is not None:
            common["optimizer"] = common_optimizer_entry(target.optimizer, target.config, target.expert_parallel)
            content |= {
                "distrib_optim_sharding_type": FULLY_RESHARDABLE,
                "distrib_optim_fully_reshardable_mem_efficient": False,
            }
        common["content_metadata"] = content
        torch.save(common, iter_dir / COMMON)
        (iter_dir / METADATA_JSON).write_text(json.dumps(BACKEND))
        (tmp / TRACKER).write_text(f"{target.iteration}\n")  # last: Megatron finds the iteration only once it is whole
    return 1, written
