"""The binary OpenFST reader and writer (rescoring/formats/fst_binary.py) against kaldifst, the reference here only."""

import struct
import warnings

import kaldifst
import numpy as np
import pytest
from conftest import REPO, TEST_DATA

from smallstate_lm.rescoring.formats.fst_binary import read_fst_bytes, read_fst_raw, write_fst_bytes
from smallstate_lm.rescoring.formats.lattice_io import read_fst, read_fst_text, write_fst
from smallstate_lm.rescoring.lattices.lattice import Lattice, LatticeFormatError, SymbolTable

BUNDLED = sorted((REPO / "lattices").glob("*.fst")) + sorted((TEST_DATA / "lattices").glob("*.fst"))
IDS = [f"{p.parent.parent.name}/{p.name}" for p in BUNDLED]
AM = 1 / 9.5
FIELDS = ("src", "dst", "word", "graph", "acoustic", "final_graph", "final_acoustic")


@pytest.fixture(scope="module")
def words() -> dict:
    return {d: SymbolTable.read(d / "words.txt") for d in {p.parent for p in BUNDLED}}


@pytest.fixture(scope="module")
def toy() -> SymbolTable:
    return SymbolTable.from_words(["a", "b", "c", "d", "e"])  # a=1 ... e=5


def assert_same(x: Lattice, y: Lattice) -> None:
    assert (x.num_states, x.start) == (y.num_states, y.start)
    for f in FIELDS:
        assert np.array_equal(getattr(x, f), getattr(y, f)), f


def kaldifst_fst(lat: Lattice, arc_type: str = "lattice4"):
    """`lat` built with kaldifst the way write_fst built it before fst_binary: states, start, arcs, finals."""
    fst = kaldifst.Lattice() if arc_type == "lattice4" else kaldifst.StdVectorFst()
    for _ in range(lat.num_states):
        fst.add_state()
    fst.start = lat.start
    for s, d, w, g, a in zip(lat.src.tolist(), lat.dst.tolist(), lat.word.tolist(), lat.graph.tolist(),
                             lat.acoustic.tolist()):
        arc = (kaldifst.LatticeArc(w, w, kaldifst.LatticeWeight(g, a), d) if arc_type == "lattice4"
               else kaldifst.StdArc(w, w, g, d))
        fst.add_arc(s, arc)
    for s in np.flatnonzero(lat.is_final()).tolist():
        g, a = float(lat.final_graph[s]), float(lat.final_acoustic[s])
        fst.set_final(s, kaldifst.LatticeWeight(g, a) if arc_type == "lattice4" else g)
    return fst


def kaldifst_bytes(fst, tmp_path) -> bytes:
    assert fst.write(str(tmp_path / "k.fst"))
    return (tmp_path / "k.fst").read_bytes()


# ---------------------------------------------------------------------------------------------- bundled lattices

@pytest.mark.parametrize("path", BUNDLED, ids=IDS)
def test_reader_gives_kaldifsts_states_arcs_and_finals(words, path):
    k = kaldifst.Lattice.read(str(path))
    raw = read_fst_raw(path.read_bytes(), str(path))
    lat = read_fst(path, words[path.parent])
    assert (lat.num_states, lat.start) == (k.num_states, k.start)
    # finals: kaldifst hands out the stored float32 values exactly
    expect = np.asarray([(k.final(s).value1, k.final(s).value2) for s in range(k.num_states)], dtype=np.float32)
    assert np.array_equal(raw.final, expect)
    finite = np.isfinite(expect).all(axis=1)
    assert np.array_equal(lat.final_graph[finite].astype(np.float32), expect[finite, 0])
    assert np.array_equal(lat.final_acoustic[finite].astype(np.float32), expect[finite, 1])
    # arcs: kaldifst gives them out only as text (6 significant digits); the digits must be those of our float32
    lines = [ln.split() for ln in str(k).splitlines() if len(ln.split()) >= 4]
    ours = [[str(s), str(a["nextstate"]), str(a["ilabel"]), str(a["olabel"]), "{:g},{:g}".format(*a["weight"])]
            for s, a in zip(raw.state.tolist(), raw.arcs)]
    assert [ln[:4] for ln in lines] == [o[:4] for o in ours]
    assert [ln[4] if len(ln) == 5 else "0,0" for ln in lines] == [o[4] for o in ours]
    assert np.array_equal(lat.word, raw.arcs["olabel"]) and np.array_equal(lat.src, raw.state)
    assert np.array_equal(lat.graph.astype(np.float32), raw.arcs["weight"][:, 0])
    assert np.array_equal(lat.acoustic.astype(np.float32), raw.arcs["weight"][:, 1])


