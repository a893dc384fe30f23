"""Interop commands stream within --memory-budget: the peak RSS of `ucp import` / `ucp export` / `ucp convert`
(a real CLI process each) barely moves when the model grows fourfold, and the output is still right; also for
Megatron checkpoints with a distributed optimizer (distrib_optim.pt beside the rank files, and torch_dist)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import ucp
from ucp.distributed.sharded_model import ShardedModel
from ucp.distributed.sharded_save import VirtualWorld
from ucp.interop.hf import hf_config_from_ucp
from ucp.interop.megatron.convert import convert
from ucp.interop.megatron.distrib_optim import MOMENTS
from ucp.interop.megatron.files import load_rank_file
from ucp.interop.megatron.optimizer import MASTER, DistributedBuffers, OptimizerMeta
from ucp.interop.megatron.save import RANK_FILE, parse_megatron_layout, rank_files
from ucp.sharding.families import MixtralConfig, canonical_atoms
from ucp.sharding.layout import Layout
from ucp.sharding.reshard import shard

from .test_hf import save_in_layout

pytestmark = pytest.mark.slow  # (scenario tests: peak-memory measurements of conversions in subprocesses)

MiB = 1 << 20
BUDGET = "16MiB"
# Mixtral-shaped, 12.5 MiB (fp32) per layer, no tensor above 1 MiB: 3 layers ~ 39 MiB (S), 12 layers ~ 154 MiB (4S)
SMALL_LAYERS, LARGE_LAYERS = 3, 12


def mixtral(layers: int) -> MixtralConfig:
    return MixtralConfig(
        vocab_size=1000,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=2,
        num_local_experts=8,
        num_experts_per_tok=2,
    )


@dataclass
class Model:
    """One synthetic model in every source format a command reads."""

    atoms: dict[str, torch.Tensor]
    ucp: Path  # ucp checkpoint (step 1, written from tp1)
    hf: Path | None  # Hugging Face directory: per-expert safetensors in two files, index, config.json
    dcp: Path | None  # DCP checkpoint of the flat state dict, with config.json
    megatron: Path  # Megatron-LM torch checkpoint in layout tp2 (iteration 1), converted from `ucp`
    torch_dist: Path  # Megatron-LM torch_dist checkpoint (iteration 1), converted from `ucp`
    config: MixtralConfig

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.atoms.values())


def build(root: Path, layers: int) -> Model:
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file

    cfg = mixtral(layers)
    g = torch.Generator().manual_seed(layers)
    atoms = {n: torch.randn(shape, generator=g) for n, (shape, _) in canonical_atoms(cfg).items()}
    root.mkdir()
    save_in_layout({"model": atoms}, cfg, "tp1", str(root / "ucp"))
    config_json = json.dumps(hf_config_from_ucp(cfg, None, torch.float32))
    hf = root / "hf"
    hf.mkdir()
    names = list(atoms)
    halves = {
        "model-00001-of-00002.safetensors": names[: len(names) // 2],
        "model-00002-of-00002.safetensors": names[len(names) // 2 :],
    }
    for fname, part in halves.items():
        save_file({n: atoms[n] for n in part}, str(hf / fname), metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {n: f for f, part in halves.items() for n in part}}
    (hf / "model.safetensors.index.json").write_text(json.dumps(index))
    (hf / "config.json").write_text(config_json)
    dcp.save(atoms, checkpoint_id=str(root / "dcp"), no_dist=True)
    (root / "dcp" / "config.json").write_text(config_json)
    convert(str(root / "ucp"), str(root / "megatron"), from_layout="universal", to_layout="tp2")
    convert(str(root / "ucp"), str(root / "torch_dist"), from_layout="universal", to_layout="torch_dist")
    return Model(atoms, root / "ucp", hf, root / "dcp", root / "megatron", root / "torch_dist", cfg)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> tuple[Model, Model]:
    root = tmp_path_factory.mktemp("models")
    return build(root / "small", SMALL_LAYERS), build(root / "large", LARGE_LAYERS)


# Runs the command and prints its peak RSS (KiB). A fresh, small process forks it: Linux keeps the pre-exec
# high-water mark in ru_maxrss, so a child forked straight from this (large) test process would report ours.
WRAPPER = (
    "import resource, subprocess, sys; rc = subprocess.call(sys.argv[1:], stdout=sys.stderr); "
    "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); sys.exit(rc)"
)


def peak_rss(args: list[str]) -> int:
    """Run `python -m ucp ARGS` in a fresh process; its peak resident set size in bytes."""
    argv = [sys.executable, "-m", "ucp", *args, "--memory-budget", BUDGET, "--no-progress"]
    proc = subprocess.run([sys.executable, "-c", WRAPPER, *argv], capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return int(proc.stdout.split()[-1]) * 1024


def assert_atoms(got: dict[str, torch.Tensor], atoms: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(atoms)
    for name, t in atoms.items():
        assert torch.equal(got[name], t), name


def check_import(url: Path, model: Model) -> None:
    assert_atoms(ucp.load(str(url))["model"], model.atoms)


def check_hf_export(out: Path, model: Model) -> None:
    from safetensors import safe_open

    got = {}
    for fname in sorted(set(json.loads((out / "model.safetensors.index.json").read_text())["weight_map"].values())):
        with safe_open(str(out / fname), framework="pt") as f:
            names = f.keys()
            got.update({k: f.get_tensor(k).clone() for k in names})
    assert_atoms(got, model.atoms)


def check_dcp_export(out: Path, model: Model) -> None:
    import torch.distributed.checkpoint as dcp

    got = {n: torch.empty_like(t) for n, t in model.atoms.items()}
    dcp.load(got, checkpoint_id=str(out), no_dist=True)
    assert_atoms(got, model.atoms)


def check_megatron(layout: str) -> Callable[[Path, Model], None]:
    """Every rank file of `layout` holds exactly the model's local tensors (`_extra_state` entries aside)."""

    def check(out: Path, model: Model) -> None:
        parsed = parse_megatron_layout(layout)
        for name, rank in rank_files(parsed).items():
            data = load_rank_file(out / "iter_0000001" / name / RANK_FILE)
            want = shard({"model": model.atoms}, model.config, parsed, rank, ())
            for chunk, tensors in want.items():
                got = {n: t for n, t in data[chunk].items() if not n.endswith("._extra_state")}
                assert_atoms(got, tensors)

    return check


