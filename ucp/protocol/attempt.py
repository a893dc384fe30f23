"""Save attempts: every save of a step writes in a directory of its own, owned by the process that saves it.

A save attempt of step N writes only below `step_N/attempt-<32 hex digits>/` (a fresh random id), so no other
attempt (a racing job, a dead job's writer that is still draining) ever writes where it does, and a late write
can never reach a committed step: the commit marker names the one attempt it commits.

The first object of an attempt is its owner record, `ucp-attempt.json`: the saving process (host, boot id,
pid namespace, pid and its start time) and a lease (`renewed_at`, `lease_s`) that the owner renews every third
of the lease while the save runs. An uncommitted attempt is garbage, and `collect_garbage` removes it, when no live process can still be saving it:

- its owner ran on this host (same host name, boot id and pid namespace) and that process is gone (no such
  pid, or the pid now belongs to a process that started at another time), or
- its owner ran elsewhere and its lease ran out: the store last saw the owner record written (its modification
  time, which the store stamps) more than `lease_s` ago by the store's own clock (`Storage.clock`). No host's clock
  takes part: a host whose clock is wrong by any amount neither loses a live save nor keeps a dead one, or
- it has no owner record (or an empty one: its first write cut short by a crash) and nothing in it changed for
  `ORPHAN_GRACE_S` by the store's clock (writes that outlived their attempt's removal; an attempt being created shows
  its directory a moment before its record).

An uncommitted step directory left empty (a process killed between removing an attempt and its step's directory) is
removed once nothing in it changed for `ORPHAN_GRACE_S` too.

An attempt of a step that another attempt committed is removed only once its owner is gone too: a live loser of
a race is still writing into it, and removes it itself when its commit is refused. The attempt that a commit
marker names is never removed (only `delete_step`, retention's, which removes the marker first, does that; it too
leaves alone an attempt whose owner may still be saving: another job's save of the same step). A step directory
with a damaged commit marker is never touched.

A saver that cannot renew its lease (a host cut off from the store) may have its attempt removed once the lease
has run out; so it never commits after its own clock says that its last renewal is more than `lease_s` old, less a
margin (`Lease.expired`): no marker names an attempt that gc may have removed, as long as the two clocks run at
about the same rate (their offsets do not matter).
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

from ..errors import FormatError, NotAFileError, StorageError
from ..format.manifest import (
    ATTEMPT_RECORD,
    FORMAT_VERSION,
    MAX_MARKER_BYTES,
    dumps,
    is_attempt_dirname,
    loads,
    step_dirname,
)
from ..storage import Storage
from . import commit

log = logging.getLogger("ucp")

DEFAULT_LEASE_S = float(os.environ.get("UCP_ATTEMPT_LEASE_S", "300"))
ORPHAN_GRACE_S = 60.0
LEASE_MARGIN_S = 30.0  # a save stops short of committing this long before its lease could run out (at most)


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

    def is_dead(self, renewed: float, now: float) -> bool:
        """Whether the owner can no longer be saving: gone from this host, or (elsewhere) its lease ran out, with
        `renewed` when the store last saw this record written and `now` the store's time (module doc)."""
        host, boot_id, pid_ns = _this_host()
        if (self.host, self.boot_id, self.pid_ns) == (host, boot_id, pid_ns) and boot_id is not None:
            started = process_start(self.pid)
            return started is None or (self.pid_start is not None and started != self.pid_start)
        return now > renewed + self.lease_s


def record_key(step: int, attempt: str) -> str:
    return f"{step_dirname(step)}/{attempt}/{ATTEMPT_RECORD}"


def remove(storage: Storage, step: int, attempt: str) -> None:
    """Remove an attempt's directory, and its step's where that is left empty (the caller knows that no marker names
    the attempt)."""
    storage.delete(f"{step_dirname(step)}/{attempt}")
    storage.remove_empty_dir(step_dirname(step))


def write_owner(storage: Storage, record: OwnerRecord) -> None:
    storage.write(record_key(record.step, record.attempt), [dumps(asdict(record))])


