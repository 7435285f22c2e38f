"""Validated requests -> the worker's work: the limits of the settings, hypothesis lists as
`Utterance`s, lattice text parsed into prepared `Lattice`s, the request's weights. Every problem
is a ServiceError naming the request field. Pure functions of the request and the loaded models,
so the routes may run them on any thread."""

from __future__ import annotations

import re
from typing import Iterator, Protocol

from smallstate_lm.rescoring.formats.fst_text import FstTextColumns, fst_text_columns
from smallstate_lm.rescoring.formats.lattice_io import read_fst_text, read_slf_text
from smallstate_lm.rescoring.lattices.lattice import Lattice, LatticeFormatError, SymbolTable
from smallstate_lm.rescoring.nbest.lists import Hypothesis, Utterance
from smallstate_lm.scoring.trie import TreeSize

from ..cost import lattice_shape
from ..errors import CostLimitError, LimitError, ServiceError
from ..model import Models
from ..schemas import LatticeIn, RescoreRequest, ScoreRequest, UtteranceIn
from ..settings import Settings
from .work import (
    LatticeItem,
    NbestItem,
    Work,
    context_words,
    lattice_item,
    list_floor,
    lists_seconds,
    lm_lengths,
    make_work,
    nbest_item,
    prepared,
    request_weights,
    trie_sizes_of,
)


class Early(Protocol):
    """What a large request's preparation tells as it goes (the service's admission, which may refuse it):
    what its hypothesis lists are predicted to take, before they are built, and a floor of what the request
    will be predicted to take, as it grows. A request refused anyway then costs a fraction of its building."""

    def lists(self, seconds: float) -> None: ...

    def so_far(self, seconds: float) -> None: ...


def rescore_work(body: RescoreRequest, models: Models, s: Settings, early: Early | None = None) -> Work:
    """The request's work; `early`, when given, is told what is known of its cost before the bulk of it."""
    if len(body.utterances) > s.max_utterances:
        raise LimitError(f"{len(body.utterances)} utterances, more than the limit of {s.max_utterances} "
                         f"(max_utterances)", "utterances", s.max_utterances)
    if body.nbest is not None and body.nbest > s.max_nbest:
        raise LimitError(f"nbest={body.nbest} is over the limit of {s.max_nbest} (max_nbest)", "nbest", s.max_nbest)
    weights = request_weights(models, body.weights.model_dump(exclude_none=True) if body.weights else {})
    lists_floor, sizes, _ = _check_lists_early(body, models, s, early) if early is not None else (0.0, None, None)
    formats = {u.lattice.format for u in body.utterances if u.lattice is not None}
    if early is not None and formats == {"openfst-text"}:
        # A large request's lattices are first read for their structure only (their weights are much of the
        # reading) and held to the limits: one refused costs about half of its reading, one let in a little more.
        for _ in _lattices_priced(body, models, s, lists_floor, early, costs=False):
            pass
    items: list[NbestItem | LatticeItem] = []
    fields = []
    lattices = iter(_lattices_priced(body, models, s, lists_floor, early))
    for i, u in enumerate(body.utterances):
        where = f"utterances[{i}]"
        if u.hypotheses is not None:
            # its hypotheses built once
            items.append(nbest_item(*_hypotheses(u, where, s)))
        else:
            items.append(next(lattices))
        fields.append(where)
    work = make_work(models, Work("rescore", weights, items, fields, nbest=body.nbest,
                                  token_logprobs=body.return_token_logprobs), sizes, s.max_request_bytes)
    _check_cost(work, "utterances", s)
    return work


