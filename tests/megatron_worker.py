"""Megatron-Core on CPU, for tests/test_convert.py: a tiny GPT MoE model (local layer spec, allgather dispatcher)
and Megatron's own optimizer, saving Megatron-LM torch-format rank files or loading them back strictly.

    python tests/megatron_worker.py MODE CKPT OUT     as ranks of a world (tests.launch.spawn: RANK, WORLD_SIZE, ...)

    save      1 process, fp32: one real optimizer step (FP32Optimizer), then the tp1 checkpoint at CKPT
    load      1 process, fp32: loads CKPT's tp1 file (model strictly, optimizer, scheduler)
    tp2       2 processes, TP 2: loads CKPT's tp2 files (model strictly, optimizer, scheduler)
    ep2       2 processes, EP 2, bf16: one step (Float16OptimizerWithFloat16Params, dense + expert optimizers),
              the tp1ep2 checkpoint, converted by ucp to tp2pp2ep2 and back, loaded into a fresh model and optimizer

Every mode writes to OUT (rank r of several: OUT.r) the logits of fixed tokens and, with an optimizer, each
parameter's optimizer state by name, found through the parameter objects (not indices) so that a test can
check the name <-> index mapping of a converted file against Megatron's own.

Megatron-Core needs a GPU in a few places that do not touch the math; on CPU the worker patches them:
`torch.cuda.current_device` (RoPE), the CUDA RNG tracker's `fork` (dropout is 0), `moe_utils.te_general_gemm`
(unbound without Transformer Engine) and, while the optimizer is built, `device='cuda'` scalars and
`Tensor.type()` names (Megatron checks for torch.cuda.*Tensor types).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F

V, H, FFN, L, HEADS, KV, E = 100, 32, 64, 2, 4, 2, 4
if "UCP_MEGATRON_SHAPE" in os.environ:  # "hidden,ffn,layers,experts,heads,kv": a larger model (benchmarks)
    H, FFN, L, E, HEADS, KV = (int(x) for x in os.environ["UCP_MEGATRON_SHAPE"].split(","))
ITERATION = 10


def _import_megatron_unfused() -> None:
    """Import megatron-core with its fusions as plain functions. It decorates them with torch.compile as its
    modules are imported (torch._dynamo and inductor: about 2.5 s of CPU in every worker process) and would compile
    them with inductor on first use; these workers compare values, which the plain functions compute.
    megatron-core's own `disable_jit_fuser` covers the modules imported after the package."""
    if "megatron.core" in sys.modules:
        return
    compile_ = torch.compile
    torch.compile = lambda fn=None, *args, **kwargs: fn if fn is not None else (lambda f: f)  # type: ignore[assignment]
    try:
        import megatron.core.jit
    finally:
        torch.compile = compile_
    megatron.core.jit.disable_jit_fuser()


def setup(rank: int, world: int, tp: int = 1, ep: int = 1, pp: int = 1, vpp: int = 1) -> None:
    warnings.filterwarnings("ignore")
    _import_megatron_unfused()
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *a, **k: None  # (dist_checkpointing calls it)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random as mrandom
    from megatron.core.transformer.moe import moe_utils

    mrandom.CudaRNGStatesTracker.fork = lambda self, name=None: contextlib.nullcontext()
    moe_utils.te_general_gemm = None
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        expert_model_parallel_size=ep,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
    )


