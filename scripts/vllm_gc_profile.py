"""What Python's cyclic garbage collector costs a vLLM engine's start-up from ucp and from safetensors, and what a ucp
load leaves to it (docs/BENCHMARKS.md, "Inference: vLLM from ucp").

Writes bench_io inference's model (--size-gib; a ucp checkpoint saved from tp2pp2 and its safetensors export), then, in
this process (vLLM's CPU build, one worker, as the benchmark runs it), builds engines to the first token and shuts them
down, the two methods alternating, the page cache dropped before each; one engine first, untimed (imports). For each
run: its seconds, the collections vLLM and Python made during it (full ones: count and seconds), the objects they
freed, and the objects the collector tracks before and after (what a full collection walks). Then a load of the step
through the loader's reads (`open_weights(...).tensors()`) with every collection's finds kept (DEBUG_SAVEALL): the
objects of ucp's and the tensors left in reference cycles, and their bytes (sys.getsizeof, tensors by their data).

Usage: PYTHONPATH=. python scripts/vllm_gc_profile.py [--size-gib 1] [--repeats 3]   # in vLLM's venv (PYTHONPATH: the
tree whose ucp and bench_io run; another revision's, `git archive REV ucp bench_io`, for a comparison)
"""

from __future__ import annotations

import argparse
import collections
import gc
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench_io import inference


class Collections:
    """Every collection made while it is on: generation, seconds, objects freed."""

    def __init__(self) -> None:
        self.done: list[tuple[int, float, int]] = []
        self._start = 0.0

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.done.append((info["generation"], time.perf_counter() - self._start, info["collected"]))


def left_in_cycles(url: str) -> tuple[collections.Counter[str], int, int]:
    """What a load of step 0 through the loader's reads leaves in reference cycles: ucp's objects and tensors by
    type, all the garbage's object count, and the bytes of what is ucp's (tensors by their data)."""
    import torch

    from ucp.interop.vllm.source import open_weights

    gc.collect()
    gc.disable()
    try:
        for _name, tensor in open_weights(url, 0).tensors():
            del tensor
        gc.set_debug(gc.DEBUG_SAVEALL)
        gc.collect()
        garbage = list(gc.garbage)
        gc.garbage.clear()
    finally:
        gc.set_debug(0)
        gc.enable()
    ours = [o for o in garbage if isinstance(o, torch.Tensor) or type(o).__module__.split(".")[0] == "ucp"]
    counts = collections.Counter(f"{type(o).__module__}.{type(o).__qualname__}" for o in ours)
    nbytes = sum(o.untyped_storage().nbytes() if isinstance(o, torch.Tensor) else sys.getsizeof(o) for o in garbage)
    return counts, len(garbage), nbytes


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size-gib", type=float, default=1.0)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dir", default=None)
    args = p.parse_args()
    inference._vllm_environment(1)
    import vllm

    from bench_io.targets import drop_page_cache

    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        root = Path(tmp)
        url = str(root / "ucp")
        inference.write_sources(inference.config_for(args.size_gib), root, url, None)
        bench = inference.Bench(root, 1, 1)
        bench.start(model=str(root / "hf0"))()  # (what the process pays once)
        methods = {
            "ucp": lambda: bench.start(model=str(bench.model_dir(url)), load_format="ucp")(),
            "safetensors": bench.start(model=str(root / "hf0")),
        }
        rows: dict[str, list[tuple[float, int, float, int, int, int]]] = {m: [] for m in methods}
        for _ in range(args.repeats):
            for name, run in methods.items():
                drop_page_cache(root, "fadvise")
                gc.collect()
                before = len(gc.get_objects())
                seen = Collections()
                gc.callbacks.append(seen)
                start = time.perf_counter()
                try:
                    run()
                finally:
                    gc.callbacks.remove(seen)
                seconds = time.perf_counter() - start
                full = [d for g, d, _ in seen.done if g == 2]
                freed = sum(c for _, _, c in seen.done)
                rows[name].append((seconds, len(full), sum(full), freed, before, len(gc.get_objects())))
        print(
            f"vLLM {vllm.__version__}, {args.size_gib} GiB, median of {args.repeats}; load {os.getloadavg()[0]:.1f}\n"
            f"{'method':<12} {'start-up s':>10} {'full GCs':>8} {'their s':>8} {'freed':>7} {'tracked before':>15} "
            f"{'after':>8}"
        )
        for name, runs in rows.items():
            med = [statistics.median(r[i] for r in runs) for i in range(6)]
            print(
                f"{name:<12} {med[0]:>10.2f} {med[1]:>8.0f} {med[2]:>8.2f} {med[3]:>7.0f} {med[4]:>15.0f} {med[5]:>8.0f}"
            )
        counts, total, nbytes = left_in_cycles(url)
        print(
            f"a load through the loader's reads left {total} objects in cycles ({nbytes} bytes); ucp's: "
            f"{dict(counts.most_common(8)) or 'none'}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
