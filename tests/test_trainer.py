"""Tests of the reference MoE trainer (trainer/): model math, layout equivalence, determinism, and its local
state against ucp's reshaper (both implement docs/LOCAL_STATE.md).

Multi-rank runs start `python -m trainer` processes the way torchrun would (RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR, MASTER_PORT), on CPU with gloo, and compare the losses they write to their metrics files.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from trainer.config import ModelConfig, load_config
from trainer.data import SyntheticTokens
from trainer.launch import trainer_argv
from trainer.model import DecoderStage, StageSpec
from trainer.parallel.mesh import Layout, coords_of, group_partitions, parse_layout
from trainer.parallel.pipeline import split_layers
from trainer.parallel.tensor import padded_vocab_size, shard_gate_up, shard_qkv, shard_vocab
from trainer.train import open_metrics
from trainer.weights import canonical_shapes, init_from_seed, initial_atom, load_canonical, ucp_config
from ucp.errors import LayoutError

from .helpers import assert_same_logits, random_hf_model
from .launch import free_port, spawn

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "trainer" / "configs" / "tiny-moe.yaml"
STEPS = 10


def launch(layout: str, tmp: Path, *extra: str, steps: int = STEPS) -> list[dict]:
    """Train in `layout` on as many local processes as it needs; return rank 0's metrics records."""
    metrics = tmp / f"{layout}-{os.getpid()}-{free_port()}.jsonl"
    spawn(trainer_argv(TINY, layout, steps, metrics, *extra), parse_layout(layout).world_size)
    return [json.loads(line) for line in metrics.read_text().splitlines()]


@functools.cache
def _cached_run(layout: str, extra: tuple[str, ...], tmp: str) -> tuple[float, ...]:
    records = launch(layout, Path(tmp), *extra)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    for r in records:
        assert isinstance(r["step_time_s"], float) and r["step_time_s"] > 0
    return tuple(r["loss"] for r in records)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("trainer-runs"))
    return lambda layout, *extra: _cached_run(layout, tuple(extra), tmp)


def _assert_close(losses: tuple[float, ...], reference: tuple[float, ...], rel: float = 1e-5, first_step: int = 1):
    for step, (a, b) in enumerate(zip(losses, reference, strict=True), start=first_step):
        assert abs(a - b) <= rel * abs(b), f"step {step}: loss {a!r} vs reference {b!r}"


# --- layouts, slicing, data: small pure checks ----------------------------------------------------------


def test_rank_order_is_tp_then_dp_then_pp_with_ep_carved_from_dp():
    layout = parse_layout("tp2pp2ep2dp2zero1")
    assert layout == Layout(tp=2, pp=2, ep=2, dp=2, zero=1) and layout.world_size == 8
    c = coords_of(5, layout)  # 5 = tp 1 + 2 * (dp 0 + 2 * pp 1)
    assert (c.tp, c.dp, c.pp, c.ep, c.expert_dp) == (1, 0, 1, 0, 0)
    c = coords_of(3, parse_layout("tp1pp1ep2dp4"))
    assert (c.dp, c.ep, c.expert_dp) == (3, 1, 1)
    with pytest.raises(LayoutError):
        parse_layout("tp1pp1ep3dp4")


