"""k2/icefall lattices (`torch.save(fsa.as_dict())`) without k2: files built by hand from k2's documented layout
read right, our lattices round-trip through the dict, every damaged file is one line naming the file and the
field, and `rescore` reads the bundled FsaVec and writes it back as one."""

import dataclasses
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import run_cli

from smallstate_lm.rescoring.formats.k2 import K2Writer, k2_dict, read_k2, write_k2
from smallstate_lm.rescoring.formats.lattice_io import lattice_inputs, read_fst, read_lattice
from smallstate_lm.rescoring.formats.resolve import lattice_format
from smallstate_lm.rescoring.lattices.lattice import LatticeFormatError, Ragged, SymbolTable

LATTICES = Path(__file__).resolve().parents[1] / "lattices"
WORDS = LATTICES / "words.txt"
SAMPLE = LATTICES / "k2" / "kal-dev.pt"
SYM = SymbolTable.from_words(["a", "b", "c"])  # a=1, b=2, c=3


def arcs(rows) -> np.ndarray:
    """(A, 4) int32 rows `src, dst, label, score`, the float32 score's bits in the last column (k2's Arc)."""
    out = np.array([[s, d, lab, 0] for s, d, lab, _ in rows], dtype=np.int32).reshape(-1, 4)
    out[:, 3] = np.array([r[3] for r in rows], dtype=np.float32).view(np.int32)
    return out


def fsa_vec(*fsas: tuple[int, np.ndarray]) -> np.ndarray:
    """k2's FsaVecToTensor layout of (num_states, arcs) FSAs: num_fsas, 0, row_splits1, row_splits12, arcs."""
    states = np.cumsum([0] + [n for n, _ in fsas])
    splits = np.cumsum([0] + [len(a) for _, a in fsas])
    flat = np.concatenate([a.ravel() for _, a in fsas]) if fsas else np.zeros(0, np.int32)
    return np.concatenate([[len(fsas), 0], states, splits, flat]).astype(np.int32)


def t(x, dtype=None):
    return torch.tensor(np.asarray(x), dtype=dtype)


# A single acceptor: 0 -a-> 1 -b-> 2, 0 -c-> 2, then 2's final arc into the final state 3.
SINGLE_ARCS = arcs([(0, 1, 1, -1.0), (0, 2, 3, -3.5), (1, 2, 2, -2.0), (2, 3, -1, -0.5)])
SINGLE_LM = np.array([-0.25, -1.0, -0.5, -0.125], dtype=np.float32)

# An FsaVec of two HLG-style FSAs: tokens in the labels, words in aux_labels (0: none, -1 on final arcs).
VEC_FSA0 = arcs([(0, 1, 5, -1.5), (1, 2, -1, -0.25)])
VEC_FSA1 = arcs([(0, 1, 7, -0.75), (1, 2, 8, -2.0), (2, 3, -1, 0.0)])
VEC_AUX = np.array([1, -1, 0, 2, -1], dtype=np.int32)
VEC_LM = np.array([-0.5, -0.125, 0.0, -1.0, 0.0], dtype=np.float32)


def vec_dict() -> dict:
    return {"arcs": t(fsa_vec((3, VEC_FSA0), (4, VEC_FSA1))), "aux_labels": t(VEC_AUX), "lm_scores": t(VEC_LM)}


def test_a_single_fsa_built_by_hand_reads_words_costs_and_finals(tmp_path):
    path = tmp_path / "utt7.pt"
    torch.save({"arcs": t(SINGLE_ARCS), "lm_scores": t(SINGLE_LM)}, path)
    assert lattice_format(path).name == "k2"
    lat = read_lattice(path, SYM)
    assert lat.name == "utt7" and lat.num_states == 3 and lat.start == 0  # the k2 final state folded away
    assert [SYM.word(w) for w in lat.word] == ["a", "c", "b"]
    assert lat.graph.tolist() == [0.25, 1.0, 0.5]  # -lm_scores
    assert lat.acoustic.tolist() == [0.75, 2.5, 1.5]  # -(scores - lm_scores)
    assert lat.final_graph.tolist() == [np.inf, np.inf, 0.125]
    assert lat.final_acoustic.tolist() == [np.inf, np.inf, 0.375]
    assert lat.arc_tids is None  # an acceptor: no tokens
    words, cost = lat.best_path(am_scale=1.0)
    assert words == ["a", "b"] and cost == pytest.approx(3.5)


