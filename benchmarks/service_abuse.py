"""`bench_service.py --abuse`: a fixed mix of small and near-limit requests, stalled uploads, clients that
hang up and wedge shapes against one server; its rules and report (docs/benchmarks.md)."""

from __future__ import annotations

import argparse
import asyncio
import collections
import dataclasses
import json
import math
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from common import command, machine, write_section
from service_client import (
    ROOT,
    ServerProcess,
    build_requests,
    http_get,
    post_bytes,
    read_response,
    service_section,
)

from smallstate_lm.rescoring.nbest.lists import read_nbest

# ---------------------------------------------------------------------------------------------
# --abuse: a fixed mix of small and near-limit requests, stalled uploads and clients that hang up

# Limits low enough that a near-limit request costs the CPU worker about a second, not a minute; timeouts short
# enough that the stalled uploads end within the run.
ABUSE_SETTINGS = ("max_trie_nodes=5000", "max_lattice_cost=50000", "header_timeout_s=5", "body_timeout_s=5")


HEAVY_KINDS = ("heavy lists", "heavy lattices")  # the near-limit packs, which alternate


def nbest_packs(paths: list[str], limit: int, n: int, max_utts: int) -> list[bytes]:
    """`n` requests of whole dev n-best lists, each packed to 80-100% of `limit` trie nodes (counted on
    words, which bounds the LM's count: OOVs only merge prefixes) or to `max_utts` utterances, whichever
    comes first."""
    utts = [u for p in paths for u in read_nbest(p)]
    reqs, k = [], 0
    while len(reqs) < n:
        body, nodes = [], 0
        while nodes < 0.8 * limit and len(body) < max_utts:
            u = utts[k % len(utts)]
            k += 1
            size = len({tuple(h.words[:i]) for h in u.hyps for i in range(1, len(h.words) + 1)}) + len(u.hyps)
            if nodes + size > limit:
                continue
            nodes += size
            body.append({"id": f"{u.utt}-{k}", "hypotheses": [{"words": h.words, "am_score": h.am,
                                                               "graph_score": h.graph} for h in u.hyps]})
        reqs.append(post_bytes(json.dumps({"utterances": body}).encode()))
    return reqs


def lattice_packs(dev: Path, limit: int, max_per_state: int, n: int, max_utts: int) -> list[bytes]:
    """`n` requests of real dev lattices (`dev`/festival_*/fst/*.lat.fst, words.txt in `dev`; OpenFST text,
    words as labels), each packed to 80-100% of `limit` estimated LM steps or to `max_utts` lattices, whichever
    comes first."""
    from smallstate_lm.rescoring.formats.lattice_io import lattice_to_text, read_fst
    from smallstate_lm.rescoring.lattices.lattice import SymbolTable
    from smallstate_lm.service.frontend.inputs import lattice_cost

    symbols = SymbolTable.read(dev / "words.txt")
    lats = []
    for path in sorted(dev.glob("festival_*/fst/*.lat.fst"))[:80]:
        lat = read_fst(path, symbols).prepare()
        cost = lattice_cost(lat, max_per_state)
        if cost <= limit:
            lines = [ln.split("\t") for ln in lattice_to_text(lat).splitlines()]
            text = "\n".join("\t".join(p[:2] + [symbols.word(int(p[2]))] * 2 + p[4:]) if len(p) == 5 else "\t".join(p)
                             for p in lines)
            lats.append((cost, {"id": path.stem, "lattice": {"format": "openfst-text", "data": text + "\n"}}))
    reqs, k = [], 0
    while len(reqs) < n:
        body, total = [], 0
        while total < 0.8 * limit and len(body) < max_utts:
            cost, utt = lats[k % len(lats)]
            k += 1
            if total + cost <= limit:
                total += cost
                body.append(utt)
        reqs.append(post_bytes(json.dumps({"utterances": body}).encode()))
    return reqs


