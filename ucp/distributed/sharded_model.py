"""The model of a distributed checkpoint: what a sharded save or load knows about the model (`ShardedModel`),
where each atom lives (`atom_path`), how every atom is chunked for the writing layout (`atom_metas`), and what a
committed step says about the model and the caller's extra state (`model_config_of`, `extra_state`)."""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from ..base import dtypes
from ..base.chunking import ChunkingPolicy, choose_chunks
from ..engine.checkpoint import CheckpointReader, checked
from ..errors import FormatError, LayoutError
from ..format import tree
from ..format.manifest import AtomMeta
from ..sharding.families import FAMILIES, block_scales, buffer_atoms, canonical_atoms, family_for
from ..sharding.families.table import block_size
from ..sharding.layout import Layout, parse_layout
from ..sharding.partition import PartitionSpec, tp_shard
from ..sharding.quantization import SCALE_DTYPE, WEIGHT_DTYPE
from ..sharding.reshard import DEFAULT_STATES


@dataclass(frozen=True)
class ShardedModel:
    """What a distributed save or load needs to know about the model: its family config, the parallel layout,
    and the names of the per-parameter optimizer states (empty: parameters only).

    `optional_states` are read by a load where the step holds them and left out of the local state where it holds
    none (a save writes `optim_states` only): fp32 master weights, say, which a mixed-precision job saves and a
    full-precision one does not, so that either job restores from the other's checkpoints."""

    config: Any
    layout: Layout
    optim_states: tuple[str, ...] = DEFAULT_STATES
    optional_states: tuple[str, ...] = ()
    # Parameter atoms whose dtype differs from the other parameters' (a bf16 DeepSeek-V3's fp32 router correction
    # bias): atom name -> Zarr dtype name. The ranks of a save must agree on every atom's dtype and each holds only
    # its own tensors, so a save needs them said (block-quantised weights and their scales need not: the format
    # fixes theirs, `quantised_dtypes`). `stored_dtypes` gives a checkpoint's.
    atom_dtypes: Mapping[str, str] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        if isinstance(self.layout, str):
            object.__setattr__(self, "layout", parse_layout(self.layout))
        if not isinstance(self.layout, Layout):
            raise LayoutError(
                f"ShardedModel needs a ucp.sharding.layout.Layout or a layout string, got {type(self.layout).__name__}"
            )
        object.__setattr__(self, "optim_states", tuple(self.optim_states))
        object.__setattr__(self, "optional_states", tuple(self.optional_states))


AtomKey = tuple[str, "str | None"]  # (canonical atom name, optimizer state name or None for the parameter)


def atom_path(atom: str, state: str | None) -> str:
    """Where an atom lives in the checkpoint: parameters under model/, states under optimizer/state/."""
    return f"model/{atom}" if state is None else f"optimizer/state/{atom}/{state}"


def stored_dtypes(atoms: Mapping[str, AtomMeta]) -> dict[str, str]:
    """Every parameter atom's dtype in a step (its manifest's atoms): `ShardedModel.atom_dtypes` for a save that
    keeps them (the reshaper's)."""
    return {path.removeprefix("model/"): meta.dtype for path, meta in atoms.items() if path.startswith("model/")}


def states_held(model: ShardedModel, atoms: Mapping[str, AtomMeta]) -> ShardedModel:
    """`model` as a load of a step with these atoms reads it: each optional state the step holds (any atom of it)
    becomes an ordinary state, the others are dropped. A state the step holds only in part then fails the load
    with the atom it lacks, as an ordinary state would."""
    if not model.optional_states:
        return model  # (nothing to look for: a step of a million atoms is not walked)
    held = {path.rsplit("/", 1)[1] for path in atoms if path.startswith("optimizer/state/")}
    states = model.optim_states + tuple(s for s in model.optional_states if s in held and s not in model.optim_states)
    return dataclasses.replace(model, optim_states=states, optional_states=())


def _tp_periods(spec: PartitionSpec, shape: tuple[int, ...], tp: int) -> list[int | None]:
    """Per dimension, the spacing of the boundaries between TP ranks' parts of an atom (None: no boundary)."""
    cuts: list[set[int]] = [set() for _ in shape]
    for t in range(tp):
        for _, atom_box in tp_shard(spec, shape, tp, t).pieces:
            for d, (a, b) in enumerate(atom_box):
                cuts[d].update(c for c in (a, b) if 0 < c < shape[d])
    return [math.gcd(*c) if c else None for c in cuts]


