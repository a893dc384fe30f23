"""Where a training step's time and memory go, per rank: the run report's data (trainer/report.py).

Each rank times the phases of its step (`StepProfile.phase`): data (the batch), forward and backward (the stage's
compute, TP collectives included), pipeline_wait (point-to-point sends and receives: the pipeline bubble and the
activation transfers), optimizer (DP gradient sync, clipping, the update) and checkpoint (the blocking part of a
save: the snapshot before the update in lazy mode, the hand-off after the step). `gather` collects every rank's
phases, its whole step's time (`step_s`: ranks start a step at different times, the first one above all) and peak
memory (RSS, and CUDA's peak allocated on a GPU) to rank 0 with one small all-gather per step,
which writes them into the metrics file as the step record's "ranks".
"""

from __future__ import annotations

import contextlib
import resource
import sys
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from .parallel import collectives

PHASES = ("data", "forward", "backward", "pipeline_wait", "optimizer", "checkpoint")


class StepProfile:
    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self.step_s = 0.0  # this rank's whole train_step (the phases but checkpoint's after-step part lie in it)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] += time.perf_counter() - t0

    def gather(self, coords: Any, device: torch.device) -> list[dict[str, Any]]:
        """Every rank's phases, coordinates and peak memory (all ranks call this; rank order)."""
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
        cuda = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else -1
        mine = [self.seconds[p] for p in PHASES] + [self.step_s, rss, cuda, coords.tp, coords.pp, coords.dp, coords.ep]
        local = torch.tensor(mine, dtype=torch.float64, device=device)
        world = dist.get_world_size() if dist.is_initialized() else 1
        rows = [torch.empty_like(local) for _ in range(world)]
        if world > 1:
            collectives.all_gather(rows, local)
        else:
            rows = [local]
        out = []
        for rank, row in enumerate(rows):
            values = row.tolist()
            record: dict[str, Any] = {"rank": rank} | dict(zip(PHASES, values[: len(PHASES)]))
            step_s, rss_b, cuda_b, tp, pp, dp, ep = values[len(PHASES) :]
            record |= {"step_s": step_s, "tp": int(tp), "pp": int(pp), "dp": int(dp), "ep": int(ep)}
            record["peak_rss_bytes"] = int(rss_b)
            if cuda_b >= 0:
                record["cuda_peak_allocated_bytes"] = int(cuda_b)
            out.append(record)
        return out
