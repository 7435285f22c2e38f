import gzip

import numpy as np
import pytest
from conftest import TEST_DATA

from smallstate_lm.rescoring.formats.lattice_io import lattice_to_text, read_fst, read_fst_text, read_slf, write_fst
from smallstate_lm.rescoring.lattices.lattice import Lattice, LatticeFormatError, LatticeWarning, SymbolTable

LAT = TEST_DATA / "lattices"
NAMES = ["slt-dev0000", "slt-dev0004", "kal-dev0001", "kal-dev0004"]
AM = 1 / 9.5  # the decoder's acoustic scale in LM units


@pytest.fixture(scope="module")
def words() -> SymbolTable:
    return SymbolTable.read(LAT / "words.txt")


@pytest.fixture(scope="module")
def toy() -> SymbolTable:
    return SymbolTable.from_words(["a", "b", "c", "<s>", "</s>", "<sil>"])  # a=1 b=2 c=3


def assert_same(x: Lattice, y: Lattice) -> None:
    assert (x.num_states, x.start) == (y.num_states, y.start)
    for f in ("src", "dst", "word", "graph", "acoustic", "final_graph", "final_acoustic"):
        assert np.array_equal(getattr(x, f), getattr(y, f)), f


# ---------------------------------------------------------------------------------------------- real lattices

@pytest.mark.parametrize("name", NAMES)
def test_fst_and_slf_of_a_dev_lattice_agree(words, name):
    wf, cf = read_fst(LAT / f"{name}.lat.fst", words).prepare().best_path(AM, 1.0)
    ws, cs = read_slf(LAT / f"{name}.lm.slf.gz", words).prepare().best_path(AM, 1.0)
    assert wf == ws and len(wf) > 3
    assert abs(cf - cs) <= 1e-3


@pytest.mark.parametrize("name", NAMES)
def test_best_path_equals_kaldifst_shortest_path(words, name):
    import kaldifst

    k = kaldifst.Lattice.read(str(LAT / f"{name}.lat.fst"))
    kaldifst.scale_lattice(kaldifst.lattice_scale(1.0, AM), k)
    ok, _, olabels, weight = kaldifst.get_linear_symbol_sequence(kaldifst.shortest_path(k, n=1))
    got, cost = read_fst(LAT / f"{name}.lat.fst", words).prepare().best_path(AM, 1.0)
    assert ok and got == [words.word(i) for i in olabels if words.is_word(i)]
    assert abs(cost - (weight.value1 + weight.value2)) <= 1e-3


def test_best_path_total_is_the_decoders_first_pass_total(words):
    top = (TEST_DATA / "nbest.tsv").read_text().splitlines()[1].split("\t")  # dev0000 rank 0, same voice
    for lat in (read_fst(LAT / "slt-dev0000.lat.fst", words), read_slf(LAT / "slt-dev0000.lm.slf.gz")):
        got, cost = lat.prepare().best_path(AM, 1.0)
        assert got == top[6].split() and abs(cost - float(top[2])) <= 1e-3


def test_write_fst_round_trip_is_identical(words, tmp_path):
    lat = read_fst(LAT / "kal-dev0004.lat.fst", words)
    write_fst(tmp_path / "out" / "x.lat.fst", lat)
    back = read_fst(tmp_path / "out" / "x.lat.fst", words)
    assert back.name == "x"
    assert_same(lat, back)
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["x.lat.fst"]  # no temp file left behind


def test_text_form_round_trip_is_identical(words):
    lat = read_slf(LAT / "slt-dev0004.lm.slf.gz", words).prepare()
    assert_same(lat, read_fst_text(lattice_to_text(lat), words))


def test_prepare_keeps_a_sorted_dev_lattice_as_it_is(words):
    lat = read_fst(LAT / "slt-dev0004.lat.fst", words)
    assert_same(lat, lat.prepare())


