"""Hostile or damaged metadata, and hostile file system objects: only ucp errors (one line in the CLI), no hang,
no allocation bomb, nothing written outside the root, committed data untouched."""

from __future__ import annotations

import json
import os
import random
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ucp
from ucp.engine.inspection import describe, verify
from ucp.format.manifest import COMMIT_MARKER, step_dirname
from ucp.protocol.attempt import collect_garbage
from ucp.storage import LocalStorage

from .helpers import manifest_view, reseal_manifest, step_path

OPTIONS = ucp.SaveOptions(chunking=ucp.ChunkingPolicy(object_bytes=8192, inner_bytes=2048, pack_below=0), fsync=False)


def make(root: Path) -> dict:
    state = {"model": {"w": torch.randn(32, 64), "b": torch.randn(7)}, "opt": {"lr": 0.1, "betas": [0.9, 0.95]}}
    ucp.save(state, str(root), step=3, options=OPTIONS)
    return state


def manifest_doc(root: Path) -> dict:
    """The step's zarr.json as it is (format 3.1: the manifest's top document, its atom records in index parts)."""
    return json.loads((step_path(root, 3) / "zarr.json").read_text())


def every_reader(root: Path) -> None:
    """Everything that reads a step's metadata; each may fail only with a ucp error."""
    for call in (
        lambda: ucp.load(str(root)),
        lambda: ucp.load(str(root), step=3),
        lambda: describe(ucp.open_checkpoint(str(root), 3)),
        lambda: verify(ucp.open_checkpoint(str(root), 3)),
        lambda: ucp.CheckpointManager(str(root)).steps(),
    ):
        try:
            call()
        except ucp.UcpError:
            pass


def run_cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ucp", *args], capture_output=True, text=True, timeout=timeout, check=False
    )


def assert_one_line_error(result: subprocess.CompletedProcess, *fragments: str) -> None:
    lines = result.stderr.strip().splitlines()
    assert result.returncode != 0 and len(lines) == 1 and lines[0].startswith("ucp: error: "), result.stderr[-2000:]
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


# ------------------------------------------------------------------------------------- declared sizes


@pytest.mark.parametrize(
    "edit, fragment",
    [
        ({"shape": [2**62, 1], "chunk_shape": [1, 1]}, "shape must be an integer in"),
        ({"shape": [2**40, 2**10], "chunk_shape": [1, 2**10]}, "declares"),
        ({"shape": [2**18, 2**15], "chunk_shape": [2**18, 2**15]}, "objects larger than"),  # a 32 GiB chunk
        ({"shape": [2**30], "chunk_shape": [1]}, "chunk objects, more than"),
        ({"shape": [2**26], "chunk_shape": [2**26], "inner_chunk_shape": [1]}, "inner chunks per shard"),
        ({"shape": [-4, 64]}, "must be an integer"),
        ({"shape": [1.5, 64]}, "must be an integer"),
        ({"shape": [True, 64]}, "must be an integer"),
        ({"shape": list(range(40))}, "at most 32"),
        ({"dtype": "complex1024"}, "complex1024"),
        ({"attributes": [1]}, "attributes an object"),
        ({"objects": [[1, 2], [3, 4]]}, "must list"),
        ({"objects": "nope"}, "must list"),
    ],
)
def test_declared_sizes_are_bounded_before_anything_is_allocated(tmp_path, edit, fragment):
    make(tmp_path)
    doc = manifest_view(tmp_path, 3)  # (in format 3.1 the entry is written back into its index part)
    doc["attributes"]["ucp"]["atoms"]["model/w"].update(edit)
    reseal_manifest(tmp_path, doc, 3)
    start = time.monotonic()
    with pytest.raises(ucp.FormatError, match=fragment):
        ucp.load(str(tmp_path))
    assert time.monotonic() - start < 5
    if (
        "more than" in fragment or "declares" in fragment or "larger" in fragment
    ):  # (the CLI costs seconds: the cases)
        assert_one_line_error(run_cli("inspect", str(tmp_path)), fragment)
        assert_one_line_error(run_cli("verify", str(tmp_path)), fragment)