def quantised_dtypes(config: Any) -> dict[str, str]:
    """The dtypes that block-quantised weights and their scales have whatever a caller says (the format's: float8
    weights; float32 scales, or the dtype the config's `weight_scale_dtype` says), by atom name; empty for a model
    whose weights are not quantised."""
    scales = block_scales(config)
    return {
        **dict.fromkeys(scales, dtypes.zarr_name(WEIGHT_DTYPE)),
        **dict.fromkeys(scales.values(), getattr(config, "weight_scale_dtype", dtypes.zarr_name(SCALE_DTYPE))),
    }


def _quantisation_attrs(config: Any) -> dict[str, dict[str, Any]]:
    """`attributes.ucp.quantization` of each block-quantised weight (its block and scale atom) and of each scale
    atom (its block and the weight it scales), by atom name (docs/FORMAT.md section 2.1)."""
    block = list(block_size(config) or ())
    out: dict[str, dict[str, Any]] = {}
    for weight, scale in block_scales(config).items():
        out[weight] = {"block": block, "scales": atom_path(scale, None)}
        out[scale] = {"block": block, "scales_of": atom_path(weight, None)}
    return out


@lru_cache(maxsize=8)
def _atom_metas_cached(
    family: str, config_json: str, tp: int, optim_states: tuple[str, ...], dtype_items: tuple, policy: ChunkingPolicy
) -> dict[AtomKey, AtomMeta]:
    config = FAMILIES[family].config_cls.from_json(json.loads(config_json))
    dtype_of = {**quantised_dtypes(config), **dict(dtype_items)}
    buffers = buffer_atoms(config)
    quantisation = _quantisation_attrs(config)
    metas: dict[AtomKey, AtomMeta] = {}
    for name, (shape, spec) in canonical_atoms(config).items():
        periods = _tp_periods(spec, shape, tp)
        split = next((d for d, p in enumerate(periods) if p), None)
        for state in (None, *(() if name in buffers else optim_states)):
            dtype = dtype_of[name] if state is None and name in dtype_of else dtype_of[state]
            packed = policy.packs(math.prod(shape) * dtypes.itemsize(dtype))
            chunk, inner = choose_chunks(shape, dtypes.itemsize(dtype), policy, periods, split, packed)
            attrs: dict[str, Any] = {"role": "param" if state is None else "optimizer_state"}
            if state is not None:
                attrs.update(state=state, param=name)
            attrs.update(partition=spec.to_json(), family=family)
            if state is None and name in quantisation:
                attrs["quantization"] = quantisation[name]
            meta = AtomMeta(atom_path(name, state), shape, dtype, chunk, inner, attrs, packed=packed)
            metas[(name, state)] = checked(meta)
    return metas


def atom_metas(
    model: ShardedModel, dtype_of: Mapping[str | None, str], policy: ChunkingPolicy
) -> dict[AtomKey, AtomMeta]:
    """Every atom of a distributed checkpoint, chunked so that chunk boundaries fall on TP boundaries of the
    writing layout; identical on every rank (a pure function), so no rank needs another's description.
    `dtype_of`: the parameters' dtype (key None), each optimizer state's (its name), and where a parameter atom has
    a dtype of its own (an import that keeps a bf16 model's fp32 router bias), that one (the atom's name).
    Block-quantised weights and their scales are float8 and float32 unless `dtype_of` names them."""
    config_json = json.dumps(model.config.to_json(), sort_keys=True)
    dtype_items = tuple(sorted(dtype_of.items(), key=lambda kv: kv[0] or ""))
    return _atom_metas_cached(
        family_for(model.config).name, config_json, model.layout.tp, model.optim_states, dtype_items, policy
    )


def model_config_of(reader: CheckpointReader) -> Any:
    """The model family config a distributed checkpoint was written with."""

    try:
        doc = dict(reader.manifest.tree_at("model_config")["value"])
        family = FAMILIES[doc.pop("family")]
    except (KeyError, TypeError):
        raise FormatError(
            f"step {reader.step} at {reader.storage.url} carries no model_config (not written by a distributed save)"
        ) from None
    return family.config_cls.from_json(doc)


def check_atom(meta: AtomMeta, shape: tuple[int, ...]) -> None:
    """The stored atom has the shape the model config gives it."""
    if meta.shape != shape:
        raise FormatError(
            f"atom {meta.path!r} has shape {list(meta.shape)} in the checkpoint, but the model config needs {list(shape)}"
        )


def extra_state(reader: CheckpointReader) -> dict[str, Any]:
    """The `extra` state a distributed save stored (JSON, and tensors read whole)."""
    node = reader.manifest.tree_at("extra")  # (only the tree part on the way, if any)
    if node is None:
        return {}
    paths = tree.tree_atoms(node)
    return tree.unflatten({"dict": {"extra": node}}, reader.read_atoms(paths))["extra"]


def with_layout(model: ShardedModel, layout: Layout) -> ShardedModel:
    return dataclasses.replace(model, layout=layout)