def build_model(
    tp: int = 1,
    ep: int = 1,
    bf16: bool = False,
    parallel_output: bool = True,
    pp: int = 1,
    vocab_size: int | None = None,
    tied: bool = False,
    vpp: int = 1,
    vp_stage: int | None = None,
) -> torch.nn.Module:
    """The test model in this rank's part of layout (tp, pp, ep); vocab_size: its padded vocabulary (default 128 * tp);
    tied: the output layer shares the embedding's weight; vpp > 1: model chunk `vp_stage` of the rank's stage (the
    layers of virtual stage vp_stage * pp + its pipeline rank)."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    dtype = torch.bfloat16 if bf16 else torch.float32
    cfg = TransformerConfig(
        num_layers=L,
        hidden_size=H,
        num_attention_heads=HEADS,
        num_query_groups=KV,
        ffn_hidden_size=FFN,
        num_moe_experts=E,
        moe_router_topk=2,
        moe_ffn_hidden_size=FFN,
        gated_linear_unit=True,
        activation_func=F.silu,
        normalization="RMSNorm",
        layernorm_epsilon=1e-5,
        add_bias_linear=False,
        use_cpu_initialization=True,
        moe_token_dispatcher_type="allgather",
        params_dtype=dtype,
        bf16=bf16,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tp,
        expert_model_parallel_size=ep,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
        pipeline_dtype=dtype,
    )
    spec = get_gpt_layer_local_spec(num_experts=E, moe_grouped_gemm=False, normalization="RMSNorm")
    torch.manual_seed(0)
    return GPTModel(
        cfg,
        spec,
        vocab_size=vocab_size or 128 * tp,
        max_sequence_length=64,
        position_embedding_type="rope",
        rotary_base=10000,
        share_embeddings_and_output_weights=tied,
        parallel_output=parallel_output,
        pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
        post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
        vp_stage=vp_stage,
    )


def megatron_args(ep: int = 1, bf16: bool = False) -> argparse.Namespace:
    return argparse.Namespace(
        num_layers=L,
        hidden_size=H,
        ffn_hidden_size=FFN,
        moe_ffn_hidden_size=FFN,
        num_attention_heads=HEADS,
        group_query_attention=True,
        num_query_groups=KV,
        kv_channels=None,
        num_experts=E,
        moe_router_topk=2,
        swiglu=True,
        add_bias_linear=False,
        normalization="RMSNorm",
        norm_epsilon=1e-5,
        position_embedding_type="rope",
        rotary_base=10000,
        untie_embeddings_and_output_weights=True,
        vocab_size=V,
        padded_vocab_size=128,
        make_vocab_size_divisible_by=128,
        tensor_model_parallel_size=1,
        pipeline_model_parallel_size=1,
        expert_model_parallel_size=ep,
        virtual_pipeline_model_parallel_size=None,
        params_dtype=torch.bfloat16 if bf16 else torch.float32,
        bf16=bf16,
        max_position_embeddings=64,
    )


class Trainable:
    """The model wrapped as Megatron-LM trains it (Float16Module for bf16, then DDP), its optimizer and scheduler."""

    def __init__(
        self,
        model: torch.nn.Module | list[torch.nn.Module],
        bf16: bool,
        distributed: bool = False,
        bucket_size: int | None = None,
    ):
        """distributed: Megatron's distributed optimizer (state sharded over DP, saved in distrib_optim.pt);
        bucket_size: with it, DDP overlaps its grad reduction and cuts its buffers into buckets of that size.
        A list of models: the model chunks of virtual pipeline stages, each wrapped on its own, bucketed only the
        first (as Megatron-LM's get_model does), under one optimizer."""
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
        from megatron.core.transformer.module import Float16Module

        self.model = model
        chunks = model if isinstance(model, list) else [model]
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            use_distributed_optimizer=distributed,
            overlap_grad_reduce=bucket_size is not None,
            bucket_size=bucket_size,
        )
        self.ddps = [
            DistributedDataParallel(
                c.config, ddp_config, Float16Module(c.config, c) if bf16 else c, disable_bucketing=i > 0
            )
            for i, c in enumerate(chunks)
        ]
        self.ddp = self.ddps[0]
        config = OptimizerConfig(
            optimizer="adam",
            lr=1e-2,
            min_lr=1e-3,
            weight_decay=0.1,
            clip_grad=0.0,
            bf16=bf16,
            params_dtype=chunks[0].config.params_dtype,
            use_distributed_optimizer=distributed,
        )
        with _cuda_free_optimizer_setup():
            self.optimizer = get_megatron_optimizer(config, self.ddps)
        self.scheduler = OptimizerParamScheduler(
            self.optimizer,
            init_lr=0.0,
            max_lr=1e-2,
            min_lr=1e-3,
            lr_warmup_steps=2,
            lr_decay_steps=20,
            lr_decay_style="cosine",
            start_wd=0.1,
            end_wd=0.1,
            wd_incr_steps=20,
            wd_incr_style="constant",
        )

    def step(self, tokens: torch.Tensor) -> None:
        """One training step. The loss sees only the V real vocabulary entries, so the padding rows of the
        embedding and the output layer get no gradient and stay zero, as ucp's atoms assume."""
        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()
        logits = forward(self.ddp, tokens)
        F.cross_entropy(logits.float().reshape(-1, V), tokens.roll(-1, 1).reshape(-1)).backward()
        self.ddp.finish_grad_sync()
        # ChainedOptimizer.step() computes the grad norm with CUDA kernels; these two are the step without it
        assert not self.optimizer.prepare_grads() and self.optimizer.step_with_ready_grads()
        self.scheduler.step(1)

    def state_by_name(self) -> dict[str, dict[str, torch.Tensor]]:
        """Each parameter's optimizer tensors (and fp32 master weight), found through the parameter objects."""
        states = {}
        for o in self.optimizer.chained_optimizers:
            states.update({id(p): s for p, s in o.optimizer.state.items()})
        out = {}
        for name, p in self.model.named_parameters():
            main = getattr(p, "main_param", None)
            key = main if main is not None else p
            out[name] = {k: v.clone() for k, v in states[id(key)].items() if v.dim() > 0}
            if main is not None:
                out[name]["master"] = main.detach().clone()
        return out


