"""The commit protocol: a step is visible only once its commit marker exists, after all its data is durable.

The marker `step_N/ucp-commit.json` is created exclusively (`Storage.create_exclusive`: a hard link on POSIX, a
conditional put on S3, one request whatever its size, on a store that a probe found honouring it), so of several
attempts to save one step exactly one commits; the others get `StepExistsError`. A store that cannot create
exclusively refuses to commit (`NonExclusiveStoreError`) unless opened for a single writer per step. It names the attempt whose directory holds the step (`step_N/attempt-<id>/`) and carries the
size and CRC-32C of that attempt's manifest (`zarr.json`), which in turn records the size and checksum of every
object: a reader that trusts the marker can hold every byte it reads to what this commit wrote. No rename is
involved, so the same protocol holds on object stores. Deleting a step removes the marker first.

Format 1.0 steps (no attempts, the marker written without exclusion) are still read.
"""

from __future__ import annotations

import logging
import struct
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import crc32c

from ..errors import (
    BucketNotFoundError,
    CheckpointNotFoundError,
    FormatError,
    NonExclusiveStoreError,
    NotAFileError,
    ObjectMissingError,
    StepExistsError,
    StorageError,
)
from ..format.manifest import (
    COMMIT_MARKER,
    FORMAT_VERSION,
    MAX_MANIFEST_BYTES,
    MAX_MARKER_BYTES,
    ZARR_JSON,
    check_format_version,
    dumps,
    is_attempt_dirname,
    json_int,
    loads,
    parse_step_dirname,
    step_dirname,
)
from ..storage import ReadableStorage, Storage

log = logging.getLogger("ucp")


@dataclass(frozen=True)
class CommitRecord:
    """What a commit marker says: which attempt holds step `step`, and the checksum of its manifest."""

    step: int
    manifest_crc32c: int
    atoms: int
    nbytes: int
    committed_at: str
    format_version: str = FORMAT_VERSION
    attempt: str | None = None  # None: a format 1.0 step, held by the step directory itself
    manifest_nbytes: int | None = None

    @property
    def prefix(self) -> str:
        """The key prefix of the committed step's Zarr group (its manifest and atoms)."""
        return f"{step_dirname(self.step)}/{self.attempt}" if self.attempt else step_dirname(self.step)

    def to_json(self) -> dict[str, Any]:
        return {
            "format_version": self.format_version,
            "step": self.step,
            "attempt": self.attempt,
            "manifest_bytes": self.manifest_nbytes,
            "manifest_crc32c": self.manifest_crc32c,
            "atoms": self.atoms,
            "bytes": self.nbytes,
            "committed_at": self.committed_at,
        }


def marker_key(step: int) -> str:
    return f"{step_dirname(step)}/{COMMIT_MARKER}"


def manifest_checksum(manifest_bytes: bytes | memoryview) -> int:
    return crc32c.crc32c(manifest_bytes)


COMMIT_TRIES = 3  # creates of a marker whose outcome stayed unknown (each already retried by the store's client)


def create_once(storage: Storage, key: str, data: bytes) -> bool:
    """Create `key` holding `data` exclusively, deciding the outcome by what the store then holds, not by the status
    of the last request: True if `key` holds `data` (created now, or by an earlier try of this same call whose
    answer was lost: a retried conditional put finds its own first success and is refused), False if it holds
    anything else (another writer's). Raises StorageError if neither can be told (the store cannot be read)."""
    failure: StorageError | None = None
    unread: StorageError | None = None  # the last read-back that failed (a later try may still tell)
    for _ in range(COMMIT_TRIES):
        try:
            storage.create_exclusive(key, data)
            return True
        except FileExistsError:
            failure = None
        except NonExclusiveStoreError:  # (nothing was sent: the store cannot commit exclusively)
            raise
        except StorageError as e:  # the request may or may not have reached the store
            failure = e
        try:
            held = bytes(storage.read(key, 0, len(data) + 1))
        except FileNotFoundError:
            unread = None
            continue  # it did not land (or was removed meanwhile): try again
        except StorageError as e:
            unread = e
            continue  # (the create again: refused if it landed, and read back once more)
        if held != data:
            return False
        log.info("%s/%s: a create's answer was lost; the store holds what it wrote", storage.url, key)
        return True
    if unread is not None:
        raise StorageError(
            f"the outcome of creating {storage.url.rstrip('/')}/{key} is unknown ({failure or 'it exists'}), "
            f"and reading it back failed: {unread}"
        ) from unread
    raise failure or StorageError(f"cannot create {storage.url.rstrip('/')}/{key}: it keeps vanishing")


