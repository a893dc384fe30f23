"""The read plan (`ucp.distributed.read_plan`): deterministic frozen data, executed by `load_sharded` and projected by
`needed_objects`, which equals what a load reads, for random models, layouts and chunkings (packed and unpacked
atoms, casts, `into` tensors, fp8 weights dequantised); and the shard index (`ucp.protocol.codec.ShardIndex`): parsed, laid
out and encoded as one value, malformed heads refused."""

from __future__ import annotations

import dataclasses
import struct
import tempfile
import threading
from pathlib import Path
from typing import Any

import crc32c
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ucp
from ucp.base.boxes import to_slices
from ucp.distributed import ShardedModel, VirtualWorld, load_sharded, needed_objects, plan_reads
from ucp.errors import IntegrityError, StateError
from ucp.format.manifest import AtomMeta, chunk_indices
from ucp.protocol import codec
from ucp.sharding.families import DeepseekV3Config, MixtralConfig, block_scales, canonical_atoms
from ucp.sharding.layout import Layout, parse_layout
from ucp.sharding.quantization import SCALE_SUFFIX
from ucp.sharding.reshard import put_local, shard

from .helpers import DRAW, assert_same_state

STATES = ("exp_avg", "exp_avg_sq")
SETTINGS = settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def chunking(draw: st.DrawFn) -> ucp.ChunkingPolicy:
    """Every atom packed, none (objects of a few inner chunks: partial reads of shards), or some of each."""
    kind = draw(st.sampled_from(["packed", "unpacked", "mixed"]))
    if kind == "packed":
        return ucp.ChunkingPolicy()
    inner = draw(st.sampled_from([64, 256]))
    small = ucp.ChunkingPolicy(object_bytes=inner * draw(st.sampled_from([1, 4, 8])), inner_bytes=inner, pack_below=0)
    return small if kind == "unpacked" else dataclasses.replace(small, pack_below=draw(st.sampled_from([64, 256])))


def save(root: Path, config: Any, layout: Layout, states: tuple[str, ...], policy: ucp.ChunkingPolicy, full) -> str:
    url = str(root / "ckpt")
    local = [shard(full, config, layout, r, states) for r in range(layout.world_size)]
    options = ucp.SaveOptions(chunking=policy, fsync=False)
    VirtualWorld(layout.world_size).save(
        local, url, step=1, model=ShardedModel(config, layout, states), options=options
    )
    return url


def recording(reader: ucp.CheckpointReader) -> tuple[set, set]:
    """Record what a load through `reader` reads: the chunk objects (atom path, index) it reads and the storage keys
    whose bytes it reads."""
    objects: set[tuple[str, tuple[int, ...]]] = set()
    keys: set[str] = set()
    lock = threading.Lock()
    read_object, read_pack_regions, storage = reader.read_object, reader._read_pack_regions, reader.storage
    read, read_into = storage.read, storage.read_into

    def recorded_object(meta, index, dest_for):
        with lock:
            objects.add((meta.path, index))
        read_object(meta, index, dest_for)

    def recorded_pack_regions(pack, run):  # (the packed chunks of one pack that a load reads together)
        with lock:
            objects.update((r.meta.path, r.index) for r in run)
        read_pack_regions(pack, run)

    def recorded_read(key, *args, **kwargs):
        with lock:
            keys.add(key)
        return read(key, *args, **kwargs)

    def recorded_read_into(key, *args, **kwargs):
        with lock:
            keys.add(key)
        return read_into(key, *args, **kwargs)

    reader.read_object = recorded_object  # type: ignore[method-assign]
    reader._read_pack_regions = recorded_pack_regions  # type: ignore[method-assign]
    storage.read, storage.read_into = recorded_read, recorded_read_into  # type: ignore[method-assign]
    return objects, keys


def check_load(url: str, model: ShardedModel, rank: int, dtype: torch.dtype | None, into: dict | None) -> dict:
    """Load `rank`: its plan is the same every time it is made, frozen, and says exactly what the load reads (chunk
    objects, storage keys, bytes needed) as `needed_objects` does. Returns the local state."""
    reader = ucp.open_checkpoint(url)
    plan = plan_reads(reader.atoms, model, rank, dtype=dtype, into=into)
    assert plan == plan_reads(reader.atoms, model, rank, dtype=dtype, into=into)
    assert hash(plan) == hash(plan_reads(reader.atoms, model, rank, dtype=dtype, into=into))
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.tensors[0].items = ()  # type: ignore[misc]
    objects, keys = recording(reader)
    local, report = load_sharded(reader, model, rank, dtype=dtype, into=into)
    assert objects == plan.objects() == needed_objects(reader.atoms, model, rank, dtype=dtype, into=into)
    assert keys == {reader.read_key(reader.atoms[path], index) for path, index in plan.objects()}
    assert report.bytes_needed == plan.bytes_needed
    return local


