"""Megatron-LM torch checkpoints: resharded through atoms, checked against Megatron-Core's own GPT/MoE modules."""

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
from ucp.families import canonical_atoms
from ucp.interop.errors import InteropError, SourceMismatchError
from ucp.interop.megatron import RANK_FILE, convert, load_rank_file, parse_megatron_layout, rank_files
from ucp.reshard import shard

from .launch import free_port
from .test_hf import random_full_state, save_in_layout, tiny_config

# Runs in a subprocess (torch.distributed and Megatron's parallel state are process-global): builds a tiny
# Megatron-Core GPT MoE model on CPU with the local layer spec, then either saves it as Megatron-LM's torch
# checkpoint (tp1) or loads a rank file into it with a strict load_state_dict; writes its logits either way.
MEGATRON_WORKER = r'''
import argparse, os, sys, warnings
warnings.filterwarnings("ignore")
import torch, torch.nn.functional as F
import torch.distributed as dist

mode, ckpt, out = sys.argv[1], sys.argv[2], sys.argv[3]
os.environ.setdefault("MASTER_ADDR", "127.0.0.1"); os.environ.setdefault("MASTER_PORT", sys.argv[4] if len(sys.argv) > 4 else "29541")
torch.cuda.current_device = lambda: "cpu"  # megatron moves RoPE inv_freq to the current CUDA device
dist.init_process_group("gloo", rank=0, world_size=1)
from megatron.core import parallel_state
import contextlib
from megatron.core.tensor_parallel import random as mrandom
mrandom.CudaRNGStatesTracker.fork = lambda self, name=None: contextlib.nullcontext()  # dropout is 0: no CUDA RNG needed
parallel_state.initialize_model_parallel(1, 1)
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.moe import moe_utils
moe_utils.te_general_gemm = None  # without Transformer Engine the name is never bound
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.transformer_config import TransformerConfig

V, H, FFN, L, HEADS, KV, E = 100, 32, 64, 2, 4, 2, 4
cfg = TransformerConfig(num_layers=L, hidden_size=H, num_attention_heads=HEADS, num_query_groups=KV, ffn_hidden_size=FFN,
    num_moe_experts=E, moe_router_topk=2, moe_ffn_hidden_size=FFN, gated_linear_unit=True, activation_func=F.silu,
    normalization="RMSNorm", layernorm_epsilon=1e-5, add_bias_linear=False, use_cpu_initialization=True,
    moe_token_dispatcher_type="allgather", params_dtype=torch.float32, hidden_dropout=0.0, attention_dropout=0.0)
spec = get_gpt_layer_local_spec(num_experts=E, moe_grouped_gemm=False, normalization="RMSNorm")
torch.manual_seed(0)
model = GPTModel(cfg, spec, vocab_size=128, max_sequence_length=64, position_embedding_type="rope",
                 rotary_base=10000, share_embeddings_and_output_weights=False).eval()
path = os.path.join(ckpt, "iter_0000010", "mp_rank_00", "model_optim_rng.pt")
if mode == "save":
    with torch.no_grad():
        for _, p in model.named_parameters():
            p.add_(torch.randn_like(p) * 0.2)
        model.embedding.word_embeddings.weight[V:] = 0  # padding rows
        model.output_layer.weight[V:] = 0
    args = argparse.Namespace(num_layers=L, hidden_size=H, ffn_hidden_size=FFN, moe_ffn_hidden_size=FFN,
        num_attention_heads=HEADS, group_query_attention=True, num_query_groups=KV, kv_channels=None, num_experts=E,
        moe_router_topk=2, swiglu=True, add_bias_linear=False, normalization="RMSNorm", norm_epsilon=1e-5,
        position_embedding_type="rope", rotary_base=10000, untie_embeddings_and_output_weights=True, vocab_size=V,
        padded_vocab_size=128, make_vocab_size_divisible_by=128, tensor_model_parallel_size=1,
        pipeline_model_parallel_size=1, expert_model_parallel_size=1, virtual_pipeline_model_parallel_size=None,
        params_dtype=torch.float32, max_position_embeddings=64)
    os.makedirs(os.path.dirname(path))
    torch.save({"args": args, "checkpoint_version": 3.0, "iteration": 10, "model": model.state_dict(),
                "rng_state": [{"random_rng_state": None, "np_rng_state": __import__("numpy").random.get_state(),
                               "torch_rng_state": torch.get_rng_state()}]}, path)
    with open(os.path.join(ckpt, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("10")
else:
    state = torch.load(path, weights_only=False)
    model.load_state_dict(state["model"], strict=True)
tokens = torch.randint(0, V, (2, 12), generator=torch.Generator().manual_seed(5))
pos = torch.arange(12).unsqueeze(0).expand(2, -1)
mask = torch.triu(torch.ones(1, 1, 12, 12, dtype=torch.bool), diagonal=1)
with torch.no_grad():
    logits = model(tokens, pos, mask)
torch.save({"tokens": tokens, "logits": logits[..., :V].contiguous()}, out)
print("ok", tuple(logits.shape))
'''


