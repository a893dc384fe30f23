"""The collective operations a save needs, behind a small interface.

`LocalComm` is one process saving alone (a single-process save, or every rank of a `VirtualWorld` run in one
process); `TorchComm` runs over a torch.distributed process group (gloo: checkpoint traffic is host memory even
when training runs on NCCL). A save uses them for the fragment exchange (only where ZeRO ranges cut a chunk),
the attempt id (broadcast), and at its end the objects each rank wrote (gathered to rank 0, 40-odd bytes per
object) and the outcome (broadcast): no plan is ever gathered. Decisions go through `ucp.protocol.coordination`, which
sends typed messages over `gather_bytes` and `broadcast_bytes` and carries any rank's failure to every rank;
`exchange` moves data point to point.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch


class Comm(Protocol):
    """The collective operations a distributed save needs."""

    rank: int
    world_size: int

    def exchange(self, outgoing: dict[int, torch.Tensor], incoming: dict[int, int]) -> dict[int, torch.Tensor]:
        """Send each peer its uint8 buffer; receive from each peer in `incoming` a buffer of that many bytes."""

    def barrier(self) -> None: ...

    def broadcast_bytes(self, data: bytes | None) -> bytes:
        """Rank 0's `data`, on every rank."""

    def gather_bytes(self, data: bytes) -> list[bytes] | None:
        """Every rank's `data`, in rank order, on rank 0 (None elsewhere)."""


class LocalComm:
    """A world of one process."""

    rank = 0
    world_size = 1

    def exchange(self, outgoing: dict[int, torch.Tensor], incoming: dict[int, int]) -> dict[int, torch.Tensor]:
        return {0: outgoing[0]} if 0 in incoming else {}

    def barrier(self) -> None:
        pass

    def broadcast_bytes(self, data: bytes | None) -> bytes:
        assert data is not None
        return data

    def gather_bytes(self, data: bytes) -> list[bytes] | None:
        return [data]


class TorchComm:
    """Comm over a torch.distributed process group (gloo: buffers stay in host memory)."""

    def __init__(self, group: Any = None):
        import torch.distributed as dist

        self.dist = dist
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)

    def _global(self, rank: int) -> int:
        return rank if self.group is None else self.dist.get_global_rank(self.group, rank)

    def exchange(self, outgoing: dict[int, torch.Tensor], incoming: dict[int, int]) -> dict[int, torch.Tensor]:
        received = {peer: torch.empty(n, dtype=torch.uint8) for peer, n in incoming.items()}
        requests = [
            self.dist.irecv(buf, self._global(peer), group=self.group) for peer, buf in sorted(received.items())
        ]
        requests += [
            self.dist.isend(buf, self._global(peer), group=self.group) for peer, buf in sorted(outgoing.items())
        ]
        for request in requests:
            if request is not None:  # (None only for a send to this rank itself, which ucp never makes)
                request.wait()
        return received

    def barrier(self) -> None:
        self.dist.barrier(group=self.group)

    def broadcast_bytes(self, data: bytes | None) -> bytes:
        size = torch.tensor([len(data) if data is not None else 0], dtype=torch.int64)
        self.dist.broadcast(size, self._global(0), group=self.group)
        buf = (
            torch.frombuffer(bytearray(data), dtype=torch.uint8)
            if self.rank == 0 and data
            else torch.empty(int(size), dtype=torch.uint8)
        )
        if int(size):
            self.dist.broadcast(buf, self._global(0), group=self.group)
        return bytes(buf.numpy())

    def gather_bytes(self, data: bytes) -> list[bytes] | None:
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world_size)]
        self.dist.all_gather(sizes, torch.tensor([len(data)], dtype=torch.int64), group=self.group)
        longest = max(int(s) for s in sizes)
        mine = torch.zeros(max(longest, 1), dtype=torch.uint8)
        mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else mine[:0]
        buffers = [torch.empty_like(mine) for _ in range(self.world_size)] if self.rank == 0 else None
        self.dist.gather(mine, buffers, dst=self._global(0), group=self.group)
        if buffers is None:
            return None
        return [bytes(b[: int(n)].numpy()) for b, n in zip(buffers, sizes)]
