"""Where a save and a load of many small atoms spend their CPU, with packs, beside raw-crc's (docs/BENCHMARKS.md).

CPU seconds of this process (`time.process_time`, every thread), not wall time: on a machine shared with other work
the wall time moves with the load, the CPU a method needs much less. Phases of ucp's save (planning, laying out the
packs, writing them and committing) and load (opening the step: reading and checking the manifest; reading the
atoms), then raw-crc's save and load of the same state (`bench_io`'s method), alternating, medians of `--repeats`.

Usage: python scripts/packs_profile.py [--tensors 20000] [--repeats 5] [--dir /dev/shm]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import ucp
from bench_io.methods import METHODS
from bench_io.state import make_state, small_specs
from ucp.engine import checkpoint
from ucp.engine.pipeline import SavePipeline
from ucp.storage import open_storage


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tensors", type=int, default=20_000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dir", default="/dev/shm")
    args = parser.parse_args()
    state = make_state("small", small_specs(args.tensors, seed=0), seed=1)
    options = ucp.SaveOptions(fsync=False)
    raw = METHODS["raw-crc"](io_threads=4)
    figures: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        root, raw_dir = Path(tmp) / "ucp", Path(tmp) / "raw"
        for _ in range(args.repeats):
            shutil.rmtree(root, ignore_errors=True)
            storage = open_storage(str(root), None, fsync=False)
            marks = [time.process_time()]
            plan = checkpoint.plan_save(state.tree, storage, 0, options)
            marks.append(time.process_time())
            plan.jobs()
            marks.append(time.process_time())
            pipeline = SavePipeline(checkpoint.io_threads_for(options, storage))
            pipeline.submit(plan, "sync").result()
            pipeline.close()
            marks.append(time.process_time())
            reader = ucp.open_checkpoint(str(root))
            marks.append(time.process_time())
            reader.load_state()
            marks.append(time.process_time())
            shutil.rmtree(raw_dir, ignore_errors=True)
            raw_dir.mkdir()
            raw.save(state, raw_dir)
            marks.append(time.process_time())
            raw.load(raw_dir)
            marks.append(time.process_time())
            names = ["ucp plan", "ucp lay out packs", "ucp write+commit", "ucp open", "ucp read", "raw-crc save"]
            for name, a, b in zip([*names, "raw-crc load"], marks, marks[1:]):
                figures.setdefault(name, []).append(b - a)
    for name, values in figures.items():
        print(f"{name:<20} {statistics.median(values):.3f} CPU-s  ({', '.join(f'{v:.2f}' for v in values)})")
    save = sum(statistics.median(figures[n]) for n in ("ucp plan", "ucp lay out packs", "ucp write+commit"))
    load = statistics.median(figures["ucp open"]) + statistics.median(figures["ucp read"])
    print(f"ucp save {save:.3f} CPU-s against raw-crc {statistics.median(figures['raw-crc save']):.3f}")
    print(f"ucp load {load:.3f} CPU-s against raw-crc {statistics.median(figures['raw-crc load']):.3f}")


if __name__ == "__main__":
    main()
