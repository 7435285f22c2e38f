"""A request's work: its hypothesis lists and prepared lattices as the worker takes them, with what
they are predicted to cost (tokens, seconds, bytes) before any of it is done. Library objects in
(`Utterance`s, `Lattice`s, `Weights`), no HTTP and no request schemas; runs on any thread, reading
the loaded models only."""

from __future__ import annotations

import dataclasses
import heapq
import itertools
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from smallstate_lm.errors import ConfigError, SmallstateError
from smallstate_lm.rescoring.decode.transcript import Decoded
from smallstate_lm.rescoring.lattices.kbest import ScoredPath
from smallstate_lm.rescoring.lattices.lattice import Lattice
from smallstate_lm.rescoring.nbest.components import Components
from smallstate_lm.rescoring.nbest.lists import Hypothesis, Utterance
from smallstate_lm.scoring.trie import TreeSize, trie_sizes
from smallstate_lm.vocab import EOS, EOS_ID
from smallstate_lm.weights import Weights, check_overlap

from ..cost import LatticeShape, lattice_shape, lattices_together
from ..errors import ServiceError
from ..model import Models

MIN_KNOWN = 0.5  # check_overlap's default: the share of a lattice's words its LMs must know


@dataclass
class NbestItem:
    """One hypothesis list. `scored` is what the LMs see (context words first), `plain` the same
    hypotheses without the context; both have the hypotheses' positions as ids, `ids` holds
    the ids they came with."""

    scored: Utterance
    plain: Utterance
    ids: list[str]
    context: int  # number of context words in front of every hypothesis of `scored`
    comps: Components | None = None
    cost: int = 0  # neural LM tokens computed (trie nodes)
    depth: int = 0  # tokens of its longest hypothesis (with the context and </s>)
    seconds: float = 0.0  # predicted by the cost model
    tree: TreeSize | None = None  # its trie's size (`scored` as the neural LM sees it), when prefixes are shared
    # scored in pieces (hypothesis indices each) when one step would take too long; their LM scores meanwhile
    neural_tok: list | None = None
    ngram_tok: list | None = None


@dataclass
class LatticeItem:
    lattice: Lattice  # prepared (see `prepared`); its name is the utterance id
    n: int  # distinct word sequences to return
    context: list[list[str]] | None = None  # sentences said before it: its LMs start after them
    hyps: list[ScoredPath] | None = None  # ExpandedLattice.nbest
    transcript: Decoded | None = None  # the best path or the consensus (weights.decode), with confidences
    lm_steps: int = 0
    seconds: float = 0.0  # predicted by the cost model: an upper bound (beam pruning is not foreseen)
    nbytes: int = 0
    shape: LatticeShape | None = None  # what its expansion may take (computed when the request is prepared)


@dataclass
class Work:
    """One request: its items in request order, the request field of each (for error messages)
    and its token counts (its cost in a batch)."""

    kind: Literal["rescore", "score"]
    weights: Weights
    items: list[NbestItem | LatticeItem]
    fields: list[str]
    nbest: int | None = None  # hypotheses returned per list; None: all
    token_logprobs: bool = False
    tokens_total: int = 0
    tokens_computed: int = 0
    lattice_arcs: int = 0
    seconds: float = 0.0  # predicted: hypothesis lists, plus the lattices' upper bound
    lattice_seconds: float = 0.0  # the lattices' part of it
    nbytes: int = 0  # predicted peak working memory and LM state
    error: BaseException | None = None

    @property
    def cost(self) -> int:
        return self.tokens_computed + self.lattice_arcs

    @property
    def hypotheses(self) -> int:
        """Hypotheses its answer may hold: every list's, and up to n per lattice."""
        return sum(len(it.scored.hyps) if isinstance(it, NbestItem) else it.n for it in self.items)


class PreparedLattice(Lattice):
    """A lattice prepared when its request came in, where its limits and cost estimate need the prepared
    form: the expansion prepares every lattice it is given, and this one answers that it already is,
    instead of sorting, trimming and copying its arrays a second time."""

    def prepare(self) -> Lattice:
        return self