@st.composite
def mixtral_case(draw):
    """A Mixtral of 4 layers, the degrees of two layouts drawn from what it takes, a chunking, and a load: in the
    stored dtype, cast, or into tensors of the caller's (some of them, of the stored dtype or another)."""
    kv = draw(st.sampled_from([1, 2, 4]))
    config = MixtralConfig(
        vocab_size=draw(st.integers(5, 40)),
        hidden_size=draw(st.integers(2, 6)),
        intermediate_size=4 * draw(st.integers(1, 3)),
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=kv,
        head_dim=2,
        num_local_experts=2 * draw(st.integers(1, 2)),
        tie_word_embeddings=draw(st.booleans()),
        make_vocab_size_divisible_by=draw(st.sampled_from([1, 4])),
    )

    def layout() -> Layout:
        ep = draw(st.sampled_from([1, 2]))
        return Layout(
            tp=draw(st.sampled_from([1, 2, 4])),
            pp=(pp := draw(st.sampled_from([1, 2]))),
            vpp=draw(st.sampled_from([1, 2])) if pp > 1 else 1,
            ep=ep,
            dp=ep * draw(st.sampled_from([1, 2])),
            zero=draw(st.sampled_from([0, 1, 2, 3])),
        )

    saved, loaded = layout(), layout()
    states = draw(st.sampled_from([STATES, ()]))
    ranks = sorted(draw(st.sets(st.integers(0, loaded.world_size - 1), min_size=1, max_size=2)))
    load = draw(st.sampled_from(["stored", "cast", "into"]))
    return config, saved, loaded, states, chunking(draw), ranks, load, draw(st.integers(0, 2**16))


@SETTINGS
@given(mixtral_case())
def test_needed_objects_are_what_a_load_reads(case):
    config, saved, loaded, states, policy, ranks, load, seed = case
    g = torch.Generator().manual_seed(seed)
    atoms = canonical_atoms(config)
    full = {"model": {n: torch.randn(s, generator=g) for n, (s, _) in atoms.items()}}
    if states:
        full["optimizer"] = {
            "state": {n: {s: torch.randn(shape, generator=g) for s in states} for n, (shape, _) in atoms.items()}
        }
    with tempfile.TemporaryDirectory() as tmp:
        url = save(Path(tmp), config, saved, states, policy, full)
        model = ShardedModel(config, loaded, states)
        for rank in ranks:
            expected = shard(full, config, loaded, rank, states)
            dtype, into = None, None
            if load == "cast":
                dtype = torch.bfloat16
            elif load == "into":  # every other tensor given, half of those in another dtype (cast into them)
                into = {}
                for i, (key, tensor) in enumerate(_leaves(expected)):
                    if i % 2 == 0:
                        put_local(into, key, torch.full_like(tensor, 7.0, dtype=torch.bfloat16 if i % 4 else None))
            local = check_load(url, model, rank, dtype, into)
            if into is None:  # (the values: the rank's state cut from the full one, cast where asked)
                if dtype is not None:
                    for key, tensor in _leaves(expected):
                        if key[0].startswith("model"):
                            put_local(expected, key, tensor.to(dtype))
                assert_same_state(expected, local)


def _leaves(tree: dict, prefix: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], torch.Tensor]]:
    out = []
    for k, v in tree.items():
        out += _leaves(v, (*prefix, k)) if isinstance(v, dict) else [((*prefix, k), v)]
    return out


# DeepSeek-V3 whose TP splits at TP 2 and 4 cut blocks of 8 or 16 (kv_lora_rank 40, intermediate 48, moe 24): a
# dequantised load reads scales that two ranks share.
DEEPSEEK = {
    "vocab_size": 64,
    "hidden_size": 40,
    "intermediate_size": 48,
    "moe_intermediate_size": 24,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "first_k_dense_replace": 1,
    "kv_lora_rank": 40,
    "qk_nope_head_dim": 8,
    "qk_rope_head_dim": 8,
    "v_head_dim": 8,
}


