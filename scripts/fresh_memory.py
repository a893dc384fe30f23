"""Loading into fresh memory: what the first touch of a load's new tensors costs, and what removes it
(docs/BENCHMARKS.md, fresh memory).

    python scripts/fresh_memory.py [--size 456MiB] [--rounds 5] [--loads 3] [--dir /dev/shm]

A transformer's training state (bench_io's mixed state) is saved once with ucp and DCP; then each strategy loads it
in processes of its own, `--loads` loads a process, the freed memory given back to the kernel between loads
(`malloc_trim`), so that every load fills memory the process has never touched (as a job that starts fills it):

- `ucp`: `ucp.load` as shipped (4 KiB pages, each faulted in by the read that first touches it);
- `ucp, huge pages`: each tensor of 4 MiB or more given MADV_HUGEPAGE when it is made (the whole huge pages inside
  it), before it is read into;
- `ucp, populated by readers`: each such tensor populated (MADV_POPULATE_WRITE, one call) by the read thread that
  reads its first chunk, beside the other threads' reads;
- `ucp, huge pages populated`: both;
- `ucp, one allocation`: every tensor a view of one allocation with MADV_HUGEPAGE (not what ucp can ship: each
  tensor a load makes must be freed, resized and saved on its own), as the bound of what fewer allocations give;
- `dcp`: `dcp.load` into tensors allocated (`empty`) inside the timing, as bench_io's dcp method.

Strategies alternate round by round; the figure of a strategy is the median over rounds of each process's median.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
STRATEGIES = (
    "ucp",
    "ucp, huge pages",
    "ucp, populated by readers",
    "ucp, huge pages populated",
    "ucp, one allocation",
    "dcp",
)
HUGE_PAGE = 2 << 20
FRESH_BYTES = 4 << 20  # (tensors this large get the advice or are populated)
MADV_HUGEPAGE, MADV_POPULATE_WRITE = 14, 23


def _madvise(address: int, nbytes: int, advice: int, align: int) -> None:
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    start, end = -(-address // align) * align, (address + nbytes) // align * align
    if end > start:
        libc.madvise(start, end - start, advice)


def _worker(strategy: str, root: str, loads: int, size: int) -> list[float]:
    """Times of `loads` loads by `strategy`, in this process."""
    sys.path.insert(0, str(REPO))
    import torch

    import ucp
    from bench_io.state import flatten, transformer_specs
    from ucp.base import heap
    from ucp.engine import checkpoint

    if "huge pages" in strategy:
        allocate = checkpoint.allocate

        def advised(meta, *, zero=False, device=None):  # type: ignore[no-untyped-def]
            tensor = allocate(meta, zero=zero, device=device)
            if meta.nbytes >= FRESH_BYTES:
                _madvise(tensor.data_ptr(), meta.nbytes, MADV_HUGEPAGE, HUGE_PAGE)
            return tensor

        checkpoint.allocate = advised  # type: ignore[assignment]
    if "populated" in strategy:
        read_chunk_into = checkpoint.CheckpointReader.read_chunk_into

        def populated(self, meta, index, out):  # type: ignore[no-untyped-def]
            if meta.nbytes >= FRESH_BYTES and not any(index):  # (the read of an atom's first chunk populates it all)
                _madvise(out.data_ptr() - out.data_ptr() % 4096, meta.nbytes + out.data_ptr() % 4096,
                         MADV_POPULATE_WRITE, 4096)  # fmt: skip
            read_chunk_into(self, meta, index, out)

        checkpoint.CheckpointReader.read_chunk_into = populated  # type: ignore[method-assign]
    if strategy == "ucp, one allocation":
        specs = {s.path: s for s in transformer_specs(size)}
        real = checkpoint.allocate
        pool: list = []

        def one(meta, *, zero=False, device=None):  # type: ignore[no-untyped-def]
            if not pool:
                total = sum(-(-s.nbytes // 64) * 64 for s in specs.values())
                base = torch.empty(total, dtype=torch.uint8)
                _madvise(base.data_ptr(), total, MADV_HUGEPAGE, HUGE_PAGE)
                pool.extend([base, 0])
            if meta.path not in specs:
                return real(meta, zero=zero, device=device)
            base, pos = pool
            pool[1] = pos + -(-meta.nbytes // 64) * 64
            return base[pos : pos + meta.nbytes].view(specs[meta.path].dtype).view(meta.shape)

        checkpoint.allocate = one  # type: ignore[assignment]
    times = []
    for _ in range(loads):
        start = time.perf_counter()
        if strategy == "dcp":
            import torch.distributed.checkpoint as dcp

            from bench_io.methods import _quiet

            out = {s.path: torch.empty(s.shape, dtype=s.dtype) for s in transformer_specs(size)}
            with _quiet():
                dcp.load(out, storage_reader=dcp.FileSystemReader(f"{root}/dcp"), no_dist=True)
        else:
            out = flatten(ucp.load(f"{root}/ucp"))
        times.append(time.perf_counter() - start)
        del out
        pool.clear() if strategy == "ucp, one allocation" else None
        heap.trim()  # (the freed memory back to the kernel: the next load's is fresh again)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="456MiB")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--loads", type=int, default=3)
    parser.add_argument("--dir", default="/dev/shm")
    parser.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    sys.path.insert(0, str(REPO))
    from bench_io.args import parse_size

    size = parse_size(args.size)
    if args.worker:
        strategy, root, loads = args.worker
        print(json.dumps(_worker(strategy, root, int(loads), size)))
        return
    import torch.distributed.checkpoint as dcp

    import ucp
    from bench_io.methods import _quiet
    from bench_io.state import transformer_state

    state = transformer_state(size)
    figures: dict[str, list[float]] = {s: [] for s in STRATEGIES}
    with tempfile.TemporaryDirectory(dir=args.dir) as root:
        ucp.save(state.tree, f"{root}/ucp")
        with _quiet():
            dcp.save(dict(state.flat), storage_writer=dcp.FileSystemWriter(f"{root}/dcp"), no_dist=True)
        del state
        for _ in range(args.rounds):
            for strategy in STRATEGIES:
                out = subprocess.run(
                    [sys.executable, __file__, "--size", args.size, "--worker", strategy, root, str(args.loads)],
                    capture_output=True,
                    text=True,
                    check=True,
                )
                figures[strategy].append(statistics.median(json.loads(out.stdout.splitlines()[-1])))
    import os

    print(
        f"{args.size} mixed state from {args.dir}, {args.rounds} rounds of {args.loads} loads a process; load {os.getloadavg()[0]:.1f}"
    )
    for strategy, values in figures.items():
        print(f"{strategy:<28} {statistics.median(values):.3f} s  ({', '.join(f'{v:.3f}' for v in values)})")
    base = figures["ucp"]
    for strategy in STRATEGIES:
        ratio = statistics.median(b / m for b, m in zip(base, figures[strategy]))
        print(f"ucp / {strategy:<28} {ratio:.2f}x (> 1: faster than 4 KiB pages faulted by the reads)")
    print(
        f"dcp / ucp: {statistics.median(d / u for d, u in zip(figures['dcp'], figures['ucp'])):.2f}x (min "
        f"{min(d / u for d, u in zip(figures['dcp'], figures['ucp'])):.2f}x)"
    )


if __name__ == "__main__":
    main()