def test_without_lm_scores_the_whole_score_is_acoustic(tmp_path):
    path = tmp_path / "u.pt"
    torch.save({"arcs": t(SINGLE_ARCS)}, path)
    lat = read_lattice(path, SYM)
    assert lat.graph.tolist() == [0.0, 0.0, 0.0] and lat.acoustic.tolist() == [1.0, 3.5, 2.0]
    assert lat.final_acoustic[2] == 0.5


def test_an_fsavec_built_by_hand_reads_words_from_aux_labels_and_keeps_tokens(tmp_path):
    path = tmp_path / "lats.pt"
    torch.save(vec_dict(), path)
    items = list(lattice_inputs([path], SYM))
    assert [(x.name, x.kind, x.archive) for x in items] == [("lats-0", "k2-fsavec", str(path)),
                                                          ("lats-1", "k2-fsavec", str(path))]
    a, b = (x.load() for x in items)
    assert (a.num_states, a.word.tolist(), a.arc_tids.tolist()) == (2, [1], [[5]])
    assert a.graph.tolist() == [0.5] and a.acoustic.tolist() == [1.0]
    assert a.final_graph.tolist() == [np.inf, 0.125] and a.final_acoustic.tolist() == [np.inf, 0.125]
    assert (b.num_states, b.word.tolist(), b.arc_tids.tolist()) == (3, [0, 2], [[7], [8]])
    assert b.src.tolist() == [0, 1] and b.dst.tolist() == [1, 2]
    assert b.final_graph.tolist() == [np.inf, np.inf, 0.0]
    assert b.best_path()[0] == ["b"]


def test_the_dict_round_trips_bit_for_bit(tmp_path):
    """file -> our lattices -> the dict we write: the same tensors, bit for bit (layout, labels, scores)."""
    path = tmp_path / "lats.pt"
    d = vec_dict()
    torch.save(d, path)
    back = k2_dict(read_k2(path, SYM), vec=True)
    assert back.keys() == d.keys()
    for k in d:
        assert back[k].dtype == d[k].dtype and torch.equal(back[k], d[k]), k
    torch.save({"arcs": t(SINGLE_ARCS), "lm_scores": t(SINGLE_LM)}, path)
    single = k2_dict(read_k2(path, SYM), vec=False)
    assert torch.equal(single["arcs"], t(SINGLE_ARCS)) and torch.equal(single["lm_scores"], t(SINGLE_LM))


def _dev_lattice(name="kal-dev0001"):
    return read_fst(LATTICES / f"{name}.lat.fst", SymbolTable.read(WORDS)).prepare()


@pytest.mark.parametrize("tokens", [False, True])
def test_our_lattices_round_trip_through_the_dict(tmp_path, tokens):
    """ours -> dict -> ours: identical arrays where the costs are exact in float32 (k2 stores the total and the LM
    part, so the acoustic part comes back as their difference), equal to float32 precision otherwise."""
    lats = [_dev_lattice(n) for n in ("kal-dev0001", "slt-dev0003")]
    exact = []
    for lat in lats:
        x = dataclasses.replace(lat)
        for f in ("graph", "acoustic", "final_graph", "final_acoustic"):
            setattr(x, f, np.round(getattr(lat, f) * 64) / 64)  # dyadic: every sum exact in float32
        exact.append(x)
    if tokens:
        rng = np.random.default_rng(0)
        for x in lats + exact:
            x.arc_tids = Ragged(np.arange(x.num_arcs + 1), rng.integers(0, 500, x.num_arcs).astype(np.int32))
    for group, close in ((exact, False), (lats, True)):
        write_k2(tmp_path / "x.pt", group, vec=True)
        back = read_k2(tmp_path / "x.pt", group[0].symbols)
        for a, b in zip(group, back):
            assert (b.num_states, b.start) == (a.num_states, a.start)
            for f in ("src", "dst", "word", "graph", "final_graph"):
                assert np.array_equal(getattr(a, f), getattr(b, f)), f
            for f in ("acoustic", "final_acoustic"):
                if close:
                    assert np.allclose(getattr(a, f), getattr(b, f), rtol=1e-6, atol=1e-4), f
                else:
                    assert np.array_equal(getattr(a, f), getattr(b, f)), f
            assert (b.arc_tids is None) != tokens
            if tokens:
                assert b.arc_tids.tolist() == a.arc_tids.tolist()
    write_k2(tmp_path / "one.pt", [exact[0]], vec=False)
    assert torch.load(tmp_path / "one.pt", weights_only=True)["arcs"].dim() == 2
    one = read_lattice(tmp_path / "one.pt", exact[0].symbols)
    assert one.name == "one" and np.array_equal(one.acoustic, exact[0].acoustic)