async def run_fixed(port: int, reqs: list[tuple[str, bytes]], concurrency: int,
                    out: list | None = None) -> list[tuple[str, float, int]]:
    """Every request once, `concurrency` at a time, each user on a keep-alive connection (a new one after
    an error answer): (kind, seconds, status) per request, appended to `out` as they come (others watch
    its length for progress); status 0 for one that got no answer."""
    queue = collections.deque(reqs)
    out = [] if out is None else out

    async def user() -> None:
        reader = writer = None
        while queue:
            kind, data = queue.popleft()
            t0 = time.perf_counter()
            try:
                if writer is None:
                    reader, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.write(data)
                await writer.drain()
                status, _ = await read_response(reader)
            except (OSError, asyncio.IncompleteReadError, ValueError, RuntimeError):
                status = 0
            out.append((kind, time.perf_counter() - t0, status))
            if status != 200 and writer is not None:
                writer.close()
                writer = None
        if writer is not None:
            writer.close()

    await asyncio.gather(*[user() for _ in range(concurrency)])
    return out


async def hang_up(port: int, data: bytes, start: float, after: float) -> None:
    """A client that sends a request and closes the connection `after` seconds later."""
    await asyncio.sleep(start)
    _, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)
    await writer.drain()
    await asyncio.sleep(after)
    writer.close()


async def stall(port: int, head: bool, start: float, wait: float) -> float | None:
    """Half a request head (or a head and half its body), then nothing: the seconds until the server
    answered or closed, None if it did neither within `wait`."""
    await asyncio.sleep(start)
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"POST /rescore HTTP/1.1\r\nHost: bench\r\nContent-Ty" if head else
                 b"POST /rescore HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 1000\r\n\r\n{\"utterances\": [")
    await writer.drain()
    t0 = time.perf_counter()
    try:
        await asyncio.wait_for(reader.read(65536), wait)
        return time.perf_counter() - t0
    except asyncio.TimeoutError:
        return None
    finally:
        writer.close()


async def mixed_run(port: int, reqs: list[tuple[str, bytes]], heavy: list[bytes], wedges: list["Wedge"],
                    probe: bytes, args) -> tuple[list, list, list]:
    """The mixed requests, with the hang-ups and the stalls spread over the first ten seconds and the
    wedges sent by `args.wedge_clients` extra clients, each when the mix has done a random share
    (5-80%) of its requests: (the mix's results, the stalls' seconds, the wedges' results)."""
    rng = random.Random(1)
    extra = [hang_up(port, heavy[i % len(heavy)], rng.uniform(0, 10), rng.uniform(0.05, 0.5))
             for i in range(args.disconnects)]
    stalls = [stall(port, i % 2 == 0, rng.uniform(0, 10), 60) for i in range(args.stalls)]
    progress: list = []
    timed = sorted(((rng.uniform(0.05, 0.8), w) for w in wedges), key=lambda t: t[0])  # moments: shares of the mix
    clients = [wedge_client(port, timed[k::args.wedge_clients], progress, len(reqs), probe)
               for k in range(args.wedge_clients if wedges else 0)]
    results = await asyncio.gather(run_fixed(port, reqs, max(args.concurrency), progress), *clients, *stalls,
                                   *extra)
    wedged = [r for rs in results[1:1 + len(clients)] for r in rs]
    return results[0], list(results[1 + len(clients):1 + len(clients) + len(stalls)]), wedged


# ---------------------------------------------------------------------------------------------
# --abuse wedges: request shapes built to hold the worker, the parser or the memory

HUNG_UP = 499  # the status recorded for a request whose client hung up before its answer (as the metrics do)
REFUSED = (400, 408, 413, 415, 422, 429, 503)  # what a request refused before (or instead of) its work gets


@dataclasses.dataclass(frozen=True)
class Wedge:
    shape: str
    data: bytes  # the whole HTTP request
    hang_up_after: float | None = None  # the client closes its connection after this many seconds
    deadline: bool = False  # sent with X-Request-Timeout: a 504 is an answer it asked for


def frequent_words(args, n: int) -> list[str]:
    """The `n` most frequent words the LMs know: the neural LM's vocabulary (ordered by frequency), or, for
    an n-gram only (or a checkpoint file), the words of the dev n-best lists by count."""
    from smallstate_lm.vocab import SPECIALS, Vocabulary

    vocab = Path(args.lm) / "vocab.txt" if args.lm else None
    if vocab is not None and vocab.is_file():
        words = [w for w in Vocabulary.load(vocab).words if w not in SPECIALS]
    else:
        counts = collections.Counter(w for p in args.nbest for u in read_nbest(p) for h in u.hyps for w in h.words)
        words = [w for w, _ in counts.most_common() if w not in SPECIALS]
    if len(words) < n:
        sys.exit(f"bench_service: the wedges need {n} distinct words, found {len(words)}")
    return words[:n]


