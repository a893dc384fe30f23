"""Hugging Face Mixtral export and import: transformers loads what ucp exports, ucp imports what transformers saves."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
import torch

from ucp import cli as ucp_cli
from ucp.errors import IntegrityError
from ucp.interop.errors import DestinationExistsError, InteropError, SourceMismatchError
from ucp.interop.hf import export_hf, import_hf
from ucp.interop.weights import load_weights
from ucp.sharding.families import MixtralConfig, canonical_atoms
from ucp.sharding.layout import parse_layout
from ucp.sharding.reshard import shard

from .helpers import DRAW, damage_atom, random_full_state, save_in_layout, tiny_config

transformers = pytest.importorskip("transformers")


def hf_reference_model(cfg: MixtralConfig, atoms: dict[str, torch.Tensor], **hf_fields) -> torch.nn.Module:
    """transformers' Mixtral filled from the atoms by hand (transformers >= 5 fuses experts in memory), independent
    of the exporter and of transformers' own on-disk conversion."""
    hf_cfg = transformers.MixtralConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        num_local_experts=cfg.num_local_experts,
        num_experts_per_tok=cfg.num_experts_per_tok,
        tie_word_embeddings=cfg.tie_word_embeddings,
        **hf_fields,
    )
    model = transformers.MixtralForCausalLM(hf_cfg).eval()
    state = {}
    for name in model.state_dict():
        parts = name.split(".")
        if name.endswith("mlp.gate.weight"):
            state[name] = atoms[name.replace(".mlp.", ".block_sparse_moe.")]
        elif name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            base = f"model.layers.{parts[2]}.block_sparse_moe.experts."
            xs = range(cfg.num_local_experts)
            if name.endswith("gate_up_proj"):
                state[name] = torch.stack(
                    [torch.cat([atoms[f"{base}{x}.w1.weight"], atoms[f"{base}{x}.w3.weight"]]) for x in xs]
                )
            else:
                state[name] = torch.stack([atoms[f"{base}{x}.w2.weight"] for x in xs])
        elif name == "lm_head.weight" and cfg.tie_word_embeddings:
            state[name] = atoms["model.embed_tokens.weight"]
        else:
            state[name] = atoms[name]
    model.load_state_dict(state, strict=True)
    return model


def logits(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=tokens).logits


def assert_close_rel(a: torch.Tensor, b: torch.Tensor, rel: float = 1e-5) -> None:
    err = (a - b).abs().max().item() / max(b.abs().max().item(), 1e-12)
    assert err <= rel, f"relative error {err:.3g} > {rel}"


