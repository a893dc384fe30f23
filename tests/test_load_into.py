"""Loads into tensors the caller holds (`into=`) and the tensors a load makes.

`ucp.load(url, into=state)`, `CheckpointReader.load_state(into=)` and `read_atoms(paths, into=)` fill the caller's
tensors in place (the same memory before and after), bitwise, and set its other values; a state of another
structure (a key missing or extra, a list of another length, a tensor of another shape or dtype, a value where a
tensor was saved) is a one-line StateError naming the key, and nothing of the caller's state changes before every
check has passed. The tensors a load makes each have a storage of their own: freed, resized and saved one by one.
"""

from __future__ import annotations

import copy
import io
import random

import pytest
import torch

import ucp

from .helpers import DRAW, assert_same_state, damage_atom
from .test_packs import OPTIONS, random_state


def _zeros_like_state(state: object) -> object:
    """A state of the same structure whose tensors are fresh zeros and whose values are other ones."""
    if isinstance(state, torch.Tensor):
        return torch.zeros_like(state)
    if isinstance(state, dict):
        return {k: _zeros_like_state(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return [_zeros_like_state(v) for v in state]
    return None if state is not None else 0


def _tensors(state: object, out: list | None = None) -> list[torch.Tensor]:
    out = [] if out is None else out
    if isinstance(state, torch.Tensor):
        out.append(state)
    elif isinstance(state, dict):
        for v in state.values():
            _tensors(v, out)
    elif isinstance(state, (list, tuple)):
        for v in state:
            _tensors(v, out)
    return out


def _snapshot(state: object) -> list[tuple[int, bytes]]:
    return [
        (t.data_ptr(), b"" if t.is_meta else bytes(t.contiguous().reshape(-1).view(torch.uint8).numpy()))
        for t in _tensors(state)
    ]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    seed = DRAW.randrange(2**31)
    state = random_state(seed)
    state["values"] = {"lr": 3e-4, "names": ["a", "b"], "nan": float("nan")}
    state["listed"] = [torch.arange(5), 7, {"t": torch.ones(3, 2, dtype=torch.bfloat16)}]
    root = tmp_path_factory.mktemp("into")
    ucp.save(state, str(root), step=1, options=OPTIONS)
    return root, state, seed


def test_a_load_into_the_callers_state_fills_its_tensors_in_place(saved):
    root, state, seed = saved
    into = _zeros_like_state(state)
    into["listed"] = (into["listed"][0], 0, into["listed"][2])  # (a tuple: its tensors filled, it stays a tuple)
    pointers = [t.data_ptr() for t in _tensors(into)]
    assert ucp.load(str(root), into=into) is into
    assert [t.data_ptr() for t in _tensors(into)] == pointers, "a tensor was replaced, not filled"
    expected = copy.copy(state)
    expected["listed"] = [state["listed"][0], 0, state["listed"][2]]  # (a tuple keeps its own values)
    assert_same_state(expected, {**into, "listed": list(into["listed"])}, f"seed {seed}")
    reader = ucp.open_checkpoint(str(root))
    again = _zeros_like_state(state)
    assert reader.load_state(into=again) is again
    assert_same_state(state, again, f"seed {seed}")


def test_read_atoms_into_the_callers_tensors(saved):
    root, _, _ = saved
    reader = ucp.open_checkpoint(str(root))
    paths = random.Random(3).sample(reader.tree_atoms, 8)
    loaded = reader.read_atoms(paths)
    into = {p: torch.full_like(t, 1) for p, t in loaded.items()}
    got = reader.read_atoms(paths, into=into)
    for p in paths:
        assert got[p] is into[p] and _snapshot(into[p])[0][1] == _snapshot(loaded[p])[0][1], p


def _refused(root, into, fragment: str) -> None:
    before = _snapshot(into)
    values = copy.deepcopy({k: v for k, v in into.items() if not _tensors(v)})
    with pytest.raises(ucp.StateError, match=fragment) as e:
        ucp.load(str(root), into=into)
    assert "\n" not in str(e.value)
    assert _snapshot(into) == before, "a refused load changed the caller's tensors"
    assert {k: v for k, v in into.items() if not _tensors(v)} == values, "a refused load changed the caller's values"


def test_a_state_of_another_structure_is_refused_before_anything_changes(saved):
    root, state, _ = saved
    rng = random.Random(DRAW.randrange(2**31))
    paths = ucp.open_checkpoint(str(root)).tree_atoms
    victim = rng.choice([p for p in paths if "/" in p and not p.startswith("listed")])
    *parents, leaf = victim.split("/")

    def edited(change) -> dict:
        into = _zeros_like_state(state)
        node = into
        for k in parents:
            node = node[k]
        change(node)
        return into

    _refused(root, edited(lambda node: node.pop(leaf)), f"lacks the key '{leaf}'")
    _refused(
        root, edited(lambda node: node.__setitem__("surplus", torch.zeros(2))), "key 'surplus' the checkpoint lacks"
    )
    t = state
    for k in victim.split("/"):
        t = t[k]
    wrong_shape = torch.zeros(t.numel() + 1, dtype=t.dtype)
    _refused(root, edited(lambda node: node.__setitem__(leaf, wrong_shape)), f"atom '{victim}'.*into a tensor of")
    other = torch.int16 if t.dtype != torch.int16 else torch.int32
    _refused(root, edited(lambda node: node.__setitem__(leaf, torch.zeros(t.shape, dtype=other))), f"atom '{victim}'")
    _refused(root, edited(lambda node: node.__setitem__(leaf, 5)), "the checkpoint holds a tensor there")
    into = _zeros_like_state(state)
    into["listed"] = into["listed"][:2]
    _refused(root, into, r"state\['listed'\].*list of 3")
    into = _zeros_like_state(state)
    into["step"] = torch.zeros(1)
    _refused(root, into, r"state\['step'\].*holds a value there, not a tensor")
    meta = torch.empty(t.shape, dtype=t.dtype, device="meta")
    _refused(
        root, edited(lambda node: node.__setitem__(leaf, meta)), f"atom '{victim}' into a tensor on the meta device"
    )
    if t.numel() > 1:  # (an expanded tensor: its elements share memory, and the load gave each the last one read)
        expanded = torch.zeros(1, dtype=t.dtype).expand(t.shape)
        _refused(root, edited(lambda node: node.__setitem__(leaf, expanded)), f"atom '{victim}'.*share memory")


@pytest.mark.parametrize("packed", [False, True])
def test_a_damaged_object_fails_a_load_into_the_callers_tensors_and_says_they_are_partly_overwritten(tmp_path, packed):
    chunking = ucp.ChunkingPolicy(object_bytes=4096, inner_bytes=1024, pack_below=1 << 20 if packed else 0)
    ucp.save({"w": torch.arange(4096.0), "b": torch.ones(8)}, str(tmp_path), options=ucp.SaveOptions(chunking=chunking))
    damage_atom(tmp_path, "w")
    into = {"w": torch.zeros(4096), "b": torch.zeros(8)}
    with pytest.raises(ucp.IntegrityError, match=r"atom 'w'.*; the tensors given \(into=\) are partly overwritten"):
        ucp.load(str(tmp_path), into=into)


def test_a_tensor_whose_elements_share_memory_is_refused(tmp_path):
    ucp.save({"w": torch.arange(5.0)}, str(tmp_path))
    into = {"w": torch.zeros(1).expand(5)}
    _refused(tmp_path, into, "atom 'w' into a tensor whose elements share memory")


def test_one_tensor_given_for_two_atoms_is_filled_as_load_state_dict_fills_it(tmp_path):
    """Tied weights: one tensor under two keys gets each atom in turn (the last one wins, as in load_state_dict);
    tensors that only overlap are refused."""
    a, b = torch.randn(4, 3), torch.randn(4, 3)
    ucp.save({"a": a, "b": b}, str(tmp_path))
    shared = torch.zeros(4, 3)
    ucp.load(str(tmp_path), into={"a": shared, "b": shared})
    assert torch.equal(shared, b)
    base = torch.zeros(24)
    with pytest.raises(ucp.StateError, match="share memory"):
        ucp.load(str(tmp_path), into={"a": base[:12].view(4, 3), "b": base[6:18].view(4, 3)})


def test_every_tensor_a_load_makes_has_a_storage_of_its_own(saved):
    """As safetensors' and DCP's loads give them: freeing, resizing or saving one touches no other."""
    root, state, _ = saved
    loaded = ucp.load(str(root))
    tensors = [t for t in _tensors(loaded) if t.numel()]
    pointers = {t.untyped_storage().data_ptr() for t in tensors}
    assert len(pointers) == len(tensors)
    for t in tensors:
        assert t.untyped_storage().nbytes() == t.numel() * t.element_size() and t.storage_offset() == 0
    t = max(tensors, key=lambda t: t.numel())
    buffer = io.BytesIO()
    torch.save(t, buffer)
    assert len(buffer.getvalue()) < t.numel() * t.element_size() + 4096  # (its own bytes, not a pack's)
    before = t.clone()
    t.resize_(t.numel() * 2)
    assert torch.equal(t[: before.numel()], before.reshape(-1))
    assert_same_state(state["listed"], loaded["listed"])


def test_a_saved_tensor_stays_the_callers_to_resize(tmp_path):
    """A save reads the caller's tensors' bytes without marking their storage (numpy's views do: not resizable)."""
    state = {"w": torch.randn(64, 32), "b": torch.randn(5).to(torch.bfloat16)}
    ucp.save(state, str(tmp_path))
    for t in state.values():
        t.resize_(t.numel() * 3)


def test_populate_faults_in_the_memory_a_read_will_fill_and_changes_none_of_it():
    """`ucp.base.heap.populate` before a read into memory never touched: writing it then takes no page faults
    (one each page without), and what the memory held is unchanged; small and read-only buffers are left alone."""
    import mmap
    import resource

    from ucp.base.heap import POPULATE_MIN_BYTES, populate

    def faults_writing(view: memoryview) -> int:
        before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
        view[:] = ones
        return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before

    nbytes = DRAW.randrange(4, 64) * POPULATE_MIN_BYTES + DRAW.randrange(mmap.PAGESIZE)
    ones = b"\x01" * nbytes  # (made, and its own pages faulted in, before anything is counted)
    pages = nbytes // mmap.PAGESIZE
    untouched = mmap.mmap(-1, nbytes)  # (anonymous memory no page of which is faulted in yet)
    assert faults_writing(memoryview(untouched)) >= pages // 2
    fresh = mmap.mmap(-1, nbytes)
    populate([memoryview(fresh)[1:]])  # (from inside its first page, as a buffer in a tensor starts anywhere)
    assert bytes(fresh[:16]) == bytes(16) and fresh.find(b"\x01") == -1
    assert faults_writing(memoryview(fresh)) < pages // 8
    held = bytearray(DRAW.randbytes(POPULATE_MIN_BYTES))
    populate([memoryview(held), memoryview(bytes(held)), memoryview(bytearray(10))])
    assert bytes(held) == bytes(memoryview(held))
