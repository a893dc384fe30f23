"""Durability per object against durability in one pass, on the file system of --dir.

    python scripts/durability_probe.py --files 20000 --bytes 15500 --dir /var/tmp

Writes --files files of --bytes each, one directory per file (as a save of that many small atoms has), from 16
threads, two ways, alternating, --repeats times each:

- "fsync each": every file fsynced as it is written, then every directory (what ucp does on a disk);
- "syncfs once": the same writes with no fsync, then one `syncfs(2)` of the file system (what a save that owns its
  file system could do instead).

Prints the write time, the time to durability and the total of each run. Where the total barely moves, the cost is
in making the files, not in waiting for them to be durable, and one pass buys nothing.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import ctypes
import os
import shutil
import tempfile
import time

THREADS = 16


def _syncfs(path: str) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        if libc.syncfs(fd) != 0:
            raise OSError(ctypes.get_errno(), "syncfs failed", path)
    finally:
        os.close(fd)


def _fsync_path(path: str, flags: int = os.O_RDONLY) -> None:
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def run_once(root: str, files: int, data: bytes, fsync_each: bool) -> tuple[float, float]:
    def write(i: int) -> None:
        directory = f"{root}/t{i}"
        os.mkdir(directory)
        fd = os.open(f"{directory}/c", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            os.write(fd, data)
            if fsync_each:
                os.fsync(fd)
        finally:
            os.close(fd)

    def sync_dirs(directories: list[str]) -> None:
        for directory in directories:
            _fsync_path(directory, os.O_RDONLY | os.O_DIRECTORY)

    t0 = time.perf_counter()
    with cf.ThreadPoolExecutor(THREADS) as pool:
        list(pool.map(write, range(files)))
    t1 = time.perf_counter()
    if fsync_each:
        directories = [root] + [f"{root}/t{i}" for i in range(files)]
        with cf.ThreadPoolExecutor(THREADS) as pool:
            list(pool.map(sync_dirs, (directories[k::THREADS] for k in range(THREADS))))
    else:
        _syncfs(root)
    return t1 - t0, time.perf_counter() - t1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--files", type=int, default=20000)
    p.add_argument("--bytes", type=int, default=15500, help="bytes per file")
    p.add_argument("--dir", default="/var/tmp", help="where to write (the file system under test)")
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args(argv)
    data = os.urandom(args.bytes)
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="durability-") as scratch:
        for _ in range(args.repeats):
            for fsync_each in (True, False):
                root = os.path.join(scratch, "run")
                shutil.rmtree(root, ignore_errors=True)
                os.mkdir(root)
                _syncfs(scratch)  # start from a clean file system: nothing of the last run left to write back
                writes, durable = run_once(root, args.files, data, fsync_each)
                name = "fsync each" if fsync_each else "syncfs once"
                print(
                    f"{name:<12} {args.files} files of {args.bytes} B: writes {writes:.2f} s, "
                    f"durable {durable:.2f} s, total {writes + durable:.2f} s",
                    flush=True,
                )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
