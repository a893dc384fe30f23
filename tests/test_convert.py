"""Megatron-LM torch checkpoints: resharded through atoms, checked against Megatron-Core's own GPT/MoE modules."""

from __future__ import annotations

import argparse
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import ucp
from ucp import cli as ucp_cli
from ucp.distributed import ShardedModel, extra_state, load_sharded
from ucp.interop import torch_file
from ucp.interop.errors import InteropError, SourceMismatchError
from ucp.interop.megatron.convert import convert
from ucp.interop.megatron.files import load_rank_file
from ucp.interop.megatron.optimizer import read_optimizer
from ucp.interop.megatron.save import RANK_FILE, parse_megatron_layout, rank_files
from ucp.sharding.families import canonical_atoms
from ucp.sharding.reshard import DEFAULT_STATES, shard

from .helpers import DRAW
from .launch import spawn
from .test_hf import random_full_state, save_in_layout, tiny_config


def run_megatron(mode: str, ckpt: Path, out: Path, world: int = 1) -> None:
    """tests/megatron_worker.py in a world of its own (torch.distributed and Megatron's parallel state are
    process-global): builds Megatron-Core's own model and optimizer on CPU, saves or loads rank files."""
    spawn(["tests/megatron_worker.py", mode, str(ckpt), str(out)], world, timeout=300, env={"PYTHONWARNINGS": "ignore"})