def build_wedges(words: list[str], repeats: int) -> tuple[list[Wedge], dict[str, Wedge], list[Wedge]]:
    """Every wedge shape of the mix `repeats` times, one of each shape by name (the idle ones too), and the
    idle ones `repeats` times. `words`: at least 2,064 distinct in-vocabulary words, the most frequent first."""
    rng = random.Random(2)
    common = words[:14]

    def nbest(n_hyps: int) -> bytes:
        hyps = [{"words": [rng.choice(common) for _ in range(100)], "am_score": round(-1000 * (1 + rng.random()), 2)}
                for _ in range(n_hyps)]
        return json.dumps({"utterances": [{"id": f"deep-{n_hyps}", "hypotheses": hyps}]}).encode()

    def lattice(arcs: list[tuple[int, int, str]], final: int) -> bytes:
        text = "".join(f"{a}\t{b}\t{w}\t{w}\t1.0,1.0\n" for a, b, w in arcs) + f"{final}\t0,0\n"
        return json.dumps({"utterances": [{"id": "wedge", "lattice": {"format": "openfst-text",
                                                                       "data": text}}]}).encode()

    deep = {h: nbest(h) for h in (200, 700, 1000)}
    fan = lattice([(0, 1, w) for w in words[:64]] + [(1, 2, w) for w in words[64:2064]], 2)
    sausage = lattice([(k, k + 1, w) for k in range(40) for w in common], 40)
    timeout = "X-Request-Timeout: 2\r\n"
    shapes = [*(Wedge(f"n-best {h} x 100 words", post_bytes(body)) for h, body in deep.items()),
              Wedge("fan lattice 64 x 2000 arcs", post_bytes(fan)),
              Wedge("sausage lattice 40 x 14 arcs", post_bytes(sausage)),
              Wedge("JSON 2000 deep, /rescore", post_bytes(b"[" * 2000 + b"]" * 2000)),
              Wedge("JSON 3000 deep, /score", post_bytes(b'{"sentences":' + b"[" * 3000 + b"]" * 3000 + b"}",
                                                         "/score")),
              Wedge("n-best 1000, X-Request-Timeout 2", post_bytes(deep[1000], headers=timeout), deadline=True),
              Wedge("n-best 1000, hang-up after 1 s", post_bytes(deep[1000]), hang_up_after=1.0),
              Wedge("sausage, X-Request-Timeout 2", post_bytes(sausage, headers=timeout), deadline=True),
              Wedge("sausage, hang-up after 1 s", post_bytes(sausage), hang_up_after=1.0)]
    # sent to the idle server after the mix, one at a time, so that the work they start is stopped part-way and
    # the request right after them shows whether the worker is free again
    idle = [Wedge("idle: n-best 200 x 100, hang-up after 1 s", post_bytes(deep[200]), hang_up_after=1.0),
            Wedge("idle: sausage, hang-up after 1 s", post_bytes(sausage), hang_up_after=1.0),
            Wedge("idle: sausage, X-Request-Timeout 2", post_bytes(sausage, headers=timeout), deadline=True)]
    return ([w for w in shapes for _ in range(repeats)], {w.shape: w for w in shapes + idle},
            [w for w in idle for _ in range(repeats)])


async def idle_stops(port: int, wedges: list, probe: bytes) -> list[dict]:
    """Each wedge alone, then at once the small `probe` after each 504 or hang-up."""
    return await wedge_client(port, [(0.0, w) for w in wedges], [], 0, probe)


async def send_once(port: int, data: bytes, hang_up_after: float | None = None,
                    wait: float = 120.0) -> tuple[int, float]:
    """One request on its own connection: (status, seconds); HUNG_UP when the client closed the connection
    after `hang_up_after` s without an answer, 0 when the server closed it or did not answer in `wait` s."""
    t0 = time.perf_counter()
    writer = None
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(data)
        await writer.drain()
        status, _ = await asyncio.wait_for(read_response(reader), hang_up_after or wait)
    except asyncio.TimeoutError:
        status = HUNG_UP if hang_up_after else 0
    except (OSError, asyncio.IncompleteReadError, ValueError, RuntimeError, StopIteration):
        status = 0
    finally:
        if writer is not None:
            writer.close()
    return status, time.perf_counter() - t0


