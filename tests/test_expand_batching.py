"""Expansion run-wide (issue 16): lattices prepared as a group and expanded side by side give each the
result it gets alone, whatever the batch and whichever lattices leave early; the decoder's best path comes
out of the same pass; symbol flags are computed only for the ids asked."""

import dataclasses

import numpy as np
import pytest
from test_expand_arrays import ARRAYS, W, lattices

from smallstate_lm.ngram import NgramLM
from smallstate_lm.rescoring.expand.rescorer import ExpandConfig, LatticeRescorer
from smallstate_lm.rescoring.lattices.lattice import SymbolTable


@pytest.fixture(scope="module")
def lats():
    return lattices()


def _same(a, b):
    assert a.stats.expanded_states == b.stats.expanded_states
    for k in ARRAYS + ("nn", "ng", "final_nn", "final_ng"):
        np.testing.assert_array_equal(getattr(a, k), getattr(b, k), err_msg=k)


def test_each_lattice_expands_as_it_does_alone_whatever_the_batch(lats, kenlm_model):
    ngram = NgramLM(kenlm_model)
    alone = [LatticeRescorer(W, ngram=ngram, config=ExpandConfig(batch_lattices=1)).expand(lat) for lat in lats]
    for batch in (3, None):  # refilled as lattices finish; all at once (the n-gram-only default)
        got = dict(LatticeRescorer(W, ngram=ngram, config=ExpandConfig(batch_lattices=batch)).expand_many(lats))
        assert sorted(got) == list(range(len(lats)))
        for i, exp in got.items():
            _same(exp, alone[i])


def test_a_stopped_lattice_yields_nothing_and_leaves_the_others_unchanged(lats, kenlm_model):
    ngram = NgramLM(kenlm_model)
    full = dict(LatticeRescorer(W, ngram=ngram, config=ExpandConfig(batch_lattices=4)).expand_many(lats))
    asked = []

    def stop(i):  # lattice 1 is stopped after it has started; lattice 2 before it starts
        asked.append(i)
        return i == 2 or (i == 1 and asked.count(1) > 2)

    got = dict(LatticeRescorer(W, ngram=ngram, config=ExpandConfig(batch_lattices=4)).expand_many(
        lats, should_stop=stop))
    assert sorted(got) == [i for i in range(len(lats)) if i not in (1, 2)]
    assert asked.count(1) > 2, "lattice 1 was asked between levels"
    for i, exp in got.items():
        _same(exp, full[i])


@pytest.mark.parametrize("am_scale", [0.1, 1.0])
def test_first_pass_from_the_expansion_is_the_lattices_best_path(lats, kenlm_model, am_scale):
    w = dataclasses.replace(W, am_scale=am_scale)
    rescorer = LatticeRescorer(w, ngram=NgramLM(kenlm_model))
    for i, exp in rescorer.expand_many(lats):
        assert exp.first_pass is not None
        assert exp.first_pass_words(am_scale) == lats[i].best_path(am_scale, 1.0)[0]
        assert exp.first_pass_words(2 * am_scale) == lats[i].best_path(2 * am_scale, 1.0)[0]  # not the cached one


def test_word_flags_look_at_the_ids_asked_and_match_is_word():
    table = SymbolTable([("<eps>", 0), ("a", 1), ("#0", 3), ("<unk>", 7), ("[NOISE]", 8), ("b", 10)])
    ids = np.array([10, 1, 3, 2, 7, 8, 0, 99, -1, 1])
    got = table.word_flags(ids)
    want = [table.has_id(i) and table.is_word(i) for i in ids.tolist()]
    assert got.tolist() == want


def test_the_ngram_answer_table_finds_every_key_given_and_stays_in_few_runs():
    from smallstate_lm.rescoring.expand.lm_cache import SortedRuns

    rng = np.random.default_rng(0)
    table, ref = SortedRuns(), {}
    for _ in range(1500):  # levels of a long run: each asks for some pairs, some of them new
        asked = np.unique(rng.integers(0, 40_000, int(rng.integers(1, 300))))
        hit, lp, nxt = table.find(asked)
        assert hit.tolist() == [k in ref for k in asked.tolist()]
        assert all(ref[k] == (a, b) for k, a, b in zip(asked[hit].tolist(), lp[hit].tolist(), nxt[hit].tolist()))
        new = asked[~hit]
        a, b = rng.random(len(new)), rng.integers(0, 99, len(new))
        table.add(new, a, b)
        ref.update(zip(new.tolist(), zip(a.tolist(), b.tolist())))
    sizes = [len(r[0]) for r in table.runs]
    assert sum(sizes) == len(ref) and all(x > 2 * y for x, y in zip(sizes, sizes[1:]))


