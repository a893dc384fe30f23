"""One rank of test_distributed_failures.py's fault tests: a process of the job SIGKILLed during a save, or one
rank's own failure in the hot tier's work after a commit.

Usage: python -m tests.save_fault_worker SCENARIO URL OUT_DIR
- "save": world 2, tp2, a plain distributed save; rank 1 dies at its first chunk write.
- "drain": world 4, tp2pp2 on two nodes (ranks 0-1 and 2-3) with a hot tier that drains every step to the durable
  URL, async; rank 3 dies in step 2's drain, just before the drain's commit (its last collective). Only rank 2
  talks to rank 3 there: it took the failure for an error after the commit, went on to step 3, and every other
  rank waited for it for good.
- "replica": the same job, none dies; rank 2 cannot write the replicas it receives for step 2 (its node's disk
  full). It skipped the rest of step 2's work after the commit, the drain's collectives among it.
- "readback": the same job, none dies; rank 1 cannot read back the objects it wrote for step 2 to send them to its
  buddy. It left the rounds of transfers at its first such object, and its buddy waited for it for good.
Each surviving rank writes OUT_DIR/rank{r}.json: the error it raised ([type, message]), or null.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from collections.abc import Callable

import torch.distributed as dist

from ucp.distributed import ShardedModel, TorchComm, save_sharded, tiers
from ucp.errors import StorageError
from ucp.manager import CheckpointManager
from ucp.protocol.session import SaveSession
from ucp.sharding.layout import parse_layout
from ucp.sharding.reshard import shard
from ucp.storage import LocalStorage

from .dist_worker import CONFIG, OPTIONS, STATES, full_state


class Dying(LocalStorage):
    def write(self, key, parts):
        if "/c." in key:
            os.kill(os.getpid(), signal.SIGKILL)
        super().write(key, parts)


def die_in_drain_of(step: int) -> None:
    """This process SIGKILLs itself when the hot tier's drain of `step` reaches its commit."""
    drain, finish = tiers.HotTier.drain, SaveSession.finish
    draining: list[int] = []

    def traced_drain(self, session, *args, **kwargs):
        draining.append(session.step)
        return drain(self, session, *args, **kwargs)

    def dying_finish(self, manifest):
        if draining and draining[-1] == step and self.step == step:
            os.kill(os.getpid(), signal.SIGKILL)
        return finish(self, manifest)

    tiers.HotTier.drain, SaveSession.finish = traced_drain, dying_finish


def save(url: str, rank: int) -> None:
    layout = parse_layout("tp2", 2)
    storage = Dying(url, fsync=False) if rank == 1 else LocalStorage(url, fsync=False)
    local = shard(full_state(1), CONFIG, layout, rank, STATES)
    save_sharded(local, url, step=1, model=ShardedModel(CONFIG, layout, STATES), comm=TorchComm(), storage=storage)


def replicating(step: int) -> Callable[[], bool]:
    """Whether this process's hot tier is replicating `step` now (its `replicate` traced)."""
    replicate = tiers.HotTier.replicate
    steps: list[int] = []

    def traced_replicate(self, session):
        steps.append(session.step)
        try:
            return replicate(self, session)
        finally:
            steps.pop()

    tiers.HotTier.replicate = traced_replicate
    return lambda: steps == [step]


def fail_replicas_of(step: int) -> None:
    """This process's hot tier cannot write the replicas it receives for `step`."""
    write, now = LocalStorage.write, replicating(step)

    def failing_write(self, key, parts):
        if now():
            raise StorageError(f"cannot write {key}: No space left on device")
        return write(self, key, parts)

    LocalStorage.write = failing_write


def fail_readback_of(step: int) -> None:
    """This process's hot tier cannot read back what it wrote for `step` to replicate it."""
    read_into, now = LocalStorage.read_into, replicating(step)

    def failing_read_into(self, key, offset, buffers):
        if now():
            raise StorageError(f"cannot read {key}: Input/output error")
        return read_into(self, key, offset, buffers)

    LocalStorage.read_into = failing_read_into


def hot_tier_job(url: str, rank: int, hot: str, scenario: str) -> None:
    if rank == 3 and scenario == "drain":
        die_in_drain_of(2)
    if rank == 2 and scenario == "replica":
        fail_replicas_of(2)
    if rank == 1 and scenario == "readback":
        fail_readback_of(2)
    layout = parse_layout("tp2pp2", 4)
    model = ShardedModel(CONFIG, layout, STATES)
    manager = CheckpointManager(
        url, options=OPTIONS, mode="async", comm=TorchComm(), local_dir=f"{hot}/{'AABB'[rank]}", durable_every=1
    )
    for step in (1, 2, 3, 4):
        manager.save_sharded(step, shard(full_state(step), CONFIG, layout, rank, STATES), model)
    manager.wait()


def main() -> None:
    scenario, url, out = sys.argv[1:4]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    failed = None
    try:
        save(url, rank) if scenario == "save" else hot_tier_job(url, rank, f"{out}/hot", scenario)
    except Exception as e:  # noqa: BLE001 -- what it raised is the result
        failed = [type(e).__name__, str(e)]
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(failed, f)


if __name__ == "__main__":
    main()
