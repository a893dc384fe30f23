"""Weights-only loads for jobs that start from a checkpoint: SFT, RL rollout workers, evaluation.

Such a job needs the parameters in its own layout and dtype and nothing else: optimizer state (two thirds or
more of a pretraining checkpoint) is never read, and each rank reads only the regions of the atoms it holds
(`ucp.distributed.load_sharded` with no optimizer states), whatever layout wrote the checkpoint.

Block-quantised weights (DeepSeek-V3's fp8, `ucp.sharding.quantization`) load as stored (float8 weights and their float32
scales, each rank the scales of its blocks: TP splits on block edges only), or dequantised, in any layout the
unquantised model takes: with `dtype`, or into tensors of another dtype.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ..distributed.sharded_load import LoadReport, load_sharded
from ..distributed.sharded_model import ShardedModel, atom_path, model_config_of
from ..engine.checkpoint import CheckpointReader, open_checkpoint
from ..errors import StateError
from ..sharding.families import FamilyConfig, block_scales, expert_names_of
from ..sharding.families.table import block_size
from ..sharding.layout import Layout, parse_layout
from ..sharding.quantization import FLOAT8, SCALE_SUFFIX, dequantize, scale_name
from ..sharding.reshard import local_plan
from .dtypes import parse_dtype


@dataclass
class LoadedWeights:
    """One rank's parameters: `local` is the local state ({"model": {name: tensor}}, or "model0", "model1", ...
    with virtual pipeline stages; Megatron-Core names, docs/LOCAL_STATE.md), plus what the load read."""

    local: dict[str, Any]
    report: LoadReport
    config: FamilyConfig
    layout: Layout

    @property
    def params(self) -> dict[str, torch.Tensor]:
        """Local parameters by Megatron-Core name (prefixed "model{v}." when there are virtual stages)."""
        if list(self.local) == ["model"]:
            return dict(self.local["model"])
        return {f"{chunk}.{n}": t for chunk, tensors in self.local.items() for n, t in tensors.items()}


def _as_layout(layout: str | Layout) -> Layout:
    return layout if isinstance(layout, Layout) else parse_layout(layout)


def load_weights(
    url: str | CheckpointReader,
    layout: str | Layout,
    rank: int,
    dtype: str | torch.dtype | None = None,
    *,
    step: int | str = "latest",
    storage_options: dict[str, Any] | None = None,
    into: Mapping[str, torch.Tensor] | torch.nn.Module | None = None,
    device: torch.device | str | None = None,
) -> LoadedWeights:
    """The parameters of `rank` in `layout`, read from the atoms of a ucp checkpoint written from any layout
    (local path or any fsspec URL), cast to `dtype`, on `device` (default: host memory; a GPU's through page-locked
    read buffers). Only the parameter regions this rank holds are read.

    `into`: the job's own parameters, filled in place on whatever device they are (a Megatron-Core module, or
    tensors by the names of `LoadedWeights.params`); each keeps its dtype. Memory already in use fills faster than
    new memory, and the job needs no copy afterwards. Parameters `into` lacks are made on `device`.

    Block-quantised weights: with a `dtype` other than float8, or when each of the rank's quantised weights has an
    `into` tensor of such a dtype, they load dequantised, in any layout the unquantised model takes (a TP split
    may cut a block: ranks share its scale): the rank's local tensors are the dequantised model's, each read as its
    fp8 regions and the scales of the blocks they fall in, and filled with their float32 products rounded once
    (`ucp.sharding.quantization.dequantize`: the same bits as dequantising the whole atom), the scales left out and `config`
    saying no quantisation. Otherwise each comes as stored (float8, with its `..._scale_inv` scales beside it), and
    a TP split must then fall on block edges (`LayoutError`); an `into` tensor of a float8 weight is filled as
    stored, one of another dtype dequantised, both in place."""
    reader = url if isinstance(url, CheckpointReader) else open_checkpoint(url, step, storage_options=storage_options)
    config = model_config_of(reader)
    target = _as_layout(layout)
    cast, given = parse_dtype(dtype), _local_params(into)
    scales = block_scales(config)
    if scales:
        plain = dataclasses.replace(config, weight_block_size=None)  # the model dequantised
        if _dequantised(ShardedModel(plain, target, optim_states=()), rank, scales, cast, given):
            config = plain
    model = ShardedModel(config, target, optim_states=())
    with torch.no_grad():
        if block_scales(config):
            return _load_quantised(reader, model, rank, cast, given, device)
        local, report = load_sharded(reader, model, rank, dtype=cast, into=given, device=device)
    return LoadedWeights(local, report, config, target)


def _dequantised(
    plain: ShardedModel, rank: int, scales: Mapping[str, str], cast: torch.dtype | None, given: dict[str, Any] | None
) -> bool:
    """Whether `rank` of the dequantised model `plain` asks for every quantised weight it holds in a dtype other
    than float8: its `into` tensor's, or where it has none, `cast`."""
    for lt in local_plan(plain.config, plain.layout, rank, ()):
        if any(p.atom in scales for p in lt.pieces):
            node: Any = given
            for k in lt.key:
                node = node.get(k) if isinstance(node, Mapping) else None
            wanted = node.dtype if isinstance(node, torch.Tensor) else cast
            if wanted is None or wanted in FLOAT8:
                return False
    return True


