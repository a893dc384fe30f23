"""Format 3 packs: small atoms' chunks written back to back into shared pack objects (docs/FORMAT.md section 4.1).

Round trips of random trees that mix packed and unpacked atoms of every dtype (0-d, empty and one-byte atoms at
the packs' edges), sync and async, single-process and distributed, resumed in other layouts; a damaged, truncated,
swapped or stale pack is refused naming the atoms it holds; a manifest whose offsets point outside a pack, overlap
or misalign is a FormatError before anything is read; zarr-python and tensorstore read packed atoms by the recipe
of docs/FORMAT.md.
"""

from __future__ import annotations

import itertools
import json
import os
import random
import shutil
from pathlib import Path

import crc32c
import numpy as np
import pytest
import torch

import ucp
from ucp.distributed import ShardedModel, VirtualWorld, load_sharded
from ucp.engine.checkpoint import CheckpointReader
from ucp.engine.inspection import describe, format_table, verify
from ucp.errors import FormatError, IntegrityError
from ucp.format.manifest import COMMIT_MARKER, CRC_BYTES, PACKS_GROUP
from ucp.sharding.families import MixtralConfig
from ucp.sharding.layout import parse_layout
from ucp.sharding.reshard import assemble, shard
from ucp.storage import open_storage

from .helpers import DRAW, assert_same_state, manifest_view, step_path, write_manifest
from .test_interop import _ML_DTYPES, _same

DTYPES = [
    torch.bool,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
]
PACK_BELOW = 2048
PACK_BYTES = 512  # small packs: many edges, and atoms of up to 2 KiB that take a pack of their own
OPTIONS = ucp.SaveOptions(
    chunking=ucp.ChunkingPolicy(object_bytes=4096, inner_bytes=1024, pack_below=PACK_BELOW, pack_bytes=PACK_BYTES),
    fsync=False,
)


def _tensor(rng: random.Random, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    g = torch.Generator().manual_seed(rng.randrange(2**31))
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=g) * 4).to(dtype)
    return torch.randint(0, 100, shape, generator=g).to(dtype)


def _edges() -> dict[str, torch.Tensor]:
    """Atoms laid out so that one-byte, 0-d and empty atoms fall at the packs' edges (PACK_BYTES 512): a one-byte
    atom fills a pack's last byte, 0-d atoms open and close packs, an empty atom sits between two packs."""
    return {
        "a_fill": torch.zeros(511, dtype=torch.uint8),
        "b_last_byte": torch.tensor([7], dtype=torch.uint8),  # byte 511: the first pack's last
        "c_empty": torch.zeros(0, 3),
        "d_first_scalar": torch.tensor(1.5, dtype=torch.float64),  # opens the second pack
        "e_fill": torch.ones(62, dtype=torch.float64),  # up to byte 504
        "f_scalar": torch.tensor(-2.0, dtype=torch.float64),  # bytes 504-511: the second pack's last element
        "g_one_byte": torch.tensor(True),  # opens the third pack
        "h_bf16": torch.tensor(3.0, dtype=torch.bfloat16),  # aligned to 2 after one byte
    }


def random_state(seed: int) -> dict:
    """A random tree: atoms of every dtype and of random shapes (0-d, empty, one element, small, above the packing
    threshold) in random nesting, the edge atoms among them."""
    rng = random.Random(seed)
    tree: dict = {"edges": _edges(), "step": seed % 1000}
    for i in range(rng.randint(30, 60)):
        dtype = rng.choice(DTYPES)
        kind = rng.choice(["scalar", "empty", "one", "small", "small", "small", "large"])
        if kind == "scalar":
            shape: tuple[int, ...] = ()
        elif kind == "empty":
            shape = tuple(rng.choice([0, rng.randint(1, 4)]) for _ in range(rng.randint(1, 3)))
            shape = (0, *shape[1:])
        elif kind == "one":
            shape = (1,) * rng.randint(1, 3)
        elif kind == "small":
            shape = tuple(rng.randint(1, 9) for _ in range(rng.randint(1, 3)))
        else:
            shape = (rng.randint(40, 90), rng.randint(8, 40))
        node = tree
        for level in range(rng.randint(0, 3)):
            node = node.setdefault(f"l{level}_{rng.randint(0, 2)}", {})
        node[f"t{i}"] = _tensor(rng, dtype, shape)
    return tree


