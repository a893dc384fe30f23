"""bench_io: the CLI end to end at --quick size, the synthetic states, the pieces a wrong figure would hide in."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench_io import methods, state, targets
from bench_io.args import parse_size

REPO = Path(__file__).resolve().parents[1]


def test_quick_run_reports_every_method_and_target(tmp_path: Path) -> None:
    out_json, out_png = tmp_path / "r.json", tmp_path / "r.png"
    # fadvise, not drop_caches: a test must not empty the page cache of everyone on the machine
    cmd = [
        sys.executable,
        "-m",
        "bench_io",
        "--quick",
        "--dir",
        str(tmp_path / "disk"),
        "--cache",
        "fadvise",
        "--targets",
        "tmpfs,disk",
        "--methods",
        "raw,ucp,torch,safetensors",
        "--json",
        str(out_json),
        "--png",
        str(out_png),
    ]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "load GB/s" in proc.stdout
    doc = json.loads(out_json.read_text())
    medians = {(m["state"], m["method"], m["target"]): m for m in doc["medians"]}
    for target in ("tmpfs", "disk"):
        for method in ("raw", "ucp", "torch", "safetensors"):  # the rest: tests/test_bench_io_more.py
            m = medians[("mixed", method, target)]
            assert m["save_gbps"] > 0 and m["load_gbps"] > 0 and not m["errors"], m
        for kind in ("small", "large"):
            assert medians[(kind, "ucp", target)]["load_gbps"] > 0
        assert medians[("mixed", "raw", target)]["save_vs_raw"] == pytest.approx(1.0)
    assert medians[("mixed", "ucp", "disk")]["cache"] == "fadvise"
    assert medians[("mixed", "ucp", "tmpfs")]["cache"] == "tmpfs"
    assert all(r["error"] is None for r in doc["results"])
    assert out_png.stat().st_size > 1000 and out_png.read_bytes()[:4] == b"\x89PNG"
    assert not list((tmp_path / "disk").iterdir()), "the disk target left files behind"


@pytest.mark.parametrize("size", [4 << 20, 64 << 20, 1 << 30, 3 * 10**9])
def test_transformer_state_sizes_add_up(size: int) -> None:
    specs = state.transformer_specs(size)
    total = sum(s.nbytes for s in specs)
    hidden = specs[0].shape[1]
    assert size - 28 * hidden < total <= size  # short by less than one embedding row pair
    assert len({s.path for s in specs}) == len(specs)
    params = [s for s in specs if s.path.startswith("model/")]
    assert {s.dtype for s in params} == {torch.bfloat16}
    assert {s.dtype for s in specs if s.path.startswith("optimizer/")} == {torch.float32}
    assert len(specs) == 4 * len(params)  # master, exp_avg, exp_avg_sq per parameter
    # a realistic mix: big embedding matrices, many mid-size matrices, many small vectors
    biggest = max(params, key=lambda s: s.nbytes)
    assert biggest.path in ("model/embed/weight", "model/lm_head/weight")
    assert sum(1 for s in params if len(s.shape) == 1) > len(params) / 2
    assert sum(1 for s in params if len(s.shape) == 2) >= 6


def test_small_and_large_states() -> None:
    small = state.small_specs(1000, seed=1)
    sizes = [s.nbytes for s in small]
    assert len(small) == 1000 and min(sizes) >= 1020 and max(sizes) <= 64 << 10
    assert sorted(sizes)[500] < 32 << 10  # log-uniform: most are small
    total = sum(sizes)
    large = state.large_specs(total)
    assert len(large) == 4 and sum(s.nbytes for s in large) == total


def test_random_bits_are_incompressible_and_verified() -> None:
    import zlib

    s = state.make_state("t", state.transformer_specs(1 << 20), seed=3)
    assert s.nbytes == sum(t.nbytes for t in s.flat.values())
    assert all(t.untyped_storage().nbytes() == t.nbytes for t in s.flat.values())  # own storage each
    blob = b"".join(t.reshape(-1).view(torch.uint8).numpy().tobytes() for t in s.flat.values())
    assert len(zlib.compress(blob, 6)) > 0.99 * len(blob)
    copy = {p: t.clone() for p, t in s.flat.items()}
    assert s.verify(copy) is None
    big = max(copy, key=lambda p: copy[p].nbytes)
    copy[big].reshape(-1).view(torch.uint8)[copy[big].nbytes // 2] ^= 1
    assert "bytes differ" in (s.verify(copy) or "")
    del copy[big]
    assert "names differ" in (s.verify(copy) or "")


@pytest.mark.parametrize("name", sorted(n for n, m in methods.METHODS.items() if m.local))
def test_each_method_round_trips(name: str, tmp_path: Path) -> None:
    s = state.make_state("t", state.transformer_specs(256 << 10) + state.small_specs(5), seed=4)
    m = methods.METHODS[name](io_threads=4)
    m.save(s, tmp_path)
    assert s.verify(m.load(tmp_path)) is None


def test_raw_crc_baseline_checks_what_it_reads(tmp_path: Path) -> None:
    s = state.make_state("t", state.small_specs(6), seed=1)
    m = methods.METHODS["raw-crc"](io_threads=2)
    m.save(s, tmp_path)
    victim = tmp_path / "3.bin"
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x10
    victim.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="3.bin: checksum mismatch"):
        m.load(tmp_path)


def test_raw_objects_lays_out_ucps_objects_and_checks_what_it_reads(tmp_path: Path) -> None:
    """raw-objects, the floor for the unpacked layout's object count: the same directories, documents and chunks as a
    ucp save of the state without packs, and a damaged chunk is noticed."""
    import ucp

    s = state.make_state("t", state.transformer_specs(256 << 10), seed=2)
    methods.METHODS["raw-objects"](io_threads=2).save(s, tmp_path / "raw")
    unpacked = ucp.SaveOptions(chunking=ucp.ChunkingPolicy(pack_below=0))
    ucp.save(s.tree, str(tmp_path / "ucp"), step=0, options=unpacked)
    step = next(p for p in (tmp_path / "ucp" / "step_00000000").iterdir() if p.is_dir())

    def layout(root: Path) -> set[str]:
        return {
            str(p.relative_to(root)) + ("/" if p.is_dir() else "")
            for p in root.rglob("*")
            if p.name != "ucp-attempt.json" and not (p.is_file() and p.name.startswith("c"))
        }

    assert layout(tmp_path / "raw") == layout(step)
    chunks = [p for p in (tmp_path / "raw").rglob("c")]
    assert len(chunks) == len(s.flat)
    data = bytearray(chunks[0].read_bytes())
    data[len(data) // 3] ^= 0x10
    chunks[0].write_bytes(bytes(data))
    with pytest.raises(ValueError, match="checksum mismatch"):
        methods.METHODS["raw-objects"](io_threads=2).load(tmp_path / "raw")


def test_cache_drop_on_disk(tmp_path: Path) -> None:
    path = tmp_path / "f.bin"
    path.write_bytes(os.urandom(1 << 20))
    assert targets.resident_fraction(tmp_path) == pytest.approx(1.0, abs=0.01)
    assert targets.drop_page_cache(tmp_path, "fadvise") == "fadvise"
    resident = targets.resident_fraction(tmp_path)
    assert resident is not None and resident < 0.5
    assert targets.fs_type("/proc") == "proc"


def test_parse_size() -> None:
    assert parse_size("1GiB") == 1 << 30
    assert parse_size("256MiB") == 256 << 20
    assert parse_size("500MB") == 500 * 10**6
    assert parse_size("1.5k") == 1500
    assert parse_size("4096") == 4096
    assert math.isclose(parse_size("0.5gib"), 1 << 29)
