"""CheckpointManager: owns the steps under one root, their retention, and the cleanup of interrupted saves."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from . import commit
from .checkpoint import CheckpointReader, SaveOptions, save
from .storage import Storage, open_storage


class CheckpointManager:
    """Steps of one training run under `root_url`.

    A trainer says `manager.save(step, state)` and, on start, `manager.restore()`; the manager keeps the last
    `keep_last` committed steps (all when None) and deletes what interrupted saves left behind.
    """

    def __init__(
        self,
        root_url: str,
        *,
        keep_last: int | None = None,
        storage_options: dict[str, Any] | None = None,
        options: SaveOptions | None = None,
    ):
        if keep_last is not None and keep_last < 1:
            raise ValueError(f"keep_last must be at least 1 (or None to keep every step), got {keep_last}")
        self.root_url = root_url
        self.keep_last = keep_last
        self.options = options or SaveOptions()
        self.storage: Storage = open_storage(root_url, storage_options, fsync=self.options.fsync)
        self.gc()

    def steps(self) -> list[int]:
        """Committed steps, ascending."""
        return commit.committed_steps(self.storage)

    def latest_step(self) -> int | None:
        steps = self.steps()
        return steps[-1] if steps else None

    def save(
        self,
        step: int,
        state: dict[str, Any],
        *,
        layout: str | None = None,
        atom_attributes: Mapping[str, Mapping[str, Any]] | None = None,
    ) -> commit.CommitRecord:
        """Save and commit `step`, then apply retention."""
        record = save(
            state,
            self.root_url,
            step=step,
            layout=layout,
            options=self.options,
            atom_attributes=atom_attributes,
            storage=self.storage,
        )
        self._apply_retention()
        return record

    def restore(self, step: int | str | None = "latest") -> dict[str, Any]:
        """The state of a committed step ('latest' or None: the newest)."""
        return self.reader(step).load_state()

    def reader(self, step: int | str | None = "latest") -> CheckpointReader:
        return CheckpointReader(self.storage, step, io_threads=self.options.io_threads)

    def gc(self) -> list[int]:
        """Delete uncommitted step directories left by interrupted saves; returns their steps."""
        return commit.collect_garbage(self.storage)

    def _apply_retention(self) -> None:
        if self.keep_last is None:
            return
        for step in self.steps()[: -self.keep_last]:
            commit.delete_step(self.storage, step)