@pytest.mark.parametrize("where", ["tree", "marker", "atom"])
def test_deep_nesting_is_refused_without_recursing(tmp_path, where):
    make(tmp_path)
    deep = "[" * 60_000 + "]" * 60_000
    if where == "marker":
        marker = tmp_path / step_dirname(3) / COMMIT_MARKER
        marker.unlink()
        marker.write_text(
            '{"format_version": "2.0", "step": 3, "x": ' + "[" * 20_000 + "]" * 20_000 + "}"
        )  # (under 64 KiB)
    else:
        doc = manifest_view(tmp_path, 3)
        if where == "tree":
            doc["attributes"]["ucp"]["tree"]["dict"]["opt"] = {"value": "DEEP"}
        else:  # (in format 3.1, in the atom's index part)
            doc["attributes"]["ucp"]["atoms"]["model/w"]["attributes"]["x"] = "DEEP"
        reseal_manifest(tmp_path, doc, 3, text_edit=lambda text: text.replace('"DEEP"', deep))
    with pytest.raises(ucp.FormatError, match="nested more than"):
        ucp.load(str(tmp_path), step=3)
    assert ucp.CheckpointManager(str(tmp_path)).steps() == ([] if where == "marker" else [3])
    assert_one_line_error(run_cli("inspect", str(tmp_path), "--step", "3"), "nested more than")


def reseal_manifest_text(root: Path, text: str) -> None:
    import crc32c

    data = text.encode()
    prefix = step_path(root, 3)
    (prefix / "zarr.json").write_bytes(data)
    marker_path = prefix.parent / COMMIT_MARKER
    marker = json.loads(marker_path.read_text())
    marker.update(manifest_crc32c=crc32c.crc32c(data), manifest_bytes=len(data))
    marker_path.unlink()
    marker_path.write_text(json.dumps(marker))


# -------------------------------------------------------------------------------- file system objects


def test_a_fifo_in_place_of_the_marker_or_manifest_does_not_hang(tmp_path):
    make(tmp_path)
    marker = tmp_path / step_dirname(3) / COMMIT_MARKER
    marker.unlink()
    os.mkfifo(marker)
    with pytest.raises(ucp.FormatError, match="not a regular file"):
        ucp.load(str(tmp_path), step=3)
    with pytest.raises(ucp.CheckpointNotFoundError):
        ucp.load(str(tmp_path))  # (no committed step left to be the latest)
    assert ucp.CheckpointManager(str(tmp_path)).steps() == []
    for command in ("inspect", "verify"):
        assert_one_line_error(run_cli(command, str(tmp_path), "--step", "3", timeout=30), "not a regular file")


def test_a_fifo_in_place_of_a_chunk_does_not_hang_verify(tmp_path):
    make(tmp_path)
    chunk = next((step_path(tmp_path, 3) / "model" / "w").glob("c.*"))
    chunk.unlink()
    os.mkfifo(chunk)
    with pytest.raises(ucp.StorageError, match="not a regular file"):
        ucp.load(str(tmp_path))
    out = run_cli("verify", str(tmp_path), timeout=30)
    assert out.returncode == 1 and "not a regular file" in out.stdout


def test_a_save_never_follows_a_symlinked_step_directory(tmp_path):
    root, outside = tmp_path / "ckpt", tmp_path / "outside"
    make(root)
    outside.mkdir()
    (root / step_dirname(4)).symlink_to(outside, target_is_directory=True)
    with pytest.raises(ucp.StorageError, match="symbolic link"):
        ucp.save({"w": torch.ones(3)}, str(root), step=4)
    assert list(outside.iterdir()) == []
    assert ucp.CheckpointManager(str(root)).steps() == [3]


