"""Run by test_hot_tier.py as ranks of a gloo world: the hot tier's point-to-point rounds (ucp.distributed.tiers.send_rounds,
used to replicate a save and to restore from peers) with random transfers.

    python tests/rounds_worker.py SEED TRIALS

Per trial every rank draws the same plan from SEED: for some ordered pairs of ranks, a number of batches (0 to 4:
more than one is what a rank whose objects exceed the batch size sends) of a few items each. Each rank sends its
batches and checks that it received exactly the items sent to it, in the batches' order. Some items cannot be read
(their fill raises, as reading back an object that is gone does): they are left out, the sender is told which, and
the rounds stay in step."""

from __future__ import annotations

import datetime
import os
import random
import sys

import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ucp.distributed.tiers import Item, from_bytes, send_rounds
from ucp.errors import StorageError
from ucp.protocol.comm import TorchComm


def payload(src: int, dst: int, batch: int, item: int) -> bytes:
    return f"{src}>{dst} batch {batch} item {item};".encode() * (1 + 97 * item)


def unreadable(name: str, size: int) -> Item:
    def fill(_dest: memoryview) -> None:
        raise StorageError(f"{name}: gone")

    return name, size, fill


def main(seed: int, trials: int) -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
    comm = TorchComm(None)
    rng = random.Random(seed)
    for trial in range(trials):
        plan = {
            (src, dst): [rng.randrange(0, 4) for _ in range(rng.randrange(0, 5))]  # items per batch
            for src in range(world)
            for dst in range(world)
            if src != dst and rng.random() < 0.7
        }
        bad = {
            (src, dst, b, i) for (src, dst), batches in plan.items() for b, n in enumerate(batches) for i in range(n)
        }
        bad = {key for key in sorted(bad) if rng.random() < 0.2}

        def item(src: int, dst: int, b: int, i: int, bad: set = bad) -> Item:
            name = f"{b}/{i}"
            return unreadable(name, 10 + i) if (src, dst, b, i) in bad else from_bytes(name, payload(src, dst, b, i))

        sends = {
            dst: [[item(src, dst, b, i) for i in range(n)] for b, n in enumerate(batches)]
            for (src, dst), batches in plan.items()
            if src == rank
        }
        received: dict[int, list[tuple[str, bytes]]] = {}

        def keep(peer: int, items: dict, received: dict = received) -> None:
            received.setdefault(peer, []).extend((name, bytes(data)) for name, data in items.items())

        unsent = send_rounds(comm, sends, [src for (src, dst) in plan if dst == rank], keep)
        mine = {f"{b}/{i}" for (src, dst, b, i) in bad if src == rank}
        assert set(unsent) <= mine and (not mine or unsent), (trial, unsent, mine)
        assert all("gone" in str(e) for e in unsent.values()), unsent
        expected = {
            src: [
                (f"{b}/{i}", payload(src, rank, b, i))
                for b, n in enumerate(batches)
                for i in range(n)
                if (src, rank, b, i) not in bad
            ]
            for (src, dst), batches in plan.items()
            if dst == rank
        }
        assert {p: v for p, v in received.items() if v} == {p: v for p, v in expected.items() if v}, trial
    dist.barrier()
    dist.destroy_process_group()
    print(f"ok: {trials} trials", flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
