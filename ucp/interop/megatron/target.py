"""What a conversion writes in Megatron's formats (`TargetFiles`: each rank file's content besides its local tensors,
the optimizer's entries), and the torch format's rank files written (`write_rank_files`; torch_dist's one checkpoint
is ucp.interop.megatron.dist.write_torch_dist).

Each target file is written tensor by tensor (torch_file.save), a few files at a time within the memory budget:
every tensor is `Deferred`, produced by the conversion (from the source tensors that hold the same atom box) only
when its record is written, and dropped after.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import functools
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ...sharding.families import FamilyConfig
from ...sharding.layout import Layout
from ...sharding.reshard import LocalTensor, local_plan, put_local
from .. import torch_file
from ..staging import staged_dir
from ..streaming import group_limit
from ..torch_file import Deferred
from .args import mark_distributed
from .distrib_optim import write_distributed
from .optimizer import OptimizerMeta, write_optimizer
from .save import (
    CHECKPOINT_VERSION,
    DISTRIB_OPTIM_FILE,
    RANK_FILE,
    TORCH_DIST,
    TRACKER,
    extra_state_owner,
    rank_files,
)

Produce = Callable[[int, LocalTensor], torch.Tensor]  # (target rank, local tensor) -> its values


def _with_extra_state(chunk: dict[str, torch.Tensor]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, t in chunk.items():
        out[name] = t
        owner = extra_state_owner(name)
        if owner is not None:
            out[owner + "._extra_state"] = None
    return out


@dataclass
class TargetFiles:
    """What a target's files hold besides each rank's local tensors (the torch format's rank files, or torch_dist's
    common.pt and optimizer entries: dist.write_torch_dist)."""

    config: FamilyConfig
    layout: Layout
    args: argparse.Namespace
    iteration: int
    optimizer: OptimizerMeta | None = None
    scheduler: Any = None  # opt_param_scheduler: global, the same in every file
    rng: dict[str, Any] | None = None  # rank directory -> rng_state: only when the layout is the source's own
    format: str = "torch"  # or TORCH_DIST (layout tp1pp1)
    expert_parallel: bool = False  # torch_dist: the optimizer entry is for a job with EP > 1 (dist)
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


def _deferred_local(
    target: TargetFiles, rank: int, produce: Produce, dtype_of: Callable[[LocalTensor], torch.dtype]
) -> dict[str, Any]:
    """A target rank's local state whose tensors are produced only when their records are written."""
    local: dict[str, Any] = {}
    for lt in local_plan(target.config, target.layout, rank, target.states):
        put_local(local, lt.key, Deferred(lt.shape, dtype_of(lt), functools.partial(produce, rank, lt)))
    return local


def write_rank_files(
    dst: str | Path,
    target: TargetFiles,
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
