"""A dead peer noticed where NCCL would wait for it for ever: a ring of TCP connections, one per rank.

On gloo a peer that dies resets its connections, and the survivors' collectives fail at once. An NCCL collective
does not: its kernel spins on the GPU, waiting for data the dead peer will never send, until the collective timeout
(and then torch's watchdog ends the process). So, with NCCL, each rank also holds a TCP connection to the next rank
of a ring and reads from it; nothing is ever sent on it but a goodbye. When a process dies, its kernel closes its
sockets and the rank before it reads end-of-file at once: it aborts its NCCL communicators (its collectives then
fail instead of waiting) and closes its own sockets, so that the rank before it notices in turn, and so on round the
ring until every survivor has aborted, in about a millisecond a hop. The survivors then exit for a restart or
re-form the job in place (trainer/regroup.py), as on gloo.

A rank that ends normally says goodbye first (`stop`), so that its watcher does not take the closed connection for
a death. Each rank runs one thread and two sockets, whatever the world size.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable

import torch.distributed as dist

log = logging.getLogger("trainer")

_GOODBYE = b"B"


def reachable_address(peer_host: str) -> str:
    """This host's address as seen on the route to `peer_host` (e.g. MASTER_ADDR), which the other ranks reach."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((peer_host, 9))  # (a datagram socket sends nothing on connect: this only picks the route)
            return probe.getsockname()[0]
        except OSError:
            return "127.0.0.1"


class PeerWatch:
    """This rank's place in the ring: it listens for the previous rank, connects to the next, and calls `on_lost`
    (from its own thread) when the next rank, or anyone beyond it, is gone. Every rank makes one together (the
    addresses go through `store`, under `key`, which must be new for this group)."""

    def __init__(
        self,
        store: dist.Store,
        key: str,
        rank: int,
        world_size: int,
        host: str,
        on_lost: Callable[[], None],
        timeout_s: float = 60.0,
    ):
        self.rank, self.on_lost = rank, on_lost
        self._stopping = threading.Event()
        self.lost = False  # whether a peer was found gone (and `on_lost` called)
        listener = socket.create_server(("", 0))
        try:
            store.set(f"{key}/{rank}", f"{host}:{listener.getsockname()[1]}")
            next_host, _, next_port = store.get(f"{key}/{(rank + 1) % world_size}").decode().rpartition(":")
            self._next = socket.create_connection((next_host, int(next_port)), timeout=timeout_s)
            listener.settimeout(timeout_s)
            self._previous, _ = listener.accept()
        finally:
            listener.close()
        self._next.settimeout(None)
        self._thread = threading.Thread(target=self._watch, name="peerwatch", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        try:
            said = self._next.recv(1)
        except OSError:
            said = b""
        if said == _GOODBYE or self._stopping.is_set():
            return
        lost_at = time.perf_counter()
        self.lost = True
        log.warning("rank %d: the next rank of the ring is gone: aborting this rank's collectives", self.rank)
        try:
            self.on_lost()
        finally:
            self._close()  # (the rank before this one notices in turn)
            log.info("rank %d: collectives aborted in %.3f s", self.rank, time.perf_counter() - lost_at)

    def stop(self) -> None:
        """End the watch of a rank that ends normally: the previous rank is told, not alarmed."""
        self._stopping.set()
        try:
            self._previous.sendall(_GOODBYE)
        except OSError:
            pass  # (that rank is gone already)
        self._close()
        self._thread.join()

    def _close(self) -> None:
        for sock in (self._previous, self._next):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()


def abort_collectives() -> None:
    """Abort every process group's communicators: an NCCL collective waiting on a dead peer returns with an error
    instead of waiting for ever, and the process groups are gone (the caller's next collective raises)."""
    dist.distributed_c10d._abort_process_group()
