"""The token source: a deterministic synthetic stream, behind the interface a real loader will implement.

Sample i of the global stream is a pure function of (seed, i). Step s (numbered from 1) trains on global
samples [(s-1)*G, s*G), G = global batch size; DP rank d takes the d-th contiguous 1/D of them, so the
global batch (and the order of its microbatches) is the same in every layout.
"""

from __future__ import annotations

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
