"""Run the measurements: every (state, target, method) once per repeat, repeats outermost so that drift in
a shared machine's load spreads over all methods instead of penalizing whichever ran last.

One measurement: fresh directory -> timed save (durable on return) -> make the files cold -> timed load ->
verify against the saved state (untimed) -> delete. Throughput is tensor payload bytes / seconds, in GB/s
(1e9 bytes), the same bytes for every method whatever its file overhead (stored bytes are reported apart).
"""

from __future__ import annotations

import contextlib
import os
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, Self

from ucp.base import heap
from ucp.storage import FSSPEC_IO_THREADS, LocalStorage

from .methods import METHODS, Method, plain_copy_s
from .state import SyntheticState
from .targets import Probe, S3Requests, Target, is_remote, iter_files


@dataclass
class Measurement:
    state: str
    method: str
    target: str
    repeat: int
    nbytes: int
    tensors: int
    save_s: float | None = None
    load_s: float | None = None
    stored_bytes: int | None = None
    files: int | None = None  # objects the save left (files on a local target, keys on S3)
    dirs: int | None = None  # directories the save left (local targets)
    save_requests: int | None = None  # S3: API calls this process made during the save (not a writer process's)
    save_request_kinds: dict[str, int] | None = None  # ... by operation
    blocking_s: float | None = None  # async saves (and the plain copy): how long the caller was held
    copy_s: float | None = None  # async saves: a plain copy of the same bytes, timed just before the save
    procs: int = 1  # ranks saving/loading at once (--procs): times are the max over ranks
    rank_min_save_gbps: float | None = None  # --procs: the slowest rank's own GB/s (MLPerf's min over ranks)
    rank_min_load_gbps: float | None = None
    cache: str | None = None  # how the read was made cold: drop_caches | fadvise | tmpfs | s3 | none (warm)
    resident_after_drop: float | None = None  # fraction of the files' pages still cached (mincore)
    save_peak_rss_mib: float | None = None  # peak RSS during the call, above RSS before it
    load_peak_rss_mib: float | None = None
    error: str | None = None  # an exception, or a failed verification
    save_error: str | None = None  # a peer's save that failed: its files were written another way, its load measured

    @property
    def ok(self) -> bool:
        """Whether the load's figure stands (a save that failed while the load was measured says so apart)."""
        return self.error is None


@dataclass
class Summary:
    """Medians over the repeats of one (state, method, target)."""

    state: str
    method: str
    target: str
    repeats: int
    nbytes: int
    tensors: int
    save_s: float | None
    load_s: float | None
    save_gbps: float | None
    load_gbps: float | None
    save_vs_raw: float | None = None
    load_vs_raw: float | None = None
    blocking_s: float | None = None
    copy_s: float | None = None  # median of the plain copies paired with the async saves (the copy row: its own)
    blocking_vs_copy: float | None = None  # aim: <= 1.5 (blocking_s / copy_s, as the table shows them)
    blocking_vs_dcp_async: float | None = None  # aim: <= 0.5 (blocking_s / dcp-async's blocking_s)
    procs: int = 1
    rank_min_save_gbps: float | None = None
    rank_min_load_gbps: float | None = None
    cache: str = ""
    resident_after_drop: float | None = None
    stored_bytes: int | None = None
    files: int | None = None  # objects per save (median)
    dirs: int | None = None
    save_requests: int | None = None  # S3 requests per save (median)
    save_peak_rss_mib: float | None = None
    load_peak_rss_mib: float | None = None
    errors: list[str] = field(default_factory=list)


class PeakRSS:
    """Samples this process's RSS in a thread (every few ms) to catch the peak of a call."""

    PERIOD_S = 0.005

    def __init__(self) -> None:
        heap.trim()  # RSS before a call counts live memory only, so the peak above it is the call's own
        self._page = os.sysconf("SC_PAGE_SIZE")
        self._stop = threading.Event()
        self.start = self.peak = self._rss()

    def _rss(self) -> int:
        try:
            with open("/proc/self/statm") as f:
                return int(f.read().split()[1]) * self._page
        except OSError:
            return 0

    def _poll(self) -> None:
        while not self._stop.wait(self.PERIOD_S):
            self.peak = max(self.peak, self._rss())

    def __enter__(self) -> Self:
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._rss())

    @property
    def extra_mib(self) -> float | None:
        return (self.peak - self.start) / (1 << 20) if self.start else None


