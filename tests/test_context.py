"""Context across utterances: training windows of consecutive sentences, perplexity after the sentences
before, and rescoring in spoken order (`rescore --utt2doc --context-utts K`), each utterance's n-best list
or lattice scored after its document's previous chosen transcripts. The reference numbers are computed
directly: the neural LM's `score` over (context tokens + hypothesis tokens) from `<s>`, the tail kept."""

import json
import math
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import TEST_DATA, run_cli

from smallstate_lm.checkpoint import load_model
from smallstate_lm.data import join_sentences
from smallstate_lm.errors import ConfigError, DataError
from smallstate_lm.evaluate import evaluate_file, with_context
from smallstate_lm.ngram import NgramLM
from smallstate_lm.rescoring.expand.rescorer import ExpandConfig, LatticeRescorer
from smallstate_lm.rescoring.formats.kaldi.write import KaldiArchiveWriter
from smallstate_lm.rescoring.formats.lattice_io import read_fst, read_fst_text
from smallstate_lm.rescoring.lattices.lattice import SymbolTable
from smallstate_lm.rescoring.nbest.components import compute_components, totals
from smallstate_lm.rescoring.nbest.lists import Hypothesis, Utterance, read_nbest_tsv, read_text
from smallstate_lm.rescoring.runs.context_run import (
    ContextPlan,
    context_utts_of,
    document_groups,
    nbest_in_context,
)
from smallstate_lm.scoring.context import History, context_tokens, ngram_start
from smallstate_lm.scoring.scorer import NeuralScorer
from smallstate_lm.train import TrainConfig, train
from smallstate_lm.vocab import EOS_ID
from smallstate_lm.weights import Weights

LATTICES = Path(__file__).resolve().parents[1] / "lattices"  # real first-pass lattices, slt-dev000N and kal-dev000N
TOL = 1e-4  # natural-log sums of a few dozen float32 log-probs


@pytest.fixture(scope="module")
def lm(tiny_lm_dir):
    lm = load_model(tiny_lm_dir)
    lm.model.eval()
    return lm


@pytest.fixture(scope="module")
def ngram(kenlm_model) -> NgramLM:
    return NgramLM(kenlm_model)


@pytest.fixture(scope="module")
def nbest_utts():
    return read_nbest_tsv(TEST_DATA / "nbest.tsv")  # dev0000 .. dev0005


@pytest.fixture(scope="module")
def refs():
    return read_text(TEST_DATA / "ref.txt")


def direct_tail(model, context: list[int], hyp: list[int]) -> np.ndarray:
    """log p of each token of `hyp` read after `<s>` and `context`, by one plain `score` call."""
    with torch.no_grad():
        x = torch.tensor([context + hyp], dtype=torch.long)  # (1, T)
        lp, _ = model.score(x, model.initial_state(1, "cpu"))
    return lp[0, len(context):].double().numpy()


def encode(vocab, words) -> list[int]:
    return vocab.encode(words) + [EOS_ID]


# --- training windows and perplexity with context ---------------------------------------------------------


def _sentences(rng: random.Random, n: int) -> list[list[int]]:
    return [[rng.randrange(4, 50) for _ in range(rng.randrange(0, 9))] + [EOS_ID] for _ in range(n)]


@pytest.mark.parametrize("k,max_len", [(1, 8), (2, 8), (3, 12), (4, 5), (10, 200)])
def test_join_sentences_keeps_every_token_in_whole_sentences_of_at_most_k(k, max_len):
    rng = random.Random(k * 100 + max_len)
    seqs = _sentences(rng, 40)
    windows = join_sentences(seqs, k, max_len)
    assert [t for w in windows for t in w] == [t for s in seqs for t in s]  # all tokens, in order
    it = iter(seqs)
    for w in windows:
        parts, taken = [], 0
        while taken < len(w):  # each window is whole consecutive sentences
            s = next(it)
            assert w[taken:taken + len(s)] == s
            parts.append(s)
            taken += len(s)
        assert 1 <= len(parts) <= k
        assert len(w) <= max_len or len(parts) == 1, (w, max_len)
    if k == 1:
        assert windows == seqs
    if k == 10 and max_len == 200:
        assert [len(w) for w in windows[:-1]] == [sum(map(len, seqs[i:i + 10])) for i in range(0, 30, 10)]