@pytest.mark.parametrize("path", BUNDLED, ids=IDS)
def test_writer_bytes_are_kaldifsts_and_the_files(words, path, tmp_path):
    """kaldifst, fed the costs we read, writes the very file back: so our float32 values are the file's."""
    lat = read_fst(path, words[path.parent])
    ours = write_fst_bytes(lat)
    assert ours == kaldifst_bytes(kaldifst_fst(lat), tmp_path)
    assert ours == path.read_bytes()
    write_fst(tmp_path / "out.lat.fst", lat)
    assert (tmp_path / "out.lat.fst").read_bytes() == ours


@pytest.mark.parametrize("path", BUNDLED, ids=IDS)
def test_round_trip_read_write_read(words, path):
    lat = read_fst(path, words[path.parent])
    back = read_fst_bytes(write_fst_bytes(lat), words[path.parent], "again", name=lat.name)
    assert_same(lat, back)
    assert back.name == lat.name and back.symbols is lat.symbols


@pytest.mark.parametrize("path", BUNDLED, ids=IDS)
def test_best_path_is_the_old_text_routes(words, path):
    """read_fst used to go through kaldifst's text form (6 digits); rescoring must not notice the change."""
    sym = words[path.parent]
    old = read_fst_text(str(kaldifst.Lattice.read(str(path))), sym).prepare().best_path(AM, 1.0)
    new = read_fst(path, sym).prepare().best_path(AM, 1.0)
    assert new[0] == old[0] and len(new[0]) > 0
    assert new[1] == pytest.approx(old[1], rel=1e-5, abs=1e-4)  # 6 digits of acoustic costs in the thousands


# ------------------------------------------------------------------------------------- lattices of every shape

def random_lattice(rng: np.random.Generator, symbols: SymbolTable, tropical: bool) -> Lattice:
    """Epsilons, unsorted labels, arcs going back, self-loops, unweighted arcs and finals, no finals at all."""
    S = int(rng.integers(1, 7))
    A = int(rng.integers(0, 10))
    pool = np.asarray([0.0, -0.0, 0.5, 1.25, -3.0, 1e-7, 2.0 / 3.0, 12345.678], dtype=np.float32)

    def costs(n: int) -> np.ndarray:
        c = rng.choice(pool, size=(n, 2)).astype(np.float64)
        c[rng.random(n) < 0.3] = 0.0  # weight One
        if tropical:
            c[:, 1] = 0.0
        return c

    forward = rng.random() < 0.5  # half of them top-sorted, as lattices are
    src = rng.integers(0, S, size=A)
    dst = np.minimum(src + rng.integers(1, 3, size=A), S - 1) if forward else rng.integers(0, S, size=A)
    arc, fin = costs(A), costs(S)
    fin[rng.random(S) < 0.5] = np.inf
    return Lattice(name="r", num_states=S, start=int(rng.integers(0, S)), src=src, dst=dst,
                   word=rng.integers(0, 6, size=A), graph=arc[:, 0], acoustic=arc[:, 1],
                   final_graph=fin[:, 0].copy(), final_acoustic=fin[:, 1].copy(), symbols=symbols)


def fstprint_order(lat: Lattice) -> Lattice:
    """`lat` with its arcs in the order the reader gives them: the start state's first, then by state."""
    order = np.lexsort((lat.src, lat.src != lat.start))
    return Lattice(lat.name, lat.num_states, lat.start, lat.src[order], lat.dst[order], lat.word[order],
                   lat.graph[order], lat.acoustic[order], lat.final_graph, lat.final_acoustic, lat.symbols)


@pytest.mark.parametrize("arc_type", ["lattice4", "standard"])
def test_writer_bytes_equal_kaldifsts_for_lattices_of_every_shape(toy, tmp_path, arc_type):
    rng = np.random.default_rng(0)
    for i in range(150):
        lat = random_lattice(rng, toy, tropical=arc_type == "standard")
        ours = write_fst_bytes(lat, arc_type)
        assert ours == kaldifst_bytes(kaldifst_fst(lat, arc_type), tmp_path), i
        if lat.num_arcs or lat.is_final().any():
            assert_same(read_fst_bytes(ours, toy, "r"), fstprint_order(lat))


