"""One save attempt from its start to its commit: the protocol that every save path runs.

1. `SaveSession.begin` (the coordinator, rank 0): refuse a committed step (StepExistsError), make the root a
   Zarr group, create the attempt's directory with its owner record (`ucp.protocol.attempt`; its lease is renewed while
   the save runs); every rank learns the attempt id (`Begun`), or raises the coordinator's error.
2. Every process writes its objects below `session.prefix` and `record`s each object's size and checksum. (A
   distributed save first plans its part on every rank together, `agree`: a rank whose part cannot be planned
   fails every rank there, as in step 5, rather than leaving them to wait for it.)
3. Every process makes its writes durable.
4. `finish` (or `fail`, on a process whose part failed): the records (`RankWrites`), or a process's failure, go to
   the coordinator; it writes the manifest (every object's size and checksum in it), makes it durable and creates
   the commit marker exclusively (`ucp.protocol.commit`). Every rank learns the outcome (`Committed`) and returns the commit
   record (rank 0), or raises one error naming every rank that failed. After a commit the `after_commit` hooks run
   on every rank, with the record on the coordinator and None elsewhere (the manager's retention; the hot tier's
   replication and drain, `ucp.distributed.tiers`).
5. On any failure before the commit, the coordinator removes the attempt's directory, freeing its space: there
   is one failure policy for every save path. (A process killed outright leaves its attempt to `collect_garbage`.)

The ranks agree through `ucp.protocol.coordination` (map on every rank, decide on the coordinator, share the decision or one
error), with the typed messages below. Single-process saves, `VirtualWorld`, the interop streams and
`CheckpointManager` all run through here, with a `LocalComm`; a distributed save passes its `TorchComm`.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import math
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NoReturn, Self

from ..errors import FormatError, PeerLostError, StepExistsError, StorageError, UcpError
from ..format import index as step_index
from ..format.manifest import (
    FORMAT_VERSION,
    MAX_DOCUMENT_BYTES,
    ZARR_JSON,
    AtomMeta,
    ObjectSum,
    PackedChunk,
    StepManifest,
    check_step,
    chunk_indices,
    dumps,
    loads,
)
from ..format.packs import Pack, pack_name, pack_object_key
from ..storage import CLOCK_KEY, ReadableStorage, Storage, writable
from . import attempt, commit, coordination
from .comm import Comm, LocalComm

log = logging.getLogger("ucp")


def ensure_root(storage: Storage) -> None:
    """Make the root a Zarr group that says what it is (created once, by whichever save comes first), with an id
    of its own: a root removed and made again at the same URL is another root (`root_id`)."""
    if storage.exists(ZARR_JSON):
        return
    doc = {
        "zarr_format": 3,
        "node_type": "group",
        "attributes": {"ucp": {"kind": "root", "format_version": FORMAT_VERSION, "id": uuid.uuid4().hex}},
    }
    try:
        storage.create_exclusive(ZARR_JSON, dumps(doc))
    except FileExistsError:
        pass  # another save made it meanwhile


def root_attributes(storage: ReadableStorage) -> dict[str, Any]:
    """The root's own attributes (its zarr.json's `attributes.ucp`), checked to say it is a ucp root."""
    where = f"{storage.url.rstrip('/')}/{ZARR_JSON}"
    doc = loads(storage.read(ZARR_JSON, 0, MAX_DOCUMENT_BYTES + 1), where, MAX_DOCUMENT_BYTES)
    attributes = doc.get("attributes") if isinstance(doc, dict) else None
    ours = attributes.get("ucp") if isinstance(attributes, dict) else None
    if not isinstance(ours, dict) or ours.get("kind") != "root":
        raise FormatError(f"the root group's zarr.json at {storage.url} does not say it is a ucp root")
    return ours


def root_id(storage: Storage) -> str | None:
    """The id of the root at `storage` (made if there is none yet, `ensure_root`); None for a root written before
    roots had ids."""
    ensure_root(storage)
    found = root_attributes(storage).get("id")
    return found if isinstance(found, str) else None


def remove_unused_root(storage: Storage) -> None:
    """Undo what a failed first save left in a root that it found empty: the root's group document (and on local
    files the directory, if that leaves it empty). A root that holds any step is left as it is."""
    names = set(storage.listdir(""))
    if names - {ZARR_JSON, CLOCK_KEY}:
        return
    for name in names:
        storage.delete(name)
    storage.remove_empty_dir("")


# -- what crosses ranks (`ucp.protocol.coordination`)

PackedRows = dict[str, list[list]]  # atom path -> [[chunk number (C order over its grid), *PackedChunk.to_json()], ...]


@dataclass(frozen=True)
class Begun:
    """The coordinator to every rank: the attempt it started."""

    attempt: str

    def to_json(self) -> dict:
        return {"attempt": self.attempt}

    @classmethod
    def from_json(cls, doc: Any) -> Begun:
        return cls(str(doc["attempt"]))


@dataclass(frozen=True)
class RankWrites:
    """One rank to the coordinator: the objects it wrote (key relative to the attempt's directory -> size and
    checksum) and where the packed chunks it wrote lie. (A rank that failed sends its failure instead.) The keys are
    relative because the coordinator takes a record per object of every rank: the attempt's directory, repeated in
    each, was a third of what crossed."""

    objects: dict[str, ObjectSum]
    packed: PackedRows

    @classmethod
    def of(cls, prefix: str, objects: dict[str, ObjectSum], packed: PackedRows) -> RankWrites:
        """What a process wrote below the attempt directory `prefix` (`objects` keyed below the root)."""
        cut = len(prefix) + 1
        return cls({key[cut:]: sums for key, sums in objects.items()}, packed)

    def to_json(self) -> dict:
        return {"objects": self.objects, "packed": self.packed}

    @classmethod
    def from_json(cls, doc: Any) -> RankWrites:
        # (taken as decoded: each size and checksum stays the pair JSON gave, [size, crc]; rank 0 takes hundreds of
        # thousands of them, and they only pass into the manifest)
        return cls(doc["objects"], doc["packed"])

    @staticmethod
    def merged(ranks: list[RankWrites]) -> tuple[dict[str, ObjectSum], PackedRows]:
        """Every rank's objects (keys relative to the attempt's directory) and packed chunks together (a TP-split
        atom's chunks come from several ranks)."""
        if len(ranks) == 1:
            return ranks[0].objects, ranks[0].packed
        objects: dict[str, ObjectSum] = {}
        packed: PackedRows = {}
        for r in ranks:
            objects.update(r.objects)
            for path, chunks in r.packed.items():
                packed.setdefault(path, []).extend(chunks)
        return objects, packed


@dataclass(frozen=True)
class Committed:
    """The coordinator to every rank: the step is committed, held by this attempt. (A failure reaches every rank as
    an error instead.)"""

    step: int
    attempt: str

    def to_json(self) -> dict:
        return {"step": self.step, "attempt": self.attempt}

    @classmethod
    def from_json(cls, doc: Any) -> Committed:
        return cls(int(doc["step"]), str(doc["attempt"]))


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
        self._packed: PackedRows = {}  # the packed chunks this process wrote
        self._packs = 0
        self._lock = threading.Lock()
        self._ended = False
        self._removed: bool | None = None  # (the coordinator's, once a failed attempt's removal was tried)
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
        """Start an attempt at `step` (every rank calls this together): the coordinator starts it, every rank learns
        its id, or every rank raises the coordinator's error."""
        comm = comm or LocalComm()
        lease = None

        def start() -> Begun:
            nonlocal lease
            check_step(step)
            writable(storage, f"save step {step}")  # (mypy refuses a read-only store here; this, at run time)
            if commit.read_marker(storage, step) is not None:
                raise StepExistsError(
                    f"step {step} is already committed at {storage.url}; committed steps are never overwritten"
                )
            ensure_root(storage)
            record = attempt.OwnerRecord.mine(step, attempt.new_attempt_id(), lease_s or attempt.DEFAULT_LEASE_S)
            try:
                lease = attempt.Lease(storage, record)  # (writes the owner record first)
            except StorageError as e:  # (a full disk, a refused write: nothing of the attempt may stay behind)
                removed = True
                try:
                    attempt.remove(storage, step, record.attempt)
                except UcpError:
                    removed = False
                raise StorageError(f"step {step} was not saved at {storage.url}, and {_left(removed)}: {e}") from e
            return Begun(record.attempt)

        begun = coordination.broadcast(comm, start, Begun)
        return cls(storage, step, begun.attempt, comm, lease)

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
    def packed(self) -> PackedRows:
        """The packed chunks this process wrote in this attempt, by atom path: [chunk number, pack, offset, nbytes,
        crc32c] each."""
        with self._lock:
            return {path: list(chunks) for path, chunks in self._packed.items()}

    @property
    def objects(self) -> dict[str, ObjectSum]:
        """The chunk objects this process wrote in this attempt, with their sizes and checksums."""
        with self._lock:
            return dict(self._objects)

    def agree(
        self,
        local: Callable[[], coordination.M],
        decide: Callable[[list[coordination.M]], coordination.R],
        message: type[coordination.M],
        result: type[coordination.R],
    ) -> coordination.R:
        """A step that every rank takes together before its writes (a distributed save's plan): `local` on every
        rank, `decide` on the coordinator with every rank's value, the decision on every rank. If any rank's `local`
        or the decision fails, the attempt ends here as in `fail`: the coordinator removes it and every rank raises
        one error naming every rank that failed. (A rank that raised on its own instead left the others waiting for
        it in the save's next collective until the process group's timeout, and the attempt's lease renewed for the
        life of the process, so that gc never took it.)"""
        if self._ended:
            raise UcpError(f"the save attempt {self.attempt} of step {self.step} has already ended")

        def remove() -> None:
            self._stop_lease()
            self._abort()

        try:
            return coordination.all_reduce(
                self.comm, local, decide, message, result, failed=self._failed, on_failure=remove
            )
        except BaseException:
            self._ended = True
            self._stop_lease()
            raise

    # -- the end

    def finish(self, manifest: StepManifest | None) -> commit.CommitRecord | None:
        """Steps 4 and 5 of the protocol (module doc) for a process whose part succeeded: every rank calls this or
        `fail` once, together; `manifest` (without objects) is the coordinator's. Returns the commit record on the
        coordinator, None elsewhere; raises on every rank if the step was not committed."""
        record = self._end(manifest, None)
        for hook in self.after_commit:
            try:
                hook(record)
            except PeerLostError as e:  # (the hooks' collectives: the ranks are no longer in step, so none goes on)
                raise PeerLostError(
                    f"step {self.step} at {self.storage.url} is committed, but the work after its commit lost a "
                    f"peer: {e}"
                ) from e
            except Exception as e:  # noqa: BLE001 -- the step is committed: what follows cannot undo that
                self.after_commit_errors.append(e)
                log.error(
                    "step %d at %s is committed, but the work after its commit failed: %s",
                    self.step,
                    self.storage.url,
                    e,
                )
        return record

    def fail(self, error: BaseException) -> NoReturn:
        """Steps 4 and 5 for a process whose part failed with `error`: nothing is committed, the coordinator removes
        the attempt, and every rank raises one error naming every rank that failed (`_failed`)."""
        self._end(None, error)
        raise AssertionError("unreachable: the coordinator commits nothing once a process has failed")

    def _end(self, manifest: StepManifest | None, error: BaseException | None) -> commit.CommitRecord | None:
        """Gather what every rank wrote, commit it on the coordinator or remove the attempt, and share the outcome
        (`coordination.all_reduce`). Returns the commit record on the coordinator, None elsewhere."""
        if self._ended:
            raise UcpError(f"the save attempt {self.attempt} of step {self.step} has already ended")
        self._ended = True
        record: commit.CommitRecord | None = None

        def written() -> RankWrites:
            if error is not None:
                raise error
            return RankWrites.of(self.prefix, self._objects, self._packed)  # (every write of this process has ended)

        def decide(ranks: list[RankWrites]) -> Committed:
            nonlocal record
            self._stop_lease()  # (every rank has written: what follows commits the attempt or removes it)
            assert manifest is not None, "the coordinator commits the manifest"
            if self._cancelled:
                raise UcpError(f"the save of step {self.step} was abandoned by its process; not committed")
            self._check_lease()
            record = self._commit(manifest, *RankWrites.merged(ranks))
            return Committed(self.step, self.attempt)

        def remove() -> None:
            self._stop_lease()
            self._abort()

        try:
            coordination.all_reduce(
                self.comm, written, decide, RankWrites, Committed, failed=self._failed, on_failure=remove
            )
        except PeerLostError as e:
            # A process lost while the ranks learn the outcome: what each says is what it knows of the store. The
            # coordinator may have committed just before (its answer to a dead rank then failed): gloo's words alone
            # told a committed step's saver that its save failed.
            if record is not None:
                raise PeerLostError(
                    f"step {self.step} at {self.storage.url} is committed, but a process of the job was lost before "
                    f"every rank learned it: {e}"
                ) from e
            known = "was not committed" if self.is_coordinator else "may or may not have been committed"
            raise PeerLostError(
                f"step {self.step} at {self.storage.url} {known}: a process of the job was lost during its commit: {e}"
            ) from e
        finally:
            self._stop_lease()
        assert record is not None or not self.is_coordinator
        return record

    def _failed(self, failures: coordination.Failures) -> UcpError:
        """The error a save that failed on some ranks raises: the first failing rank's type where it is a ucp one,
        else a StorageError (an OSError from a write, say); it names the step, the root and, in a distributed save,
        every rank that failed with its reason. A StepExistsError is raised as it is."""
        if failures.kind() is StepExistsError:
            return StepExistsError(failures.first.reason)
        return failures.error(
            f"step {self.step} was not saved at {self.storage.url}, and {_left(bool(self._removed))}",
            default=StorageError,
        )

    def _check_lease(self) -> None:
        """Refuse to commit once the lease may have run out where gc judges it (`attempt.Lease.expired`), or once
        the attempt is gone (removed by another process: what it wrote before may be gone with it)."""
        lease = self._lease
        expired = lease.expired() if lease is not None else None
        if lease is not None and expired is not None:
            raise StorageError(
                f"step {self.step} at {self.storage.url} was not committed: its attempt's lease could not be renewed "
                f"for {lease.record.lease_s + expired:.1f} s (the store unreachable?), so garbage collection may have "
                "removed the attempt"
            )
        if lease is not None and not self.storage.exists(attempt.record_key(self.step, self.attempt)):
            raise StorageError(
                f"step {self.step} at {self.storage.url} was not committed: its attempt {self.attempt} was removed "
                "while it was saved (by another process's retention or garbage collection)"
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

    def _commit(self, manifest: StepManifest, objects: dict[str, ObjectSum], packed: PackedRows) -> commit.CommitRecord:
        atoms = manifest.atoms.items()
        manifest.objects = {path: self._object_sums(meta, objects) for path, meta in atoms if not meta.packed}
        manifest.packed = {path: self._packed_chunks(meta, packed) for path, meta in atoms if meta.packed}
        names = sorted({c.pack for chunks in manifest.packed.values() for c in chunks})
        manifest.packs = {name: objects[pack_object_key("", name)[1:]] for name in names}  # (keys are relative)
        manifest_bytes, parts = step_index.encode(manifest)  # (format 3.1: the manifest and its index parts)
        with cf.ThreadPoolExecutor(min(len(parts), 16) or 1, thread_name_prefix="ucp-index") as pool:
            list(pool.map(lambda part: self.storage.write(f"{self.prefix}/{part[0]}", [part[1]]), parts))
        self.storage.write(f"{self.prefix}/{ZARR_JSON}", [manifest_bytes])
        self.storage.flush()
        nbytes = sum(a.nbytes for a in manifest.atoms.values())
        try:
            record = commit.commit(self.storage, self.step, self.attempt, manifest_bytes, len(manifest.atoms), nbytes)
        except StorageError as e:  # (the outcome unknown: what the store holds decides it, read once more)
            record = self._held_commit(e)
        log.info(
            "committed step %d at %s: %d atoms, %d bytes, %.2f s after its save began",
            self.step,
            self.storage.url,
            record.atoms,
            nbytes,
            time.perf_counter() - self._started,
        )
        return record

    def _held_commit(self, unknown: StorageError) -> commit.CommitRecord:
        """The commit record of this attempt if the step's marker names it after all (a create whose answer and
        read-backs were lost), else `unknown` raised: what a save is told is what the store holds."""
        try:
            held = commit.read_marker(self.storage, self.step)
        except UcpError:
            raise unknown from None
        if held is None or held.attempt != self.attempt:
            raise unknown
        log.warning(
            "step %d at %s is committed (its marker read back at last): %s", self.step, self.storage.url, unknown
        )
        return held

    def _object_sums(self, meta: AtomMeta, objects: dict[str, ObjectSum]) -> list[ObjectSum]:
        """The atom's chunk objects' sizes and checksums in C order over its grid (`objects`: keyed below the attempt's
        directory, as the ranks sent them)."""
        sums = []
        for index in chunk_indices(meta.grid):
            key = f"{meta.path}/{meta.chunk_key(index)}"
            if key not in objects:
                raise UcpError(f"step {self.step}: no process wrote {self.prefix}/{key}; the save is incomplete")
            sums.append(objects[key])
        return sums

    def _packed_chunks(self, meta: AtomMeta, packed: PackedRows) -> list[PackedChunk]:
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
        self._removed = False
        try:
            held = commit.read_marker(self.storage, self.step)
        except UcpError as e:
            log.warning("left the failed attempt %s/%s to gc: its step's marker cannot be read (%s)", *self._where, e)
            return
        if held is not None and held.attempt == self.attempt:
            log.error("the attempt %s/%s is committed: not removed", *self._where)
            return
        try:
            attempt.remove(self.storage, self.step, self.attempt)
            self._removed = True
        except UcpError as e:
            log.warning("could not remove the failed attempt %s/%s (collect_garbage will): %s", *self._where, e)

    @property
    def _where(self) -> tuple[str, str]:
        return self.storage.url, self.prefix

    def _stop_lease(self) -> None:
        if self._lease is not None:
            self._lease.stop()


def _left(removed: bool) -> str:
    """What a failed save's error says of what its attempt wrote (whether its removal went through)."""
    if removed:
        return "what this attempt wrote was removed"
    return "what this attempt wrote is left to garbage collection (it could not be removed now)"