def test_tropical_fst_reads_as_graph_cost_only(toy, tmp_path):
    import kaldifst

    f = kaldifst.StdVectorFst()
    f.add_state(), f.add_state()
    f.start = 0
    f.add_arc(0, kaldifst.StdArc(2, 2, 1.5, 1))
    f.set_final(1, 0.25)
    f.write(str(tmp_path / "g.fst"))
    lat = read_fst(tmp_path / "g.fst", toy)
    assert lat.graph.tolist() == [1.5] and lat.acoustic.tolist() == [0.0] and lat.final_graph[1] == 0.25
    assert lat.best_path() == (["b"], 1.75)


# ---------------------------------------------------------------------------------------- hand-made lattices

def test_epsilon_chain_keeps_arcs_and_costs(toy):
    lat = read_fst_text("0 1 0 0 1,0\n1 2 4 4 0,2\n2 3 1 1 0.5,1\n3 4 6 6 0,0\n4 0.25,0\n", toy).prepare()
    assert lat.num_arcs == 4
    assert lat.best_path(am_scale=0.5) == (["a"], 1.0 + 0.5 + 0.25 + 0.5 * 3)  # <s>, <sil> are not words


DIAMOND = """\
0 1 1 1 1,10
0 1 2 2 2,4
1 2 3 3 0.5,6
1 3 0 0 0,2
3 2 1 1 3,0
2 0,0
"""


@pytest.mark.parametrize("am_scale,expect", [
    (0.5, (["b", "c"], 2 + 0.5 * 4 + 0.5 + 0.5 * 6)),  # b (4) beats a (6); c (3.5) beats eps+a (4)
    (0.0, (["a", "c"], 1 + 0.5)),
    (0.1, (["a", "c"], 1 + 0.1 * 10 + 0.5 + 0.1 * 6)),  # a 2.0 vs b 2.4; c 1.1 vs eps+a 3.2
])
def test_best_path_worked_out_by_hand(toy, am_scale, expect):
    words, cost = read_fst_text(DIAMOND, toy).best_path(am_scale=am_scale)
    assert words == expect[0] and cost == pytest.approx(expect[1])


def test_prepare_sorts_states_topologically(toy):
    lat = read_fst_text("3 1 1 1 1,0\n1 0 2 2 1,0\n3 2 3 3 5,0\n2 0 0 0 0,0\n0 0.5,0\n", toy, name="mixed")
    p = lat.prepare()
    assert p.start == 0 and np.all(p.src < p.dst) and np.all(np.diff(p.src) >= 0)
    assert p.best_path() == lat.best_path() == (["a", "b"], 2.5)


def test_symbolic_labels_in_text_form(toy):
    assert read_fst_text("0 1 b b 1,2\n1\n", toy).word.tolist() == [2]


@pytest.mark.parametrize("text", ["0 1 1 1 1,0\n1 2 2 2 1,0\n2 1 3 3 1,0\n2 3 0 0 0,0\n3\n",
                                  "0 1 1 1 1,0\n1 1 2 2 1,0\n1 0,0\n"])
def test_cycle_is_an_error_naming_a_state_on_it(toy, text):
    with pytest.raises(LatticeFormatError, match=r"'loopy' has a cycle through state 1$"):
        read_fst_text(text, toy, name="loopy").prepare()


def test_empty_lattice_is_an_error(toy):
    with pytest.raises(LatticeFormatError, match="req: empty lattice"):
        read_fst_text("\n", toy, name="req")


@pytest.mark.parametrize("text,needle", [
    ("0 1 1 1 1,0\n", "has no final state"),
    ("0 1 1 1 1,0\n2 0,0\n", "no path from the start state 0 to a final state"),
])
def test_lattice_without_a_complete_path_is_an_error(toy, text, needle):
    with pytest.raises(LatticeFormatError, match="'u7'") as e:
        read_fst_text(text, toy, name="u7").prepare()
    assert needle in str(e.value)


def test_unreachable_and_dead_end_states_are_trimmed_with_a_warning(toy):
    text = "0 1 1 1 1,0\n1 2 2 2 1,0\n1 4 3 3 1,0\n5 2 1 1 1,0\n2 0,0\n"  # 3, 5 unreachable; 4 dead end
    with pytest.warns(LatticeWarning, match=r"'u9': dropped 3 of 6 states \(2 unreachable .*, 1 reaching no final"):
        p = read_fst_text(text, toy, name="u9").prepare()
    assert (p.num_states, p.num_arcs) == (3, 2) and p.best_path() == (["a", "b"], 2.0)


