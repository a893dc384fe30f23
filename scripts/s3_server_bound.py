"""Whether an S3 save against the embedded moto server is bound by the server: its CPU time around each save.

    python scripts/s3_server_bound.py --size-mib 256 --repeats 3

Saves bench_io's transformer state (as `bench_io --size` makes it) to a moto server on 127.0.0.1, alternating raw
concurrent puts (one object per tensor, 64 in flight) and `ucp.save` (64 threads), and prints for each: the wall
time, the server process's CPU time over it (user + system, from /proc/<pid>/stat) as a share of one core, the
client's own CPU time, and the objects the save left. A server near 100% of a core is the bound: then a save's
time follows the requests it makes, not what the client does.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

import ucp
from bench_io.s3_servers import MotoServer
from bench_io.state import transformer_state
from bench_io.targets import s3_filesystem

BUCKET = "server-bound"


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (Linux)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size-mib", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    state = transformer_state(args.size_mib << 20)
    blobs = {path: t.contiguous().view(-1).view(torch.uint8).numpy().tobytes() for path, t in state.flat.items()}
    server = MotoServer()
    try:
        options = {"endpoint_url": server.url, "key": "bench", "secret": "bench"}
        fs = s3_filesystem(options)
        fs.mkdir(BUCKET)
        print(f"{len(blobs)} tensors, {sum(map(len, blobs.values())) / 2**20:.0f} MiB")
        for rep in range(args.repeats):
            for name in ("raw", "ucp"):
                prefix = f"{BUCKET}/{name}{rep}"
                server_cpu, client, t0 = cpu_seconds(server.proc.pid), os.times(), time.perf_counter()
                if name == "raw":
                    with cf.ThreadPoolExecutor(64) as pool:
                        keys = [f"{prefix}/{path}" for path in blobs]
                        list(pool.map(fs.pipe_file, keys, blobs.values()))
                else:
                    ucp.save(
                        state.tree, f"s3://{prefix}", step=0, options=ucp.SaveOptions(io_threads=64),
                        storage_options=options,
                    )  # fmt: skip
                wall = time.perf_counter() - t0
                server_cpu = cpu_seconds(server.proc.pid) - server_cpu
                after = os.times()
                client_cpu = (after.user + after.system) - (client.user + client.system)
                objects = len(fs.find(prefix))
                print(
                    f"{name}: {objects} objects, wall {wall:.2f} s, server CPU {server_cpu:.2f} s "
                    f"({server_cpu / wall:.0%} of a core), client CPU {client_cpu:.2f} s",
                    flush=True,
                )
    finally:
        server.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
