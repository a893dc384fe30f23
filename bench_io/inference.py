"""Inference start-up and RL refresh: a vLLM engine from a ucp checkpoint against vLLM's own loads of the same weights.

    python -m bench_io inference --size-gib 1 [--s3 [moto,radosgw]] [--repeats 3] [--tp 1] [--refresh-budgets 1024,256]

Writes one bf16 Llama-shaped model of about --size-gib as a ucp checkpoint of two steps (saved from tp2pp2, as a
pretraining job would; the second step's weights differ) and step 0 as Hugging Face safetensors (`ucp export --to
hf`), then times in this process (vLLM's CPU build, bf16; with --tp 2 the engine's workers are processes of their
own), each run with the page cache of every file dropped first (posix_fadvise DONTNEED, no root needed):

- start-up, from `LLM(...)` to the first generated token:
  - ucp: `LLM(model=model_dir(url), load_format="ucp")` (the model directory made inside the timer); and the same
    with every weight handed to vLLM's `load_weights` (`into_parameters: false`, what the loader did before it read
    weights straight into the parameters);
  - safetensors: `LLM(model=<the export>)`, vLLM's default loader of the exported copy;
  - runai_streamer, fastsafetensors: `LLM(model=<the export>, load_format=...)`, where they are installed (a loader
    that fails here is reported with its error, not timed);
  - sharded_state: `LLM(model=<vLLM's own per-worker copy>, load_format="sharded_state")`, the copy saved beforehand
    by an engine (`save_sharded_state`), as vLLM suggests for fast start-up of large models;
  - export, then safetensors: `ucp export --to hf` into a fresh directory, then the same (what a ucp checkpoint cost
    before `load_format="ucp"`);
- refresh, a running engine taking the second step's weights: `refresh(llm, url, 1)`, against building a new engine
  from that step (the ucp start-up above) and against vLLM's `reload_weights` from a safetensors copy of it; with
  --refresh-budgets, also with each memory budget named (the weights read in groups of a quarter of it),
  alternating with the default's.

With --s3 the checkpoint and the export go to each S3 server named (on 127.0.0.1: moto, a subprocess, and Ceph's
radosgw where installed; default both, radosgw where installed) and the same rows are timed from there: ucp reads the
bucket; vLLM's safetensors loader cannot, so its row is a download of the export (s3fs) followed by its load;
runai_streamer streams the bucket itself (the endpoint and keys in the AWS variables).

Each start-up's weights phase (the loader's `load_weights`, vLLM's for its loaders, ucp's for its own) is timed
apart, and what the start-up takes beside it reported as vLLM's own part (building the model, processing the weights
into its kernels' formats, the KV cache, the first token: no loader makes it shorter). Locally, a raw read of a
step's weight objects (`preadv` on 8 threads into memory touched beforehand, page cache dropped) is timed among the
methods, and vLLM's own part of ucp's start-up plus that read reported against export-then-load: the fastest a
start-up from these bytes could be, whatever the loader.

Before the timed runs one engine is built and dropped, so that what a process pays once (imports, vLLM's model
inspection) is paid by none of them. Prints seconds (median of the repeats; the methods alternate within each
repeat), the bytes each ucp worker read (the refresh's report), and the ratios the aims are about.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ucp.distributed import ShardedModel, VirtualWorld
from ucp.interop.streaming import DEFAULT_MEMORY_BUDGET
from ucp.sharding.families import LlamaConfig, canonical_atoms
from ucp.sharding.layout import parse_layout
from ucp.sharding.reshard import shard

from .args import at_least, counts, positive_float
from .coldstart import chunk_objects, raw_read
from .methods import runai_environment
from .s3_servers import S3_SERVERS, radosgw_missing, s3_server_version, start_s3_server
from .state import even_layers
from .targets import drop_page_cache, s3_filesystem

PROMPT = {"prompt_token_ids": list(range(1, 17))}


def config_for(size_gib: float) -> LlamaConfig:
    """A Llama-shaped model of about size_gib in bf16: h=1024, 16 heads of 64 (4 KV heads), ffn 4096, vocab 32000."""
    h, ffn, kv, vocab = 1024, 4096, 256, 32000
    per_layer = 2 * h * h + 2 * kv * h + 3 * h * ffn + 2 * h
    layers = even_layers(size_gib, per_layer, fixed=2 * vocab * h + h, minimum=2)
    return LlamaConfig(
        vocab_size=vocab,
        hidden_size=h,
        intermediate_size=ffn,
        num_hidden_layers=layers,
        num_attention_heads=16,
        num_key_value_heads=4,
    )


def write_sources(cfg: LlamaConfig, root: Path, url: str, storage_options: dict | None) -> None:
    """Steps 0 and 1 of the ucp checkpoint (from tp2pp2), and safetensors exports of each (root/hf0, root/hf1)."""
    from ucp.interop.hf import export_hf

    layout = parse_layout("tp2pp2")
    for step in (0, 1):
        g = torch.Generator().manual_seed(step)
        atoms = {
            n: torch.randn(shape, generator=g).mul_(0.02).to(torch.bfloat16)
            for n, (shape, _) in canonical_atoms(cfg).items()
        }
        local = [shard({"model": atoms}, cfg, layout, r, ()) for r in range(layout.world_size)]
        del atoms
        VirtualWorld(layout.world_size).save(
            local, url, step=step, model=ShardedModel(cfg, layout, optim_states=()), storage_options=storage_options
        )
        del local
        export_hf(url, root / f"hf{step}", step=step, storage_options=storage_options, max_shard_bytes=512 << 20)


class WeightsPhase:
    """Times the weights phase of every engine built in this process: each vLLM loader's `load_weights` (ucp's
    included), wrapped in its class, the outermost call timed (a loader that calls its parent's is one phase). What
    a start-up takes beside it is vLLM's own, whatever the loader: building the model, processing the weights into
    its kernels' formats, the KV cache, the first token. Engines whose workers are processes of their own (--tp > 1)
    are not seen."""

    def __init__(self) -> None:
        self.seconds: list[float] = []
        self._depth = 0

    def install(self) -> None:
        """Wrap the loaders registered so far (ucp's is registered by vLLM's plugins as its first engine starts, so
        this is called before every run); a class wrapped already is left as it is."""
        from vllm.model_executor.model_loader import _LOAD_FORMAT_TO_MODEL_LOADER

        for cls in list(_LOAD_FORMAT_TO_MODEL_LOADER.values()):
            owner = next(c for c in cls.__mro__ if "load_weights" in c.__dict__)
            method = owner.__dict__["load_weights"]
            if not getattr(method, "_bench_weights_phase", False):
                owner.load_weights = self._timed(method)

    def _timed(self, method: Callable[..., Any]) -> Callable[..., Any]:
        def load_weights(*args: Any, **kwargs: Any) -> Any:
            self._depth += 1
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                self._depth -= 1
                if self._depth == 0:
                    self.seconds.append(time.perf_counter() - start)

        load_weights._bench_weights_phase = True  # type: ignore[attr-defined]
        return load_weights


@dataclass
class Bench:
    """The engines' common arguments and where their files are; every run drops the page cache first. `weights`:
    the weights phase of each run that built one engine in this process (`WeightsPhase`)."""

    root: Path
    tp: int
    repeats: int
    times: dict[str, list[float]] = field(default_factory=dict)
    notes: dict[str, str] = field(default_factory=dict)
    weights: dict[str, list[float]] = field(default_factory=dict)
    phase: WeightsPhase = field(default_factory=WeightsPhase)

    def engine_args(self) -> dict[str, Any]:
        from ucp.interop.vllm import WORKER_EXTENSION

        return {
            "skip_tokenizer_init": True,
            "enforce_eager": True,
            "dtype": "bfloat16",
            "max_model_len": 256,
            "tensor_parallel_size": self.tp,
            "worker_extension_cls": WORKER_EXTENSION,
        }

    @contextlib.contextmanager
    def engine(self, **kw: Any) -> Iterator[Any]:
        import vllm

        llm = vllm.LLM(**self.engine_args(), **kw)
        try:
            llm.generate([PROMPT], vllm.SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)
            yield llm
        finally:
            llm.llm_engine.engine_core.shutdown()
            del llm
            gc.collect()

    def cold(self) -> None:
        drop_page_cache(self.root, "fadvise")

    def time(self, name: str, run: Callable[[], None]) -> None:
        """One timed run of `run` (page cache dropped first); a failure is noted once and the method left out."""
        if name in self.notes:
            return
        self.phase.install()
        self.cold()
        phases = len(self.phase.seconds)
        start = time.perf_counter()
        try:
            run()
        except Exception as e:  # noqa: BLE001 -- a loader that does not work here is reported, not fatal
            self.notes[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
            return
        self.times.setdefault(name, []).append(time.perf_counter() - start)
        if len(self.phase.seconds) == phases + 1:
            self.weights.setdefault(name, []).append(self.phase.seconds[-1])

    def own_part(self, name: str) -> float | None:
        """vLLM's own part of the runs of `name`: the median of each run less its weights phase (None where a run
        had none)."""
        runs, phases = self.times.get(name, []), self.weights.get(name, [])
        if not runs or len(runs) != len(phases):
            return None
        return statistics.median(t - w for t, w in zip(runs, phases))

    def start(self, **kw: Any) -> Callable[[], None]:
        """Engine construction to the first token, the engine then dropped (outside nothing: it is timed too, as a
        caller who replaces an engine pays it; it is short)."""

        def run() -> None:
            with self.engine(**kw):
                pass

        return run

    def model_dir(self, url: str, options: dict | None = None) -> Path:
        """A new model directory of step 0 of `url` (`ucp.interop.vllm.model_dir`), in the scratch directory (removed
        with it, not left in the system's temporary directory run after run)."""
        from ucp.interop.vllm import model_dir

        return model_dir(url, 0, dir=tempfile.mkdtemp(prefix="model-dir-", dir=self.root), storage_options=options)

    def median(self, name: str) -> float | None:
        return statistics.median(self.times[name]) if self.times.get(name) else None


def has(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def startup_methods(
    bench: Bench, url: str, hf0: Callable[[], Path], options: dict | None, sharded: Path | None = None
) -> dict[str, Callable]:
    """(row name -> timed run) of every start-up method, from the ucp checkpoint at `url` or the export `hf0()` gives
    (a local path: for S3, downloaded inside the timer), or vLLM's sharded_state copy `sharded` where given."""
    from ucp.interop.hf import export_hf

    extra = {"storage_options": options} if options else None

    def ucp_start(into_parameters: bool = True) -> None:
        config = {**(extra or {}), **({} if into_parameters else {"into_parameters": False})}
        bench.start(
            model=str(bench.model_dir(url, options)), load_format="ucp", model_loader_extra_config=config or None
        )()

    def export_then_load() -> None:
        out = bench.root / "export-timed"
        shutil.rmtree(out, ignore_errors=True)
        export_hf(url, out, step=0, storage_options=options, max_shard_bytes=512 << 20)
        bench.start(model=str(out))()

    def safetensors() -> None:
        bench.start(model=str(hf0()))()

    methods = {
        "ucp": ucp_start,
        "ucp, every weight through load_weights": lambda: ucp_start(into_parameters=False),
        "safetensors": safetensors,
        "export, then safetensors": export_then_load,
    }
    for load_format, module, package in (
        ("runai_streamer", "runai_model_streamer", "runai-model-streamer"),
        ("fastsafetensors", "fastsafetensors", "fastsafetensors"),
    ):
        if has(module):
            methods[load_format] = lambda f=load_format: bench.start(model=str(hf0()), load_format=f)()
        else:
            bench.notes[load_format] = f"not installed (pip install {package})"
    if sharded is not None:
        methods["sharded_state"] = bench.start(model=str(sharded), load_format="sharded_state")
    return methods


def save_sharded_state(bench: Bench, hf0: Path) -> Path | None:
    """vLLM's sharded_state copy of the export `hf0` (each worker's weights as it holds them, saved by an engine, with
    the export's config files beside), or None with a note where vLLM cannot make one here."""
    out = bench.root / "sharded0"
    out.mkdir()
    try:
        with bench.engine(model=str(hf0)) as llm:
            llm.llm_engine.engine_core.save_sharded_state(path=str(out))
    except Exception as e:  # noqa: BLE001 -- reported, as a loader that does not work here
        bench.notes["sharded_state (local)"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
        return None
    for f in hf0.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, out / f.name)
    return out


def refresh_rows(
    bench: Bench,
    url: str,
    options: dict | None,
    hf: tuple[Path, Path] | None,
    label: str = "local",
    budgets: Sequence[int] = (),
) -> list[int]:
    """Time refreshes of one running engine (step 0 -> 1 -> 0 ...), and where the safetensors copies `hf` of the two
    steps are local, vLLM's own `reload_weights` of them into an engine started from the first; returns the bytes
    each worker read in the last refresh. `budgets`: also refreshes with each of these memory budgets (bytes; the
    weights read in groups of a quarter of it), alternating with the default's in each repeat."""
    from ucp.interop.vllm import refresh

    extra = {"storage_options": options} if options else None
    bytes_read: list[int] = []
    runs = [(f"refresh ({label})", DEFAULT_MEMORY_BUDGET)]
    runs += [(f"refresh, memory_budget {b >> 20} MiB ({label})", b) for b in budgets if b != DEFAULT_MEMORY_BUDGET]
    with bench.engine(
        model=str(bench.model_dir(url, options)), load_format="ucp", model_loader_extra_config=extra
    ) as llm:
        done = 0
        for _ in range(bench.repeats):
            for name, budget in runs:

                def ucp_refresh(step: int = 1 - done % 2, budget: int = budget) -> None:
                    bytes_read[:] = refresh(llm, url, step, storage_options=options, memory_budget=budget).bytes_read

                bench.time(name, ucp_refresh)
                done += 1
    if hf is not None:
        with bench.engine(model=str(hf[0])) as llm:
            for i in range(bench.repeats):

                def reload(path: Path = hf[1 - i % 2]) -> None:
                    llm.collective_rpc("reload_weights", kwargs={"weights_path": str(path)})
                    llm.reset_prefix_cache()

                bench.time(f"vLLM reload_weights, safetensors ({label})", reload)
    return bytes_read


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench_io inference", description=__doc__.split("\n\n")[0])
    p.add_argument("--size-gib", type=positive_float, default=1.0)
    p.add_argument(
        "--s3",
        nargs="?",
        const="auto",
        default=None,
        help=f"also from S3 servers on 127.0.0.1, a comma list of {', '.join(S3_SERVERS)} (default: moto, and radosgw"
        " where installed)",
    )
    p.add_argument("--repeats", type=at_least(1), default=3)
    p.add_argument("--tp", type=at_least(1), default=1, help="tensor-parallel workers (> 1: each a process of its own)")
    p.add_argument("--dir", default=None, help="scratch directory (default: a temporary one)")
    p.add_argument(
        "--refresh-budgets",
        type=counts(1),
        default=[],
        help="a comma list of memory budgets in MiB: refreshes with each too, alternating with the default's",
    )
    args = p.parse_args(argv)
    _vllm_environment(args.tp)
    log = logging.getLogger("ucp")  # (each ucp load's own time, beside vLLM's "Loading weights took")
    log.setLevel(logging.INFO)
    handler = logging.StreamHandler(sys.stdout)
    log.addHandler(handler)
    try:
        return _run(args)
    finally:
        log.removeHandler(handler)


def _run(args: argparse.Namespace) -> int:
    import vllm  # (after the environment is set)

    cfg = config_for(args.size_gib)
    params = sum(torch.Size(s).numel() for s, _ in canonical_atoms(cfg).values())
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        root = Path(tmp)
        url = str(root / "ucp")
        write_sources(cfg, root, url, None)
        print(
            f"model: Llama, {cfg.num_hidden_layers} layers, {params / 1e6:.0f}M parameters, {params * 2 / 2**30:.2f} "
            f"GiB bf16; ucp saved from tp2pp2; vLLM {vllm.__version__} on CPU, tp {args.tp}; load "
            f"{os.getloadavg()[0]:.1f}; repeats: {args.repeats} (median)"
        )
        bench = Bench(root, args.tp, args.repeats)
        bench.start(model=str(root / "hf0"))()  # (what the process pays once)
        sharded = save_sharded_state(bench, root / "hf0")
        local = startup_methods(bench, url, lambda: root / "hf0", None, sharded)
        local[RAW_READ] = raw_read(chunk_objects(root / "ucp"), 8)
        for _ in range(args.repeats):
            for name, run in local.items():
                bench.time(f"{name} (local)", run)
        budgets = [b << 20 for b in args.refresh_budgets]
        bytes_read = refresh_rows(bench, url, None, (root / "hf0", root / "hf1"), budgets=budgets)
        total = sum(m.nbytes for m in _reader(url).atoms.values())
        labels = ["local"]
        for server in s3_servers(args.s3):
            labels.append(f"s3 {server}")
            try:
                _s3(bench, root, server, budgets)
            except Exception as e:  # noqa: BLE001 -- a server that fails here is reported with the rows measured
                bench.notes[f"s3 {server}"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
        report(bench, bytes_read, total, labels)
    return 0


def _reader(url: str) -> Any:
    import ucp

    return ucp.open_checkpoint(url, 1)


def s3_servers(choice: str | None) -> list[str]:
    """The S3 servers --s3 names (none without it; "auto": moto, and radosgw where installed)."""
    if choice is None:
        return []
    if choice == "auto":
        return ["moto"] + ([] if radosgw_missing() else ["radosgw"])
    names = choice.split(",")
    for name in names:
        if name not in S3_SERVERS:
            raise SystemExit(f"bench_io inference: --s3: no S3 server {name!r} (one of {', '.join(S3_SERVERS)})")
    return names


def _s3(bench: Bench, root: Path, server_name: str, budgets: Sequence[int] = ()) -> None:
    server = start_s3_server(server_name)
    label = f"s3 {server_name}"
    try:
        options = server.endpoint.storage_options
        print(f"{label}: {s3_server_version(server_name)} on 127.0.0.1")
        fs = s3_filesystem(options)
        fs.mkdir("inference")
        for name in ("ucp", "hf0"):  # (8 uploads at a time: a busy moto refuses connections at fsspec's 128)
            fs.put(str(root / name), f"inference/{name}", recursive=True, batch_size=8)

        def downloaded() -> Path:
            out = root / "hf0-downloaded"
            shutil.rmtree(out, ignore_errors=True)
            fs.get("inference/hf0", str(out), recursive=True)
            return out

        methods = startup_methods(bench, "s3://inference/ucp", downloaded, options)
        methods["download, then safetensors"] = methods.pop("safetensors")
        methods.pop("fastsafetensors", None)  # (it reads local files only)
        if "runai_streamer" in methods:
            methods["runai_streamer"] = bench.start(model="s3://inference/hf0", load_format="runai_streamer")
        with runai_environment(options):
            for _ in range(bench.repeats):
                for name, run in methods.items():
                    bench.time(f"{name} ({label})", run)
            refresh_rows(bench, "s3://inference/ucp", options, None, label, budgets)
    finally:
        server.close()


RAW_READ = "raw read of a step's weights, 8 threads"  # (the floor of reading them: bench_io.coldstart.raw_read)
ONE_ENGINE = (  # (the start-up rows that are one engine's construction and nothing else)
    "ucp",
    "ucp, every weight through load_weights",
    "safetensors",
    "runai_streamer",
    "fastsafetensors",
    "sharded_state",
)


def report(bench: Bench, bytes_read: list[int], total: int, labels: list[str]) -> None:
    print(f"{'method':<44} {'seconds':>9}  each run")
    for name, runs in bench.times.items():
        print(f"{name:<44} {bench.median(name):>9.2f}  {' '.join(f'{t:.2f}' for t in runs)}")
    for name, note in bench.notes.items():
        print(f"{name:<44} {'-':>9}  {note}")
    print(f"bytes read per worker in a refresh: {[f'{b / 2**20:.1f} MiB' for b in bytes_read]} of {total / 2**20:.1f}")
    for where in labels:
        ucp_start = bench.median(f"ucp ({where})")
        for baseline in (
            "safetensors",
            "download, then safetensors",
            "export, then safetensors",
            "runai_streamer",
            "fastsafetensors",
            "sharded_state",
            "ucp, every weight through load_weights",
        ):
            other = bench.median(f"{baseline} ({where})")
            if ucp_start and other:
                print(f"{where}: start-up, ucp / {baseline} = {ucp_start / other:.2f}x")
        refreshed = bench.median(f"refresh ({where})")
        for name in bench.times:
            if name.startswith("refresh") and name.endswith(f"({where})") and ucp_start:
                label = name.removesuffix(f" ({where})")
                print(f"{where}: {label} / a new engine (ucp) = {bench.median(name) / ucp_start:.2f}x")
        reload = bench.median(f"vLLM reload_weights, safetensors ({where})")
        if refreshed and reload:
            print(f"{where}: refresh / vLLM reload_weights of safetensors = {refreshed / reload:.2f}x")
        own = {n: bench.own_part(f"{n} ({where})") for n in ONE_ENGINE}
        own = {n: s for n, s in own.items() if s is not None}
        if own:
            parts = ", ".join(f"{n} {s:.2f}" for n, s in own.items())
            print(f"{where}: vLLM's own part of a start-up (less the loader's load_weights), seconds: {parts}")
        raw, export = bench.median(f"{RAW_READ} ({where})"), bench.median(f"export, then safetensors ({where})")
        if raw and export and "ucp" in own:
            floor = own["ucp"] + raw
            print(
                f"{where}: the fastest ucp start-up the weights' bytes allow (vLLM's own part + a raw read of them: "
                f"{own['ucp']:.2f} + {raw:.2f} s) / export, then safetensors = {floor / export:.2f}x"
            )


def _vllm_environment(tp: int) -> None:
    """vLLM's CPU build in this process (one worker), or in worker processes (tp > 1), bf16 with its AMX tiles
    initialised in each (without, its bf16 kernels die with an illegal instruction)."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    torch.cpu._init_amx()
    if tp == 1:
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        return
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(i) for i in range(tp)))
    site = Path(tempfile.mkdtemp(prefix="bench-inference-site-"))
    (site / "sitecustomize.py").write_text("import torch\ntorch.cpu._init_amx()\n")
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))


if __name__ == "__main__":
    raise SystemExit(main())