def measure(method: Method, state: SyntheticState, target: Target, repeat: int, cache_mode: str) -> Measurement:
    m = Measurement(state.name, method.name, target.name, repeat, state.nbytes, state.count)
    directory = target.workdir(f"{state.name}-{method.name}")
    try:
        if method.paired_copy:
            plain_copy_s(state)  # warm (allocator, page faults): the first copy of a state is slower than the rest
            m.copy_s = plain_copy_s(state)
        with PeakRSS() as rss, S3Requests() if is_remote(directory) else contextlib.nullcontext() as requests:
            t0 = time.perf_counter()
            extra = method.save(state, directory) or {}
            m.save_s = extra.get("time_s", time.perf_counter() - t0)
        m.save_error = extra.get("save_error")
        if m.save_error is not None:
            m.save_s = None
        if requests is not None:
            m.save_requests, m.save_request_kinds = requests.total, dict(requests.calls)
        m.blocking_s = extra.get("blocking_s")
        m.save_peak_rss_mib = rss.extra_mib
        record_stored(m, method, target, directory, cache_mode)
        with PeakRSS() as rss:
            t0 = time.perf_counter()
            loaded = method.load(directory)
            m.load_s = time.perf_counter() - t0 if method.storage else None  # the copy has no load
        m.load_peak_rss_mib = rss.extra_mib
        problem = state.verify(loaded)
        del loaded
        if problem:
            m.error = f"verification failed: {problem}"
    except Exception as e:  # noqa: BLE001 -- one broken method must not cost the other figures
        m.error = f"{type(e).__name__}: {e}"
    finally:
        target.remove(directory)
    return m


@dataclass
class Plan:
    """What to run: each state with the methods to run on it, on every target, `repeats` times."""

    runs: list[tuple[SyntheticState, list[str]]]
    targets: list[Target]
    repeats: int
    cache_mode: str = "auto"
    io_threads: int | None = None  # None: on each target, what ucp takes there when left to itself
    local_only: frozenset[str] = frozenset()  # states not run on remote targets (the many-small-tensors ones)

    def cells(self, names: list[str], state: str | None = None) -> list[tuple[int, str]]:
        """(target index, method) pairs to run for one state: storage methods on every target that supports
        them (remote ones unless the state is local-only), in-memory baselines (the plain copy) once, first."""
        out = []
        for i, target in enumerate(self.targets):
            remote = is_remote(target.root)
            if remote and state in self.local_only:
                continue
            for name in names:
                cls = METHODS[name]
                if not cls.storage:
                    if i == 0:
                        out.append((i, name))
                elif cls.remote if remote else cls.local:
                    out.append((i, name))
        return out

    def threads_for(self, target: Target) -> int:
        """Requests in flight for every method on `target`: the plan's, or ucp's own default there (16 on a disk,
        two per core in memory, 64 on an object store), so that each baseline runs as ucp would."""
        if self.io_threads:
            return self.io_threads
        if is_remote(target.root):
            return FSSPEC_IO_THREADS
        return LocalStorage(str(target.root)).capabilities.io_threads

    def count(self) -> int:
        return self.repeats * sum(len(self.cells(methods, state.name)) for state, methods in self.runs)

    def estimate_s(self, probes: dict[str, Probe]) -> float:
        """Roughly how long the run takes, from each target's probe: every storage measurement's bytes and tensors
        written and read at the probed rates (the in-memory copy costs next to nothing)."""
        total = 0.0
        for state, methods in self.runs:
            for i, name in self.cells(methods, state.name):
                target = self.targets[i]
                if METHODS[name].storage:
                    total += probes[target.name].seconds(state.nbytes, state.count, self.threads_for(target))
        return total * self.repeats


def run(plan: Plan, progress: Callable[[int, int, Measurement], None] | None = None) -> list[Measurement]:
    methods = {
        (i, name): METHODS[name](io_threads=plan.threads_for(target))
        for _, names in plan.runs
        for name in names
        for i, target in enumerate(plan.targets)
    }
    results: list[Measurement] = []
    total = plan.count()
    for repeat in range(plan.repeats):
        for state, names in plan.runs:
            for i, name in plan.cells(names, state.name):
                m = measure(methods[i, name], state, plan.targets[i], repeat, plan.cache_mode)
                results.append(m)
                if progress:
                    progress(len(results), total, m)
    return results


