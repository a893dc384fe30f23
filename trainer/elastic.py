"""Nodes of an elastic job, simulated on one machine: each node is a torchrun elastic agent with its own worker
processes, and a lost node is its agent and every process under it killed with SIGKILL at once (as a power cut
would). Used by the demo, the recovery benchmark and the tests; on a cluster, start the same torchrun command
on each node (docs/ELASTIC.md).

Rendezvous is torchrun's c10d backend: the first agent to start hosts its store, so losing that node ends the
job (an etcd rendezvous, `--rdzv-backend etcd-v2`, removes that single point of failure). Two settings matter:

- `--rdzv-conf` below: a lost agent is dropped from the rendezvous after five seconds without its keep-alive
  (keep_alive_interval x keep_alive_max_attempt; torch's default is fifteen), and a new round closes one second
  after the minimum of nodes has joined;
- TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: with the store shared between rendezvous and workers (torch >= 2.4's
  default), a node that joins a running job waits forever for the master address of a round whose rank 0 kept
  the previous round's (seen with torch 2.13: both agents time out after a minute). Not sharing it costs one
  TCP store per round.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .launch import REPO, free_port

RDZV_CONF = "last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=5,join_timeout=300"


def descendants(pid: int) -> list[int]:
    """`pid` and every process below it (read from /proc; workers run in sessions of their own)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat[stat.rindex(b")") + 2 :].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    tree, i = [pid], 0
    while i < len(tree):
        tree += children.get(tree[i], [])
        i += 1
    return tree