def test_tropical_fst_reads_exactly_as_kaldifst_holds_it(toy, tmp_path):
    f = kaldifst.StdVectorFst()
    for _ in range(3):
        f.add_state()
    f.start = 0
    f.add_arc(0, kaldifst.StdArc(2, 2, 0.1, 1))
    f.add_arc(0, kaldifst.StdArc(1, 1, 1 / 3, 2))
    f.add_arc(1, kaldifst.StdArc(0, 0, 0.0, 2))
    f.set_final(2, 0.7)
    f.write(str(tmp_path / "g.fst"))
    lat = read_fst(tmp_path / "g.fst", toy)
    it = [kaldifst.ArcIterator(f, s) for s in (0, 0, 1)]
    it[1].next()
    assert lat.graph.tolist() == [i.value.weight.value for i in it]  # exact: 0.1 and 1/3 as float32
    assert lat.acoustic.tolist() == [0.0] * 3 and lat.final_acoustic[2] == 0.0
    assert lat.final_graph.tolist() == [np.inf, np.inf, f.final(2).value]
    assert write_fst_bytes(lat, "standard") == (tmp_path / "g.fst").read_bytes()
    assert lat.best_path() == (["b"], float(np.float32(0.1)) + float(np.float32(0.7)))


def test_const_fst_reads_as_the_vector_fst(words, tmp_path):
    path = TEST_DATA / "lattices" / "kal-dev0001.lat.fst"
    lat = read_fst(path, words[path.parent])
    lat.acoustic[:] = 0.0  # kaldifst writes const FSTs of tropical arcs only
    lat.final_acoustic[lat.is_final()] = 0.0
    kaldifst.StdConstFst(kaldifst_fst(lat, "standard")).write(str(tmp_path / "c.fst"))
    data = (tmp_path / "c.fst").read_bytes()
    assert read_fst_raw(data, "c").header.fst_type == "const"
    assert_same(read_fst_bytes(data, words[path.parent], "c"), lat)


def test_aligned_const_fst_skips_the_padding(toy, tmp_path):
    lat = fstprint_order(random_lattice(np.random.default_rng(3), toy, tropical=True))
    lat.final_graph[0] = lat.final_acoustic[0] = 0.0
    kaldifst.StdConstFst(kaldifst_fst(lat, "standard")).write(str(tmp_path / "c.fst"))
    data = (tmp_path / "c.fst").read_bytes()
    h = read_fst_raw(data, "c").header
    states_end = h.end + 20 * h.num_states
    pad1, pad2 = -h.end % 16, -(states_end + -h.end % 16) % 16
    aligned = bytearray(data[: h.end] + b"\0" * pad1 + data[h.end: states_end] + b"\0" * pad2 + data[states_end:])
    aligned[h.end - 36: h.end - 32] = struct.pack("<i", 4)  # the flags: IS_ALIGNED
    assert_same(read_fst_bytes(bytes(aligned), toy, "c"), lat)


def test_embedded_symbol_tables_map_labels_by_name(toy, tmp_path):
    table = kaldifst.SymbolTable()
    for w, i in (("<eps>", 0), ("b", 1), ("a", 2)):  # not the ids of `toy` (a=1, b=2)
        table.add_symbol(w, i)
    f = kaldifst.compile("0 1 a a 0.5\n1 2 b b 1.25\n2 0.5\n", isymbols=table, osymbols=table,
                         keep_isymbols=True, keep_osymbols=True)
    f.write(str(tmp_path / "sym.fst"))
    lat = read_fst(tmp_path / "sym.fst", toy)
    assert [toy.word(w) for w in lat.word] == ["a", "b"] and lat.graph.tolist() == [0.5, 1.25]
    assert lat.best_path() == (["a", "b"], 2.25)
    with pytest.raises(LatticeFormatError, match=r"sym.fst: state 0: label a is not in the symbol table"):
        read_fst(tmp_path / "sym.fst", SymbolTable.from_words(["b"]))


def test_uncounted_states_read_to_the_end_of_the_file(words):
    path = TEST_DATA / "lattices" / "slt-dev0004.lat.fst"
    data = bytearray(path.read_bytes())
    h = read_fst_raw(bytes(data), "x").header
    data[h.end - 16: h.end - 8] = struct.pack("<q", -1)  # how OpenFST writes to a pipe
    assert_same(read_fst_bytes(bytes(data), words[path.parent], "x"), read_fst(path, words[path.parent]))


def test_tropical_writer_refuses_acoustic_costs(toy):
    lat = read_fst_text("0 1 1 1 0.5,1\n1\n", toy)
    with pytest.raises(ValueError, match="acoustic"):
        write_fst_bytes(lat, "standard")


# -------------------------------------------------------------------------------------------------- bad files

