"""DeepSeek-V3's fp8 weights (ucp.sharding.quantization): a random tiny transformers DeepseekV3ForCausalLM saved as the released
checkpoints are (float8_e4m3fn linear weights, a float32 `weight_scale_inv` per block, config.json's
quantization_config) imports as fp8 atoms and scale atoms, moves between layouts and exports back bitwise; dequantised
(export --dtype, the weights loader) it equals what transformers computes; what ucp cannot hold is refused, naming it."""

from __future__ import annotations

import dataclasses
import json
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ucp
from ucp.distributed import ShardedModel, VirtualWorld, load_sharded, needed_objects
from ucp.distributed.sharded_model import extra_state, model_config_of, stored_dtypes
from ucp.errors import LayoutError, UcpError
from ucp.interop.hf import export_hf, import_hf
from ucp.interop.weights import load_into_module, load_weights
from ucp.sharding.layout import parse_layout
from ucp.sharding.reshard import assemble, local_plan

from .helpers import DRAW, assert_same_state, perturb_parameters, step_path

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

# Blocks of 16 with partial last blocks (hidden 40, kv_lora_rank 24), and every TP-split dimension a multiple of
# 2 x 16, so that TP 2 cuts along block edges (TP 4 does not: q_a_proj's and kv_a_proj's 32 rows are two blocks).
BLOCK = [16, 16]
SHAPE = {
    "vocab_size": 100,
    "hidden_size": 40,
    "intermediate_size": 64,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "n_group": 2,
    "topk_group": 1,
    "kv_lora_rank": 24,
    "qk_nope_head_dim": 8,
    "qk_rope_head_dim": 8,
    "v_head_dim": 8,
    "max_position_embeddings": 64,
}
# Every dimension whole blocks of 8: transformers' own loader dequantises only such weights (its Fp8Dequantize
# derives the block from the scale grid, and refuses a partial one).
WHOLE_BLOCK = [8, 8]
WHOLE_SHAPE = {**SHAPE, "hidden_size": 32, "intermediate_size": 48, "moe_intermediate_size": 16, "kv_lora_rank": 16}
QUANTISED = re.compile(r".*_proj(_with_mqa)?\.weight")  # the released checkpoints' fp8 tensors
FP8_MAX = torch.finfo(torch.float8_e4m3fn).max


