"""Run by test_races.py, twice at once: save step 5 of TRIALS roots (or, through a manager, step t of one root in
trial t), racing the other saver on each.

Usage: python -m tests.race_saver URL WRITER TRIALS SYNC_DIR [save|sync|async]
Both savers meet at a file barrier before each trial, then wait a random 0-20 ms and save: `save` with
`ucp.save`, one root per trial; `sync` and `async` with one CheckpointManager of that mode (its writer process, its
retention and gc after every commit) on one root. Prints one JSON line per trial: {"trial": t, "outcome":
"committed" | "exists" | "<another error>", "after_commit": [errors after a commit]}. S3 options come from the
environment (UCP_TEST_STORAGE_OPTIONS, JSON).
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
from pathlib import Path

import torch

import ucp

SAVE_OPTIONS = ucp.SaveOptions(chunking=ucp.ChunkingPolicy(object_bytes=4096, inner_bytes=1024), fsync=False)


def state(writer: int, trial: int) -> dict:
    g = torch.Generator().manual_seed(1000 * writer + trial)
    return {"model": {f"w{i}": torch.randn(32, 64, generator=g) for i in range(8)}, "writer": writer, "trial": trial}


def main(url: str, writer: int, trials: int, sync_dir: str, how: str = "save") -> None:
    options = json.loads(os.environ.get("UCP_TEST_STORAGE_OPTIONS", "null"))
    rng = random.Random(writer * 7919 + int(time.time()))
    manager = None
    if how != "save":
        manager = ucp.CheckpointManager(url, mode=how, storage_options=options, options=SAVE_OPTIONS)  # type: ignore[arg-type]
    for trial in range(trials):
        Path(sync_dir, f"{trial}.{writer}").touch()
        while not Path(sync_dir, f"{trial}.{1 - writer}").exists():
            time.sleep(0.0005)
        time.sleep(rng.uniform(0, 0.02))
        after: list[str] = []
        try:
            if manager is None:
                ucp.save(
                    state(writer, trial), f"{url}/trial{trial}", step=5, storage_options=options, options=SAVE_OPTIONS
                )
            else:
                manager.save(trial, state(writer, trial)).result()
                after = [f"{type(e).__name__}: {e}" for e in manager.after_commit_errors]
            outcome = "committed"
        except ucp.StepExistsError as e:  # (this trial's step, not an earlier trial's failure raised again)
            step = 5 if manager is None else trial
            outcome = "exists" if f"step {step} " in str(e) else f"StepExistsError of another step: {e}"
        except Exception as e:  # noqa: BLE001 -- reported to the test, which fails on it
            outcome = f"{type(e).__name__}: {e}"
        print(json.dumps({"trial": trial, "outcome": outcome, "after_commit": after}), flush=True)
    if manager is not None:
        manager.close()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], *sys.argv[5:])
