"""The collective operations a save needs, behind a small interface.

`LocalComm` is one process saving alone (a single-process save, or every rank of a `VirtualWorld` run in one
process); `TorchComm` runs over a torch.distributed process group (gloo: checkpoint traffic is host memory even
when training runs on NCCL). A save uses them for the fragment exchange (only where ZeRO ranges cut a chunk),
the attempt id (broadcast), and at its end the objects each rank wrote (gathered to rank 0 up a tree, exact sizes:
rank 0 receives the payload, not W buffers of the longest) and the outcome (broadcast): no plan is ever gathered. Decisions go through `ucp.protocol.coordination`, which
sends typed messages over `gather_bytes` and `broadcast_bytes` and carries any rank's failure to every rank;
`exchange` moves data point to point.
"""

from __future__ import annotations

import contextlib
import struct
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch

from ..errors import PeerLostError


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

    def scatter_bytes(self, data: list[bytes] | None) -> bytes:
        """Rank 0's `data[r]` (a message for every rank), on each rank r."""


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

    def scatter_bytes(self, data: list[bytes] | None) -> bytes:
        assert data is not None and len(data) == 1
        return data[0]


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

    @contextlib.contextmanager
    def _collective(self, what: str) -> Iterator[None]:
        """The process group's failure (gloo's RuntimeError: a peer closed its connection, a timeout) as a
        PeerLostError naming this rank and the operation."""
        try:
            yield
        except RuntimeError as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise PeerLostError(
                f"rank {self.rank} of {self.world_size}: {what} failed, a process of the job is gone or cannot be "
                f"reached ({first[:300]})"
            ) from e

    def exchange(self, outgoing: dict[int, torch.Tensor], incoming: dict[int, int]) -> dict[int, torch.Tensor]:
        with self._collective("the exchange of chunk fragments"):
            return self._exchange(outgoing, incoming)

    def _exchange(self, outgoing: dict[int, torch.Tensor], incoming: dict[int, int]) -> dict[int, torch.Tensor]:
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
        with self._collective("a barrier"):
            self.dist.barrier(group=self.group)

    def broadcast_bytes(self, data: bytes | None) -> bytes:
        with self._collective("a broadcast from rank 0"):
            return self._broadcast_bytes(data)

    def _broadcast_bytes(self, data: bytes | None) -> bytes:
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

    def _send(self, peer: int, buf: bytes) -> None:
        """A message of any size to `peer`: its length, then its bytes (`_recv` takes both)."""
        self.dist.send(torch.tensor([len(buf)], dtype=torch.int64), self._global(peer), group=self.group)
        if buf:
            self.dist.send(torch.frombuffer(bytearray(buf), dtype=torch.uint8), self._global(peer), group=self.group)

    def _recv(self, peer: int) -> bytes:
        size = torch.empty(1, dtype=torch.int64)
        self.dist.recv(size, self._global(peer), group=self.group)
        buf = torch.empty(int(size), dtype=torch.uint8)
        if int(size):
            self.dist.recv(buf, self._global(peer), group=self.group)
        return bytes(buf.numpy())

    def gather_bytes(self, data: bytes) -> list[bytes] | None:
        """Up a binomial tree of point-to-point messages of exact sizes (`tree_gather`): rank 0 takes log2(W)
        messages holding the payload itself, not W buffers of the longest (torch.distributed's gather pads every
        rank's to one size, and gloo's root receives from every rank)."""
        with self._collective("a gather to rank 0"):
            return tree_gather(self.rank, self.world_size, data, self._send, self._recv)

    def scatter_bytes(self, data: list[bytes] | None) -> bytes:
        """Down the same tree (`tree_scatter`)."""
        with self._collective("a scatter from rank 0"):
            return tree_scatter(self.rank, self.world_size, data, self._send, self._recv)


def tree_gather(
    rank: int, world_size: int, data: bytes, send: Callable[[int, bytes], None], recv: Callable[[int], bytes]
) -> list[bytes] | None:
    """Every rank's `data`, in rank order, on rank 0 (None elsewhere), gathered up a binomial tree: in round k a rank
    whose lowest set bit is k sends what its subtree holds (ranks rank .. rank + 2^k - 1, contiguous and in order) to
    rank - 2^k and is done; a rank with bits 0..k clear receives rank + 2^k's subtree. log2(W) rounds; no rank sends
    or holds more than its subtree's messages. The frames: a count, each message's length, then the messages."""
    held = [data]
    step = 1
    while step < world_size:
        if rank & step:
            send(rank - step, _frames(held))
            return None
        if rank + step < world_size:
            held += _unframe(recv(rank + step))
        step <<= 1
    return held


def tree_scatter(
    rank: int,
    world_size: int,
    data: list[bytes] | None,
    send: Callable[[int, bytes], None],
    recv: Callable[[int], bytes],
) -> bytes:
    """Rank 0's `data[r]` on each rank r, down the binomial tree of `tree_gather`: a rank receives its subtree's
    messages from its parent (rank - its lowest set bit), then hands each child (rank + 2^k, k from high to low) the
    child's subtree and keeps its own. No rank holds more than its subtree's messages."""
    if rank == 0:
        assert data is not None and len(data) == world_size, "rank 0 scatters a message for every rank"
        held, span = list(data), 1 << max(world_size - 1, 0).bit_length()
    else:
        span = rank & -rank  # (the lowest set bit: this rank's subtree is rank .. rank + span - 1)
        held = _unframe(recv(rank - span))
    step = span >> 1
    while step:
        if rank + step < world_size:
            send(rank + step, _frames(held[step:]))
            held = held[:step]
        step >>= 1
    return held[0]


def exchange_sizes(comm: Comm, sizes: dict[int, int]) -> dict[int, int]:
    """Who sends this rank how much (peer -> bytes), given what it sends whom (`sizes`): the counts of a sparse
    exchange whose receivers do not know their senders. The (peer, size) pairs go up the tree to rank 0, which hands
    each rank those addressed to it: a rank's cost grows with its own pairs and its subtree's, never with W x W (an
    all-to-all of counts sends every rank W numbers, in W messages on gloo)."""
    mine = struct.pack(f"<{2 * len(sizes)}q", *(x for pair in sorted(sizes.items()) for x in pair))
    gathered = comm.gather_bytes(mine)
    routed = None
    if gathered is not None:
        inbox: list[list[int]] = [[] for _ in range(comm.world_size)]
        for src, buf in enumerate(gathered):
            pairs = struct.unpack(f"<{len(buf) // 8}q", buf)
            for dst, size in zip(pairs[::2], pairs[1::2]):
                inbox[dst] += (src, size)
        routed = [struct.pack(f"<{len(box)}q", *box) for box in inbox]
    got = comm.scatter_bytes(routed)
    pairs = struct.unpack(f"<{len(got) // 8}q", got)
    return dict(zip(pairs[::2], pairs[1::2]))


def _frames(messages: list[bytes]) -> bytes:
    head = struct.pack(f"<Q{len(messages)}Q", len(messages), *(len(m) for m in messages))
    return b"".join([head, *messages])


def _unframe(buf: bytes) -> list[bytes]:
    (n,) = struct.unpack_from("<Q", buf)
    sizes = struct.unpack_from(f"<{n}Q", buf, 8)
    out, pos = [], 8 * (n + 1)
    for size in sizes:
        out.append(buf[pos : pos + size])
        pos += size
    return out
