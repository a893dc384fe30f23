"""Staging memory for async saves: a pool of arenas, reused from save to save, carved into one slot per chunk.

An arena is one large host allocation: ordinary memory, pinned memory (when chunks come from a GPU), or a
shared-memory file that a writer process maps too (`SharedArena`: the snapshot is then a copy into memory the
writer reads directly). Slots are carved from an arena front to back; the arena is reused once every slot in it
is released, which is the pattern of a save (all chunks staged, then all written). The pool's `capacity` bounds
the bytes of all arenas together; when it is reached, `acquire` waits for writes to release slots.
"""

from __future__ import annotations

import mmap
import os
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

from ..base.devices import page_lock, page_unlock
from ..errors import UcpError

ARENA_BYTES = 64 << 20  # an arena holds at least one chunk object of the default chunking policy
_ALIGN = 64  # slot offsets: any dtype can be viewed at them, and cache lines are not shared
_PAGE = 4096


@dataclass(eq=False)
class Arena:
    """One allocation; `memory` is a uint8 tensor over it. `fd` is set for shared arenas (a memfd)."""

    id: int
    memory: torch.Tensor
    fd: int | None = None
    registered: bool = False  # page-locked for CUDA with cudaHostRegister (undone when the arena is closed)
    used: int = 0
    live: int = 0

    @property
    def size(self) -> int:
        return self.memory.numel()


@dataclass(eq=False)
class Slot:
    """`nbytes` of an arena at `offset`."""

    arena: Arena
    offset: int
    nbytes: int
    memory: torch.Tensor = field(repr=False)


def host_arena(arena_id: int, size: int, pinned: bool) -> Arena:
    return Arena(arena_id, torch.empty(size, dtype=torch.uint8, pin_memory=pinned))


def shared_arena(arena_id: int, size: int, pin_for_cuda: bool = False) -> Arena:
    """An anonymous shared-memory file (memfd), mapped here; its fd is passed to the writer process, which maps
    the same pages. The memory is freed when both sides have dropped their mapping and fd."""
    fd = os.memfd_create(f"ucp-staging-{arena_id}", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, size)
        memory = torch.frombuffer(mmap.mmap(fd, size), dtype=torch.uint8)
    except BaseException:
        os.close(fd)
        raise
    if pin_for_cuda:  # page-locked, so that device-to-host copies into it are asynchronous
        try:
            page_lock(memory)
        except BaseException:
            os.close(fd)
            raise
    return Arena(arena_id, memory, fd, registered=pin_for_cuda)


def map_shared_arena(arena_id: int, fd: int, size: int) -> Arena:
    """The writer process's view of an arena whose fd it received."""
    try:
        return Arena(arena_id, torch.frombuffer(mmap.mmap(fd, size), dtype=torch.uint8))
    finally:
        os.close(fd)


def close_arena(arena: Arena) -> None:
    """Drop our reference; the mapping goes when the last tensor viewing it does."""
    if arena.registered:
        page_unlock(arena.memory)
        arena.registered = False
    if arena.fd is not None:
        os.close(arena.fd)
        arena.fd = None


class StagingPool:
    """Arenas of at most `capacity` bytes in all (None: as many as a save needs), made by `allocate(id, size)`;
    `on_drop` is told when an arena is given up (the writer process unmaps it)."""

    def __init__(
        self,
        capacity: int | None = None,
        allocate: Callable[[int, int], Arena] | None = None,
        on_drop: Callable[[Arena], None] | None = None,
    ):
        self.capacity = capacity
        self._allocate = allocate or (lambda arena_id, size: host_arena(arena_id, size, pinned=False))
        self._on_drop = on_drop
        self.arenas: list[Arena] = []
        self._next_id = 0
        self._cond = threading.Condition()

    @property
    def allocated_bytes(self) -> int:
        return sum(a.size for a in self.arenas)

    def acquire(self, nbytes: int, wait: bool = True) -> Slot | None:
        """A slot of `nbytes`; when the pool is full, wait for releases (or return None if not `wait`)."""
        if self.capacity is not None and nbytes > self.capacity:
            raise UcpError(f"staging capacity {self.capacity} bytes is smaller than one chunk object ({nbytes} bytes)")
        with self._cond:
            while True:
                slot = self._carve(nbytes)
                if slot is not None:
                    return slot
                if self._grow(nbytes) or self._drop_an_empty_arena():
                    continue
                if not wait:
                    return None
                self._cond.wait()

    def reserve(self, sizes: Iterable[int]) -> None:
        """Make the arenas that slots of `sizes`, acquired in this order, will take (as far as the capacity allows),
        now rather than inside the first save: a save of the same chunks then allocates (and page-locks) nothing,
        and finds every page of its slots mapped (each slot is written here, a byte a page, while it is held)."""
        slots = []
        try:
            for nbytes in sizes:
                slot = self.acquire(nbytes, wait=False)
                if slot is None:
                    break  # (the capacity is reached: a save waits for writes to free memory anyway)
                slots.append(slot)
                slot.memory[::_PAGE].zero_()
        finally:
            for slot in slots:
                self.release(slot)

    def release(self, slot: Slot) -> None:
        with self._cond:
            arena = slot.arena
            arena.live -= 1
            if arena.live == 0:
                arena.used = 0
                self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            for arena in self.arenas:
                self._drop(arena)
            self.arenas = []

    def _carve(self, nbytes: int) -> Slot | None:
        for arena in self.arenas:
            start = -(-arena.used // _ALIGN) * _ALIGN
            if start + nbytes <= arena.size:
                arena.used = start + nbytes
                arena.live += 1
                return Slot(arena, start, nbytes, arena.memory[start : start + nbytes])
        return None

    def _grow(self, nbytes: int) -> bool:
        room = None if self.capacity is None else self.capacity - self.allocated_bytes
        if room is not None and room < nbytes:
            return False
        size = max(nbytes, ARENA_BYTES if room is None else min(ARENA_BYTES, room))
        self.arenas.append(self._allocate(self._next_id, size))
        self._next_id += 1
        return True

    def _drop_an_empty_arena(self) -> bool:
        """Make room for a larger arena by giving up an empty one (chunk sizes changed between saves)."""
        empty = next((a for a in self.arenas if a.live == 0), None)
        if empty is None:
            return False
        self.arenas.remove(empty)
        self._drop(empty)
        return True

    def _drop(self, arena: Arena) -> None:
        if self._on_drop is not None:
            self._on_drop(arena)
        close_arena(arena)
