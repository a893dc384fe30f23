"""Devices: tensors that are not in host memory (CUDA), and the copies between them and the host, said once.

Everything ucp checksums, encodes and writes is host memory, and everything it reads is verified in host memory. A
tensor on a device is copied to the host first (a save's snapshot), and a load that lands on a device is read and
verified on the host, then copied. What those copies need:

- `on_host`: whether the CPU can read a tensor's bytes where they are.
- `page_lock` / `page_unlock`: page-lock memory ucp allocated itself (the writer process's shared staging memory),
  so that copies between it and a device are asynchronous DMA, not staged through the driver's own buffer.
- `SideStreams` and `Copies`: the copies of one snapshot or one load, queued on a side stream of each device (not
  the caller's stream: its work goes on meanwhile), ordered after what the caller had queued when the `Copies` was
  made and, after a snapshot, before what it queues next (`order_after`: the optimizer step cannot change a tensor
  before it was copied).

A CUDA tensor whose memory is not the current device's is copied on a side stream of its own device. Where CUDA was
never initialised no tensor can be on a GPU, and nothing here touches it (a CPU job on a GPU machine makes no CUDA
context because of ucp).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator

import torch

from ..errors import StateError, UcpError

log = logging.getLogger("ucp")

# cudaHostRegisterPortable: the memory counts as page-locked for every device, not only the current one
_PORTABLE = 1


def on_host(tensor: torch.Tensor) -> bool:
    """Whether the CPU reads `tensor`'s bytes where they are (a CPU tensor)."""
    return tensor.is_cpu


def load_device(device: torch.device | str | None) -> torch.device | None:
    """`device` as where a load puts its tensors (None: host memory); a StateError for a name torch does not know
    and for the meta device, which holds no values."""
    if device is None:
        return None
    try:
        place = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise StateError(f"cannot load onto device {device!r}: {e}") from None
    if place.type == "meta":
        raise StateError("cannot load onto the meta device: it holds no values")
    return place


def cuda_in_use() -> bool:
    """Whether this process has initialised CUDA (only then can a tensor be on a GPU)."""
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def page_lock(memory: torch.Tensor) -> None:
    """Page-lock the host memory under the uint8 tensor `memory` for every device (cudaHostRegister)."""
    nbytes = memory.numel()
    try:
        torch.cuda.check_error(torch.cuda.cudart().cudaHostRegister(memory.data_ptr(), nbytes, _PORTABLE))
    except (RuntimeError, torch.cuda.CudaError) as e:
        raise UcpError(f"cannot page-lock {nbytes} bytes of staging memory for the GPU (cudaHostRegister): {e}") from e


def page_unlock(memory: torch.Tensor) -> None:
    """Undo `page_lock` (best effort: at the process's exit CUDA may be gone already, and the memory goes anyway)."""
    error = torch.cuda.cudart().cudaHostUnregister(memory.data_ptr())
    if error != torch.cuda.cudart().cudaError.success:
        log.debug("cudaHostUnregister of staging memory: %s", error)


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


class SideStreams:
    """One side stream per CUDA device, made when first asked for and kept (a pipeline's copies reuse them)."""

    def __init__(self) -> None:
        self._streams: dict[int, torch.cuda.Stream] = {}
        self._lock = threading.Lock()

    def get(self, index: int) -> torch.cuda.Stream:
        with self._lock:
            stream = self._streams.get(index)
            if stream is None:
                stream = self._streams[index] = torch.cuda.Stream(device=index)
            return stream


class Copies:
    """The copies of one snapshot or one load between host memory and devices.

    Made in the caller's thread: it marks what the caller has queued so far on its current stream of the current
    device. A copy on that device waits for the mark (so a snapshot taken in a background thread still waits only
    for what was queued before the save, not for the next forward pass); a copy on another device waits for that
    device's current stream (the copying thread's) each time. `to_host` and `to_device` queue a copy and return the
    CUDA event that marks it done, or None when the copy was synchronous (no CUDA tensor in it). Safe to use from
    several threads.
    """

    def __init__(self, streams: SideStreams):
        self.streams = streams
        self._lock = threading.Lock()
        self._waited: set[int] = set()  # devices whose side stream waits for the caller already
        self.devices: set[int] = set()  # devices copied from or to
        self._home: int | None = None  # the caller's current device, with its stream and the mark on it
        self._caller: torch.cuda.Stream | None = None
        self._mark: torch.cuda.Event | None = None
        self._sourcing: int | None = None  # the thread inside `sourcing`
        if cuda_in_use():
            self._home = torch.cuda.current_device()
            self._caller = torch.cuda.current_stream(self._home)
            self._mark = torch.cuda.Event()
            self._mark.record(self._caller)

    def side(self, index: int) -> torch.cuda.Stream:
        """Device `index`'s side stream, made to wait for the caller's work the first time this `Copies` uses it."""
        stream = self.streams.get(index)
        with self._lock:
            if index not in self._waited:
                self._waited.add(index)
                if index == self._home and self._mark is not None:
                    stream.wait_event(self._mark)
                else:
                    stream.wait_stream(torch.cuda.current_stream(index))
            self.devices.add(index)
        return stream

    @contextlib.contextmanager
    def sourcing(self) -> Iterator[None]:
        """A context (one thread's) in which the side stream of the caller's device is the current stream: work that
        makes the values to copy (a chunk assembled from pieces on the device) then queues after the mark and before
        the copies, and copies on that device need no stream switch each."""
        if self._home is None:
            yield
            return
        with torch.cuda.stream(self.side(self._home)):
            self._sourcing = threading.get_ident()
            try:
                yield
            finally:
                self._sourcing = None

    def to_host(self, dst: torch.Tensor, src: torch.Tensor) -> torch.cuda.Event | None:
        """Queue `dst` (host memory, page-locked for the copy to be asynchronous) <- `src`."""
        if src.device.type != "cuda":
            dst.copy_(src)
            return None
        return self._queued(dst, src, _index(src.device))

    def to_device(self, dst: torch.Tensor, src: torch.Tensor) -> torch.cuda.Event | None:
        """Queue `dst` (on a device) <- `src` (host memory, page-locked for the copy to be asynchronous)."""
        if dst.device.type != "cuda":
            dst.copy_(src)
            return None
        return self._queued(dst, src, _index(dst.device))

    def _queued(self, dst: torch.Tensor, src: torch.Tensor, index: int) -> torch.cuda.Event:
        stream = self.side(index)
        done = torch.cuda.Event()
        if index == self._home and self._sourcing == threading.get_ident():
            dst.copy_(src, non_blocking=True)  # (the side stream is current: `sourcing`)
            done.record(stream)
            return done
        if index != self._home:
            # Values on a device other than the caller's may have been made just now on that device's current stream
            # (a chunk assembled from pieces on it, outside `sourcing`), after the first wait for it: wait each time.
            stream.wait_stream(torch.cuda.current_stream(index))
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)
            done.record(stream)
        return done

    def order_after(self) -> None:
        """Make the caller's streams wait for every copy queued so far (call it from the caller's thread, or before
        the caller queues more work: a lazy snapshot's `wait_snapshot`)."""
        for index in sorted(self.devices):
            caller = self._caller if index == self._home else torch.cuda.current_stream(index)
            assert caller is not None
            caller.wait_stream(self.streams.get(index))
