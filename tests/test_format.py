"""Single-process save/load: every dtype, shapes, nesting, JSON leaves, storage URLs, chunking."""

from __future__ import annotations

import json
import math
import os
import random
import struct

import crc32c
import pytest
import torch

import ucp
from ucp.base.chunking import ChunkingPolicy, choose_chunks
from ucp.engine.inspection import verify
from ucp.format.manifest import AtomMeta, chunk_indices

from .helpers import assert_same_state, reseal_object, step_path

SMALL_CHUNKS = ucp.SaveOptions(
    chunking=ChunkingPolicy(object_bytes=64 * 1024, inner_bytes=8 * 1024, pack_below=0), fsync=False
)  # (chunks of atoms that are Zarr arrays of their own: packs have tests of their own, test_packs.py)


def every_dtype_state() -> dict:
    g = torch.Generator().manual_seed(0)
    floats = {
        str(dt).removeprefix("torch."): torch.randn(33, 17, generator=g).to(dt)
        for dt in (torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2)
    }
    ints = {
        str(dt).removeprefix("torch."): torch.randint(-100, 100, (5, 3, 2), generator=g).to(dt)
        for dt in (torch.int8, torch.int16, torch.int32, torch.int64)
    }
    return {
        "floats": floats,
        "ints": ints,
        "uint8": torch.randint(0, 255, (300,), generator=g, dtype=torch.uint8),
        "bool": torch.rand(7, 9, generator=g) > 0.5,
        "scalar": torch.tensor(2.5),
        "scalar_bf16": torch.tensor(-1.25, dtype=torch.bfloat16),
        "empty": torch.empty(0, 4),
        "empty_2": torch.zeros(3, 0, 2, dtype=torch.int32),
        "non_contiguous": torch.randn(20, 30, generator=g).t()[::2],
        "big": torch.randn(250, 130, generator=g),  # sharded under SMALL_CHUNKS
        "json": {"lr": 1e-3, "betas": [0.9, 0.95], "name": "adamw", "nested": {"a": None, "b": True}},
        "step": 42,
        "nonfinite": [float("inf"), -float("inf"), float("nan"), 1.0],
        "tuple": (1, 2, 3),
        "tensor_list": [torch.arange(3), {"x": torch.ones(2)}],
        "empty_dict": {},
    }


@pytest.mark.parametrize("kind", ["path", "file", "memory"])
def test_round_trip_every_dtype(tmp_path, kind):
    state = every_dtype_state()
    url = {"path": str(tmp_path / "ck"), "file": f"file://{tmp_path}/ck", "memory": f"memory://{tmp_path.name}/ck"}[
        kind
    ]
    record = ucp.save(state, url, step=7, options=SMALL_CHUNKS)
    assert record.step == 7
    loaded = ucp.load(url)
    expected = dict(state, tuple=[1, 2, 3])  # tuples come back as lists
    assert_same_state(expected, loaded)


def test_step_defaults_to_next_and_committed_steps_are_never_overwritten(tmp_path):
    url = str(tmp_path)
    assert ucp.save({"x": torch.ones(2)}, url).step == 0
    assert ucp.save({"x": torch.zeros(2)}, url).step == 1
    with pytest.raises(ucp.StepExistsError, match="step 1 is already committed"):
        ucp.save({"x": torch.full((2,), 5.0)}, url, step=1)
    assert torch.equal(ucp.load(url, step=1)["x"], torch.zeros(2))
    assert torch.equal(ucp.load(url, step=0)["x"], torch.ones(2))


def test_the_latest_step_is_found_from_the_newest_marker_down_in_one_listing(tmp_path):
    """Opening the latest step lists the root once and reads markers from the newest step down to the first valid
    one (each a request in series before a load's first read on an object store), not every step's; a step with a
    damaged marker or none is passed over, and a step asked for by number is its marker alone."""
    from ucp.format.manifest import COMMIT_MARKER, step_dirname
    from ucp.storage import open_storage

    for step in range(4):
        ucp.save({"x": torch.full((2,), float(step))}, str(tmp_path), step=step)
    (tmp_path / step_dirname(3) / COMMIT_MARKER).write_text('{"torn')
    (tmp_path / step_dirname(5)).mkdir()  # (a save that did not finish)
    storage = open_storage(str(tmp_path))
    asked: list[tuple[str, str]] = []  # (method, key) of every request

    def recorded(name, method):
        def call(*args, **kwargs):
            asked.append((name, args[0] if args else ""))
            return method(*args, **kwargs)

        return call

    for name in ("read", "read_into", "listdir", "exists", "root_exists"):
        setattr(storage, name, recorded(name, getattr(storage, name)))
    reader = ucp.CheckpointReader(storage)
    assert reader.step == 2 and torch.equal(reader.load_state()["x"], torch.full((2,), 2.0))
    markers = [key for name, key in asked if key.endswith(COMMIT_MARKER)]
    assert markers == [f"{step_dirname(s)}/{COMMIT_MARKER}" for s in (5, 3, 2)], asked
    names = [name for name, _ in asked]
    assert names.count("listdir") == 1 and "root_exists" not in names, asked
    asked.clear()
    assert ucp.CheckpointReader(storage, 1).step == 1
    assert [key for _, key in asked if key.endswith(COMMIT_MARKER)] == [f"{step_dirname(1)}/{COMMIT_MARKER}"]
    assert [name for name, _ in asked].count("listdir") == 0, asked


