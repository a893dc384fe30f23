"""ucp on a CUDA GPU: every save path takes CUDA tensors, every load lands on the device, the trainer resumes on GPUs.

Marked `gpu`: skipped where torch sees no GPU (conftest.py); scripts/gpu_check.sh runs them on a GPU machine. What
does not need a GPU is checked on CPU too: tests/test_devices.py (the landing, device= and into=, prepare) and
tests/test_trainer_devices.py (placement, collectives through host copies, the peer watch)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

import ucp
from trainer import launch
from trainer.parallel.mesh import parse_layout
from ucp.distributed import ShardedModel, VirtualWorld, load_sharded
from ucp.engine.landing import Landing
from ucp.errors import IntegrityError
from ucp.format.manifest import chunk_indices
from ucp.interop.weights import load_weights
from ucp.protocol.comm import LocalComm
from ucp.sharding.families import canonical_atoms
from ucp.sharding.reshard import shard
from ucp.training_state import restore_training_state, training_state

from .dist_worker import CONFIG, STATES, full_state
from .helpers import assert_same_state, random_full_state, save_in_layout, step_path, tiny_config

pytestmark = pytest.mark.gpu

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "trainer" / "configs" / "tiny-moe.yaml"
DTYPES = (
    torch.float32,
    torch.bfloat16,
    torch.float16,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.float64,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
)
# small objects, so that the tensors below are several chunk objects (and shards of inner chunks) each
SMALL = ucp.SaveOptions(chunking=ucp.ChunkingPolicy(object_bytes=64 << 10, inner_bytes=8 << 10), fsync=False)


def random_tensor(shape: tuple[int, ...], dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    """Random values of `dtype` (host memory)."""
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=g) * 8).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(info.min, info.max, shape, generator=g, dtype=torch.int64).to(dtype)


def cuda_state(seed: int, device: str = "cuda") -> dict:
    """Every dtype as a tensor of several chunk objects, a non-contiguous view of it, a 0-d and an empty tensor, all
    on `device`; one 64 MiB tensor (its copies take long enough for a missing stream order to show); JSON."""
    g = torch.Generator().manual_seed(seed)
    state: dict = {"step": seed, "big": torch.randn(16 << 20, generator=g).to(device)}
    for dtype in DTYPES:
        whole = random_tensor((257, 300), dtype, g).to(device)
        state[str(dtype).removeprefix("torch.")] = {
            "whole": whole,
            "strided": whole.t()[::3],
            "scalar": random_tensor((), dtype, g).to(device),
            "empty": random_tensor((0, 5), dtype, g).to(device),
        }
    return state


def host_copy(state: dict) -> dict:
    return {
        k: host_copy(v) if isinstance(v, dict) else v.detach().cpu().clone() if isinstance(v, torch.Tensor) else v
        for k, v in state.items()
    }


def busy() -> None:
    """Queue a few tenths of a second of GPU work on the current stream. A save's copies wait for it (they copy what
    the caller had queued before the save), so an async save returns, and a lazy snapshot is done, while they are
    all still queued: a change queued right after overtakes them unless the caller's stream waits for them. (Without
    it, the copies have long ended before a change queued from Python can run, and the test could not fail.)"""
    torch.cuda._sleep(400_000_000)  # (GPU clock cycles: 0.2 s at 2 GHz)


def scribble(state: dict, fresh: dict) -> None:
    """Change every tensor of `state` in place to `fresh`'s values, on the device (queued on the current stream, as
    training would: no work of the host's between the save's return and the change)."""
    state["big"].copy_(fresh["big"])
    for dtype in DTYPES:
        name = str(dtype).removeprefix("torch.")
        for part in ("whole", "scalar"):
            state[name][part].copy_(fresh[name][part])


def on_device(state: dict, device: torch.device) -> bool:
    return all(
        on_device(v, device) if isinstance(v, dict) else v.device == device
        for v in state.values()
        if isinstance(v, (dict, torch.Tensor))
    )


def _device(name: str = "cuda") -> torch.device:
    d = torch.device(name)
    return torch.device("cuda", d.index if d.index is not None else torch.cuda.current_device())


SAVES = [
    ("ucp.save", None),
    ("sync", "threads"),
    ("sync", "process"),
    ("async", "threads"),
    ("async", "process"),
    ("lazy", "threads"),
    ("lazy", "process"),
]


@pytest.mark.parametrize(("mode", "writer"), SAVES)
def test_every_save_of_cuda_tensors_is_the_state_when_save_returned(tmp_path, mode, writer):
    """Every dtype, views, 0-d and empty tensors on the GPU, changed in place on the device right after `save()`
    returns (lazy: after `wait_snapshot`, as its contract says): the step holds the values of the call, bit for bit,
    loaded to host memory and onto the device."""
    state, fresh = cuda_state(1), cuda_state(2)
    expected = host_copy(state)
    url = str(tmp_path / "ckpt")
    if mode == "ucp.save":
        busy()
        ucp.save(state, url, step=0, options=SMALL)
        scribble(state, fresh)
    else:
        with ucp.CheckpointManager(url, options=SMALL, mode=mode, writer=writer) as manager:
            manager.prepare(state)  # (the staging memory, made here: the save's blocking part is the copies alone)
            busy()
            handle = manager.save(0, state)
            if mode == "lazy":
                handle.wait_snapshot()
            scribble(state, fresh)
            handle.result()
    assert_same_state(expected, ucp.load(url))
    loaded = ucp.load(url, device="cuda")
    assert on_device(loaded, _device()) and not on_device(expected, _device())
    assert_same_state(expected, loaded)


@pytest.mark.parametrize("mode", ["sync", "async", "lazy"])
def test_tensors_on_another_gpu_than_the_current_one(tmp_path, mode):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    torch.cuda.set_device(0)
    state, fresh = cuda_state(3, device="cuda:1"), cuda_state(4, device="cuda:1")
    expected = host_copy(state)
    with ucp.CheckpointManager(str(tmp_path), options=SMALL, mode=mode) as manager:
        with torch.cuda.device(1):
            busy()
        handle = manager.save(0, state)
        handle.wait_snapshot()
        with torch.cuda.device(1):
            scribble(state, fresh)
        handle.result()
        loaded = manager.restore(device="cuda:1")
    assert on_device(loaded, torch.device("cuda", 1))
    assert_same_state(expected, loaded)


def _to(state: dict, device: str) -> dict:
    return {k: _to(v, device) if isinstance(v, dict) else v.to(device) for k, v in state.items()}


def _zeros(state: dict) -> dict:
    return {k: _zeros(v) if isinstance(v, dict) else torch.zeros_like(v) for k, v in state.items()}


def _fill_zero(state: dict) -> None:
    for v in state.values():
        _fill_zero(v) if isinstance(v, dict) else v.zero_()


def _same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k, x in a.items():
        if isinstance(x, dict):
            _same(x, b[k])
        else:
            assert x.dtype == b[k].dtype and x.shape == b[k].shape, k
            assert torch.equal(x.cpu(), b[k].cpu()), k


def test_sharded_saves_from_cuda_tensors_and_loads_onto_the_gpu(tmp_path):
    """Ranks whose local states are on the GPU (ZeRO-1 ranges: fragments go between ranks and chunks are put together
    on the device) save; another layout loads onto the GPU, with `device=` and into CUDA tensors of its own,
    contiguous or not, of the saved dtype or another (cast); the manager's sharded save and restore, with a hot
    tier too."""
    full = full_state()
    source, target = parse_layout("tp1pp1dp2zero1"), parse_layout("tp2pp2")
    VirtualWorld(2).save(
        [_to(shard(full, CONFIG, source, r, STATES), "cuda") for r in range(2)],
        str(tmp_path / "a"),
        step=1,
        model=ShardedModel(CONFIG, source, STATES),
        options=SMALL,
    )
    reader = ucp.open_checkpoint(str(tmp_path / "a"))
    model = ShardedModel(CONFIG, target, STATES)
    for rank in range(target.world_size):
        expected = shard(full, CONFIG, target, rank, STATES)
        local, _ = load_sharded(reader, model, rank, device="cuda")
        assert on_device(local, _device())
        _same(local, expected)
        into = _zeros(_to(expected, "cuda"))
        names = list(into["model"])
        for name in names[::2]:  # (every other one a transposed view: not contiguous)
            t = into["model"][name]
            if t.dim() == 2:
                into["model"][name] = torch.zeros(t.shape[::-1], device="cuda").t()
        cast = names[1]
        into["model"][cast] = torch.zeros(into["model"][cast].shape, dtype=torch.bfloat16, device="cuda")
        busy()  # (the tensors are zeroed again behind it: the load's copies must land after that, not before)
        _fill_zero(into)
        local, _ = load_sharded(reader, model, rank, into=into)
        assert local["model"][names[0]] is into["model"][names[0]]
        expected["model"][cast] = expected["model"][cast].to(torch.bfloat16)
        _same(local, expected)

    layout = parse_layout("tp1pp1")
    local = _to(shard(full, CONFIG, layout, 0, STATES), "cuda")
    one = ShardedModel(CONFIG, layout, STATES)
    for local_dir in (None, str(tmp_path / "hot")):
        url = str(tmp_path / f"b-{local_dir is None}")
        with ucp.CheckpointManager(url, options=SMALL, mode="async", comm=LocalComm(), local_dir=local_dir) as m:
            m.prepare(local, one, extra={"rng": torch.get_rng_state()})
            m.save_sharded(2, local, one, extra={"rng": torch.get_rng_state()}).result()
            restored, _, _ = m.restore_sharded(one, 0, into=_zeros(local), device="cuda")
        _same(restored, local)


def test_weights_load_onto_the_gpu_and_into_its_tensors(tmp_path):
    full = full_state()
    source = parse_layout("tp2pp1")
    VirtualWorld(2).save(
        [shard(full, CONFIG, source, r, STATES) for r in range(2)],
        str(tmp_path),
        step=1,
        model=ShardedModel(CONFIG, source, STATES),
        options=SMALL,
    )
    on_cpu = load_weights(str(tmp_path), "tp1pp2", 1, torch.bfloat16)
    on_gpu = load_weights(str(tmp_path), "tp1pp2", 1, torch.bfloat16, device="cuda")
    assert all(t.device == _device() for t in on_gpu.params.values())
    _same(on_gpu.local, on_cpu.local)
    into = {n: torch.zeros_like(t, device="cuda") for n, t in on_cpu.params.items()}
    filled = load_weights(str(tmp_path), "tp1pp2", 1, into=into)
    assert all(filled.params[n].data_ptr() == t.data_ptr() for n, t in into.items())  # (filled in place)
    _same(filled.local, on_cpu.local)


def test_a_load_into_cuda_tensors_fills_them_in_place(tmp_path):
    """`ucp.load(into=)` of the caller's CUDA tensors: each lands through the landing path (read and checked in
    page-locked memory, copied asynchronously), in the same memory as before, bitwise; packed and unpacked atoms."""
    g = torch.Generator().manual_seed(7)
    state = {
        "small": {f"t{i}": torch.randn(i + 1, 3, generator=g) for i in range(20)},  # (packed)
        "big": torch.randn(700, 600, generator=g).to(torch.bfloat16),  # (a shard of inner chunks)
        "step": 4,
    }
    ucp.save(state, str(tmp_path), options=ucp.SaveOptions(chunking=ucp.ChunkingPolicy(object_bytes=1 << 19)))
    into = {"small": {k: torch.zeros_like(v, device="cuda") for k, v in state["small"].items()},
            "big": torch.zeros_like(state["big"], device="cuda"), "step": 0}  # fmt: skip
    pointers = [t.data_ptr() for t in [*into["small"].values(), into["big"]]]
    assert ucp.load(str(tmp_path), into=into) is into
    assert [t.data_ptr() for t in [*into["small"].values(), into["big"]]] == pointers
    assert_same_state(state, {"small": {k: v.cpu() for k, v in into["small"].items()}, "big": into["big"].cpu(),
                              "step": into["step"]})  # fmt: skip


def test_a_vllm_start_up_reads_weights_straight_into_cuda_parameters(tmp_path):
    """ucp.interop.vllm's start-up on a model whose parameters are on the GPU: the weights whose places the dry run
    finds land through page-locked memory straight into the parameters' views (strided ones included), and every
    parameter ends as the model's own loading leaves it. Needs no vLLM: tests/test_vllm_dry_run.py's model loads as
    vLLM's layers do."""
    from ucp.interop.vllm.engine import Request, load_step

    from .test_vllm_dry_run import LoadsLikeVllm, assert_same_parameters, engine_config, oracle

    cfg = tiny_config()
    url = str(tmp_path / "ckpt")
    save_in_layout(random_full_state(cfg, states=()), cfg, "tp2", url)
    for tp, rank in ((1, 0), (2, 1)):
        model = LoadsLikeVllm(cfg, tp, rank).cuda()
        report = load_step(model, engine_config(url), Request(url))
        assert report.in_place == len(canonical_atoms(cfg)) - 1  # (all but the LM head, converted as it is copied)
        torch.cuda.synchronize()
        assert_same_parameters(model.cpu(), oracle(url, tp, rank))


