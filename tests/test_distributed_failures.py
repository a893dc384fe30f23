"""A distributed save in which one rank fails: every rank raises the same error (no rank waits forever for the
failed one), nothing is committed, the attempt is removed; the next save commits; a committed step is refused on
every rank."""

from __future__ import annotations

import json
import os
import signal

import pytest
import torch

import ucp
from ucp.distributed import ShardedModel, load_sharded
from ucp.format.manifest import step_dirname
from ucp.sharding.layout import parse_layout
from ucp.sharding.reshard import shard

from .dist_worker import CONFIG, STATES, full_state
from .launch import spawn


def test_one_rank_out_of_space_fails_every_rank_and_commits_nothing(tmp_path):
    url, out = str(tmp_path / "ckpt"), tmp_path / "out"
    out.mkdir()
    spawn(["-m", "tests.dist_fail_worker", url, str(out)], world=2, timeout=120)
    results = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    for rank, r in enumerate(results):
        kind, message = r["failed"]
        assert kind == "StorageError" and "step 1 was not saved" in message and "rank 1 failed" in message, (
            rank,
            message,
        )
        assert "No space left" in message
        kind, message = r["interop"]
        assert kind == "InteropError" and "rank 1 failed" in message and "refused by this rank's source" in message
        kind, message = r["both"]
        assert "ranks 0, 1 failed" in message and "No space left" in message and "InteropError" in message, message
        assert r["again"] is not None and "step 1" in r["again"]
    assert results[0]["committed_after_failure"] == []
    assert ucp.CheckpointManager(url).steps() == [1]
    assert results[0]["second"] == 1 and results[1]["second"] is None
    assert [n for n in os.listdir(tmp_path / "ckpt" / step_dirname(1)) if n.startswith("attempt-")] == [
        ucp.open_checkpoint(url).record.attempt
    ]
    layout = parse_layout("tp2")
    for rank in range(2):
        local, _ = load_sharded(ucp.open_checkpoint(url), ShardedModel(CONFIG, layout, STATES), rank)
        expected = shard(full_state(), CONFIG, layout, rank, STATES)
        assert all(torch.equal(local["model"][k], v) for k, v in expected["model"].items())


@pytest.mark.parametrize("scenario, world", [("save", 2), ("drain", 4)])
def test_a_peer_killed_in_a_save_fails_every_survivor_promptly_with_a_peer_lost_error(tmp_path, scenario, world):
    """A rank SIGKILLed during a save (its chunk writes; the hot tier's drain to durable storage, after the step's
    commit): every other rank raises PeerLostError within seconds (gloo's own RuntimeError before, naming no step;
    in the drain, the one rank that saw the loss went on to its next save and the others waited for it for good)."""
    from trainer.launch import kill, start

    url, out = str(tmp_path / "ckpt"), tmp_path / "out"
    out.mkdir()
    procs = start(["-m", "tests.save_fault_worker", scenario, url, str(out)], world, tmp_path / "logs")
    dead = 1 if scenario == "save" else 3
    try:
        for proc in procs:
            proc.wait(timeout=150)
    finally:
        kill(procs)
    logs = {r: (tmp_path / "logs" / f"rank{r}.log").read_text()[-1500:] for r in range(world)}
    assert procs[dead].returncode == -signal.SIGKILL, logs[dead]
    for rank in range(world):
        if rank == dead:
            continue
        assert procs[rank].returncode == 0, logs[rank]
        kind, message = json.loads((out / f"rank{rank}.json").read_text())
        assert kind == "PeerLostError" and f"rank {rank} of {world}" in message, (rank, kind, message)
        if scenario == "drain":
            assert "step 2 at" in message and "is committed, but the work after its commit lost a peer" in message


@pytest.mark.parametrize("scenario", ["replica", "readback"])
def test_a_ranks_own_failure_after_a_commit_keeps_it_in_step_with_the_others(tmp_path, scenario):
    """One rank cannot keep the replicas it receives (its node's disk full), or another cannot read back what it
    wrote to send it: each logs that and still runs the rest of the work after the commit with the others (the
    transfers, publication, the drain to the durable URL): no rank waits for it, and every step reaches the durable
    URL."""
    from trainer.launch import kill, start

    url, out = str(tmp_path / "ckpt"), tmp_path / "out"
    out.mkdir()
    procs = start(["-m", "tests.save_fault_worker", scenario, url, str(out)], 4, tmp_path / "logs")
    try:
        for proc in procs:
            proc.wait(timeout=150)
    finally:
        kill(procs)
    logs = {r: (tmp_path / "logs" / f"rank{r}.log").read_text() for r in range(4)}
    for rank in range(4):
        assert procs[rank].returncode == 0 and json.loads((out / f"rank{rank}.json").read_text()) is None, logs[rank]
    failing, said = (2, "replicas not kept") if scenario == "replica" else (1, "not replicated to rank 3")
    assert said in logs[failing] and "step 2" in logs[failing], logs[failing][-2000:]
    assert ucp.CheckpointManager(url).steps() == [1, 2, 3, 4]
    layout = parse_layout("tp2pp2")
    for rank in range(4):
        local, _ = load_sharded(ucp.open_checkpoint(url, 2), ShardedModel(CONFIG, layout, STATES), rank)
        expected = shard(full_state(2), CONFIG, layout, rank, STATES)
        assert all(torch.equal(local["model"][k], v) for k, v in expected["model"].items())