def test_a_level_in_row_chunks_gives_the_scores_of_one_call_and_pauses_between_them(lats, kenlm_model, tiny_lm_dir):
    """A server bounds the time between two of its checks by cutting a level's LM step into calls of a
    few rows (`rows_per_call`): same expansion, within float rounding of differently batched calls."""
    from test_expand_arrays import assert_same

    from smallstate_lm.checkpoint import load_model

    lm, ngram = load_model(tiny_lm_dir), NgramLM(kenlm_model)
    cfg = ExpandConfig(batch_lattices=4)
    whole_r = LatticeRescorer(W, lm.model, lm.vocab, ngram, cfg)
    whole = dict(whole_r.expand_many(lats))
    chunked_r = LatticeRescorer(W, lm.model, lm.vocab, ngram, cfg)
    chunked_r.rows_per_call = lambda step: 7
    outs = list(chunked_r.expand_many(lats, pause=True))
    got = {o[0]: o[1] for o in outs if o is not None}
    levels = sum(1 for o in outs if o is None)
    assert chunked_r.lm_calls > whole_r.lm_calls
    assert levels >= chunked_r.lm_calls - 1 > whole_r.lm_calls, "a pause between the calls of a level"
    assert sorted(got) == sorted(whole)
    for i in got:
        assert_same(got[i], whole[i], lm_tol=1e-5)


def test_a_lattice_stopped_inside_a_level_has_no_more_rows_computed(lats, kenlm_model, tiny_lm_dir):
    from smallstate_lm.checkpoint import load_model

    lm = load_model(tiny_lm_dir)
    big = max(range(len(lats)), key=lambda i: lats[i].num_arcs)
    r = LatticeRescorer(W, lm.model, lm.vocab, NgramLM(kenlm_model), ExpandConfig(batch_lattices=4))
    r.rows_per_call = lambda step: 3
    asked = []

    def stop(i):
        asked.append(i)
        return i == big and len(asked) > 4

    steps = r.expand_many([lats[big]], should_stop=lambda i: stop(big), pause=True)
    pauses = 0
    for out in steps:
        assert out is None, "a stopped lattice yields no result"
        pauses += 1
    calls_after_stop = r.lm_calls
    full = LatticeRescorer(W, lm.model, lm.vocab, NgramLM(kenlm_model), ExpandConfig(batch_lattices=4))
    full.rows_per_call = lambda step: 3
    list(full.expand_many([lats[big]], pause=True))
    assert calls_after_stop < full.lm_calls / 2


def test_a_wide_level_keeps_its_best_states_within_max_level_bytes(kenlm_model, tiny_lm_dir):
    """A fan lattice (every history followed by many words): under max_level_bytes a level keeps its best
    states only, says it pruned harder, and still finds a complete path."""
    from smallstate_lm.checkpoint import load_model
    from smallstate_lm.rescoring.formats.lattice_io import read_fst_text

    lm, ngram = load_model(tiny_lm_dir), NgramLM(kenlm_model)
    words = [w for w in lm.vocab.words[4:] if w in ngram][:60]
    text = "".join(f"0 1 {w} {w} 1.0,1.0\n" for w in words[:20]) + "".join(
        f"1 2 {w} {w} 1.0,1.0\n" for w in words[20:60]) + "2 0,0\n"
    lat = read_fst_text(text, SymbolTable.from_words(words), name="fan")
    wide = ExpandConfig(max_per_state=64, beam=1000.0)
    free = LatticeRescorer(W, lm.model, lm.vocab, ngram, wide).expand(lat)
    row_bytes = 3 * lm.model.state_numel_per_position() * 4
    capped = LatticeRescorer(W, lm.model, lm.vocab, ngram,
                             dataclasses.replace(wide, max_level_bytes=200 * row_bytes)).expand(lat)
    assert not free.stats.pruned_harder and capped.stats.pruned_harder
    # words at 0, every history x every word at 1, </s> after the best 64 at 2
    assert free.stats.lm_rows == 20 + 20 * 40 + 64
    assert capped.stats.lm_rows <= 20 + 200 + 64
    assert capped.nbest(W, 1)[0].words
