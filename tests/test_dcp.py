"""PyTorch DCP: import what FSDP2 ranks saved, export what DCP loads in another world size."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ucp
from ucp import cli as ucp_cli
from ucp.interop.dcp import export_dcp, import_dcp
from ucp.interop.errors import InteropError, SourceMismatchError
from ucp.sharding.families import canonical_atoms

from .launch import free_port
from .test_hf import random_full_state, save_in_layout, tiny_config

pytest.importorskip("transformers")

# Two gloo ranks in a subprocess: "save" trains nothing but shards transformers' Mixtral with FSDP2 and writes
# {"model", "optim"} with dcp.save; "load" reads a checkpoint into Shard(0) DTensors and checks every shard.
DCP_WORKER = r"""
import os, sys, warnings
warnings.filterwarnings("ignore")
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp


def save(rank, world, ckpt, ref):
    import transformers
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    cfg = transformers.MixtralConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, num_local_experts=4)
    model = transformers.MixtralForCausalLM(cfg)
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=0.0)  # lr 0: a step creates state, weights stay put
    model(input_ids=torch.randint(0, 100, (1, 8)), labels=torch.randint(0, 100, (1, 8))).loss.backward()
    opt.step()
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    dcp.save(state, checkpoint_id=ckpt)
    whole = get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        cfg.save_pretrained(ckpt)  # config.json beside the DCP files, as training jobs often do
        expected["optim_exp_avg"] = {k: v["exp_avg"] for k, v in whole["state"].items()}
        torch.save(expected, ref)


def load(rank, world, ckpt, ref):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    expected = torch.load(ref, weights_only=True)
    state = {n: distribute_tensor(torch.zeros_like(t), mesh, [Shard(0)]) for n, t in expected.items()}
    dcp.load(state, checkpoint_id=ckpt)
    for n, t in expected.items():
        want = distribute_tensor(t, mesh, [Shard(0)]).to_local()
        assert torch.equal(state[n].to_local(), want), n


def main(rank, world, port, mode, ckpt, ref):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        {"save": save, "load": load}[mode](rank, world, ckpt, ref)
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    import torch.multiprocessing as mp

    mode, ckpt, ref, port = sys.argv[1:5]
    mp.spawn(main, args=(2, port, mode, ckpt, ref), nprocs=2)
    print("ok")
