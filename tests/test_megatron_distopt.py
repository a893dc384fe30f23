"""Megatron-Core's distributed optimizer in Megatron-LM's torch format (distrib_optim.pt beside each rank file) and
in the torch_dist format (`fully_reshardable`, `dp_reshardable`), converted by ucp (ucp.interop.megatron.distrib_optim) and checked against megatron-core's own: its
DistributedOptimizer takes a step in pp2 x ep2 with DP 2 (several buckets on the first stage, a dense and an expert
optimizer, the dense state in EP rank 0's file only), and after ucp converts the files to tp1pp1 a DP 2 job of
megatron-core loads them; each parameter's master weight and Adam moments, assembled from the ranks' pieces through
megatron-core's own range maps, are bitwise the saved ones. Other layouts and ucp's own format round-trip every file
bitwise; damaged or mismatched files are clear errors that leave nothing at the destination."""

from __future__ import annotations

import io
import os
import pickle
import random
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

import ucp
from ucp.interop import InteropError
from ucp.interop.megatron.convert import convert
from ucp.interop.megatron.files import load_rank_file
from ucp.interop.megatron.save import DISTRIB_OPTIM_FILE, RANK_FILE

from .helpers import DRAW
from .launch import spawn
from .megatron_worker import V
from .test_convert import _replace, assert_bitwise_equal

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]
SOURCE = "tp1pp2ep2"
ITER = "iter_0000010"
# hidden 36, FFN 52: parameter sizes that are not multiples of 64, so megatron-core pads between parameters and the
# padding lost at each bucket's end moves every later parameter (a wrong bucketing could not go unseen)
ENV = {"PYTHONWARNINGS": "ignore", "UCP_MEGATRON_SHAPE": "36,52,2,4,4,2"}
STATES = ("param", "exp_avg", "exp_avg_sq")  # what the worker records of each parameter's piece


def assemble(prefix: Path, world: int) -> dict[str, dict[str, torch.Tensor]]:
    """Every parameter's whole fp32 master weight and moments from the ranks' pieces (megatron_distopt_worker):
    each TP shard from its DP ranks' ranges, then the TP shards joined as a tp1 model holds the parameter
    (SwiGLU's fc1 shards each [gate; up]); a vocabulary's padding rows, which depend on TP, are checked zero and
    left out."""
    pieces: dict[str, dict[int, list[dict]]] = {}
    for r in range(world):
        for name, d in torch.load(f"{prefix}.{r}", weights_only=True).items():
            if not name.startswith("__"):
                pieces.setdefault(name, {}).setdefault(d["tp_rank"], []).append(d)
    whole = {}
    for name, by_tp in pieces.items():
        shards: dict[str, list[torch.Tensor]] = {k: [] for k in STATES}
        for tp_rank in sorted(by_tp):
            ds = by_tp[tp_rank]
            shape = ds[0]["shape"]
            flat = {k: torch.full((torch.Size(shape).numel(),), float("nan")) for k in STATES}
            for d in ds:
                start, end = d["range"]
                for k, t in flat.items():
                    t[start:end] = d[k]
            assert not any(t.isnan().any() for t in flat.values()), f"{name}: TP rank {tp_rank} is not covered"
            for k, t in flat.items():
                shards[k].append(t.view(shape))
        dim = next(iter(by_tp.values()))[0]["partition_dim"]
        assert sorted(by_tp) == list(range(len(by_tp))), (name, sorted(by_tp))
        whole[name] = {k: _join_tp(name, ts, dim) for k, ts in shards.items()}
    return whole


def _join_tp(name: str, shards: list[torch.Tensor], dim: int | None) -> torch.Tensor:
    if dim is None:  # (replicated: every TP rank holds the same)
        assert all(torch.equal(t, shards[0]) for t in shards), f"{name}: TP ranks differ"
        return shards[0]
    if name.endswith("linear_fc1.weight"):  # each shard is its gate rows, then its up rows
        halves = [t.chunk(2, dim) for t in shards]
        joined = torch.cat([g for g, _ in halves] + [u for _, u in halves], dim)
    else:
        joined = torch.cat(shards, dim)
    if name.endswith(("word_embeddings.weight", "output_layer.weight")):
        assert not joined[V:].any(), f"{name}: a vocabulary padding row is not zero"
        joined = joined[:V]
    return joined


def save(tmp: Path, env: dict[str, str], world: int = 4) -> tuple[Path, dict[str, dict[str, torch.Tensor]]]:
    """megatron-core's DistributedOptimizer after a step, saved at TMP/src by `world` processes (DP: what the
    layout, UCP_DISTOPT_SAVE, leaves of them); each parameter's whole state."""
    pytest.importorskip("megatron.core")
    spawn(["tests/megatron_distopt_worker.py", "save", str(tmp / "src"), str(tmp / "saved")], world, 300, env)
    return tmp / "src", assemble(tmp / "saved", world)


@pytest.fixture(scope="module")
def distopt(tmp_path_factory):
    return save(tmp_path_factory.mktemp("distopt"), ENV)


def assert_same_states(got: dict[str, dict[str, torch.Tensor]], want: dict[str, dict[str, torch.Tensor]]) -> None:
    """Every parameter of `got` holds bitwise `want`'s master weight and moments (assemble's output)."""
    for name, states in got.items():
        for k, t in states.items():
            assert torch.equal(t, want[name][k]), (name, k)