def commit(storage: Storage, step: int, attempt: str, manifest_bytes: bytes, atoms: int, nbytes: int) -> CommitRecord:
    """Commit attempt `attempt` of `step`, whose data and manifest are already durable: create the marker, or
    raise StepExistsError if another attempt committed the step first. Whether it committed is decided by the
    marker the store holds (`create_once`)."""
    record = CommitRecord(
        step=step,
        manifest_crc32c=manifest_checksum(manifest_bytes),
        atoms=atoms,
        nbytes=nbytes,
        committed_at=datetime.now(UTC).isoformat(timespec="seconds"),
        attempt=attempt,
        manifest_nbytes=len(manifest_bytes),
    )
    if not create_once(storage, marker_key(step), dumps(record.to_json())):
        raise StepExistsError(
            f"step {step} at {storage.url} was committed by another save meanwhile; "
            "committed steps are never overwritten"
        )
    return record


def read_marker(storage: ReadableStorage, step: int) -> CommitRecord | None:
    """The step's commit record; None when the step has no marker. A marker that is not a valid one (torn by a
    1.0 writer's crash, edited, not a regular file) is a FormatError naming it."""
    key = marker_key(step)
    where = f"{storage.url.rstrip('/')}/{key}"
    try:
        raw = storage.read(key, 0, MAX_MARKER_BYTES + 1)
    except FileNotFoundError:
        return None
    except NotAFileError as e:
        raise FormatError(f"commit marker: {e}") from None
    return parse_marker(raw, step, where)


def parse_marker(raw: bytes | memoryview, step: int, where: str) -> CommitRecord:
    """A commit marker's record; a FormatError naming `where` if it is not a valid marker of `step`."""
    doc = loads(raw, f"commit marker {where}", MAX_MARKER_BYTES)
    if not isinstance(doc, dict):
        raise FormatError(f"commit marker {where} is not a JSON object")
    version = doc.get("format_version")
    check_format_version(version, where)
    attempt = doc.get("attempt")
    if attempt is not None and not is_attempt_dirname(attempt):
        raise FormatError(
            f"commit marker {where} names attempt {attempt!r:.80}, which is not an attempt directory name"
        )
    if attempt is None and not str(version).startswith("1."):
        raise FormatError(f"commit marker {where} names no attempt (format {version} requires one)")
    manifest_nbytes = doc.get("manifest_bytes")
    committed_at = doc.get("committed_at")
    if not isinstance(committed_at, str):
        raise FormatError(f"commit marker {where}: committed_at must be a string")
    record = CommitRecord(
        step=json_int(doc.get("step"), f"commit marker {where}", "step"),
        manifest_crc32c=json_int(doc.get("manifest_crc32c"), f"commit marker {where}", "manifest_crc32c", 0, 2**32 - 1),
        atoms=json_int(doc.get("atoms"), f"commit marker {where}", "atoms"),
        nbytes=json_int(doc.get("bytes"), f"commit marker {where}", "bytes"),
        committed_at=committed_at,
        format_version=version,  # type: ignore[arg-type]
        attempt=attempt,
        manifest_nbytes=None
        if attempt is None
        else json_int(manifest_nbytes, where, "manifest_bytes", 0, MAX_MANIFEST_BYTES),
    )
    if record.step != step:
        raise FormatError(f"commit marker {where} names step {record.step}, not {step}")
    return record


def step_dirs(storage: ReadableStorage) -> list[int]:
    """Every step directory under the root, committed or not, ascending."""
    steps = (parse_step_dirname(name) for name in storage.listdir(""))
    return sorted(s for s in steps if s is not None)


def committed_steps(storage: ReadableStorage) -> list[int]:
    """Steps with a valid commit marker, ascending. A step whose marker is damaged is left out (and logged): it
    cannot be loaded, and it is never taken for a leftover to delete either."""
    return [step for step in step_dirs(storage) if _valid_marker(storage, step) is not None]


def _foreign_hint(storage: ReadableStorage) -> str:
    """What another framework's checkpoint at `storage` looks like to ucp, with the command that reads it."""
    names = set(storage.listdir(""))
    if "latest_checkpointed_iteration.txt" in names or any(n.startswith(("iter_", "mp_rank_")) for n in names):
        # (torch_dist iteration directories hold metadata.json; the torch format's, mp_rank_* directories)
        torch_dist = any(storage.exists(f"{n}/metadata.json") for n in names if n.startswith("iter_") or n == "release")
        command = f"`ucp convert SRC DST --from {'torch_dist' if torch_dist else 'LAYOUT'} --to universal`"
        saved_in = "" if torch_dist else " (LAYOUT: the TP/PP/EP it was saved in, e.g. tp2pp2)"
        return f": this is a Megatron-LM checkpoint; make a ucp one with {command}{saved_in}"
    if ".metadata" in names:
        return ": this is a PyTorch DCP checkpoint; import it with `ucp import SRC DST --from dcp`"
    if "config.json" in names and any(n.endswith(".safetensors") for n in names):
        return ": this is a Hugging Face model; import it with `ucp import SRC DST --from hf`"
    return ""


