"""Small helpers shared by the tests."""

from __future__ import annotations

import collections
import contextlib
import gc
import math
import os
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from ucp.distributed import ShardedModel, VirtualWorld
from ucp.sharding.families import MixtralConfig, canonical_atoms
from ucp.sharding.layout import parse_layout
from ucp.sharding.reshard import DEFAULT_STATES, shard

from .launch import SEED_VARIABLE

# What a test module draws at collection time (which layouts a parametrized test runs in) comes from this generator,
# seeded by UCP_TEST_SEED: conftest.py sets it once per run, so every pytest-xdist worker collects the same tests,
# and prints it, so a run's draws can be repeated.
DRAW = random.Random(int(os.environ.get(SEED_VARIABLE, "0")))


def assert_same_state(a: Any, b: Any, path: str = "state") -> None:
    """Bitwise equality of nested states: same keys, same tensor dtype/shape/bytes, equal JSON values."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), f"{path}: {type(b)} is not a tensor"
        assert a.dtype == b.dtype and a.shape == b.shape, (
            f"{path}: {a.dtype}{tuple(a.shape)} != {b.dtype}{tuple(b.shape)}"
        )
        assert b.is_contiguous(), f"{path}: loaded tensor is not contiguous"
        assert bytes(a.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()) == bytes(
            b.cpu().reshape(-1).view(torch.uint8).numpy()
        ), f"{path}: bytes differ"
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), (
            f"{path}: keys {list(a)} != {list(b) if isinstance(b, dict) else b}"
        )
        for k in a:
            assert_same_state(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, list) and len(a) == len(b), f"{path}: {a!r} != {b!r}"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same_state(x, y, f"{path}[{i}]")
    elif isinstance(a, float) and math.isnan(a):
        assert isinstance(b, float) and math.isnan(b), f"{path}: {b!r} is not nan"
    else:
        assert a == b and type(a) is type(b), f"{path}: {a!r} != {b!r}"


def step_path(root: Any, step: int | str = "latest") -> Path:
    """The directory of a committed step's Zarr group: the attempt that its commit marker names."""
    import ucp

    return Path(root) / ucp.open_checkpoint(str(root), step).prefix


