"""The process's memory: giving freed heap memory back to the OS, faulting in memory about to be written, and
pausing the cyclic garbage collector.

glibc keeps freed blocks in its heaps (its mmap threshold grows after the first large free), where fragmentation
can strand tensor-sized buffers: a process that streams many large tensors then holds resident memory it no
longer uses, and RSS stops telling live memory. `trim()` returns those pages (glibc only; elsewhere a no-op).
`populate()` takes the page faults of memory a read is about to fill in one system call, before the read.
`collector_paused()` keeps Python's cyclic collector from walking the whole process while a save or load makes its
many small objects.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import gc
import mmap
import threading
from collections.abc import Callable, Iterable, Iterator


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


@functools.cache
def _madvise() -> Callable[..., int] | None:
    libc = ctypes.util.find_library("c")
    try:
        madvise = getattr(ctypes.CDLL(libc, use_errno=True), "madvise", None) if libc else None
    except OSError:
        return None
    if madvise is not None:
        madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    return madvise


MADV_POPULATE_WRITE = 23  # Linux 5.14+; an older kernel refuses it (EINVAL), and nothing is done
PAGE_BYTES = mmap.PAGESIZE
POPULATE_MIN_BYTES = 256 << 10  # (below this the call costs more than the faults it saves)


def populate(buffers: Iterable[memoryview]) -> None:
    """Fault in the pages of writable contiguous `buffers` (each of POPULATE_MIN_BYTES or more) that a read is about
    to fill, one system call each, with the GIL released, their contents unchanged. Memory a process has never
    touched (every tensor a load makes) faults page by page as it is first written: where the writer is one thread
    for many reads (the event loop that copies every S3 response into its buffers, holding the GIL) those faults are
    taken there one at a time, in series with everything else it does; here each reading thread takes its own
    buffers' in one call, 2-4x cheaper than one fault a page (1 GiB: 0.24 s against 0.4-0.9 s of system time,
    measured on 2 cores). A reader that writes its buffers itself (a file's `preadv`) takes their faults in its own
    thread anyway: it gains little (docs/BENCHMARKS.md, "fresh memory"). Where the system call is missing or
    refused, the pages fault as they are written."""
    madvise = _madvise()
    if madvise is None:
        return
    for buffer in buffers:
        if buffer.nbytes < POPULATE_MIN_BYTES or buffer.readonly or not buffer.c_contiguous:
            continue
        start = ctypes.addressof(ctypes.c_char.from_buffer(buffer))
        first = start - start % PAGE_BYTES
        if madvise(first, start + buffer.nbytes - first, MADV_POPULATE_WRITE) != 0:
            return  # (refused: not this kernel's, or not such memory; the read faults them in)


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
