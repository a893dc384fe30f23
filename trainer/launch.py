"""Start the ranks of a layout as local processes, the way torchrun does (RANK, WORLD_SIZE, MASTER_ADDR, ...),
and stop them as a failure would (SIGKILL). Used by the demo, scripts/trainer_bench.py and the tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def trainer_argv(config: str | Path, layout: str, steps: int, metrics: str | Path, *extra: str) -> list[str]:
    """The arguments of `python -m trainer` (for `start`): the config, the layout(s), the step to stop at, the
    metrics file, then `extra`."""
    return [
        "-m",
        "trainer",
        "--config",
        str(config),
        "--layout",
        layout,
        "--steps",
        str(steps),
        "--metrics-file",
        str(metrics),
        *extra,
    ]


def start(
    argv: list[str], world: int, log_dir: Path, rank0_to_terminal: bool = False, env: dict[str, str] | None = None
) -> list[subprocess.Popen]:
    """`python *argv` as ranks 0..world-1 of one process group; rank r's output goes to log_dir/rank{r}.log."""
    log_dir.mkdir(parents=True, exist_ok=True)
    port = str(free_port())
    procs = []
    for rank in range(world):
        rank_env = (
            os.environ
            | (env or {})
            | {
                "RANK": str(rank),
                "LOCAL_RANK": str(rank),
                "WORLD_SIZE": str(world),
                "LOCAL_WORLD_SIZE": str(world),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": port,
                "OMP_NUM_THREADS": "1",
                "PYTHONUNBUFFERED": "1",
            }
        )
        with open(log_dir / f"rank{rank}.log", "w") as log:
            out = None if rank == 0 and rank0_to_terminal else log
            procs.append(
                subprocess.Popen([sys.executable, *argv], cwd=REPO, env=rank_env, stdout=out, stderr=subprocess.STDOUT)
            )
    return procs


def wait(procs: list[subprocess.Popen], log_dir: Path, timeout: float = 600) -> None:
    """Wait for every rank; on a failure kill the rest and raise with the tails of their logs."""
    try:
        for proc in procs:
            proc.wait(timeout=timeout)
    finally:
        kill(procs)
    failed = [r for r, p in enumerate(procs) if p.returncode != 0]
    if failed:
        tails = "\n".join(f"--- rank {r}\n" + (log_dir / f"rank{r}.log").read_text()[-2000:] for r in failed)
        raise RuntimeError(f"ranks {failed} failed:\n{tails}")


def kill(procs: list[subprocess.Popen]) -> None:
    """SIGKILL every rank still running (no cleanup runs in them: as on a lost node)."""
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
    for proc in procs:
        proc.wait()
