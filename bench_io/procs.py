"""`--procs N`: N processes (ranks), each saving and loading its own 1/N of the state at the same time.

MLPerf Storage's rules: the ranks start each phase together (a barrier), the phase's time is the max over
ranks, the aggregate GB/s is all ranks' bytes over that time, and the slowest rank's own GB/s (the min over
ranks) is reported beside it. Each rank builds its share of the state once (seed + rank) and keeps its method
objects, so a load follows its own save. The parent makes the files cold between the phases.
"""

from __future__ import annotations

import multiprocessing as mp
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .methods import METHODS, plain_copy_s
from .runner import Measurement, PeakRSS, Plan, record_stored
from .targets import Target, is_remote


@dataclass
class StateInfo:
    """What the parent knows of the ranks' states (it holds none of their bytes)."""

    name: str
    nbytes: int  # all ranks together
    count: int  # tensors, all ranks together


def _rank_dir(directory: Any, rank: int) -> Any:
    sub = directory / f"rank{rank}"
    if not is_remote(sub):
        sub.mkdir(parents=True, exist_ok=True)
    return sub


def _worker(rank: int, size: int, seed: int, io_threads: int, barrier: Any, conn: Any) -> None:
    import torch

    torch.set_num_threads(1)
    from .state import transformer_state

    state = transformer_state(size, seed=seed + rank)
    conn.send((state.name, state.nbytes, state.count))
    methods: dict[str, Any] = {}
    while True:
        msg = conn.recv()
        if msg is None:
            return
        op, name, directory = msg
        method = methods.setdefault(name, METHODS[name](io_threads=io_threads))
        where = _rank_dir(directory, rank)
        reply: dict[str, Any] = {"nbytes": state.nbytes}
        try:
            if op == "save" and method.paired_copy:
                reply["copy_s"] = plain_copy_s(state)
            barrier.wait(timeout=600)
            with PeakRSS() as rss:
                t0 = time.perf_counter()
                if op == "save":
                    extra = method.save(state, where) or {}
                    reply["s"] = extra.get("time_s", time.perf_counter() - t0)
                    reply["blocking_s"] = extra.get("blocking_s")
                else:
                    loaded = method.load(where)
                    reply["s"] = time.perf_counter() - t0
            reply["rss"] = rss.extra_mib
            if op == "load":
                problem = state.verify(loaded)
                del loaded
                if problem:
                    reply["error"] = f"rank {rank}: verification failed: {problem}"
        except Exception as e:  # noqa: BLE001
            reply["error"] = f"rank {rank}: {type(e).__name__}: {e}"
            reply["trace"] = traceback.format_exc()
            barrier.abort()
        conn.send(reply)


class RankPool:
    """N spawned rank processes, each holding its share of the state."""

    def __init__(self, procs: int, size: int, seed: int, io_threads: int):
        ctx = mp.get_context("spawn")
        self.barrier = ctx.Barrier(procs)
        self.conns, self.procs = [], []
        per_rank_threads = max(1, io_threads // procs)
        for rank in range(procs):
            parent, child = ctx.Pipe()
            p = ctx.Process(
                target=_worker, args=(rank, size // procs, seed, per_rank_threads, self.barrier, child), daemon=True
            )
            p.start()
            self.conns.append(parent)
            self.procs.append(p)
        infos = [c.recv() for c in self.conns]
        self.state = StateInfo(infos[0][0], sum(i[1] for i in infos), sum(i[2] for i in infos))

    def phase(self, op: str, name: str, directory: Any) -> list[dict[str, Any]]:
        if self.barrier.broken:
            self.barrier.reset()
        for c in self.conns:
            c.send((op, name, directory))
        return [c.recv() for c in self.conns]

    def close(self) -> None:
        for c in self.conns:
            try:
                c.send(None)
            except OSError:
                pass
        for p in self.procs:
            p.join(30)
            if p.is_alive():
                p.terminate()


def measure(pool: RankPool, name: str, target: Target, repeat: int, cache_mode: str) -> Measurement:
    method = METHODS[name]
    s = pool.state
    n = len(pool.procs)
    m = Measurement(s.name, name, target.name, repeat, s.nbytes, s.count, procs=n)
    directory = target.workdir(f"{s.name}-{name}-p{n}")
    try:
        saves = pool.phase("save", name, directory)
        errors = [r["error"] for r in saves if "error" in r]
        if errors:
            m.error = errors[0]
            return m
        m.save_s = max(r["s"] for r in saves)
        m.rank_min_save_gbps = min(r["nbytes"] / r["s"] / 1e9 for r in saves)
        blocking = [r["blocking_s"] for r in saves if r.get("blocking_s") is not None]
        m.blocking_s = max(blocking) if blocking else None
        copies = [r["copy_s"] for r in saves if r.get("copy_s") is not None]
        m.copy_s = max(copies) if copies else None
        m.save_peak_rss_mib = sum(r["rss"] or 0 for r in saves)  # all ranks together
        record_stored(m, method, target, directory, cache_mode)
        loads = pool.phase("load", name, directory)
        errors = [r["error"] for r in loads if "error" in r]
        if errors:
            m.error = errors[0]
            return m
        if method.storage:  # the plain copy has no load
            m.load_s = max(r["s"] for r in loads)
            m.rank_min_load_gbps = min(r["nbytes"] / r["s"] / 1e9 for r in loads)
        m.load_peak_rss_mib = sum(r["rss"] or 0 for r in loads)
    except Exception as e:  # noqa: BLE001
        m.error = f"{type(e).__name__}: {e}"
    finally:
        target.remove(directory)
    return m


def run(
    pool: RankPool,
    methods: list[str],
    plan: Plan,
    progress: Callable[[int, int, Measurement], None] | None = None,
) -> list[Measurement]:
    cells = plan.cells(methods)
    total = plan.repeats * len(cells)
    results: list[Measurement] = []
    for repeat in range(plan.repeats):
        for i, name in cells:
            m = measure(pool, name, plan.targets[i], repeat, plan.cache_mode)
            results.append(m)
            if progress:
                progress(len(results), total, m)
    return results