def test_a_symlinked_chunk_is_not_followed_on_read(tmp_path):
    make(tmp_path)
    chunk = next((step_path(tmp_path, 3) / "model" / "w").glob("c.*"))
    target = tmp_path / "elsewhere"
    target.write_bytes(chunk.read_bytes())
    chunk.unlink()
    chunk.symlink_to(target)
    with pytest.raises(ucp.StorageError, match="symbolic link"):
        ucp.load(str(tmp_path))


def test_a_directory_replaced_by_a_link_is_not_followed_on_read(tmp_path):
    """Any directory between the step and a chunk moved elsewhere and linked back: every byte it holds is still
    what the manifest's checksums say, but a read through it is refused, naming the path."""
    root = tmp_path / "ckpt"
    make(root)
    chunk = next((step_path(root, 3) / "model" / "w").glob("c.*"))
    directory = random.choice([p for p in chunk.parents if p.is_relative_to(step_path(root, 3))])
    moved = tmp_path / "elsewhere"
    directory.rename(moved)
    directory.symlink_to(moved, target_is_directory=True)
    with pytest.raises(ucp.StorageError, match="symbolic link"):
        ucp.load(str(root))
    with pytest.raises(ucp.StorageError, match="symbolic link"):
        LocalStorage(str(root)).read(str(chunk.relative_to(root)))
    out = run_cli("verify", str(root), timeout=30)  # (a damaged atom is a report line; a damaged manifest an error)
    assert out.returncode != 0 and "symbolic link" in out.stdout + out.stderr


def test_a_root_named_through_a_link_is_the_callers_choice(tmp_path):
    """The root itself (or a directory above it) may be a link: only links below the root are refused."""
    (tmp_path / "real" / "deeper").mkdir(parents=True)
    (tmp_path / "above").symlink_to(tmp_path / "real", target_is_directory=True)
    (tmp_path / "real" / "root-link").symlink_to(tmp_path / "real" / "deeper", target_is_directory=True)
    for root in (tmp_path / "above" / "deeper", tmp_path / "real" / "root-link", tmp_path / "above" / "root-link"):
        state = {"w": torch.randn(3, 5), "small": {f"t{i}": torch.randn(2) for i in range(20)}}
        step = random.randrange(100)
        ucp.save(state, str(root), step=step, options=OPTIONS)
        got = ucp.load(str(root))
        assert torch.equal(got["w"], state["w"]) and all(
            torch.equal(got["small"][k], v) for k, v in state["small"].items()
        )
        assert ucp.CheckpointManager(str(root)).steps() == [step]
        assert verify(ucp.open_checkpoint(str(root))).ok
        LocalStorage(str(root)).delete(step_dirname(step))
        assert ucp.CheckpointManager(str(root)).steps() == []


def test_gc_never_removes_anything_through_a_linked_directory(tmp_path):
    """A step directory below the latest commit, without a marker, would be a 1.0 save's leftovers; as a link to
    elsewhere it is left alone, and so is what it points to (as is the target of a link inside a dead attempt)."""
    root, outside = tmp_path / "ckpt", tmp_path / "outside"
    ucp.save({"w": torch.ones(2)}, str(root), step=5)
    outside.mkdir()
    for name in ("keep.txt", "zarr.json"):
        (outside / name).write_text("not ucp's")
    (outside / "sub").mkdir()
    (root / step_dirname(3)).symlink_to(outside, target_is_directory=True)
    storage = LocalStorage(str(root))
    storage.write(f"{step_dirname(2)}/attempt-{'0' * 32}/model/w/c.0", [b"x"])  # a dead attempt: no owner record
    os.symlink(outside, root / step_dirname(2) / f"attempt-{'0' * 32}" / "model" / "link")
    for directory, dirs, files in os.walk(root / step_dirname(2)):  # (nothing in it written for an hour)
        for name in [".", *dirs, *files]:
            os.utime(os.path.join(directory, name), (time.time() - 3600,) * 2, follow_symlinks=False)
    (outside / "ucp-attempt.json").write_text("{}")  # an owner record there, for a linked attempt to be read through
    linked_attempt = root / step_dirname(6) / f"attempt-{'1' * 32}"
    linked_attempt.parent.mkdir()
    linked_attempt.symlink_to(outside, target_is_directory=True)
    removed = collect_garbage(storage)
    assert sorted(p.name for p in outside.iterdir()) == ["keep.txt", "sub", "ucp-attempt.json", "zarr.json"]
    assert (root / step_dirname(3)).is_symlink() and linked_attempt.is_symlink()
    assert removed == [f"{step_dirname(2)}/attempt-{'0' * 32}"]
    for call in (storage.listdir, storage.delete, storage.remove_empty_dir):
        with pytest.raises(ucp.StorageError, match=f"{step_dirname(3)} is a symbolic link"):
            call(f"{step_dirname(3)}/sub")
    assert sorted(p.name for p in outside.iterdir()) == ["keep.txt", "sub", "ucp-attempt.json", "zarr.json"]
    assert ucp.load(str(root))["w"].tolist() == [1.0, 1.0]


