"""Megatron-Core's distributed optimizer as the oracle of ucp's distrib_optim.pt conversion
(tests/test_megatron_distopt.py).

    python tests/megatron_distopt_worker.py save CKPT OUT        pp2 x ep2, bf16 (UCP_DISTOPT_SAVE="TP,PP,EP[,VPP]":
                                                                 another layout); DP is what the ranks leave (4 ranks:
                                                                 DP 2)
    python tests/megatron_distopt_worker.py save_dist CKPT OUT   the same, saved in the torch_dist format
    python tests/megatron_distopt_worker.py load CKPT OUT        torch format, in UCP_DISTOPT_LOAD="TP,PP,EP[,VPP]"
                                                                 (tp1pp1)
    python tests/megatron_distopt_worker.py load_dist CKPT OUT   torch_dist, in UCP_DISTOPT_LOAD

`save` takes one step of Megatron's distributed optimizer (DDP with overlapped grad reduction in small buckets, so
the first stage's buffer has several) and saves the Megatron-LM torch-format checkpoint as Megatron-LM does with
--use-distributed-optimizer: model_optim_rng.pt per rank directory, distrib_optim.pt gathered over DP by
`save_parameter_state`; `save_dist` saves it with dist_checkpointing instead (the optimizer `fully_reshardable`,
or as UCP_DISTOPT_SHARDING says). Both runs are deterministic: the same layout gives the same state either way.
`load` loads CKPT into a fresh model and distributed optimizer (strict model load,
`load_state_dict`, `load_parameter_state`). Both write OUT.r: each parameter's piece of master weight and Adam
moments that rank r's optimizer holds, found through megatron-core's own range maps and keyed by the global
parameter name (layers and experts numbered as in a tp1pp1 model), with the rank's TP rank and the parameter's TP
partition dimension, so a test can assemble whole states and compare two layouts name by name. With VPP > 1 each
rank holds VPP model chunks (Megatron-LM's `model0`, `model1`, ... in the rank file and the state dicts), each its
own DDP (only the first bucketed, as Megatron-LM builds them) under one optimizer. With UCP_DISTOPT_NEXT=1 every
mode then takes one more step (gradients drawn as the first step's, from another seed) and writes OUT.next.r the
same way: the state a job continuing from the checkpoint reaches, to compare with the saving job's own next step.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.megatron_worker import (
    ITERATION,
    E,
    L,
    Trainable,
    V,
    build_model,
    exit_now,
    megatron_args,
    perturb,
    setup,
)

# elements: the first stage's buffer gets several buckets; UCP_DISTOPT_BUCKET=none: one bucket per buffer (for
# torch_dist: megatron-core 0.16.1's fully_reshardable save indexes the gathered, bucket-coalesced state with the
# padded buffer's offsets, so with several buckets and bucket padding it stores later buckets' parameters shifted)
BUCKET = None if os.environ.get("UCP_DISTOPT_BUCKET") == "none" else 2000


def _layout(text: str) -> tuple[int, int, int, int]:
    """TP, PP, EP and VPP from "TP,PP,EP[,VPP]"."""
    sizes = [int(x) for x in text.split(",")]
    return sizes[0], sizes[1], sizes[2], sizes[3] if len(sizes) > 3 else 1


# the saved layout (DP: the world size over TP x PP; 4 ranks in pp2 x ep2: DP 2, expert DP 1)
TP, PP, EP, VPP = _layout(os.environ.get("UCP_DISTOPT_SAVE", "1,2,2"))
# load's and load_dist's layout
LOAD_TP, LOAD_PP, LOAD_EP, LOAD_VPP = _layout(os.environ.get("UCP_DISTOPT_LOAD", "1,1,1"))
NEXT = os.environ.get("UCP_DISTOPT_NEXT") == "1"  # take one more step after the save or the load
# UCP_DISTOPT_TIED=1: the output layer shares the embedding's weight; across pipeline stages megatron-core keeps a copy
# on the last stage and gives both a grad buffer bucket of their own
TIED = os.environ.get("UCP_DISTOPT_TIED") == "1"
# save_dist's form of the optimizer state (megatron-core's distrib_optim_sharding_type)
SHARDING = os.environ.get("UCP_DISTOPT_SHARDING", "fully_reshardable")
EMBEDDING = "embedding.word_embeddings.weight"


def global_name(name: str, chunk: int, ep_rank: int, chunks: int, ep: int) -> str:
    """A local parameter name of model chunk `chunk` (virtual stage v of pipeline rank p: v * PP + p; the stage
    itself without VPP) of `chunks`, EP rank ep_rank, as the tp1pp1 model names it."""
    parts = name.split(".")
    if name.startswith("decoder.layers."):
        parts[2] = str(int(parts[2]) + chunk * (L // chunks))
        if "local_experts" in parts:
            i = parts.index("local_experts") + 1
            parts[i] = str(int(parts[i]) + ep_rank * (E // ep))
    return ".".join(parts)


def rank_dirname(tp_rank: int, pp_rank: int, ep_rank: int, pp: int, ep: int) -> str:
    """Megatron-LM's rank directory name: a PP rank only with PP > 1, an EP rank only with EP > 1."""
    return f"mp_rank_{tp_rank:02d}" + (f"_{pp_rank:03d}" if pp > 1 else "") + (f"_{ep_rank:03d}" if ep > 1 else "")


