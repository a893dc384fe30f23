"""Start the ranks of a layout as local processes, the way torchrun does (RANK, WORLD_SIZE, MASTER_ADDR, ...),
and stop them as a failure would (SIGKILL). Used by the demo, scripts/trainer_bench.py and the tests."""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


_LOWEST_PORT = 10_000  # clear of the well-known and commonly configured service ports


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing is bound to now, for a local process group's rendezvous or a server.

    Drawn below the kernel's ephemeral range, not with bind(0): a port from bind(0) lies in that range, which the
    kernel also hands out as the source port of every outgoing connection, so between the pick and the listen
    another process's connection can take it (seen under the parallel suite: the rendezvous store failed with
    EADDRINUSE). Below the range a port is only ever taken by an explicit bind. Drawn from the system's entropy, not
    `random`'s, because test processes seed `random` alike."""
    draw = random.SystemRandom()
    low = _ephemeral_low()
    for _ in range(200):
        port = draw.randrange(_LOWEST_PORT, low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # every draw taken: a crowded machine, take what the kernel gives
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _ephemeral_low() -> int:
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768  # Linux's default range starts here
    return max(low, _LOWEST_PORT + 1000)


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