def test_a_state_key_longer_than_a_file_name_is_refused_before_any_write(tmp_path):
    make(tmp_path)
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    with pytest.raises(ucp.StateError, match="longer than 255 bytes"):
        ucp.save({"model": {"x" * 300: torch.ones(1)}}, str(tmp_path), step=4)
    with pytest.raises(ucp.StateError, match="nested more than"):
        nested: dict = {"w": torch.ones(1)}
        for _ in range(100):
            nested = {"k": nested}
        ucp.save(nested, str(tmp_path), step=4)
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before


def test_an_edited_marker_that_names_another_directory_is_refused(tmp_path):
    make(tmp_path)
    marker = tmp_path / step_dirname(3) / COMMIT_MARKER
    doc = json.loads(marker.read_text())
    for attempt in ("../../etc", "attempt-xyz", 5, None):
        doc["attempt"] = attempt
        marker.unlink()
        marker.write_text(json.dumps(doc))
        with pytest.raises(ucp.FormatError, match="attempt"):
            ucp.load(str(tmp_path), step=3)


# ------------------------------------------------------------------------------------------------ fuzz


JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False)
    | st.text(max_size=8),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=6), children, max_size=4),
    max_leaves=12,
)


def _paths(node: object, prefix: tuple = ()) -> list[tuple]:
    out = [prefix]
    if isinstance(node, dict):
        for k, v in node.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            out += _paths(v, (*prefix, i))
    return out


def _mutate(doc: dict, path: tuple, value: object, delete: bool) -> dict:
    if not path:
        return value  # type: ignore[return-value]
    node = doc
    for k in path[:-1]:
        node = node[k]
    if delete and isinstance(node, dict):
        del node[path[-1]]
    else:
        node[path[-1]] = value
    return doc


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    root = tmp_path_factory.mktemp("pristine")
    make(root)
    return root


def _fresh(pristine: Path, tmp_path_factory) -> Path:
    import shutil

    root = tmp_path_factory.mktemp("fuzz")
    shutil.copytree(pristine, root, dirs_exist_ok=True)
    return root


