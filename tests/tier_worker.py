"""One rank of test_hot_tier.py: save steps through a hot tier, or restore from it, on simulated nodes.

Usage: python -m tests.tier_worker save|restore DURABLE_URL LAYOUT OUT_DIR STEPS
The environment gives each rank its node: UCP_TEST_NODE_DIRS is a JSON list of local directories, one per rank
(ranks with the same directory are one node), UCP_TEST_DURABLE_EVERY how often a save drains to the durable URL.
`save` saves the given steps (a comma list) of `state(step)`; `restore` restores the latest step and writes
OUT_DIR/rank{r}.json: the step, whether the local state equals state(step) sharded for this rank, bytes per tier;
then it saves the given steps, if any (0: none), as the resumed job would. UCP_TEST_BAD_INTO_RANK names a rank
that restores into a tensor of the wrong shape: it writes the error it gets instead.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

import ucp
from ucp.distributed import ShardedModel, TorchComm
from ucp.sharding.layout import parse_layout
from ucp.sharding.reshard import shard

from .dist_worker import CONFIG, OPTIONS, STATES, full_state, same


def main(action: str, url: str, layout_name: str, out_dir: str, steps: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    local_dir = json.loads(os.environ["UCP_TEST_NODE_DIRS"])[rank]
    layout = parse_layout(layout_name)
    model = ShardedModel(CONFIG, layout, STATES)
    manager = ucp.CheckpointManager(
        url,
        comm=TorchComm(dist.new_group(backend="gloo")),
        options=OPTIONS,
        local_dir=local_dir,
        local_keep=2,
        durable_every=int(os.environ.get("UCP_TEST_DURABLE_EVERY", "1")),
    )
    result: dict = {}
    if action == "save":
        for step in map(int, steps.split(",")):
            manager.save_sharded(
                step,
                shard(full_state(step), CONFIG, layout, rank, STATES),
                model,
                extra={"step": step, "rng": torch.arange(4, dtype=torch.uint8) + step},
            )
        manager.wait()
    elif os.environ.get("UCP_TEST_BAD_INTO_RANK") == str(rank):
        param = next(iter(shard(full_state(0), CONFIG, layout, rank, STATES)["model"]))
        try:
            manager.restore_sharded(model, rank, into={"model": {param: torch.zeros(1)}})
            result = {"error": None}
        except ucp.UcpError as e:
            result = {"error": type(e).__name__, "message": str(e)}
    else:
        try:
            result = restored(manager, model, layout, rank)
        except ucp.CheckpointNotFoundError as e:  # (a fresh start: nothing to restore)
            result = {"step": None, "error": str(e)}
        for step in (int(s) for s in steps.split(",") if s != "0"):  # the job goes on: it saves the steps it redoes
            manager.save_sharded(
                step,
                shard(full_state(step), CONFIG, layout, rank, STATES),
                model,
                extra={"step": step, "rng": torch.arange(4, dtype=torch.uint8) + step},
            )
        manager.wait()
    manager.close()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


def restored(manager: ucp.CheckpointManager, model: ShardedModel, layout, rank: int) -> dict:
    """Restore the latest step: which, whether it is exact, and where its bytes came from."""
    local, extra, report = manager.restore_sharded(model, rank)
    r = manager.last_restore
    step = extra["step"]
    return {
        "step": step,
        "exact": same(local, shard(full_state(step), CONFIG, layout, rank, STATES)),
        "extra_ok": torch.equal(extra["rng"], torch.arange(4, dtype=torch.uint8) + step),
        "source": r.source,
        "local": r.bytes_local,
        "peers": r.bytes_peers,
        "durable": r.bytes_durable,
        "damaged": r.damaged,
        "amplification": report.amplification,
    }


if __name__ == "__main__":
    main(*sys.argv[1:6])
