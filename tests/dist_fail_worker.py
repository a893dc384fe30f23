"""One rank of test_distributed_failures.py: a distributed save in which one rank's writes fail.

Usage: python -m tests.dist_fail_worker URL OUT_DIR
World 2, layout tp2. Rank 1's storage fails every chunk write (ENOSPC). Every rank must raise the same
StorageError (naming rank 1 and the step) and nothing may be committed; so must an error of interop's own type
(InteropError) on rank 1, and failures on both ranks name both; then a save with working storage commits,
and a save of the committed step raises StepExistsError on every rank. Writes OUT_DIR/rank{r}.json.
"""

from __future__ import annotations

import json
import os
import sys

import torch.distributed as dist

import ucp
from ucp.distributed import ShardedModel, TorchComm, save_sharded
from ucp.interop.errors import InteropError
from ucp.sharding.layout import parse_layout
from ucp.sharding.reshard import shard
from ucp.storage import LocalStorage

from .dist_worker import CONFIG, OPTIONS, STATES, full_state


class FullDisk(LocalStorage):
    def write(self, key, parts):
        if "/c." in key:
            raise OSError(28, "No space left on device", key)
        super().write(key, parts)


class Refusing(LocalStorage):
    """Fails its chunk writes with an error of a type that the save protocol's module does not know of itself."""

    def write(self, key, parts):
        if "/c." in key:
            raise InteropError(f"{key}: refused by this rank's source")
        super().write(key, parts)


def outcome(save) -> list[str] | None:
    try:
        save()
    except ucp.UcpError as e:
        return [type(e).__name__, str(e)]
    return None


def main(url: str, out_dir: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    comm = TorchComm()
    layout = parse_layout("tp2")
    model = ShardedModel(CONFIG, layout, STATES)
    local = shard(full_state(), CONFIG, layout, rank, STATES)
    result: dict = {}
    storage = FullDisk(url, fsync=False) if rank == 1 else LocalStorage(url, fsync=False)
    try:
        save_sharded(local, url, step=1, model=model, comm=comm, storage=storage, options=OPTIONS)
        result["failed"] = None
    except ucp.UcpError as e:
        result["failed"] = [type(e).__name__, str(e)]
    result["committed_after_failure"] = ucp.CheckpointManager(url).steps() if rank == 0 else None
    # An error type defined outside ucp's core (interop's), on rank 1; then failures on both ranks
    storage = Refusing(url, fsync=False) if rank == 1 else LocalStorage(url, fsync=False)
    result["interop"] = outcome(
        lambda: save_sharded(local, url, step=2, model=model, comm=comm, storage=storage, options=OPTIONS)
    )
    storage = Refusing(url, fsync=False) if rank == 1 else FullDisk(url, fsync=False)
    result["both"] = outcome(
        lambda: save_sharded(local, url, step=3, model=model, comm=comm, storage=storage, options=OPTIONS)
    )
    dist.barrier()
    record = save_sharded(local, url, step=1, model=model, comm=comm, options=OPTIONS)
    result["second"] = record.step if record is not None else None
    try:
        save_sharded(local, url, step=1, model=model, comm=comm, options=OPTIONS)
        result["again"] = None
    except ucp.StepExistsError as e:
        result["again"] = str(e)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