def files_of(ckpt: Path) -> dict[str, dict]:
    """Every rank directory's files, read whole (rank files through ucp's allowlisted reader)."""
    out = {}
    for d in sorted((ckpt / ITER).iterdir()):
        out[d.name] = {
            RANK_FILE: {k: v for k, v in load_rank_file(d / RANK_FILE).items() if k != "args"},
            DISTRIB_OPTIM_FILE: torch.load(d / DISTRIB_OPTIM_FILE, weights_only=True),
        }
    return out


def converts_and_loads(src: Path, saved: dict, tmp: Path, env: dict[str, str]) -> None:
    """ucp converts SRC to tp1, a DP 2 megatron-core job loads it: every parameter's state is the saved one."""
    report = convert(str(src), str(tmp / "tp1"), from_layout=SOURCE, to_layout="tp1")
    assert "optimizer" not in report.dropped
    spawn(["tests/megatron_distopt_worker.py", "load", str(tmp / "tp1"), str(tmp / "loaded")], 2, 300, env)
    loaded = assemble(tmp / "loaded", 2)
    tied = env.get("UCP_DISTOPT_TIED") == "1"  # (the tp1 model holds a tied embedding once)
    assert set(loaded) == set(saved) - ({"output_layer.weight"} if tied else set()) and len(loaded) > 20
    assert_same_states(loaded, saved)
    # the moments are real (a step was taken)
    assert saved["decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight"]["exp_avg"].abs().sum() > 0


def test_megatron_loads_the_converted_distributed_optimizer(distopt, tmp_path):
    converts_and_loads(*distopt, tmp_path, ENV)


def test_a_tied_embedding_across_stages_has_a_bucket_of_its_own(tmp_path):
    """Tied embeddings with PP > 1: megatron-core keeps a copy on the last stage, and each copy takes a DDP bucket
    of its own (`shared_embedding`); the tp1 target holds the embedding once."""
    env = {**ENV, "UCP_DISTOPT_TIED": "1"}
    src, saved = save(tmp_path, env)
    assert torch.equal(saved["output_layer.weight"]["exp_avg"], saved["embedding.word_embeddings.weight"]["exp_avg"])
    converts_and_loads(src, saved, tmp_path, env)


@pytest.mark.parametrize(("heads", "kv"), [(8, 4), (4, 2), (4, 1)])
def test_tp2pp2_dp2_to_tp4_dp1_loads_in_megatron_and_back_is_bitwise(tmp_path, heads, kv):
    """megatron-core's DistributedOptimizer in tp2pp2 with DP 2 (8 processes; several buckets on the first stage,
    each TP shard with values of its own; GQA with `heads` heads in `kv` query groups: TP 4 divides them, or is a
    multiple of them and the ranks of a group each hold a run of its fused QKV rows) -> ucp -> tp4 with DP 1:
    megatron-core's tp4 job (4 processes) loads the files, and every parameter's master weight and moments, joined
    from its TP shards, are bitwise the saved ones. Converted back to tp2pp2, every file is bitwise the source's."""
    shape = f"40,52,2,4,{heads},{kv}"
    env = {**ENV, "UCP_MEGATRON_SHAPE": shape, "UCP_DISTOPT_SAVE": "2,2,1", "UCP_DISTOPT_LOAD": "4,1,1"}
    src, saved = save(tmp_path, env, world=8)
    assert saved["decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight"]["exp_avg"].abs().sum() > 0
    report = convert(str(src), str(tmp_path / "tp4"), from_layout="tp2pp2", to_layout="tp4")
    assert report.dropped == ()
    spawn(["tests/megatron_distopt_worker.py", "load", str(tmp_path / "tp4"), str(tmp_path / "loaded")], 4, 300, env)
    loaded = assemble(tmp_path / "loaded", 4)
    assert set(loaded) == set(saved) and len(loaded) > 20
    assert_same_states(loaded, saved)
    convert(str(tmp_path / "tp4"), str(tmp_path / "back"), from_layout="tp4", to_layout="tp2pp2")
    assert_bitwise_equal(files_of(tmp_path / "back"), files_of(src), "tp2pp2 -> tp4 -> tp2pp2")


@pytest.mark.parametrize("trial", range(2))
def test_other_layouts_and_ucp_round_trip_every_file_bitwise(distopt, tmp_path, trial):
    src, _ = distopt
    via = random.Random(trial * 7919 + os.getpid()).choice(["tp1", "tp2", "tp2ep2", "tp2pp2", "tp1ep4", "tp2pp2ep4"])
    convert(str(src), str(tmp_path / "mid"), from_layout=SOURCE, to_layout=via)
    there = convert(str(tmp_path / "mid"), str(tmp_path / "back"), from_layout=via, to_layout=SOURCE)
    assert_bitwise_equal(files_of(tmp_path / "back"), files_of(src), f"via {via}")
    imported = convert(str(src), str(tmp_path / "u"), from_layout=SOURCE, to_layout="universal")
    exported = convert(str(tmp_path / "u"), str(tmp_path / "from_u"), from_layout="universal", to_layout=SOURCE)
    assert_bitwise_equal(files_of(tmp_path / "from_u"), files_of(src), "via universal")
    # the atoms each conversion says it carried: every one of the checkpoint's, the optimizer's states with them
    atoms = ucp.open_checkpoint(str(tmp_path / "u")).atoms
    assert any(path.startswith("optimizer/") for path in atoms)
    assert imported.atoms == exported.atoms == there.atoms == len(atoms), (len(atoms), imported, exported, there)


