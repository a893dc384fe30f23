"""Pipeline parallelism: which layers each stage holds, and the 1F1B schedule with send/recv between stages.

Stage p (of P) holds a contiguous run of layers; the first stage also embeds tokens, the last one holds the
final norm, the output layer and the loss. A step pushes M microbatches through with the non-interleaved
1F1B schedule of Megatron/PipeDream-Flush: P-p-1 warm-up forwards, then alternating one forward and one
backward, then the remaining backwards. With virtual stages (vpp V > 1) each stage holds V model chunks of
the P*V (chunk v of stage p is model chunk v*P + p) and the schedule is Megatron's interleaved 1F1B, which
shrinks the pipeline bubble V times. Combined send+recv pairs go through batch_isend_irecv so that two
neighbours sending to each other at once cannot deadlock.
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..profile import StepProfile
from . import collectives
from .mesh import Mesh, rank_of


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


ACTIVATION, GRADIENT = 0, 1  # message tags: in a ring of two stages both kinds go to the same peer


class P2P:
    """Activation and gradient exchange with the neighbouring stages of this rank's pipeline: the stages before and
    after it, or with `ring` (an interleaved pipeline) those around the ring, the last stage's next being the
    first."""

    def __init__(self, mesh: Mesh, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, ring=False):
        if ring:
            c, L = mesh.coords, mesh.layout
            self.prev: int | None = rank_of(L, c.tp, c.dp, (c.pp - 1) % L.pp)
            self.next: int | None = rank_of(L, c.tp, c.dp, (c.pp + 1) % L.pp)
        else:
            self.prev, self.next = mesh.prev_stage_rank, mesh.next_stage_rank
        self.shape, self.dtype, self.device = shape, dtype, device

    def communicate(
        self,
        send_next: torch.Tensor | None = None,
        send_prev: torch.Tensor | None = None,
        recv_prev: bool = False,
        recv_next: bool = False,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """One round, every message in flight at once (so two neighbours sending to each other cannot deadlock):
        an activation to the next stage, a gradient to the previous one, and (activation from the previous
        stage, gradient from the next) received; nothing to or from a stage that does not exist."""
        sends, recvs = [], []
        if send_next is not None and self.next is not None:
            sends.append((send_next.contiguous(), self.next, ACTIVATION))
        if send_prev is not None and self.prev is not None:
            sends.append((send_prev.contiguous(), self.prev, GRADIENT))
        x = dy = None
        if recv_prev and self.prev is not None:
            x = torch.empty(self.shape, dtype=self.dtype, device=self.device)
            recvs.append((x, self.prev, ACTIVATION))
        if recv_next and self.next is not None:
            dy = torch.empty(self.shape, dtype=self.dtype, device=self.device)
            recvs.append((dy, self.next, GRADIENT))
        collectives.exchange(sends, recvs)
        return (x.requires_grad_() if x is not None else None), dy

    def recv_forward(self) -> torch.Tensor | None:
        return self.communicate(recv_prev=True)[0]

    def send_forward(self, y: torch.Tensor | None) -> None:
        self.communicate(send_next=y)

    def recv_backward(self) -> torch.Tensor | None:
        return self.communicate(recv_next=True)[1]

    def send_backward(self, dx: torch.Tensor | None) -> None:
        self.communicate(send_prev=dx)

    def send_forward_recv_backward(self, y: torch.Tensor | None) -> torch.Tensor | None:
        return self.communicate(send_next=y, recv_next=True)[1]

    def send_backward_recv_forward(self, dx: torch.Tensor | None) -> torch.Tensor | None:
        return self.communicate(send_prev=dx, recv_prev=True)[0]


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


def interleaved_one_f_one_b(
    num_microbatches: int,
    forward_step: Callable[[int, int, torch.Tensor | None], StageOutput],
    p2p: P2P,
    stage: int,
    stages: int,
    chunks: int,
    profile: StepProfile | None = None,
) -> None:
    """Megatron's interleaved 1F1B (virtual pipeline stages): this rank holds `chunks` model chunks, chunk v
    being model chunk v*P + stage of the P*V, and activations go round the ring of stages V times.

    Work is counted in virtual microbatches k = 0 .. M*V-1, taken in groups of P microbatches per chunk: forward
    k runs microbatch (k // (P*V)) * P + k % P through chunk (k % (P*V)) // P, backward k the same group of
    microbatches through the chunks in reverse order. After (P - stage - 1) * 2 + (V - 1) * P warm-up forwards
    (all of them when M == P) every step does one forward and one backward. The sends and receives of a step go
    out together, in the same order as Megatron's, so that every stage's round of messages meets its
    neighbours'. forward_step(v, i, x) runs microbatch i through chunk v (x: the received activation, None for
    the first chunk of the first stage). M must be a multiple of P.
    """
    if num_microbatches % stages:
        raise ValueError(f"an interleaved pipeline needs microbatches ({num_microbatches}) a multiple of pp ({stages})")
    phase = profile.phase if profile is not None else (lambda _name: contextlib.nullcontext())
    group = stages * chunks
    total = num_microbatches * chunks
    first_stage, last_stage = stage == 0, stage == stages - 1
    if num_microbatches == stages:
        warmup, all_warmup = total, True
    else:
        warmup, all_warmup = min((stages - stage - 1) * 2 + (chunks - 1) * stages, total), False
    remaining = total - warmup

    def chunk_of(k: int, forward: bool) -> int:
        v = (k % group) // stages
        return v if forward else chunks - 1 - v

    inputs: list[deque[torch.Tensor | None]] = [deque() for _ in range(chunks)]
    outputs: list[deque[StageOutput]] = [deque() for _ in range(chunks)]
    output_grads: list[deque[torch.Tensor | None]] = [deque() for _ in range(chunks)]

    def forward(k: int) -> torch.Tensor | None:
        """Run forward k; the activation to send on (None from the model's last chunk)."""
        v = chunk_of(k, forward=True)
        if first_stage and v == 0:
            inputs[v].append(None)  # (the first chunk reads tokens)
        with phase("forward"):
            out = forward_step(v, (k // group) * stages + k % stages, inputs[v][-1])
        outputs[v].append(out)
        return None if last_stage and v == chunks - 1 else out.activation

    def backward(k: int) -> torch.Tensor | None:
        """Run backward k; the gradient to send back (None from the model's first chunk)."""
        v = chunk_of(k, forward=False)
        if last_stage and v == chunks - 1 and not output_grads[v]:
            output_grads[v].append(None)  # (the last chunk's output is the loss: no gradient comes for it)
        x, out, dy = inputs[v].popleft(), outputs[v].popleft(), output_grads[v].popleft()
        with phase("backward"):
            dx = _backward(x, out, dy)
        return None if first_stage and v == 0 else dx

    def communicate(**kwargs) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        with phase("pipeline_wait"):
            return p2p.communicate(**kwargs)

    if not first_stage:
        inputs[0].append(communicate(recv_prev=True)[0])
    for k in range(warmup):
        y = forward(k)
        next_v = chunk_of(k + 1, forward=True)
        recv_prev = not (first_stage and next_v == 0) and k != total - 1
        if k == warmup - 1 and not all_warmup:
            x, dy = communicate(send_next=y, recv_prev=recv_prev, recv_next=not last_stage)
            output_grads[chunks - 1].append(dy)
        else:
            x, _ = communicate(send_next=y, recv_prev=recv_prev)
        if recv_prev:
            inputs[next_v].append(x)

    for k in range(remaining):
        forward_k = k + warmup
        y = forward(forward_k)
        dx = backward(k)
        # The first stage runs P-1 virtual microbatches ahead of the last one, and the last behind the first: what
        # each receives next belongs to the chunk those positions name.
        if first_stage:
            v = chunk_of(forward_k - (stages - 1), forward=True)
            recv_prev, next_forward_v = v != chunks - 1, v + 1
        else:
            recv_prev, next_forward_v = True, chunk_of(forward_k + 1, forward=True)
        if last_stage:
            v = chunk_of(k - (stages - 1), forward=False)
            recv_next, next_backward_v = v != 0, v - 1
        else:
            recv_next, next_backward_v = True, chunk_of(k + 1, forward=False)
        if k == remaining - 1:
            recv_prev = False  # (the last forward's input came with the warm-up's last round)
        x, dy = communicate(send_next=y, send_prev=dx, recv_prev=recv_prev, recv_next=recv_next)
        if recv_prev:
            inputs[next_forward_v].append(x)
        if recv_next:
            output_grads[next_backward_v].append(dy)

    if all_warmup:
        output_grads[chunks - 1].append(communicate(recv_next=not last_stage)[1])
    for k in range(remaining, total):
        dx = backward(k)
        next_v = chunk_of(k + 1, forward=False)
        recv_next = not (last_stage and next_v == chunks - 1) and k != total - 1
        _, dy = communicate(send_prev=dx, recv_next=recv_next)
        if recv_next:
            output_grads[next_v].append(dy)
