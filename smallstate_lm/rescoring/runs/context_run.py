"""Rescoring in spoken order, each utterance read after what the rescorer chose for the ones before it
(`rescore --utt2doc FILE --context-utts K`): the documents of an utt2doc file (`utterance document` per
line, in spoken order, as Kaldi's utt2spk), each document's utterances one after the other, both LMs
conditioned on the chosen transcripts of up to K previous utterances of the same document (never on a
reference). Documents are independent: a wave holds the next utterance of every document, so the LMs still
see many lattices or lists per call, and `--jobs` hands whole documents to a worker."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from ...errors import ConfigError
from ...files import read_utt2doc
from ...scoring.context import History
from ...weights import Weights
from ..formats.lattice_io import LatticeInput, lattice_inputs
from ..nbest.components import Components, ScoreStats, apply_weights, compute_components
from ..nbest.lists import Utterance
from .lattice_files import rescore_lattices

CONTEXT_KEY = "context_utts"  # where a weights file made by `tune --utt2doc` keeps the K it chose


@dataclass(frozen=True)
class ContextPlan:
    """The documents (`order`: utterance -> (document, position in spoken order)), how many previous
    utterances each one is read after (`utts`, 0: none, but still in spoken order), and whether the n-gram
    reads them too (`ngram`; off by default: an n-gram trained sentence by sentence has no history across a
    boundary, and starting it after the previous words measured worse than from `<s>`, docs/results.md)."""

    order: dict[str, tuple[str, int]]
    utts: int = 1
    ngram: bool = False
    source: str = "utt2doc"

    def __post_init__(self):
        if self.utts < 0:
            raise ConfigError(f"--context-utts must be >= 0, got {self.utts}")

    @classmethod
    def read(cls, path: str | Path, utts: int = 1, ngram: bool = False) -> ContextPlan:
        """An utt2doc file: `utterance document` per line, in spoken order; blank lines are skipped."""
        order = {utt: (doc, k) for k, (utt, doc) in enumerate(read_utt2doc(path, ConfigError))}
        if not order:
            raise ConfigError(f"{path}: no utterances; expected 'utterance document' per line")
        return cls(order, utts, ngram, str(path))

    def with_utts(self, utts: int) -> ContextPlan:
        return dataclasses.replace(self, utts=utts)

    def lattices(self, inputs, symbols, rescorer, nbest: int = 10, write_lattices: bool = True, ctm=None):
        """`lattices_in_context` under this plan (what `rescore_lattice_files` calls with one)."""
        return lattices_in_context(inputs, symbols, rescorer, self, nbest, write_lattices, ctm)

    def document(self, name: str) -> str:
        return self.order[name][0]

    def check(self, names: Sequence[str], what: str = "input") -> None:
        """Every utterance to rescore must be in the utt2doc file, once."""
        missing = [n for n in names if n not in self.order]
        if missing:
            more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
            raise ConfigError(f"{self.source}: no document for utterance {missing[0]!r} of the {what}{more}; "
                              "every utterance rescored with context must be listed")
        seen: set[str] = set()
        for n in names:
            if n in seen:
                raise ConfigError(f"utterance {n!r} appears twice in the {what}")
            seen.add(n)

    def waves(self, names: Sequence[str]) -> list[list[int]]:
        """Indices into `names` in rounds: round t holds the t-th utterance (in spoken order) of every
        document that has one, so an utterance comes after every earlier one of its document."""
        by_doc: dict[str, list[int]] = {}
        for i in sorted(range(len(names)), key=lambda i: self.order[names[i]][1]):
            by_doc.setdefault(self.document(names[i]), []).append(i)
        rounds = max((len(v) for v in by_doc.values()), default=0)
        return [[v[t] for v in by_doc.values() if t < len(v)] for t in range(rounds)]

    def history(self, histories: dict[str, History], name: str) -> History:
        doc = self.document(name)
        if doc not in histories:
            histories[doc] = History(self.utts)
        return histories[doc]


def context_utts_of(weights_file: str | Path | None) -> int | None:
    """The K a weights file from `tune --utt2doc` chose (None: the file has none)."""
    import json

    if weights_file is None:
        return None
    try:
        value = json.loads(Path(weights_file).read_text()).get(CONTEXT_KEY)
    except (OSError, ValueError, AttributeError):
        return None  # Weights.load reports a bad file
    if value is None:
        return None
    if not isinstance(value, int) or value < 0:
        raise ConfigError(f"{weights_file}: {CONTEXT_KEY} must be a whole number >= 0, got {value!r}")
    return value


def nbest_in_context(utts: Sequence[Utterance], neural, ngram, weights: Weights, plan: ContextPlan,
                     progress: bool = False, said: dict[str, list[str]] | None = None,
                     ) -> tuple[list[Utterance], list[Components], ScoreStats]:
    """Rank `utts` in spoken order, each list's hypotheses scored after its document's chosen transcripts:
    (the ranked utterances and their components, both in input order; the scoring stats). `said`: what is
    read as each utterance's context instead of the chosen transcript (references, for an upper bound)."""
    from tqdm import tqdm

    names = [u.utt for u in utts]
    plan.check(names, "n-best lists")
    ranked: list[Utterance | None] = [None] * len(utts)
    comps: list[Components | None] = [None] * len(utts)
    total = ScoreStats()
    histories: dict[str, History] = {}
    with tqdm(total=len(utts), disable=not progress, desc="in spoken order", unit="utt") as bar:
        for wave in plan.waves(names):
            part = [utts[i] for i in wave]
            contexts = [plan.history(histories, u.utt).sentences() for u in part]
            got, stats = compute_components(part, neural, ngram, progress=False, contexts=contexts,
                                            ngram_context=plan.ngram)
            for i, u, c, r in zip(wave, part, got, apply_weights(part, got, weights)):
                ranked[i], comps[i] = r, c
                plan.history(histories, u.utt).add(said[u.utt] if said is not None else r.hyps[0].words)
            for name in ("utterances", "hypotheses", "tokens_total", "tokens_computed", "seconds"):
                setattr(total, name, getattr(total, name) + getattr(stats, name))
            bar.update(len(wave))
    words = sum(float(c.n_words.sum()) for c in comps)
    total.oov_rate = sum(float(c.n_oov.sum()) for c in comps) / words if words else 0.0
    return ranked, comps, total


