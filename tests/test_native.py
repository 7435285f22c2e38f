"""The compiled loops (_native.c) against their Python twins: the same k-best lists (ties, caps and
warnings included), the same FST bytes and records (broken files included), the same levels, Viterbi
searches and completion costs. setup.sh builds the library, so it must be there."""

import contextlib
import hashlib
import subprocess
import warnings

import numpy as np
import pytest
from conftest import REPO, TEST_DATA
from test_fst_binary import random_lattice
from test_kbest import diamonds, random_dag

from smallstate_lm.rescoring import native
from smallstate_lm.rescoring.fst_binary import read_fst_bytes, write_fst_bytes
from smallstate_lm.rescoring.kbest import kbest_paths
from smallstate_lm.rescoring.lattice import LatticeFormatError, SymbolTable, state_levels, viterbi
from smallstate_lm.rescoring.lattice_expand import _backward, _merge_keys
from smallstate_lm.rescoring.lattice_io import read_lattice


@contextlib.contextmanager
def python_only(monkeypatch):
    """Within the block, every caller gets the Python code (as on a machine without the library)."""
    monkeypatch.setenv("SMALLSTATE_NO_NATIVE", "1")
    native.library.cache_clear()
    try:
        assert native.library() is None
        yield
    finally:
        monkeypatch.delenv("SMALLSTATE_NO_NATIVE")
        native.library.cache_clear()


def both(monkeypatch, fn, *args):
    """(fn(*args) with the library, fn(*args) without it), warnings recorded alongside."""
    assert native.library() is not None, "scripts/build_native.sh (run by setup.sh) has not built _native.so"
    out = []
    for ctx in (contextlib.nullcontext(), python_only(monkeypatch)):
        with ctx, warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out.append((fn(*args), [str(w.message) for w in caught]))
    return out


def _paths(dag, n, max_paths=None):
    got = kbest_paths(*dag, n=n) if max_paths is None else kbest_paths(*dag, n=n, max_paths=max_paths)
    return [(total, arcs.tolist(), fi) for total, arcs, fi in got]


@pytest.mark.parametrize("seed", range(60))
def test_kbest_is_the_python_search(monkeypatch, seed):
    dag = random_dag(seed, int_costs=seed % 2 == 0)  # integer costs: many ties
    (compiled, w1), (python, w2) = both(monkeypatch, _paths, dag, 12)
    assert compiled == python and w1 == w2 == []


def test_kbest_cap_stops_both_at_the_same_pop_with_the_same_warning(monkeypatch):
    for seed in range(2000, 2030):
        dag = random_dag(seed)
        for cap in (1, 4, 9):
            (compiled, w1), (python, w2) = both(monkeypatch, _paths, dag, 20, cap)
            assert compiled == python and w1 == w2
    dag = diamonds(30)  # 2**30 paths, 2 sequences
    (compiled, _), (python, _) = both(monkeypatch, _paths, dag, 5)
    assert compiled == python and len(compiled) == 2


def test_lattice_nbest_and_outputs_are_the_python_ones(monkeypatch, kenlm_model):
    from smallstate_lm.ngram import NgramLM
    from smallstate_lm.rescoring.lattice_expand import LatticeRescorer
    from smallstate_lm.scoring import Weights

    sym = SymbolTable.read(TEST_DATA / "lattices" / "words.txt")
    lats = [read_lattice(p, sym) for p in sorted((TEST_DATA / "lattices").glob("*.lat.fst"))]
    w = Weights(am_scale=1 / 9.5, graph_scale=0.5, ngram_weight=0.7, word_penalty=-0.5)

    def run():
        rescorer = LatticeRescorer(w, ngram=NgramLM(kenlm_model))
        out = dict(rescorer.expand_many(lats))
        return [(out[i].nbest(w, 10), out[i].first_pass, write_fst_bytes(out[i].to_lattice(w)))
                for i in sorted(out)]

    (compiled, _), (python, _) = both(monkeypatch, run)
    assert compiled == python


def test_fst_bytes_and_records_are_the_python_ones(monkeypatch):
    toy = SymbolTable.from_words(["a", "b", "c", "d", "e"])
    rng = np.random.default_rng(5)
    for _ in range(200):
        lat = random_lattice(rng, toy, tropical=False)
        (data, _), (data_py, _) = both(monkeypatch, write_fst_bytes, lat)
        assert data == data_py
        (back, _), (back_py, _) = both(monkeypatch, _read, data, toy)
        assert back == back_py


