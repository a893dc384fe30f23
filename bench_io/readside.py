"""The read side (and the save beside it) against its baselines, every ratio measured side by side in one run:

    python -m bench_io readside [--repeats 5] [--only small,disk,mixed] [--dir /var/tmp] [--json F]

- `small`: 5,000 tensors of 1-16 KiB on tmpfs. `ucp.save` and `ucp.load` against raw one-file-per-tensor IO done in
  the calling thread (for files this small the fastest raw: a thread pool's hand-offs cost more than the IO), which
  takes a CRC-32C of every tensor it writes; `raw-crc` also checks it on load, `raw` does not.
- `disk`: 20,000 tensors of 1-64 KiB on a local disk (`--dir`), the page cache dropped before every load: `ucp.load`
  against raw-crc's load, with 16 threads and in the calling thread (the faster of the two is the baseline).
- `mixed`: a transformer's training state (456 MiB: bf16 parameters, fp32 master weights and Adam moments) on tmpfs.
  `ucp.save` / `ucp.load` against raw-crc with 8 threads; `ucp.load` into fresh memory and `ucp.load(into=)` of
  tensors the caller holds (allocated and touched before the timer, as a resuming job's are) against DCP's load
  (`dcp.load`, no process group) into tensors it allocates inside the timing (`empty`, as `bench_io`'s dcp method),
  and into the same held tensors. Before each load the memory the last one freed goes back to the kernel
  (`malloc_trim`), so that what a load allocates is fresh memory, as a starting job's is.

Methods alternate within each repeat, so that a shared machine's drift spreads over all of them; the figures are
medians, and each ratio is the median (and the range) of the per-repeat ratios. Every load is checked against the
saved state (outside the timing). The machine's load average is printed with the results.
"""

from __future__ import annotations

import argparse
import functools
import inspect
import json
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .args import at_least, output_file, parse_list, positive_size

SCENARIOS = ("small", "disk", "mixed")
MiB = 1 << 20


def _bytes(t: Any) -> memoryview:
    import torch

    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


