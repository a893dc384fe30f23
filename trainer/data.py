"""Token sources: the dataloaders package's PretrainLoader (the default) and a synthetic stream (for tests).

Both give step s (numbered from 1) the global samples [(s-1)*G, s*G) of their global order, G = global batch
size; DP rank d takes the d-th contiguous 1/D of them, so the global batch (and the order of its microbatches)
is the same in every layout. Their state is JSON that a checkpoint carries.

The synthetic stream's sample i is a pure function of (seed, i): no files, nothing to restore.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

import torch

from .seed import derive_seed


class TokenSource(Protocol):
    def get_batch(self, step: int) -> torch.Tensor:
        """This DP rank's samples of `step`: int64 [local_batch, seq_len + 1] (inputs, then shifted labels)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class SyntheticTokens:
    """Learnable synthetic sequences: each sample walks the vocabulary with a random start and stride."""

    def __init__(self, vocab_size: int, seq_len: int, global_batch: int, dp_rank: int, dp_size: int, seed: int):
        if global_batch % dp_size:
            raise ValueError(f"global batch {global_batch} is not divisible by dp={dp_size}")
        self.vocab_size, self.seq_len, self.seed = vocab_size, seq_len, seed
        self.global_batch, self.dp_rank, self.dp_size = global_batch, dp_rank, dp_size
        self.consumed_samples = 0  # global samples handed out by steps before the next get_batch

    def sample(self, index: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(derive_seed(self.seed, f"sample/{index}"))
        start = torch.randint(self.vocab_size, (1,), generator=generator)
        stride = torch.randint(1, 8, (1,), generator=generator)
        return (start + stride * torch.arange(self.seq_len + 1)) % self.vocab_size

    def get_batch(self, step: int) -> torch.Tensor:
        local = self.global_batch // self.dp_size
        first = (step - 1) * self.global_batch + self.dp_rank * local
        self.consumed_samples = step * self.global_batch
        return torch.stack([self.sample(first + j) for j in range(local)])

    def state_dict(self) -> dict[str, Any]:
        return {"seed": self.seed, "consumed_samples": self.consumed_samples}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.seed, self.consumed_samples = state["seed"], state["consumed_samples"]


class PretrainTokens:
    """`dataloaders.PretrainLoader` over a prepared dataset, behind the step-indexed interface.

    The loader is sequential and elastic: its state counts consumed samples, which any DP size resumes from.
    """

    def __init__(
        self,
        path: str | Path,
        seq_len: int,
        global_batch: int,
        dp_rank: int,
        dp_size: int,
        seed: int,
        shuffle: str = "windows",
    ):
        from dataloaders import PretrainLoader

        self.global_batch = global_batch
        self.loader = PretrainLoader(
            str(path), seq_len, global_batch, dp_rank=dp_rank, dp_size=dp_size, seed=seed, shuffle=shuffle
        )

    def get_batch(self, step: int) -> torch.Tensor:
        # A step-indexed call on a sequential loader: a mismatch means the state was not restored.
        expected = (step - 1) * self.global_batch
        if self.loader.consumed_samples != expected:
            raise RuntimeError(
                f"step {step} needs the data position {expected}, the loader is at {self.loader.consumed_samples}"
            )
        batch = next(self.loader)
        return torch.cat([batch["input_ids"], batch["labels"][:, -1:]], dim=1)

    def state_dict(self) -> dict[str, Any]:
        return self.loader.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loader.load_state_dict(state)

    def close(self) -> None:
        self.loader.close()