def _read(data: bytes, symbols: SymbolTable):
    try:
        lat = read_fst_bytes(data, symbols, "x")
    except LatticeFormatError as e:  # some random lattices are empty: the same message either way
        return str(e)
    return [getattr(lat, k).tolist() for k in ("src", "dst", "word", "graph", "acoustic", "final_graph",
                                               "final_acoustic")]


def test_broken_files_give_the_python_errors(monkeypatch):
    path = TEST_DATA / "lattices" / "kal-dev0004.lat.fst"
    data = path.read_bytes()
    sym = SymbolTable.read(path.parent / "words.txt")
    cuts = sorted({int(c) for c in np.linspace(60, len(data) - 1, 40)})
    garbled = bytearray(data)
    garbled[200:208] = (2 ** 62).to_bytes(8, "little")  # an absurd arc count somewhere in the records

    def errors():
        out = []
        for blob in [data[:c] for c in cuts] + [bytes(garbled), data + b"\0" * 12]:
            try:
                read_fst_bytes(blob, sym, "f")
                out.append(None)
            except LatticeFormatError as e:
                out.append(str(e))
        return out

    (compiled, _), (python, _) = both(monkeypatch, errors)
    assert compiled == python and all(m is not None for m in compiled)


def test_levels_viterbi_and_completions_are_the_python_ones(monkeypatch):
    rng = np.random.default_rng(9)
    for _ in range(40):
        n = int(rng.integers(2, 60))
        src = rng.integers(0, n - 1, size=int(rng.integers(1, 4 * n)))
        dst = src + 1 + (rng.integers(0, n, size=src.size) % (n - 1 - src))
        src, dst = np.r_[np.arange(n - 1), src], np.r_[np.arange(1, n), dst]  # every node reachable
        order = np.argsort(src, kind="stable")
        src, dst = src[order], dst[order]  # numbered upwards, sorted by source: the compiled case
        cost = rng.integers(-2, 3, size=src.size).astype(float)  # ties
        final = np.where(rng.random(n) < 0.3, rng.normal(size=n), np.inf)

        (compiled, _), (python, _) = both(monkeypatch, _searches, n, src, dst, cost, final)
        for a, b in zip(compiled, python):
            np.testing.assert_array_equal(a, b)


def _merged(lat_s, key, cost):
    member, winner, first = _merge_keys(lat_s, key, cost)
    return winner[member].tolist(), first[member].tolist()  # per path, whatever the numbering of the merges


def test_merging_paths_by_key_is_the_python_merge(monkeypatch):
    rng = np.random.default_rng(3)
    for _ in range(50):
        n = int(rng.integers(0, 400))
        lat_s = rng.integers(0, 30, n)
        key = rng.integers(0, 6, n) << 41 | rng.integers(0, 3, n)  # packed keys, high bits in use
        cost = rng.integers(0, 4, n).astype(float)  # ties
        (compiled, _), (python, _) = both(monkeypatch, _merged, lat_s, key, cost)
        assert compiled == python


def _searches(n, src, dst, cost, final):
    level = state_levels(n, src, dst)
    dist, back = viterbi(n, src, dst, cost, level, sources=np.array([0, n // 2]))  # a source with in-arcs too
    return level, dist, back, _backward(src, dst, cost, final, level)


def test_bad_graphs_take_the_python_path_and_its_error(monkeypatch):
    with pytest.raises(IndexError):  # an arc to a node that does not exist: never handed to the C loop
        state_levels(2, np.array([0, 1]), np.array([1, 5]))


def test_a_library_built_from_another_source_is_not_used(tmp_path):
    changed = tmp_path / "_native.c"
    changed.write_bytes(native.SOURCE.read_bytes() + b"\n/* another version */\n")
    subprocess.run(["bash", str(REPO / "scripts" / "build_native.sh"), str(changed), str(tmp_path / "x.so")],
                   check=True)
    import ctypes

    lib = ctypes.CDLL(str(tmp_path / "x.so"))
    lib.ssl_source.restype = ctypes.c_char_p
    assert lib.ssl_source().decode() == hashlib.sha1(changed.read_bytes()).hexdigest()
    assert lib.ssl_source().decode() != hashlib.sha1(native.SOURCE.read_bytes()).hexdigest()  # so: not ours