def damage_atom(root: Any, atom: str, step: int | str = "latest") -> None:
    """Flip a bit in the stored bytes of an atom's first chunk: in its chunk object, or in the pack that holds it."""
    import ucp

    reader = ucp.open_checkpoint(str(root), step)
    meta = reader.atoms[atom]
    index = (0,) * len(meta.shape)
    path = Path(root) / reader.object_key(meta, index)
    data = bytearray(path.read_bytes())
    where = reader.packed_chunk(meta, index) if meta.packed else None
    data[where.offset + where.nbytes // 2 if where else len(data) // 2] ^= 0x40
    path.write_bytes(bytes(data))


def manifest_view(root: Any, step: int | str = "latest") -> dict:
    """A committed step's manifest as one document in format 3.0's layout, whatever the step's format: its group's
    zarr.json with every atom's entry under attributes.ucp "atoms" (shape, dtype, chunk_shape, inner_chunk_shape,
    attributes, and "objects" or "packed"), the packs under "packs" and the whole state tree. What a test edits;
    `reseal_manifest` writes it back in the step's own format (3.1: its index parts laid out again)."""
    import json

    import ucp
    from ucp.format.index import IndexedManifest

    reader = ucp.open_checkpoint(str(root), step)
    doc = json.loads((Path(root) / reader.prefix / "zarr.json").read_text())
    manifest = reader.manifest
    if not isinstance(manifest, IndexedManifest):
        return doc
    attrs = doc["attributes"]["ucp"]
    atoms = {}
    for path, meta in manifest.atoms.items():
        entry = meta.to_manifest()
        if meta.packed:
            entry["packed"] = [c.to_json() for c in manifest.packed_of(path)]
        else:
            entry["objects"] = [list(o) for o in manifest.objects_of(path) or []]
        atoms[path] = entry
    attrs.pop("index")
    attrs.update(tree=manifest.tree, atoms=atoms, packs={name: list(s) for name, s in manifest.packs.items()})
    return doc


def _index_layout(attrs: dict) -> tuple[dict, list[tuple[str, bytes]]]:
    """Format 3.1's manifest attributes and index parts for a 3.0-layout view (`manifest_view`), laid out leniently:
    whatever an edit put in an entry goes into the columns as it is, for a reader to refuse (docs/FORMAT.md 3.1)."""
    import crc32c

    from ucp.base import dtypes
    from ucp.format.index import PART_RECORDS, atoms_part_name, path_key
    from ucp.format.manifest import dumps

    atoms, packs = attrs.pop("atoms"), attrs.pop("packs", {})
    paths = sorted(atoms, key=path_key)
    parts, directory = [], []
    start = 0
    while start < len(paths):
        end, records = start, 0
        while end < len(paths) and (records < PART_RECORDS or end == start):
            entry = atoms[paths[end]]
            chunks = entry.get("packed", entry.get("objects"))
            records += 1 + (len(chunks) if isinstance(chunks, list) else 0)
            end += 1
        col: dict[str, list] = {
            k: [] for k in ("dtype", "ndim", "shape", "chunk_shape", "sharded", "inner_chunk_shape")
        }
        col.update({k: [] for k in ("attrs", "packed", "chunks", "pack", "offset", "nbytes", "crc")})
        dtype_table: list = []
        attr_table: list = []
        pack_table: list = list(packs) if not parts else []  # (the first part lists every pack the view has)
        nbytes = 0
        for number, path in enumerate(paths[start:end]):
            entry = atoms[path]
            for value, table, column in (
                (entry.get("dtype"), dtype_table, "dtype"),
                (entry.get("attributes", {}), attr_table, "attrs"),
            ):
                if value not in table:
                    table.append(value)
                col[column].append(table.index(value))
            shape = entry.get("shape")
            col["ndim"].append(len(shape))
            col["shape"] += shape
            col["chunk_shape"] += entry.get("chunk_shape")
            if "inner_chunk_shape" in entry:
                col["sharded"].append(number)
                col["inner_chunk_shape"] += entry["inner_chunk_shape"]
            with contextlib.suppress(Exception):  # (an edited entry: its size is what the reader refuses)
                nbytes += int(min(max(math.prod(shape) * dtypes.itemsize(entry.get("dtype")), 0), 1 << 46))
            packed = "packed" in entry
            col["packed"].append(int(packed))
            chunks = entry.get("packed" if packed else "objects")
            chunks = chunks if isinstance(chunks, list) else []
            col["chunks"].append(len(chunks))
            for c in chunks:
                if packed:
                    known = isinstance(c[0], str) and c[0] in packs
                    if known and c[0] not in pack_table:
                        pack_table.append(c[0])
                    c = [pack_table.index(c[0]) if known else len(packs) + 99, *c[1:]]
                else:
                    c = [-1, 0, *c]
                for column, value in zip(("pack", "offset", "nbytes", "crc"), c):
                    col[column].append(value)
        doc = {
            "paths": paths[start:end],
            "dtypes": dtype_table,
            **col,
            "attributes": attr_table,
            "packs": [[name, *packs.get(name, [0, 0])] for name in pack_table],
        }
        data = dumps(doc)
        directory.append([paths[start], end - start, nbytes, len(data), crc32c.crc32c(data)])
        parts.append((atoms_part_name(len(parts)), data))
        start = end
    attrs["index"] = {"atoms": len(paths), "bytes": sum(d[2] for d in directory), "parts": directory, "trees": []}
    return attrs, parts


def reseal_manifest(root: Any, doc: dict, step: int | str = "latest", text_edit: Any = None) -> None:
    """Write `doc` (`manifest_view`'s layout, or the step's zarr.json as it is) as a committed step's manifest and
    record its size and checksum in the commit marker, as a writer (or an operator who edits both) would: what is
    left for a reader to catch is what the manifest says (`write_manifest`)."""
    import ucp
    from ucp.format.manifest import COMMIT_MARKER

    reader = ucp.open_checkpoint(str(root), step)
    attempt = Path(root) / reader.prefix
    write_manifest(
        attempt, attempt.parent / COMMIT_MARKER if reader.record.attempt else attempt / COMMIT_MARKER, doc, text_edit
    )


def write_manifest(attempt: Path, marker_path: Path, doc: dict, text_edit: Any = None) -> None:
    """`reseal_manifest` without opening the step (which an earlier edit may have left refused): a format 3.1 view
    gets its index parts laid out again (and the marker its atoms and bytes); `text_edit` changes each JSON text
    written before it is sealed."""
    import json
    import shutil

    import crc32c

    from ucp.format.manifest import INDEX_DIR, dumps

    attrs = doc["attributes"]["ucp"]
    edit = text_edit or (lambda text: text)
    marker = json.loads(marker_path.read_text())
    if attrs.get("format_version") == "3.1" and "atoms" in attrs:
        attrs, parts = _index_layout(dict(attrs))
        doc = {**doc, "attributes": {**doc["attributes"], "ucp": attrs}}
        shutil.rmtree(attempt / INDEX_DIR, ignore_errors=True)
        (attempt / INDEX_DIR).mkdir()
        for number, (name, data) in enumerate(parts):
            data = edit(data.decode()).encode()
            (attempt / name).write_bytes(data)
            attrs["index"]["parts"][number][3:] = [len(data), crc32c.crc32c(data)]
        marker.update(atoms=attrs["index"]["atoms"], bytes=attrs["index"]["bytes"])
    data = edit(dumps(doc).decode()).encode()
    (attempt / "zarr.json").write_bytes(data)
    marker.update(manifest_crc32c=crc32c.crc32c(data), manifest_bytes=len(data))
    marker_path.unlink()
    marker_path.write_bytes(dumps(marker))


def reseal_object(root: Any, atom: str, index: tuple[int, ...], data: bytes, step: int | str = "latest") -> None:
    """Replace a committed chunk object with `data` and record its size and checksum in the manifest (and the
    manifest's in the marker), as another writer that wrote `data` would have."""
    import struct

    import crc32c

    import ucp
    from ucp.protocol.codec import head_nbytes

    reader = ucp.open_checkpoint(str(root), step)
    meta = reader.atoms[atom]
    (Path(root) / reader.prefix / atom / meta.chunk_key(index)).write_bytes(data)
    crc = crc32c.crc32c(data[: head_nbytes(meta)]) if meta.inner_chunk_shape else struct.unpack("<I", data[-4:])[0]
    doc = manifest_view(root, step)
    doc["attributes"]["ucp"]["atoms"][atom]["objects"][meta.object_number(index)] = [len(data), crc]
    reseal_manifest(root, doc, step)


def assert_reshards(config: Any, url: str, source: str, targets: list[str], seed: int = 0) -> None:
    """Random atoms and Adam states of `config`, saved by every rank of layout `source`, load in each of `targets`
    and assemble back bitwise (the reshaper's round trip for one model family)."""
    import ucp
    from ucp.distributed import ShardedModel, VirtualWorld, load_sharded
    from ucp.sharding.families import buffer_atoms, canonical_atoms
    from ucp.sharding.layout import parse_layout
    from ucp.sharding.reshard import assemble, shard

    states = ("exp_avg", "exp_avg_sq")
    g = torch.Generator().manual_seed(seed)
    atoms = canonical_atoms(config)
    full = {
        "model": {n: torch.randn(s, generator=g) for n, (s, _) in atoms.items()},
        "optimizer": {
            "state": {
                n: {st: torch.randn(s, generator=g) for st in states}
                for n, (s, _) in atoms.items()
                if n not in buffer_atoms(config)  # (buffers have no optimizer state)
            }
        },
    }
    lay = parse_layout(source)
    VirtualWorld(lay.world_size).save(
        [shard(full, config, lay, r, states) for r in range(lay.world_size)],
        url,
        step=1,
        model=ShardedModel(config, lay, states),
    )
    reader = ucp.open_checkpoint(url)
    for name in targets:
        target = parse_layout(name)
        local = [load_sharded(reader, ShardedModel(config, target, states), r)[0] for r in range(target.world_size)]
        back = assemble(local, config, target, states)
        for n in atoms:
            assert torch.equal(back["model"][n], full["model"][n]), (name, n)
            if n in full["optimizer"]["state"]:
                assert all(
                    torch.equal(back["optimizer"]["state"][n][s], full["optimizer"]["state"][n][s]) for s in states
                )
            else:
                assert n not in back["optimizer"]["state"], (name, n)


def hf_logits(model: torch.nn.Module, vocab_size: int) -> torch.Tensor:
    """A transformers causal LM's logits on a fixed batch of tokens."""
    tokens = torch.randint(0, vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        return model(tokens).logits


def train_records(config: Path, layout: str, steps: int, tmp: Path, *extra: str) -> list[dict]:
    """Every record rank 0 of `python -m trainer` writes to its metrics file, run in `layout` (as many local processes
    as it needs) up to `steps`; logs under `tmp`."""
    import json

    from trainer import launch
    from trainer.parallel.mesh import parse_layout

    metrics = tmp / f"{layout}-{launch.free_port()}.jsonl"
    logs = tmp / f"logs-{metrics.stem}"
    argv = launch.trainer_argv(config, layout, steps, metrics, *extra)
    launch.wait(launch.start(argv, parse_layout(layout).world_size, logs), logs, 300)
    return [json.loads(line) for line in metrics.read_text().splitlines()]


def perturb_parameters(model: torch.nn.Module, scale: float = 0.05) -> None:
    """Noise on every parameter of a freshly built model (norm weights start at one and biases at zero: so that every
    tensor counts in a comparison)."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * scale)


def random_hf_model(arch: str, **config: Any) -> torch.nn.Module:
    """transformers' `arch` (e.g. "LlamaForCausalLM") of `config`, eager attention, with random weights: norms near
    1 and every other weight N(0, 0.05), so that every weight matters."""
    import pytest

    transformers = pytest.importorskip(
        "transformers", reason="transformers is not installed (pip install transformers)"
    )
    cls = getattr(transformers, arch)
    model = cls(cls.config_class(**config, max_position_embeddings=256, attn_implementation="eager"))
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn_like(p) if "norm" in name else 0.05 * torch.randn_like(p))
    return model.eval()


def assert_same_logits(stage: torch.nn.Module, hf: torch.nn.Module, vocab_size: int, seed: int = 1) -> torch.Tensor:
    """The reference trainer's stage (one stage: the whole model) computes transformers' logits on random tokens
    (<= 1e-5 of the largest, relative); returns the stage's load-balancing loss."""
    tokens = torch.randint(vocab_size, (2, 32), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        expected = hf(tokens).logits
        logits, aux = stage(tokens)
    logits = logits[..., :vocab_size]
    assert logits.shape == expected.shape
    error = (logits - expected).abs().max() / expected.abs().max()
    assert error <= 1e-5, f"relative error {error:.3g}"
    return aux


def load_factor() -> float:
    """How overloaded the machine is now: the 1-minute load average over the cores, at least 1. A bound on how soon
    something must happen (a watchdog's reaction, a peer noticing a death) is for a machine whose cores a test has
    to itself; at a load of 6 on 2 cores every process runs a third of the time."""
    return max(1.0, os.getloadavg()[0] / (os.cpu_count() or 1))


# An S3 test that is about something else than the store (a command's arguments, a benchmark's bookkeeping) runs on
# moto alone: `@moto_only` (the S3 fixtures run every other test on each server, tests/conftest.py).
moto_only = pytest.mark.parametrize("s3_server", ["moto"], indirect=True)


@contextlib.contextmanager
def left_to_the_collector() -> Iterator[collections.Counter[str]]:
    """What the block leaves that only Python's cyclic garbage collector frees (objects in reference cycles, and what
    they hold) and that is ucp's: its objects and tensors, counted by type once the block ends. Every collection
    made meanwhile (vLLM makes several) keeps what it finds (DEBUG_SAVEALL) instead of freeing it, so that nothing
    escapes the count; what was garbage before the block is collected first and not counted."""
    found: collections.Counter[str] = collections.Counter()
    gc.collect()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        yield found
        gc.collect()
    finally:
        gc.set_debug(0)
        for o in gc.garbage:
            if isinstance(o, torch.Tensor) or type(o).__module__.split(".")[0] == "ucp":
                found[f"{type(o).__module__}.{type(o).__qualname__}"] += 1
        gc.garbage.clear()


# ------------------------------------------------------------------ a tiny Mixtral checkpoint in a training layout


def tiny_config(**overrides) -> MixtralConfig:
    """vocab 100 is not a multiple of 128: every layout pads it."""
    fields = {
        "vocab_size": 100,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
    }
    fields.update(overrides)
    return MixtralConfig(**fields)


def random_full_state(cfg: MixtralConfig, states: tuple[str, ...] = DEFAULT_STATES, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    model = {n: torch.randn(shape, generator=g) * 0.2 for n, (shape, _) in canonical_atoms(cfg).items()}
    full: dict = {"model": model}
    if states:
        full["optimizer"] = {
            "state": {n: {s: torch.randn(t.shape, generator=g) for s in states} for n, t in model.items()}
        }
    return full


def save_in_layout(
    full: dict, cfg: MixtralConfig, layout: str, url: str, *, step: int = 1, storage_options=None, options=None
) -> None:
    """A checkpoint as a training job in `layout` would write it: every rank's local state, one distributed save."""
    lay = parse_layout(layout)
    states = tuple(next(iter(full["optimizer"]["state"].values()))) if "optimizer" in full else ()
    local = [shard(full, cfg, lay, r, states) for r in range(lay.world_size)]
    VirtualWorld(lay.world_size).save(
        local, url, step=step, model=ShardedModel(cfg, lay, states), storage_options=storage_options, options=options
    )


def s3_client(options: dict) -> Any:
    """A boto3 S3 client of the user in `options` (s3fs's storage options: endpoint_url, key, secret), for what a
    test asks of the store beside ucp."""
    import boto3

    return boto3.client(
        "s3",
        endpoint_url=options["endpoint_url"],
        aws_access_key_id=options["key"],
        aws_secret_access_key=options["secret"],
        region_name="us-east-1",
    )
