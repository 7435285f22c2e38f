"""Decode WAV files with PocketSphinx and write lattices that `smallstate-lm rescore` reads.

    python examples/pocketsphinx/decode.py wavs/*.wav -o lattices_ps/

For each `<utt>.wav` (16 kHz mono 16-bit PCM; other rates and stereo are converted on the way in) the output
directory gets:

- `<utt>.lat.fst`: binary OpenFST lattice with Kaldi `lattice4` weights (graph, acoustic), labels = ids of
  `words.txt`, 0 = epsilon (`<s>`, `</s>`, silence and fillers);
- `<utt>.lm.slf`: the same lattice as HTK SLF, words on links, `a=` / `l=` natural-log scores;
- and once: `words.txt` (the dictionary's words, case-mapped), `hyp.txt` (PocketSphinx's own 1-best,
  `utt word word ...`), `weights.json` (the decoder's first-pass scales, for `rescore --weights`).

How PocketSphinx's scores become graph and acoustic costs
---------------------------------------------------------
PocketSphinx keeps every score as an integer logarithm in base `-logbase` (1.0001 by default), and its
lattice (`Lattice.write_htk`, kept with `--keep-raw`) has words on nodes and one acoustic score per link and
no language-model score at all. Three things are fixed on the way to the project's format:

1. Units. A link's `a=` is written by PocketSphinx already converted to natural log (`logmath_log_to_ln`);
   language-model probabilities come from the decoder's own n-gram (`NGramModel.prob`) in base-`logbase`
   units and are converted explicitly: ln p = units * ln(logbase) (`ln_per_unit` below).
2. Attachment. PocketSphinx's link u -> v carries the acoustic score of the word of node u (the segment that
   ends where v begins), so the word of u goes on that arc; the first link carries `<s>`'s score as epsilon.
   The acoustic score of the final `</s>` node itself is not in the file; it is the same on every path.
3. Language-model context. Nodes are (word, start frame) and do not determine the two previous words, so
   the lattice is expanded into states (node, last n-1 words) and every word arc gets the exact
   first-pass n-gram cost; fillers keep the history and cost nothing in the graph (PocketSphinx's lattice
   code adds its silence and filler penalties to link acoustic scores).

Scale. PocketSphinx's best path maximises acoustic + bestpathlw * (ln P + ln(wip) / lw) (defaults:
bestpathlw 9.5, lw 6.5, wip 0.65). Divided by bestpathlw and negated, that is the project's convention
with graph scale 1 and acoustic scale 1/bestpathlw:

    graph    = -ln P(word | previous n-1 words) - ln(wip) / lw     (0.06627 with the defaults)
    acoustic = -a                                                  (natural log, unscaled)

on word arcs, graph 0 on epsilon arcs, and `-ln P(</s> | history) - ln(wip) / lw` on the arcs into the
final state. The SLF states this as `lmscale=bestpathlw wdpenalty=ln(wip)*bestpathlw/lw` with `l=` = ln P,
which the project's `read_slf` turns back into exactly these graph costs. While expanding, states more than
`--expand-beam` behind the best state of their start frame are not expanded; the result is then pruned with
`--beam` on graph + acoustic/bestpathlw (forward + backward best costs), as Kaldi prunes lattices.

Words. PocketSphinx's en-us dictionary is lowercase and so is this project's LM text (data/train.txt), so
`--case lower` (the default) keeps words as they are and also folds an uppercase dictionary (WSJ-style) to
match; alternative pronunciations (`read(2)`) are written as their base word.
"""

from __future__ import annotations

import argparse
import math
import re
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from audio16k import AudioError, load_16k_mono

from smallstate_lm.rescoring.formats.lattice_io import read_slf, write_fst
from smallstate_lm.rescoring.lattices.lattice import LatticeFormatError, SymbolTable
from smallstate_lm.weights import Weights

CASE_MAPS = {"lower": str.lower, "upper": str.upper, "keep": lambda w: w}
_ALT_PRON = re.compile(r"\(\d+\)$")


class DecodeError(RuntimeError):
    """An utterance could not be decoded into a lattice; the message names the file."""


@dataclass
class RawLattice:
    """PocketSphinx's word graph as written by `Lattice.write_htk`: words on nodes, acoustic on links.

    `word[i]` is the node's dictionary word, None for fillers, `!NULL` and `<s>`/`</s>` other than at the
    start and end node. A link's `ac` is the natural-log acoustic score of its *source* node's word.
    """

    start: int
    end: int
    word: list[str | None]  # (N,)
    time: list[float]  # (N,) start time of the node's word in seconds
    src: list[int]  # (L,)
    dst: list[int]  # (L,)
    ac: list[float]  # (L,) natural log