def prepared(lat: Lattice) -> PreparedLattice:
    """`lat.prepare()` (which may warn or raise LatticeFormatError), done once for the lattice's whole way."""
    p = lat.prepare()
    return PreparedLattice(**{f.name: getattr(p, f.name) for f in dataclasses.fields(p)})


def request_weights(models: Models, overrides: dict[str, Any]) -> Weights:
    """The server's default weights with a request's `overrides`; errors name the field."""
    w = models.weights
    if overrides:
        try:
            w = dataclasses.replace(w, **overrides)
        except ConfigError as e:
            raise ServiceError(str(e), "weights") from None
    if w.interpolation == "linear" and (models.neural is None or models.ngram is None):
        raise ServiceError("linear interpolation needs both a neural LM and an n-gram; this server has "
                           + ("no n-gram" if models.ngram is None else "no neural LM"), "weights.interpolation")
    return w


def context_words(sentences: list[list[str]]) -> list[str]:
    """What a list's hypotheses are read after, as words: each context sentence then `</s>` (which the neural
    LM's vocabulary takes as its end token), so a hypothesis follows a sentence's end as in training across
    sentences, and as `rescore --utt2doc` reads it."""
    return [w for s in sentences for w in (*s, EOS)]


def nbest_item(utt: Utterance, context: list[str], ids: list[str] | None = None) -> NbestItem:
    """`utt`'s hypotheses, scored after the `context` words (`context_words`; their own log-probs not counted,
    the n-gram's taken from `<s>`). With `ids` (the
    ones the hypotheses came with), `utt`'s hypotheses have their positions as ids already and are taken as
    they are."""
    if ids is not None:
        return _item(utt, context, ids)
    plain = Utterance(utt.utt, [Hypothesis(words=h.words, am=h.am, graph=h.graph, id=str(j))
                                for j, h in enumerate(utt.hyps)])
    return _item(plain, context, [h.id if h.id is not None else str(j) for j, h in enumerate(utt.hyps)])


def _item(plain: Utterance, context: list[str], ids: list[str]) -> NbestItem:
    scored = plain
    if context:
        scored = Utterance(plain.utt, [Hypothesis(words=context + h.words, am=h.am, graph=h.graph, id=h.id)
                                     for h in plain.hyps])
    return NbestItem(scored=scored, plain=plain, ids=ids, context=len(context))


def make_work(models: Models, work: Work, sizes: list[TreeSize | None] | None = None,
              max_bytes: int | None = None) -> Work:
    """A request's work, given as its kind, weights, items, fields and what to answer (a new `Work`), with its
    token counts (the tokens its hypotheses have, the ones a prefix-sharing scorer computes), lattice arcs, and
    predicted seconds and bytes filled in; returns it. `sizes`: the hypothesis lists' `trie_sizes`, in order, when
    already worked out; `max_bytes`: the request's byte limit, which sets how many of its lattices are expanded
    together (default: the server's `max_request_bytes`)."""
    if work.tokens_total or work.tokens_computed or work.lattice_arcs or work.seconds or work.nbytes:
        raise ValueError("make_work takes a new Work, its counts and predictions not yet filled in")
    items, fields = work.items, work.fields
    neural = models.neural is not None
    lattice_bytes = []
    lists = [it for it in items if not isinstance(it, LatticeItem)]
    if sizes is None:
        sizes = trie_sizes_of(models, [[h.words for h in it.scored.hyps] for it in lists])
    sizes = dict(zip(map(id, lists), sizes, strict=True))
    for it, field in zip(items, fields):
        if isinstance(it, LatticeItem):
            check_lattice_vocabulary(models, it.lattice, f"{field}.lattice")
            lattice_bytes.append(it.nbytes)
            work.lattice_arcs += it.lattice.num_arcs
            work.lattice_seconds += it.seconds
        else:
            tokens, nbytes = _estimate_list(models, it, sizes.get(id(it)))
            work.tokens_total += tokens
            work.nbytes = max(work.nbytes, nbytes)
            work.tokens_computed += it.cost if neural else 0
    work.seconds = _lists_seconds(models, [it.seconds for it in lists]) + work.lattice_seconds
    limit = max_bytes if max_bytes is not None else models.s.max_request_bytes
    work.nbytes = max(work.nbytes, lattices_peak(models, lattice_bytes, limit))
    return work


