"""`ucp demo`: save a small model's training state, load it into a fresh model, show what was written."""

from __future__ import annotations

import torch

from .engine.checkpoint import open_checkpoint
from .engine.inspection import describe, format_table
from .manager import CheckpointManager
from .training_state import restore_training_state, training_state


def _job(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Embedding(512, 64),
        torch.nn.TransformerEncoderLayer(d_model=64, nhead=4, dim_feedforward=256, batch_first=True),
        torch.nn.Linear(64, 512),
    )
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: int) -> float:
    loss = torch.tensor(0.0)
    for _ in range(steps):
        tokens = torch.randint(0, 512, (8, 33))
        logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 512), tokens[:, 1:].reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return loss.item()


def run(directory: str, steps: int = 3) -> int:
    model, optimizer = _job(seed=0)
    loss = _train(model, optimizer, steps)
    manager = CheckpointManager(directory, keep_last=2)
    step = (manager.latest_step() or 0) + steps
    manager.save(step, training_state(model, optimizer, extra={"step": step, "loss": loss}))
    print(f"trained {steps} steps (loss {loss:.4f}), saved step {step} to {directory}")

    fresh_model, fresh_optimizer = _job(seed=1)
    restored = manager.restore()
    restore_training_state(restored, fresh_model, fresh_optimizer)
    same = all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), fresh_model.state_dict().values()))
    print(f"loaded step {restored['step']} into a fresh model: parameters bitwise equal: {same}\n")
    print(format_table(describe(open_checkpoint(directory, step))))
    return 0 if same else 1