def test_fused_qkv_and_gate_up_follow_local_state_md():
    heads, kv_heads, head_dim, hidden = 4, 2, 1, 1
    q = torch.arange(100, 104.0).view(heads * head_dim, hidden)  # query heads 100..103
    k = torch.arange(200, 202.0).view(kv_heads * head_dim, hidden)
    v = torch.arange(300, 302.0).view(kv_heads * head_dim, hidden)
    assert shard_qkv(q, k, v, heads, kv_heads, 0, 1).flatten().tolist() == [100, 101, 200, 300, 102, 103, 201, 301]
    assert shard_qkv(q, k, v, heads, kv_heads, 1, 2).flatten().tolist() == [102, 103, 201, 301]
    # fewer KV heads than TP ranks: each rank a run of the rows of the global fused tensor, as megatron-core holds it
    assert shard_qkv(q, k, v, heads, kv_heads, 1, 4).flatten().tolist() == [200, 300]
    assert shard_qkv(q, k[:1], v[:1], heads, 1, 1, 2).flatten().tolist() == [103, 200, 300]
    w1, w3 = torch.arange(4.0).view(4, 1), torch.arange(10, 14.0).view(4, 1)
    assert shard_gate_up(w1, w3, 1, 2).flatten().tolist() == [2, 3, 12, 13]
    assert padded_vocab_size(500, 128, 1) == 512 and padded_vocab_size(500, 128, 4) == 512
    assert padded_vocab_size(513, 128, 2) == 768
    rows = shard_vocab(torch.ones(500, 2), 512, 1, 2)
    assert rows.shape == (256, 2) and rows[:244].eq(1).all() and rows[244:].eq(0).all()


def test_uneven_pipeline_split():
    assert split_layers(4, 2, [1, 3]) == [[0], [1, 2, 3]]
    assert split_layers(4, 2, None) == [[0, 1], [2, 3]]
    with pytest.raises(ValueError):
        split_layers(5, 2, None)


def test_global_batch_is_the_same_in_every_dp_degree():
    whole = SyntheticTokens(500, 32, 8, 0, 1, seed=7).get_batch(3)
    parts = [SyntheticTokens(500, 32, 8, r, 4, seed=7).get_batch(3) for r in range(4)]
    assert torch.equal(whole, torch.cat(parts))
    assert not torch.equal(whole, SyntheticTokens(500, 32, 8, 0, 1, seed=7).get_batch(4))


# --- reference math -------------------------------------------------------------------------------------


def _hf_atoms(hf_model, cfg) -> dict[str, torch.Tensor]:
    """transformers' Mixtral state dict under the canonical atom names (transformers 4.x or 5.x naming)."""
    state = {k: v.detach() for k, v in hf_model.state_dict().items()}
    atoms = {}
    for name in canonical_shapes(cfg):
        if name in state:
            atoms[name] = state[name]
            continue
        prefix, _, rest = name.partition(".block_sparse_moe.")
        if rest == "gate.weight":
            atoms[name] = state[f"{prefix}.mlp.gate.weight"]
        elif rest.startswith("experts."):  # transformers 5 fuses the experts: gate_up_proj [E, 2F, H], down_proj
            expert, proj = int(rest.split(".")[1]), rest.split(".")[2]
            gate_up, down = state[f"{prefix}.mlp.experts.gate_up_proj"], state[f"{prefix}.mlp.experts.down_proj"]
            ffn = cfg.ffn_hidden_size
            atoms[name] = {"w1": gate_up[expert, :ffn], "w3": gate_up[expert, ffn:], "w2": down[expert]}[proj]
        else:
            raise KeyError(name)
    return atoms


def hf_fields(cfg: ModelConfig) -> dict:
    """The transformers config fields that the trainer's model config sets, whatever the family."""
    return {
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.ffn_hidden_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "rope_theta": cfg.rope_theta,
        "rms_norm_eps": cfg.rms_norm_eps,
        "tie_word_embeddings": cfg.tie_word_embeddings,
    }


def _hf_model(cfg):
    return random_hf_model(
        "MixtralForCausalLM",
        **hf_fields(cfg),
        num_local_experts=cfg.num_experts,
        num_experts_per_tok=cfg.top_k,
        router_aux_loss_coef=cfg.router_aux_loss_coef,
    )


@pytest.mark.parametrize("tied", [False, True])
def test_logits_match_transformers_mixtral(tied):
    cfg = load_config(TINY, [f"model.tie_word_embeddings={str(tied).lower()}"]).model
    hf = _hf_model(cfg)
    stage = DecoderStage(cfg, StageSpec(layers=list(range(cfg.num_layers)), first=True, last=True))
    load_canonical(stage, _hf_atoms(hf, cfg).__getitem__, tp_rank=0)
    assert_same_logits(stage, hf, cfg.vocab_size)


