"""What a manifest costs a reader, by the step's number of atoms (docs/BENCHMARKS.md, a manifest that scales).

    python scripts/manifest_scale.py [--atoms 20000,200000,1000000] [--repeats 3] [--dir /dev/shm]

For each size, a Mixtral-shaped model of tiny tensors (hidden 8, many layers and experts) and its two Adam moments
is saved from one rank (`VirtualWorld(1)`, as a distributed save writes it: packed atoms, the model config in the
state tree), so that the step holds about that many atoms. Then fresh processes (the interpreter and ucp imported
before the timer) measure, medians of `--repeats`:

- `open`: `ucp.open_checkpoint` (marker, manifest) alone;
- `open + plan`: the same, then rank 0's read plan in a layout of many ranks (`plan_reads` for `tp1pp16ep8dp8`:
  the layers of one pipeline stage, an eighth of their experts), as a rank of a large job starts its load; `table`
  is what the model family's table of every atom (`canonical_atoms`, which a plan makes first) took of it, a cost of
  the model's size that is not the manifest's;
- `open + read 1%`: the same open, then `read_atoms` of 1% of the atoms, a contiguous run of them (a stage's);
- the bytes of manifest each read (the marker, the manifest and the index parts, from the storage's counters)
  against the whole manifest (the marker, the manifest and every index part).
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

REPO = Path(__file__).resolve().parents[1]
STATES = ("exp_avg", "exp_avg_sq")
LAYOUT = "tp1pp16ep8dp8"


def config_for(atoms: int):
    """A Mixtral of tiny tensors with about `atoms` atoms (parameters and the two Adam moments)."""
    from ucp.sharding.families import MixtralConfig

    layers = 16 if atoms < 100_000 else 64
    per_layer = atoms // 3 // layers  # (each parameter atom has its two moments)
    experts = max(8, (per_layer - 7) // 3 // 8 * 8)  # (attention 4, two norms and the router: 7 a layer)
    return MixtralConfig(
        vocab_size=64,
        hidden_size=8,
        intermediate_size=8,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_local_experts=experts,
        make_vocab_size_divisible_by=8,
    )


def save(atoms: int, url: str) -> int:
    import torch

    import ucp
    from ucp.distributed import ShardedModel, VirtualWorld
    from ucp.sharding.families import canonical_atoms
    from ucp.sharding.layout import parse_layout
    from ucp.sharding.reshard import shard

    cfg = config_for(atoms)
    shapes = canonical_atoms(cfg)
    full = {
        "model": {n: torch.randn(s) for n, (s, _) in shapes.items()},
        "optimizer": {"state": {n: {st: torch.randn(s) for st in STATES} for n, (s, _) in shapes.items()}},
    }
    layout = parse_layout("tp1pp1")
    local = [shard(full, cfg, layout, 0, STATES)]
    del full  # (a million tensors: the full state and the shard's are not held at once)
    VirtualWorld(1).save(
        local,
        url,
        step=0,
        model=ShardedModel(cfg, layout, STATES),
        options=ucp.SaveOptions(fsync=False),
    )
    return len(ucp.open_checkpoint(url).atoms)


def manifest_bytes(url: str) -> int:
    import ucp

    reader = ucp.open_checkpoint(url)
    step_dir = Path(url) / reader.prefix
    index = step_dir / "ucp-index"
    parts = sum(f.stat().st_size for f in index.iterdir()) if index.is_dir() else 0
    marker = (step_dir.parent / "ucp-commit.json").stat().st_size
    return marker + (step_dir / "zarr.json").stat().st_size + parts


def measure(what: str, url: str, atoms: int) -> dict:
    """One measurement in this (fresh) process."""
    from ucp.distributed import ShardedModel, plan_reads
    from ucp.engine.checkpoint import CheckpointReader
    from ucp.sharding.layout import parse_layout
    from ucp.storage import open_storage

    count, table = 0, 0.0
    config = config_for(atoms)
    if what == "plan":  # (what making the family's table of every atom of the model takes, which a plan does first)
        from ucp.sharding.families import canonical_atoms

        table = time.perf_counter()
        canonical_atoms(config)
        table = time.perf_counter() - table
    storage = open_storage(url)
    start = time.perf_counter()
    reader = CheckpointReader(storage, "latest")
    if what == "plan":
        plan = plan_reads(reader.atoms, ShardedModel(config, parse_layout(LAYOUT), STATES), 0)
        count = len({item.atom for t in plan.tensors for item in t.items})
    manifest_read = storage.stats.bytes_read  # (the marker, the manifest and the index parts read so far)
    if what == "read":
        paths = _run_of_atoms(reader, atoms)
        manifest_read = storage.stats.bytes_read
        reader.read_atoms(paths)
        count = len(paths)
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "manifest_read": manifest_read, "atoms": count, "table_s": table}


def _run_of_atoms(reader, atoms: int) -> list[str]:  # type: ignore[no-untyped-def]
    """1% of the step's atoms, a contiguous run of them (its parts read to find their paths; the atoms' records
    with them)."""
    manifest = reader.manifest
    wanted = atoms // 100
    paths: list[str] = []
    for number in range(len(manifest.entries)):
        paths += manifest.part(number).paths[: wanted - len(paths)]
        if len(paths) >= wanted:
            break
    return paths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--atoms", default="20000,200000,1000000")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default="/dev/shm")
    parser.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    sys.path.insert(0, str(REPO))
    if args.worker:
        what, url, atoms = args.worker
        print(json.dumps(measure(what, url, int(atoms))))
        return
    rows = []
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        for target in (int(a) for a in args.atoms.split(",")):
            url = f"{tmp}/ckpt-{target}"
            started = time.perf_counter()
            atoms = save(target, url)
            saved_s = time.perf_counter() - started
            total = manifest_bytes(url)
            row = {"atoms": atoms, "manifest_bytes": total, "save_s": saved_s}
            for what in ("open", "plan", "read"):
                runs = []
                for _ in range(args.repeats):
                    out = subprocess.run(
                        [sys.executable, __file__, "--worker", what, url, str(atoms)],
                        capture_output=True,
                        text=True,
                        check=True,
                    )
                    runs.append(json.loads(out.stdout.splitlines()[-1]))
                row[what] = {
                    "seconds": statistics.median(r["seconds"] for r in runs),
                    "manifest_read": statistics.median(r["manifest_read"] for r in runs),
                    "atoms": runs[0]["atoms"],
                    "table_s": statistics.median(r["table_s"] for r in runs),
                }
            rows.append(row)
            print(json.dumps(row), flush=True)
    print(f"load average {os.getloadavg()[0]:.1f}; medians of {args.repeats} fresh processes each")
    print(
        f"{'atoms':>9} {'manifest':>11} {'open s':>8} {'open+plan s':>12} {'(table s)':>10} {'atoms planned':>14} "
        f"{'open+read 1% s':>15} {'manifest read (plan / read)':>30}"
    )
    for r in rows:
        share = f"{r['plan']['manifest_read'] / r['manifest_bytes']:.2%} / {r['read']['manifest_read'] / r['manifest_bytes']:.2%}"
        print(
            f"{r['atoms']:>9,} {r['manifest_bytes'] / 1e6:>9.1f}MB {r['open']['seconds']:>8.3f} "
            f"{r['plan']['seconds']:>12.3f} {r['plan']['table_s']:>10.3f} {r['plan']['atoms']:>14,} "
            f"{r['read']['seconds']:>15.3f} {share:>30}"
        )


if __name__ == "__main__":
    main()
