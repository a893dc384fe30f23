"""The training loop: set up the process groups, build this rank's stage, then step.

    torchrun --nproc-per-node 4 -m trainer --config trainer/configs/tiny-moe.yaml --layout tp2pp2 --steps 10

Every rank holds one pipeline stage of the model (trainer/model.py) with its TP and EP slices, in fp32 or (with
`train.precision: bf16`) in bf16; a step runs the stage's microbatches through the 1F1B schedule
(parallel/pipeline.py), then the distributed optimizer syncs gradients over DP, clips and updates the fp32
weights or master weights (parallel/data.py). The logged loss is the LM loss averaged over every
token of the global batch, identical in every layout.

With `--ckpt URL` the run resumes from the latest committed step under URL (in whatever layout saved it) and
saves every `--save-interval` steps and at the last step (trainer/checkpoint.py).

Each rank trains on a GPU of its own with NCCL where the node has one per local rank, else on the CPU with gloo;
`--set train.backend=gloo` on a GPU machine keeps CUDA tensors but sends collectives through host memory, so that
ranks can share a GPU (`placement`). With NCCL a ring of TCP connections notices a dead peer, which NCCL would wait
for, and aborts the survivors' communicators (trainer/peerwatch.py).

Under torchrun's elastic agent the same command runs unchanged: `--layout tp2pp2,tp2pp1,tp1pp1` lists the layouts
the job may take, and each (re)start takes the first whose world size is WORLD_SIZE. A peer that dies fails the
step at once (its connections reset) and a hung one within `train.collective_timeout_s`. With `--regroup-store` the
survivors then re-form the job among themselves and go on in place (trainer/regroup.py); otherwise the process
exits non-zero without waiting for anything, the agent re-forms the group with the nodes left (or joined), and the
new workers resume from the newest checkpoint in their layout (docs/ELASTIC.md).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import faulthandler
import gc
import json
import os
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import IO

import torch
import torch.distributed as dist

from .checkpoint import Checkpointer
from .config import Config, TrainConfig, load_config
from .corpus import DEFAULT_DIR, ensure_corpus
from .data import PretrainTokens, SyntheticTokens, TokenSource
from .model import DecoderStage, StageSpec, is_expert_param
from .parallel import collectives
from .parallel.data import DistributedAdamW
from .parallel.mesh import Layout, Mesh, parse_layout
from .parallel.pipeline import P2P, StageOutput, interleaved_one_f_one_b, one_f_one_b, split_layers
from .parallel.tensor import vocab_parallel_cross_entropy
from .peerwatch import PeerWatch, abort_collectives, reachable_address
from .profile import StepProfile
from .regroup import Regroup, incarnation
from .weights import init_from_seed


@dataclass
class StepMetrics:
    step: int
    loss: float  # mean LM loss over the global batch
    aux_loss: float  # mean load-balancing loss over layers and global microbatches
    grad_norm: float
    lr: float
    step_time_s: float


class Trainer:
    def __init__(self, cfg: Config, mesh: Mesh, device: torch.device):
        self.cfg, self.mesh, self.device = cfg, mesh, device
        m, d, layout, c = cfg.model, cfg.data, mesh.layout, mesh.coords
        if layout.ep != 1 and not m.is_moe:
            raise ValueError(
                f"layout {cfg.train.layout}: ep > 1 needs a mixture of experts, model.family is {m.family}"
            )

        # This rank's model chunks: one per stage, or with virtual stages (vpp V) chunk v of stage p is model chunk
        # v*P + p of the P*V (docs/LOCAL_STATE.md), each a DecoderStage, keyed as in the local state.
        model_chunks = layout.pp * layout.vpp
        chunk_layers = split_layers(m.num_layers, model_chunks, cfg.train.stage_layers)
        self.chunks: dict[str, DecoderStage] = {}
        for v in range(layout.vpp):
            index = v * layout.pp + c.pp
            spec = StageSpec(
                layers=chunk_layers[index],
                first=index == 0,
                last=index == model_chunks - 1,
                tp_size=layout.tp,
                ep_size=layout.ep,
                ep_rank=c.ep,
            )
            chunk = DecoderStage(m, spec, mesh.tp_group, mesh.ep_group).to(device)
            init_from_seed(chunk, cfg.train.seed, c.tp)
            chunk.to(cfg.train.dtype)  # (bf16: the optimizer keeps the fp32 masters, made from these values)
            self.chunks["model" if layout.vpp == 1 else f"model{v}"] = chunk

        named = [(key, name, p) for key, chunk in self.chunks.items() for name, p in chunk.named_parameters()]
        self.optimizer = DistributedAdamW(named, mesh, cfg.optim, m.tie_word_embeddings, is_expert_param)
        self.data: TokenSource
        if d.source == "pretrain":
            self.data = PretrainTokens(
                d.path or DEFAULT_DIR, d.seq_len, d.global_batch_size, c.dp, layout.dp, cfg.train.seed, d.shuffle
            )
        elif d.source == "synthetic":
            self.data = SyntheticTokens(m.vocab_size, d.seq_len, d.global_batch_size, c.dp, layout.dp, cfg.train.seed)
        else:
            raise ValueError(f"data.source must be 'pretrain' or 'synthetic', got {d.source!r}")

        local_batch = d.global_batch_size // layout.dp
        if local_batch % d.micro_batch_size:
            raise ValueError(f"per-DP-rank batch {local_batch} is not divisible by micro_batch_size")
        self.num_microbatches = local_batch // d.micro_batch_size
        if layout.vpp > 1 and self.num_microbatches % layout.pp:
            raise ValueError(
                f"an interleaved pipeline (vpp {layout.vpp}) needs the microbatches per DP rank "
                f"({self.num_microbatches}) to be a multiple of pp ({layout.pp})"
            )
        shape = (d.micro_batch_size, d.seq_len, m.hidden_size)
        self.p2p = P2P(mesh, shape, cfg.train.dtype, device, ring=layout.vpp > 1)
        self.profile = StepProfile()  # this rank's phases of the current step (reset by train_step)
        self.peer_watch: PeerWatch | None = None  # (NCCL: build_trainer starts one)

    def close(self) -> None:
        """Stop watching the peers (a rank that ends, or re-forms the job, must not be taken for a dead one)."""
        if self.peer_watch is not None:
            self.peer_watch.stop()
            self.peer_watch = None

    def local_state(self) -> dict:
        """This rank's model and optimizer state in the form of docs/LOCAL_STATE.md (live tensors, not copies)."""
        state: dict = {key: {n: p.detach() for n, p in chunk.named_parameters()} for key, chunk in self.chunks.items()}
        return state | {"optimizer": self.optimizer.state_dict()}

    @torch.no_grad()
    def load_local_state(self, state: dict) -> None:
        """Load a local state saved in any precision (master weights, where it has them, set the parameters)."""
        for key, chunk in self.chunks.items():
            for name, p in chunk.named_parameters():
                p.copy_(state[key][name])
        self.optimizer.load_state_dict(state["optimizer"], {key: state[key] for key in self.chunks})

    def train_step(self, step: int, before_update: Callable[[], None] | None = None) -> StepMetrics:
        start = time.perf_counter()
        m, d = self.cfg.model, self.cfg.data
        self.profile.reset()
        with self.profile.phase("data"):
            microbatches = self.data.get_batch(step).to(self.device).split(d.micro_batch_size)
        # The loss is the global mean over tokens plus the load-balancing loss averaged over (layer, global
        # microbatch): every microbatch adds its share, so summed gradients are those of the global loss.
        global_tokens = d.global_batch_size * d.seq_len
        aux_terms = d.global_batch_size // d.micro_batch_size * m.num_layers  # (global microbatch, layer) pairs
        aux_weight = m.router_aux_loss_coef / aux_terms
        tally = torch.zeros(2, dtype=torch.float64, device=self.device)  # [LM loss sum, aux loss sum]

        chunks = list(self.chunks.values())

        def forward_step(v: int, i: int, x: torch.Tensor | None) -> StageOutput:
            """Microbatch i through model chunk v of this rank."""
            tokens, chunk = microbatches[i], chunks[v]
            out, aux = chunk(tokens[:, :-1] if chunk.spec.first else x)
            tally[1] += aux.detach().double()
            objective = aux * aux_weight
            if not chunk.spec.last:
                return StageOutput(out, objective)
            lm_sum = vocab_parallel_cross_entropy(out, tokens[:, 1:], m.vocab_size, self.mesh.tp_group).sum()
            tally[0] += lm_sum.detach().double()
            return StageOutput(None, objective + lm_sum / global_tokens)

        self.optimizer.zero_grad()
        stage, stages = self.mesh.coords.pp, self.mesh.layout.pp
        if len(chunks) == 1:
            one_f_one_b(self.num_microbatches, partial(forward_step, 0), self.p2p, stage, stages, self.profile)
        else:
            interleaved_one_f_one_b(
                self.num_microbatches, forward_step, self.p2p, stage, stages, len(chunks), self.profile
            )
        if before_update is not None:
            with self.profile.phase("checkpoint"):
                before_update()
        with self.profile.phase("optimizer"):
            grad_norm, lr = self.optimizer.step_()

        # TP ranks hold copies of the same sums: count TP rank 0 only, over all stages and DP ranks.
        if self.mesh.coords.tp != 0:
            tally.zero_()
        if dist.get_world_size() > 1:
            collectives.all_reduce(tally)
        self.profile.step_s = time.perf_counter() - start
        return StepMetrics(
            step=step,
            loss=tally[0].item() / global_tokens,
            aux_loss=tally[1].item() / aux_terms,
            grad_norm=grad_norm,
            lr=lr,
            step_time_s=self.profile.step_s,
        )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m trainer", description="ucp's reference MoE trainer")
    parser.add_argument("--config", help="YAML config file (trainer/configs/*.yaml)")
    parser.add_argument(
        "--layout",
        help="e.g. tp2pp2, tp1pp1ep2dp2, tp1pp2dp2zero1, tp1pp2vpp2, or a comma-separated list: the "
        "first whose world size is WORLD_SIZE is taken (overrides train.layout)",
    )
    parser.add_argument("--steps", type=int, help="the step to stop at (overrides train.steps)")
    parser.add_argument("--seed", type=int, help="overrides train.seed")
    parser.add_argument("--metrics-file", help="JSON lines, one per step (overrides train.metrics_file)")
    parser.add_argument(
        "--ckpt",
        help="checkpoint root URL (local dir, s3://...): resume from its latest step, "
        "save to it (overrides checkpoint.url)",
    )
    parser.add_argument(
        "--save-interval",
        type=int,
        help="save every K steps; the last step is always saved (overrides checkpoint.interval)",
    )
    parser.add_argument("--ckpt-mode", choices=("sync", "async", "lazy"), help="overrides checkpoint.mode")
    parser.add_argument(
        "--ckpt-local",
        help="this node's directory for a hot tier of recent steps, e.g. /dev/shm/ucp (overrides checkpoint.local)",
    )
    parser.add_argument(
        "--durable-every",
        type=int,
        help="with --ckpt-local: drain every K-th save and the last to --ckpt (overrides checkpoint.durable_every)",
    )
    parser.add_argument(
        "--regroup-store",
        metavar="HOST:PORT",
        help="a store that outlives any lost node (torchrun's --rdzv-endpoint): survivors of a lost peer re-form "
        "the job in place instead of exiting for a restart (overrides train.regroup_store)",
    )
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override any config key, e.g. --set model.hidden_size=128 (repeatable)",
    )
    return parser.parse_args(argv)


