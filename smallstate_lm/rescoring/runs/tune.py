"""Weight tuning on a dev set: a grid over the chosen weights, then a finer
coordinate search around the best point. Every setting re-ranks cached components
(no LM call); errors per hypothesis are aligned once."""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from ...errors import ConfigError, SmallstateError
from ...weights import COMPONENTS, Weights, weight_vector
from ..decode.wer import align_counts
from ..nbest.components import MBR_DECIMALS, Components, linear_lm, mbr_distances
from ..nbest.lists import Utterance

DEFAULT_GRID = {
    "lm_weight": np.round(np.arange(0.0, 2.01, 0.1), 3).tolist(),
    "ngram_weight": np.round(np.arange(0.0, 2.01, 0.1), 3).tolist(),
    "word_penalty": np.round(np.arange(-3.0, 3.01, 0.25), 3).tolist(),
}
LAM_GRID = np.round(np.arange(0.0, 1.001, 0.1), 3).tolist()
SEARCHABLE = ("am_scale", "graph_scale", "lm_weight", "ngram_weight", "word_penalty", "oov_penalty", "lam")
# posterior scales tried by `tune(..., mbr=True)`; 0 keeps the highest total
MBR_GRID = [0.0, 0.1, 0.2, 0.3, 0.5, 0.7, 1.0, 1.5, 2.0, 3.0]


@dataclass
class TuneResult:
    weights: Weights
    errors: int
    ref_words: int
    baseline_errors: int  # the first hypothesis of each list (the decoder's 1-best)
    oracle_errors: int
    grid: dict[str, list[float]]
    surface: np.ndarray  # errors over the grid, axes in `grid` order (lam first when linear)
    mbr_errors: list[tuple[float, int]] | None = None  # (mbr_scale, errors) at the best other weights
    decode_choice: object | None = None  # lattices with decodes to choose among: tune_decode.DecodeChoice

    @property
    def wer(self) -> float:
        return self.errors / self.ref_words


def hypothesis_errors(utts: Sequence[Utterance], refs: dict[str, list[str]]) -> tuple[list[np.ndarray], int]:
    missing = [u.utt for u in utts if u.utt not in refs]
    if missing:
        raise SmallstateError(f"no reference for {len(missing)} utterance(s), e.g. {missing[0]!r}")
    errs = [np.array([align_counts(refs[u.utt], h.words).errors for h in u.hyps]) for u in utts]
    return errs, sum(len(refs[u.utt]) for u in utts)


