"""Optimizer states of another dtype than their parameters (bf16 weights, fp32 Adam moments and master weights):
each state is chunked for its own bytes, so its grid can be finer than its parameter's, and a distributed save must
still write every chunk the manifest names, once, and load back bitwise in another layout.

Which dtypes, layouts and chunk sizes each case takes is drawn at collection (helpers.DRAW, UCP_TEST_SEED)."""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest
import torch

import ucp
from ucp.base.chunking import ChunkingPolicy
from ucp.distributed import ShardedModel, VirtualWorld, load_sharded
from ucp.distributed.sharded_model import atom_metas
from ucp.engine.checkpoint import SaveOptions
from ucp.format.manifest import chunk_indices
from ucp.sharding.families import MixtralConfig, canonical_atoms
from ucp.sharding.layout import parse_layout
from ucp.sharding.reshard import chunk_write_plan, shard

from .dist_worker import same
from .helpers import DRAW

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
STATES = ("exp_avg", "exp_avg_sq", "master")

CONFIG = MixtralConfig(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_local_experts=4,
)
# Odd sizes: ZeRO's pieces and the fragments sent between ranks of an odd number of elements (a bf16 fragment then
# leaves the fp32 one after it misaligned in the peer's buffer, unless each is aligned).
ODD = dataclasses.replace(CONFIG, vocab_size=101, hidden_size=36, intermediate_size=20, head_dim=None)  # (derived)


def full_state(
    param_dtype: torch.dtype, state_dtypes: dict[str, torch.dtype], seed: int, config: MixtralConfig = CONFIG
) -> dict:
    g = torch.Generator().manual_seed(seed)
    atoms = canonical_atoms(config)
    return {
        "model": {n: torch.randn(s, generator=g).to(param_dtype) for n, (s, _) in atoms.items()},
        "optimizer": {
            "state": {
                n: {st: torch.randn(s, generator=g).to(dt) for st, dt in state_dtypes.items()}
                for n, (s, _) in atoms.items()
            }
        },
    }


def save_and_check(
    tmp_path, full: dict, states: tuple[str, ...], saved_in: str, load_in: str, policy, config: MixtralConfig = CONFIG
) -> None:
    """Save `full` from every rank of `saved_in`, check that every chunk the manifest names was written exactly once
    (by the plans) and is on storage, and that every rank of `load_in` reads its share bitwise."""
    source, target = parse_layout(saved_in), parse_layout(load_in)
    model = ShardedModel(config, source, states)
    url = str(tmp_path / "ckpt")
    locals_ = [shard(full, config, source, r, states) for r in range(source.world_size)]
    VirtualWorld(source.world_size).save(locals_, url, step=1, model=model, options=SaveOptions(chunking=policy))
    reader = ucp.open_checkpoint(url)
    # every chunk the manifest names is on storage: its object is readable and its checksum holds
    for meta in reader.atoms.values():
        for index in chunk_indices(meta.grid):
            assert reader.storage.exists(reader.object_key(meta, index)), (meta.path, index)
    for rank in range(target.world_size):
        local, _ = load_sharded(reader, ShardedModel(config, target, states), rank)
        assert same(local, shard(full, config, target, rank, states)), (saved_in, load_in, rank)


def test_bf16_parameters_with_fp32_states_whose_grid_is_finer_commit_and_load(tmp_path):
    """The case found at scale, small: the fp32 embedding and LM head parts of a TP rank pass `object_bytes` where
    their bf16 parameters' do not, so the states have more chunks than the parameters."""
    policy = ChunkingPolicy(object_bytes=16384, inner_bytes=4096, pack_below=0)
    states = ("exp_avg", "exp_avg_sq")
    full = full_state(torch.bfloat16, dict.fromkeys(states, torch.float32), seed=0)
    source = parse_layout("tp2pp1")
    metas = atom_metas(
        ShardedModel(CONFIG, source, states), {None: "bfloat16", **dict.fromkeys(states, "float32")}, policy
    )
    embed = "model.embed_tokens.weight"
    assert metas[(embed, "exp_avg")].grid != metas[(embed, None)].grid  # (what the case is about)
    save_and_check(tmp_path, full, states, "tp2pp1", "tp1pp1", policy)


