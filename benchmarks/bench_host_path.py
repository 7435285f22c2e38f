"""The service's request path, before and after: servers of this tree and of earlier commits side by side
on loopback, the same model and requests, load rows alternating between them so that machine noise hits
each alike. Per server: requests/s and hypotheses/s at one concurrency, p99 latency, and the server's CPU time
per request (utime + stime over the row, summed over every process of the server: supervisor, front-ends and
engine, or an older tree's one process and its pricing copies: what the request path costs, whoever else shares
the cores), and the engine process's own where there is one.

With a small model (`--lm` of a `tiny` run with a small vocabulary) the model's share is small and the rest
is the host path: parsing, admission, tries, KenLM, ranking, confidences and the response.

    python benchmarks/bench_host_path.py --lm runs/tiny2k --ngram runs/lm4.bin --against 0da5fbf HEAD
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import command, machine, write_section  # noqa: E402
from service_client import DEV, ROOT, build_requests, free_port, http_get, load  # noqa: E402


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lm", required=True, help="neural LM run directory")
    ap.add_argument("--ngram", required=True, help="KenLM model")
    ap.add_argument("--against", nargs="+", default=[], metavar="REV",
                    help="git revisions (or source-tree directories) whose servers run beside this working tree's")
    ap.add_argument("--device", default="cpu", help="the servers' device (cpu, cuda)")
    ap.add_argument("--nbest", nargs="+", default=[str(DEV / "festival_slt" / "nbest.tsv"),
                                                   str(DEV / "festival_kal" / "nbest.tsv")])
    ap.add_argument("--shapes", nargs="+", default=["50", "5"], help="hypotheses per request (0: all)")
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--seconds", type=float, default=6.0)
    ap.add_argument("--rounds", type=int, default=3, help="rows per server and shape (medians reported)")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads per server (default: 1 on CPU, where spinning intra-op threads of two "
                    "servers and the client would fight over the cores; torch's default on a GPU)")
    ap.add_argument("--frontends", type=int, default=None,
                    help="front-end processes of this tree's server (default: its own default)")
    ap.add_argument("--doc", type=Path, default=None, help="write the section into this markdown file")
    return ap.parse_args()


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def processes(pid: int) -> dict[int, str]:
    """`pid` and its descendants: pid -> command line."""
    out, todo = {}, [pid]
    while todo:
        p = todo.pop()
        try:
            out[p] = Path(f"/proc/{p}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            for task in Path(f"/proc/{p}/task").iterdir():
                todo += map(int, (task / "children").read_text().split())
        except OSError:  # gone meanwhile
            continue
    return out


def server_cpu(pid: int) -> tuple[float, float | None]:
    """CPU seconds of the server rooted at `pid`: every process of it, and its engine's alone (None without one)."""
    total, engine = 0.0, None
    for p, cmd in processes(pid).items():
        try:
            s = cpu_seconds(p)
        except OSError:
            continue
        total += s
        if "smallstate_lm.service.engine" in cmd:
            engine = s
    return total, engine


def worktree(rev: str, parent: Path) -> Path:
    if Path(rev).is_dir():  # a copy of a tree, where there is no repository (a lent GPU host)
        return Path(rev).resolve()
    path = parent / rev.replace("/", "_")
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-f", str(path), rev], check=True,
                   capture_output=True)
    return path


def start(root: Path, args) -> tuple[subprocess.Popen, int]:
    port = free_port()
    threads = ["--threads", str(args.threads)] if args.threads else []
    if args.frontends and root == ROOT:
        threads += ["--set", f"frontends={args.frontends}"]
    cmd = [sys.executable, "-m", "smallstate_lm.cli", "serve", "--port", str(port), "--device", args.device,
           "--batching", *threads, "--set", "log_level=warning", "--set", "max_wait_ms=5.0",
           "--set", "max_queue=1024", "--lm", str(Path(args.lm).resolve()), "--ngram", str(Path(args.ngram).resolve())]
    # the tree's own package first: `-m` puts the working directory on the path
    return subprocess.Popen(cmd, cwd=root, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL), port


