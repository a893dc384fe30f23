"""The hot tier with real processes (gloo) on simulated nodes (one local directory per node): saves commit in
node-local storage with a replica on the next node and drain to the durable URL; restores read their own node's
copies, receive the rest from other nodes over the process group, and fall back to the durable URL only for what no
survivor holds intact."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

import ucp
from ucp.format.manifest import step_dirname

from .helpers import DRAW, damage_atom
from .launch import spawn


def run(
    action: str,
    url: str,
    layout: str,
    node_dirs: list[Path],
    tmp: Path,
    steps: str = "0",
    durable_every: int = 1,
    bad_into_rank: int | None = None,
) -> list[dict]:
    out = tmp / f"out-{action}-{len(list(tmp.glob('out-*')))}"
    out.mkdir()
    env = {"UCP_TEST_NODE_DIRS": json.dumps([str(d) for d in node_dirs]), "UCP_TEST_DURABLE_EVERY": str(durable_every)}
    if bad_into_rank is not None:
        env["UCP_TEST_BAD_INTO_RANK"] = str(bad_into_rank)
    spawn(["-m", "tests.tier_worker", action, url, layout, str(out), steps], world=len(node_dirs), env=env, timeout=240)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(len(node_dirs))]


def run_dir(node: Path) -> Path:
    (sub,) = node.iterdir()  # <local_dir>/run-<hash of the durable URL>
    return sub


@pytest.mark.slow
def test_a_lost_node_is_restored_from_its_replica_and_a_new_node_from_its_peers(tmp_path):
    url = str(tmp_path / "durable")
    a, b, c = tmp_path / "node-a", tmp_path / "node-b", tmp_path / "node-c"
    run("save", url, "tp2pp2", [a, a, b, b], tmp_path, steps="1,2,3", durable_every=2)
    assert ucp.CheckpointManager(url).steps() == [2], "only every second save drains to the durable URL"
    for node in (a, b):  # two hot steps kept per node
        assert sorted(p.name for p in run_dir(node).glob("step_*")) == [step_dirname(2), step_dirname(3)]

    shutil.rmtree(b)  # node b is lost, with its local directory
    results = run("restore", url, "tp2pp1", [a, a], tmp_path)
    for r in results:
        assert r["step"] == 3 and r["source"] == "hot" and r["exact"] and r["extra_ok"], r
        assert r["durable"] == 0 and r["peers"] == 0 and r["local"] > 0, r  # b's objects came from its replica on a

    results = run("restore", url, "tp2pp2", [a, a, c, c], tmp_path)  # the job grows back: node c is new and empty
    for rank, r in enumerate(results):
        assert r["step"] == 3 and r["source"] == "hot" and r["exact"] and r["durable"] == 0, r
        if rank >= 2:
            assert r["peers"] > 0 and r["local"] == 0, r  # c holds nothing: everything came over the process group


def test_a_node_and_its_replica_holder_lost_the_durable_url_serves_the_rest(tmp_path):
    url = str(tmp_path / "durable")
    a, b, c = tmp_path / "node-a", tmp_path / "node-b", tmp_path / "node-c"
    run("save", url, "tp1pp1dp3", [a, b, c], tmp_path, steps="1")  # ring a -> b -> c -> a: b's replicas are on c
    shutil.rmtree(b)
    shutil.rmtree(c)
    (r,) = run("restore", url, "tp1pp1", [a], tmp_path)
    assert r["step"] == 1 and r["source"] == "hot" and r["exact"] and r["extra_ok"], r
    assert r["local"] > 0 and r["durable"] > 0 and r["peers"] == 0, r  # a's and c's objects hot, b's from the URL


def test_the_saves_before_a_drain_are_counted_across_restarts(tmp_path):
    """`durable_every` counts the hot saves since the last drain, not those of one manager: a job restarted more
    often than every `durable_every` saves still drains (each node keeps the count; a new node's is the others')."""
    url = str(tmp_path / "durable")
    a, b, c = tmp_path / "node-a", tmp_path / "node-b", tmp_path / "node-c"
    every = DRAW.choice([3, 4])
    for step in range(1, every):  # a job restarted after each save
        run("save", url, "tp1pp1dp2", [a, b], tmp_path, steps=str(step), durable_every=every)
    assert ucp.CheckpointManager(url).steps() == []
    shutil.rmtree(a)  # rank 0's node is lost with its count: node b's holds
    run("save", url, "tp1pp1dp2", [c, b], tmp_path, steps=f"{every},{every + 1}", durable_every=every)
    assert ucp.CheckpointManager(url).steps() == [every], f"the {every}th save drains, the one after it does not"
    for node in (c, b):
        assert json.loads((run_dir(node) / "undrained.json").read_text()) == {"saves": 1}

    (run_dir(b) / "undrained.json").write_text("{damaged")  # a damaged count: a drain is due
    shutil.rmtree(c)
    run("save", url, "tp1pp1dp2", [c, b], tmp_path, steps=str(every + 2), durable_every=every)
    assert ucp.CheckpointManager(url).steps() == [every, every + 2]


def test_a_damaged_hot_copy_is_replaced_by_a_good_one_and_reported(tmp_path):
    url = str(tmp_path / "durable")
    a, b = tmp_path / "node-a", tmp_path / "node-b"
    run("save", url, "tp1pp1dp2", [a, b], tmp_path, steps="1", durable_every=5)  # hot only: no durable copy
    assert ucp.CheckpointManager(url).steps() == []
    hot = ucp.open_checkpoint(str(run_dir(a)))  # the embedding's object (its pack, where it is packed)
    damage_atom(run_dir(a), next(p for p in hot.atoms if p.startswith("model/") and "embed_tokens" in p))
    results = run("restore", url, "tp1pp1dp2", [a, b], tmp_path)
    for r in results:
        assert r["step"] == 1 and r["source"] == "hot" and r["exact"] and r["durable"] == 0, r
        assert any("embed_tokens" in d and "checksum" in d for d in r["damaged"]), r["damaged"]
    assert results[0]["peers"] > 0, "node a's damaged object came from node b's copy"


def test_with_no_hot_copy_left_the_durable_url_serves_everything(tmp_path):
    url = str(tmp_path / "durable")
    a, b, c = tmp_path / "node-a", tmp_path / "node-b", tmp_path / "node-c"
    run("save", url, "tp2pp1", [a, b], tmp_path, steps="4,6", durable_every=1)
    shutil.rmtree(a)
    shutil.rmtree(b)
    results = run("restore", url, "tp1pp1dp2", [c, c], tmp_path)
    for r in results:
        assert r["step"] == 6 and r["source"] == "durable" and r["exact"] and r["local"] == 0 and r["peers"] == 0, r


@pytest.mark.slow
def test_a_hot_step_the_survivors_cannot_cover_gives_way_to_the_durable_one_and_is_redone(tmp_path):
    url = str(tmp_path / "durable")
    a, b, c = tmp_path / "node-a", tmp_path / "node-b", tmp_path / "node-c"
    run("save", url, "tp1pp1dp3", [a, b, c], tmp_path, steps="1,2,3", durable_every=2)  # step 3: hot only
    assert ucp.CheckpointManager(url).steps() == [2]
    shutil.rmtree(b)
    shutil.rmtree(c)
    (r,) = run("restore", url, "tp1pp1", [a], tmp_path, steps="3")  # then the job saves step 3 again
    assert r["step"] == 2 and r["exact"], r  # (step 2 is hot on a, and durable: what a lacks comes from the URL)
    (r,) = run("restore", url, "tp1pp1", [a], tmp_path)
    assert r["step"] == 3 and r["source"] == "hot" and r["exact"], r  # the redone step 3, not the lost one


def test_a_rank_whose_load_is_refused_still_serves_its_peers_then_raises(tmp_path):
    """A rank whose read plan is refused (here: an `into` tensor of another shape) takes its part in the exchange of
    objects between nodes, so that the others restore, and then raises the refusal: nobody waits for it forever."""
    url = str(tmp_path / "durable")
    a, b = tmp_path / "node-a", tmp_path / "node-b"
    run("save", url, "tp1pp1dp2", [a, b], tmp_path, steps="1", durable_every=5)  # hot only: b's objects only on b
    shutil.rmtree(a)
    # the refused rank is on node b, which holds every copy left: the rank on the new node c needs all of it
    results = run("restore", url, "tp1pp1dp2", [tmp_path / "node-c", b], tmp_path, bad_into_rank=1)
    assert results[1]["error"] == "StateError" and "cannot load into model/" in results[1]["message"], results
    good = results[0]
    assert good["step"] == 1 and good["source"] == "hot" and good["exact"] and good["peers"] > 0, good
    assert good["durable"] == 0 and good["local"] == 0, good


@pytest.mark.parametrize("world", [2, 3])
def test_peer_transfers_of_several_batches_arrive_whole(world):
    """The rounds that replicate a save and restore from peers (send_rounds) with random transfers over gloo: 0-4
    batches per pair of ranks (a rank's objects beyond the batch size are sent in several), every item arrives, in
    order. Before the fix, a peer told "no more" one batch early hung the save of any rank with two batches or more
    (seen with a 2 GiB state on 4 processes: 256 MiB batches)."""
    outputs = spawn(["tests/rounds_worker.py", str(DRAW.randrange(1 << 30)), "20"], world, timeout=120)
    assert all("ok: 20 trials" in out for out in outputs)


@pytest.mark.parametrize("seed", [DRAW.randrange(1 << 30) for _ in range(3)])
def test_each_rank_keeps_the_replicas_of_exactly_the_ranks_whose_buddy_it_is(seed):
    """`Nodes.senders_to` answers from the rank's node alone (it was a scan of the world per rank: O(W^2) over a job);
    it must stay the inverse of `buddy` for nodes of any sizes and in any order of ranks."""
    import random

    from ucp.distributed.tiers import Nodes

    rng = random.Random(seed)
    count, world = rng.randrange(1, 7), rng.randrange(1, 60)
    node_of = [rng.randrange(count) for _ in range(world)]
    order = {n: i for i, n in enumerate(dict.fromkeys(node_of))}  # (nodes numbered by their lowest rank)
    nodes = Nodes(tuple(order[n] for n in node_of))
    for rank in range(world):
        assert nodes.senders_to(rank) == [r for r in range(world) if nodes.buddy(r) == rank], (node_of, rank)
        assert nodes.is_leader(rank) == (nodes.leader(nodes.node_of[rank]) == rank)
        if nodes.count > 1:
            assert nodes.node_of[nodes.buddy(rank)] == (nodes.node_of[rank] + 1) % nodes.count


def test_hot_steps_of_a_durable_root_removed_and_made_again_are_never_restored(tmp_path):
    """A job that starts over (its durable root removed) on nodes whose local directories still hold the old run's
    hot steps starts fresh: those steps are another root's (the root's id differs), removed, not restored."""
    url = str(tmp_path / "durable")
    a, b = tmp_path / "node-a", tmp_path / "node-b"
    run("save", url, "tp1pp1dp2", [a, b], tmp_path, steps="1,2", durable_every=5)  # hot only
    shutil.rmtree(url)
    for r in run("restore", url, "tp1pp1dp2", [a, b], tmp_path):
        assert r["step"] is None, r
    for node in (a, b):
        assert not list(run_dir(node).glob("step_*")), "the other root's steps are removed"
    run("save", url, "tp1pp1dp2", [a, b], tmp_path, steps="1", durable_every=5)  # the new run saves its own step 1
    for r in run("restore", url, "tp1pp1dp2", [a, b], tmp_path):
        assert r["step"] == 1 and r["source"] == "hot" and r["exact"], r


def test_a_relative_durable_path_names_the_hot_tier_of_its_absolute_place(tmp_path, monkeypatch):
    from ucp.distributed.tiers import HotTier
    from ucp.storage import open_storage

    node = tmp_path / "node"
    homes = [tmp_path / "job-a", tmp_path / "job-b"]
    places = []
    for home in homes:
        home.mkdir()
        monkeypatch.chdir(home)
        places.append(HotTier(str(node), open_storage("ckpt"), None).storage.url)
    assert places[0] != places[1], "two jobs' 'ckpt' are two durable roots, two hot tiers"


def test_a_damaged_manifest_on_the_first_holder_is_read_from_another_node(tmp_path):
    url = str(tmp_path / "durable")
    a, b = tmp_path / "node-a", tmp_path / "node-b"
    run("save", url, "tp1pp1dp2", [a, b], tmp_path, steps="1,2", durable_every=5)  # hot only
    (manifest,) = run_dir(a).glob(f"{step_dirname(2)}/attempt-*/zarr.json")
    manifest.write_bytes(manifest.read_bytes()[: DRAW.randrange(1, manifest.stat().st_size)])  # cut short on a
    for r in run("restore", url, "tp1pp1dp2", [a, b], tmp_path):
        assert r["step"] == 2 and r["source"] == "hot" and r["exact"] and r["durable"] == 0, r


def test_a_pack_damaged_on_a_node_in_chunks_a_rank_does_not_read_is_still_read_there(tmp_path):
    """A rank reads a pack from its own node if every chunk it reads of the pack is intact there, whatever the
    pack's other chunks (damaged here, intact on another node) are."""
    url = str(tmp_path / "durable")
    a, b = tmp_path / "node-a", tmp_path / "node-b"
    run("save", url, "tp1pp1dp2", [a, b], tmp_path, steps="1", durable_every=5)  # hot only: no durable copy
    hot = ucp.open_checkpoint(str(run_dir(a)))
    members: dict[str, list[str]] = {}
    for path, chunks in hot.manifest.packed.items():
        members.setdefault(chunks[0].pack, []).append(path)
    # tp1pp2 on 4 layers: rank 0 (node a) reads layers 0-1, rank 1 (node b) layers 2-3
    last = []
    for paths in members.values():
        late = [p for p in paths if ".layers.3." in p]
        if late and any(".layers.0." in p or ".layers.1." in p for p in paths):
            last.append(DRAW.choice(late))
    assert last, "a pack holds atoms of both stages"
    damage_atom(run_dir(a), last[0])
    results = run("restore", url, "tp1pp2", [a, b], tmp_path)
    for r in results:
        assert r["step"] == 1 and r["source"] == "hot" and r["exact"] and r["durable"] == 0, r
    assert any(last[0] in d for d in results[0]["damaged"]), results[0]["damaged"]
    assert results[0]["peers"] == 0, "rank 0 read its whole stage on its own node"


def test_a_single_process_restore_reads_a_damaged_hot_step_from_the_durable_url(tmp_path):
    url, local = str(tmp_path / "durable"), str(tmp_path / "shm")
    state = {f"w{i}": torch.randn(DRAW.randrange(1, 300)) for i in range(5)}
    with ucp.CheckpointManager(url, local_dir=local, durable_every=1) as manager:
        manager.save(1, {"w": torch.zeros(2)})
        manager.save(2, state)
        damage_atom(manager.hot.storage.url, DRAW.choice(sorted(state)))
        restored = manager.restore()
    assert restored.keys() == state.keys() and all(torch.equal(restored[k], v) for k, v in state.items())

    url2 = str(tmp_path / "durable-2")
    with ucp.CheckpointManager(url2, local_dir=local, durable_every=5) as manager:  # the hot copy is the only one
        manager.save(2, state)
        damage_atom(manager.hot.storage.url, "w0")
        with pytest.raises(ucp.IntegrityError, match=rf"hot tier .*step 2 is damaged and {url2} lacks it"):
            manager.restore()
