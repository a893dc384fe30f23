"""Every byte is bound to its place: a chunk object moved, swapped, or copied in from another step (or left by
another save) fails the load with IntegrityError and `ucp verify` with exit 1, although each object's own
checksum is valid. Plain and sharded objects, whole loads and partial (resharding) loads."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch

import ucp
from ucp.distributed import ShardedModel, VirtualWorld, load_sharded
from ucp.sharding.layout import parse_layout
from ucp.sharding.reshard import shard

from .dist_worker import CONFIG, STATES, full_state
from .helpers import step_path

PLAIN = ucp.SaveOptions(chunking=ucp.ChunkingPolicy(object_bytes=4096, inner_bytes=4096, pack_below=0), fsync=False)
SHARDED = ucp.SaveOptions(chunking=ucp.ChunkingPolicy(object_bytes=8192, inner_bytes=1024, pack_below=0), fsync=False)


def state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"model": {"w": torch.randn(64, 64, generator=g), "v": torch.randn(64, 64, generator=g)}}


def verify_cli(root) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ucp", "verify", str(root)], capture_output=True, text=True, check=False
    )


def damaged(root, atom: str, *chunks: str) -> None:
    """A load fails naming one of `chunks` (reads run in parallel: whichever is read first), and verify names each."""
    names = "|".join(c.replace(".", "[.]") for c in chunks)
    with pytest.raises(ucp.IntegrityError, match=f"atom '{atom}' chunk ({names}).*not the one the commit recorded"):
        ucp.load(str(root))
    out = verify_cli(root)
    assert out.returncode == 1 and all(f"atom '{atom}' chunk {c}" in out.stdout for c in chunks), out.stdout


@pytest.mark.parametrize("options", [PLAIN, SHARDED], ids=["plain", "sharded"])
def test_two_chunks_of_an_atom_swapped(tmp_path, options):
    ucp.save(state(1), str(tmp_path), step=1, options=options)
    atom = step_path(tmp_path) / "model" / "w"
    a, b = atom / "c.0.0", atom / "c.1.0"
    data_a, data_b = a.read_bytes(), b.read_bytes()
    a.write_bytes(data_b)
    b.write_bytes(data_a)
    damaged(tmp_path, "model/w", "c.0.0", "c.1.0")


@pytest.mark.parametrize("options", [PLAIN, SHARDED], ids=["plain", "sharded"])
def test_a_chunk_copied_from_another_step(tmp_path, options):
    ucp.save(state(1), str(tmp_path), step=1, options=options)
    ucp.save(state(2), str(tmp_path), step=2, options=options)
    shutil.copy(step_path(tmp_path, 1) / "model" / "w" / "c.1.0", step_path(tmp_path, 2) / "model" / "w" / "c.1.0")
    damaged(tmp_path, "model/w", "c.1.0")
    assert torch.equal(ucp.load(str(tmp_path), step=1)["model"]["w"], state(1)["model"]["w"])


@pytest.mark.parametrize("options", [PLAIN, SHARDED], ids=["plain", "sharded"])
def test_a_chunk_copied_from_another_atom(tmp_path, options):
    ucp.save(state(1), str(tmp_path), step=1, options=options)
    step = step_path(tmp_path)
    shutil.copy(step / "model" / "v" / "c.1.0", step / "model" / "w" / "c.1.0")
    damaged(tmp_path, "model/w", "c.1.0")


def test_a_write_left_by_another_attempt_never_reaches_the_committed_step(tmp_path):
    """What a dead job's draining writer would do: write into its own (uncommitted) attempt of the same step."""
    ucp.save(state(1), str(tmp_path), step=1, options=PLAIN)
    committed = step_path(tmp_path)
    stale = committed.parent / "attempt-0123456789abcdef0123456789abcdef"
    shutil.copytree(committed, stale)
    for chunk in (stale / "model" / "w").glob("c.*"):
        chunk.write_bytes(bytes(len(chunk.read_bytes())))
    assert torch.equal(ucp.load(str(tmp_path))["model"]["w"], state(1)["model"]["w"])
    assert verify_cli(tmp_path).returncode == 0


