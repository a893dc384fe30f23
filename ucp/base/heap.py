"""The process's memory: giving freed heap memory back to the OS, and pausing the cyclic garbage collector.

glibc keeps freed blocks in its heaps (its mmap threshold grows after the first large free), where fragmentation
can strand tensor-sized buffers: a process that streams many large tensors then holds resident memory it no
longer uses, and RSS stops telling live memory. `trim()` returns those pages (glibc only; elsewhere a no-op).
`collector_paused()` keeps Python's cyclic collector from walking the whole process while a save or load makes its
many small objects.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import gc
import threading
from collections.abc import Callable, Iterator


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    libc = ctypes.util.find_library("c")
    try:
        return getattr(ctypes.CDLL(libc), "malloc_trim", None) if libc else None
    except OSError:
        return None


def trim() -> None:
    malloc_trim = _malloc_trim()
    if malloc_trim is not None:
        malloc_trim(0)


_pause_lock = threading.Lock()
_pauses = 0  # callers inside `collector_paused` now (threads of a save and a load may overlap)
_was_enabled = False


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector paused for the duration (and resumed as it was after the last of several
    overlapping callers). A save or a load of many atoms makes tens of objects per atom, none of them cycles, and
    each batch of new objects triggers a collection; a full one walks every object of the process (a training job
    holds hundreds of thousands): measured on 5,000 atoms of 1-16 KiB, a save took 0.158 s with the collector on
    and 0.084 s paused, a load 0.133 s and 0.070 s. What becomes garbage meanwhile is collected afterwards."""
    global _pauses, _was_enabled
    with _pause_lock:
        if _pauses == 0:
            _was_enabled = gc.isenabled()
            gc.disable()
        _pauses += 1
    try:
        yield
    finally:
        with _pause_lock:
            _pauses -= 1
            if _pauses == 0 and _was_enabled:
                gc.enable()