def test_a_state_with_several_final_arcs_keeps_them_into_a_final_state(tmp_path):
    path = tmp_path / "u.pt"
    torch.save({"arcs": t(arcs([(0, 1, 1, -1.0), (1, 2, -1, -0.5), (1, 2, -1, -2.0)]))}, path)
    lat = read_lattice(path, SYM)
    assert lat.num_states == 3 and lat.word.tolist() == [1, 0, 0] and lat.dst.tolist() == [1, 2, 2]
    assert lat.final_acoustic.tolist() == [np.inf, np.inf, 0.0]
    assert lat.best_path(1.0)[1] == pytest.approx(1.5)


def test_the_writer_keeps_positions_of_lattices_that_failed(tmp_path):
    lat = _dev_lattice()
    with K2Writer(tmp_path / "x.pt", "k2-fsavec") as w:
        w.write("x-0", lat)
        w.write("x-2", lat)
    items = list(lattice_inputs([tmp_path / "x.pt"], lat.symbols))
    assert [x.name for x in items] == ["x-0", "x-1", "x-2"]
    with pytest.raises(LatticeFormatError, match=r"x\.pt: FSA 1: empty FSA"):
        items[1].load()
    assert items[2].load().num_arcs == lat.num_arcs
    with pytest.raises(ValueError):  # an error in the block: nothing is written
        with K2Writer(tmp_path / "y.pt") as w:
            w.write("y-0", lat)
            raise ValueError
    assert not (tmp_path / "y.pt").exists()


class Opaque:
    """A class k2's dict could hold (its RaggedTensor, SymbolTable): unpickling it needs code we do not run."""


def _bad_vec(*, header=None, tail=None):
    flat = fsa_vec((3, VEC_FSA0), (4, VEC_FSA1))
    if header is not None:
        flat[2: 2 + len(header)] = header
    return {"arcs": t(flat if tail is None else flat[:tail])}