def test_join_sentences_lets_a_long_sentence_stand_alone_and_refuses_k_below_one():
    long = [5] * 9 + [EOS_ID]
    assert join_sentences([[4, EOS_ID], long, [6, EOS_ID], [7, EOS_ID]], 3, 6) == \
        [[4, EOS_ID], long, [6, EOS_ID, 7, EOS_ID]]
    with pytest.raises(DataError, match="must be >= 1"):
        join_sentences([[4, EOS_ID]], 0, 8)


def test_with_context_reads_each_sentence_after_the_k_before_it_in_its_document():
    s = [[10, 1], [20, 1], [30, 1], [40, 1]]
    assert with_context(s, 0) == s
    assert with_context(s, 2) == [[10, 1], [10, 1, 20, 1], [10, 1, 20, 1, 30, 1], [20, 1, 30, 1, 40, 1]]
    assert with_context(s, 5, ["a", "a", "b", "b"]) == [[10, 1], [10, 1, 20, 1], [30, 1], [30, 1, 40, 1]]


def test_with_context_never_crosses_documents_that_interleave():
    s = [[10, 1], [20, 1], [30, 1]]
    assert with_context(s, 2, ["a", "b", "a"])[2] == [10, 1, 30, 1]


def test_eval_with_context_in_single_sentence_documents_equals_eval_without(tiny_lm_dir, tmp_path):
    text = tmp_path / "text.txt"
    text.write_text("the lord said\nand the man spoke to him\nhe said unto them\ngo in peace\n")
    alone, one_doc = tmp_path / "alone", tmp_path / "one"
    alone.write_text("".join(f"u{i} d{i}\n" for i in range(4)))
    one_doc.write_text("".join(f"u{i} d\n" for i in range(4)))
    plain = evaluate_file(tiny_lm_dir, text)
    separate = evaluate_file(tiny_lm_dir, text, context_sentences=2, utt2doc=alone)
    together = evaluate_file(tiny_lm_dir, text, context_sentences=2, utt2doc=one_doc)
    assert math.isclose(separate["perplexity"], plain["perplexity"], rel_tol=1e-5)
    assert not math.isclose(together["perplexity"], plain["perplexity"], rel_tol=1e-3)
    assert together["context_sentences"] == 2 and plain["context_sentences"] == 0
    assert separate["words"] == plain["words"]  # the context's own tokens are not counted
    one_doc.write_text("u0 d\nu1 d\n")
    with pytest.raises(DataError, match="2 utterances for a text of 4 sentences"):
        evaluate_file(tiny_lm_dir, text, context_sentences=1, utt2doc=one_doc)


def test_train_refuses_context_sentences_below_one_and_with_stream(small_corpus, tmp_path):
    base = dict(train=str(small_corpus[0]), valid=str(small_corpus[1]), out=str(tmp_path / "run"), preset="tiny",
                progress=False, device="cpu")
    with pytest.raises(ConfigError, match="context_sentences must be >= 1"):
        train(TrainConfig(**base, context_sentences=0))
    with pytest.raises(ConfigError, match="stream"):
        train(TrainConfig(**base, context_sentences=2, stream=True))
    assert not (tmp_path / "run" / "model.pt").exists()


# --- the neural scorer and the n-gram after a context -----------------------------------------------------


@pytest.mark.parametrize("share_prefixes,use_tree", [(True, True), (True, False), (False, True)])
def test_scoring_after_a_context_equals_scoring_context_and_hypothesis_from_bos(lm, nbest_utts, refs,
                                                                                share_prefixes, use_tree):
    scorer = NeuralScorer(lm.model, lm.vocab, share_prefixes=share_prefixes, use_tree=use_tree)
    groups = [[h.words for h in u.hyps[:6]] for u in nbest_utts[:3]]
    contexts = [context_tokens(lm.vocab, [refs["dev0003"], refs["dev0004"]]), [],
                context_tokens(lm.vocab, [refs["dev0005"]])]
    assert contexts[2] == encode(lm.vocab, refs["dev0005"])  # each sentence's ids, then </s>
    got = scorer.token_logprobs(groups, contexts=contexts)
    for ctx, hyps, lps in zip(contexts, groups, got):
        for words, lp in zip(hyps, lps):
            assert lp.shape == (len(words) + 1,)
            np.testing.assert_allclose(lp, direct_tail(lm.model, ctx, encode(lm.vocab, words)), atol=1e-5)
    plain = scorer.token_logprobs(groups)
    for lps, ref in zip(got[1], plain[1]):  # the utterance without context scores as without any
        np.testing.assert_allclose(lps, ref, atol=1e-5)
    assert abs(got[0][0].sum() - plain[0][0].sum()) > 1e-3  # the context matters to this model
    for a, b in zip(scorer.token_logprobs(groups, contexts=[[], [], []]), plain):
        for x, y in zip(a, b):
            np.testing.assert_allclose(x, y, atol=1e-5)