class Lease:
    """An attempt's owner record, written when the attempt starts and renewed every third of its lease while the
    save runs (a daemon thread)."""

    def __init__(self, storage: Storage, record: OwnerRecord):
        self.storage, self.record = storage, record
        self._renewed = time.monotonic()  # (taken before the write: the store stamps the record later than this)
        write_owner(storage, record)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ucp-lease", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.record.lease_s / 3):
            sent = time.monotonic()
            try:
                write_owner(self.storage, OwnerRecord(**{**asdict(self.record), "renewed_at": time.time()}))
                self._renewed = sent
            except Exception as e:  # noqa: BLE001 -- the save itself reports storage failures; keep trying
                log.warning("could not renew the lease of %s step %d: %s", self.record.attempt, self.record.step, e)

    def expired(self) -> float | None:
        """How long ago, by this process's clock, the lease may have run out where gc judges it (None while it is
        safely held): a save must not commit then, since gc may have removed its attempt. The margin covers the
        commit's own request."""
        margin = min(LEASE_MARGIN_S, self.record.lease_s / 10)
        over = time.monotonic() - self._renewed - (self.record.lease_s - margin)
        return over if over > 0 else None

    def stop(self) -> None:
        """Stop renewing, and wait for a renewal in flight: one that landed after the attempt was removed (or
        committed) would write into it again."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join()


def _attempt_is_dead(storage: Storage, step: int, attempt: str, clock: _StoreClock) -> bool:
    key = record_key(step, attempt)
    try:
        raw = storage.read(key, 0, MAX_MARKER_BYTES + 1)
        if not len(raw):  # the record's first write cut short (its process killed, or its host, before the bytes
            raise FileNotFoundError(key)  # landed): no owner can be told from it, as from a missing record
        owner = OwnerRecord.parse(raw, f"{storage.url}/{key}")
    except FileNotFoundError:
        changed = storage.newest_mtime(f"{step_dirname(step)}/{attempt}")
        return changed is None or clock.now() - changed > ORPHAN_GRACE_S
    except (FormatError, NotAFileError) as e:  # (damaged, or reached through a link: an operator's case)
        log.warning("%s; its attempt is left alone", e)
        return False
    renewed = storage.mtime(key)
    if renewed is None:  # (a store that keeps no modification times: the owner's own clock is all there is)
        return owner.is_dead(owner.renewed_at, time.time())
    return owner.is_dead(renewed, clock.now())


class _StoreClock:
    """The store's time, asked for once per collection and only if needed (it costs a write)."""

    def __init__(self, storage: Storage, now: float | None):
        self.storage, self._now = storage, now

    def now(self) -> float:
        if self._now is None:
            self._now = self.storage.clock()
        return self._now


def _is_stray_temp(name: str) -> bool:
    return name.startswith(".") and name.endswith(".tmp")  # an exclusive create's temporary file (a crash's)


def collect_garbage(storage: Storage, *, now: float | None = None) -> list[str]:
    """Remove every attempt that no live saver owns (module docstring), and the leftovers of interrupted format 1.0
    saves below the latest commit. `now`: the store's time, if the caller knows it (tests). Returns what was
    removed, as keys below the root."""
    clock = _StoreClock(storage, now)
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
                    continue  # the committed attempt
                if not _attempt_is_dead(storage, step, name, clock):
                    continue  # (a live loser of a race removes its attempt itself)
                if _named_by_marker(storage, step, name):
                    continue  # committed meanwhile
            elif _is_stray_temp(name):
                if clock.now() - (storage.mtime(key) or 0) <= ORPHAN_GRACE_S:
                    continue
            elif record is not None or latest is None or step >= latest:
                continue  # a 1.0 step's contents: only an uncommitted one below the latest commit is a leftover
            storage.delete(key)
            removed.append(key)
            log.info("removed %s/%s: no live save owns it", storage.url, key)
        if record is None and removed and removed[-1].startswith(step_dir + "/"):
            storage.remove_empty_dir(step_dir)
        elif record is None and not names and _is_stale_empty_dir(storage, step_dir, clock):
            # (a process killed between removing a step's last attempt and its directory: a failed save's removal,
            # gc's, retention's; nothing else ever removed it)
            storage.remove_empty_dir(step_dir)
            if not storage.exists(step_dir):
                removed.append(step_dir)
                log.info("removed %s/%s: an empty step directory", storage.url, step_dir)
    return removed


def _is_stale_empty_dir(storage: Storage, step_dir: str, clock: _StoreClock) -> bool:
    """Whether an empty step directory has stayed unchanged for ORPHAN_GRACE_S (a save that is starting makes it a
    moment before its attempt's directory). Only where the store keeps directories with times (local files)."""
    made = storage.mtime(step_dir)
    return made is not None and clock.now() - made > ORPHAN_GRACE_S


def delete_step(storage: Storage, step: int, *, now: float | None = None) -> None:
    """Remove a committed step (retention): the marker first, so it is never visible half-deleted, then everything
    under the step's directory but an attempt that a live process may still be saving (another job's save of the
    same step: removed, its writes would go on into nothing and its commit would name objects that are gone)."""
    clock = _StoreClock(storage, now)
    record = commit.read_marker(storage, step)
    storage.delete(commit.marker_key(step))
    storage.flush()
    step_dir = step_dirname(step)
    kept = False
    for name in storage.listdir(step_dir):
        live = (
            is_attempt_dirname(name)
            and (record is None or name != record.attempt)
            and not _attempt_is_dead(storage, step, name, clock)
        )
        if live:
            kept = True
            log.info("kept %s/%s/%s: a save of it may still run", storage.url, step_dir, name)
        else:
            storage.delete(f"{step_dir}/{name}")
    if not kept:
        storage.delete(step_dir)


def _named_by_marker(storage: Storage, step: int, attempt: str) -> bool:
    """Whether the step's commit marker names `attempt` now (an unreadable marker counts as naming it: nothing is
    removed on a guess)."""
    try:
        record = commit.read_marker(storage, step)
    except (FormatError, StorageError):
        return True
    return record is not None and record.attempt == attempt