@st.composite
def fp8_case(draw):
    """An fp8 DeepSeek-V3 saved from one rank, and a load of it: dequantised by a model without scales (any TP), as
    stored, or as stored but some weights into tensors of another dtype (dequantised into them; TP 1: as stored, a
    split must fall on block edges)."""
    block = draw(st.sampled_from([[4, 4], [8, 4], [8, 8]]))
    config = DeepseekV3Config(**DEEPSEEK, q_lora_rank=draw(st.sampled_from([None, 32])), weight_block_size=block)
    load = draw(st.sampled_from(["dequantised", "stored", "into"]))
    tp = draw(st.sampled_from([1, 2, 4])) if load == "dequantised" else 1
    ep = draw(st.sampled_from([1, 2, 4]))
    layout = Layout(
        tp=tp,
        pp=draw(st.sampled_from([1, 3])),
        ep=ep,
        dp=ep * draw(st.sampled_from([1, 2])),
        zero=draw(st.sampled_from([0, 1, 3] if load == "dequantised" else [0, 1])),
    )
    rank = draw(st.integers(0, layout.world_size - 1))
    dtype = draw(st.sampled_from([None, torch.bfloat16, torch.float32])) if load == "dequantised" else None
    return config, layout, rank, load, dtype, chunking(draw), draw(st.integers(0, 2**16))


@SETTINGS
@given(fp8_case())
def test_needed_objects_are_what_an_fp8_load_reads(case):
    config, layout, rank, load, dtype, policy, seed = case
    g = torch.Generator().manual_seed(seed)
    scales = block_scales(config)
    full: dict[str, torch.Tensor] = {}
    for name, (shape, _) in canonical_atoms(config).items():
        if name in scales:
            full[name] = torch.randn(shape, generator=g).to(torch.float8_e4m3fn)
        elif name.endswith(SCALE_SUFFIX):
            full[name] = torch.rand(shape, generator=g) + 0.5
        else:
            full[name] = torch.randn(shape, generator=g)
    with tempfile.TemporaryDirectory() as tmp:
        url = save(Path(tmp), config, parse_layout("tp1"), (), policy, {"model": full})
        into = None
        if load == "dequantised":
            model = ShardedModel(dataclasses.replace(config, weight_block_size=None), layout, ())
        else:
            model = ShardedModel(config, layout, ())
        if load == "into":  # the rank's fp8 weights, every other one into a bf16 tensor: those are dequantised
            stored = shard({"model": full}, config, layout, rank, ())
            weights = [(key, t) for key, t in _leaves(stored) if t.dtype == torch.float8_e4m3fn]
            into = {}
            for key, tensor in weights[::2]:
                put_local(into, key, torch.zeros(tensor.shape, dtype=torch.bfloat16))
        reader = ucp.open_checkpoint(url)
        plan = plan_reads(reader.atoms, model, rank, dtype=dtype, into=into)
        dequantising = [item for t in plan.tensors for item in t.items if item.scales is not None]
        weights = [item for t in plan.tensors for item in t.items if item.atom.removeprefix("model/") in scales]
        assert bool(dequantising) == (load == "dequantised" and bool(weights) or bool(into))
        check_load(url, model, rank, dtype, into)


@pytest.mark.parametrize("states", [(), STATES])
def test_a_load_reads_the_chunks_it_wants_of_a_pack_in_one_request(tmp_path, states):
    """Each chunk of a packed atom is a read of its own in the plan; the load merges them: a rank of one layout
    loading from another reads each pack it needs in one request (with the optimizer state packed beside the
    weights, the load of the weights and the state reads each pack once too)."""
    config = MixtralConfig(
        vocab_size=24, hidden_size=4, intermediate_size=8, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=2, num_local_experts=2,
    )  # fmt: skip
    g = torch.Generator().manual_seed(DRAW.randrange(2**31))
    atoms = canonical_atoms(config)
    full: dict[str, Any] = {"model": {n: torch.randn(s, generator=g) for n, (s, _) in atoms.items()}}
    if states:
        full["optimizer"] = {
            "state": {n: {s: torch.randn(shape, generator=g) for s in states} for n, (shape, _) in atoms.items()}
        }
    url = save(tmp_path, config, parse_layout("tp2pp2"), states, ucp.ChunkingPolicy(), full)
    reader = ucp.open_checkpoint(url)
    requests: dict[str, int] = {}
    lock, read_into = threading.Lock(), reader.storage.read_into

    def counted(key, *args):
        with lock:
            requests[key] = requests.get(key, 0) + 1
        return read_into(key, *args)

    reader.storage.read_into = counted  # type: ignore[method-assign]
    target = parse_layout("tp1")
    local, _ = load_sharded(reader, ShardedModel(config, target, states), 0)
    assert_same_state(shard(full, config, target, 0, states), local)
    packs = {key: n for key, n in requests.items() if "ucp-packs/" in key}
    assert len(packs) == parse_layout("tp2pp2").world_size and set(packs.values()) == {1}, packs