FUZZ = settings(
    max_examples=int(os.environ.get("UCP_FUZZ_EXAMPLES", "60")),
    deadline=20_000,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


@FUZZ
@given(data=st.data())
def test_fuzzed_manifests_get_only_ucp_errors(pristine, tmp_path_factory, data):
    root = _fresh(pristine, tmp_path_factory)
    doc = manifest_doc(root)
    for _ in range(data.draw(st.integers(1, 3))):
        path = data.draw(st.sampled_from(_paths(doc)))
        doc = _mutate(doc, path, data.draw(JSON), data.draw(st.booleans()))
    before = _peak_rss()
    reseal_manifest_text(root, json.dumps(doc))
    every_reader(root)
    assert _peak_rss() - before < 256 << 20, "a fuzzed manifest made a reader allocate"
    assert_verify_passes_only_what_loads(root)


def assert_verify_passes_only_what_loads(root: Path) -> None:
    """A step `verify` finds ok loads: what it passes, no load refuses."""
    try:
        report = verify(ucp.open_checkpoint(str(root), 3))
    except ucp.UcpError:
        return
    if report.ok:
        ucp.load(str(root), step=3)


@pytest.mark.parametrize("node", [{"part": 5}, -1, "3.1", [-1], True, {"atom": 7}, {"dict": []}, {"float": "1"}])
def test_a_resealed_state_tree_that_no_load_takes_fails_verify(tmp_path, node):
    """A manifest whose state tree is malformed, resealed in its marker (a writer's bug, a hostile edit), fails
    every load; verify, which passed it, reports it too (exit 1, naming the tree)."""
    make(tmp_path)
    doc = manifest_doc(tmp_path)
    doc["attributes"]["ucp"]["tree"]["dict"]["model"] = node
    reseal_manifest_text(tmp_path, json.dumps(doc))
    with pytest.raises(ucp.FormatError, match="state tree"):
        ucp.load(str(tmp_path))
    out = run_cli("verify", str(tmp_path))
    assert out.returncode == 1 and "state tree" in out.stdout, (out.stdout, out.stderr)


@FUZZ
@given(data=st.data())
def test_fuzzed_markers_get_only_ucp_errors(pristine, tmp_path_factory, data):
    root = _fresh(pristine, tmp_path_factory)
    marker = root / step_dirname(3) / COMMIT_MARKER
    doc = json.loads(marker.read_text())
    if data.draw(st.booleans()):
        text = data.draw(st.binary(max_size=200))
    else:
        for _ in range(data.draw(st.integers(1, 3))):
            doc = _mutate(doc, data.draw(st.sampled_from(_paths(doc))), data.draw(JSON), data.draw(st.booleans()))
        text = json.dumps(doc).encode()
    marker.unlink()
    marker.write_bytes(text)
    every_reader(root)


@FUZZ
@given(data=st.data())
def test_fuzzed_atom_metadata_is_reported_by_verify(pristine, tmp_path_factory, data):
    root = _fresh(pristine, tmp_path_factory)
    meta_file = step_path(root, 3) / "model" / "w" / "zarr.json"
    doc = json.loads(meta_file.read_text())
    path = data.draw(st.sampled_from(_paths(doc)[1:]))
    doc = _mutate(doc, path, data.draw(JSON), data.draw(st.booleans()))
    meta_file.write_text(json.dumps(doc))
    report = verify(ucp.open_checkpoint(str(root)))
    changed = json.loads(meta_file.read_text()) != json.loads(
        (step_path(pristine, 3) / "model" / "w" / "zarr.json").read_text()
    )
    if not report.ok:
        assert any("model/w" in p for p in report.problems)
    ucp.load(str(root))  # loads plan from the manifest alone: still fine
    assert changed or report.ok


# --------------------------------------------------------------------------------- format 3.1's index parts


@pytest.fixture(scope="module")
def pristine_packed(tmp_path_factory):
    """A step whose small atoms are packed: an index part of packed and unpacked atoms' records."""
    root = tmp_path_factory.mktemp("pristine-packed")
    state = {"model": {"w": torch.randn(32, 64), "b": torch.randn(7), "h": torch.randn(3, 5).to(torch.bfloat16)}}
    ucp.save(state, str(root), step=3, options=ucp.SaveOptions(chunking=ucp.ChunkingPolicy(pack_below=1024)))
    return root


def reseal_part(root: Path, text: str) -> None:
    """Write `text` as the step's first atom part, its size and checksum in the manifest, the manifest's in the
    marker (as a writer that wrote this part would)."""
    import crc32c

    from ucp.format.index import atoms_part_name

    prefix = step_path(root, 3)
    data = text.encode()
    (prefix / atoms_part_name(0)).write_bytes(data)
    doc = manifest_doc(root)
    doc["attributes"]["ucp"]["index"]["parts"][0][3:] = [len(data), crc32c.crc32c(data)]
    reseal_manifest_text(root, json.dumps(doc))


@FUZZ
@given(data=st.data())
def test_fuzzed_index_parts_get_only_ucp_errors(pristine_packed, tmp_path_factory, data):
    from ucp.format.index import atoms_part_name

    root = _fresh(pristine_packed, tmp_path_factory)
    doc = json.loads((step_path(root, 3) / atoms_part_name(0)).read_text())
    for _ in range(data.draw(st.integers(1, 3))):
        path = data.draw(st.sampled_from(_paths(doc)))
        doc = _mutate(doc, path, data.draw(JSON), data.draw(st.booleans()))
    before = _peak_rss()
    reseal_part(root, json.dumps(doc))
    every_reader(root)
    assert _peak_rss() - before < 256 << 20, "a fuzzed index part made a reader allocate"


def test_a_3_0_reader_refuses_a_3_1_step_clearly(pristine_packed):
    """What a reader of format 3.0 does with a 3.1 manifest (ucp's 3.0 parser, kept for 3.0 steps): a FormatError
    that says what it lacks, never an empty or partial step."""
    from ucp.format.manifest import StepManifest

    with pytest.raises(ucp.FormatError, match="needs an 'atoms' object"):
        StepManifest.from_group_json(manifest_doc(pristine_packed), "a 3.1 manifest")


@pytest.mark.parametrize(
    "edit, fragment",
    [
        (lambda part: part["paths"].reverse(), "do not start at"),
        (lambda part: part["paths"].__setitem__(1, part["paths"][0]), "appears twice"),
        (lambda part: part["chunks"].__setitem__(0, 2**40), "must list"),
        (lambda part: part["crc"].__setitem__(0, 2**32), "crc32c is not an integer of 32 bits"),
        (lambda part: part["ndim"].__setitem__(0, 33), "at most 32"),
        (lambda part: part["pack"].__setitem__(0, 7), "no listed pack"),
        (lambda part: part["shape"].append(1), "column 'shape' must be a list of"),
        (lambda part: part.__setitem__("dtypes", ["complex1024"]), "complex1024"),
    ],
)
def test_a_hostile_index_part_is_a_format_error_naming_it(pristine_packed, tmp_path_factory, edit, fragment):
    from ucp.format.index import atoms_part_name

    root = _fresh(pristine_packed, tmp_path_factory)
    doc = json.loads((step_path(root, 3) / atoms_part_name(0)).read_text())
    edit(doc)
    reseal_part(root, json.dumps(doc))
    with pytest.raises(ucp.FormatError, match=fragment):
        ucp.load(str(root), step=3)
    assert_one_line_error(run_cli("verify", str(root), "--step", "3"), fragment)


def test_packed_chunks_of_two_index_parts_that_overlap_are_refused_by_load_and_verify(tmp_path, monkeypatch):
    """Each index part's own records are checked not to overlap when it is read; records of two parts meet only in
    a read of the pack (or verify's): there, an overlap is a FormatError. Before, verify passed it and a load read
    the second chunk out of place (a false IntegrityError of intact data)."""
    import crc32c

    from ucp.format import index

    packed = ucp.SaveOptions(chunking=ucp.ChunkingPolicy(pack_below=1 << 20), fsync=False)
    ucp.save({"a": torch.randn(7), "b": torch.randn(9)}, str(tmp_path), step=3, options=packed)
    doc = manifest_view(tmp_path, 3)
    atoms = doc["attributes"]["ucp"]["atoms"]
    (pack, offset, _, _), (_, _, nbytes, _) = atoms["a"]["packed"][0], atoms["b"]["packed"][0]
    data = (step_path(tmp_path, 3) / pack / "c.0").read_bytes()
    atoms["b"]["packed"][0] = [pack, offset, nbytes, crc32c.crc32c(data[offset : offset + nbytes])]  # over a's
    monkeypatch.setattr(index, "PART_RECORDS", 1)  # (a part per atom: a's record and b's in two)
    reseal_manifest(tmp_path, doc, 3)
    assert len(list((step_path(tmp_path, 3) / "ucp-index").glob("atoms-*"))) == 2
    with pytest.raises(ucp.FormatError, match=r"atom '(a|b)' chunk c .*overlap another chunk's"):
        ucp.load(str(tmp_path))
    out = run_cli("verify", str(tmp_path))
    assert out.returncode == 1 and "overlap atom" in out.stdout, (out.stdout, out.stderr)


def test_verify_reads_no_more_of_a_pack_than_its_recorded_size(tmp_path):
    """(It read a pack whole whatever its size on storage: a pack grown to a 4 TiB sparse file was a MemoryError.)"""
    packed = ucp.SaveOptions(chunking=ucp.ChunkingPolicy(pack_below=1 << 20), fsync=False)
    ucp.save({"a": torch.randn(7), "b": torch.randn(9)}, str(tmp_path), step=3, options=packed)
    (pack,) = (step_path(tmp_path, 3) / "ucp-packs").glob("p*")
    with open(pack / "c.0", "r+b") as f:
        f.truncate(1 << 42)
    out = run_cli("verify", str(tmp_path))
    assert out.returncode == 1 and "is more than the" in out.stdout and "bytes its commit recorded" in out.stdout, (
        out.stdout,
        out.stderr,
    )


def _reseal_part(root: Path, number: int, part: dict) -> None:
    """Write index part `number` and record its size and checksum in the manifest, the manifest's in the marker."""
    import crc32c

    data = json.dumps(part).encode()
    (step_path(root, 3) / f"ucp-index/atoms-{number}.json").write_bytes(data)
    doc = manifest_doc(root)
    doc["attributes"]["ucp"]["index"]["parts"][number][3:] = [len(data), crc32c.crc32c(data)]
    reseal_manifest_text(root, json.dumps(doc))


@pytest.mark.parametrize("edit", ["twice", "out-of-order"])
def test_an_atom_in_the_wrong_index_part_is_refused_whichever_parts_a_load_reads(tmp_path, monkeypatch, edit):
    """A part's paths are bounded by the directory only at its ends: an atom listed by two parts, or out of order
    inside one, gave a whole load one record and a load of that atom alone another (or none), and verify passed."""
    from ucp.format import index

    monkeypatch.setattr(index, "PART_RECORDS", 6)  # (three atoms a part: a record each and one of its chunk)
    ucp.save({k: torch.randn(3) for k in "abcdef"}, str(tmp_path), step=3, options=OPTIONS)
    parts = [json.loads(p.read_text()) for p in sorted((step_path(tmp_path, 3) / "ucp-index").glob("atoms-*.json"))]
    assert [p["paths"] for p in parts] == [["a", "b", "c"], ["d", "e", "f"]]
    if edit == "twice":
        parts[1]["paths"][1] = "b"  # (e's record, named b: b is part 0's too)
    else:
        parts[0]["paths"][1], parts[1]["paths"][1] = "e", "b"  # (each part's ends in place, their middles swapped)
    for number, part in enumerate(parts):
        _reseal_part(tmp_path, number, part)
    with pytest.raises(ucp.FormatError, match="listed by (another index part too|index part .* out of the order)"):
        reader = ucp.open_checkpoint(str(tmp_path), 3)
        report = verify(reader)
        assert not report.ok, report
        raise ucp.FormatError(report.problems[0])


def test_a_resealed_tree_naming_an_atom_twice_is_refused(tmp_path):
    """(Both keys got one tensor, sharing storage, and `into=` filled one of the caller's two.)"""
    make(tmp_path)
    doc = manifest_doc(tmp_path)
    doc["attributes"]["ucp"]["tree"]["dict"]["model"]["dict"]["again"] = {"atom": "model/w"}
    reseal_manifest_text(tmp_path, json.dumps(doc))
    with pytest.raises(ucp.FormatError, match="the state tree names atom 'model/w' twice"):
        ucp.load(str(tmp_path))
    assert run_cli("verify", str(tmp_path)).returncode == 1


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("zarr_format", 2),
        ("fill_value", "banana"),
        ("storage_transformers", [{"name": "x", "must_understand": True}]),
        ("dimension_names", [1, 2]),
        ("attributes", {"ucp": {"role": "optimizer_state"}}),
    ],
)
def test_verify_holds_every_key_of_an_atoms_zarr_json_to_the_manifest(tmp_path, key, value):
    """(It compared six keys: a zarr.json that zarr-python cannot open, or whose attributes were changed, passed.)"""
    make(tmp_path)
    path = step_path(tmp_path, 3) / "model" / "w" / "zarr.json"
    doc = json.loads(path.read_text())
    doc[key] = value
    path.write_text(json.dumps(doc))
    out = run_cli("verify", str(tmp_path))
    assert out.returncode == 1 and f"atom 'model/w': zarr.json says {key} = " in out.stdout, out.stdout


