"""One rank of tests/test_distributed.py: save a model in one layout with torch.distributed (gloo), then load
it back in several layouts of the same world size and compare with the expected local states.

Usage: python -m tests.dist_worker URL SAVE_LAYOUT LOAD_LAYOUT[,LOAD_LAYOUT...] OUT_DIR
Writes OUT_DIR/rank{r}.json: the keys this rank wrote, and per load layout: exact or not, read amplification.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

from ucp.base.chunking import ChunkingPolicy
from ucp.distributed import ShardedModel, TorchComm, extra_state, load_sharded, save_sharded
from ucp.engine.checkpoint import CheckpointReader, SaveOptions
from ucp.manager import CheckpointManager
from ucp.sharding.families import MixtralConfig, canonical_atoms
from ucp.sharding.layout import parse_layout
from ucp.sharding.reshard import shard
from ucp.storage import open_storage

STATES = ("exp_avg", "exp_avg_sq")
CONFIG = MixtralConfig(
    vocab_size=500,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    num_local_experts=2,
    make_vocab_size_divisible_by=8,
)
# Small atoms (norms, routers, their states: under 1 KiB) packed, the rest in small shards that partial reads cut.
OPTIONS = SaveOptions(chunking=ChunkingPolicy(object_bytes=16384, inner_bytes=2048, pack_below=1024), fsync=False)
# Fewer, larger objects where each request costs milliseconds (the S3 server).
LARGE_OPTIONS = SaveOptions(
    chunking=ChunkingPolicy(object_bytes=65536, inner_bytes=8192, pack_below=8192), fsync=False
)  # (the norms packed, the rest not: both kinds on S3)


def full_state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    atoms = canonical_atoms(CONFIG)
    return {
        "model": {n: torch.randn(s, generator=g) for n, (s, _) in atoms.items()},
        "optimizer": {"state": {n: {st: torch.rand(s, generator=g) for st in STATES} for n, (s, _) in atoms.items()}},
    }


def same(a, b) -> bool:
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def main(url: str, save_layout: str, load_layouts: str, out_dir: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    storage_options = json.loads(os.environ.get("UCP_TEST_STORAGE_OPTIONS", "null"))
    full = full_state()
    layout = parse_layout(save_layout, dist.get_world_size())
    options = LARGE_OPTIONS if url.startswith("s3://") else OPTIONS
    mode = os.environ.get("UCP_TEST_SAVE_MODE", "sync")
    local_state = shard(full, CONFIG, layout, rank, STATES)
    extra = {"iteration": 7, "data": {"consumed": 123}}
    if mode == "sync":
        storage = open_storage(url, storage_options, fsync=False)
        storage.stats.write_log = []
        save_sharded(
            local_state,
            url,
            step=7,
            model=ShardedModel(CONFIG, layout, STATES),
            comm=TorchComm(),
            extra=extra,
            storage=storage,
            options=options,
        )
    else:  # an async or lazy save through the manager: its writer process encodes and writes (packs included)
        manager = CheckpointManager(url, storage_options=storage_options, options=options, mode=mode, comm=TorchComm())
        storage = manager.storage
        storage.stats.write_log = []
        manager.save_sharded(7, local_state, ShardedModel(CONFIG, layout, STATES), extra=extra)
        manager.wait()
        manager.close()
    result = {"writes": storage.stats.write_log, "loads": {}}
    for name in load_layouts.split(","):
        target = parse_layout(name, dist.get_world_size())
        reader = CheckpointReader(open_storage(url, storage_options), "latest")
        local, report = load_sharded(reader, ShardedModel(CONFIG, target, STATES), rank)
        result["loads"][name] = {
            "exact": same(local, shard(full, CONFIG, target, rank, STATES)),
            "amplification": report.amplification,
            "extra": extra_state(reader),
        }
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
