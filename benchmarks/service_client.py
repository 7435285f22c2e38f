"""The service benchmarks' servers and client: `smallstate-lm serve` processes on loopback, a minimal
asyncio HTTP/1.1 client (the load generator must cost far less than the server), and requests built
from the dev n-best lists."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from smallstate_lm.rescoring.nbest.lists import read_nbest  # noqa: E402

DEV = ROOT.parent / "shared" / "data" / "dev"


# ---------------------------------------------------------------------------------------------
# Servers


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, args, batching: bool, log: Path, settings: tuple[str, ...] = ()):
        self.port = free_port()
        cmd = [sys.executable, "-m", "smallstate_lm.cli", "serve", "--port", str(self.port), "--device", args.device,
               "--batching" if batching else "--no-batching", "--set", "log_level=warning",
               "--set", f"max_wait_ms={args.max_wait_ms}", "--set", "max_queue=1024"]
        for setting in settings:
            cmd += ["--set", setting]
        if args.lm:
            cmd += ["--lm", args.lm]
        if args.ngram:
            cmd += ["--ngram", args.ngram]
        if args.threads:
            cmd += ["--threads", str(args.threads)]
        self.log = log
        self.proc = subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, cwd=ROOT)

    def wait_ready(self, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited:\n{self.log.read_text()}")
            try:
                status, _ = asyncio.run(http_get(self.port, "/readyz"))
                if status == 200:
                    return
            except OSError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"server not ready after {timeout} s:\n{self.log.read_text()}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()


# ---------------------------------------------------------------------------------------------
# A minimal HTTP/1.1 client: the load generator must cost far less than the server


async def read_response(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    status = int(lines[0].split(b" ", 2)[1])
    length = next(int(v) for k, _, v in (ln.partition(b":") for ln in lines[1:]) if k.lower() == b"content-length")
    return status, await reader.readexactly(length)


async def http_get(port: int, path: str) -> tuple[int, bytes]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"GET {path} HTTP/1.1\r\nHost: bench\r\nConnection: close\r\n\r\n".encode())
    await writer.drain()
    try:
        return await read_response(reader)
    finally:
        writer.close()


def service_section(kind: str, args) -> str:
    """The docs section a service benchmark writes: per device, and per precision other than fp32."""
    name = f"{kind}-{'cuda' if args.device.startswith('cuda') else 'cpu'}"
    return name if args.precision == "fp32" else f"{name}-{args.precision}"


def post_bytes(body: bytes, path: str = "/rescore", headers: str = "") -> bytes:
    """A whole POST request; `headers`: extra header lines, each ending in CRLF."""
    return (f"POST {path} HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n{headers}"
            f"Content-Length: {len(body)}\r\n\r\n").encode() + body


async def user(port: int, requests: list[bytes], offset: int, t_begin: float, t_end: float, out: list) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    i = offset
    try:
        while True:
            t0 = time.perf_counter()
            if t0 >= t_end:
                return
            writer.write(requests[i % len(requests)])
            await writer.drain()
            status, _ = await read_response(reader)
            t1 = time.perf_counter()
            if t0 >= t_begin:  # requests started during the warm-up are not counted
                out.append((t1, t1 - t0, status))
            i += 7  # users walk the list at different phases
    finally:
        writer.close()


async def load(port: int, requests: list[bytes], concurrency: int, warmup: float, seconds: float) -> dict:
    t_begin = time.perf_counter() + warmup
    t_end = t_begin + seconds
    out: list = []
    await asyncio.gather(*[user(port, requests, k * len(requests) // concurrency, t_begin, t_end, out)
                           for k in range(concurrency)])
    bad = [s for _, _, s in out if s != 200]
    if bad:
        raise RuntimeError(f"{len(bad)} requests failed (statuses {sorted(set(bad))})")
    lat = sorted(x for _, x, _ in out)
    span = max(t for t, _, _ in out) - t_begin
    return {"requests": len(lat), "rps": len(lat) / span, "p50": 1000 * lat[len(lat) // 2],
            "p99": 1000 * lat[min(len(lat) - 1, int(0.99 * len(lat)))], "mean": 1000 * statistics.fmean(lat)}


def batch_counts(port: int) -> tuple[float, float]:
    """(batches, requests in them) from the server's metrics."""
    _, text = asyncio.run(http_get(port, "/metrics"))
    vals = {}
    for line in text.decode().splitlines():
        if line.startswith("smallstate_batch_requests_"):
            k, v = line.split(" ")
            vals[k] = float(v)
    return vals.get("smallstate_batch_requests_count", 0.0), vals.get("smallstate_batch_requests_sum", 0.0)


# ---------------------------------------------------------------------------------------------


def build_requests(paths: list[str], n_hyps: int | None, limit: int) -> tuple[list[bytes], float]:
    """One request per utterance: its first `n_hyps` hypotheses (all when None)."""
    utts = [u for p in paths for u in read_nbest(p)][:limit]
    reqs, hyps = [], 0
    for u in utts:
        hs = u.hyps[:n_hyps] if n_hyps else u.hyps
        hyps += len(hs)
        body = {"utterances": [{"id": u.utt, "hypotheses": [{"words": h.words, "am_score": h.am,
                                                             "graph_score": h.graph} for h in hs]}]}
        reqs.append(post_bytes(json.dumps(body).encode()))
    return reqs, hyps / len(utts)
