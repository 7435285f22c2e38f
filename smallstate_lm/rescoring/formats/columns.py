"""Whitespace-separated text split into tokens a column at a time, as numpy arrays of byte offsets, with each
column read as integers, floats or strings in a few array operations. What a line-by-line reader (`str.split`,
`int`, `float` per field) makes of the same text, at a fraction of the interpreter's time: a service prices a
2 MB request of lattices in text form before it decides to refuse it, and that reading was most of it.

Only text that the line-by-line reader splits the same way is taken (`split_tokens` says None otherwise):
fields separated by spaces and tabs, lines by LF or CRLF. Readers fall back to their line-by-line form for
anything else, which also words their errors.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

# what str.split and str.splitlines take for whitespace or a line break beyond ASCII (str.isspace; the line breaks
# are among them; tests/test_columns.py checks the list against every code point)
NON_ASCII_SPACE = "\x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000"
_NON_ASCII_SPACE = re.compile(f"[{NON_ASCII_SPACE}]")
_MAX_DIGITS = 18  # int64 holds every such number
_MAX_GATHER = 64 << 20  # bytes of a column's fixed-width copy: beyond, the line-by-line reader (a pathological label)


@dataclass
class Tokens:
    """The tokens of a text, in order: byte spans of `data` (its UTF-8 form), how many tokens the (non-blank) line
    of each has, and the token's position on it."""

    data: np.ndarray  # uint8
    start: np.ndarray
    end: np.ndarray  # exclusive
    fields: np.ndarray
    column: np.ndarray


def split_tokens(text: str) -> Tokens | None:
    """`text`'s tokens, or None when `str.split`/`str.splitlines` would split it otherwise than on ' ', '\\t',
    LF and CRLF (other whitespace, a lone CR), or it does not encode (a lone surrogate)."""
    try:
        raw = text.encode("utf-8")
    except UnicodeEncodeError:
        return None
    data = np.frombuffer(raw, dtype=np.uint8)
    if ((data < 32) & (data != 9) & (data != 10) & (data != 13)).any():
        return None  # control characters: some are whitespace to str.split, NUL would not survive `strings`
    cr = np.flatnonzero(data == 13)
    if len(cr) and (cr[-1] + 1 == len(data) or (data[cr + 1] != 10).any()):
        return None  # a CR not followed by LF breaks a line for str.splitlines
    if (data >= 128).any() and _NON_ASCII_SPACE.search(text):
        return None
    space = (data == 32) | (data == 9) | (data == 10) | (data == 13)
    edges = np.diff(np.concatenate(([True], space, [True])).view(np.int8))
    start = np.flatnonzero(edges == -1)
    end = np.flatnonzero(edges == 1)
    # a token begins a line when a newline precedes it since the token before (blank lines do not count)
    begins_line = np.zeros(len(start), dtype=bool)
    begins_line[:1] = True
    after = np.searchsorted(start, np.flatnonzero(data == 10))  # the token after each newline
    begins_line[after[after < len(start)]] = True
    begins = np.flatnonzero(begins_line)
    fields = np.diff(begins, append=len(start))
    line = np.cumsum(begins_line) - 1
    column = np.arange(len(start)) - begins[line]
    return Tokens(data, start, end, fields[line], column)


def _fixed_width(data: np.ndarray, start: np.ndarray, end: np.ndarray) -> np.ndarray | None:
    """The spans as rows of a fixed-width uint8 array, zero-padded; None when the copy would be too large."""
    lens = end - start
    width = int(lens.max(initial=0))
    if len(start) * width > _MAX_GATHER:
        return None
    if width == 0:
        return np.zeros((len(start), 0), dtype=np.uint8)
    rows = sliding_window_view(np.concatenate([data, np.zeros(width, dtype=np.uint8)]), width)[start]
    rows[np.arange(width) >= lens[:, None]] = 0
    return rows


def ints(data: np.ndarray, start: np.ndarray, end: np.ndarray) -> np.ndarray | None:
    """The spans as non-negative integers (ASCII digits only, at most 18); None for any other span, which
    `int()` may still read (a sign, an underscore, other digits) or refuse."""
    lens = end - start
    if len(start) == 0:
        return np.zeros(0, dtype=np.int64)
    width = int(lens.max())
    if width > _MAX_DIGITS or int(lens.min()) < 1:
        return None
    at = end[:, None] - width + np.arange(width)  # right-aligned: a digit's place is its column
    inside = at >= start[:, None]
    digits = data[np.maximum(at, 0)] - np.uint8(48)  # wraps around below '0'
    if not ((digits <= 9) | ~inside).all():
        return None
    return np.where(inside, digits, 0).astype(np.int64) @ (10 ** np.arange(width - 1, -1, -1, dtype=np.int64))