def parse_pocketsphinx_slf(path: Path) -> RawLattice:
    """Read the HTK SLF dialect of `ps_lattice_write_htk`: `start= end= N= L=`, nodes `I= t= W= v=`,
    links `J= S= E= a= p=` (a= natural log, p= posterior, unused)."""
    header: dict[str, str] = {}
    nodes: dict[int, tuple[str, float]] = {}
    links: list[tuple[int, int, float]] = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip() or line.startswith("#"):
            continue
        try:
            f = dict(item.split("=", 1) for item in line.split())
            if "I" in f:
                nodes[int(f["I"])] = (f["W"], float(f["t"]))
            elif "J" in f:
                links.append((int(f["S"]), int(f["E"]), float(f["a"])))
            else:
                header.update(f)
        except (ValueError, KeyError) as e:
            raise LatticeFormatError(f"{path}:{n}: unexpected PocketSphinx SLF line {line!r} ({e})") from None
    try:
        N, start, end = int(header["N"]), int(header["start"]), int(header["end"])
    except (KeyError, ValueError):
        raise LatticeFormatError(f"{path}: missing N=, start= or end= in the header") from None
    if sorted(nodes) != list(range(N)) or not (0 <= start < N and 0 <= end < N):
        raise LatticeFormatError(f"{path}: nodes (start and end included) are not numbered 0..{N - 1}")
    for s, e, _ in links:
        if not (0 <= s < N and 0 <= e < N):
            raise LatticeFormatError(f"{path}: a link joins nodes {s} and {e}, outside 0..{N - 1}")
    words: list[str | None] = []
    for i in range(N):
        w = nodes[i][0]
        if i == start:
            words.append("<s>")
        elif i == end:
            words.append("</s>")
        elif w.startswith("!") or _is_filler(w):  # !NULL, and <s>/</s> hypothesised inside the utterance
            words.append(None)
        else:
            words.append(w)
    return RawLattice(start=start, end=end, word=words, time=[nodes[i][1] for i in range(N)],
                      src=[s for s, _, _ in links], dst=[e for _, e, _ in links], ac=[a for *_, a in links])


def _is_filler(w: str) -> bool:
    return w.startswith(("<", "[", "+"))


def _topological_order(N: int, src: list[int], dst: list[int], name: str) -> list[int]:
    indeg = [0] * N
    out: list[list[int]] = [[] for _ in range(N)]
    for k, (s, e) in enumerate(zip(src, dst)):
        indeg[e] += 1
        out[s].append(k)
    ready = [i for i in range(N) if indeg[i] == 0]
    order: list[int] = []
    while ready:
        u = ready.pop()
        order.append(u)
        for k in out[u]:
            indeg[dst[k]] -= 1
            if indeg[dst[k]] == 0:
                ready.append(dst[k])
    if len(order) != N:
        raise LatticeFormatError(f"{name}: PocketSphinx lattice has a cycle")
    return order


@dataclass
class ExpandedLattice:
    """States (node, history) in topological order; state 0 is the start; the final node is appended
    by `to_slf`. Words are output (case-mapped) strings or None for epsilon; costs are natural-log."""

    time: list[float]  # (S,)
    src: np.ndarray  # (A,) int64
    dst: np.ndarray  # (A,) int64
    word: list[str | None]  # (A,)
    lm: np.ndarray  # (A,) ln P of the arc's word (0 for epsilon)
    ac: np.ndarray  # (A,) ln acoustic score
    final_state: np.ndarray  # (F,) int64, states of the end node kept after pruning
    final_lm: np.ndarray  # (F,) ln P(</s> | history)


class FirstPassLM:
    """The decoder's own n-gram, queried in natural log with a cache. `prob(word, history)` returns
    ln P(word | history) or None where the model gives probability zero."""

    def __init__(self, ngram, ln_per_unit: float, log_zero: int):
        self.ngram = ngram
        self.order = int(ngram.size())
        self.ln_per_unit = ln_per_unit
        self.log_zero = log_zero
        self.cache: dict[tuple, float | None] = {}

    def prob(self, word: str, history: tuple[str, ...]) -> float | None:
        key = (word, history)
        if key not in self.cache:
            # NGramModel.prob takes the word first, then its history most recent first.
            units = self.ngram.prob([word, *reversed(history)])
            self.cache[key] = None if units <= self.log_zero else units * self.ln_per_unit
        return self.cache[key]


