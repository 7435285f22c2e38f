"""What a lattice rescorer remembers for its whole life, whatever the weights: words, history keys and
n-gram states interned as integers (so that the expansion handles them in arrays), and every n-gram answer
it was given. Lattices of one run share most of their words, so KenLM is asked once per (n-gram state,
word) over all of them, and the answers cost a searchsorted afterwards."""

from __future__ import annotations

import numpy as np

from ...errors import ConfigError
from ...ngram import LN10, NgramLM

KEY_BITS = 21  # bits per word of a packed history key (word ids + 1, 0 = no word): three words in an int64


class SortedRuns:
    """int64 keys -> (float, int64), in sorted runs each more than twice the size of the next: a lookup is
    one searchsorted per run (log2 n of them at most), and each key is merged O(log n) times, however long a
    run of lattices grows the table (inserting into one sorted array would copy all of it every level)."""

    def __init__(self):
        self.runs: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []

    def find(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(found, value, value) for sorted keys; 0.0 and -1 where not found."""
        hit = np.zeros(len(keys), dtype=bool)
        a, b = np.zeros(len(keys)), np.full(len(keys), -1, dtype=np.int64)
        for k, va, vb in self.runs:
            pos = np.minimum(np.searchsorted(k, keys), len(k) - 1)
            here = (k[pos] == keys) & ~hit
            a[here], b[here] = va[pos[here]], vb[pos[here]]
            hit |= here
        return hit, a, b

    def add(self, keys: np.ndarray, a: np.ndarray, b: np.ndarray) -> None:
        """New keys (sorted, none present yet) and their values."""
        if len(keys) == 0:
            return
        self.runs.append((keys, a, b))
        while len(self.runs) > 1 and len(self.runs[-2][0]) <= 2 * len(self.runs[-1][0]):
            merged = [np.concatenate([x, y]) for x, y in zip(self.runs.pop(-2), self.runs.pop())]
            order = np.argsort(merged[0], kind="stable")
            self.runs.append(tuple(m[order] for m in merged))


class LmCache:
    """Interned words (`word_id`: lattices may come with different symbol tables), history keys (the last
    `max_ngram_order` - 1 words, or all of them when None) and n-gram states, and the n-gram's answers."""

    def __init__(self, ngram: NgramLM | None, max_ngram_order: int | None):
        self.ngram, self.order = ngram, max_ngram_order
        self._keys: list[tuple] = [()]  # key id -> history key (decoder word ids)
        self._key_id: dict[tuple, int] = {(): 0}
        self._child: dict[tuple[int, int], int] = {}  # (key id, word) -> key id after the word
        self._ng_states: list = []
        self._ng_id: dict = {}
        self._answers = SortedRuns()  # (n-gram state id, word id + 1; 0 </s>) packed -> (ln p, state id after)
        self._words: list[str] = []
        self._word_ids: dict[str, int] = {}

    def word_id(self, word: str) -> int:
        i = self._word_ids.get(word)
        if i is None:
            if len(self._words) >= (1 << KEY_BITS) - 2:
                raise ConfigError(f"more than {(1 << KEY_BITS) - 2} distinct words in one run")
            i = self._word_ids[word] = len(self._words)
            self._words.append(word)
        return i

    def initial_ngram_state(self) -> int:
        """The id of the n-gram's start-of-sentence state; -1 without an n-gram."""
        return self.ngram_state_id(self.ngram.initial_state()) if self.ngram is not None else -1

    def ngram_state_id(self, state) -> int:
        i = self._ng_id.get(state)
        if i is None:
            i = self._ng_id[state] = len(self._ng_states)
            self._ng_states.append(state)
        return i

    def _key(self, history: tuple) -> tuple:
        n = self.order
        if n is None:
            return history
        return history[-(n - 1):] if n > 1 else ()  # the whole history while it is shorter than n - 1

    def child_keys(self, parents: np.ndarray, words: np.ndarray, gwords: np.ndarray) -> np.ndarray:
        """History key ids after each (key id, word); -1 where the word is -1 (</s>). `gwords` are the
        same words as `word_id`s: up to order 4 a key is their packed last n-1 ids, computed in arrays."""
        n = self.order
        if n is not None and n <= 1 + 63 // KEY_BITS:
            mask = np.int64((1 << (KEY_BITS * (n - 1))) - 1)
            return np.where(gwords >= 0, ((parents << KEY_BITS) | (gwords + 1)) & mask, -1)
        out = np.full(len(parents), -1, dtype=np.int64)
        steps = np.flatnonzero(words >= 0)
        if steps.size == 0:
            return out
        pairs, inverse = np.unique(np.stack([parents[steps], words[steps]], axis=1), axis=0, return_inverse=True)
        child, keys, key_id = self._child, self._keys, self._key_id
        ids = np.empty(len(pairs), dtype=np.int64)
        for i, (k, wd) in enumerate(pairs.tolist()):  # each distinct step once: levels repeat them a lot
            c = child.get((k, wd))
            if c is None:
                key = self._key(keys[k] + (wd,))
                c = key_id.get(key)
                if c is None:
                    c = key_id[key] = len(keys)
                    keys.append(key)
                child[(k, wd)] = c
            ids[i] = c
        out[steps] = ids[inverse.reshape(-1)]
        return out

    def ngram_steps(self, states: np.ndarray, words: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(ln p of each step's word (a `word_id`), or of </s> where it is -1; the n-gram state id after it).
        The pairs answered before are looked up at once; KenLM is asked only for new ones."""
        n = len(states)
        if self.ngram is None:
            return np.zeros(n), np.full(n, -1, dtype=np.int64)
        pair = (states << KEY_BITS) | (words + 1)  # word ids are below 2**KEY_BITS - 1 (word_id checks)
        uniq, inverse = np.unique(pair, return_inverse=True)
        hit, lp, nxt = self._answers.find(uniq)
        new = np.flatnonzero(~hit)
        if len(new):
            got_lp, got_next = self._ask(uniq[new])
            lp[new], nxt[new] = got_lp, got_next
            self._answers.add(uniq[new], got_lp, got_next)
        inverse = inverse.reshape(-1)
        return lp[inverse], nxt[inverse]

    def _ask(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """KenLM's answers to packed (state, word) pairs; ~40k calls a run, so its names are bound locally."""
        got_lp, got_next = np.empty(len(keys)), np.full(len(keys), -1, dtype=np.int64)
        model, new_state, ln10 = self.ngram.model, self.ngram.new_state, LN10
        ng_states, words_of, ng_index = self._ng_states, self._words, self._ng_id
        mask = (1 << KEY_BITS) - 1
        for k, key in enumerate(keys.tolist()):
            s, wd = key >> KEY_BITS, (key & mask) - 1
            after = new_state()
            got_lp[k] = model.BaseScore(ng_states[s], words_of[wd] if wd >= 0 else "</s>", after) * ln10
            if wd >= 0:
                i = ng_index.get(after)
                if i is None:
                    i = ng_index[after] = len(ng_states)
                    ng_states.append(after)
                got_next[k] = i
        return got_lp, got_next
