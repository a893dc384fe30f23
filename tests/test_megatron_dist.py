"""Megatron's torch_dist format (megatron-core dist_checkpointing): read by `ucp convert --from torch_dist`,
written by `--to torch_dist`. megatron-core itself is the oracle (tests/megatron_dist_worker.py): it saves in one
layout, and its own loads, in another, of the source and of what ucp wrote are bitwise the same; torch's DCP
reader is the oracle of the files ucp writes."""

from __future__ import annotations

import io
import pickle
import random
import shutil
from pathlib import Path

import pytest
import torch

import ucp
from ucp import cli as ucp_cli
from ucp.errors import UcpError
from ucp.interop.errors import InteropError, SourceMismatchError
from ucp.interop.megatron.convert import convert
from ucp.interop.megatron.dist import dist_name
from ucp.interop.megatron.files import load_rank_file
from ucp.interop.megatron.save import RANK_FILE, parse_megatron_layout, rank_files
from ucp.sharding.families import LlamaConfig, canonical_atoms
from ucp.sharding.reshard import shard

from .helpers import assert_same_state
from .launch import spawn
from .test_hf import random_full_state, save_in_layout, tiny_config

ITER = "iter_0000003"


def configs() -> dict[str, object]:
    return {
        "mixtral": tiny_config(),
        "llama-qkv-bias-qk-norm": LlamaConfig(
            vocab_size=100,
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            attention_bias=True,
            qk_norm=True,
            make_vocab_size_divisible_by=8,
        ),
    }


def universal(tmp_path: Path, cfg, layout: str = "tp1", seed: int = 0) -> tuple[Path, dict[str, torch.Tensor]]:
    full = random_full_state(cfg, states=(), seed=seed)
    save_in_layout(full, cfg, layout, str(tmp_path / "u"), step=3)
    return tmp_path / "u", full["model"]


@pytest.fixture
def torch_dist(tmp_path):
    src, atoms = universal(tmp_path, tiny_config())
    convert(str(src), str(tmp_path / "td"), from_layout="universal", to_layout="torch_dist")
    return tmp_path / "td", atoms


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize("family", list(configs()))
def test_universal_to_torch_dist_and_back_is_bitwise_and_dcp_reads_megatrons_global_tensors(tmp_path, family):
    cfg = configs()[family]
    rng = random.Random()
    src, atoms = universal(tmp_path, cfg, rng.choice(["tp1", "tp2", "tp2pp2"]), seed=rng.randrange(1000))
    report = convert(str(src), str(tmp_path / "td"), from_layout="universal", to_layout="torch_dist")
    assert report.files == 1 and report.dropped == ()
    it = tmp_path / "td" / ITER
    assert sorted(p.name for p in it.iterdir()) == [".metadata", "__0_0.distcp", "common.pt", "metadata.json"]
    assert (tmp_path / "td" / "latest_checkpointed_iteration.txt").read_text().strip() == "3"

    # torch's own DCP reader: every global tensor, a layer of which is the tensor of a tp1 rank file
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = dcp.FileSystemReader(str(it)).read_metadata()
    full = {
        k: torch.empty(e.size, dtype=e.properties.dtype)
        for k, e in metadata.state_dict_metadata.items()
        if isinstance(e, TensorStorageMetadata)
    }
    dcp.load(full, checkpoint_id=str(it), no_dist=True)
    tp1 = shard({"model": atoms}, cfg, parse_megatron_layout("tp1"), 0, ())["model"]
    for name, t in tp1.items():
        where = dist_name(name)
        for key in where.keys:
            assert torch.equal(full[key][where.index], t), (name, key)

    # back to ucp, and to a Megatron layout: bitwise the atoms
    convert(str(tmp_path / "td"), str(tmp_path / "u2"), from_layout="torch_dist", to_layout="universal")
    got = ucp.load(str(tmp_path / "u2"))["model"]
    assert sorted(got) == sorted(atoms) and all(torch.equal(got[n], atoms[n]) for n in atoms)
    layout = rng.choice(["tp2", "tp2pp2", "tp1pp4"] if family.startswith("llama") else ["tp2", "tp2pp2", "tp1ep2"])
    convert(str(tmp_path / "td"), str(tmp_path / "m"), from_layout="torch_dist", to_layout=layout)
    parsed = parse_megatron_layout(layout)
    for name, rank in rank_files(parsed).items():
        data = load_rank_file(tmp_path / "m" / ITER / name / RANK_FILE)
        assert data["args"].ckpt_format == "torch"
        for chunk, tensors in shard({"model": atoms}, cfg, parsed, rank, ()).items():
            for n, t in tensors.items():
                assert torch.equal(data[chunk][n], t), (layout, name, n)


