"""Distributed saves and loads over real gloo process groups with drawn inputs (tests/distributed_hunt_worker.py):
a drawn model of each family saved in a drawn layout with drawn dtypes and chunk sizes, loaded in other layouts,
every local tensor bitwise `shard` of the canonical state; one rank failing at a drawn point of a save; steps of
different world sizes in one root. Every case prints its draw on failure."""

from __future__ import annotations

import json
import os
import random
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import ucp
from ucp.distributed import LocalComm, ShardedModel, VirtualWorld, save_sharded
from ucp.errors import LayoutError, StateError
from ucp.sharding.families import FAMILIES, DeepseekV3Config, LlamaConfig, MixtralConfig, QwenMoeConfig
from ucp.sharding.layout import Layout, parse_layout
from ucp.sharding.reshard import local_plan, shard

from . import dist_worker
from .distributed_hunt_worker import misplan, tensors
from .helpers import DRAW
from .launch import spawn

STATES = {"exp_avg": "float32", "exp_avg_sq": "float32"}


def draw_config(rng: random.Random) -> tuple[str, Any]:
    """A small model of a drawn family: GQA or not, tied or untied embeddings, a vocabulary that pads."""
    heads = rng.choice([2, 4, 8])
    head_dim = rng.choice([4, 8])
    shape = {
        "vocab_size": rng.randrange(40, 200),
        "hidden_size": heads * head_dim,
        "num_hidden_layers": rng.randrange(2, 5),
        "num_attention_heads": heads,
        "tie_word_embeddings": rng.random() < 0.5,
        "make_vocab_size_divisible_by": rng.choice([4, 8, 128]),
    }
    kv = rng.choice([k for k in (1, 2, heads) if heads % k == 0])
    experts = rng.choice([2, 4, 6])
    family = rng.choice(["llama", "mixtral", "qwen_moe", "deepseek_v3"])
    if family == "llama":
        return family, LlamaConfig(
            intermediate_size=rng.choice([16, 24, 48]), num_key_value_heads=kv, qk_norm=rng.random() < 0.5, **shape
        )
    if family == "mixtral":
        return family, MixtralConfig(
            intermediate_size=rng.choice([16, 24, 48]), num_local_experts=experts, num_key_value_heads=kv, **shape
        )
    if family == "qwen_moe":
        return family, QwenMoeConfig(
            moe_intermediate_size=rng.choice([8, 16, 24]),
            shared_expert_intermediate_size=rng.choice([0, 16]),
            num_local_experts=experts,
            num_key_value_heads=kv,
            attention_bias=rng.random() < 0.5,
            **shape,
        )
    return family, DeepseekV3Config(
        intermediate_size=rng.choice([16, 24]),
        moe_intermediate_size=rng.choice([8, 16]),
        num_local_experts=experts,
        n_shared_experts=rng.randrange(0, 2),
        first_k_dense_replace=rng.randrange(0, 2),
        q_lora_rank=rng.choice([None, 16]),
        kv_lora_rank=8,
        qk_nope_head_dim=4,
        qk_rope_head_dim=4,
        v_head_dim=4,
        **shape,
    )


def fits(config: Any, layout: Layout) -> bool:
    try:
        for rank in range(layout.world_size):
            local_plan(config, layout, rank, ())
    except LayoutError:
        return False
    return True


def draw_layout(rng: random.Random, world: int | None = None) -> Layout:
    """A layout of `world` ranks (or of up to 8): tp, pp (virtual stages too), dp, ep, ZeRO."""
    while True:
        tp, pp = rng.choice([1, 2, 4]), rng.choice([1, 2])
        dp = world // (tp * pp) if world else rng.choice([1, 2, 4])
        if dp < 1 or tp * pp * dp != (world or tp * pp * dp) or tp * pp * dp > 8:
            continue
        ep = rng.choice([e for e in (1, 2, 4) if dp % e == 0])
        vpp = rng.choice([1, 2]) if pp > 1 else 1
        return Layout(tp=tp, pp=pp, vpp=vpp, ep=ep, dp=dp, zero=rng.choice([0, 1, 1, 3]))


def draw_case(seed: int, world: int) -> dict:
    """A save of a drawn model in a drawn layout of `world` ranks, loaded in drawn layouts (one of which may not fit
    the model: its load must be refused)."""
    rng = random.Random(seed)
    while True:
        family, config = draw_config(rng)
        save = next((s for s in (draw_layout(rng, world) for _ in range(50)) if fits(config, s)), None)
        if save is not None:
            break
    loads = [next(x for x in (draw_layout(rng) for _ in range(200)) if fits(config, x)) for _ in range(2)]
    misfit = next((x for x in (draw_layout(rng) for _ in range(200)) if not fits(config, x)), None)
    inner = rng.choice([64, 128, 256, 512])
    return {
        "seed": seed,
        "family": family,
        "config": config.to_json(),
        "save": str(save),
        "loads": [str(x) for x in loads] + ([str(misfit)] if misfit is not None else []),
        "misfit": str(misfit) if misfit is not None else None,
        "param_dtype": rng.choice(["float32", "bfloat16"]),
        "states": STATES,
        "chunking": {
            "object_bytes": inner * rng.choice([1, 2, 4, 16]),
            "inner_bytes": inner,
            "pack_below": rng.choice([0, 256, 1024, 4096]),
            "pack_bytes": rng.choice([512, 4096, 1 << 20]),
        },
        "steps": [1],
    }


