"""Distributed save and load with real processes (gloo), and with virtual ranks in one process."""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch

import ucp
from ucp.distributed import ShardedModel, VirtualWorld, atom_path, load_sharded
from ucp.engine.checkpoint import CheckpointReader
from ucp.format.manifest import chunk_indices
from ucp.sharding.families import MixtralConfig, canonical_atoms
from ucp.sharding.layout import parse_layout
from ucp.sharding.reshard import shard
from ucp.storage import open_storage

from .dist_worker import CONFIG, OPTIONS, STATES, full_state, same
from .launch import spawn

LOAD_LAYOUTS = "tp4pp1,tp1pp4,tp1pp1dp4zero1,tp1pp2ep2dp2"


def run_world(url: str, out_dir, env: dict | None = None) -> list[dict]:
    """Save in tp2pp2 with four processes (`env`: UCP_TEST_SAVE_MODE async or lazy saves through a manager), then
    load in each of LOAD_LAYOUTS."""
    spawn(["-m", "tests.dist_worker", url, "tp2pp2", LOAD_LAYOUTS, str(out_dir)], world=4, env=env)
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(4)]


def check_world(results: list[dict], reader: CheckpointReader) -> None:
    # every chunk object of every atom was written exactly once, by one rank, and nothing else twice
    writes = Counter(key for r in results for key in r["writes"])
    assert max(writes.values()) == 1, [k for k, n in writes.items() if n > 1][:5]
    for meta in reader.atoms.values():
        for index in chunk_indices(meta.grid):
            assert writes[reader.object_key(meta, index)] == 1, meta.path  # (a packed atom's: its pack)
    writers = Counter(i for i, r in enumerate(results) for key in r["writes"] if "/c." in key)
    assert len(writers) == 4, f"every rank writes a share, got {writers}"
    packers = {name.rsplit("-", 1)[0] for name in reader.manifest.packs}  # ucp-packs/p<rank>-<n>: each packs its own
    assert reader.manifest.packed and any(not m.packed for m in reader.atoms.values())
    assert len(packers) == 4, f"every rank packs what it writes, got {sorted(reader.manifest.packs)}"
    for layout in LOAD_LAYOUTS.split(","):
        for rank, r in enumerate(results):
            load = r["loads"][layout]
            assert load["exact"], f"rank {rank} loaded {layout} wrong"
            assert load["amplification"] <= 1.25, (
                f"rank {rank} {layout}: read amplification {load['amplification']:.2f}"
            )
            assert load["extra"] == {"iteration": 7, "data": {"consumed": 123}}
    full = full_state()
    assert reader.manifest.layout == "tp2pp2"
    loaded = reader.read_atoms([atom_path(n, None) for n in canonical_atoms(CONFIG)])
    assert all(torch.equal(loaded[atom_path(n, None)], t) for n, t in full["model"].items())


def test_save_tp2pp2_with_four_processes_and_load_in_other_layouts(tmp_path):
    url = str(tmp_path / "ckpt")
    out = tmp_path / "out"
    out.mkdir()
    check_world(run_world(url, out), CheckpointReader(open_storage(url), "latest"))


@pytest.mark.parametrize("mode", ["async", "lazy"])
def test_an_async_save_with_four_processes_packs_what_each_rank_writes_and_loads_in_other_layouts(tmp_path, mode):
    url = str(tmp_path / "ckpt")
    out = tmp_path / "out"
    out.mkdir()
    results = run_world(url, out, env={"UCP_TEST_SAVE_MODE": mode})
    check_world(results, CheckpointReader(open_storage(url), "latest"))


@pytest.mark.slow
def test_the_same_on_s3(s3_bucket, tmp_path):
    bucket, options = s3_bucket
    url = f"s3://{bucket}/dist"
    check_world(
        run_world(url, tmp_path, env={"UCP_TEST_STORAGE_OPTIONS": json.dumps(options)}),
        CheckpointReader(open_storage(url, options), "latest"),
    )