def resolve_step(storage: ReadableStorage, step: int | str | None) -> tuple[int, CommitRecord]:
    """The committed step that `step` ('latest', None or a number) names, with its commit record. In as few round
    trips as the answer takes (each is a request in series before a load's first read on an object store): 'latest'
    lists the root once and reads markers from the newest step down to the first valid one; a number reads its
    marker alone. The root's existence, and the listing that names what is there, are looked up only to say why
    nothing was found."""
    try:
        return _resolve_step(storage, step)
    except BucketNotFoundError:
        _check_root(storage)  # (what a missing bucket means to a reader: no checkpoint there, in those words)
        raise


def _resolve_step(storage: ReadableStorage, step: int | str | None) -> tuple[int, CommitRecord]:
    if step in (None, "latest"):
        all_steps = step_dirs(storage)
        for latest in reversed(all_steps):
            record = _valid_marker(storage, latest)
            if record is not None:
                return latest, record
        _check_root(storage)
        pending = f" (uncommitted steps present: {all_steps}; an interrupted save?)" if all_steps else ""
        raise CheckpointNotFoundError(f"no committed ucp checkpoint at {storage.url}{pending}{_foreign_hint(storage)}")
    if isinstance(step, bool) or not isinstance(step, (int, str)) or not str(step).isdigit():
        raise CheckpointNotFoundError(f"step must be a non-negative integer or 'latest', got {step!r:.80}")
    step = int(step)
    record = read_marker(storage, step)
    if record is None:
        _check_root(storage)
        all_steps = step_dirs(storage)
        if step in all_steps:
            raise CheckpointNotFoundError(
                f"step {step} at {storage.url} is not committed (its save did not finish); "
                f"committed steps: {committed_steps(storage)}"
            )
        raise CheckpointNotFoundError(f"no step {step} at {storage.url}; steps present: {all_steps}")
    return step, record


def _valid_marker(storage: ReadableStorage, step: int) -> CommitRecord | None:
    """The step's commit record, or None where it has none or a damaged one (logged: such a step is not counted as
    committed, `committed_steps`)."""
    try:
        return read_marker(storage, step)
    except FormatError as e:
        log.warning("step %d at %s is not counted as committed: %s", step, storage.url, e)
        return None


def _check_root(storage: ReadableStorage) -> None:
    """A CheckpointNotFoundError if the root does not exist (a missing bucket: `BucketNotFoundError`)."""
    if not storage.root_exists():
        raise CheckpointNotFoundError(
            f"no ucp checkpoint at {storage.url}: the path does not exist or is not a directory"
        )


def read_manifest_bytes(storage: ReadableStorage, record: CommitRecord) -> bytes:
    """The committed step's zarr.json, checked against the size and checksum its commit recorded."""
    key = f"{record.prefix}/{ZARR_JSON}"
    where = f"{storage.url.rstrip('/')}/{key}"
    limit = record.manifest_nbytes if record.manifest_nbytes is not None else MAX_MANIFEST_BYTES
    try:
        data = bytes(storage.read(key, 0, limit + 1))
    except FileNotFoundError:
        raise ObjectMissingError(f"{where} is missing") from None
    return check_manifest_bytes(data, record, where)


def check_manifest_bytes(data: bytes, record: CommitRecord, where: str) -> bytes:
    """`data` if it is the manifest the commit recorded (size and checksum), else a FormatError."""
    limit = record.manifest_nbytes if record.manifest_nbytes is not None else MAX_MANIFEST_BYTES
    if len(data) > limit or (record.manifest_nbytes is not None and len(data) != record.manifest_nbytes):
        raise FormatError(
            f"{where} was modified after the step was committed (it is not {limit} bytes long)"
            if record.manifest_nbytes is not None
            else f"{where} is larger than {limit} bytes"
        )
    if manifest_checksum(data) != record.manifest_crc32c:
        raise FormatError(
            f"{where} was modified after the step was committed (crc32c {struct.pack('>I', manifest_checksum(data)).hex()} "
            f"!= {struct.pack('>I', record.manifest_crc32c).hex()} recorded by the commit)"
        )
    return data