def chunks_of(t: Trainable) -> list[torch.nn.Module]:
    return t.model if isinstance(t.model, list) else [t.model]


def named_parameters(t: Trainable, pp_rank: int, ep_rank: int, pp: int, ep: int) -> list[tuple[str, str, Any]]:
    """(local name, global name, parameter) of every parameter of every model chunk of the rank."""
    chunks = chunks_of(t)
    out = []
    for v, chunk in enumerate(chunks):
        for name, p in chunk.named_parameters():
            out.append((name, global_name(name, v * pp + pp_rank, ep_rank, pp * len(chunks), ep), p))
    return out


def shards(t: Trainable, pp_rank: int, ep_rank: int, pp: int, ep: int) -> dict[str, dict]:
    """Each parameter's range of its flattened (TP-local) values this rank's distributed optimizer holds, with its
    fp32 master weight and Adam moments there (megatron-core's own range maps and state accessors), the TP rank
    and the parameter's TP partition dimension (None: the same on every TP rank)."""
    from megatron.core import parallel_state as ps

    tp_rank = ps.get_tensor_model_parallel_rank()
    out = {}
    for name, global_, p in named_parameters(t, pp_rank, ep_rank, pp, ep):
        split = getattr(p, "tensor_model_parallel", False)
        for o in t.optimizer.chained_optimizers:
            if p in o.model_param_group_index_map:
                r = o._get_model_param_range_map(p)["param"]
                tensors = o._get_main_param_and_optimizer_states(p)
                out[global_] = {
                    "range": (r.start, r.end),
                    "shape": tuple(p.shape),
                    "tp_rank": tp_rank,
                    "partition_dim": getattr(p, "partition_dim", None) if split else None,
                    **{k: tensors[k].detach().float().clone() for k in ("param", "exp_avg", "exp_avg_sq")},
                }
    return out


def _tie(model: torch.nn.Module, pp_rank: int) -> None:
    """The last stage's copy of a tied embedding made equal to the first stage's, as megatron-core's model init
    does it (zeroed, then summed over the embedding group)."""
    from megatron.core import parallel_state as ps

    weight = model.embedding.word_embeddings.weight if pp_rank == 0 else model.output_layer.weight
    values = weight.data.float() if pp_rank == 0 else torch.zeros(weight.shape)
    dist.all_reduce(values, group=ps.get_embedding_group())
    weight.data.copy_(values)


def padding_start(vocab_shard: torch.Tensor, tp_rank: int) -> int:
    """The first row of a TP rank's vocabulary shard that pads past the real vocabulary."""
    return max(0, V - tp_rank * vocab_shard.shape[0])


def distinct_tp_shards(model: torch.nn.Module, tp_rank: int) -> None:
    """With TP > 1: the TP-split parameters get values of their own on each TP rank (perturb draws the same on
    every rank, so a mixed-up TP order would go unseen), and each shard's vocabulary padding rows are zero."""
    g = torch.Generator().manual_seed(1234 + tp_rank)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if getattr(p, "tensor_model_parallel", False):
                p.add_((torch.randn(p.shape, generator=g) * 0.2).to(p.dtype))
            if name.endswith(("word_embeddings.weight", "output_layer.weight")):
                p[padding_start(p, tp_rank) :] = 0


