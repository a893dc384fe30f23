"""Format 1.0, 2.0 and 3.0 checkpoints (kept as fixtures, written by the 1.0, 2.0 and 3.0 writers:
scripts/make_v1_fixture.py) still load bitwise, verify, inspect and load sharded in any layout; a save of today's
format into a 1.0 root sits beside them."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ucp
from ucp.distributed import ShardedModel, load_sharded
from ucp.engine.inspection import verify
from ucp.sharding.families import MixtralConfig
from ucp.sharding.layout import parse_layout
from ucp.sharding.reshard import assemble

FIXTURES = Path(__file__).parent / "fixtures" / "v1"
EXPECTED = json.loads((FIXTURES / "expected.json").read_text())
V2 = Path(__file__).parent / "fixtures" / "v2"  # the same states, written by the 2.0 writer
V3 = Path(__file__).parent / "fixtures" / "v3"  # and by the 3.0 writer: some atoms packed, the others sharded


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(
        t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
    ).hexdigest()


def copy(tmp_path: Path, name: str) -> Path:
    dst = tmp_path / name
    shutil.copytree(FIXTURES / name, dst)
    return dst


def test_a_v1_single_process_checkpoint_loads_bitwise_and_verifies(tmp_path):
    root = copy(tmp_path, "single")
    for step in (4, 5):
        reader = ucp.open_checkpoint(str(root), step)
        assert (
            reader.manifest.format_version == "1.0"
            and reader.record.attempt is None
            and reader.manifest.objects is None
        )
        state = reader.load_state()
        for name, (dtype, shape, sha) in EXPECTED["single"].items():
            t = state["model"][name]
            assert (str(t.dtype), list(t.shape), digest(t)) == (dtype, shape, sha), name
        assert state["step"] == 5 and state["names"] == ["a", "b"] and state["lr"] != state["lr"]
        assert verify(reader).ok
    out = subprocess.run(
        [sys.executable, "-m", "ucp", "inspect", str(root)], capture_output=True, text=True, check=False
    )
    assert out.returncode == 0 and "UCP 1.0" in out.stdout


def test_a_damaged_v1_chunk_is_still_caught(tmp_path):
    root = copy(tmp_path, "single")
    chunk = max((root / "step_00000005" / "model" / "w").glob("c.*"))
    data = bytearray(chunk.read_bytes())
    data[len(data) // 2] ^= 1
    chunk.write_bytes(bytes(data))
    try:
        ucp.load(str(root))
    except ucp.IntegrityError as e:
        assert "model/w" in str(e)
    else:
        raise AssertionError("a flipped bit in a v1 chunk was not caught")
    assert not verify(ucp.open_checkpoint(str(root))).ok


def test_a_v3_save_into_a_v1_root_sits_beside_the_v1_steps(tmp_path):
    root = copy(tmp_path, "single")
    manager = ucp.CheckpointManager(str(root))  # starts with a gc: the committed 1.0 steps are not leftovers
    assert manager.steps() == [4, 5]
    manager.save(6, {"w": torch.arange(5.0)})
    assert manager.steps() == [4, 5, 6]
    assert ucp.open_checkpoint(str(root)).manifest.format_version == "3.1"
    assert torch.equal(ucp.load(str(root))["w"], torch.arange(5.0))
    assert ucp.load(str(root), step=5)["model"]["w"].shape == (48, 40)


def test_a_v2_single_process_checkpoint_loads_bitwise_and_verifies(tmp_path):
    shutil.copytree(V2 / "single", tmp_path / "single")
    root = tmp_path / "single"
    for step in (4, 5):
        reader = ucp.open_checkpoint(str(root), step)
        assert reader.manifest.format_version == "2.0" and reader.record.attempt is not None
        assert not reader.manifest.packs and not any(m.packed for m in reader.atoms.values())
        state = reader.load_state()
        for name, (dtype, shape, sha) in EXPECTED["single"].items():
            t = state["model"][name]
            assert (str(t.dtype), list(t.shape), digest(t)) == (dtype, shape, sha), name
        assert verify(reader).ok
    manager = ucp.CheckpointManager(str(root))  # a format 3 step beside them, its small atoms packed
    manager.save(6, {"w": torch.arange(5.0)})
    assert ucp.open_checkpoint(str(root)).manifest.packs
    assert torch.equal(ucp.load(str(root))["w"], torch.arange(5.0))
    assert digest(ucp.load(str(root), step=5)["model"]["w"]) == EXPECTED["single"]["w"][2]


@pytest.mark.parametrize("fixtures", [FIXTURES, V2, V3], ids=["v1", "v2", "v3"])
def test_a_v1_v2_or_v3_distributed_checkpoint_loads_in_other_layouts(tmp_path, fixtures):
    shutil.copytree(fixtures / "sharded", tmp_path / "sharded")
    root = tmp_path / "sharded"
    config = MixtralConfig.from_json(EXPECTED["config"])
    reader = ucp.open_checkpoint(str(root))
    assert reader.manifest.layout == "tp2pp1"
    for layout in ("tp1pp1", "tp2pp1", "tp1pp2"):
        target = parse_layout(layout)
        locals_ = [
            load_sharded(reader, ShardedModel(config, target, ("exp_avg", "exp_avg_sq")), r)[0]
            for r in range(target.world_size)
        ]
        full = assemble(locals_, config, target, ("exp_avg", "exp_avg_sq"))
        assert {n: digest(t) for n, t in full["model"].items()} == EXPECTED["sharded"], layout
    assert verify(reader).ok
