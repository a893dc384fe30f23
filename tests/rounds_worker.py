"""Run by test_hot_tier.py as ranks of a gloo world: the hot tier's point-to-point rounds (ucp.distributed.tiers.send_rounds,
used to replicate a save and to restore from peers) with random transfers.

    python tests/rounds_worker.py SEED TRIALS

Per trial every rank draws the same plan from SEED: for some ordered pairs of ranks, a number of batches (0 to 4:
more than one is what a rank whose objects exceed the batch size sends) of a few items each. Each rank sends its
batches and checks that it received exactly the items sent to it, in the batches' order."""

from __future__ import annotations

import datetime
import os
import random
import sys

import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ucp.distributed.tiers import from_bytes, send_rounds
from ucp.protocol.comm import TorchComm


def payload(src: int, dst: int, batch: int, item: int) -> bytes:
    return f"{src}>{dst} batch {batch} item {item};".encode() * (1 + 97 * item)


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
        sends = {
            dst: [[from_bytes(f"{b}/{i}", payload(src, dst, b, i)) for i in range(n)] for b, n in enumerate(batches)]
            for (src, dst), batches in plan.items()
            if src == rank
        }
        received: dict[int, list[tuple[str, bytes]]] = {}

        def keep(peer: int, items: dict, received: dict = received) -> None:
            received.setdefault(peer, []).extend((name, bytes(data)) for name, data in items.items())

        send_rounds(comm, sends, [src for (src, dst) in plan if dst == rank], keep)
        expected = {
            src: [(f"{b}/{i}", payload(src, rank, b, i)) for b, n in enumerate(batches) for i in range(n)]
            for (src, dst), batches in plan.items()
            if dst == rank
        }
        assert {p: v for p, v in received.items() if v} == {p: v for p, v in expected.items() if v}, trial
    dist.barrier()
    dist.destroy_process_group()
    print(f"ok: {trials} trials", flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
