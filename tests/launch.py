"""Launch a world of processes as torchrun would (RANK, WORLD_SIZE, MASTER_ADDR, ... in the environment)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(argv: list[str], world: int, timeout: float = 180, env: dict[str, str] | None = None) -> list[str]:
    """Run `python *argv` as `world` ranks of one process group; return their outputs, fail with them."""
    port = str(free_port())
    procs = []
    for rank in range(world):
        rank_env = os.environ | (env or {}) | {
            "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "OMP_NUM_THREADS": "1",
        }
        procs.append(subprocess.Popen([sys.executable, *argv], cwd=REPO, env=rank_env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    outputs, failed = [], False
    try:
        for proc in procs:
            out, _ = proc.communicate(timeout=timeout)
            outputs.append(out)
            failed |= proc.returncode != 0
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert not failed, f"{argv} failed:\n" + "\n".join(o[-3000:] for o in outputs)
    return outputs
