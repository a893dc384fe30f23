"""Megatron-Core on CPU as the oracle of Megatron's torch_dist format (tests/test_megatron_dist.py): the tiny GPT
MoE model of megatron_worker.py, saved and loaded with megatron-core's own `dist_checkpointing`.

    python tests/megatron_dist_worker.py save TP PP CKPT             as the TP*PP ranks of a world
    python tests/megatron_dist_worker.py load TP PP OUT CKPT...       as the TP*PP ranks of a world
    python tests/megatron_dist_worker.py resave TP PP SRC DST         as the TP*PP ranks of a world

save: random weights, then CKPT/iter_0000010 as Megatron-LM's save_checkpoint writes it with --ckpt-format torch_dist
      (the model's sharded state dict; args, iteration and checkpoint_version in the common state) and its tracker;
      with UCP_MEGATRON_BARE=1 also CKPT-bare, the same model as `dist_checkpointing.save` alone writes it.
load: for each CKPT, a fresh model in layout TP PP loads it with `dist_checkpointing.load` (torch_dist, strict as
      Megatron-LM's default: a missing key is an error) and rank r writes its parameters to OUT.r as a list,
      one dict of name -> tensor per CKPT; a checkpoint in Megatron's legacy torch format (mp_rank_* files) is
      loaded the legacy way instead (`load_state_dict`, strict).
resave: Megatron's own way from a torch_dist checkpoint to torch-format files of a layout: load SRC in layout
      TP PP with `dist_checkpointing.load`, then save the rank files at DST as save_checkpoint does with
      --ckpt-format torch; rank 0 prints {"load_s", "save_s"} (scripts/megatron_dist_bench.py).

UCP_MEGATRON_SHAPE="hidden,ffn,layers,experts,heads,kv" sizes the model (default: the tiny test model).
The vocabulary (100) is padded as Megatron-LM pads it, to a multiple of make_vocab_size_divisible_by * TP: 128 rows
at TP 1 and 2 alike with 64 (the default); UCP_MEGATRON_DIVISIBLE_BY sets another divisor (8: 104 rows at TP 1, 112
at TP 2: megatron-core loads the embedding and output layer of another padding, `allow_shape_mismatch`).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.megatron_worker import (  # (sized by UCP_MEGATRON_SHAPE when set)
    ITERATION,
    V,
    exit_now,
    megatron_args,
    setup,
)
from tests.megatron_worker import build_model as test_model

DIVISIBLE_BY = int(os.environ.get("UCP_MEGATRON_DIVISIBLE_BY", "64"))


def padded(tp: int) -> int:
    """The vocabulary rows at `tp`, as Megatron-LM pads them."""
    return -(-V // (DIVISIBLE_BY * tp)) * DIVISIBLE_BY * tp


# UCP_MEGATRON_KIND names another model kind of megatron_order_worker.build (e.g. DeepSeek-V3's MLA; TP only, the
# vocabulary padded as at 128), UCP_MEGATRON_CONFIG its ucp family config as JSON (for its Megatron args).
KIND = os.environ.get("UCP_MEGATRON_KIND")
# UCP_MEGATRON_BARE=1: save also writes CKPT-bare, the model saved with megatron-core's dist_checkpointing alone
BARE = os.environ.get("UCP_MEGATRON_BARE") == "1"


def build_model(tp: int, pp: int) -> torch.nn.Module:
    if KIND is not None:
        from tests.megatron_order_worker import build

        assert pp == 1, "another model kind runs in TP only"
        return build(KIND, tp)
    return test_model(tp=tp, pp=pp, vocab_size=padded(tp))


def args_for(tp: int, pp: int) -> argparse.Namespace:
    if KIND is not None:
        import json

        from ucp.interop.megatron.args import args_for as ucp_args_for
        from ucp.sharding.families import FAMILIES
        from ucp.sharding.layout import parse_layout

        doc = json.loads(os.environ["UCP_MEGATRON_CONFIG"])
        config = FAMILIES[doc.pop("family")].config_cls.from_json(doc)
        args = ucp_args_for(config, parse_layout(f"tp{tp}pp{pp}"))
    else:
        args = megatron_args()
        args.padded_vocab_size, args.make_vocab_size_divisible_by = padded(tp), DIVISIBLE_BY
    args.tensor_model_parallel_size, args.pipeline_model_parallel_size = tp, pp
    args.ckpt_format = "torch_dist"
    return args


def save(tp: int, pp: int, ckpt: str) -> None:
    from megatron.core import dist_checkpointing, parallel_state

    model = build_model(tp, pp)
    torch.manual_seed(100 + dist.get_rank())
    with torch.no_grad():
        for _, p in model.named_parameters():
            p.add_(torch.randn_like(p) * 0.2)
        # the vocabulary's padding rows stay zero, as ucp's atoms assume (this rank holds rows start.. of them)
        vocab = [model.embedding.word_embeddings.weight] if model.pre_process else []
        for w in vocab + ([model.output_layer.weight] if model.post_process else []):
            start = parallel_state.get_tensor_model_parallel_rank() * w.shape[0]
            w[max(0, V - start) :] = 0
    iter_dir = os.path.join(ckpt, f"iter_{ITERATION:07d}")
    if dist.get_rank() == 0:
        os.makedirs(iter_dir)
    dist.barrier()
    state = {
        "args": args_for(tp, pp),
        "checkpoint_version": 3.0,
        "iteration": ITERATION,
        "model": model.sharded_state_dict(),
    }
    dist_checkpointing.save(state, iter_dir, sharded_strategy=("torch_dist", 1))
    if dist.get_rank() == 0:
        with open(os.path.join(ckpt, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write(str(ITERATION))
    if BARE:  # the same model saved by dist_checkpointing alone, without Megatron-LM's args, tracker or iteration
        bare = ckpt + "-bare"
        if dist.get_rank() == 0:
            os.makedirs(bare)
        dist.barrier()
        dist_checkpointing.save({"model": model.sharded_state_dict()}, bare, sharded_strategy=("torch_dist", 1))


def load(tp: int, pp: int, out: str, ckpts: list[str]) -> None:
    from megatron.core import dist_checkpointing

    results = []
    for ckpt in ckpts:
        model = build_model(tp, pp)
        with open(os.path.join(ckpt, "latest_checkpointed_iteration.txt")) as f:
            iteration = int(f.read())
        iter_dir = os.path.join(ckpt, f"iter_{iteration:07d}")
        if os.path.exists(os.path.join(iter_dir, "metadata.json")):
            loaded = dist_checkpointing.load({"model": model.sharded_state_dict()}, iter_dir)
            model.load_state_dict(loaded["model"], strict=True)
        else:
            name = f"mp_rank_{dist.get_rank() % tp:02d}" + (f"_{dist.get_rank() // tp:03d}" if pp > 1 else "")
            state = torch.load(os.path.join(iter_dir, name, "model_optim_rng.pt"), weights_only=False)
            model.load_state_dict(state["model"], strict=True)
        results.append({n: p.detach().clone() for n, p in model.named_parameters()})
    torch.save(results, f"{out}.{dist.get_rank()}")


def resave(tp: int, pp: int, src: str, dst: str) -> None:
    import json
    import time

    from megatron.core import dist_checkpointing

    model = build_model(tp, pp)
    t0 = time.perf_counter()
    loaded = dist_checkpointing.load({"model": model.sharded_state_dict()}, os.path.join(src, f"iter_{ITERATION:07d}"))
    model.load_state_dict(loaded["model"], strict=True)
    del loaded
    dist.barrier()
    t1 = time.perf_counter()
    rank = dist.get_rank()
    name = f"mp_rank_{rank % tp:02d}" + (f"_{rank // tp:03d}" if pp > 1 else "")
    path = os.path.join(dst, f"iter_{ITERATION:07d}", name, "model_optim_rng.pt")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    args = args_for(tp, pp)
    args.ckpt_format = "torch"
    torch.save({"args": args, "checkpoint_version": 3.0, "iteration": ITERATION, "model": model.state_dict()}, path)
    dist.barrier()
    t2 = time.perf_counter()
    import resource

    rss = torch.tensor([float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)], dtype=torch.float64)
    peaks = [torch.zeros_like(rss) for _ in range(dist.get_world_size())]
    dist.all_gather(peaks, rss)
    if rank == 0:
        with open(os.path.join(dst, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write(str(ITERATION))
        rss_bytes = [int(p.item()) for p in peaks]
        print(json.dumps({"load_s": t1 - t0, "save_s": t2 - t1, "peak_rss_bytes": rss_bytes}), flush=True)


if __name__ == "__main__":
    mode, tp, pp = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    setup(rank, world, tp=tp, pp=pp)
    try:
        if mode == "save":
            save(tp, pp, sys.argv[4])
        elif mode == "resave":
            resave(tp, pp, sys.argv[4], sys.argv[5])
        else:
            load(tp, pp, sys.argv[4], sys.argv[5:])
        dist.barrier()
    finally:
        dist.destroy_process_group()
    print("ok", flush=True)
    exit_now()  # (megatron_worker.exit_now: no teardown, no process left behind)