def test_zero3_fragments_of_odd_sizes_and_mixed_dtypes_travel_aligned(tmp_path):
    """bf16 parameters, fp32 states, ZeRO-3 over 4 ranks of a model of odd sizes: a peer's buffer held a bf16 fragment
    of an odd number of elements before an fp32 one, which the receiver could not view as fp32 (the save failed)."""
    states = ("exp_avg", "exp_avg_sq")
    full = full_state(torch.bfloat16, dict.fromkeys(states, torch.float32), seed=0, config=ODD)
    save_and_check(tmp_path, full, states, "tp1pp1dp4zero3", "tp2pp1", ChunkingPolicy(), ODD)


def test_chunk_write_plan_writes_each_states_own_grid_once():
    """Over the world, every chunk of every state's own grid has one writer, and every fragment sent is received."""
    layout = parse_layout("tp2pp2dp2zero1")
    atoms = canonical_atoms(CONFIG)
    edges = {None: 8, "exp_avg": 3, "exp_avg_sq": 5}

    def chunk_shape(atom, state):
        return tuple(min(edges[state], n) for n in atoms[atom][0])

    plans = [chunk_write_plan(CONFIG, layout, r, chunk_shape, ("exp_avg", "exp_avg_sq")) for r in range(8)]
    writes = Counter(w for p in plans for w in p.writes)
    assert set(writes.values()) == {1}
    for state, edge in edges.items():
        expected = sum(
            torch.tensor([-(-n // min(edge, n)) for n in shape]).prod().item() for shape, _ in atoms.values()
        )
        assert sum(1 for _, s, _ in writes if s == state) == expected, state
    sends = Counter((r, t.peer, t.atom, t.state, t.atom_box) for r, p in enumerate(plans) for t in p.sends)
    recvs = Counter((t.peer, r, t.atom, t.state, t.atom_box) for r, p in enumerate(plans) for t in p.recvs)
    assert sends == recvs


SAVE_LAYOUTS = (
    "tp2pp1",
    "tp2pp2",
    "tp1pp1dp2zero1",
    "tp2pp1dp2zero1",
    "tp2pp1ep2dp2",
    "tp1pp2dp2zero3",
    "tp1pp1dp4zero3",
    "tp2pp1dp3zero3",
)
LOAD_LAYOUTS = ("tp1pp1", "tp4pp1", "tp1pp2dp2zero1", "tp2pp1ep2dp2zero1")


def draw_case(param_dtype: torch.dtype) -> tuple:
    """(state dtypes, save layout, load layout, chunking, seed, model): each state's dtype drawn on its own, chunk sizes from a
    few hundred bytes (many chunks, finer than some TP parts) to larger than any atom (one chunk each)."""
    state_dtypes = {s: DRAW.choice(DTYPES) for s in STATES}
    inner = DRAW.choice([256, 512, 1024, 4096])
    policy = ChunkingPolicy(
        object_bytes=inner * DRAW.choice([1, 2, 4, 16, 1024]),
        inner_bytes=inner,
        pack_below=DRAW.choice([0, 0, 2048, 1 << 20]),
        pack_bytes=DRAW.choice([4096, 1 << 20]),
    )
    config = DRAW.choice([CONFIG, ODD])
    return state_dtypes, DRAW.choice(SAVE_LAYOUTS), DRAW.choice(LOAD_LAYOUTS), policy, DRAW.randrange(1 << 30), config


@pytest.mark.parametrize(
    "param_dtype,case",
    [(p, draw_case(p)) for p in DTYPES for _ in range(2)],
    ids=lambda v: str(v).removeprefix("torch.") if isinstance(v, torch.dtype) else "",
)
def test_any_parameter_and_state_dtypes_against_random_chunk_sizes(tmp_path, param_dtype, case):
    state_dtypes, saved_in, load_in, policy, seed, config = case
    full = full_state(param_dtype, state_dtypes, seed, config)
    save_and_check(tmp_path, full, STATES, saved_in, load_in, policy, config)