async def wedge_client(port: int, timed: list[tuple[float, Wedge]], progress: list, total: int,
                       probe: bytes) -> list[dict]:
    """Sends each wedge once the mix has done its share of `total` requests (`progress` grows as it goes);
    after a 504 or a hang-up, at once a small request (`probe`), timed."""
    out = []
    for share, w in timed:
        while len(progress) < share * total and len(progress) < total:
            await asyncio.sleep(0.01)
        status, seconds = await send_once(port, w.data, w.hang_up_after)
        row = {"shape": w.shape, "status": status, "seconds": seconds, "deadline": w.deadline}
        if status in (504, HUNG_UP):
            row["probe_status"], row["probe_seconds"] = await send_once(port, probe)
        out.append(row)
    return out


class RssSampler(threading.Thread):
    """The server's resident memory every `period` s, its peak kept."""

    def __init__(self, pid: int, period: float = 0.1):
        super().__init__(daemon=True)
        self.pid, self.period, self.peak, self.samples = pid, period, 0.0, 0
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            try:
                self.peak = max(self.peak, server_rss_mib(self.pid))
                self.samples += 1
            except (OSError, ValueError):  # the process is gone
                return
            self.done.wait(self.period)

    def stop(self) -> float:
        self.done.set()
        self.join()
        return self.peak


async def shutdown_run(server: "ServerProcess", in_flight: list[tuple[str, bytes]], settle: float,
                       limit: float) -> dict:
    """Sends `in_flight`, waits `settle` s (their bodies in, their work begun), then SIGTERM: the seconds until
    the process exits (killed after `limit` + 30 s) and its exit code, and what each request got."""
    sends = [asyncio.create_task(send_once(server.port, data, wait=limit + 30)) for _, data in in_flight]
    await asyncio.sleep(settle)
    t0 = time.perf_counter()
    server.proc.send_signal(signal.SIGTERM)
    try:
        code = await asyncio.to_thread(server.proc.wait, limit + 30)
    except subprocess.TimeoutExpired:
        server.proc.kill()
        code = None
    seconds = time.perf_counter() - t0
    answers = await asyncio.gather(*sends)
    return {"seconds": seconds, "exit_code": code, "limit": limit,
            "requests": [{"shape": shape, "status": s, "seconds": t} for (shape, _), (s, t) in zip(in_flight, answers)]}


def server_rss_mib(pid: int, field: str = "VmRSS") -> float:
    """The server's resident memory (`VmRSS`), or a part of it: `RssAnon` (its own heap) or `RssFile` (pages of
    mapped files, such as the n-gram's, which the kernel may drop); summed over every process of it (`pid` and
    its descendants: supervisor, engine, front-ends)."""
    total, todo, seen = 0.0, [pid], False
    while todo:
        p = todo.pop()
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith(field + ":"):
                    total += int(line.split()[1]) / 1024
                    seen = True
            for task in Path(f"/proc/{p}/task").iterdir():
                todo += map(int, (task / "children").read_text().split())
        except OSError:  # gone meanwhile
            if p == pid:
                raise
    return total if seen else float("nan")


def metric(text: str, name: str, **labels) -> float:
    """Sum of the samples of `name` whose labels include `labels`, in the server's /metrics `text`."""
    total = 0.0
    for line in text.splitlines():
        key, _, value = line.rpartition(" ")
        if key.partition("{")[0] == name and all(f'{k}="{v}"' in key for k, v in labels.items()):
            total += float(value)
    return total


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return 1000 * xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def dev_dir(args: argparse.Namespace) -> Path:
    """The dev data whose lattices the packs take: --dev, else the directory above the n-best lists'
    (DIR/festival_x/nbest.tsv -> DIR; links not followed)."""
    dev = Path(args.dev) if args.dev else Path(args.nbest[0]).absolute().parent.parent
    if not (dev / "words.txt").is_file() or not any(dev.glob("festival_*/fst/*.lat.fst")):
        sys.exit(f"bench_service --abuse: no dev lattices in {dev} (expected festival_*/fst/*.lat.fst and words.txt "
                 f"there; give --dev DIR)")
    return dev