_LM4 = t(np.zeros(4, np.float32))
BAD = {  # case: (dict or bytes to save, the field and problem the one-line message must name)
    "not a dict": ([1, 2], "holds a list"),
    "no arcs": ({"lm_scores": _LM4}, "arcs: missing"),
    "arcs int64": ({"arcs": t(SINGLE_ARCS, torch.int64)}, "arcs: dtype int64, expected int32"),
    "arcs 3 columns": ({"arcs": t(SINGLE_ARCS[:, :3])}, "arcs: shape (4, 3)"),
    "aux_labels float": ({"arcs": t(SINGLE_ARCS), "aux_labels": _LM4}, "aux_labels: dtype float32"),
    "lm_scores short": ({"arcs": t(SINGLE_ARCS), "lm_scores": _LM4[:2]}, "lm_scores: shape (2,), expected (4,)"),
    "lm_scores int": ({"arcs": t(SINGLE_ARCS), "lm_scores": t(SINGLE_ARCS[:, 0])}, "lm_scores: dtype int32"),
    "aux_labels a list": ({"arcs": t(SINGLE_ARCS), "aux_labels": [1, 2, 3, -1]}, "aux_labels: expected a tensor"),
    "state out of range": ({"arcs": t(arcs([(0, 1, 1, -1.0), (0, 7, 2, 0.0), (1, 3, -1, 0.0)]))},
                           "arcs: arc 1 has dest_state 7, outside the FSA's 4 states"),
    "no final arc": ({"arcs": t(arcs([(0, 1, 1, -1.0), (1, 2, 2, 0.0)]))},
                     "arcs: no arc enters the final state 3 (label -1)"),
    "two final states": ({"arcs": t(arcs([(0, 1, -1, -1.0), (0, 2, -1, 0.0)]))},
                         "arcs: arcs labelled -1 enter states 1 and 2"),
    "word into the final state": ({"arcs": t(arcs([(0, 2, 1, -1.0), (1, 2, -1, 0.0)]))},
                                  "labels: arc 0 enters the final state 2 with label 1"),
    "src goes back": ({"arcs": t(arcs([(1, 2, -1, -1.0), (0, 1, 1, 0.0)]))}, "arcs: src_state goes back from 1 to 0"),
    "NaN score": ({"arcs": t(arcs([(0, 1, 1, np.nan), (1, 2, -1, 0.0)]))}, "scores: arc 0 has nan"),
    "unknown word": ({"arcs": t(arcs([(0, 1, 99, -1.0), (1, 2, -1, 0.0)]))}, "labels: arc 0 has word id 99"),
    "aux -1 inside": ({"arcs": t(SINGLE_ARCS), "aux_labels": t(np.array([1, -1, 2, -1], np.int32))},
                      "aux_labels: arc 1 has -1"),
    "vec header truncated": (_bad_vec(tail=5), "arcs: 5 ints cannot hold the header of 2 FSAs"),
    "vec arcs truncated": (_bad_vec(tail=-3), "arcs: 17 ints after the header, not whole arcs"),
    "vec row_splits1 decrease": (_bad_vec(header=[0, 5, 4]), "row_splits1 (states before each FSA) decrease at "
                                                             "FSA 1 (5 then 4)"),
    "vec row_splits12 not from 0": (_bad_vec(header=[0, 3, 7, 1]), "row_splits12 (arcs before each FSA) starts at 1"),
    "vec arc count": (_bad_vec(header=[0, 3, 7, 0, 2, 4]), "row_splits12 counts 4 arcs, but 5 follow"),
    "vec state outside its FSA": (_bad_vec(header=[0, 2, 7]), "FSA 0: arcs: arc 1 has dest_state 2, outside the "
                                                              "FSA's 2 states"),
    "vec leaves the final state": ({"arcs": t(fsa_vec((2, arcs([(0, 1, -1, 0.0), (1, 1, -1, 0.0)]))))},
                                   "FSA 0: arcs: arc 1 leaves the final state 1"),
    "vec empty FSA": ({"arcs": t(fsa_vec((0, arcs([]))))}, "FSA 0: empty FSA (no states)"),
    "foreign class": ({"arcs": t(SINGLE_ARCS), "aux_labels": Opaque()}, "needs k2 classes"),
    "truncated file": (b"cut", "not a torch.save file, or a truncated one"),
    "not torch at all": (b"hello, world", "not a torch.save file"),
}


@pytest.mark.parametrize("case", BAD)
def test_a_bad_file_is_one_line_naming_the_file_and_the_field(tmp_path, case):
    obj, expected = BAD[case]
    path = tmp_path / "bad.pt"
    if obj == b"cut":
        torch.save({"arcs": t(SINGLE_ARCS)}, path)
        path.write_bytes(path.read_bytes()[:200])
    elif isinstance(obj, bytes):
        path.write_bytes(obj)
    else:
        torch.save(obj, path)
    with pytest.raises(LatticeFormatError) as e:
        read_k2(path, SYM)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"{path}: ") and expected in msg, msg
    if case == "foreign class":
        assert "Opaque" in msg and "torch.save({k: v for k, v in lats.as_dict().items()" in msg


def test_a_bad_fsa_fails_alone(tmp_path):
    path = tmp_path / "lats.pt"
    bad0 = arcs([(0, 1, 99, -1.0), (1, 2, -1, 0.0)])
    torch.save({"arcs": t(fsa_vec((3, bad0), (4, VEC_FSA1)))}, path)
    first, second = lattice_inputs([path], SymbolTable.from_words([f"w{i}" for i in range(10)]))
    with pytest.raises(LatticeFormatError, match=r"lats\.pt: FSA 0: labels: arc 0 has word id 99"):
        first.load()
    assert second.load().word.tolist() == [7, 8]


def test_the_sample_is_found_by_name_and_by_content(tmp_path):
    assert lattice_format(SAMPLE).name == "k2"
    shutil.copy(SAMPLE, tmp_path / "lats")
    assert lattice_format(tmp_path / "lats").name == "k2"
    with pytest.raises(LatticeFormatError, match="holds several lattices"):
        read_lattice(SAMPLE, SymbolTable.read(WORDS))


def _rescore(ngram, out, *inputs, extra=()):
    return run_cli("rescore", *inputs, "--words", WORDS, "--weights", LATTICES / "weights-ngram.json",
                   "--ngram", ngram, "-o", out, "--quiet", *extra)