def check_torch_dist(out: Path, model: Model) -> None:
    """Read back through ucp: torch_dist -> ucp gives the atoms."""
    url = out.parent / f"{out.name}-ucp"
    convert(str(out), str(url), from_layout="torch_dist", to_layout="universal")
    check_import(url, model)


COMMANDS = {
    "import-hf": (lambda m, dst: ["import", str(m.hf), str(dst)], check_import),
    "import-dcp": (lambda m, dst: ["import", str(m.dcp), str(dst), "--from", "dcp"], check_import),
    "export-hf": (
        lambda m, dst: ["export", str(m.ucp), "--to", "hf", str(dst), "--max-shard-size", "64MiB"],
        check_hf_export,
    ),
    "export-dcp": (lambda m, dst: ["export", str(m.ucp), "--to", "dcp", str(dst)], check_dcp_export),
    "convert-tp2-universal": (
        lambda m, dst: ["convert", str(m.megatron), str(dst), "--from", "tp2", "--to", "universal"],
        check_import,
    ),
    "convert-universal-tp2": (
        lambda m, dst: ["convert", str(m.ucp), str(dst), "--from", "universal", "--to", "tp2"],
        check_megatron("tp2"),
    ),
    "convert-torch_dist-tp2": (
        lambda m, dst: ["convert", str(m.torch_dist), str(dst), "--from", "torch_dist", "--to", "tp2"],
        check_megatron("tp2"),
    ),
    "convert-tp2-torch_dist": (
        lambda m, dst: ["convert", str(m.megatron), str(dst), "--from", "tp2", "--to", "torch_dist"],
        check_torch_dist,
    ),
    "convert-tp2-tp1ep2": (
        lambda m, dst: ["convert", str(m.megatron), str(dst), "--from", "tp2", "--to", "tp1ep2"],
        check_megatron("tp1ep2"),
    ),
}


# a Megatron distributed optimizer's states, as ucp names them (Adam's moments, the fp32 master weights)
OPTIMIZER_STATES = (*MOMENTS, MASTER)


def build_distributed_optimizer(root: Path, layers: int) -> Model:
    """The model with a Megatron distributed optimizer's state (every atom's moments and master weight, random):
    `ucp` holds it with the param groups and buffers Megatron-LM's files need (the meta a Megatron -> ucp conversion
    stores), `megatron` is its tp2 files with distrib_optim.pt (DDP buckets of 1M elements: several per buffer),
    `torch_dist` its torch_dist checkpoint (the optimizer fully_reshardable). `atoms` holds every atom and state,
    keyed as ucp's checkpoint paths."""
    cfg = mixtral(layers)
    g = torch.Generator().manual_seed(layers)
    model = {n: torch.randn(shape, generator=g) for n, (shape, _) in canonical_atoms(cfg).items()}
    state = {n: {s: torch.randn(t.shape, generator=g) for s in OPTIMIZER_STATES} for n, t in model.items()}
    groups = {
        (wd, 1.0, False, False): {"wd_mult": wd, "lr_mult": 1.0, "is_expert_parallel": False, "is_decoupled_lr": False}
        | {"lr": 1e-3, "weight_decay": 0.1 * wd, "betas": (0.9, 0.95), "eps": 1e-8, "step": 7}
        for wd in (1.0, 0.0)
    }
    meta = OptimizerMeta(
        True, MOMENTS, groups=groups, distributed=DistributedBuffers(("float32", "float32"), 1_000_000)
    )
    root.mkdir()
    full = {"model": model, "optimizer": {"state": state}}
    VirtualWorld(1).save(
        [shard(full, cfg, Layout(), 0, OPTIMIZER_STATES)],
        str(root / "ucp"),
        step=1,
        model=ShardedModel(cfg, Layout(), OPTIMIZER_STATES),
        extra={"megatron_optimizer": meta.to_json()},
    )
    convert(str(root / "ucp"), str(root / "megatron"), from_layout="universal", to_layout="tp2")
    assert (root / "megatron" / "iter_0000001" / "mp_rank_01" / "distrib_optim.pt").is_file()
    convert(str(root / "ucp"), str(root / "torch_dist"), from_layout="universal", to_layout="torch_dist")
    atoms = {f"model/{n}": t for n, t in model.items()}
    atoms.update({f"optimizer/{s}/{n}": t for n, states in state.items() for s, t in states.items()})
    return Model(atoms, root / "ucp", None, None, root / "megatron", root / "torch_dist", cfg)


