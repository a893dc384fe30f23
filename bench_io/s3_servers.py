"""The S3 servers the benchmarks and the tests start on 127.0.0.1: moto's (a Python mock that runs anywhere) and Ceph's
radosgw (a real implementation, where Debian's packages are installed: `apt-get install -y radosgw ceph-mon
ceph-osd`), each an `S3Server` whose `endpoint` says where it listens and with which keys.

`Radosgw` is a throwaway one-node RADOS cluster in a temporary directory: one ceph-mon and one bluestore ceph-osd on a
sparse file, no mgr, no cephx (`auth ... required = none`), pools of size 1, and radosgw's beast frontend on a port of
its own, with a user whose keys it makes (and a second user, a stranger to the first one's buckets). It starts in
15-30 s on 2 cores and holds about 0.5 GiB of memory. Every daemon is its child, started with a parent-death
signal (SIGKILL), and `close` kills each by its PID and removes the directory, so nothing outlives the process that
started it. Debian 12's Ceph (16, "pacific") has no standalone backend: radosgw needs the cluster.

    python -m bench_io.s3_servers [radosgw|moto]    # serve one in the foreground, its endpoint and keys on stdout
"""

from __future__ import annotations

import json
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol, Self

from trainer.elastic import alive as process_alive
from trainer.launch import free_port

RADOSGW_PACKAGES = ("radosgw", "ceph-mon", "ceph-osd")
RADOSGW_INSTALL = f"apt-get install -y {' '.join(RADOSGW_PACKAGES)}"
RADOSGW_COMMANDS = ("monmaptool", "ceph-mon", "ceph-osd", "ceph", "radosgw", "radosgw-admin", "setpriv")
S3_SERVERS = ("moto", "radosgw")
RADOSGW_START_S = 240  # at most, on a busy machine (15-30 s on 2 idle cores)


@dataclass(frozen=True)
class S3Endpoint:
    """Where an S3 server listens, and the keys of its user (and of a `stranger`, a second user who owns none of the
    first one's buckets; moto takes any keys and checks none)."""

    server: str  # "moto" | "radosgw"
    url: str
    key: str
    secret: str
    stranger_key: str | None = None
    stranger_secret: str | None = None

    @property
    def storage_options(self) -> dict[str, str]:
        """s3fs's arguments for this endpoint and its user (ucp's `storage_options`)."""
        return {"endpoint_url": self.url, "key": self.key, "secret": self.secret}

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> S3Endpoint:
        return cls(**doc)


class S3Server(Protocol):
    endpoint: S3Endpoint

    def close(self) -> None: ...


def radosgw_missing() -> str | None:
    """One line saying why radosgw cannot run here (its commands are not installed), or None."""
    missing = [c for c in RADOSGW_COMMANDS if shutil.which(c) is None]
    if not missing:
        return None
    return f"radosgw is not installed (no {', '.join(missing)}): {RADOSGW_INSTALL} (Debian 12's Ceph 16)"


def s3_server_version(name: str) -> str:
    """The version of a server kind as installed here ("16.2.15" for radosgw, moto's package version), or "?"."""
    try:
        if name == "radosgw":
            out = subprocess.run(["radosgw", "--version"], capture_output=True, text=True, timeout=30, check=False)
            words = out.stdout.split()
            return words[words.index("version") + 1] if "version" in words else "?"
        from importlib.metadata import version

        return version(name)
    except (OSError, ValueError, subprocess.SubprocessError):
        return "?"


def start_s3_server(name: str) -> S3Server:
    """A server of kind `name` (S3_SERVERS), started and answering."""
    if name == "moto":
        return MotoServer()
    if name == "radosgw":
        return Radosgw()
    raise ValueError(f"no S3 server {name!r}: one of {', '.join(S3_SERVERS)}")


def _wait_for_port(port: int, alive: Any, deadline: float, what: str) -> None:
    """Until something listens on 127.0.0.1:`port`; `alive()` raises if the server has died meanwhile."""
    while True:
        alive()
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{what} did not listen on 127.0.0.1:{port} in time") from None
            time.sleep(0.05)