def test_ngram_scores_from_a_state_equal_scoring_the_words_in_a_row(ngram, refs):
    words = refs["dev0004"]
    np.testing.assert_allclose(ngram.token_logprobs(words, ngram.initial_state()), ngram.token_logprobs(words),
                               atol=1e-9)
    before = [refs["dev0002"], refs["dev0003"]]
    state = ngram_start(ngram, before)
    in_row = [w for s in before for w in s] + words
    st, lps = ngram.initial_state(), []
    for w in in_row:
        lp, st = ngram.score_word(st, w)
        lps.append(lp)
    lps.append(ngram.score_eos(st))
    np.testing.assert_allclose(ngram.token_logprobs(words, state), lps[-(len(words) + 1):], atol=1e-9)
    assert ngram_start(ngram, []) == ngram.initial_state()


# --- lattices expanded after a context --------------------------------------------------------------------

SYMS = ["the", "lord", "man", "said", "spoke", "<sil>"]
PATHS = [("the", b, c) for b in ("lord", "man") for c in ("said", "spoke")]


def sausage(sym: SymbolTable) -> str:
    """the (lord | man) <sil> (said | spoke): four word sequences."""
    i = sym.id
    return "\n".join([
        f"0 1 {i('the')} {i('the')} 1,10",
        f"1 2 {i('lord')} {i('lord')} 1,10",
        f"1 2 {i('man')} {i('man')} 0.5,9",
        f"2 3 {i('<sil>')} {i('<sil>')} 0,2",
        f"3 4 {i('said')} {i('said')} 1,10",
        f"3 4 {i('spoke')} {i('spoke')} 0.2,10",
        "4 0.3,0",
    ]) + "\n"


@pytest.mark.parametrize("ngram_context", [False, True])
def test_lattice_expanded_after_a_context_scores_each_path_as_read_after_it(lm, ngram, ngram_context):
    sym = SymbolTable.from_words(SYMS)
    lat = read_fst_text(sausage(sym), sym, name="sausage")
    w = Weights(am_scale=0.1, graph_scale=0.5, lm_weight=1.0, ngram_weight=0.3, word_penalty=-0.1)
    r = LatticeRescorer(w, lm.model, lm.vocab, ngram, ExpandConfig(max_ngram_order=None))
    before = [["and", "he", "said", "unto", "them"], ["go", "in", "peace"]]
    start = r.context_start(before, ngram_context)
    ctx = context_tokens(lm.vocab, before)
    assert start.positions == len(ctx) and (start.ngram is not None) == ngram_context
    assert r.context_start([]) is None
    got = {tuple(h.words): h for h in r.expand(lat, start).nbest(w, 4)}
    plain = {tuple(h.words): h for h in r.expand(lat).nbest(w, 4)}
    assert sorted(got) == sorted(PATHS) == sorted(plain)
    ng_state = ngram_start(ngram, before) if ngram_context else None
    for p in PATHS:
        assert math.isclose(got[p].neural, direct_tail(lm.model, ctx, encode(lm.vocab, p)).sum(), abs_tol=TOL)
        assert math.isclose(got[p].ngram, ngram.token_logprobs(list(p), ng_state).sum(), abs_tol=1e-6)
        assert math.isclose(plain[p].neural, direct_tail(lm.model, [], encode(lm.vocab, p)).sum(), abs_tol=TOL)
        assert got[p].am == pytest.approx(plain[p].am) and got[p].graph == pytest.approx(plain[p].graph)
    assert abs(got[PATHS[0]].neural - plain[PATHS[0]].neural) > 1e-3
    # the lattice's ranking is the n-best ranking of its paths scored after the same context
    hyps = [Hypothesis(list(p), am=got[p].am, graph=got[p].graph) for p in PATHS]
    comps, _ = compute_components([Utterance("u", hyps)], NeuralScorer(lm.model, lm.vocab), ngram,
                                  progress=False, contexts=[before], ngram_context=ngram_context)
    for p, t in zip(PATHS, totals(comps[0], w)):
        assert math.isclose(got[p].total, t, abs_tol=TOL)


