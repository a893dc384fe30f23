"""Layouts: parsing, Megatron rank order, process groups, validation against a model."""

from __future__ import annotations

import pytest

from ucp.errors import LayoutError, UcpError
from ucp.sharding.families import MixtralConfig
from ucp.sharding.layout import Layout, RankCoords, chunk_layer_counts, parse_layout, validate_for_model
from ucp.sharding.partition import PartitionSpec, padded_rows, tp_shard

from .helpers import tiny_config


def small_config(**kw) -> MixtralConfig:
    return tiny_config(
        **{"intermediate_size": 48, "num_hidden_layers": 8, "num_attention_heads": 8, "num_key_value_heads": 4, **kw}
    )


@pytest.mark.parametrize(
    "text, expected",
    [
        ("tp8pp4", Layout(tp=8, pp=4)),
        ("tp4pp8", Layout(tp=4, pp=8)),
        ("tp2pp2ep4dp4zero1", Layout(tp=2, pp=2, ep=4, dp=4, zero=1)),
        ("tp1pp4vpp2dp2", Layout(pp=4, vpp=2, dp=2)),
        ("tp2pp1dp8zero3", Layout(tp=2, dp=8, zero=3)),
        ("TP2PP2", Layout(tp=2, pp=2)),
        ("dp4", Layout(dp=4)),
    ],
)
def test_parse_good(text, expected):
    layout = parse_layout(text)
    assert layout == expected
    assert parse_layout(str(layout)) == layout


def test_canonical_string():
    assert str(Layout(tp=2, pp=2, ep=4, dp=4, zero=1)) == "tp2pp2ep4dp4zero1"
    assert str(Layout(tp=8, pp=4)) == "tp8pp4"
    assert str(Layout()) == "tp1pp1"
    assert str(Layout(pp=2, vpp=3)) == "tp1pp2vpp3"


def test_world_size_inference_and_mismatch():
    assert parse_layout("tp8pp4", world_size=64) == Layout(tp=8, pp=4, dp=2)
    assert parse_layout("tp2pp2dp2", world_size=8).world_size == 8
    with pytest.raises(LayoutError, match=r"world size tp\*pp\*dp = 8.*world size is 16"):
        parse_layout("tp2pp2dp2", world_size=16)
    with pytest.raises(LayoutError, match="not a multiple of tp\\*pp = 32"):
        parse_layout("tp8pp4", world_size=48)


@pytest.mark.parametrize(
    "text, message",
    [
        ("tp8xpp4", "malformed layout 'tp8xpp4': expected tp{T}pp{P}"),
        ("pp4tp8", "malformed layout 'pp4tp8'"),
        ("", "malformed layout ''"),
        ("tp-1pp2", "malformed layout"),
        ("tp2pp2zero", "malformed layout"),
        ("tp0pp2", "degree tp0 must be at least 1"),
        ("tp2pp2dp0", "degree dp0 must be at least 1"),
        ("tp2pp2dp4ep2", "malformed layout"),  # order matters: ep before dp
        ("tp2pp2ep3dp4", "ep=3 must divide dp=4"),
        ("tp2pp2dp4zero4", "zero=4 must be 0, 1, 2 or 3"),
        ("tp2pp1vpp2", "vpp=2 needs pp > 1"),
    ],
)
def test_parse_bad(text, message):
    with pytest.raises(LayoutError, match=message.replace("{", r"\{").replace("}", r"\}").replace("*", r"\*")):
        parse_layout(text)


def test_layout_error_is_ucp_error():
    assert issubclass(LayoutError, UcpError)
    with pytest.raises(UcpError):
        Layout(tp=0)