def decouple(groups: list[dict]) -> None:
    """Param groups as megatron-core 0.16's _get_param_groups makes them with a decoupled LR: the embedding and
    output layer in a group of their own after the default one, with the same identifier (wd_mult 1, lr_mult 1,
    is_decoupled_lr False) and their own max_lr."""
    groups.insert(1, {**groups[0], "max_lr": groups[0]["max_lr"] * 10, "default_config": False})


def _rewrite(path: Path, change) -> None:
    """A file of the checkpoint read, changed in memory, and written anew (test_convert._replace)."""
    data = torch.load(path, weights_only=False)
    change(data)
    _replace(data, path)


def test_damaged_or_mismatched_distributed_optimizer_files_are_clear_errors(distopt, tmp_path):
    src, _ = distopt
    dst = tmp_path / "out"

    def fresh() -> Path:
        ckpt = tmp_path / "m"
        shutil.rmtree(ckpt, ignore_errors=True)
        shutil.copytree(src, ckpt)
        return ckpt

    def refused(ckpt: Path, pattern: str) -> None:
        with pytest.raises(InteropError, match=pattern):
            convert(str(ckpt), str(dst), from_layout=SOURCE, to_layout="tp1")
        assert not dst.exists()

    first = Path(ITER) / "mp_rank_00_000_000"
    # args that bucket the buffers otherwise than the file was written: refused before anything is read
    ckpt = fresh()
    for d in (ckpt / ITER).iterdir():
        _rewrite(d / RANK_FILE, lambda data: setattr(data["args"], "ddp_bucket_size", 1000))
    refused(ckpt, rf"{first}/distrib_optim.pt: grad buffer 0 holds \d+ elements, but .* has \d+ .*ddp_bucket_size")
    # the param group megatron-core 0.16 splits off for a decoupled LR (the matrices' identifier, its own max_lr)
    ckpt = fresh()
    _rewrite(ckpt / first / RANK_FILE, lambda data: decouple(data["optimizer"][0]["optimizer"]["param_groups"]))
    refused(ckpt, rf"{first}/model_optim_rng.pt: optimizer param groups .* not Megatron-Core's standard")
    # a buffer of another size than the layout's
    ckpt = fresh()

    def grow(data: list) -> None:
        world = next(iter(data[0][0].values()))
        world.update({k: torch.cat([world[k], torch.zeros(64)]) for k in ("param", "exp_avg", "exp_avg_sq")})
        world["numel_unpadded"] += 64

    _rewrite(ckpt / first / DISTRIB_OPTIM_FILE, grow)
    refused(ckpt, rf"{first}/distrib_optim.pt: grad buffer 0 holds \d+ elements, but .* has \d+")
    # one rank directory without its distrib_optim.pt
    ckpt = fresh()
    (ckpt / first / DISTRIB_OPTIM_FILE).unlink()
    refused(ckpt, rf"{first}/distrib_optim.pt is missing, but other rank directories have")
    # none at all: the rank files' optimizer entries have no per-parameter state
    for d in (ckpt / ITER).iterdir():
        (d / DISTRIB_OPTIM_FILE).unlink(missing_ok=True)
    refused(ckpt, r"model_optim_rng.pt: its 'optimizer' entry has no per-parameter state .* none beside it")
    # truncated
    ckpt = fresh()
    path = ckpt / first / DISTRIB_OPTIM_FILE
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    refused(ckpt, rf"{first}/distrib_optim.pt is not a readable torch checkpoint")
    # EP rank 0's file without its expert state, or without the dense state it holds for every EP rank
    ckpt = fresh()
    _rewrite(ckpt / first / DISTRIB_OPTIM_FILE, lambda data: data.pop())
    refused(ckpt, rf"{first}/distrib_optim.pt: holds a list of 1, not a list of 2 distributed optimizer states")
    ckpt = fresh()
    _rewrite(ckpt / first / DISTRIB_OPTIM_FILE, lambda data: data.__setitem__(0, None))
    refused(ckpt, rf"{first}/distrib_optim.pt: holds no dense distributed optimizer state \(NoneType\)")
    # a world tensor of the wrong size
    ckpt = fresh()

    def shorten(data: list) -> None:
        world = next(iter(data[1][0].values()))
        world["exp_avg"] = world["exp_avg"][:-1].clone()

    _rewrite(ckpt / first / DISTRIB_OPTIM_FILE, shorten)
    refused(ckpt, r"grad buffer 0's 'exp_avg' is not an fp32 tensor of \d+ elements")
    # a pickle naming a global outside the allowlist
    ckpt = fresh()
    torch.save([None, {"buckets_coalesced": True, 0: os.getcwd}], ckpt / first / DISTRIB_OPTIM_FILE)
    refused(ckpt, rf"{first}/distrib_optim.pt: refused to unpickle a type outside the allowlist")


