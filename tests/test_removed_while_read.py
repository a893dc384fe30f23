"""A step that retention (or anyone's `delete`) removes while it is being read is a StepRemovedError, a kind of
CheckpointNotFoundError that says so: the reader is never told that its checkpoint is damaged when it was only
deleted. Damage stays an IntegrityError."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

import ucp
from ucp.errors import ObjectMissingError, StepRemovedError
from ucp.protocol import attempt
from ucp.storage import open_storage

OPTIONS = ucp.SaveOptions(chunking=ucp.ChunkingPolicy(object_bytes=8192, inner_bytes=2048), fsync=False)
UNPACKED = ucp.SaveOptions(chunking=ucp.ChunkingPolicy(object_bytes=8192, inner_bytes=2048, pack_below=0), fsync=False)


def state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"model": {f"w{i}": torch.randn(32, 64, generator=g) for i in range(6)}, "seed": seed}


@pytest.mark.parametrize("options", [OPTIONS, UNPACKED], ids=["packed", "unpacked"])
def test_a_step_deleted_after_it_was_opened_is_removed_not_damaged(tmp_path, options):
    ucp.save(state(1), str(tmp_path), step=1, options=options)
    reader = ucp.open_checkpoint(str(tmp_path))
    attempt.delete_step(open_storage(str(tmp_path)), 1)
    with pytest.raises(StepRemovedError, match="step 1 .* was removed while it was being read"):
        reader.load_state()
    assert issubclass(StepRemovedError, ucp.CheckpointNotFoundError)


@pytest.mark.parametrize("options", [OPTIONS, UNPACKED], ids=["packed", "unpacked"])
def test_a_missing_object_of_a_step_still_committed_is_damage(tmp_path, options):
    ucp.save(state(1), str(tmp_path), step=1, options=options)
    reader = ucp.open_checkpoint(str(tmp_path))
    stored = tmp_path / reader.prefix / ("ucp-packs" if reader.manifest.packed else "model/w3")
    os.remove(next(p for p in sorted(stored.rglob("*")) if p.is_file() and p.name != "zarr.json"))
    with pytest.raises(ObjectMissingError) as failure:
        reader.load_state()
    assert isinstance(failure.value, ucp.IntegrityError) and not isinstance(failure.value, StepRemovedError)


@pytest.mark.slow
def test_readers_beside_retention_are_told_the_step_was_removed(tmp_path):
    """A writer saving with keep_last=1 as fast as it can, a reader loading the latest step as fast as it can, for
    a few seconds: every read either returns a state that was saved or says the step is gone."""
    url = str(tmp_path)
    ucp.save(state(0), url, step=0, options=OPTIONS)
    stop = threading.Event()
    saved: list[int] = []

    def write() -> None:
        manager = ucp.CheckpointManager(url, keep_last=1, options=OPTIONS)
        step = 1
        while not stop.is_set():
            manager.save(step, state(step))
            saved.append(step)
            step += 1

    writer = threading.Thread(target=write)
    writer.start()
    reads = removed = 0
    deadline = time.monotonic() + 6
    try:
        while time.monotonic() < deadline:
            try:
                got = ucp.load(url)
            except ucp.CheckpointNotFoundError:
                removed += 1
                continue
            reads += 1
            assert all(torch.equal(a, b) for a, b in zip(got["model"].values(), state(got["seed"])["model"].values()))
    finally:
        stop.set()
        writer.join()
    print(f"reads {reads}, removed while read {removed}, saves {len(saved)}")
    assert reads > 0 and len(saved) > 5, (reads, removed, len(saved))
