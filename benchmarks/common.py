"""Shared by the benchmarks: machine description and writing a section of docs/benchmarks.md."""

from __future__ import annotations

import os
import platform
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch

DOC = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"
HEADER = ("# Benchmarks\n\nEach section is written by the benchmark named in it; rerun the command to refresh it. "
          "On CPU only ratios measured in one run are reported (the machine is shared and noisy); "
          "absolute numbers come from a GPU.\n")


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:  # a VM may name only the vendor line ("AMD EPYC"): family, model and the matmul extensions tell more
        info: dict[str, str] = {}
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if not key.strip():
                break  # the first processor is enough
            info.setdefault(key.strip(), value.strip())
        flags = set(info.get("flags", "").split())
        ext = ("AMX" if "amx_tile" in flags else "no AMX") + (", AVX-512" if "avx512f" in flags else ", no AVX-512")
        cpu = (f"{info.get('model name', cpu)} (family {info.get('cpu family', '?')}, model {info.get('model', '?')}; "
               f"{ext})")
    except OSError:
        pass
    dev = f"CUDA {torch.cuda.get_device_name()}" if torch.cuda.is_available() else "no GPU"
    # CPU ratios move with what else runs: every multithreaded op waits for its slowest
    # thread, so a busy neighbour on a 2-core machine taxes the paths with more, smaller ops.
    load = f", load average {os.getloadavg()[0]:.1f} (this run included)" if hasattr(os, "getloadavg") else ""
    return (f"{cpu}, {os.cpu_count()} cores visible, torch {torch.__version__} with {torch.get_num_threads()} "
            f"threads, {dev}, Python {platform.python_version()}{load}")


def command() -> str:
    return "python " + " ".join([os.path.relpath(sys.argv[0])] + sys.argv[1:])


def paired_medians(fa: Callable[[], object], fb: Callable[[], object], repeats: int, b_per_a: int = 1,
                   sync: bool = False) -> tuple[float, float]:
    """Median seconds of fa and of fb, timed alternately (one fa, then b_per_a fb calls)
    so that load from other processes hits both alike."""
    fa(), fb()
    ta, tb = [], []
    for _ in range(repeats):
        for fn, out, n in ((fa, ta, 1), (fb, tb, b_per_a)):
            for _ in range(n):
                if sync:
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                fn()
                if sync:
                    torch.cuda.synchronize()
                out.append(time.perf_counter() - t0)
    return statistics.median(ta), statistics.median(tb)


def write_section(name: str, body: str, doc: Path = DOC, header: str = HEADER) -> None:
    """Replace (or append) the section delimited by markers for `name` in `doc`."""
    doc.parent.mkdir(parents=True, exist_ok=True)
    text = doc.read_text() if doc.exists() else header
    start, end = f"<!-- {name} -->", f"<!-- /{name} -->"
    block = f"{start}\n{body.rstrip()}\n{end}"
    pattern = re.compile(re.escape(start) + r".*?" + re.escape(end), re.S)
    text = pattern.sub(lambda _: block, text) if pattern.search(text) else text.rstrip() + "\n\n" + block + "\n"
    tmp = doc.with_suffix(".md.tmp")
    tmp.write_text(text)
    os.replace(tmp, doc)
