"""One rank of tests/test_distributed_hunt.py: a distributed save over gloo of a drawn model in a drawn layout, with a
drawn chunking policy and dtypes, then loads in other layouts; or a save in which one rank fails at a drawn point.

Usage: python -m tests.distributed_hunt_worker CASE_JSON OUT_DIR
CASE_JSON (made by the test, `case` there): family and config, save layout, load layouts, dtypes, chunking, seed,
the steps to save and, for a failure case, `fail`: {"step", "rank", "at" (plan, dtype, shape, write, commit, after),
"how" (raise, kill), "nth"} (`Failing`, `misplan`).
Writes OUT_DIR/rank{r}.json: per step its outcome ([type, message, seconds] or null), per load layout the ranks
whose loaded state differs from `shard` of the canonical state (with the first difference), or the load's error.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import sys
import threading
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

import ucp
from ucp.base.chunking import ChunkingPolicy
from ucp.distributed import ShardedModel, TorchComm, extra_state, load_sharded, save_sharded
from ucp.engine.checkpoint import CheckpointReader, SaveOptions
from ucp.errors import StorageError, UcpError
from ucp.sharding.families import FAMILIES, canonical_atoms
from ucp.sharding.layout import parse_layout
from ucp.sharding.reshard import shard
from ucp.storage import LocalStorage, open_storage

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def config_of(case: dict) -> Any:
    return FAMILIES[case["family"]].config_cls.from_json(case["config"])


def full_state(case: dict, step: int) -> dict:
    """The canonical state the case saves at `step` (every step's values differ)."""
    g = torch.Generator().manual_seed(case["seed"] * 1000 + step)
    param, states = DTYPES[case["param_dtype"]], case["states"]
    atoms = canonical_atoms(config_of(case))
    return {
        "model": {n: torch.randn(s, generator=g).to(param) for n, (s, _) in atoms.items()},
        "optimizer": {
            "state": {
                n: {st: torch.randn(s, generator=g).to(DTYPES[dt]) for st, dt in states.items()}
                for n, (s, _) in atoms.items()
            }
        },
    }


def first_difference(a: Any, b: Any, path: str = "") -> str | None:
    """Where two local states differ (keys, dtype, shape or bytes), or None."""
    if isinstance(a, dict):
        if not isinstance(b, dict) or sorted(a) != sorted(b):
            return f"{path}: keys {sorted(a)} != {sorted(b) if isinstance(b, dict) else type(b).__name__}"
        for k in a:
            found = first_difference(a[k], b[k], f"{path}/{k}")
            if found:
                return found
        return None
    if not isinstance(b, torch.Tensor) or a.dtype != b.dtype or a.shape != b.shape:
        return f"{path}: {a.dtype}{tuple(a.shape)} != {getattr(b, 'dtype', b)}{tuple(getattr(b, 'shape', ()))}"
    if not torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)):
        return f"{path}: bytes differ"
    return None


class Failing(LocalStorage):
    """This rank's storage: fails (raises a StorageError, as a refused write does, or SIGKILLs the process) at the
    `nth` write of a kind of object: a chunk, pack or atom document ("write"), or the commit's manifest or marker ("commit", the
    coordinator's). "after": this rank is killed a second after its writes are durable, while the coordinator, slow
    to write the manifest (`Slow`), commits."""

    def __init__(self, url: str, fail: dict):
        super().__init__(url, fsync=False)
        self.fail, self.seen = fail, 0

    def flush(self) -> None:
        super().flush()
        if self.fail["at"] == "after":
            threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGKILL)).start()

    def _hit(self, key: str) -> None:
        if self.fail["at"] == "after":
            return
        parts = key.split("/")  # step_N/attempt-X/...
        inside = parts[2:] if len(parts) > 2 and parts[1].startswith("attempt-") else None
        if self.fail["at"] == "write":
            # (a chunk, a pack, an atom's zarr.json: not the owner record, the manifest or its index)
            ours = inside is not None and inside[0] not in ("ucp-attempt.json", "zarr.json", "ucp-index")
        else:  # the attempt's manifest (its zarr.json, its index parts), the step's marker
            ours = (
                inside in (["zarr.json"],)
                or (inside is not None and inside[0] == "ucp-index")
                or key.endswith("ucp-commit.json")
            )
        if not ours:
            return
        self.seen += 1
        if self.seen < self.fail["nth"]:
            return
        if self.fail["how"] == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        raise StorageError(f"cannot write {key}: injected failure")

    def write(self, key, parts):
        self._hit(key)
        super().write(key, parts)

    def create_exclusive(self, key, data):
        self._hit(key)
        super().create_exclusive(key, data)


