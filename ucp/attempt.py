"""Save attempts: every save of a step writes in a directory of its own, owned by the process that saves it.

A save attempt of step N writes only below `step_N/attempt-<32 hex digits>/` (a fresh random id), so no other
attempt (a racing job, a dead job's writer that is still draining) ever writes where it does, and a late write
can never reach a committed step: the commit marker names the one attempt it commits.

The first object of an attempt is its owner record, `ucp-attempt.json`: the saving process (host, boot id,
pid namespace, pid and its start time) and a lease (`renewed_at`, `lease_s`) that the owner renews every third
of the lease while the save runs. An uncommitted attempt is garbage, and `collect_garbage` removes it, when

- its step was committed by another attempt (it can never commit now), or
- its owner ran on this host (same host name, boot id and pid namespace) and that process is gone (no such
  pid, or the pid now belongs to a process that started at another time), or
- its lease ran out: `renewed_at + lease_s` is in the past by this host's clock (an owner on another host;
  this assumes clocks that agree to well within the lease, 5 minutes by default), or
- it has no owner record and nothing in it changed for `ORPHAN_GRACE_S` (writes that outlived their attempt's
  removal; an attempt being created shows its directory a moment before its record, hence the grace).

Anything else may be a save in progress and is left alone. A step directory with a damaged commit marker is
never touched.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from functools import lru_cache

from . import commit
from .errors import FormatError, NotAFileError
from .format import (
    ATTEMPT_RECORD,
    FORMAT_VERSION,
    MAX_MARKER_BYTES,
    dumps,
    is_attempt_dirname,
    loads,
    step_dirname,
)
from .storage import Storage

log = logging.getLogger("ucp")

DEFAULT_LEASE_S = float(os.environ.get("UCP_ATTEMPT_LEASE_S", "300"))
ORPHAN_GRACE_S = 60.0


def new_attempt_id() -> str:
    return f"attempt-{uuid.uuid4().hex}"


@lru_cache(maxsize=1)
def _this_host() -> tuple[str, str | None, int | None]:
    """(host name, boot id, pid namespace): what tells a process on this host from one elsewhere."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot_id: str | None = f.read().strip()
    except OSError:
        boot_id = None
    try:
        pid_ns: int | None = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        pid_ns = None
    return socket.gethostname(), boot_id, pid_ns


