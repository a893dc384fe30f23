"""Cold start: time from nothing to filled parameters, ucp against safetensors, local and S3.

    python -m bench_io coldstart --size-gib 1 [--s3] [--repeats 3]

Writes one bf16 Mixtral-shaped model of about --size-gib as a ucp checkpoint (saved from tp2pp2, as a
pretraining job would) and as Hugging Face safetensors, then times, with the page cache of every file dropped
before each run (posix_fadvise DONTNEED, no root needed):

- ucp, tp1: every parameter of the model (`load_weights(url, "tp1", 0)`);
- ucp, tp2 rank 0: what one rank of a tp2 job reads (half the matrices);
- safetensors: `safetensors.torch.load_file` of every file (local), or download + `safetensors.torch.load` (S3),
  each tensor then copied once. `load_file` maps a file lazily (its pages are read when first touched) and a job's
  `load_state_dict` copies every tensor into its parameters, so the copy is what makes the parameters filled; ucp's
  load_weights returns tensors already read and filled.

With --s3 the same files go to a moto S3 server on 127.0.0.1 (in process), and S3 rows are added.
Prints a table: seconds (median of the repeats), bytes read from storage, and the effective rate.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from ucp.distributed import ShardedModel, VirtualWorld
from ucp.families import MixtralConfig, canonical_atoms
from ucp.layout import parse_layout
from ucp.reshard import shard

from .targets import MotoServer, drop_page_cache


@dataclass
class Row:
    method: str
    storage: str
    seconds: float
    bytes_read: int

    def line(self) -> str:
        rate = self.bytes_read / self.seconds / 2**30 if self.seconds else 0.0
        return f"{self.method:<26} {self.storage:<7} {self.seconds:>9.3f} {self.bytes_read / 2**20:>11.1f} {rate:>9.2f}"


def config_for(size_gib: float) -> MixtralConfig:
    """A Mixtral-shaped model of about size_gib in bf16: h=1024, 8 experts of ffn 1024, vocab 32000."""
    h, ffn, experts, vocab = 1024, 1024, 8, 32000
    per_layer = 2 * h * h + 2 * 256 * h + 2 * h + experts * h + experts * 3 * h * ffn
    fixed = 2 * vocab * h + h
    layers = max(1, round((size_gib * 2**30 / 2 - fixed) / per_layer))
    layers += layers % 2  # the source layout has pp2
    return MixtralConfig(
        vocab_size=vocab,
        hidden_size=h,
        intermediate_size=ffn,
        num_hidden_layers=layers,
        num_attention_heads=16,
        num_key_value_heads=4,
        num_local_experts=experts,
    )


def write_sources(cfg: MixtralConfig, root: Path, ucp_url: str, storage_options: dict | None) -> Path:
    """The ucp checkpoint (from tp2pp2) and the safetensors directory of the same weights."""
    from ucp.interop.hf import export_hf

    g = torch.Generator().manual_seed(0)
    atoms = {
        n: torch.randn(shape, generator=g).mul_(0.02).to(torch.bfloat16)
        for n, (shape, _) in canonical_atoms(cfg).items()
    }
    layout = parse_layout("tp2pp2")
    local = [shard({"model": atoms}, cfg, layout, r, ()) for r in range(layout.world_size)]
    del atoms
    VirtualWorld(layout.world_size).save(
        local, ucp_url, step=0, model=ShardedModel(cfg, layout, optim_states=()), storage_options=storage_options
    )
    del local
    hf = root / "hf"
    export_hf(ucp_url, hf, storage_options=storage_options, max_shard_bytes=512 << 20)
    return hf


def timed(fn: Callable[[], int], repeats: int, before: Callable[[], None]) -> tuple[float, int]:
    times, nbytes = [], 0
    for _ in range(repeats):
        before()
        t0 = time.perf_counter()
        nbytes = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), nbytes


def ucp_load(url: str, layout: str, storage_options: dict | None) -> Callable[[], int]:
    from ucp.interop.weights import load_weights

    def run() -> int:
        return load_weights(url, layout, 0, storage_options=storage_options).report.bytes_read

    return run


def safetensors_local(hf: Path) -> Callable[[], int]:
    from safetensors.torch import load_file

    def run() -> int:
        n = 0
        for f in sorted(hf.glob("*.safetensors")):
            for t in load_file(str(f)).values():
                t.clone()  # filled: the bytes read, as load_state_dict's copy into the parameters would
            n += f.stat().st_size
        return n

    return run


def safetensors_s3(fs, prefix: str) -> Callable[[], int]:
    import concurrent.futures as cf

    from safetensors.torch import load

    def run() -> int:
        files = sorted(p for p in fs.ls(prefix, detail=False) if p.endswith(".safetensors"))
        with cf.ThreadPoolExecutor(8) as pool:
            blobs = list(pool.map(fs.cat_file, files))
        for b in blobs:
            for t in load(b).values():
                t.clone()
        return sum(len(b) for b in blobs)

    return run


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size-gib", type=float, default=1.0)
    p.add_argument("--s3", action="store_true", help="also measure against an embedded S3 server (moto) on 127.0.0.1")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dir", default=None, help="scratch directory (default: a temporary one)")
    args = p.parse_args(argv)
    cfg = config_for(args.size_gib)
    params = sum(torch.Size(s).numel() for s, _ in canonical_atoms(cfg).values())
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        root = Path(tmp)
        url = str(root / "ucp")
        hf = write_sources(cfg, root, url, None)
        print(
            f"model: {cfg.num_hidden_layers} layers, {params / 1e6:.0f}M parameters, "
            f"{params * 2 / 2**30:.2f} GiB bf16; ucp saved from tp2pp2; repeats: {args.repeats} (median)"
        )
        rows = []

        def cold() -> None:
            drop_page_cache(root, "fadvise")

        for method, fn in (
            ("ucp load_weights tp1", ucp_load(url, "tp1", None)),
            ("ucp load_weights tp2 r0", ucp_load(url, "tp2", None)),
            ("safetensors load_file+copy", safetensors_local(hf)),
        ):
            rows.append(Row(method, "local", *timed(fn, args.repeats, cold)))
        if args.s3:
            rows += _s3_rows(cfg, root, hf, args.repeats)
        print(f"{'method':<26} {'storage':<7} {'seconds':>9} {'MiB read':>11} {'GiB/s':>9}")
        for row in rows:
            print(row.line())
    return 0


def _s3_rows(cfg: MixtralConfig, root: Path, hf: Path, repeats: int) -> list[Row]:
    import s3fs

    server = MotoServer()
    try:
        options = {"endpoint_url": server.url, "key": "bench", "secret": "bench"}
        fs = s3fs.S3FileSystem(**options, skip_instance_cache=True)
        fs.mkdir("coldstart")
        url = "s3://coldstart/ucp"
        fs.put(str(root / "ucp"), "coldstart/ucp", recursive=True)
        fs.put(str(hf), "coldstart/hf", recursive=True)

        def nothing() -> None:  # the server keeps objects in memory: no cache to drop
            return None

        return [
            Row("ucp load_weights tp1", "s3", *timed(ucp_load(url, "tp1", options), repeats, nothing)),
            Row("ucp load_weights tp2 r0", "s3", *timed(ucp_load(url, "tp2", options), repeats, nothing)),
            Row("safetensors get+load+copy", "s3", *timed(safetensors_s3(fs, "coldstart/hf"), repeats, nothing)),
        ]
    finally:
        server.close()


if __name__ == "__main__":
    raise SystemExit(main())