def assert_bitwise_equal(a: Any, b: Any, where: str = "") -> None:
    """Nested dicts (in any key order), lists and tuples of tensors, arrays and plain values: same structure,
    types and bits."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and (a.dtype, a.shape) == (b.dtype, b.shape) and torch.equal(a, b), where
    elif isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), (where, list(a), b if not isinstance(b, dict) else list(b))
        for k in a:
            assert_bitwise_equal(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), (where, a, b)
        for i, (x, y) in enumerate(zip(a, b)):
            assert_bitwise_equal(x, y, f"{where}[{i}]")
    else:
        assert type(a) is type(b) and a == b, (where, a, b)


def megatron_file(ckpt: Path, name: str, iteration: int = 10) -> dict:
    return load_rank_file(ckpt / f"iter_{iteration:07d}" / name / RANK_FILE)


def optimizer_by_name(url: Path, layout: str, rank: int, states: tuple[str, ...]) -> dict[str, dict[str, torch.Tensor]]:
    """A Megatron rank's optimizer state by parameter name, read from a ucp checkpoint as ucp's trainer reads it."""
    local, _ = load_sharded(
        ucp.open_checkpoint(str(url)), ShardedModel(tiny_config(), parse_megatron_layout(layout), states), rank
    )
    return local["optimizer"]["state"]["model"]


@pytest.fixture(scope="module")
def megatron_tp1(tmp_path_factory):
    """A tp1 checkpoint of Megatron-Core's model after one step of its own optimizer (fp32: FP32Optimizer), and
    the worker's record: logits, and each parameter's optimizer state found by parameter object."""
    pytest.importorskip("megatron.core")
    tmp = tmp_path_factory.mktemp("megatron")
    run_megatron("save", tmp / "tp1", tmp / "saved.pt")
    return tmp / "tp1", torch.load(tmp / "saved.pt", weights_only=True)


def test_megatron_checkpoint_to_ucp_gives_megatrons_logits_and_optimizer(megatron_tp1, tmp_path):
    transformers = pytest.importorskip("transformers")
    from ucp.interop.hf import export_hf

    src, ref = megatron_tp1
    report = convert(str(src), str(tmp_path / "u"), from_layout="tp1", to_layout="universal")
    assert report.dropped == ("rng_state",)
    reader = ucp.open_checkpoint(str(tmp_path / "u"))
    assert reader.step == 10 and reader.atoms["model/model.embed_tokens.weight"].shape == (100, 32)
    # Adam's moments sit where ucp's trainer keeps them, under the parameter Megatron's optimizer holds them for
    assert reader.manifest.tree["dict"]["optim_states"]["value"] == ["exp_avg", "exp_avg_sq"]
    states = optimizer_by_name(tmp_path / "u", "tp1", 0, DEFAULT_STATES)
    assert sorted(states) == sorted(ref["optim"]) and ref["optim"]["output_layer.weight"]["exp_avg"].abs().sum() > 0
    assert_bitwise_equal(states, ref["optim"])
    extra = extra_state(reader)
    assert extra["optimizer_step"] == 1 and extra["megatron_optimizer"]["kind"] == "fp32"
    assert extra["opt_param_scheduler"] == megatron_file(src, "mp_rank_00")["opt_param_scheduler"]
    export_hf(str(tmp_path / "u"), tmp_path / "hf")
    model = transformers.MixtralForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(input_ids=ref["tokens"]).logits
    err = ((logits - ref["logits"]).abs().max() / ref["logits"].abs().max()).item()
    assert err <= 1e-5


def test_reshard_tp1_to_tp2pp2ep2_and_back_loads_in_megatron(megatron_tp1, tmp_path):
    src, ref = megatron_tp1
    mid, back = tmp_path / "tp2pp2ep2", tmp_path / "tp1"
    report = convert(str(src), str(mid), from_layout="tp1", to_layout="tp2pp2ep2", memory_budget=1 << 20)
    assert report.dropped == ("rng_state",)  # per rank: no meaning in another layout
    layout = parse_megatron_layout("tp2pp2ep2")
    names = sorted(p.name for p in (mid / "iter_0000010").iterdir())
    assert names == sorted(rank_files(layout)) and "mp_rank_01_001_001" in names
    assert (mid / "latest_checkpointed_iteration.txt").read_text().strip() == "10"
    # every target file is exactly ucp's shard of the atoms (which the test above ties to Megatron's modules)
    convert(str(src), str(tmp_path / "u"), from_layout="tp1", to_layout="universal")
    cfg = tiny_config()
    atoms = list(canonical_atoms(cfg))
    read = ucp.open_checkpoint(str(tmp_path / "u")).read_atoms(
        [f"model/{n}" for n in atoms] + [f"optimizer/state/{n}/{s}" for n in atoms for s in DEFAULT_STATES]
    )
    full = {
        "model": {n: read[f"model/{n}"] for n in atoms},
        "optimizer": {"state": {n: {s: read[f"optimizer/state/{n}/{s}"] for s in DEFAULT_STATES} for n in atoms}},
    }
    source = megatron_file(src, "mp_rank_00")
    for name, rank in rank_files(layout).items():
        data = megatron_file(mid, name)
        assert data["args"].tensor_model_parallel_size == 2 and data["args"].expert_model_parallel_size == 2
        assert data["iteration"] == 10 and data["opt_param_scheduler"] == source["opt_param_scheduler"]
        assert "rng_state" not in data
        want = shard(full, cfg, layout, rank, DEFAULT_STATES)
        got = {n: t for n, t in data["model"].items() if not n.endswith("_extra_state")}
        assert list(got) == list(want["model"]), name
        for n in want["model"]:
            assert torch.equal(got[n], want["model"][n]), (name, n)
        assert all(n.removesuffix(".weight") + "._extra_state" in data["model"] for n in got if "linear" in n)
        optim, _ = read_optimizer(data["optimizer"], cfg, layout, rank, name)
        assert isinstance(data["optimizer"], list) and len(data["optimizer"]) == 2  # EP: dense and expert optimizers
        assert_bitwise_equal(optim, want["optimizer"]["state"], name)
    convert(str(mid), str(back), from_layout="tp2pp2ep2", to_layout="tp1")
    assert_bitwise_equal(megatron_file(back, "mp_rank_00")["optimizer"], source["optimizer"])
    # Megatron's own model and optimizer load the round trip: same logits, same state per parameter, same LR
    run_megatron("load", back, tmp_path / "loaded.pt")
    again = torch.load(tmp_path / "loaded.pt", weights_only=True)
    assert torch.equal(again["tokens"], ref["tokens"])
    torch.testing.assert_close(again["logits"], ref["logits"], rtol=0, atol=0)
    assert_bitwise_equal(again["optim"], ref["optim"])
    assert again["lr"] == ref["lr"]


def test_tp2_files_load_into_megatrons_own_tp2_model_with_the_same_logits(megatron_tp1, tmp_path):
    """TP slicing (fused QKV per query group, gate/up, vocab padding to 128*T) of weights and optimizer state,
    checked by Megatron itself."""
    src, ref = megatron_tp1
    convert(str(src), str(tmp_path / "tp2"), from_layout="tp1", to_layout="tp2")
    run_megatron("tp2", tmp_path / "tp2", tmp_path / "logits.pt", world=2)
    logits = torch.load(tmp_path / "logits.pt", weights_only=True)["logits"]
    err = ((logits - ref["logits"]).abs().max() / ref["logits"].abs().max()).item()
    assert err <= 1e-5
    # each tp2 rank's optimizer, as Megatron loaded it, holds the TP slices of the tp1 optimizer's state
    convert(str(src), str(tmp_path / "u"), from_layout="tp1", to_layout="universal")
    for rank in range(2):
        loaded = torch.load(f"{tmp_path / 'logits.pt'}.{rank}", weights_only=True)["optim"]
        assert_bitwise_equal(loaded, optimizer_by_name(tmp_path / "u", "tp2", rank, DEFAULT_STATES), f"rank {rank}")


def test_bf16_expert_parallel_optimizer_round_trips_and_loads_in_megatron(tmp_path):
    """Float16OptimizerWithFloat16Params with EP 2: a dense and an expert optimizer, fp32 master weights. The
    worker saves tp1ep2, converts it to tp2pp2ep2 and back, and loads the result into Megatron's optimizer."""
    pytest.importorskip("megatron.core")
    run_megatron("ep2", tmp_path, tmp_path / "ep2.pt", world=2)
    names = rank_files(parse_megatron_layout("tp1ep2"))
    sources = {name: megatron_file(tmp_path / "src", name) for name in names}
    for name, rank in names.items():
        assert_bitwise_equal(megatron_file(tmp_path / "back", name)["optimizer"], sources[name]["optimizer"], name)
        out = torch.load(f"{tmp_path / 'ep2.pt'}.{rank}", weights_only=True)
        assert out["saved"]["decoder.layers.0.mlp.experts.local_experts.1.linear_fc2.weight"]["exp_avg"].abs().sum() > 0
        assert_bitwise_equal(out["loaded"], out["saved"], name)
        assert out["lr"][0] == out["lr"][1]
    # Megatron -> ucp: moments and master weights under the names Megatron's optimizer holds them for
    assert convert(str(tmp_path / "src"), str(tmp_path / "u"), from_layout="tp1ep2", to_layout="universal").dropped == (
        "rng_state",
    )
    for name, rank in names.items():
        saved = torch.load(f"{tmp_path / 'ep2.pt'}.{rank}", weights_only=True)["saved"]
        assert_bitwise_equal(
            optimizer_by_name(tmp_path / "u", "tp1ep2", rank, (*DEFAULT_STATES, "master")), saved, name
        )
    # ... and back to Megatron: the same optimizer entries, scheduler and iteration, no RNG state
    assert convert(str(tmp_path / "u"), str(tmp_path / "m"), from_layout="universal", to_layout="tp1ep2").dropped == ()
    for name in names:
        data = megatron_file(tmp_path / "m", name)
        assert_bitwise_equal(data["optimizer"], sources[name]["optimizer"], name)
        assert data["opt_param_scheduler"] == sources[name]["opt_param_scheduler"] and data["iteration"] == 10
        assert "rng_state" not in data


