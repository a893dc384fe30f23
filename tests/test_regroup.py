"""How the survivors of a lost node agree on who is left (trainer/regroup.py), through a real TCPStore, with
threads standing in for the processes of two or three simulated nodes."""

from __future__ import annotations

import datetime
import threading
import time

import pytest
import torch.distributed as dist

from trainer.launch import free_port
from trainer.regroup import Regroup, RegroupError


@pytest.fixture
def store_address():
    port = free_port()
    server = dist.TCPStore(
        "127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=30)
    )
    yield f"127.0.0.1:{port}"
    del server


def regroup_all(
    address: str,
    world: int,
    per_node: int,
    arrivals: dict[int, float],
    settle_s: float = 0.3,
    incarnation: str = "one",
):
    """Ranks in `arrivals` (rank -> seconds after the start) register; returns rank -> (new rank, size) or error."""
    parties = {
        rank: Regroup(
            address,
            rank,
            world,
            10,
            incarnation=incarnation,
            settle_s=settle_s,
            node=(f"node{rank // per_node}", per_node),
        )
        for rank in arrivals
    }
    results: dict[int, object] = {}

    def run(rank: int) -> None:
        time.sleep(arrivals[rank])
        try:
            new_rank, size, _ = parties[rank].survivors()
            results[rank] = (new_rank, size)
        except RegroupError as e:
            results[rank] = e

    threads = [threading.Thread(target=run, args=(r,)) for r in arrivals]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return results


def test_a_survivor_waits_for_the_rest_of_its_node_however_late(store_address):
    # node 1 (ranks 2, 3) is lost; rank 1 learns of it 3 settle times after rank 0 (blocked on rank 0 meanwhile)
    results = regroup_all(store_address, 4, 2, {0: 0.0, 1: 1.0})
    assert results == {0: (0, 2), 1: (1, 2)}


def test_survivors_are_ranked_in_their_old_order_whoever_comes_first(store_address):
    # three nodes of two, the middle one lost
    results = regroup_all(store_address, 6, 2, {5: 0.0, 4: 0.05, 0: 0.1, 1: 0.15})
    assert results == {0: (0, 4), 1: (1, 4), 4: (2, 4), 5: (3, 4)}


def test_a_node_that_arrives_after_the_count_restarts_and_the_rest_go_on(store_address):
    results = regroup_all(store_address, 6, 2, {0: 0.0, 1: 0.0, 4: 2.0, 5: 2.0})
    assert results[0] == (0, 2) and results[1] == (1, 2)
    assert isinstance(results[4], RegroupError) and "after the survivors were counted" in str(results[4])


def test_a_failure_that_loses_nobody_is_not_regrouped(store_address):
    results = regroup_all(store_address, 4, 2, {0: 0.0, 1: 0.0, 2: 0.0, 3: 0.1})
    assert all(isinstance(r, RegroupError) and "not a lost peer" in str(r) for r in results.values()), results


def test_a_second_failure_regroups_again_among_the_new_ranks(store_address):
    parties = {
        r: Regroup(store_address, r, 6, 10, incarnation="one", settle_s=0.3, node=(f"node{r // 2}", 2))
        for r in range(4)
    }
    out: dict[int, tuple[int, int]] = {}

    def twice(rank: int) -> None:
        out[rank] = parties[rank].survivors()[:2]  # node 2 (ranks 4, 5) lost
        if rank >= 2:  # then node 1 is lost too
            return
        out[rank] = parties[rank].survivors()[:2]

    threads = [threading.Thread(target=twice, args=(r,)) for r in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert out == {0: (0, 2), 1: (1, 2), 2: (2, 4), 3: (3, 4)}


def test_each_incarnation_of_the_job_counts_its_survivors_apart(store_address):
    # the store outlives a restart: the next incarnation (the same ranks, new processes) must not read the old count
    first = regroup_all(store_address, 4, 2, {0: 0.0, 1: 0.0})
    second = regroup_all(store_address, 6, 2, {0: 0.0, 1: 0.0, 2: 0.0, 3: 0.0}, incarnation="two")
    assert first == {0: (0, 2), 1: (1, 2)}
    assert second == {0: (0, 4), 1: (1, 4), 2: (2, 4), 3: (3, 4)}, second