def test_expand_many_starts_only_the_lattices_given_a_start_after_their_context(lm):
    sym = SymbolTable.read(LATTICES / "words.txt")
    lats = [read_fst(LATTICES / f"slt-dev000{i}.lat.fst", sym) for i in range(3)]
    w = Weights(am_scale=0.10526, lm_weight=1.0, ngram_weight=0.0)
    r = LatticeRescorer(w, lm.model, lm.vocab, None, ExpandConfig(max_ngram_order=4))
    start = r.context_start([["and", "he", "said", "unto", "them"]])
    together = dict(r.expand_many(lats, starts={1: start}))
    for i, lat in enumerate(lats):
        alone = r.expand(lat, start if i == 1 else None).nbest(w, 3)
        both = together[i].nbest(w, 3)
        assert [h.words for h in both] == [h.words for h in alone]
        for a, b in zip(both, alone):
            assert math.isclose(a.neural, b.neural, abs_tol=TOL)
    best = together[1].nbest(w, 1)[0]
    ctx = context_tokens(lm.vocab, [["and", "he", "said", "unto", "them"]])
    assert math.isclose(best.neural, direct_tail(lm.model, ctx, encode(lm.vocab, best.words)).sum(), abs_tol=TOL)
    plain_best = r.expand(lats[1]).nbest(w, 1)[0]
    assert plain_best.words != best.words or abs(plain_best.neural - best.neural) > 1e-3


# --- the plan: which utterances follow which --------------------------------------------------------------