def _load_quantised(
    reader: CheckpointReader,
    model: ShardedModel,
    rank: int,
    cast: torch.dtype | None,
    given: dict[str, Any] | None,
    device: torch.device | str | None,
) -> LoadedWeights:
    """`load_weights` of a model with block-quantised weights, some of them asked for as stored. `into` tensors are
    filled in place by the load (`load_sharded`: a float8 one as stored, one of another dtype dequantised with the
    scales of its blocks); the weights without one come as stored (a rank's scales are those of its blocks,
    `ucp.sharding.partition`), then, where `cast` asks for another dtype than float8, dequantised with their local scales,
    which are then left out."""
    stored, report = load_sharded(reader, model, rank, into=given, device=device)
    block = block_size(model.config)
    assert block is not None  # (the model has scales)
    given = given or {}

    def wanted(chunk: str, name: str) -> torch.dtype | None:
        into = given.get(chunk, {}).get(name)
        return into.dtype if into is not None else cast

    local: dict[str, Any] = {}
    for chunk, tensors in stored.items():
        for name, tensor in tensors.items():
            if given.get(chunk, {}).get(name) is not None:
                local.setdefault(chunk, {})[name] = tensor  # (the caller's own tensor, filled)
                continue
            weight = name.removesuffix(SCALE_SUFFIX)
            if weight != name and wanted(chunk, weight) not in (None, *FLOAT8):
                continue  # (its weight is dequantised: nothing needs it)
            dtype = cast or tensor.dtype
            scales = tensors.get(scale_name(name))
            if scales is not None and dtype != tensor.dtype:
                tensor = dequantize(tensor, scales, block, dtype)
            elif weight == name:  # (scales stay float32)
                tensor = tensor.to(dtype)
            local.setdefault(chunk, {})[name] = tensor
    config = dataclasses.replace(model.config, weight_block_size=None) if cast is not None else model.config
    return LoadedWeights(local, report, config, model.layout)


_VIRTUAL_STAGE = re.compile(r"(model\d+)\.(.+)")


def _local_params(into: Mapping[str, torch.Tensor] | torch.nn.Module | None) -> dict[str, Any] | None:
    """`into` as a local state ({"model": {name: tensor}}, or "model0", "model1", ... for names so prefixed);
    detached, so that a module's parameters are filled without autograd seeing an in-place write."""
    if into is None:
        return None
    named = dict(into.named_parameters()) if isinstance(into, torch.nn.Module) else dict(into)
    local: dict[str, Any] = {}
    for name, tensor in named.items():
        staged = _VIRTUAL_STAGE.fullmatch(name)
        chunk, local_name = (staged[1], staged[2]) if staged else ("model", name)
        local.setdefault(chunk, {})[local_name] = tensor.detach() if isinstance(tensor, torch.Tensor) else tensor
    return local


# --------------------------------------------------------------------------------- plain nn.Module by name

# transformers >= 5 keeps a layer's experts fused: gate_up_proj [E, 2*ffn, hidden] = per expert [w1; w3],
# down_proj [E, hidden, ffn] = per expert w2; the router is mlp.gate. Its fp8 experts (FP8Experts) hold beside each
# the block scales, fused alike: gate_up_proj_scale_inv = per expert [w1's; w3's], down_proj_scale_inv = w2's.
_HF_FUSED = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)(_scale_inv)?")
_HF_ROUTER = re.compile(r"model\.layers\.(\d+)\.mlp\.gate\.weight")

Composer = Callable[[Mapping[str, torch.Tensor]], torch.Tensor]


@dataclass(frozen=True)
class Source:
    """How one module tensor is made from atoms: the atoms it needs, and how to combine them."""

    atoms: tuple[str, ...]
    compose: Composer


