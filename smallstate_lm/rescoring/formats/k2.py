"""k2/icefall lattices: files of `torch.save(fsa.as_dict())` read into `Lattice`s, and rescored ones written back
in the same form, without k2 (it has no wheel for our Python and torch).

The layout (k2/csrc/fsa.h `FsaToTensor`, `FsaVecToTensor`; k2/python/k2/fsa.py `as_dict`):
- `arcs`, int32. A single Fsa: (num_arcs, 4) rows `src_state, dest_state, label, score`, the float32 score's
  bits stored as an int32. An FsaVec: 1-D, `[num_fsas, 0, row_splits1, row_splits12, arcs...]`: row_splits1
  (num_fsas + 1) counts the states before each FSA, row_splits12 (num_fsas + 1) the arcs before each FSA, then
  the arcs, 4 ints each, with states numbered within their FSA.
- per-arc tensors: `aux_labels` (int; icefall's HLG lattices carry tokens in the labels and words here),
  `lm_scores` (float: the graph/LM part of the score); `scores` and `labels` when a dict has them (they replace
  the arcs' own, as `Fsa.from_dict` does). Other entries are ignored, and not written back.
- an FSA starts at state 0 and ends in one final state, its last, which only arcs labelled -1 enter; a
  single Fsa's state count is inferred as k2 does (the final state is where the -1 arcs go).

Into a `Lattice`: words are the `aux_labels`, else the labels (ids of the decoder's words.txt, 0 = epsilon);
scores are natural-log probabilities, so graph = -lm_scores and acoustic = -(scores - lm_scores) (all of it
acoustic without lm_scores). A state's one final arc becomes its final weight and the k2 final state goes (a
state with several keeps them, as epsilon arcs into a final state). With aux_labels, each arc's label (token)
rides along as its one-id `arc_tids` row, as a Kaldi `Lattice`'s transition-id does: it is written back, and
`--ctm` counts one frame per arc, as in k2's lattices from dense intersection.

Written back: the same form (a single Fsa, or an FsaVec with one FSA per input FSA, in order); `lm_scores` =
-graph (the new LM part), scores = -(graph + acoustic) with the acoustic part untouched (as in the other
formats' outputs: the weights' am_scale is not applied), labels and aux_labels as read, a final arc from each
final state. Scores are float32, as in k2. An FsaVec's lattices are named `<file stem>-<index>`; an FSA that
fails is written as an empty FSA in its place (positions keep matching the decoder's utterances), except
after the last one written.
"""

from __future__ import annotations

import functools
import io
import os
import pickle
import re
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Sequence

import numpy as np

from ...files import atomic_write_bytes
from ..lattices.lattice import Lattice, LatticeFormatError, Ragged, SymbolTable
from .resolve import open_lattice_file, utterance_id

K2_KINDS = ("k2-fsa", "k2-fsavec")  # a file of one Fsa, or of an FsaVec
_INDEX = re.compile(r"-(\d+)\Z")
_GLOBAL = re.compile(r"GLOBAL (\S+?)[.,]?(?:\s|$)")
_EXPORT = ("save plain tensors instead: lats = k2.expand_ragged_attributes(lats); torch.save({k: v for k, v in "
           "lats.as_dict().items() if isinstance(v, torch.Tensor)}, path)")
_INT32 = 2**31


@dataclass
class K2Arrays:
    """The FSAs of a file as arrays: arcs (A, 4) int32 with states within their FSA; FSA i has arcs
    `arc_splits[i]:arc_splits[i + 1]` and `num_states[i]` states."""

    vec: bool
    arcs: np.ndarray  # (A, 4) int32
    arc_splits: np.ndarray  # (n + 1,) int64
    num_states: np.ndarray  # (n,) int64
    labels: np.ndarray  # (A,) int64
    scores: np.ndarray  # (A,) float64
    aux: np.ndarray | None  # (A,) int64
    lm: np.ndarray | None  # (A,) float64