def expand(raw: RawLattice, lm: FirstPassLM, case, wip_cost: float, am_scale: float, beam: float,
           expand_beam: float, name: str) -> ExpandedLattice:
    """Expand `raw` into (node, last n-1 words) states with exact n-gram scores (see the module docstring for
    the costs). States worse than the best of their start frame by more than `expand_beam` are not expanded;
    arcs and final states off every path within `beam` of the best path are dropped. Both beams are on
    graph + am_scale * acoustic."""
    N = len(raw.word)
    order = _topological_order(N, raw.src, raw.dst, name)
    out_links: list[list[int]] = [[] for _ in range(N)]
    for k, s in enumerate(raw.src):
        out_links[s].append(k)
    keep_words = lm.order - 1
    state_of: list[dict[tuple, int]] = [dict() for _ in range(N)]
    s_node: list[int] = []
    alpha: list[float] = []

    def state(node: int, hist: tuple) -> int:
        sid = state_of[node].get(hist)
        if sid is None:
            sid = state_of[node][hist] = len(s_node)
            s_node.append(node)
            alpha.append(math.inf)
        return sid

    state(raw.start, ("<s>",))
    alpha[0] = 0.0
    a_src: list[int] = []
    a_dst: list[int] = []
    a_word: list[str | None] = []
    a_lm: list[float] = []
    a_ac: list[float] = []
    a_cost: list[float] = []
    rank = np.empty(N, dtype=np.int64)
    rank[order] = np.arange(N)
    # A word's links lead to nodes that start later, so start time is a topological order; all states of the
    # nodes starting at one frame have scored the same audio, and a beam among them prunes the expansion as
    # it goes (time-synchronous, as in a decoder). Forward-backward pruning below then makes it exact. Should a
    # link not go forward in time, each node is its own group instead (a beam among its histories).
    forward_in_time = all(raw.time[e] > raw.time[s] for s, e in zip(raw.src, raw.dst))
    by_time: dict[float, list[int]] = defaultdict(list)
    for u in sorted(range(N), key=lambda u: (raw.time[u], rank[u]) if forward_in_time else rank[u]):
        by_time[raw.time[u] if forward_in_time else float(rank[u])].append(u)
    for t in sorted(by_time):
        group = [(u, hist, sid) for u in by_time[t] for hist, sid in state_of[u].items()]
        if not group:
            continue
        limit = min(alpha[sid] for *_, sid in group) + expand_beam
        for u, hist, sid in group:
            if alpha[sid] > limit or u == raw.end:
                continue
            w = raw.word[u] if u != raw.start else None
            if w is None:
                lp, new_hist, graph = 0.0, hist, 0.0
            else:
                lp = lm.prob(w, hist)
                if lp is None:  # a path the first-pass LM forbids
                    continue
                new_hist, graph = (hist + (w,))[-keep_words:], -lp + wip_cost
            out_word = None if w is None else case(w)
            for k in out_links[u]:
                d = state(raw.dst[k], new_hist)
                cost = graph - am_scale * raw.ac[k]
                a_src.append(sid)
                a_dst.append(d)
                a_word.append(out_word)
                a_lm.append(lp)
                a_ac.append(raw.ac[k])
                a_cost.append(cost)
                if alpha[sid] + cost < alpha[d]:
                    alpha[d] = alpha[sid] + cost
    S = len(s_node)
    finals = list(state_of[raw.end].items())
    end_lp = [lm.prob("</s>", h) for h, _ in finals]
    final_lm = np.array([-math.inf if lp is None else lp for lp in end_lp])
    final_state = np.array([sid for _, sid in finals], dtype=np.int64)
    beta = np.full(S, math.inf)
    beta[final_state] = -final_lm + wip_cost
    src, dst, cost = np.array(a_src, dtype=np.int64), np.array(a_dst, dtype=np.int64), np.array(a_cost)
    alpha_arr = np.array(alpha)
    # Backward pass in reverse topological order of the source states' nodes.
    by_src = np.argsort(-rank[np.array(s_node, dtype=np.int64)][src], kind="stable")
    for k in by_src.tolist():
        b = cost[k] + beta[dst[k]]
        if b < beta[src[k]]:
            beta[src[k]] = b
    best = beta[0]
    if not math.isfinite(best):
        raise DecodeError(f"{name}: no complete path through the lattice")
    keep_arc = alpha_arr[src] + cost + beta[dst] <= best + beam
    keep_final = alpha_arr[final_state] + beta[final_state] <= best + beam
    keep_state = np.zeros(S, dtype=bool)
    keep_state[src[keep_arc]] = True
    keep_state[dst[keep_arc]] = True
    keep_state[final_state[keep_final]] = True
    # New numbering: topological (node rank, then creation order), so state 0 stays the start.
    kept = np.flatnonzero(keep_state)
    kept = kept[np.lexsort((kept, rank[np.array(s_node, dtype=np.int64)[kept]]))]
    new_id = np.full(S, -1, dtype=np.int64)
    new_id[kept] = np.arange(kept.size)
    idx = np.flatnonzero(keep_arc)
    return ExpandedLattice(
        time=[raw.time[s_node[s]] for s in kept.tolist()],
        src=new_id[src[idx]], dst=new_id[dst[idx]], word=[a_word[k] for k in idx.tolist()],
        lm=np.array(a_lm)[idx], ac=np.array(a_ac)[idx],
        final_state=new_id[final_state[keep_final]], final_lm=final_lm[keep_final],
    )


