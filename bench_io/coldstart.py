"""Cold start: time from nothing to filled parameters, ucp against safetensors, local and S3.

    python -m bench_io coldstart --size-gib 1 [--s3] [--repeats 3]

Writes one bf16 Mixtral-shaped model of about --size-gib as a ucp checkpoint (saved from tp2pp2, as a
pretraining job would) and as Hugging Face safetensors, then times, with the page cache of every file dropped
before each run (posix_fadvise DONTNEED, no root needed):

- ucp, tp1: every parameter of the model (`load_weights(url, "tp1", 0)`);
- ucp, tp2 rank 0: what one rank of a tp2 job reads (half the matrices);
- safetensors: `safetensors.torch.load_file` of every file (local), or download + `safetensors.torch.load` (S3),
  each tensor then copied once. `load_file` maps a file lazily (its pages are read when first touched), so the
  copy is what makes the parameters filled; ucp's load_weights returns tensors already read and filled.

Each is timed twice, by where the weights land:

- "new": in memory the load allocates (ucp's returned tensors; safetensors' tensors cloned and kept), as a job
  that builds its model from the checkpoint does. Every page is new to the process, so every page faults.
- "into": in the job's own parameters, allocated and touched before the timer, as a job that has built its model
  has them (ucp `load_weights(..., into=params)`; safetensors copied into them, as `load_state_dict` does).

Locally, two floors are timed in the same run: "raw read" of the files each method reads (ucp's chunk objects of the
model, with `--raw-threads` threads, 8 by default; safetensors' files one after another, as load_file reads them), `preadv` into
memory allocated and touched before the timer, no checksum, no parsing. They say what the file count and placement
cost before any format's work.

With --s3 the same files go to an S3 server on 127.0.0.1 (`--s3-server`: Ceph's radosgw where installed, else
moto's), and S3 rows are added, with Run:ai's model streamer beside them where it is installed (`pip install
runai-model-streamer runai-model-streamer-s3`): its SafetensorsStreamer streaming the safetensors files ("new": the
tensors it returns, each its own; "into": copied into the job's parameters), an inference engine's cold start.
`--reads-in-flight 16,32` adds rows of ucp tp1 "into" with those counts of reads in flight (otherwise the storage's
own: on a disk 4 a core, at most 16; on S3 64). Each repeat runs every method once in turn (a round), so that a
repeat's methods meet the same machine. Prints a table: seconds (median of the repeats), bytes read from storage,
the effective rate and each repeat's seconds; then ucp's time over each peer's, of the medians and repeat by repeat.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import itertools
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from ucp.distributed import ShardedModel, VirtualWorld
from ucp.sharding.families import MixtralConfig, canonical_atoms
from ucp.sharding.layout import parse_layout
from ucp.sharding.reshard import shard

from .args import at_least, counts, positive_float
from .methods import one_line, runai_environment
from .s3_servers import S3_SERVERS, s3_server_version, start_s3_server
from .state import even_layers
from .targets import drop_page_cache, embedded_server, s3_filesystem


@dataclass
class Row:
    method: str
    storage: str
    times: list[float]  # seconds of each repeat, in order
    bytes_read: int

    @property
    def seconds(self) -> float:
        return statistics.median(self.times)

    def line(self) -> str:
        rate = self.bytes_read / self.seconds / 2**30 if self.seconds else 0.0
        repeats = " ".join(f"{t:.3f}" for t in self.times)
        return (
            f"{self.method:<26} {self.storage:<7} {self.seconds:>9.3f} {self.bytes_read / 2**20:>11.1f} {rate:>9.2f}"
            f"   {repeats}"
        )


def config_for(size_gib: float) -> MixtralConfig:
    """A Mixtral-shaped model of about size_gib in bf16: h=1024, 8 experts of ffn 1024, vocab 32000."""
    h, ffn, experts, vocab = 1024, 1024, 8, 32000
    per_layer = 2 * h * h + 2 * 256 * h + 2 * h + experts * h + experts * 3 * h * ffn
    layers = even_layers(size_gib, per_layer, fixed=2 * vocab * h + h, minimum=1)
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


def timed(
    methods: list[tuple[str, Callable[[], int]]], storage: str, repeats: int, before: Callable[[], None]
) -> list[Row]:
    """A row of each method: `repeats` rounds, each running every method once in turn (so that each round's
    methods meet the same machine: ratios repeat by repeat compare runs made next to each other)."""
    rows = [Row(name, storage, [], 0) for name, _ in methods]
    for _ in range(repeats):
        for row, (_, fn) in zip(rows, methods, strict=True):
            before()
            t0 = time.perf_counter()
            row.bytes_read = fn()
            row.times.append(time.perf_counter() - t0)
    return rows


Params = dict[str, torch.Tensor]


def ucp_load(
    url: str, layout: str, storage_options: dict | None, into: Params | None = None, reads: int | None = None
) -> Callable[[], int]:
    """ucp's load of rank 0 of `layout`; `reads`: the reads in flight (None: the storage's default)."""
    from ucp.engine.checkpoint import CheckpointReader
    from ucp.interop.weights import load_weights
    from ucp.storage import open_storage

    def run() -> int:
        source = url if reads is None else CheckpointReader(open_storage(url, storage_options), 0, io_threads=reads)
        return load_weights(source, layout, 0, storage_options=storage_options, into=into).report.bytes_read

    return run


def ucp_params(url: str, layout: str, storage_options: dict | None) -> Params:
    """A job's parameters for rank 0 of `layout`: allocated and touched (zeros), as a built model's are."""
    from ucp.interop.weights import load_weights

    return {
        n: torch.zeros_like(t) for n, t in load_weights(url, layout, 0, storage_options=storage_options).params.items()
    }


def fill(tensors: dict[str, torch.Tensor], into: Params | None, kept: list[torch.Tensor]) -> None:
    """What a job does with tensors that a safetensors load returned: copy them into its parameters, or (no
    parameters yet) into memory of its own."""
    for name, t in tensors.items():
        if into is None:
            kept.append(t.clone())
        else:
            into[name].copy_(t)


def safetensors_local(hf: Path, into: Params | None = None) -> Callable[[], int]:
    from safetensors.torch import load_file

    def run() -> int:
        n, kept = 0, []
        for f in sorted(hf.glob("*.safetensors")):
            fill(load_file(str(f)), into, kept)
            n += f.stat().st_size
        return n

    return run


def safetensors_params(hf: Path) -> Params:
    from safetensors.torch import load_file

    return {n: torch.zeros_like(t) for f in sorted(hf.glob("*.safetensors")) for n, t in load_file(str(f)).items()}


def safetensors_s3(fs, prefix: str, into: Params | None = None) -> Callable[[], int]:
    import concurrent.futures as cf

    from safetensors.torch import load

    def run() -> int:
        files = sorted(p for p in fs.ls(prefix, detail=False) if p.endswith(".safetensors"))
        with cf.ThreadPoolExecutor(8) as pool:
            blobs = list(pool.map(fs.cat_file, files))
        kept: list[torch.Tensor] = []
        for b in blobs:
            fill(load(b), into, kept)
        return sum(len(b) for b in blobs)

    return run


def chunk_objects(ucp_root: Path) -> list[Path]:
    """The files a weights-only load of every parameter reads: the chunk objects of the model's atoms, and the packs
    that hold its packed ones (not the `zarr.json` documents, which ucp's loads do not read: the manifest plans
    them)."""
    import ucp
    from ucp.format.manifest import chunk_indices

    reader = ucp.open_checkpoint(str(ucp_root))
    keys = {
        reader.object_key(meta, index)
        for meta in reader.atoms.values()
        if meta.path.startswith("model/")
        for index in chunk_indices(meta.grid)
    }
    return sorted(ucp_root / key for key in keys)


def raw_read(files: list[Path], threads: int) -> Callable[[], int]:
    """`preadv` of whole files into one buffer allocated and touched up front: the floor of any reader of them."""
    sizes = [f.stat().st_size for f in files]
    buffer = torch.zeros(sum(sizes), dtype=torch.uint8)
    offsets = itertools.accumulate(sizes, initial=0)
    views = [memoryview(buffer[o : o + n].numpy()) for o, n in zip(offsets, sizes, strict=False)]

    def read_one(i: int) -> int:
        fd = os.open(files[i], os.O_RDONLY)
        try:
            return os.preadv(fd, [views[i]], 0)
        finally:
            os.close(fd)

    def run() -> int:
        if threads == 1:
            return sum(map(read_one, range(len(files))))
        with cf.ThreadPoolExecutor(threads) as pool:
            return sum(pool.map(read_one, range(len(files))))

    return run


def methods(
    ucp_url: str,
    hf: Callable[[Params | None], Callable[[], int]],
    st_params: Params,
    options: dict | None,
    reads_in_flight: Sequence[int] = (),
):
    """(name, run) of every method, ucp's in both layouts and both destinations (tp1 "into" also with each count of
    `reads_in_flight`), then safetensors'."""
    out = []
    for layout, label in (("tp1", "tp1"), ("tp2", "tp2 r0")):
        job = ucp_params(ucp_url, layout, options)
        out.append((f"ucp {label}, new", ucp_load(ucp_url, layout, options)))
        out.append((f"ucp {label}, into", ucp_load(ucp_url, layout, options, job)))
        if layout == "tp1":
            out += [(f"ucp tp1, into, {n} reads", ucp_load(ucp_url, layout, options, job, n)) for n in reads_in_flight]
    out.append(("safetensors, new", hf(None)))
    out.append(("safetensors, into", hf(st_params)))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench_io coldstart", description=__doc__.split("\n\n")[0])
    p.add_argument("--size-gib", type=positive_float, default=1.0)
    p.add_argument("--s3", action="store_true", help="also measure against an S3 server on 127.0.0.1 (--s3-server)")
    p.add_argument(
        "--s3-server",
        choices=("auto", *S3_SERVERS),
        default="auto",
        help="with --s3: radosgw, moto, or auto (the default: radosgw where installed, else moto)",
    )
    p.add_argument("--repeats", type=at_least(1), default=3)
    p.add_argument("--dir", default=None, help="scratch directory (default: a temporary one)")
    p.add_argument(
        "--raw-threads", type=at_least(1), default=8, help="threads of the raw read of ucp's files (default 8)"
    )
    p.add_argument(
        "--reads-in-flight",
        type=counts(1),
        default=[],
        metavar="N[,N...]",
        help="also time ucp tp1 'into' with each of these counts of reads in flight (otherwise the storage's own: "
        "on a disk 4 a core, at most 16; on S3 64)",
    )
    p.add_argument(
        "--cache",
        choices=("auto", "drop_caches", "fadvise"),
        default="fadvise",
        help="how the page cache is dropped before each run: fadvise (default: these files, no root needed), "
        "drop_caches (the whole system's, as root), auto (drop_caches if root, else fadvise)",
    )
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
            drop_page_cache(root, args.cache)

        st_params = safetensors_params(hf)
        objects, st_files = chunk_objects(Path(url)), sorted(hf.glob("*.safetensors"))
        local = methods(url, lambda into: safetensors_local(hf, into), st_params, None, args.reads_in_flight) + [
            (f"raw read, ucp's {len(objects)} files", raw_read(objects, args.raw_threads)),
            (f"raw read, safetensors' {len(st_files)}", raw_read(st_files, 1)),
        ]
        rows += timed(local, "local", args.repeats, cold)
        if args.s3:
            server = embedded_server(args.s3_server)
            rows += _s3_rows(root, hf, st_params, args.repeats, server, args.reads_in_flight)
        print(f"{'method':<26} {'storage':<7} {'seconds':>9} {'MiB read':>11} {'GiB/s':>9}   each repeat's seconds")
        for row in rows:
            print(row.line())
        print(ratios(rows))
    return 0


