"""A Megatron torch_dist checkpoint to torch-format files of another layout: `ucp convert` against megatron-core's
own way (load it in the target layout with `dist_checkpointing.load`, save the rank files), same model, same run.

    python scripts/megatron_dist_bench.py [--shape 512,1024,8,8,8,4] [--source tp2pp2] [--target tp1pp2]
                                          [--repeats 3] [--memory-budget 256MiB] [--out docs/figures/megatron-dist.json]

megatron-core on CPU (gloo) first saves the MoE GPT model of tests/megatron_dist_worker.py, sized by --shape
(hidden, ffn, layers, experts, heads, query groups), in the source layout with `dist_checkpointing.save`
(torch_dist; not timed). Then, --repeats times, alternating:

- megatron: tests/megatron_dist_worker.py resave in the target layout (one process per rank): build the model, load
  the checkpoint, save each rank's file. Reported: the command's wall time (process start, imports and model
  build included, as a user runs it), load + save alone, and peak RSS per rank (sum and largest);
- ucp: `python -m ucp convert SRC DST --from torch_dist --to TARGET --memory-budget B` (one process). Reported:
  the command's wall time and its peak RSS.

Both outputs are compared tensor by tensor (every rank file's model entries, `_extra_state` aside): they must be
bitwise the same. Medians over the repeats; warm page cache (both read the same files).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.launch import spawn

WRAPPER = (  # the peak RSS of a command run in a fresh, small process (see tests/test_interop_memory.py)
    "import resource, subprocess, sys; rc = subprocess.call(sys.argv[1:], stdout=sys.stderr); "
    "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); sys.exit(rc)"
)


def world(layout: str) -> tuple[int, int]:
    from ucp.interop.megatron.save import parse_megatron_layout

    lay = parse_megatron_layout(layout)
    return lay.tp, lay.pp


def megatron(src: Path, dst: Path, target: str, env: dict[str, str]) -> dict:
    tp, pp = world(target)
    t0 = time.perf_counter()
    out = spawn(["tests/megatron_dist_worker.py", "resave", str(tp), str(pp), str(src), str(dst)], tp * pp, 900, env)
    wall = time.perf_counter() - t0
    line = next(json.loads(x) for x in out[0].splitlines() if x.startswith("{"))
    return {
        "wall_s": wall,
        "load_s": line["load_s"],
        "save_s": line["save_s"],
        "peak_rss_bytes": line["peak_rss_bytes"],
    }


def ucp_convert(src: Path, dst: Path, target: str, budget: str) -> dict:
    argv = [sys.executable, "-m", "ucp", "convert", str(src), str(dst), "--from", "torch_dist", "--to", target]
    argv += ["--memory-budget", budget, "--no-progress"]
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", WRAPPER, *argv], capture_output=True, text=True, check=False, cwd=REPO)
    wall = time.perf_counter() - t0
    if proc.returncode:
        raise SystemExit(f"ucp convert failed:\n{proc.stderr[-3000:]}")
    return {"wall_s": wall, "peak_rss_bytes": int(proc.stdout.split()[-1]) * 1024}


def same_files(a: Path, b: Path) -> int:
    """Every rank file's model tensors bitwise equal; the number of tensors compared."""
    import torch

    from ucp.interop.megatron.files import load_rank_file
    from ucp.interop.megatron.save import RANK_FILE

    compared = 0
    for rank_dir in sorted((a / "iter_0000010").iterdir()):
        x = load_rank_file(rank_dir / RANK_FILE)["model"]
        y = load_rank_file(b / "iter_0000010" / rank_dir.name / RANK_FILE)["model"]
        names = {n for n in x if not n.endswith("._extra_state")}
        if names != {n for n in y if not n.endswith("._extra_state")}:
            raise SystemExit(f"{rank_dir.name}: the two conversions hold different tensors")
        for n in names:
            if not torch.equal(x[n], y[n]):
                raise SystemExit(f"{rank_dir.name}/{n}: the two conversions differ")
            compared += 1
    return compared


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="512,1024,8,8,8,4", help="hidden,ffn,layers,experts,heads,kv")
    p.add_argument("--source", default="tp2pp2")
    p.add_argument("--target", default="tp1pp2")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--memory-budget", default="256MiB")
    p.add_argument("--out", help="JSON of every run and the medians")
    args = p.parse_args()
    env = {"PYTHONWARNINGS": "ignore", "UCP_MEGATRON_SHAPE": args.shape}
    tmp = Path(tempfile.mkdtemp(prefix="megatron-dist-bench-"))
    try:
        src = tmp / "src"
        tp, pp = world(args.source)
        print(f"megatron-core saves torch_dist in {args.source} (shape {args.shape}) ...", file=sys.stderr, flush=True)
        spawn(["tests/megatron_dist_worker.py", "save", str(tp), str(pp), str(src)], tp * pp, 900, env)
        size = sum(f.stat().st_size for f in (src / "iter_0000010").iterdir())
        runs: dict[str, list[dict]] = {"megatron": [], "ucp": []}
        for i in range(args.repeats):
            for method in ("megatron", "ucp") if i % 2 == 0 else ("ucp", "megatron"):
                dst = tmp / f"{method}-{i}"
                if method == "megatron":
                    runs[method].append(megatron(src, dst, args.target, env))
                else:
                    runs[method].append(ucp_convert(src, dst, args.target, args.memory_budget))
                print(f"  {method} run {i}: {runs[method][-1]}", file=sys.stderr, flush=True)
            compared = same_files(tmp / f"megatron-{i}", tmp / f"ucp-{i}")
            shutil.rmtree(tmp / f"megatron-{i}")
            shutil.rmtree(tmp / f"ucp-{i}")
        med = {
            "megatron_wall_s": statistics.median(r["wall_s"] for r in runs["megatron"]),
            "megatron_load_save_s": statistics.median(r["load_s"] + r["save_s"] for r in runs["megatron"]),
            "megatron_rss_sum_mib": statistics.median(sum(r["peak_rss_bytes"]) for r in runs["megatron"]) / 2**20,
            "megatron_rss_max_mib": statistics.median(max(r["peak_rss_bytes"]) for r in runs["megatron"]) / 2**20,
            "ucp_wall_s": statistics.median(r["wall_s"] for r in runs["ucp"]),
            "ucp_rss_mib": statistics.median(r["peak_rss_bytes"] for r in runs["ucp"]) / 2**20,
        }
        print(
            f"torch_dist {args.source} -> torch {args.target}, {size / 2**20:.0f} MiB checkpoint, "
            f"{args.repeats} repeats (medians); outputs bitwise equal ({compared} tensors)\n"
            f"  megatron-core load + re-save: {med['megatron_wall_s']:.2f} s command "
            f"({med['megatron_load_save_s']:.2f} s load + save), peak RSS {med['megatron_rss_sum_mib']:.0f} MiB "
            f"over its ranks (largest {med['megatron_rss_max_mib']:.0f} MiB)\n"
            f"  ucp convert (--memory-budget {args.memory_budget}): {med['ucp_wall_s']:.2f} s command, "
            f"peak RSS {med['ucp_rss_mib']:.0f} MiB\n"
            f"  ratio (megatron command / ucp command): {med['megatron_wall_s'] / med['ucp_wall_s']:.2f}x"
        )
        if args.out:
            doc = {"args": vars(args), "checkpoint_bytes": size, "runs": runs, "medians": med}
            Path(args.out).write_text(json.dumps(doc, indent=1))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    os.chdir(REPO)
    sys.exit(main())