def _attempt(root: Path) -> Path:
    return step_path(root)


def _check_packed(reader: CheckpointReader) -> None:
    """Which atoms are packed follows the threshold; every packed chunk lies inside its pack, aligned, alone."""
    for meta in reader.atoms.values():
        assert meta.packed == (meta.nbytes < PACK_BELOW), meta.path
    for name, chunks in _by_pack(reader).items():
        data_bytes = reader.manifest.packs[name][0] - CRC_BYTES
        spans = sorted((c.offset, c.offset + c.nbytes) for _, c in chunks)
        assert all(a < b <= data_bytes for a, b in spans) and all(
            b <= c for (_, b), (c, _) in itertools.pairwise(spans)
        )


def _by_pack(reader: CheckpointReader) -> dict:
    out: dict = {}
    for path, chunks in reader.manifest.packed.items():
        for c in chunks:
            out.setdefault(c.pack, []).append((path, c))
    return out


@pytest.mark.parametrize("mode,writer", [("sync", "threads"), ("async", "process"), ("lazy", "threads")])
def test_random_trees_of_packed_and_unpacked_atoms_round_trip(tmp_path, mode, writer):
    seed = DRAW.randrange(2**31)
    state = random_state(seed)
    root = tmp_path / "ckpt"
    manager = ucp.CheckpointManager(str(root), options=OPTIONS, mode=mode, writer=writer)
    try:
        manager.save(1, state)
        manager.wait()
    finally:
        manager.close()
    reader = ucp.open_checkpoint(str(root))
    assert reader.manifest.format_version == "3.1"
    assert_same_state(state, reader.load_state(), f"seed {seed}")
    _check_packed(reader)
    # the edges happened as laid out: one-byte, 0-d and empty atoms at the packs' ends and starts
    p = reader.manifest.packed
    first, second = p["edges/b_last_byte"][0], p["edges/f_scalar"][0]
    assert (first.offset, reader.manifest.packs[first.pack][0] - CRC_BYTES) == (511, 512), f"seed {seed}"
    assert second.offset + 8 == reader.manifest.packs[second.pack][0] - CRC_BYTES == 512, f"seed {seed}"
    assert p["edges/d_first_scalar"][0].offset == 0 and p["edges/g_one_byte"][0].offset == 0
    assert p["edges/c_empty"] == [] and p["edges/h_bf16"][0].offset == 2
    assert verify(reader).ok
    # no directory or zarr.json per packed atom; the packs are Zarr arrays of bytes in their own group
    attempt = _attempt(root)
    assert not (attempt / "edges").exists()
    assert json.loads((attempt / PACKS_GROUP / "zarr.json").read_text())["node_type"] == "group"
    for name in reader.manifest.packs:
        doc = json.loads((attempt / name / "zarr.json").read_text())
        assert doc["data_type"] == "uint8" and doc["shape"] == [reader.manifest.packs[name][0] - CRC_BYTES]
    for meta in reader.atoms.values():
        assert (attempt / meta.path / "zarr.json").exists() == (not meta.packed), meta.path