def _utt2doc(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "utt2doc"
    p.write_text(text)
    return p


def test_waves_hold_each_documents_next_utterance_in_spoken_order(tmp_path):
    # spoken order: A = u3 u2 u6, B = u1 u5, C = u4; u7 is listed but not rescored
    plan = ContextPlan.read(_utt2doc(tmp_path, "u3 A\nu1 B\n\nu2 A\nu7 C\nu5 B\nu4 C\nu6 A\n"), utts=2)
    names = ["u1", "u2", "u3", "u4", "u5", "u6"]
    waves = plan.waves(names)
    assert [[names[i] for i in wave] for wave in waves] == [["u3", "u1", "u4"], ["u2", "u5"], ["u6"]]
    assert sorted(i for wave in waves for i in wave) == list(range(len(names)))
    assert plan.document("u5") == "B" and plan.utts == 2 and plan.with_utts(0).utts == 0
    assert document_groups(names, plan) == [[0, 4], [1, 2, 5], [3]]  # by each document's first input
    # blocks of whole documents, the unit a run, a --jobs worker or a Ray actor takes
    assert document_groups(names, plan, 2) == [[0, 4, 1, 2, 5], [3]]
    assert document_groups(names, plan, 16) == [[0, 4, 1, 2, 5, 3]]
    assert plan.waves([]) == []


def test_lattices_of_several_blocks_on_two_workers_write_what_one_process_writes(tmp_path, tiny_lm_dir, kenlm_model):
    """With one lattice per block (--set batch-lattices is not a CLI option: the library's ExpandConfig), three
    documents make three tasks; the outputs equal the one-process run's."""
    from smallstate_lm.rescoring.expand.rescorer import ExpandConfig
    from smallstate_lm.rescoring.runs.lattice_run import LatticeRun, classify_inputs, rescore_lattice_run
    from smallstate_lm.weights import Weights

    names = ["slt-dev0000", "kal-dev0000", "slt-dev0001", "kal-dev0001", "slt-dev0002"]
    plan = ContextPlan.read(_utt2doc(tmp_path, "slt-dev0000 S\nkal-dev0000 K\nslt-dev0001 S\nkal-dev0001 K\n"
                                               "slt-dev0002 T\n"), utts=1)
    sources, _ = classify_inputs([LATTICES / f"{n}.lat.fst" for n in names])
    for jobs in (1, 2):
        run = LatticeRun(LATTICES / "words.txt", tiny_lm_dir, kenlm_model, Weights(am_scale=0.105),
                         ExpandConfig(batch_lattices=1), device="cpu", jobs=jobs, progress=False, context=plan)
        rescore_lattice_run(sources, run, tmp_path / str(jobs))
    assert (tmp_path / "1" / "best.txt").read_text() == (tmp_path / "2" / "best.txt").read_text()
    # the same batches; a worker may use other threads than this process, so scores agree to float rounding
    assert _same_scores(_jsonl(tmp_path / "1" / "nbest.jsonl"), _jsonl(tmp_path / "2" / "nbest.jsonl"))


def test_history_keeps_the_last_k_transcripts_of_a_document():
    h = History(2)
    for s in (["a"], ["b", "c"], ["d"]):
        h.add(s)
    assert h.sentences() == [["b", "c"], ["d"]]
    none = History(0)
    none.add(["a"])
    assert none.sentences() == []
    with pytest.raises(ConfigError, match=">= 0"):
        History(-1)


@pytest.mark.parametrize("text,needle", [
    ("u1 A\n\nu2 A extra\n", ":3: expected 'utterance document'"),
    ("u1 A\nu2\n", ":2: expected 'utterance document'"),
    ("u1 A\nu2 B\nu1 B\n", ":3: utterance 'u1' is listed twice"),
    ("\n\n", "no utterances"),
])
def test_a_bad_utt2doc_file_names_its_line(tmp_path, text, needle):
    p = _utt2doc(tmp_path, text)
    with pytest.raises(ConfigError) as e:
        ContextPlan.read(p)
    assert str(p) in str(e.value) and needle in str(e.value)


def test_check_names_the_utt2doc_file_and_the_missing_or_repeated_utterance(tmp_path):
    p = _utt2doc(tmp_path, "u1 A\nu2 A\n")
    plan = ContextPlan.read(p)
    with pytest.raises(ConfigError) as e:
        plan.check(["u1", "ghost", "phantom"], "lattices")
    assert str(p) in str(e.value) and "'ghost'" in str(e.value) and "and 1 more" in str(e.value)
    with pytest.raises(ConfigError, match="'u2' appears twice"):
        plan.check(["u1", "u2", "u2"])
    plan.check(["u2"])  # a subset of the listed utterances is fine
    with pytest.raises(ConfigError, match="not found"):
        ContextPlan.read(tmp_path / "missing")
    with pytest.raises(ConfigError, match=">= 0"):
        ContextPlan.read(p, utts=-1)


def test_context_utts_of_a_weights_file(tmp_path):
    p = tmp_path / "w.json"
    p.write_text(json.dumps({"lm_weight": 1.0, "context_utts": 3}))
    assert context_utts_of(p) == 3
    p.write_text(json.dumps({"lm_weight": 1.0}))
    assert context_utts_of(p) is None and context_utts_of(None) is None
    for bad in (-1, 1.5, "2"):
        p.write_text(json.dumps({"context_utts": bad}))
        with pytest.raises(ConfigError, match="context_utts"):
            context_utts_of(p)


# --- n-best lists in spoken order ---------------------------------------------------------------------------

# documents interleaved in the file: A = dev0000 dev0002 dev0004, B = dev0001 dev0003 dev0005
NB_DOCS = "".join(f"dev000{i} {'AB'[i % 2]}\n" for i in range(6))


def _neural_after(lm, utt, sentences) -> list[float]:
    ctx = context_tokens(lm.vocab, sentences)
    return [float(direct_tail(lm.model, ctx, encode(lm.vocab, h.words)).sum()) for h in utt.hyps]


@pytest.mark.parametrize("k", [1, 2])
def test_each_list_is_scored_after_its_own_documents_previous_transcripts(lm, ngram, nbest_utts, refs, tmp_path,
                                                                         k):
    utts = [Utterance(u.utt, u.hyps[:5]) for u in nbest_utts]
    plan = ContextPlan.read(_utt2doc(tmp_path, NB_DOCS), utts=k)
    scorer = NeuralScorer(lm.model, lm.vocab)
    w = Weights(am_scale=0.105, lm_weight=1.0, ngram_weight=0.5)
    plain, _ = compute_components(utts, scorer, ngram, progress=False)
    ranked, comps, stats = nbest_in_context(utts, scorer, ngram, w, plan, said=refs)
    assert [u.utt for u in ranked] == [u.utt for u in utts] and stats.utterances == 6
    docs = {"A": ["dev0000", "dev0002", "dev0004"], "B": ["dev0001", "dev0003", "dev0005"]}
    for order in docs.values():
        for pos, name in enumerate(order):
            i = int(name[-1])
            before = [refs[x] for x in order[max(0, pos - k):pos]]  # never the other document's
            np.testing.assert_allclose(comps[i].neural, _neural_after(lm, utts[i], before), atol=TOL)
            np.testing.assert_allclose(comps[i].ngram, plain[i].ngram, atol=1e-9)  # the n-gram starts at <s>
            if pos == 0:  # a document's first utterance: as without context
                np.testing.assert_allclose(comps[i].neural, plain[i].neural, atol=TOL)
            else:
                assert np.abs(comps[i].neural - plain[i].neural).max() > 1e-3


def test_without_said_the_context_is_the_chosen_transcript_and_k0_is_no_context(lm, ngram, nbest_utts,
                                                                               tmp_path):
    utts = [Utterance(u.utt, u.hyps[:5]) for u in nbest_utts]
    plan = ContextPlan.read(_utt2doc(tmp_path, "dev0003 D\ndev0000 D\ndev0005 E\n"
                                     "dev0001 F\ndev0002 F\ndev0004 F\n"), utts=1)
    scorer = NeuralScorer(lm.model, lm.vocab)
    w = Weights(am_scale=0.105, lm_weight=1.0, ngram_weight=0.5)
    ranked, comps, _ = nbest_in_context(utts, scorer, ngram, w, plan)
    by = {u.utt: u for u in ranked}
    chained = [("dev0000", "dev0003"), ("dev0002", "dev0001"), ("dev0004", "dev0002")]  # (utterance, said before)
    for name, prev in chained:
        i = int(name[-1])
        np.testing.assert_allclose(comps[i].neural, _neural_after(lm, utts[i], [by[prev].hyps[0].words]), atol=TOL)
    plain, _ = compute_components(utts, scorer, ngram, progress=False)
    _, none, _ = nbest_in_context(utts, scorer, ngram, w, plan.with_utts(0))
    for a, b in zip(none, plain):
        np.testing.assert_allclose(a.neural, b.neural, atol=TOL)
    ng = ContextPlan.read(plan.source, utts=1, ngram=True)
    _, with_ng, _ = nbest_in_context(utts, scorer, ngram, w, ng, said={u.utt: ["go", "in", "peace"] for u in utts})
    start = ngram_start(ngram, [["go", "in", "peace"]])
    for name in ("dev0000", "dev0002", "dev0004"):  # not first in their documents
        i = int(name[-1])
        np.testing.assert_allclose(with_ng[i].ngram, [ngram.token_logprobs(h.words, start).sum() for h in utts[i].hyps],
                                   atol=1e-9)
    np.testing.assert_allclose(with_ng[3].ngram, plain[3].ngram, atol=1e-9)  # dev0003 opens its document


# --- the command line ---------------------------------------------------------------------------------------


def _jsonl(path: Path) -> dict[str, list[dict]]:
    return {r["utt"]: r["hyps"] for r in map(json.loads, path.read_text().splitlines())}


def _same_scores(a: dict, b: dict, tol: float = TOL) -> bool:
    return a.keys() == b.keys() and all(
        [h["words"] for h in a[u]] == [h["words"] for h in b[u]]
        and all(abs(x["neural"] - y["neural"]) <= tol for x, y in zip(a[u], b[u])) for u in a)


def test_rescore_nbest_with_utt2doc(tmp_path, tiny_lm_dir, kenlm_model):
    u2d = _utt2doc(tmp_path, NB_DOCS)
    common = [TEST_DATA / "nbest.tsv", "--lm", tiny_lm_dir, "--ngram", kenlm_model, "--set", "am_scale=0.105",
              "--set", "lm_weight=1", "--quiet"]
    outs = {}
    for name, extra in [("plain", []), ("k1", ["--utt2doc", u2d]), ("k0", ["--utt2doc", u2d, "--context-utts", "0"])]:
        proc = run_cli("rescore", *common, *extra, "-o", tmp_path / name)
        assert proc.returncode == 0, proc.stderr
        outs[name] = _jsonl(tmp_path / name / "nbest.jsonl")
    assert (tmp_path / "k0" / "best.txt").read_text() == (tmp_path / "plain" / "best.txt").read_text()
    assert _same_scores(outs["k0"], outs["plain"])
    best = (tmp_path / "k1" / "best.txt").read_text().splitlines()
    assert [line.split()[0] for line in best] == [f"dev000{i}" for i in range(6)]  # input order, not spoken order
    for u in ("dev0000", "dev0001"):  # first of their documents
        assert _same_scores({u: outs["k1"][u]}, {u: outs["plain"][u]})
    plain_by_words = {tuple(h["words"]): h["neural"] for h in outs["plain"]["dev0002"]}
    assert any(abs(h["neural"] - plain_by_words[tuple(h["words"])]) > 1e-3 for h in outs["k1"]["dev0002"])


def test_rescore_context_flags_need_utt2doc_and_every_input_listed(tmp_path, tiny_lm_dir):
    for flag in (["--context-utts", "2"], ["--ngram-context"]):
        proc = run_cli("rescore", TEST_DATA / "nbest.tsv", "--lm", tiny_lm_dir, *flag, "-o", tmp_path / "x")
        assert proc.returncode == 2 and "need --utt2doc" in proc.stderr and "Traceback" not in proc.stderr
    partial = _utt2doc(tmp_path, "slt-dev0000 A\nslt-dev0002 A\n")
    files = [LATTICES / f"slt-dev000{i}.lat.fst" for i in range(3)]
    proc = run_cli("rescore", *files, "--words", LATTICES / "words.txt", "--lm", tiny_lm_dir, "--utt2doc", partial,
                   "-o", tmp_path / "out", "--quiet")
    lines = [x for x in proc.stderr.splitlines() if x.strip()]
    assert proc.returncode != 0 and len(lines) == 1 and lines[0].startswith("error:"), proc.stderr
    assert str(partial) in lines[0] and "'slt-dev0001'" in lines[0]
    assert not (tmp_path / "out").exists() and not (tmp_path / "x").exists()


def test_rescore_lattices_in_context_two_jobs_write_what_one_writes(tmp_path, tiny_lm_dir, kenlm_model):
    names = ["slt-dev0002", "kal-dev0001", "slt-dev0000", "slt-dev0001", "kal-dev0000"]  # input order
    u2d = _utt2doc(tmp_path, "slt-dev0000 S\nkal-dev0000 K\nslt-dev0001 S\nkal-dev0001 K\nslt-dev0002 S\n")
    outs = {}
    for jobs in ("1", "2"):
        proc = run_cli("rescore", *[LATTICES / f"{n}.lat.fst" for n in names], "--words", LATTICES / "words.txt",
                       "--lm", tiny_lm_dir, "--ngram", kenlm_model, "--weights", LATTICES / "weights-ngram.json",
                       "--set", "lm_weight=0.5", "--utt2doc", u2d, "--context-utts", "2", "--jobs", jobs,
                       "-o", tmp_path / jobs, "--quiet")
        assert proc.returncode == 0, proc.stderr
        outs[jobs] = _jsonl(tmp_path / jobs / "nbest.jsonl")
    one, two = ((tmp_path / j / "best.txt").read_text() for j in ("1", "2"))
    assert one == two and [line.split()[0] for line in one.splitlines()] == names
    assert _same_scores(outs["1"], outs["2"])
    assert sorted(p.name for p in (tmp_path / "2" / "lattices").iterdir()) == sorted(f"{n}.lat.fst" for n in names)


def test_tune_chooses_context_utts_and_rescore_reads_it_from_the_weights(tmp_path, tiny_lm_dir, kenlm_model, lm,
                                                                         ngram, nbest_utts):
    u2d = _utt2doc(tmp_path, NB_DOCS)
    weights = tmp_path / "weights.json"
    proc = run_cli("tune", "--nbest", TEST_DATA / "nbest.tsv", "--refs", TEST_DATA / "ref.txt", "--lm", tiny_lm_dir,
                   "--ngram", kenlm_model, "--set", "am_scale=0.105", "--utt2doc", u2d, "--context-utts", "1",
                   "-o", weights, "--quiet")
    assert proc.returncode == 0, proc.stderr
    assert "WER% vs context utterances" in proc.stdout
    tuned = json.loads(weights.read_text())
    assert isinstance(tuned["context_utts"], int) and tuned["context_utts"] in (0, 1)
    assert set(tuned["dev_wer_by_context_utts"]) == {"0", "1"}
    # a weights file whose K is 2: rescore reads it when --context-utts is not given
    tuned["context_utts"] = 2
    weights.write_text(json.dumps(tuned))
    proc = run_cli("rescore", TEST_DATA / "nbest.tsv", "--lm", tiny_lm_dir, "--ngram", kenlm_model, "--weights",
                   weights, "--utt2doc", u2d, "-o", tmp_path / "out", "--quiet")
    assert proc.returncode == 0, proc.stderr
    got = _jsonl(tmp_path / "out" / "nbest.jsonl")
    scorer = NeuralScorer(lm.model, lm.vocab)
    expected = {}
    for k in (1, 2):
        _, comps, _ = nbest_in_context(nbest_utts, scorer, ngram, Weights.load(weights),
                                       ContextPlan.read(u2d, utts=k))
        expected[k] = {u.utt: dict(zip(map(tuple, (h.words for h in u.hyps)), c.neural))
                       for u, c in zip(nbest_utts, comps)}
    for u, hyps in got.items():
        for h in hyps:
            assert abs(h["neural"] - expected[2][u][tuple(h["words"])]) <= TOL, u
    h = got["dev0004"][0]  # third of its document: K = 2 reads one more utterance than K = 1
    assert abs(h["neural"] - expected[1]["dev0004"][tuple(h["words"])]) > 1e-3
    weights.write_text(json.dumps(tuned | {"context_utts": -1}))
    proc = run_cli("rescore", TEST_DATA / "nbest.tsv", "--lm", tiny_lm_dir, "--weights", weights, "--utt2doc", u2d,
                   "-o", tmp_path / "bad", "--quiet")
    assert proc.returncode == 2 and "context_utts" in proc.stderr and not (tmp_path / "bad").exists()


# --- known bugs: --jobs N with a Kaldi archive among the inputs ---------------------------------------------


@pytest.fixture(scope="module")
def archive_runs(tmp_path_factory, tiny_lm_dir):
    """`rescore lat.1.gz slt-dev0000.lat.fst slt-dev0001.lat.fst --utt2doc` with --jobs 1 and 2, the archive
    holding slt-dev0002 and slt-dev0003, the second utterances of the single files' documents."""
    d = tmp_path_factory.mktemp("archive_ctx")
    sym = SymbolTable.read(LATTICES / "words.txt")
    with KaldiArchiveWriter(d / "lat.1.gz") as w:
        for u in ("slt-dev0002", "slt-dev0003"):
            w.write(u, read_fst(LATTICES / f"{u}.lat.fst", sym))
    u2d = _utt2doc(d, "slt-dev0000 A\nslt-dev0001 B\nslt-dev0002 A\nslt-dev0003 B\n")
    out = {}
    for jobs in ("1", "2"):
        proc = run_cli("rescore", d / "lat.1.gz", LATTICES / "slt-dev0000.lat.fst", LATTICES / "slt-dev0001.lat.fst",
                       "--words", LATTICES / "words.txt", "--lm", tiny_lm_dir, "--utt2doc", u2d, "--jobs", jobs,
                       "-o", d / jobs, "--quiet")
        assert proc.returncode == 0, proc.stderr
        out[jobs] = d / jobs
    return out


def test_two_jobs_read_archive_entries_after_their_documents_other_inputs(archive_runs):
    one, two = (_jsonl(archive_runs[j] / "nbest.jsonl") for j in ("1", "2"))
    assert _same_scores(one, two)


def test_two_jobs_keep_the_input_order_with_an_archive(archive_runs):
    one, two = ((archive_runs[j] / "best.txt").read_text() for j in ("1", "2"))
    assert [x.split()[0] for x in one.splitlines()] == ["slt-dev0002", "slt-dev0003", "slt-dev0000", "slt-dev0001"]
    assert two == one