def to_slf(lat: ExpandedLattice, utt: str, lmscale: float, wdpenalty: float) -> str:
    """HTK SLF text: words on links (`W=!NULL` for epsilon, `W=</s>` on the links into the added final
    node), `a=` and `l=` natural log; `lmscale`/`wdpenalty` give the insertion penalty in LM units."""
    S, end = len(lat.time), len(lat.time)
    lines = ["VERSION=1.0", f"UTTERANCE={utt}", f"lmscale={lmscale:g}", f"wdpenalty={wdpenalty:.6f}",
             f"start=0\tend={end}", f"N={S + 1}\tL={lat.src.size + lat.final_state.size}"]
    lines += [f"I={i}\tt={t:.2f}" for i, t in enumerate(lat.time)]
    lines.append(f"I={end}\tt={max(lat.time):.2f}")
    j = 0
    for s, d, w, lp, a in zip(lat.src.tolist(), lat.dst.tolist(), lat.word, lat.lm.tolist(), lat.ac.tolist()):
        lines.append(f"J={j}\tS={s}\tE={d}\tW={w or '!NULL'}\ta={a:.6f}\tl={lp:.6f}")
        j += 1
    for s, lp in zip(lat.final_state.tolist(), lat.final_lm.tolist()):
        lines.append(f"J={j}\tS={s}\tE={end}\tW=</s>\ta=0.000000\tl={lp:.6f}")
        j += 1
    return "\n".join(lines) + "\n"


def dictionary_symbols(dict_path: str, case) -> list[str]:
    """The base words of a PocketSphinx dictionary in file order, case-mapped, without duplicates."""
    words: dict[str, None] = {}
    with open(dict_path, encoding="utf-8") as f:
        for line in f:
            parts = line.split(maxsplit=1)
            if parts:
                words.setdefault(case(_ALT_PRON.sub("", parts[0])), None)
    return list(words)


