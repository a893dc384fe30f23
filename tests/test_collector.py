"""What ucp's saves and loads leave to Python's cyclic garbage collector: nothing of ucp's and no tensor. An object in a
reference cycle outlives its last user until a collection of its generation runs (for what survived a few, a full
one, which walks every object of the process: a training job or a vLLM engine holds hundreds of thousands); a load
whose tensors were held by a cycle kept all of them alive after the caller dropped them, and a reader that was one
kept its manifest (every atom's description) and its storage."""

from __future__ import annotations

import gc
import weakref

import torch

import ucp

from .helpers import DRAW, left_to_the_collector


def random_state() -> dict:
    """Nested dicts and lists of tensors (some packed, some of their own objects) and JSON values."""
    layers = [
        {"w": torch.randn(DRAW.randint(1, 64), DRAW.randint(1, 64)), "step": DRAW.randint(0, 9)}
        for _ in range(DRAW.randint(1, 4))
    ]
    big = torch.randn(DRAW.randint(300, 600), 1024)  # (over the packing threshold: objects of its own)
    return {"model": {"layers": layers, "big": big}, "optim": {"lr": 0.1, "m": torch.zeros(DRAW.randint(1, 9))}}


def test_a_save_and_the_loads_leave_nothing_to_the_cyclic_collector(tmp_path):
    url = str(tmp_path / "ckpt")
    state = random_state()
    with left_to_the_collector() as left:
        ucp.save(state, url, step=0)
    assert not left, f"a save left {dict(left)}"
    with left_to_the_collector() as left:
        loaded = ucp.load(url)
        ucp.load(url, into=loaded)
        reader = ucp.open_checkpoint(url)
        atoms = reader.read_atoms(reader.tree_atoms[:2])
        del loaded, reader, atoms
    assert not left, f"the loads left {dict(left)}"


def test_a_loaded_state_is_freed_as_soon_as_its_user_drops_it(tmp_path):
    url = str(tmp_path / "ckpt")
    ucp.save(random_state(), url, step=0)
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        loaded = ucp.load(url)
        tensor = weakref.ref(loaded["model"]["big"])
        reader = ucp.open_checkpoint(url)
        opened = weakref.ref(reader)
        del loaded, reader
        assert tensor() is None, "the loaded tensor outlived its last user"
        assert opened() is None, "the reader outlived its last user"
    finally:
        if was_enabled:
            gc.enable()