@contextlib.contextmanager
def _cuda_free_optimizer_setup():
    tensor, type_ = torch.tensor, torch.Tensor.type

    def cpu_tensor(*args, device=None, **kwargs):
        return tensor(*args, **kwargs)

    def cuda_type(self, *args, **kwargs):
        return type_(self, *args, **kwargs) if args or kwargs else type_(self).replace("torch.", "torch.cuda.", 1)

    torch.tensor, torch.Tensor.type = cpu_tensor, cuda_type
    try:
        yield
    finally:
        torch.tensor, torch.Tensor.type = tensor, type_


def exit_now() -> None:
    """End the worker without the interpreter's teardown: megatron-core's and gloo's background threads sometimes
    abort it ("terminate called without an active exception") after the work is done and its results are written.
    Child processes go first: dist_checkpointing's save starts a multiprocessing manager that only that teardown
    would stop, and that would outlive the worker."""
    import multiprocessing

    for child in multiprocessing.active_children():
        child.terminate()
        child.join(5)
    os._exit(0)


def tokens(seed: int = 5) -> torch.Tensor:
    return torch.randint(0, V, (2, 12), generator=torch.Generator().manual_seed(seed))


def forward(model: torch.nn.Module, toks: torch.Tensor) -> torch.Tensor:
    pos = torch.arange(toks.shape[1]).unsqueeze(0).expand(toks.shape[0], -1)
    mask = torch.triu(torch.ones(1, 1, toks.shape[1], toks.shape[1], dtype=torch.bool), diagonal=1)
    return model(toks, pos, mask)[..., :V]


def write_tp2_logits(cfg, spec, ckpt: str, out: str, rank: int) -> None:
    """The oracle workers' end (megatron_family_worker.py, megatron_deepseek_worker.py): megatron-core's GPT model of
    `cfg` and `spec` in TP `cfg.tensor_model_parallel_size` (2 unless told), with RoPE as the file's args say it (its
    base and scaling, as Megatron-LM's `model_provider` passes them), loads this rank's file under CKPT strictly
    (every name and shape its own) and writes its gathered logits to OUT.rank; then the process exits."""
    import glob

    from megatron.core.models.gpt import GPTModel

    (path,) = glob.glob(os.path.join(ckpt, "iter_*", f"mp_rank_{rank:02d}", "model_optim_rng.pt"))
    saved = torch.load(path, weights_only=False)
    args = saved["args"]
    model = GPTModel(
        cfg,
        spec,
        vocab_size=128 * cfg.tensor_model_parallel_size,
        max_sequence_length=64,
        position_embedding_type="rope",
        rotary_base=args.rotary_base,
        rope_scaling=getattr(args, "use_rope_scaling", False),
        rope_scaling_factor=getattr(args, "rope_scaling_factor", 8.0),
        seq_len_interpolation_factor=getattr(args, "rotary_seq_len_interpolation_factor", None),
        share_embeddings_and_output_weights=False,
        parallel_output=False,
    )
    model.load_state_dict(saved["model"], strict=True)
    model.eval()
    with torch.no_grad():
        torch.save(forward(model, tokens()), f"{out}.{rank}")
    dist.destroy_process_group()
    print("ok", flush=True)
    exit_now()


def rank_path(ckpt: str, name: str) -> str:
    return os.path.join(ckpt, f"iter_{ITERATION:07d}", name, "model_optim_rng.pt")


