"""The collectives under every save and hot-tier decision (`ucp.protocol.comm`): the binomial-tree gather and scatter
with exact sizes, and the sparse exchange of counts built on them. The trees run first in one process, with a thread
per rank and queues for the links (any world size, and what each rank receives measured), then over gloo."""

from __future__ import annotations

import math
import queue
import random
import threading

import pytest

from ucp.protocol.comm import LocalComm, exchange_sizes, tree_gather, tree_scatter

from .helpers import DRAW
from .launch import spawn


class Links:
    """Point-to-point links between the threads standing for ranks, counting what each rank receives."""

    def __init__(self, world: int):
        self.queues = {(s, d): queue.Queue() for s in range(world) for d in range(world) if s != d}
        self.received = [0] * world
        self.messages = [0] * world

    def ends(self, rank: int):
        def send(peer: int, data: bytes) -> None:
            self.queues[(rank, peer)].put(data)

        def recv(peer: int) -> bytes:
            data = self.queues[(peer, rank)].get(timeout=30)
            self.received[rank] += len(data)
            self.messages[rank] += 1
            return data

        return send, recv


def run_ranks(world: int, body) -> list:
    results: list = [None] * world
    errors: list = []

    def run(rank: int) -> None:
        try:
            results[rank] = body(rank)
        except BaseException as e:  # noqa: BLE001 -- reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    return results


WORLDS = sorted({1, 2, 3, 5, 8, *(DRAW.randrange(2, 70) for _ in range(4))})


@pytest.mark.parametrize("world", WORLDS)
def test_tree_gather_and_scatter_deliver_every_message_in_rank_order_with_log_fan_in(world):
    rng = random.Random(DRAW.randrange(1 << 30))
    up = [bytes([r % 251]) * rng.choice([0, 1, rng.randrange(2, 5000)]) for r in range(world)]
    down = [bytes([(r * 7) % 251]) * rng.choice([0, 3, rng.randrange(4, 5000)]) for r in range(world)]
    links = Links(world)
    gathered = run_ranks(world, lambda r: tree_gather(r, world, up[r], *links.ends(r)))
    assert gathered[0] == up and all(g is None for g in gathered[1:])
    rounds = math.ceil(math.log2(world)) if world > 1 else 0
    assert links.messages[0] == rounds  # rank 0 takes one message a round, not one a rank
    payload, framing = sum(map(len, up[1:])), 8 * (world + rounds)
    assert links.received[0] <= payload + framing  # exact sizes: no padding to the longest message
    links = Links(world)
    assert run_ranks(world, lambda r: tree_scatter(r, world, down if r == 0 else None, *links.ends(r))) == down
    assert all(n == (1 if r else 0) for r, n in enumerate(links.messages))  # each rank hears from its parent once


def test_a_world_of_one_gathers_and_scatters_its_own_message():
    comm = LocalComm()
    assert comm.gather_bytes(b"x") == [b"x"] and comm.scatter_bytes([b"y"]) == b"y"
    assert exchange_sizes(comm, {0: 12}) == {0: 12} and exchange_sizes(comm, {}) == {}


@pytest.mark.parametrize("world", [2, 5])
def test_gather_scatter_and_exchange_sizes_over_gloo(world):
    outputs = spawn(["tests/comm_worker.py", str(DRAW.randrange(1 << 30)), "12"], world, timeout=120)
    assert all("ok: 12 trials" in out for out in outputs), outputs
