"""`python -m bench_io reshard` (or `python -m bench_io.reshard`): load a checkpoint saved in one parallel layout
in another, rank by rank, and measure what each rank reads.

A Mixtral-shaped model (MixtralConfig sized so that fp32 parameters + Adam's exp_avg and exp_avg_sq come to
`--size`) is cut into the local states of every rank of layout A (default tp2pp2dp2zero1) and saved from
virtual ranks (ucp.distributed.VirtualWorld). Then, for each layout B, every rank of B loads its local state
with load_sharded from cold files, as a resumed job's ranks would, and we report per rank:

- read amplification (LoadReport: chunk bytes read / bytes the rank's tensors need; 1.0 is perfect),
- load GB/s (bytes needed / seconds, reader open included), against a raw read of the same number of bytes
  from the checkpoint's own files (whole files, preadv into a preallocated buffer, the same thread count),
- peak RSS above the start of the load.

Every rank's local state is checked against the same rank cut from the full state (--no-verify skips it).
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from ucp.cli_common import Applies, refuse_inapplicable

from .args import at_least, output_file, parse_size, positive_size

MAX_IO = 1 << 30


@dataclass
class RankLoad:
    layout: str
    rank: int
    bytes_needed: int
    bytes_read: int
    amplification: float
    load_s: float
    load_gbps: float
    raw_s: float
    raw_gbps: float
    load_vs_raw: float
    peak_rss_mib: float | None
    cache: str
    verified: bool | None


def size_config(total_bytes: int, states: tuple[str, ...]) -> Any:
    """A Mixtral-shaped config (4 layers, 4 experts, 8 heads / 4 kv heads, intermediate = 2 x hidden, vocab =
    8 x hidden) whose fp32 params + `states` come to at most `total_bytes` (the largest hidden size that fits,
    in steps of 64), so that tp4, pp2, ep2 and their mixes all divide it."""
    from ucp.sharding.families import MixtralConfig, canonical_atoms

    per_param = 4 * (1 + len(states))

    def config(h: int) -> Any:
        return MixtralConfig(
            vocab_size=8 * h, hidden_size=h, intermediate_size=2 * h, num_hidden_layers=4, num_attention_heads=8,
            num_key_value_heads=4, num_local_experts=4, make_vocab_size_divisible_by=128,
        )  # fmt: skip

    def nbytes(h: int) -> int:
        return per_param * sum(math.prod(s) for s, _ in canonical_atoms(config(h)).values())

    h = 64
    while nbytes(h + 64) <= total_bytes:
        h += 64
    return config(h), nbytes(h)


def full_state(config: Any, states: tuple[str, ...], seed: int) -> dict[str, Any]:
    """The canonical state, atom by atom (uniform floats: no NaN, so a bitwise compare is exact)."""
    from ucp.sharding.families import canonical_atoms

    g = torch.Generator().manual_seed(seed)
    atoms = canonical_atoms(config)

    def make(shape: tuple[int, ...]) -> torch.Tensor:
        return torch.empty(shape).uniform_(-1, 1, generator=g)

    return {
        "model": {n: make(s) for n, (s, _) in atoms.items()},
        "optimizer": {"state": {n: {st: make(s) for st in states} for n, (s, _) in atoms.items()}},
    }


def tree_equal(a: Any, b: Any) -> bool:
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(tree_equal(a[k], b[k]) for k in a)
    return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)


def tree_bytes(tree: Any) -> int:
    if isinstance(tree, dict):
        return sum(tree_bytes(v) for v in tree.values())
    return tree.numel() * tree.element_size() if isinstance(tree, torch.Tensor) else 0


def raw_read(files: list[tuple[Path, int]], threads: int) -> float:
    """Seconds to read these whole files with preadv into one preallocated buffer, `threads` at a time."""
    total = sum(size for _, size in files)
    buf = torch.empty(total, dtype=torch.uint8)
    view = memoryview(buf.numpy())
    buf[::4096] = 0  # fault the buffer in before the timing
    jobs, at = [], 0
    for path, size in files:
        jobs.append((path, at, size))
        at += size

    def read(job: tuple[Path, int, int]) -> None:
        path, at, size = job
        fd = os.open(path, os.O_RDONLY)
        try:
            done = 0
            while done < size:
                n = os.preadv(fd, [view[at + done : at + min(size, done + MAX_IO)]], done)
                if n == 0:
                    raise EOFError(path)
                done += n
        finally:
            os.close(fd)

    t0 = time.perf_counter()
    with cf.ThreadPoolExecutor(threads) as pool:
        list(pool.map(read, jobs))
    return time.perf_counter() - t0


def pick_files(files: list[tuple[Path, int]], nbytes: int, start: int) -> list[tuple[Path, int]]:
    """Files of the checkpoint, taken in turn from `start`, until they hold at least `nbytes`."""
    out, got = [], 0
    for i in range(len(files)):
        if got >= nbytes:
            break
        f = files[(start + i) % len(files)]
        out.append(f)
        got += f[1]
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="bench_io reshard", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--size", type=positive_size, default=2 << 30, help="fp32 params + Adam states (default 2GiB)")
    p.add_argument("--save-layout", default="tp2pp2dp2zero1", help="layout A, saved from virtual ranks")
    p.add_argument(
        "--load-layouts",
        default="tp4pp1,tp1pp2ep2dp2,tp2pp1ep2dp4zero1",
        help="comma list of layouts B, each loaded rank by rank",
    )
    p.add_argument("--target", choices=("disk", "tmpfs"), default="disk")
    p.add_argument("--dir", help="with --target disk: its parent directory (default /var/tmp)")
    p.add_argument(
        "--cache",
        choices=("auto", "drop_caches", "fadvise", "none"),
        help="with --target disk: how reads are made cold (default auto)",
    )
    p.add_argument("--io-threads", type=at_least(1), default=16)
    p.add_argument(
        "--object-bytes", type=positive_size, help="ChunkingPolicy.object_bytes for the save (default: ucp's, 64 MiB)"
    )
    p.add_argument(
        "--inner-bytes",
        type=positive_size,
        help="ChunkingPolicy.inner_bytes, the unit of a partial read (default: ucp's, 1 MiB); at tiny sizes a"
        " smaller one keeps amplification down, as chunks must be small against a rank's share",
    )
    p.add_argument(
        "--pack-below",
        type=parse_size,
        help="ChunkingPolicy.pack_below: atoms under it are packed and read whole (default: ucp's, 1 MiB); at tiny"
        " sizes a smaller one keeps amplification down, as for --inner-bytes (0 packs nothing)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-verify", action="store_true", help="skip the check of every rank's state")
    p.add_argument("--json", type=output_file, help="write the per-rank figures to this file")
    p.add_argument("--png", type=output_file, help="write a chart (per-rank GB/s against raw, and amplification)")
    return p


def run(args: argparse.Namespace, log: Any = None) -> dict[str, Any]:
    import ucp
    from ucp.distributed import ShardedModel, VirtualWorld, load_sharded
    from ucp.sharding.layout import parse_layout
    from ucp.sharding.reshard import DEFAULT_STATES, shard

    from .runner import PeakRSS
    from .targets import TARGETS, iter_files

    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    states = DEFAULT_STATES
    config, nbytes = size_config(args.size, states)
    layout_a = parse_layout(args.save_layout)
    layouts_b = [parse_layout(x.strip()) for x in args.load_layouts.split(",") if x.strip()]
    log(f"reshard: MixtralConfig hidden={config.hidden_size} vocab={config.vocab_size}: {nbytes / 2**20:.0f} MiB")
    t0 = time.perf_counter()
    full = full_state(config, states, args.seed)
    local_a = [shard(full, config, layout_a, r, states) for r in range(layout_a.world_size)]
    log(f"reshard: full state and {layout_a.world_size} local states of {layout_a} in {time.perf_counter() - t0:.1f} s")
    target = TARGETS[args.target](args.dir)
    results: list[RankLoad] = []
    try:
        url = str(target.root / "ckpt")
        from ucp.base.chunking import ChunkingPolicy

        policy = ChunkingPolicy()
        policy = ChunkingPolicy(
            object_bytes=args.object_bytes or policy.object_bytes,
            inner_bytes=args.inner_bytes or policy.inner_bytes,
            pack_below=policy.pack_below if args.pack_below is None else args.pack_below,
        )
        options = ucp.SaveOptions(chunking=policy, fsync=True, io_threads=args.io_threads)
        t0 = time.perf_counter()
        VirtualWorld(layout_a.world_size).save(
            local_a, url, step=1, model=ShardedModel(config, layout_a, states), options=options
        )
        save_s = time.perf_counter() - t0
        written = tree_bytes(local_a)
        del local_a
        files = sorted(((p, p.stat().st_size) for p in iter_files(Path(url))), key=lambda f: -f[1])
        stored = sum(s for _, s in files)
        log(
            f"reshard: saved {layout_a} from {layout_a.world_size} virtual ranks in {save_s:.2f} s"
            f" ({nbytes / save_s / 1e9:.2f} GB/s of atoms; {stored / 2**20:.0f} MiB in {len(files)} files)"
        )
        for layout in layouts_b:
            model_b = ShardedModel(config, layout, states)
            for rank in range(layout.world_size):
                cache, _ = target.make_cold(Path(url), args.cache)
                with PeakRSS() as rss:
                    t1 = time.perf_counter()
                    reader = ucp.open_checkpoint(url)
                    local, report = load_sharded(reader, model_b, rank)
                    load_s = time.perf_counter() - t1
                verified = None if args.no_verify else tree_equal(local, shard(full, config, layout, rank, states))
                del local, reader
                picked = pick_files(files, report.bytes_needed, start=rank * 7)
                target.make_cold(Path(url), args.cache)
                raw_s = raw_read(picked, args.io_threads)
                raw_bytes = sum(s for _, s in picked)
                r = RankLoad(
                    str(layout), rank, report.bytes_needed, report.bytes_read, report.amplification, load_s,
                    report.bytes_needed / load_s / 1e9, raw_s, raw_bytes / raw_s / 1e9,
                    (report.bytes_needed / load_s) / (raw_bytes / raw_s), rss.extra_mib, cache, verified,
                )  # fmt: skip
                results.append(r)
                log(
                    f"  {layout} rank {rank}: needs {r.bytes_needed / 2**20:.1f} MiB, read {r.bytes_read / 2**20:.1f} MiB"
                    f" (x{r.amplification:.3f}), {r.load_gbps:.2f} GB/s vs raw {r.raw_gbps:.2f} GB/s,"
                    f" +RSS {r.peak_rss_mib or 0:.0f} MiB{'' if verified is not False else '  WRONG STATE'}"
                )
    finally:
        target.close()
    return {
        "config": {
            **{k: v for k, v in vars(args).items()},
            "model_config": config.to_json(),
            "state_bytes": nbytes,
            "saved_local_bytes": written,
            "stored_bytes": stored,
            "files": len(files),
            "save_s": save_s,
            "save_gbps": nbytes / save_s / 1e9,
            "target_fstype": target.fstype,
        },
        "ranks": [asdict(r) for r in results],
    }


def table(doc: dict[str, Any]) -> str:
    header = (
        "layout",
        "rank",
        "need MiB",
        "read MiB",
        "amplif.",
        "load s",
        "GB/s",
        "raw GB/s",
        "load/raw",
        "+RSS MiB",
        "ok",
    )
    rows = [header]
    for r in doc["ranks"]:
        rows.append(
            (
                r["layout"], str(r["rank"]), f"{r['bytes_needed'] / 2**20:.1f}", f"{r['bytes_read'] / 2**20:.1f}",
                f"{r['amplification']:.3f}", f"{r['load_s']:.3f}", f"{r['load_gbps']:.2f}", f"{r['raw_gbps']:.2f}",
                f"{r['load_vs_raw']:.2f}", f"{r['peak_rss_mib'] or 0:.0f}",
                {True: "yes", False: "NO", None: "-"}[r["verified"]],
            )
        )  # fmt: skip
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = []
    for k, row in enumerate(rows):
        lines.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))))
        if k == 0:
            lines.append("  ".join("-" * w for w in widths))
    by_layout: dict[str, list[dict[str, Any]]] = {}
    for r in doc["ranks"]:
        by_layout.setdefault(r["layout"], []).append(r)
    for name, rs in by_layout.items():
        need = sum(r["bytes_needed"] for r in rs)
        read = sum(r["bytes_read"] for r in rs)
        lines.append(
            f"{name}: {len(rs)} ranks, max amplification {max(r['amplification'] for r in rs):.3f},"
            f" all ranks {read / need:.3f}; median load/raw {sorted(r['load_vs_raw'] for r in rs)[len(rs) // 2]:.2f}"
        )
    return "\n".join(lines)


def write_png(path: str, doc: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ranks = doc["ranks"]
    labels = [f"{r['layout']}\nr{r['rank']}" for r in ranks]
    xs = range(len(ranks))
    fig, (a, b) = plt.subplots(2, 1, figsize=(max(8.0, 0.5 * len(ranks)), 6.5), sharex=True)
    a.bar([x - 0.2 for x in xs], [r["load_gbps"] for r in ranks], 0.4, label="ucp load_sharded")
    a.bar([x + 0.2 for x in xs], [r["raw_gbps"] for r in ranks], 0.4, label="raw preadv, same bytes")
    a.set_ylabel("GB/s")
    a.legend(fontsize=8)
    a.grid(axis="y", alpha=0.3)
    b.bar(xs, [r["amplification"] for r in ranks], 0.6, color="tab:orange")
    b.axhline(1.25, color="red", lw=0.8, ls="--")
    b.set_ylabel("read amplification")
    b.set_xticks(list(xs), labels, fontsize=6)
    b.grid(axis="y", alpha=0.3)
    c = doc["config"]
    fig.suptitle(
        f"reshard: {c['state_bytes'] / 2**20:.0f} MiB saved as {c['save_layout']}, loaded rank by rank", fontsize=10
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _target(args: argparse.Namespace) -> str:
    return f"--target {args.target}"


RULES = (
    Applies("--dir", "dir", lambda args: args.target == "disk", "with --target disk", _target),
    Applies("--cache", "cache", lambda args: args.target == "disk", "with --target disk (tmpfs has no cache to drop)"),
)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    refuse_inapplicable(args, RULES, _target)
    args.cache = args.cache or "auto"
    doc = run(args)
    print(table(doc))
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=1, default=str))
    if args.png:
        write_png(args.png, doc)
    return 0 if all(r["verified"] is not False for r in doc["ranks"]) else 1


if __name__ == "__main__":
    sys.exit(main())
