"""Handing freed memory back to the operating system: the allocator keeps the pages a large request
freed for reuse, and the process would otherwise stay at its peak size."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc
import os
from typing import Callable

M_MMAP_THRESHOLD, M_ARENA_MAX = -3, -8  # glibc's mallopt parameters
MMAP_THRESHOLD = 256 * 1024


@functools.lru_cache(maxsize=1)
def _libc():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc if hasattr(libc, "malloc_trim") and hasattr(libc, "mallopt") else None
    except OSError:
        return None


def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's malloc_trim, or None elsewhere."""
    libc = _libc()
    return libc.malloc_trim if libc is not None else None


def tune_allocator() -> None:
    """For a long-running server (glibc; nothing elsewhere): blocks of 256 KiB and more (request bodies,
    arrays) get pages of their own, handed back when freed. By default glibc raises that threshold to the
    largest block freed so far (up to 32 MiB), after which every 2 MB body lands in the heap and its pages
    stay; and two malloc arenas instead of eight per core leave fewer heaps to fragment."""
    libc = _libc()
    if libc is not None:
        libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)
        libc.mallopt(M_ARENA_MAX, 2)


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
