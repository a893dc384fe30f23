"""One save attempt from its start to its commit: the protocol that every save path runs.

1. `SaveSession.begin` (the coordinator, rank 0): refuse a committed step (StepExistsError), make the root a
   Zarr group, create the attempt's directory with its owner record (`ucp.attempt`; its lease is renewed while
   the save runs); every rank learns the attempt id.
2. Every process writes its objects below `session.prefix` and `record`s each object's size and checksum.
3. Every process makes its writes durable.
4. `finish`: the records, or a process's failure, go to the coordinator; it writes the manifest (every object's
   size and checksum in it), makes it durable and creates the commit marker exclusively (`ucp.commit`). Every
   rank learns the outcome and returns the commit record (rank 0) or raises the same error. After a commit the
   `after_commit` hooks run on every rank, with the record on the coordinator and None elsewhere (the manager's
   retention; the hot tier's replication and drain, `ucp.tiers`).
5. On any failure before the commit, the coordinator removes the attempt's directory, freeing its space: there
   is one failure policy for every save path. (A process killed outright leaves its attempt to `collect_garbage`.)

Single-process saves, `VirtualWorld`, the interop streams and `CheckpointManager` all run through here, with a
`LocalComm`; a distributed save passes its `TorchComm`.
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from collections.abc import Callable
from typing import Any, NoReturn, Self

from . import attempt, commit
from .comm import Comm, LocalComm
from .errors import StepExistsError, StorageError, UcpError, error_kind
from .format import (
    FORMAT_VERSION,
    ZARR_JSON,
    AtomMeta,
    ObjectSum,
    PackedChunk,
    StepManifest,
    check_step,
    chunk_indices,
    dumps,
)
from .packs import Pack, pack_name, pack_object_key
from .storage import CLOCK_KEY, Storage, writable

log = logging.getLogger("ucp")


def ensure_root(storage: Storage) -> None:
    """Make the root a Zarr group that says what it is (created once, by whichever save comes first)."""
    if storage.exists(ZARR_JSON):
        return
    doc = {
        "zarr_format": 3,
        "node_type": "group",
        "attributes": {"ucp": {"kind": "root", "format_version": FORMAT_VERSION}},
    }
    try:
        storage.create_exclusive(ZARR_JSON, dumps(doc))
    except FileExistsError:
        pass  # another save made it meanwhile


def remove_unused_root(storage: Storage) -> None:
    """Undo what a failed first save left in a root that it found empty: the root's group document (and on local
    files the directory, if that leaves it empty). A root that holds any step is left as it is."""
    names = set(storage.listdir(""))
    if names - {ZARR_JSON, CLOCK_KEY}:
        return
    for name in names:
        storage.delete(name)
    storage.remove_empty_dir("")


class SaveSession:
    """One attempt at saving `step` under `storage`, shared by every process of the save (see the module doc)."""

    def __init__(self, storage: Storage, step: int, attempt_id: str, comm: Comm, lease: attempt.Lease | None):
        self.storage, self.step, self.attempt, self.comm = storage, step, attempt_id, comm
        self.prefix = f"{commit.step_dirname(step)}/{attempt_id}"
        self.after_commit: list[Callable[[commit.CommitRecord | None], None]] = []
        # What failed after the commit (retention, gc, the hot tier's drain): logged and kept here, never raised
        self.after_commit_errors: list[Exception] = []
        self._lease = lease
        self._objects: dict[str, ObjectSum] = {}
        # packed chunks: atom path -> [[chunk number (C order over its grid), *PackedChunk.to_json()], ...]
        self._packed: dict[str, list[list]] = {}
        self._packs = 0
        self._lock = threading.Lock()
        self._ended = False
        self._cancelled = False
        self._started = time.perf_counter()
        if self.is_coordinator:
            log.info("saving step %d at %s (%s)", step, storage.url, attempt_id)

    @property
    def is_coordinator(self) -> bool:
        return self.comm.rank == 0

    @classmethod
    def begin(
        cls, storage: Storage, step: int, comm: Comm | None = None, *, lease_s: float | None = None
    ) -> SaveSession:
        """Start an attempt at `step` (every rank calls this together)."""
        comm = comm or LocalComm()
        message: dict = {}
        lease = None
        if comm.rank == 0:
            try:
                check_step(step)
                writable(storage, f"save step {step}")  # (mypy refuses a read-only store here; this, at run time)
                if commit.read_marker(storage, step) is not None:
                    raise StepExistsError(
                        f"step {step} is already committed at {storage.url}; committed steps are never overwritten"
                    )
                ensure_root(storage)
                record = attempt.OwnerRecord.mine(step, attempt.new_attempt_id(), lease_s or attempt.DEFAULT_LEASE_S)
                lease = attempt.Lease(storage, record)  # (writes the owner record first)
                message = {"attempt": record.attempt}
            except BaseException as e:
                if comm.world_size == 1:
                    raise
                message = _describe(e)  # every rank raises it, below
        if comm.world_size > 1:
            message = json.loads(comm.broadcast_bytes(dumps(message) if comm.rank == 0 else None))
        if "attempt" not in message:
            _raise(message)
        return cls(storage, step, message["attempt"], comm, lease)

    # -- what the writers call

    def record(self, key: str, nbytes: int, crc: int) -> None:
        """An object this process wrote (`key` below the root) and its size and checksum."""
        with self._lock:
            self._objects[key] = (nbytes, crc)

    def new_pack_name(self) -> str:
        """A name for a pack this process writes in this attempt (no other process or pack takes it)."""
        with self._lock:
            self._packs += 1
            return pack_name(self.comm.rank, self._packs - 1)

    def record_pack(self, pack: Pack, nbytes: int, crc: int, member_crcs: list[int]) -> None:
        """A pack this process wrote (its object's size and checksum) and the checksum of each chunk it holds."""
        key = pack.key(self.prefix)
        with self._lock:
            self._objects[key] = (nbytes, crc)
            for m, member_crc in zip(pack.members, member_crcs, strict=True):
                number = m.meta.object_number(m.index)
                self._packed.setdefault(m.meta.path, []).append([number, pack.name, m.offset, m.nbytes, member_crc])

    def record_packed(self, path: str, chunks: list[list]) -> None:
        """Where packed chunks of atom `path` lie: [chunk number, *PackedChunk.to_json()] each (as `packed` gives)."""
        with self._lock:
            self._packed.setdefault(path, []).extend(chunks)

    @property
    def packed(self) -> dict[str, list[list]]:
        """The packed chunks this process wrote in this attempt, by atom path: [chunk number, pack, offset, nbytes,
        crc32c] each."""
        with self._lock:
            return {path: list(chunks) for path, chunks in self._packed.items()}

    @property
    def objects(self) -> dict[str, ObjectSum]:
        """The chunk objects this process wrote in this attempt, with their sizes and checksums."""
        with self._lock:
            return dict(self._objects)

    # -- the end

    def finish(self, manifest: StepManifest | None, error: BaseException | None = None) -> commit.CommitRecord | None:
        """Steps 4 and 5 of the protocol (module doc): every rank calls this once, with this process's failure if
        it had one; `manifest` (without objects) is the coordinator's. Returns the commit record on the
        coordinator, None elsewhere; raises on every rank if the step was not committed."""
        if self._ended:
            raise UcpError(f"the save attempt {self.attempt} of step {self.step} has already ended")
        self._ended = True
        try:
            outcome, record, failure = self._end(manifest, error)
        finally:
            self._stop_lease()
        if outcome:
            if self.comm.world_size == 1 and failure is not None and not isinstance(failure, (UcpError, OSError)):
                raise failure  # not a storage failure: a bug or an interrupt, as it was
            raise _as_error(outcome) from (error or failure)
        assert record is not None or not self.is_coordinator
        for hook in self.after_commit:
            try:
                hook(record)
            except Exception as e:  # noqa: BLE001 -- the step is committed: what follows cannot undo that
                self.after_commit_errors.append(e)
                log.error(
                    "step %d at %s is committed, but the work after its commit failed: %s",
                    self.step,
                    self.storage.url,
                    e,
                )
        return record

    def _end(
        self, manifest: StepManifest | None, error: BaseException | None
    ) -> tuple[dict, commit.CommitRecord | None, BaseException | None]:
        """Gather, commit or abort, and share the outcome ({} when committed)."""
        mine: dict[str, Any] = (
            {"failure": _describe(error)} if error is not None else {"objects": self._objects, "packed": self._packed}
        )
        gathered = [mine] if self.comm.world_size == 1 else self._gather(mine)
        outcome: dict = {}
        record = failure = None
        if self.is_coordinator:
            assert gathered is not None
            self._stop_lease()  # (every rank has written: what follows removes or commits the attempt)
            try:
                failed = {rank: g["failure"] for rank, g in enumerate(gathered) if "failure" in g}
                if failed:
                    failure = error if 0 in failed else None
                    raise _failed(failed, self)
                objects: dict[str, ObjectSum] = {}
                packed: dict[str, list[list]] = gathered[0]["packed"] if len(gathered) == 1 else {}
                for g in gathered:
                    objects.update({k: (v[0], v[1]) for k, v in g["objects"].items()})
                    if len(gathered) > 1:
                        for path, chunks in g["packed"].items():  # (a TP-split atom's chunks come from several ranks)
                            packed.setdefault(path, []).extend(chunks)
                assert manifest is not None, "the coordinator commits the manifest"
                if self._cancelled:
                    raise UcpError(f"the save of step {self.step} was abandoned by its process; not committed")
                self._check_lease()
                record = self._commit(manifest, objects, packed)
            except BaseException as e:  # noqa: BLE001 -- raised on every rank below, after the attempt is removed
                self._abort()
                failure = failure or e
                outcome = _describe(e)
        if self.comm.world_size > 1:
            outcome = json.loads(self.comm.broadcast_bytes(dumps(outcome) if self.is_coordinator else None))
        return outcome, record, failure

    def _check_lease(self) -> None:
        """Refuse to commit once the lease may have run out where gc judges it (`attempt.Lease.expired`)."""
        lease = self._lease
        expired = lease.expired() if lease is not None else None
        if lease is not None and expired is not None:
            raise StorageError(
                f"step {self.step} at {self.storage.url} was not committed: its attempt's lease could not be renewed "
                f"for {lease.record.lease_s + expired:.1f} s (the store unreachable?), so garbage collection may have "
                "removed the attempt"
            )

    def abort(self, error: BaseException) -> None:
        """End an attempt that failed before `finish` (single process only): remove what it wrote."""
        assert self.comm.world_size == 1, "a distributed save ends through finish(), which every rank calls"
        if not self._ended:
            self._ended = True
            self._stop_lease()
            self._abort()
            log.info("save attempt %s of step %d failed and was removed: %s", self.attempt, self.step, error)

    def cancel(self) -> None:
        """Never commit this attempt: its process abandoned it (the job lost a peer and goes on from the step it
        restores, which a late commit of this one would contradict). The coordinator checks just before it
        commits; an attempt cancelled after that check had committed before its job went on."""
        self._cancelled = True

    def __enter__(self) -> Self:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: object) -> None:
        if error is not None:
            self.abort(error)

    # -- internals

    def _gather(self, mine: dict) -> list[dict] | None:
        gathered = self.comm.gather_bytes(json.dumps(mine).encode())
        return None if gathered is None else [json.loads(g) for g in gathered]

    def _commit(
        self, manifest: StepManifest, objects: dict[str, ObjectSum], packed: dict[str, list[list]]
    ) -> commit.CommitRecord:
        atoms = manifest.atoms.items()
        manifest.objects = {path: self._object_sums(meta, objects) for path, meta in atoms if not meta.packed}
        manifest.packed = {path: self._packed_chunks(meta, packed) for path, meta in atoms if meta.packed}
        names = sorted({c.pack for chunks in manifest.packed.values() for c in chunks})
        manifest.packs = {name: objects[pack_object_key(self.prefix, name)] for name in names}
        manifest_bytes = dumps(manifest.to_group_json())
        self.storage.write(f"{self.prefix}/{ZARR_JSON}", [manifest_bytes])
        self.storage.flush()
        nbytes = sum(a.nbytes for a in manifest.atoms.values())
        record = commit.commit(self.storage, self.step, self.attempt, manifest_bytes, len(manifest.atoms), nbytes)
        log.info(
            "committed step %d at %s: %d atoms, %d bytes, %.2f s after its save began",
            self.step,
            self.storage.url,
            record.atoms,
            nbytes,
            time.perf_counter() - self._started,
        )
        return record

    def _object_sums(self, meta: AtomMeta, objects: dict[str, ObjectSum]) -> list[ObjectSum]:
        sums = []
        for index in chunk_indices(meta.grid):
            key = meta.object_key(self.prefix, index)
            if key not in objects:
                raise UcpError(f"step {self.step}: no process wrote {key}; the save is incomplete")
            sums.append(objects[key])
        return sums

    def _packed_chunks(self, meta: AtomMeta, packed: dict[str, list[list]]) -> list[PackedChunk]:
        """The atom's packed chunks in C order over its grid: every one recorded exactly once."""
        recorded = packed.get(meta.path, [])
        if len(recorded) == 1 and recorded[0][0] == 0 and meta.single_chunk:  # (most: one chunk, the atom)
            return [PackedChunk(*recorded[0][1:])]
        recorded = sorted(recorded)
        if [c[0] for c in recorded] != list(range(math.prod(meta.grid))):
            raise UcpError(f"step {self.step}: the packed chunks of atom {meta.path!r} were not all written once")
        return [PackedChunk(*c[1:]) for c in recorded]

    def _abort(self) -> None:
        """Remove the attempt, unless a commit marker names it: a commit whose answer was lost may have landed, and
        what a marker names is never removed (an unreadable marker leaves it to `collect_garbage`, which checks)."""
        try:
            held = commit.read_marker(self.storage, self.step)
        except UcpError as e:
            log.warning("left the failed attempt %s/%s to gc: its step's marker cannot be read (%s)", *self._where, e)
            return
        if held is not None and held.attempt == self.attempt:
            log.error("the attempt %s/%s is committed: not removed", *self._where)
            return
        try:
            self.storage.delete(self.prefix)
            self.storage.remove_empty_dir(commit.step_dirname(self.step))
        except UcpError as e:
            log.warning("could not remove the failed attempt %s/%s (collect_garbage will): %s", *self._where, e)

    @property
    def _where(self) -> tuple[str, str]:
        return self.storage.url, self.prefix

    def _stop_lease(self) -> None:
        if self._lease is not None:
            self._lease.stop()