def test_a_pack_read_by_row_and_column_ranges_and_in_other_layouts(tmp_path):
    """A distributed save whose small TP-split atoms are packed chunk by chunk (each rank packs what it writes),
    read back whole, by regions (the reshaper's partial reads of packed atoms) and in other layouts."""
    config = MixtralConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        num_local_experts=2,
        make_vocab_size_divisible_by=8,
    )
    states = ("exp_avg", "exp_avg_sq")
    g = torch.Generator().manual_seed(DRAW.randrange(2**31))
    from ucp.sharding.families import canonical_atoms

    atoms = canonical_atoms(config)
    full = {
        "model": {n: torch.randn(s, generator=g) for n, (s, _) in atoms.items()},
        "optimizer": {"state": {n: {st: torch.rand(s, generator=g) for st in states} for n, (s, _) in atoms.items()}},
    }
    layout = parse_layout("tp2pp2")
    options = ucp.SaveOptions(chunking=ucp.ChunkingPolicy(pack_below=8192, pack_bytes=16384), fsync=False)
    url = str(tmp_path / "ckpt")
    VirtualWorld(layout.world_size).save(
        [shard(full, config, layout, r, states) for r in range(layout.world_size)],
        url,
        step=3,
        model=ShardedModel(config, layout, states),
        extra={"iteration": 3, "rng": torch.arange(3, dtype=torch.uint8)},
        options=options,
    )
    reader = ucp.open_checkpoint(url)
    packed = [m for m in reader.atoms.values() if m.packed]
    assert packed and any(not m.packed for m in reader.atoms.values())
    assert any(len(reader.manifest.packed[m.path]) > 1 for m in packed), "no TP-split atom was packed by chunks"
    assert {n.rsplit("-", 1)[0] for n in reader.manifest.packs} == {f"{PACKS_GROUP}/p0"}  # (one process)
    assert verify(reader).ok
    for target in ("tp1pp1", "tp4pp1", "tp1pp2dp2zero1", "tp2pp1ep2dp2"):
        lay = parse_layout(target)
        model = ShardedModel(config, lay, states)
        locals_ = [load_sharded(reader, model, r)[0] for r in range(lay.world_size)]
        assert_same_state(assemble(locals_, config, lay, states), full, target)


def test_a_pack_read_by_regions_of_a_packed_atom(tmp_path):
    """`read_object` of a packed chunk delivers only the region asked for (a row range, a column range)."""
    t = torch.arange(60, dtype=torch.float32).reshape(6, 10)
    ucp.save({"w": t, "b": torch.ones(3)}, str(tmp_path), options=OPTIONS)
    reader = ucp.open_checkpoint(str(tmp_path))
    meta = reader.atoms["w"]
    assert meta.packed
    for region in (((2, 5), (0, 10)), ((0, 6), (3, 7)), ((1, 2), (9, 10))):
        out = torch.zeros(tuple(b - a for a, b in region))

        def dest(box, region=region, out=out):
            inside = tuple((max(a, c), min(b, d)) for (a, b), (c, d) in zip(box, region))
            view = out[tuple(slice(a - c, b - c) for (a, b), (c, _) in zip(inside, region))]
            return view, tuple(a - c for (a, _), (c, _) in zip(inside, box))

        reader.read_object(meta, (0, 0), dest)
        assert torch.equal(out, t[tuple(slice(a, b) for a, b in region)]), region


def test_a_small_state_takes_few_objects(tmp_path):
    """20,000 small atoms were three entries each (a directory, a zarr.json, a chunk): now a few packs."""
    g = torch.Generator().manual_seed(0)
    state = {
        "model": {
            f"layer{j}": {f"t{i}": torch.randn(64, generator=g) for i in range(50 * j, 50 * j + 50)} for j in range(40)
        }
    }
    ucp.save(state, str(tmp_path), options=ucp.SaveOptions(fsync=False))
    files = [p for p in _attempt(tmp_path).rglob("*") if p.is_file()]
    assert len(files) <= 8, sorted(
        str(f) for f in files
    )  # manifest, owner record, packs group, a pack and its zarr.json
    assert_same_state(state, ucp.load(str(tmp_path)))


# ------------------------------------------------------------------------------------------- damage