def alive(pid: int) -> bool:
    """A process that still runs (a zombie waiting to be reaped does not)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rindex(b")") + 2 :].split()[0] not in (b"Z", b"X")


@dataclass
class Node:
    """One simulated node: a torchrun agent and its workers."""

    name: str
    proc: subprocess.Popen
    log: Path

    def processes(self) -> list[int]:
        return [p for p in descendants(self.proc.pid) if alive(p)]

    def kill(self) -> float:
        """SIGKILL the agent and every process under it at once; returns when (time.time())."""
        tree = self.processes()
        killed_at = time.time()
        for pid in tree:
            _signal(pid, signal.SIGKILL)
        self.proc.wait()
        deadline = time.monotonic() + 10
        while any(alive(p) for p in tree) and time.monotonic() < deadline:
            time.sleep(0.02)
        return killed_at

    def wait(self, timeout: float) -> int:
        return self.proc.wait(timeout)


def _signal(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass


def rendezvous_waiting(endpoint: str, run_id: str, nnodes: str) -> Callable[[], int]:
    """How many nodes wait in the job's rendezvous for the next round (what each agent checks to re-form the
    job), read without joining it."""
    from torch.distributed.elastic.rendezvous import RendezvousParameters, rendezvous_handler_registry

    low, _, high = nnodes.partition(":")
    conf = dict(item.split("=") for item in RDZV_CONF.split(","))
    params = RendezvousParameters("c10d", endpoint, run_id, int(low), int(high or low), is_host="false", **conf)
    return rendezvous_handler_registry.create_handler(params).num_nodes_waiting


def endpoint() -> str:
    return f"127.0.0.1:{free_port()}"


def start_node(
    name: str,
    argv: list[str],
    *,
    nproc: int,
    rdzv_endpoint: str,
    run_id: str,
    nnodes: str,
    log: Path,
    hosts_store: bool,
    max_restarts: int = 20,
    env: dict[str, str] | None = None,
) -> Node:
    """Start a torchrun elastic agent running `python *argv` on `nproc` processes, its output to `log`.

    `hosts_store`: whether this agent hosts the rendezvous store. Say so explicitly: left to itself, every agent
    whose address matches the endpoint tries to host it, and on one machine a late agent can bind the same port
    beside the first (seen: a rejoining node formed a job of its own instead of joining the running one)."""
    node_env = (
        os.environ
        | (env or {})
        | {
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
            "OMP_NUM_THREADS": "1",
            "PYTHONUNBUFFERED": "1",
        }
    )
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        nnodes,
        "--nproc-per-node",
        str(nproc),
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        rdzv_endpoint,
        "--rdzv-id",
        run_id,
        "--max-restarts",
        str(max_restarts),
        "--monitor-interval",
        "0.5",
        "--rdzv-conf",
        f"{RDZV_CONF},is_host={'true' if hosts_store else 'false'}",
        *argv,
    ]
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "a") as out:
        proc = subprocess.Popen(
            command, cwd=REPO, env=node_env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    return Node(name, proc, log)


class Job:
    """An elastic job of simulated nodes of `nproc` processes each, started, lost and brought back by name. The
    first node started hosts the rendezvous store; `node_args(name)` adds per-node arguments (its --ckpt-local);
    `in_place`: survivors of a lost node re-form the job without a restart (the trainer's --regroup-store)."""

    def __init__(
        self,
        argv: list[str],
        run_id: str,
        log_dir: Path,
        *,
        nproc: int = 2,
        nnodes: str = "1:2",
        node_args: Callable[[str], list[str]] | None = None,
        env: dict[str, str] | None = None,
        in_place: bool = False,
    ):
        self.argv, self.run_id, self.log_dir, self.nproc, self.nnodes = argv, run_id, log_dir, nproc, nnodes
        self.node_args = node_args or (lambda _name: [])
        self.env = env
        self.endpoint = endpoint()
        if in_place:  # survivors of a lost node re-form the job through the rendezvous store (trainer/regroup.py)
            self.argv = [*argv, "--regroup-store", self.endpoint]
        self.nodes: dict[str, Node] = {}
        self._host: str | None = None

    def start(self, name: str) -> Node:
        self._host = self._host or name
        self.nodes[name] = start_node(
            name,
            [*self.argv, *self.node_args(name)],
            nproc=self.nproc,
            rdzv_endpoint=self.endpoint,
            run_id=self.run_id,
            nnodes=self.nnodes,
            log=self.log_dir / f"node-{name}.log",
            hosts_store=name == self._host,
            env=self.env,
        )
        return self.nodes[name]

    def join(self, name: str, timeout: float = 300) -> Node:
        """Start node `name` into the running job and hold the running nodes' workers (SIGSTOP) until the
        rendezvous lists the newcomer as waiting: the agents then re-form the job at their next check (every
        --monitor-interval). Unheld, a short job on a busy machine can finish its last steps before the new agent
        has even imported torch, and never grow."""
        running = [pid for node in self.nodes.values() for pid in node.processes() if pid != node.proc.pid]
        for pid in running:
            _signal(pid, signal.SIGSTOP)
        try:
            node = self.start(name)
            waiting = rendezvous_waiting(self.endpoint, self.run_id, self.nnodes)
            self.wait_for(lambda: waiting() > 0, f"node {name} in the rendezvous", timeout)
            return node
        finally:
            for pid in running:
                _signal(pid, signal.SIGCONT)

    def lose(self, name: str) -> float:
        """Kill node `name` as a power cut would; returns when (time.time())."""
        return self.nodes.pop(name).kill()

    def wait_for(self, condition: Callable[[], object], what: str, timeout: float = 600) -> None:
        """Poll `condition` until it holds; a node that ends meanwhile, or the timeout, raises with the logs."""
        deadline = time.monotonic() + timeout
        while not condition():
            if time.monotonic() > deadline or any(n.proc.poll() is not None for n in self.nodes.values()):
                raise RuntimeError(f"gave up waiting for {what}:\n{self.tails()}")
            time.sleep(0.05)

    def wait(self, timeout: float) -> None:
        """Wait for every node to finish; raise with the logs if one failed."""
        for node in self.nodes.values():
            if node.wait(timeout) != 0:
                raise RuntimeError(f"node {node.name} failed:\n{self.tails()}")

    def tails(self) -> str:
        return "\n".join(f"--- node {n.name}\n{n.log.read_text()[-3000:]}" for n in self.nodes.values())

    def stop(self) -> None:
        for node in self.nodes.values():
            node.kill()