def build(tp: int, pp: int, ep: int, vpp: int) -> torch.nn.Module | list[torch.nn.Module]:
    """This rank's model in layout (tp, pp, ep), bf16: one module, or with vpp > 1 its model chunks."""
    if vpp == 1:
        return build_model(tp=tp, pp=pp, ep=ep, bf16=True, tied=TIED)
    assert not TIED, "a tied embedding with virtual stages is not set up here"
    return [build_model(tp=tp, pp=pp, ep=ep, bf16=True, vpp=vpp, vp_stage=v) for v in range(vpp)]


def model_entries(t: Trainable, sharded: bool = False, metadata: dict | None = None) -> dict[str, Any]:
    """The rank's model state dict(s) as Megatron-LM keys them: "model", or "model0", "model1", ... per chunk."""
    chunks = chunks_of(t)
    states = [c.sharded_state_dict(metadata=metadata) if sharded else c.state_dict() for c in chunks]
    return {"model": states[0]} if not isinstance(t.model, list) else {f"model{v}": s for v, s in enumerate(states)}


def load_models(t: Trainable, state: dict[str, Any]) -> None:
    chunks = chunks_of(t)
    for v, chunk in enumerate(chunks):
        chunk.load_state_dict(state["model" if not isinstance(t.model, list) else f"model{v}"], strict=True)


def next_step(t: Trainable, out: str, rank: int, pp: int, ep: int) -> None:
    """With UCP_DISTOPT_NEXT: one more step (another draw of gradients), its state to OUT.next.r. Each parameter's
    torch Adam `step` is first set to its param group's, as the group keeps it: megatron-core's loads without Apex
    or Transformer Engine leave it otherwise (load_state_dict gives every parameter one and the same tensor, which
    torch's Adam then increments once per parameter; the dp_reshardable load puts back the fresh optimizer's own
    step, which the form does not save); TE's FusedAdam, as Megatron-LM runs on GPUs, keeps only the groups'."""
    if not NEXT:
        return
    from megatron.core import parallel_state as ps

    for o in t.optimizer.chained_optimizers:
        for group in o.optimizer.param_groups:
            for p in group["params"] if "step" in group else ():  # (a loaded group; the saving job's are as made)
                o.optimizer.state[p]["step"] = torch.tensor(float(group["step"]))
    pp_rank, ep_rank = ps.get_pipeline_model_parallel_rank(), ps.get_expert_model_parallel_rank()
    step(t, pp_rank, ep_rank, ps.get_tensor_model_parallel_rank(), pp, ep, draw=1)
    torch.save(shards(t, pp_rank, ep_rank, pp, ep), f"{out}.next.{rank}")


def step(t: Trainable, pp_rank: int, ep_rank: int, tp_rank: int = 0, pp: int = PP, ep: int = EP, draw: int = 0) -> None:
    """One optimizer step on gradients drawn per global parameter name (and `draw`: another step's) (no forward
    pass: a pipeline needs none to fill the grad buffers, and the buffers' layout is what is tested); every DP
    rank gets the same, so DP's average is that gradient whatever the DP; the vocabulary padding rows get none, so
    they stay zero, as ucp's atoms assume."""
    for ddp in t.ddps:
        ddp.zero_grad_buffer()
    t.optimizer.zero_grad()
    for name, global_, p in named_parameters(t, pp_rank, ep_rank, pp, ep):
        # a tied output layer gets the embedding's gradient, as Megatron's all-reduce of the two makes it
        seed = sum(map(ord, EMBEDDING if TIED and name == "output_layer.weight" else global_)) + 104729 * draw
        if getattr(p, "tensor_model_parallel", False):
            seed += 7919 * tp_rank  # (a TP shard's own gradient; replicated parameters get the same on every rank)
        grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(seed))
        if name.endswith(("word_embeddings.weight", "output_layer.weight")):
            grad[padding_start(grad, tp_rank) :] = 0
        p.main_grad.copy_(grad)
    for ddp in t.ddps:
        ddp.start_grad_sync()
    for ddp in t.ddps:
        ddp.finish_grad_sync()
    assert not t.optimizer.prepare_grads() and t.optimizer.step_with_ready_grads()
    t.scheduler.step(1)