def _edit_metadata(it: Path, edit) -> None:
    metadata = pickle.loads((it / ".metadata").read_bytes())  # (the test's own file: plain pickle is fine here)
    edit(metadata)
    (it / ".metadata").write_bytes(pickle.dumps(metadata))


def test_bad_torch_dist_sources_are_clear_errors_and_leave_nothing(torch_dist, tmp_path):
    root, _ = torch_dist
    it = root / ITER
    dst = tmp_path / "out"

    def refused(exc, match, from_layout="torch_dist"):
        with pytest.raises(exc, match=match):
            convert(str(root), str(dst), from_layout=from_layout, to_layout="tp2")
        assert not dst.exists()

    refused(SourceMismatchError, "torch_dist format .* use --from torch_dist", from_layout="tp1")
    shutil.copytree(root, tmp_path / "keep")
    # a metadata file naming a path outside the directory
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    def escape(md):
        for index, info in md.storage_data.items():
            md.storage_data[index] = _StorageInfo("../../../etc/passwd", info.offset, info.length)

    _edit_metadata(it, escape)
    refused(InteropError, r"names the data file '../../../etc/passwd'")
    # a chunk missing from the metadata
    shutil.rmtree(root)
    shutil.copytree(tmp_path / "keep", root)

    def drop_chunk(md):
        md.state_dict_metadata["decoder.layers.self_attention.linear_proj.weight"].chunks.pop()

    _edit_metadata(it, drop_chunk)
    refused(InteropError, r"chunks of decoder.layers.self_attention.linear_proj.weight do not cover its slice \[1\]")
    # a truncated data file
    shutil.rmtree(root)
    shutil.copytree(tmp_path / "keep", root)
    data = it / "__0_0.distcp"
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    refused(InteropError, r"__0_0.distcp.*(unreadable|outside)")
    # args that disagree with the metadata's global shapes
    shutil.rmtree(root)
    shutil.copytree(tmp_path / "keep", root)
    common = torch.load(it / "common.pt", weights_only=False)
    common["args"].num_layers = 3
    torch.save(common, it / "common.pt")
    refused(InteropError, r"has global shape \[2, .*in 3 layers")
    # a type outside the allowlist in common.pt is never unpickled
    common["evil"] = io.StringIO
    torch.save(common, it / "common.pt")
    refused(InteropError, "refused to unpickle")
    (it / "common.pt").unlink()
    refused(InteropError, "no common.pt")
    # another sharded backend
    (it / "metadata.json").write_text('{"sharded_backend": "zarr"}')
    refused(InteropError, "sharded backend 'zarr'")
    # garbage for metadata
    shutil.rmtree(root)
    shutil.copytree(tmp_path / "keep", root)
    (it / ".metadata").write_bytes(b"\x80\x04garbage")
    refused(InteropError, r"\.metadata: refused or unreadable DCP metadata")
    # a legacy checkpoint given as torch_dist
    convert(str(tmp_path / "u"), str(tmp_path / "legacy"), from_layout="universal", to_layout="tp2")
    with pytest.raises(SourceMismatchError, match="not in the torch_dist format .* give the layout"):
        convert(str(tmp_path / "legacy"), str(dst), from_layout="torch_dist", to_layout="tp1")
    assert not dst.exists()


