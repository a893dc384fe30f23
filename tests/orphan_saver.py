"""Run by test_orphan_writer.py: a trainer whose async save (by the writer process) is in flight when it is killed.

Usage: python -m tests.orphan_saver ROOT [--thread]
Commits step 1, prints {"writer_pid": ...}, starts an async save of step 2 and prints SAVING, then waits to be
killed. Step 2's writes are many small fsynced objects through one IO thread, so they take a while to drain.
"""

from __future__ import annotations

import json
import sys
import threading
import time

import torch

import ucp

# (packing off: the point is many small fsynced objects, which packs would merge into one)
OPTIONS = ucp.SaveOptions(
    chunking=ucp.ChunkingPolicy(object_bytes=16384, inner_bytes=4096, pack_below=0), io_threads=1, fsync=True
)


def state(seed: int, n: int = 48) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"model": {f"w{i}": torch.randn(64, 256, generator=g) for i in range(n)}, "seed": seed}


def main(root: str, from_thread: bool = False) -> None:
    made: list = []
    if from_thread:  # (a writer started from another thread has no parent-death signal: its watchdog alone stops it)
        maker = threading.Thread(
            target=lambda: made.append(ucp.CheckpointManager(root, mode="async", writer="process", options=OPTIONS))
        )
        maker.start()
        maker.join()
    manager = made[0] if made else ucp.CheckpointManager(root, mode="async", writer="process", options=OPTIONS)
    manager.save(1, state(1, n=8))
    manager.wait()
    print(json.dumps({"writer_pid": manager.pipeline.writer_pid}), flush=True)
    manager.save(2, state(2, n=192))  # (12 MiB in 4 KiB inner chunks through one fsyncing thread: seconds)
    print("SAVING", flush=True)
    time.sleep(3600)


if __name__ == "__main__":
    main(sys.argv[1], "--thread" in sys.argv[2:])
