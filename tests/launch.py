"""Launch a world of processes as torchrun would, for tests: trainer.launch, with the ranks' output returned."""

from __future__ import annotations

import tempfile
from pathlib import Path

from trainer.launch import free_port, start, wait

__all__ = ["SEED_VARIABLE", "free_port", "spawn"]

SEED_VARIABLE = "UCP_TEST_SEED"  # seeds the tests' collection-time draws (helpers.DRAW; conftest sets and prints it)


def spawn(argv: list[str], world: int, timeout: float = 180, env: dict[str, str] | None = None) -> list[str]:
    """Run `python *argv` as `world` ranks of one process group; return their outputs, fail with them."""
    with tempfile.TemporaryDirectory() as tmp:
        logs = Path(tmp)
        procs = start(argv, world, logs, env=env)
        try:
            wait(procs, logs, timeout)
        except RuntimeError as e:
            raise AssertionError(f"{argv} failed: {e}") from None
        return [(logs / f"rank{r}.log").read_text() for r in range(world)]
