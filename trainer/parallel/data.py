"""Data parallelism: gradient all-reduce, global gradient-norm clipping, and AdamW with ZeRO-1 flat buffers.

Parameters fall in two groups (docs/LOCAL_STATE.md): "dense" (everything but the experts), replicated over the
DP group, and "expert", replicated over the expert-data-parallel group (D/E members). Each group's local
parameters are laid out end to end, in local-state order, in one flat fp32 buffer padded to a multiple of the
group size; with ZeRO-1 each member owns one contiguous range of it and keeps AdamW's exp_avg and exp_avg_sq
for that range only. Without ZeRO every rank owns the whole buffer.

Gradients accumulate in fp32 in the flat buffer itself (each parameter's gradient is added there as soon as a
backward pass has produced it, as Megatron's main_grad does), whatever the parameters' dtype. With bf16
parameters (`train.precision: bf16`) the optimizer also keeps fp32 master weights of the range it owns, as
Megatron's distributed optimizer does: AdamW updates the masters, and the parameters are their bf16 copies.
A step:

  1. all-reduce the flat gradients over the group (every member then holds the full sum), after summing the
     two copies of tied embeddings over the first and last pipeline stages;
  2. compute the global gradient norm over all ranks, every element counted once, and clip;
  3. AdamW on the owned range (of the masters, or of the fp32 parameters themselves);
  4. all-gather the owned ranges (ZeRO) and copy the flat result back into the parameters.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..config import OptimConfig
from . import collectives
from .mesh import Mesh, group_rank, group_size

STATE_NAMES = ("exp_avg", "exp_avg_sq")
MASTER = "master"  # the fp32 master weights, under ucp's name for them (also Megatron interop's)


def lr_at(step: int, cfg: OptimConfig) -> float:
    """Linear warmup to cfg.lr over warmup_steps, then cosine decay to min_lr at decay_steps (steps from 1)."""
    if step <= cfg.warmup_steps:
        return cfg.lr * step / max(cfg.warmup_steps, 1)
    progress = min(1.0, (step - cfg.warmup_steps) / max(cfg.decay_steps - cfg.warmup_steps, 1))
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1.0 + math.cos(math.pi * progress))


# Local parameters by model chunk ("model", or "model0", "model1", ... with virtual pipeline stages), then name:
# the nesting of the local state (docs/LOCAL_STATE.md).
Chunks = dict[str, dict[str, torch.Tensor]]


@dataclass
class Entry:
    """Where one local parameter lies in its flat buffer."""

    chunk: str
    name: str
    param: torch.nn.Parameter
    offset: int
    numel: int


class FlatBuffer:
    """One parameter group's flat layout and, for the range this rank owns, its optimizer state."""

    def __init__(self, named_params: list[tuple[str, str, torch.nn.Parameter]], group, zero: int, masters: bool):
        self.group, self.zero = group, zero
        self.size = group_size(group)
        self.entries: list[Entry] = []
        offset = 0
        for chunk, name, param in named_params:
            self.entries.append(Entry(chunk, name, param, offset, param.numel()))
            offset += param.numel()
        self.numel = offset
        self.padded = -(-offset // self.size) * self.size
        if zero:
            shard = self.padded // self.size
            self.start = group_rank(group) * shard
            self.end = self.start + shard
        else:
            self.start, self.end = 0, self.padded
        device = named_params[0][2].device if named_params else torch.device("cpu")
        # 1 where decoupled weight decay applies (matrices), 0 for norm weights.
        mask = torch.zeros(self.padded, device=device)
        for e in self.entries:
            if e.param.dim() >= 2:
                mask[e.offset : e.offset + e.numel] = 1.0
        self.decay_mask = mask[self.start : self.end]
        self.state = {name: torch.zeros(self.end - self.start, device=device) for name in STATE_NAMES}
        self.grad = torch.zeros(self.padded, device=device)
        # fp32 master weights of the owned range where the parameters are of lower precision; None where they are
        # fp32 and serve as their own masters.
        self.master: torch.Tensor | None = None
        if masters:
            self.master = self.owned(self.flatten(lambda e: e.param.detach())).clone()
        for e in self.entries:
            e.param.register_post_accumulate_grad_hook(self._accumulate_into(e))

    def _accumulate_into(self, e: Entry):
        def hook(param: torch.Tensor) -> None:
            self.grad_of(e).add_(param.grad.flatten())
            param.grad = None

        return hook

    def zero_grad(self) -> None:
        self.grad.zero_()

    def allreduce_grads(self) -> None:
        """Sum the flat gradients over the group."""
        if self.size > 1:
            collectives.all_reduce(self.grad, group=self.group)

    def grad_of(self, entry: Entry) -> torch.Tensor:
        return self.grad[entry.offset : entry.offset + entry.numel]

    def flatten(self, value_of: Callable[[Entry], torch.Tensor]) -> torch.Tensor:
        """A value per parameter of the group (the parameter itself, or one shaped like it), end to end in fp32."""
        flat = torch.zeros(self.padded, device=self.grad.device)
        for e in self.entries:
            flat[e.offset : e.offset + e.numel].copy_(value_of(e).flatten())
        return flat

    def owned(self, flat: torch.Tensor) -> torch.Tensor:
        return flat[self.start : self.end]

    @torch.no_grad()
    def publish(self, owned: torch.Tensor) -> None:
        """Set the parameters from the owned range of their fp32 values (all-gathered over the group with ZeRO),
        cast to the parameters' dtype."""
        flat = owned
        if self.zero and self.size > 1:
            flat = torch.empty(self.padded, device=owned.device)
            collectives.all_gather_into_tensor(flat, owned.contiguous(), group=self.group)
        for e in self.entries:
            e.param.copy_(flat[e.offset : e.offset + e.numel].view_as(e.param))

    @torch.no_grad()
    def adamw(self, step: int, lr: float, cfg: OptimConfig) -> None:
        if self.master is not None:
            p = self.master
        else:
            p = self.owned(self.flatten(lambda e: e.param.detach()))
        g = self.owned(self.grad)
        m, v = self.state["exp_avg"], self.state["exp_avg_sq"]
        p.mul_(1.0 - lr * cfg.weight_decay * self.decay_mask)
        m.mul_(cfg.beta1).add_(g, alpha=1.0 - cfg.beta1)
        v.mul_(cfg.beta2).addcmul_(g, g, value=1.0 - cfg.beta2)
        denom = (v.sqrt() / math.sqrt(1.0 - cfg.beta2**step)).add_(cfg.eps)
        p.addcdiv_(m, denom, value=-lr / (1.0 - cfg.beta1**step))
        self.publish(p)

    def states(self) -> dict[str, torch.Tensor]:
        """The owned range of every per-element state: Adam's, and the master weights where there are any."""
        return {**self.state, MASTER: self.master} if self.master is not None else dict(self.state)


def _counted_once(name: str, mesh: Mesh, tied: bool) -> bool:
    """Whether this rank counts a dense parameter in the gradient norm: TP-replicated parameters (norms,
    router) only on TP rank 0; the last stage's copy of tied embeddings not at all (the first stage has it)."""
    if ("layernorm" in name or name.endswith("router.weight")) and mesh.coords.tp != 0:
        return False
    return not (tied and name == "output_layer.weight")


class DistributedAdamW:
    """AdamW over the flat "dense" and "expert" buffers (ZeRO-1 when layout.zero >= 1), with fp32 master weights
    when the parameters are not fp32. `named_params`: (model chunk, local name, parameter) in local-state order."""

    def __init__(
        self,
        named_params: list[tuple[str, str, torch.nn.Parameter]],
        mesh: Mesh,
        cfg: OptimConfig,
        tied_embeddings: bool,
        is_expert,
    ):
        zero = mesh.layout.zero
        if zero > 1:
            raise ValueError(
                f"the reference trainer runs zero0 and zero1, not zero{zero} (ucp checkpoints hold ZeRO 0-3)"
            )
        self.mesh, self.cfg, self.tied = mesh, cfg, tied_embeddings
        self.step = 0
        self.mixed = any(p.dtype != torch.float32 for _, _, p in named_params)
        self.chunks = list(dict.fromkeys(chunk for chunk, _, _ in named_params))
        dense = [(c, n, p) for c, n, p in named_params if not is_expert(n)]
        expert = [(c, n, p) for c, n, p in named_params if is_expert(n)]
        self.buffers = {
            "dense": FlatBuffer(dense, mesh.dp_group, zero, self.mixed),
            "expert": FlatBuffer(expert, mesh.expert_dp_group, zero, self.mixed),
        }

    def zero_grad(self) -> None:
        for buffer in self.buffers.values():
            buffer.zero_grad()

    def grad_of(self, chunk: str, name: str) -> torch.Tensor:
        """The accumulated fp32 gradient of local parameter `name` of model chunk `chunk`."""
        buffer, e = self._entry(chunk, name)
        return buffer.grad_of(e)

    def grad_norm(self) -> float:
        """Global L2 norm of the gradient of the whole model, every element counted once over all ranks."""
        dense, expert = self.buffers["dense"], self.buffers["expert"]
        counted = [dense.grad_of(e) for e in dense.entries if _counted_once(e.name, self.mesh, self.tied)]
        sums = torch.stack([torch.cat(counted).double().pow(2).sum(), expert.grad.double().pow(2).sum()])
        if dist.get_world_size() > 1:
            collectives.all_reduce(sums)
        # Every dense element has D replicas in the world, every expert element D/E.
        layout = self.mesh.layout
        return math.sqrt(sums[0].item() / layout.dp + sums[1].item() / (layout.dp // layout.ep))

    def _allreduce_tied_embedding_grads(self) -> None:
        """With tied embeddings over P > 1 stages, the first stage's embedding and the last stage's output layer
        are two copies of one tensor: both get the sum of their gradients, so they stay equal."""
        if not self.tied or self.mesh.embedding_group is None:
            return
        if self.mesh.is_first_stage:  # (in its first model chunk)
            grad = self.grad_of(self.chunks[0], "embedding.word_embeddings.weight")
        elif self.mesh.is_last_stage:  # (in its last model chunk)
            grad = self.grad_of(self.chunks[-1], "output_layer.weight")
        else:
            return
        collectives.all_reduce(grad, group=self.mesh.embedding_group)

    def step_(self) -> tuple[float, float]:
        """One optimizer step from the gradients accumulated since `zero_grad`; returns (grad_norm, lr)."""
        self._allreduce_tied_embedding_grads()
        for buffer in self.buffers.values():
            buffer.allreduce_grads()
        norm = self.grad_norm()
        if self.cfg.grad_clip > 0 and norm > self.cfg.grad_clip:
            for buffer in self.buffers.values():
                buffer.grad.mul_(self.cfg.grad_clip / (norm + 1e-6))
        self.step += 1
        lr = lr_at(self.step, self.cfg)
        for buffer in self.buffers.values():
            buffer.adamw(self.step, lr, self.cfg)
        return norm, lr

    # --- access by local name, and the local state of docs/LOCAL_STATE.md ---------------------------------

    def _entry(self, chunk: str, name: str) -> tuple[FlatBuffer, Entry]:
        for buffer in self.buffers.values():
            for e in buffer.entries:
                if e.chunk == chunk and e.name == name:
                    return buffer, e
        raise KeyError(f"{chunk}/{name}")

    def param_state(self, chunk: str, name: str) -> dict[str, torch.Tensor]:
        """The state of local parameter `name` that this rank owns (Adam's, and its master weights where there are
        any): full-shaped tensors without ZeRO; with ZeRO the 1-D piece of the owned range that falls inside the
        parameter (possibly empty), plus "offset" (0-d int64: where that piece starts inside the flattened
        parameter)."""
        buffer, e = self._entry(chunk, name)
        lo, hi = max(e.offset, buffer.start), min(e.offset + e.numel, buffer.end)
        hi = max(lo, hi)
        out = {s: t[lo - buffer.start : hi - buffer.start] for s, t in buffer.states().items()}
        if not buffer.zero:
            out = {s: t.view_as(e.param) for s, t in out.items()}
        else:
            out["offset"] = torch.tensor(lo - e.offset)
        out["step"] = torch.tensor(float(self.step))
        return out

    def state_dict(self) -> dict:
        """{"state": {chunk: {name: {exp_avg, exp_avg_sq[, master], step}}}, "step": int} without ZeRO,
        {"flat": {"dense": {state: 1-D}, "expert": {state: 1-D}}, "step": int} with ZeRO (the owned ranges)."""
        if self.mesh.layout.zero == 0:
            per_param: dict[str, dict[str, dict[str, torch.Tensor]]] = {c: {} for c in self.chunks}
            for b in self.buffers.values():
                for e in b.entries:
                    per_param[e.chunk][e.name] = self.param_state(e.chunk, e.name)
            return {"state": per_param, "step": self.step}
        return {"flat": {k: b.states() for k, b in self.buffers.items()}, "step": self.step}

    @torch.no_grad()
    def load_state_dict(self, state: dict, params: Chunks) -> None:
        """Inverse of state_dict (the per-parameter 0-d "step" tensors are not needed: the top-level one is).

        `params` are the parameter values saved with `state`, in their saved precision. Master weights, where
        `state` has them, set the parameters, whatever their precision (a full-precision run resumes from a
        mixed-precision one's masters); a mixed-precision run given a state without them (a full-precision
        run's) takes its masters from `params`."""
        per_param = state.get("state", {})  # (without ZeRO: chunk -> name -> {state: tensor})
        for key, buffer in self.buffers.items():
            if not buffer.entries:
                continue  # (a dense model's expert buffer)
            if self.mesh.layout.zero == 0:
                first = buffer.entries[0]
                for s in STATE_NAMES:  # straight into the buffer, where a restore may have filled them in place
                    for e in buffer.entries:
                        buffer.state[s][e.offset : e.offset + e.numel].copy_(per_param[e.chunk][e.name][s].flatten())
                saved = {}
                if MASTER in per_param[first.chunk][first.name]:
                    saved[MASTER] = buffer.flatten(lambda e: per_param[e.chunk][e.name][MASTER])
            else:
                saved = state["flat"][key]
                for s in STATE_NAMES:
                    buffer.state[s].copy_(saved[s])
            if MASTER in saved:
                if buffer.master is not None:
                    buffer.master.copy_(saved[MASTER])
                buffer.publish(saved[MASTER].float())
            elif buffer.master is not None:
                buffer.master.copy_(buffer.owned(buffer.flatten(lambda e: params[e.chunk][e.name])))
        self.step = int(state["step"])
