"""Run by test_crash.py in a subprocess: save step 1, then start saving step 2 and freeze at a given stage.

The freeze is injected by wrapping the storage (the code under test is otherwise untouched):
  chunks         after a few chunk objects of step 2 are written
  before_commit  all data and the manifest are written, the commit marker is not
  during_commit  the commit marker's temporary file is written and durable, not yet linked to its name
The parent kills this process with SIGKILL once it prints READY.
"""

from __future__ import annotations

import sys
import time

import torch

import ucp
from ucp.format.manifest import COMMIT_MARKER
from ucp.storage import LocalStorage


def state(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"model": {f"w{i}": torch.randn(64, 64, generator=g) for i in range(12)}, "step": step}


def freeze() -> None:
    print("READY", flush=True)
    while True:
        time.sleep(1)


def main(root: str, stage: str) -> None:
    # (packs of 16 KiB: each atom one pack, so that the save writes a dozen data objects, like chunks before packs)
    policy = ucp.ChunkingPolicy(object_bytes=8192, inner_bytes=4096, pack_bytes=16384)
    options = ucp.SaveOptions(chunking=policy, io_threads=1)
    manager = ucp.CheckpointManager(root, options=options)
    manager.save(1, state(1))

    write, write_file, create_exclusive = LocalStorage.write, LocalStorage._write_file, LocalStorage.create_exclusive
    chunk_writes = 0

    def counting_write(self, key, parts):
        nonlocal chunk_writes
        if stage == "chunks" and "/c." in key:
            chunk_writes += 1
            if chunk_writes == 5:
                freeze()
        return write(self, key, parts)

    def frozen_create(self, key, data):
        if stage == "before_commit" and key.endswith(COMMIT_MARKER):
            freeze()
        return create_exclusive(self, key, data)

    def marker_temp(self, path, parts, flags):
        done = write_file(self, path, parts, flags)
        if stage == "during_commit" and COMMIT_MARKER in path and path.endswith(".tmp"):
            freeze()
        return done

    LocalStorage.write, LocalStorage._write_file, LocalStorage.create_exclusive = (
        counting_write,
        marker_temp,
        frozen_create,
    )
    manager.save(2, state(2))
    print("UNEXPECTED: the save finished", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