def test_cli_convert_torch_dist(torch_dist, tmp_path, capsys):
    root, _ = torch_dist
    argv = ["convert", str(root), str(tmp_path / "m"), "--from", "torch_dist", "--to", "tp2pp2", "--no-progress"]
    assert ucp_cli.main(argv) == 0
    assert "converted 41 atoms from torch_dist to tp2pp2" in capsys.readouterr().out
    assert ucp_cli.main(["convert", str(root), str(tmp_path / "x"), "--from", "tp2", "--to", "tp1"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "use --from torch_dist" in err
    assert not (tmp_path / "x").exists()


def test_target_layout_arguments_are_checked_before_anything_is_read(torch_dist, tmp_path, capsys):
    """--target-layout names the job a --to torch_dist is written for (the optimizer in Megatron-LM's default form):
    refused with another --to, beside --target-ep, malformed or not fitting the model; nothing at DST."""
    from ucp.errors import LayoutError

    root, _ = torch_dist
    dst = tmp_path / "out"
    for kwargs, error, match in (
        ({"to_layout": "tp2", "target_layout": "tp2"}, UcpError, "--target-layout tp2: .* --to tp2 names its own"),
        ({"to_layout": "torch_dist", "target_layout": "tp2", "target_ep": 2}, UcpError, "the layout names its EP"),
        ({"to_layout": "torch_dist", "target_layout": "tp2x"}, LayoutError, "malformed Megatron layout 'tp2x'"),
        ({"to_layout": "torch_dist", "target_layout": "tp3"}, LayoutError, "tp=3 does not divide"),
    ):
        with pytest.raises(error, match=match):
            convert(str(root), str(dst), from_layout="torch_dist", **kwargs)
        assert not dst.exists()
    argv = ["convert", str(root), str(dst), "--from", "torch_dist", "--to", "tp2", "--target-layout", "tp2"]
    assert ucp_cli.main(argv) == 1
    assert capsys.readouterr().err.count("\n") == 1 and not dst.exists()
    # a source without optimizer: the weights, with the target job's args
    convert(str(root), str(dst), from_layout="torch_dist", to_layout="torch_dist", target_layout="tp2pp2")
    args = torch.load(dst / ITER / "common.pt", weights_only=False)["args"]
    assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size) == (2, 2)


def _rank_files(ckpt: Path) -> dict[str, dict]:
    return {d.name: load_rank_file(d / RANK_FILE) for d in sorted((ckpt / ITER).iterdir())}


def test_an_iteration_directory_given_itself_converts_as_its_save_root_does(torch_dist, tmp_path, capsys):
    """`ucp convert ROOT/iter_0000003 OUT --from torch_dist` is `ucp convert ROOT OUT ...` (users point at the
    iteration they mean); the legacy format likewise; an --iteration that is not the directory's is refused."""
    root, _ = torch_dist
    convert(str(root), str(tmp_path / "a"), from_layout="torch_dist", to_layout="tp2pp2")
    argv = ["convert", str(root / ITER), str(tmp_path / "b"), "--from", "torch_dist", "--to", "tp2pp2"]
    assert ucp_cli.main([*argv, "--no-progress"]) == 0
    assert "converted 41 atoms from torch_dist to tp2pp2" in capsys.readouterr().out
    assert_same_state(_rank_files(tmp_path / "b"), _rank_files(tmp_path / "a"))
    # the legacy format's iteration directory, too
    convert(str(tmp_path / "a" / ITER), str(tmp_path / "c"), from_layout="tp2pp2", to_layout="tp1")
    convert(str(tmp_path / "a"), str(tmp_path / "d"), from_layout="tp2pp2", to_layout="tp1")
    assert_same_state(_rank_files(tmp_path / "c"), _rank_files(tmp_path / "d"))
    for src, layout in ((root / ITER, "torch_dist"), (tmp_path / "a" / ITER, "tp2pp2")):
        with pytest.raises(InteropError, match=f"--iteration 5, but {src} is"):
            convert(str(src), str(tmp_path / "x"), from_layout=layout, to_layout="tp1", iteration=5)
        assert not (tmp_path / "x").exists()
    # a directory that is neither
    with pytest.raises(InteropError, match="no latest_checkpointed_iteration.txt, and not an iter_NNNNNNN directory"):
        convert(str(tmp_path / "a" / ITER / "mp_rank_00_000"), str(tmp_path / "x"), from_layout="tp1", to_layout="tp2")


LAYOUTS = [(2, 2), (2, 1), (1, 2), (1, 1)]


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_megatron_loads_what_ucp_converts_from_its_torch_dist_bitwise_as_its_own_reshard(tmp_path):
    """Megatron saves torch_dist in layout A; ucp converts it to a legacy layout B, to ucp and back to torch_dist;
    Megatron, in layout B, loads the source and each conversion: every parameter bitwise the same."""
    rng = random.Random()
    a = rng.choice(LAYOUTS[:3])
    b = rng.choice([lay for lay in LAYOUTS if lay != a])
    env = {"PYTHONWARNINGS": "ignore"}
    src = tmp_path / "src"
    spawn(["tests/megatron_dist_worker.py", "save", *map(str, a), str(src)], a[0] * a[1], timeout=300, env=env)
    legacy = f"tp{b[0]}pp{b[1]}"
    report = convert(str(src), str(tmp_path / "legacy"), from_layout="torch_dist", to_layout=legacy)
    assert report.dropped == ()
    convert(str(src), str(tmp_path / "u"), from_layout="torch_dist", to_layout="universal")
    assert ucp.open_checkpoint(str(tmp_path / "u")).step == 10
    convert(str(tmp_path / "u"), str(tmp_path / "back"), from_layout="universal", to_layout="torch_dist")
    out = tmp_path / "params"
    ckpts = [src, tmp_path / "legacy", tmp_path / "back"]
    spawn(["tests/megatron_dist_worker.py", "load", *map(str, b), str(out), *map(str, ckpts)], b[0] * b[1], 300, env)
    for rank in range(b[0] * b[1]):
        own, *ours = torch.load(f"{out}.{rank}")
        assert len(own) > 5
        for name, got in zip(("legacy " + legacy, "torch_dist"), ours):
            assert sorted(got) == sorted(own)
            bad = [n for n in own if not torch.equal(own[n], got[n])]
            assert not bad, f"A={a} B={b} rank {rank}: {name} differs from Megatron's own load in {bad[:4]}"
    assert len(canonical_atoms(tiny_config())) == report.atoms


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_megatron_at_tp2_loads_a_torch_dist_whose_vocabulary_is_padded_as_at_tp1(tmp_path):
    """With make_vocab_size_divisible_by 8 a vocabulary of 100 is 112 rows at TP 2 and 104 at TP 1, as ucp writes
    torch_dist. Megatron saves torch_dist at TP 2; converted to ucp and back, its TP-2 load of ucp's file (104 rows:
    megatron-core marks the embedding and output layer allow_shape_mismatch, the missing rows load as zeros) gets
    every parameter bitwise as its own load of its own file."""
    env = {"PYTHONWARNINGS": "ignore", "UCP_MEGATRON_DIVISIBLE_BY": "8"}
    src = tmp_path / "src"
    spawn(["tests/megatron_dist_worker.py", "save", "2", "1", str(src)], 2, timeout=300, env=env)
    convert(str(src), str(tmp_path / "u"), from_layout="torch_dist", to_layout="universal")
    convert(str(tmp_path / "u"), str(tmp_path / "back"), from_layout="universal", to_layout="torch_dist")
    import torch.distributed.checkpoint as dcp

    for ckpt, rows in ((src, 112), (tmp_path / "back", 104)):
        metadata = dcp.FileSystemReader(str(ckpt / "iter_0000010")).read_metadata()
        assert metadata.state_dict_metadata["embedding.word_embeddings.weight"].size[0] == rows
    out = tmp_path / "params"
    spawn(["tests/megatron_dist_worker.py", "load", "2", "1", str(out), str(src), str(tmp_path / "back")], 2, 300, env)
    for rank in range(2):
        own, ours = torch.load(f"{out}.{rank}")
        assert sorted(ours) == sorted(own) and all(torch.equal(own[n], ours[n]) for n in own), rank


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_dist_checkpointing_save_without_megatron_lms_args_converts_with_the_models_shape_given(tmp_path, capsys):
    """megatron-core's dist_checkpointing alone saves no args: ucp says in one line what is missing and how to give
    the model's shape; given as the model's Hugging Face config.json or as a JSON of the job's Megatron-LM
    arguments, the conversion gives the atoms of the same model saved by Megatron-LM (with its args)."""
    import json

    from .megatron_worker import megatron_args

    env = {"PYTHONWARNINGS": "ignore", "UCP_MEGATRON_BARE": "1"}
    src = tmp_path / "src"
    spawn(["tests/megatron_dist_worker.py", "save", "2", "1", str(src)], 2, timeout=300, env=env)
    bare = tmp_path / "src-bare"
    assert {"common.pt", "metadata.json", ".metadata"} <= {p.name for p in bare.iterdir()}
    dst = tmp_path / "out"
    with pytest.raises(InteropError, match="holds no Megatron-LM args .* give it with --config FILE"):
        convert(str(bare), str(dst), from_layout="torch_dist", to_layout="universal")
    assert not dst.exists()
    assert ucp_cli.main(["convert", str(bare), str(dst), "--from", "torch_dist", "--to", "tp2"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Hugging Face config.json" in err and not dst.exists()
    convert(str(src), str(tmp_path / "u"), from_layout="torch_dist", to_layout="universal")
    want = ucp.load(str(tmp_path / "u"))["model"]
    cfg = tiny_config()
    hf = {
        "model_type": "mixtral",
        "architectures": ["MixtralForCausalLM"],
        **{k: getattr(cfg, k) for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers")},
        **{k: getattr(cfg, k) for k in ("num_attention_heads", "num_key_value_heads", "num_local_experts")},
        "num_experts_per_tok": 2,
        "tie_word_embeddings": False,
    }
    (tmp_path / "config.json").write_text(json.dumps(hf))
    args = {k: v for k, v in vars(megatron_args()).items() if not isinstance(v, torch.dtype)}
    (tmp_path / "args.json").write_text(json.dumps(args))
    for given in ("config.json", "args.json"):
        out = tmp_path / f"u-{given}"
        argv = ["import", str(bare), str(out), "--from", "megatron-dist", "--config", str(tmp_path / given)]
        assert ucp_cli.main([*argv, "--no-progress"]) == 0, capsys.readouterr().err
        got = ucp.load(str(out))["model"]
        assert sorted(got) == sorted(want) and all(torch.equal(got[n], want[n]) for n in want), given
    # a --config beside Megatron-LM's own args, or with another --from, is refused
    with pytest.raises(InteropError, match="holds Megatron-LM's args, which give the model's shape already"):
        convert(str(src), str(dst), from_layout="torch_dist", to_layout="tp1", model_config=tmp_path / "config.json")
    with pytest.raises(UcpError, match="--from tp2 files have their args"):
        convert(str(src), str(dst), from_layout="tp2", to_layout="tp1", model_config=tmp_path / "config.json")
    assert not dst.exists()