def ratios(rows: list[Row]) -> str:
    """ucp's tp1 time over safetensors' and runai-model-streamer's, per storage and destination (< 1: ucp is
    faster): of the medians, then repeat by repeat."""
    by = {(r.method, r.storage): r for r in rows}
    out = []
    for storage in dict.fromkeys(r.storage for r in rows):
        for dest in ("new", "into"):
            mine = by.get((f"ucp tp1, {dest}", storage))
            for label, peer in (("safetensors", "safetensors"), ("runai-model-streamer", "runai")):
                other = by.get((f"{peer}, {dest}", storage))
                if mine and other:
                    each = " ".join(f"{a / b:.2f}" for a, b in zip(mine.times, other.times, strict=True))
                    out.append(
                        f"{storage} {dest}: ucp tp1 / {label} = {mine.seconds / other.seconds:.2f}x (each repeat: {each})"
                    )
    floors = [r.seconds for r in rows if r.method.startswith("raw read")]
    if len(floors) == 2:
        out.append(f"local raw reads of the same files: ucp's / safetensors' = {floors[0] / floors[1]:.2f}x")
    return "\n".join(out)


def runai_s3(urls: list[str], options: dict, nbytes: int, into: Params | None = None) -> Callable[[], int]:
    """Run:ai's SafetensorsStreamer over the safetensors files at `urls`; each tensor it yields is its own (owned)."""

    def run() -> int:
        from runai_model_streamer import SafetensorsStreamer

        with runai_environment(options), SafetensorsStreamer() as streamer:
            streamer.stream_files(urls)
            tensors = dict(streamer.get_tensors())
        if into is not None:
            for name, t in tensors.items():
                into[name].copy_(t)
        return nbytes

    return run