def test_label_missing_from_symbol_table_names_state_and_label(toy, tmp_path):
    with pytest.raises(LatticeFormatError, match=r"req:2: state 1: label 99 is not in the symbol table"):
        read_fst_text("0 1 1 1 1,0\n1 2 99 99 1,0\n2\n", toy, name="req")
    write_fst(tmp_path / "big.lat.fst", read_fst_text("0 1 1 1 0,0\n1 2 3 3 1,0\n2\n", toy))
    with pytest.raises(LatticeFormatError, match=r"big.lat.fst: state 1: label 3 is not in the symbol table"):
        read_fst(tmp_path / "big.lat.fst", SymbolTable.from_words(["a"]))


@pytest.mark.parametrize("cut", [30, 3000])
def test_truncated_fst_is_a_clear_error(words, tmp_path, cut):
    p = tmp_path / "cut.lat.fst"
    p.write_bytes((LAT / "slt-dev0004.lat.fst").read_bytes()[:cut])
    with pytest.raises(LatticeFormatError, match=r"cut.lat.fst: file ends inside .*\(truncated"):
        read_fst(p, words)


def test_text_file_is_not_an_fst(words, tmp_path):
    (tmp_path / "t.fst").write_text("0 1 1 1\n")
    with pytest.raises(LatticeFormatError, match="t.fst: not a binary OpenFST file"):
        read_fst(tmp_path / "t.fst", words)


