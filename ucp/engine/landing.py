"""The load path to a device: objects read into reused page-locked host memory, then copied asynchronously.

A load whose destination is on a GPU cannot read into it (reads, checksums and decoding need host memory), and a
copy from ordinary (pageable) memory runs at the driver's bounce speed (measured on an H200: 1.3 GB/s, against
55 GB/s from page-locked memory). So each object read for such a destination goes first into a slot of a `Landing`:
a bounded pool of page-locked arenas (`ucp.engine.staging.StagingPool`, the save's staging pool). The reading thread reads
and verifies the object there as it would into the destination, queues the copy to the destination on the device's
side stream (`ucp.base.devices.Copies`) and goes on to the next read; a thread of the landing's own waits for the copies
in order and releases each slot when its copy is done. Reads, checksums and copies of different objects so overlap,
and the memory is reused from object to object (and, through torch's cache of page-locked memory, from load to
load). The destination's own tensors are filled in place, whatever their strides.
"""

from __future__ import annotations

import contextlib
import functools
import queue
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Self

import torch

from ..base.devices import Copies, SideStreams, on_host
from ..format.manifest import AtomMeta
from .staging import Slot, StagingPool, host_arena

# Page-locked memory a load holds at most (more when one object is larger): enough for the reads in flight of the
# default 16 threads at half the default object size each, and no more (page-locking costs ~0.1 s per GiB).
LANDING_BYTES = 512 << 20

_STREAMS = SideStreams()  # the loads' side streams (a save's are its pipeline's own)


class Landing:
    """Page-locked slots through which one load's objects reach a device; leave it (a context) to wait for every
    copy. `capacity`: bytes of page-locked memory at most; `pinned`: page-lock it (False for devices other than
    CUDA, whose copies are synchronous anyway)."""

    def __init__(self, capacity: int, pinned: bool = True):
        self.pool = StagingPool(capacity, functools.partial(host_arena, pinned=pinned))
        self.copies = Copies(_STREAMS)  # (made in the caller's thread: copies wait for what it queued before)
        self._copied: queue.SimpleQueue[tuple[torch.cuda.Event | None, Slot] | None] = queue.SimpleQueue()
        self._error: BaseException | None = None
        self._releaser = threading.Thread(target=self._release_copied, name="ucp-landing", daemon=True)
        self._releaser.start()

    def land(self, dest: torch.Tensor, fill: Callable[[torch.Tensor], object]) -> None:
        """`fill(host)` puts `dest`'s values into `host` (host memory of `dest`'s dtype and shape, contiguous), and
        they are then copied into `dest`. Waits for a slot when the pool is full."""
        nbytes = dest.numel() * dest.element_size()
        if nbytes == 0:
            return
        slot = self.pool.acquire(nbytes)
        assert slot is not None  # (waiting acquires always give one)
        try:
            host = slot.memory.view(dest.dtype).view(dest.shape)
            fill(host)
            # (no_grad, as `load_state_dict` copies: `dest` may be a caller's parameter, or a view of one, that requires
            # grad, which torch refuses to change in place otherwise; no_grad is per thread, and this is a reader's)
            with torch.no_grad():
                done = self.copies.to_device(dest, host)
        except BaseException:
            self.pool.release(slot)
            raise
        self._copied.put((done, slot))

    def _release_copied(self) -> None:
        while (item := self._copied.get()) is not None:
            done, slot = item
            try:
                if done is not None:
                    done.synchronize()
            except BaseException as e:  # noqa: BLE001 -- a failed copy fails the load, when the landing is left
                self._error = self._error or e
            finally:
                self.pool.release(slot)

    def close(self) -> None:
        """Wait for every copy, then give the memory back; raises a copy's error."""
        self._copied.put(None)
        self._releaser.join()
        self.pool.close()
        if self._error is not None:
            raise self._error

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *_: object) -> None:
        try:
            self.close()
        except BaseException:
            if exc_type is None:
                raise  # (a failed read is the error to raise: a copy's error after it is a consequence)


@contextlib.contextmanager
def open_landing(destinations: Iterable[torch.Tensor], metas: Iterable[AtomMeta]) -> Iterator[Landing | None]:
    """A `Landing` for a load into `destinations` of objects of `metas`, or None when every destination is in host
    memory (reads go straight into them)."""
    devices = {t.device for t in destinations if not on_host(t)}
    if not devices:
        yield None
        return
    largest = max((m.object_bytes for m in metas), default=0)
    with Landing(max(LANDING_BYTES, 2 * largest), pinned=any(d.type == "cuda" for d in devices)) as landing:
        yield landing
