"""The CPU a resharding load (`load_sharded`) costs, this tree's code beside a baseline revision's, in one run
(docs/BENCHMARKS.md).

Checkpoints are saved once (with this tree's code), then worker processes load them, alternating between this tree
and the baseline (`git archive REV ucp`, unpacked beside the checkpoints and put first on PYTHONPATH). Each worker
loads every scenario once to warm up (imports, cached plans), then `--loads` times, and reports the median CPU
seconds of one load (`time.process_time`: this process, every thread; CPU moves far less with a shared machine's
load than wall time), its reads one at a time (`io_threads=1`: with many threads in flight, the CPU they spend
handing the GIL to each other moves with the machine's load by more than the code under test costs). The figures are the medians over `--repeats` workers of each side, and their ratio.

Scenarios (each the loads of the ranks named, one after another; the state is Mixtral-shaped, fp32 with Adam's two
moments, saved from tp2pp2dp2zero1):
- `packed tp4 r0`, `packed tp2ep2dp4zero1 r0`: ~3,000 small atoms, packed: per-piece planning and Python;
- `sharded tp4 r1`: 2 MiB objects of 16 KiB inner chunks, a TP split reading part of each shard (index lookups);
- `sharded tp1 r0`: the same read whole (shards wanted whole: one read, one copy each);
- `cast bf16 tp2 r0`: weights only, cast to bf16 on load;
- `encode x100 (write)`: not a load: 100 encodes of a 2 MiB shard of 128 inner chunks (its index laid out).

Usage: python scripts/load_plan_profile.py [--baseline main] [--repeats 5] [--loads 3] [--dir /dev/shm]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
STATES = ("exp_avg", "exp_avg_sq")

# name: (checkpoint, load layout, ranks, dtype or None, optimizer states loaded)
SCENARIOS: dict[str, tuple[str, str, list[int], str | None, bool]] = {
    "packed tp4 r0": ("packed", "tp4", [0], None, True),
    "packed tp2ep2dp4zero1 r0": ("packed", "tp2ep2dp4zero1", [0], None, True),
    "sharded tp4 r1": ("sharded", "tp4", [1], None, True),
    "sharded tp1 r0": ("sharded", "tp1", [0], None, True),
    "cast bf16 tp2 r0": ("sharded", "tp2", [0], "bfloat16", False),
}


def configs() -> dict[str, Any]:
    from ucp.sharding.families import MixtralConfig

    small = MixtralConfig(
        vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=24, num_attention_heads=8,
        num_key_value_heads=4, num_local_experts=8, make_vocab_size_divisible_by=128,
    )  # fmt: skip
    large = MixtralConfig(
        vocab_size=4096, hidden_size=512, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=4, num_local_experts=4, make_vocab_size_divisible_by=128,
    )  # fmt: skip
    return {"packed": small, "sharded": large}


def save_checkpoints(root: Path) -> None:
    import torch

    import ucp
    from ucp.distributed import ShardedModel, VirtualWorld
    from ucp.sharding.families import canonical_atoms
    from ucp.sharding.layout import parse_layout
    from ucp.sharding.reshard import shard

    policies = {
        "packed": ucp.ChunkingPolicy(),
        "sharded": ucp.ChunkingPolicy(object_bytes=2 << 20, inner_bytes=16 << 10, pack_below=0),
    }
    layout = parse_layout("tp2pp2dp2zero1")
    g = torch.Generator().manual_seed(0)
    for name, config in configs().items():
        atoms = canonical_atoms(config)
        full = {
            "model": {n: torch.randn(s, generator=g) for n, (s, _) in atoms.items()},
            "optimizer": {
                "state": {n: {st: torch.randn(s, generator=g) for st in STATES} for n, (s, _) in atoms.items()}
            },
        }
        local = [shard(full, config, layout, r, STATES) for r in range(layout.world_size)]
        options = ucp.SaveOptions(chunking=policies[name], fsync=False)
        VirtualWorld(layout.world_size).save(
            local, str(root / name), step=1, model=ShardedModel(config, layout, STATES), options=options
        )


def worker(root: Path, loads: int) -> dict[str, Any]:
    import torch

    import ucp
    from ucp.distributed import ShardedModel, load_sharded
    from ucp.sharding.layout import parse_layout
    from ucp.storage import open_storage

    cfgs = configs()
    out = {}
    for name, (ckpt, layout, ranks, dtype, states) in SCENARIOS.items():
        model = ShardedModel(cfgs[ckpt], parse_layout(layout), STATES if states else ())
        cast = getattr(torch, dtype) if dtype else None
        times = []
        for _ in range(loads + 1):  # (the first warms up)
            reader = ucp.CheckpointReader(open_storage(str(root / ckpt)), io_threads=1)
            t0 = time.process_time()
            for rank in ranks:
                load_sharded(reader, model, rank, dtype=cast)
            times.append(time.process_time() - t0)
        out[name] = statistics.median(times[1:])
    out["encode x100 (write)"] = _encode_seconds(loads)
    return {"ucp": ucp.__file__, **out}


def _encode_seconds(loads: int) -> float:
    """CPU seconds of 100 encodes of a 2 MiB shard of 128 inner chunks (the write side of the shard index)."""
    import torch

    from ucp.format.manifest import AtomMeta
    from ucp.protocol import codec

    meta = AtomMeta("w", (512, 1024), "float32", (512, 1024), (4, 1024))
    values = torch.randn(512, 1024)
    times = []
    for _ in range(loads + 1):
        t0 = time.process_time()
        for _ in range(100):
            codec.encode(meta, (0, 0), values)
        times.append(time.process_time() - t0)
    return statistics.median(times[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", default="main", help="the revision to compare with (git)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--loads", type=int, default=3)
    parser.add_argument("--dir", default="/dev/shm")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(Path(args.worker), args.loads)))
        return
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        root = Path(tmp)
        base = root / "baseline"
        base.mkdir()
        archive = subprocess.run(["git", "archive", args.baseline, "ucp"], cwd=REPO, check=True, capture_output=True)
        subprocess.run(["tar", "-x", "-C", str(base)], input=archive.stdout, check=True)
        save_checkpoints(root)
        sides = {"baseline": str(base), "this tree": str(REPO)}
        figures: dict[str, dict[str, list[float]]] = {side: {} for side in sides}
        for repeat in range(args.repeats):
            for side, path in sorted(sides.items(), reverse=bool(repeat % 2)):  # (each side first in turn)
                env = {**os.environ, "PYTHONPATH": os.pathsep.join([path, str(REPO)])}
                cmd = [sys.executable, __file__, "--worker", str(root), "--loads", str(args.loads)]
                got = json.loads(subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout)
                assert got.pop("ucp").startswith(path), f"the {side} worker imported another ucp"
                for name, seconds in got.items():
                    figures[side].setdefault(name, []).append(seconds)
    print(
        f"CPU seconds of one load, medians of {args.repeats} workers ({args.loads} loads each; min-max of the workers)"
    )
    print(f"{'scenario':28} {'baseline ' + args.baseline:>26} {'this tree':>26} {'ratio':>7}")
    for name in [*SCENARIOS, "encode x100 (write)"]:
        cells = []
        for side in sides:
            got = figures[side][name]
            cells.append(f"{statistics.median(got):.3f} ({min(got):.3f}-{max(got):.3f})")
        ratio = statistics.median(figures["this tree"][name]) / statistics.median(figures["baseline"][name])
        print(f"{name:28} {cells[0]:>26} {cells[1]:>26} {ratio:7.2f}x")


if __name__ == "__main__":
    main()