def test_a_role_or_quantization_attribute_of_another_type_is_shown_or_refused(tmp_path):
    """A caller's attribute may be any JSON value (`inspect` crashed on a role that is not a string); a
    `quantization` attribute is the format's (section 2.1), checked by verify as a sharded load checks it."""
    ucp.save({"w": torch.randn(4, 4)}, str(tmp_path), step=3, atom_attributes={"w": {"role": 5}}, options=OPTIONS)
    shown = run_cli("inspect", str(tmp_path))
    assert shown.returncode == 0 and any(line.split()[:2] == ["w", "5"] for line in shown.stdout.splitlines())
    doc = manifest_view(tmp_path, 3)
    doc["attributes"]["ucp"]["atoms"]["w"]["attributes"]["quantization"] = {"scales": 5, "block": [2, 2]}
    reseal_manifest(tmp_path, doc, 3)
    out = run_cli("verify", str(tmp_path))
    assert out.returncode == 1 and "quantization scales 5 is not the path of an atom" in out.stdout, out.stdout


def test_a_path_to_an_attempt_that_is_not_committed_is_refused(tmp_path):
    """(`open_checkpoint` of step_N/attempt-X read the committed attempt whatever X was: verify said ok of a
    directory it never read.)"""
    make(tmp_path)
    other = step_path(tmp_path, 3).parent / ("attempt-" + "b" * 32)
    shutil.copytree(step_path(tmp_path, 3), other)
    with pytest.raises(ucp.CheckpointNotFoundError, match="is not the committed attempt of step 3"):
        ucp.open_checkpoint(str(other))
    assert ucp.open_checkpoint(str(step_path(tmp_path, 3))).step == 3
    out = run_cli("verify", str(other))
    assert out.returncode != 0 and "is not the committed attempt" in out.stderr, (out.stdout, out.stderr)


def test_a_format_3_0_packed_entry_whose_pack_is_not_a_name_is_refused(tmp_path):
    """(A pack named by a JSON list was a TypeError, unhashable, in every reader of a 3.0 step.)"""
    root = tmp_path / "v3"
    shutil.copytree(Path(__file__).parent / "fixtures" / "v3" / "single", root)
    doc = manifest_view(root, "latest")
    atoms = doc["attributes"]["ucp"]["atoms"]
    path = next(p for p, a in atoms.items() if "packed" in a)
    atoms[path]["packed"][0][0] = [atoms[path]["packed"][0][0]]
    reseal_manifest(root, doc, "latest")
    with pytest.raises(ucp.FormatError, match=f"packed atom {path!r} has an entry .* not \\[a listed pack"):
        ucp.load(str(root))
    assert_one_line_error(run_cli("verify", str(root)), "that is not [a listed pack")