def test_a_plan_made_for_other_tensors_is_refused_by_the_load(tmp_path):
    """A plan records the dtype of each `into` tensor it was made for: executed with tensors of another dtype (or
    none where it had one), the load is refused before it reads, naming the tensor."""
    from ucp.distributed.sharded_load import run_plan

    config = MixtralConfig(
        vocab_size=16, hidden_size=4, intermediate_size=8, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=2,
    )  # fmt: skip
    atoms = canonical_atoms(config)
    full = {"model": {n: torch.randn(s) for n, (s, _) in atoms.items()}}
    url = save(tmp_path, config, parse_layout("tp2"), (), ucp.ChunkingPolicy(), full)
    model = ShardedModel(config, parse_layout("tp1"), ())
    reader = ucp.open_checkpoint(url)
    key, tensor = _leaves(shard(full, config, model.layout, 0, ()))[0]
    into: dict = {}
    put_local(into, key, torch.zeros_like(tensor))
    plan = plan_reads(reader.atoms, model, 0, into=into)
    other: dict = {}
    put_local(other, key, torch.zeros_like(tensor, dtype=torch.bfloat16))
    for wrong in (other, None):
        with pytest.raises(StateError, match=f"cannot load into {'/'.join(key)}: the read plan was made for a"):
            run_plan(reader, plan, into=wrong)
    local, _ = run_plan(reader, plan, into=into)
    assert local[key[0]][key[1]] is into[key[0]][key[1]]


# ---- the shard index


def _sharded_meta(shape, chunk, inner, crc_table=True) -> AtomMeta:
    return AtomMeta("w", tuple(shape), "float32", tuple(chunk), tuple(inner), crc_table=crc_table)


@st.composite
def shard_case(draw):
    """An atom of 1-3 dimensions cut into shards of inner chunks (the edge ones partly outside the array), and one
    of its shards."""
    dims = draw(st.integers(1, 3))
    inner = [draw(st.integers(1, 3)) for _ in range(dims)]
    chunk = [i * draw(st.integers(1, 3)) for i in inner]
    shape = [draw(st.integers(1, 2 * c)) for c in chunk]
    meta = _sharded_meta(shape, chunk, inner)
    outer = draw(st.sampled_from(list(chunk_indices(meta.grid))))
    return meta, outer


@settings(max_examples=60, deadline=None)
@given(shard_case())
def test_the_shard_index_round_trips(case):
    """The index `encode` writes is `ShardIndex.laid_out` of the shard's inner chunks, its head the bytes at the
    object's start, and `parse` of them gives it back: inner chunks inside the array, back to back after the head
    (dense), each with its checksum; the others absent."""
    meta, outer = case
    values = torch.randn(meta.shape)
    encoded = codec.encode(meta, outer, values[to_slices(meta.chunk_box(outer))])
    data = b"".join(bytes(p) for p in encoded.parts)
    head = codec.head_nbytes(meta)
    index = codec.ShardIndex.parse(meta, outer, data[:head], "w", encoded.sum)
    assert b"".join(index.head()) == data[:head]
    assert encoded.sum == (len(data), crc32c.crc32c(data[:head]))
    boxes = codec._inner_boxes(meta, outer)
    present = [i for i, b in enumerate(boxes) if b is not None]
    assert [c.number for c in index.chunks] == present and index.count == len(boxes)
    assert index.is_dense() and index.by_offset() == list(index.chunks)
    by_number = {c.number: c for c in index.chunks}
    sums = [(by_number[i].nbytes, by_number[i].crc) if i in by_number else None for i in range(index.count)]
    assert codec.ShardIndex.laid_out(meta, sums) == index  # (offsets laid out from the sizes alone)
    for c in index.chunks:  # each inner chunk: its region of the array (padded at the edge), the table's checksum
        payload = data[c.offset : c.offset + c.nbytes - 4]
        assert struct.pack("<I", crc32c.crc32c(payload)) == c.crc == data[c.offset + c.nbytes - 4 : c.offset + c.nbytes]
        stored = torch.frombuffer(bytearray(payload), dtype=torch.float32).reshape(meta.inner_chunk_shape)
        box = boxes[c.number]
        assert box is not None
        assert torch.equal(stored[tuple(slice(0, b - a) for a, b in box)], values[to_slices(box)])
    # format 1.0: no table; the same entries, after its shorter head
    old = dataclasses.replace(meta, crc_table=False)
    table = head - codec.head_nbytes(old)
    v1 = codec.ShardIndex(
        index.count, tuple(c._replace(offset=c.offset - table, crc=None) for c in index.chunks), crc_table=False
    )
    assert codec.ShardIndex.parse(old, outer, b"".join(v1.head()), "w") == v1