def _s3_rows(
    root: Path, hf: Path, st_params: Params, repeats: int, server_name: str, reads_in_flight: Sequence[int]
) -> list[Row]:
    server = start_s3_server(server_name)
    try:
        options = server.endpoint.storage_options
        fs = s3_filesystem(options)
        fs.mkdir("coldstart")
        url = "s3://coldstart/ucp"
        fs.put(str(root / "ucp"), "coldstart/ucp", recursive=True)
        fs.put(str(hf), "coldstart/hf", recursive=True)
        st_files = sorted(hf.glob("*.safetensors"))
        print(f"s3: {server_name} {s3_server_version(server_name)} on 127.0.0.1")

        def nothing() -> None:  # (no cache of the client's to drop; the server's is its own)
            return None

        timing = methods(
            url, lambda into: safetensors_s3(fs, "coldstart/hf", into), st_params, options, reads_in_flight
        )
        urls = [f"s3://coldstart/hf/{f.name}" for f in st_files]
        nbytes = sum(f.stat().st_size for f in st_files)
        try:
            runai_s3(urls, options, nbytes)()  # (whether it runs here, untimed: as ucp's first load, in `methods`)
            timing += [
                (f"runai, {dest}", runai_s3(urls, options, nbytes, into))
                for dest, into in (("new", None), ("into", st_params))
            ]
        except Exception as e:  # noqa: BLE001 -- a peer that cannot run here is reported, not dropped
            print(f"runai-model-streamer on {server_name}: {one_line(e)}")
        return timed(timing, "s3", repeats, nothing)
    finally:
        server.close()


if __name__ == "__main__":
    raise SystemExit(main())