def test_restore_training_state_onto_a_gpu_model(tmp_path):
    """A GPU model and AdamW saved with `training_state`, loaded onto the GPU and restored into a new model: the next
    steps are the same bits as the original's (the optimizer's step counters back in host memory, where AdamW
    keeps them)."""

    def make() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 8)).cuda()
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)

    def train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: int) -> None:
        g = torch.Generator(device="cuda").manual_seed(steps)
        for _ in range(steps):
            loss = model(torch.randn(32, 64, device="cuda", generator=g)).square().mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()

    model, optimizer = make()
    train(model, optimizer, 3)
    with ucp.CheckpointManager(str(tmp_path), mode="async") as manager:
        manager.save(3, training_state(model, optimizer)).result()
    again, again_optimizer = make()
    restore_training_state(ucp.load(str(tmp_path), device="cuda"), again, again_optimizer)
    assert all(s["step"].device.type == "cpu" for s in again_optimizer.state.values())
    train(model, optimizer, 2)
    train(again, again_optimizer, 2)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), again.parameters()))


def test_a_damaged_chunk_fails_a_load_onto_the_gpu_and_the_next_load_works(tmp_path):
    state = {"w": torch.randn(1 << 20, device="cuda")}
    ucp.save(state, str(tmp_path), step=0, options=SMALL)
    meta = ucp.open_checkpoint(str(tmp_path)).atoms["w"]
    path = step_path(tmp_path) / "w" / meta.chunk_key(list(chunk_indices(meta.grid))[3])
    original = path.read_bytes()
    damaged = bytearray(original)
    damaged[len(damaged) // 2] ^= 0x01
    path.write_bytes(damaged)
    with pytest.raises(IntegrityError, match="checksum mismatch"):
        ucp.load(str(tmp_path), device="cuda")
    path.write_bytes(original)
    assert torch.equal(ucp.load(str(tmp_path), device="cuda")["w"], state["w"])


@pytest.mark.parametrize("writer", ["threads", "process"])
def test_prepare_makes_page_locked_staging_before_the_first_save(tmp_path, writer):
    state = cuda_state(5)
    with ucp.CheckpointManager(str(tmp_path), options=SMALL, mode="async", writer=writer) as manager:
        manager.prepare(state)
        arenas = list(manager.pipeline.staging.arenas)
        assert arenas and all(a.registered if writer == "process" else a.memory.is_pinned() for a in arenas)
        manager.save(0, state).result()
        assert manager.pipeline.staging.arenas == arenas


def test_a_landing_reads_into_page_locked_memory():
    dest = torch.empty(1 << 20, device="cuda")
    values = torch.randn(1 << 20)
    with Landing(8 << 20) as landing:
        landing.land(dest, lambda host: host.copy_(values))
        assert all(a.memory.is_pinned() for a in landing.pool.arenas)
    assert torch.equal(dest.cpu(), values)


# ------------------------------------------------------------------------------------------------ the trainer


def _train(tmp: Path, layout: str, steps: int, *extra: str) -> tuple[list[dict], list[dict]]:
    metrics = tmp / f"{layout}-{launch.free_port()}.jsonl"
    argv = launch.trainer_argv(TINY, layout, steps, metrics, "--set", "data.source=synthetic", *extra)
    logs = metrics.with_suffix("")
    try:
        launch.wait(launch.start(argv, parse_layout(layout).world_size, logs), logs, 300)
    except RuntimeError as e:
        pytest.fail(f"trainer failed: {e}")
    lines = [json.loads(line) for line in metrics.read_text().splitlines()]
    return [r for r in lines if "event" not in r], [r for r in lines if "event" in r]


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_gpu_run_interrupted_and_resumed_equals_the_uninterrupted_one(tmp_path, precision):
    """One rank on the GPU (NCCL), deterministic algorithms: 8 steps straight against 4 with async checkpoints (bf16:
    through a hot tier too) and 4 more resumed: the same losses and gradient norms, bit for bit."""
    gpu = ["--set", "train.device=cuda", "--set", "train.deterministic=true", "--set", f"train.precision={precision}"]
    reference, _ = _train(tmp_path, "tp1pp1", 8, *gpu)
    ckpt = ["--ckpt", str(tmp_path / "ckpt"), "--save-interval", "2"]
    if precision == "bf16":
        ckpt += ["--ckpt-local", str(tmp_path / "hot")]
    first, events = _train(tmp_path, "tp1pp1", 4, *gpu, *ckpt)
    assert [e["step"] for e in events if e["event"] == "checkpoint"] == [2, 4]
    resumed, events = _train(tmp_path, "tp1pp1", 8, *gpu, *ckpt)
    (resume,) = [e for e in events if e["event"] == "resume"]
    assert resume["from_step"] == 4 and resume["source"] == ("hot" if precision == "bf16" else "durable")
    got = [(r["step"], r["loss"], r["grad_norm"]) for r in first + resumed]
    assert got == [(r["step"], r["loss"], r["grad_norm"]) for r in reference]
    assert all("cuda_peak_allocated_bytes" in rank for r in resumed for rank in r["ranks"])


@pytest.mark.slow
def test_layouts_sharing_one_gpu_with_gloo_resume_in_another_layout(tmp_path):
    """TP, PP and EP ranks sharing one GPU (gloo, CUDA tensors, collectives through host copies): a tp2pp2 run saves
    at step 4 and a tp1pp2ep2dp2 run resumes it; its losses are those of tp1pp2ep2dp2 trained straight through, as
    closely as a different reduction order before the checkpoint allows."""
    gloo = ["--set", "train.backend=gloo", "--set", "train.device=cuda", "--set", "train.deterministic=true"]
    reference, _ = _train(tmp_path, "tp1pp2ep2dp2", 8, *gloo)
    ckpt = ["--ckpt", str(tmp_path / "ckpt")]
    _train(tmp_path, "tp2pp2", 4, *gloo, *ckpt)
    resumed, events = _train(tmp_path, "tp1pp2ep2dp2", 8, *gloo, *ckpt)
    (resume,) = [e for e in events if e["event"] == "resume"]
    assert resume["from_step"] == 4 and resume["saved_layout"] == "tp2pp2"
    assert [r["step"] for r in resumed] == [5, 6, 7, 8]
    for r, ref in zip(resumed, reference[4:], strict=True):
        assert math.isclose(r["loss"], ref["loss"], rel_tol=1e-4), (r["step"], r["loss"], ref["loss"])


@pytest.mark.slow
def test_the_demo_runs_on_a_gpu_machine(tmp_path):
    """`python -m trainer.demo` on a GPU machine: its four ranks train on the GPUs (gloo: two simulated nodes share
    them), a node is lost and comes back, and the losses go on as on CPU."""
    import subprocess
    import sys

    run = tmp_path / "demo"
    proc = subprocess.run(
        [sys.executable, "-m", "trainer.demo", "--dir", str(run)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "steps trained twice" in proc.stdout and (run / "loss.png").exists()
    from trainer.demo import read_metrics

    metrics = read_metrics(run / "metrics.jsonl")
    assert any("cuda_peak_allocated_bytes" in rank for r in metrics if "ranks" in r for rank in r["ranks"])
