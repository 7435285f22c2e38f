"""The OpenFST text form read a column at a time gives the line-by-line reader's lattice exactly,
and every text it does not take goes to that reader (its errors); `trie_sizes` gives `trie_size`
of each list."""

from __future__ import annotations

import random

import numpy as np
import pytest
from conftest import REPO

from smallstate_lm.rescoring.formats.fst_text import _FstTextLines, fst_text_columns, lattice_to_text, read_fst_text
from smallstate_lm.rescoring.formats.lattice_io import read_fst
from smallstate_lm.rescoring.lattices.lattice import LatticeFormatError, SymbolTable
from smallstate_lm.scoring.trie import trie_size, trie_sizes

FIELDS = ("src", "dst", "word", "graph", "acoustic", "final_graph", "final_acoustic")


def _line_by_line(text: str, symbols: SymbolTable):
    lines = _FstTextLines(symbols)
    for n, line in enumerate(text.splitlines(), 1):
        parts = line.split()
        if parts:
            lines.add(parts, line, f"x:{n}")
    return lines.lattice("x")


def _same(a, b) -> None:
    assert (a.start, a.num_states) == (b.start, b.num_states)
    for f in FIELDS:
        np.testing.assert_array_equal(getattr(a, f), getattr(b, f), err_msg=f)


def test_the_bundled_lattices_read_alike_both_ways():
    symbols = SymbolTable.read(REPO / "lattices" / "words.txt")
    paths = sorted((REPO / "lattices").glob("*.lat.fst"))
    assert paths
    for path in paths:
        text = lattice_to_text(read_fst(path, symbols))
        assert fst_text_columns(text) is not None
        _same(read_fst_text(text, symbols), _line_by_line(text, symbols))


SYMBOLS = SymbolTable.from_words(["a", "b", "c"])


@pytest.mark.parametrize("text", [
    "0 1 a a 1.5,2\n1 2 b b\n2 0.25\n",  # a missing weight, a single final cost
    "0\t1\t1\t1\t-0.5,1e-3\n1\t2\t0\t0\t.5,3.\n2\n",  # integer labels, epsilon, a final without a weight
    "  \n0 1 a a 1,2\r\n\n1 0,0\n",  # blank lines, CRLF, the start state first by its arc
    "3 0,0\n3 4 c c 1,1\n4 0,0\n",  # the first line a final: the start
    "0 1 a a +1.0E+2,-0\n1 0\n",
])
def test_plain_texts_take_the_column_way_and_read_alike(text):
    assert fst_text_columns(text) is not None
    _same(read_fst_text(text, SYMBOLS), _line_by_line(text, SYMBOLS))


@pytest.mark.parametrize("text", [
    "0 1 a a 1,2\n1 inf\n",  # an infinite final weight: not final
    "0 1 a a 1,2,5_6\n1 0\n",  # transition ids
    "0 1 a a nan\n1 0\n",
    "0 1 a a 1,2\n1 2 x x\n2 0\n",  # a label the table lacks
    "0 1 a a 1,2\n1 0\n1 0\n",  # final twice
    "0 1 a\n1 0\n",  # three columns
    "0 -1 a a 1,2\n",
    "0 1 a a 1,2\u20281 0\n",  # a line break str.splitlines sees
    "0 1 a a 1_0\n1 0\n",  # Python's float reads it
    "",
])
def test_other_texts_go_line_by_line_with_its_answer(text):
    _reads_alike(text, SYMBOLS)


def _reads_alike(text: str, symbols: SymbolTable) -> None:
    """`read_fst_text` gives the line-by-line reader's lattice, or its error word for word."""
    try:
        want = _line_by_line(text, symbols)
    except LatticeFormatError as e:
        with pytest.raises(LatticeFormatError) as got:
            read_fst_text(text, symbols, name="x")
        assert str(got.value) == str(e)
    else:
        _same(read_fst_text(text, symbols), want)


def test_trie_sizes_of_many_lists_are_each_lists_trie_size():
    rng = random.Random(3)
    for _ in range(200):
        lists = []
        for _ in range(rng.randint(1, 6)):
            stem = [rng.randint(0, 3) for _ in range(rng.randint(0, 6))]
            lists.append([stem[:rng.randint(0, len(stem))] + [rng.randint(0, 3) for _ in range(rng.randint(0, 4))]
                          for _ in range(rng.randint(0, 6))])
        seqs = [q for lst in lists for q in lst]
        ids = np.array([t for q in seqs for t in q], dtype=np.int64)
        lens = np.array([len(q) for q in seqs], dtype=np.int64)
        which = np.array([i for i, lst in enumerate(lists) for _ in lst], dtype=np.int64)
        for end in (None, 9):
            want = [trie_size([q + ([end] if end is not None else []) for q in lst]) for lst in lists]
            assert trie_sizes(ids, lens, which, len(lists), end) == want


def test_random_texts_read_alike_both_ways_or_fail_alike():
    """Texts of arcs and finals with the odd field among them (signs, underscores, huge ids, bad weights, other
    whitespace, non-ASCII labels): the columns' lattice or error is the line-by-line reader's."""
    rng = random.Random(17)
    symbols = SymbolTable.from_words(["a", "b\u00e9", "\u4e2d", "x,y"])
    odd_ids = ["+3", "-1", "1_0", "x", "99999999999999999999"]
    odd_weights = ["inf", "nan", "1,2,3", "1,", ",2", "abc", "-inf", "1_5.5"]

    def state() -> str:
        return str(rng.randint(0, 12)) if rng.random() < 0.95 else rng.choice(odd_ids)

    def weight() -> str:
        if rng.random() < 0.95:
            return rng.choice([repr(rng.uniform(-50, 50)), f"{rng.uniform(-5, 5)!r},{rng.uniform(0, 99)!r}", "0"])
        return rng.choice(odd_weights)

    columns = 0
    for _ in range(1500):
        lines = []
        for _ in range(rng.randint(1, 8)):
            k = rng.choice([1, 2, 4, 5, 5, 5, 4, 3])
            fields = ([state(), state(), rng.choice(["a", "b\u00e9", "\u4e2d", "x,y", "0", "zz"])] * 2)[:4]
            parts = [state(), weight()][:k] if k <= 2 else (fields + [weight()])[:k]
            lines.append(rng.choice([" ", "\t", "  "]).join(parts))
        text = rng.choice(["\n", "\r\n"]).join(lines) + rng.choice(["", "\n"])
        if rng.random() < 0.05:
            text = text.replace(" ", rng.choice(["\u00a0", "\x0b", "\r"]), 1)
        columns += fst_text_columns(text) is not None
        _reads_alike(text, symbols)
    assert columns > 500  # most took the column way


def test_a_state_id_beyond_int64_is_a_format_error():
    with pytest.raises(LatticeFormatError, match="below 2\\*\\*63"):
        read_fst_text("0 99999999999999999999 a a\n", SYMBOLS, name="x")