def _cut_points(data: bytes) -> dict[str, int]:
    """Offsets that cut a lattice4 vector FST inside each kind of field."""
    h = read_fst_raw(data, "x").header
    first_arcs = h.end + 16
    narcs0 = struct.unpack_from("<q", data, h.end + 8)[0]
    return {"magic": 2, "fst type": 7, "arc type": 20, "properties": 30, "num states": h.end - 12,
            "state head": h.end + 11, "arcs": first_arcs + 20 * narcs0 - 5, "state boundary": first_arcs + 20 * narcs0}


@pytest.mark.parametrize("where", ["magic", "fst type", "arc type", "properties", "num states", "state head",
                                   "arcs", "state boundary"])
def test_truncated_file_names_file_expectation_and_offset(words, tmp_path, where):
    path = TEST_DATA / "lattices" / "kal-dev0004.lat.fst"
    data = path.read_bytes()
    cut = _cut_points(data)[where]
    (tmp_path / "cut.lat.fst").write_bytes(data[:cut])
    with pytest.raises(LatticeFormatError) as e:
        read_fst(tmp_path / "cut.lat.fst", words[path.parent])
    msg = str(e.value)
    assert msg.startswith(str(tmp_path / "cut.lat.fst") + ": "), msg
    if where == "magic":
        assert "not a binary OpenFST file" in msg and "byte 0" in msg, msg
    else:
        assert "truncated" in msg and "expected" in msg and "byte " in msg, msg
        assert f"after {cut} bytes" in msg or f"at byte {cut}" in msg, msg


def test_bad_magic_names_file_and_offset(words, tmp_path):
    data = bytearray((TEST_DATA / "lattices" / "kal-dev0004.lat.fst").read_bytes())
    data[0] ^= 0xFF
    (tmp_path / "bad.lat.fst").write_bytes(bytes(data))
    with pytest.raises(LatticeFormatError, match=r"bad.lat.fst: not a binary OpenFST file \(bad magic number at "
                                                 r"byte 0; expected 2125659606\)"):
        read_fst(tmp_path / "bad.lat.fst", words[TEST_DATA / "lattices"])


def test_garbled_arc_names_state_arc_and_offset(words, tmp_path):
    data = bytearray((TEST_DATA / "lattices" / "kal-dev0004.lat.fst").read_bytes())
    h = read_fst_raw(bytes(data), "x").header
    at = h.end + 16 + 20  # the second arc of state 0
    data[at + 16: at + 20] = struct.pack("<i", 99999)  # its next state
    (tmp_path / "bad.lat.fst").write_bytes(bytes(data))
    with pytest.raises(LatticeFormatError, match=rf"bad.lat.fst: corrupt file: arc 1 of state 0 at byte {at}: "
                                                 r"its next state 99999 is outside"):
        read_fst(tmp_path / "bad.lat.fst", words[TEST_DATA / "lattices"])


@pytest.mark.parametrize("cut", [70, 200, -7])
def test_truncated_const_fst_names_the_table_and_offset(toy, tmp_path, cut):
    lat = random_lattice(np.random.default_rng(5), toy, tropical=True)
    kaldifst.StdConstFst(kaldifst_fst(lat, "standard")).write(str(tmp_path / "c.fst"))
    data = (tmp_path / "c.fst").read_bytes()
    with pytest.raises(LatticeFormatError, match=r"^c.fst: file ends inside the table of (states|arcs) after "
                                                 r"\d+ bytes \(truncated\); expected \d+ records of \d+ bytes "
                                                 r"from byte \d+$"):
        read_fst_bytes(data[:cut], toy, "c.fst")


@pytest.mark.parametrize("kind", ["vector", "const"])
def test_damaged_bytes_give_a_format_error_or_a_lattice_never_a_crash(toy, tmp_path, kind):
    lat = fstprint_order(random_lattice(np.random.default_rng(7), toy, tropical=True))
    fst = kaldifst_fst(lat, "standard")
    data = kaldifst_bytes(kaldifst.StdConstFst(fst) if kind == "const" else fst, tmp_path)
    rng = np.random.default_rng(0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nor a numpy warning on garbled floats
        for _ in range(300):
            d = bytearray(data[: rng.integers(0, len(data))] if rng.random() < 0.3 else data)
            at = int(rng.integers(0, len(d) or 1))
            d[at: at + 4] = rng.integers(0, 256, size=len(d[at: at + 4]), dtype=np.uint8).tobytes()
            try:
                read_fst_bytes(bytes(d), toy, "f")
            except LatticeFormatError as e:
                assert str(e).startswith("f: ")