def test_megatron_rank_order_exact():
    layout = parse_layout("tp2pp2ep2dp2")
    # rank = tp + T * (dp + D * pp)
    expected = {
        0: (0, 0, 0),
        1: (1, 0, 0),
        2: (0, 1, 0),
        3: (1, 1, 0),
        4: (0, 0, 1),
        5: (1, 0, 1),
        6: (0, 1, 1),
        7: (1, 1, 1),
    }
    for rank, (tp, dp, pp) in expected.items():
        c = layout.coords(rank)
        assert (c.tp, c.dp, c.pp) == (tp, dp, pp)
        assert (c.ep, c.expert_dp) == (dp % 2, dp // 2)
        assert layout.rank(tp=tp, dp=dp, pp=pp) == rank


def test_coords_round_trip_and_ep():
    layout = parse_layout("tp2pp3ep2dp4")
    assert layout.world_size == 24
    seen = set()
    for rank in range(layout.world_size):
        c = layout.coords(rank)
        assert layout.rank(tp=c.tp, dp=c.dp, pp=c.pp) == rank
        assert c == RankCoords(tp=c.tp, dp=c.dp, pp=c.pp, ep=c.dp % 2, expert_dp=c.dp // 2)
        seen.add((c.tp, c.dp, c.pp))
    assert len(seen) == 24
    with pytest.raises(LayoutError, match="rank 24 is outside"):
        layout.coords(24)
    with pytest.raises(LayoutError, match="tp rank 2 is outside"):
        layout.rank(tp=2)


def test_groups():
    layout = parse_layout("tp2pp2ep2dp4")
    assert layout.tp_group(5) == [4, 5]
    assert layout.dp_group(1) == [1, 3, 5, 7]
    assert layout.pp_group(3) == [3, 11]
    # rank 3: tp1 dp1 pp0 -> ep1, expert_dp0
    assert layout.ep_group(3) == [1, 3]
    assert layout.expert_dp_group(3) == [3, 7]
    for rank in range(layout.world_size):
        for group in (layout.tp_group, layout.dp_group, layout.pp_group, layout.ep_group, layout.expert_dp_group):
            assert rank in group(rank)


def test_validate_for_model():
    validate_for_model(parse_layout("tp4pp2ep4dp4"), small_config())
    with pytest.raises(LayoutError, match="tp=3 does not divide num_attention_heads=8"):
        validate_for_model(Layout(tp=3), small_config())
    validate_for_model(Layout(tp=8), small_config())  # (fewer KV heads than TP ranks: they share query groups)
    with pytest.raises(LayoutError, match="tp=6 neither divides nor is a multiple of num_key_value_heads=4"):
        validate_for_model(Layout(tp=6), small_config(num_attention_heads=12, head_dim=8))
    with pytest.raises(LayoutError, match="tp=4 does not divide intermediate_size=50"):
        validate_for_model(Layout(tp=4), small_config(intermediate_size=50))
    with pytest.raises(LayoutError, match="ep=8 does not divide num_local_experts=4"):
        validate_for_model(Layout(ep=8, dp=8), small_config())
    with pytest.raises(LayoutError, match="16 model chunks but the model has only 8 layers"):
        validate_for_model(Layout(pp=8, vpp=2), small_config())
    with pytest.raises(LayoutError, match="8 layers do not split evenly over pp\\*vpp = 3.*stage_layers"):
        validate_for_model(Layout(pp=3), small_config())
    validate_for_model(Layout(pp=3), small_config(stage_layers=[3, 3, 2]))
    with pytest.raises(LayoutError, match="sum to 7, but the model has 8 layers"):
        validate_for_model(Layout(pp=3), small_config(stage_layers=[3, 2, 2]))
    with pytest.raises(LayoutError, match="has 2 entries but layout tp1pp3 has pp\\*vpp = 3"):
        validate_for_model(Layout(pp=3), small_config(stage_layers=[4, 4]))


def test_chunk_layer_counts():
    assert chunk_layer_counts(Layout(pp=2, vpp=2), 8) == [2, 2, 2, 2]
    assert chunk_layer_counts(Layout(pp=2), 5, [3, 2]) == [3, 2]
    with pytest.raises(LayoutError, match="at least one layer"):
        chunk_layer_counts(Layout(pp=2), 5, [5, 0])


# ---- partition specs


def test_partition_spec_json_round_trip():
    specs = [
        PartitionSpec(),
        PartitionSpec("split", split_dim=1, layer=3),
        PartitionSpec("vocab", pad_to_multiple_of=128, unpadded=32000, tied_to=("lm_head.weight",)),
        PartitionSpec("fused_qkv", part="k", num_heads=32, num_kv_heads=8, head_dim=128, layer=0),
        PartitionSpec("fused_gate_up", part="up", layer=5, expert=7, zero_group="expert"),
    ]
    import json

    for spec in specs:
        d = json.loads(json.dumps(spec.to_json()))
        assert PartitionSpec.from_json(d) == spec
        assert d["kind"] == spec.kind


@pytest.mark.parametrize(
    "d, message",
    [
        ({"kind": "diagonal"}, "unknown partition kind 'diagonal'"),
        ({"kind": "split"}, "needs split_dim"),
        ({"kind": "fused_qkv", "part": "x", "num_heads": 4, "num_kv_heads": 2, "head_dim": 2}, "part 'x'"),
        ({"kind": "replicated", "colour": 1}, "unknown fields \\['colour'\\]"),
        ({"split_dim": 0}, "with a 'kind'"),
        ({"kind": "replicated", "zero_group": "sparse"}, "unknown zero_group"),
    ],
)
def test_partition_spec_rejects(d, message):
    with pytest.raises(UcpError, match=message):
        PartitionSpec.from_json(d)


def test_vocab_padding_rule():
    spec = PartitionSpec("vocab", pad_to_multiple_of=8, unpadded=100)
    assert padded_rows(spec, 1) == 104
    assert padded_rows(spec, 4) == 128
    last = tp_shard(spec, (100, 3), 4, 3)
    assert last.local_shape == (32, 3)
    assert last.pieces == ((((0, 4), (0, 3)), ((96, 100), (0, 3))),)


def test_mixtral_config_json_round_trip():
    c = small_config(stage_layers=[5, 3], tie_word_embeddings=True)
    assert MixtralConfig.from_json(c.to_json()) == c
    assert c.head_dim == 4
    with pytest.raises(UcpError, match="unknown fields \\['rope'\\]"):
        MixtralConfig.from_json({**c.to_json(), "rope": 1})