def test_torch_dist_fully_reshardable_optimizer_converts_and_loads_in_megatron(tmp_path):
    """torch_dist with the optimizer in megatron-core's model-space form -> torch-format tp1 files with a distributed
    optimizer, which megatron-core loads with every parameter's state bitwise the saved one. One bucket per buffer:
    megatron-core 0.16.1's own fully_reshardable save misplaces the state of parameters past the first bucket
    (see megatron_distopt_worker.BUCKET)."""
    pytest.importorskip("megatron.core")
    env = {**ENV, "UCP_DISTOPT_BUCKET": "none"}
    spawn(
        ["tests/megatron_distopt_worker.py", "save_dist", str(tmp_path / "src"), str(tmp_path / "saved")], 4, 300, env
    )
    report = convert(str(tmp_path / "src"), str(tmp_path / "tp1"), from_layout="torch_dist", to_layout="tp1")
    assert report.dropped == ()
    spawn(["tests/megatron_distopt_worker.py", "load", str(tmp_path / "tp1"), str(tmp_path / "loaded")], 2, 300, env)
    saved, loaded = assemble(tmp_path / "saved", 4), assemble(tmp_path / "loaded", 2)
    assert set(saved) == set(loaded)
    assert_same_states(loaded, saved)
    # through ucp's format: the same files
    convert(str(tmp_path / "src"), str(tmp_path / "u"), from_layout="torch_dist", to_layout="universal")
    convert(str(tmp_path / "u"), str(tmp_path / "from_u"), from_layout="universal", to_layout="tp1")
    assert_bitwise_equal(files_of(tmp_path / "from_u"), files_of(tmp_path / "tp1"), "via universal")


def test_deprecated_torch_dist_optimizer_forms_are_named_not_carried(tmp_path):
    """megatron-core 0.16.1 still saves the deprecated `dp_zero_gather_scatter` form (each model-parallel rank's
    gathered distrib_optim.pt content as one object): ucp converts the model and names the optimizer as not
    carried. The other deprecated form, `fully_sharded_model_space` (the default without a sharding type in the
    metadata), megatron-core 0.16.1 cannot save at all: its ShardedTensor refuses the flattened range the form
    needs, on any device, so there is no such checkpoint to read (should a later megatron-core save one, this
    fails and ucp should learn to read it)."""
    pytest.importorskip("megatron.core")
    worker, env = "tests/megatron_distopt_worker.py", {**ENV, "UCP_DISTOPT_SAVE": "1,1,1"}
    spawn(
        [worker, "save_dist", str(tmp_path / "src"), str(tmp_path / "s")],
        1,
        300,
        {**env, "UCP_DISTOPT_SHARDING": "dp_zero_gather_scatter"},
    )
    report = convert(str(tmp_path / "src"), str(tmp_path / "tp1"), from_layout="torch_dist", to_layout="tp1")
    assert report.dropped == ("optimizer",)
    saved = torch.load(f"{tmp_path / 's'}.0", weights_only=True)
    written = load_rank_file(tmp_path / "tp1" / ITER / "mp_rank_00" / RANK_FILE)
    assert "optimizer" not in written
    name = "decoder.layers.1.self_attention.linear_qkv.weight"
    weight = written["model"][name]
    assert torch.equal(weight.reshape(-1), saved[name]["param"].to(weight.dtype))  # (the bf16 copy of its master)
    with pytest.raises(AssertionError, match="ShardedTensor.flattened_range is not supported"):
        spawn(
            [worker, "save_dist", str(tmp_path / "fs"), str(tmp_path / "s2")],
            1,
            300,
            {**env, "UCP_DISTOPT_SHARDING": "fully_sharded_model_space"},
        )


# megatron-core's layout (TP, PP, EP) -> ucp's name for its rank files (each a 4-rank job)
DP_RESHARDABLE_LAYOUTS = {"1,2,2": "tp1pp2ep2", "2,2,1": "tp2pp2", "2,1,2": "tp2ep2"}