def test_chunks_follow_policy_and_sharded_atoms_hold_inner_chunks(tmp_path):
    shape, itemsize = (1000, 300), 4
    policy = ChunkingPolicy(object_bytes=400_000, inner_bytes=100_000)
    chunk, inner = choose_chunks(shape, itemsize, policy)
    assert inner is not None and all(c % i == 0 for c, i in zip(chunk, inner))
    assert inner[0] * inner[1] * itemsize <= 100_000 and chunk[0] * chunk[1] * itemsize <= 400_000
    assert inner[1] == 300  # rows are cut, not columns
    assert choose_chunks((10,), 4, policy) == ((10,), None)
    assert choose_chunks((), 4, policy) == ((), None)
    assert choose_chunks((0, 5), 4, policy) == ((1, 5), None)

    t = torch.randn(shape)
    ucp.save({"w": t}, str(tmp_path), options=ucp.SaveOptions(chunking=policy, fsync=False))
    doc = json.loads((step_path(tmp_path) / "w" / "zarr.json").read_text())
    assert doc["codecs"][0]["name"] == "sharding_indexed"
    assert doc["codecs"][0]["configuration"]["codecs"][-1] == {"name": "crc32c"}
    objects = sorted(n for n in os.listdir(step_path(tmp_path) / "w") if n.startswith("c."))
    assert len(objects) == -(-shape[0] // chunk[0])
    assert torch.equal(ucp.load(str(tmp_path))["w"], t)


def test_each_save_describes_its_atoms_by_its_own_chunking_policy(tmp_path):
    """Atom descriptions are cached across saves of the same tensors (ucp.engine.checkpoint._described): a save with
    another chunking policy still gets its own description."""
    state = {"model": {"w": torch.randn(256, 128)}}
    ucp.save(state, str(tmp_path), step=1)
    ucp.save(state, str(tmp_path), step=2, options=SMALL_CHUNKS)
    ucp.save(state, str(tmp_path), step=3)
    chunks = {step: ucp.open_checkpoint(str(tmp_path), step).atoms["model/w"].chunk_shape for step in (1, 2, 3)}
    assert chunks[1] == chunks[3] == (256, 128) and chunks[2] != chunks[1]
    for step in (1, 2, 3):
        assert torch.equal(ucp.load(str(tmp_path), step=step)["model"]["w"], state["model"]["w"])


def test_shards_whose_inner_chunks_are_stored_in_another_order_still_read(tmp_path):
    """The sharding codec lets a writer place inner chunks anywhere its index says; ucp reads its own dense layout
    in one request, and must notice another layout by the index and read by it."""
    policy = ChunkingPolicy(object_bytes=400_000, inner_bytes=100_000)
    t = torch.randn(1000, 300)
    ucp.save({"w": t}, str(tmp_path), options=ucp.SaveOptions(chunking=policy, fsync=False))
    meta = ucp.open_checkpoint(str(tmp_path)).atoms["w"]
    path = step_path(tmp_path) / "w" / meta.chunk_key((0, 0))
    data = path.read_bytes()
    n = meta.inner_grid[0] * meta.inner_grid[1]
    head_len = n * 16 + 4 + n * 4  # index, its checksum, the inner chunks' checksums (which stay in grid order)
    entries = struct.unpack(f"<{2 * n}Q", data[: n * 16])
    pieces = [data[entries[2 * i] : entries[2 * i] + entries[2 * i + 1]] for i in range(n)]
    offsets, pos = [0] * n, head_len
    for i in reversed(range(n)):  # the same inner chunks, stored last to first
        offsets[i], pos = pos, pos + len(pieces[i])
    index = struct.pack(f"<{2 * n}Q", *(v for i in range(n) for v in (offsets[i], len(pieces[i]))))
    body = b"".join(pieces[i] for i in reversed(range(n)))
    table = data[n * 16 + 4 : head_len]
    reseal_object(tmp_path, "w", (0, 0), index + struct.pack("<I", crc32c.crc32c(index)) + table + body)
    assert torch.equal(ucp.load(str(tmp_path))["w"], t)
    assert verify(ucp.open_checkpoint(str(tmp_path))).ok


def test_every_plain_chunk_carries_a_crc32c(tmp_path):
    ucp.save(every_dtype_state(), str(tmp_path), options=SMALL_CHUNKS)
    reader = ucp.open_checkpoint(str(tmp_path))
    for meta in reader.atoms.values():
        codecs = meta.zarr_json()["codecs"]
        inner = codecs[0]["configuration"]["codecs"] if codecs[0]["name"] == "sharding_indexed" else codecs
        assert inner[-1] == {"name": "crc32c"}, meta.path


def test_manifest_round_trip():
    meta = AtomMeta("model/w", (4, 6), "bfloat16", (2, 6), (1, 6), {"role": "param"})
    assert AtomMeta.from_manifest("model/w", meta.to_manifest()) == meta
    assert meta.grid == (2, 1) and meta.inner_grid == (2, 1)


def test_roles_follow_top_level_keys(tmp_path):
    ucp.save(
        {
            "model": {"w": torch.ones(1)},
            "optimizer": {"state": {"w": {"exp_avg": torch.ones(1)}}},
            "rng": {"torch": torch.zeros(2, dtype=torch.uint8)},
            "other": torch.ones(1),
        },
        str(tmp_path),
    )
    roles = {m.path: m.attributes["role"] for m in ucp.open_checkpoint(str(tmp_path)).atoms.values()}
    assert roles == {
        "model/w": "param",
        "optimizer/state/w/exp_avg": "optimizer_state",
        "rng/torch": "rng",
        "other": "tensor",
    }


def test_step_directory_url_opens_that_step(tmp_path):
    ucp.save({"x": torch.ones(1)}, str(tmp_path), step=3)
    ucp.save({"x": torch.zeros(1)}, str(tmp_path), step=4)
    assert torch.equal(ucp.load(str(tmp_path / "step_00000003"))["x"], torch.ones(1))


@pytest.mark.parametrize("trial", range(4))
def test_shards_read_whole_land_in_place_and_every_inner_chunk_is_checked(tmp_path, monkeypatch, trial):
    """A shard wanted whole is read in one request and moved into place with one copy (ucp.protocol.codec._read_whole_shard):
    straight into the destination when its inner chunks are row bands of it, else (inner chunks that cut columns too,
    as a distributed save's are) through scratch memory. Random shapes, dtypes and inner grids of one to three
    dimensions, into whole tensors and into regions of larger ones; a damaged or swapped inner chunk is refused by
    name."""
    from ucp.engine.landing import Landing
    from ucp.errors import IntegrityError

    seed = random.randrange(2**32)
    rng = random.Random(seed)
    dtype = rng.choice([torch.float64, torch.float32, torch.bfloat16, torch.int16, torch.uint8, torch.bool])
    ndim = rng.randint(1, 3)
    inner = tuple(rng.randint(1, 6) for _ in range(ndim))
    per_shard = tuple(rng.randint(1, 3) for _ in range(ndim))
    chunk = tuple(i * g for i, g in zip(inner, per_shard))
    # at least one shard inside the array along every dimension, the last perhaps cut by the array's edge
    counts = [rng.randint(1, 3) for _ in chunk]
    shape = tuple(c * k - (rng.randrange(c) if k > 1 and rng.random() < 0.5 else 0) for c, k in zip(chunk, counts))
    monkeypatch.setattr("ucp.engine.checkpoint.choose_chunks", lambda *_, **__: (chunk, inner))
    t = (torch.rand(shape) > 0.5) if dtype == torch.bool else (torch.rand(shape) * 100).to(dtype)
    options = ucp.SaveOptions(fsync=False, chunking=ChunkingPolicy(pack_below=0))  # (shards, not a pack)
    ucp.save({"w": t}, str(tmp_path), options=options, atom_attributes={"w": {"case": seed}})  # (not the cached plan)
    reader = ucp.open_checkpoint(str(tmp_path))
    meta = reader.atoms["w"]
    whole = [i for i in chunk_indices(meta.grid) if all(b - a == c for (a, b), c in zip(meta.chunk_box(i), chunk))]
    case = f"seed {seed}: {dtype} {shape}, chunks {meta.chunk_shape}, inner {meta.inner_chunk_shape}"
    assert torch.equal(ucp.load(str(tmp_path))["w"], t), case

    # into a region of a larger tensor (not contiguous when the margin is in the last dimension)
    margin = tuple(rng.randint(0, 3) for _ in shape)
    out = torch.zeros(tuple(n + 2 * m for n, m in zip(shape, margin)), dtype=dtype)
    view = out[tuple(slice(m, m + n) for m, n in zip(margin, shape))]
    full = tuple((0, n) for n in shape)
    for index in chunk_indices(meta.grid):
        reader.read_region(meta, index, full, view)
    assert torch.equal(view, t), case
    assert torch.count_nonzero(out) == torch.count_nonzero(view), f"{case}: written outside its region"

    # the same through a Landing (the load path to a device), with host memory as the destination: each object read
    # and verified in a slot of its pool (room for about two), then copied into the region
    out.zero_()
    with Landing(2 * meta.object_bytes, pinned=False) as landing:
        for index in chunk_indices(meta.grid):
            reader.read_region(meta, index, full, view, landing)
    assert torch.equal(view, t), case
    assert torch.count_nonzero(out) == torch.count_nonzero(view), f"{case}: written outside its region"

    # a damaged inner chunk of a whole shard, and one swapped for another chunk's (its own checksum right)
    index = rng.choice(whole)
    path = step_path(tmp_path) / "w" / meta.chunk_key(index)
    data = bytearray(path.read_bytes())
    n = math.prod(meta.inner_grid)
    head, step = n * 16 + 4 + n * 4, meta.stored_chunk_bytes() + 4
    k = rng.randrange(n)
    flipped = bytearray(data)
    flipped[head + k * step + rng.randrange(step - 4)] ^= 0x10
    path.write_bytes(flipped)
    with pytest.raises(IntegrityError, match=f"'w' chunk {meta.chunk_key(index)} .*checksum mismatch"):  # ({case})
        ucp.load(str(tmp_path))
    if n > 1:
        other = (k + 1) % n
        swapped = bytearray(data)
        swapped[head + k * step : head + (k + 1) * step] = data[head + other * step : head + (other + 1) * step]
        path.write_bytes(swapped)
        if swapped != data:
            with pytest.raises(IntegrityError, match="not the one the commit recorded"):
                ucp.load(str(tmp_path))


@pytest.mark.parametrize("seed", range(4))
def test_inner_chunks_of_whole_rows_encode_as_any_inner_chunk_does(seed):
    """codec.encode takes inner chunks of whole rows from a contiguous chunk as byte ranges; its objects are
    byte for byte those of the general path (a tensor per inner chunk, taken here with a non-contiguous chunk)."""
    from ucp.base.boxes import to_slices
    from ucp.protocol import codec

    rng = random.Random(seed)
    fast = 0
    for _ in range(60):
        shape = tuple(rng.randint(1, 40) for _ in range(rng.randint(1, 3)))
        dtype = rng.choice([torch.float32, torch.bfloat16, torch.int8, torch.float64])
        itemsize = torch.empty(0, dtype=dtype).element_size()
        split = rng.choice([None, *range(len(shape))])
        periods = (
            None
            if split is None
            else [shape[d] // 2 if d == split and shape[d] % 2 == 0 else None for d in range(len(shape))]
        )
        policy = ChunkingPolicy(object_bytes=rng.randint(64, 4096), inner_bytes=rng.randint(8, 512))
        chunk_shape, inner = choose_chunks(shape, itemsize, policy, periods, split)
        if inner is None:
            continue
        meta = AtomMeta("w", shape, str(dtype).removeprefix("torch."), chunk_shape, inner, {})
        array = (torch.randn(shape) * 50).to(dtype)
        for index in chunk_indices(meta.grid):
            chunk = array[to_slices(meta.chunk_box(index))].contiguous()
            strided = torch.stack([chunk, chunk], -1)[..., 0]  # the same values, not contiguous
            assert not strided.is_contiguous()
            got, want = codec.encode(meta, index, chunk), codec.encode(meta, index, strided)
            assert got.sum == want.sum and b"".join(map(bytes, got.parts)) == b"".join(map(bytes, want.parts))
            fast += all(g == 1 for g in meta.inner_grid[1:]) and chunk.shape[1:] == inner[1:]
    assert fast  # (the byte-range path was taken)


def test_tensors_torch_calls_contiguous_whatever_their_strides_save_and_load(tmp_path):
    """One element (or none) taken by slicing keeps its source's strides (x[0:1, 0] has stride 3), and torch calls
    it contiguous: its bytes are still taken without a copy, and it loads back equal."""
    rng = random.Random()
    state = {}
    for i in range(24):
        dtype = rng.choice([torch.float32, torch.bfloat16, torch.int64, torch.float16, torch.uint8])
        base = (torch.randn(rng.randint(2, 5), rng.randint(2, 5), rng.randint(2, 5)) * 9).to(dtype)
        picks = [
            rng.choice([slice(j := rng.randrange(n), j + 1), rng.randrange(n), slice(0, 0), slice(None)])
            for n in base.shape
        ]
        state[f"t{i}"] = base[tuple(picks)]
    ucp.save(state, str(tmp_path), step=0, options=ucp.SaveOptions(fsync=False))
    got = ucp.load(str(tmp_path))
    for name, want in state.items():
        assert got[name].shape == want.shape and got[name].dtype == want.dtype and torch.equal(got[name], want), name
