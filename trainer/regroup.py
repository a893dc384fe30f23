"""Recovery without a restart: the processes that survive a lost node re-form the job among themselves.

Under torchrun's elastic agent a lost node costs a restart of every worker: the survivors' agent notices the
loss only when its own workers exit, drops the lost agent from the rendezvous after its keep-alive lapses, and
starts new processes, which import torch, join new groups and build the model (docs/BENCHMARKS.md: 10-13 s of
fixed costs on 2 cores). With `--regroup-store HOST:PORT` the trainer does it in place instead:

1. A survivor's collective fails (the lost peer's connections reset) and the step raises.
2. Every survivor registers in the store under this incarnation's next generation (with its node), and waits
   until every node with a survivor has all of its processes registered and no new one has come for `settle_s`;
   the first to see that closes the generation with the count (compare-and-set, so every survivor reads the same
   count). One that registers after the close ends its process (torchrun then restarts the node's workers: the
   ordinary path).
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
import json
import os
import socket
import time
from collections import Counter

import torch
import torch.distributed as dist

SETTLE_S = 1.0  # how long the registrations must stand still before the survivors are counted


class RegroupError(RuntimeError):
    """The survivors could not re-form the job in place (the process ends; the agent restarts it)."""


class Regroup:
    """This process's part in re-forming the job among the survivors of a failure, through `address`'s store."""

    def __init__(
        self,
        address: str,
        rank: int,
        world_size: int,
        timeout_s: float,
        *,
        incarnation: str,
        settle_s: float = SETTLE_S,
        node: tuple[str, int] | None = None,
    ):
        """`incarnation`: the same on every process of this incarnation of the job, and new in each (`incarnation()`);
        `node`: this process's node and the job's process count on it (default: torchrun's, `this_node`)."""
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"--regroup-store must be HOST:PORT, got {address!r}")
        self.store = dist.TCPStore(host, int(port), is_master=False, timeout=datetime.timedelta(seconds=timeout_s))
        self.prefix = f"ucp/regroup/{os.environ.get('TORCHELASTIC_RUN_ID', 'run')}/{incarnation}"
        self.rank, self.world_size = rank, world_size
        self.node = node or this_node()
        self.generation = 0
        self.timeout_s, self.settle_s = timeout_s, settle_s

    def survivors(self) -> tuple[int, int, dist.Store]:
        """Register, wait for the others, and return this process's rank and the world size among the survivors,
        with the store the new process group forms through."""
        self.generation += 1
        prefix = f"{self.prefix}/{self.generation}"
        order = self.store.add(f"{prefix}/joined", 1)
        self.store.set(f"{prefix}/member/{order}", json.dumps([self.rank, *self.node]))
        members = self._settle(prefix)
        if order > len(members):
            raise RegroupError(
                f"rank {self.rank} reached the regroup after the survivors were counted ({len(members)}): restarting"
            )
        if len(members) >= self.world_size:
            raise RegroupError(
                f"every one of the {len(members)} processes is still here: the failure is not a lost peer"
            )
        ranks = sorted(rank for rank, _, _ in members)
        self.rank, self.world_size = ranks.index(self.rank), len(ranks)
        return self.rank, self.world_size, dist.PrefixStore(f"{prefix}/group", self.store)

    def _settle(self, prefix: str) -> list[tuple[int, str, int]]:
        """The survivors (rank, node, processes on the node), once every node that has one has all of its processes
        registered and no other has registered for `settle_s`, as the first survivor to see that recorded it.

        A node is lost whole (its agent and processes), so a survivor waits for the rest of its node: they may
        learn of the failure only when a survivor's group is torn down (seen: a survivor blocked in a TP all-reduce
        with its node's other process registered 1-2 s after it). A node none of whose processes has registered
        within `settle_s` counts as lost; were it not, its processes arrive late and restart through the agent."""
        joined, closed = f"{prefix}/joined", f"{prefix}/closed"
        deadline = time.monotonic() + self.timeout_s
        members: list[tuple[int, str, int]] = []
        since = time.monotonic()
        while not self.store.check([closed]):
            count = self.store.add(joined, 0)
            now = time.monotonic()
            if count != len(members):
                members += [self._member(prefix, i) for i in range(len(members) + 1, count + 1)]
                since = now
            elif now - since >= self.settle_s and _whole_nodes(members):
                self.store.compare_set(closed, "", str(count))
                break
            if now > deadline:
                raise RegroupError(f"the survivors did not settle within {self.timeout_s:.0f} s: {members}")
            time.sleep(0.05)
        count = int(self.store.get(closed))
        members += [self._member(prefix, i) for i in range(len(members) + 1, count + 1)]
        return members[:count]

    def _member(self, prefix: str, order: int) -> tuple[int, str, int]:
        rank, node, size = json.loads(self.store.get(f"{prefix}/member/{order}"))
        return int(rank), str(node), int(size)


def incarnation() -> str:
    """A name for this incarnation of the job, the same on every process (rank 0's random bytes, broadcast over the
    default group): the store outlives incarnations, and each must count its survivors apart."""
    token = torch.frombuffer(bytearray(os.urandom(16)), dtype=torch.uint8)
    dist.broadcast(token, src=0)
    return token.numpy().tobytes().hex()


def _whole_nodes(members: list[tuple[int, str, int]]) -> bool:
    """Whether every node with a registered process has all of its processes registered."""
    counts = Counter(node for _, node, _ in members)
    return all(counts[node] >= size for _, node, size in members)


def this_node() -> tuple[str, int]:
    """This process's node and how many processes the job has on it: torchrun's node rank and local world size
    (a node keeps both through an in-place regroup: no new rendezvous round), or the host alone without torchrun."""
    if "GROUP_RANK" in os.environ and "LOCAL_WORLD_SIZE" in os.environ:
        return f"node{os.environ['GROUP_RANK']}", int(os.environ["LOCAL_WORLD_SIZE"])
    return socket.gethostname(), 1