def process_start(pid: int) -> int | None:
    """When process `pid` started (clock ticks after boot, /proc/PID/stat field 22), or None if there is none."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    try:
        return int(stat[stat.rindex(b")") + 2 :].split()[19])
    except (ValueError, IndexError):
        return None


@dataclass(frozen=True)
class OwnerRecord:
    """Who saves an attempt, and until when they have promised to renew it."""

    step: int
    attempt: str
    host: str
    boot_id: str | None
    pid_ns: int | None
    pid: int
    pid_start: int | None
    started_at: str
    renewed_at: float
    lease_s: float
    format_version: str = FORMAT_VERSION

    @classmethod
    def mine(cls, step: int, attempt: str, lease_s: float) -> OwnerRecord:
        host, boot_id, pid_ns = _this_host()
        pid = os.getpid()
        return cls(
            step,
            attempt,
            host,
            boot_id,
            pid_ns,
            pid,
            process_start(pid),
            datetime.now(UTC).isoformat(timespec="seconds"),
            time.time(),
            lease_s,
        )

    @classmethod
    def parse(cls, data: bytes | memoryview, where: str) -> OwnerRecord:
        doc = loads(data, where, MAX_MARKER_BYTES)
        try:
            record = cls(**{k: doc[k] for k in cls.__dataclass_fields__})
        except (KeyError, TypeError) as e:
            raise FormatError(f"{where} is not an attempt owner record ({e!r})") from None
        numbers_ok = all(
            isinstance(v, (int, float)) and not isinstance(v, bool) for v in (record.renewed_at, record.lease_s)
        )
        if not numbers_ok or not isinstance(record.pid, int) or not isinstance(record.host, str):
            raise FormatError(f"{where} is not an attempt owner record (mistyped fields)")
        return record

    def is_dead(self, now: float) -> bool:
        host, boot_id, pid_ns = _this_host()
        if (self.host, self.boot_id, self.pid_ns) == (host, boot_id, pid_ns) and boot_id is not None:
            started = process_start(self.pid)
            return started is None or (self.pid_start is not None and started != self.pid_start)
        return now > self.renewed_at + self.lease_s


def record_key(step: int, attempt: str) -> str:
    return f"{step_dirname(step)}/{attempt}/{ATTEMPT_RECORD}"


def write_owner(storage: Storage, record: OwnerRecord) -> None:
    storage.write(record_key(record.step, record.attempt), [dumps(asdict(record))])


class Lease:
    """Renews an attempt's owner record every third of its lease while its save runs (a daemon thread)."""

    def __init__(self, storage: Storage, record: OwnerRecord):
        self.storage, self.record = storage, record
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ucp-lease", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.record.lease_s / 3):
            try:
                write_owner(self.storage, OwnerRecord(**{**asdict(self.record), "renewed_at": time.time()}))
            except Exception as e:  # noqa: BLE001 -- the save itself reports storage failures; keep trying
                log.warning("could not renew the lease of %s step %d: %s", self.record.attempt, self.record.step, e)

    def stop(self) -> None:
        """Stop renewing, and wait for a renewal in flight: one that landed after the attempt was removed (or
        committed) would write into it again."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join()


def _attempt_is_dead(storage: Storage, step: int, attempt: str, now: float) -> bool:
    key = record_key(step, attempt)
    try:
        owner = OwnerRecord.parse(storage.read(key, 0, MAX_MARKER_BYTES + 1), f"{storage.url}/{key}")
    except FileNotFoundError:
        changed = storage.mtime(f"{step_dirname(step)}/{attempt}")
        return changed is None or now - changed > ORPHAN_GRACE_S
    except (FormatError, NotAFileError) as e:  # (damaged, or reached through a link: an operator's case)
        log.warning("%s; its attempt is left alone", e)
        return False
    return owner.is_dead(now)


def _is_stray_temp(name: str) -> bool:
    return name.startswith(".") and name.endswith(".tmp")  # an exclusive create's temporary file (a crash's)


def collect_garbage(storage: Storage, *, now: float | None = None) -> list[str]:
    """Remove every attempt that no live saver owns (module docstring), and the leftovers of interrupted format 1.0
    saves below the latest commit. Returns what was removed, as keys below the root."""
    now = time.time() if now is None else now
    removed: list[str] = []
    steps = commit.step_dirs(storage)
    latest = max(commit.committed_steps(storage), default=None)
    for step in steps:
        try:
            record = commit.read_marker(storage, step)
        except FormatError:
            continue  # damaged: an operator's case, never ours to delete
        step_dir = step_dirname(step)
        try:
            names = storage.listdir(step_dir)
        except NotAFileError as e:  # a step directory replaced by a link: an operator's case too
            log.warning("left %s/%s alone: %s", storage.url, step_dir, e)
            continue
        for name in names:
            key = f"{step_dir}/{name}"
            if is_attempt_dirname(name):
                if record is not None and name == record.attempt:
                    continue
                if record is None and not _attempt_is_dead(storage, step, name, now):
                    continue
            elif _is_stray_temp(name):
                if now - (storage.mtime(key) or 0) <= ORPHAN_GRACE_S:
                    continue
            elif record is not None or latest is None or step >= latest:
                continue  # a 1.0 step's contents: only an uncommitted one below the latest commit is a leftover
            storage.delete(key)
            removed.append(key)
            log.info("removed %s/%s: no live save owns it", storage.url, key)
        if record is None and removed and removed[-1].startswith(step_dir + "/"):
            storage.remove_empty_dir(step_dir)
    return removed