def run(case: dict, world: int, tmp_path: Path, timeout: float = 240) -> list[dict]:
    out = tmp_path / f"out-{time.monotonic_ns()}"
    out.mkdir()
    spawn(["-m", "tests.distributed_hunt_worker", json.dumps(case), str(out)], world=world, timeout=timeout)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


def check_loads(case: dict, results: list[dict]) -> None:
    """Every load of a committed step equals `shard` of its canonical state; a layout that does not fit the model is
    refused in one line naming it."""
    for rank, result in enumerate(results):
        for key, found in result["loads"].items():
            name = key.split(":", 1)[1]
            if name == case["misfit"]:
                kind, message = found.get("error", [None, ""])
                assert kind == "LayoutError" and "\n" not in message and name in message, (rank, key, found)
            else:
                assert found == {}, (rank, key, found)


SEEDS = [DRAW.randrange(2**31) for _ in range(4)]


@pytest.mark.slow
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("world", [2, 3])
def test_drawn_models_layouts_and_chunkings_load_bitwise_in_other_layouts(tmp_path, seed, world):
    case = draw_case(seed, world) | {"url": str(tmp_path / "ckpt")}
    print("case:", json.dumps(case))
    results = run(case, world, tmp_path)
    for result in results:
        assert result["saves"] == {"1": None}, result["saves"]
        assert result["committed"] == [1]
        assert result["extra"]["1"] == {"scheduler": {"lr": 1e-4, "last_epoch": 1}, "data": {"consumed": [1, world]}}
    check_loads(case, results)


def draw_failure(seed: int, world: int, at: str, how: str) -> dict:
    """A drawn case whose step 2 fails on a drawn rank (`at`, `how`: tests/distributed_hunt_worker.py); steps 1
    and 3 save as usual."""
    rng = random.Random(seed)
    case = draw_case(seed, world)
    case["fail"] = {
        "step": 2,
        "rank": 0 if at == "commit" else rng.randrange(1 if at == "after" else 0, world),
        "at": at,
        "how": how,
        "nth": rng.randrange(1, 4),  # (every rank writes several objects; every commit, 3 or more)
    }
    case["steps"] = [1, 2, 3]
    case["timeout_s"] = TIMEOUT_S
    case["loads"], case["misfit"] = case["loads"][:1], None
    return case


TIMEOUT_S = 30  # the process group's: a failure must reach every rank well before it


def attempts(url: str, step: int) -> list[str]:
    where = Path(url) / f"step_{step:08d}"
    return sorted(n for n in os.listdir(where) if n.startswith("attempt-")) if where.exists() else []


RAISED = ["plan", "dtype", "shape", "write", "commit"]


@pytest.mark.slow
@pytest.mark.parametrize("at", RAISED)
def test_a_rank_failing_at_a_drawn_point_of_a_save_fails_every_rank_at_once_and_the_next_save_commits(tmp_path, at):
    """One rank's save fails (its plan refused: a tensor missing, of another dtype than the other ranks', of another
    shape; a chunk write; the coordinator's commit): every rank raises the same ucp error naming the step (and the
    failing rank) within seconds, nothing of the attempt stays, and the next save commits. A rank whose plan failed
    raised alone before: the others waited for it until the process group's timeout, then the next save failed too."""
    seed = DRAW.randrange(2**31)
    world = random.Random(seed).choice([2, 3])
    case = draw_failure(seed, world, at, "raise") | {"url": str(tmp_path / "ckpt")}
    print("case:", json.dumps(case))
    results = run(case, world, tmp_path)
    failing = case["fail"]["rank"]
    errors = [r["saves"]["2"] for r in results]
    for rank, result in enumerate(results):
        assert result["saves"]["1"] is None and result["saves"]["3"] is None, (rank, result["saves"])
        kind, message, seconds = errors[rank]
        assert [kind, message] == errors[0][:2], (rank, errors)
        assert kind != "PeerLostError" and seconds < TIMEOUT_S / 2, (rank, errors)
        assert "step 2" in message or "step_00000002" in message, message  # (a commit's error names its object)
        if at == "dtype":  # (the coordinator finds the ranks disagree: the first that differs from rank 0 named)
            assert "step 2 was not saved" in message and "other dtypes" in message, message
            assert f"on rank {failing or 1}" in message, message
        elif at != "commit":
            assert "step 2 was not saved" in message and f"rank {failing} failed" in message, message
        assert result["committed"] == [1, 3]
    assert attempts(case["url"], 2) == []
    check_loads(case, results)


