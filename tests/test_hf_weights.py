"""Weights-only loads: RL and SFT jobs read only their parameters, in their own layout, from any checkpoint."""

from __future__ import annotations

import pytest
import torch

import ucp
from ucp.interop.weights import load_into_module, load_weights
from ucp.sharding.layout import parse_layout
from ucp.sharding.reshard import shard

from .helpers import step_path
from .test_hf import hf_reference_model, random_full_state, save_in_layout, tiny_config


def test_rl_worker_in_tp2_loads_from_a_tp1pp2dp2zero1_checkpoint(tmp_path):
    cfg = tiny_config()
    full = random_full_state(cfg)  # parameters plus Adam state: the rollout worker must skip the latter
    url = str(tmp_path / "pretrain")
    unpacked = ucp.SaveOptions(chunking=ucp.ChunkingPolicy(pack_below=0))  # (the optimizer state apart from the rest)
    save_in_layout(full, cfg, "tp1pp2dp2zero1", url, step=7, options=unpacked)
    import shutil

    shutil.rmtree(step_path(tmp_path / "pretrain", 7) / "optimizer")  # proof that nothing reads it
    target = parse_layout("tp2")
    read = 0
    for rank in range(2):
        got = load_weights(url, "tp2", rank, dtype="bf16")
        want = shard({"model": full["model"]}, cfg, target, rank, ())
        assert list(got.local) == ["model"] and list(got.params) == list(want["model"])
        for name, t in want["model"].items():
            assert got.params[name].dtype == torch.bfloat16, name
            assert torch.equal(got.params[name], t.bfloat16()), name
        assert got.report.bytes_read >= got.report.bytes_needed > 0
        read += got.report.bytes_read
    # at most each parameter byte once per TP rank (tiny atoms are single chunks, read whole by both ranks)
    params = sum(t.numel() * 4 for t in full["model"].values())
    assert read <= 2 * params


@pytest.mark.parametrize("where", ["local", "s3"])
def test_sft_job_in_tp1_loads_a_tp2pp2_checkpoint_and_trains(tmp_path, where, request):
    cfg = tiny_config()
    full = random_full_state(cfg)
    if where == "s3":
        bucket, options = request.getfixturevalue("moto_bucket")
        url = f"s3://{bucket}/pretrain"
    else:
        url, options = str(tmp_path / "pretrain"), None
    save_in_layout(full, cfg, "tp2pp2", url, step=3, storage_options=options)
    model = hf_reference_model(cfg, {n: torch.zeros_like(t) for n, t in full["model"].items()})
    report = load_into_module(url, model, "hf", storage_options=options)
    assert report.bytes_read < ucp.open_checkpoint(url, storage_options=options).total_bytes() / 2
    expected = hf_reference_model(cfg, full["model"]).state_dict()
    for name, t in model.state_dict().items():
        assert torch.equal(t, expected[name]), name
    # and it trains: a few AdamW steps on a fixed batch bring the loss down
    model.train()
    tokens = torch.randint(0, cfg.vocab_size, (4, 16), generator=torch.Generator().manual_seed(0))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(5):
        loss = model(input_ids=tokens, labels=tokens).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]


def test_load_into_module_refuses_a_module_it_cannot_fill(tmp_path):
    cfg = tiny_config(num_hidden_layers=1)
    url = str(tmp_path / "c")
    save_in_layout(random_full_state(cfg, states=()), cfg, "tp1", url)
    module = torch.nn.Linear(32, 100, bias=True)
    with pytest.raises(ucp.StateError, match=r"fills the module's parameters \['bias'\]"):
        load_into_module(url, module, {"weight": "lm_head.weight"})
    load_into_module(url, module, {"weight": "lm_head.weight"}, strict=False)
    assert torch.equal(module.weight, ucp.load(url)["model"]["lm_head.weight"])
    with pytest.raises(ucp.StateError, match="has shape"):
        load_into_module(url, torch.nn.Linear(32, 7, bias=False), {"weight": "lm_head.weight"})


@pytest.mark.parametrize("seed", range(2))
def test_load_weights_fills_the_jobs_own_parameters_in_place(tmp_path, seed):
    """A job that has built its model passes its parameters: they are filled where they lie (a bf16 one cast),
    what the job lacks comes back new, and a parameter of the wrong shape is refused by name."""
    import random

    rng = random.Random(seed)
    cfg = tiny_config(num_hidden_layers=4)
    full = random_full_state(cfg)
    url = str(tmp_path / "ckpt")
    save_in_layout(full, cfg, rng.choice(["tp2pp2", "tp1pp2dp2zero1", "tp2ep2dp2"]), url, step=1)
    layout, rank = rng.choice([("tp2", 1), ("tp1pp2vpp2", 1), ("tp2pp2", 2), ("tp1", 0)])
    want = load_weights(url, layout, rank).params
    names = sorted(want)
    rng.shuffle(names)
    missing, as_bf16 = names[0], set(names[1 : 1 + len(names) // 3])
    into = {
        n: torch.nn.Parameter(torch.full_like(want[n], 7.0, dtype=torch.bfloat16 if n in as_bf16 else None))
        for n in names[1:]
    }
    pointers = {n: p.data_ptr() for n, p in into.items()}
    got = load_weights(url, layout, rank, into=into)
    for n in names[1:]:
        assert into[n].data_ptr() == pointers[n] and into[n].requires_grad, n
        assert torch.equal(into[n], want[n].to(into[n].dtype)), n
        assert got.params[n].data_ptr() == pointers[n], n
    assert torch.equal(got.params[missing], want[missing])

    into[names[1]] = torch.nn.Parameter(torch.zeros(3, 5))
    with pytest.raises(ucp.StateError, match=names[1].replace(".", r"\.")):
        load_weights(url, layout, rank, into=into)
