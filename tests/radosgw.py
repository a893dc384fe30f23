"""One radosgw for a whole test run, shared by pytest-xdist's workers: the first worker that needs it starts a keeper
process (`python -m tests.radosgw DIR`), which starts the cluster (`bench_io.s3_servers.Radosgw`) and writes its
endpoint to DIR; every worker registers its PID there while it uses it. The keeper serves until no registered
worker is alive (each unregisters at its session's end; a killed one is noticed by its PID), then kills every
daemon by PID and removes the cluster. So a run of three workers starts one cluster (15-30 s, ~0.5 GiB), not three,
and nothing outlives the run, however it ends. A daemon that exits while serving is named, with its exit status and
the end of its log, in DIR/keeper.log, which the run leaves behind (the tests themselves see refused connections).

DIR is per run: pytest-xdist gives its workers one id (PYTEST_XDIST_TESTRUNUID); a run without xdist is its own.
"""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from bench_io.s3_servers import RADOSGW_START_S, Radosgw, S3Endpoint, stop_on_signals
from trainer.elastic import alive as process_alive

REPO = Path(__file__).resolve().parents[1]
ENDPOINT = "endpoint.json"
CLIENTS = "clients"
POLL_S = 0.5
UNCLAIMED_S = 120  # a keeper whose cluster nobody registered for this long stops (its starter died while waiting)


def run_dir() -> Path:
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID") or f"pid{os.getpid()}"
    return Path(tempfile.gettempdir()) / f"ucp-test-radosgw-{run}"  # (not a cluster's CLUSTER_PREFIX)


@contextmanager
def _locked(directory: Path) -> Iterator[None]:
    with open(directory / "lock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _served(directory: Path) -> S3Endpoint | None:
    """The endpoint of the run's keeper, if one is serving."""
    try:
        doc = json.loads((directory / ENDPOINT).read_text())
    except (OSError, ValueError):
        return None
    return S3Endpoint.from_json(doc["endpoint"]) if process_alive(doc["keeper"]) else None


@contextmanager
def shared_radosgw() -> Iterator[S3Endpoint]:
    """The run's radosgw (started if no worker has yet), registered for as long as the context lasts. A RuntimeError
    says why it could not start."""
    directory = run_dir()
    (directory / CLIENTS).mkdir(parents=True, exist_ok=True)
    me = directory / CLIENTS / str(os.getpid())
    with _locked(directory):
        endpoint = _served(directory)
        if endpoint is None:
            endpoint = _start_keeper(directory)
        me.touch()
    try:
        yield endpoint
    finally:
        me.unlink(missing_ok=True)


def _start_keeper(directory: Path) -> S3Endpoint:
    """Start the keeper (in a session of its own: an interrupted test run stops it through its workers' exits, never
    half-way through its start) and wait for its endpoint."""
    (directory / ENDPOINT).unlink(missing_ok=True)
    log = directory / "keeper.log"
    with open(log, "wb") as out:
        keeper = subprocess.Popen(
            [sys.executable, "-m", "tests.radosgw", str(directory)],
            cwd=REPO,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=out,
            start_new_session=True,
        )
    deadline = time.monotonic() + RADOSGW_START_S + 30
    while (endpoint := _served(directory)) is None:
        if keeper.poll() is not None or time.monotonic() > deadline:
            if keeper.poll() is None:
                keeper.kill()
            lines = log.read_text(errors="replace").strip().splitlines()
            raise RuntimeError(f"radosgw did not start: {lines[-1] if lines else 'no output'}")
        time.sleep(0.1)
    return endpoint


def keep(directory: Path) -> None:
    """The keeper: start the cluster, publish its endpoint, serve while a registered worker lives."""
    stop = stop_on_signals()
    server = Radosgw()
    try:
        doc = {
            "endpoint": server.endpoint.to_json(),
            "keeper": os.getpid(),
            "daemons": server.pids,
            "dir": str(server.dir),
        }
        (directory / f"{ENDPOINT}.tmp").write_text(json.dumps(doc))
        os.replace(directory / f"{ENDPOINT}.tmp", directory / ENDPOINT)
        ready, claimed, told = time.monotonic(), False, False
        while not stop.wait(POLL_S):
            if not told and (gone := server.exited()) is not None:
                # (the tests then fail on a refused connection: keeper.log, kept after the run, says why)
                print(f"the cluster broke while serving: {gone}", file=sys.stderr, flush=True)
                told = True
            with _locked(directory):
                clients = list((directory / CLIENTS).iterdir())
                for client in clients:
                    if not process_alive(int(client.name)):
                        client.unlink(missing_ok=True)
                alive = any(c.exists() for c in clients)
                claimed = claimed or alive
                if not alive and (claimed or time.monotonic() - ready > UNCLAIMED_S):
                    (directory / ENDPOINT).unlink(missing_ok=True)  # (under the lock: a worker now starts a new one)
                    break
    finally:
        server.close()


if __name__ == "__main__":
    keep(Path(sys.argv[1]))
