"""A rescored lattice's transcript and word confidences under some weights: the best path or the consensus
(`Weights.decode`), each word's confidence (its posterior in its own bin once the lattice is aligned to the
transcript, decode/consensus.py), and word times for a CTM; also the first pass's own transcript and confidences.
Plain lists out, for the writers and for the service."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from ...errors import SmallstateError
from .consensus import Aligner, aligned_confidences, consensus_of
from .posteriors import first_pass_dag

# Working arrays of a group of lattices aligned together (arcs x hypothesis positions): ~20 MB of them
ALIGN_CELLS = 1000000


@dataclass
class Decoded:
    """A rescored lattice's transcript under some weights (`Weights.decode`): its words, each word's confidence
    in [0, 1], and with word times `timed` (word, start, duration, confidence) in seconds; `path_words` and
    `path_confidences` are the best path's (the same as `words`/`confidences` under Viterbi)."""

    words: list[str]
    confidences: list[float]
    path_words: list[str]
    path_confidences: list[float]
    timed: list[tuple[str, float, float, float]] | None = None
    risk: float | None = None  # the consensus's approximate expected word errors (mbr only)


def _keys(x, words: Sequence[str]) -> list[int]:
    return [x.symbols.id(wd) if wd in x.symbols else -2 for wd in words]  # -2: no arc has it


def decode_lattice(x, w, path_words: Sequence[str] | None = None, frame_shift: float | None = None,
                   confidences: bool = True) -> Decoded:
    """Decode expanded lattice `x` (`ExpandedLattice`) under weights `w`: its best path (w.decode "viterbi")
    or its consensus ("mbr", from the best path, at posterior scale w.mbr_scale, or w.posterior_scale when that
    is 0), with confidences from the lattice aligned to the transcript at w.posterior_scale. `path_words`: the
    best path's words when already known (the n-best's first); `frame_shift`: seconds per transition-id, to also
    give word times (raises ConfigError for a lattice without times, as a CTM does). Without `confidences` (and
    without word times) a Viterbi decode is the best path alone, with empty confidence lists. Many lattices'
    confidences cost several times less made together (`decode_lattices`)."""
    path = list(path_words) if path_words is not None else x.best_words(w)
    if w.decode == "viterbi" and not confidences and frame_shift is None:
        return Decoded(path, [], path, [])
    dag, name = x.dag(w), f"lattice {x.name}"
    if w.decode == "viterbi":
        al = Aligner(dag, w.posterior_scale, None, name)
        conf = al.confidences_of(_keys(x, path))
        timed = None
        if frame_shift is not None:
            spans = x.best_timed_words(w, frame_shift)
            said = [s[0] for s in spans]
            conf_t = conf if said == path else al.confidences_of(_keys(x, said))  # a tie resolved the other way
            timed = [(wd, a, d, c) for (wd, a, d), c in zip(spans, conf_t)]
        return Decoded(path, conf, path, conf, timed)
    scale = w.mbr_scale if w.mbr_scale > 0 else w.posterior_scale
    times = x.node_times(frame_shift) if frame_shift is not None else None
    c = consensus_of(Aligner(dag, scale, times, name), _keys(x, path))
    conf, path_conf = c.confidences, c.start_confidences
    if scale != w.posterior_scale:  # decoded at one sharpness, judged at another
        al = Aligner(dag, w.posterior_scale, None, name)
        conf, path_conf = al.confidences_of(c.keys), al.confidences_of(_keys(x, path))
    words = [x.symbols.word(k) for k in c.keys]
    timed = None
    if c.times is not None:
        spans = _tidy_spans(c.times, x.labels_on_one_frame(), float(times.max(initial=0.0)))
        timed = [(wd, a, d, cf) for wd, (a, d), cf in zip(words, spans, conf)]
    return Decoded(words, conf, path, path_conf, timed, c.risk)