def _describe(error: BaseException) -> dict:
    return {"error": str(error) or type(error).__name__, "type": type(error).__name__}


def _failed(failed: dict[int, dict], session: SaveSession) -> UcpError:
    """The error a failed save raises: the failure's own type where it is a ucp one (the first failing rank's), else
    a StorageError (an OSError from a write, say); it names the step, the root and, in a distributed save, every
    rank that failed with its reason."""
    first = failed[min(failed)]
    kind = error_kind(first["type"]) or StorageError
    if kind is StepExistsError:
        return StepExistsError(first["error"])
    if session.comm.world_size == 1:
        reason = first["error"]
    elif len(failed) == 1:
        reason = f"rank {min(failed)} failed: {first['error']}"
    else:
        reason = f"ranks {', '.join(map(str, sorted(failed)))} failed: " + "; ".join(
            f"rank {rank}: {d['type']}: {d['error']}" for rank, d in sorted(failed.items())
        )
    return kind(
        f"step {session.step} was not saved at {session.storage.url}, and what this attempt wrote was removed: {reason}"
    )


def _as_error(described: dict) -> UcpError:
    return (error_kind(described.get("type", "")) or UcpError)(described.get("error", "the save failed"))


def _raise(described: dict) -> NoReturn:
    raise _as_error(described)