class RawLoop:
    """One file per tensor, written and read in the calling thread (os.write + fsync; os.readv into a tensor
    allocated per file), with a CRC-32C of every tensor taken on save; `check` also verifies it on load."""

    def __init__(self, check: bool):
        self.check = check

    def save(self, flat: dict[str, Any], directory: Path) -> None:
        import crc32c

        index = {}
        for i, (path, t) in enumerate(flat.items()):
            data = _bytes(t)
            index[path] = [str(t.dtype).removeprefix("torch."), list(t.shape), crc32c.crc32c(data)]
            fd = os.open(directory / str(i), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                os.write(fd, data)
                os.fsync(fd)
            finally:
                os.close(fd)
        (directory / "index.json").write_text(json.dumps(index))

    def load(self, directory: Path) -> dict[str, Any]:
        import crc32c
        import torch

        index = json.loads((directory / "index.json").read_text())
        out = {}
        for i, (path, (dtype, shape, crc)) in enumerate(index.items()):
            t = torch.empty(shape, dtype=getattr(torch, dtype))
            view = _bytes(t)
            fd = os.open(directory / str(i), os.O_RDONLY)
            try:
                os.readv(fd, [view])
            finally:
                os.close(fd)
            if self.check and crc32c.crc32c(view) != crc:
                raise ValueError(f"{path}: checksum mismatch")
            out[path] = t
        return out


def _ucp_save(tree: dict[str, Any], directory: Path) -> None:
    import ucp

    ucp.save(tree, str(directory), step=0)


def _ucp_load(directory: Path, into: dict[str, Any] | None = None) -> dict[str, Any]:
    import ucp
    from bench_io.state import flatten

    return flatten(ucp.load(str(directory), into=into) if into is not None else ucp.load(str(directory)))


class Timings:
    """Seconds per (method, phase), one list per repeat."""

    def __init__(self) -> None:
        self.times: dict[str, list[float]] = {}

    def timed(self, name: str, fn: Callable[..., Any], *args: Any) -> Any:
        t0 = time.perf_counter()
        out = fn(*args)
        self.times.setdefault(name, []).append(time.perf_counter() - t0)
        return out

    def median(self, name: str) -> float:
        return statistics.median(self.times[name])

    def ratio(self, base: str, mine: str) -> tuple[float, float, float]:
        """Median, min and max over repeats of base time / mine time (> 1: mine is faster)."""
        ratios = [b / m for b, m in zip(self.times[base], self.times[mine])]
        return statistics.median(ratios), min(ratios), max(ratios)


def _check(state: Any, loaded: dict[str, Any], what: str) -> None:
    problem = state.verify(loaded)
    if problem is not None:
        raise SystemExit(f"{what} loaded something else than was saved: {problem}")


def run_small(args: argparse.Namespace, t: Timings) -> dict[str, Any]:
    from bench_io.state import make_state, small_specs

    state = make_state("small", small_specs(args.small, seed=args.seed, hi=16 << 10), seed=args.seed + 1)
    raw, raw_crc = RawLoop(check=False), RawLoop(check=True)
    with tempfile.TemporaryDirectory(dir="/dev/shm") as tmp:
        for r in range(args.repeats):
            for name, save, load in (
                ("raw", raw.save, raw.load),
                ("raw-crc", raw_crc.save, raw_crc.load),
                ("ucp", _ucp_save, _ucp_load),
            ):
                d = Path(tmp) / f"{name}-{r}"
                d.mkdir()
                t.timed(f"small {name} save", save, state.flat if name != "ucp" else state.tree, d)
                _check(state, t.timed(f"small {name} load", load, d), name)
                shutil.rmtree(d)
    return {"tensors": args.small, "bytes": state.nbytes}


def run_disk(args: argparse.Namespace, t: Timings) -> dict[str, Any]:
    from bench_io.methods import RawCrc
    from bench_io.state import make_state, small_specs
    from bench_io.targets import drop_page_cache

    state = make_state("small", small_specs(args.disk, seed=args.seed), seed=args.seed + 1)
    pooled, loop = RawCrc(io_threads=16), RawLoop(check=True)
    cache = set()
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        root = Path(tmp)
        dirs = {name: root / name for name in ("raw-crc", "ucp")}
        for d in dirs.values():
            d.mkdir()
        pooled.save(state, dirs["raw-crc"])
        _ucp_save(state.tree, dirs["ucp"])
        for r in range(args.repeats):
            for name, load in (
                ("raw-crc 16 threads", functools.partial(pooled.load, dirs["raw-crc"])),
                ("raw-crc 1 thread", functools.partial(_loop_load_pooled_files, loop, dirs["raw-crc"])),
                ("ucp", functools.partial(_ucp_load, dirs["ucp"])),
            ):
                cache.add(drop_page_cache(root, args.cache))
                _check(state, t.timed(f"disk {name} load", load), name)
    return {"tensors": args.disk, "bytes": state.nbytes, "cache": sorted(cache)}


def _loop_load_pooled_files(loop: RawLoop, directory: Path) -> dict[str, Any]:
    """raw-crc's files (bench_io's `RawCrc` layout: `<i>.bin`, an index of [file, dtype, shape, crc]) read in the
    calling thread."""
    import crc32c
    import torch

    index = json.loads((directory / "index.json").read_text())
    out = {}
    for path, (name, dtype, shape, crc) in index.items():
        tensor = torch.empty(shape, dtype=getattr(torch, dtype))
        view = _bytes(tensor)
        fd = os.open(directory / name, os.O_RDONLY)
        try:
            os.readv(fd, [view])
        finally:
            os.close(fd)
        if loop.check and crc32c.crc32c(view) != crc:
            raise ValueError(f"{path}: checksum mismatch")
        out[path] = tensor
    return out


def run_mixed(args: argparse.Namespace, t: Timings) -> dict[str, Any]:
    import torch
    import torch.distributed.checkpoint as dcp

    from bench_io.methods import RawCrc, _dcp
    from bench_io.state import transformer_state
    from ucp import load as ucp_load
    from ucp.base.heap import trim

    state = transformer_state(args.mixed, seed=args.seed)
    raw = RawCrc(io_threads=8)
    held = {p: torch.zeros_like(v) for p, v in state.flat.items()}  # a resuming job's own tensors, touched

    def held_tree() -> dict[str, Any]:
        from bench_io.state import set_path

        tree: dict[str, Any] = {}
        for p, v in held.items():
            set_path(tree, p, v)
        return {**state.tree, **{k: v for k, v in tree.items()}}

    into = held_tree()

    def dcp_load(d: Path, fresh: bool) -> dict[str, Any]:
        out = {p: torch.empty(v.shape, dtype=v.dtype) for p, v in state.flat.items()} if fresh else dict(held)
        with _dcp():
            dcp.load(out, storage_reader=dcp.FileSystemReader(str(d)), no_dist=True)
        return out

    def dcp_save(d: Path) -> None:
        with _dcp():
            dcp.save(
                dict(state.flat),
                storage_writer=dcp.FileSystemWriter(str(d), sync_files=True, thread_count=8),
                no_dist=True,
            )

    with tempfile.TemporaryDirectory(dir="/dev/shm") as tmp:
        for r in range(args.repeats):
            dirs = {name: Path(tmp) / f"{name}-{r}" for name in ("raw-crc", "ucp", "dcp")}
            for d in dirs.values():
                d.mkdir()
            t.timed("mixed raw-crc save", raw.save, state, dirs["raw-crc"])
            t.timed("mixed ucp save", _ucp_save, state.tree, dirs["ucp"])
            t.timed("mixed dcp save", dcp_save, dirs["dcp"])
            for name, load in (
                ("raw-crc", functools.partial(raw.load, dirs["raw-crc"])),
                ("ucp", functools.partial(_ucp_load, dirs["ucp"])),
                ("dcp", functools.partial(dcp_load, dirs["dcp"], True)),
                ("ucp into", functools.partial(_ucp_load, dirs["ucp"], into)),
                ("dcp into", functools.partial(dcp_load, dirs["dcp"], False)),
            ):
                if name == "ucp into" and "into" not in inspect.signature(ucp_load).parameters:
                    continue  # (a ucp from before `into=`: the baseline of the change that added it)
                trim()  # (the memory the last load freed back to the kernel: a load that allocates gets fresh pages)
                _check(state, t.timed(f"mixed {name} load", load), name)
            for d in dirs.values():
                shutil.rmtree(d)
    return {"tensors": state.count, "bytes": state.nbytes}


RATIOS = {
    "small": [
        ("save against raw-crc (raw writes CRC)", "small raw-crc save", "small ucp save"),
        ("load against raw (no CRC)", "small raw load", "small ucp load"),
        ("load against raw-crc", "small raw-crc load", "small ucp load"),
    ],
    "disk": [
        ("cold load against raw-crc, 16 threads", "disk raw-crc 16 threads load", "disk ucp load"),
        ("cold load against raw-crc, 1 thread", "disk raw-crc 1 thread load", "disk ucp load"),
    ],
    "mixed": [
        ("save against raw-crc, 8 threads", "mixed raw-crc save", "mixed ucp save"),
        ("load against raw-crc, 8 threads", "mixed raw-crc load", "mixed ucp load"),
        ("save against DCP", "mixed dcp save", "mixed ucp save"),
        ("load (fresh) against DCP (fresh)", "mixed dcp load", "mixed ucp load"),
        ("load (into=) against DCP (fresh)", "mixed dcp load", "mixed ucp into load"),
        ("load (into=) against DCP (into)", "mixed dcp into load", "mixed ucp into load"),
    ],
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="bench_io readside", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--only", type=parse_list(list(SCENARIOS)), default=list(SCENARIOS), help="comma list of scenarios")
    p.add_argument("--repeats", type=at_least(1), default=5)
    p.add_argument("--small", type=at_least(1), default=5000, help="tensors of 1-16 KiB in the small state (tmpfs)")
    p.add_argument("--disk", type=at_least(1), default=20000, help="tensors of 1-64 KiB in the disk state")
    p.add_argument("--mixed", type=positive_size, default=456 * MiB, help="bytes of the mixed state (tmpfs)")
    p.add_argument("--dir", default="/var/tmp", help="the disk scenario's parent directory")
    p.add_argument("--cache", default="auto", help="how the disk is made cold (bench_io's --cache)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=output_file, help="write every time and ratio to this file")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    runs = {"small": run_small, "disk": run_disk, "mixed": run_mixed}
    t = Timings()
    info = {}
    load_before = os.getloadavg()
    for name in args.only:
        info[name] = runs[name](args, t)
    load_after = os.getloadavg()
    print(f"load average before {load_before[0]:.2f}, after {load_after[0]:.2f} (1 min); {args.repeats} repeats")
    for name in t.times:
        values = ", ".join(f"{v:.4f}" for v in t.times[name])
        print(f"{name:<36} median {t.median(name):8.4f} s   ({values})")
    ratios = {}
    for scenario in args.only:
        print(f"-- {scenario}: {info[scenario]}")
        for label, base, mine in RATIOS[scenario]:
            if base in t.times and mine in t.times:
                med, lo, hi = t.ratio(base, mine)
                ratios[f"{scenario}: {label}"] = [med, lo, hi]
                print(f"   ucp {label:<44} {med:5.2f}x  (repeats {lo:.2f}-{hi:.2f}x; > 1: ucp faster)")
    if args.json:
        Path(args.json).write_text(
            json.dumps({"times": t.times, "ratios": ratios, "info": info, "load": [load_before, load_after]}, indent=1)
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
