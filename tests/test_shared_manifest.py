"""A distributed load reads a step's manifest once (`ucp.distributed.open_shared`): rank 0 reads the marker and the
manifest, each index part a rank needs is read by one of the ranks that need it and sent to the others over the
process group (real torch.distributed, gloo), and every rank then reads its atoms exactly; a part that cannot be
read fails every rank with one error, none hangs."""

from __future__ import annotations

import hashlib
import json
import random
import shutil

import pytest
import torch

import ucp
from ucp.format.index import PART_RECORDS, atoms_part_name

from .helpers import DRAW, step_path
from .launch import spawn

WORLD = 4


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(bytes(t.contiguous().reshape(-1).view(torch.uint8).numpy()) if t.numel() else b"").hexdigest()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A step of several index parts: atoms grouped as a model's layers are, of random small shapes."""
    rng = random.Random(DRAW.randrange(2**31))
    layers = 3 * PART_RECORDS // 64
    state = {
        "model": {
            f"layers.{i}": {f"w{j}": torch.randn(rng.randint(1, 8), rng.randint(1, 4)) for j in range(32)}
            for i in range(layers)
        }
    }
    root = tmp_path_factory.mktemp("shared")
    ucp.save(state, str(root), step=3)
    flat = {
        f"model/layers.{i}/w{j}": t
        for i, layer in enumerate(state["model"].values())
        for j, t in enumerate(layer.values())
    }
    return root, flat


def run(root, tmp_path, wanted: list[list[str]]) -> list[dict]:
    (tmp_path / "paths.json").write_text(json.dumps(wanted))
    out = tmp_path / "out"
    out.mkdir()
    spawn(["-m", "tests.shared_manifest_worker", str(root), str(tmp_path / "paths.json"), str(out)], world=WORLD)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]


def test_each_index_part_is_read_once_for_the_whole_job(saved, tmp_path):
    root, flat = saved
    paths = sorted(flat)
    # each rank a run of atoms (a pipeline stage's), the runs overlapping, one rank wanting almost all
    wanted = [
        paths[a : a + n]
        for a, n in (
            (0, len(paths) // 3),
            (len(paths) // 4, len(paths) // 3),
            (len(paths) // 2, 10),
            (5, len(paths) - 10),
        )
    ]
    reader = ucp.open_checkpoint(str(root))
    needs = [set(reader.manifest.parts(w)) for w in wanted]
    assert len(reader.manifest.entries) >= 3 and len(set.union(*needs)) >= 3
    results = run(root, tmp_path, wanted)
    parts_read = [k for r in results for k in r["read"] if "/ucp-index/" in k]
    assert sorted(parts_read) == sorted(f"{reader.prefix}/{atoms_part_name(n)}" for n in set.union(*needs))
    assert all(not any("ucp-commit.json" in k or k.endswith("zarr.json") for k in r["read"]) for r in results[1:])
    for rank, r in enumerate(results):
        assert set(r["held"]) == needs[rank], rank
        assert r["digests"] == {p: digest(flat[p]) for p in wanted[rank]}, rank


@pytest.mark.slow
def test_a_part_no_rank_can_read_fails_every_rank(saved, tmp_path):
    root, flat = saved
    broken = tmp_path / "broken"
    shutil.copytree(root, broken)
    reader = ucp.open_checkpoint(str(broken))
    paths = sorted(flat)
    (step_path(broken) / atoms_part_name(1)).unlink()
    wanted = [paths[: len(paths) // 2]] * WORLD
    results = run(broken, tmp_path, wanted)
    assert 1 in reader.manifest.parts(wanted[0])
    for r in results:
        assert r["raised"][0] == "ObjectMissingError" and atoms_part_name(1) in r["raised"][1], r