def test_swapped_inner_chunks_fail_a_partial_read(tmp_path):
    """A resharding load reads some inner chunks of a shard: each must carry the checksum its shard's table lists
    for its place, so inner chunks swapped between two shards of one atom fail even where the index checks out."""
    layout = parse_layout("tp2pp1")
    full = full_state()
    VirtualWorld(2).save(
        [shard(full, CONFIG, layout, r, STATES) for r in range(2)],
        str(tmp_path),
        step=1,
        model=ShardedModel(CONFIG, layout, STATES),
        options=SHARDED,
    )
    reader = ucp.open_checkpoint(str(tmp_path))
    meta = next(
        m
        for m in reader.atoms.values()
        if m.inner_chunk_shape is not None and m.grid[0] >= 2 and m.path.startswith("model/")
    )
    atom = step_path(tmp_path) / meta.path
    first, second = (
        (atom / meta.chunk_key((0, *([0] * (len(meta.grid) - 1))))),
        (atom / meta.chunk_key((1, *([0] * (len(meta.grid) - 1))))),
    )
    a, b = first.read_bytes(), second.read_bytes()
    head = meta.inner_grid[0] * meta.inner_grid[1] * 20 + 4 if len(meta.grid) == 2 else None
    assert head is not None and len(a) == len(b)
    first.write_bytes(a[:head] + b[head:])  # a's head (valid index and table), b's inner chunks (each valid alone)
    target = parse_layout("tp4pp1")
    with pytest.raises(ucp.IntegrityError, match="not the one the commit recorded"):
        for rank in range(4):
            load_sharded(reader, ShardedModel(CONFIG, target, STATES), rank)


@pytest.mark.parametrize("which", ["root", "root-attributes", "root-ucp", "group", "group-missing"])
def test_verify_checks_the_root_and_group_documents(tmp_path, which):
    ucp.save(state(1), str(tmp_path), step=1, options=PLAIN)
    if which == "root":
        (tmp_path / "zarr.json").write_text('{"zarr_format": 3, "node_type": "array"}')
    elif which.startswith("root-"):  # (attributes, or ucp's among them, of another type: verify crashed on them)
        doc = {
            "zarr_format": 3,
            "node_type": "group",
            "attributes": [1] if which == "root-attributes" else {"ucp": 1.5},
        }
        (tmp_path / "zarr.json").write_text(json.dumps(doc))
    elif which == "group":
        (step_path(tmp_path) / "model" / "zarr.json").write_text('{"zarr_format": 2}')
    else:
        (step_path(tmp_path) / "model" / "zarr.json").unlink()
    out = verify_cli(tmp_path)
    assert out.returncode == 1 and ("root group" if which.startswith("root") else "group 'model'") in out.stdout, (
        out.stdout
    )
    assert torch.equal(ucp.load(str(tmp_path))["model"]["w"], state(1)["model"]["w"])


@pytest.mark.parametrize("edit", ["far", "swapped", "moved"])
def test_a_shard_index_changed_with_its_own_checksum_fixed_is_refused(tmp_path, edit):
    """The head's recorded checksum cannot tell one index from another that carries its own CRC (a message followed
    by its CRC-32C always hashes to one constant): an index is held by its bounds and the table. An offset of 16 TiB
    was a MemoryError (a gap of that size allocated); entries swapped or moved read an inner chunk from another
    place, which fails the checksum the table lists for its own."""
    import struct

    import crc32c

    ucp.save(state(0), str(tmp_path), step=1, options=SHARDED)
    meta = ucp.open_checkpoint(str(tmp_path)).atoms["model/w"]
    n = meta.inner_grid[0] * meta.inner_grid[1]
    shard_file = step_path(tmp_path) / "model/w" / meta.chunk_key((0, 0))
    data = bytearray(shard_file.read_bytes())
    entries = list(struct.unpack(f"<{2 * n}Q", data[: 16 * n]))
    if edit == "far":
        entries[2] = 1 << 44
    elif edit == "swapped":
        entries[0], entries[2] = entries[2], entries[0]
    else:  # (one inner chunk moved past the last one's end: a gap where the object ends)
        entries[2 * (n - 1)] += entries[1]
    index = struct.pack(f"<{2 * n}Q", *entries)
    data[: 16 * n] = index
    data[16 * n : 16 * n + 4] = struct.pack("<I", crc32c.crc32c(index))
    shard_file.write_bytes(bytes(data))
    with pytest.raises(ucp.IntegrityError, match=r"model/w' chunk c\.0\.0.*(bad index entry|not the one the commit)"):
        ucp.load(str(tmp_path))
    out = verify_cli(tmp_path)
    assert out.returncode == 1 and "atom 'model/w' chunk c.0.0" in out.stdout, out.stdout