def test_truncated_and_corrupt_slf_gz_name_the_file(tmp_path):
    data = (LAT / "slt-dev0004.lm.slf.gz").read_bytes()
    (tmp_path / "cut.lm.slf.gz").write_bytes(data[: len(data) // 2])
    with pytest.raises(LatticeFormatError, match=r"cut.lm.slf.gz:\d+: gzip data ends early \(truncated file\)"):
        read_slf(tmp_path / "cut.lm.slf.gz")
    bad = bytearray(data)
    bad[len(bad) // 2: len(bad) // 2 + 64] = bytes(64)
    (tmp_path / "bad.lm.slf.gz").write_bytes(bytes(bad))
    with pytest.raises(LatticeFormatError, match=r"bad.lm.slf.gz:\d+: corrupt gzip data"):
        read_slf(tmp_path / "bad.lm.slf.gz")


# ------------------------------------------------------------------------------------------------ hand-made SLF

SLF_HEAD = ["VERSION=1.0", "lmscale=2.0 wdpenalty=-1.0", "start=0", "end=4", "N=5 L=5"]
SLF_ON_LINKS = SLF_HEAD + [
    "I=0 t=0.00", "I=1 t=0.10", "I=2 t=0.20", "I=3 t=0.25", "I=4 t=0.30",
    "J=0 S=0 E=1 W=a a=-10.0 l=-1.0",
    "J=1 S=0 E=2 W=b a=-8.0 l=-2.0",
    "J=2 S=2 E=3 W=!NULL a=-1.0 l=0.0",
    "J=3 S=1 E=4 W=!NULL a=0 l=-0.5",
    "J=4 S=3 E=4 W=!NULL a=0 l=-0.25",
]
SLF_ON_NODES = SLF_HEAD + [
    "I=0 t=0.00 W=!NULL", "I=1 t=0.10 W=a", "I=2 t=0.20 W=b", "I=3 t=0.25 W=!NULL", "I=4 t=0.30 W=!NULL",
    "J=0 S=0 E=1 a=-10.0 l=-1.0",
    "J=1 S=0 E=2 a=-8.0 l=-2.0",
    "J=2 S=2 E=3 a=-1.0 l=0.0",
    "J=3 S=1 E=4 a=0 l=-0.5",
    "J=4 S=3 E=4 a=0 l=-0.25",
]


def test_slf_costs_follow_the_decoders_fst_convention(tmp_path):
    p = tmp_path / "u.slf"
    p.write_text("\n".join(SLF_ON_LINKS) + "\n")
    lat = read_slf(p)
    pen = 1.0 / 2.0  # -wdpenalty / lmscale: on words and on the sentence-end links into the end node
    assert lat.name == "u" and [lat.symbols.word(w) for w in lat.word] == ["a", "b", "<eps>", "<eps>", "<eps>"]
    assert lat.graph.tolist() == [1.0 + pen, 2.0 + pen, 0.0, 0.5 + pen, 0.25 + pen]
    assert lat.acoustic.tolist() == [10.0, 8.0, 1.0, 0.0, 0.0]
    assert lat.is_final().tolist() == [False] * 4 + [True]
    assert lat.best_path(am_scale=0.1) == (["a"], pytest.approx(1.5 + 1.0 + 1.0))


def test_words_on_nodes_and_on_links_give_the_same_lattice(tmp_path):
    (tmp_path / "links.slf").write_text("\n".join(SLF_ON_LINKS) + "\n")
    with gzip.open(tmp_path / "nodes.slf", "wt") as f:  # gzip found by its magic bytes, not the name
        f.write("\n".join(SLF_ON_NODES) + "\n")
    a, b = read_slf(tmp_path / "links.slf"), read_slf(tmp_path / "nodes.slf")
    assert_same(a, b)
    assert [a.symbols.word(w) for w in a.word] == [b.symbols.word(w) for w in b.word]


def test_slf_word_missing_from_given_symbols_is_an_error(tmp_path):
    (tmp_path / "u.slf").write_text("\n".join(SLF_ON_LINKS) + "\n")
    with pytest.raises(LatticeFormatError, match=r"u.slf:12: word 'b' is not in the symbol table"):
        read_slf(tmp_path / "u.slf", SymbolTable.from_words(["a"]))


def _replace(lines: list[str], i: int, new: str | None) -> list[str]:
    out = list(lines)
    if new is None:
        del out[i]
    else:
        out[i] = new
    return out


@pytest.mark.parametrize("lines,needle", [
    (_replace(SLF_ON_LINKS, 4, "X=1"), ":6: node/link lines before the N= and L= counts"),
    (_replace(SLF_ON_LINKS, 11, "J=1 S=0 E=7 W=b a=-8.0 l=-2.0"), ":12: link refers to undefined node 7"),
    (_replace(SLF_ON_LINKS, 11, "J=1 S=0 E=2 W=b a=loud l=-2.0"), ":12: a= must be a number, got 'loud'"),
    (_replace(SLF_ON_LINKS, 11, "J=1 S=0 E=2 W=b a=-8.0 l=nan"), ":12: l= must be finite"),
    (_replace(SLF_ON_LINKS, 11, "J=0 S=0 E=2 W=b a=-8.0 l=-2.0"), ":12: link J=0 appears twice"),
    (_replace(SLF_ON_LINKS, 11, "J=1 S=0 E=2 W=b a -8.0"), ":12: expected 'key=value' fields"),
    (_replace(SLF_ON_LINKS, 11, "J=1 E=2 W=b"), ":12: missing S= field"),
    (SLF_ON_LINKS[:-1], ":14: file ends after 4 of L=5 links (truncated?)"),
    (_replace(SLF_ON_LINKS, 1, "lmscale=2.0 wdpenalty=high"), ":2: wdpenalty= must be a number"),
])
def test_malformed_slf_names_file_and_line(tmp_path, lines, needle):
    p = tmp_path / "bad.slf"
    p.write_text("\n".join(lines) + "\n")
    with pytest.raises(LatticeFormatError, match="bad.slf") as e:
        read_slf(p)
    assert needle in str(e.value)


# ------------------------------------------------------------------------------------------------ symbol table

def test_symbol_table_ids_and_word_test(words, toy):
    assert words.id("<eps>") == 0 and words.word(words.id("double")) == "double" and "double" in words
    assert len(toy) == 7 and toy.id("a") == 1
    assert [toy.is_word(i) for i in range(7)] == [False, True, True, True, False, False, False]
    assert SymbolTable.from_words(["<unk>", "#0", "[NOISE]"]).word_flags(np.arange(4)).tolist() == \
        [False, True, False, False]


@pytest.mark.parametrize("body,needle", [
    ("<eps> 0\na 1 extra\n", ":2: expected 'word id'"),
    ("<eps> 0\na one\n", ":2: id of 'a' must be an integer"),
    ("<eps> 0\na 1\na 2\n", ":3: word 'a' already defined on line 2"),
    ("<eps> 0\na 1\nb 1\n", ":3: id 1 already used on line 2"),
])
def test_symbol_table_errors_name_file_and_line(tmp_path, body, needle):
    (tmp_path / "words.txt").write_text(body)
    with pytest.raises(LatticeFormatError, match="words.txt") as e:
        SymbolTable.read(tmp_path / "words.txt")
    assert needle in str(e.value)



# ------------------------------------------------------------------------------------ damaged binary lattices

def _state_offsets(data: bytes) -> list[int]:
    """Where each state record (final weight, arc count, arcs) of a lattice4 vector FST starts."""
    import struct

    pos = 4
    for _ in range(2):
        pos += 4 + struct.unpack_from("<i", data, pos)[0]
    num_states = struct.unpack_from("<q", data, pos + 24)[0]
    pos += 40
    out = []
    for _ in range(num_states):
        out.append(pos)
        pos += 16 + 20 * struct.unpack_from("<q", data, pos + 8)[0]
    return out


def _damaged(tmp_path, at: int, patch: bytes, name: str = "bad.lat.fst"):
    data = bytearray((LAT / "slt-dev0004.lat.fst").read_bytes())
    data[at: at + len(patch)] = patch
    (tmp_path / name).write_bytes(bytes(data))
    return tmp_path / name


def _read_error(path, words) -> str:
    with pytest.raises(LatticeFormatError) as e:
        read_fst(path, words)
    msg = str(e.value)
    assert msg.startswith(str(path))
    return msg


def test_garbled_arc_count_is_corrupt_not_truncated(words, tmp_path):
    import struct

    data = (LAT / "slt-dev0004.lat.fst").read_bytes()
    state = _state_offsets(data)[10]
    for narcs in (1_000_000, -3):
        msg = _read_error(_damaged(tmp_path, state + 8, struct.pack("<q", narcs)), words)
        assert "state 10" in msg and "corrupt" in msg and "truncated" not in msg, msg


@pytest.mark.parametrize("frac", [0.3, 0.5, 0.8])
def test_garbled_bytes_in_the_middle_are_corrupt_not_truncated(words, tmp_path, frac):
    size = (LAT / "slt-dev0004.lat.fst").stat().st_size
    msg = _read_error(_damaged(tmp_path, int(size * frac), b"\xab" * 64), words)
    assert "corrupt" in msg and "truncated" not in msg, msg


@pytest.mark.parametrize("at,patch,needle", [
    (8 + 6 + 4, b"lattXce4", "arc type 'lattXce4'"),  # after the magic, "vector" and the arc type's length
    (8 + 6 + 4 + 8 + 16, b"\x88\x13" + b"\x00" * 6, "start state 5000"),  # kaldifst crashed on this
    (8 + 6 + 4 + 8 + 24, b"\xff" * 7 + b"\x00", "states"),  # num_states: 2**56 - 1
])
def test_garbled_header_says_what_is_wrong(words, tmp_path, at, patch, needle):
    msg = _read_error(_damaged(tmp_path, at, patch), words)
    assert needle in msg and "truncated" not in msg, msg


def test_truncated_inside_the_arcs_still_says_truncated(words, tmp_path):
    data = (LAT / "slt-dev0004.lat.fst").read_bytes()
    (tmp_path / "cut.lat.fst").write_bytes(data[: _state_offsets(data)[50] + 16 + 7])
    msg = _read_error(tmp_path / "cut.lat.fst", words)
    assert "state 50" in msg and "(truncated" in msg, msg
