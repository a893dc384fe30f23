"""Weights-only loads: RL and SFT jobs read only their parameters, in their own layout, from any checkpoint."""

from __future__ import annotations

import pytest
import torch

import ucp
from ucp.interop.weights import load_into_module, load_weights
from ucp.layout import parse_layout
from ucp.reshard import shard

from .helpers import step_path
from .test_hf import hf_reference_model, random_full_state, save_in_layout, tiny_config


def test_rl_worker_in_tp2_loads_from_a_tp1pp2dp2zero1_checkpoint(tmp_path):
    cfg = tiny_config()
    full = random_full_state(cfg)  # parameters plus Adam state: the rollout worker must skip the latter
    url = str(tmp_path / "pretrain")
    save_in_layout(full, cfg, "tp1pp2dp2zero1", url, step=7)
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
        bucket, options = request.getfixturevalue("s3_bucket")
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
