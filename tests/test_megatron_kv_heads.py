"""Fewer KV heads than TP ranks, checked against megatron-core 0.16.1 on CPU.

megatron-core accepts `num_query_groups` a divisor of TP as well as a multiple (transformer_config.py), keeps
linear_qkv a ColumnParallelLinear over the global fused tensor (group by group: its query heads, its key head, its
value head), so TP rank t holds the t-th run of its rows, and has the ranks of a query group gather the group's
output before each keeps its own query heads (attention.py, `num_query_groups < world_size`). ucp's reshaper lays
the fused QKV out the same way (`ucp.sharding.partition`); these tests hold it to megatron-core's own sharding and math:

- megatron-core saves torch_dist in one TP degree and loads it in another (with 1 or 2 KV heads below TP 2 or 4);
  ucp's conversions of the same checkpoint (rank files of the loading layout, ucp's format and back, the weights
  loader) load bitwise as megatron-core's own resharding;
- megatron-core's GPT model in TP 2 and TP 4 loads ucp's rank files of a Qwen2 with one KV head strictly and
  computes transformers' logits.

The distributed optimizer's buffers with fewer KV heads than TP: tests/test_megatron_distopt.py."""

from __future__ import annotations

import pytest
import torch

import ucp
from ucp.interop.hf import import_hf
from ucp.interop.megatron.convert import convert
from ucp.interop.weights import load_weights

from .helpers import DRAW
from .launch import spawn

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]

# (KV heads, the TP degree megatron-core saves in, the TP degree it loads in): the loading TP above the KV heads
CASES = [(kv, a, b) for kv in (1, 2) for b in (2, 4) if kv < b for a in (1, 2, 4) if a != b]


@pytest.mark.parametrize(("kv", "saved_tp", "load_tp"), DRAW.sample(CASES, 2))
def test_megatron_core_loads_ucps_conversions_bitwise_as_its_own_reshard(tmp_path, kv, saved_tp, load_tp):
    pytest.importorskip("megatron.core")
    # hidden 32, FFN 64, 2 layers, 4 experts, 4 heads in `kv` query groups (the Mixtral test model)
    env = {"PYTHONWARNINGS": "ignore", "UCP_MEGATRON_SHAPE": f"32,64,2,4,4,{kv}"}
    worker = "tests/megatron_dist_worker.py"
    src = tmp_path / "src"
    spawn([worker, "save", str(saved_tp), "1", str(src)], saved_tp, 300, env)
    layout = f"tp{load_tp}"
    convert(str(src), str(tmp_path / "files"), from_layout="torch_dist", to_layout=layout)
    convert(str(src), str(tmp_path / "u"), from_layout="torch_dist", to_layout="universal")
    convert(str(tmp_path / "u"), str(tmp_path / "back"), from_layout="universal", to_layout="torch_dist")
    convert(str(tmp_path / "u"), str(tmp_path / "from_u"), from_layout="universal", to_layout=layout)
    # the rank files read back: the same atoms
    convert(str(tmp_path / "files"), str(tmp_path / "u2"), from_layout=layout, to_layout="universal")
    atoms, again = ucp.load(str(tmp_path / "u"))["model"], ucp.load(str(tmp_path / "u2"))["model"]
    assert sorted(atoms) == sorted(again) and all(torch.equal(atoms[n], again[n]) for n in atoms)
    out = tmp_path / "params"
    ckpts = [src, tmp_path / "files", tmp_path / "back", tmp_path / "from_u"]
    spawn([worker, "load", str(load_tp), "1", str(out), *map(str, ckpts)], load_tp, 300, env)
    qkv = "decoder.layers.0.self_attention.linear_qkv.weight"
    for rank in range(load_tp):
        own, *ours = torch.load(f"{out}.{rank}")
        assert own[qkv].shape[0] == (4 + 2 * kv) * 8 // load_tp  # (a run of the fused rows, not whole groups)
        for name, got in zip(("rank files", "torch_dist", "rank files from ucp"), ours, strict=True):
            assert sorted(got) == sorted(own)
            bad = [n for n in own if not torch.equal(own[n], got[n])]
            assert not bad, f"kv={kv} tp{saved_tp} -> tp{load_tp}, rank {rank}: {name} differ in {bad[:4]}"
        # the weights loader gives each rank megatron-core's own tensors
        weights = load_weights(str(tmp_path / "u"), layout, rank).params
        bad = [n for n in own if not torch.equal(own[n], weights[n])]
        assert not bad and sorted(weights) == sorted(own), f"load_weights rank {rank}: {bad[:4]}"


@pytest.mark.parametrize("tp", [2, 4])
def test_megatron_core_computes_transformers_logits_from_ucps_files_of_a_model_with_one_kv_head(tmp_path, tp):
    """A random Qwen2 (q/k/v biases: the bias is split with the weight's rows) with 4 query heads in one group,
    imported and converted to tp2 or tp4 rank files: megatron-core's GPT model in that TP degree loads them strictly
    and computes transformers' logits (within float tolerance: another kernel order)."""
    pytest.importorskip("megatron.core")
    from .helpers import perturb_parameters
    from .megatron_worker import tokens
    from .test_families import ARCHS, SHAPE

    config_cls, model_cls, _ = ARCHS["qwen2"]
    torch.manual_seed(DRAW.randrange(1000))
    model = model_cls(config_cls(**{**SHAPE, "num_key_value_heads": 1}, rope_theta=1e4, rms_norm_eps=1e-6)).eval()
    perturb_parameters(model)
    model.save_pretrained(tmp_path / "hf")
    import_hf(tmp_path / "hf", str(tmp_path / "u"))
    convert(str(tmp_path / "u"), str(tmp_path / "megatron"), from_layout="universal", to_layout=f"tp{tp}")
    out = tmp_path / "logits"
    head_dim = SHAPE["hidden_size"] // SHAPE["num_attention_heads"]
    argv = ["tests/megatron_family_worker.py", str(tmp_path / "megatron"), str(out), "1", "0", str(head_dim)]
    spawn(argv, tp, timeout=300, env={"PYTHONWARNINGS": "ignore", "UCP_FAMILY_TP": str(tp), "UCP_FAMILY_KV": "1"})
    with torch.no_grad():
        expected = model(tokens()).logits
    for rank in range(tp):
        got = torch.load(f"{out}.{rank}", weights_only=True)
        assert torch.allclose(got, expected, atol=1e-4, rtol=1e-4), (rank, (got - expected).abs().max())
