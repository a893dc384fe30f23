"""Checkpointing through ucp: save every K steps (asynchronously by default), resume in any layout.

The loop calls this module in three places: `Checkpointer.restore` once before the first step, `after_step`
after every step (it saves when the step is due; in "lazy" mode the next step calls `before_update` before the
optimizer changes the tensors being snapshotted), and `close` at the end (waits for the last commit).

A checkpoint holds the canonical atoms of the model and of Adam's exp_avg/exp_avg_sq (parallelism-free, so a
run restarts in another layout), with `train.precision: bf16` also the fp32 master weights (state "master"; the
parameters are then bf16 atoms), and, as extra state, the step, the data loader's position, the optimizer's
step counter, the LR schedule, the config and rank 0's RNG states.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist

from ucp.distributed import ShardedModel, TorchComm
from ucp.engine.pipeline import SaveHandle
from ucp.errors import CheckpointNotFoundError, StorageError
from ucp.manager import CheckpointManager
from ucp.training_state import rng_state, set_rng_state

from .config import Config
from .data import TokenSource
from .parallel.data import MASTER, DistributedAdamW, lr_at
from .parallel.mesh import Mesh
from .weights import ucp_config

OPTIM_STATES = ("exp_avg", "exp_avg_sq")


class Trained(Protocol):
    """What a run's checkpoints save and restore of its trainer (train.Trainer is one): its local state in ucp's
    form, the optimizer's step and precision, the data loader's position, where the rank sits in the layout."""

    mesh: Mesh
    optimizer: DistributedAdamW
    data: TokenSource
    device: torch.device

    def local_state(self) -> dict: ...

    def load_local_state(self, state: dict) -> None: ...


@dataclass
class Resumed:
    from_step: int
    saved_layout: str
    bytes_read: int  # this rank's (rank 0's, in the metrics)
    source: str  # "hot" (node-local tiers, with what no survivor held from the URL) or "durable"
    bytes_by_tier: dict[str, int]  # the job's bytes read from each rank's own node, from other nodes, from the URL
    restore_s: float  # how long the restore took (rank 0's)


class Checkpointer:
    """One training run's checkpoints under `cfg.checkpoint.url` (every rank builds one, in the same order)."""

    def __init__(self, cfg: Config, trainer: Trained):
        self.cfg, self.trainer = cfg, trainer
        self.interval = cfg.checkpoint.interval
        config, layout = ucp_config(cfg.model, cfg.train.stage_layers), trainer.mesh.layout
        saved_states = OPTIM_STATES + ((MASTER,) if trainer.optimizer.mixed else ())
        self.model = ShardedModel(config, layout, saved_states)
        # A restore reads master weights where the step has them, whatever this run's precision: a bf16 run's
        # masters are the weights an fp32 run continues from, and a bf16 run makes its masters from an fp32 run's
        # weights (Trainer.load_local_state).
        self.restore_model = ShardedModel(config, layout, OPTIM_STATES, optional_states=(MASTER,))
        # Checkpoint traffic (fragment exchange, barriers) goes over its own gloo group, host memory on any device.
        self.group = dist.new_group(backend="gloo")
        comm = TorchComm(self.group)
        self.manager = CheckpointManager(
            cfg.checkpoint.url,
            mode=cfg.checkpoint.mode,
            comm=comm,
            keep_last=cfg.checkpoint.keep_last,
            local_dir=cfg.checkpoint.local,
            local_keep=cfg.checkpoint.local_keep,
            durable_every=cfg.checkpoint.durable_every,
        )
        # The staging memory of the saves (page-locked on a GPU) is made now, not inside the first save.
        self.manager.prepare(trainer.local_state(), self.model, extra=self.extra(0))
        self.pending: SaveHandle | None = None  # lazy mode: a snapshot that may still read the tensors
        self.last_saved: int | None = None

    def restore(self) -> Resumed | None:
        """Load the newest committed step (of the hot tier or the URL) into the trainer, whatever layout saved it;
        None on a fresh start. Every rank calls it together."""
        if self.manager.hot is None and self.manager.latest_step() is None:
            return None
        t = self.trainer
        start = time.perf_counter()
        # Read straight into the trainer's own tensors, on its device (memory it has touched fills several times faster
        # than new memory, and no copy follows), but not a mixed-precision run's parameters: its masters may have to
        # be made from the saved full-precision weights, which the bf16 parameters cannot hold.
        into = t.local_state()
        if t.optimizer.mixed:
            into = {"optimizer": into["optimizer"]}
        try:
            local, extra, report = self.manager.restore_sharded(
                self.restore_model, t.mesh.rank, into=into, device=t.device
            )
        except CheckpointNotFoundError:
            return None  # (every rank sees the same: the choice of step is shared)
        local["optimizer"]["step"] = extra["optimizer_step"]
        t.load_local_state(local)
        t.data.load_state_dict(extra["data"])
        if t.mesh.rank == 0:
            set_rng_state(extra["rng"])
        tiers = self.manager.last_restore
        assert tiers is not None
        totals = torch.tensor([tiers.bytes_local, tiers.bytes_peers, tiers.bytes_durable], dtype=torch.int64)
        dist.all_reduce(totals, group=self.group)  # what the whole job read, from where
        by_tier = dict(zip(("local", "peers", "durable"), totals.tolist()))
        return Resumed(
            extra["step"], extra["layout"], report.bytes_read, tiers.source, by_tier, time.perf_counter() - start
        )

    def before_update(self) -> None:
        """Called before the optimizer step: a lazy snapshot must be complete before the tensors change."""
        if self.pending is not None:
            self.pending.wait_snapshot()
            self.pending = None

    def after_step(self, step: int) -> dict[str, Any] | None:
        """Save `step` if it is due (every `interval` steps and the last one); returns the metrics event."""
        last = step == self.cfg.train.steps
        if not last and not (self.interval and step % self.interval == 0):
            return None
        start = time.perf_counter()
        # (the last step is committed at the URL whatever --durable-every says: the hot tier goes with the nodes)
        handle = self.manager.save_sharded(
            step, self.trainer.local_state(), self.model, extra=self.extra(step), durable=last
        )
        self.last_saved = step
        if handle.mode == "lazy":
            self.pending = handle
        return {
            "event": "checkpoint",
            "step": step,
            "mode": handle.mode,
            "blocking_s": handle.blocking_s,
            "call_s": time.perf_counter() - start,
        }

    def extra(self, step: int) -> dict[str, Any]:
        """The extra state a save of `step` carries."""
        t = self.trainer
        return {
            "step": step,
            "layout": str(t.mesh.layout),
            "data": t.data.state_dict(),
            "optimizer_step": t.optimizer.step,
            # The schedule is a pure function of the step and the optim config; both are saved.
            "scheduler": {
                "kind": "linear_warmup_cosine",
                "step": t.optimizer.step,
                "last_lr": lr_at(t.optimizer.step, self.cfg.optim),
            },
            "config": self.cfg.to_dict(),
            # what changes the model's computation beyond its shapes, by the names an HF export writes them under
            "hf_config": {
                "rope_theta": self.cfg.model.rope_theta,
                "rms_norm_eps": self.cfg.model.rms_norm_eps,
                "router_aux_loss_coef": self.cfg.model.router_aux_loss_coef,
                "initializer_range": self.cfg.model.init_std,
            },
            "rng": rng_state(),
        }

    def abandon(self) -> None:
        """After a failure: stop without waiting for the save in flight (it stays uncommitted)."""
        self.pending = None
        self.manager.abandon()

    def close(self) -> None:
        """Wait for the save in flight to commit (its error is raised here) and stop the writer threads. With a hot
        tier, rank 0 raises if the run's last step did not reach the durable URL (its drain failed: logged)."""
        try:
            self.before_update()
            self.manager.wait()
        finally:
            self.manager.close()
        last, hot = self.last_saved, self.manager.hot
        final = hot is not None and last == self.cfg.train.steps and self.trainer.mesh.rank == 0
        if final and self.manager.latest_step() != last:
            errors = self.manager.after_commit_errors
            raise StorageError(
                f"the last step {last} is committed in the nodes' hot tiers ({hot.storage.url} on rank 0's node) but"
                f" not at {self.manager.root_url}" + (f": {errors[0]}" if errors else "")
            )