def build_config(args: argparse.Namespace) -> Config:
    overrides = list(args.overrides)
    for key, value in (
        ("layout", args.layout),
        ("steps", args.steps),
        ("seed", args.seed),
        ("metrics_file", args.metrics_file),
        ("regroup_store", args.regroup_store),
    ):
        if value is not None:  # (a string flag as a JSON string, which YAML reads as the same string: `--ckpt 2024`)
            overrides.append(f"train.{key}={json.dumps(value)}")
    for key, value in (
        ("url", args.ckpt),
        ("interval", args.save_interval),
        ("mode", args.ckpt_mode),
        ("local", args.ckpt_local),
        ("durable_every", args.durable_every),
    ):
        if value is not None:
            overrides.append(f"checkpoint.{key}={json.dumps(value)}")
    return load_config(args.config, overrides)


def placement(train: TrainConfig, local_rank: int, local_world: int, gpus: int) -> tuple[torch.device, str]:
    """The device this rank trains on and the backend of its collectives, from `train.device` and `train.backend`
    (trainer/config.py), its LOCAL_RANK, the node's process count and the GPUs it sees."""
    device, backend = train.device, train.backend
    if device == "auto":  # the GPUs where there are any and a backend is asked for, or one per local rank
        device = "cuda" if gpus and (backend != "auto" or local_world <= gpus) else "cpu"
    if device == "cpu":
        if backend == "nccl":
            raise ValueError("train.backend=nccl needs GPUs (train.device=cuda); on the CPU it is gloo")
        return torch.device("cpu"), "gloo"
    if not gpus:
        raise ValueError("train.device=cuda, but torch sees no GPU")
    backend = "nccl" if backend == "auto" else backend
    if backend == "nccl" and local_world > gpus:
        raise ValueError(
            f"{local_world} ranks on this node but {gpus} GPUs: NCCL needs a GPU per rank "
            "(train.backend=gloo lets ranks share GPUs)"
        )
    return torch.device("cuda", local_rank % gpus), backend