def _reason(e: Exception) -> str:
    line = next((x.strip() for x in str(e).splitlines() if x.strip()), type(e).__name__)
    return re.split(r"(?<=[^.\s])\.\s", line + " ", maxsplit=1)[0].strip().rstrip(".")[:160]


def _load(path: Path) -> dict:
    """The dict of a torch.save file, loaded with weights_only (no code of the file runs)."""
    import torch

    with open_lattice_file(path) as f:
        try:
            obj = torch.load(f, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as e:
            if m := _GLOBAL.search(str(e)):  # torch's own advice (weights_only=False) would run the file's code
                raise LatticeFormatError(f"{path}: a pickled {m.group(1)} object needs k2 classes to unpickle "
                                         f"(ragged aux_labels, a SymbolTable, an Fsa), which are not read here; "
                                         f"{_EXPORT}") from None
            raise LatticeFormatError(f"{path}: not a torch.save file ({_reason(e)})") from None
        except RuntimeError as e:  # torch's zip reader: says what it found wrong
            raise LatticeFormatError(f"{path}: not a torch.save file, or a truncated one ({_reason(e)})") from None
        except (EOFError, OSError, ValueError, KeyError, IndexError, AttributeError, TypeError, zipfile.BadZipFile):
            raise LatticeFormatError(f"{path}: not a torch.save file, or a truncated one") from None
    if not isinstance(obj, dict):
        raise LatticeFormatError(f"{path}: holds a {type(obj).__name__}; expected the dict of a k2 Fsa "
                                 "(torch.save(fsa.as_dict()))")
    return obj


def _tensor(path: Path, d: dict, key: str, dtypes: tuple[str, ...], rows: int | None) -> np.ndarray | None:
    """`d[key]` as a numpy array, None when absent; it must be a tensor of one of `dtypes`, of `rows` rows
    when given (a per-arc attribute is 1-D)."""
    import torch

    v = d.get(key)
    if v is None:
        return None
    if not isinstance(v, torch.Tensor):
        raise LatticeFormatError(f"{path}: {key}: expected a tensor, got {type(v).__name__}")
    name = str(v.dtype).removeprefix("torch.")
    if name not in dtypes:
        raise LatticeFormatError(f"{path}: {key}: dtype {name}, expected {' or '.join(dtypes)}")
    if rows is not None and tuple(v.shape) != (rows,):
        raise LatticeFormatError(f"{path}: {key}: shape {tuple(v.shape)}, expected ({rows},): one value per arc")
    return v.detach().cpu().numpy()


def _single_num_states(path: Path, arcs: np.ndarray) -> int:
    """States of a single Fsa, as k2's FsaFromTensor counts them: up to the state the -1 arcs enter, else one
    past the highest state named (an FSA without a final arc); 0 without arcs (the empty FSA)."""
    if not len(arcs):
        return 0
    final = arcs[arcs[:, 2] == -1, 1]
    if final.size and np.any(final != final[0]):
        other = final[np.argmax(final != final[0])]
        raise LatticeFormatError(f"{path}: arcs: arcs labelled -1 enter states {final[0]} and {other}; an FSA has "
                                 "one final state")
    return max(int(final[0]) + 1, 0) if final.size else int(arcs[:, :2].max()) + 2


def _vec_layout(path: Path, flat: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(arcs (A, 4), arc splits (n + 1,), states (n,)) of an FsaVec's 1-D `arcs`, its header checked."""
    if flat.size < 2:
        raise LatticeFormatError(f"{path}: arcs: {flat.size} ints, too few for an FsaVec header (truncated)")
    n = int(flat[0])
    start = 2 + 2 * (n + 1)
    if n < 0 or flat.size < start:
        raise LatticeFormatError(f"{path}: arcs: {flat.size} ints cannot hold the header of {n} FSAs "
                                 f"(num_fsas, 0, 2 x {n + 1} row splits; truncated?)")
    if (flat.size - start) % 4:
        raise LatticeFormatError(f"{path}: arcs: {flat.size - start} ints after the header, not whole arcs of "
                                 "4 ints (truncated?)")
    splits1, splits12 = flat[2: 3 + n].astype(np.int64), flat[3 + n: start].astype(np.int64)
    for what, rs in (("row_splits1 (states before each FSA)", splits1), ("row_splits12 (arcs before each FSA)",
                                                                         splits12)):
        if rs[0] != 0:
            raise LatticeFormatError(f"{path}: arcs: {what} starts at {rs[0]}, expected 0")
        down = np.flatnonzero(np.diff(rs) < 0)
        if down.size:
            i = int(down[0])
            raise LatticeFormatError(f"{path}: arcs: {what} decrease at FSA {i} ({rs[i]} then {rs[i + 1]})")
    num_arcs = (flat.size - start) // 4
    if splits12[-1] != num_arcs:
        raise LatticeFormatError(f"{path}: arcs: row_splits12 counts {splits12[-1]} arcs, but {num_arcs} follow "
                                 "the header (truncated or inconsistent)")
    return flat[start:].reshape(num_arcs, 4), splits12, np.diff(splits1)


def read_k2_arrays(path: str | os.PathLike) -> K2Arrays:
    """The FSAs of a k2 file, their layout and per-arc attributes checked (the content of each FSA is checked
    when its lattice is built). Errors name the file and the field."""
    path = Path(path)
    d = _load(path)
    if "arcs" not in d:
        raise LatticeFormatError(f"{path}: arcs: missing; expected the dict of a k2 Fsa (torch.save(fsa.as_dict()))")
    raw = _tensor(path, d, "arcs", ("int32",), None)
    if raw.ndim == 2 and raw.shape[1] == 4:
        vec, arcs = False, raw
        splits, states = np.array([0, len(raw)]), np.array([_single_num_states(path, raw)])
    elif raw.ndim == 1:
        vec = True
        arcs, splits, states = _vec_layout(path, raw)
    else:
        raise LatticeFormatError(f"{path}: arcs: shape {tuple(raw.shape)}, expected (num_arcs, 4) for an Fsa or "
                                 "1-D for an FsaVec")
    A = len(arcs)
    labels = _tensor(path, d, "labels", ("int32",), A)
    scores = _tensor(path, d, "scores", ("float32", "float64"), A)
    aux = _tensor(path, d, "aux_labels", ("int32", "int64"), A)
    lm = _tensor(path, d, "lm_scores", ("float32", "float64"), A)
    return K2Arrays(vec, arcs, splits, states,
                 labels=(arcs[:, 2] if labels is None else labels).astype(np.int64),
                 scores=(np.ascontiguousarray(arcs[:, 3]).view(np.float32) if scores is None else scores)
                 .astype(np.float64),
                 aux=None if aux is None else aux.astype(np.int64), lm=None if lm is None else lm.astype(np.float64))


def _check_arcs(where: str, n: int, src: np.ndarray, dst: np.ndarray, label: np.ndarray) -> None:
    """k2's rules for an FSA of `n` states: states in range, arcs grouped by state in order, one final state
    (the last), entered exactly by the arcs labelled -1 and left by none."""
    if n == 0:
        raise LatticeFormatError(f"{where}: empty FSA (no states): nothing to rescore")
    for field, s in (("src_state", src), ("dest_state", dst)):
        bad = np.flatnonzero((s < 0) | (s >= n))
        if bad.size:
            j = int(bad[0])
            raise LatticeFormatError(f"{where}: arcs: arc {j} has {field} {s[j]}, outside the FSA's {n} states")
    bad = np.flatnonzero(np.diff(src) < 0)
    if bad.size:
        j = int(bad[0]) + 1
        raise LatticeFormatError(f"{where}: arcs: src_state goes back from {src[j - 1]} to {src[j]} at arc {j}; "
                                 "k2 keeps a state's arcs together, states in order")
    final = n - 1
    if (bad := np.flatnonzero(src == final)).size:
        raise LatticeFormatError(f"{where}: arcs: arc {bad[0]} leaves the final state {final} (the last state)")
    if (bad := np.flatnonzero(label < -1)).size:
        raise LatticeFormatError(f"{where}: labels: arc {bad[0]} has label {label[bad[0]]}; expected >= 0, or -1 "
                                 "into the final state")
    if (bad := np.flatnonzero((label == -1) != (dst == final))).size:
        j = int(bad[0])
        raise LatticeFormatError(f"{where}: labels: arc {j} " + (
            f"is labelled -1 but enters state {dst[j]}, not the final state {final}" if label[j] == -1 else
            f"enters the final state {final} with label {label[j]}; only arcs labelled -1 may"))
    if not np.any(label == -1):
        raise LatticeFormatError(f"{where}: arcs: no arc enters the final state {final} (label -1): the FSA "
                                 "accepts nothing")


def _words(where: str, field: str, ids: np.ndarray, final: np.ndarray, symbols: SymbolTable) -> np.ndarray:
    """(A,) word ids of the arcs (0 on final arcs), each checked against `symbols`."""
    w = np.where(final, 0, ids)
    if (bad := np.flatnonzero(w < 0)).size:
        raise LatticeFormatError(f"{where}: {field}: arc {bad[0]} has {w[bad[0]]}; a word id is >= 0 (-1 only "
                                 "on arcs into the final state)")
    if (bad := np.flatnonzero((w != 0) & ~symbols.has_ids(w))).size:
        raise LatticeFormatError(f"{where}: {field}: arc {bad[0]} has word id {w[bad[0]]}, which is not in the "
                                 f"symbol table ({len(symbols)} symbols)")
    return w


def _finite(where: str, field: str, x: np.ndarray) -> None:
    if (bad := np.flatnonzero(~np.isfinite(x))).size:
        raise LatticeFormatError(f"{where}: {field}: arc {bad[0]} has {x[bad[0]]}; scores must be finite")


def fsa_lattice(f: K2Arrays, i: int, symbols: SymbolTable, name: str, where: str) -> Lattice:
    """FSA `i` of `f` as a `Lattice` named `name` (see the module docstring); errors name `where`."""
    a0, a1 = int(f.arc_splits[i]), int(f.arc_splits[i + 1])
    n = int(f.num_states[i])
    src, dst = f.arcs[a0:a1, 0].astype(np.int64), f.arcs[a0:a1, 1].astype(np.int64)
    label, score = f.labels[a0:a1], f.scores[a0:a1]
    _check_arcs(where, n, src, dst, label)
    final = label == -1
    word = _words(where, "aux_labels" if f.aux is not None else "labels",
                  label if f.aux is None else f.aux[a0:a1], final, symbols)
    lm = np.zeros(a1 - a0) if f.lm is None else f.lm[a0:a1]
    _finite(where, "scores", score)
    _finite(where, "lm_scores", lm)
    graph, acoustic = -lm, lm - score
    fin = np.flatnonzero(final)
    fold = fin[np.bincount(src[fin], minlength=n)[src[fin]] == 1]  # a state's only final arc: its final weight
    keep = np.ones(a1 - a0, dtype=bool)
    keep[fold] = False
    S = n - 1 if fold.size == fin.size else n  # the k2 final state goes once no arc enters it
    final_graph, final_acoustic = np.full(S, np.inf), np.full(S, np.inf)
    final_graph[src[fold]], final_acoustic[src[fold]] = graph[fold], acoustic[fold]
    if S == n:
        final_graph[-1] = final_acoustic[-1] = 0.0
    tids = None
    if f.aux is not None:  # tokens; a final arc kept as an epsilon arc gets 0 (k2 allows -1 only into the final)
        tokens = np.where(final, 0, label)[keep].astype(np.int32)
        tids = Ragged(np.arange(tokens.size + 1, dtype=np.int64), tokens)
    return Lattice(name=name, num_states=S, start=0, src=src[keep], dst=dst[keep], word=word[keep],
                   graph=graph[keep], acoustic=acoustic[keep], final_graph=final_graph,
                   final_acoustic=final_acoustic, symbols=symbols, arc_tids=tids)


def iter_k2_entries(path: str | os.PathLike,
                    symbols: SymbolTable) -> Iterator[tuple[str, str, Callable[[], Lattice]]]:
    """(name, kind, load) of each FSA of a k2 file, as Kaldi archive entries are given. The file is read whole
    at the first step (a torch.save file is one pickle): a file that cannot be read, or whose layout is wrong,
    raises there; an FSA whose content is wrong fails alone, in its `load`."""
    path = Path(path)
    f = read_k2_arrays(path)
    stem = utterance_id(path)
    for i in range(len(f.num_states)):
        name, where = (f"{stem}-{i}", f"{path}: FSA {i}") if f.vec else (stem, str(path))
        yield name, K2_KINDS[f.vec], functools.partial(fsa_lattice, f, i, symbols, name, where)


def read_k2(path: str | os.PathLike, symbols: SymbolTable) -> list[Lattice]:
    """Every lattice of a k2 file (one for a single Fsa), the first problem raised."""
    return [load() for _, _, load in iter_k2_entries(path, symbols)]


# ----------------------------------------------------------------------------------------------------------
# Writing


@dataclass
class _Out:
    """One FSA laid out for k2: arcs (A, 4) int32 sorted by state, the words (-1 on final arcs) and the
    float32 LM part per arc; `tokens`: the labels are tokens and the words go to aux_labels."""

    arcs: np.ndarray
    words: np.ndarray
    lm: np.ndarray
    num_states: int
    tokens: bool


def _fsa_layout(lat: Lattice) -> _Out:
    """`lat` as a k2 FSA: its start state swapped with state 0, a final state added after the others, and a
    final arc from each final state carrying its final weight."""
    lat._check_shapes()
    S, where, is_final = lat.num_states, f"lattice {lat.name!r}", lat.is_final()
    if not is_final.any():
        raise LatticeFormatError(f"{where} has no final state; a k2 FSA needs one")
    if S + 1 >= _INT32 or (lat.num_arcs and not 0 <= lat.word.min() <= lat.word.max() < _INT32):
        raise LatticeFormatError(f"{where}: states and word ids must fit in int32 for a k2 FSA")
    new = np.arange(S)
    new[[0, lat.start]] = new[[lat.start, 0]]  # k2 starts at state 0
    fin = np.flatnonzero(is_final)
    t = lat.arc_tids
    tokens = t is not None and len(t.values) == lat.num_arcs and bool(np.all(t.lengths() == 1))
    minus = np.full(fin.size, -1)
    src = np.concatenate([new[lat.src], new[fin]])
    graph = np.concatenate([lat.graph, lat.final_graph[fin]])
    with np.errstate(over="ignore"):  # lm - acoustic, not -(graph + acoustic): a score of 0 stays +0.0 as read
        score = (-graph - np.concatenate([lat.acoustic, lat.final_acoustic[fin]])).astype(np.float32)
        lm = (-graph).astype(np.float32)
    if not (np.isfinite(score).all() and np.isfinite(lm).all()):
        raise LatticeFormatError(f"{where}: a score is not finite in float32 (k2 scores are float32)")
    order = np.argsort(src, kind="stable")  # (A + F,) each state's arcs, then its final arc
    arcs = np.empty((order.size, 4), dtype=np.int32)
    arcs[:, 0], arcs[:, 1] = src[order], np.concatenate([new[lat.dst], np.full(fin.size, S)])[order]
    arcs[:, 2] = np.concatenate([t.values if tokens else lat.word, minus])[order]
    arcs[:, 3] = score[order].view(np.int32)
    words = np.concatenate([lat.word, minus])[order].astype(np.int32)
    return _Out(arcs, words, lm[order], S + 1, tokens)


def _as_dict(outs: Sequence[_Out | None], vec: bool) -> dict:
    """The `as_dict()` of the FSAs (None: an empty FSA, in an FsaVec): plain tensors only."""
    import torch

    got = [o for o in outs if o is not None]
    arcs = np.concatenate([o.arcs for o in got]) if got else np.zeros((0, 4), dtype=np.int32)
    if vec:
        states = np.cumsum([0] + [o.num_states if o else 0 for o in outs])
        splits = np.cumsum([0] + [len(o.arcs) if o else 0 for o in outs])
        if states[-1] >= _INT32 or splits[-1] >= _INT32 // 4:
            raise LatticeFormatError(f"{len(outs)} lattices are too large for one k2 FsaVec (int32 offsets)")
        arcs = np.concatenate([[len(outs), 0], states, splits, arcs.ravel()]).astype(np.int32)
    d = {"arcs": torch.from_numpy(arcs)}
    if any(o.tokens for o in got):  # words on aux_labels; an FSA without tokens has them as labels too
        d["aux_labels"] = torch.from_numpy(np.concatenate([o.words for o in got]))
    d["lm_scores"] = torch.from_numpy(np.concatenate([o.lm for o in got]) if got else np.zeros(0, np.float32))
    return d


def k2_dict(lattices: Sequence[Lattice | None], vec: bool = True) -> dict:
    """The dict `Fsa.as_dict()` gives for `lattices` as an FsaVec (None: an empty FSA in its place), or, with
    `vec=False`, for the one lattice as a single Fsa (see the module docstring)."""
    if not vec and len(lattices) != 1:
        raise ValueError(f"a single Fsa holds one lattice, got {len(lattices)}")
    return _as_dict([None if lat is None else _fsa_layout(lat) for lat in lattices], vec)


def write_k2(path: str | os.PathLike, lattices: Sequence[Lattice | None], vec: bool = True) -> None:
    """`torch.save(k2_dict(lattices, vec), path)`, atomically."""
    _save(path, k2_dict(lattices, vec))


def _save(path: str | os.PathLike, d: dict) -> None:
    import torch

    buf = io.BytesIO()  # saved to a file, the zip's inner name would be the temp file's: the same bytes every run
    torch.save(d, buf)
    atomic_write_bytes(path, buf.getvalue())


class K2Writer:
    """Writes rescored lattices back as a k2 file, atomically, when the `with` block ends without an exception:
    kind "k2-fsa" a single Fsa (one lattice), "k2-fsavec" an FsaVec. A lattice named `<stem>-<index>` (as
    read) goes to FSA `index`, the FSAs before it that were not written are left empty; others go after the
    last. Each lattice is laid out when written, so a lattice k2 cannot hold fails alone."""

    def __init__(self, path: str | os.PathLike, kind: str = "k2-fsavec") -> None:
        if kind not in K2_KINDS:
            raise ValueError(f"kind must be one of {K2_KINDS}, got {kind!r}")
        self.path, self.vec = Path(path), kind == "k2-fsavec"
        self._fsas: dict[int, _Out] = {}

    def __enter__(self) -> K2Writer:
        return self

    def write(self, name: str, lattice: Lattice) -> None:
        if not self.vec and self._fsas:
            raise LatticeFormatError(f"{self.path}: a single Fsa holds one lattice; {name!r} would be a second")
        m = _INDEX.search(name) if self.vec else None
        index = int(m.group(1)) if m and int(m.group(1)) not in self._fsas else max(self._fsas, default=-1) + 1
        self._fsas[index] = _fsa_layout(lattice)

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None and self._fsas:
            outs = [self._fsas.get(i) for i in range(max(self._fsas) + 1)]
            _save(self.path, _as_dict(outs, self.vec))