# Two gloo ranks: Megatron-Core's GPTModel with tensor_model_parallel_size=2 loads its rank's file strictly and
# writes the gathered logits (parallel_output=False), to compare with the tp1 model's.
MEGATRON_TP2_WORKER = r'''
import os, sys, warnings
warnings.filterwarnings("ignore")
import torch, torch.nn.functional as F
import torch.distributed as dist


def main(rank, world, port, ckpt, out):
    torch.cuda.current_device = lambda: "cpu"
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from megatron.core import parallel_state
    import contextlib
    from megatron.core.tensor_parallel import random as mrandom
    mrandom.CudaRNGStatesTracker.fork = lambda self, name=None: contextlib.nullcontext()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.moe import moe_utils
    moe_utils.te_general_gemm = None
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig
    V, H, FFN, L, HEADS, KV, E = 100, 32, 64, 2, 4, 2, 4
    cfg = TransformerConfig(num_layers=L, hidden_size=H, num_attention_heads=HEADS, num_query_groups=KV, ffn_hidden_size=FFN,
        num_moe_experts=E, moe_router_topk=2, moe_ffn_hidden_size=FFN, gated_linear_unit=True, activation_func=F.silu,
        normalization="RMSNorm", layernorm_epsilon=1e-5, add_bias_linear=False, use_cpu_initialization=True,
        moe_token_dispatcher_type="allgather", params_dtype=torch.float32, hidden_dropout=0.0, attention_dropout=0.0,
        tensor_model_parallel_size=2)
    spec = get_gpt_layer_local_spec(num_experts=E, moe_grouped_gemm=False, normalization="RMSNorm")
    model = GPTModel(cfg, spec, vocab_size=256, max_sequence_length=64, position_embedding_type="rope",
                     rotary_base=10000, share_embeddings_and_output_weights=False, parallel_output=False).eval()
    state = torch.load(os.path.join(ckpt, "iter_0000010", f"mp_rank_{rank:02d}", "model_optim_rng.pt"), weights_only=False)
    model.load_state_dict(state["model"], strict=True)
    ref = torch.load(out + ".ref", weights_only=True)
    tokens = ref["tokens"]
    pos = torch.arange(12).unsqueeze(0).expand(2, -1)
    mask = torch.triu(torch.ones(1, 1, 12, 12, dtype=torch.bool), diagonal=1)
    with torch.no_grad():
        logits = model(tokens, pos, mask)
    if rank == 0:
        torch.save({"logits": logits[..., :V].contiguous()}, out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    import torch.multiprocessing as mp
    ckpt, out, port = sys.argv[1:4]
    mp.spawn(main, args=(2, port, ckpt, out), nprocs=2)
    print("ok")
'''


def run_megatron(tmp: Path, mode: str, ckpt: Path, out: Path) -> dict:
    script = tmp / "megatron_worker.py"
    script.write_text(MEGATRON_WORKER)
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, str(script), mode, str(ckpt), str(out), str(free_port())],
                          capture_output=True, text=True, timeout=300, env=env, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return torch.load(out, weights_only=True)


@pytest.fixture(scope="module")
def megatron_tp1(tmp_path_factory):
    pytest.importorskip("megatron.core")
    tmp = tmp_path_factory.mktemp("megatron")
    ref = run_megatron(tmp, "save", tmp / "tp1", tmp / "logits.pt")
    return tmp, tmp / "tp1", ref


def test_megatron_checkpoint_to_ucp_gives_megatrons_logits_in_transformers(megatron_tp1, tmp_path):
    transformers = pytest.importorskip("transformers")
    from ucp.interop.hf import export_hf

    _, src, ref = megatron_tp1
    report = convert(str(src), str(tmp_path / "u"), from_layout="tp1", to_layout="universal")
    assert report.dropped == ("rng_state",)
    reader = ucp.open_checkpoint(str(tmp_path / "u"))
    assert reader.step == 10 and reader.atoms["model/model.embed_tokens.weight"].shape == (100, 32)
    export_hf(str(tmp_path / "u"), tmp_path / "hf")
    model = transformers.MixtralForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(input_ids=ref["tokens"]).logits
    err = ((logits - ref["logits"]).abs().max() / ref["logits"].abs().max()).item()
    assert err <= 1e-5