def _lattices_priced(body: RescoreRequest, models: Models, s: Settings, lists_floor: float, early: Early | None,
                     costs: bool = True) -> Iterator[LatticeItem]:
    """The request's lattices as work, in order, each parsed (with its weights unless `costs` is False: OpenFST
    text is then read for its structure only) and held to the limits as they add up: their LM steps, predicted
    seconds and working memory; `early`, when given, told the request's floor so far (`lists_floor` for its
    lists) after each. A generator: the caller takes each lattice as it reaches it (or, run to the end, every
    lattice is checked)."""
    steps = 0  # estimated LM steps of the request's lattices
    lattice_s = 0.0  # and their predicted seconds: over the limit, the rest of the request need not be parsed
    for i, u in enumerate(body.utterances):
        if u.hypotheses is not None:
            continue
        where = f"utterances[{i}]"
        context = context_sentences(u, where, s)
        lat = parse_lattice(u.lattice, f"{where}.lattice", u.id, s.max_lattice_arcs, costs)
        shape = lattice_shape(lat, s.max_per_state)
        steps += shape.total_steps
        if steps > s.max_lattice_cost:
            raise CostLimitError(f"expanding the request's lattices would take up to {steps} LM steps "
                                 f"(estimated from their arcs and paths), more than the limit of "
                                 f"{s.max_lattice_cost} (max_lattice_cost)", f"{where}.lattice",
                                 s.max_lattice_cost)
        item = lattice_item(models, lat, body.nbest or s.lattice_nbest, shape)
        item.context = context or None
        lattice_s += item.seconds
        if item.nbytes > s.max_request_bytes:  # lattices that do not fit together are expanded fewer at a time
            raise CostLimitError(f"expanding the lattice would need up to {item.nbytes / 2**20:.0f} MiB of "
                                 f"working memory (predicted by the cost model), more than the limit of "
                                 f"{s.max_request_bytes / 2**20:.0f} MiB (max_request_bytes)",
                                 f"{where}.lattice", s.max_request_bytes)
        if early is not None:
            early.so_far(lists_floor + lattice_s)
        if lattice_s > s.max_request_seconds:
            raise CostLimitError(f"the request's lattices up to {where} alone would take up to {lattice_s:.1f} s "
                                 f"on this server (predicted by its cost model), more than the limit of "
                                 f"{s.max_request_seconds:g} s (max_request_seconds)", f"{where}.lattice",
                                 s.max_request_seconds)
        yield item


def _check_lists_early(body: RescoreRequest, models: Models, s: Settings,
                       early: Early) -> tuple[float, list[TreeSize | None] | None, list[list[int]]]:
    """The request's hypothesis lists predicted as `make_work` will predict them, from the request's words (any
    context first), and told to `early`; before that, list by list, a floor of that prediction that costs one
    pass over the hypotheses (no trie), told as it grows. Lists over a count limit are left to `_hypotheses`,
    which names them. Returns the floor, the lists' trie sizes (for `make_work`) once all were counted (else
    None), and the lengths of the lists' hypotheses as the LMs see them (those counted)."""
    lens_of: list[list[int]] = []
    seqs_of: list[list[list[str]]] = []
    floor = 0.0
    for u in body.utterances:
        if u.hypotheses is None:
            continue
        if len(u.hypotheses) > s.max_hypotheses:
            return floor, None, lens_of
        try:
            context = context_words(context_sentences(u, "", s))
        except LimitError:  # named by `_hypotheses`
            return floor, None, lens_of
        seqs = [h.words if h.words is not None else h.text.split() for h in u.hypotheses]
        if max(map(len, seqs)) > s.max_words:
            return floor, None, lens_of
        if context:
            seqs = [context + q for q in seqs]
        seqs_of.append(seqs)
        lens_of.append(lm_lengths(models, seqs))
        floor += list_floor(models, lens_of[-1])
        early.so_far(floor)
    sizes = trie_sizes_of(models, seqs_of)
    if lens_of:
        # the limits `_check_cost` holds the work to, from the same numbers, before a hypothesis is built
        if None not in sizes:
            _check_nodes(sum(size.total_nodes for size in sizes), "utterances", s)
        seconds = lists_seconds(models, seqs_of, lens_of, sizes)
        _check_seconds(seconds, "utterances", s)
        early.lists(seconds)
    return floor, sizes, lens_of


def _check_cost(work: Work, field: str, s: Settings) -> None:
    """The request's estimated cost against the limits, before any work: the neural LM tokens its
    hypotheses need computed, and the seconds and bytes the cost model predicts."""
    _check_nodes(work.tokens_computed, field, s)
    _check_seconds(work.seconds, field, s)
    if work.nbytes > s.max_request_bytes:
        raise CostLimitError(f"the request would need up to {work.nbytes / 2**20:.0f} MiB of working memory "
                             f"(predicted by the cost model), more than the limit of "
                             f"{s.max_request_bytes / 2**20:.0f} MiB (max_request_bytes)", field, s.max_request_bytes)


