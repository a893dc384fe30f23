"""Megatron tensor parallelism: the two conjugate communication operators, and what is built from them.

Activations are replicated over the TP group (no sequence parallelism). A column-parallel linear takes the
replicated input through `copy_to_tp` (identity forward, all-reduce of the input gradient backward) and yields
a TP-split output; a row-parallel linear takes a TP-split input and sums the partial outputs with
`reduce_from_tp` (all-reduce forward, identity backward). Parameters that are replicated over TP (norms,
router) receive identical gradients on every TP rank, so they need no TP communication.

Also here: the canonical -> local slicing of the TP-split tensors (fused QKV, fused gate/up, vocab padding),
exactly as docs/LOCAL_STATE.md defines them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from . import collectives
from .mesh import group_rank, group_size


def _all_reduce(x: torch.Tensor, group, op=dist.ReduceOp.SUM) -> torch.Tensor:
    if group_size(group) > 1:
        x = x.contiguous()
        collectives.all_reduce(x, op=op, group=group)
    return x


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad.clone(), ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x.clone(), group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherFromTP(torch.autograd.Function):
    """All-gather along the last dim forward; backward, each rank's own slice of the gradient summed over the group
    (megatron-core's all_gather_last_dim_from_tensor_parallel_region, whose backward is a reduce-scatter: here an
    all-reduce and a slice, which gloo has)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        parts = [torch.empty_like(x) for _ in range(group_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx, grad):
        full = _all_reduce(grad.clone(), ctx.group)
        return full.chunk(group_size(ctx.group), dim=-1)[group_rank(ctx.group)].contiguous(), None


def gather_from_tp(x: torch.Tensor, group) -> torch.Tensor:
    return _GatherFromTP.apply(x, group) if group_size(group) > 1 else x


def copy_to_tp(x: torch.Tensor, group) -> torch.Tensor:
    return _CopyToTP.apply(x, group) if group_size(group) > 1 else x


def reduce_from_tp(x: torch.Tensor, group) -> torch.Tensor:
    return _ReduceFromTP.apply(x, group) if group_size(group) > 1 else x


def column_parallel(x: torch.Tensor, weight: torch.Tensor, group) -> torch.Tensor:
    """y_local = x @ W_local^T, W split over TP along dim 0."""
    return F.linear(copy_to_tp(x, group), weight)


def row_parallel(x_local: torch.Tensor, weight: torch.Tensor, group) -> torch.Tensor:
    """y = sum over TP of x_local @ W_local^T, W split over TP along dim 1."""
    return reduce_from_tp(F.linear(x_local, weight), group)


# --- vocabulary parallelism ------------------------------------------------------------------------------


def padded_vocab_size(vocab: int, divisible_by: int, tp: int) -> int:
    multiple = divisible_by * tp
    return -(-vocab // multiple) * multiple


def vocab_parallel_embedding(tokens: torch.Tensor, weight: torch.Tensor, group) -> torch.Tensor:
    """Look up tokens in a vocab-split table: each rank embeds the tokens of its rows, then all-reduce."""
    rows = weight.shape[0]
    start = group_rank(group) * rows
    if group_size(group) == 1:
        return F.embedding(tokens, weight)
    local = tokens - start
    outside = (local < 0) | (local >= rows)
    out = F.embedding(local.masked_fill(outside, 0), weight)
    out = out.masked_fill(outside.unsqueeze(-1), 0.0)
    return reduce_from_tp(out, group)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token cross-entropy over logits split along the vocabulary (Megatron's algorithm).

    Columns at or past `vocab` (vocabulary padding) are excluded from the softmax, so the loss does not depend
    on how much padding a TP degree adds.
    """

    @staticmethod
    def forward(ctx, logits, targets, vocab, group):
        logits = logits.float()
        rows = logits.shape[-1]
        start = group_rank(group) * rows
        columns = torch.arange(start, start + rows, device=logits.device)
        logits = logits.masked_fill(columns >= vocab, float("-inf"))
        global_max = _all_reduce(logits.max(dim=-1).values, group, dist.ReduceOp.MAX)
        shifted = logits - global_max.unsqueeze(-1)
        exp = shifted.exp()
        sum_exp = _all_reduce(exp.sum(dim=-1), group)
        local_target = targets - start
        inside = (local_target >= 0) & (local_target < rows)
        index = local_target.clamp(0, rows - 1).unsqueeze(-1)
        target_logit = torch.gather(shifted, -1, index).squeeze(-1).masked_fill(~inside, 0.0)
        target_logit = _all_reduce(target_logit, group)
        loss = sum_exp.log() - target_logit
        ctx.save_for_backward(exp.div_(sum_exp.unsqueeze(-1)), index, inside)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, index, inside = ctx.saved_tensors
        grad = softmax.clone()
        grad.scatter_add_(-1, index, -inside.unsqueeze(-1).to(grad.dtype))
        return grad * grad_loss.unsqueeze(-1), None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, vocab: int, group) -> torch.Tensor:
    """Per-token loss [..] from local logits [.., padded_vocab/T] and global target ids."""
    return _VocabParallelCrossEntropy.apply(logits, targets, vocab, group)


# --- canonical -> local slicing --------------------------------------------------------------------------


def split_dim(full: torch.Tensor, dim: int, rank: int, size: int) -> torch.Tensor:
    return full.chunk(size, dim=dim)[rank] if size > 1 else full


def shard_vocab(full: torch.Tensor, padded_vocab: int, rank: int, size: int) -> torch.Tensor:
    """Pad the vocabulary rows with zeros to padded_vocab, then take this rank's rows."""
    padded = torch.zeros(padded_vocab, *full.shape[1:], dtype=full.dtype)
    padded[: full.shape[0]] = full
    return split_dim(padded, 0, rank, size)


def shard_qkv(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int, kv_heads: int, rank: int, size: int
) -> torch.Tensor:
    """Megatron's fused QKV: this rank's run of the rows of the query groups, each [its query heads; its key head; its
    value head]: whole groups when TP divides the KV heads, a share of one group when there are fewer KV heads."""
    head_dim = k.shape[0] // kv_heads
    per_group = heads // kv_heads
    qg = q.reshape(kv_heads, per_group * head_dim, -1)
    kg = k.reshape(kv_heads, head_dim, -1)
    vg = v.reshape(kv_heads, head_dim, -1)
    fused = torch.cat([qg, kg, vg], dim=1)  # [kv_heads, (per_group + 2) * head_dim, hidden]
    return split_dim(fused.reshape(-1, q.shape[-1]), 0, rank, size)


def shard_gate_up(w1: torch.Tensor, w3: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """Megatron's fused gate/up: [w1 rows of this rank ; w3 rows of this rank]."""
    return torch.cat([split_dim(w1, 0, rank, size), split_dim(w3, 0, rank, size)], dim=0)
