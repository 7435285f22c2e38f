"""The compiled twins of sequential loops (`_native.c`: the lazy k-best search, the walk over a vector
FST's state records and their writing, the searches over a graph numbered in topological order, and the
merging of paths by key),
loaded with ctypes. `library()` is None where `scripts/build_native.sh` (run by
setup.sh) did not build `_native.so` from this very `_native.c`, or where SMALLSTATE_NO_NATIVE is set: the Python code,
which gives the same results, runs instead."""

from __future__ import annotations

import ctypes
import hashlib
import os
import warnings
from functools import lru_cache
from pathlib import Path

import numpy as np

SOURCE = Path(__file__).with_name("_native.c")
LIBRARY = Path(__file__).with_name("_native.so")


@lru_cache(maxsize=1)
def library():
    if os.environ.get("SMALLSTATE_NO_NATIVE"):
        return None
    try:
        lib = ctypes.CDLL(str(LIBRARY))
        lib.ssl_source.restype = ctypes.c_char_p
        built_from = lib.ssl_source().decode()
        if SOURCE.exists() and built_from != hashlib.sha1(SOURCE.read_bytes()).hexdigest():
            warnings.warn(f"{LIBRARY} was built from another version of {SOURCE.name}: the Python code runs "
                          "instead (same results, slower); run scripts/build_native.sh", RuntimeWarning, stacklevel=2)
            return None  # its functions may not be ours
    except (OSError, AttributeError):
        return None
    i64, f64, u8 = (np.ctypeslib.ndpointer(dtype=t, flags="C_CONTIGUOUS") for t in (np.int64, np.float64, np.uint8))
    n = ctypes.c_int64
    lib.ssl_kbest.restype = n
    lib.ssl_kbest.argtypes = [n, i64, f64, i64, i64, i64, n, n, n, f64, i64, i64, i64, n, i64, i64]
    lib.ssl_vector_read.restype = n
    lib.ssl_vector_read.argtypes = [u8, n, n, n, n, n, i64, u8, u8, i64]
    lib.ssl_group_min.restype = n
    lib.ssl_group_min.argtypes = [n, i64, i64, f64, i64, i64, i64]
    lib.ssl_vector_write.restype = None
    lib.ssl_levels_up.restype = lib.ssl_viterbi_up.restype = lib.ssl_backward_up.restype = None
    lib.ssl_levels_up.argtypes = [n, n, i64, i64, i64]
    lib.ssl_viterbi_up.argtypes = [n, n, i64, i64, f64, n, i64, f64, i64]
    lib.ssl_backward_up.argtypes = [n, i64, i64, f64, f64]
    lib.ssl_vector_write.argtypes = [n, n, np.ctypeslib.ndpointer(dtype=np.float32, flags="C_CONTIGUOUS"), i64, u8, u8]
    return lib


def upward(src: np.ndarray, dst: np.ndarray, num_nodes: int, *per_arc: np.ndarray) -> bool:
    """What the `*_up` functions need: arcs sorted by source, every one going up between nodes of
    [0, num_nodes), and the per-arc arrays as long as `src` (anything else takes the Python path,
    which raises where the input is wrong)."""
    if len(src) != len(dst) or any(len(a) != len(src) for a in per_arc):
        return False
    if len(src) == 0:
        return True
    return (bool(src[0] >= 0) and bool(np.all(src[1:] >= src[:-1])) and bool(np.all(src < dst))
            and int(dst.max()) < num_nodes)


def as_int64(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.int64)