def test_set_reads_a_float_without_a_dot():
    # YAML 1.1 (PyYAML) reads 1e-3 as a string: a float key takes it as the number it spells, refuses a word
    cfg = load_config(TINY, ["optim.lr=1e-3", "optim.min_lr=2E-5", "model.rms_norm_eps=1e-06", "optim.eps=.5"])
    assert (cfg.optim.lr, cfg.optim.min_lr, cfg.model.rms_norm_eps, cfg.optim.eps) == (1e-3, 2e-5, 1e-6, 0.5)
    assert isinstance(cfg.optim.lr, float)
    with pytest.raises(ValueError, match=r"optim\.lr must be a number, got 'fast'"):
        load_config(TINY, ["optim.lr=fast"])


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--config", "{tmp}/nosuch.yaml"], "cannot read the config {tmp}/nosuch.yaml: No such file or directory"),
        (["--config", "{tmp}"], "cannot read the config {tmp}: Is a directory"),
        (["--config", "{tmp}/list.yaml"], "the config {tmp}/list.yaml must map sections to settings, not hold a list"),
        (["--config", "{tmp}/bad.yaml"], "the config {tmp}/bad.yaml is not YAML"),
        (["--set", "train.nosuch=1"], "unknown config key(s) in train: ['nosuch']"),
        (["--set", "optim.lr=fast"], "optim.lr must be a number, got 'fast'"),
        (["--set", "model.hidden_size=abc"], "model.hidden_size must be a whole number, got 'abc'"),
        (["--set", "model.top_k=9"], "model.top_k must be 1 to model.num_experts=8, got 9"),
        (["--set", "model.num_heads=3"], "model.hidden_size=64 is not divisible by model.num_heads=3"),
        (["--set", "train.stage_layers=[2, x]"], "train.stage_layers must be a list of whole numbers"),
        (["--durable-every", "0"], "checkpoint.durable_every must be at least 1, got 0"),
        (["--layout", "tp2pp1"], "none of the layouts tp2pp1 (2) runs on 1 processes"),  # (after the group formed)
        (["--set", "model.num_layers=3", "--set", "train.stage_layers=[1, 1]"], "stage_layers=[1, 1] must be 1"),
        (["--ckpt", "s3://bucket/run", "-", "AWS_ACCESS_KEY_ID="], "StorageAuthError: cannot list s3://bucket/run"),
    ],
)
def test_a_wrong_config_is_one_line_and_a_failed_exit(tmp_path, argv, message):
    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    (tmp_path / "bad.yaml").write_text("train: [1, 2\n")
    argv = [a.format(tmp=tmp_path) for a in argv]
    env = dict(os.environ)
    if "-" in argv:  # (what follows it is the environment: here, no AWS credentials and no endpoint to find them at)
        env = {k: v for k, v in env.items() if not k.startswith("AWS_")}
        env.update(AWS_CONFIG_FILE=os.devnull, AWS_SHARED_CREDENTIALS_FILE=os.devnull, AWS_EC2_METADATA_DISABLED="true")
        argv = argv[: argv.index("-")]
    out = subprocess.run(
        [sys.executable, "-m", "trainer", *argv, "--steps", "1"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode != 0 and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert out.stderr.startswith("trainer: " + message.format(tmp=tmp_path)), out.stderr


def test_a_string_flag_stays_a_string_whatever_yaml_would_make_of_it():
    from trainer.train import build_config, parse_args

    cfg = build_config(parse_args(["--ckpt", "2024", "--ckpt-local", "1e3", "--layout", "tp1pp1", "--steps", "3"]))
    assert (cfg.checkpoint.url, cfg.checkpoint.local, cfg.train.steps) == ("2024", "1e3", 3)


def test_metrics_file_in_a_new_directory(tmp_path):
    # trainer/README's `--metrics-file ./run1/metrics.jsonl` of a fresh run: nothing has made run1/ yet
    path = tmp_path / "run1" / "metrics.jsonl"
    for line in ("1", "2"):
        with open_metrics(str(path)) as f:
            f.write(line + "\n")
    assert path.read_text() == "1\n2\n"  # appended, as a restarted run's


def test_load_balancing_loss_matches_transformers_for_one_layer():
    # transformers pools the loss over all layers; ours is per layer (then averaged): equal for one layer.
    cfg = load_config(TINY, ["model.num_layers=1"]).model
    hf = _hf_model(cfg)
    stage = DecoderStage(cfg, StageSpec(layers=[0], first=True, last=True))
    load_canonical(stage, _hf_atoms(hf, cfg).__getitem__, tp_rank=0)
    tokens = torch.randint(cfg.vocab_size, (2, 32), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = hf(tokens, output_router_logits=True).aux_loss
        _, aux = stage(tokens)
    assert torch.allclose(aux, expected.float(), rtol=1e-5), (aux, expected)


# --- multi-process training -----------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["tp2pp1", "tp1pp1ep2dp2", "tp1pp2dp2zero1", "tp2pp2"])
def test_layouts_train_like_tp1pp1(run, layout):
    reference = run("tp1pp1")
    assert reference[-1] < reference[0], "the tiny model should learn in 10 steps"
    _assert_close(run(layout), reference)


@pytest.mark.parametrize("layout", ["tp2pp1", "tp4pp1"])
def test_fewer_kv_heads_than_tp_ranks_train_like_tp1pp1(run, layout):
    """One KV head (4 query heads) over TP 2 and 4: the ranks of the one query group each hold a run of its fused QKV
    rows, gather the group's output and attend with their own query heads (megatron-core's layout)."""
    one_kv_head = ("--set", "model.num_kv_heads=1")
    _assert_close(run(layout, *one_kv_head), run("tp1pp1", *one_kv_head))


@pytest.mark.slow
def test_tied_embeddings_over_an_uneven_pipeline_train_like_tp1pp1(run):
    # (Experts split over both TP and EP are checked, with ZeRO-1, by the state-assembly test below.)
    # Vocab padded to a multiple of 200*T: 600 rows at T=1, 800 at T=2; the loss must ignore the padding.
    tied = ("--set", "model.tie_word_embeddings=true", "--set", "model.make_vocab_size_divisible_by=200")
    reference = run("tp1pp1", *tied)
    assert reference != run("tp1pp1")
    _assert_close(run("tp2pp2", *tied, "--set", "train.stage_layers=[1,3]"), reference)


@pytest.mark.slow
def test_same_config_layout_and_seed_give_bitwise_identical_losses(run, tmp_path):
    first = run("tp1pp1ep2dp2")
    again = tuple(r["loss"] for r in launch("tp1pp1ep2dp2", tmp_path))
    assert again == first
    other_seed = tuple(r["loss"] for r in launch("tp1pp1", tmp_path, "--seed", "99", steps=2))
    assert other_seed != run("tp1pp1")[:2]


# --- conformance with ucp's reshaper --------------------------------------------------------------------


def _ucp():
    """ucp's layout parser, reshaper and Mixtral family (written in parallel with the trainer)."""
    reason = "ucp's reshaper (ucp/sharding/reshard.py, ucp/sharding/families/mixtral.py) is not importable"
    return (
        pytest.importorskip("ucp.sharding.layout", reason=reason),
        pytest.importorskip("ucp.sharding.reshard", reason=reason),
        pytest.importorskip("ucp.sharding.families.mixtral", reason=reason),
    )


@pytest.mark.parametrize("layout", ["tp2pp2ep2dp2zero1", "tp1pp2ep4dp4", "tp2pp1dp3"])
def test_rank_coordinates_and_process_groups_equal_ucp_layout(layout):
    ucp_layout = _ucp()[0].parse_layout(layout)
    partitions = group_partitions(parse_layout(layout))
    for rank in range(ucp_layout.world_size):
        assert coords_of(rank, parse_layout(layout)).__dict__ == ucp_layout.coords(rank).__dict__
        for kind in ("tp", "dp", "pp", "ep", "expert_dp"):
            assert getattr(ucp_layout, f"{kind}_group")(rank) in partitions[kind], (rank, kind)
            assert sum(rank in members for members in partitions[kind]) == 1


@pytest.mark.parametrize(
    ("layout", "tied", "stage_layers"),
    [
        ("tp1pp1", False, None),
        ("tp2pp2ep2dp2zero1", True, [1, 3]),
        ("tp2pp1ep2dp4", False, None),
    ],
)
def test_initial_local_params_equal_ucp_shard_of_the_initial_atoms(layout, tied, stage_layers):
    _ucp()
    cfg = load_config(TINY, [f"model.tie_word_embeddings={str(tied).lower()}"]).model
    assert_initial_params_equal_ucp_shard(cfg, layout, stage_layers)


@pytest.mark.parametrize(("layout", "kv_heads"), [("tp2pp1", 1), ("tp4pp1", 1), ("tp4pp1", 2)])
def test_with_fewer_kv_heads_than_tp_ranks_local_params_equal_ucp_shard(layout, kv_heads):
    cfg = load_config(TINY, [f"model.num_kv_heads={kv_heads}"]).model
    assert_initial_params_equal_ucp_shard(cfg, layout, None)


def assert_initial_params_equal_ucp_shard(cfg: ModelConfig, layout: str, stage_layers: list[int] | None) -> None:
    """Every rank's initial local parameters of `layout` equal ucp's reshaper's shard of the initial atoms: the same
    names, order and values (the trainer and ucp implement docs/LOCAL_STATE.md independently)."""
    from ucp.sharding.layout import parse_layout as ucp_parse_layout
    from ucp.sharding.reshard import shard

    atoms = {name: initial_atom(cfg, 5, name) for name in canonical_shapes(cfg)}
    parsed = parse_layout(layout)
    for rank in range(parsed.world_size):
        c = coords_of(rank, parsed)
        spec = StageSpec(
            layers=split_layers(cfg.num_layers, parsed.pp, stage_layers)[c.pp],
            first=c.pp == 0,
            last=c.pp == parsed.pp - 1,
            tp_size=parsed.tp,
            ep_size=parsed.ep,
            ep_rank=c.ep,
        )
        stage = DecoderStage(cfg, spec)
        init_from_seed(stage, 5, c.tp)
        mine = dict(stage.named_parameters())
        theirs = shard({"model": atoms}, ucp_config(cfg, stage_layers), ucp_parse_layout(layout), rank)
        assert list(theirs) == ["model"]
        assert list(theirs["model"]) == list(mine), f"rank {rank}: local names or order differ"
        for name, value in mine.items():
            assert torch.equal(value, theirs["model"][name]), f"rank {rank}: {name} differs"


# Trains like `python -m trainer`, first loading the local state saved in argv[2] (unless "-"), and saves its
# local state to argv[1] (torch.save: good enough between test processes; checkpoints go through ucp).
RUN_AND_SAVE = """
import sys, torch, torch.distributed as dist
from trainer.train import build_config, build_trainer, parse_args, train
trainer = build_trainer(build_config(parse_args(sys.argv[3:])))
if sys.argv[2] != "-":
    trainer.load_local_state(torch.load(f"{sys.argv[2]}/rank{dist.get_rank()}.pt"))
    for step in range(1, trainer.optimizer.step + 1):  # the data position of the resumed run
        trainer.data.get_batch(step)
train(trainer)
torch.save(trainer.local_state(), f"{sys.argv[1]}/rank{dist.get_rank()}.pt")
dist.destroy_process_group()
"""


def _run_and_save(layout: str, tmp_path: Path, steps: int, load_from: Path | None = None, *extra: str) -> list[dict]:
    """Train in `layout` up to `steps`; return the local states of all ranks."""
    out = tmp_path / f"{layout}-{steps}"
    out.mkdir()
    world = parse_layout(layout).world_size
    spawn(
        [
            "-c",
            RUN_AND_SAVE,
            str(out),
            str(load_from or "-"),
            "--config",
            str(TINY),
            "--layout",
            layout,
            "--steps",
            str(steps),
            *extra,
        ],
        world,
    )
    return [torch.load(out / f"rank{r}.pt") for r in range(world)]


def _trained_canonical_state(layout: str, tmp_path: Path, steps: int = 3) -> dict:
    ucp_layout, reshard, _ = _ucp()
    local_states = _run_and_save(layout, tmp_path, steps)
    return reshard.assemble(local_states, ucp_config(load_config(TINY).model, None), ucp_layout.parse_layout(layout))


@pytest.mark.slow
def test_trained_state_assembles_to_the_same_atoms_in_every_layout(tmp_path):
    reference = _trained_canonical_state("tp1pp1", tmp_path)
    other = _trained_canonical_state("tp2pp1ep2dp2zero1", tmp_path)  # fused TP, EP, ZeRO-1 flat ranges
    assert list(other["model"]) == list(reference["model"]) == list(canonical_shapes(load_config(TINY).model))
    # Compared by norm: AdamW amplifies rounding for the rare elements whose gradient is near eps.
    for name, value in reference["model"].items():
        assert _relative_difference(other["model"][name], value) <= 1e-4, name
    for name, states in reference["optimizer"]["state"].items():
        assert set(states) == {"exp_avg", "exp_avg_sq"}
        for state, value in states.items():
            assert _relative_difference(other["optimizer"]["state"][name][state], value) <= 1e-4, (name, state)


def _relative_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def test_mixtral_8x7b_config_has_mixtrals_46_7b_parameters():
    cfg = load_config(REPO / "trainer" / "configs" / "mixtral-8x7b.yaml")
    assert parse_layout(cfg.train.layout).world_size == 64
    with torch.device("meta"):  # shapes only
        stage = DecoderStage(cfg.model, StageSpec(layers=list(range(cfg.model.num_layers)), first=True, last=True))
    assert round(sum(p.numel() for p in stage.parameters()) / 1e9, 1) == 46.7


def test_resume_in_another_layout_through_ucp_continues_the_same_run(run, tmp_path):
    """5 steps with EP and ZeRO-1, assembled into atoms and sharded for a 2-stage pipeline, then 5 more steps:
    the losses of steps 6..10 are those of an uninterrupted tp1pp1 run."""
    ucp_layout, reshard, _ = _ucp()
    full = _trained_canonical_state("tp1pp1ep2dp2zero1", tmp_path, steps=5)
    target = ucp_layout.parse_layout("tp1pp2")
    saved = tmp_path / "resharded"
    saved.mkdir()
    for rank in range(target.world_size):
        local = reshard.shard(full, ucp_config(load_config(TINY).model, None), target, rank)
        local["optimizer"]["step"] = 5
        torch.save(local, saved / f"rank{rank}.pt")
    metrics = tmp_path / "resumed.jsonl"
    _run_and_save("tp1pp2", tmp_path, 10, saved, "--metrics-file", str(metrics))
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in records] == [6, 7, 8, 9, 10]
    _assert_close(tuple(r["loss"] for r in records), run("tp1pp1")[5:], first_step=6)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--layouts", "tpx"], "--layouts: malformed layout 'tpx'"),
        (["--layouts", "tp2pp2"], "give one layout of 4 processes and one of 2"),
        (["--layouts", "tp1pp2dp2,tp3"], "give one layout of 4 processes and one of 2"),
        (["--kill-after", "25"], "--kill-after 25 < --rejoin-after 22 < --steps 36 must hold"),
        (["--save-interval", "0"], "--save-interval must be at least 1, got 0"),
    ],
)
def test_the_demo_refuses_what_would_leave_it_waiting_before_it_starts(tmp_path, argv, message, capsys):
    from trainer.demo import main

    with pytest.raises(SystemExit) as stop:
        main(["--dir", str(tmp_path / "run"), *argv])
    assert stop.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "run").exists()
