"""Recovery without a restart: the processes that survive a lost node re-form the job among themselves.

Under torchrun's elastic agent a lost node costs a restart of every worker: the survivors' agent notices the
loss only when its own workers exit, drops the lost agent from the rendezvous after its keep-alive lapses, and
starts new processes, which import torch, join new groups and build the model (docs/BENCHMARKS.md: 10-13 s of
fixed costs on 2 cores). With `--regroup-store HOST:PORT` the trainer does it in place instead:

1. A survivor's collective fails (the lost peer's connections reset) and the step raises.
2. Every survivor registers in the store under this incarnation's next generation, and waits until no new one
   has registered for `settle_s`; the first to see that closes the generation with the count (compare-and-set, so
   every survivor reads the same count). One that registers after the close ends its process (torchrun then
   restarts the node's workers: the ordinary path).
3. The survivors destroy their process groups and form a new one of `count` processes, ranked in their old rank
   order; the trainer is built for the first layout that fits and restores the newest step. The hot tier serves
   it from the survivors' memory (the lost node's pieces from their replica), as after a restart.

Why restore rather than keep the tensors that are already in memory: the lost node's shards exist nowhere but in
the checkpoint, so the state must be that of a committed step, and a survivor's own tensors may be part-way
through a step. What the in-place path saves is detection and process start, not the read.

The store must outlive any node the job can lose. torchrun's c10d rendezvous store lives in the first agent,
whose loss ends the job anyway, so its endpoint (`--rdzv-endpoint`) is the natural choice; the workers' own store
(MASTER_ADDR) lives in rank 0's process and dies with its node. The agent stays out of the way: it restarts its
workers only when one of them exits or another node joins, so a shrunken job runs on, and a node that comes back
grows it through the ordinary restart.

A failure that does not shrink the job (every process registers: a bug, not a lost peer) is raised again: a
re-formed group would fail the same way.
"""

from __future__ import annotations

import datetime
import os
import time

import torch.distributed as dist

SETTLE_S = 1.0  # how long the registrations must stand still before the survivors are counted


class RegroupError(RuntimeError):
    """The survivors could not re-form the job in place (the process ends; the agent restarts it)."""


class Regroup:
    """This process's part in re-forming the job among the survivors of a failure, through `address`'s store."""

    def __init__(self, address: str, rank: int, world_size: int, timeout_s: float, settle_s: float = SETTLE_S):
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"--regroup-store must be HOST:PORT, got {address!r}")
        self.store = dist.TCPStore(host, int(port), is_master=False, timeout=datetime.timedelta(seconds=timeout_s))
        # One namespace per incarnation of the job: every worker of an agents' round has the same master address.
        round_id = f"{os.environ.get('MASTER_ADDR', '')}:{os.environ.get('MASTER_PORT', '')}"
        self.prefix = f"ucp/regroup/{os.environ.get('TORCHELASTIC_RUN_ID', 'run')}/{round_id}"
        self.rank, self.world_size = rank, world_size
        self.generation = 0
        self.timeout_s, self.settle_s = timeout_s, settle_s

    def survivors(self) -> tuple[int, int, dist.Store]:
        """Register, wait for the others, and return this process's rank and the world size among the survivors,
        with the store the new process group forms through."""
        self.generation += 1
        prefix = f"{self.prefix}/{self.generation}"
        order = self.store.add(f"{prefix}/joined", 1)
        self.store.set(f"{prefix}/member/{order}", str(self.rank))
        count = self._settle(prefix)
        if order > count:
            raise RegroupError(
                f"rank {self.rank} reached the regroup after the survivors were counted ({count}): restarting"
            )
        if count >= self.world_size:
            raise RegroupError(f"every one of the {count} processes is still here: the failure is not a lost peer")
        members = sorted(int(self.store.get(f"{prefix}/member/{i}")) for i in range(1, count + 1))
        self.rank, self.world_size = members.index(self.rank), count
        return self.rank, count, dist.PrefixStore(f"{prefix}/group", self.store)

    def _settle(self, prefix: str) -> int:
        """The number of survivors: the registrations once none has come for `settle_s`, as the first survivor to
        see that recorded it."""
        joined, closed = f"{prefix}/joined", f"{prefix}/closed"
        deadline = time.monotonic() + self.timeout_s
        last, since = -1, time.monotonic()
        while not self.store.check([closed]):
            count = self.store.add(joined, 0)
            now = time.monotonic()
            if count != last:
                last, since = count, now
            elif now - since >= self.settle_s:
                self.store.compare_set(closed, "", str(count))
                break
            if now > deadline:
                raise RegroupError(f"the survivors did not settle within {self.timeout_s:.0f} s")
            time.sleep(0.05)
        return int(self.store.get(closed))