def test_virtual_ranks_tp8pp4_read_back_as_tp4pp8_and_tp2pp4ep4dp4zero1(tmp_path):
    config = MixtralConfig(
        vocab_size=1000,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=8,
        num_local_experts=4,
        make_vocab_size_divisible_by=8,
    )
    g = torch.Generator().manual_seed(1)
    atoms = canonical_atoms(config)
    full = {
        "model": {n: torch.randn(s, generator=g) for n, (s, _) in atoms.items()},
        "optimizer": {"state": {n: {st: torch.randn(s, generator=g) for st in STATES} for n, (s, _) in atoms.items()}},
    }
    source = parse_layout("tp8pp4")
    VirtualWorld(32).save(
        [shard(full, config, source, r, STATES) for r in range(32)],
        str(tmp_path),
        step=1,
        model=ShardedModel(config, source, STATES),
        options=OPTIONS,
    )
    reader = ucp.open_checkpoint(str(tmp_path))
    for name in ("tp4pp8", "tp2pp4ep4dp4zero1"):
        target = parse_layout(name)
        for rank in range(target.world_size):
            local, report = load_sharded(reader, ShardedModel(config, target, STATES), rank)
            assert same(local, shard(full, config, target, rank, STATES)), (name, rank)
            assert report.amplification <= 1.25, (name, rank, report.amplification)


def test_weights_only_load_in_another_dtype(tmp_path):
    layout = parse_layout("tp2pp1")
    full = full_state()
    VirtualWorld(2).save(
        [shard(full, CONFIG, layout, r, STATES) for r in range(2)],
        str(tmp_path),
        step=1,
        model=ShardedModel(CONFIG, layout, STATES),
        options=OPTIONS,
    )
    target = parse_layout("tp1pp1")
    local, _ = load_sharded(
        ucp.open_checkpoint(str(tmp_path)), ShardedModel(CONFIG, target, ()), 0, dtype=torch.bfloat16
    )
    expected = shard({"model": full["model"]}, CONFIG, target, 0, ())
    assert "optimizer" not in local
    for name, t in expected["model"].items():
        assert local["model"][name].dtype == torch.bfloat16
        assert torch.equal(local["model"][name], t.to(torch.bfloat16)), name


def test_an_optional_state_is_read_where_the_step_has_it_and_left_out_where_it_has_none(tmp_path):
    """A job that restores from checkpoints with and without fp32 master weights asks for them as optional."""
    full = full_state()
    for name, states in full["optimizer"]["state"].items():
        states["master"] = full["model"][name].clone()
    saved_in, load_in = parse_layout("tp2pp1dp2zero1"), parse_layout("tp1pp2dp2zero1")
    for states, url in ((STATES, tmp_path / "without"), ((*STATES, "master"), tmp_path / "with")):
        VirtualWorld(saved_in.world_size).save(
            [shard(full, CONFIG, saved_in, r, states) for r in range(saved_in.world_size)],
            str(url),
            step=1,
            model=ShardedModel(CONFIG, saved_in, states),
            options=OPTIONS,
        )
    asking = ShardedModel(CONFIG, load_in, STATES, optional_states=("master",))
    for rank in range(load_in.world_size):
        without, _ = load_sharded(ucp.open_checkpoint(str(tmp_path / "without")), asking, rank)
        assert same(without, shard(full, CONFIG, load_in, rank, STATES)), rank
        with_, _ = load_sharded(ucp.open_checkpoint(str(tmp_path / "with")), asking, rank)
        assert same(with_, shard(full, CONFIG, load_in, rank, (*STATES, "master"))), rank
        assert set(with_["optimizer"]["flat"]["dense"]) == {*STATES, "master"}


def test_a_checkpoint_of_another_model_is_refused(tmp_path):
    layout = parse_layout("tp1pp1")
    VirtualWorld(1).save(
        [shard(full_state(), CONFIG, layout, 0, STATES)],
        str(tmp_path),
        step=1,
        model=ShardedModel(CONFIG, layout, STATES),
        options=OPTIONS,
    )
    bigger = MixtralConfig(**{**CONFIG.to_json(), "hidden_size": 128})
    with pytest.raises(ucp.FormatError, match="has shape .* but the model config needs"):
        load_sharded(ucp.open_checkpoint(str(tmp_path)), ShardedModel(bigger, layout, STATES), 0)
    more_layers = MixtralConfig(**{**CONFIG.to_json(), "num_hidden_layers": 6})
    with pytest.raises(ucp.FormatError, match="has no atom 'model/model.layers.4"):
        load_sharded(ucp.open_checkpoint(str(tmp_path)), ShardedModel(more_layers, layout, STATES), 0)
