"""The trainer's collectives, on every backend and device.

NCCL (GPUs) and gloo (CPU) take the tensors as they are. gloo with CUDA tensors (`train.backend: gloo` on a GPU
machine: several ranks sharing one GPU) gets host copies: gloo moves host memory, and its point-to-point and
all-to-all take no CUDA tensors at all. Each call here copies what it sends to the host, runs the collective there
and copies what it received back into the caller's tensors, so the layers above run the same code everywhere.

`UCP_TRAINER_COLLECTIVES_VIA_HOST=1` sends every collective through host copies, CPU tensors too: the path gloo
with CUDA tensors takes, checked on a machine without a GPU (tests/test_trainer_devices.py).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch
import torch.distributed as dist

VIA_HOST_ALWAYS = os.environ.get("UCP_TRAINER_COLLECTIVES_VIA_HOST") == "1"


def via_host(tensor: torch.Tensor, group: dist.ProcessGroup | None = None) -> bool:
    """Whether a collective of `tensor` over `group` goes through host copies (module doc)."""
    return VIA_HOST_ALWAYS or (tensor.device.type != "cpu" and dist.get_backend(group) == "gloo")


def _host(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to("cpu", copy=True)


def all_reduce(x: torch.Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM, group=None) -> None:
    """`dist.all_reduce` of `x` in place."""
    if not via_host(x, group):
        dist.all_reduce(x, op=op, group=group)
        return
    host = _host(x)
    dist.all_reduce(host, op=op, group=group)
    x.copy_(host)


def all_gather(rows: list[torch.Tensor], x: torch.Tensor, group=None) -> None:
    """`dist.all_gather` of `x` into `rows`."""
    if not via_host(x, group):
        dist.all_gather(rows, x, group=group)
        return
    host_rows = [torch.empty_like(r, device="cpu") for r in rows]
    dist.all_gather(host_rows, _host(x), group=group)
    for row, host in zip(rows, host_rows):
        row.copy_(host)


def all_gather_into_tensor(out: torch.Tensor, x: torch.Tensor, group=None) -> None:
    """`dist.all_gather_into_tensor` of `x` into `out`."""
    if not via_host(x, group):
        dist.all_gather_into_tensor(out, x, group=group)
        return
    host_out = torch.empty_like(out, device="cpu")
    dist.all_gather_into_tensor(host_out, _host(x), group=group)
    out.copy_(host_out)


def all_to_all_single(
    out: torch.Tensor,
    x: torch.Tensor,
    out_splits: list[int] | None = None,
    in_splits: list[int] | None = None,
    group=None,
) -> None:
    """`dist.all_to_all_single` of `x` into `out`."""
    if not via_host(x, group):
        dist.all_to_all_single(out, x, out_splits, in_splits, group=group)
        return
    host_out = torch.empty_like(out, device="cpu")
    dist.all_to_all_single(host_out, _host(x), out_splits, in_splits, group=group)
    out.copy_(host_out)


def exchange(sends: Sequence[tuple[torch.Tensor, int, int]], recvs: Sequence[tuple[torch.Tensor, int, int]]) -> None:
    """Point-to-point messages all in flight at once (`dist.batch_isend_irecv`): each of `sends` and `recvs` is
    (tensor, peer rank, tag); returns when every message is sent and every received one is in its tensor."""
    if not sends and not recvs:
        return
    first = (sends or recvs)[0][0]
    host = via_host(first)
    sent = [(_host(t) if host else t, peer, tag) for t, peer, tag in sends]
    landed = [(torch.empty_like(t, device="cpu") if host else t, peer, tag) for t, peer, tag in recvs]
    ops = [dist.P2POp(dist.isend, t, peer, tag=tag) for t, peer, tag in sent]
    ops += [dist.P2POp(dist.irecv, t, peer, tag=tag) for t, peer, tag in landed]
    for request in dist.batch_isend_irecv(ops):
        request.wait()
    if host:
        for (t, _, _), (received, _, _) in zip(recvs, landed):
            t.copy_(received)
