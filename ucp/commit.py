"""The commit protocol: a step is visible only once its commit marker is written, after all its data.

The marker `<step>/ucp-commit.json` is written last, whole, by one writer. It is valid only if it parses,
names its own step, and carries the crc32c of the step's `zarr.json` (the manifest), so a torn or stale
marker, or a manifest edited after the commit, is never taken for a committed checkpoint. No rename is
involved, so the same protocol holds on object stores. Deleting a step removes the marker first.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import crc32c

from .errors import CheckpointNotFoundError, FormatError
from .format import (
    COMMIT_MARKER,
    FORMAT_VERSION,
    ZARR_JSON,
    check_format_version,
    dumps,
    parse_step_dirname,
    step_dirname,
)
from .storage import Storage


@dataclass(frozen=True)
class CommitRecord:
    step: int
    manifest_crc32c: int
    atoms: int
    nbytes: int
    committed_at: str
    format_version: str = FORMAT_VERSION

    def to_json(self) -> dict[str, Any]:
        return {
            "format_version": self.format_version,
            "step": self.step,
            "manifest_crc32c": self.manifest_crc32c,
            "atoms": self.atoms,
            "bytes": self.nbytes,
            "committed_at": self.committed_at,
        }


def manifest_checksum(manifest_bytes: bytes | memoryview) -> int:
    return crc32c.crc32c(manifest_bytes)


def write_marker(storage: Storage, step: int, manifest_bytes: bytes, atoms: int, nbytes: int) -> CommitRecord:
    """Commit a step whose data and manifest are already durable."""
    record = CommitRecord(
        step=step,
        manifest_crc32c=manifest_checksum(manifest_bytes),
        atoms=atoms,
        nbytes=nbytes,
        committed_at=datetime.now(UTC).isoformat(timespec="seconds"),
    )
    storage.write(f"{step_dirname(step)}/{COMMIT_MARKER}", [dumps(record.to_json())])
    storage.flush()
    return record


def read_marker(storage: Storage, step: int) -> CommitRecord | None:
    """The step's commit record, or None when the step is not (validly) committed."""
    try:
        raw = storage.read(f"{step_dirname(step)}/{COMMIT_MARKER}")
        doc = json.loads(bytes(raw))
        record = CommitRecord(
            step=int(doc["step"]),
            manifest_crc32c=int(doc["manifest_crc32c"]),
            atoms=int(doc["atoms"]),
            nbytes=int(doc["bytes"]),
            committed_at=str(doc["committed_at"]),
            format_version=str(doc["format_version"]),
        )
    except (FileNotFoundError, ValueError, KeyError, TypeError, UnicodeDecodeError):
        return None  # absent or torn: not committed
    if record.step != step:
        return None
    check_format_version(record.format_version, f"{storage.url}/{step_dirname(step)}")
    return record


def step_dirs(storage: Storage) -> list[int]:
    """Every step directory under the root, committed or not, ascending."""
    steps = (parse_step_dirname(name) for name in storage.listdir(""))
    return sorted(s for s in steps if s is not None)


def committed_steps(storage: Storage) -> list[int]:
    return [s for s in step_dirs(storage) if read_marker(storage, s) is not None]


def resolve_step(storage: Storage, step: int | str | None) -> tuple[int, CommitRecord]:
    """The committed step that `step` ('latest', None or a number) names, with its commit record."""
    if not storage.root_exists():
        raise CheckpointNotFoundError(f"no ucp checkpoint at {storage.url}: the path does not exist")
    all_steps = step_dirs(storage)
    if step in (None, "latest"):
        committed = [s for s in all_steps if read_marker(storage, s) is not None]
        if not committed:
            pending = f" (uncommitted steps present: {all_steps}; an interrupted save?)" if all_steps else ""
            raise CheckpointNotFoundError(f"no committed ucp checkpoint at {storage.url}{pending}")
        step = committed[-1]
    try:
        step = int(step)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise CheckpointNotFoundError(f"step must be an integer or 'latest', got {step!r}") from None
    record = read_marker(storage, step)
    if record is None:
        if step in all_steps:
            raise CheckpointNotFoundError(
                f"step {step} at {storage.url} is not committed (its save did not finish); "
                f"committed steps: {[s for s in all_steps if read_marker(storage, s) is not None]}"
            )
        raise CheckpointNotFoundError(f"no step {step} at {storage.url}; steps present: {all_steps}")
    return step, record


def read_manifest_bytes(storage: Storage, step: int, record: CommitRecord) -> bytes:
    """The step's zarr.json, checked against the checksum its commit recorded."""
    where = f"{storage.url}/{step_dirname(step)}/{ZARR_JSON}"
    try:
        data = bytes(storage.read(f"{step_dirname(step)}/{ZARR_JSON}"))
    except FileNotFoundError:
        raise FormatError(f"{where} is missing") from None
    if manifest_checksum(data) != record.manifest_crc32c:
        raise FormatError(f"{where} was modified after the step was committed (crc32c {struct.pack('>I', manifest_checksum(data)).hex()} "
                          f"!= {struct.pack('>I', record.manifest_crc32c).hex()} recorded by the commit)")
    return data


def delete_step(storage: Storage, step: int) -> None:
    """Remove a step: the marker first, so it is never visible half-deleted."""
    storage.delete(f"{step_dirname(step)}/{COMMIT_MARKER}")
    storage.flush()
    storage.delete(step_dirname(step))


def collect_garbage(storage: Storage, below: int | None = None) -> list[int]:
    """Delete uncommitted step directories (leftovers of interrupted saves) numbered below `below` (all of them
    when None); returns their steps. A step above the latest commit may be a save still in progress elsewhere."""
    removed = []
    for step in step_dirs(storage):
        if (below is None or step < below) and read_marker(storage, step) is None:
            storage.delete(step_dirname(step))
            removed.append(step)
    return removed