def test_rng_state_is_carried_into_the_same_layout_only(megatron_tp1, tmp_path):
    src, _ = megatron_tp1
    assert convert(str(src), str(tmp_path / "same"), from_layout="tp1", to_layout="tp1").dropped == ()
    source, same = megatron_file(src, "mp_rank_00"), megatron_file(tmp_path / "same", "mp_rank_00")
    assert_bitwise_equal(same["rng_state"], source["rng_state"])
    assert_bitwise_equal(same["optimizer"], source["optimizer"])
    assert same["opt_param_scheduler"] == source["opt_param_scheduler"]
    assert convert(str(src), str(tmp_path / "ep"), from_layout="tp1", to_layout="tp1ep2").dropped == ("rng_state",)
    assert all(
        "rng_state" not in megatron_file(tmp_path / "ep", n) for n in rank_files(parse_megatron_layout("tp1ep2"))
    )


def test_universal_to_megatron_with_tied_embeddings_and_virtual_stages(tmp_path):
    cfg = tiny_config(num_hidden_layers=4, tie_word_embeddings=True)
    full = random_full_state(cfg)  # with Adam state as ucp's trainer writes it: nothing says how Megatron groups it
    save_in_layout(full, cfg, "tp1", str(tmp_path / "u"), step=4)
    report = convert(str(tmp_path / "u"), str(tmp_path / "m"), from_layout="universal", to_layout="tp2pp2vpp2ep2")
    assert report.dropped == ("optimizer",)
    layout = parse_megatron_layout("tp2pp2vpp2ep2")
    for name, rank in rank_files(layout).items():
        data = megatron_file(tmp_path / "m", name, iteration=4)
        want = shard(full, cfg, layout, rank, ())
        assert [k for k in data if k.startswith("model")] == ["model0", "model1"] and "optimizer" not in data
        for chunk in ("model0", "model1"):
            got = {n: t for n, t in data[chunk].items() if not n.endswith("_extra_state")}
            assert list(got) == list(want[chunk])
            assert all(torch.equal(got[n], want[chunk][n]) for n in got), (name, chunk)
    # the last stage's output_layer is a tied copy of the embedding; back to atoms gives the original bitwise
    convert(str(tmp_path / "m"), str(tmp_path / "u2"), from_layout="tp2pp2vpp2ep2", to_layout="universal")
    back = ucp.open_checkpoint(str(tmp_path / "u2"))
    assert "model/lm_head.weight" not in back.atoms
    got = back.read_atoms([f"model/{n}" for n in full["model"]])
    for n, t in full["model"].items():
        assert torch.equal(got[f"model/{n}"], t), n