def _held(item: LatticeInput) -> LatticeInput:
    """An archive's entry read now (archives are read as a stream, in their order; a run in spoken order
    takes entries out of it), a single file left to load when its turn comes."""
    if item.archive is None:
        return item
    try:
        lat = item.load()
    except Exception:  # noqa: BLE001 - its own load raises it again, as that lattice's failure
        return item
    return dataclasses.replace(item, load=functools.partial(_same, lat))


def _same(lat):
    return lat


def lattices_in_context(inputs: Iterable, symbols, rescorer, plan: ContextPlan, nbest: int = 10,
                        write_lattices: bool = True, ctm=None,
                        said: dict[str, list[str]] | None = None) -> Iterator[tuple[int, object]]:
    """`rescore_lattices` in spoken order: yield (index of the lattice among the inputs, LatticeResult), each
    lattice expanded from its LMs' state after its document's chosen transcripts (`LatticeRescorer.
    context_start`). A lattice that fails is reported as a result and leaves its document's context as it
    was. `said`: as for `nbest_in_context`."""
    items = [_held(it) for x in inputs
             for it in ([x] if isinstance(x, LatticeInput) else lattice_inputs([x], symbols))]
    names = [it.name for it in items]
    plan.check(names, "lattices")
    histories: dict[str, History] = {}
    per_block = rescorer.cfg.lattices_per_batch(rescorer.model is not None)
    for wave in ([block[k] for k in local] for block in document_groups(names, plan, per_block)
                 for local in plan.waves([names[i] for i in block])):
        starts = {}
        for j, i in enumerate(wave):
            start = rescorer.context_start(plan.history(histories, names[i]).sentences(), plan.ngram)
            if start is not None:
                starts[j] = start
        for j, r in rescore_lattices([items[i] for i in wave], symbols, rescorer, nbest, write_lattices, ctm,
                                     starts=starts, batch=len(wave)):
            if r.error is None:
                plan.history(histories, names[wave[j]]).add(said[r.name] if said is not None else r.best)
            yield wave[j], r


def document_groups(names: Sequence[str], plan: ContextPlan, per_block: int | None = None) -> list[list[int]]:
    """Indices into `names` grouped by document (in order of each document's first input); with `per_block`,
    blocks of that many documents. A run in spoken order takes one block at a time (a round of it holds the next
    lattice of each of its documents), and `--jobs` and Ray workers take whole blocks: every lattice then shares
    its LM calls with the same others whatever the number of workers, so the outputs are the same, float
    rounding included."""
    groups: dict[str, list[int]] = {}
    for i, n in enumerate(names):
        groups.setdefault(plan.document(n), []).append(i)
    docs = list(groups.values())
    if per_block is None:
        return docs
    return [[i for d in docs[b : b + per_block] for i in d] for b in range(0, len(docs), per_block)]