@pytest.mark.slow
@pytest.mark.parametrize("at", ["plan", "write", "commit", "after"])
def test_a_rank_killed_at_a_drawn_point_of_a_save_fails_the_others_promptly_and_a_new_world_saves(tmp_path, at):
    """One rank SIGKILLed in a save (as it starts it, at a chunk write, the coordinator at its commit, or another rank
    after its writes while the coordinator commits): every survivor raises a PeerLostError within seconds, which says
    what it knows of the step (the coordinator that committed it says so: gloo's words alone told it that its save
    failed); the previous step loads; a job of another world size then saves the next steps into the same root."""
    from trainer.launch import kill, start

    seed = DRAW.randrange(2**31)
    rng = random.Random(seed)
    world = rng.choice([2, 3])
    case = draw_failure(seed, world, at, "kill") | {"url": str(tmp_path / "ckpt")}
    print("case:", json.dumps(case))
    out = tmp_path / "out"
    out.mkdir()
    procs = start(["-m", "tests.distributed_hunt_worker", json.dumps(case), str(out)], world, tmp_path / "logs")
    try:
        for proc in procs:
            proc.wait(timeout=180)
    finally:
        kill(procs)
    dead = case["fail"]["rank"]
    logs = {r: (tmp_path / "logs" / f"rank{r}.log").read_text()[-2000:] for r in range(world)}
    assert procs[dead].returncode == -signal.SIGKILL, logs[dead]
    committed = ucp.CheckpointManager(case["url"]).steps()
    assert committed == ([1, 2] if at == "after" else [1]), committed
    for rank in range(world):
        if rank == dead:
            continue
        assert procs[rank].returncode == 0, logs[rank]
        result = json.loads((out / f"rank{rank}.json").read_text())
        kind, message, seconds = result["saves"]["2"]
        assert kind == "PeerLostError" and f"rank {rank} of {world}" in message, (rank, message)
        assert seconds < TIMEOUT_S, (rank, seconds, message)
        if at == "after":
            said = "is committed" if rank == 0 else "may or may not have been committed"
            assert f"step 2 at {case['url']} {said}" in message, (rank, message)
    # a job of another world size goes on from the root: the step its predecessor lost, and one more
    world = 5 - world
    family, config = case["family"], FAMILIES[case["family"]].config_cls.from_json(case["config"])
    save = next(x for x in (draw_layout(rng, world) for _ in range(200)) if fits(config, x))
    steps = [3, 4] if at == "after" else [2, 3]
    again = case | {"save": str(save), "steps": steps, "fail": None}
    print("then:", family, save, steps)
    results = run(again, world, tmp_path)
    for result in results:
        assert all(v is None for v in result["saves"].values()), result["saves"]
        assert result["committed"] == sorted({*committed, *steps})
    check_loads(again, results)


def test_a_save_whose_plan_is_refused_leaves_no_attempt_and_no_lease_behind(tmp_path):
    """A local state that lacks a tensor is refused before any write; the attempt begun for it is removed and its
    lease no longer renewed (before: the attempt stayed, its lease renewed by a thread for the life of the process,
    so that garbage collection never took it)."""
    layout = parse_layout("tp1")
    local = shard(dist_worker.full_state(), dist_worker.CONFIG, layout, 0, dist_worker.STATES)
    local["model"].pop(next(iter(local["model"])))
    url = str(tmp_path / "ckpt")
    model = ShardedModel(dist_worker.CONFIG, layout, dist_worker.STATES)
    with pytest.raises(StateError, match="step 4 was not saved .*the local state has no model/"):
        save_sharded(local, url, step=4, model=model, comm=LocalComm(), options=dist_worker.OPTIONS)
    assert attempts(url, 4) == []
    assert not [t for t in threading.enumerate() if t.name == "ucp-lease"]


@pytest.mark.parametrize("wrong", ["dtype", "shape"])
def test_ranks_that_disagree_on_dtypes_or_hold_a_tensor_of_another_shape_are_refused(tmp_path, wrong):
    """One rank holds its parameters in bf16 where the others hold fp32, or a tensor of another shape than its layout
    gives it (say, its whole unsharded tensor): the save is refused, saying which. Before, the first committed a step
    that no load could read (chunks of another size than the manifest's), the second saved the wrong values."""
    rng = random.Random(DRAW.randrange(2**31))
    layout = parse_layout(rng.choice(["tp2", "tp2pp2", "tp1pp1dp2zero1", "tp2pp1dp2zero3"]))
    full = dist_worker.full_state()
    local = [shard(full, dist_worker.CONFIG, layout, r, dist_worker.STATES) for r in range(layout.world_size)]
    rank = rng.randrange(layout.world_size)
    where, key = rng.choice(tensors(local[rank]))
    if wrong == "dtype":
        misplan(local[rank], "dtype")  # (every tensor of the rank: one alone is refused by the rank itself)
    else:
        where[key] = torch.cat([where[key], where[key]], dim=rng.randrange(where[key].dim()))
    print("layout", layout, "rank", rank, "tensor", key)
    said = "other dtypes" if wrong == "dtype" else f"has shape .* but rank {rank} of {layout} holds"
    with pytest.raises(StateError, match=said):
        VirtualWorld(layout.world_size).save(
            local, str(tmp_path), step=1, model=ShardedModel(dist_worker.CONFIG, layout, dist_worker.STATES)
        )
    assert ucp.CheckpointManager(str(tmp_path)).steps() == []
