"""The device logic of saves and loads that runs without a GPU: the Landing (the load path to a device) with host
memory as its destination, `device=` and `into=` on every load, the copies' dispatch without CUDA, and
`CheckpointManager.prepare` (staging memory made before the first save). tests/test_gpu.py runs the same paths with
CUDA tensors where there is a GPU."""

from __future__ import annotations

import concurrent.futures as cf
import random

import pytest
import torch

import ucp
from ucp.base.devices import Copies, SideStreams, on_host
from ucp.distributed import ShardedModel, VirtualWorld, load_sharded
from ucp.engine.landing import Landing
from ucp.engine.pipeline import _release, _Staged
from ucp.engine.staging import StagingPool
from ucp.errors import StateError
from ucp.protocol.comm import LocalComm
from ucp.sharding.layout import parse_layout
from ucp.sharding.reshard import shard
from ucp.training_state import rng_state, set_rng_state

from .dist_worker import CONFIG, OPTIONS, STATES, full_state, same
from .helpers import assert_same_state


def test_copies_without_cuda_are_synchronous_copies():
    copies = Copies(SideStreams())
    src, dst = torch.arange(12.0).view(3, 4).t(), torch.empty(4, 3)
    with copies.sourcing():
        assert copies.to_host(dst, src) is None
    assert torch.equal(dst, src)
    back = torch.empty(4, 3)
    assert copies.to_device(back, dst) is None and torch.equal(back, src)
    copies.order_after()
    assert copies.devices == set()


def test_a_landing_reuses_a_bounded_pool_from_many_threads():
    """Objects land from 8 threads through a pool with room for about three of them: every value arrives, the pool
    never holds more than its capacity, a failed read gives its slot back and the others go on."""
    rng = random.Random(7)
    sizes = [rng.randrange(1, 40_000) for _ in range(200)]
    sources = [torch.randn(n) for n in sizes]
    dests = [torch.empty(n) for n in sizes]
    capacity = 3 * 40_000 * 4
    peak = 0

    def fill(i: int, host: torch.Tensor) -> None:
        nonlocal peak
        peak = max(peak, landing.pool.allocated_bytes)
        if i == 17:
            raise OSError("a read that fails")
        host.copy_(sources[i])

    with Landing(capacity, pinned=False) as landing:
        with cf.ThreadPoolExecutor(8) as pool:
            futures = [pool.submit(landing.land, dests[i], lambda h, i=i: fill(i, h)) for i in range(len(sizes))]
        errors = [f.exception() for f in futures]
    assert isinstance(errors[17], OSError) and sum(e is not None for e in errors) == 1
    assert all(torch.equal(d, s) for i, (d, s) in enumerate(zip(dests, sources)) if i != 17)
    assert peak <= capacity
    assert all(a.live == 0 for a in landing.pool.arenas)  # (closed: every slot released)


def test_a_landing_refuses_an_object_larger_than_its_pool():
    with Landing(1024, pinned=False) as landing, pytest.raises(ucp.UcpError, match="smaller than one chunk"):
        landing.land(torch.empty(1024), lambda host: None)


class _QueuedCopy:
    """Stands for the CUDA event of a copy into staging memory that is still queued on a device: `synchronize` says
    how many slots of the arena were still held when the copy was waited for."""

    def __init__(self, slot, fails: bool = False):
        self.slot, self.fails = slot, fails
        self.held_when_waited: int | None = None

    def synchronize(self) -> None:
        self.held_when_waited = self.slot.arena.live
        if self.fails:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")


@pytest.mark.parametrize("fails", [False, True])
def test_a_staging_slot_goes_back_only_once_its_copy_has_ended(fails):
    """A chunk whose write is cancelled, or never handed over because the snapshot failed, may still have its copy
    from the device queued: its slot is released only after that copy is waited for (a copy that failed too still
    gives its slot back), never while the copy could still write into memory another chunk is given."""
    pool = StagingPool(1 << 20)
    slots = [pool.acquire(4096) for _ in range(2)]
    copies = [_QueuedCopy(slot, fails) for slot in slots]
    staged = [_Staged(None, slot.memory, slot, copy) for slot, copy in zip(slots, copies)]  # type: ignore[arg-type]
    _release(pool, staged)
    assert [c.held_when_waited for c in copies] == [2, 1]  # (each waited for while its own slot was still held)
    assert slots[0].arena.live == 0


def test_loads_take_a_device(tmp_path):
    state = {
        "w": torch.randn(33, 17),
        "b": torch.arange(5, dtype=torch.bfloat16),
        "s": torch.tensor(3),
        "e": torch.empty(0, 4),
        "n": {"k": 1},
    }
    ucp.save(state, str(tmp_path), step=0, options=OPTIONS)
    loaded = ucp.load(str(tmp_path), device="cpu")
    assert_same_state(state, loaded)
    assert all(on_host(t) for t in (loaded["w"], loaded["b"], loaded["s"], loaded["e"]))
    manager = ucp.CheckpointManager(str(tmp_path))
    assert_same_state(state, manager.restore(device=torch.device("cpu")))
    with pytest.raises(StateError, match="cannot load onto the meta device: it holds no values"):
        ucp.load(str(tmp_path), device="meta")
    with pytest.raises(StateError, match="cannot load onto device 'gpu0'"):
        manager.restore(device="gpu0")


