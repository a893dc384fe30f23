"""Resharding: hand-checked local layouts, writer ownership, chunk writers, and shard/assemble round trips."""

from __future__ import annotations

import time
from collections import Counter

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ucp.base.boxes import box_numel, flat_range_boxes, intersect, is_contiguous, to_slices
from ucp.sharding.families import MixtralConfig, canonical_atoms
from ucp.sharding.layout import Layout, parse_layout
from ucp.sharding.reshard import (
    AtomOwners,
    assemble,
    atom_owners,
    chunk_write_plan,
    local_plan,
    owned_pieces,
    shard,
    write_grid,
)

from .helpers import tiny_config

STATES = ("exp_avg", "exp_avg_sq")


def config(**kw) -> MixtralConfig:
    shape = {"vocab_size": 10, "hidden_size": 3, "intermediate_size": 4, "head_dim": 2, "num_local_experts": 2}
    return tiny_config(**{**shape, "make_vocab_size_divisible_by": 4, **kw})


def full_state(cfg: MixtralConfig, seed: int = 0, states=STATES, arange: bool = False) -> dict:
    g = torch.Generator().manual_seed(seed)
    atoms = canonical_atoms(cfg)

    def make(shape, k):
        if arange:  # distinct, recognisable values: atom k's elements are k*1000 + position
            return (torch.arange(int(np.prod(shape)), dtype=torch.float32) + 1000 * k).reshape(shape)
        return torch.randn(shape, generator=g)

    model = {n: make(s, k) for k, (n, (s, _)) in enumerate(atoms.items())}
    out = {"model": model}
    if states:
        out["optimizer"] = {
            "state": {n: {s: torch.randn(shape, generator=g) for s in states} for n, (shape, _) in atoms.items()}
        }
    return out


def tree_equal(a, b) -> bool:
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(tree_equal(a[k], b[k]) for k in a)
    return a.dtype == b.dtype and torch.equal(a, b)


def round_trip(cfg, layout, full, states=STATES):
    locals_ = [shard(full, cfg, layout, r, states) for r in range(layout.world_size)]
    return locals_, assemble(locals_, cfg, layout)


# ---- hand-checked layouts


def test_boxes_flat_range_decomposition():
    shape = (3, 4, 5)
    boxes = flat_range_boxes(7, 53, shape)
    # partial row of row 0 (in 2-D recursion), full rows, partial last
    assert boxes[0] == ((0, 1), (1, 2), (2, 5))
    assert sum(box_numel(b) for b in boxes) == 46
    flat = np.arange(60).reshape(shape)
    got = np.concatenate([flat[to_slices(b)].reshape(-1) for b in boxes])
    assert np.array_equal(got, np.arange(7, 53))
    assert all(is_contiguous(b, shape) for b in boxes)