class MotoServer:
    """moto's S3 server as a subprocess on 127.0.0.1 (not a thread: it would share our GIL). It takes any keys."""

    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.endpoint = S3Endpoint("moto", self.url, "testing", "testing")
        exe = Path(sys.executable).with_name("moto_server")
        cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "moto.server"]
        self.proc = subprocess.Popen(
            [*cmd, "-H", "127.0.0.1", "-p", str(self.port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )

        def alive() -> None:
            if self.proc.poll() is not None:
                raise RuntimeError(f"moto_server exited with {self.proc.returncode}")

        try:
            _wait_for_port(self.port, alive, time.monotonic() + 30, "moto_server")
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


# A daemon gets SIGKILL when the process that started it dies (PR_SET_PDEATHSIG, set by util-linux's setpriv before
# it execs the daemon), so that a killed test run or benchmark leaves no Ceph daemon behind. (The signal comes when
# the starting thread exits: start a cluster from a thread that outlives it, such as the main thread.)
DIE_WITH_PARENT = ("setpriv", "--pdeathsig", "KILL", "--")


# The config that runs on one host, on loopback, with no keys between the daemons. Without `auth client required =
# none` and `ms mon client mode = crc` radosgw loops on "get_initial_auth_request returned -13". The logs are
# quiet (radosgw logs every request at its default level, a cost in a benchmark), and radosgw's garbage collection
# of deleted objects' tails runs at once rather than after 2 hours, so a long benchmark does not fill the OSD. The
# monitor's check of the free space on its disk is off (`mon data avail crit = 0`): by default it refuses to start
# below 5% free, a share of the disk that says nothing of the ~1 GiB this cluster needs (it refused with 12 GiB free).
CEPH_CONF = """\
[global]
fsid = {fsid}
mon host = v2:127.0.0.1:{mon_port}
mon initial members = a
auth cluster required = none
auth service required = none
auth client required = none
ms mon client mode = crc
osd pool default size = 1
osd pool default min size = 1
osd pool default pg num = 8
osd pool default pgp num = 8
mon max pg per osd = 1000
mon allow pool size one = true
mon warn on pool no redundancy = false
mon data avail crit = 0
mon data avail warn = 0
osd objectstore = bluestore
bluestore block create = true
bluestore block size = {block_bytes}
osd memory target = 939524096
osd data = {dir}/osd.$id
mon data = {dir}/mon.$id
run dir = {dir}/run
admin socket = {dir}/run/$name.asok
pid file = {dir}/run/$name.pid
log file = {dir}/$name.log
keyring = {dir}/keyring
debug ms = 0/0
debug mon = 0/0
debug osd = 0/0
debug bluestore = 0/0
debug rgw = 0/0
[client.rgw.a]
rgw frontends = beast endpoint=127.0.0.1:{rgw_port}
rgw data = {dir}/rgw
rgw enable ops log = false
rgw enable usage log = false
rgw gc obj min wait = 0
rgw gc processor period = 10
"""
OSD_BLOCK_BYTES = 64 << 30  # a sparse file: the disk holds only what is written (and not yet freed)
CLUSTER_PREFIX = "ucp-radosgw-"
STALE_AFTER_S = 600


def remove_stale_clusters(parent: Path) -> None:
    """Remove the directories of clusters whose starter was killed before it could (its daemons died with it: none
    of the PIDs in their pid files lives), once they are old enough not to be one that is starting now. Only a
    cluster's own directory (its ceph.conf in it) is removed: another directory whose name starts alike is not
    ours to judge (a test run's keeper directory once was, and its live cluster went with it)."""
    for old in parent.glob(f"{CLUSTER_PREFIX}*"):
        try:
            if not (old / "ceph.conf").is_file() or time.time() - old.stat().st_mtime < STALE_AFTER_S:
                continue
            pids = [int(p.read_text().strip() or 0) for p in (old / "run").glob("*.pid")]
        except (OSError, ValueError):
            continue
        if not any(process_alive(pid) for pid in pids if pid > 0):
            shutil.rmtree(old, ignore_errors=True)


class Radosgw:
    """A one-node Ceph cluster with radosgw on 127.0.0.1 ports of its own, in a temporary directory under `parent`
    (the system's default), serving once constructed; `close()` kills every daemon by PID and removes the directory.
    A RuntimeError says what failed (with the end of the failing daemon's log) if it cannot start."""

    def __init__(self, parent: str | None = None, timeout_s: float = RADOSGW_START_S) -> None:
        missing = radosgw_missing()
        if missing:
            raise RuntimeError(missing)
        remove_stale_clusters(Path(parent or tempfile.gettempdir()))
        self.dir = Path(tempfile.mkdtemp(prefix=CLUSTER_PREFIX, dir=parent))
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.conf = self.dir / "ceph.conf"
        self.mon_port, self.rgw_port = free_port(), free_port()
        while self.rgw_port == self.mon_port:
            self.rgw_port = free_port()
        try:
            self._start(time.monotonic() + timeout_s)
        except BaseException:
            self.close()
            raise

    @property
    def pids(self) -> dict[str, int]:
        return {name: p.pid for name, p in self.procs.items()}

    def _start(self, deadline: float) -> None:
        for sub in ("run", "mon.a", "osd.0", "rgw"):
            (self.dir / sub).mkdir()
        fsid = str(uuid.uuid4())
        self.conf.write_text(
            CEPH_CONF.format(
                fsid=fsid,
                mon_port=self.mon_port,
                rgw_port=self.rgw_port,
                dir=self.dir,
                block_bytes=OSD_BLOCK_BYTES,
            )
        )
        conf = ["-c", str(self.conf)]
        self._run(deadline, "monmaptool", "--create", "--fsid", fsid, "--addv", "a", f"[v2:127.0.0.1:{self.mon_port}]",
                  str(self.dir / "monmap"))  # fmt: skip
        self._run(deadline, "ceph-mon", *conf, "--mkfs", "-i", "a", "--monmap", str(self.dir / "monmap"))
        self._spawn("ceph-mon", "ceph-mon", *conf, "-i", "a", "-f")
        _wait_for_port(self.mon_port, self._alive, deadline, "ceph-mon")
        osd_uuid = str(uuid.uuid4())
        osd_id = self._run(deadline, "ceph", *conf, "--connect-timeout", "60", "osd", "new", osd_uuid).strip()
        self._run(deadline, "ceph-osd", *conf, "-i", osd_id, "--mkfs", "--osd-uuid", osd_uuid)
        self._spawn("ceph-osd", "ceph-osd", *conf, "-i", osd_id, "-f")
        self._spawn("radosgw", "radosgw", *conf, "-n", "client.rgw.a", "-f")
        _wait_for_port(self.rgw_port, self._alive, deadline, "radosgw")
        self._wait_for_s3(deadline)
        users = [self._user(deadline, uid) for uid in ("ucp", "stranger")]
        self.endpoint = S3Endpoint(
            "radosgw", f"http://127.0.0.1:{self.rgw_port}", *users[0], stranger_key=users[1][0],
            stranger_secret=users[1][1],
        )  # fmt: skip

    def _run(self, deadline: float, *cmd: str) -> str:
        """Run a setup command to its end (within the deadline); its stdout. A failure names it, with its output."""
        try:
            out = subprocess.run(
                cmd, capture_output=True, text=True, timeout=max(1.0, deadline - time.monotonic()), check=False
            )
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"radosgw setup: {' '.join(cmd[:4])} ... did not finish in time") from None
        if out.returncode != 0:
            tail = (out.stderr or out.stdout).strip().splitlines()[-3:]
            raise RuntimeError(f"radosgw setup: {cmd[0]} failed ({out.returncode}): {' | '.join(tail)}")
        return out.stdout

    def _spawn(self, name: str, *cmd: str) -> None:
        """Start a daemon in the foreground (-f), a child of this process that dies with it."""
        with open(self.dir / f"{name}.stderr", "wb") as stderr:
            self.procs[name] = subprocess.Popen(
                [*DIE_WITH_PARENT, *cmd], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=stderr
            )

    def exited(self) -> str | None:
        """The daemon that has exited, its exit status (negative: the signal that killed it) and the end of its log;
        None while every one runs."""
        for name, proc in self.procs.items():
            if proc.poll() is not None:
                logs = sorted(self.dir.glob(f"{name.replace('ceph-', '')}*.log")) + [self.dir / f"{name}.stderr"]
                tail = " | ".join(
                    line for log in logs if log.exists() for line in log.read_text(errors="replace").splitlines()[-3:]
                )
                return f"{name} exited with {proc.returncode}: {tail[-600:]}"
        return None

    def _alive(self) -> None:
        """Raise naming the daemon that has exited, with the end of its log."""
        gone = self.exited()
        if gone is not None:
            raise RuntimeError(f"while starting, {gone}")

    def _wait_for_s3(self, deadline: float) -> None:
        """Until radosgw answers an anonymous bucket listing (it listens before its pools exist)."""
        import http.client

        while True:
            self._alive()
            try:
                conn = http.client.HTTPConnection("127.0.0.1", self.rgw_port, timeout=5)
                conn.request("GET", "/")
                if conn.getresponse().status == 200:
                    return
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("radosgw did not answer S3 requests in time")
            time.sleep(0.2)

    def _user(self, deadline: float, uid: str) -> tuple[str, str]:
        """Create a radosgw user; its access key and secret."""
        key, secret = f"{uid}-{secrets.token_hex(8)}", secrets.token_hex(20)
        self._run(deadline, "radosgw-admin", "-c", str(self.conf), "user", "create", "--uid", uid, "--display-name",
                  uid, "--access-key", key, "--secret", secret)  # fmt: skip
        return key, secret

    def close(self) -> None:
        """Kill every daemon by its PID (radosgw first, the monitor last) and remove the directory. Idempotent."""
        for proc in reversed(list(self.procs.values())):
            if proc.poll() is None:
                proc.kill()  # (a throwaway cluster: nothing to flush)
            proc.wait()
        self.procs.clear()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def main(argv: list[str] | None = None) -> int:
    """Serve one server in the foreground until SIGINT or SIGTERM: its endpoint and keys as one JSON line on stdout."""
    args = list(sys.argv[1:] if argv is None else argv)
    name = args[0] if args else "radosgw"
    server = start_s3_server(name)
    stop = stop_on_signals()
    try:
        print(json.dumps(server.endpoint.to_json()), flush=True)
        while not stop.wait(0.5):
            pass
    finally:
        server.close()
    return 0


def stop_on_signals() -> threading.Event:
    """An event that SIGTERM or SIGINT sets: a process serving a server ends its loop and closes the server (its
    daemons are killed by PID) rather than dying with them left running."""
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    return stop


if __name__ == "__main__":
    raise SystemExit(main())