def lattices_peak(models: Models, nbytes: list[int], limit: int) -> int:
    """Predicted peak bytes of expanding lattices of predicted peaks `nbytes`, `lattices_together` at a time: the
    largest of them may be held together. At most `limit` unless one lattice alone needs more."""
    per_batch = models.expand_config.lattices_per_batch(models.neural is not None)
    return sum(heapq.nlargest(lattices_together(per_batch, nbytes, limit), nbytes))


def lattice_item(models: Models, lat: Lattice, n: int, shape: LatticeShape | None = None) -> LatticeItem:
    """A prepared lattice as work, with its shape (`shape` when known) and what the cost model predicts of it."""
    shape = shape if shape is not None else lattice_shape(lat, models.expand_config.max_per_state)
    est = models.cost.lattice(shape, models.expand_config.max_level_bytes, models.neural is not None,
                              models.ngram is not None)
    return LatticeItem(lattice=lat, n=n, shape=shape, seconds=est.seconds, nbytes=est.nbytes)



def _estimate_list(models: Models, it: NbestItem, size: TreeSize | None) -> tuple[int, int]:
    """Sets the list's cost (the neural LM tokens it needs computed), depth and predicted seconds; returns its
    tokens and predicted peak bytes. `size`: its trie's (`trie_sizes_of`; None unless the scorer shares prefixes)."""
    seqs = [h.words for h in it.scored.hyps]
    est = _list_estimate(models, lm_lengths(models, seqs), size, seqs)
    tokens, it.cost, it.depth, nbytes, it.seconds = est
    it.tree = size
    return tokens, nbytes


def _list_estimate(models: Models, lens: list[int], size: TreeSize | None, seqs: list[list[str]] | None = None,
                   nbytes: bool = True) -> tuple[int, int, int, int, float]:
    """(tokens, neural LM tokens computed, depth, peak bytes, predicted seconds) of a list of word sequences as
    the LMs see them, of lengths `lens`, before any work (no model call); peak bytes 0 unless `nbytes` (a tree
    plan's bytes take longer to work out than its seconds). The sequences themselves (`seqs`) are needed only
    without a `size` (a scorer that does not share prefixes estimates its own cost)."""
    tokens = sum(lens) + len(lens)
    cost, depth, peak = tokens, max(lens) + 1, 0
    neural = models.neural
    if neural is not None:
        if size is not None:
            cost, peak = size.total_nodes, _tree_bytes(models, size) if nbytes else 0
        else:  # scored level by level or padded: the scorer's own estimate
            cost, peak = neural.estimate_cost([seqs])
    seconds = models.cost.nbest_seconds(cost, depth, tokens, neural is not None, models.ngram is not None,
                                        models.step_s)
    return tokens, cost, depth, peak, seconds


def _lists_seconds(models: Models, seconds: list[float]) -> float:
    """A request's hypothesis lists together, from each one's predicted seconds: lists scored whole share their
    calls with the request's other lists (and the batch's)."""
    if models.neural is None or not seconds:
        return sum(seconds)
    return sum(_share(models, x) for x in seconds) + models.cost.call_s


def _share(models: Models, seconds: float) -> float:
    """A list's predicted `seconds` as part of a request (neural LM): a list scored whole shares its call with the
    request's other lists (monotone in `seconds`)."""
    return seconds - (models.cost.call_s if seconds <= models.step_s else 0.0)


def lists_seconds(models: Models, lists: list[list[list[str]]], lens: list[list[int]],
                  sizes: list[TreeSize | None]) -> float:
    """What `make_work` will predict for hypothesis lists given as word sequences (as the LMs see them: any
    context words first), their lengths and their `trie_sizes_of`, without building them: a request's cheapest
    prediction, for refusing it early."""
    return _lists_seconds(models, [_list_estimate(models, n, size, seqs, nbytes=False)[4]
                                   for seqs, n, size in zip(lists, lens, sizes, strict=True)])