def save(ckpt: str, name: str, t: Trainable, args: argparse.Namespace) -> None:
    """A rank file as Megatron-LM's save_checkpoint writes it with --ckpt-format torch (non-distributed optimizer)."""
    import numpy as np

    os.makedirs(os.path.dirname(rank_path(ckpt, name)))
    rng = [{"random_rng_state": None, "np_rng_state": np.random.get_state(), "torch_rng_state": torch.get_rng_state()}]
    torch.save(
        {
            "args": args,
            "checkpoint_version": 3.0,
            "iteration": ITERATION,
            "model": t.model.state_dict(),
            "optimizer": t.optimizer.state_dict(),
            "opt_param_scheduler": t.scheduler.state_dict(),
            "rng_state": rng,
        },
        rank_path(ckpt, name),
    )
    if dist.get_rank() == 0:
        with open(os.path.join(ckpt, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write(str(ITERATION))


def load(ckpt: str, name: str, t: Trainable) -> dict:
    state = torch.load(rank_path(ckpt, name), weights_only=False)
    t.model.load_state_dict(state["model"], strict=True)
    t.optimizer.load_state_dict(state["optimizer"])
    t.scheduler.load_state_dict(state["opt_param_scheduler"])
    return state


def perturb(model: torch.nn.Module) -> None:
    """Random weights away from init, with zero vocabulary padding rows."""
    with torch.no_grad():
        for _, p in model.named_parameters():
            p.add_(torch.randn_like(p) * 0.2)
        if hasattr(model, "embedding"):  # (a pipeline stage has the embedding or the output layer or neither)
            model.embedding.word_embeddings.weight[V:] = 0
        if hasattr(model, "output_layer"):
            model.output_layer.weight[V:] = 0


def single(mode: str, ckpt: str, out: str) -> None:
    model = build_model()
    result: dict = {}
    if mode == "save":
        perturb(model)
        t = Trainable(model, bf16=False)
        t.step(tokens(seed=1))
        save(ckpt, "mp_rank_00", t, megatron_args())
    else:
        t = Trainable(model, bf16=False)
        load(ckpt, "mp_rank_00", t)
    result.update(optim=t.state_by_name(), lr=[g["lr"] for g in t.optimizer.param_groups])
    model.eval()
    with torch.no_grad():
        result.update(tokens=tokens(), logits=forward(model, tokens()).contiguous())
    torch.save(result, out)


def tp2(rank: int, ckpt: str, out: str) -> None:
    """Load CKPT's tp2 files into Megatron's tp2 model and optimizer: OUT gets the gathered logits, OUT.r rank r's
    optimizer state."""
    model = build_model(tp=2, parallel_output=False)
    t = Trainable(model, bf16=False)
    load(ckpt, f"mp_rank_{rank:02d}", t)
    torch.save({"optim": t.state_by_name()}, f"{out}.{rank}")
    model.eval()
    with torch.no_grad():
        logits = forward(model, tokens()).contiguous()
    if rank == 0:
        torch.save({"logits": logits}, out)


def ep2(rank: int, ckpt: str, out: str) -> None:
    """Save tp1ep2 at CKPT/src, convert it with ucp to tp2pp2ep2 (CKPT/mid) and back (CKPT/back), then load the
    result into a fresh model and optimizer. OUT.r: rank r's optimizer state after the step and after the load."""
    from ucp.interop.megatron.convert import convert

    name = f"mp_rank_00_{rank:03d}"
    model = build_model(ep=2, bf16=True)
    perturb(model)  # before the optimizer copies the master weights
    t = Trainable(model, bf16=True)
    t.step(tokens(seed=1 + rank))  # each data-parallel rank its own batch: the expert states differ per EP rank
    save(os.path.join(ckpt, "src"), name, t, megatron_args(ep=2, bf16=True))
    dist.barrier()
    if rank == 0:
        convert(os.path.join(ckpt, "src"), os.path.join(ckpt, "mid"), from_layout="tp1ep2", to_layout="tp2pp2ep2")
        convert(os.path.join(ckpt, "mid"), os.path.join(ckpt, "back"), from_layout="tp2pp2ep2", to_layout="tp1ep2")
    dist.barrier()
    fresh = Trainable(build_model(ep=2, bf16=True), bf16=True)
    load(os.path.join(ckpt, "back"), name, fresh)
    torch.save(
        {
            "saved": t.state_by_name(),
            "loaded": fresh.state_by_name(),
            "lr": ([g["lr"] for g in t.optimizer.param_groups], [g["lr"] for g in fresh.optimizer.param_groups]),
        },
        f"{out}.{rank}",
    )


if __name__ == "__main__":
    mode, ckpt, out = sys.argv[1:4]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    setup(rank, world, tp=2 if mode == "tp2" else 1, ep=2 if mode == "ep2" else 1)
    try:
        if mode in ("save", "load"):
            single(mode, ckpt, out)
        elif mode == "tp2":
            tp2(rank, ckpt, out)
        else:
            ep2(rank, ckpt, out)
    finally:
        dist.destroy_process_group()
    print("ok", flush=True)
    exit_now()
