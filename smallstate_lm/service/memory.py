"""Handing freed memory back to the operating system: the allocator keeps the pages a large request
freed for reuse, and the process would otherwise stay at its peak size."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc
import os
from typing import Callable


@functools.lru_cache(maxsize=1)
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's malloc_trim, or None elsewhere."""
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


def rss_bytes() -> int:
    """The process's resident size (Linux; 0 elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def release_memory() -> None:
    """Collect garbage and hand what it and the last request freed back to the OS (in a thread: a full
    collection of a large heap takes a while)."""
    gc.collect()
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