@pytest.mark.parametrize("saved_in", DRAW.sample(sorted(DP_RESHARDABLE_LAYOUTS), 1))
def test_torch_dist_dp_reshardable_optimizer_converts_to_megatrons_own_files(tmp_path, saved_in):
    """Megatron-LM's default torch_dist optimizer form keeps each model-parallel rank's flat buckets. megatron-core
    takes the same step twice in layout A (several buckets on the first stage; TP shards with values of their own)
    and saves it in the torch_dist format (dp_reshardable) and in the torch format (distrib_optim.pt). ucp converts
    the torch_dist checkpoint to A's torch format: every distrib_optim.pt and model is bitwise megatron-core's own.
    To tp1, it gives the same files as the torch-format source (which megatron-core loads: the tests above); back to
    torch_dist, megatron-core in ep2 loads the same state from it. The torch-format source written by ucp into
    torch_dist in that form for A (`target_layout`) is megatron-core's own dp_reshardable save."""
    pytest.importorskip("megatron.core")
    env = {**ENV, "UCP_DISTOPT_SAVE": saved_in}
    layout = DP_RESHARDABLE_LAYOUTS[saved_in]
    worker = "tests/megatron_distopt_worker.py"
    spawn([worker, "save", str(tmp_path / "torch"), str(tmp_path / "s1")], 4, 300, env)
    spawn(
        [worker, "save_dist", str(tmp_path / "dist"), str(tmp_path / "s2")],
        4,
        300,
        {**env, "UCP_DISTOPT_SHARDING": "dp_reshardable"},
    )
    report = convert(str(tmp_path / "dist"), str(tmp_path / "back"), from_layout="torch_dist", to_layout=layout)
    assert report.dropped == ()
    ours, megatrons = files_of(tmp_path / "back"), files_of(tmp_path / "torch")
    assert sorted(ours) == sorted(megatrons)
    for d in ours:
        assert_bitwise_equal(ours[d][DISTRIB_OPTIM_FILE], megatrons[d][DISTRIB_OPTIM_FILE], f"{d}/{DISTRIB_OPTIM_FILE}")
        assert_bitwise_equal(ours[d][RANK_FILE]["model"], megatrons[d][RANK_FILE]["model"], f"{d}/{RANK_FILE}")
    convert(str(tmp_path / "dist"), str(tmp_path / "tp1_dist"), from_layout="torch_dist", to_layout="tp1")
    convert(str(tmp_path / "torch"), str(tmp_path / "tp1_torch"), from_layout=layout, to_layout="tp1")
    assert_bitwise_equal(files_of(tmp_path / "tp1_dist"), files_of(tmp_path / "tp1_torch"), "tp1")
    # torch_dist in A -> (ucp) -> torch_dist, loaded by megatron-core in ep2 with dist_checkpointing.load: the same
    # state as its load of the tp1 files above (an entry for EP 2 also where A had none: --target-ep)
    convert(str(tmp_path / "dist"), str(tmp_path / "u"), from_layout="torch_dist", to_layout="universal")
    convert(str(tmp_path / "u"), str(tmp_path / "redist"), from_layout="universal", to_layout="torch_dist", target_ep=2)
    spawn([worker, "load", str(tmp_path / "tp1_dist"), str(tmp_path / "l1")], 2, 300, env)
    spawn(
        [worker, "load_dist", str(tmp_path / "redist"), str(tmp_path / "l2")],
        2,
        300,
        {**env, "UCP_DISTOPT_LOAD": "1,1,2"},
    )
    via_files, via_dist = assemble(tmp_path / "l1", 2), assemble(tmp_path / "l2", 2)
    assert set(via_files) == set(via_dist) and len(via_files) > 20
    assert_same_states(via_dist, via_files)
    # the torch-format source written by ucp in that form for layout A: megatron-core's own dp_reshardable save
    convert(
        str(tmp_path / "torch"),
        str(tmp_path / "ours"),
        from_layout=layout,
        to_layout="torch_dist",
        target_layout=layout,
    )
    assert_megatrons_own_buckets(tmp_path / "ours", tmp_path / "dist", layout)
    damaged_dp_reshardable_is_refused(tmp_path / "dist", tmp_path)


def damaged_dp_reshardable_is_refused(src: Path, tmp: Path) -> None:
    """A bucket of another size (other bucketing), a missing bucket, a missing param-group object and param groups
    with a decoupled LR are clear errors naming the file and the key; nothing is left at the destination."""
    from dataclasses import replace

    from torch.distributed.checkpoint.metadata import MetadataIndex

    from ucp.interop.dcp import METADATA, read_metadata

    iter_dir = src / ITER
    original = (iter_dir / METADATA).read_bytes()
    # the first stage's buffer (several buckets), its last bucket
    pattern = r"((chained_0\.)?optimizer\.distributed\.dp_group_idx_0)\.gbuf_idx_0\.dtype_.*\.bucket_idx_(\d+)\.exp_avg"
    found = [m for k in read_metadata(iter_dir).state_dict_metadata if (m := re.fullmatch(pattern, k))]
    last = max(found, key=lambda m: int(m.group(3)))
    group, n = last.group(1), int(last.group(3))
    assert n >= 1
    bucket = last.group(0).removesuffix(f".bucket_idx_{n}.exp_avg")

    def refused(change, match: str) -> None:
        metadata = read_metadata(iter_dir)
        change(metadata)
        (iter_dir / METADATA).write_bytes(pickle.dumps(metadata))
        dst = tmp / f"refused{random.randrange(10**9)}"
        try:
            with pytest.raises(InteropError, match=match):
                convert(str(src), str(dst), from_layout="torch_dist", to_layout="tp1")
            assert not dst.exists()
        finally:
            (iter_dir / METADATA).write_bytes(original)

    def resize(m) -> None:
        m.state_dict_metadata[f"{bucket}.bucket_idx_{n}.exp_avg"].size = torch.Size([4096])

    def drop_bucket(m) -> None:
        for k in ("param", "exp_avg", "exp_avg_sq"):
            del m.state_dict_metadata[f"{bucket}.bucket_idx_{n}.{k}"]

    def drop_groups(m) -> None:
        del m.storage_data[MetadataIndex(f"{group}.optimizer/shard_0_1")]

    def decoupled_groups(m) -> None:
        # the param-group object rewritten (appended to its data file, the metadata pointing there)
        index = MetadataIndex(f"{group}.optimizer/shard_0_1")
        info = m.storage_data[index]
        path = iter_dir / info.relative_path
        blob = path.read_bytes()[info.offset : info.offset + info.length]
        stored = torch.load(io.BytesIO(blob), weights_only=False)  # (megatron-core keeps the object in a list of one)
        decouple(stored[0]["param_groups"])
        buf = io.BytesIO()
        torch.save(stored, buf)
        with path.open("ab") as f:
            m.storage_data[index] = replace(info, offset=f.tell(), length=len(buf.getvalue()))
            f.write(buf.getvalue())

    refused(resize, re.escape(f"{bucket}.bucket_idx_{n}.exp_avg is a tensor of [4096] float32"))
    refused(decoupled_groups, re.escape(f"{group}.optimizer: optimizer param groups") + ".* not Megatron-Core's")
    refused(drop_bucket, re.escape(f"{group}.gbuf_idx_0 has buckets {list(range(n))}, but megatron-core's buffer"))
    refused(drop_groups, re.escape(f"no param groups in {group}.optimizer"))