def test_an_optimizer_before_its_first_step_keeps_its_param_groups(megatron_tp1, tmp_path):
    src, _ = megatron_tp1
    ckpt = tmp_path / "m"
    shutil.copytree(src, ckpt)
    good = megatron_file(ckpt, "mp_rank_00")
    fresh = dict(good["optimizer"], state={})  # torch keeps no per-parameter entry before the first step
    _replace(dict(good, optimizer=fresh), ckpt / "iter_0000010" / "mp_rank_00" / RANK_FILE)
    convert(str(ckpt), str(tmp_path / "tp2"), from_layout="tp1", to_layout="tp2")
    convert(str(tmp_path / "tp2"), str(tmp_path / "u"), from_layout="tp2", to_layout="universal")
    assert not [p for p in ucp.open_checkpoint(str(tmp_path / "u")).atoms if p.startswith("optimizer/")]
    convert(str(tmp_path / "u"), str(tmp_path / "back"), from_layout="universal", to_layout="tp1")
    assert_bitwise_equal(megatron_file(tmp_path / "back", "mp_rank_00")["optimizer"], fresh)


def test_optimizer_state_ucp_cannot_map_is_refused(megatron_tp1, tmp_path):
    src, _ = megatron_tp1
    ckpt = tmp_path / "m"
    shutil.copytree(src, ckpt)
    path = ckpt / "iter_0000010" / "mp_rank_00" / RANK_FILE
    good = megatron_file(ckpt, "mp_rank_00")
    dst = tmp_path / "out"
    # a param group Megatron builds only with other overrides (a decoupled LR): its indices cannot be named
    groups = [dict(g) for g in good["optimizer"]["param_groups"]]
    groups[0]["is_decoupled_lr"] = True
    _replace(dict(good, optimizer=dict(good["optimizer"], param_groups=groups)), path)
    with pytest.raises(
        InteropError, match=r"mp_rank_00/model_optim_rng.pt: optimizer param groups .* not Megatron-Core's standard"
    ):
        convert(str(ckpt), str(dst), from_layout="tp1", to_layout="tp2")
    # a moment whose shape is not its parameter's
    state = {i: dict(s) for i, s in good["optimizer"]["state"].items()}
    state[1]["exp_avg"] = torch.zeros(3)
    _replace(dict(good, optimizer=dict(good["optimizer"], state=state)), path)
    with pytest.raises(
        InteropError,
        match=r"optimizer state of model/decoder.layers.0.self_attention.linear_proj.weight\['exp_avg'\] is \[3\]",
    ):
        convert(str(ckpt), str(dst), from_layout="tp1", to_layout="tp2")
    # a distributed optimizer's file that is not one is refused, naming it
    _replace(good, path)
    (path.parent / "distrib_optim.pt").write_bytes(b"")
    with pytest.raises(InteropError, match=r"mp_rank_00/distrib_optim.pt is not a readable torch checkpoint"):
        convert(str(ckpt), str(dst), from_layout="tp1", to_layout="universal")
    assert not dst.exists()