@pytest.mark.parametrize("layout", ["tp2pp2", "tp1pp1ep2dp2zero1"])
def test_export_loads_in_transformers_with_the_same_logits(tmp_path, layout):
    cfg = tiny_config()
    full = random_full_state(cfg)
    save_in_layout(full, cfg, layout, str(tmp_path / "ckpt"))
    out = tmp_path / "hf"
    report = export_hf(str(tmp_path / "ckpt"), out, max_shard_bytes=64 << 10, memory_budget=64 << 10)  # files in groups
    assert report.files > 1 and report.tensors == len(canonical_atoms(cfg))
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(canonical_atoms(cfg))
    loaded = transformers.MixtralForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    tokens = torch.randint(0, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    assert_close_rel(logits(loaded, tokens), logits(hf_reference_model(cfg, full["model"]), tokens))


def test_export_bf16_and_tied_embeddings(tmp_path):
    from safetensors import safe_open

    cfg = tiny_config(tie_word_embeddings=True, num_hidden_layers=1)
    full = random_full_state(cfg, states=())
    save_in_layout(full, cfg, "tp2", str(tmp_path / "ckpt"))
    out = tmp_path / "hf"
    export_hf(str(tmp_path / "ckpt"), out, dtype="bf16")
    config = json.loads((out / "config.json").read_text())
    assert config["dtype"] == "bfloat16" and config["tie_word_embeddings"] is True
    files = sorted(out.glob("*.safetensors"))
    with safe_open(str(files[0]), framework="pt") as f:
        names = list(f.keys())
        assert "lm_head.weight" not in names
        assert all(f.get_tensor(k).dtype == torch.bfloat16 for k in names)
        assert torch.equal(
            f.get_tensor("model.embed_tokens.weight"), full["model"]["model.embed_tokens.weight"].bfloat16()
        )
    loaded = transformers.MixtralForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    bf16_atoms = {n: t.bfloat16().float() for n, t in full["model"].items()}
    tokens = torch.randint(0, cfg.vocab_size, (1, 8), generator=torch.Generator().manual_seed(2))
    assert_close_rel(logits(loaded, tokens), logits(hf_reference_model(cfg, bf16_atoms), tokens))


def save_hf(tmp_path: Path, **fields) -> tuple[Path, torch.nn.Module]:
    torch.manual_seed(0)
    hf_cfg = transformers.MixtralConfig(
        vocab_size=100,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        **fields,
    )
    model = transformers.MixtralForCausalLM(hf_cfg).eval()
    src = tmp_path / "hf_src"
    model.save_pretrained(src, max_shard_size="100KB")
    return src, model


def test_import_then_any_layout_loads_it_and_export_gives_it_back(tmp_path):
    src, model = save_hf(tmp_path, rms_norm_eps=1e-6)
    url = str(tmp_path / "ucp")
    report = import_hf(src, url, memory_budget=64 << 10)  # many groups of atoms
    assert report.step == 0
    import ucp

    reader = ucp.open_checkpoint(url)
    assert reader.manifest.layout == "tp1pp1"
    assert not [p for p in reader.atoms if p.startswith("optimizer/")]
    # tp2 rank 1 gets its slices of the HF tensors, padded vocab rows and all
    cfg = tiny_config()
    atoms = {n: t for n, t in reader.read_atoms([f"model/{n}" for n in canonical_atoms(cfg)]).items()}
    atoms = {p.removeprefix("model/"): t for p, t in atoms.items()}
    assert torch.equal(atoms["model.embed_tokens.weight"], model.model.embed_tokens.weight)
    assert torch.equal(
        atoms["model.layers.1.block_sparse_moe.experts.3.w3.weight"],
        model.model.layers[1].mlp.experts.gate_up_proj[3, 64:],
    )
    got = load_weights(url, "tp2", 1)
    want = shard({"model": atoms}, cfg, parse_layout("tp2"), 1, ())["model"]
    assert list(got.params) == list(want)
    for name in want:
        assert torch.equal(got.params[name], want[name]), name
    # round trip: the exported directory loads with the same logits and keeps the HF-only fields
    out = tmp_path / "hf_out"
    export_hf(url, out)
    assert json.loads((out / "config.json").read_text())["rms_norm_eps"] == 1e-6
    again = transformers.MixtralForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    tokens = torch.randint(0, 100, (2, 10), generator=torch.Generator().manual_seed(3))
    assert torch.equal(logits(again, tokens), logits(model, tokens))


def test_import_fused_expert_files_atom_by_atom(tmp_path):
    """transformers' in-memory naming saved as is (fused experts, one file): each expert's part of a fused
    tensor is an atom of its own, read alone under a budget smaller than the fused tensor."""
    from safetensors.torch import save_file

    import ucp

    src, model = save_hf(tmp_path)
    fused = tmp_path / "fused"
    fused.mkdir()
    (fused / "config.json").write_text((src / "config.json").read_text())
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    assert state["model.layers.0.mlp.experts.gate_up_proj"].nbytes > 16 << 10
    save_file(state, str(fused / "model.safetensors"))
    import_hf(fused, str(tmp_path / "u"), memory_budget=16 << 10)
    got = ucp.load(str(tmp_path / "u"))["model"]
    for layer in range(2):
        mlp = f"model.layers.{layer}.mlp."
        moe = f"model.layers.{layer}.block_sparse_moe."
        assert torch.equal(got[moe + "gate.weight"], state[mlp + "gate.weight"])
        for x in range(4):
            assert torch.equal(got[f"{moe}experts.{x}.w1.weight"], state[mlp + "experts.gate_up_proj"][x, :64])
            assert torch.equal(got[f"{moe}experts.{x}.w3.weight"], state[mlp + "experts.gate_up_proj"][x, 64:])
            assert torch.equal(got[f"{moe}experts.{x}.w2.weight"], state[mlp + "experts.down_proj"][x])
    assert torch.equal(got["lm_head.weight"], state["lm_head.weight"])


def test_import_refuses_another_architecture_and_writes_nothing(tmp_path):
    gpt2 = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(vocab_size=64, n_embd=16, n_layer=1, n_head=2, n_positions=32)
    )
    gpt2.save_pretrained(tmp_path / "gpt2")
    url = tmp_path / "ucp"
    with pytest.raises(SourceMismatchError, match="model_type='gpt2'.*ucp imports Hugging Face mixtral.*llama.*qwen3"):
        import_hf(tmp_path / "gpt2", str(url))
    assert not url.exists()
    llama = transformers.LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, mlp_bias=True
    )  # a setting whose weights have no atom
    transformers.LlamaForCausalLM(llama).save_pretrained(tmp_path / "llama")
    with pytest.raises(SourceMismatchError, match="mlp_bias=True"):
        import_hf(tmp_path / "llama", str(url))
    assert not url.exists()


