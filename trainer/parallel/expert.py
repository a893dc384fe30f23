"""Expert parallelism: each EP rank holds num_experts/E experts; tokens travel to them and back by all-to-all.

The EP group is carved out of the data-parallel group (docs/LOCAL_STATE.md), so its members route different
tokens. Every member sorts its (token, k) slots by expert, exchanges per-expert counts, sends each slot to the
rank holding its expert, runs its local experts on what it received, and sends the results back to where the
slots came from. gloo implements all_to_all_single with uneven splits, so CPU and GPU run the same code
(parallel/collectives.py).
"""

from __future__ import annotations

import torch

from . import collectives
from .mesh import group_size


class _AllToAll(torch.autograd.Function):
    """Uneven all-to-all whose backward is the reverse all-to-all."""

    @staticmethod
    def forward(ctx, x, send_splits, recv_splits, group):
        ctx.group, ctx.send_splits, ctx.recv_splits = group, send_splits, recv_splits
        out = x.new_empty(sum(recv_splits), *x.shape[1:])
        collectives.all_to_all_single(out, x.contiguous(), recv_splits, send_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return _AllToAll.apply(grad, ctx.recv_splits, ctx.send_splits, ctx.group), None, None, None


class ExpertRouting:
    """One dispatch/combine round trip: built from the slots' expert ids, used once forward (and backward).

    `dispatch` maps slots (sorted by expert on their home rank) to the rows this rank's experts process,
    grouped by local expert; `counts_per_local_expert` says how many rows each local expert gets; `combine`
    maps the experts' output rows back to the home rank's slot order.
    """

    def __init__(self, expert_ids: torch.Tensor, num_experts: int, group):
        self.group = group
        self.ep = group_size(group)
        self.local_experts = num_experts // self.ep
        self.order = torch.argsort(expert_ids, stable=True)  # slot order -> expert-sorted order
        self.inverse_order = torch.argsort(self.order)
        counts = torch.bincount(expert_ids, minlength=num_experts)
        if self.ep == 1:
            self.counts_per_local_expert = counts.tolist()
            return
        # recv_counts[s * local_experts + e]: rows that source rank s sends to our local expert e.
        recv_counts = torch.empty_like(counts)
        collectives.all_to_all_single(recv_counts, counts, group=group)
        self.send_splits = counts.view(self.ep, self.local_experts).sum(1).tolist()
        self.recv_splits = recv_counts.view(self.ep, self.local_experts).sum(1).tolist()
        self.counts_per_local_expert = recv_counts.view(self.ep, self.local_experts).sum(0).tolist()
        # Received rows come grouped by source rank, then by expert; regroup them by local expert.
        local_expert_of_row = torch.arange(self.local_experts).repeat(self.ep).repeat_interleave(recv_counts.cpu())
        self.regroup = torch.argsort(local_expert_of_row.to(expert_ids.device), stable=True)
        self.inverse_regroup = torch.argsort(self.regroup)

    def dispatch(self, slots: torch.Tensor) -> torch.Tensor:
        rows = slots[self.order]
        if self.ep == 1:
            return rows
        received = _AllToAll.apply(rows, self.send_splits, self.recv_splits, self.group)
        return received[self.regroup]

    def combine(self, expert_out: torch.Tensor) -> torch.Tensor:
        if self.ep > 1:
            back = expert_out[self.inverse_regroup]
            expert_out = _AllToAll.apply(back, self.recv_splits, self.send_splits, self.group)
        return expert_out[self.inverse_order]