def init_distributed(train: TrainConfig, group: tuple[int, int, dist.Store] | None = None) -> tuple[torch.device, str]:
    """Join the process group torchrun describes, or `group` (rank, world size, store: a re-formed job), or a
    group of one without torchrun, on this rank's device and backend (`placement`). Every group made later (the
    checkpoint's included) inherits `train.collective_timeout_s`."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    device, backend = placement(train, int(os.environ.get("LOCAL_RANK", "0")), local_world, gpus)
    if train.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # (cuBLAS repeats bit for bit only with it)
        torch.use_deterministic_algorithms(True)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    timeout = datetime.timedelta(seconds=train.collective_timeout_s)
    if group is not None:
        rank, world_size, store = group
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
    elif "WORLD_SIZE" in os.environ:
        dist.init_process_group(backend, timeout=timeout)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    return device, backend


def watch_peers() -> PeerWatch:
    """Join the ring that aborts this rank's NCCL collectives when a peer dies (trainer/peerwatch.py); every rank
    calls it together, once the process group is formed."""
    token = [os.urandom(8).hex() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(token)  # (a key of the store no earlier ring used)
    return PeerWatch(
        dist.distributed_c10d._get_default_store(),
        f"ucp/peerwatch/{token[0]}",
        dist.get_rank(),
        dist.get_world_size(),
        reachable_address(os.environ.get("MASTER_ADDR", "127.0.0.1")),
        abort_collectives,
    )


def choose_layout(layouts: str, world_size: int) -> Layout:
    """The first of the comma-separated `layouts` whose world size is `world_size`."""
    candidates = [parse_layout(name.strip()) for name in str(layouts).split(",") if name.strip()]
    for layout in candidates:
        if layout.world_size == world_size:
            return layout
    sizes = ", ".join(f"{layout} ({layout.world_size})" for layout in candidates)
    raise ValueError(f"none of the layouts {sizes} runs on {world_size} processes: add one to --layout")


def build_trainer(cfg: Config, group: tuple[int, int, dist.Store] | None = None) -> Trainer:
    """Join the process group (torchrun's, or `group`: see init_distributed) and build this rank's trainer
    (weights initialized from the seed)."""
    device, backend = init_distributed(cfg.train, group)
    layout = choose_layout(cfg.train.layout, dist.get_world_size())
    mesh = Mesh(layout, dist.get_rank())
    if cfg.data.source == "pretrain" and cfg.data.path is None and int(os.environ.get("LOCAL_RANK", "0")) == 0:
        ensure_corpus()  # the built-in corpus, prepared once per machine (the barrier makes the others wait)
    dist.barrier()  # every communicator exists before the first send/recv (NCCL wants that)
    trainer = Trainer(cfg, mesh, device)
    if backend == "nccl" and dist.get_world_size() > 1:
        trainer.peer_watch = watch_peers()
    return trainer


def train(trainer: Trainer, started: float | None = None, regrouped: int = 0) -> None:
    """Resume from the latest checkpoint (with --ckpt), then train up to cfg.train.steps; rank 0 logs metrics.

    `started` (a perf_counter value, default now) is when the process began, or `regrouped` (the how-manieth) the
    job was re-formed in place, for the resume's time to first step.
    """
    started = time.perf_counter() if started is None else started
    cfg, rank = trainer.cfg, trainer.mesh.rank
    checkpointer = Checkpointer(cfg, trainer) if cfg.checkpoint.url else None
    resumed = checkpointer.restore() if checkpointer else None
    write_metrics = cfg.train.metrics_file is not None and rank == 0
    last_logged = last_logged_step_time(cfg.train.metrics_file) if write_metrics else None
    restart_count = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if rank == 0:
        print(
            f"world size {dist.get_world_size()}: layout {trainer.mesh.layout}"
            + (f" (restart {restart_count})" if restart_count else ""),
            flush=True,
        )

    def log(record: dict) -> None:
        if metrics_file is not None:
            metrics_file.write(json.dumps(record) + "\n")
            metrics_file.flush()

    with open_metrics(cfg.train.metrics_file) if write_metrics else contextlib.nullcontext() as metrics_file:
        try:
            for step in range(trainer.optimizer.step + 1, cfg.train.steps + 1):
                metrics = trainer.train_step(step, checkpointer.before_update if checkpointer else None)
                with trainer.profile.phase("checkpoint"):
                    event = checkpointer.after_step(step) if checkpointer else None
                ranks = trainer.profile.gather(trainer.mesh.coords, trainer.device)  # (every rank: a collective)
                if rank != 0:
                    continue
                if resumed is not None and step == resumed.from_step + 1:
                    resume = {
                        "from_step": resumed.from_step,
                        "saved_layout": resumed.saved_layout,
                        "layout": str(trainer.mesh.layout),
                        "world_size": dist.get_world_size(),
                        "bytes_read": resumed.bytes_read,
                        "source": resumed.source,
                        "bytes_by_tier": resumed.bytes_by_tier,
                        "restore_s": resumed.restore_s,
                        "time_to_first_step_s": time.perf_counter() - started,
                        "time": time.time(),
                    }
                    log({"event": "resume", **resume})
                    if last_logged is not None:  # an earlier incarnation of this run logged steps: a restart
                        # (the failure came after that incarnation's last logged step: an upper bound)
                        log(
                            {
                                "event": "restart",
                                **resume,
                                "restart_count": restart_count,
                                "in_place": regrouped > 0,
                                "failure_to_first_step_s": time.time() - last_logged[1],
                                "last_step_before": last_logged[0],
                            }
                        )
                    print(f"resumed from step {resumed.from_step} (saved in {resumed.saved_layout})", flush=True)
                log(
                    asdict(metrics)
                    | {"layout": str(trainer.mesh.layout), "world_size": dist.get_world_size(), "time": time.time()}
                    | {"ranks": ranks}
                )
                if event is not None:
                    log(event)
                if step % cfg.train.log_every == 0:
                    print(
                        f"step {step} loss {metrics.loss:.6f} aux {metrics.aux_loss:.4f} "
                        f"grad_norm {metrics.grad_norm:.4f} lr {metrics.lr:.2e} {metrics.step_time_s:.3f}s"
                        + (f" ckpt blocked {event['blocking_s']:.3f}s" if event else ""),
                        flush=True,
                    )
        except BaseException:
            if checkpointer is not None:
                checkpointer.abandon()  # (never waits: the save in flight may need the lost peer)
            raise
        finally:
            close = getattr(trainer.data, "close", None)
            if close is not None:
                close()
        # Only a run that got here waits for its last save to commit. After a failure (a peer may be gone, and the
        # wait could last a collective timeout) the save in flight stays uncommitted; the next job collects it.
        if checkpointer is not None:
            checkpointer.close()


def open_metrics(metrics_file: str) -> IO[str]:
    """The metrics file, opened to append to; its directory is made if missing (`--metrics-file run1/metrics.jsonl`
    of a fresh run: the checkpoint root beside it appears only at the first commit)."""
    Path(metrics_file).parent.mkdir(parents=True, exist_ok=True)
    return open(metrics_file, "a")


def last_logged_step_time(metrics_file: str) -> tuple[int, float] | None:
    """(step, wall time) of the last step an earlier incarnation of this run logged, if any."""
    try:
        with open(metrics_file) as f:
            lines = f.read().splitlines()
    except FileNotFoundError:
        return None
    for line in reversed(lines):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # (a line cut short when that incarnation was killed)
        if "event" not in record and "time" in record:
            return record["step"], record["time"]
    return None


def main(argv: list[str] | None = None, started: float | None = None) -> None:
    """`started`: a perf_counter value taken when the process began (default: now)."""
    started = time.perf_counter() if started is None else started
    args = parse_args(argv)
    try:
        cfg = build_config(args)
    except ValueError as e:  # a wrong config or setting: one line, as for the ucp commands
        raise SystemExit(f"trainer: {e}") from None
    try:
        try:
            trainer = build_trainer(cfg)
        except ValueError as e:  # a layout that the job or the model cannot take: one line (each rank says it)
            raise SystemExit(f"trainer: {e}") from None
        regroup = None
        if cfg.train.regroup_store and dist.get_world_size() > 1:
            regroup = Regroup(
                cfg.train.regroup_store,
                dist.get_rank(),
                dist.get_world_size(),
                cfg.train.collective_timeout_s,
                incarnation=incarnation(),
            )
        while True:
            try:
                train(trainer, started, regroup.generation if regroup else 0)
                trainer.close()
                return
            except Exception:
                if regroup is None:
                    raise
                traceback.print_exc()  # what failed, before the job goes on without the lost peer
            # Out of the handler, the failure's traceback (whose frames hold the old groups) is gone. The groups must
            # be freed, not only destroyed: a gloo group's connections close when its last reference goes, and only
            # then does a survivor still blocked on one of them (say, in a TP all-reduce with this process) fail,
            # rather than at its collective timeout (measured: at once, against the whole timeout with a reference left).
            started = time.perf_counter()
            faulthandler.dump_traceback_later(10)  # a regroup that hangs says where
            trainer.close()
            del trainer
            if dist.is_initialized():  # (not after the peer watch aborted the groups: they are gone)
                dist.destroy_process_group()
            gc.collect()
            group = regroup.survivors()  # (a RegroupError ends the process: the agent restarts it)
            faulthandler.cancel_dump_traceback_later()
            print(
                f"re-forming the job in place: rank {group[0]} of {group[1]} "
                f"({time.perf_counter() - started:.2f} s after the failure)",
                flush=True,
            )
            trainer = build_trainer(cfg, group)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
