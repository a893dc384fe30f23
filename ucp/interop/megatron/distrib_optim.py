"""Megatron-Core's distributed optimizer in Megatron-LM's torch format: `distrib_optim.pt` <-> ucp local optimizer
state.

With `--use-distributed-optimizer`, a rank directory holds two files. model_optim_rng.pt's "optimizer" entry keeps
only what is not per parameter (`DistributedOptimizer.state_dict()`: the param groups without their "params" and
with Adam's step; the grad scaler). distrib_optim.pt (`save_parameter_state`, written by data-parallel rank 0)
holds every parameter's fp32 master weight and Adam moments as the DDP grad buffers lay them out, gathered over DP:

    {"buckets_coalesced": True,
     gbuf_index: {(param dtype, grad dtype): {"param" | "exp_avg" | "exp_avg_sq": fp32 [numel_unpadded],
                                               "numel_unpadded": int}}}

When Megatron chains a dense and an expert optimizer (EP > 1) the file holds a list of two such entries, `None` for
an optimizer whose data-parallel rank 0 is in another directory: the dense optimizer's DP group spans the EP ranks,
so the dense state of every EP rank is in EP rank 0's file.

Where a parameter sits in those tensors is megatron-core's grad buffer layout (distributed/param_and_grad_buffer.py),
rebuilt here from the layout and the args (`grad_buffers`): one buffer per model chunk and kind (dense; expert
parameters under EP), its parameters in reverse registration order (roughly backprop order), each starting at a
multiple of 64 elements, cut into buckets once a bucket reaches `bucket_size` elements (only with
overlap_grad_reduce, only on the first pipeline stage's first model chunk; default max(40M, 1M x DP)), a tied
embedding shared across pipeline stages in a bucket of its own. The file leaves out the padding at each bucket's
end, so DP enters only through the bucket size. Every buffer's `numel_unpadded` is checked against the rebuilt
layout before anything is read, so a file written with other bucketing is refused, not mis-read.

The world tensors map to ucp optimizer states "exp_avg", "exp_avg_sq" and "master" (the fp32 main parameter, also
for an fp32 model, where it equals the weight); each parameter's piece is a view of the file's tensor, read from
its byte range only when a conversion needs it.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from ...sharding.families import FamilyConfig
from ...sharding.layout import Layout
from ...sharding.reshard import LocalParam, local_params
from ..errors import InteropError
from ..torch_file import Deferred
from .optimizer import (
    MASTER,
    DistributedBuffers,
    Groups,
    LocalOptimState,
    OptimizerMeta,
    check_param_groups,
    group_key,
    identifier,
    optimizer_entries,
    param_groups,
    registration_key,
)

PARAM_ALIGNMENT = 64  # a parameter starts at a multiple of 64 elements (128-byte aligned for 16-bit values)
BUCKET_ALIGNMENT = 128  # a bucket ends padded to lcm(DP, 128): a multiple of PARAM_ALIGNMENT whatever DP is
WORLD_KEYS = ("param", "exp_avg", "exp_avg_sq")
STATE_OF = {"param": MASTER, "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}  # world tensor -> ucp state
MOMENTS = ("exp_avg", "exp_avg_sq")  # OptimizerMeta.keys of a distributed optimizer (its per-element states)
EMBEDDINGS = ("embedding.word_embeddings.weight", "output_layer.weight")


@dataclass(frozen=True)
class Slot:
    """A parameter's place in its buffer's world tensors (`offset`), and in its bucket's (`bucket`,
    `bucket_offset`: the torch_dist format's dp_reshardable form keeps each bucket a tensor of its own)."""

    param: LocalParam
    offset: int
    bucket: int
    bucket_offset: int


@dataclass(frozen=True)
class GradBuffer:
    slots: tuple[Slot, ...]
    bucket_numels: tuple[int, ...]  # each bucket without its end padding; the world tensors concatenate them

    @property
    def numel_unpadded(self) -> int:
        return sum(self.bucket_numels)