@pytest.mark.parametrize("overridden", ["decoupled", "lr_mult"])
def test_torch_dist_param_groups_ucp_does_not_know_are_refused(distopt, tmp_path, overridden):
    """A torch_dist checkpoint's optimizer (fully_reshardable) with a param group other than Megatron-Core's
    standard ones (megatron-core 0.16's decoupled-LR group, an older one's lr_mult override) is a clear error
    naming common.pt: its groups' hyperparameters could not be carried to the right parameters."""
    from ucp.interop.megatron.dist import COMMON

    src, _ = distopt
    dist = tmp_path / "dist"
    convert(str(src), str(dist), from_layout=SOURCE, to_layout="torch_dist")
    common = dist / ITER / COMMON
    data = torch.load(common, weights_only=False)
    groups = data["optimizer"][0]["optimizer"]["param_groups"]
    if overridden == "decoupled":
        decouple(groups)
    else:
        groups[0]["lr_mult"] = 0.5
    torch.save(data, common)
    dst = tmp_path / "out"
    with pytest.raises(InteropError, match=rf"{ITER}/{COMMON}: optimizer param groups .* not Megatron-Core's standard"):
        convert(str(dist), str(dst), from_layout="torch_dist", to_layout="tp1")
    assert not dst.exists()


def load_dist(ckpt: Path, out: Path, layout: str, processes: int, env: dict[str, str]) -> dict[str, dict]:
    """A megatron-core job of `layout` ("TP,PP,EP[,VPP]") on `processes` loads the torch_dist checkpoint CKPT as
    Megatron-LM does (megatron_distopt_worker load_dist); each parameter's whole state, as it holds it."""
    spawn(
        ["tests/megatron_distopt_worker.py", "load_dist", str(ckpt), str(out)],
        processes,
        300,
        {**env, "UCP_DISTOPT_LOAD": layout},
    )
    return assemble(out, processes)


# a job that loads a torch_dist checkpoint ucp wrote: its (TP, PP, EP) and process count
TORCH_DIST_LOADS = {"1,1,2": 2, "1,2,1": 2, "1,2,2": 4, "1,1,1": 2, "2,1,1": 2, "2,2,1": 4}


@pytest.mark.parametrize("load_in", DRAW.sample(sorted(TORCH_DIST_LOADS), 2))
def test_the_distributed_optimizer_written_into_torch_dist_loads_in_megatron(distopt, tmp_path, load_in):
    """ucp writes the torch-format source's distributed optimizer into torch_dist (fully_reshardable, its entry
    made for the loading job's EP); megatron-core in another layout loads it as Megatron-LM does (sharded state
    dicts from the checkpoint's content_metadata, then load_state_dict): every parameter's master weight and
    moments are bitwise the saved ones, under the saved learning rates. Through ucp's format: the same tensors."""
    src, saved = distopt
    ep = int(load_in.split(",")[2])
    dist = tmp_path / "dist"
    report = convert(str(src), str(dist), from_layout=SOURCE, to_layout="torch_dist", target_ep=ep)
    assert report.dropped == ()
    loaded = load_dist(dist, tmp_path / "loaded", load_in, TORCH_DIST_LOADS[load_in], ENV)
    assert set(loaded) == set(saved)
    assert_same_states(loaded, saved)
    info = torch.load(f"{tmp_path / 'loaded'}.0", weights_only=True)
    assert info["__optimizers__"] == (2 if ep > 1 else 1)  # (a dense and an expert optimizer only with EP > 1)
    entry = load_rank_file(src / ITER / "mp_rank_00_000_000" / RANK_FILE)["optimizer"]
    saved_lr = {
        g["lr"] for e in (entry if isinstance(entry, list) else [entry]) for g in e["optimizer"]["param_groups"]
    }
    assert set(info["__lr__"]) == saved_lr  # (the param groups' hyperparameters are the saved ones)
    # through ucp's format: the same tensors in the same file
    convert(str(src), str(tmp_path / "u"), from_layout=SOURCE, to_layout="universal")
    convert(str(tmp_path / "u"), str(tmp_path / "via_u"), from_layout="universal", to_layout="torch_dist", target_ep=ep)
    data = f"{ITER}/__0_0.distcp"
    assert (tmp_path / "via_u" / data).read_bytes() == (dist / data).read_bytes()