@pytest.fixture
def two_steps(tmp_path):
    seed = DRAW.randrange(2**31)
    root = tmp_path / "ckpt"
    for step in (1, 2):
        ucp.save(random_state(seed + step), str(root), step=step, options=OPTIONS)
    return root


def _a_pack(root: Path, step: int) -> tuple[str, list[str]]:
    reader = ucp.open_checkpoint(str(root), step)
    name, members = max(_by_pack(reader).items(), key=lambda kv: len(kv[1]))
    return name, sorted({path for path, _ in members})


def _refused_naming(root: Path, step: int, atoms: list[str]) -> None:
    """A load fails naming the atoms the bad pack holds (the first of them at least), and so does verify."""
    with pytest.raises(IntegrityError) as e:
        ucp.load(str(root), step=step)
    message = str(e.value)
    assert "holds the atoms" in message and any(repr(a) in message for a in atoms[:1]), message
    report = verify(ucp.open_checkpoint(str(root), step))
    assert not report.ok and any(repr(atoms[0]) in p for p in report.problems), report.problems


def test_a_damaged_pack_is_refused_naming_its_atoms(two_steps):
    name, atoms = _a_pack(two_steps, 2)
    path = _attempt(two_steps) / name / "c.0"
    data = bytearray(path.read_bytes())
    reader = ucp.open_checkpoint(str(two_steps), 2)
    first = min(c.offset for _, c in _by_pack(reader)[name])
    data[first] ^= 0x10
    path.write_bytes(bytes(data))
    _refused_naming(two_steps, 2, atoms)


def test_a_truncated_pack_is_refused_naming_its_atoms(two_steps):
    name, atoms = _a_pack(two_steps, 2)
    path = _attempt(two_steps) / name / "c.0"
    path.write_bytes(path.read_bytes()[: -CRC_BYTES - 3])
    _refused_naming(two_steps, 2, atoms)


def test_swapped_packs_are_refused_naming_their_atoms(two_steps):
    reader = ucp.open_checkpoint(str(two_steps), 2)
    names = sorted(_by_pack(reader), key=lambda n: -len(_by_pack(reader)[n]))[:2]
    a, b = (_attempt(two_steps) / n / "c.0" for n in names)
    data_a, data_b = a.read_bytes(), b.read_bytes()
    a.write_bytes(data_b)
    b.write_bytes(data_a)
    with pytest.raises(IntegrityError) as e:
        ucp.load(str(two_steps), step=2)
    held = [sorted({p for p, _ in _by_pack(reader)[n]}) for n in names]
    assert "holds the atoms" in str(e.value) and any(repr(atoms[0]) in str(e.value) for atoms in held), str(e.value)
    problems = verify(ucp.open_checkpoint(str(two_steps), 2)).problems
    assert all(any(repr(atoms[0]) in p for p in problems) for atoms in held), problems


def test_a_stale_pack_from_another_step_is_refused_naming_its_atoms(two_steps):
    name, atoms = _a_pack(two_steps, 2)
    old = step_path(two_steps, 1) / name / "c.0"
    if not old.exists():  # (step 1 has fewer packs): another of its packs, stale all the same
        old = step_path(two_steps, 1) / next(iter(ucp.open_checkpoint(str(two_steps), 1).manifest.packs)) / "c.0"
    shutil.copy(old, _attempt(two_steps) / name / "c.0")
    _refused_naming(two_steps, 2, atoms)


def test_a_missing_pack_is_refused_naming_its_atoms(two_steps):
    name, atoms = _a_pack(two_steps, 2)
    os.unlink(_attempt(two_steps) / name / "c.0")
    _refused_naming(two_steps, 2, atoms)


def test_a_damaged_pack_fails_a_partial_read_of_one_of_its_atoms(two_steps):
    name, atoms = _a_pack(two_steps, 2)
    path = _attempt(two_steps) / name / "c.0"
    path.write_bytes(bytes(b ^ 0xFF for b in path.read_bytes()))
    reader = ucp.open_checkpoint(str(two_steps), 2)
    with pytest.raises(IntegrityError, match=f"atom {atoms[0]!r}.*holds the atoms"):
        reader.read_atoms([atoms[0]])