def save(rank: int, ckpt: str, out: str, torch_dist: bool) -> None:
    """One step, then the checkpoint in the torch format (rank files and distrib_optim.pt) or, with `torch_dist`,
    with dist_checkpointing in the torch_dist format, the optimizer `fully_reshardable` (gathered with gloo:
    `distrib_optim_fully_reshardable_mem_efficient`, as a job without NCCL must)."""
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps

    pp_rank, ep_rank = ps.get_pipeline_model_parallel_rank(), ps.get_expert_model_parallel_rank()
    # (megatron-core moves the tied copies to the GPU for its init all-reduce, and dp_zero_gather_scatter its
    # gathered buffers for the gather; here they stay on the CPU)
    if TIED or (torch_dist and SHARDING == "dp_zero_gather_scatter"):
        torch.Tensor.cuda = lambda self, *args, **kwargs: self
    tp_rank = ps.get_tensor_model_parallel_rank()
    model = build(TP, PP, EP, VPP)
    for chunk in model if isinstance(model, list) else [model]:
        perturb(chunk)
        if TP > 1:
            distinct_tp_shards(chunk, tp_rank)
    if TIED:
        _tie(model, pp_rank)
    t = Trainable(model, bf16=True, distributed=True, bucket_size=BUCKET)
    step(t, pp_rank, ep_rank, tp_rank)
    args = megatron_args(ep=EP, bf16=True)
    args.untie_embeddings_and_output_weights = not TIED
    args.tensor_model_parallel_size, args.pipeline_model_parallel_size = TP, PP
    args.virtual_pipeline_model_parallel_size = VPP if VPP > 1 else None
    args.padded_vocab_size = 128 * TP  # (build_model's default padding)
    args.use_distributed_optimizer = True
    args.overlap_grad_reduce = BUCKET is not None
    args.ddp_bucket_size = BUCKET
    args.accumulate_allreduce_grads_in_fp32 = True
    args.data_parallel_size = dist.get_world_size() // (TP * PP)
    iter_dir = os.path.join(ckpt, f"iter_{ITERATION:07d}")
    common = {"args": args, "checkpoint_version": 3.0, "iteration": ITERATION}
    if torch_dist:
        args.ckpt_format = "torch_dist"
        metadata = {
            "distrib_optim_sharding_type": SHARDING,
            "distrib_optim_fully_reshardable_mem_efficient": True,
        }
        os.makedirs(iter_dir, exist_ok=True)
        dist.barrier()
        model_state = model_entries(t, sharded=True)
        state = {
            **common,
            **model_state,
            "optimizer": t.optimizer.sharded_state_dict(model_state, metadata=metadata),
            "opt_param_scheduler": t.scheduler.state_dict(),
        }
        dist_checkpointing.save(state, iter_dir, sharded_strategy=("torch_dist", 1), content_metadata=metadata)
    else:
        directory = os.path.join(iter_dir, rank_dirname(tp_rank, pp_rank, ep_rank, PP, EP))
        os.makedirs(directory, exist_ok=True)
        state = {
            **common,
            **model_entries(t),
            "optimizer": t.optimizer.state_dict(),
            "opt_param_scheduler": t.scheduler.state_dict(),
        }
        if ps.get_expert_data_parallel_rank() == 0:  # (one writer per directory, as Megatron-LM's save)
            torch.save(state, os.path.join(directory, "model_optim_rng.pt"))
        t.optimizer.save_parameter_state(os.path.join(directory, "distrib_optim.pt"))  # (a collective over DP)
    dist.barrier()
    if rank == 0:
        with open(os.path.join(ckpt, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write(str(ITERATION))
    torch.save(shards(t, pp_rank, ep_rank, PP, EP), f"{out}.{rank}")
    next_step(t, out, rank, PP, EP)


def _keep_step_on_load() -> None:
    """megatron-core without Apex or Transformer Engine runs torch's Adam, which keeps the step in every parameter's
    state, and its load_parameter_state then wants a "step" from the file too, which save_parameter_state never
    writes (with TE's FusedAdam, as Megatron-LM runs on GPUs, the step lives in the param groups). Give it the step
    that load_state_dict already set."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    original = DistributedOptimizer._set_main_param_and_optimizer_states

    def with_step(self, model_param, tensors):
        current = self._get_main_param_and_optimizer_states(model_param)
        step = {"step": current["step"]} if "step" in current and "step" not in tensors else {}
        return original(self, model_param, {**tensors, **step})

    DistributedOptimizer._set_main_param_and_optimizer_states = with_step


def load(rank: int, ckpt: str, out: str) -> None:
    """CKPT's torch-format files loaded in the UCP_DISTOPT_LOAD layout as Megatron-LM loads them with
    --use-distributed-optimizer: the model strictly, the optimizer's state dict, then `load_parameter_state` of
    the rank directory's distrib_optim.pt (which scatters it over DP)."""
    from megatron.core import parallel_state as ps

    _keep_step_on_load()
    t = Trainable(build(LOAD_TP, LOAD_PP, LOAD_EP, LOAD_VPP), bf16=True, distributed=True, bucket_size=BUCKET)
    tp_rank, pp_rank = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()
    ep_rank = ps.get_expert_model_parallel_rank()
    name = rank_dirname(tp_rank, pp_rank, ep_rank, LOAD_PP, LOAD_EP)
    directory = os.path.join(ckpt, f"iter_{ITERATION:07d}", name)
    state = torch.load(os.path.join(directory, "model_optim_rng.pt"), weights_only=False)
    load_models(t, state)
    t.optimizer.load_state_dict(state["optimizer"])
    t.optimizer.load_parameter_state(os.path.join(directory, "distrib_optim.pt"))
    t.scheduler.load_state_dict(state["opt_param_scheduler"])
    result = shards(t, pp_rank, ep_rank, LOAD_PP, LOAD_EP)
    result["__lr__"] = [g["lr"] for g in t.optimizer.param_groups]
    torch.save(result, f"{out}.{rank}")
    next_step(t, out, rank, LOAD_PP, LOAD_EP)


def _fresh_state(t: Trainable) -> None:
    """Without Apex or Transformer Engine, megatron-core's DistributedOptimizer.state_dict() reads Adam's step
    from every parameter's state, which torch's Adam makes only at its first step, so a fresh optimizer cannot
    make its sharded state dict for loading (TE's FusedAdam, as Megatron-LM runs on GPUs, keeps the step in the
    param groups). Give it the state a step-0 optimizer has (megatron-core's own init_state_fn, and step 0)."""
    for o in t.optimizer.chained_optimizers:
        o.init_state_fn(o.optimizer, o.config)
        for group in o.optimizer.param_groups:
            for p in group["params"]:
                o.optimizer.state[p]["step"] = torch.tensor(0.0)


def load_dist(rank: int, ckpt: str, out: str) -> None:
    """A torch_dist checkpoint loaded as Megatron-LM loads one: the sharded state dicts made with the checkpoint's
    content_metadata, `dist_checkpointing.load`, then the model's and the optimizer's `load_state_dict`."""
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps

    _keep_step_on_load()
    t = Trainable(build(LOAD_TP, LOAD_PP, LOAD_EP, LOAD_VPP), bf16=True, distributed=True, bucket_size=BUCKET)
    iter_dir = os.path.join(ckpt, f"iter_{ITERATION:07d}")
    _fresh_state(t)
    metadata = dist_checkpointing.load_content_metadata(iter_dir)
    model_state = model_entries(t, sharded=True, metadata=metadata)
    optimizer_state = t.optimizer.sharded_state_dict(model_state, is_loading=True, metadata=metadata)
    state = dist_checkpointing.load({**model_state, "optimizer": optimizer_state}, iter_dir)
    load_models(t, state)
    t.optimizer.load_state_dict(state["optimizer"])
    if "opt_param_scheduler" in state:
        t.scheduler.load_state_dict(state["opt_param_scheduler"])
    pp_rank, ep_rank = ps.get_pipeline_model_parallel_rank(), ps.get_expert_model_parallel_rank()
    result = shards(t, pp_rank, ep_rank, LOAD_PP, LOAD_EP)
    result["__lr__"] = [g["lr"] for g in t.optimizer.param_groups]
    result["__optimizers__"] = len(t.optimizer.chained_optimizers)
    torch.save(result, f"{out}.{rank}")
    next_step(t, out, rank, LOAD_PP, LOAD_EP)


if __name__ == "__main__":
    mode, ckpt, out = sys.argv[1:4]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if mode in ("save", "save_dist"):
        setup(rank, world, tp=TP, pp=PP, ep=EP, vpp=VPP)
        save(rank, ckpt, out, torch_dist=mode == "save_dist")
    else:
        setup(rank, world, tp=LOAD_TP, pp=LOAD_PP, ep=LOAD_EP, vpp=LOAD_VPP)
        (load_dist if mode == "load_dist" else load)(rank, ckpt, out)
    dist.barrier()
    dist.destroy_process_group()
    print("ok", flush=True)
    exit_now()  # (megatron_worker.exit_now: no teardown, no process left behind)