def hf_source(name: str, config: FamilyConfig) -> Source | None:
    """The atoms behind a Hugging Face module tensor: the tensor of the same name (every family's atoms take HF's
    names), or for a MoE family's experts either the per-expert or transformers' fused-expert naming (with an fp8
    model's fused scales, FP8Experts'); None for tensors no atom backs (e.g. rotary buffers)."""
    moe = expert_names_of(config)
    if moe is not None and (m := _HF_ROUTER.fullmatch(name)):
        atom = moe.router_atom(m[1])
        return Source((atom,), lambda a: a[atom])
    if moe is not None and (m := _HF_FUSED.fullmatch(name)):
        experts = range(config.num_local_experts)
        scaled = scale_name if m[3] else str  # (the weights' block scales, fused as the weights are)
        if m[2] == "gate_up_proj":
            names = tuple(map(scaled, moe.gate_up_atoms(m[1], config.num_local_experts)))
            return Source(
                names, lambda a: torch.stack([torch.cat([a[names[2 * x]], a[names[2 * x + 1]]]) for x in experts])
            )
        names = tuple(map(scaled, moe.down_atoms(m[1], config.num_local_experts)))
        return Source(names, lambda a: torch.stack([a[n] for n in names]))
    if name == "lm_head.weight" and config.tie_word_embeddings:
        return Source(("model.embed_tokens.weight",), lambda a: a["model.embed_tokens.weight"])
    if name.startswith("model.") or name == "lm_head.weight":
        return Source((name,), lambda a: a[name])
    return None


NameMap = str | Mapping[str, str] | Callable[[str, FamilyConfig], "Source | None"]


def _dequantises(target: torch.Tensor, src: Source, scales: Mapping[str, str]) -> tuple[str, ...]:
    """The block-quantised atoms behind a module tensor that it takes dequantised: all of them unless it is float8."""
    if target.dtype in FLOAT8:
        return ()
    return tuple(a for a in src.atoms if a in scales)


def _resolver(name_map: NameMap) -> Callable[[str, FamilyConfig], Source | None]:
    if name_map == "hf":
        return hf_source
    if isinstance(name_map, Mapping):
        mapping = name_map

        def mapped(name: str, _config: FamilyConfig) -> Source | None:
            if name not in mapping:
                return None
            atom = mapping[name]
            return Source((atom,), lambda a: a[atom])

        return mapped
    if callable(name_map):
        return name_map
    raise StateError(f"name_map must be 'hf', a dict module name -> atom name, or a callable; got {name_map!r}")


def load_into_module(
    url: str | CheckpointReader,
    module: torch.nn.Module,
    name_map: NameMap = "hf",
    *,
    step: int | str = "latest",
    storage_options: dict[str, Any] | None = None,
    strict: bool = True,
) -> LoadReport:
    """Fill a plain (unsharded) module's parameters and buffers from a ucp checkpoint's atoms, matched by
    name: "hf" for a transformers model of any family (either expert naming), a dict {module name: atom name}, or a
    callable name -> Source. Values are cast to each tensor's dtype; block-quantised weights are dequantised for
    a tensor that is not float8 (a bf16 transformers model of an fp8 checkpoint), as stored for one that is. With
    strict, a module parameter that no atom fills, or a shape that disagrees, is an error. Only the atoms the module
    needs are read."""
    reader = url if isinstance(url, CheckpointReader) else open_checkpoint(url, step, storage_options=storage_options)
    config = model_config_of(reader)
    resolve = _resolver(name_map)
    targets = dict(module.state_dict(keep_vars=True))
    sources: dict[str, Source] = {}
    unfilled = []
    for name, tensor in targets.items():
        src = resolve(name, config)
        if src is None or any(atom_path(a, None) not in reader.atoms for a in src.atoms):
            if isinstance(tensor, torch.nn.Parameter):
                unfilled.append(name)
            continue
        sources[name] = src
    if strict and unfilled:
        raise StateError(
            f"no atom of step {reader.step} fills the module's parameters {unfilled[:5]}"
            f"{' ...' if len(unfilled) > 5 else ''}"
        )
    scales = block_scales(config)
    dequantised = {n: _dequantises(targets[n], src, scales) for n, src in sources.items()}
    paths = sorted(
        {atom_path(a, None) for n, s in sources.items() for a in s.atoms + tuple(scales[a] for a in dequantised[n])}
    )
    before = reader.storage.stats.bytes_read
    atoms = {p.removeprefix("model/"): t for p, t in reader.read_atoms(paths).items()}
    read = reader.storage.stats.bytes_read - before
    block = block_size(config)
    with torch.no_grad():
        for name, src in sources.items():
            view = {a: atoms[a] for a in src.atoms}
            for a in dequantised[name]:
                assert block is not None  # (only a quantised model has scales)
                view[a] = dequantize(atoms[a], atoms[scales[a]], block, targets[name].dtype)
            value = src.compose(view)
            target = targets[name]
            if tuple(value.shape) != tuple(target.shape):
                raise StateError(
                    f"module tensor {name} has shape {list(target.shape)}, the checkpoint gives {list(value.shape)}"
                )
            target.copy_(value.to(target.dtype))
    return LoadReport(bytes_needed=sum(t.numel() * t.element_size() for t in atoms.values()), bytes_read=read)
