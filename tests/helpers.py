"""Small helpers shared by the tests."""

from __future__ import annotations

import math
import os
import random
from pathlib import Path
from typing import Any

import pytest
import torch

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


def reseal_manifest(root: Any, doc: dict, step: int | str = "latest") -> None:
    """Write `doc` as a committed step's manifest and record its size and checksum in the commit marker, as a
    writer (or an operator who edits both) would: what is left for a reader to catch is what the manifest says."""
    import json

    import crc32c

    import ucp
    from ucp.format.manifest import COMMIT_MARKER, dumps

    reader = ucp.open_checkpoint(str(root), step)
    data = dumps(doc)
    (Path(root) / reader.prefix / "zarr.json").write_bytes(data)
    marker_path = (
        Path(root) / reader.prefix.rsplit("/", 1)[0] / COMMIT_MARKER
        if reader.record.attempt
        else Path(root) / reader.prefix / COMMIT_MARKER
    )
    marker = json.loads(marker_path.read_text())
    marker.update(manifest_crc32c=crc32c.crc32c(data), manifest_bytes=len(data))
    marker_path.unlink()
    marker_path.write_bytes(dumps(marker))


def reseal_object(root: Any, atom: str, index: tuple[int, ...], data: bytes, step: int | str = "latest") -> None:
    """Replace a committed chunk object with `data` and record its size and checksum in the manifest (and the
    manifest's in the marker), as another writer that wrote `data` would have."""
    import json
    import struct

    import crc32c

    import ucp
    from ucp.protocol.codec import head_nbytes

    reader = ucp.open_checkpoint(str(root), step)
    meta = reader.atoms[atom]
    (Path(root) / reader.prefix / atom / meta.chunk_key(index)).write_bytes(data)
    crc = crc32c.crc32c(data[: head_nbytes(meta)]) if meta.inner_chunk_shape else struct.unpack("<I", data[-4:])[0]
    doc = json.loads((Path(root) / reader.prefix / "zarr.json").read_text())
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