@pytest.fixture(scope="module")
def distributed_optimizer_models(tmp_path_factory) -> tuple[Model, Model]:
    root = tmp_path_factory.mktemp("distopt")
    return (
        build_distributed_optimizer(root / "small", SMALL_LAYERS),
        build_distributed_optimizer(root / "large", LARGE_LAYERS),
    )


def check_optimizer(layout: str) -> Callable[[Path, Model], None]:
    """Read back through ucp (the output in `layout` -> ucp, in this process): every atom and optimizer state."""

    def check(out: Path, model: Model) -> None:
        url = out
        if layout != "universal":
            url = out.parent / f"{out.name}-ucp"
            assert convert(str(out), str(url), from_layout=layout, to_layout="universal").dropped == ()
        loaded = ucp.load(str(url))
        got = {f"model/{n}": t for n, t in loaded["model"].items()}
        for n, states in loaded["optimizer"]["state"].items():
            got.update({f"optimizer/{s}/{n}": t for s, t in states.items()})
        assert_atoms(got, model.atoms)

    return check


DISTRIBUTED_OPTIMIZER_COMMANDS = {
    "convert-tp2-tp1ep2": (
        lambda m, dst: ["convert", str(m.megatron), str(dst), "--from", "tp2", "--to", "tp1ep2"],
        check_optimizer("tp1ep2"),
    ),
    "convert-torch_dist-tp2": (
        lambda m, dst: ["convert", str(m.torch_dist), str(dst), "--from", "torch_dist", "--to", "tp2"],
        check_optimizer("tp2"),
    ),
    "convert-tp2-torch_dist": (
        lambda m, dst: ["convert", str(m.megatron), str(dst), "--from", "tp2", "--to", "torch_dist"],
        check_optimizer("torch_dist"),
    ),
    "convert-tp2-universal": (
        lambda m, dst: ["convert", str(m.megatron), str(dst), "--from", "tp2", "--to", "universal"],
        check_optimizer("universal"),
    ),
    "convert-torch_dist-universal": (
        lambda m, dst: ["convert", str(m.torch_dist), str(dst), "--from", "torch_dist", "--to", "universal"],
        check_optimizer("universal"),
    ),
}


def assert_peak_rss_bounded(
    models: tuple[Model, Model], tmp_path: Path, command: str, argv, check, limit: float | None = None
) -> None:
    """The command's peak RSS on the large model exceeds the small one's by less than `limit` bytes (by default a
    quarter of what the model grows)."""
    peaks: list[int] = []
    for model in models:
        dst = tmp_path / f"out-{len(peaks)}"
        peaks.append(peak_rss(argv(model, dst)))
        check(dst, model)
    small, large = models
    growth = peaks[1] - peaks[0]
    print(
        f"{command}: peak RSS {peaks[0] / MiB:.0f} MiB (model {small.nbytes / MiB:.0f} MiB), "
        f"{peaks[1] / MiB:.0f} MiB (model {large.nbytes / MiB:.0f} MiB): +{growth / MiB:.1f} MiB"
    )
    limit = 0.25 * (large.nbytes - small.nbytes) if limit is None else limit
    assert growth < limit, f"{command}: peak RSS grew by {growth / MiB:.1f} MiB"


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize("command", list(COMMANDS))
def test_peak_rss_does_not_grow_with_the_model(models, tmp_path, command):
    assert_peak_rss_bounded(models, tmp_path, command, *COMMANDS[command])


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize("command", list(DISTRIBUTED_OPTIMIZER_COMMANDS))
def test_peak_rss_does_not_grow_with_a_distributed_optimizer(distributed_optimizer_models, tmp_path, command):
    """Megatron files with a distributed optimizer (each rank's flat buffers in distrib_optim.pt, several buckets;
    torch_dist's per-parameter states) convert within the budget too, their optimizer state intact. The bound is a
    quarter of what the weights alone grow: less than half of what one state's flat buffer of a tp2 rank grows, so
    a buffer held whole would exceed it."""
    small, large = distributed_optimizer_models
    weights = sum(t.numel() * t.element_size() for n, t in large.atoms.items() if n.startswith("model/")) - sum(
        t.numel() * t.element_size() for n, t in small.atoms.items() if n.startswith("model/")
    )
    argv, check = DISTRIBUTED_OPTIMIZER_COMMANDS[command]
    assert_peak_rss_bounded(distributed_optimizer_models, tmp_path, command, argv, check, limit=0.25 * weights)
