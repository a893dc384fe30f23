"""Bad input: each case gets a ucp exception naming the problem, a one-line CLI error with a non-zero exit,
and leaves existing data untouched."""

from __future__ import annotations

import hashlib
import json
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ucp
from ucp.format.manifest import COMMIT_MARKER, dumps, step_dirname
from ucp.storage import open_storage

from .helpers import assert_same_state, reseal_manifest, step_path

OPTIONS = ucp.SaveOptions(
    chunking=ucp.ChunkingPolicy(object_bytes=16 * 1024, inner_bytes=4 * 1024, pack_below=0), fsync=False
)


def snapshot(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ucp", *args], capture_output=True, text=True, check=False)


@pytest.fixture
def ckpt(tmp_path):
    root = tmp_path / "ckpt"
    state = {"model": {"w": torch.randn(64, 64), "b": torch.randn(64)}, "step": 3}
    ucp.save(state, str(root), step=3, options=OPTIONS)
    return root, state


def step_dir(root: Path) -> Path:
    """The committed step 3's group (its attempt's directory)."""
    return step_path(root, 3)


def assert_cli_error(result: subprocess.CompletedProcess, *fragments: str) -> None:
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ucp: error: "), result.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def test_url_that_does_not_exist(tmp_path):
    with pytest.raises(ucp.CheckpointNotFoundError, match="does not exist"):
        ucp.load(str(tmp_path / "nope"))
    assert_cli_error(run_cli("inspect", str(tmp_path / "nope")), "does not exist")


def test_url_that_is_not_a_checkpoint(tmp_path):
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(ucp.CheckpointNotFoundError, match="no committed ucp checkpoint"):
        ucp.load(str(tmp_path))
    assert_cli_error(run_cli("verify", str(tmp_path)), "no committed ucp checkpoint")


def test_uncommitted_step(ckpt):
    root, _ = ckpt
    storage = open_storage(str(root))
    storage.delete(f"{step_dirname(3)}/{COMMIT_MARKER}")
    with pytest.raises(ucp.CheckpointNotFoundError, match="uncommitted steps present: \\[3\\]"):
        ucp.load(str(root))
    with pytest.raises(ucp.CheckpointNotFoundError, match="step 3 .* is not committed"):
        ucp.load(str(root), step=3)
    assert_cli_error(run_cli("inspect", str(root), "--step", "3"), "not committed")


def _a_chunk(root: Path) -> Path:
    return max((step_dir(root) / "model" / "w").glob("c.*"))


@pytest.mark.parametrize("damage", ["truncate", "bitflip"])
def test_damaged_chunk(ckpt, damage):
    root, _ = ckpt
    chunk = _a_chunk(root)
    data = bytearray(chunk.read_bytes())
    if damage == "truncate":
        data = data[: len(data) - 100]
    else:
        data[len(data) // 2] ^= 0x10
    chunk.write_bytes(bytes(data))
    before = snapshot(root)
    key = str(chunk.relative_to(step_dir(root) / "model" / "w"))
    with pytest.raises(ucp.IntegrityError, match=f"atom 'model/w' chunk {key}"):
        ucp.load(str(root))
    result = run_cli("verify", str(root))
    assert result.returncode == 1
    assert f"atom 'model/w' chunk {key}" in result.stdout and "1 problem" in result.stdout
    assert snapshot(root) == before


def test_missing_atom(ckpt):
    import shutil

    root, _ = ckpt
    shutil.rmtree(step_dir(root) / "model" / "b")
    with pytest.raises(ucp.IntegrityError, match="atom 'model/b' chunk .* is missing"):
        ucp.load(str(root))
    result = run_cli("verify", str(root))
    assert result.returncode == 1 and "model/b" in result.stdout


def test_hand_edited_atom_metadata(ckpt):
    """ucp plans reads from the committed manifest, so loads still return the saved values; an atom zarr.json
    that disagrees with it would mislead other Zarr readers, and `ucp verify` says which atom and field."""
    root, state = ckpt
    meta_file = step_dir(root) / "model" / "w" / "zarr.json"
    doc = json.loads(meta_file.read_text())
    doc["shape"] = [32, 128]
    meta_file.write_text(json.dumps(doc))
    assert_same_state(state, ucp.load(str(root)))
    result = run_cli("verify", str(root))
    assert result.returncode == 1 and "atom 'model/w': zarr.json says shape = [32, 128]" in result.stdout
    doc["shape"], doc["data_type"] = [64, 64], "float16"
    meta_file.write_text(json.dumps(doc))
    result = run_cli("verify", str(root))
    assert result.returncode == 1 and "data_type" in result.stdout


def test_hand_edited_manifest(ckpt):
    root, _ = ckpt
    manifest = step_dir(root) / "zarr.json"
    doc = json.loads(manifest.read_text())
    doc["attributes"]["ucp"]["layout"] = "tp8"
    manifest.write_text(json.dumps(doc))
    with pytest.raises(ucp.FormatError, match="modified after the step was committed"):
        ucp.load(str(root))
    assert_cli_error(run_cli("inspect", str(root)), "modified after the step was committed")


def test_hand_edited_index_part(ckpt):
    """Format 3.1's atom records lie in index parts, each bound by its size and checksum in the manifest (which the
    marker binds): an edited part is refused as an edited manifest is."""
    root, _ = ckpt
    part = step_dir(root) / "ucp-index" / "atoms-0.json"
    doc = json.loads(part.read_text())
    doc["dtypes"] = ["int32" for _ in doc["dtypes"]]
    part.write_text(json.dumps(doc))
    with pytest.raises(ucp.FormatError, match="atoms-0.json is not the one the manifest records.*modified after"):
        ucp.load(str(root))
    assert_cli_error(run_cli("inspect", str(root)), "modified after the step was committed")


def test_newer_major_format_version(ckpt):
    root, _ = ckpt
    storage = open_storage(str(root))
    doc = json.loads((step_dir(root) / "zarr.json").read_text())
    doc["attributes"]["ucp"]["format_version"] = "4.0"
    reseal_manifest(root, doc, 3)
    with pytest.raises(ucp.UnsupportedVersionError, match="format 4.0.*reads major version 3"):
        ucp.load(str(root))
    marker = json.loads((root / step_dirname(3) / COMMIT_MARKER).read_text())
    marker.update(format_version="4.0")
    storage.delete(f"{step_dirname(3)}/{COMMIT_MARKER}")
    storage.write(f"{step_dirname(3)}/{COMMIT_MARKER}", [dumps(marker)])
    with pytest.raises(ucp.UnsupportedVersionError, match="format 4.0.*reads major version 3"):
        ucp.load(str(root), step=3)
    assert_cli_error(run_cli("inspect", str(root), "--step", "3"), "4.0")


@pytest.mark.parametrize("key", ["../escape", "/abs", "a/b", "..", ".", "", "__reserved", "zarr.json", "back\\slash"])
def test_names_that_would_escape_or_collide(ckpt, key):
    root, _ = ckpt
    before = snapshot(root)
    with pytest.raises(ucp.StateError, match="key"):
        ucp.save({"model": {key: torch.ones(1)}}, str(root), step=4)
    with pytest.raises(ucp.StateError):
        ucp.save({key: torch.ones(1)}, str(root), step=4)
    assert snapshot(root) == before


@pytest.mark.parametrize("leaf", [object(), {1, 2}, b"bytes", torch.nn.Linear(1, 1), 1 + 2j])
def test_unsupported_leaf_type(ckpt, leaf):
    root, _ = ckpt
    before = snapshot(root)
    with pytest.raises(ucp.StateError, match=r"state\['extra'\]: values of type"):
        ucp.save({"model": {"w": torch.ones(1)}, "extra": leaf}, str(root), step=4)
    assert snapshot(root) == before


def test_unsupported_tensor_dtype(ckpt):
    root, _ = ckpt
    before = snapshot(root)
    with pytest.raises(ucp.StateError, match="complex64"):
        ucp.save({"z": torch.zeros(2, dtype=torch.complex64)}, str(root), step=4)
    assert snapshot(root) == before


@pytest.mark.parametrize(
    ("make", "says"),
    [
        (lambda: torch.eye(3).to_sparse(), "sparse_coo tensor"),
        (lambda: torch.eye(3).to_sparse_csr(), "sparse_csr tensor"),
        (lambda: torch.empty(3, 4, device="meta"), "meta device"),
    ],
)
@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
def test_tensors_without_dense_values_are_named(ckpt, make, says):
    root, _ = ckpt
    before = snapshot(root)
    with pytest.raises(ucp.StateError, match=rf"state\['model'\]\['w'\] is .*{says}"):
        ucp.save({"model": {"w": make(), "b": torch.ones(2)}}, str(root), step=4)
    with ucp.CheckpointManager(str(root), mode="async") as manager, pytest.raises(ucp.StateError, match=says):
        manager.save(4, {"w": make()})
    assert snapshot(root) == before


def test_bad_cli_arguments(ckpt):
    root, _ = ckpt
    assert_cli_error(run_cli("inspect", str(root), "--step", "three"), "--step")
    assert_cli_error(run_cli("inspect", "memory://nothing", "-o", "novalue"), "KEY=VALUE")
    assert_cli_error(
        run_cli("inspect", str(root), "-o", "endpoint_url=x"), "-o/--storage-option endpoint_url=x applies only"
    )
    assert run_cli("nosuchcommand").returncode == 2


@pytest.mark.parametrize(
    "argv",
    [
        ["import", "SRC", "DST", "--from", "hf", "--step", "-1"],
        ["import", "SRC", "DST", "--from", "dcp", "--step=-7"],
        ["convert", "SRC", "DST", "--from", "tp2", "--to", "universal", "--step", "-3"],
        ["convert", "SRC", "DST", "--from", "tp2", "--to", "universal", "--iteration", "-3"],
        ["export", "SRC", "--to", "hf", "DST", "--step", "-1"],
    ],
)
def test_a_negative_step_is_refused_in_one_line_and_writes_nothing(tmp_path, argv):
    """(It once wrote step_-0000001, which nothing can read.)"""
    argv = [str(tmp_path / a) if a in ("SRC", "DST") else a for a in argv]
    result = run_cli(*argv)
    assert result.returncode == 2 and "non-negative integer" in result.stderr, result.stderr
    assert not (tmp_path / "DST").exists()


def test_a_negative_step_is_refused_by_every_save(tmp_path):
    from ucp.interop.hf import import_hf

    with pytest.raises(ucp.StateError, match=r"a step must be an integer in \[0, 2\^63 - 1\]"):
        ucp.save({"w": torch.ones(2)}, str(tmp_path / "a"), step=-5)
    with pytest.raises(ucp.StateError, match=r"a step must be an integer in \[0, 2\^63 - 1\]"):
        ucp.CheckpointManager(str(tmp_path / "b")).save(-1, {"w": torch.ones(2)})
    from .test_hf import save_hf

    src, _ = save_hf(tmp_path)
    with pytest.raises(ucp.StateError, match=r"a step must be an integer in \[0, 2\^63 - 1\]"):
        import_hf(src, str(tmp_path / "c"), step=-1)
    assert not (tmp_path / "c").exists() and not (tmp_path / "b" / "step_-0000001").exists()


@pytest.mark.parametrize(
    "make",
    [
        lambda: ucp.SaveOptions(io_threads=0),
        lambda: ucp.SaveOptions(io_threads=-3),
        lambda: ucp.SaveOptions(io_threads=True),
        lambda: ucp.ChunkingPolicy(object_bytes=0),
        lambda: ucp.ChunkingPolicy(inner_bytes=-1),
        lambda: ucp.ChunkingPolicy(object_bytes=2.5),
    ],
)
def test_options_out_of_range_are_refused_where_they_are_made(make):
    with pytest.raises(ValueError, match=r"(io_threads|object_bytes|inner_bytes) must be"):
        make()


def test_a_root_that_is_a_file_or_of_no_known_protocol_is_named(tmp_path):
    root = tmp_path / "a-file"
    root.write_text("not a directory")
    with pytest.raises(ucp.StorageError, match=f"{root} is not a directory"):
        ucp.save({"w": torch.ones(2)}, str(root), step=0)
    assert root.read_text() == "not a directory"
    with pytest.raises(ucp.StorageError, match="nosuch://x/y: no storage for nosuch://"):
        ucp.save({"w": torch.ones(2)}, "nosuch://x/y", step=0)
    assert_cli_error(run_cli("inspect", "nosuch://x/y"), "no storage for nosuch://")
    # (file systems that connect or open their container when made: their errors were tracebacks)
    for url, says in [
        ("ftp://127.0.0.1:1/ck", "cannot open ftp://127.0.0.1:1/ck: ConnectionRefusedError"),
        (f"zip://a::{root}", f"cannot open zip://a::{root}: BadZipFile"),
        ("s3://", "s3:// names no bucket"),
    ]:
        with pytest.raises(ucp.UcpError, match=re.escape(says)):
            ucp.load(url)
        assert_cli_error(run_cli("inspect", url), says)
    convert = ("convert", str(tmp_path), str(tmp_path / "out"), "--from", "tp1", "--to", "tp2")
    for option, value, says in [
        ("--workers", "0", "must be at least 1"),
        ("--memory-budget", "0", "must be positive"),
        ("--memory-budget", "-5MiB", "must be positive"),
        ("--memory-budget", "infGiB", "not a size"),
    ]:
        out = run_cli(*convert, f"{option}={value}")  # (with "=": "-5MiB" would read as an option)
        assert out.returncode == 2 and f"{option}: {says}" in out.stderr, out.stderr
    assert not (tmp_path / "out").exists()


def test_an_output_inside_its_source_or_holding_it_is_refused(ckpt, tmp_path):
    """`ucp export ckpt ckpt/step_.../out` would put files into a committed step (and lose them at its retention)."""
    root, _ = ckpt
    before = snapshot(root)
    inside = [root / "out", root / step_dirname(3) / "out", root]
    for args in [
        *(("export", str(root), str(dst), "--to", random.choice(["hf", "dcp", "megatron-dist"])) for dst in inside),
        ("import", str(root / "somewhere"), str(root), "--from", "hf"),
        ("convert", str(root), str(root / "tp2"), "--from", "universal", "--to", "tp2"),
        ("convert", str(tmp_path), str(root), "--from", "tp2", "--to", "universal"),
    ]:
        assert_cli_error(run_cli(*args), "the source", "write it elsewhere")
    assert snapshot(root) == before and not (root / "out").exists() and not (root / "tp2").exists()


def test_another_frameworks_checkpoint_gets_the_command_that_reads_it(tmp_path):
    megatron = tmp_path / "megatron"
    (megatron / "iter_0000010" / "mp_rank_00").mkdir(parents=True)
    (megatron / "latest_checkpointed_iteration.txt").write_text("10")
    assert_cli_error(run_cli("inspect", str(megatron)), "Megatron-LM checkpoint", "--from LAYOUT --to universal")
    (megatron / "iter_0000010" / "metadata.json").write_text('{"sharded_backend": "torch_dist"}')
    assert_cli_error(run_cli("inspect", str(megatron)), "Megatron-LM checkpoint", "--from torch_dist --to universal")
    dcp = tmp_path / "dcp"
    dcp.mkdir()
    (dcp / ".metadata").write_bytes(b"x")
    assert_cli_error(run_cli("verify", str(dcp)), "DCP checkpoint", "ucp import")


def test_a_bad_layout_is_named_as_written(tmp_path):
    result = run_cli("convert", str(tmp_path / "src"), str(tmp_path / "dst"), "--from", "tp0pp4", "--to", "tp2")
    assert_cli_error(result, "tp0pp4")
    assert "vpp1" not in result.stderr and "zero0" not in result.stderr


def test_storage_options_take_json_where_it_parses_and_keep_credentials_as_written():
    """`-o KEY=VALUE`: a secret or profile that starts with a digit, is all digits or is empty stays the string
    written (it crashed the CLI with a JSONDecodeError, or became an int); JSON values still parse."""
    from ucp.cli_common import parse_storage_options

    pairs = ["secret=9fK2/abcDEF", "key=1234", "profile=1prod", "token=", "endpoint_url=127.0.0.1:9000"]
    pairs += ["max_concurrency=8", "use_ssl=false", 'config_kwargs={"max_pool_connections": 64}', "region=[eu"]
    assert parse_storage_options(pairs) == {
        "secret": "9fK2/abcDEF",
        "key": "1234",
        "profile": "1prod",
        "token": "",
        "endpoint_url": "127.0.0.1:9000",
        "max_concurrency": 8,
        "use_ssl": False,
        "config_kwargs": {"max_pool_connections": 64},
        "region": "[eu",
    }


def test_a_secret_that_starts_with_a_digit_reaches_the_store_from_the_cli():
    out = run_cli("inspect", "s3://bucket/run", "-o", "secret=9fK2/abc", "-o", "endpoint_url=http://127.0.0.1:1")
    assert out.returncode == 1
    assert out.stderr.startswith("ucp: error: ") and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert "127.0.0.1:1" in out.stderr


@pytest.mark.parametrize(
    "argv",
    [
        ["export", "{src}", "--to", "hf", "s3://bucket/hf"],
        ["export", "{src}", "--to", "dcp", "s3://bucket/dcp"],
        ["export", "{src}", "--to", "vllm", "s3://bucket/served"],
        ["convert", "{src}", "s3://bucket/meg", "--from", "universal", "--to", "tp1"],
    ],
)
def test_an_export_to_a_url_of_another_store_is_refused_and_writes_nothing(ckpt, tmp_path, argv):
    """These outputs are files other tools read from a local disk: given an s3:// URL they were written to a local
    directory named `s3:` (relative to the working directory), and the command said it wrote the URL."""
    root, _ = ckpt
    work = tmp_path / "cwd"
    work.mkdir()
    out = subprocess.run(
        [sys.executable, "-m", "ucp", *[a.format(src=root) for a in argv]],
        capture_output=True,
        text=True,
        check=False,
        cwd=work,
    )
    assert_cli_error(out, "this output is a directory of files on a local disk", "s3://bucket/")
    assert list(work.iterdir()) == []