def _check_nodes(nodes: int, field: str, s: Settings) -> None:
    if nodes > s.max_trie_nodes:
        raise CostLimitError(f"the request's hypotheses need {nodes} neural LM tokens computed (unique prefixes), "
                             f"more than the limit of {s.max_trie_nodes} (max_trie_nodes)", field, s.max_trie_nodes)


def _check_seconds(seconds: float, field: str, s: Settings) -> None:
    if seconds > s.max_request_seconds:
        raise CostLimitError(f"the request would take up to {seconds:.1f} s on this server (predicted by its "
                             f"cost model), more than the limit of {s.max_request_seconds:g} s (max_request_seconds)",
                             field, s.max_request_seconds)


def lattice_cost(lat: Lattice, max_per_state: int) -> int:
    """An upper bound of the LM steps that expanding the prepared `lat` takes, known before any LM
    work (linear in its arcs): per word arc and per final state, the histories its state may hold,
    i.e. the paths into it, at most `max_per_state` (the expansion keeps no more per state)."""
    return lattice_shape(lat, max_per_state).total_steps


def context_sentences(u: UtteranceIn, where: str, s: Settings) -> list[list[str]]:
    """The utterance's `context` as sentences of words, oldest first, held to the limits (max_context_utts
    sentences, max_words words each)."""
    if u.context is None:
        return []
    texts = [u.context] if isinstance(u.context, str) else list(u.context)
    if len(texts) > s.max_context_utts:
        raise LimitError(f"{len(texts)} context transcripts, more than the limit of {s.max_context_utts} "
                         "(max_context_utts)", f"{where}.context", s.max_context_utts)
    out = []
    for k, text in enumerate(texts):
        words = text.split()
        if len(words) > s.max_words:
            at = f"{where}.context" + (f"[{k}]" if not isinstance(u.context, str) else "")
            raise LimitError(f"{len(words)} context words, more than the limit of {s.max_words} (max_words)",
                             at, s.max_words)
        if words:
            out.append(words)
    return out


def _hypotheses(u: UtteranceIn, where: str, s: Settings) -> tuple[Utterance, list[str], list[str]]:
    """The utterance's hypotheses (their positions as ids), its context words, and the ids the hypotheses
    came with (their positions where the request gave none)."""
    if len(u.hypotheses) > s.max_hypotheses:
        raise LimitError(f"{len(u.hypotheses)} hypotheses, more than the limit of {s.max_hypotheses} "
                         f"(max_hypotheses)", f"{where}.hypotheses", s.max_hypotheses)
    context = context_words(context_sentences(u, where, s))
    hyps = []
    for j, h in enumerate(u.hypotheses):
        words = list(h.words) if h.words is not None else h.text.split()
        if len(words) > s.max_words:
            key = "words" if h.words is not None else "text"
            raise LimitError(f"{len(words)} words, more than the limit of {s.max_words} (max_words)",
                             f"{where}.hypotheses[{j}].{key}", s.max_words)
        hyps.append(Hypothesis(words=words, am=h.am_score, graph=h.graph_score, id=str(j)))
    return Utterance(u.id, hyps), context, [str(j) if h.id is None else h.id for j, h in enumerate(u.hypotheses)]


def score_work(body: ScoreRequest, models: Models, s: Settings) -> Work:
    if len(body.sentences) > s.max_utterances:
        raise LimitError(f"{len(body.sentences)} sentences, more than the limit of {s.max_utterances} "
                         f"(max_utterances)", "sentences", s.max_utterances)
    items, fields = [], []
    for i, text in enumerate(body.sentences):
        words = text.split()
        if len(words) > s.max_words:
            raise LimitError(f"{len(words)} words, more than the limit of {s.max_words} (max_words)",
                             f"sentences[{i}]", s.max_words)
        items.append(nbest_item(Utterance(str(i), [Hypothesis(words=words)]), []))
        fields.append(f"sentences[{i}]")
    work = make_work(models, Work("score", models.weights, items, fields, token_logprobs=body.return_token_logprobs))
    _check_cost(work, "sentences", s)
    return work


# ---------------------------------------------------------------------------------------------
# Lattices from request text

_SLF_COUNT = re.compile(r'(?:^|\s|")(N|NODES|L|LINKS)=("(?:[^"\\]|\\.)*"|\S*)', re.M)


def _as_int(s: str) -> int | None:
    try:
        return int(s)
    except ValueError:
        return None


