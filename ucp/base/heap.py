"""Giving freed heap memory back to the OS.

glibc keeps freed blocks in its heaps (its mmap threshold grows after the first large free), where fragmentation
can strand tensor-sized buffers: a process that streams many large tensors then holds resident memory it no
longer uses, and RSS stops telling live memory. `trim()` returns those pages (glibc only; elsewhere a no-op).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from collections.abc import Callable


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