def floats(data: np.ndarray, start: np.ndarray, end: np.ndarray) -> np.ndarray:
    """The spans as `float()` reads them (ValueError for a span it refuses, an empty one included)."""
    if len(start) and int((end - start).min()) < 1:
        raise ValueError("an empty number")
    chars = _fixed_width(data, start, end)
    if chars is None:
        raise ValueError("a number too long to read a column at a time")
    if chars.shape[1] == 0:
        return np.zeros(len(start))
    return chars.view(f"S{chars.shape[1]}").ravel().astype(np.float64)


def strings(data: np.ndarray, start: np.ndarray, end: np.ndarray) -> tuple[np.ndarray, list[str]]:
    """The spans (UTF-8) as an index into their distinct strings, listed in order of first appearance. A span is
    read as 8-byte words (its bytes exactly, with its length); spans are grouped by a hash of those, and each
    span's words are then compared with its group's first (exact: a hash shared by two strings sorts them apart by
    their words)."""
    if len(start) == 0:
        return np.zeros(0, dtype=np.int64), []
    lens = end - start
    words = byte_words(data, start, lens)
    key = lens.astype(np.uint64)
    for w in words:
        key = (key ^ w) * np.uint64(0x9E3779B97F4A7C15)
        key ^= key >> np.uint64(29)
    first, inverse = group(key, [lens.astype(np.uint64), *words])
    order = np.argsort(first)
    rank = np.empty_like(order)
    rank[order] = np.arange(len(order))
    names = [data[a:b].tobytes().decode("utf-8") for a, b in zip(start[first[order]].tolist(),
                                                                   end[first[order]].tolist())]
    return rank[inverse], names


def group(key: np.ndarray, columns: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Rows told apart by their `columns` (uint64 each), grouped by `key`, a hash of them: each group's first row
    and each row's group. Exact: where two rows share a key but differ, they are grouped by the columns
    themselves."""
    _, first, inverse = np.unique(key, return_index=True, return_inverse=True)
    inverse = inverse.ravel()
    if not all((c == c[first[inverse]]).all() for c in columns):
        _, first, inverse = np.unique(np.stack(columns, axis=1), axis=0, return_index=True, return_inverse=True)
        inverse = inverse.ravel()
    return first, inverse


_LOW_BYTES = np.array([(1 << (8 * k)) - 1 for k in range(8)] + [(1 << 64) - 1], dtype=np.uint64)


def byte_words(data: np.ndarray, start: np.ndarray, lens: np.ndarray) -> list[np.ndarray]:
    """Each span's bytes as little-endian 8-byte words, zero past its end: one array per 8 bytes of the longest."""
    n = -(-int(lens.max(initial=0)) // 8)
    padded = np.concatenate([data, np.zeros(8 * n + 8, dtype=np.uint8)])
    # every offset's next 8 bytes as one number: a view with a stride of one byte
    at = np.ndarray(shape=(len(padded) - 7,), dtype="<u8", buffer=padded, strides=(1,))
    return [at[start + 8 * k] & _LOW_BYTES[np.clip(lens - 8 * k, 0, 8)] for k in range(n)]


def split_at(data: np.ndarray, start: np.ndarray, end: np.ndarray, sep: str) -> tuple[np.ndarray, np.ndarray]:
    """How many `sep` bytes (one ASCII character) each span holds, and the offset of its first (its end where it
    holds none)."""
    if len(start) == 0:
        return np.zeros(0, dtype=np.int64), end.copy()
    at = np.flatnonzero(data == ord(sep))
    owner = np.searchsorted(start, at, side="right") - 1
    inside = (owner >= 0) & (at < end[np.maximum(owner, 0)])
    at, owner = at[inside], owner[inside]
    count = np.bincount(owner, minlength=len(start))
    first = end.copy()
    spans, at_first = np.unique(owner, return_index=True)  # `at` ascends: a span's first is its first in `at`
    first[spans] = at[at_first]
    return count, first