def _replace(data: dict, path: Path) -> None:
    """Write a new file in place of a rank file (a new inode, as a real rewrite would make)."""
    tmp = path.with_suffix(".new")
    torch.save(data, tmp)
    os.replace(tmp, path)


@pytest.fixture
def megatron_tp2(tmp_path):
    cfg = tiny_config()
    save_in_layout(random_full_state(cfg, states=()), cfg, "tp1", str(tmp_path / "u"), step=3)
    convert(str(tmp_path / "u"), str(tmp_path / "m"), from_layout="universal", to_layout="tp2")
    return tmp_path / "m"


def test_bad_megatron_sources_are_clear_errors_and_leave_nothing(megatron_tp2, tmp_path):
    it = megatron_tp2 / "iter_0000003"
    dst = tmp_path / "out"
    with pytest.raises(SourceMismatchError, match=r"--from tp4 does not match .*args say tp2pp1"):  # (as written)
        convert(str(megatron_tp2), str(dst), from_layout="tp4", to_layout="tp1")
    with pytest.raises(SourceMismatchError, match="use --from universal"):
        convert(str(tmp_path / "u"), str(dst), from_layout="tp2", to_layout="tp1")
    with pytest.raises(SourceMismatchError, match="is a Megatron checkpoint"):
        convert(str(megatron_tp2), str(dst), from_layout="universal", to_layout="tp1")
    # ranks that disagree on shapes
    path = it / "mp_rank_01" / RANK_FILE
    data = load_rank_file(path)
    good = {k: v for k, v in data.items()}
    bad = dict(data, model=dict(data["model"]))
    bad["model"]["decoder.layers.1.self_attention.linear_proj.weight"] = torch.zeros(32, 32)
    _replace(bad, path)
    with pytest.raises(
        InteropError,
        match=r"mp_rank_01/model_optim_rng.pt: model/decoder.layers.1.self_attention.linear_proj.weight has shape \[32, 32\], but .* imply \[32, 16\]",
    ):
        convert(str(megatron_tp2), str(dst), from_layout="tp2", to_layout="tp1")
    # a type outside the allowlist is never unpickled
    _replace(dict(good, evil=argparse.ArgumentParser), path)
    with pytest.raises(InteropError, match="refused to unpickle"):
        convert(str(megatron_tp2), str(dst), from_layout="tp2", to_layout="tp1")
    # a missing rank file
    path.unlink()
    with pytest.raises(InteropError, match=r"missing rank file"):
        convert(str(megatron_tp2), str(dst), from_layout="tp2", to_layout="tp1")
    (it / "mp_rank_01").rmdir()
    with pytest.raises(InteropError, match=r"missing rank file\(s\) \['mp_rank_01/"):
        convert(str(megatron_tp2), str(dst), from_layout="tp2", to_layout="tp1")
    assert not dst.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]


