"""A bug hunt on the format and the read side, at random and seeded: hostile or damaged checkpoints (bytes flipped,
files cut short, JSON fields edited, resealed or not) get only ucp errors, never a raw exception, a hang, an
allocation or wrong data; unusual but legal states round-trip bitwise through `load` and `load(into=...)`, or are
refused at save time naming their key."""

from __future__ import annotations

import json
import math
import os
import random
import resource
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import crc32c
import pytest
import torch

import ucp
from ucp.engine.inspection import describe, verify
from ucp.format import index
from ucp.format.manifest import COMMIT_MARKER, step_dirname

from .helpers import manifest_view, reseal_manifest, step_path

SEED = int(os.environ.get("UCP_HUNT_SEED", "0"))
CASES = int(os.environ.get("UCP_HUNT_CASES", "40"))


class Hang(Exception):
    pass


@contextmanager
def deadline(seconds: int) -> Iterator[None]:
    """Raise Hang in the calling (main) thread if the block runs longer than `seconds`."""

    def expire(*_: object) -> None:
        raise Hang(f"still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def same(a: Any, b: Any) -> bool:
    """Bitwise equality of nested states (a tuple comes back as a list; a loaded tensor's strides do not count)."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and (a.dtype, a.shape) == (b.dtype, b.shape) and _bytes(a) == _bytes(b)
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, list) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and math.isnan(a):
        return isinstance(b, float) and math.isnan(b)
    return a == b and type(a) is type(b)


def _bytes(t: torch.Tensor) -> bytes:
    dense = torch.empty(t.shape, dtype=t.dtype).copy_(t.detach())  # (C order, whatever the strides)
    return bytes(dense.reshape(-1).view(torch.uint8).numpy())


def zeros(state: Any) -> Any:
    """A state of the same structure with zero tensors of their own (what a resuming job holds)."""
    if isinstance(state, torch.Tensor):
        return torch.zeros(state.shape, dtype=state.dtype)
    if isinstance(state, dict):
        return {k: zeros(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return [zeros(v) for v in state]
    return state


def strided_zeros(state: Any, rng: random.Random) -> Any:
    """`zeros`, some of whose tensors of 2 dimensions or more lay their memory out in another order (not contiguous)."""
    if isinstance(state, torch.Tensor) and state.dim() >= 2 and rng.random() < 0.5:
        return torch.zeros(state.shape[::-1], dtype=state.dtype).permute(*reversed(range(state.dim())))
    if isinstance(state, dict):
        return {k: strided_zeros(v, rng) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return [strided_zeros(v, rng) for v in state]
    return zeros(state)


def tensors_of(state: Any) -> list[torch.Tensor]:
    if isinstance(state, torch.Tensor):
        return [state]
    values = state.values() if isinstance(state, dict) else state if isinstance(state, (list, tuple)) else []
    return [t for v in values for t in tensors_of(v)]


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ucp", *args], capture_output=True, text=True, timeout=120, check=False
    )


# ------------------------------------------------------------------------------- hostile checkpoints, at random


def hunted_state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {
            "w": torch.randn(32, 64, generator=g),
            "b": torch.randn(7, generator=g),
            "h": torch.randn(3, 5, generator=g).to(torch.bfloat16),
            "e": torch.empty(0, 3),
            "s": torch.tensor(3.5, dtype=torch.float64),
            "layers": [{"n": torch.randn(4, generator=g).half()} for _ in range(3)],
            "big": torch.randn(40, 33, generator=g),
            "i8": torch.randint(-100, 100, (9,), dtype=torch.int8, generator=g),
            "f8": torch.randn(6, 6, generator=g).to(torch.float8_e4m3fn),
        },
        "opt": {"lr": 0.1, "betas": [0.9, 0.95], "x": float("nan")},
        "flags": torch.tensor([True, False, True]),
    }


@pytest.fixture(scope="module")
def pristines(tmp_path_factory) -> list[tuple[Path, dict]]:
    """Steps of one state in several layouts: packed or not, sharded or not, in several index parts and tree parts
    or in one."""
    out = []
    saved = index.PART_RECORDS, index.TREE_INLINE_BYTES
    try:
        for n, (records, inline, pack_below, object_bytes) in enumerate(
            [(3, 50, 600, 1024), (2048, 1 << 16, 0, 8192), (8, 50, 1 << 20, 1024)]
        ):
            index.PART_RECORDS, index.TREE_INLINE_BYTES = records, inline
            root = tmp_path_factory.mktemp(f"hunt-pristine-{n}")
            state = hunted_state(n)
            policy = ucp.ChunkingPolicy(object_bytes=object_bytes, inner_bytes=256, pack_below=pack_below)
            ucp.save(state, str(root), step=3, options=ucp.SaveOptions(chunking=policy, fsync=False))
            out.append((root, state))
    finally:
        index.PART_RECORDS, index.TREE_INLINE_BYTES = saved
    return out


HOSTILE: list[Any] = [
    None, True, False, 0, -1, 1, 2, 7, 2**31, 2**32, 2**46, 2**53 + 1, 2**63 - 1, 2**63, 2**64, -(2**63), 1.0, 0.5,
    1e308, "", "a", "..", "../../x", "/etc/passwd", "a//b", "ucp-packs/p0-0", "ucp-packs/../x", "float32", "complex64",
    "int4", "x" * 1000, "model/\ud800", [], [1], [0], [-1], [2**40, 2**40], [1] * 40, {}, {"a": 1}, [[[[1]]]],
    {"dict": {}}, {"atom": "model/w"}, {"part": 0}, {"value": 1},
]  # fmt: skip


def _json_paths(node: Any, prefix: tuple = ()) -> list[tuple]:
    out = [prefix]
    if len(prefix) < 30 and isinstance(node, dict):
        for k, v in node.items():
            out += _json_paths(v, (*prefix, k))
    elif len(prefix) < 30 and isinstance(node, list):
        for i, v in enumerate(node):
            out += _json_paths(v, (*prefix, i))
    return out


def mutate_json(rng: random.Random, doc: Any) -> Any:
    """`doc` with 1 to 3 random edits: a field removed, an integer moved off by a little or a lot, a value replaced by
    a hostile one (wrong type, huge, negative, a path that leaves the root), a list shortened, grown or shuffled, a
    value nested deep."""
    for _ in range(rng.randint(1, 3)):
        path = rng.choice(_json_paths(doc))
        if not path:
            continue
        parent = doc
        for key in path[:-1]:
            parent = parent[key]
        key, old, k = path[-1], parent[path[-1]], rng.random()
        if k < 0.1 and isinstance(parent, dict):
            del parent[key]
        elif k < 0.25 and type(old) is int:
            parent[key] = rng.choice([old + 1, old - 1, -old, old * 2**20, old + 2**32, old + 4, 0])
        elif k < 0.3:
            deep: Any = 1
            for _ in range(rng.choice([50, 200, 900])):
                deep = [deep]
            parent[key] = deep
        elif k < 0.4 and isinstance(old, list) and old:
            edit = rng.random()
            if edit < 0.3:
                old.pop(rng.randrange(len(old)))
            elif edit < 0.6:
                old.insert(rng.randrange(len(old)), rng.choice(old))
            else:
                rng.shuffle(old)
        elif k < 0.5 and isinstance(old, str):
            parent[key] = rng.choice([old + "/..", "../" + old, "/" + old, old.replace("/", "//"), old + "/", ""])
        else:
            parent[key] = json.loads(json.dumps(rng.choice(HOSTILE)))
    return doc


def _reseal(attempt: Path, name: str, data: bytes) -> None:
    """Write the step's object `name` (the manifest, or an index part) as a writer that wrote it would: its size and
    checksum recorded in the manifest, the manifest's in the commit marker."""
    manifest = json.loads((attempt / "zarr.json").read_text())
    directory = manifest["attributes"]["ucp"].get("index") or {}
    (attempt / name).write_bytes(data)
    number = int(name.rsplit("-", 1)[-1].split(".")[0]) if name.startswith("ucp-index/") else -1
    if name.startswith("ucp-index/atoms-") and number < len(directory.get("parts", [])):
        directory["parts"][number][3:] = [len(data), crc32c.crc32c(data)]
    elif name.startswith("ucp-index/tree-") and number < len(directory.get("trees", [])):
        directory["trees"][number] = [len(data), crc32c.crc32c(data)]
    if name != "zarr.json":
        data = json.dumps(manifest).encode()
        (attempt / "zarr.json").write_bytes(data)
    marker_path = attempt.parent / COMMIT_MARKER
    marker = json.loads(marker_path.read_text())
    marker["manifest_bytes"], marker["manifest_crc32c"] = len(data), crc32c.crc32c(data)
    try:
        top = json.loads(data)["attributes"]["ucp"]["index"]
        marker["atoms"], marker["bytes"] = top["atoms"], top["bytes"]
    except (KeyError, TypeError, ValueError):
        pass
    marker_path.unlink()
    marker_path.write_text(json.dumps(marker))


EDITS = ["path", "overflow", "grid", "dtype", "overlap", "outside"]


def _semantic_edit(rng: random.Random, root: Path, case: int) -> str:
    """One of the edits a hostile writer makes on purpose, resealed: an atom path that leaves the root or holds an
    empty component or a lone surrogate, a shape whose product overflows, a chunk grid that does not fit the shape,
    an unknown data type, packed chunks that overlap or lie outside their pack (each in turn, by `case`)."""
    doc = manifest_view(root, 3)
    attrs = doc["attributes"]["ucp"]
    atoms = attrs["atoms"]
    edit = EDITS[case // 2 % len(EDITS)]
    unpacked = sorted(p for p, a in atoms.items() if "objects" in a)
    path = rng.choice(unpacked if edit == "path" and unpacked else sorted(atoms))  # (a path that names files)
    entry = atoms[path]
    if edit == "path":
        new = [f"{path}\ud800", "../" + path, "/" + path, "//" + path, path + "/..", "./" + path][case // 24 % 6]
        atoms[new] = atoms.pop(path)
        text = json.dumps(attrs["tree"]).replace(json.dumps(path), json.dumps(new))
        attrs["tree"] = json.loads(text)
    elif edit == "overflow":
        entry["shape"] = [2**40, 2**40, 2**40][: max(1, len(entry["shape"]))]
    elif edit == "grid":
        entry["chunk_shape"] = [rng.choice([0, 1, 3, 2**45]) for _ in entry["chunk_shape"] or [1]]
    elif edit == "dtype":
        entry["dtype"] = rng.choice(["complex64", "int4", "float128", "", "Float32"])
    elif entry.get("packed"):
        others = [a["packed"][0] for p, a in atoms.items() if p != path and a.get("packed")]
        pack, offset, nbytes, crc = entry["packed"][0]
        if edit == "overlap" and others:
            offset = others[0][1]
        else:
            offset = rng.choice([2**32, attrs["packs"][pack][0], -8, offset + 1])
        entry["packed"][0] = [pack, offset, nbytes, crc]
    else:
        entry["objects"] = [[n + rng.choice([-4, 4, 2**33]), c] for n, c in entry.get("objects", [])]
    reseal_manifest(root, doc, 3)
    return edit


KINDS = ["flip", "truncate", "json", "resealed", "semantic", "marker", "semantic", "resealed"]


def hostile_case(rng: random.Random, pristine: Path, root: Path, case: int) -> tuple[str, bool]:
    """Copy `pristine` to `root` and damage it at random, each kind of damage in turn (`case`); (what was done,
    whether it was resealed: a writer's own checkpoint, whose data may then differ from the state saved)."""
    shutil.copytree(pristine, root)
    attempt = step_path(root, 3)
    files = sorted(p for p in attempt.rglob("*") if p.is_file() and p.name != "ucp-attempt.json")
    kind = KINDS[case % len(KINDS)]
    if kind in ("flip", "truncate"):
        target = rng.choice(files)
        data = bytearray(target.read_bytes())
        if kind == "flip" and data:
            for _ in range(rng.randint(1, 3)):
                data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        else:
            data = data[: rng.randrange(len(data) + 1)]
        target.write_bytes(bytes(data))
        return f"{kind} {target.relative_to(attempt)}", False
    if kind == "semantic":
        return f"semantic {_semantic_edit(rng, root, case)}", True
    if kind == "marker":
        marker = root / step_dirname(3) / COMMIT_MARKER
        text = json.dumps(mutate_json(rng, json.loads(marker.read_text())))
        marker.unlink()
        marker.write_text(text)
        return "marker", False
    documents = [p for p in files if p.suffix == ".json"]
    target = rng.choice(documents)
    data = json.dumps(mutate_json(rng, json.loads(target.read_text()))).encode()
    name = str(target.relative_to(attempt))
    if kind == "resealed" and (name == "zarr.json" or name.startswith("ucp-index/")):
        _reseal(attempt, name, data)
        return f"resealed {name}", True
    target.write_bytes(data)
    return f"json {name}", False


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def read_everything(root: Path, state: dict) -> dict[str, tuple[str, Any]]:
    """Every reader of a step, each bounded in time: ("ok", its result) or ("ucp", the error); anything else fails."""
    into = zeros(state)
    pointers = [t.data_ptr() for t in tensors_of(into)]
    calls: dict[str, Callable[[], Any]] = {
        "load": lambda: ucp.load(str(root)),
        "into": lambda: ucp.load(str(root), step=3, into=into),
        "describe": lambda: describe(ucp.open_checkpoint(str(root), 3)),
        "verify": lambda: verify(ucp.open_checkpoint(str(root), 3)),
    }
    out: dict[str, tuple[str, Any]] = {}
    for name, call in calls.items():
        try:
            with deadline(60):
                out[name] = ("ok", call())
        except ucp.UcpError as e:
            out[name] = ("ucp", e)
    out["into"] = (out["into"][0], into)
    assert [t.data_ptr() for t in tensors_of(into)] == pointers, "a load into the caller's tensors replaced one"
    return out


def test_random_hostile_checkpoints_get_only_ucp_errors_and_never_wrong_data(pristines, tmp_path):
    """Seeded: each case damages a copy of a real step at random (flipped bits and cut files anywhere, JSON fields
    edited in any document, resealed or not, a hostile writer's edits) and runs every reader on it. Each returns or
    raises a ucp error, within a minute, without growing the process by 256 MiB; a step that was not resealed loads
    as the state saved or not at all; what verify passes loads; nothing is written outside the step's root."""
    rng = random.Random(SEED)
    for case in range(CASES):
        pristine, state = pristines[case % len(pristines)]
        where = tmp_path / f"case-{case}"
        where.mkdir()
        root = where / "root"
        what, resealed = hostile_case(rng, pristine, root, case)
        listing = sorted(str(p.relative_to(where)) for p in where.rglob("*"))
        before = _peak_rss()
        try:
            out = read_everything(root, state)
        except Exception as e:
            raise AssertionError(f"case {case} (seed {SEED}, {what}): {type(e).__name__}: {e}") from e
        assert _peak_rss() - before < 256 << 20, f"case {case} ({what}) made a reader allocate"
        assert sorted(str(p.relative_to(where)) for p in where.rglob("*")) == listing, f"case {case} ({what}) wrote"
        if not resealed:
            for name in ("load", "into"):
                if out[name][0] == "ok":
                    assert same(state, out[name][1]), f"case {case} ({what}): {name} returned other data silently"
        report = out["verify"][1] if out["verify"][0] == "ok" else None
        if report is not None and report.ok:
            assert out["load"][0] == "ok", f"case {case} ({what}): verify passed, the load failed: {out['load'][1]}"
        shutil.rmtree(where)


@pytest.mark.parametrize("case", range(2))
def test_the_cli_answers_random_hostile_checkpoints_in_one_line(pristines, tmp_path, case):
    """`ucp verify` and `ucp inspect` on a damaged step: exit 0 or 1, never a traceback; an error is one line."""
    rng = random.Random(SEED * 1000 + case)
    pristine, _ = pristines[case % len(pristines)]
    what, _ = hostile_case(rng, pristine, tmp_path / "root", rng.randrange(len(KINDS) * 12))
    for command in ("verify", "inspect"):
        out = run_cli(command, str(tmp_path / "root"))
        lines = out.stderr.strip().splitlines()
        assert out.returncode in (0, 1) and "Traceback" not in out.stderr, (what, out.stderr[-2000:])
        if lines or (out.returncode and command == "inspect"):  # (verify's problems go to stdout, exit 1)
            assert len(lines) == 1 and lines[0].startswith("ucp: error: "), (what, out.stderr)


def test_an_atom_path_holding_a_lone_surrogate_is_a_format_error(tmp_path):
    """JSON's "\\ud800" is a str no file or object can be named by: an atom path holding one, in a resealed index,
    is a FormatError naming it (it was a UnicodeEncodeError from the file system, out of load and verify alike)."""
    rng = random.Random(SEED)
    for case in range(4):
        root = tmp_path / f"r{case}"
        policy = ucp.ChunkingPolicy(pack_below=rng.choice([0, 1 << 20]))
        ucp.save({"model": {"w": torch.randn(3)}}, str(root), step=3, options=ucp.SaveOptions(chunking=policy))
        doc = manifest_view(root, 3)
        attrs = doc["attributes"]["ucp"]
        name = "".join(rng.sample("abc", 2)) + chr(rng.randrange(0xD800, 0xE000))
        attrs["atoms"][f"model/{name}"] = attrs["atoms"].pop("model/w")
        attrs["tree"]["dict"]["model"] = {"dict": {"w": {"atom": f"model/{name}"}}}
        reseal_manifest(root, doc, 3)
        with pytest.raises(ucp.FormatError, match="lone surrogate"):
            ucp.load(str(root))
        with pytest.raises(ucp.FormatError, match="lone surrogate"):
            verify(ucp.open_checkpoint(str(root)))


def test_an_empty_atom_of_a_huge_grid_is_read_without_listing_its_chunks(tmp_path):
    """An empty atom (an extent 0) whose other extents are up to 2^46 chunks long declares no chunk: load and verify
    read nothing and list nothing. (They listed the chunk positions of every extent before the 0, out of memory: a
    hang and an allocation bomb from a few bytes of resealed metadata.) Run in a process of its own, with 2 GiB of
    address space above what it starts with, so that a bomb fails this test rather than the machine."""
    rng = random.Random(SEED)
    script = f"""
import resource, sys, torch, ucp
from ucp.engine.inspection import verify
sys.path.insert(0, {str(Path(__file__).parent.parent)!r})
from tests.helpers import manifest_view, reseal_manifest
root, ndim, zero, pack = sys.argv[1], *map(int, sys.argv[2:])
policy = ucp.ChunkingPolicy(pack_below=pack)
ucp.save({{"e": torch.empty(0, 3)}}, root, step=3, options=ucp.SaveOptions(chunking=policy, fsync=False))
doc = manifest_view(root, 3)
entry = doc["attributes"]["ucp"]["atoms"]["e"]
entry["shape"] = [0 if i == zero else 2**30 for i in range(ndim)]
entry["chunk_shape"] = [1] * ndim
reseal_manifest(root, doc, 3)
with open("/proc/self/statm") as f:
    size = int(f.read().split()[0]) * resource.getpagesize()
resource.setrlimit(resource.RLIMIT_AS, (size + (2 << 30), resource.RLIM_INFINITY))
loaded = ucp.load(root)["e"]
assert list(loaded.shape) == entry["shape"], loaded.shape
try:
    report = verify(ucp.open_checkpoint(root))
except ucp.UcpError as e:
    report = e
print("done", report)
"""
    for case in range(3):
        ndim = rng.randint(2, 4)
        zero, pack = rng.randrange(1, ndim), rng.choice([0, 1 << 20])
        out = subprocess.run(
            [sys.executable, "-c", script, str(tmp_path / f"r{case}"), str(ndim), str(zero), str(pack)],
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        assert out.returncode == 0 and "done" in out.stdout, (ndim, zero, pack, out.stderr[-2000:])


# --------------------------------------------------------------------------------- legal states, at random

DTYPES = [
    torch.bool, torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64, torch.float16, torch.bfloat16,
    torch.float32, torch.float64, torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e8m0fnu,
]  # fmt: skip
KEYS = ["a", "b.c", "w eight", "ü", "名前", "x" * 200, "1", "0", "-", "a.b.c", "~", "é" * 60, "model", "01", "2", "c.0"]
LEAVES: list[Any] = [None, True, False, 0, -1, 2**70, 1.5, float("nan"), float("inf"), -0.0, "s", "", [], {}, ()]


def random_tensor(rng: random.Random) -> torch.Tensor:
    dtype = rng.choice(DTYPES)
    shape = [rng.choice([0, 1, 2, 3, 5, 17]) for _ in range(rng.choice([0, 1, 1, 2, 2, 3]))]
    g = torch.Generator().manual_seed(rng.randrange(2**31))
    t = torch.randint(0, 256, (math.prod(shape) * dtype.itemsize,), dtype=torch.uint8, generator=g)
    t = t.view(dtype).reshape(shape) if dtype != torch.bool else (t % 2).bool().reshape(shape)
    k = rng.random()
    if k < 0.2 and t.dim() >= 2:
        t = t.transpose(0, 1)  # (strided)
    elif k < 0.35 and t.dim() >= 1 and t.shape[0] > 1:
        t = t[::2]
    elif k < 0.45 and t.dim() < 3:
        t = t.expand(2, *t.shape)  # (elements that share memory)
    elif k < 0.55 and t.dim() >= 1:
        t = torch.cat([t, t])[t.shape[0] :]  # (a view at an offset of a larger storage)
    return t


def random_node(rng: random.Random, depth: int = 0) -> Any:
    k = rng.random()
    if depth > 3 or k < 0.4:
        return random_tensor(rng) if rng.random() < 0.6 else json.loads(json.dumps(rng.choice(LEAVES)))
    if k < 0.7:
        return {rng.choice(KEYS) + str(i): random_node(rng, depth + 1) for i in range(rng.randint(0, 4))}
    items = [random_node(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    return tuple(items) if rng.random() < 0.3 else items


def random_state(rng: random.Random) -> dict:
    state = {key: random_node(rng) for key in rng.sample(KEYS, rng.randint(1, 5))}
    if rng.random() < 0.4:
        tied = torch.randn(4, 6)
        state["tied"] = {"in": tied, "out": tied, "rows": tied[1:3], "cols": tied[:, ::2]}  # (one storage)
    if rng.random() < 0.2:
        state["many"] = [torch.full((1,), i, dtype=torch.int64) for i in range(rng.randint(100, 400))]
    return state


@pytest.mark.parametrize("seed", range(SEED, SEED + 12))
def test_random_legal_states_round_trip_bitwise_through_load_and_into(tmp_path, seed):
    """Seeded random states (nested dicts, lists and tuples, empty containers, 0-d and empty tensors, strided views,
    expanded tensors and views of one storage, every stored dtype, keys with dots, spaces, unicode and 200 bytes,
    JSON leaves, hundreds of tiny tensors), saved packed or not, sharded or not: `load` gives them back bitwise, and
    `load(into=)` fills zeroed tensors of their own, contiguous or not, in place (the same data pointers) with the same
    bytes."""
    rng = random.Random(seed)
    state = random_state(rng)
    policy = ucp.ChunkingPolicy(
        object_bytes=rng.choice([64, 4096, 1 << 22]),
        inner_bytes=rng.choice([16, 64, 1 << 20]),
        pack_below=rng.choice([0, 64, 1 << 20]),
    )
    ucp.save(state, str(tmp_path), step=1, options=ucp.SaveOptions(chunking=policy, fsync=False))
    assert same(state, ucp.load(str(tmp_path)))
    into = strided_zeros(state, rng)
    pointers = [t.data_ptr() for t in tensors_of(into)]
    assert ucp.load(str(tmp_path), into=into) is into
    assert same(state, into)
    assert [t.data_ptr() for t in tensors_of(into)] == pointers


@pytest.mark.parametrize("seed", range(SEED, SEED + 8))
def test_views_that_share_an_element_are_refused_before_anything_is_filled(tmp_path, seed):
    """Two of the caller's tensors (into=) whose elements lie in one storage, a strided view and a view inside its
    reach, are refused (a StateError naming both) with the storage untouched, where they share an element: two reads
    would race to fill it. (The check took a tensor's memory as numel * itemsize bytes from its first element, which
    a strided view reaches past: `x[::2]` and `x[6:8]` share x[6] unseen, and the load filled it with either.) Views
    whose reaches do not meet are filled as any tensors are."""
    rng = random.Random(seed)
    step, n = rng.randint(2, 4), rng.randint(3, 6)
    k = rng.randint(-(-(n + 1) // step), n - 1)  # (element k of the strided view lies past its first n elements)
    start = k * step - rng.choice([0, 1])  # (a run of two whose first or second element is that one)
    ucp.save({"a": torch.arange(float(n)), "b": torch.full((2,), 100.0)}, str(tmp_path), step=0)
    x = torch.zeros(step * n + 4)
    into = {"a": x[::step][:n], "b": x[start : start + 2]}
    with pytest.raises(ucp.StateError, match="'a' and 'b' into tensors that share memory"):
        ucp.load(str(tmp_path), into=into)
    assert not x.any(), "a refused load changed the caller's tensors"
    apart = {"a": x[::step][:n], "b": x[step * (n - 1) + 1 : step * (n - 1) + 3]}  # (past the strided view's reach)
    ucp.load(str(tmp_path), into=apart)
    assert x[::step][:n].tolist() == list(map(float, range(n))) and apart["b"].tolist() == [100.0, 100.0]


@pytest.mark.parametrize("seed", range(SEED, SEED + 4))
def test_a_key_holding_a_lone_surrogate_is_refused_at_save_naming_it(tmp_path, seed):
    """A key with a lone surrogate (a str that no file or object is named by) is a StateError naming it, before
    anything is written, packed or not (unpacked, it was a UnicodeEncodeError out of the writer's mkdir)."""
    rng = random.Random(seed)
    key = rng.choice(["w", "layer.1", "é"]) + chr(rng.randrange(0xD800, 0xE000))
    state: dict = {"model": {key: torch.randn(3)}} if rng.random() < 0.5 else {key: torch.randn(3)}
    policy = ucp.ChunkingPolicy(pack_below=rng.choice([0, 1 << 20]))
    with pytest.raises(ucp.StateError, match="lone surrogate") as refused:
        ucp.save(state, str(tmp_path), step=0, options=ucp.SaveOptions(chunking=policy))
    assert repr(key) in str(refused.value)
    assert not (tmp_path / step_dirname(0)).exists()


@pytest.mark.parametrize("seed", range(SEED, SEED + 4))
def test_the_values_a_load_returns_are_its_own(tmp_path, seed):
    """JSON values a load returns (or sets in `into`) are copies: a caller that changes them (an optimizer's param
    groups, a scheduler's state) does not change what another load of the same reader returns. (They were the
    reader's own parsed tree, shared by every load of it.)"""
    rng = random.Random(seed)
    values = {"groups": [{"lr": rng.random(), "params": [0, 1]}], "sched": {"it": rng.randrange(100)}}
    state = {"w": torch.randn(2), "opt": json.loads(json.dumps(values)), "extra": [rng.random(), {"k": [1, 2]}, None]}
    ucp.save(state, str(tmp_path), step=0)
    reader = ucp.open_checkpoint(str(tmp_path))
    first = reader.load_state() if rng.random() < 0.5 else reader.load_state(into=zeros(state))
    first["opt"]["groups"][0]["lr"] = -1.0
    first["opt"]["groups"][0]["params"].append(7)
    first["opt"]["sched"]["it"] = -1
    first["extra"][1]["k"].clear()
    assert same(state, reader.load_state())
    assert same(state, reader.load_state(into=zeros(state)))


@pytest.mark.parametrize("seed", range(SEED, SEED + 4))
def test_parameters_that_require_grad_are_filled_in_place_tied_or_not(tmp_path, seed):
    """A load into a model's own parameters (`into=`: nn.Parameters, which require grad), contiguous or not, one
    tied under two keys (an embedding and its output layer): each filled in place, as `load_state_dict` fills them
    (under no_grad), the tied one with the last key's atom. (The tied one was a RuntimeError out of torch, "a leaf
    Variable that requires grad is being used in an in-place operation", after every other tensor was filled.)"""
    rng = random.Random(seed)
    rows, cols = rng.randint(1, 6), rng.randint(1, 6)
    state = {k: torch.randn(rows, cols) for k in ("embed", "norm", "out", "w")}
    policy = ucp.ChunkingPolicy(pack_below=rng.choice([0, 1 << 20]), object_bytes=rng.choice([16, 1 << 20]))
    ucp.save(state, str(tmp_path), step=0, options=ucp.SaveOptions(chunking=policy, fsync=False))
    tied = torch.nn.Parameter(torch.zeros(rows, cols))
    strided = torch.nn.Parameter(torch.zeros(cols, rows).t())  # (a leaf whose memory is in the other order)
    into = {"embed": tied, "norm": torch.nn.Parameter(torch.zeros(rows, cols)), "out": tied, "w": strided}
    pointers = {k: t.data_ptr() for k, t in into.items()}
    assert ucp.load(str(tmp_path), into=into) is into
    assert {k: t.data_ptr() for k, t in into.items()} == pointers
    assert all(isinstance(t, torch.nn.Parameter) and t.requires_grad for t in into.values())
    for key in ("norm", "out", "w"):
        assert torch.equal(into[key].detach(), state[key])
    assert into["embed"] is tied  # (the last key's atom: "out")


@pytest.mark.parametrize("seed", range(SEED, SEED + 3))
def test_the_landing_fills_a_parameter_that_requires_grad_or_a_view_of_one(seed):
    """The load path to a device (`Landing`, here with host memory as its destination, as on a machine without a GPU)
    copies into the caller's tensors as `load_state_dict` does, under no_grad, in the reading thread: a parameter
    that requires grad, or a view of one (a sharded load's region), is filled. (torch refused the copy: "a leaf
    Variable that requires grad is being used in an in-place operation".)"""
    from ucp.engine.landing import Landing

    rng = random.Random(seed)
    rows, cols = rng.randint(2, 9), rng.randint(1, 9)
    param = torch.nn.Parameter(torch.zeros(rows, cols))
    cut = rng.randrange(1, rows)
    values = torch.randn(rows, cols)
    with Landing(1 << 20, pinned=False) as landing:
        landing.land(param, lambda host: host.copy_(values))
        landing.land(param[cut:], lambda host: host.copy_(-values[cut:]))
    assert torch.equal(param.detach(), torch.cat([values[:cut], -values[cut:]])) and param.requires_grad