def decode_files(wavs: list[Path], out: Path, options: dict[str, str], beam: float = 10.0,
                 expand_beam: float = 15.0, case_name: str = "lower", keep_raw: bool = False) -> int:
    """Decode each WAV into OUT/<stem>.lat.fst and OUT/<stem>.lm.slf; write words.txt, hyp.txt and
    weights.json. A file that fails is reported on stderr and skipped. Returns the number of failures."""
    import pocketsphinx

    try:
        decoder = pocketsphinx.Decoder(**options)
    except (KeyError, ValueError, RuntimeError) as e:
        raise DecodeError(f"PocketSphinx could not start with options {options} ({e})") from None
    cfg = decoder.config
    if not cfg["bestpath"]:
        raise DecodeError("lattices need the decoder's bestpath search (do not set bestpath=no)")
    lw, bestpath_lw, wip = float(cfg["lw"]), float(cfg["bestpathlw"]), float(cfg["wip"])
    ln_per_unit = math.log(float(cfg["logbase"]))  # PocketSphinx's integer log scores -> natural log
    wip_cost = -math.log(wip) / lw  # the insertion penalty in LM units (0.06627 for wip 0.65, lw 6.5)
    am_scale = 1.0 / bestpath_lw
    case = CASE_MAPS[case_name]
    ngram = decoder.get_lm()
    if ngram is None:
        raise DecodeError("graph costs need the decoder's n-gram LM; grammar and keyword searches have none")
    lm = FirstPassLM(ngram, ln_per_unit, decoder.logmath.get_zero())

    out.mkdir(parents=True, exist_ok=True)
    symbol_words = dictionary_symbols(cfg["dict"], case)
    known = set(symbol_words)
    symbols = SymbolTable.from_words(symbol_words)
    hyps: list[str] = []
    failed = 0
    with tempfile.TemporaryDirectory(prefix="ps-raw-") as tmp:
        raw_dir = out / "raw" if keep_raw else Path(tmp)
        raw_dir.mkdir(exist_ok=True)
        for wav in wavs:
            utt = wav.stem
            try:
                pcm, converted = load_16k_mono(wav)
                if converted:
                    print(f"{wav}: converted to 16 kHz mono", file=sys.stderr)
                decoder.start_utt()
                decoder.process_raw(pcm, full_utt=True)
                decoder.end_utt()
                hyp = decoder.hyp()
                lattice = decoder.get_lattice() if hyp is not None else None
                if lattice is None:
                    raise DecodeError(f"{wav}: PocketSphinx found no hypothesis (silence or unreadable audio?)")
                raw_path = raw_dir / f"{utt}.slf"
                lattice.write_htk(str(raw_path))
                raw = parse_pocketsphinx_slf(raw_path)
                exp = expand(raw, lm, case, wip_cost, am_scale, beam, expand_beam, str(wav))
                new = [w for w in exp.word if w is not None and w not in known]
                if new:  # words added to the decoder at run time: append them, keeping every existing id
                    symbol_words += list(dict.fromkeys(new))
                    known.update(new)
                    symbols = SymbolTable.from_words(symbol_words)
                slf = out / f"{utt}.lm.slf"
                slf.write_text(to_slf(exp, utt, bestpath_lw, math.log(wip) * bestpath_lw / lw), encoding="utf-8")
                write_fst(out / f"{utt}.lat.fst", read_slf(slf, symbols).prepare())
                hyps.append(" ".join([utt] + [case(w) for w in hyp.hypstr.split()]))
                print(f"{utt}: {len(exp.time) + 1} states, {exp.src.size + exp.final_state.size} arcs "
                      f"(PocketSphinx: {len(raw.word)} nodes, {len(raw.src)} links)", file=sys.stderr)
            except (AudioError, DecodeError, LatticeFormatError) as e:
                print(f"error: {e} (skipped)", file=sys.stderr)
                failed += 1
    symbols.write(out / "words.txt")
    (out / "hyp.txt").write_text("".join(h + "\n" for h in hyps), encoding="utf-8")
    Weights(am_scale=am_scale, graph_scale=1.0).save(out / "weights.json", {
        "note": f"first-pass scales of PocketSphinx: acoustic 1/bestpathlw = 1/{bestpath_lw:g}, graph 1"})
    return failed


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("wavs", nargs="+", type=Path, help="WAV files, or directories of *.wav")
    p.add_argument("-o", "--out", type=Path, required=True, help="output directory")
    p.add_argument("--beam", type=float, default=10.0,
                   help="lattice pruning beam on graph + acoustic/bestpathlw (natural log; default 10)")
    p.add_argument("--expand-beam", type=float, default=15.0,
                   help="beam among the states of one start frame while expanding (default 15)")
    p.add_argument("--case", choices=sorted(CASE_MAPS), default="lower",
                   help="case mapping of the decoder's words to the LM's (default lower)")
    p.add_argument("--ps", action="append", default=[], metavar="KEY=VALUE",
                   help="PocketSphinx option, e.g. --ps lw=7 --ps dict=my.dict (repeatable)")
    p.add_argument("--keep-raw", action="store_true", help="also keep PocketSphinx's own SLF in OUT/raw/")
    args = p.parse_args(argv)

    wavs: list[Path] = []
    for w in args.wavs:
        wavs.extend(sorted(w.glob("*.wav")) if w.is_dir() else [w])
    if not wavs:
        p.error("no WAV files given")
    stems = [w.stem for w in wavs]
    if len(set(stems)) != len(stems):
        p.error("two WAV files share a name; utterance ids are the file names without .wav")
    options = {"loglevel": "ERROR"}
    for kv in args.ps:
        k, sep, v = kv.partition("=")
        if not sep:
            p.error(f"--ps expects KEY=VALUE, got {kv!r}")
        options[k.lstrip("-")] = v
    t0 = time.perf_counter()
    try:
        failed = decode_files(wavs, args.out, options, args.beam, args.expand_beam, args.case, args.keep_raw)
    except DecodeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{len(wavs) - failed} of {len(wavs)} utterances -> {args.out} ({time.perf_counter() - t0:.1f} s)",
          file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