def test_reshard_tp1_to_tp2pp2ep2_and_back_loads_in_megatron(megatron_tp1, tmp_path):
    tmp, src, ref = megatron_tp1
    mid, back = tmp_path / "tp2pp2ep2", tmp_path / "tp1"
    convert(str(src), str(mid), from_layout="tp1", to_layout="tp2pp2ep2", memory_budget=1 << 20)
    layout = parse_megatron_layout("tp2pp2ep2")
    names = sorted(p.name for p in (mid / "iter_0000010").iterdir())
    assert names == sorted(rank_files(layout)) and "mp_rank_01_001_001" in names
    assert (mid / "latest_checkpointed_iteration.txt").read_text().strip() == "10"
    # every target file is exactly ucp's shard of the atoms (which the test above ties to Megatron's modules)
    convert(str(src), str(tmp_path / "u"), from_layout="tp1", to_layout="universal")
    atoms = {p.removeprefix("model/"): t for p, t in ucp.open_checkpoint(str(tmp_path / "u")).read_atoms(
        [f"model/{n}" for n in canonical_atoms(tiny_config())]).items()}
    for name, rank in rank_files(layout).items():
        data = load_rank_file(mid / "iter_0000010" / name / RANK_FILE)
        assert data["args"].tensor_model_parallel_size == 2 and data["args"].expert_model_parallel_size == 2
        want = shard({"model": atoms}, tiny_config(), layout, rank, ())["model"]
        got = {n: t for n, t in data["model"].items() if not n.endswith("_extra_state")}
        assert list(got) == list(want), name
        for n in want:
            assert torch.equal(got[n], want[n]), (name, n)
        assert all(n.removesuffix(".weight") + "._extra_state" in data["model"] for n in want if "linear" in n)
    convert(str(mid), str(back), from_layout="tp2pp2ep2", to_layout="tp1")
    again = run_megatron(tmp, "load", back, tmp_path / "logits.pt")
    assert torch.equal(again["tokens"], ref["tokens"])
    torch.testing.assert_close(again["logits"], ref["logits"], rtol=0, atol=0)


def test_tp2_files_load_into_megatrons_own_tp2_model_with_the_same_logits(megatron_tp1, tmp_path):
    """TP slicing (fused QKV per query group, gate/up, vocab padding to 128*T) checked by Megatron itself."""
    _, src, ref = megatron_tp1
    convert(str(src), str(tmp_path / "tp2"), from_layout="tp1", to_layout="tp2")
    torch.save(ref, tmp_path / "logits.pt.ref")
    script = tmp_path / "tp2_worker.py"
    script.write_text(MEGATRON_TP2_WORKER)
    proc = subprocess.run([sys.executable, str(script), str(tmp_path / "tp2"), str(tmp_path / "logits.pt"), str(free_port())],
                          capture_output=True, text=True, timeout=300, check=False,
                          env=dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1"))
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
    logits = torch.load(tmp_path / "logits.pt", weights_only=True)["logits"]
    err = ((logits - ref["logits"]).abs().max() / ref["logits"].abs().max()).item()
    assert err <= 1e-5


def test_universal_to_megatron_with_tied_embeddings_and_virtual_stages(tmp_path):
    cfg = tiny_config(num_hidden_layers=4, tie_word_embeddings=True)
    full = random_full_state(cfg, states=())
    save_in_layout(full, cfg, "tp1", str(tmp_path / "u"), step=4)
    convert(str(tmp_path / "u"), str(tmp_path / "m"), from_layout="universal", to_layout="tp2pp2vpp2ep2")
    layout = parse_megatron_layout("tp2pp2vpp2ep2")
    for name, rank in rank_files(layout).items():
        data = load_rank_file(tmp_path / "m" / "iter_0000004" / name / RANK_FILE)
        want = shard(full, cfg, layout, rank, ())
        assert [k for k in data if k.startswith("model")] == ["model0", "model1"]
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


def _replace(data: dict, path: Path) -> None:
    """Write a new file in place of a memory-mapped one (a new inode: overwriting a mapped file is a bus error)."""
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
    with pytest.raises(SourceMismatchError, match=r"--from tp4pp1 does not match .*args say tp2pp1"):
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
    with pytest.raises(InteropError, match=r"mp_rank_01/model_optim_rng.pt: model/decoder.layers.1.self_attention.linear_proj.weight has shape \[32, 32\], but .* imply \[32, 16\]"):
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
    real = torch.save

    def failing(obj, f, *a, **k):
        calls.append(f)
        if len(calls) == 2:
            raise OSError("disk full")
        return real(obj, f, *a, **k)

    monkeypatch.setattr(torch, "save", failing)
    with pytest.raises(OSError, match="disk full"):
        convert(str(megatron_tp2), str(tmp_path / "out"), from_layout="tp2", to_layout="tp1pp2", workers=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m", "u"]


def test_cli_convert(megatron_tp2, tmp_path, capsys):
    argv = ["convert", str(megatron_tp2), str(tmp_path / "u2"), "--from", "tp2", "--to", "universal", "--no-progress"]
    assert ucp_cli.main(argv) == 0
    assert "converted 41 atoms" in capsys.readouterr().out
    assert ucp.open_checkpoint(str(tmp_path / "u2")).step == 3
    assert ucp_cli.main(["convert", str(megatron_tp2), str(tmp_path / "x"), "--from", "tp2pp2", "--to", "tp1"]) == 1
    assert "args say tp2pp1" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()