def test_rescore_the_bundled_sample_end_to_end(tmp_path, kenlm_model):
    sym = SymbolTable.read(WORDS)
    proc = _rescore(kenlm_model, tmp_path / "k2", SAMPLE)
    assert proc.returncode == 0, proc.stderr
    best = dict(line.split(" ", 1) for line in (tmp_path / "k2" / "best.txt").read_text().splitlines())
    assert list(best) == ["kal-dev-0", "kal-dev-1", "kal-dev-2"]
    assert len((tmp_path / "k2" / "nbest.jsonl").read_text().splitlines()) == 3
    proc = _rescore(kenlm_model, tmp_path / "fst", *[LATTICES / f"kal-dev000{i}.lat.fst" for i in range(3)])
    assert proc.returncode == 0, proc.stderr
    fst_best = [line.split(" ", 1)[1] for line in (tmp_path / "fst" / "best.txt").read_text().splitlines()]
    assert list(best.values()) == fst_best  # the same lattices as the .fst files, to float32 precision

    # the written FsaVec holds the rescored lattices: its best path under the weights is best.txt
    w = json.loads((LATTICES / "weights-ngram.json").read_text())
    written = read_k2(tmp_path / "k2" / "lattices" / "kal-dev.pt", sym)
    assert [x.name for x in written] == list(best)
    for lat in written:
        assert " ".join(lat.best_path(w["am_scale"], 1.0)[0]) == best[lat.name]

    # with no history kept and no pruning, the rescored lattices have the input's topology
    proc = _rescore(kenlm_model, tmp_path / "order1", SAMPLE, extra=("--max-ngram-order", "1", "--beam", "inf",
                                                                    "--nbest", "0"))
    assert proc.returncode == 0, proc.stderr
    for a, b in zip(read_k2(SAMPLE, sym), read_k2(tmp_path / "order1" / "lattices" / "kal-dev.pt", sym)):
        assert (b.num_states, b.num_arcs) == (a.num_states, a.num_arcs)
        assert b.is_final().sum() == a.is_final().sum()
        assert np.array_equal(np.sort(np.bincount(a.src, minlength=a.num_states)),
                              np.sort(np.bincount(b.src, minlength=b.num_states)))
        ka, kb = np.lexsort((a.acoustic, a.word)), np.lexsort((b.acoustic, b.word))
        assert np.array_equal(a.word[ka], b.word[kb])
        assert np.allclose(a.acoustic[ka], b.acoustic[kb], atol=1e-4)  # acoustic untouched, float32 sums aside


def test_rescore_keeps_tokens_and_writes_a_ctm(tmp_path, kenlm_model):
    """An icefall-style FsaVec (tokens on the labels, words on aux_labels) is written back with both, every
    rescored arc a copy of an input arc; one frame per arc gives the CTM's times."""
    rng = np.random.default_rng(1)
    lats = [_dev_lattice(n) for n in ("slt-dev0000", "slt-dev0001")]
    for lat in lats:
        lat.arc_tids = Ragged(np.arange(lat.num_arcs + 1), rng.integers(1, 300, lat.num_arcs).astype(np.int32))
    write_k2(tmp_path / "hlg.pt", lats)
    assert set(torch.load(tmp_path / "hlg.pt", weights_only=True)) == {"arcs", "aux_labels", "lm_scores"}
    proc = _rescore(kenlm_model, tmp_path / "out", tmp_path / "hlg.pt", extra=("--ctm", "--frame-shift", "0.04"))
    assert proc.returncode == 0, proc.stderr
    sym = SymbolTable.read(WORDS)
    written = read_k2(tmp_path / "out" / "lattices" / "hlg.pt", sym)
    for src, out in zip(lats, written):
        have = {(int(w), int(tok)) for w, tok in zip(src.word, src.arc_tids.values)}
        assert {(int(w), int(tok)) for w, tok in zip(out.word, out.arc_tids.values)} <= have
    ctm = (tmp_path / "out" / "best.ctm").read_text().splitlines()
    best = (tmp_path / "out" / "best.txt").read_text().splitlines()
    assert {line.split()[0] for line in ctm} == {"hlg-0", "hlg-1"}
    assert [line.split()[4] for line in ctm if line.startswith("hlg-0 ")] == best[0].split()[1:]  # word, confidence