def _check_fst_text(text: str, where: str, max_arcs: int,
                    costs: bool = True) -> tuple[list[str], FstTextColumns | None]:
    """Arc count and largest state id against the limits before the parser allocates
    per-state arrays; returns the distinct output labels of the arcs (in order of first appearance), and the
    text's columns when it has the plain form that `fst_text_columns` reads (the parser then takes them)."""
    cols = fst_text_columns(text, costs)
    if cols is not None:
        if len(cols.src) > max_arcs:
            raise LimitError(f"the lattice has more than {max_arcs} arcs (max_lattice_arcs)", where, max_arcs)
        _check_max_state(cols.max_state, where, max_arcs)
        return cols.label_names, cols
    labels: list[str] = []
    max_state = -1
    for line in text.splitlines():
        parts = line.split()
        if len(parts) >= 4:
            labels.append(parts[3])
            if len(labels) > max_arcs:
                raise LimitError(f"the lattice has more than {max_arcs} arcs (max_lattice_arcs)", where, max_arcs)
        for p in parts[: 2 if len(parts) >= 4 else 1]:
            s = _as_int(p)
            if s is not None and s > max_state:
                max_state = s
    _check_max_state(max_state, where, max_arcs)
    return list(dict.fromkeys(labels)), None


def _check_max_state(max_state: int, where: str, max_arcs: int) -> None:
    if max_state > max_arcs:
        raise LimitError(f"state id {max_state} is beyond the {max_arcs + 1} states a lattice may have "
                         f"(max_lattice_arcs + 1)", where, max_arcs)


def _check_slf_counts(text: str, where: str, max_arcs: int) -> None:
    for m in _SLF_COUNT.finditer(text):
        key, raw = m.group(1), m.group(2)
        if raw.startswith('"') and raw.endswith('"') and len(raw) >= 2:
            raw = re.sub(r"\\(.)", r"\1", raw[1:-1])
        n = _as_int(raw)
        if n is None:
            continue  # the parser names the bad value
        nodes = key in ("N", "NODES")
        limit = max_arcs + 1 if nodes else max_arcs
        if n > limit:
            what = "nodes (max_lattice_arcs + 1)" if nodes else "links (max_lattice_arcs)"
            raise LimitError(f"{key}={n}: a lattice may have at most {limit} {what}", where, limit)


def _symbol_table(words: dict[str, int], where: str) -> SymbolTable:
    pairs = list(words.items())
    if "<eps>" not in words and 0 not in words.values():
        pairs.insert(0, ("<eps>", 0))
    try:
        return SymbolTable(pairs, source=where)
    except LatticeFormatError as e:
        raise ServiceError(str(e), where) from None


def parse_lattice(lat: LatticeIn, where: str, name: str, max_arcs: int, costs: bool = True) -> Lattice:
    """A request's lattice text -> a prepared Lattice named `name`; every problem is a ServiceError naming `where`.
    `costs=False`: OpenFST text's weights are not read (all 0; see `fst_text_columns`)."""
    data_field = f"{where}.data"
    symbols = _symbol_table(lat.words, f"{where}.words") if lat.words is not None else None
    try:
        if lat.format == "openfst-text":
            distinct, cols = _check_fst_text(lat.data, data_field, max_arcs, costs)
            if symbols is None:  # in order: the first numeric label is named
                numeric = [lb for lb in distinct if _as_int(lb) not in (None, 0)]
                if numeric:
                    raise ServiceError(f"arc label {numeric[0]} is a number: give the decoder's symbol table as "
                                       f"'words' (or use words as labels)", f"{where}.words")
                symbols = SymbolTable.from_words([lb for lb in distinct if _as_int(lb) is None])
            parsed = read_fst_text(lat.data, symbols, name=data_field, columns=cols)
        else:
            _check_slf_counts(lat.data, data_field, max_arcs)
            parsed = read_slf_text(lat.data, symbols, name=data_field, lattice_name=name)
        if parsed.num_arcs > max_arcs:
            raise LimitError(f"the lattice has {parsed.num_arcs} arcs, more than {max_arcs} (max_lattice_arcs)",
                             data_field, max_arcs)
        parsed.name = name
        return prepared(parsed)
    except LatticeFormatError as e:
        raise ServiceError(str(e), data_field) from None
