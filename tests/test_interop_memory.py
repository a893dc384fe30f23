"""Interop commands stream within --memory-budget: the peak RSS of `ucp import` / `ucp export` / `ucp convert`
(a real CLI process each) barely moves when the model grows fourfold, and the output is still right."""

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
from ucp.families import MixtralConfig, canonical_atoms
from ucp.interop.hf import hf_config_from_ucp
from ucp.interop.megatron import RANK_FILE, convert, load_rank_file, parse_megatron_layout, rank_files
from ucp.reshard import shard

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
    hf: Path  # Hugging Face directory: per-expert safetensors in two files, index, config.json
    dcp: Path  # DCP checkpoint of the flat state dict, with config.json
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


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize("command", list(COMMANDS))
def test_peak_rss_does_not_grow_with_the_model(models, tmp_path, command):
    argv, check = COMMANDS[command]
    peaks = []
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
    assert growth < 0.25 * (large.nbytes - small.nbytes), f"{command}: peak RSS grew by {growth / MiB:.1f} MiB"