def _median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def summarize(results: list[Measurement]) -> list[Summary]:
    """Medians per (state, method, target), in first-seen order; ratios to raw on the same state and target.
    GB/s is computed from the median time (for an odd number of repeats, the median GB/s)."""
    groups: dict[tuple[str, str, str], list[Measurement]] = {}
    for m in results:
        groups.setdefault((m.state, m.method, m.target), []).append(m)
    out: list[Summary] = []
    for (state, method, target), ms in groups.items():
        good = [m for m in ms if m.ok]
        save_s = _median([m.save_s for m in good])
        load_s = _median([m.load_s for m in good])
        nbytes = ms[0].nbytes
        caches = sorted({m.cache for m in good if m.cache})
        out.append(
            Summary(
                state,
                method,
                target,
                len(good),
                nbytes,
                ms[0].tensors,
                save_s,
                load_s,
                nbytes / save_s / 1e9 if save_s else None,
                nbytes / load_s / 1e9 if load_s else None,
                blocking_s=_median([m.blocking_s for m in good]),
                copy_s=_median([m.copy_s for m in good]),
                procs=ms[0].procs,
                rank_min_save_gbps=_median([m.rank_min_save_gbps for m in good]),
                rank_min_load_gbps=_median([m.rank_min_load_gbps for m in good]),
                cache="+".join(caches),
                resident_after_drop=_median([m.resident_after_drop for m in good]),
                stored_bytes=_median([m.stored_bytes for m in good]),  # type: ignore[arg-type]
                files=_median([m.files for m in good]),  # type: ignore[arg-type]
                dirs=_median([m.dirs for m in good]),  # type: ignore[arg-type]
                save_requests=_median([m.save_requests for m in good]),  # type: ignore[arg-type]
                save_peak_rss_mib=_median([m.save_peak_rss_mib for m in good]),
                load_peak_rss_mib=_median([m.load_peak_rss_mib for m in good]),
                errors=[m.error for m in ms if m.error] + [f"save: {m.save_error}" for m in ms if m.save_error],
            )
        )
    raw = {(s.state, s.target): s for s in out if s.method == "raw"}
    for s in out:
        r = raw.get((s.state, s.target))
        if r and r.save_gbps and s.save_gbps:
            s.save_vs_raw = s.save_gbps / r.save_gbps
        if r and r.load_gbps and s.load_gbps:
            s.load_vs_raw = s.load_gbps / r.load_gbps
    # The ratios are of the medians the table shows beside them (block s / copy s), so that its columns agree. An
    # async save's copy is the one timed just before it (same machine load); without one, the copy row's.
    copy = {s.state: s for s in out if s.method == "copy"}
    dcp_async = {(s.state, s.target): s for s in out if s.method == "dcp-async"}
    for s in out:
        if s.method == "copy":
            s.copy_s = s.blocking_s
        if s.blocking_s is None:
            continue
        c, d = copy.get(s.state), dcp_async.get((s.state, s.target))
        if s.copy_s is None and c is not None:
            s.copy_s = c.blocking_s
        if s.copy_s:
            s.blocking_vs_copy = s.blocking_s / s.copy_s
        if d and d.blocking_s and s.method != "copy":
            s.blocking_vs_dcp_async = s.blocking_s / d.blocking_s
    return out


def as_dicts(items: list[Any]) -> list[dict[str, Any]]:
    return [asdict(i) for i in items]


def record_stored(m: Measurement, method: Method, target: Target, directory: Any, cache_mode: str) -> None:
    """What a save left in storage (bytes, files), then make it cold for the load (and say how)."""
    if not method.storage:
        m.target = m.cache = "memory"
        return
    if is_remote(directory):
        sizes = [d["size"] for d in directory.fs.find(directory.path, detail=True).values()]
    else:
        sizes = [p.stat().st_size for p in iter_files(directory)]
        m.dirs = sum(len(dirs) for _, dirs, _ in os.walk(directory))
    m.stored_bytes, m.files = sum(sizes), len(sizes)
    m.cache, m.resident_after_drop = target.make_cold(directory, cache_mode)