def test_a_failed_conversion_leaves_nothing_at_dst(megatron_tp2, tmp_path, monkeypatch):
    calls = []
    real = torch_file.save

    def failing(obj, f):
        calls.append(f)
        if len(calls) == 2:
            raise OSError("disk full")
        return real(obj, f)

    monkeypatch.setattr(torch_file, "save", failing)
    with pytest.raises(OSError, match="disk full"):
        convert(str(megatron_tp2), str(tmp_path / "out"), from_layout="tp2", to_layout="tp1pp2", workers=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m", "u"]


def test_cli_convert(megatron_tp2, tmp_path, capsys):
    argv = ["convert", str(megatron_tp2), str(tmp_path / "u2"), "--from", "tp2", "--to", "universal", "--no-progress"]
    assert ucp_cli.main(argv) == 0
    out = capsys.readouterr().out
    # a ucp target has atoms, not rank files: the summary names where they went, no count of files
    assert f"converted 41 atoms from tp2 to universal: 0.2 MiB written to {tmp_path / 'u2'}\n" in out
    assert ucp.open_checkpoint(str(tmp_path / "u2")).step == 3
    argv = ["convert", str(tmp_path / "u2"), str(tmp_path / "m1"), "--from", "universal", "--to", "tp1"]
    assert ucp_cli.main([*argv, "--no-progress"]) == 0
    assert "to tp1: 1 file, 0.2 MiB written (a tensor that several ranks hold" in capsys.readouterr().out
    argv = ["convert", str(tmp_path / "u2"), str(tmp_path / "d1"), "--from", "universal", "--to", "torch_dist"]
    assert ucp_cli.main([*argv, "--no-progress"]) == 0
    assert "to torch_dist: 1 file, 0.2 MiB written\n" in capsys.readouterr().out  # torch_dist: each tensor once
    assert ucp_cli.main(["convert", str(megatron_tp2), str(tmp_path / "x"), "--from", "tp2pp2", "--to", "tp1"]) == 1
    assert "args say tp2pp1" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()
    # --target-ep says which job loads a torch_dist target; a layout names its own EP
    # (and an EP the model's experts do not split over: it wrote a checkpoint for a job that cannot exist)
    experts = tiny_config().num_local_experts
    for to, ep in (("tp1", "2"), ("torch_dist", "0"), ("torch_dist", str(experts + 1))):
        argv = ["convert", str(megatron_tp2), str(tmp_path / "x"), "--from", "tp2", "--to", to, "--target-ep", ep]
        assert ucp_cli.main(argv) == 1
        err = capsys.readouterr().err
        assert f"--target-ep {ep}" in err and len(err.strip().splitlines()) == 1
        assert not (tmp_path / "x").exists()


def test_torch_file_save_loads_like_torch_save(tmp_path):
    """torch_file.save writes what torch.save writes for the same dict (Deferred tensors produced on the way),
    and TorchFile reads each tensor back alone, views included."""
    base = torch.arange(24, dtype=torch.bfloat16).view(4, 6)
    produced = []

    def ones() -> torch.Tensor:
        produced.append(1)
        return torch.ones(3, 2)

    common = {
        "view": base[1:3, ::2],
        "base": base,
        "step": torch.tensor(3.0),
        "args": argparse.Namespace(lr=0.1),
        "none": None,
        "nested": [{"ids": torch.arange(5)}, (1, "x")],
    }
    torch_file.save({**common, "deferred": torch_file.Deferred((3, 2), torch.float32, ones)}, tmp_path / "ours.pt")
    torch.save({**common, "deferred": torch.ones(3, 2)}, tmp_path / "torch.pt")
    assert produced == [1]
    with torch.serialization.safe_globals([argparse.Namespace]):
        ours = torch.load(tmp_path / "ours.pt", weights_only=True)
        theirs = torch.load(tmp_path / "torch.pt", weights_only=True)
        lazy = torch_file.TorchFile(tmp_path / "ours.pt")
    assert_bitwise_equal(ours, theirs)
    assert (
        ours["view"].untyped_storage().data_ptr() == ours["base"].untyped_storage().data_ptr()
    )  # one storage, as torch's
    assert lazy.obj["base"].device.type == "meta" and lazy.obj["args"] == common["args"]
    for name in ("view", "base", "step", "deferred"):
        assert_bitwise_equal(lazy.read(lazy.obj[name]), theirs[name], name)
    assert_bitwise_equal(lazy.read(lazy.obj["nested"][0]["ids"]), theirs["nested"][0]["ids"])
    with pytest.raises(ValueError, match="promised torch.float32"):
        torch_file.save({"bad": torch_file.Deferred((2,), torch.float32, lambda: torch.ones(3))}, tmp_path / "bad.pt")


def test_export_and_import_megatron_dist_are_the_torch_dist_conversions(megatron_tp2, tmp_path, capsys):
    """`ucp export --to megatron-dist` / `ucp import --from megatron-dist` write what `ucp convert` to and from
    torch_dist writes: the same data file, and the same atoms back."""
    u = str(tmp_path / "u")
    assert ucp_cli.main(["export", u, "--to", "megatron-dist", str(tmp_path / "e"), "--no-progress"]) == 0
    assert "as Megatron torch_dist" in capsys.readouterr().out
    convert(u, str(tmp_path / "c"), from_layout="universal", to_layout="torch_dist")
    data = "iter_0000003/__0_0.distcp"
    assert (tmp_path / "e" / data).read_bytes() == (tmp_path / "c" / data).read_bytes()
    argv = ["import", str(tmp_path / "e"), str(tmp_path / "back"), "--from", "megatron-dist", "--no-progress"]
    assert ucp_cli.main(argv) == 0
    assert "imported" in capsys.readouterr().out
    before, after = ucp.open_checkpoint(u), ucp.open_checkpoint(str(tmp_path / "back"))
    assert after.step == 3 and sorted(after.atoms) == sorted(before.atoms)
    a, b = before.read_atoms(sorted(before.atoms)), after.read_atoms(sorted(before.atoms))
    assert all(torch.equal(a[p], b[p]) for p in a)
    # options that do not apply are one-line errors, and nothing is written
    argv = ["export", u, "--to", "megatron-dist", str(tmp_path / "x"), "--dtype", "bf16"]
    assert ucp_cli.main(argv) == 1
    err = capsys.readouterr().err
    assert "--dtype" in err and len(err.strip().splitlines()) == 1 and not (tmp_path / "x").exists()


def test_a_fused_tensor_of_atoms_stored_in_several_dtypes_holds_each_exactly(tmp_path):
    """Megatron fuses gate and up (linear_fc1) in one tensor: an HF model whose gate and up are stored in two dtypes
    converts with each cast into one that holds both exactly (bf16 and fp16 make fp32), never its bytes
    reinterpreted."""
    import transformers
    from safetensors.torch import load_file, save_file

    from ucp.interop.hf import import_hf

    torch.manual_seed(DRAW.randrange(1 << 30))
    hf_cfg = transformers.Qwen2Config(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    src = tmp_path / "hf"
    transformers.Qwen2ForCausalLM(hf_cfg).save_pretrained(src)
    kinds = [torch.bfloat16, torch.float16, torch.float32]
    gate, up, rest = DRAW.choice(kinds), DRAW.choice(kinds), DRAW.choice(kinds)
    weights = load_file(src / "model.safetensors")
    cast = {n: t.to(gate if "gate_proj" in n else up if "up_proj" in n else rest) for n, t in weights.items()}
    save_file(cast, src / "model.safetensors", metadata={"format": "pt"})
    import_hf(src, str(tmp_path / "u"))
    convert(str(tmp_path / "u"), str(tmp_path / "m"), from_layout="universal", to_layout="tp1")
    got = megatron_file(tmp_path / "m", "mp_rank_00", iteration=0)["model"]
    fused = torch.promote_types(gate, up)
    for layer in range(hf_cfg.num_hidden_layers):
        mlp = f"model.layers.{layer}.mlp"
        want = torch.cat([cast[f"{mlp}.gate_proj.weight"], cast[f"{mlp}.up_proj.weight"]]).to(fused)
        fc1 = got[f"decoder.layers.{layer}.mlp.linear_fc1.weight"]
        assert fc1.dtype == fused and torch.equal(fc1, want), (layer, gate, up)
