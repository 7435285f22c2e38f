"""What crosses between a front-end and the engine: messages survive the trip whole (arrays small and large,
a prepared lattice, an expansion, a client's error), and a request's hypothesis lists become exactly the token ids
the neural LM's own encoding gives."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
from conftest import TEST_DATA

from smallstate_lm.rescoring.expand.rescorer import ExpandConfig, build_rescorer
from smallstate_lm.rescoring.formats.lattice_io import read_fst
from smallstate_lm.rescoring.lattices.lattice import SymbolTable
from smallstate_lm.service.board import Board
from smallstate_lm.service.errors import CostLimitError
from smallstate_lm.service.messages import (
    OUT_OF_BAND,
    LatticeJob,
    ListJob,
    Refused,
    Scored,
    Submit,
    from_frames,
    portable,
    to_frames,
)
from smallstate_lm.weights import Weights


def _trip(msg):
    frames = to_frames(msg)
    return frames, from_frames([memoryview(bytes(f)) for f in frames])


def test_small_arrays_ride_in_the_pickle_and_large_ones_as_frames_of_their_own():
    small = np.arange(10, dtype=np.int64)
    large = np.arange(OUT_OF_BAND // 8 + 1, dtype=np.int64)
    msg = Submit(7, "rescore", Weights(lm_weight=0.3), [ListJob(small, np.array([4, 6]), 0.01, 6),
                                                         ListJob(large, np.array([len(large)]), 2.0, len(large))],
                 [], cost=5, seconds=2.01, lattice_seconds=0.0, tokens_total=10, tokens_computed=10, remaining=3.5,
                 timeout=30.0, field="utterances")
    frames, back = _trip(msg)
    assert len(frames) == 2  # the pickle, and the one large array
    assert back.id == 7 and back.weights == msg.weights and back.remaining == 3.5
    for a, b in zip(msg.lists, back.lists):
        np.testing.assert_array_equal(a.tokens, b.tokens)
        assert a.tokens.dtype == b.tokens.dtype
    assert back.lists[0].sequences == [[0, 1, 2, 3], [4, 5, 6, 7, 8, 9]]


def test_a_lattice_and_its_expansion_cross_whole(kenlm_model):
    symbols = SymbolTable.read(TEST_DATA / "lattices" / "words.txt")
    lat = read_fst(sorted((TEST_DATA / "lattices").glob("*.lat.fst"))[0], symbols).prepare()
    _, back = _trip(Submit(1, "rescore", Weights(), [], [LatticeJob(lat, "utterances[0]", 0.5, 1000)], cost=1,
                           seconds=0.5, lattice_seconds=0.5, tokens_total=0, tokens_computed=0, remaining=1.0,
                           timeout=1.0, field="utterances"))
    got = back.lattices[0].lattice
    for f in dataclasses.fields(lat):
        a, b = getattr(lat, f.name), getattr(got, f.name)
        if isinstance(a, np.ndarray):
            np.testing.assert_array_equal(a, b)
    assert [got.symbols.word(i) for i in got.word.tolist()] == [lat.symbols.word(i) for i in lat.word.tolist()]

    from smallstate_lm.lms import load_lms

    _, ngram = load_lms(None, str(kenlm_model), "cpu", required=False)
    exp = build_rescorer(Weights(), None, ngram, ExpandConfig(), "cpu").expand(lat)
    _, back = _trip(Scored(1, None, [dataclasses.replace(exp, source=None)]))
    mine = dataclasses.replace(back.lattices[0], source=lat)
    assert [p.words for p in mine.nbest(Weights(), 5)] == [p.words for p in exp.nbest(Weights(), 5)]
    assert [p.total for p in mine.nbest(Weights(), 5)] == [p.total for p in exp.nbest(Weights(), 5)]


def test_a_clients_error_crosses_with_its_field_and_limit_and_a_bug_as_its_name():
    _, back = _trip(Refused(3, portable(CostLimitError("too big", "utterances[2].lattice", 100))))
    assert isinstance(back.error, CostLimitError)
    assert (str(back.error), back.error.field, back.error.limit) == ("too big", "utterances[2].lattice", 100)
    _, back = _trip(Refused(4, portable(KeyError("x"))))
    assert isinstance(back.error, RuntimeError) and "KeyError" in str(back.error)


def test_lists_become_the_neural_lms_own_token_ids(tiny_lm_dir, kenlm_model):
    from smallstate_lm.rescoring.nbest.lists import Hypothesis, Utterance
    from smallstate_lm.service.frontend.submit import engine_submit
    from smallstate_lm.service.frontend.work import Work, make_work, nbest_item
    from smallstate_lm.service.model import Models
    from smallstate_lm.service.settings import Settings

    models = Models(Settings(lm=str(tiny_lm_dir), ngram=str(kenlm_model), device="cpu", threads=1))
    models.load()
    hyps = [["the", "lord", "said"], [], ["and", "zzzunknown", "the"], ["The", "lord"]]
    items = [nbest_item(Utterance("u", [Hypothesis(words=h, am=-1.0) for h in hyps]), ["in", "the"]),
             nbest_item(Utterance("v", [Hypothesis(words=["unto", "them"], am=-2.0)]), [])]
    work = make_work(models, Work("rescore", models.weights, items, ["utterances[0]", "utterances[1]"]))
    msg = engine_submit(models, work, 5.0, 30.0)
    assert [job.sequences for job in msg.lists] == [
        [models.neural.encode(["in", "the"] + h) for h in hyps], [models.neural.encode(["unto", "them"])]]
    assert msg.cost == work.cost and msg.seconds == work.seconds and msg.remaining == 5.0
    assert [job.tree for job in msg.lists] == [it.tree for it in items]


def test_the_board_counts_requests_on_their_way_in_across_front_ends(tmp_path):
    board = Board(tmp_path / "board", 2, create=True)
    other = Board(tmp_path / "board", 2)  # another process's view of the same memory
    board.set_counts(0, 5, 3)
    board.set_counts(1, 2, 2)
    assert (other.received(), other.handed()) == (7, 5)
    other.settle(0)  # front-end 0 died: its two requests will never come
    assert board.handed() == board.received() == 7
    board.engine(1234, True)
    board.frontend_ready(0, True)
    assert other.engine_pid == 1234 and not other.all_ready()
    board.frontend_ready(1, True)
    assert other.all_ready()
    board.backlog(3.0, 0.0, 0.05)
    assert other.long_backlog() == 3.0
    board.backlog(0.01, 0.01, 0.05)
    assert other.long_backlog() is None and math.isfinite(board.a.sum())


@pytest.mark.parametrize("cpus, expected", [(1, 1), (2, 1), (3, 2), (8, 7)])
def test_front_ends_by_default_leave_one_cpu_to_the_engine(cpus, expected):
    from smallstate_lm.service.supervisor import default_frontends

    assert default_frontends(cpus) == expected