def _head(meta: AtomMeta, entries: list[int], table: bytes | None = None) -> bytes:
    """A shard head with these index entries (its checksum right) and table (zeros by default)."""
    index = struct.pack(f"<{len(entries)}Q", *entries)
    n = len(entries) // 2
    return index + struct.pack("<I", crc32c.crc32c(index)) + (table if table is not None else bytes(4 * n))


def test_the_shard_index_refuses_malformed_heads():
    """A head that is short, whose index checksum fails, that is not the one the commit recorded, lacks an inner
    chunk inside the array, gives one another size or places it inside the head is refused naming the object; an
    entry of a chunk outside the array is not read. A valid index whose chunks are not in C order is not dense."""
    meta = _sharded_meta([3, 4], [4, 4], [2, 2])  # 4 inner chunks, the second row of them padded at the edge
    size = meta.stored_chunk_bytes() + 4
    head = codec.head_nbytes(meta)
    good = [head, size, head + size, size, head + 2 * size, size, head + 3 * size, size]
    parsed = codec.ShardIndex.parse(meta, (0, 0), _head(meta, good), "obj")
    assert parsed.is_dense() and [c.number for c in parsed.chunks] == [0, 1, 2, 3]
    empty = codec.EMPTY_INDEX_ENTRY
    bad = {
        "truncated shard": _head(meta, good)[:-1],
        r"\(shard index\): checksum mismatch": _head(meta, good)[:8] + b"\x01" + _head(meta, good)[9:],
        "inner chunk 1 is missing from the shard index": _head(meta, [*good[:2], empty, empty, *good[4:]]),
        r"inner chunk 2 has a bad index entry \(offset \d+, 5 bytes\)": _head(meta, [*good[:5], 5, *good[6:]]),
        r"inner chunk 0 has a bad index entry \(offset 8,": _head(meta, [8, size, *good[2:]]),
    }
    for message, data in bad.items():
        with pytest.raises(IntegrityError, match=f"^obj.*{message}"):
            codec.ShardIndex.parse(meta, (0, 0), data, "obj")
    with pytest.raises(IntegrityError, match="^obj: the object is not the one the commit recorded"):
        codec.ShardIndex.parse(meta, (0, 0), _head(meta, good), "obj", (head + 4 * size, 1234))
    swapped = [*good[2:4], *good[:2], *good[4:]]
    assert not codec.ShardIndex.parse(meta, (0, 0), _head(meta, swapped), "obj").is_dense()
    edge = _sharded_meta([2, 4], [4, 4], [2, 2])  # the second row of inner chunks lies outside the array
    edge_good = [head, size, head + size, size, empty, empty, 0, 7]  # (an entry outside the array is never read)
    index = codec.ShardIndex.parse(edge, (0, 0), _head(edge, edge_good), "obj")
    assert [c.number for c in index.chunks] == [0, 1] and index.is_dense()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_sharded_load_fills_parameters_that_require_grad_in_place(tmp_path, dtype):
    """A job's parameters (`nn.Parameter`, requiring grad; tied or cast where their dtype is not the checkpoint's)
    are filled as `load_state_dict` fills them, in place: torch refuses an in-place change of such a leaf unless it is
    detached (a raw RuntimeError after other tensors were filled, before)."""
    config = MixtralConfig(
        vocab_size=16, hidden_size=4, intermediate_size=8, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=2,
    )  # fmt: skip
    full = {"model": {n: torch.randn(s) for n, (s, _) in canonical_atoms(config).items()}}
    saved_from, load_as = DRAW.choice([("tp2", "tp1pp2dp2zero1"), ("tp1pp2", "tp2"), ("tp2pp2", "tp1")])
    url = save(tmp_path, config, parse_layout(saved_from), (), ucp.ChunkingPolicy(), full)
    model = ShardedModel(config, parse_layout(load_as), ())
    for rank in range(model.layout.world_size):
        expected = shard(full, config, model.layout, rank, ())
        into: dict = {}
        for key, tensor in _leaves(expected):
            put_local(into, key, torch.nn.Parameter(torch.zeros(tensor.shape, dtype=dtype)))
        pointers = {key: t.data_ptr() for key, t in _leaves(into)}
        local, _ = load_sharded(ucp.open_checkpoint(url), model, rank, into=into)
        for key, want in _leaves(expected):
            got = dict(_leaves(local))[key]
            assert isinstance(got, torch.nn.Parameter) and got.requires_grad and got.data_ptr() == pointers[key]
            assert torch.equal(got.detach(), want.to(dtype)), (saved_from, load_as, rank, key)
