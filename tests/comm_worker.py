"""Run by test_comm.py as ranks of a gloo world: `TorchComm`'s tree gather and scatter and `exchange_sizes` over
real point-to-point messages, trial by trial.

    python tests/comm_worker.py SEED TRIALS

Per trial every rank draws the same plan from SEED: each rank's message (sizes from empty to ~100 KB), a message
for every rank from rank 0, and which peers each rank sends how many bytes. Each rank checks what it got."""

from __future__ import annotations

import datetime
import os
import random
import sys

import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ucp.protocol.comm import TorchComm, exchange_sizes


def message(rng: random.Random, tag: str) -> bytes:
    n = rng.choice([0, 1, rng.randrange(2, 100), rng.randrange(100, 100_000)])
    return (tag.encode() * (n // max(len(tag), 1) + 1))[:n]


def main(seed: int, trials: int) -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    comm = TorchComm(None)
    rng = random.Random(seed)
    for trial in range(trials):
        up = [message(rng, f"{trial}:{r}>0;") for r in range(world)]
        down = [message(rng, f"{trial}:0>{r};") for r in range(world)]
        sizes = {(s, d): rng.randrange(0, 1 << 40) for s in range(world) for d in range(world) if rng.random() < 0.4}
        gathered = comm.gather_bytes(up[rank])
        assert gathered == (up if rank == 0 else None), trial
        assert comm.scatter_bytes(down if rank == 0 else None) == down[rank], trial
        got = exchange_sizes(comm, {d: n for (s, d), n in sizes.items() if s == rank})
        assert got == {s: n for (s, d), n in sizes.items() if d == rank}, trial
    dist.barrier()
    dist.destroy_process_group()
    print(f"ok: {trials} trials", flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