def list_floor(models: Models, lens: list[int]) -> float:
    """A floor under the share of a request's predicted seconds (`make_work`'s) that a hypothesis list adds, from
    the lengths of its word sequences (as the LMs see them) alone: no trie. A request's lists are predicted to take
    at least the sum of their floors."""
    if not lens:
        return 0.0
    tokens = sum(lens) + len(lens)
    depth = max(lens) + 1
    neural = models.neural is not None
    # a trie holds the longest sequence's path at least; a scorer without prefix sharing computes more nodes
    seconds = models.cost.nbest_seconds(depth - 1, depth, tokens, neural, models.ngram is not None, models.step_s)
    return _share(models, seconds) if neural else seconds  # monotone: a floor stays a floor


def lm_lengths(models: Models, seqs: list[list[str]]) -> list[int]:
    """The neural LM's tokens (without `</s>`) of each word sequence: its words, or a subword LM's pieces of them."""
    return models.neural.vocab.lengths(seqs) if models.neural is not None else list(map(len, seqs))


def trie_sizes_of(models: Models, lists: list[list[list[str]]]) -> list[TreeSize | None]:
    """The size of the prefix trie the scorer builds over each list of word sequences (all None unless the
    scorer shares prefixes), all at once: each distinct word encoded once, the sizes from `trie_sizes`."""
    neural = models.neural
    if neural is None or not (neural.use_tree and neural.share_prefixes) or not lists:
        return [None] * len(lists)
    seqs = list(itertools.chain.from_iterable(lists))
    lens = np.fromiter(lm_lengths(models, seqs), dtype=np.int64, count=len(seqs))
    flat = np.fromiter(neural.vocab.ids(itertools.chain.from_iterable(seqs)), dtype=np.int64, count=int(lens.sum()))
    which = np.repeat(np.arange(len(lists)), list(map(len, lists)))
    return trie_sizes(flat, lens, which, len(lists), end=EOS_ID)


def _tree_bytes(models: Models, size: TreeSize) -> int:
    """Peak working memory of scoring a trie of `size` in pieces: its plan's, or the scorer's cap when
    the plan runs in blocks or sub-tries (one hypothesis over the cap is refused by the scorer itself)."""
    neural = models.neural
    cap = neural.max_work_bytes
    one = dataclasses.replace(size, total_nodes=size.max_depth, max_nodes=size.max_depth,
                              path_len=size.max_depth + 1)
    whole = size.nbytes(neural.model, cap)
    return max(one.nbytes(neural.model, cap), min(whole, cap if cap is not None else 1 << 62))


def check_encodable(models: Models, words: Iterable[str], field: str) -> None:
    """A subword LM has no out-of-vocabulary words, only words with a character its tokenizer never saw, which it
    cannot score: 422 naming the first of them."""
    vocab = models.neural.vocab if models.neural is not None else None
    if vocab is None or not vocab.subword:
        return
    for w in words:
        if w not in vocab:
            raise ServiceError(f"the word {w!r} cannot be cut into the neural LM's pieces: its tokenizer "
                               f"({vocab.spec}) has never seen a character of it", field)


def check_lattice_vocabulary(models: Models, lat: Lattice, field: str) -> None:
    """The overlap check of hypothesis lists, on a lattice's words: a lattice in the wrong
    vocabulary is refused like a list in it (422), not scored as all <unk>."""
    ids = lat.word[lat.symbols.word_flags(lat.word)]
    distinct, counts = np.unique(ids, return_counts=True)  # a word per distinct id, not per arc
    words = [lat.symbols.word(i) for i in distinct.tolist()]
    check_encodable(models, words, field)
    for known, what in ((models.neural and models.neural.vocab, "the neural LM"), (models.ngram, "the n-gram")):
        if known is None or not len(ids):
            continue
        hit = sum(c for w, c in zip(words, counts.tolist()) if w in known)
        if hit / len(ids) < MIN_KNOWN:
            try:  # its message, which names words in the lattice's order
                check_overlap([[lat.symbols.word(i) for i in ids.tolist()]], known, what, MIN_KNOWN)
            except SmallstateError as e:
                raise ServiceError(str(e), field) from None
