"""What one rank's share of ucp's coordination costs as the world grows from 1k to 100k ranks, simulated from the
real code (no process group of that size: the ranks' messages are built as each rank builds its own, and rank 0
runs its real part), this tree beside a baseline revision's in one run (docs/BENCHMARKS.md, issue 40).

The job: a 64-layer, 64-expert Mixtral-like model (hidden 6144, vocab 131072, 48 heads, 8 KV heads, FFN 16384),
bf16 parameters with fp32 master weights and Adam's two moments, in layout tp8pp16ep{min(64, D)}dp{D}zero1
(W = 128 D ranks, 8 a node), chunked by the default policy.

Per world size:
- **commit**: each chunk object's writer as the layout gives it (the owner of its first element:
  `ucp.sharding.reshard.AtomOwners`, the rule `chunk_write_plan` applies), and each rank's message to rank 0 as that
  side encodes it (`RankWrites`). What rank 0 receives in the gather: the baseline gathered every rank's size to
  every rank and then W buffers of the longest; this tree sends the payload up a binomial tree (log2 W messages at
  rank 0). Rank 0's part of the commit, measured: `SaveSession.finish` on rank 0 with a comm that stands for the
  other W - 1 ranks (it hands rank 0 their messages): decode, merge every object, write the manifest and the
  commit marker (to a temporary directory).
- **hot tier**: the CPU of one rank's `Nodes.senders_to` (the ranks whose replicas it keeps; the baseline scanned the
  world, so it is run up to 4,096 ranks and extrapolated as W^2 beyond), and what each rank receives to plan a
  restore: the baseline all-gathered every rank's bitmap over every object and every rank's list of needs; this tree
  sends each rank the directory of which nodes hold each object (two copies each: the writer's node and its buddy)
  and the rank's own asks.
- **ZeRO planning**: `chunk_write_plan` for rank 0 and a middle rank: CPU seconds and the fragments it receives.
- **DCP on paper**: PyTorch DCP's global plan and metadata hold an entry per tensor shard per rank (each rank's local
  tensors' pieces here, counted from `local_plan` on sampled ranks), gathered to rank 0 at save and read whole by every
  rank at load; its bytes per entry are measured (a `dcp.save` of 5,000 tensors).

Usage: python scripts/scale_sim.py [--baseline REV] [--worlds 1024,4096,16384,65536,98304] [--json out.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
STATES = ("exp_avg", "exp_avg_sq", "master")
DTYPES = {None: "bfloat16", **dict.fromkeys(STATES, "float32")}
RANKS_PER_NODE = 8
BASELINE = "86451d5"  # main before issue 40's coordination work
OLD_SENDERS_LIMIT = 4096  # (the baseline's senders_to is O(W) per call: minutes beyond this)


def config() -> Any:
    from ucp.sharding.families import MixtralConfig

    return MixtralConfig(
        vocab_size=131072, hidden_size=6144, intermediate_size=16384, num_hidden_layers=64, num_attention_heads=48,
        num_key_value_heads=8, num_local_experts=64,
    )  # fmt: skip


def layout_for(world: int) -> str:
    dp = world // 128
    return f"tp8pp16ep{min(64, dp)}dp{dp}zero1"


def metas_for(layout: str) -> dict:
    from ucp.base.chunking import ChunkingPolicy
    from ucp.distributed.sharded_model import ShardedModel, atom_metas
    from ucp.sharding.layout import parse_layout

    return atom_metas(ShardedModel(config(), parse_layout(layout), STATES), DTYPES, ChunkingPolicy())


# ------------------------------------------------------------------------------------------ the world's writes


def world_writes(world: int) -> dict[str, Any]:
    """Every chunk's writer and what each rank records (this tree's planning: the same rule on both sides), with
    sizes as written and random checksums: {"writes": {rank: [[key below the attempt, nbytes, crc]]}, "packed": {rank:
    {atom path: [[chunk number, pack, offset, nbytes, crc]]}}, "packs": {rank: [pack, nbytes, crc]}}."""
    from ucp.base.boxes import box_numel
    from ucp.format.manifest import chunk_indices
    from ucp.format.packs import pack_name
    from ucp.sharding.layout import parse_layout
    from ucp.sharding.reshard import AtomOwners

    rng = random.Random(world)
    layout = layout_for(world)
    lay = parse_layout(layout)
    writes: dict[int, list] = {}
    packed: dict[int, dict[str, list]] = {}
    pack_sizes: dict[int, int] = {}
    writers = []  # (object number in the hot tier's list, writer)
    for (atom, state), meta in metas_for(layout).items():
        owners = AtomOwners(config(), lay, atom, state, STATES)
        for number, index in enumerate(chunk_indices(meta.grid)):
            box = meta.chunk_box(index)
            writer = owners.within(tuple((a, a + 1) for a, _ in box))[0][0]
            nbytes = box_numel(box) * meta.itemsize
            writers.append(writer)
            if meta.packed:
                offset = pack_sizes.get(writer, 0)
                pack_sizes[writer] = offset + nbytes
                row = [number, pack_name(writer, 0), offset, nbytes, rng.randrange(1 << 32)]
                packed.setdefault(writer, {}).setdefault(meta.path, []).append(row)
            else:
                key = f"{meta.path}/{meta.chunk_key(index)}"
                writes.setdefault(writer, []).append([key, nbytes + 16 * 1024, rng.randrange(1 << 32)])
    packs = {r: [pack_name(r, 0), n, rng.randrange(1 << 32)] for r, n in pack_sizes.items()}
    return {"world": world, "layout": layout, "writes": writes, "packed": packed, "packs": packs, "writers": writers}


class StandIn:
    """Rank 0's comm in a world of `world_size` ranks whose other ranks' messages are given (`others`): their
    gathers hand rank 0 those messages, broadcasts and scatters go nowhere."""

    rank = 0

    def __init__(self, world_size: int):
        self.world_size = world_size
        self.others: list[bytes] = []

    def gather_bytes(self, data: bytes) -> list[bytes]:
        return [data, *self.others]

    def broadcast_bytes(self, data: bytes | None) -> bytes:
        assert data is not None
        return data

    def scatter_bytes(self, data: list[bytes] | None) -> bytes:
        assert data is not None
        return data[0]

    def barrier(self) -> None:
        pass

    def exchange(self, outgoing: dict, incoming: dict) -> dict:
        raise AssertionError("rank 0's commit exchanges nothing point to point")


def commit_on_rank0(world: dict[str, Any], tmp: Path) -> dict[str, Any]:
    """Rank 0's part of the commit of this world's save (this process's ucp): its CPU and wall seconds, and the
    size of every rank's message."""
    import ucp
    from ucp.base.chunking import ChunkingPolicy
    from ucp.distributed.sharded_model import ShardedModel
    from ucp.distributed.sharded_save import manifest_for
    from ucp.protocol.session import RankWrites, SaveSession
    from ucp.sharding.layout import parse_layout
    from ucp.storage import LocalStorage

    layout, size = world["layout"], world["world"]
    model = ShardedModel(config(), parse_layout(layout), STATES)
    manifest, _ = manifest_for(model, metas_for(layout), {}, 1, ChunkingPolicy())
    comm = StandIn(size)
    storage = LocalStorage(tempfile.mkdtemp(dir=tmp, prefix=f"ckpt-{size}-"), fsync=False)
    session = SaveSession.begin(storage, 1, comm)  # type: ignore[arg-type]
    prefix = session.prefix

    def recorded(rank: str) -> tuple[dict, dict]:
        objects = {f"{prefix}/{k}": (n, c) for k, n, c in world["writes"].get(rank, [])}
        if rank in world["packs"]:
            name, n, c = world["packs"][rank]
            objects[f"{prefix}/{name}/c.0"] = (n, c)
        return objects, world["packed"].get(rank, {})

    def message(rank: str) -> bytes:
        objects, packed = recorded(rank)
        writes = RankWrites.of(prefix, objects, packed) if hasattr(RankWrites, "of") else RankWrites(objects, packed)
        return json.dumps({"value": writes.to_json()}).encode()

    comm.others = [message(str(r)) for r in range(1, size)]
    objects, packed = recorded("0")
    for key, (n, c) in objects.items():
        session.record(key, n, c)
    for path, rows in packed.items():
        session.record_packed(path, rows)
    mine = message("0")
    cpu, wall = time.process_time(), time.perf_counter()
    session.finish(manifest)
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    assert ucp.CheckpointManager(storage.url).steps() == [1]
    return {"cpu_s": cpu, "wall_s": wall, "sizes": [len(mine), *map(len, comm.others)]}


def senders_seconds(size: int) -> float | None:
    from ucp.distributed.tiers import Nodes

    nodes = Nodes(tuple(r // RANKS_PER_NODE for r in range(size)))
    if "position" not in {f.name for f in dataclasses.fields(Nodes)} and size > OLD_SENDERS_LIMIT:  # (the baseline)
        return None
    t0 = time.process_time()
    nodes.senders_to(size // 2)
    return time.process_time() - t0


def planning(layout: str) -> dict[str, Any]:
    from ucp.sharding.layout import parse_layout
    from ucp.sharding.reshard import chunk_write_plan

    lay, metas = parse_layout(layout), metas_for(layout)

    def grid(atom: str, state_or_shape: Any) -> tuple[int, ...]:  # (the baseline passed the atom's shape)
        return metas.get((atom, state_or_shape), metas[(atom, None)]).chunk_shape

    out = {}
    for rank in (0, lay.world_size // 2 + 3):
        times, recvs = [], 0
        for _ in range(3):
            t0 = time.process_time()
            plan = chunk_write_plan(config(), lay, rank, grid, STATES)
            times.append(time.process_time() - t0)
            recvs = len(plan.recvs)
        out[str(rank)] = {"cpu_s": statistics.median(times), "recvs": recvs, "writes": len(plan.writes)}
    return out


def worker(files: list[str], tmp: str) -> dict[str, Any]:
    import ucp

    out: dict[str, Any] = {"ucp": ucp.__file__}
    for path in files:
        world = json.loads(Path(path).read_text())
        size = world["world"]
        out[str(size)] = {
            "commit": commit_on_rank0(world, Path(tmp)),
            "senders_s": senders_seconds(size),
            "planning": planning(world["layout"]),
        }
    return out


# ------------------------------------------------------------------------------------------ figures


def gather_bytes(sizes: list[int]) -> tuple[int, int]:
    """What rank 0 receives in the gather: (the baseline's: every rank's size, then W buffers of the longest;
    this tree's: the payload and the frames' lengths, up the tree)."""
    w = len(sizes)
    rounds = math.ceil(math.log2(w)) if w > 1 else 0
    return 8 * w + w * max(sizes), sum(sizes[1:]) + 8 * (w + 2 * rounds)


def restore_bytes(world: dict[str, Any], needs: int) -> tuple[int, int]:
    """What one rank receives to plan a restore: the baseline's (every rank's bitmap over every object, base64 in
    JSON, and every rank's needs, ~7 bytes a number) and this tree's (the directory, as `Directory` encodes it)."""
    from ucp.distributed.tiers import Directory

    size, writers = world["world"], world["writers"]
    objects = len(writers)
    nodes = size // RANKS_PER_NODE
    old = size * (4 * math.ceil(math.ceil(objects / 8) / 3) + 40) + size * 7 * needs
    holders = [[w // RANKS_PER_NODE, (w // RANKS_PER_NODE + 1) % nodes] for w in writers]
    new = len(json.dumps(Directory.of(holders, []).to_json())) + 7 * needs
    return old, new


def needs_of_rank0(layout: str) -> int:
    """The chunk objects rank 0 reads to restore in the layout it saved in."""
    from ucp.distributed import ShardedModel, needed_objects
    from ucp.sharding.layout import parse_layout

    atoms = {m.path: m for m in metas_for(layout).values()}
    return len(needed_objects(atoms, ShardedModel(config(), parse_layout(layout), STATES), 0))


def dcp_entries(layout: str) -> int:
    """PyTorch DCP's metadata entries for this job on paper: a chunk per local tensor piece per rank (sampled ranks'
    `local_plan`s times the world)."""
    from ucp.sharding.layout import parse_layout
    from ucp.sharding.reshard import local_plan

    lay = parse_layout(layout)
    sample = [0, lay.world_size // 3, lay.world_size - 1]
    per_rank = statistics.mean(sum(len(t.pieces) for t in local_plan(config(), lay, r, STATES)) for r in sample)
    return round(per_rank * lay.world_size)


def dcp_bytes_per_entry(entries: int = 5000) -> float:
    """The bytes of DCP's .metadata per entry, measured: `dcp.save` of `entries` small tensors in one process."""
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp

    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (a save in one process, without a process group: as meant)
        dcp.save(
            {f"model.layers.{i // 64}.mlp.experts.{i % 64}.w1.weight": torch.zeros(4, 4) for i in range(entries)},
            checkpoint_id=tmp,
        )
        return os.path.getsize(os.path.join(tmp, ".metadata")) / entries


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", default=BASELINE, help="the revision to compare with (git)")
    parser.add_argument("--worlds", default="1024,4096,16384,65536,98304")
    parser.add_argument("--json", help="write the figures here too")
    parser.add_argument("--png", help="and draw them here (matplotlib, the bench extra)")
    parser.add_argument("--worker", nargs="*", help=argparse.SUPPRESS)
    parser.add_argument("--tmp", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        print(json.dumps(worker(args.worker, args.tmp)))
        return
    sizes = [int(w) for w in args.worlds.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        base = root / "baseline"
        base.mkdir()
        archive = subprocess.run(["git", "archive", args.baseline, "ucp"], cwd=REPO, check=True, capture_output=True)
        subprocess.run(["tar", "-x", "-C", str(base)], input=archive.stdout, check=True)
        files, worlds = [], {}
        for size in sizes:
            t0 = time.perf_counter()
            worlds[size] = world_writes(size)
            path = root / f"world-{size}.json"
            path.write_text(json.dumps(worlds[size]))
            files.append(str(path))
            print(f"planned the writes of {size} ranks in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
        sides = {"baseline": str(base), "this tree": str(REPO)}
        got = {}
        for side, path in sides.items():
            env = {**os.environ, "PYTHONPATH": os.pathsep.join([path, str(REPO)])}
            cmd = [sys.executable, __file__, "--tmp", tmp, "--worker", *files]
            got[side] = json.loads(subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout)
            assert got[side].pop("ucp").startswith(path), f"the {side} worker imported another ucp"
    rows = []
    per_entry = dcp_bytes_per_entry()
    for size in sizes:
        world, old, new = worlds[size], got["baseline"][str(size)], got["this tree"][str(size)]
        sizes_old, sizes_new = old["commit"]["sizes"], new["commit"]["sizes"]
        needs = needs_of_rank0(world["layout"])
        old_senders = old["senders_s"] if old["senders_s"] is not None else None
        rows.append(
            {
                "world": size,
                "layout": world["layout"],
                "objects": len(world["writers"]),
                "payload_mb": [sum(sizes_old) / 1e6, sum(sizes_new) / 1e6],
                "rank0_gather_mb": [gather_bytes(sizes_old)[0] / 1e6, gather_bytes(sizes_new)[1] / 1e6],
                "rank0_commit_cpu_s": [old["commit"]["cpu_s"], new["commit"]["cpu_s"]],
                "senders_to_s": [old_senders, new["senders_s"]],
                "restore_plan_mb_per_rank": [b / 1e6 for b in restore_bytes(world, needs)],
                "planning": [old["planning"], new["planning"]],
                "dcp_metadata_entries": dcp_entries(world["layout"]),
                "dcp_metadata_mb": dcp_entries(world["layout"]) * per_entry / 1e6,
            }
        )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    if args.png:
        chart(rows, args.png)
    print(table(rows))


def chart(rows: list[dict[str, Any]], path: str) -> None:
    """The curves, log-log: each figure of the table against the world size, baseline dashed, this tree solid."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    worlds = [r["world"] for r in rows]
    panels = {
        "rank 0 receives at commit (MB)": [r["rank0_gather_mb"] for r in rows],
        "a rank receives to plan a restore (MB)": [r["restore_plan_mb_per_rank"] for r in rows],
        "senders_to, one rank (CPU s)": [r["senders_to_s"] for r in rows],
        "ZeRO plan of rank 0 (CPU s)": [[p["0"]["cpu_s"] for p in r["planning"]] for r in rows],
        "rank 0's commit (CPU s)": [r["rank0_commit_cpu_s"] for r in rows],
    }
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.4))
    for ax, (title, values) in zip(axes, panels.items()):
        for side, style in ((0, "--"), (1, "-")):
            points = [(w, v[side]) for w, v in zip(worlds, values) if v[side] is not None]
            ax.plot(*zip(*points), style, marker="o", label=("baseline", "this tree")[side])
        ax.set(xscale="log", yscale="log", title=title, xlabel="ranks")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def table(rows: list[dict[str, Any]]) -> str:
    """The figures, baseline -> this tree in each cell."""

    def pair(values: list[Any], fmt: str) -> str:
        return " -> ".join("n/a" if v is None else format(v, fmt) for v in values)

    lines = [
        (
            "| ranks | objects | rank 0 receives at commit, MB | rank 0's commit, CPU s | senders_to, s | a rank "
            "receives to plan a restore, MB | ZeRO plan of rank 0, CPU s (fragments) | DCP metadata: entries, MB |"
        ),
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        old_plan, new_plan = (p["0"] for p in r["planning"])
        senders = r["senders_to_s"]
        if senders[0] is None:  # (extrapolated from the largest measured world, as W^2)
            measured = next(x for x in rows if x["senders_to_s"][0] is not None and x["world"] <= OLD_SENDERS_LIMIT)
            senders = [measured["senders_to_s"][0] * (r["world"] / measured["world"]) ** 2, senders[1]]
            senders_cell = f"~{senders[0]:.0f} (extrapolated) -> {senders[1]:.5f}"
        else:
            senders_cell = pair(senders, ".5f")
        lines.append(
            f"| {r['world']:,} | {r['objects']:,} | {pair(r['rank0_gather_mb'], '.1f')} | "
            f"{pair(r['rank0_commit_cpu_s'], '.2f')} | {senders_cell} | {pair(r['restore_plan_mb_per_rank'], '.1f')} | "
            f"{old_plan['cpu_s']:.3f} -> {new_plan['cpu_s']:.3f} ({new_plan['recvs']}) | "
            f"{r['dcp_metadata_entries']:,}, {r['dcp_metadata_mb']:.0f} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