def _pad(n: int, divisor: int) -> int:
    return -(-n // divisor) * divisor


def _layout(params: list[LocalParam], bucket_size: int | None, shared: set[str]) -> GradBuffer:
    """One buffer's parameters (registration order) placed as megatron-core's _ParamAndGradBuffer places them,
    with offsets into the world tensors (buckets concatenated without their end padding)."""
    buckets: list[tuple[int, int]] = []  # (start in the padded buffer, unpadded numel)
    placed: list[tuple[LocalParam, int, int]] = []  # (param, start in the padded buffer, bucket)
    bucket_start = start = end = 0
    in_bucket = 0

    def close(end_index: int) -> int:
        nonlocal bucket_start, in_bucket
        buckets.append((bucket_start, end_index - bucket_start))
        bucket_start, in_bucket = _pad(end_index, BUCKET_ALIGNMENT), 0
        return bucket_start

    for p in reversed(params):
        start = _pad(start, PARAM_ALIGNMENT)
        own_bucket = p.name in shared
        if own_bucket and in_bucket:
            start = close(start)
        end = start + p.numel
        placed.append((p, start, len(buckets)))
        in_bucket += 1
        if (bucket_size is not None and end - bucket_start >= bucket_size) or own_bucket:
            start = close(end)
        else:
            start = end
    if in_bucket:
        close(end)
    base = [sum(n for _, n in buckets[:b]) for b in range(len(buckets))]
    slots = tuple(Slot(p, base[b] + s - buckets[b][0], b, s - buckets[b][0]) for p, s, b in placed)
    return GradBuffer(slots, tuple(n for _, n in buckets))


def grad_buffers(config: FamilyConfig, layout: Layout, rank: int, bucket_size: int | None) -> list[list[GradBuffer]]:
    """Per Megatron optimizer of the rank (dense, then expert under EP, as `param_groups`), its grad buffers in
    the optimizer's order (gbuf index): model chunk by chunk."""
    coords = layout.coords(rank)
    params = sorted((p for p in local_params(config, layout, coords) if p.parameter), key=registration_key)
    shared = set(EMBEDDINGS) if config.tie_word_embeddings and layout.pp > 1 else set()
    chunks = list(dict.fromkeys(p.chunk_key for p in params))
    out: dict[bool, list[GradBuffer]] = {False: [], True: []}
    for i, chunk in enumerate(chunks):
        # megatron-core buckets only the first stage's first chunk (elsewhere DP's reduce is off the critical path)
        size = bucket_size if coords.pp == 0 and i == 0 else None
        for expert in (False, True):
            mine = [p for p in params if p.chunk_key == chunk and group_key(p, layout)[2] == expert]
            if mine:
                out[expert].append(_layout(mine, size, shared))
    return [b for b in out.values() if b]


def holder(layout: Layout, rank: int, expert: bool) -> int:
    """The rank whose directory's distrib_optim.pt holds `rank`'s dense (or expert) optimizer state: the dense
    optimizer's data-parallel rank 0 is EP rank 0 of the same TP and PP ranks."""
    c = layout.coords(rank)
    return rank if expert or layout.ep == 1 else layout.rank(c.tp, 0, c.pp)


# ------------------------------------------------------------------------------------------- read


def read_distributed(
    entry: Any,
    files: dict[int, tuple[Any, str]],
    config: FamilyConfig,
    layout: Layout,
    rank: int,
    bucket_size: int | None,
    where: str,
) -> tuple[LocalOptimState, OptimizerMeta]:
    """A rank's optimizer state from its rank file's "optimizer" entry (`entry`) and the distrib_optim.pt files
    (`files`: ucp rank -> (unpickled content with meta tensors, path) of every rank directory)."""
    groups = param_groups(config, layout, rank)
    layouts = grad_buffers(config, layout, rank, bucket_size)
    subs = optimizer_entries(entry, groups, where)
    state: LocalOptimState = {}
    meta: OptimizerMeta | None = None
    for i, (sub, expected, buffers) in enumerate(zip(subs, groups, layouts)):
        expert = i == 1
        sub_meta = _read_groups(sub, expected, where)
        data, path = files[holder(layout, rank, expert)]
        if len(groups) > 1 and not (isinstance(data, list) and len(data) == len(groups)):
            found = f"a list of {len(data)}" if isinstance(data, list) else type(data).__name__
            raise InteropError(
                f"{path}: holds {found}, not a list of {len(groups)} distributed optimizer states (dense, expert)"
            )
        held = data[i] if len(groups) > 1 else data
        if not isinstance(held, dict):
            raise InteropError(
                f"{path}: holds no {'expert' if expert else 'dense'} distributed optimizer state "
                f"({type(held).__name__}), which {where} needs"
            )
        dtypes = _read_buffers(held, buffers, state, path)
        sub_meta = OptimizerMeta(
            True,
            MOMENTS,
            groups=sub_meta.groups,
            grad_scaler=sub_meta.grad_scaler,
            distributed=DistributedBuffers(dtypes, bucket_size),
        )
        meta = sub_meta if meta is None else meta.merge(sub_meta, where)
    assert meta is not None
    return state, meta


def _read_groups(sub: Any, expected: list[tuple[Any, list[LocalParam]]], where: str) -> OptimizerMeta:
    """The param groups (hyperparameters, Adam's step) and grad scaler of a DistributedOptimizer.state_dict()."""
    inner = sub.get("optimizer") if isinstance(sub, dict) else None
    if not isinstance(inner, dict) or not isinstance(inner.get("param_groups"), list) or "state" in inner:
        raise InteropError(
            f"{where}: its 'optimizer' entry is not a Megatron-Core DistributedOptimizer state dict "
            f"(keys: {sorted(sub) if isinstance(sub, dict) else type(sub).__name__})"
        )
    saved = inner["param_groups"]
    check_param_groups(saved, expected, where, sized=False)
    return OptimizerMeta(
        True, MOMENTS, groups={identifier(g): dict(g) for g in saved}, grad_scaler=sub.get("grad_scaler")
    )


def _read_buffers(
    held: dict[Any, Any], buffers: list[GradBuffer], state: LocalOptimState, path: str
) -> tuple[str, str]:
    """Views of each parameter's piece of the world tensors, into `state`; returns the buffers' dtype pair."""
    if held.get("buckets_coalesced") is not True:
        raise InteropError(
            f"{path}: a distributed optimizer state without coalesced buckets (written by a Megatron-Core before "
            f"0.7); load and save it once with a newer Megatron-Core first"
        )
    indices = sorted(k for k in held if k != "buckets_coalesced")
    if indices != list(range(len(buffers))):
        raise InteropError(
            f"{path}: holds grad buffers {indices}, but this layout has {len(buffers)} (one per model chunk)"
        )
    pairs: set[tuple[str, str]] = set()
    for gbuf, buffer in enumerate(buffers):
        by_dtype = held[gbuf]
        if not isinstance(by_dtype, dict) or len(by_dtype) != 1:
            raise InteropError(f"{path}: grad buffer {gbuf} has not exactly one (param dtype, grad dtype) entry")
        ((pair, world),) = by_dtype.items()
        if not (isinstance(pair, tuple) and len(pair) == 2 and all(isinstance(d, torch.dtype) for d in pair)):
            raise InteropError(f"{path}: grad buffer {gbuf} is keyed {pair!r}, not a (param dtype, grad dtype) pair")
        param_dtype, grad_dtype = (str(d).removeprefix("torch.") for d in pair)
        pairs.add((param_dtype, grad_dtype))
        if not isinstance(world, dict) or world.get("numel_unpadded") != buffer.numel_unpadded:
            got = world.get("numel_unpadded") if isinstance(world, dict) else type(world).__name__
            raise InteropError(
                f"{path}: grad buffer {gbuf} holds {got} elements, but Megatron-Core's buffer for this layout "
                f"and bucketing has {buffer.numel_unpadded} (check the args' overlap_grad_reduce, ddp_bucket_size "
                f"and data_parallel_size)"
            )
        for key in WORLD_KEYS:
            t = world.get(key)
            if (
                not isinstance(t, torch.Tensor)
                or t.dtype != torch.float32
                or tuple(t.shape) != (buffer.numel_unpadded,)
            ):
                raise InteropError(
                    f"{path}: grad buffer {gbuf}'s {key!r} is not an fp32 tensor of {buffer.numel_unpadded} elements"
                )
            for slot in buffer.slots:
                p = slot.param
                piece = t[slot.offset : slot.offset + p.numel].view(p.shape)
                state.setdefault(p.chunk_key, {}).setdefault(p.name, {})[STATE_OF[key]] = piece
    if len(pairs) != 1:
        raise InteropError(f"{path}: grad buffers of different dtypes {sorted(pairs)}; ucp maps one dtype pair")
    return pairs.pop()


# ------------------------------------------------------------------------------------------- write


def optimizer_entry(meta: OptimizerMeta, groups: Groups) -> dict[str, Any]:
    """One Megatron optimizer's `DistributedOptimizer.state_dict()`: its param groups (without params, in `groups`'
    order) and the grad scaler."""
    entry: dict[str, Any] = {"optimizer": {"param_groups": [meta.group(key) for key, _ in groups]}}
    if meta.grad_scaler is not None:
        entry["grad_scaler"] = meta.grad_scaler
    return entry


def write_distributed(
    state: dict[str, dict[str, dict[str, Any]]],
    meta: OptimizerMeta,
    config: FamilyConfig,
    layout: Layout,
    rank: int,
) -> tuple[Any, Any]:
    """(the rank file's "optimizer" entry, the content of its distrib_optim.pt or None where no optimizer's
    data-parallel rank 0 is this rank). `state` holds each parameter's tensors or Deferred placeholders;
    a world tensor is assembled only when its record is written."""
    assert meta.distributed is not None
    pair = tuple(getattr(torch, d) for d in meta.distributed.dtypes)
    bucket_size = meta.distributed.bucket_size
    entries: list[dict[str, Any]] = []
    files: list[dict[Any, Any] | None] = []
    for i, (groups, buffers) in enumerate(
        zip(param_groups(config, layout, rank), grad_buffers(config, layout, rank, bucket_size))
    ):
        entries.append(optimizer_entry(meta, groups))
        if holder(layout, rank, expert=i == 1) != rank:
            files.append(None)
            continue
        held: dict[Any, Any] = {"buckets_coalesced": True}
        for gbuf, buffer in enumerate(buffers):
            world: dict[str, Any] = {
                key: Deferred((buffer.numel_unpadded,), torch.float32, parts=_world_parts(buffer, state, STATE_OF[key]))
                for key in WORLD_KEYS
            }
            held[gbuf] = {pair: {**world, "numel_unpadded": buffer.numel_unpadded}}
        files.append(held)
    if len(entries) == 1:
        return entries[0], files[0]
    return entries, (files if any(f is not None for f in files) else None)


def _world_parts(buffer: GradBuffer, state: dict[str, dict[str, dict[str, Any]]], name: str) -> Any:
    """A world tensor's parts, parameter by parameter (only one parameter's values in memory at a time)."""

    def parts() -> Iterator[tuple[int, torch.Tensor]]:
        for slot in sorted(buffer.slots, key=lambda slot: slot.offset):
            p = slot.param
            value = state[p.chunk_key][p.name][name]
            if isinstance(value, Deferred):
                assert value.produce is not None  # (a parameter's state is made whole)
                value = value.produce()
            if tuple(value.shape) != p.shape:
                raise InteropError(f"{p.name}'s {name} is {list(value.shape)}, its parameter {list(p.shape)}")
            yield slot.offset, value.reshape(-1).to(torch.float32)

    return parts