def test_import_refuses_missing_and_misshapen_tensors(tmp_path):
    from safetensors.torch import load_file, save_file

    src, _ = save_hf(tmp_path)
    index = json.loads((src / "model.safetensors.index.json").read_text())
    fname = index["weight_map"]["model.norm.weight"]
    tensors = load_file(str(src / fname))
    tensors["model.norm.weight"] = torch.ones(31)
    save_file(tensors, str(src / fname))
    with pytest.raises(InteropError, match=r"model\.norm\.weight has shape \[31\]"):
        import_hf(src, str(tmp_path / "a"))
    del tensors["model.norm.weight"]
    save_file(tensors, str(src / fname))
    del index["weight_map"]["model.norm.weight"]
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(InteropError, match=r"lacks tensors \['model\.norm\.weight'\]"):
        import_hf(src, str(tmp_path / "b"))
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_export_never_leaves_a_partial_directory(tmp_path, monkeypatch):
    cfg = tiny_config(num_hidden_layers=1)
    save_in_layout(random_full_state(cfg, states=()), cfg, "tp1", str(tmp_path / "ckpt"))
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "x").write_text("keep")
    with pytest.raises(DestinationExistsError):
        export_hf(str(tmp_path / "ckpt"), tmp_path / "busy")
    assert (tmp_path / "busy" / "x").read_text() == "keep"
    # a corrupt chunk of the last atom (in the last of several files) fails the export once earlier files are written
    damage_atom(tmp_path / "ckpt", "model/lm_head.weight")
    with pytest.raises(IntegrityError, match="lm_head.weight"):
        export_hf(str(tmp_path / "ckpt"), tmp_path / "out", max_shard_bytes=16 << 10, memory_budget=16 << 10)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["busy", "ckpt"]


def _cli(argv: list[str]) -> int:
    return ucp_cli.main(argv)


def test_cli_export_import_and_errors(tmp_path, capsys):
    src, _ = save_hf(tmp_path)
    assert _cli(["import", str(src), str(tmp_path / "ucp"), "--from", "hf"]) == 0
    assert _cli(["export", str(tmp_path / "ucp"), "--to", "hf", str(tmp_path / "out"), "--dtype", "bf16"]) == 0
    assert json.loads((tmp_path / "out" / "config.json").read_text())["dtype"] == "bfloat16"
    assert _cli(["export", str(tmp_path / "ucp"), "--to", "hf", str(tmp_path / "out")]) == 1
    assert "already exists" in capsys.readouterr().err
    assert _cli(["import", str(tmp_path / "nowhere"), str(tmp_path / "ucp2")]) == 1
    assert "no config.json" in capsys.readouterr().err
    assert not (tmp_path / "ucp2").exists()