def quantise(weight: torch.Tensor, block: list[int], ue8m0: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek's fp8 recipe: per block, scale = max |w| / 448 and w / scale rounded to float8_e4m3fn; with ue8m0 the
    scale rounded up to a power of two and kept as float8_e8m0fnu (transformers' Fp8Quantize with scale_fmt ue8m0)."""
    (rows, cols), (b0, b1) = weight.shape, block
    grid = (-(-rows // b0), -(-cols // b1))
    padded = torch.zeros(grid[0] * b0, grid[1] * b1)
    padded[:rows, :cols] = weight.float()
    scales = padded.reshape(grid[0], b0, grid[1], b1).abs().amax(dim=(1, 3)).clamp(min=1e-8) / FP8_MAX
    if ue8m0:
        scales = torch.pow(2.0, torch.ceil(torch.log2(scales)))
    per_element = scales.repeat_interleave(b0, 0)[:rows].repeat_interleave(b1, 1)[:, :cols]
    quantised = (weight.float() / per_element).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return quantised, scales.to(torch.float8_e8m0fnu) if ue8m0 else scales


def fp8_checkpoint(
    directory: Path, shape: dict, block: list[int], ue8m0: bool = False, **overrides
) -> transformers.DeepseekV3Config:
    """A random DeepSeek-V3 saved as the released checkpoints are: bf16, the router's correction bias fp32, the
    linear weights of attention, dense MLPs and experts fp8 with their weight_scale_inv. Structure drawn at random.
    ue8m0: the scales powers of two stored as float8_e8m0fnu, quantization_config's scale_fmt "ue8m0" (as
    transformers quantises and saves DeepSeek-V3.1's)."""
    rng = random.Random()
    drawn = {
        "q_lora_rank": rng.choice([None, 32]),
        "first_k_dense_replace": rng.choice([0, 1, 2]),
        "n_shared_experts": rng.choice([1, 2]),
        "tie_word_embeddings": rng.choice([True, False]),
    }
    config = transformers.DeepseekV3Config(**{**shape, **drawn, **overrides})
    torch.manual_seed(rng.randrange(1000))
    model = transformers.DeepseekV3ForCausalLM(config).eval()
    perturb_parameters(model)
    model.save_pretrained(directory)
    tensors = safetensors_torch.load_file(directory / "model.safetensors")
    out = {}
    for name, t in tensors.items():
        if QUANTISED.fullmatch(name):
            out[name], out[name + "_scale_inv"] = quantise(t, block, ue8m0)
        else:
            out[name] = t.float() if name.endswith("e_score_correction_bias") else t.to(torch.bfloat16)
    safetensors_torch.save_file(out, directory / "model.safetensors", metadata={"format": "pt"})
    doc = json.loads((directory / "config.json").read_text())
    doc["dtype"] = "bfloat16"
    doc["quantization_config"] = {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": block,
        **({"scale_fmt": "ue8m0"} if ue8m0 else {}),
    }
    (directory / "config.json").write_text(json.dumps(doc, indent=2))
    return config


def tensors_of(directory: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for path in sorted(directory.glob("*.safetensors")):
        out.update(safetensors_torch.load_file(path))
    return out


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def reshape(src: str, dst: str, layout: str, options: ucp.SaveOptions | None = None) -> None:
    """The reshaper: every rank of `layout` loads its local state from the atoms of `src` and saves it to `dst`
    (each atom in its stored dtype: the fp32 router bias of a bf16 model, fp8 weights, fp32 scales)."""
    reader = ucp.open_checkpoint(src)
    lay = parse_layout(layout)
    model = ShardedModel(model_config_of(reader), lay, optim_states=(), atom_dtypes=stored_dtypes(reader.atoms))
    local = [load_sharded(reader, model, r)[0] for r in range(lay.world_size)]
    VirtualWorld(lay.world_size).save(
        local, dst, step=reader.step, model=model, extra=extra_state(reader), options=options
    )


def config_of(directory: Path) -> dict:
    doc = json.loads((directory / "config.json").read_text())
    return {k: v for k, v in doc.items() if k not in ("transformers_version", "dtype", "torch_dtype")}


@pytest.mark.parametrize("layout", DRAW.sample(["tp2ep2dp2", "tp2pp3ep2dp2", "tp1pp3ep4dp4", "tp2dp2zero1"], 2))
def test_import_reshape_export_round_trips_bitwise(tmp_path, layout):
    fp8_checkpoint(tmp_path / "hf", SHAPE, BLOCK)
    import_hf(tmp_path / "hf", str(tmp_path / "u1"))
    reshape(str(tmp_path / "u1"), str(tmp_path / "u2"), layout)  # written from `layout`: chunks on its TP cuts
    assert ucp.open_checkpoint(str(tmp_path / "u2")).manifest.layout == str(parse_layout(layout))
    reshape(str(tmp_path / "u2"), str(tmp_path / "u3"), "tp1")
    subprocess.run(
        [sys.executable, "-m", "ucp", "export", str(tmp_path / "u3"), "--to", "hf", str(tmp_path / "out")],
        check=True,
        capture_output=True,
    )
    source, back = tensors_of(tmp_path / "hf"), tensors_of(tmp_path / "out")
    if json.loads((tmp_path / "hf" / "config.json").read_text())["tie_word_embeddings"]:
        source.pop("lm_head.weight", None)  # (a tied copy: the embedding is the atom)
    assert set(back) == set(source)
    assert any(t.dtype == torch.float8_e4m3fn for t in back.values())
    for name, t in source.items():
        assert back[name].dtype == t.dtype and back[name].shape == t.shape, name
        assert torch.equal(bits(back[name]), bits(t)), name
    assert config_of(tmp_path / "out") == config_of(tmp_path / "hf")


def dequantised_by_blocks(weight: torch.Tensor, scales: torch.Tensor, block: list[int]) -> torch.Tensor:
    """The definition, block by block: each block of the weight, in float32, times its scale; rounded to bf16."""
    out = torch.empty(weight.shape, dtype=torch.float32)
    b0, b1 = block
    for i in range(scales.shape[0]):
        for j in range(scales.shape[1]):
            rows, cols = slice(i * b0, (i + 1) * b0), slice(j * b1, (j + 1) * b1)
            out[rows, cols] = weight[rows, cols].float() * scales[i, j]
    return out.to(torch.bfloat16)


def test_bf16_export_is_each_block_times_its_scale_as_transformers_dequantises(tmp_path):
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize, _dequantize_fp8_weight

    fp8_checkpoint(tmp_path / "hf", SHAPE, BLOCK, q_lora_rank=32)  # (q_b_proj [64, 32]: whole blocks; the rest not)
    import_hf(tmp_path / "hf", str(tmp_path / "u"))
    export_hf(str(tmp_path / "u"), tmp_path / "out", dtype="bf16")
    source, out = tensors_of(tmp_path / "hf"), tensors_of(tmp_path / "out")
    assert not any(n.endswith("weight_scale_inv") for n in out)
    assert "quantization_config" not in config_of(tmp_path / "out")
    weights = [n for n in source if QUANTISED.fullmatch(n)]
    partial = 0
    for name in weights:
        weight, scales = source[name], source[name + "_scale_inv"]
        assert out[name].dtype == torch.bfloat16
        assert torch.equal(out[name], dequantised_by_blocks(weight, scales, BLOCK)), name
        # transformers' dequantisation for the backward pass of its FP8 linears takes partial blocks: in float32, then
        # rounded to bf16 as its loader's does
        assert torch.equal(out[name], _dequantize_fp8_weight(weight, scales, BLOCK, torch.float32).bfloat16()), name
        if any(n % b for n, b in zip(weight.shape, BLOCK, strict=True)):
            partial += 1
        else:  # transformers' loader (Fp8Dequantize), which takes whole blocks only
            assert torch.equal(out[name], Fp8Dequantize(None)._dequantize_one(weight, scales, torch.bfloat16)), name
    assert 0 < partial < len(weights)
    for name, t in source.items():  # the rest: cast
        if name not in weights and not name.endswith("_scale_inv") and name in out:
            assert torch.equal(out[name], t.bfloat16()), name


def test_transformers_loads_the_fp8_checkpoint_as_the_bf16_export(tmp_path):
    """transformers itself loads the fp8 checkpoint on CPU (dequantising it to bf16: it needs accelerate, and whole
    blocks) to the very parameters, and logits, of ucp's bf16 export."""
    pytest.importorskip("accelerate", reason="transformers loads fp8 checkpoints only with accelerate")
    fp8_checkpoint(tmp_path / "hf", WHOLE_SHAPE, WHOLE_BLOCK)
    import_hf(tmp_path / "hf", str(tmp_path / "u"))
    export_hf(str(tmp_path / "u"), tmp_path / "out", dtype="bf16")
    theirs = transformers.DeepseekV3ForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.bfloat16).eval()
    ours = transformers.DeepseekV3ForCausalLM.from_pretrained(tmp_path / "out").eval()
    a, b = theirs.state_dict(), ours.state_dict()
    assert set(a) == set(b)
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name
    tokens = torch.randint(0, SHAPE["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(theirs(tokens).logits, ours(tokens).logits)


def test_the_weights_loader_gives_fp8_with_local_scales_or_dequantises(tmp_path):
    fp8_checkpoint(tmp_path / "hf", SHAPE, BLOCK, q_lora_rank=32)
    import_hf(tmp_path / "hf", str(tmp_path / "u"))
    export_hf(str(tmp_path / "u"), tmp_path / "out", dtype="bf16")
    expected = tensors_of(tmp_path / "out")
    layout = parse_layout("tp2ep2dp2")
    # as stored: each TP rank's scales are those of its blocks (rank 1 of q_b_proj's 64 rows: scale rows 2 and 3)
    stored = [load_weights(str(tmp_path / "u"), layout, r) for r in range(layout.world_size)]
    name = "decoder.layers.0.self_attention.linear_q_up_proj"
    scales = tensors_of(tmp_path / "hf")["model.layers.0.self_attn.q_b_proj.weight_scale_inv"]
    assert stored[1].params[name + ".weight"].dtype == torch.float8_e4m3fn
    assert torch.equal(stored[1].params[name + ".weight_scale_inv"], scales[2:4])
    # dequantised per rank from the local scales: assembled, the bf16 export
    loaded = [load_weights(str(tmp_path / "u"), layout, r, dtype="bf16") for r in range(layout.world_size)]
    assert loaded[0].config.weight_block_size is None
    assert not any(n.endswith("_scale_inv") for n in loaded[0].params)
    full = assemble([w.local for w in loaded], loaded[0].config, layout, ())["model"]
    for atom, t in full.items():
        assert t.dtype == torch.bfloat16 and torch.equal(t, expected[atom]), atom
    # into the job's own bf16 tensors: dequantised into them
    into = {n: torch.full_like(t, 7.0) for n, t in loaded[1].params.items()}
    filled = load_weights(str(tmp_path / "u"), layout, 1, into=into)
    for n, t in loaded[1].params.items():
        assert torch.equal(into[n], t) and filled.params[n].data_ptr() == into[n].data_ptr(), n
    # as stored into the job's own tensors: each filled in place by the read, none made and copied over. A float8
    # weight's tensor gets the bytes as stored (read straight into it), a bf16 one the weight dequantised; a weight
    # without one comes as stored, with its scales
    reader = ucp.open_checkpoint(str(tmp_path / "u"))
    fp8_names = [n for n, t in stored[1].params.items() if t.dtype == torch.float8_e4m3fn]
    as_bf16, as_fp8, left = fp8_names[0], fp8_names[1:-1], fp8_names[-1]
    into = {n: torch.zeros_like(stored[1].params[n]) for n in as_fp8}
    into[as_bf16] = torch.zeros_like(loaded[1].params[as_bf16])
    into |= {
        n: torch.zeros_like(t)
        for n, t in stored[1].params.items()
        if n.endswith("_scale_inv") and n != left + "_scale_inv"
    }
    storages = {t.untyped_storage().data_ptr(): n for n, t in into.items()}
    destinations: dict[str, set[str | None]] = {}
    read_object = reader.read_object

    def recording(meta, index, dest_for):
        def dest(box):
            found = dest_for(box)
            if found is not None:
                where = storages.get(found[0].untyped_storage().data_ptr())
                destinations.setdefault(meta.path, set()).add(where)
            return found

        read_object(meta, index, dest)

    read_pack_regions = reader._read_pack_regions

    def recording_packed(pack, run):  # (packed chunks a load reads together: each read's view is its destination)
        for r in run:
            destinations.setdefault(r.meta.path, set()).add(storages.get(r.view.untyped_storage().data_ptr()))
        read_pack_regions(pack, run)

    reader.read_object = recording
    reader._read_pack_regions = recording_packed
    filled = load_weights(reader, layout, 1, into=into)
    for n in as_fp8:
        assert filled.params[n].data_ptr() == into[n].data_ptr(), n
        assert torch.equal(bits(into[n]), bits(stored[1].params[n])), n
    assert filled.params[as_bf16].data_ptr() == into[as_bf16].data_ptr()
    assert torch.equal(into[as_bf16], loaded[1].params[as_bf16])
    assert filled.params[left].dtype == torch.float8_e4m3fn and torch.equal(
        bits(filled.params[left]), bits(stored[1].params[left])
    )
    assert left + "_scale_inv" in filled.params and as_bf16 + "_scale_inv" in filled.params
    # every fp8 region read went straight into the job's tensor, and the dequantised one's into a buffer of its own
    atom_of = {lt.key[1]: lt.pieces[0].atom for lt in local_plan(filled.config, layout, 1, ()) if lt.pieces}
    for n in as_fp8:
        assert destinations[f"model/{atom_of[n]}"] == {n}, n
    assert destinations[f"model/{atom_of[as_bf16]}"] == {None}
    # a transformers model (bf16, no scales) by name
    module = transformers.DeepseekV3ForCausalLM.from_pretrained(tmp_path / "out").eval()
    fresh = transformers.DeepseekV3ForCausalLM(module.config).to(torch.bfloat16).eval()
    load_into_module(str(tmp_path / "u"), fresh)
    assert all(torch.equal(t, module.state_dict()[n]) for n, t in fresh.state_dict().items())


# Blocks of 16 that TP 2 and 4 cut: kv_a_proj_with_mqa's 48 rows (kv_lora_rank 40 + rope 8, 3 blocks) split into parts
# of 24 or 12, the dense MLP's 48 rows and 48 columns (down_proj), the experts' 24 (or shared 48) rows, o_proj's 32
# columns at TP 4: rows and columns whose part ends mid-block, so two ranks share those blocks' scales.
MISALIGNED = {**SHAPE, "kv_lora_rank": 40, "intermediate_size": 48, "moe_intermediate_size": 24}
UNPACKED = ucp.ChunkingPolicy(pack_below=0)
SMALL_CHUNKS = ucp.SaveOptions(
    chunking=ucp.ChunkingPolicy(object_bytes=4096, inner_bytes=256, pack_below=0), fsync=False
)  # (unpacked: a packed atom is read whole)


@pytest.mark.parametrize(
    "layout", DRAW.sample(["tp2", "tp4", "tp2pp3ep2dp2", "tp4ep2dp2", "tp2dp2zero3", "tp1pp3ep4dp4"], 3)
)
def test_a_dequantised_load_takes_any_tp_split_and_equals_the_bf16_export(tmp_path, layout):
    """Every rank of a layout whose TP splits cut blocks loads the fp8 checkpoint dequantised: its local tensors are
    bitwise those it loads from the bf16 export (ucp export --dtype bf16, ucp import) of the same checkpoint, it reads
    only the regions of its own pieces and their scales, and `into` fills its own tensors in place."""
    from ucp.cli import main

    fp8_checkpoint(tmp_path / "hf", MISALIGNED, BLOCK)
    import_hf(tmp_path / "hf", str(tmp_path / "u0"))
    reshape(str(tmp_path / "u0"), str(tmp_path / "u"), "tp1", SMALL_CHUNKS)  # (partial reads: small inner chunks)
    assert main(["export", str(tmp_path / "u"), "--to", "hf", str(tmp_path / "bf16"), "--dtype", "bf16"]) == 0
    assert main(["import", str(tmp_path / "bf16"), str(tmp_path / "b"), "--no-progress"]) == 0
    fp8, bf16 = ucp.open_checkpoint(str(tmp_path / "u")), ucp.open_checkpoint(str(tmp_path / "b"))
    lay = parse_layout(layout)
    if lay.tp > 1:  # as stored, this layout is refused: the way to load it is dequantised
        with pytest.raises(LayoutError, match=r"(not a multiple of its block \[16, 16\]|ZeRO-3).*dtype="):
            load_weights(fp8, lay, 0)
    read_objects: set[tuple[str, tuple[int, ...]]] = set()
    read_object = fp8.read_object

    def recording(meta, index, dest_for):
        read_objects.add((meta.path, index))
        read_object(meta, index, dest_for)

    fp8.read_object = recording
    for rank in range(lay.world_size):
        read_objects.clear()
        got = load_weights(fp8, lay, rank, dtype=torch.bfloat16)
        expected = load_weights(bf16, lay, rank, dtype=torch.bfloat16)
        assert got.config.weight_block_size is None and got.config == expected.config
        assert_same_state(expected.local, got.local)
        # what it reads: the objects of its pieces' regions and of their blocks' scales, as a restore plans them
        assert read_objects == needed_objects(fp8.atoms, ShardedModel(got.config, lay, optim_states=()), rank)
        assert any(path.endswith("_scale_inv") for path, _ in read_objects)
        if lay.tp > 1:
            assert got.report.bytes_read < fp8.total_bytes(), (rank, got.report)
    # into the job's own tensors (dequantised into them, no dtype needed), and assembled: the bf16 export's tensors
    last = lay.world_size - 1
    if lay.zero != 3:  # (ZeRO-3's parameters are flat buffers, not the job's tensors by name)
        into = {n: torch.full_like(t, 7.0) for n, t in expected.params.items()}
        filled = load_weights(fp8, lay, last, into=into)
        for n, t in expected.params.items():
            assert torch.equal(bits(into[n]), bits(t)) and filled.params[n].data_ptr() == into[n].data_ptr(), n
    loaded = [load_weights(fp8, lay, r, dtype="bf16").local for r in range(lay.world_size)]
    full = assemble(loaded, got.config, lay, ())["model"]
    exported = tensors_of(tmp_path / "bf16")
    for atom, t in full.items():
        assert torch.equal(bits(t), bits(exported[atom].bfloat16())), atom


def test_atoms_say_their_scales_and_other_zarr_readers_read_them(tmp_path):
    fp8_checkpoint(tmp_path / "hf", SHAPE, BLOCK)
    import_hf(tmp_path / "hf", str(tmp_path / "u"))
    reader = ucp.open_checkpoint(str(tmp_path / "u"))
    weight, scales = (
        "model/model.layers.1.self_attn.o_proj.weight",
        "model/model.layers.1.self_attn.o_proj.weight_scale_inv",
    )
    w, s = reader.atoms[weight], reader.atoms[scales]
    assert (w.dtype, w.shape, s.dtype, s.shape) == ("float8_e4m3fn", (40, 32), "float32", (3, 2))
    assert w.attributes["quantization"] == {"block": BLOCK, "scales": scales}
    assert s.attributes["quantization"] == {"block": BLOCK, "scales_of": weight}
    assert w.attributes["partition"]["block"] == BLOCK
    source = tensors_of(tmp_path / "hf")["model.layers.1.self_attn.o_proj.weight"]
    ts = pytest.importorskip("tensorstore")
    if w.packed:  # (a small weight: its bytes in a pack, read by docs/FORMAT.md 4.1's recipe)
        pack, offset, nbytes, _ = reader.manifest.packed[weight][0].to_json()
        path = str(step_path(tmp_path / "u", 0) / pack)
        array = ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": path}}, open=True).result()
        assert array[offset : offset + nbytes].read().result().tobytes() == bits(source).numpy().tobytes()
        return
    path = str(step_path(tmp_path / "u", 0) / weight)
    array = ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": path}}, open=True).result()
    assert array.dtype.name == "float8_e4m3fn"
    assert array.read().result().tobytes() == bits(source).numpy().tobytes()


def test_inspect_shows_the_family_its_hyperparameters_and_the_quantisation(tmp_path):
    fp8_checkpoint(tmp_path / "hf", SHAPE, BLOCK, q_lora_rank=32, first_k_dense_replace=1)
    import_hf(tmp_path / "hf", str(tmp_path / "u"))
    shown = subprocess.run(
        [sys.executable, "-m", "ucp", "inspect", str(tmp_path / "u")], capture_output=True, text=True, check=True
    ).stdout
    assert "model       deepseek_v3:" in shown and "first_k_dense_replace 1, q_lora_rank 32, kv_lora_rank 24" in shown
    assert "quantised   fp8 e4m3 linear weights (float8_e4m3fn), one float32 scale per 16x16 block" in shown
    assert re.search(r"model\.layers\.0\.self_attn\.q_a_proj\.weight_scale_inv\s+param\s+2x3\s+float32", shown)


def test_a_tp_split_off_block_edges_is_refused_with_the_tensor(tmp_path):
    fp8_checkpoint(tmp_path / "hf", SHAPE, BLOCK, q_lora_rank=32)
    import_hf(tmp_path / "hf", str(tmp_path / "u"))
    with pytest.raises(
        LayoutError, match=r"q_a_proj\.weight in tp4.*tp=4 splits dim 0 \(size 32\).*parts of 8.*\[16, 16\].*dtype="
    ):
        load_weights(str(tmp_path / "u"), "tp4", 0)
    with pytest.raises(LayoutError, match="ZeRO-3"):
        load_weights(str(tmp_path / "u"), "tp2dp2zero3", 0)
    # dequantised, both load (test_a_dequantised_load_takes_any_tp_split_and_equals_the_bf16_export checks the values)
    for layout in ("tp4", "tp2dp2zero3"):
        assert load_weights(str(tmp_path / "u"), layout, 0, dtype="bf16").config.weight_block_size is None


def run_cli(capsys, *args: str) -> str:
    """`ucp ARGS` in this process: it must fail with one line on stderr; that line."""
    from ucp.cli import main

    capsys.readouterr()  # (what came before: transformers' progress bars)
    assert main(list(args)) == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ucp: error: "), lines
    return lines[0]


def _rewrite(directory: Path, change) -> None:
    tensors = safetensors_torch.load_file(directory / "model.safetensors")
    change(tensors)
    safetensors_torch.save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})


def _quant_config(directory: Path, **fields) -> None:
    doc = json.loads((directory / "config.json").read_text())
    doc["quantization_config"].update(fields)
    (directory / "config.json").write_text(json.dumps(doc))


W = "model.layers.0.self_attn.o_proj.weight"
BAD_SOURCES = {
    "scales of another shape": (
        lambda d: _rewrite(d, lambda t: t.update({W + "_scale_inv": torch.ones(2, 2)})),
        [W + "_scale_inv", "model.safetensors", "[2, 2]", "[3, 2]", "block"],
    ),
    "a weight that is not fp8": (
        lambda d: _rewrite(d, lambda t: t.update({W: t[W].float()})),
        [W, "model.safetensors", "torch.float32", "float8_e4m3fn"],
    ),
    "scales missing": (
        lambda d: _rewrite(d, lambda t: t.pop(W + "_scale_inv")),
        [W + "_scale_inv", "lacks"],
    ),
    "another quant method": (lambda d: _quant_config(d, quant_method="bitsandbytes"), ["config.json", "quant_method"]),
    "another fp8 format": (lambda d: _quant_config(d, fmt="e5m2"), ["config.json", "fmt='e5m2'"]),
    "static activation scales": (lambda d: _quant_config(d, activation_scheme="static"), ["activation_scheme"]),
    "a malformed block size": (lambda d: _quant_config(d, weight_block_size=[16]), ["weight_block_size=[16]"]),
}


@pytest.mark.parametrize("case", sorted(BAD_SOURCES))
def test_a_bad_fp8_source_is_refused_naming_it(tmp_path, capsys, case):
    fp8_checkpoint(tmp_path / "hf", SHAPE, BLOCK)
    damage, fragments = BAD_SOURCES[case]
    damage(tmp_path / "hf")
    with pytest.raises(UcpError) as error:
        import_hf(tmp_path / "hf", str(tmp_path / "u"))
    line = run_cli(capsys, "import", str(tmp_path / "hf"), str(tmp_path / "u"), "--no-progress")
    for fragment in fragments:
        assert fragment in str(error.value) and fragment in line, (fragment, line)
    assert not (tmp_path / "u").exists()


def test_what_cannot_carry_fp8_says_so(tmp_path, capsys):
    """import --dtype (a cast would lose the scales), Megatron (no fp8 blocks in its checkpoints), DCP export --dtype,
    and a quantization_config on another family: each refused in one line, leaving nothing behind."""
    fp8_checkpoint(tmp_path / "hf", SHAPE, BLOCK)
    line = run_cli(capsys, "import", str(tmp_path / "hf"), str(tmp_path / "u0"), "--dtype", "bf16", "--no-progress")
    assert "fp8" in line and "--dtype bf16" in line and not (tmp_path / "u0").exists()
    import_hf(tmp_path / "hf", str(tmp_path / "u"))
    for to in ("tp2", "torch_dist"):
        line = run_cli(capsys, "convert", str(tmp_path / "u"), str(tmp_path / to), "--from", "universal", "--to", to)
        assert "model.layers.0.self_attn" in line and "fp8" in line and "Megatron" in line
        assert not (tmp_path / to).exists()
    line = run_cli(capsys, "export", str(tmp_path / "u"), "--to", "dcp", str(tmp_path / "dcp"), "--dtype", "bf16")
    assert "fp8" in line and not (tmp_path / "dcp").exists()
    llama = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4
    )
    transformers.LlamaForCausalLM(llama).save_pretrained(tmp_path / "llama")
    doc = json.loads((tmp_path / "llama" / "config.json").read_text())
    doc["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [16, 16]}
    (tmp_path / "llama" / "config.json").write_text(json.dumps(doc))
    line = run_cli(capsys, "import", str(tmp_path / "llama"), str(tmp_path / "u1"), "--no-progress")
    assert "deepseek_v3 only" in line and "config.json" in line


@pytest.mark.parametrize("ue8m0", [False, True])
def test_dcp_carries_the_fp8_atoms_as_they_are(tmp_path, ue8m0):
    from ucp.interop.dcp import export_dcp, import_dcp

    fp8_checkpoint(tmp_path / "hf", SHAPE, BLOCK, ue8m0=ue8m0)
    import_hf(tmp_path / "hf", str(tmp_path / "u1"))
    export_dcp(str(tmp_path / "u1"), tmp_path / "dcp")
    with pytest.raises(UcpError, match="fp8 with block scales"):
        import_dcp(tmp_path / "dcp", str(tmp_path / "u0"), dtype="bf16")
    import_dcp(tmp_path / "dcp", str(tmp_path / "u2"))
    export_hf(str(tmp_path / "u2"), tmp_path / "out")
    source, back = tensors_of(tmp_path / "hf"), tensors_of(tmp_path / "out")
    assert all(back[n].dtype == source[n].dtype and torch.equal(bits(back[n]), bits(source[n])) for n in back)
    assert config_of(tmp_path / "out") == config_of(tmp_path / "hf")


# DeepSeek-V3.1's power-of-two scales (scale_fmt ue8m0) as float8_e8m0fnu tensors, and transformers' fp8 modules


# (as stored, whole blocks of 8 take TP 1 only: kv_a_proj_with_mqa's 24 rows are 3 blocks)
@pytest.mark.parametrize("layout", DRAW.sample(["tp1pp3ep2dp2", "tp1pp3ep4dp4", "tp1dp2zero1"], 1))
def test_e8m0_scales_are_carried_bitwise_and_dequantised_as_transformers_does(tmp_path, layout):
    """A checkpoint whose scales are float8_e8m0fnu: imported as e8m0 scale atoms (tensorstore reads them exactly),
    moved between layouts and exported bitwise (F8_E8M0 in the safetensors header); dequantised (bf16 export, the
    weights loader in a layout TP 4 cuts) each block times its power of two as transformers' Fp8Dequantize computes
    it, and transformers' own load of the checkpoint (CPU: dequantising) gives the bf16 export's parameters."""
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    fp8_checkpoint(tmp_path / "hf", WHOLE_SHAPE, WHOLE_BLOCK, ue8m0=True)
    source = tensors_of(tmp_path / "hf")
    import_hf(tmp_path / "hf", str(tmp_path / "u1"))
    reader = ucp.open_checkpoint(str(tmp_path / "u1"))
    scale = "model/model.layers.1.self_attn.o_proj.weight_scale_inv"
    assert reader.atoms[scale].dtype == "float8_e8m0fnu"
    assert model_config_of(reader).weight_scale_dtype == "float8_e8m0fnu"
    ts = pytest.importorskip("tensorstore")
    # (a scale atom is small, so packed; saved unpacked, it is a Zarr array of its own that tensorstore opens)
    reshape(str(tmp_path / "u1"), str(tmp_path / "unpacked"), "tp1", ucp.SaveOptions(chunking=UNPACKED))
    path = str(step_path(tmp_path / "unpacked", 0) / scale)
    array = ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": path}}, open=True).result()
    assert array.dtype.name == "float8_e8m0fnu"
    assert array.read().result().tobytes() == bits(source[scale.removeprefix("model/")]).numpy().tobytes()
    # bitwise through a layout and back
    reshape(str(tmp_path / "u1"), str(tmp_path / "u2"), layout)
    reshape(str(tmp_path / "u2"), str(tmp_path / "u3"), "tp1")
    export_hf(str(tmp_path / "u3"), tmp_path / "out")
    back = tensors_of(tmp_path / "out")
    if config_of(tmp_path / "hf")["tie_word_embeddings"]:
        source.pop("lm_head.weight", None)  # (a tied copy: the embedding is the atom)
    assert set(back) == set(source)
    for name, t in source.items():
        assert back[name].dtype == t.dtype and torch.equal(bits(back[name]), bits(t)), name
    assert config_of(tmp_path / "out") == config_of(tmp_path / "hf")
    # dequantised: transformers' Fp8Dequantize of the e8m0 scales
    export_hf(str(tmp_path / "u1"), tmp_path / "bf16", dtype="bf16")
    out = tensors_of(tmp_path / "bf16")
    weights = [n for n in source if QUANTISED.fullmatch(n)]
    for name in weights:
        theirs = Fp8Dequantize(None)._dequantize_one(source[name], source[name + "_scale_inv"], torch.bfloat16)
        assert torch.equal(out[name], theirs), name
    lay = parse_layout("tp4")
    loaded = [load_weights(reader, lay, r, dtype="bf16").local for r in range(lay.world_size)]
    config = dataclasses.replace(model_config_of(reader), weight_block_size=None)
    full = assemble(loaded, config, lay, ())["model"]
    assert all(torch.equal(bits(t), bits(out[a])) for a, t in full.items())
    pytest.importorskip("accelerate", reason="transformers loads fp8 checkpoints only with accelerate")
    theirs = transformers.DeepseekV3ForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.bfloat16).state_dict()
    ours = transformers.DeepseekV3ForCausalLM.from_pretrained(tmp_path / "bf16").state_dict()
    assert set(theirs) == set(ours) and all(torch.equal(theirs[n], ours[n]) for n in theirs)


def transformers_fp8_model(directory: Path) -> torch.nn.Module:
    """transformers' own load of an fp8 checkpoint into its fp8 modules (FP8Linear; FP8Experts with fused gate/up and
    fused scales), as stored. Its loader dequantises on a machine without a GPU, for FP8 kernels it would not have
    here; only the environment check says so, and loading runs no kernel, so the check is skipped for this load."""
    from transformers.quantizers.quantizer_finegrained_fp8 import FineGrainedFP8HfQuantizer

    check = FineGrainedFP8HfQuantizer.validate_environment
    FineGrainedFP8HfQuantizer.validate_environment = lambda self, *args, **kwargs: None
    try:
        return transformers.DeepseekV3ForCausalLM.from_pretrained(directory, device_map="cpu").eval()
    finally:
        FineGrainedFP8HfQuantizer.validate_environment = check


@pytest.mark.parametrize("ue8m0", [False, True])
def test_load_into_module_fills_transformers_fp8_modules_as_its_own_loader(tmp_path, ue8m0):
    """transformers' fp8 model (FP8Linear weights and scales; FP8Experts' fused gate_up_proj, down_proj and their
    fused scales; float32 or e8m0 scales as the config's scale_fmt says), its tensors zeroed, filled by
    load_into_module from ucp's atoms: every tensor bitwise as transformers' own load of the checkpoint."""
    pytest.importorskip("accelerate", reason="transformers loads fp8 checkpoints only with accelerate")
    from transformers.integrations.finegrained_fp8 import FP8Experts

    fp8_checkpoint(tmp_path / "hf", WHOLE_SHAPE, WHOLE_BLOCK, ue8m0=ue8m0, first_k_dense_replace=1)
    import_hf(tmp_path / "hf", str(tmp_path / "u"))
    reference = transformers_fp8_model(tmp_path / "hf")
    module = transformers_fp8_model(tmp_path / "hf")
    assert any(isinstance(m, FP8Experts) for m in module.modules())
    fused = [n for n in module.state_dict() if n.endswith("experts.gate_up_proj_scale_inv")]
    assert fused and module.state_dict()[fused[0]].dtype == (torch.float8_e8m0fnu if ue8m0 else torch.float32)
    with torch.no_grad():
        for t in module.state_dict().values():
            t.view(torch.uint8).zero_() if t.element_size() == 1 else t.zero_()
    load_into_module(str(tmp_path / "u"), module)
    theirs, ours = reference.state_dict(), module.state_dict()
    assert set(theirs) == set(ours)
    for name, t in theirs.items():
        assert ours[name].dtype == t.dtype and torch.equal(bits(ours[name]), bits(t)), name