def test_sharded_loads_take_a_device_and_into_tensors_of_any_device(tmp_path):
    """`device=` places the tensors a load makes; `into=` tensors are refused for their shape or for the meta device
    (no values), never for being on a device."""
    full = full_state()
    source, target = parse_layout("tp2pp1"), parse_layout("tp1pp2dp2zero1")
    VirtualWorld(2).save(
        [shard(full, CONFIG, source, r, STATES) for r in range(2)],
        str(tmp_path),
        step=3,
        model=ShardedModel(CONFIG, source, STATES),
        options=OPTIONS,
    )
    reader = ucp.open_checkpoint(str(tmp_path))
    model = ShardedModel(CONFIG, target, STATES)
    expected = shard(full, CONFIG, target, 1, STATES)
    local, _ = load_sharded(reader, model, 1, device="cpu")
    assert same(local, expected)
    into = {"model": {n: torch.zeros_like(t) for n, t in expected["model"].items()}}
    local, _ = load_sharded(reader, model, 1, into=into, device="cpu")
    assert same(local, expected) and all(local["model"][n] is t for n, t in into["model"].items())
    name, tensor = next(iter(expected["model"].items()))
    with pytest.raises(StateError, match=f"cannot load into model/{name}: it has shape"):
        load_sharded(reader, model, 1, into={"model": {name: torch.zeros(tensor.numel() + 1)}})
    with pytest.raises(StateError, match=f"cannot load into model/{name}: it is on the meta device"):
        load_sharded(reader, model, 1, into={"model": {name: torch.empty_like(tensor, device="meta")}})


@pytest.mark.parametrize("writer", ["threads", "process"])
def test_prepare_makes_the_staging_memory_before_the_first_save(tmp_path, writer):
    """After `prepare(state)` the first async save of that state allocates no staging memory: its chunks take the
    arenas made beforehand. A sync save of host tensors copies nothing, so there is nothing to prepare."""
    state = {"a": torch.randn(300_000), "b": torch.randn(70, 1000), "c": {"d": torch.arange(10)}}
    options = ucp.SaveOptions(chunking=ucp.ChunkingPolicy(object_bytes=256 << 10, inner_bytes=64 << 10), fsync=False)
    with ucp.CheckpointManager(str(tmp_path / "sync"), options=options, writer=writer) as manager:
        assert manager.prepare(state) == 0
    with ucp.CheckpointManager(str(tmp_path / "async"), options=options, mode="async", writer=writer) as manager:
        held = manager.prepare(state)
        arenas = list(manager.pipeline.staging.arenas)
        assert held >= sum(t.numel() * t.element_size() for t in (state["a"], state["b"], state["c"]["d"]))
        for step in range(2):
            manager.save(step, state).result()
            assert manager.pipeline.staging.arenas == arenas  # (the same arenas, none added)
        assert_same_state(state, manager.restore())


def test_prepare_of_a_sharded_save(tmp_path):
    """The same for `save_sharded`: this rank's chunks (and rank 0's extra state) take the arenas `prepare` made."""
    layout = parse_layout("tp1pp1")
    local = shard(full_state(), CONFIG, layout, 0, STATES)
    model = ShardedModel(CONFIG, layout, STATES)
    extra = {"step": 5, "rng": torch.get_rng_state()}
    with ucp.CheckpointManager(
        str(tmp_path), options=OPTIONS, mode="async", writer="threads", comm=LocalComm()
    ) as manager:
        assert manager.prepare(local, model, extra=extra) > 0
        arenas = list(manager.pipeline.staging.arenas)
        manager.save_sharded(5, local, model, extra=extra).result()
        assert manager.pipeline.staging.arenas == arenas
        restored, saved_extra, _ = manager.restore_sharded(model, 0)
    assert same(restored, local) and torch.equal(saved_extra["rng"], extra["rng"])


def test_rng_states_on_a_gpu_machine(monkeypatch):
    """As torch on a machine with 2 GPUs answers: a process that never used CUDA saves no CUDA generator states and
    does not initialise CUDA to ask (a CPU job there makes no GPU context because of ucp), and one that did saves a
    state per device; a restore sets the states of the devices this machine has, from a job saved on more."""
    gpus = 2
    asked: list[str] = []
    set_states: list[list[torch.Tensor]] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: asked.append("initialised") or [])
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", set_states.append)
    assert "cuda" not in rng_state() and asked == []
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    states = [torch.full((16,), i, dtype=torch.uint8) for i in range(gpus)]
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: states)
    saved = rng_state()
    assert [torch.equal(saved["cuda"][str(i)], s) for i, s in enumerate(states)] == [True] * gpus
    saved["cuda"] = {str(i): torch.full((16,), i, dtype=torch.uint8) for i in range(8)}  # (saved on 8 GPUs)
    set_rng_state(saved)
    (restored,) = set_states
    assert [int(s[0]) for s in restored] == list(range(gpus))