def test_fused_qkv_gqa_tp2():
    cfg = config()  # 4 heads, 2 kv heads, head_dim 2: 2 query heads per group
    full = full_state(cfg, arange=True)
    m = full["model"]
    q, k, v = (m[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv")
    layout = Layout(tp=2)
    for t in range(2):
        local = shard(full, cfg, layout, t)["model"]["decoder.layers.0.self_attention.linear_qkv.weight"]
        expected = torch.cat([q[4 * t : 4 * t + 4], k[2 * t : 2 * t + 2], v[2 * t : 2 * t + 2]])
        assert torch.equal(local, expected)
    # tp1: groups interleaved in the one local tensor
    local = shard(full, cfg, Layout(), 0)["model"]["decoder.layers.0.self_attention.linear_qkv.weight"]
    assert torch.equal(local, torch.cat([q[0:4], k[0:2], v[0:2], q[4:8], k[2:4], v[2:4]]))


@pytest.mark.parametrize("kv, tp", [(1, 2), (1, 4), (2, 4)])
def test_fused_qkv_with_fewer_kv_heads_than_tp_ranks_is_megatron_cores_row_split(kv, tp):
    """megatron-core (attention.py, num_query_groups < tp) keeps linear_qkv a ColumnParallelLinear over the global
    fused tensor [q heads of group 0; k0; v0; q heads of group 1; ...]: rank t holds its t-th run of rows, which may
    end inside a group or a head (checked against megatron-core itself in tests/test_megatron_kv_heads.py)."""
    cfg = config(num_key_value_heads=kv, head_dim=3 if tp == 2 else 2)
    full = full_state(cfg, arange=True)
    m = full["model"]
    q, k, v = (m[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv")
    hd, qh = cfg.head_dim, 4 // kv
    fused = torch.cat(
        [
            torch.cat([q[g * qh * hd : (g + 1) * qh * hd], k[g * hd : (g + 1) * hd], v[g * hd : (g + 1) * hd]])
            for g in range(kv)
        ]
    )
    layout = Layout(tp=tp)
    for t in range(tp):
        local = shard(full, cfg, layout, t)["model"]["decoder.layers.0.self_attention.linear_qkv.weight"]
        assert torch.equal(local, fused.chunk(tp)[t]), t
    _, back = round_trip(cfg, layout, full)
    assert tree_equal(back, full)


def test_gate_up_and_row_parallel_tp2():
    cfg = config()
    full = full_state(cfg, arange=True)
    m = full["model"]
    for t in range(2):
        local = shard(full, cfg, Layout(tp=2), t)["model"]
        pre = "decoder.layers.1.mlp.experts.local_experts.1."
        w1, w3, w2 = (m[f"model.layers.1.block_sparse_moe.experts.1.{w}.weight"] for w in ("w1", "w3", "w2"))
        assert torch.equal(local[pre + "linear_fc1.weight"], torch.cat([w1[2 * t : 2 * t + 2], w3[2 * t : 2 * t + 2]]))
        assert torch.equal(local[pre + "linear_fc2.weight"], w2[:, 2 * t : 2 * t + 2])
        o = m["model.layers.0.self_attn.o_proj.weight"]
        assert torch.equal(local["decoder.layers.0.self_attention.linear_proj.weight"], o[:, 4 * t : 4 * t + 4])
        assert torch.equal(
            local["decoder.layers.0.mlp.router.weight"], m["model.layers.0.block_sparse_moe.gate.weight"]
        )


def test_vocab_padding_zero_and_dropped():
    cfg = config()  # vocab 10, padded to a multiple of 4*T = 8 -> 16, 8 rows per rank
    layout = Layout(tp=2, zero=1, dp=2)
    full = full_state(cfg)
    emb = full["model"]["model.embed_tokens.weight"]
    local = shard(full, cfg, layout, 1)["model"]
    assert local["embedding.word_embeddings.weight"].shape == (8, 3)
    assert torch.equal(local["embedding.word_embeddings.weight"][:2], emb[8:10])
    assert not local["embedding.word_embeddings.weight"][2:].any()
    assert torch.equal(local["output_layer.weight"][:2], full["model"]["lm_head.weight"][8:10])
    locals_ = [shard(full, cfg, layout, r) for r in range(4)]
    for r in (1, 3):  # garbage in the padding rows must not reach the atoms
        locals_[r]["model"]["embedding.word_embeddings.weight"][2:] = 7.0
        locals_[r]["model"]["output_layer.weight"][2:] = 7.0
    assert tree_equal(assemble(locals_, cfg, layout), full)


def test_uneven_pp():
    cfg = config(num_hidden_layers=5, stage_layers=[3, 2])
    full = full_state(cfg, arange=True)
    layout = Layout(pp=2)
    first, last = (shard(full, cfg, layout, r)["model"] for r in (0, 1))
    assert {k.split(".")[2] for k in first if k.startswith("decoder.layers")} == {"0", "1", "2"}
    assert {k.split(".")[2] for k in last if k.startswith("decoder.layers")} == {"0", "1"}
    assert torch.equal(
        last["decoder.layers.1.input_layernorm.weight"], full["model"]["model.layers.4.input_layernorm.weight"]
    )
    assert "embedding.word_embeddings.weight" in first and "output_layer.weight" not in first
    assert "decoder.final_layernorm.weight" in last and "embedding.word_embeddings.weight" not in last
    _, back = round_trip(cfg, layout, full)
    assert tree_equal(back, full)


def test_virtual_pipeline_chunks():
    cfg = config(num_hidden_layers=4)
    full = full_state(cfg, arange=True)
    layout = Layout(pp=2, vpp=2)
    s0, s1 = (shard(full, cfg, layout, r) for r in (0, 1))
    assert set(s0) == {"model0", "model1", "optimizer"}
    # chunk c = v*P + p: stage 0 holds layers 0 (v0) and 2 (v1); stage 1 holds 1 and 3
    m = full["model"]
    for st_, v, layer in ((s0, 0, 0), (s0, 1, 2), (s1, 0, 1), (s1, 1, 3)):
        assert torch.equal(
            st_[f"model{v}"]["decoder.layers.0.pre_mlp_layernorm.weight"],
            m[f"model.layers.{layer}.post_attention_layernorm.weight"],
        )
    assert "embedding.word_embeddings.weight" in s0["model0"] and "embedding.word_embeddings.weight" not in s0["model1"]
    assert "output_layer.weight" in s1["model1"] and "output_layer.weight" not in s1["model0"]
    assert set(s0["optimizer"]["state"]) == {"model0", "model1"}
    _, back = round_trip(cfg, layout, full)
    assert tree_equal(back, full)


def test_expert_parallel_local_numbering():
    cfg = config(num_local_experts=4)
    full = full_state(cfg, arange=True)
    layout = parse_layout("tp1pp1ep2dp2")
    local = shard(full, cfg, layout, 1)["model"]  # dp 1 -> ep 1: experts 2, 3 as local 0, 1
    names = sorted(k for k in local if "local_experts" in k and "layers.0." in k)
    assert names == [
        f"decoder.layers.0.mlp.experts.local_experts.{e}.linear_fc{i}.weight" for e in (0, 1) for i in (1, 2)
    ]
    assert torch.equal(
        local["decoder.layers.0.mlp.experts.local_experts.1.linear_fc2.weight"],
        full["model"]["model.layers.0.block_sparse_moe.experts.3.w2.weight"],
    )


def test_tied_embeddings_pp2():
    cfg = config(tie_word_embeddings=True)
    assert "lm_head.weight" not in canonical_atoms(cfg)
    assert canonical_atoms(cfg)["model.embed_tokens.weight"][1].tied_to == ("lm_head.weight",)
    full = full_state(cfg)
    layout = Layout(pp=2, tp=2)
    for r in (2, 3):  # last stage: output layer is a copy of the embedding shard
        last = shard(full, cfg, layout, r)
        first = shard(full, cfg, layout, r - 2)
        assert torch.equal(last["model"]["output_layer.weight"], first["model"]["embedding.word_embeddings.weight"])
        assert torch.equal(
            last["optimizer"]["state"]["model"]["output_layer.weight"]["exp_avg"],
            first["optimizer"]["state"]["model"]["embedding.word_embeddings.weight"]["exp_avg"],
        )
        # the copy is never written
        assert not any(p.atom == "model.embed_tokens.weight" for lt in owned_pieces(cfg, layout, r) for p in lt.pieces)
    # pp1: no separate output layer at all
    assert "output_layer.weight" not in shard(full, cfg, Layout(), 0)["model"]
    locals_, _back = round_trip(cfg, layout, full)
    locals_[2]["model"]["output_layer.weight"].fill_(5.0)  # a drifted copy must not reach the atom
    assert tree_equal(assemble(locals_, cfg, layout), full)


@pytest.mark.parametrize("text", ["tp1pp1dp3zero1", "tp2pp2ep2dp2zero1", "tp2pp1vpp1ep2dp4zero3"])
def test_zero_flat_buffer_matches_contract(text):
    """The flat buffer is the concatenation, in local-state order, of the flattened local tensors (dense and
    expert apart), padded to a multiple of the group size; each member holds its contiguous slice."""
    cfg = config(num_hidden_layers=3 if "pp2" not in text else 2, vocab_size=11)
    layout = parse_layout(text)
    plain = Layout(tp=layout.tp, pp=layout.pp, vpp=layout.vpp, ep=layout.ep, dp=layout.dp)
    full = full_state(cfg)
    saw_partial_row = False
    for rank in range(layout.world_size):
        c = layout.coords(rank)
        ref = shard(full, cfg, plain, rank)
        got = shard(full, cfg, layout, rank)
        for group, members, index in (("dense", layout.dp, c.dp), ("expert", layout.expert_dp, c.expert_dp)):
            for state in (None,) + STATES:
                if state is None:
                    if layout.zero < 3:
                        continue
                    tensors = [
                        t for name, t in ref["model"].items() if ("local_experts" in name) == (group == "expert")
                    ]
                    buf = got["model_flat"][group]
                else:
                    tensors = [
                        d[state]
                        for name, d in ref["optimizer"]["state"]["model"].items()
                        if ("local_experts" in name) == (group == "expert")
                    ]
                    buf = got["optimizer"]["flat"][group][state]
                cat = torch.cat([t.reshape(-1) for t in tensors])
                per = -(-cat.numel() // members)
                cat = torch.cat([cat, torch.zeros(per * members - cat.numel())])
                assert torch.equal(buf, cat[index * per : (index + 1) * per])
        for lt in local_plan(cfg, layout, rank):
            for p in lt.pieces:
                if lt.flat and len(p.atom_box) == 2 and p.atom_box[0][1] - p.atom_box[0][0] == 1:
                    shape = canonical_atoms(cfg)[p.atom][0]
                    saw_partial_row |= p.atom_box[1] != (0, shape[1])
    assert saw_partial_row  # some boundary falls inside a row
    _, back = round_trip(cfg, layout, full)
    assert tree_equal(back, full)


# ---- writers


def ownership_counts(cfg, layout, states=STATES):
    counts = {
        (a, s): np.zeros(shape, dtype=np.int64)
        for a, (shape, _) in canonical_atoms(cfg).items()
        for s in (None,) + states
    }
    writers = Counter()
    for rank in range(layout.world_size):
        for lt in owned_pieces(cfg, layout, rank, states):
            for p in lt.pieces:
                counts[(p.atom, lt.state)][to_slices(p.atom_box)] += 1
                writers[rank] += p.numel
    return counts, writers


@pytest.mark.parametrize(
    "text", ["tp2pp2dp2", "tp2pp2vpp2ep2dp2zero1", "tp2pp1ep2dp4zero3", "tp1pp3dp3zero2", "tp2pp2ep2dp4"]
)
def test_every_element_has_exactly_one_writer(text):
    cfg = config(num_hidden_layers=4 if "pp3" not in text else 3, num_local_experts=4, tie_word_embeddings=True)
    layout = parse_layout(text)
    counts, writers = ownership_counts(cfg, layout)
    for key, c in counts.items():
        assert (c == 1).all(), f"{key}: counts {np.unique(c)}"
    # replicated work is spread: every rank writes something
    assert set(writers) == set(range(layout.world_size))
    for (atom, state), c in counts.items():
        owners = atom_owners(cfg, layout, atom, state)
        seen = np.zeros_like(c)
        for _, box in owners:
            seen[to_slices(box)] += 1
        assert (seen == 1).all()


def test_atom_owners_agree_with_owned_pieces():
    cfg = config(num_local_experts=4)
    layout = parse_layout("tp2pp2ep2dp2zero1")
    from_ranks = {}
    for rank in range(layout.world_size):
        for lt in owned_pieces(cfg, layout, rank):
            for p in lt.pieces:
                from_ranks.setdefault((p.atom, lt.state), set()).add((rank, p.atom_box))
    for (atom, state), pairs in from_ranks.items():
        assert set(atom_owners(cfg, layout, atom, state)) == pairs


def test_write_grid():
    cfg = config()
    grid = write_grid(cfg, Layout(tp=2, dp=2), "model.layers.0.self_attn.o_proj.weight")
    assert grid == ((0, 3), (0, 4, 8))
    grid = write_grid(cfg, Layout(tp=2, dp=2), "model.layers.0.self_attn.q_proj.weight")
    assert grid == ((0, 4, 8), (0, 3))


@pytest.mark.parametrize("text", ["tp2pp2ep2dp2zero1", "tp1pp1dp3zero3", "tp2pp1dp2"])
def test_chunk_write_plan_is_consistent(text):
    cfg = config(hidden_size=5, intermediate_size=6, num_local_experts=4)
    layout = parse_layout(text)
    atoms = canonical_atoms(cfg)

    def chunk_shape(atom, state):
        return tuple(min(3, n) for n in atoms[atom][0])

    plans = [chunk_write_plan(cfg, layout, r, chunk_shape) for r in range(layout.world_size)]
    written = Counter()
    for r, plan in enumerate(plans):
        for atom, state, chunk in plan.writes:
            written[(atom, state, chunk)] += 1
    for atom, (shape, _) in atoms.items():
        for state in (None,) + STATES:
            grid = np.zeros(shape, dtype=np.int64)
            for (a, s, chunk), n in written.items():
                if (a, s) == (atom, state):
                    grid[to_slices(chunk)] += n
            assert (grid == 1).all(), (atom, state)
    sends = Counter((r, t.peer, t.atom, t.state, t.atom_box) for r, p in enumerate(plans) for t in p.sends)
    recvs = Counter((t.peer, r, t.atom, t.state, t.atom_box) for r, p in enumerate(plans) for t in p.recvs)
    assert sends == recvs
    if "zero" in text:
        assert sends  # flat ranges cut chunks: fragments move


# ---- performance: one rank's plan does not scale with the world


def test_plan_of_one_rank_at_scale():
    cfg = MixtralConfig(
        vocab_size=32000,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        num_local_experts=8,
    )
    layout = parse_layout("tp8pp16ep8dp128zero1")
    assert layout.world_size == 16384
    rank = layout.rank(tp=3, dp=77, pp=15)
    t0 = time.perf_counter()
    plan = local_plan(cfg, layout, rank)
    owned = owned_pieces(cfg, layout, rank)
    elapsed = time.perf_counter() - t0
    keys = {lt.key for lt in plan}
    assert ("model", "decoder.layers.1.mlp.experts.local_experts.0.linear_fc1.weight") in keys
    assert ("model", "decoder.layers.2.input_layernorm.weight") not in keys  # 2 layers per stage
    assert ("model", "output_layer.weight") in keys
    fc2 = next(lt for lt in plan if lt.key[-1] == "decoder.layers.1.mlp.experts.local_experts.0.linear_fc2.weight")
    # ep rank 77 % 8 = 5 -> expert 5; tp 3 of 8 -> columns 3*1792..4*1792
    assert fc2.pieces[0].atom == "model.layers.31.block_sparse_moe.experts.5.w2.weight"
    assert fc2.pieces[0].atom_box == ((0, 4096), (5376, 7168))
    assert {lt.key for lt in owned} <= keys
    assert not any(p.tied_copy for lt in owned for p in lt.pieces)
    flat = {lt.key: lt for lt in plan if lt.flat}
    assert set(flat) == {("optimizer", "flat", g, s) for g in ("dense", "expert") for s in STATES}
    dense = flat[("optimizer", "flat", "dense", "exp_avg")]
    assert sum(p.numel for p in dense.pieces) <= dense.shape[0]
    assert elapsed < 5.0
    big = parse_layout("tp8pp16ep8dp800zero1")  # 102,400 ranks
    t0 = time.perf_counter()
    assert local_plan(cfg, big, big.world_size - 1)
    assert time.perf_counter() - t0 < 5.0


# ---- property: assemble(shard(x)) == x for any layout


@st.composite
def model_and_layout(draw):
    tp = draw(st.sampled_from([1, 2, 4]))
    # KV heads a multiple of TP, or fewer than TP ranks (a divisor of it: ranks share a query group)
    kv = draw(st.sampled_from([tp, 2 * tp] + [d for d in (1, 2) if d < tp]))
    heads = max(kv, tp) * draw(st.integers(1, 2))
    # the fused QKV's rows, kv * (heads/kv + 2) * head_dim, split evenly over TP
    head_dim = draw(st.integers(1, 3).filter(lambda hd: (2 * kv * hd) % tp == 0))
    ep = draw(st.sampled_from([1, 2]))
    experts = ep * draw(st.integers(1, 2))
    dp = ep * draw(st.integers(1, 2))
    pp = draw(st.integers(1, 3))
    vpp = draw(st.integers(1, 2)) if pp > 1 else 1
    chunks = pp * vpp
    layers = chunks + draw(st.integers(0, 2))
    stage_layers = None
    if layers % chunks or draw(st.booleans()):
        extra = draw(st.lists(st.integers(0, chunks - 1), min_size=layers - chunks, max_size=layers - chunks))
        stage_layers = [1 + extra.count(c) for c in range(chunks)]
    cfg = MixtralConfig(
        vocab_size=draw(st.integers(3, 20)),
        hidden_size=draw(st.integers(1, 4)),
        intermediate_size=tp * draw(st.integers(1, 3)),
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=head_dim,
        num_local_experts=experts,
        tie_word_embeddings=draw(st.booleans()),
        make_vocab_size_divisible_by=draw(st.sampled_from([1, 2, 4])),
        stage_layers=stage_layers,
    )
    layout = Layout(tp=tp, pp=pp, vpp=vpp, ep=ep, dp=dp, zero=draw(st.sampled_from([0, 1, 2, 3])))
    return cfg, layout, draw(st.integers(0, 2**16))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(model_and_layout())
def test_round_trip_property(case):
    cfg, layout, seed = case
    full = full_state(cfg, seed)
    _, back = round_trip(cfg, layout, full)
    assert tree_equal(back, full)
    counts, _ = ownership_counts(cfg, layout)
    assert all((c == 1).all() for c in counts.values())


def test_round_trip_without_optimizer_and_bf16():
    cfg = config()
    full = full_state(cfg, states=())
    full["model"] = {k: v.to(torch.bfloat16) for k, v in full["model"].items()}
    layout = parse_layout("tp2pp2dp2zero3")
    locals_ = [shard(full, cfg, layout, r) for r in range(layout.world_size)]
    assert "optimizer" not in locals_[0]
    assert locals_[0]["model_flat"]["dense"].dtype == torch.bfloat16
    assert tree_equal(assemble(locals_, cfg, layout), full)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(1, 4), min_size=1, max_size=4), st.data())
def test_flat_range_boxes_property(shape, data):
    n = int(np.prod(shape))
    start = data.draw(st.integers(0, n))
    stop = data.draw(st.integers(start, n))
    boxes = flat_range_boxes(start, stop, tuple(shape))
    flat = np.arange(n).reshape(shape)
    got = np.concatenate([flat[to_slices(b)].reshape(-1) for b in boxes]) if boxes else np.zeros(0, dtype=int)
    assert np.array_equal(got, np.arange(start, stop))
    assert all(is_contiguous(b, tuple(shape)) for b in boxes)
    assert len(boxes) <= 2 * len(shape) - 1


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(model_and_layout(), st.integers(1, 5))
def test_chunk_write_plan_property(case, edge):
    """Every chunk is written exactly once, and every fragment sent is received by the chunk's writer."""
    cfg, layout, _ = case

    def chunk_shape(atom, state):
        return tuple(min(edge, n) for n in canonical_atoms(cfg)[atom][0])

    plans = [chunk_write_plan(cfg, layout, r, chunk_shape) for r in range(layout.world_size)]
    writes = Counter(w for p in plans for w in p.writes)
    assert all(n == 1 for n in writes.values())
    expected = sum(
        int(np.prod([-(-n // min(edge, n)) for n in shape])) * (1 + len(STATES))
        for shape, _ in canonical_atoms(cfg).values()
    )
    assert len(writes) == expected
    sends = Counter((r, t.peer, t.atom, t.state, t.atom_box) for r, p in enumerate(plans) for t in p.sends)
    recvs = Counter((t.peer, r, t.atom, t.state, t.atom_box) for r, p in enumerate(plans) for t in p.recvs)
    assert sends == recvs


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(model_and_layout(), st.data())
def test_the_writers_of_a_region_are_those_of_the_atom_that_cross_it(case, data):
    """`AtomOwners.within(box)` finds a region's writers from its flat extent (ZeRO) instead of listing the atom's:
    the same pairs as the whole atom's owners that overlap the region, for regions of any shape and place."""
    cfg, layout, _ = case
    atoms = canonical_atoms(cfg)
    atom = data.draw(st.sampled_from(sorted(atoms)))
    state = data.draw(st.sampled_from([None, *STATES]))
    shape = atoms[atom][0]
    box = []
    for n in shape:
        a = data.draw(st.integers(0, n - 1))
        box.append((a, data.draw(st.integers(a + 1, n))))
    box = tuple(box)
    owners = AtomOwners(cfg, layout, atom, state)
    whole = atom_owners(cfg, layout, atom, state)
    assert owners.within() == whole
    assert sorted(owners.within(box)) == sorted(o for o in whole if intersect(o[1], box) is not None)