@pytest.mark.parametrize("damage", ["truncated", "garbage header", "garbage index"])
def test_a_damaged_hf_checkpoint_is_one_line_naming_the_file_and_leaves_no_destination(tmp_path, capsys, damage):
    src, _ = save_hf(tmp_path)
    files = sorted(src.glob("*.safetensors"))
    target = src / "model.safetensors.index.json" if damage == "garbage index" else files[-1]
    if not target.exists():  # (a single-file model has no index)
        pytest.skip("no index to damage")
    data = target.read_bytes()
    target.write_bytes(data[: len(data) // 2] if damage == "truncated" else os.urandom(64) + data[64:])
    dest = tmp_path / "ucp"
    capsys.readouterr()
    assert _cli(["import", str(src), str(dest), "--from", "hf", "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err and str(target) in err, err
    assert not dest.exists()


SMALL = {
    "vocab_size": 64,
    "hidden_size": 32,
    "num_hidden_layers": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}
QWEN_MOE = {**SMALL, "moe_intermediate_size": 8, "num_local_experts": 4, "num_experts_per_tok": 2}


def _saved(tmp_path, config) -> str:
    from ucp.sharding.families import canonical_atoms

    url = str(tmp_path / "u")
    full = {"model": {n: torch.randn(s) for n, (s, _) in canonical_atoms(config).items()}}
    save_in_layout(full, config, "tp1pp1", url)
    return url


@pytest.mark.parametrize(
    "family, fields, says",
    [
        ("llama", {"intermediate_size": 16, "attention_bias": True, "qk_norm": True}, "attention_bias=True"),
        ("qwen_moe", {"qk_norm": False, "qk_norm_full": True, "shared_expert_intermediate_size": 16}, "shared_expert"),
        ("qwen_moe", {"qk_norm": True, "shared_expert_intermediate_size": 16}, "shared_expert_intermediate_size=16"),
        ("qwen_moe", {"qk_norm": True, "attention_bias": True}, "attention_bias=True"),
    ],
)
def test_a_model_no_hf_architecture_holds_is_refused_by_export(tmp_path, family, fields, says):
    """Models a training job can hold (Megatron's qk_layernorm with add_qkv_bias, a shared expert beside full q/k
    norms) that no architecture here holds: exported as the nearest one, transformers dropped weights (q/k/v biases,
    the shared expert) or made some anew (o_proj's bias). Refused, and nothing written."""
    from ucp.sharding.families import LlamaConfig, QwenMoeConfig

    config = LlamaConfig(**SMALL, **fields) if family == "llama" else QwenMoeConfig(**QWEN_MOE, **fields)
    url = _saved(tmp_path, config)
    with pytest.raises(SourceMismatchError, match=f"{says}.*has no Hugging Face architecture here"):
        export_hf(url, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


def test_a_qwen_moe_without_a_dense_size_exports_a_config_transformers_loads(tmp_path):
    """intermediate_size (a dense MLP's, which no layer here has) is None where a training job never set it: it was
    written as null, which transformers refuses; now left to transformers' default."""
    from ucp.sharding.families import QwenMoeConfig

    url = _saved(tmp_path, QwenMoeConfig(**QWEN_MOE))
    export_hf(url, tmp_path / "hf")
    model, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", output_loading_info=True)
    assert type(model).__name__ == "Qwen3MoeForCausalLM"
    assert not info["missing_keys"] and not info["unexpected_keys"], info


@pytest.mark.parametrize("elsewhere", ["../elsewhere", "/abs", "sub/dir", ".."])
def test_an_index_naming_a_file_not_beside_it_is_refused(tmp_path, capsys, elsewhere):
    """A weight_map entry is a file name in the checkpoint's directory: a path that leads elsewhere is never read."""
    import shutil

    src, _ = save_hf(tmp_path)  # (several shards: an index)
    index = src / "model.safetensors.index.json"
    doc = json.loads(index.read_text())
    name = next(iter(doc["weight_map"]))
    moved = tmp_path / "outside.safetensors"
    shutil.copy(src / doc["weight_map"][name], moved)
    doc["weight_map"][name] = {"../elsewhere": "../outside.safetensors", "/abs": str(moved),
                               "sub/dir": "sub/x.safetensors", "..": ".."}[elsewhere]  # fmt: skip
    index.write_text(json.dumps(doc))
    capsys.readouterr()  # (transformers' progress while saving)
    assert ucp_cli.main(["import", str(src), str(tmp_path / "u"), "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not a file beside it" in err and str(index) in err, err
    assert not (tmp_path / "u").exists()


def test_an_export_whose_destination_cannot_be_made_is_one_line(tmp_path, capsys):
    cfg = tiny_config(num_hidden_layers=1)
    save_in_layout(random_full_state(cfg, states=()), cfg, "tp1", str(tmp_path / "u"))
    (tmp_path / "file").write_text("")
    for to in ("hf", "vllm"):
        assert ucp_cli.main(["export", str(tmp_path / "u"), "--to", to, str(tmp_path / "file" / "x")]) == 1
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("ucp: error: cannot make") and "file" in err, err


def test_a_step_directory_opens_with_its_own_step_named_again(tmp_path):
    import ucp

    cfg = tiny_config(num_hidden_layers=1)
    for step in (1, 2):
        save_in_layout(random_full_state(cfg, states=(), seed=step), cfg, "tp1", str(tmp_path / "u"), step=step)
    step_dir = str(tmp_path / "u" / "step_00000001")
    assert ucp.open_checkpoint(step_dir, 1).step == 1 == ucp.open_checkpoint(step_dir).step
    assert ucp_cli.main(["export", step_dir, "--to", "hf", str(tmp_path / "hf"), "--step", "1"]) == 0


ASSUMED_ARCHS = {
    "llama": "LlamaConfig",
    "mistral": "MistralConfig",
    "qwen2": "Qwen2Config",
    "qwen3": "Qwen3Config",
    "mixtral": "MixtralConfig",
    "qwen2_moe": "Qwen2MoeConfig",
    "qwen3_moe": "Qwen3MoeConfig",
}


@pytest.mark.parametrize("arch", DRAW.sample(sorted(ASSUMED_ARCHS), 3))
def test_a_config_json_relying_on_transformers_defaults_exports_as_the_same_model(tmp_path, arch):
    """A config.json without rms_norm_eps, rope_theta or norm_topk_prob means transformers' own defaults for them:
    an import then an export says the values transformers read from the source, and so does a Megatron conversion."""
    import transformers

    shape = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 1,
             "num_attention_heads": 4, "num_key_value_heads": 2}  # fmt: skip
    if arch.endswith("moe"):
        shape.update(moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2)
        if arch == "qwen2_moe":
            shape.update(shared_expert_intermediate_size=16)
    elif arch == "mixtral":
        shape.update(num_local_experts=4, num_experts_per_tok=2)
    cfg = getattr(transformers, ASSUMED_ARCHS[arch])(**shape)
    src = tmp_path / "hf"
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(src)
    doc = json.loads((src / "config.json").read_text())
    for key in ("rms_norm_eps", "rope_theta", "rope_parameters", "rope_scaling", "norm_topk_prob"):
        doc.pop(key, None)
    (src / "config.json").write_text(json.dumps(doc))
    read = transformers.AutoConfig.from_pretrained(src)
    import_hf(src, str(tmp_path / "u"))
    export_hf(str(tmp_path / "u"), tmp_path / "back")
    back = transformers.AutoConfig.from_pretrained(tmp_path / "back")

    def theta(c):
        params = getattr(c, "rope_parameters", None)
        return params["rope_theta"] if isinstance(params, dict) else c.rope_theta

    assert back.rms_norm_eps == read.rms_norm_eps and theta(back) == theta(read), (arch, back, read)
    assert getattr(back, "norm_topk_prob", None) == getattr(read, "norm_topk_prob", None)


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (lambda doc: "{not json", "is not valid JSON"),
        (lambda doc: b"\xff\xfe{}", "is not valid JSON"),
        (lambda doc: [doc], "is not a config .a JSON object., but a list"),
        (lambda doc: {**doc, "num_hidden_layers": "2"}, "num_hidden_layers is '2', not a positive integer"),
        (lambda doc: {**doc, "hidden_size": 32.0}, "hidden_size is 32.0, not a positive integer"),
        (lambda doc: {**doc, "num_key_value_heads": 0}, "num_key_value_heads is 0, not a positive integer"),
        (lambda doc: {**doc, "vocab_size": True}, "vocab_size is True, not a positive integer"),
    ],
)
def test_a_malformed_config_json_is_one_line_naming_it(tmp_path, capsys, edit, match):
    src, _ = save_hf(tmp_path)
    doc = edit(json.loads((src / "config.json").read_text()))
    data = doc if isinstance(doc, bytes) else (doc if isinstance(doc, str) else json.dumps(doc)).encode()
    (src / "config.json").write_bytes(data)
    capsys.readouterr()
    assert ucp_cli.main(["import", str(src), str(tmp_path / "u"), "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(src / "config.json") in err, err
    assert re.search(match, err), err
    assert not (tmp_path / "u").exists()


def test_an_atom_given_twice_is_refused_naming_both_tensors(tmp_path, capsys):
    """Per-expert tensors and the fused ones of the same layer both present: which is the model? Refused."""
    from safetensors.torch import save_file

    src, _ = save_hf(tmp_path)
    experts, ffn, hidden = 4, 64, 32
    fused = {
        "model.layers.0.mlp.experts.gate_up_proj": torch.full((experts, 2 * ffn, hidden), 7.0),
        "model.layers.0.mlp.experts.down_proj": torch.full((experts, hidden, ffn), 7.0),
    }
    save_file(fused, src / "extra.safetensors", metadata={"format": "pt"})
    index = src / "model.safetensors.index.json"
    doc = json.loads(index.read_text())
    doc["weight_map"].update(dict.fromkeys(fused, "extra.safetensors"))
    index.write_text(json.dumps(doc))
    capsys.readouterr()
    assert ucp_cli.main(["import", str(src), str(tmp_path / "u"), "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is given twice" in err and "mlp.experts." in err, err
    assert not (tmp_path / "u").exists()