# ------------------------------------------------------------------------------------ hostile manifests


def _fuzz_cases(doc: dict, rng: random.Random) -> list[tuple[str, dict]]:
    """Manifests whose packed entries lie: outside their pack, overlapping, misaligned, of the wrong size, in an
    unknown pack, mistyped; and packs of impossible sizes."""
    ucp_doc = doc["attributes"]["ucp"]
    packed = [(p, a) for p, a in ucp_doc["atoms"].items() if a.get("packed")]

    def fits_one_more(a: dict) -> bool:
        pack, offset, nbytes, _ = a["packed"][0]
        return offset + 1 + nbytes <= ucp_doc["packs"][pack][0] - CRC_BYTES

    wide = [(p, a) for p, a in packed if ucp.base.dtypes.itemsize(a["dtype"]) > 1 and fits_one_more(a)]
    cases = []

    def case(what: str, change) -> None:
        edited = json.loads(json.dumps(doc))
        change(edited["attributes"]["ucp"])
        cases.append((what, edited))

    path, atom = rng.choice(packed)
    entry = atom["packed"][0]
    size = ucp_doc["packs"][entry[0]][0] - CRC_BYTES
    case("outside", lambda u: u["atoms"][path]["packed"][0].__setitem__(1, size - entry[2] + rng.randint(1, 64)))
    case("an integer", lambda u: u["atoms"][path]["packed"][0].__setitem__(1, 2**40))
    case("an integer", lambda u: u["atoms"][path]["packed"][0].__setitem__(1, -8))
    case("an integer", lambda u: u["atoms"][path]["packed"][0].__setitem__(1, 1.0))
    case("an integer", lambda u: u["atoms"][path]["packed"][0].__setitem__(2, True))
    case("records", lambda u: u["atoms"][path]["packed"][0].__setitem__(2, entry[2] + 1))
    case("listed pack", lambda u: u["atoms"][path]["packed"][0].__setitem__(0, "ucp-packs/p9-9"))
    case("listed pack", lambda u: u["atoms"][path]["packed"][0].__setitem__(0, "../../etc/passwd"))
    case("must list", lambda u: u["atoms"][path]["packed"].append(entry))
    case("pack entry", lambda u: u["packs"].__setitem__("../x", [10, 0]))
    case("nbytes", lambda u: u["packs"].__setitem__(entry[0], [2, 0]))
    case("nbytes", lambda u: u["packs"].__setitem__(entry[0], [2**40, 0]))
    wpath, watom = rng.choice(wide)
    wentry = watom["packed"][0]
    case("element", lambda u: u["atoms"][wpath]["packed"][0].__setitem__(1, wentry[1] + 1))
    # a chunk moved back to start inside the one before it in its pack (aligned, so only the overlap is wrong)
    overlaps = []
    for name in ucp_doc["packs"]:
        members = sorted((a["packed"][0][1], p) for p, a in packed if a["packed"][0][0] == name)
        for (o0, p0), (_, p1) in itertools.pairwise(members):
            size1 = ucp.base.dtypes.itemsize(ucp_doc["atoms"][p1]["dtype"])
            moved = -(-o0 // size1) * size1
            if moved < o0 + ucp_doc["atoms"][p0]["packed"][0][2]:
                overlaps.append((p1, moved))
    assert overlaps, "no two neighbours in a pack to overlap"  # (random states have hundreds)
    p1, moved = rng.choice(overlaps)
    case("overlap", lambda u: u["atoms"][p1]["packed"][0].__setitem__(1, moved))
    return cases


def test_fuzzed_packed_entries_are_format_errors_before_any_read(tmp_path, monkeypatch):
    root = tmp_path / "ckpt"
    seed = DRAW.randrange(2**31)
    ucp.save(random_state(seed), str(root), step=1, options=OPTIONS)
    doc = manifest_view(root)  # (format 3.1: written back into its index parts)
    reads = []
    real_read_into = type(open_storage(str(root))).read_into
    monkeypatch.setattr(
        type(open_storage(str(root))), "read_into", lambda self, *a: reads.append(a) or real_read_into(self, *a)
    )
    attempt = step_path(root)
    marker_path = attempt.parent / COMMIT_MARKER

    def reseal(edited: dict) -> None:  # (reseal_manifest opens the step, which the last case left refused)
        write_manifest(attempt, marker_path, edited)

    for what, edited in _fuzz_cases(doc, random.Random(seed)):
        reseal(edited)
        reads.clear()
        with pytest.raises(FormatError, match=what):
            ucp.load(str(root))
        assert not reads, f"{what}: read {reads[:1]} before refusing the manifest"
    reseal(doc)
    assert verify(ucp.open_checkpoint(str(root))).ok


# ------------------------------------------------------------------------ other readers, other tools


def _recipe_case(tmp_path):
    state = {
        f"a_{str(dt).removeprefix('torch.')}": _tensor(random.Random(i), dt, (3, 5)) for i, dt in enumerate(DTYPES)
    }
    state["scalar"] = torch.tensor(2.5, dtype=torch.bfloat16)
    state["big"] = torch.randn(64, 64)  # (not packed: 16 KiB)
    ucp.save(state, str(tmp_path), options=OPTIONS)
    attempt = _attempt(tmp_path)
    return state, attempt, {name: atom_record(str(attempt), name) for name in state}


def atom_record(step: str, path: str) -> dict:
    """docs/FORMAT.md 3.1's recipe, as written there: an atom's record in a format 3.1 step (the attempt directory
    `step`), found through the manifest's index: its dtype, shape, chunk shape, attributes and chunks ("packed":
    [pack, offset, nbytes, crc32c] each; else "objects": [nbytes, crc32c] per chunk object)."""
    import re

    def path_key(path: str) -> tuple:  # the index's order: runs of digits as numbers (then by length), the rest as text
        return tuple((int(p), len(p)) if i % 2 else p for i, p in enumerate(re.split(r"(\d+)", path)))

    index = json.loads(Path(f"{step}/zarr.json").read_bytes())["attributes"]["ucp"]["index"]
    number = max(n for n, (first, *_) in enumerate(index["parts"]) if path_key(first) <= path_key(path))
    part = json.loads(
        Path(f"{step}/ucp-index/atoms-{number}.json").read_bytes()
    )  # (its size and crc32c: index["parts"][number])
    i = part["paths"].index(path)
    d, k = sum(part["ndim"][:i]), part["ndim"][i]  # its extents in "shape" and "chunk_shape"
    r, c = sum(part["chunks"][:i]), part["chunks"][i]  # its chunk records
    chunks = zip(*(part[column][r : r + c] for column in ("pack", "offset", "nbytes", "crc")))
    record = {
        "dtype": part["dtypes"][part["dtype"][i]],
        "shape": part["shape"][d : d + k],
        "chunk_shape": part["chunk_shape"][d : d + k],
        "attributes": part["attributes"][part["attrs"][i]],
    }
    if i in part["sharded"]:
        e = sum(part["ndim"][j] for j in part["sharded"][: part["sharded"].index(i)])
        record["inner_chunk_shape"] = part["inner_chunk_shape"][e : e + k]
    if part["packed"][i]:
        record["packed"] = [[part["packs"][p][0], offset, n, crc] for p, offset, n, crc in chunks]
    else:
        record["objects"] = [[n, crc] for _, _, n, crc in chunks]
    return record


def _decode(raw: np.ndarray, atom: dict) -> np.ndarray:
    """docs/FORMAT.md 4.1's recipe: the bytes as the atom's dtype (little-endian), in its shape."""
    names = {"bfloat16": "bfloat16", "float8_e4m3fn": "float8_e4m3fn", "float8_e5m2": "float8_e5m2"}
    import ml_dtypes

    dtype = (
        getattr(ml_dtypes, names[atom["dtype"]])
        if atom["dtype"] in names
        else np.dtype(atom["dtype"]).newbyteorder("<")
    )
    return raw.view(dtype).reshape(atom["shape"])


def _packed_atoms(state: dict, records: dict):
    """(tensor, its record, its one packed chunk) of every packed atom of the recipe's state."""
    packed = [(name, t, records[name]) for name, t in state.items() if "packed" in records[name]]
    assert len(packed) == len(state) - 1  # (all but "big")
    return [(name, t, atom, *atom["packed"][0]) for name, t, atom in packed]


def test_zarr_python_reads_packed_atoms_by_the_documented_recipe(tmp_path):
    zarr = pytest.importorskip("zarr")
    state, attempt, manifest = _recipe_case(tmp_path)
    for name, t, atom, pack, offset, nbytes, crc in _packed_atoms(state, manifest):
        raw = np.asarray(zarr.open_array(str(attempt / pack), mode="r")[offset : offset + nbytes])
        assert crc32c.crc32c(raw.tobytes()) == crc
        assert _same(_decode(raw, atom), t), name
    assert _ML_DTYPES  # (bf16 and fp8 among them)


def test_tensorstore_reads_packed_atoms_by_the_documented_recipe(tmp_path):
    ts = pytest.importorskip("tensorstore")
    state, attempt, manifest = _recipe_case(tmp_path)
    for name, t, atom, pack, offset, nbytes, _ in _packed_atoms(state, manifest):
        array = ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": str(attempt / pack)}}).result()
        raw = array[offset : offset + nbytes].read().result()
        assert _same(_decode(raw, atom), t), name


def test_inspect_shows_the_packs(tmp_path):
    ucp.save(random_state(5), str(tmp_path), options=OPTIONS)
    reader = ucp.open_checkpoint(str(tmp_path))
    info = describe(reader)
    assert info["totals"]["packs"] == len(reader.manifest.packs) > 1
    assert sum(p["chunks"] for p in info["packs"]) == sum(len(c) for c in reader.manifest.packed.values())
    text = format_table(info)
    assert f"{PACKS_GROUP}/p0-0" in text and "atoms packed in" in text


def test_a_read_of_some_packed_atoms_skips_long_runs_of_others(tmp_path):
    """Wanted chunks of a pack come in one request, short gaps read over; a gap longer than GAP_READ_BYTES (the
    optimizer state packed beside weights) splits the read, so its bytes are not read."""
    from ucp.protocol.codec import GAP_READ_BYTES

    big = torch.arange(GAP_READ_BYTES // 4 + 1024, dtype=torch.float32)  # just over the gap, packed (< pack_below)
    state = {"a": torch.ones(10), "b": big, "c": torch.full((10,), 2.0), "d": torch.zeros(3)}
    ucp.save(state, str(tmp_path), options=ucp.SaveOptions(chunking=ucp.ChunkingPolicy(pack_below=8 << 20)))
    reader = ucp.open_checkpoint(str(tmp_path))
    assert len({c[0].pack for c in reader.manifest.packed.values()}) == 1
    before = reader.storage.stats.bytes_read
    got = reader.read_atoms(["a", "c", "d"])
    assert reader.storage.stats.bytes_read - before == 40 + 40 + 12 + 0  # (c and d back to back: one run)
    assert torch.equal(got["c"], state["c"]) and torch.equal(got["a"], state["a"]) and torch.equal(got["d"], state["d"])
    before = reader.storage.stats.bytes_read
    assert torch.equal(reader.read_atoms(["a", "b"])["b"], big)
    assert reader.storage.stats.bytes_read - before == 40 + big.numel() * 4