class Slow(LocalStorage):
    """The coordinator's storage while another rank dies after its writes: the manifest takes 4 s to write."""

    def write(self, key, parts):
        if key.endswith("/zarr.json") and key.count("/") == 2:
            time.sleep(4)
        super().write(key, parts)


def tensors(state: dict) -> list[tuple[dict, str]]:
    """Every tensor of a nested state, as (its dict, its key)."""
    found = []
    for key, value in state.items():
        found += tensors(value) if isinstance(value, dict) else [(state, key)]
    return found


def misplan(local: dict, at: str) -> None:
    """Make a local state that a save must refuse: one that lacks a tensor ("plan"), holds every tensor in the other
    dtype ("dtype": the ranks then disagree) or one tensor twice as long ("shape")."""
    where, key = tensors(local)[0]
    if at == "plan":
        where.pop(key)
    elif at == "shape":
        where[key] = torch.cat([where[key], where[key]])
    else:
        for where, key in tensors(local):
            other = torch.bfloat16 if where[key].dtype == torch.float32 else torch.float32
            where[key] = where[key].to(other)


def outcome(save) -> list | None:
    started = time.monotonic()
    try:
        save()
    except UcpError as e:
        return [type(e).__name__, str(e), time.monotonic() - started]
    return None


def main(case_json: str, out_dir: str) -> None:
    case = json.loads(case_json)
    dist.init_process_group("gloo", timeout=timedelta(seconds=case.get("timeout_s", 60)))
    rank, world = dist.get_rank(), dist.get_world_size()
    url = case["url"]
    config = config_of(case)
    states = tuple(case["states"])
    layout = parse_layout(case["save"], world)
    model = ShardedModel(config, layout, states)
    policy = ChunkingPolicy(**case["chunking"])
    options = SaveOptions(chunking=policy, fsync=False)
    fail = case.get("fail")
    result: dict[str, Any] = {"saves": {}, "loads": {}}
    comm = TorchComm()
    for step in case["steps"]:
        local = shard(full_state(case, step), config, layout, rank, states)
        storage: LocalStorage = LocalStorage(url, fsync=False)
        failing_here = fail is not None and fail["step"] == step and fail["rank"] == rank
        if failing_here and fail["at"] in ("plan", "dtype", "shape"):
            if fail["how"] == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            misplan(local, fail["at"])
        elif failing_here:
            storage = Failing(url, fail)
        elif fail is not None and fail["step"] == step and fail["at"] == "after" and rank == 0:
            storage = Slow(url, fsync=False)
        extra = {"scheduler": {"lr": 1e-4 * step, "last_epoch": step}, "data": {"consumed": [step, world]}}
        result["saves"][str(step)] = outcome(
            functools.partial(
                save_sharded,
                local,
                url,
                step=step,
                model=model,
                comm=comm,
                extra=extra,
                storage=storage,
                options=options,
            )
        )
        if result["saves"][str(step)] and result["saves"][str(step)][0] == "PeerLostError":
            break  # (a process of the job is gone: its group can do no more)
    result["committed"] = ucp.CheckpointManager(url).steps()
    for step in result["committed"]:
        reader = CheckpointReader(open_storage(url), step)
        result.setdefault("extra", {})[str(step)] = extra_state(reader)
        for name in case["loads"]:
            target = parse_layout(name)
            found: dict[str, Any] = {}
            try:
                full = full_state(case, step)
                for r in range(rank, target.world_size, world):  # (the load ranks spread over the processes)
                    got, _ = load_sharded(reader, ShardedModel(config, target, states), r)  # (first: it refuses)
                    diff = first_difference(shard(full, config, target, r, states), got)
                    if diff:
                        found[str(r)] = diff
            except UcpError as e:
                found = {"error": [type(e).__name__, str(e)]}
            result["loads"][f"{step}:{name}"] = found
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    if any(r and r[0] == "PeerLostError" for r in result["saves"].values()):
        os._exit(0)  # (the group lost a process: tearing it down could wait for it)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
