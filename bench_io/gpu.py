"""`python -m bench_io gpu` (or `ucp bench gpu`): a state that lives on a GPU, saved and loaded by ucp side by side
with the alternatives and with the floors, and the reference trainer's step time with checkpoints against none.

The state: `--tensors` bf16 tensors of `--size` bytes in all, made on the device. On each medium (`--dirs`: /dev/shm
and a local disk's directory, read back from the page cache as a job restarting on the same machine would), each
repeat saves the state with every method and loads what it wrote, back onto the device; every load is compared with
the state, bit for bit.

Saves (blocking: until the call returns and training may go on; total: until the data is in files):
  floor        page-locked device-to-host copy of every tensor into preallocated pinned memory (no files)
  ucp-async    CheckpointManager(mode="async"), staging made by `prepare` first; its first save is reported apart
  ucp-async-unprepared  the first save of a manager without `prepare`, once (the stall `prepare` removes)
  ucp-sync     ucp.save
  dcp-async    torch.distributed.checkpoint.async_save (no_dist), dcp: dcp.save
  safetensors  safetensors.torch.save_file of the device tensors
  torch        torch.save
Loads:
  floor        page-locked reads of ucp's object files, each checksummed (CRC-32C), no copy to the device
  ucp          ucp.load(device=...): reads into reused page-locked buffers, async copies on a side stream
  ucp+to       ucp.load, then .to(device) of every tensor (from pageable memory)
  safetensors  load_file(device=...); dcp: dcp.load into preallocated device tensors; torch: torch.load(map_location,
               weights_only=True: no pickled code runs)
  pinned-raw   the page-locked path alone: raw files (one per tensor) read into page-locked slots and copied
               asynchronously (ucp.engine.landing.Landing, no checksum)
  kvikio       where kvikio imports: the same raw files read by kvikio.CuFile straight into device memory
               (compatibility mode where GPUDirect Storage is absent)

`--trainer-steps N` (0: skip) also runs the reference trainer on the device, one rank: N steps with an async
checkpoint every `--trainer-every` steps against N without, median step time (the step plus the checkpoint call).

`--budget-s S` stops measuring once S seconds have gone (what was measured is reported, and the JSON says what was
left out). `--device cpu` runs everything on the CPU (a smoke test of the benchmark itself; the figures mean nothing).
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

import crc32c
import torch

import ucp
from ucp.engine.landing import Landing

from .args import at_least, output_file, parse_list, positive_float, positive_size

GiB = 1 << 30
SEGMENT = 64 << 20  # raw files are read in pieces of this size (ucp's default object size)
SAVES = ("floor", "ucp-async", "ucp-async-unprepared", "ucp-sync", "dcp-async", "dcp", "safetensors", "torch")
LOADS = ("floor", "ucp", "ucp+to", "safetensors", "dcp", "torch", "pinned-raw", "kvikio")
# what each save writes, and the loads that read it
READS = {"ucp-sync": ("floor", "ucp", "ucp+to"), "dcp": ("dcp",), "safetensors": ("safetensors",), "torch": ("torch",)}


@dataclass
class Row:
    phase: str  # "save" or "load"
    method: str
    medium: str
    repeat: int
    nbytes: int
    total_s: float | None = None
    blocking_s: float | None = None
    ok: bool = True
    error: str | None = None


def make_state(size: int, tensors: int, device: torch.device, seed: int) -> dict[str, torch.Tensor]:
    """`tensors` bf16 tensors of 4096 columns, `size` bytes in all, random, on `device`."""
    g = torch.Generator(device=device).manual_seed(seed)
    rows = max(1, size // (tensors * 4096 * 2))
    return {
        f"layer{i}.weight": torch.randn(rows, 4096, dtype=torch.bfloat16, device=device, generator=g)
        for i in range(tensors)
    }


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def same(out: dict[str, torch.Tensor], state: dict[str, torch.Tensor]) -> bool:
    return out.keys() == state.keys() and all(
        out[k].dtype == v.dtype and out[k].device == v.device and torch.equal(out[k], v) for k, v in state.items()
    )


def nbytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


class Bench:
    def __init__(self, args: argparse.Namespace, device: torch.device):
        self.args, self.device = args, device
        self.state = make_state(args.size, args.tensors, device, args.seed)
        self.nbytes = nbytes(self.state)
        self.pinned = device.type == "cuda"
        self.rows: list[Row] = []
        self.notes: dict[str, Any] = {}
        self._managers: dict[str, ucp.CheckpointManager] = {}
        self._floor: dict[str, torch.Tensor] | None = None
        self.started = time.perf_counter()
        self.skipped: list[str] = []  # what the time budget left out

    def over_budget(self, what: str) -> bool:
        """Whether the time budget is spent (then `what` is noted as left out)."""
        budget = self.args.budget_s
        if budget is None or time.perf_counter() - self.started < budget:
            return False
        self.skipped.append(what)
        return True

    def timed(self, phase: str, method: str, medium: str, repeat: int, run: Callable[[], Any]) -> Any:
        """Run `run` (which returns a loaded state to check, a blocking time, or None) and record it."""
        row = Row(phase, method, medium, repeat, self.nbytes)
        out = None
        try:
            sync(self.device)
            start = time.perf_counter()
            out = run()
            sync(self.device)
            row.total_s = time.perf_counter() - start
            if isinstance(out, float):
                row.blocking_s = out
            elif isinstance(out, dict):
                row.ok = same(out, self.state)
                if not row.ok:
                    row.error = "loaded values differ from the state"
        except Exception as e:  # noqa: BLE001 -- recorded: one method's failure does not end the benchmark
            row.ok, row.error = False, f"{type(e).__name__}: {e}"[:300]
        self.rows.append(row)
        self._progress(row)
        return out

    @staticmethod
    def _progress(row: Row) -> None:
        total = f"{row.total_s:7.3f} s ({row.nbytes / row.total_s / 1e9:6.2f} GB/s)" if row.total_s else "-"
        blocking = f"  blocking {row.blocking_s:.4f} s" if row.blocking_s is not None else ""
        status = "ok" if row.ok else f"ERROR {row.error}"
        print(
            f"  r{row.repeat} {row.phase:<4} {row.method:<21} {row.medium:<10} {total}{blocking}  {status}", flush=True
        )

    # -- saves

    def save(self, method: str, root: Path, medium: str, repeat: int) -> None:
        """Save with `method` under `root` (this repeat's directory; the async manager keeps its steps beside it)."""
        state, where = self.state, root / method
        if method == "floor":
            if self._floor is None:
                self._floor = {k: torch.empty(v.shape, dtype=v.dtype, pin_memory=self.pinned) for k, v in state.items()}
            floor = self._floor

            def copy() -> None:
                for k, v in state.items():
                    floor[k].copy_(v, non_blocking=True)

            self.timed("save", method, medium, repeat, copy)
        elif method == "ucp-async":
            manager = self._managers.get(medium)
            if manager is None:
                steps = str(root.parent / method)  # (one manager for every repeat: its steps outlive a repeat)
                manager = self._managers[medium] = ucp.CheckpointManager(steps, mode="async", keep_last=1)
                start = time.perf_counter()
                manager.prepare(state)
                self.notes.setdefault("prepare_s", {})[medium] = time.perf_counter() - start
                self.timed("save", "ucp-async-first", medium, repeat, lambda: self._async_save(manager, 0))
            self.timed("save", method, medium, repeat, lambda: self._async_save(manager, repeat + 1))
        elif method == "ucp-async-unprepared":
            if repeat == 0:
                with ucp.CheckpointManager(str(where), mode="async") as fresh:
                    self.timed("save", method, medium, repeat, lambda: self._async_save(fresh, 0))
        elif method == "ucp-sync":
            self.timed("save", method, medium, repeat, lambda: ucp.save(state, str(where), step=0))
        elif method in ("dcp", "dcp-async"):
            self.timed("save", method, medium, repeat, lambda: self._dcp_save(where, method == "dcp-async"))
        elif method == "safetensors":
            from safetensors.torch import save_file

            where.mkdir(parents=True, exist_ok=True)
            self.timed("save", method, medium, repeat, lambda: save_file(state, str(where / "state.safetensors")))
        elif method == "torch":
            where.mkdir(parents=True, exist_ok=True)
            self.timed("save", method, medium, repeat, lambda: torch.save(state, where / "state.pt"))

    def _async_save(self, manager: ucp.CheckpointManager, step: int) -> float:
        start = time.perf_counter()
        handle = manager.save(step, self.state)
        blocking = time.perf_counter() - start
        handle.result()
        return blocking

    def _dcp_save(self, where: Path, asynchronous: bool) -> float | None:
        import torch.distributed.checkpoint as dcp

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            writer = dcp.FileSystemWriter(where, sync_files=True, thread_count=16)
            if not asynchronous:
                dcp.save(dict(self.state), storage_writer=writer, no_dist=True)
                return None
            start = time.perf_counter()
            future = dcp.async_save(dict(self.state), storage_writer=writer, no_dist=True)
            blocking = time.perf_counter() - start
            getattr(future, "upload_completion", future).result()
            return blocking

    # -- loads

    def load(self, method: str, root: Path, medium: str, repeat: int) -> None:
        device, state = self.device, self.state
        if method == "floor":
            self.timed("load", method, medium, repeat, lambda: self._floor_reads(root / "ucp-sync"))
        elif method == "ucp":
            self.timed("load", method, medium, repeat, lambda: ucp.load(str(root / "ucp-sync"), device=device))
        elif method == "ucp+to":
            self.timed(
                "load",
                method,
                medium,
                repeat,
                lambda: {k: v.to(device) for k, v in ucp.load(str(root / "ucp-sync")).items()},
            )
        elif method == "safetensors":
            from safetensors.torch import load_file

            path = str(root / "safetensors" / "state.safetensors")
            self.timed("load", method, medium, repeat, lambda: load_file(path, device=str(device)))
        elif method == "dcp":
            out = {k: torch.empty_like(v) for k, v in state.items()}
            self.timed("load", method, medium, repeat, lambda: self._dcp_load(root / "dcp", out))
        elif method == "torch":
            path = root / "torch" / "state.pt"
            self.timed("load", method, medium, repeat, lambda: torch.load(path, map_location=device, weights_only=True))
        elif method == "pinned-raw":
            out = {k: torch.empty_like(v) for k, v in state.items()}
            self.timed("load", method, medium, repeat, lambda: self._landed(root / "raw", out))
        elif method == "kvikio":
            out = {k: torch.empty_like(v) for k, v in state.items()}
            self.timed("load", method, medium, repeat, lambda: self._kvikio(root / "raw", out))

    def _floor_reads(self, where: Path) -> None:
        """Every file of the ucp checkpoint read into page-locked memory (a buffer per thread) and checksummed."""
        files = [p for p in where.rglob("*") if p.is_file()]
        largest = max(p.stat().st_size for p in files)
        threads = 16
        buffers = [torch.empty(largest, dtype=torch.uint8, pin_memory=self.pinned) for _ in range(threads)]
        free = list(range(threads))

        def read(path: Path) -> int:
            i = free.pop()
            try:
                view = buffers[i].numpy()
                with open(path, "rb", buffering=0) as f:
                    n = f.readinto(view)
                return crc32c.crc32c(view[:n])
            finally:
                free.append(i)

        with cf.ThreadPoolExecutor(threads) as pool:
            list(pool.map(read, files))

    def _dcp_load(self, where: Path, out: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        import torch.distributed.checkpoint as dcp

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.load(out, storage_reader=dcp.FileSystemReader(where), no_dist=True)
        return out

    def write_raw(self, where: Path) -> None:
        """One file per tensor, its bytes as they are (the files pinned-raw and kvikio read; not timed)."""
        where.mkdir(parents=True, exist_ok=True)
        for k, v in self.state.items():
            (where / k).write_bytes(v.cpu().view(torch.uint8).numpy().tobytes())

    def _landed(self, where: Path, out: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        def fill(path: Path, offset: int, host: torch.Tensor) -> None:
            with open(path, "rb", buffering=0) as f:
                f.seek(offset)
                f.readinto(host.view(torch.uint8).numpy())

        pieces = []
        for k, t in out.items():
            flat = t.view(-1).view(torch.uint8)
            pieces += [(where / k, a, flat[a : a + SEGMENT]) for a in range(0, flat.numel(), SEGMENT)]
        with Landing(512 << 20, pinned=self.pinned) as landing, cf.ThreadPoolExecutor(16) as pool:
            futures = [pool.submit(landing.land, dest, lambda h, p=p, a=a: fill(p, a, h)) for p, a, dest in pieces]
            for f in futures:
                f.result()
        return out

    def _kvikio(self, where: Path, out: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        import kvikio

        files = [kvikio.CuFile(where / k, "r") for k in out]
        try:
            futures = [f.pread(t) for f, t in zip(files, out.values())]
            for future in futures:
                future.get()
        finally:
            for f in files:
                f.close()
        return out

    def guarded(self, phase: str, method: str, medium: str, repeat: int, step: Callable[[], None]) -> bool:
        """Run `step`, a method's work around its timed part (making a manager and its staging memory, writing the raw
        files): a failure there is recorded as that method's, and the benchmark goes on with the others."""
        try:
            step()
            return True
        except Exception as e:  # noqa: BLE001 -- recorded as the method's failure
            row = Row(phase, method, medium, repeat, self.nbytes, ok=False, error=f"{type(e).__name__}: {e}"[:300])
            self.rows.append(row)
            self._progress(row)
            return False

    # -- a medium

    def run_medium(self, directory: str, saves: list[str], loads: list[str]) -> None:
        medium = "shm" if directory.startswith("/dev/shm") else Path(directory).name or directory
        base = Path(tempfile.mkdtemp(prefix="bench-gpu-", dir=directory))
        print(f"bench_io gpu: {medium} ({base})", flush=True)
        try:
            for repeat in range(self.args.repeats):
                root = base / f"r{repeat}"
                for method in saves:
                    if self.over_budget(f"{medium} r{repeat} {method}"):
                        continue
                    if not self.guarded(
                        "save", method, medium, repeat, partial(self.save, method, root, medium, repeat)
                    ):
                        continue  # (nothing to load)
                    for load in READS.get(method, ()):
                        if load in loads:
                            self.load(load, root, medium, repeat)
                    if method in READS:
                        shutil.rmtree(root / method, ignore_errors=True)
                raw = [m for m in ("pinned-raw", "kvikio") if m in loads]
                if raw and not self.over_budget(f"{medium} r{repeat} raw loads"):
                    if not self.guarded("load", "pinned-raw", medium, repeat, partial(self.write_raw, root / "raw")):
                        raw = []
                    for method in raw:
                        if method == "kvikio" and not _kvikio_importable(self.notes):
                            continue
                        self.load(method, root, medium, repeat)
                shutil.rmtree(root, ignore_errors=True)
        finally:
            for manager in self._managers.values():
                manager.close()
            self._managers = {}
            shutil.rmtree(base, ignore_errors=True)


def _kvikio_importable(notes: dict[str, Any]) -> bool:
    if "kvikio" not in notes:
        try:
            import kvikio
            import kvikio.defaults

            notes["kvikio"] = {"version": kvikio.__version__, "compat_mode": str(kvikio.defaults.compat_mode())}
        except Exception as e:  # noqa: BLE001 -- absent or unusable: said in the report, not measured
            notes["kvikio"] = {"error": f"{type(e).__name__}: {e}"[:200]}
    return "error" not in notes["kvikio"]


# ------------------------------------------------------------------------------------------------ trainer


def trainer_steps(args: argparse.Namespace, device: torch.device, work: Path) -> dict[str, Any]:
    """The reference trainer on the device, one rank: median step time (step plus checkpoint call) with an async
    checkpoint every `--trainer-every` steps against none, and the checkpoints' blocking time."""
    from trainer import launch

    config = Path(__file__).resolve().parents[1] / "trainer" / "configs" / "tiny-moe.yaml"
    sizes = [] if device.type == "cpu" else _TRAINER_MODEL
    common = [*sizes, "--set", "data.source=synthetic", "--set", f"train.device={device.type}"]
    out: dict[str, Any] = {"model": sizes, "steps": args.trainer_steps, "every": args.trainer_every}
    for name, extra in (
        ("none", []),
        ("every", ["--ckpt", str(work / "ckpt"), "--save-interval", str(args.trainer_every)]),
    ):
        metrics = work / f"{name}.jsonl"
        argv = launch.trainer_argv(config, "tp1pp1", args.trainer_steps, metrics, *common, *extra)
        launch.wait(launch.start(argv, 1, work / f"logs-{name}"), work / f"logs-{name}", 600)
        records = [json.loads(line) for line in metrics.read_text().splitlines()]
        calls = {r["step"]: r for r in records if r.get("event") == "checkpoint"}
        steps = [r for r in records if "event" not in r][2:]  # (the first steps warm up)
        out[f"step_s_{name}"] = statistics.median(
            r["step_time_s"] + calls.get(r["step"], {}).get("call_s", 0) for r in steps
        )
        if calls:
            out["blocking_s"] = statistics.median(c["blocking_s"] for c in calls.values())
            out["checkpoints"] = len(calls)
    out["ratio"] = out["step_s_every"] / out["step_s_none"]
    return out


# A model whose step takes tens of milliseconds on a GPU and whose checkpoint is ~1.7 GB (fp32 weights and Adam).
_TRAINER_MODEL = [
    *("--set", "model.hidden_size=512", "--set", "model.num_layers=8", "--set", "model.num_heads=8"),
    *("--set", "model.num_kv_heads=4", "--set", "model.ffn_hidden_size=1024", "--set", "model.vocab_size=32000"),
    *("--set", "data.seq_len=512", "--set", "data.global_batch_size=8", "--set", "data.micro_batch_size=4"),
]


# ------------------------------------------------------------------------------------------------- report


def summarize(rows: list[Row]) -> list[dict[str, Any]]:
    groups: dict[tuple[str, str, str], list[Row]] = {}
    for r in rows:
        groups.setdefault((r.phase, r.method, r.medium), []).append(r)
    out = []
    for (phase, method, medium), rs in groups.items():
        good = [r for r in rs if r.ok and r.total_s is not None]
        total = statistics.median(r.total_s for r in good) if good else None  # type: ignore[type-var]
        blocking = [r.blocking_s for r in good if r.blocking_s is not None]
        out.append(
            {
                "phase": phase,
                "method": method,
                "medium": medium,
                "n": len(good),
                "errors": [r.error for r in rs if not r.ok],
                "total_s": total,
                "gb_s": rs[0].nbytes / total / 1e9 if total else None,
                "blocking_s": statistics.median(blocking) if blocking else None,
            }
        )
    for s in out:
        floor = next(
            (f for f in out if (f["phase"], f["method"], f["medium"]) == (s["phase"], "floor", s["medium"])), None
        )
        s["vs_floor"] = floor["total_s"] / s["total_s"] if floor and floor["total_s"] and s["total_s"] else None
    return out


def table(summaries: list[dict[str, Any]]) -> str:
    lines = [
        "| phase | method | medium | total s | GB/s | floor/this | blocking s | n |",
        "|---|---|---|---|---|---|---|---|",
    ]

    def f(x: float | None, spec: str) -> str:
        return format(x, spec) if x is not None else "-"

    for s in summaries:
        errors = f" ({len(s['errors'])} failed: {s['errors'][0]})" if s["errors"] else ""
        lines.append(
            f"| {s['phase']} | {s['method']} | {s['medium']} | {f(s['total_s'], '.3f')} | {f(s['gb_s'], '.2f')} | "
            f"{f(s['vs_floor'], '.2f')} | {f(s['blocking_s'], '.4f')} | {s['n']}{errors} |"
        )
    return "\n".join(lines)


def device_description(device: torch.device) -> dict[str, Any]:
    out: dict[str, Any] = {"device": str(device), "torch": torch.__version__, "cpus": os.cpu_count()}
    out["python"] = platform.python_version()
    if device.type == "cuda":
        out["gpu"] = torch.cuda.get_device_name(device)
        out["cuda"] = torch.version.cuda
        out["gpu_memory_bytes"] = torch.cuda.get_device_properties(device).total_memory
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="bench_io gpu", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--size", type=positive_size, default=6 * GiB, help="bytes of the state (default 6GiB)")
    p.add_argument("--tensors", type=at_least(1), default=24, help="tensors in the state (default 24)")
    p.add_argument("--repeats", type=at_least(1), default=3, help="repeats, medians reported (default 3)")
    p.add_argument("--dirs", default="/dev/shm", help="comma list of directories, one per medium (default /dev/shm)")
    p.add_argument("--saves", type=parse_list(list(SAVES)), default=list(SAVES), help="comma list of saves")
    p.add_argument("--loads", type=parse_list(list(LOADS)), default=list(LOADS), help="comma list of loads")
    p.add_argument("--device", default="cuda", help="default cuda; cpu: a smoke test of the benchmark itself")
    p.add_argument("--trainer-steps", type=at_least(0), default=20, help="trainer steps per run (0: no trainer runs)")
    p.add_argument(
        "--trainer-every", type=at_least(1), default=5, help="a checkpoint every this many steps (default 5)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--budget-s", type=positive_float, help="stop measuring after this many seconds (default: no limit)")
    p.add_argument("--json", type=output_file, help="write the rows, medians and machine here")
    return p


def write_json(
    args: argparse.Namespace, device: torch.device, bench: Bench, trainer: dict[str, Any] | None, started: float
) -> None:
    doc = {
        "config": {k: v for k, v in vars(args).items()},
        "machine": device_description(device),
        "rows": [asdict(r) for r in bench.rows],
        "medians": summarize(bench.rows),
        "notes": bench.notes,
        "left_out": bench.skipped,
        "trainer": trainer,
        "elapsed_s": time.perf_counter() - started,
    }
    Path(args.json).write_text(json.dumps(doc, indent=1))


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench_io gpu: torch sees no GPU (--device cpu runs the benchmark's own smoke test)")
    if device.type == "cuda":
        device = torch.device("cuda", device.index if device.index is not None else 0)
        torch.cuda.set_device(device)
    started = time.perf_counter()
    print(f"bench_io gpu: {args.size / GiB:.2f} GiB in {args.tensors} bf16 tensors on {device}", flush=True)
    bench = Bench(args, device)
    for directory in [d.strip() for d in args.dirs.split(",") if d.strip()]:
        bench.run_medium(directory, args.saves, args.loads)
    trainer = None
    if args.trainer_steps > 0 and not bench.over_budget("trainer"):
        if args.json:  # (what was measured so far, should the trainer runs be stopped from outside)
            write_json(args, device, bench, {"error": "not finished"}, started)
        print("bench_io gpu: the reference trainer, with checkpoints and without", flush=True)
        with tempfile.TemporaryDirectory(dir=args.dirs.split(",")[0]) as work:
            try:
                trainer = trainer_steps(args, device, Path(work))
            except Exception as e:  # noqa: BLE001 -- recorded, as a method's failure is
                trainer = {"error": f"{type(e).__name__}: {e}"[:500]}
    summaries = summarize(bench.rows)
    print()
    print(f"bench_io gpu: {bench.nbytes / GiB:.2f} GiB on {device_description(device).get('gpu', device)}, medians")
    print(table(summaries))
    if "kvikio" in bench.notes:
        print(f"kvikio: {bench.notes['kvikio']}")
    if "prepare_s" in bench.notes:
        print(f"prepare (staging made and page-locked before the first save): {bench.notes['prepare_s']}")
    if trainer is not None:
        print(f"trainer: {trainer}")
    if bench.skipped:
        print(f"left out (the time budget was spent): {', '.join(bench.skipped)}")
    if args.json:
        write_json(args, device, bench, trainer, started)
    failed = [r for r in bench.rows if not r.ok] or (trainer is not None and "error" in trainer)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