def decode_lattices(xs: Sequence, w, path_words: Sequence[Sequence[str] | None], frame_shift: float | None = None,
                    confidences: bool = True, max_cells: int = ALIGN_CELLS,
                    dags: Sequence | None = None) -> list[Decoded | SmallstateError]:
    """`decode_lattice` of each of `xs` (path_words[k] for xs[k]), in order; a lattice's SmallstateError comes
    back in its place. The best paths' confidences (Viterbi, no word times) are aligned for many lattices in
    the same passes, a level of all of them at a time: the same numbers at a fraction of the cost, since a
    pass over one small lattice is mostly the fixed cost of its levels' array operations. The lattices go in
    order of hypothesis length, in groups of at most `max_cells` (their arcs x their longest hypothesis's
    positions) of working arrays, a lattice past it alone; `dags`: their `dag(w)`, when already made."""
    if w.decode != "viterbi" or not confidences or frame_shift is not None or len(xs) < 2:
        return [_decode_one(x, w, p, frame_shift, confidences) for x, p in zip(xs, path_words)]
    paths = [list(p) if p is not None else x.best_words(w) for x, p in zip(xs, path_words)]
    dags = [x.dag(w) for x in xs] if dags is None else dags
    out: list[Decoded | SmallstateError] = [None] * len(xs)  # type: ignore[list-item]
    group: list[int] = []
    arcs = 0
    for k in sorted(range(len(xs)), key=lambda k: len(paths[k])):  # the last one added sets the group's width
        more = len(dags[k].src) + len(dags[k].final_node)
        if group and (arcs + more) * (len(paths[k]) + 1) > max_cells:
            _decode_group(xs, w, paths, dags, group, out)
            group, arcs = [], 0
        group.append(k)
        arcs += more
    if group:
        _decode_group(xs, w, paths, dags, group, out)
    return out


def _decode_group(xs, w, paths, dags, group: list[int], out: list) -> None:
    """Lattices `group` of xs aligned to their best paths together, their Decoded put in `out`; where one of
    them has no complete path of finite cost, each is decoded alone, for its own error."""
    try:
        levels = [xs[k].node_level for k in group]
        al = Aligner.many([dags[k] for k in group], w.posterior_scale, [f"lattice {xs[k].name}" for k in group],
                          None if any(lv is None for lv in levels) else levels)
    except SmallstateError:
        for k in group:
            out[k] = _decode_one(xs[k], w, paths[k], None, True)
        return
    for k, conf in zip(group, al.confidences_many([_keys(xs[k], paths[k]) for k in group])):
        out[k] = Decoded(paths[k], conf, paths[k], conf)


def _decode_one(x, w, path, frame_shift, confidences) -> Decoded | SmallstateError:
    try:
        return decode_lattice(x, w, path, frame_shift, confidences)
    except SmallstateError as e:
        return e


def _tidy_spans(times: list[tuple[float, float]], one_frame: bool, end: float) -> list[tuple[float, float]]:
    """(start, duration) per consensus word from its bin's mean (start, end): words whose label sits on one
    frame (`one_frame`) last until the next word, the last until `end` (as the best path's CTM does), and no
    word starts before the previous one ends."""
    spans, prev_end = [], 0.0
    for i, (a, b) in enumerate(times):
        if one_frame:
            b = max(b, times[i + 1][0] if i + 1 < len(times) else end)
        a = max(a, prev_end)
        b = max(b, a)
        spans.append((a, b - a))
        prev_end = b
    return spans


def word_confidences(x, w, words: Sequence[str] | None = None) -> list[float]:
    """The confidence in [0, 1] of each of `words` (default: the transcript `w.decode` gives) in expanded lattice
    `x` under weights `w`: its posterior in its own bin once the lattice is aligned to `words` (0 for a word
    the lattice lacks). Plain floats, for callers that serialise them (the service)."""
    if words is None:
        return decode_lattice(x, w).confidences
    return aligned_confidences(x.dag(w), w.posterior_scale, _keys(x, words), f"lattice {x.name}")


def first_pass_decode(x, am_scale: float, scale: float) -> tuple[list[str], list[float]]:
    """The decoder's own best path in expanded lattice `x`'s source lattice (graph + am_scale * acoustic) and
    its words' confidences there at posterior scale `scale`: what the first pass alone would have said."""
    words = x.first_pass_words(am_scale)
    dag = first_pass_dag(x.source, am_scale)
    return words, aligned_confidences(dag, scale, _keys(x, words), f"lattice {x.name} (first pass)")
