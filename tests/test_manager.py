"""CheckpointManager: steps, latest, restore, retention, garbage collection; training-state helpers."""

from __future__ import annotations

import pytest
import torch

import ucp
from ucp.format.manifest import step_dirname


def test_steps_latest_restore_and_retention(tmp_path):
    manager = ucp.CheckpointManager(str(tmp_path), keep_last=2)
    assert manager.steps() == [] and manager.latest_step() is None
    for step in (10, 20, 30):
        manager.save(step, {"w": torch.full((3,), float(step)), "step": step})
    assert manager.steps() == [20, 30] and manager.latest_step() == 30
    assert not (tmp_path / step_dirname(10)).exists()
    assert manager.restore()["step"] == 30
    assert torch.equal(manager.restore(20)["w"], torch.full((3,), 20.0))
    with pytest.raises(ucp.CheckpointNotFoundError, match="no step 10"):
        manager.restore(10)


def test_keep_last_must_be_positive(tmp_path):
    with pytest.raises(ValueError, match="keep_last"):
        ucp.CheckpointManager(str(tmp_path), keep_last=0)


def _make_job():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Dropout(0.1), torch.nn.Linear(32, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    return model, optimizer


def _train(model, optimizer, steps):
    for _ in range(steps):
        x = torch.randn(16, 8)  # drawn from the global RNG, which the checkpoint carries
        loss = model(x).square().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


@pytest.mark.parametrize("optimizer_cls", [torch.optim.AdamW, torch.optim.SGD])
def test_resume_is_bitwise_equal_to_uninterrupted_training(tmp_path, optimizer_cls):
    def make():
        model, _ = _make_job()
        kwargs = (
            {"lr": 1e-2, "momentum": 0.9} if optimizer_cls is torch.optim.SGD else {"lr": 1e-2, "betas": (0.9, 0.95)}
        )
        return model, optimizer_cls(model.parameters(), **kwargs)

    model, optimizer = make()
    _train(model, optimizer, 20)
    reference = [p.detach().clone() for p in model.parameters()]

    model, optimizer = make()
    _train(model, optimizer, 10)
    manager = ucp.CheckpointManager(str(tmp_path))
    manager.save(10, ucp.training_state(model, optimizer))

    torch.manual_seed(1234)  # a fresh process would start from other RNG states
    fresh_model, fresh_optimizer = make()
    ucp.restore_training_state(manager.restore(), fresh_model, fresh_optimizer)
    _train(fresh_model, fresh_optimizer, 10)
    for expected, actual in zip(reference, fresh_model.parameters()):
        assert torch.equal(expected, actual)


def test_optimizer_state_is_stored_per_parameter_name(tmp_path):
    model, optimizer = _make_job()
    _train(model, optimizer, 1)
    ucp.save(ucp.training_state(model, optimizer), str(tmp_path))
    atoms = ucp.open_checkpoint(str(tmp_path)).atoms
    assert "optimizer/state/0.weight/exp_avg" in atoms and "optimizer/state/3.bias/exp_avg_sq" in atoms
    assert atoms["rng/torch"].dtype == "uint8"
    state = ucp.load(str(tmp_path))
    assert state["optimizer"]["param_groups"][0]["params"] == ["0.weight", "0.bias", "3.weight", "3.bias"]
    assert state["optimizer"]["param_groups"][0]["betas"] == [0.9, 0.95]


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("stop", ["close", "abandon"])
def test_a_closed_or_abandoned_manager_refuses_to_save_and_leaves_nothing(tmp_path, mode, stop):
    manager = ucp.CheckpointManager(str(tmp_path), mode=mode)
    manager.save(1, {"w": torch.ones(3)}).result()
    getattr(manager, stop)()
    manager.close()  # (closing after either: what the manager was stays what it says)
    with pytest.raises(ucp.StateError, match=f"was {stop}(ed|d): saves need a new CheckpointManager"):
        manager.save(2, {"w": torch.ones(3)})
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("step_")) == [step_dirname(1)]
    with ucp.CheckpointManager(str(tmp_path)) as again:
        assert again.steps() == [1] and again.restore()["w"].tolist() == [1.0, 1.0, 1.0]


@pytest.mark.parametrize("step", [-1, 2**63, 2**64, True, "3"])
def test_a_step_no_reader_can_hold_is_refused_before_anything_is_written(tmp_path, step):
    """(A step past 2^63 - 1 was committed, then unreadable: its marker out of every reader's bounds, invisible to
    `steps()` and never removed.)"""
    manager = ucp.CheckpointManager(str(tmp_path))
    with pytest.raises(ucp.StateError, match=r"a step must be an integer in \[0, 2\^63 - 1\]"):
        manager.save(step, {"w": torch.ones(3)})
    manager.save(2**63 - 1, {"w": torch.ones(3)}).result()
    assert manager.steps() == [2**63 - 1]
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("step_")] == [step_dirname(2**63 - 1)]


@pytest.mark.parametrize("where", ["manager", "save"])
def test_a_save_mode_that_does_not_exist_is_refused_before_anything_begins(tmp_path, where):
    """(Refused only inside the save, after its attempt began: the attempt stayed, owned by a live process.)"""
    with pytest.raises(ucp.UcpError, match="save mode must be one of .*, got 'asynch'"):
        manager = ucp.CheckpointManager(str(tmp_path), **({"mode": "asynch"} if where == "manager" else {}))
        manager.save(0, {"w": torch.ones(2)}, mode="asynch")
    assert not any(p.name.startswith("step_") for p in tmp_path.iterdir())


def test_a_step_older_than_every_kept_one_is_saved_then_removed_with_a_warning(tmp_path, caplog):
    manager = ucp.CheckpointManager(str(tmp_path), keep_last=2)
    for step in (5, 6):
        manager.save(step, {"w": torch.ones(3)})
    with caplog.at_level("WARNING", logger="ucp"):
        manager.save(3, {"w": torch.ones(3)}).result()
    assert manager.steps() == [5, 6]
    assert "step 3 at" in caplog.text and "removed as soon as it was committed" in caplog.text