class _Stack:
    """Padded (U, H, 6) components with -inf totals for missing hypotheses; with
    `distances`, also the padded (U, C, C) edit distances among each list's MBR candidates."""

    def __init__(self, comps: Sequence[Components], errs: Sequence[np.ndarray],
                 distances: Sequence[np.ndarray] | None = None):
        U, H = len(comps), max(len(e) for e in errs)
        self.m = np.zeros((U, H, len(COMPONENTS)))
        self.valid = np.zeros((U, H), dtype=bool)
        self.err = np.zeros((U, H))
        for i, (c, e) in enumerate(zip(comps, errs)):
            self.m[i, : len(e)] = c.matrix()
            self.valid[i, : len(e)] = True
            self.err[i, : len(e)] = e
        self.dist = None
        if distances is not None:
            C = max(len(d) for d in distances)
            self.dist = np.zeros((U, C, C))
            self.cand = np.zeros((U, C), dtype=bool)
            for i, d in enumerate(distances):
                self.dist[i, : len(d), : len(d)] = d
                self.cand[i, : len(d)] = True

    def errors(self, W: np.ndarray, mbr_scale: float = 0.0, chunk: int = 512) -> np.ndarray:
        """W (S, 6) weight vectors -> (S,) total errors of the chosen hypotheses: the
        highest total, or with mbr_scale > 0 the fewest expected errors."""
        out = np.empty(len(W))
        if mbr_scale > 0:
            chunk = max(1, chunk // 8)  # the (S, U, C, C) product is the big array here
        for s in range(0, len(W), chunk):
            t = np.einsum("uhk,sk->suh", self.m, W[s : s + chunk])  # (S, U, H)
            t = np.where(self.valid[None], t, -np.inf)
            if mbr_scale > 0:
                C = self.dist.shape[1]
                tc = np.where(self.cand[None], mbr_scale * t[:, :, :C], -np.inf)  # (S, U, C)
                p = np.exp(tc - tc.max(axis=2, keepdims=True))
                p /= p.sum(axis=2, keepdims=True)
                risk = np.round(np.einsum("suj,uij->sui", p, self.dist), MBR_DECIMALS)  # (S, U, C)
                risk = np.where(self.cand[None], risk, np.inf)
                # ties go to the higher total, as in `ranking`
                best = np.lexsort((-tc, risk), axis=2)[..., 0]
            else:
                best = t.argmax(axis=2)  # (S, U)
            out[s : s + chunk] = np.take_along_axis(self.err[None], best[..., None], axis=2)[..., 0].sum(axis=1)
        return out


def _smooth(x: np.ndarray) -> np.ndarray:
    """Box filter of width 3 along every axis (edges replicated): breaks ties towards
    the middle of a flat optimum, which transfers better to unseen data."""
    for ax in range(x.ndim):
        if x.shape[ax] < 3:
            continue
        p = np.concatenate([np.take(x, [0], ax), x, np.take(x, [-1], ax)], axis=ax)
        n = x.shape[ax]
        x = (np.take(p, range(0, n), ax) + np.take(p, range(1, n + 1), ax) + np.take(p, range(2, n + 2), ax)) / 3
    return x


class _Errors:
    """Word errors of the lists' best hypotheses at many weight points at once: one stack of components per
    interpolation weight `lam` (linear interpolation puts the mixed LM in the neural column)."""

    def __init__(self, base: Weights, comps: Sequence[Components], errs, dists):
        self.base, self.comps, self.errs, self.dists = base, comps, errs, dists
        self.stacks: dict[float | None, _Stack] = {}

    def _stack(self, lam: float | None) -> _Stack:
        if lam not in self.stacks:
            cs = self.comps if lam is None else [dataclasses.replace(c, neural=linear_lm(c, lam), ngram=None)
                                                 for c in self.comps]
            self.stacks[lam] = _Stack(cs, self.errs, self.dists)
        return self.stacks[lam]

    def __call__(self, points: list[dict], mbr_scale: float | None = None) -> np.ndarray:
        base = self.base
        scale = base.mbr_scale if mbr_scale is None else mbr_scale
        if base.interpolation != "linear":
            return self._stack(None).errors(np.array([weight_vector(dataclasses.replace(base, **p)) for p in points]),
                                            scale)
        out = np.empty(len(points))
        by_lam: dict[float, list[int]] = {}
        for i, p in enumerate(points):
            by_lam.setdefault(p.get("lam", base.lam), []).append(i)
        for lam, idx in by_lam.items():
            W = np.array([weight_vector(dataclasses.replace(base, **{**points[i], "lam": lam})) for i in idx])
            out[idx] = self._stack(lam).errors(W, scale)
        return out


def tune(utts: Sequence[Utterance], comps: Sequence[Components], refs: dict[str, list[str]], base: Weights,
         grid: dict[str, list[float]] | None = None, refine: bool = True, mbr: bool = False) -> TuneResult:
    """Grid search, then a finer coordinate search around the best point. With `mbr`,
    the MBR posterior scale is then chosen from MBR_GRID at those weights, and each
    weight is searched once more over its grid under that scale (MBR often wants a
    different LM weight)."""
    grid = checked_grid(base, grid)
    errs, ref_words = hypothesis_errors(utts, refs)
    base = dataclasses.replace(base, mbr_scale=0.0) if mbr else base
    dists = [mbr_distances(u, c) for u, c in zip(utts, comps)] if mbr or base.mbr_scale > 0 else None
    errors_for = _Errors(base, comps, errs, dists)
    keys = list(grid)
    points = [dict(zip(keys, vals)) for vals in itertools.product(*(grid[k] for k in keys))]
    e = errors_for(points)
    surface = e.reshape([len(grid[k]) for k in keys])
    score = surface + 1e-3 * _smooth(surface)  # errors first; smoothed errors break ties
    best = int(np.argmin(score.reshape(-1)))
    best_point, best_err = points[best], float(e[best])
    if refine:
        best_point, best_err = _refined(errors_for, grid, best_point, best_err)
    mbr_errors = None
    if mbr:
        best_point, best_err, mbr_errors = _with_mbr(errors_for, grid, best_point, best_err)
    return TuneResult(weights=dataclasses.replace(base, **best_point), errors=int(best_err), ref_words=ref_words,
                      baseline_errors=int(sum(e[0] for e in errs)), oracle_errors=int(sum(e.min() for e in errs)),
                      grid=grid, surface=surface, mbr_errors=mbr_errors)


def _refined(errors_for: _Errors, grid: dict[str, list[float]], best_point: dict, best_err: float) -> tuple:
    """A coordinate search at a quarter of each grid step around the best grid point (not over `lam`)."""
    for k, vals in grid.items():
        step = (vals[1] - vals[0]) / 4 if len(vals) > 1 else 0
        if step <= 0 or k == "lam":
            continue
        cands = [{**best_point, k: round(best_point[k] + d * step, 6)} for d in (-2, -1, 1, 2)]
        ce = errors_for(cands)
        j = int(np.argmin(ce))
        if ce[j] < best_err:
            best_point, best_err = cands[j], float(ce[j])
    return best_point, best_err


def _with_mbr(errors_for: _Errors, grid: dict[str, list[float]], best_point: dict, best_err: float) -> tuple:
    """The MBR scale from MBR_GRID at the best weights, then each weight over its grid under that scale; also
    the errors at each scale."""
    me = np.array([errors_for([best_point], m)[0] for m in MBR_GRID])
    j = int(np.argmin(me + 1e-3 * _smooth(me)))
    mbr_errors = [(m, int(x)) for m, x in zip(MBR_GRID, me)]
    if me[j] < best_err:
        best_err = float(me[j])
        best_point = {**best_point, "mbr_scale": MBR_GRID[j]}
        for k in grid:
            cands = [{**best_point, k: v} for v in grid[k]]
            ce = errors_for(cands, MBR_GRID[j])
            i = int(np.argmin(ce))
            if ce[i] < best_err:
                best_point, best_err = cands[i], float(ce[i])
    return best_point, best_err, mbr_errors


def surface_text(r: TuneResult) -> str:
    """WER against each tuned weight, the others held at their best values."""
    keys = list(r.grid)
    best_idx = []
    for k in keys:
        vals = np.array(r.grid[k])
        best_idx.append(int(np.argmin(np.abs(vals - getattr(r.weights, k)))))
    lines = []
    for ax, k in enumerate(keys):
        idx = list(best_idx)
        row = []
        for i, v in enumerate(r.grid[k]):
            idx[ax] = i
            row.append(f"{v:g}:{100 * r.surface[tuple(idx)] / r.ref_words:.2f}")
        lines.append(f"WER% vs {k}: " + "  ".join(row))
    return "\n".join(lines)


def plot_surface(r: TuneResult, path: str) -> bool:
    """PNG of WER against lm_weight (others at their best); False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    keys = list(r.grid)
    if "lm_weight" not in keys:
        return False
    idx = [int(np.argmin(np.abs(np.array(r.grid[k]) - getattr(r.weights, k)))) for k in keys]
    ax_i = keys.index("lm_weight")
    ys = []
    for i in range(len(r.grid["lm_weight"])):
        idx[ax_i] = i
        ys.append(100 * r.surface[tuple(idx)] / r.ref_words)
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(r.grid["lm_weight"], ys, marker="o")
    ax.set_xlabel("lm_weight")
    ax.set_ylabel("WER (%)")
    ax.set_title("dev WER vs neural LM weight (other weights at their best)")
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


def checked_grid(base: Weights, grid: dict[str, list[float]] | None) -> dict[str, list[float]]:
    """The grid to search under `base`: names checked; with linear interpolation `lam`
    (0 to 1) replaces `ngram_weight` and comes first, otherwise `lam` is dropped."""
    grid = dict(grid or DEFAULT_GRID)
    for k, v in grid.items():
        if k not in SEARCHABLE:
            raise ConfigError(f"cannot tune {k!r}; choose among {', '.join(SEARCHABLE)}")
        if not v:
            raise ConfigError(f"empty grid for {k!r}")
    if base.interpolation == "linear":
        grid.pop("ngram_weight", None)
        grid.setdefault("lam", LAM_GRID)
        grid = {"lam": grid.pop("lam"), **grid}  # lam first: components change with it
    elif "lam" in grid:
        grid.pop("lam")
    return grid


def tune_lattices(expanded: Sequence, refs: dict[str, list[str]], base: Weights, grid: dict[str, list[float]],
                  rounds: int = 2, decodes: Sequence[str] | None = None) -> TuneResult:
    """Coordinate search on expanded lattices: each weight in turn takes the grid value
    that minimises errors with the others held; each setting is a Viterbi search over
    the stored expanded graphs (no LM call). Merged histories were chosen under the
    weights the lattices were expanded with, so re-expanding with the tuned weights
    and tuning again can still move a little. With `decodes` (viterbi and/or mbr), the decode and the
    posterior scale are then chosen at those weights (`tune_decode.choose_decode`)."""
    from ..decode.wer import align_counts

    missing = [e.name for e in expanded if e.name not in refs]
    if missing:
        raise SmallstateError(f"no reference for {len(missing)} lattice(s), e.g. {missing[0]!r}")
    grid = checked_grid(base, grid)
    ref_words = sum(len(refs[e.name]) for e in expanded)

    def errors(w: Weights) -> int:
        return sum(align_counts(refs[e.name], e.best_words(w)).errors for e in expanded)

    first = dataclasses.replace(base, lm_weight=0.0, ngram_weight=0.0, word_penalty=0.0, oov_penalty=0.0)
    baseline = errors(first)
    best_w, best_e = base, errors(base)
    keys = list(grid)
    for _ in range(rounds):
        changed = False
        for k in keys:
            for v in grid[k]:
                cand = dataclasses.replace(best_w, **{k: v})
                e = errors(cand)
                if e < best_e:
                    best_w, best_e, changed = cand, e, True
        if not changed:
            break
    surface = np.array([errors(dataclasses.replace(best_w, **{keys[0]: v})) for v in grid[keys[0]]]) if keys else \
        np.zeros(0)
    choice = None
    if decodes:
        from .tune_decode import choose_decode

        choice = choose_decode(expanded, refs, dataclasses.replace(best_w, decode="viterbi"), best_e, decodes, grid)
        best_w, best_e = choice.weights, choice.errors
    return TuneResult(weights=best_w, errors=best_e, ref_words=ref_words, baseline_errors=baseline,
                      oracle_errors=-1, grid={keys[0]: grid[keys[0]]} if keys else {}, surface=surface,
                      decode_choice=choice)
