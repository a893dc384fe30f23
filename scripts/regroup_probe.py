"""Can the survivors of a lost process re-form their gloo process group in place, without a restart?

    python scripts/regroup_probe.py [--world 4] [--trials 10] [--timeout 5]

A probe for docs/ELASTIC.md ("recovery without a restart"), not part of ucp. The launcher hosts a TCPStore (as
torchrun's agent hosts the rendezvous store) and starts `--world` worker processes on it; they all-reduce a
counter in a loop. The launcher SIGKILLs one worker at a random moment. Every survivor must see its collective
fail (a reset connection at once, else the group's `--timeout`), destroy its process group, and form a new one of
the survivors through the same store under a new prefix (rank = its place among the survivors), then check an
all-reduce in the new group and keep its tensors. Membership is taken as known (world - 1): agreeing on it is the
rendezvous's job. Per trial: seconds from the kill to the first failed collective on each survivor, and to the
new group's first all-reduce; a trial fails if any survivor hangs, errs in the new group or loses its state.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from datetime import timedelta

WORKER = r"""
import json, os, sys, time
from datetime import timedelta
import torch, torch.distributed as dist
rank, world, port, timeout = (int(x) for x in sys.argv[1:5])
store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
dist.init_process_group("gloo", store=dist.PrefixStore("gen0", store), rank=rank, world_size=world,
                        timeout=timedelta(seconds=timeout))
state = torch.full((1 << 20,), float(rank))  # the tensors a survivor keeps across the failure
x = torch.ones(1)
print(json.dumps({"ready": rank}), flush=True)
while True:
    try:
        dist.all_reduce(x)
        time.sleep(0.01)
    except Exception as e:
        failed_at = time.time()
        break
survivors = world - 1
new_rank = int(store.add("gen1/joined", 1)) - 1  # first come, first ranked
dist.destroy_process_group()
dist.init_process_group("gloo", store=dist.PrefixStore("gen1", store), rank=new_rank, world_size=survivors,
                        timeout=timedelta(seconds=timeout))
y = torch.ones(1)
dist.all_reduce(y)
formed_at = time.time()
ok = int(y.item()) == survivors and bool((state == float(rank)).all())
print(json.dumps({"rank": rank, "failed_at": failed_at, "formed_at": formed_at, "ok": ok}), flush=True)
dist.destroy_process_group()
"""


def trial(world: int, timeout: int, rng: random.Random) -> dict:
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", WORKER, str(r), str(world), str(store.port), str(timeout)],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        for r in range(world)
    ]
    try:
        for p in procs:
            json.loads(p.stdout.readline())
        time.sleep(rng.uniform(0.2, 1.0))
        victim = rng.randrange(world)
        killed_at = time.time()
        os.kill(procs[victim].pid, signal.SIGKILL)
        results = []
        for r, p in enumerate(procs):
            if r == victim:
                continue
            try:
                out, _ = p.communicate(timeout=timeout * 3 + 30)
                results.append(json.loads(out.strip().splitlines()[-1]))
            except (subprocess.TimeoutExpired, IndexError, json.JSONDecodeError):
                results.append({"rank": r, "ok": False})
        ok = all(r.get("ok") for r in results)
        return {
            "victim": victim,
            "ok": ok,
            "detect_s": max(r["failed_at"] - killed_at for r in results) if ok else None,
            "reformed_s": max(r["formed_at"] - killed_at for r in results) if ok else None,
        }
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--trials", type=int, default=10)
    p.add_argument("--timeout", type=int, default=5, help="the process groups' collective timeout, seconds")
    p.add_argument("--seed", type=int, default=None)
    args = p.parse_args()
    rng = random.Random(args.seed)
    runs = []
    for i in range(args.trials):
        r = trial(args.world, args.timeout, rng)
        runs.append(r)
        print(f"trial {i}: {r}", flush=True)
    good = [r for r in runs if r["ok"]]
    print(
        f"{len(good)}/{len(runs)} trials re-formed the group of {args.world - 1} in place"
        + (
            f"; kill -> every survivor's failed collective {statistics.median(r['detect_s'] for r in good):.2f} s, "
            f"-> new group's first all-reduce {statistics.median(r['reformed_s'] for r in good):.2f} s (medians)"
            if good
            else ""
        )
    )


if __name__ == "__main__":
    main()
