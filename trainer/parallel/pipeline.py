"""Pipeline parallelism: which layers each stage holds, and the 1F1B schedule with send/recv between stages.

Stage p (of P) holds a contiguous run of layers; the first stage also embeds tokens, the last one holds the
final norm, the output layer and the loss. A step pushes M microbatches through with the non-interleaved
1F1B schedule of Megatron/PipeDream-Flush: P-p-1 warm-up forwards, then alternating one forward and one
backward, then the remaining backwards. Combined send+recv pairs go through batch_isend_irecv so that two
neighbours sending to each other at once cannot deadlock.
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..profile import StepProfile
from .mesh import Mesh


def split_layers(num_layers: int, stages: int, layers_per_stage: list[int] | None) -> list[list[int]]:
    """Global layer indices of each stage: even by default, or the explicit (possibly uneven) counts."""
    if layers_per_stage is None:
        if num_layers % stages:
            raise ValueError(f"{num_layers} layers do not split evenly over pp={stages}: give train.stage_layers")
        layers_per_stage = [num_layers // stages] * stages
    if len(layers_per_stage) != stages or sum(layers_per_stage) != num_layers or min(layers_per_stage) < 1:
        raise ValueError(f"stage_layers={layers_per_stage} must be {stages} positive counts summing to {num_layers}")
    starts = [sum(layers_per_stage[:p]) for p in range(stages)]
    return [list(range(s, s + n)) for s, n in zip(starts, layers_per_stage)]


@dataclass
class StageOutput:
    """What a forward step leaves for its backward: the activation sent on (None on the last stage) and the
    scalar this stage's part of the loss contributes (LM loss on the last stage, load-balancing losses)."""

    activation: torch.Tensor | None
    objective: torch.Tensor


class P2P:
    """Activation and gradient exchange with the neighbouring stages of this rank's pipeline."""

    def __init__(self, mesh: Mesh, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device):
        self.prev, self.next = mesh.prev_stage_rank, mesh.next_stage_rank
        self.shape, self.dtype, self.device = shape, dtype, device

    def _exchange(self, send: list[tuple[torch.Tensor, int]], recv_from: int | None) -> torch.Tensor | None:
        ops = [dist.P2POp(dist.isend, tensor.contiguous(), peer) for tensor, peer in send]
        received = None
        if recv_from is not None:
            received = torch.empty(self.shape, dtype=self.dtype, device=self.device)
            ops.append(dist.P2POp(dist.irecv, received, recv_from))
        if ops:
            for request in dist.batch_isend_irecv(ops):
                request.wait()
        return received

    def recv_forward(self) -> torch.Tensor | None:
        x = self._exchange([], self.prev)
        return x.requires_grad_() if x is not None else None

    def send_forward(self, y: torch.Tensor | None) -> None:
        self._exchange([(y, self.next)] if self.next is not None else [], None)

    def recv_backward(self) -> torch.Tensor | None:
        return self._exchange([], self.next)

    def send_backward(self, dx: torch.Tensor | None) -> None:
        self._exchange([(dx, self.prev)] if self.prev is not None else [], None)

    def send_forward_recv_backward(self, y: torch.Tensor | None) -> torch.Tensor | None:
        return self._exchange([(y, self.next)] if self.next is not None else [], self.next)

    def send_backward_recv_forward(self, dx: torch.Tensor | None) -> torch.Tensor | None:
        x = self._exchange([(dx, self.prev)] if self.prev is not None else [], self.prev)
        return x.requires_grad_() if x is not None else None


def _backward(x: torch.Tensor | None, out: StageOutput, dy: torch.Tensor | None) -> torch.Tensor | None:
    tensors: list[torch.Tensor] = []
    grads: list[torch.Tensor | None] = []
    if out.objective.requires_grad:  # (a constant on a dense model's inner stage: no router, no loss there)
        tensors, grads = [out.objective], [torch.ones_like(out.objective)]
    if out.activation is not None:
        tensors.append(out.activation)
        grads.append(dy)
    torch.autograd.backward(tensors, grads)
    return x.grad if x is not None else None


def one_f_one_b(
    num_microbatches: int,
    forward_step: Callable[[int, torch.Tensor | None], StageOutput],
    p2p: P2P,
    stage: int,
    stages: int,
    profile: StepProfile | None = None,
) -> None:
    """Run forward and backward of every microbatch; gradients go to the parameters'
    .grad (whence the optimizer's hooks sum them into its fp32 buffers).

    forward_step(i, x) runs microbatch i through this stage; x is the received activation (None on the first
    stage, which reads microbatch i's tokens itself). With `profile`, the time of forward, backward and
    point-to-point communication (pipeline_wait) is added to its phases.
    """
    phase = profile.phase if profile is not None else (lambda _name: contextlib.nullcontext())
    warmup = min(stages - stage - 1, num_microbatches)
    steady = num_microbatches - warmup
    inputs: deque[torch.Tensor | None] = deque()
    outputs: deque[StageOutput] = deque()

    def forward(i: int, x: torch.Tensor | None) -> StageOutput:
        with phase("forward"):
            return forward_step(i, x)

    def backward(x: torch.Tensor | None, out: StageOutput, dy: torch.Tensor | None) -> torch.Tensor | None:
        with phase("backward"):
            return _backward(x, out, dy)

    for i in range(warmup):
        with phase("pipeline_wait"):
            x = p2p.recv_forward()
        out = forward(i, x)
        with phase("pipeline_wait"):
            p2p.send_forward(out.activation)
        inputs.append(x)
        outputs.append(out)

    with phase("pipeline_wait"):
        x = p2p.recv_forward() if steady > 0 else None
    for i in range(steady):
        out = forward(warmup + i, x)
        with phase("pipeline_wait"):
            dy = p2p.send_forward_recv_backward(out.activation)
        inputs.append(x)
        outputs.append(out)
        dx = backward(inputs.popleft(), outputs.popleft(), dy)
        with phase("pipeline_wait"):
            if i == steady - 1:
                p2p.send_backward(dx)
            else:
                x = p2p.send_backward_recv_forward(dx)

    for _ in range(warmup):
        with phase("pipeline_wait"):
            dy = p2p.recv_backward()
        dx = backward(inputs.popleft(), outputs.popleft(), dy)
        with phase("pipeline_wait"):
            p2p.send_backward(dx)