def run_abuse(args: argparse.Namespace) -> None:
    from smallstate_lm.service.settings import Settings

    dev = dev_dir(args)  # before any pack is built

    settings = [*ABUSE_SETTINGS, f"precision={args.precision}", *args.settings]
    server_settings = Settings.from_env(assignments=settings)  # as the server reads them (it inherits our environment)
    n_heavy = round(args.requests * args.heavy_share)
    small = [("small", r) for r in build_requests(args.nbest, 5, args.utts)[0]]
    half, utts = (n_heavy + 1) // 2, server_settings.max_utterances
    packs = zip(nbest_packs(args.nbest, server_settings.max_trie_nodes, half, utts),
                lattice_packs(dev, server_settings.max_lattice_cost, server_settings.max_per_state,
                              half, utts))
    heavy = [r for pair in packs for r in pair][:n_heavy]
    mixed = [small[i % len(small)] for i in range(args.requests - n_heavy)] + [(HEAVY_KINDS[i % 2], r)
                                                                               for i, r in enumerate(heavy)]
    random.Random(0).shuffle(mixed)
    alone = [small[i % len(small)] for i in range(args.requests - n_heavy)]
    words = frequent_words(args, 2064)
    wedges, wedge_shapes, idle_wedges = build_wedges(words, args.wedges)
    probe = post_bytes(json.dumps({"utterances": [{"id": "probe", "hypotheses": [
        {"words": words[:3], "am_score": -10.0}]}]}).encode())
    # in flight at SIGTERM: wedges (two sausages, which the limits admit, a deep list, a fan) and heavy requests
    at_sigterm = ("sausage lattice 40 x 14 arcs",) * 2 + ("n-best 1000 x 100 words", "fan lattice 64 x 2000 arcs")
    in_flight = [(s, wedge_shapes[s].data) for s in at_sigterm if args.wedges] + [("heavy", r) for r in heavy[:2]]
    logs = ROOT / "runs" / "bench_service"
    logs.mkdir(parents=True, exist_ok=True)
    server = ServerProcess(args, True, logs / "abuse.log", tuple(settings))
    try:
        server.wait_ready()
        slice_ms = float(json.loads(asyncio.run(http_get(server.port, "/v1/models"))[1])["batching"]["slice_ms"])
        c = max(args.concurrency)
        asyncio.run(run_fixed(server.port, small[:200], 8))  # warm-up
        rss0 = server_rss_mib(server.proc.pid)
        anon0 = server_rss_mib(server.proc.pid, "RssAnon")
        sampler = RssSampler(server.proc.pid)
        sampler.start()
        t0 = time.perf_counter()
        base = asyncio.run(run_fixed(server.port, alone, c))
        t1 = time.perf_counter()
        out, stalls, wedged = asyncio.run(mixed_run(server.port, mixed, heavy, wedges, probe, args))
        t2 = time.perf_counter()
        time.sleep(3)  # the hang-ups' work is stopped
        wedged += asyncio.run(idle_stops(server.port, idle_wedges, probe))
        wedged.sort(key=lambda r: list(wedge_shapes).index(r["shape"]))  # stable: in the order sent, by shape
        time.sleep(3)  # large requests' memory given back
        rss1 = server_rss_mib(server.proc.pid)
        anon1 = server_rss_mib(server.proc.pid, "RssAnon")
        text = asyncio.run(http_get(server.port, "/metrics"))[1].decode()
        counts = {k: metric(text, f"smallstate_{k}_total") for k in ("requests_cancelled", "work_cancelled",
                                                                    "header_timeouts")}
        counts["408"] = metric(text, "smallstate_requests_total", status="408")
        for stage in ("wait", "price"):  # the server's view of the pricing process, over the whole run
            for part in ("count", "sum"):
                counts[f"pricing {stage} {part}"] = metric(text, f"smallstate_pricing_seconds_{part}", stage=stage)
            counts[f"pricing {stage} over 50 ms"] = counts[f"pricing {stage} count"] - metric(
                text, "smallstate_pricing_seconds_bucket", stage=stage, le="0.05")
        rss_peak = sampler.stop()
        grace = server_settings.drain_seconds + server_settings.graceful_timeout_s
        shutdown = asyncio.run(shutdown_run(server, in_flight, 1.0, grace))
    finally:
        server.stop()
    rss = {"before": rss0, "peak": rss_peak, "after": rss1, "samples": sampler.samples, "anon_before": anon0,
           "anon_after": anon1}
    body, summary = abuse_report(args, settings, base, out, stalls, counts, rss, (t1 - t0, t2 - t1), wedged,
                                 slice_ms, shutdown, server_settings)
    print(body)
    if not args.no_write:
        write_section(service_section("bench_service-abuse", args), body, Path(args.doc))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(summary, indent=1) + "\n")


