"""Text read a column at a time (rescoring/formats/columns.py) as a line-by-line reader reads it field by field: the
whitespace it leaves to that reader is exactly what str.split sees beyond ASCII, its tokens are str.split's of
str.splitlines', and strings are grouped exactly, also when their hashes collide."""

from __future__ import annotations

import random
import sys

import numpy as np

from smallstate_lm.rescoring.formats.columns import NON_ASCII_SPACE, group, split_tokens, strings


def test_the_whitespace_left_to_the_line_reader_is_what_str_split_sees():
    spaces = {chr(c) for c in range(128, sys.maxunicode + 1) if chr(c).isspace()}
    lo, hi = NON_ASCII_SPACE.split("-")[0][-1], NON_ASCII_SPACE.split("-")[1][0]
    listed = set(NON_ASCII_SPACE.replace(f"{lo}-{hi}", "")) | {chr(c) for c in range(ord(lo), ord(hi) + 1)}
    assert listed == spaces
    breaks = {chr(c) for c in range(sys.maxunicode + 1) if len(f"a{chr(c)}b".splitlines()) > 1}
    assert breaks <= spaces | {"\n", "\r", "\x0b", "\x0c", "\x1c", "\x1d", "\x1e"}
    for other in ("a\u00a0b", "a\u2028b", "a\x0bb", "a\rb", "a\x1cb"):
        assert split_tokens(other) is None, repr(other)


def test_tokens_are_str_split_of_str_splitlines():
    rng = random.Random(3)
    for _ in range(300):
        lines = [" ".join("".join(rng.choice("ab\u00e9\u4e2d09,.") for _ in range(rng.randint(1, 6)))
                          for _ in range(rng.randint(0, 5))) for _ in range(rng.randint(0, 6))]
        text = rng.choice(["\n", "\r\n"]).join(rng.choice(["", " ", "\t "]) + ln for ln in lines)
        t = split_tokens(text)
        rows = [r for r in map(str.split, text.splitlines()) if r]
        got = [t.data[a:b].tobytes().decode() for a, b in zip(t.start.tolist(), t.end.tolist())]
        assert got == [w for r in rows for w in r]
        assert t.fields.tolist() == [len(r) for r in rows for _ in r]
        assert t.column.tolist() == [k for r in rows for k in range(len(r))]


def test_strings_are_their_distinct_values_in_order_of_first_appearance():
    rng = random.Random(5)
    for _ in range(200):
        words = ["".join(rng.choice("ab\u00e9\u4e2dxyz") for _ in range(rng.randint(0, 20)))
                 for _ in range(rng.randint(0, 60))]
        data = np.frombuffer(" ".join(words).encode(), dtype=np.uint8)
        lens = np.array([len(w.encode()) for w in words], dtype=np.int64)
        start = np.cumsum(lens + 1) - lens - 1
        index, names = strings(data, start, start + lens)
        assert names == list(dict.fromkeys(words))
        assert [names[i] for i in index.tolist()] == words


def test_rows_whose_hashes_collide_are_still_told_apart():
    columns = [np.array([1, 2, 1, 3, 2], dtype=np.uint64), np.array([7, 7, 7, 7, 8], dtype=np.uint64)]
    first, inverse = group(np.zeros(5, dtype=np.uint64), columns)  # every row the same hash
    rows = list(zip(*(c.tolist() for c in columns)))
    assert [rows[first[g]] for g in inverse.tolist()] == rows
    assert len(first) == len(set(rows))

