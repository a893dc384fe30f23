"""Made the fixture checkpoints in tests/fixtures: v1 with the v1 writer (ucp 0.1.0 before format 2.0), v2 with the
2.0 writer, v3 with the 3.0 writer (format 3.1's manifest came after it); kept to show how they were made. The
states are the same in each (the same seeds), so one `expected.json` (v1's) describes them all.

Usage (at the last commit of that format's writer): python scripts/make_v1_fixture.py tests/fixtures/v1
With `--v3`, the 3.0 writer's layout is exercised whole: some atoms packed (one pack chunk, or one per TP writer),
the others unpacked and sharded (`pack_below` just under their size).
"""

import argparse
import hashlib
import json

import torch

import ucp
from ucp.distributed import ShardedModel, VirtualWorld
from ucp.sharding.families import MixtralConfig, canonical_atoms
from ucp.sharding.layout import parse_layout
from ucp.sharding.reshard import shard

STATES = ("exp_avg", "exp_avg_sq")
CONFIG = MixtralConfig(
    vocab_size=64,
    hidden_size=16,
    intermediate_size=24,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_local_experts=2,
    make_vocab_size_divisible_by=8,
)


def full_state():
    g = torch.Generator().manual_seed(3)
    atoms = canonical_atoms(CONFIG)
    return {
        "model": {n: torch.randn(s, generator=g) for n, (s, _) in atoms.items()},
        "optimizer": {"state": {n: {st: torch.rand(s, generator=g) for st in STATES} for n, (s, _) in atoms.items()}},
    }


def single_state():
    g = torch.Generator().manual_seed(11)
    return {
        "model": {
            "w": torch.randn(48, 40, generator=g),
            "bf": torch.randn(33, 7, generator=g).to(torch.bfloat16),
            "i": torch.arange(10, dtype=torch.int64),
            "flag": torch.tensor([True, False, True]),
            "scalar": torch.tensor(3.5),
            "empty": torch.zeros(0, 4),
        },
        "step": 5,
        "lr": float("nan"),
        "names": ["a", "b"],
    }


def digest(t):
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b"").hexdigest()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out")
    parser.add_argument("--v3", action="store_true", help="mix packed and unpacked atoms (format 3's packs)")
    args = parser.parse_args()
    out = args.out
    state = single_state()
    # (v1 and v2 had no packs: pack_below is ignored by their writers; v3 packs what is under it)
    single_pack, sharded_pack = (1024, 600) if args.v3 else (1 << 20, 1 << 20)
    policy = ucp.ChunkingPolicy(object_bytes=4096, inner_bytes=1024, pack_below=single_pack)
    ucp.save(state, f"{out}/single", step=4, options=ucp.SaveOptions(fsync=False))
    ucp.save(state, f"{out}/single", step=5, options=ucp.SaveOptions(chunking=policy, fsync=False))
    layout = parse_layout("tp2pp1")
    full = full_state()
    VirtualWorld(2).save(
        [shard(full, CONFIG, layout, r, STATES) for r in range(2)],
        f"{out}/sharded",
        step=7,
        model=ShardedModel(CONFIG, layout, STATES),
        extra={"iteration": 7},
        options=ucp.SaveOptions(
            chunking=ucp.ChunkingPolicy(object_bytes=2048, inner_bytes=512, pack_below=sharded_pack), fsync=False
        ),
    )
    expected = {
        "single": {k: [str(v.dtype), list(v.shape), digest(v.reshape(-1))] for k, v in state["model"].items()},
        "sharded": {k: digest(v.reshape(-1)) for k, v in full["model"].items()},
        "config": CONFIG.to_json(),
    }
    with open(f"{out}/expected.json", "w") as f:
        json.dump(expected, f, indent=1, sort_keys=True)


if __name__ == "__main__":
    main()