def latency_cells(ms: list[float]) -> str:
    """p50 / p90 / max of seconds, in ms."""
    return f"{percentile(ms, 0.5):.0f} / {percentile(ms, 0.9):.0f} / {1000 * max(ms):.0f} ms" if ms else "-"


def abuse_report(args, settings, base, out, stalls, counts, rss, seconds, wedged, slice_ms, shutdown,
                 server_settings) -> tuple[str, dict]:
    """The markdown section and its numbers (for --json)."""
    statuses = collections.Counter((kind, status) for kind, _, status in out)
    lost = sum(n for (_, status), n in statuses.items() if status == 0)
    p99_alone = percentile([t for _, t, s in base if s == 200], 0.99)
    p99_mixed = percentile([t for k, t, s in out if k == "small" and s == 200], 0.99)
    heavy_ms = [t for k, t, s in out if k.startswith("heavy") and s == 200]
    timed_out = [t for t in stalls if t is not None]
    table = ", ".join(f"{kind} {status}: {n}" for (kind, status), n in sorted(statuses.items()))
    # every answer of the run: (what, status, whether it asked for a short deadline)
    answers = ([(k, s, False) for k, _, s in base + out] + [(w["shape"], w["status"], w["deadline"]) for w in wedged]
               + [("probe", w["probe_status"], False) for w in wedged if "probe_status" in w]
               + [(f"at SIGTERM: {r['shape']}", r["status"], False) for r in shutdown["requests"]])
    bad_5xx = collections.Counter((k, s) for k, s, deadline in answers
                                  if s >= 500 and s != 503 and not (s == 504 and deadline))
    asked_504 = sum(1 for _, s, deadline in answers if s == 504 and deadline)
    n_5xx = sum(bad_5xx.values())
    # heavy and wedge requests: refused ones must be quick, answered ones are a distribution
    heavy_rows = [(k, t, s) for k, t, s in out if k.startswith("heavy")] + [(w["shape"], w["seconds"], w["status"])
                                                                           for w in wedged]
    refusals = {k: [t for kk, t, s in heavy_rows if kk == k and s in REFUSED] for k in HEAVY_KINDS}
    slowest_refusal = {k: 1000 * max(v, default=math.nan) for k, v in refusals.items()}
    refused = [t for _, t, s in heavy_rows if s in REFUSED]
    refused_max = 1000 * max(refused) if refused else float("nan")
    refused_p99 = 1000 * sorted(refused)[min(len(refused) - 1, int(0.99 * len(refused)))] if refused else float("nan")
    ok = [t for _, t, s in heavy_rows if s == 200]
    # the worker is free after a stopped request when nothing else keeps it busy: judged on the idle phase (in the
    # mix a probe queues like any small request; those are shown, not judged)
    probes = [w["probe_seconds"] for w in wedged if "probe_seconds" in w and w["shape"].startswith("idle:")]
    mix_probes = [w["probe_seconds"] for w in wedged if "probe_seconds" in w and not w["shape"].startswith("idle:")]
    probe_max = 1000 * max(probes) if probes else float("nan")
    ratio = p99_mixed / p99_alone
    rss_ratio = rss["after"] / rss["before"]
    code, exit_s, grace = shutdown["exit_code"], shutdown["seconds"], shutdown["limit"]

    by_shape: dict[str, list] = collections.defaultdict(list)
    for w in wedged:
        by_shape[w["shape"]].append(w)
    wedge_rows = []
    for shape, rows in by_shape.items():
        sts = collections.Counter(r["status"] for r in rows)
        ref = [r["seconds"] for r in rows if r["status"] in REFUSED]
        answered = [r["seconds"] for r in rows if r["status"] == 200]
        after = [r["probe_seconds"] for r in rows if "probe_seconds" in r]
        wedge_rows.append(
            f"| {shape} | {len(rows)} | {', '.join(f'{s}: {n}' for s, n in sorted(sts.items()))} | "
            f"{f'{1000 * max(ref):.0f} ms' if ref else '-'} | {latency_cells(answered)} | "
            f"{f'{1000 * max(after):.0f} ms ({len(after)})' if after else '-'} |")
    sd = collections.Counter(r["status"] for r in shutdown["requests"])

    def verdict(passed: bool | None) -> str:
        return "n/a" if passed is None else "PASS" if passed else "FAIL"

    rules = [
        ("5xx other than 503 (a 504 counts unless the request asked for a 2 s deadline)", n_5xx == 0,
         f"{n_5xx}" + (f" ({', '.join(f'{k} {s}: {n}' for (k, s), n in sorted(bad_5xx.items()))})" if bad_5xx else "")
         + f"; {asked_504} x 504 to requests that sent X-Request-Timeout 2"),
        ("refused heavy/wedge requests (4xx, 503): p99 under 100 ms, max under 200 ms",
         refused_p99 < 100 and refused_max < 200 if refused else None,
         f"p99 {refused_p99:.0f} ms, max {refused_max:.0f} ms over {len(refused)}"),
        (f"the request after a 504 or hang-up (idle phase) answered within 2 x slice_ms = {2 * slice_ms:g} ms",
         probe_max <= 2 * slice_ms if probes else None,
         f"max {probe_max:.0f} ms, p50 {percentile(probes, 0.5):.0f} ms over {len(probes)}"),
        ("small requests' p99 with the heavy ones within 3x of alone", ratio <= 3, f"{ratio:.2f}x"),
        ("server RSS after the run within 1.2x of before", rss_ratio <= 1.2, f"{rss_ratio:.2f}x"),
        (f"after SIGTERM, exit 0 within drain_seconds + graceful_timeout_s = {grace:g} s",
         code == 0 and exit_s <= grace, f"exit code {code} after {exit_s:.1f} s"),
    ]
    lines = [
        f"## bench_service --abuse: mixed load, wedges, stalled uploads and hang-ups, {args.device}",
        "",
        f"- Machine: {machine()}",
        f"- Command: `{command()}`",
        f"- Models: {Path(args.lm).name if args.lm else '-'} ({args.lm}), n-gram {args.ngram}; server settings: "
        f"{', '.join(settings)} (the rest default; slice_ms {slice_ms:g}, drain_seconds "
        f"{server_settings.drain_seconds:g}, graceful_timeout_s {server_settings.graceful_timeout_s:g}), "
        f"{args.threads or os.cpu_count()} torch thread(s).",
        f"- Load: {len(out)} requests at concurrency {max(args.concurrency)}, {args.heavy_share:.0%} near-limit "
        "(hypothesis lists of dev utterances near max_trie_nodes, alternating with packs of real dev lattices near "
        "max_lattice_cost, each at most max_utterances), the rest one utterance's 5-best list; meanwhile "
        f"{args.stalls} stalled uploads (half a "
        f"head, or a head and half a body) and {args.disconnects} clients that send a near-limit request and hang up "
        "after 0.05-0.5 s. Baseline: the same small requests alone, first.",
    ]
    if wedged:
        lines.append(
            f"- Wedges: {len(by_shape)} shapes x {args.wedges}, sent by {args.wedge_clients} more clients, each when "
            "the mix had done a random 5-80% of its requests: n-best lists of 200, 700 and 1000 hypotheses x 100 "
            "words drawn from the 14 most frequent words; a fan lattice (0->1: 64 words, 1->2: 2000 words); a "
            "sausage lattice (40 slots of 14 words); JSON nested 2000 deep to /rescore and 3000 deep to /score; the "
            "1000-hypothesis list and the sausage with `X-Request-Timeout: 2`, and from a client that hangs up "
            "after 1 s. After each 504 and hang-up, at once on a new connection, a 3-word request.")
    lines += [
        "",
        "| measure | result | target |",
        "|---|---|---|",
        f"| 5xx answers other than 503 | {n_5xx} | 0 |",
        f"| lost requests (no answer) | {lost} | 0 |",
        f"| answers | {table} | all 200 |",
        f"| small requests' p99, alone / with the heavy ones | {p99_alone:.0f} ms / {p99_mixed:.0f} ms "
        f"({ratio:.2f}x) | within 3x |",
        f"| heavy requests' p50 / p99 | {percentile(heavy_ms, 0.5):.0f} ms / {percentile(heavy_ms, 0.99):.0f} ms | |",
        f"| heavy and wedge requests refused (4xx, 503): p99 / slowest | {refused_p99:.0f} / {refused_max:.0f} ms of "
        f"{len(refused)} | under 100 / 200 ms |",
        "| of them, the near-limit packs' refusals, p50 / p90 / max: " + ", ".join(
            f"{k.removeprefix('heavy ')} {percentile(v, 0.5):.0f} / {percentile(v, 0.9):.0f} / "
            f"{slowest_refusal[k]:.0f} ms" for k, v in refusals.items()) + " | |",
        f"| heavy and wedge requests answered 200: p50 / p90 / max | {latency_cells(ok)} ({len(ok)}) | |",
        f"| request after a 504 or hang-up, idle phase: p50 / max | {percentile(probes, 0.5):.0f} ms / "
        f"{probe_max:.0f} ms ({len(probes)}) | within 2 x slice_ms = {2 * slice_ms:g} ms |",
        f"| request after a 504 or hang-up, during the mix (queued like any small request): p50 / max | "
        f"{percentile(mix_probes, 0.5):.0f} ms / {1000 * max(mix_probes, default=float('nan')):.0f} ms "
        f"({len(mix_probes)}) | |",
        f"| stalled uploads answered 408 or closed | {len(timed_out)} of {len(stalls)}, after at most "
        f"{max(timed_out, default=float('nan')):.1f} s (server: {counts['408']:.0f} 408s, "
        f"{counts['header_timeouts']:.0f} head timeouts) | all, within the timeouts |",
        "| large bodies in the pricing process (the server's view): wait for a free copy / the copy's answer | "
        + " / ".join(f"{1000 * counts[f'pricing {st} sum'] / max(1, counts[f'pricing {st} count']):.0f}"
                     for st in ("wait", "price")) + " ms mean; over 50 ms: "
        + " / ".join(f"{counts[f'pricing {st} over 50 ms']:.0f}" for st in ("wait", "price"))
        + f" of {counts['pricing wait count']:.0f} | |",
        f"| hang-ups whose work was stopped | {counts['requests_cancelled']:.0f} requests cancelled, "
        f"{counts['work_cancelled']:.0f} jobs dropped or stopped | {args.disconnects} or more |",
        f"| server RSS before / peak / after | {rss['before']:.0f} MiB / {rss['peak']:.0f} MiB / "
        f"{rss['after']:.0f} MiB (after {rss_ratio:.2f}x before; peak of {rss['samples']} samples, 100 ms apart; "
        f"of it the process's own heap (RssAnon) {rss['anon_before']:.0f} / {rss['anon_after']:.0f} MiB "
        "before / after) | "
        "after within 1.2x |",
        f"| SIGTERM with {len(shutdown['requests'])} heavy and wedge requests in flight | exit code {code} after "
        f"{exit_s:.1f} s; they got {', '.join(f'{s}: {n}' for s, n in sorted(sd.items()))} | 0, within {grace:g} s |",
        f"| wall time, alone / mixed | {seconds[0]:.1f} s / {seconds[1]:.1f} s | |",
        "",
        f"The heavy requests' latency is queueing: near the end of the run most of the {max(args.concurrency)} "
        f"clients wait on one, and they are served oldest first, about "
        f"{(seconds[1] - seconds[0]) / max(1, len(heavy_ms)):.2f} s of worker time each here; the limits are set so "
        "that the last one still finishes within request_timeout_s (30 s).",
    ]
    if wedged:
        lines += [
            "",
            "| wedge | sent | answers (499: the client hung up) | slowest refusal | 200: p50 / p90 / max | "
            "request after it: slowest (n) |",
            "|---|---|---|---|---|---|",
            *wedge_rows,
        ]
    lines += ["", "Rules:", ""]
    lines += [f"- {verdict(passed)}: {rule}: {result}" for rule, passed, result in rules]
    summary = {
        "settings": settings, "slice_ms": slice_ms, "statuses": {f"{k} {s}": n for (k, s), n in statuses.items()},
        "lost": lost, "p99_small_alone_ms": p99_alone, "p99_small_mixed_ms": p99_mixed,
        "refused_max_ms": refused_max, "refusals_seconds": refusals, "ok_seconds": ok, "probes_seconds": probes,
        "rss_mib": rss,
        "wedges": wedged, "shutdown": shutdown, "counts": counts, "seconds": {"alone": seconds[0], "mixed": seconds[1]},
        "rules": [{"rule": rule, "result": result, "pass": passed} for rule, passed, result in rules],
    }
    return "\n".join(lines), summary
