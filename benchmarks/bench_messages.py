"""How the service's messages cross between a front-end and the engine, three ways side by side: pickle protocol 5
with each array's buffer as a zmq frame of its own (what `service/messages.py` does), one in-band pickle per
message, and the arrays in a shared-memory segment per message (the pickle's out-of-band buffers copied into it;
the receiver maps it, reads the message and unlinks it). Each message goes to an echo process over zmq ipc and
comes back the same way: round trip per message and the sender's CPU per message, medians of rounds that alternate.

The messages are real ones: a dev 50-best list's `Submit` (token ids) and its `Scored` (log-probs), and a bundled
lattice's `Submit` and the `Scored` with its expansion by the full-text 4-gram.

    python benchmarks/bench_messages.py --ngram runs/lm4.bin --doc docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import multiprocessing
import pickle
import statistics
import sys
import time
from multiprocessing import shared_memory
from pathlib import Path

import numpy as np
import zmq

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import command, machine, write_section  # noqa: E402
from service_client import DEV, ROOT  # noqa: E402

from smallstate_lm.rescoring.formats.lattice_io import read_fst  # noqa: E402
from smallstate_lm.rescoring.lattices.lattice import SymbolTable  # noqa: E402
from smallstate_lm.rescoring.nbest.lists import read_nbest  # noqa: E402
from smallstate_lm.service.messages import (  # noqa: E402
    OUT_OF_BAND,
    LatticeJob,
    ListJob,
    Scored,
    Submit,
    from_frames,
    to_frames,
)
from smallstate_lm.vocab import EOS_ID  # noqa: E402
from smallstate_lm.weights import Weights  # noqa: E402


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ngram", required=True, help="KenLM model (to expand the lattice of the Scored message)")
    ap.add_argument("--count", type=int, default=2000, help="messages per round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--doc", type=Path, default=None)
    return ap.parse_args()


# ---- three ways ------------------------------------------------------------------------------
def frames_ours(msg) -> list:
    return to_frames(msg)


def frames_oob(msg) -> list:
    buffers: list[pickle.PickleBuffer] = []
    head = pickle.dumps(msg, protocol=5, buffer_callback=buffers.append)
    return [head, *(b.raw() for b in buffers)]


def read_oob(frames: list):
    return from_frames([f.buffer for f in frames])


def frames_inband(msg) -> list:
    return [pickle.dumps(msg, protocol=5)]


def read_inband(frames: list):
    return pickle.loads(frames[0].buffer)


def frames_shm(msg) -> list:
    buffers: list[pickle.PickleBuffer] = []
    head = pickle.dumps(msg, protocol=5, buffer_callback=buffers.append)
    raws = [b.raw() for b in buffers]
    size = sum(r.nbytes for r in raws)
    if not size:
        return [head, b""]
    seg = shared_memory.SharedMemory(create=True, size=size)
    offsets, at = [], 0
    for r in raws:
        seg.buf[at : at + r.nbytes] = r
        offsets.append((at, r.nbytes))
        at += r.nbytes
    name = seg.name
    seg.close()
    return [head, pickle.dumps((name, offsets))]


def read_shm(frames: list):
    if not frames[1].bytes:
        return pickle.loads(frames[0].buffer)
    name, offsets = pickle.loads(frames[1].buffer)
    seg = shared_memory.SharedMemory(name=name)
    buffers = [bytes(seg.buf[a : a + n]) for a, n in offsets]  # the message outlives the segment
    msg = pickle.loads(frames[0].buffer, buffers=buffers)
    seg.close()
    seg.unlink()
    return msg


WAYS = {f"ours: pickle 5, arrays of {OUT_OF_BAND // 1024} KiB+ as frames": (frames_ours, read_oob),
        "pickle 5, every array a frame": (frames_oob, read_oob), "pickle, in band": (frames_inband, read_inband),
        "shared memory per message": (frames_shm, read_shm)}


def echo(address: str, way: str) -> None:
    """The other process: reads each message whole and sends it back the same way."""
    write, read = WAYS[way]
    sock = zmq.Context().socket(zmq.PAIR)
    sock.connect(address)
    while True:
        frames = sock.recv_multipart(copy=False)
        if frames[0].bytes == b"stop":
            return
        sock.send_multipart(write(read(frames)), copy=False)


# ---- the messages ------------------------------------------------------------------------------
def messages(ngram_path: str) -> dict[str, object]:
    from smallstate_lm.lms import load_lms
    from smallstate_lm.rescoring.expand.rescorer import ExpandConfig, build_rescorer

    utt = max(read_nbest(DEV / "festival_kal" / "nbest.tsv"), key=lambda u: len(u.hyps))
    hyps = utt.hyps[:50]
    lens = np.array([len(h.words) + 1 for h in hyps])
    rng = np.random.default_rng(0)
    tokens = rng.integers(3, 18000, int(lens.sum()))
    tokens[np.cumsum(lens) - 1] = EOS_ID
    nbest = Submit(1, "rescore", Weights(), [ListJob(tokens, lens, 0.01, int(lens.max()))], [], cost=int(lens.sum()),
                   seconds=0.01, lattice_seconds=0.0, tokens_total=int(lens.sum()), tokens_computed=int(lens.sum()),
                   remaining=30.0, timeout=30.0, field="utterances")
    scored = Scored(1, [rng.normal(size=int(lens.sum())).astype(np.float32)])
    lat_dir = ROOT / "lattices"
    symbols = SymbolTable.read(lat_dir / "words.txt")
    lat = read_fst(sorted(lat_dir.glob("*.fst"))[0], symbols).prepare()
    lattice = Submit(2, "rescore", Weights(), [], [LatticeJob(lat, "utterances[0]", 0.1, 1 << 20)], cost=lat.num_arcs,
                     seconds=0.1, lattice_seconds=0.1, tokens_total=0, tokens_computed=0, remaining=30.0,
                     timeout=30.0, field="utterances")
    deep = rng.integers(3, 18000, 1000 * 200)  # a list of 1,000 hypotheses of 199 words (max_words is 200)
    big = Submit(3, "rescore", Weights(), [ListJob(deep, np.full(1000, 200), 5.0, 200)], [], cost=len(deep),
                 seconds=5.0, lattice_seconds=0.0, tokens_total=len(deep), tokens_computed=len(deep), remaining=30.0,
                 timeout=30.0, field="utterances")
    _, ngram = load_lms(None, ngram_path, "cpu", required=False)
    exp = build_rescorer(Weights(), None, ngram, ExpandConfig(), "cpu").expand(lat)
    import dataclasses

    expanded = Scored(2, None, [dataclasses.replace(exp, source=None)])
    return {f"50-best Submit ({len(hyps)} hyps, {int(lens.sum())} tokens)": nbest,
            "50-best Scored": scored,
            f"lattice Submit ({lat.num_arcs} arcs)": lattice,
            f"lattice Scored ({len(exp.src)} expanded arcs)": expanded,
            "deep list Submit (1,000 x 200 tokens, 1.6 MB)": big}


def main() -> None:
    args = parse_args()
    msgs = messages(args.ngram)
    ctx = zmq.Context()
    results = {(m, w): [] for m in msgs for w in WAYS}
    for _ in range(args.rounds):
        for way, (write, read) in WAYS.items():
            sock = ctx.socket(zmq.PAIR)
            address = f"ipc:///tmp/bench-messages-{time.monotonic_ns()}"
            sock.bind(address)
            proc = multiprocessing.get_context("spawn").Process(target=echo, args=(address, way))
            proc.start()
            for name, msg in msgs.items():
                sock.send_multipart(write(msg), copy=False)  # warm-up
                read(sock.recv_multipart(copy=False))
                c0, t0 = time.process_time(), time.perf_counter()
                for _ in range(args.count):
                    sock.send_multipart(write(msg), copy=False)
                    read(sock.recv_multipart(copy=False))
                t1, c1 = time.perf_counter(), time.process_time()
                results[(name, way)].append((1e6 * (t1 - t0) / args.count, 1e6 * (c1 - c0) / args.count))
            sock.send(b"stop")
            proc.join()
            sock.close()
    lines = ["## bench_messages: how arrays cross between front-end and engine", "", f"- Machine: {machine()}",
             f"- Command: `{command()}`",
             f"- Round trip to an echo process over zmq ipc, {args.count} messages per row, {args.rounds} rounds "
             "alternating the ways; medians. CPU: the sender's process time per round trip (both ends do the same "
             "work).", "", "| message | way | round trip µs | sender CPU µs |", "|---|---|---|---|"]
    for (name, way), rows in results.items():
        rt, cpu = statistics.median(r[0] for r in rows), statistics.median(r[1] for r in rows)
        lines.append(f"| {name} | {way} | {rt:.0f} | {cpu:.0f} |")
    text = "\n".join(lines)
    print(text)
    if args.doc is not None:
        write_section("bench_messages", text, args.doc)


if __name__ == "__main__":
    main()