# Megatron-LM's default torch_dist form (dp_reshardable) written by ucp for a loading job's layout


def bucket_tensors(iter_dir: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Every dp_reshardable bucket tensor of a torch_dist iteration (read whole with torch's DCP reader) and every
    optimizer object (param groups, bucket sizes), by key."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

    from ucp.interop.dcp import read_metadata
    from ucp.interop.megatron.dist import DistTensors

    metadata = read_metadata(iter_dir)
    entries = metadata.state_dict_metadata
    tensors = {
        k: torch.empty(e.size, dtype=e.properties.dtype)
        for k, e in entries.items()
        if isinstance(e, TensorStorageMetadata) and ".bucket_idx_" in k
    }
    dcp.load(tensors, checkpoint_id=str(iter_dir), no_dist=True)
    reader = DistTensors(iter_dir, metadata)
    objects = {k: reader.obj(k) for k, e in entries.items() if isinstance(e, BytesStorageMetadata) and "optimizer" in k}
    return tensors, objects


def parameter_spans(config: Any, layout: Any, bucket_size: int | None) -> dict[tuple[str, int], list[tuple[int, int]]]:
    """Where parameters lie in each dp_reshardable bucket of a job of `layout`: (the grad buffer's key prefix
    `[chained_I.]optimizer.distributed.dp_group_idx_<I>.gbuf_idx_<G>`, bucket) -> [start, end) of each."""
    from ucp.interop.megatron.distrib_optim import grad_buffers

    spans: dict[tuple[str, int], list[tuple[int, int]]] = {}
    for rank in range(layout.world_size):
        c = layout.coords(rank)
        optimizers = grad_buffers(config, layout, rank, bucket_size)
        for i, buffers in enumerate(optimizers):
            idx = c.tp + layout.tp * ((c.ep + layout.ep * c.pp) if i == 1 else c.pp)
            chained = f"chained_{i}." if len(optimizers) > 1 else ""
            for g, buffer in enumerate(buffers):
                for slot in buffer.slots:
                    at = (f"{chained}optimizer.distributed.dp_group_idx_{idx}.gbuf_idx_{g}", slot.bucket)
                    spans.setdefault(at, []).append((slot.bucket_offset, slot.bucket_offset + slot.param.numel))
    return spans


def assert_megatrons_own_buckets(ours: Path, megatrons: Path, layout: str) -> None:
    """ucp's dp_reshardable torch_dist for `layout` holds megatron-core's own save in that layout: the same keys,
    objects (param groups, bucket sizes) and common.pt entries, and every parameter's values in every bucket
    bitwise (between parameters megatron-core saves the uninitialised memory of its alignment padding, ucp zeros)."""
    from ucp.interop.megatron.args import bucket_size_of
    from ucp.interop.megatron.dist import COMMON, open_torch_dist
    from ucp.interop.megatron.save import parse_megatron_layout

    ours_t, ours_o = bucket_tensors(ours / ITER)
    theirs_t, theirs_o = bucket_tensors(megatrons / ITER)
    assert sorted(ours_t) == sorted(theirs_t) and len(ours_t) > 10
    assert ours_o == theirs_o
    common = [torch.load(d / ITER / COMMON, weights_only=False) for d in (ours, megatrons)]
    assert common[0]["optimizer"] == common[1]["optimizer"]
    assert common[0]["content_metadata"]["distrib_optim_sharding_type"] == "dp_reshardable"
    source = open_torch_dist(megatrons)
    spans = parameter_spans(source.config, parse_megatron_layout(layout), bucket_size_of(source.args))
    for key, theirs in theirs_t.items():
        m = re.fullmatch(r"(.+\.gbuf_idx_\d+)\.dtype_.+\.bucket_idx_(\d+)\.\w+", key)
        assert m is not None, key
        held = torch.zeros(theirs.numel(), dtype=torch.bool)
        for lo, hi in spans[(m[1], int(m[2]))]:
            held[lo:hi] = True
        assert torch.equal(ours_t[key][held], theirs[held]), key
        assert not ours_t[key][~held].any(), key


# (TP, PP, EP[, VPP]) a job saves in with 4 processes -> processes of the job in that layout that resumes; one KV head
# in 4 query heads, below TP 2 (the ranks of the query group share it)
RESUMED = {"2,1,1": 2, "1,2,1,2": 2, "2,1,2": 4, "1,2,2": 4}
RESUME_ENV = {**ENV, "UCP_MEGATRON_SHAPE": "36,52,4,4,4,1", "UCP_DISTOPT_NEXT": "1"}


def _processes(layout: str) -> int:
    tp, pp, ep = (int(x) for x in layout.split(",")[:3])
    return tp * pp * ep  # (the fewest a job of that layout runs on: DP = EP)


@pytest.mark.parametrize("layout", DRAW.sample(sorted(RESUMED), 2))
def test_torch_dist_in_megatron_lms_default_form_resumes_with_the_saving_jobs_next_step(tmp_path, layout):
    """A job of megatron-core's distributed optimizer in layout A (DP 2) takes a step, saves torch-format files,
    then takes the next step. ucp converts the files, through its own format, to torch_dist with the optimizer in
    Megatron-LM's default form for A (`--target-layout`); a job in A with another DP (the form is DP-reshardable)
    loads it as Megatron-LM does and holds every parameter's master weight and moments bitwise as saved, and its
    next step on the same gradients gives bitwise the saving job's next state."""
    env = {**RESUME_ENV, "UCP_DISTOPT_SAVE": layout}
    tp, pp, ep, *vpp = (int(x) for x in layout.split(","))
    name = f"tp{tp}pp{pp}" + (f"vpp{vpp[0]}" if vpp else "") + (f"ep{ep}" if ep > 1 else "")
    src, saved = save(tmp_path, env)
    following = assemble(tmp_path / "saved.next", 4)
    convert(str(src), str(tmp_path / "u"), from_layout=name, to_layout="universal")
    report = convert(
        str(tmp_path / "u"), str(tmp_path / "dist"), from_layout="universal", to_layout="torch_dist", target_layout=name
    )
    assert report.dropped == ()
    # straight from the files: the same data file
    convert(str(src), str(tmp_path / "direct"), from_layout=name, to_layout="torch_dist", target_layout=name)
    data = f"{ITER}/__0_0.distcp"
    assert (tmp_path / "direct" / data).read_bytes() == (tmp_path / "dist" / data).read_bytes()
    processes = RESUMED[layout]
    loaded = load_dist(tmp_path / "dist", tmp_path / "loaded", layout, processes, env)
    resumed = assemble(tmp_path / "loaded.next", processes)
    assert set(loaded) == set(saved) == set(resumed) and len(saved) > 20
    assert_same_states(loaded, saved)
    assert_same_states(resumed, following)
    assert any(not torch.equal(following[n]["param"], saved[n]["param"]) for n in saved)  # (a step was taken)


def test_virtual_pipeline_stages_distributed_optimizer_against_megatron_core(tmp_path):
    """megatron-core's distributed optimizer with virtual pipeline stages (tp1pp2vpp2, 4 layers, DP 2: each rank two
    model chunks, a grad buffer each, only the first bucketed) saves torch-format files and, for the same step,
    torch_dist in the dp_reshardable form. ucp reads both: to tp1, the two give the same files, which a DP 2
    megatron-core job loads with every parameter's state as saved; back to tp1pp2vpp2, every file is bitwise the
    source's; written for tp1pp2vpp2 in the dp_reshardable form, it is megatron-core's own save."""
    env = {**ENV, "UCP_MEGATRON_SHAPE": "36,52,4,4,4,2", "UCP_DISTOPT_SAVE": "1,2,1,2"}
    layout = "tp1pp2vpp2"
    src, saved = save(tmp_path, env)
    worker = "tests/megatron_distopt_worker.py"
    spawn(
        [worker, "save_dist", str(tmp_path / "dist"), str(tmp_path / "s2")],
        4,
        300,
        {**env, "UCP_DISTOPT_SHARDING": "dp_reshardable"},
    )
    assert_same_states(assemble(tmp_path / "s2", 4), saved)  # (the same step)
    convert(str(src), str(tmp_path / "tp1"), from_layout=layout, to_layout="tp1")
    convert(str(tmp_path / "dist"), str(tmp_path / "tp1_dist"), from_layout="torch_dist", to_layout="tp1")
    assert_bitwise_equal(files_of(tmp_path / "tp1_dist"), files_of(tmp_path / "tp1"), "tp1 from torch_dist")
    spawn([worker, "load", str(tmp_path / "tp1"), str(tmp_path / "loaded")], 2, 300, env)
    loaded = assemble(tmp_path / "loaded", 2)
    assert set(loaded) == set(saved) and len(loaded) > 40
    assert_same_states(loaded, saved)
    convert(str(tmp_path / "tp1"), str(tmp_path / "back"), from_layout="tp1", to_layout=layout)
    assert_bitwise_equal(files_of(tmp_path / "back"), files_of(src), f"tp1 -> {layout}")
    convert(str(src), str(tmp_path / "ours"), from_layout=layout, to_layout="torch_dist", target_layout=layout)
    assert_megatrons_own_buckets(tmp_path / "ours", tmp_path / "dist", layout)


@pytest.mark.parametrize("load_in", DRAW.sample(["2,1,1", "2,2,1", "1,1,2", "2,1,2"], 1))
def test_the_default_form_written_for_another_layout_loads_in_megatron(distopt, tmp_path, load_in):
    """The tp1pp2ep2 source's distributed optimizer written into torch_dist in Megatron-LM's default form for another
    layout B: megatron-core in B loads it, every parameter's master weight and moments bitwise as saved."""
    src, saved = distopt
    tp, pp, ep = (int(x) for x in load_in.split(","))
    target = f"tp{tp}pp{pp}" + (f"ep{ep}" if ep > 1 else "")
    convert(str(src), str(tmp_path / "dist"), from_layout=SOURCE, to_layout="torch_dist", target_layout=target)
    loaded = load_dist(tmp_path / "dist", tmp_path / "loaded", load_in, _processes(load_in), ENV)
    assert set(loaded) == set(saved)
    assert_same_states(loaded, saved)