def wait_ready(proc: subprocess.Popen, port: int, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"a server exited with {proc.returncode} before it was ready")
        try:
            if asyncio.run(http_get(port, "/readyz"))[0] == 200:
                return
        except OSError:
            pass
        time.sleep(0.2)
    raise RuntimeError("a server was not ready in time")


def main() -> None:
    args = parse_args()
    if args.threads is None and args.device == "cpu":
        args.threads = 1
    names = ["this tree"] + args.against
    with tempfile.TemporaryDirectory(prefix="host-path-") as tmp:
        roots = [ROOT] + [worktree(rev, Path(tmp)) for rev in args.against]
        servers = [start(root, args) for root in roots]
        try:
            for proc, port in servers:
                wait_ready(proc, port)
            rows = []
            for shape in args.shapes:
                n = int(shape) or None
                reqs, hyps = build_requests(args.nbest, n, 200)
                runs: dict[str, list[dict]] = {name: [] for name in names}
                for _ in range(args.rounds):
                    for name, (proc, port) in zip(names, servers):
                        (c0, e0), t0 = server_cpu(proc.pid), time.perf_counter()
                        r = asyncio.run(load(port, reqs, args.concurrency, 1.0, args.seconds))
                        served = r["rps"] * (time.perf_counter() - t0)  # warm-up included, as the CPU time is
                        c1, e1 = server_cpu(proc.pid)
                        r["cpu_ms"] = 1000 * (c1 - c0) / served
                        r["engine_ms"] = 1000 * (e1 - e0) / served if e0 is not None and e1 is not None else None
                        runs[name].append(r)
                        engine = f"  engine {r['engine_ms']:6.2f}" if r["engine_ms"] is not None else ""
                        print(f"{shape:>4} {name:12s} {r['rps']:7.1f} req/s  p99 {r['p99']:7.1f} ms  "
                              f"cpu {r['cpu_ms']:6.2f} ms/request{engine}", flush=True)
                for name in names:
                    med = {k: statistics.median(r[k] for r in runs[name]) for k in ("rps", "p99", "cpu_ms")}
                    engines = [r["engine_ms"] for r in runs[name] if r["engine_ms"] is not None]
                    med["engine_ms"] = statistics.median(engines) if engines else None
                    rows.append((shape, hyps, name, med))
        finally:
            for proc, _ in servers:
                proc.terminate()
            for proc, _ in servers:
                proc.wait()
            for root in roots[1:]:
                if str(root).startswith(tmp):
                    subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(root)],
                                   capture_output=True)
    print(report(args, rows))


def report(args, rows) -> str:
    first = {shape: med for shape, _, name, med in rows if name == "this tree"}
    lines = [f"## bench_host_path: the request path, this tree against {', '.join(args.against) or 'nothing'}", "",
             f"- Machine: {machine()}", f"- Command: `{command()}`",
             f"- Model `{args.lm}`, n-gram `{args.ngram}`, device {args.device}; "
             f"{args.threads or 'all'} torch thread(s) per server, concurrency "
             f"{args.concurrency}, {args.seconds:g} s per row after 1 s warm-up, {args.rounds} rows per server and "
             "shape, alternating; medians. CPU: utime + stime per request served, summed over every process of the "
             "server; engine: the engine process's alone.", "",
             "| hypotheses per request | server | requests/s | hypotheses/s | p99 ms | server CPU ms per request "
             "| engine CPU ms per request | this tree's requests/s over it | its CPU per request over it |",
             "|---|---|---|---|---|---|---|---|---|"]
    for shape, hyps, name, med in rows:
        ratio = "" if name == "this tree" else f"{first[shape]['rps'] / med['rps']:.2f}x"
        cpu = "" if name == "this tree" else f"{first[shape]['cpu_ms'] / med['cpu_ms']:.2f}x"
        engine = f"{med['engine_ms']:.2f}" if med["engine_ms"] is not None else "-"
        lines.append(f"| {hyps:.1f} | {name} | {med['rps']:.1f} | {med['rps'] * hyps:,.0f} | {med['p99']:.1f} | "
                     f"{med['cpu_ms']:.2f} | {engine} | {ratio} | {cpu} |")
    text = "\n".join(lines)
    if args.doc is not None:
        write_section(f"bench_host_path-{args.device.split(':')[0]}", text, args.doc)
    return text


if __name__ == "__main__":
    main()