"""


def run_two_ranks(tmp: Path, mode: str, ckpt: Path, ref: Path) -> None:
    script = tmp / "dcp_worker.py"
    script.write_text(DCP_WORKER)
    proc = subprocess.run(
        [sys.executable, str(script), mode, str(ckpt), str(ref), str(free_port())],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env=dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1"),
    )
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]


@pytest.mark.slow
def test_import_fsdp2_dcp_checkpoint(tmp_path):
    run_two_ranks(tmp_path, "save", tmp_path / "dcp", tmp_path / "ref.pt")
    report = import_dcp(tmp_path / "dcp", str(tmp_path / "u"), memory_budget=64 << 10)  # many groups of DCP tensors
    assert report.atoms == len(canonical_atoms(tiny_config()))
    assert report.optim_states == ("exp_avg", "exp_avg_sq")
    assert any(s.startswith("optim.state.") and s.endswith(".step") for s in report.skipped)
    ref = torch.load(tmp_path / "ref.pt", weights_only=True)  # transformers' fused-expert state dict
    got = ucp.load(str(tmp_path / "u"))["model"]
    for layer in range(2):
        base = f"model.layers.{layer}."
        assert torch.equal(got[base + "self_attn.k_proj.weight"], ref[base + "self_attn.k_proj.weight"])
        assert torch.equal(got[base + "block_sparse_moe.gate.weight"], ref[base + "mlp.gate.weight"])
        for x in range(4):
            e = f"{base}block_sparse_moe.experts.{x}."
            assert torch.equal(got[e + "w1.weight"], ref[base + "mlp.experts.gate_up_proj"][x, :64])
            assert torch.equal(got[e + "w3.weight"], ref[base + "mlp.experts.gate_up_proj"][x, 64:])
            assert torch.equal(got[e + "w2.weight"], ref[base + "mlp.experts.down_proj"][x])
    assert torch.equal(got["lm_head.weight"], ref["lm_head.weight"])
    # Adam's state came along, split per expert like the weights, and loads into any layout
    opt = ucp.load(str(tmp_path / "u"))["optimizer"]["state"]
    gate_up = ref["optim_exp_avg"]["model.layers.1.mlp.experts.gate_up_proj"]
    assert torch.equal(opt["model.layers.1.block_sparse_moe.experts.3.w3.weight"]["exp_avg"], gate_up[3, 64:])
    assert gate_up.abs().sum() > 0
    from ucp.distributed import ShardedModel, load_sharded
    from ucp.sharding.layout import parse_layout
    from ucp.sharding.reshard import shard

    layout = parse_layout("tp2dp2zero1")
    full = {"model": got, "optimizer": {"state": opt}}
    local, _ = load_sharded(ucp.open_checkpoint(str(tmp_path / "u")), ShardedModel(tiny_config(), layout), 3)
    want = shard(full, tiny_config(), layout, 3)
    assert torch.equal(
        local["optimizer"]["flat"]["expert"]["exp_avg_sq"], want["optimizer"]["flat"]["expert"]["exp_avg_sq"]
    )


@pytest.mark.slow
def test_export_reads_back_with_dcp_to_torch_save_and_in_world_size_two(tmp_path):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    cfg = tiny_config()
    full = random_full_state(cfg)
    save_in_layout(full, cfg, "tp2pp2", str(tmp_path / "u"))
    report = export_dcp(str(tmp_path / "u"), tmp_path / "dcp")
    assert report.tensors == len(full["model"])
    dcp_to_torch_save(tmp_path / "dcp", tmp_path / "whole.pt")
    whole = torch.load(tmp_path / "whole.pt", weights_only=True)
    assert list(whole) == list(full["model"])
    for name, t in full["model"].items():
        assert torch.equal(whole[name], t), name
    torch.save(full["model"], tmp_path / "ref.pt")
    run_two_ranks(tmp_path, "load", tmp_path / "dcp", tmp_path / "ref.pt")
    # and the export imports back to the same atoms
    (tmp_path / "config.json").write_text(_hf_config_json(cfg))
    import_dcp(tmp_path / "dcp", str(tmp_path / "u2"), config=tmp_path / "config.json")
    again = ucp.load(str(tmp_path / "u2"))["model"]
    assert all(torch.equal(again[n], t) for n, t in full["model"].items())


def _hf_config_json(cfg) -> str:
    import json

    from ucp.interop.hf import hf_config_from_ucp

    return json.dumps(hf_config_from_ucp(cfg, None, torch.float32))


def test_dcp_tensors_ucp_cannot_map_and_unsafe_metadata_are_refused(tmp_path):
    import torch.distributed.checkpoint as dcp

    cfg = tiny_config(num_hidden_layers=1)
    model = random_full_state(cfg, states=())["model"]
    (tmp_path / "config.json").write_text(_hf_config_json(cfg))
    dcp.save(
        dict(model, **{"model.layers.0.mlp.shared_expert.weight": torch.zeros(4, 4)}),
        checkpoint_id=str(tmp_path / "odd"),
        no_dist=True,
    )
    with pytest.raises(
        SourceMismatchError, match=r"cannot map to Mixtral atoms: \['model.layers.0.mlp.shared_expert.weight'\]"
    ):
        import_dcp(tmp_path / "odd", str(tmp_path / "u"), config=tmp_path / "config.json")
    del model["model.norm.weight"]
    dcp.save(model, checkpoint_id=str(tmp_path / "short"), no_dist=True)
    with pytest.raises(InteropError, match=r"lacks tensors for atoms \['model.norm.weight'\]"):
        import_dcp(tmp_path / "short", str(tmp_path / "u"), config=tmp_path / "config.json")
    with pytest.raises(InteropError, match="carry no model config"):
        import_dcp(tmp_path / "short", str(tmp_path / "u"))
    # metadata that names any other global is never unpickled
    import pickle

    (tmp_path / "short" / ".metadata").write_bytes(pickle.dumps(argparse.ArgumentParser))
    with pytest.raises(InteropError, match="argparse.ArgumentParser is not allowed"):
        import_dcp(tmp_path / "short", str(tmp_path / "u"), config=tmp_path / "config.json")
    assert not (tmp_path / "u").exists()


def test_cli_export_and_import_dcp(tmp_path, capsys):
    cfg = tiny_config(num_hidden_layers=1)
    save_in_layout(random_full_state(cfg, states=()), cfg, "tp1", str(tmp_path / "u"))
    assert ucp_cli.main(["export", str(tmp_path / "u"), "--to", "dcp", str(tmp_path / "d"), "--dtype", "bf16"]) == 0
    (tmp_path / "d" / "config.json").write_text(_hf_config_json(cfg))
    assert ucp_cli.main(["import", str(tmp_path / "d"), str(tmp_path / "u2"), "--from", "dcp"]) == 0
    got = ucp.load(str(tmp_path / "u2"))["model"]
    assert got["model.norm.weight"].dtype == torch.bfloat16
    assert ucp_cli.main(["import", str(tmp_path / "u"), str(tmp_path / "u3"), "--from", "dcp"]) == 1
    assert "not a DCP checkpoint" in capsys.readouterr().err


@pytest.mark.parametrize("damage", ["garbage", "hostile pickle", "truncated"])
def test_a_damaged_or_hostile_data_file_is_one_line_and_leaves_no_destination(tmp_path, capsys, damage):
    """Nothing is executed, the CLI says in one line which file it could not read, and the destination (new) is not
    created: DCP's own CheckpointException (wrapping an UnpicklingError or worse) never reaches the user."""
    import pickle

    import torch.distributed.checkpoint as dcp

    cfg = tiny_config(num_hidden_layers=1)
    src = tmp_path / "d"
    dcp.save(random_full_state(cfg, states=())["model"], checkpoint_id=str(src), no_dist=True)
    (src / "config.json").write_text(_hf_config_json(cfg))
    data = min(src.glob("*.distcp"))
    ran = tmp_path / "ran"

    class Hostile:
        def __reduce__(self):
            return (os.mkdir, (str(ran),))

    payload = {
        "garbage": os.urandom(data.stat().st_size),
        "hostile pickle": pickle.dumps(Hostile()) * (data.stat().st_size // 64 + 1),
        "truncated": data.read_bytes()[: data.stat().st_size // 3],
    }[damage]
    data.write_bytes(payload)
    dest = tmp_path / "u"
    assert ucp_cli.main(["import", str(src), str(dest), "--from", "dcp", "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert str(data) in err, err
    assert not ran.exists(), "the hostile pickle ran"
    assert not dest.exists(), f"a partial destination was left: {list(dest.rglob('*'))}"


@pytest.mark.parametrize("elsewhere", ["../elsewhere.distcp", "/tmp/x.distcp", "sub/x.distcp", ".."])
def test_metadata_naming_a_data_file_not_beside_it_is_refused(tmp_path, capsys, elsewhere):
    import dataclasses
    import pickle

    import torch.distributed.checkpoint as dcp

    cfg = tiny_config(num_hidden_layers=1)
    src = tmp_path / "d"
    dcp.save(random_full_state(cfg, states=())["model"], checkpoint_id=str(src), no_dist=True)
    (src / "config.json").write_text(_hf_config_json(cfg))
    metadata = pickle.loads((src / ".metadata").read_bytes())
    key = next(iter(metadata.storage_data))
    metadata.storage_data[key] = dataclasses.replace(metadata.storage_data[key], relative_path=elsewhere)
    (src / ".metadata").write_bytes(pickle.dumps(metadata))
    dest = tmp_path / "u"
    assert ucp_cli.main(["import", str(src), str(dest), "--from", "dcp", "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not a file beside it" in err and str(src / ".metadata") in err, err
    assert not dest.exists()


def test_an_atom_given_twice_is_refused_naming_both_tensors(tmp_path, capsys):
    """A state dict saved both nested under "model" and flat: two tensors for each atom, refused."""
    import torch.distributed.checkpoint as dcp

    cfg = tiny_config(num_hidden_layers=1)
    model = random_full_state(cfg, states=())["model"]
    src = tmp_path / "d"
    dcp.save({"model": model, **{n: t + 1 for n, t in model.items()}}, checkpoint_id=str(src), no_dist=True)
    (src / "config.json").write_text(_hf_config_json(cfg))
    assert ucp_cli.main(["import", str(src), str(tmp_path / "u"), "--from", "dcp", "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is given twice, by " in err, err
    assert not (tmp_path / "u").exists()
