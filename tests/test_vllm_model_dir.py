"""The directory a vLLM engine starts a ucp checkpoint from (ucp.interop.vllm.source.model_dir, `ucp export --to
vllm`): config.json as `ucp export --to hf` writes it and the checkpoint's URL and step, no weights; its command's
flags and errors. Needs no vLLM (tests/test_vllm.py serves from such directories)."""

from __future__ import annotations

import json
import re

import pytest

from ucp import cli as ucp_cli
from ucp.interop.errors import DestinationExistsError, InteropError
from ucp.interop.hf import export_hf
from ucp.interop.vllm.engine import Request, request_of
from ucp.interop.vllm.source import CONFIG, POINTER, Pointer, model_dir

from .test_hf import random_full_state, save_in_layout, tiny_config


@pytest.fixture
def checkpoint(tmp_path) -> str:
    """A tiny Mixtral with steps 1 and 2 (the second written from another layout)."""
    cfg = tiny_config(num_hidden_layers=1)
    url = str(tmp_path / "ckpt")
    save_in_layout(random_full_state(cfg, states=()), cfg, "tp1", url, step=1)
    save_in_layout(random_full_state(cfg, states=(), seed=1), cfg, "tp2", url, step=2)
    return url


def test_the_model_directory_holds_the_exports_config_and_names_the_checkpoint_and_step(checkpoint, tmp_path):
    export_hf(checkpoint, tmp_path / "hf", step=1)
    for step, where in ((None, model_dir(checkpoint)), (1, model_dir(checkpoint, 1, dir=tmp_path / "one"))):
        assert sorted(p.name for p in where.iterdir()) == sorted([CONFIG, POINTER])  # (no weights)
        assert json.loads((where / CONFIG).read_text()) == json.loads((tmp_path / "hf" / "config.json").read_text())
        assert Pointer.read(where) == Pointer(checkpoint, 2 if step is None else 1)  # ("latest" resolved now)
    assert Pointer.read(model_dir(f"{checkpoint}/step_00000001")).step == 1  # (a step directory names its step)


def test_ucp_export_to_vllm_and_its_errors_in_one_line(checkpoint, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert ucp_cli.main(["export", "ckpt", "--to", "vllm", "served", "--step", "1"]) == 0
    assert "vllm serve" in capsys.readouterr().out
    assert Pointer.read(tmp_path / "served") == Pointer(checkpoint, 1)  # (a relative path made absolute)
    assert ucp_cli.main(["export", checkpoint, "--to", "vllm", str(tmp_path / "served")]) == 1
    assert "already exists" in capsys.readouterr().err
    for flag in (["--dtype", "bf16"], ["--memory-budget", "1GiB"], ["--workers", "2"], ["--no-progress"]):
        assert ucp_cli.main(["export", checkpoint, "--to", "vllm", str(tmp_path / "x"), *flag]) == 1, flag
        err = capsys.readouterr().err
        assert f"{flag[0]}" in err and "not --to vllm" in err and len(err.strip().splitlines()) == 1, err
    assert ucp_cli.main(["export", checkpoint, "--to", "vllm", str(tmp_path / "x"), "--step", "7"]) == 1
    assert "no step 7" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()
    with pytest.raises(DestinationExistsError):
        model_dir(checkpoint, dir=tmp_path / "ckpt" / "inside")


def test_a_directory_without_a_readable_pointer_is_refused_naming_it(checkpoint, tmp_path):
    with pytest.raises(InteropError, match=f"{tmp_path} is not a ucp model directory"):
        Pointer.read(tmp_path)
    # nothing coerced: a step 1.9 opened step 1, true step 1, a url null the path "None"
    for doc in (
        {"url": 3, "step": 1},
        {"url": None, "step": 1},
        {"url": {"a": 1}, "step": 1},
        {"url": "", "step": 1},
        {"url": checkpoint, "step": 1.9},
        {"url": checkpoint, "step": True},
        {"url": checkpoint, "step": "2"},
        {"url": checkpoint, "step": -1},
        {"url": checkpoint},
        [checkpoint, 1],
    ):
        (tmp_path / POINTER).write_text(json.dumps(doc))
        with pytest.raises(InteropError, match=f"^{re.escape(str(tmp_path / POINTER))} is malformed[^\n]*$"):
            Pointer.read(tmp_path)
    for raw in (b"{", b'{"url": "\xff", "step": 1}'):
        (tmp_path / POINTER).write_bytes(raw)
        with pytest.raises(InteropError, match=f"{tmp_path / POINTER} is malformed"):
            Pointer.read(tmp_path)
    (tmp_path / POINTER).unlink()
    (tmp_path / POINTER).mkdir()  # (was an IsADirectoryError)
    with pytest.raises(InteropError, match=f"{tmp_path / POINTER} is malformed"):
        Pointer.read(tmp_path)
    (tmp_path / POINTER).rmdir()
    (tmp_path / POINTER).write_text(json.dumps({"url": checkpoint, "step": 1}))
    assert Pointer.read(tmp_path) == Pointer(checkpoint, 1)


def test_model_loader_extra_config_of_the_wrong_types_is_refused_naming_the_key(checkpoint, tmp_path):
    # (were coerced: a memory_budget "1GiB" was a ValueError at the engine's start, storage_options a list a
    # TypeError, into_parameters "false" true)
    served = model_dir(checkpoint, dir=tmp_path / "served")
    assert request_of({"memory_budget": 1 << 20, "into_parameters": False}, str(served)) == Request(
        checkpoint, 2, None, 1 << 20, False
    )
    for key, value in (
        ("memory_budget", "1GiB"),
        ("memory_budget", True),
        ("storage_options", [["key", "k"]]),
        ("into_parameters", "false"),
        ("url", 3),
    ):
        with pytest.raises(InteropError, match=f"^model_loader_extra_config for load_format 'ucp': {key} is .*, not"):
            request_of({key: value}, str(served))
