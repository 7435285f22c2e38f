"""N-best lists in ASR toolkits' own layouts (ESPnet, NeMo, Kaldi nbest-to-linear, JSON): readers,
format detection, duplicate merging, the decoder adapters of examples/, and `rescore`/`tune` on each."""

import importlib.util
import json
import math
import shutil

import numpy as np
import pytest
from conftest import REPO, TEST_DATA, run_cli

from smallstate_lm.errors import ConfigError
from smallstate_lm.ngram import NgramLM
from smallstate_lm.rescoring.nbest.formats import (
    FORMATS,
    NBEST_FORMATS,
    ImportOptions,
    detect_format,
    manifest_ids,
    merge_duplicates,
    parse_number,
    read_nbest_inputs,
)
from smallstate_lm.rescoring.nbest.lists import Hypothesis, NBestFormatError, Utterance, read_nbest_jsonl

DATA = TEST_DATA / "nbest_import"
ESPNET = DATA / "espnet" / "decode_asr_lm"
NEMO = DATA / "nemo" / "preds_out_width3_alpha0.5_beta1.0.tsv"
MANIFEST = DATA / "nemo" / "test_manifest.json"
KALDI = DATA / "kaldi" / "decode"
WORDS = DATA / "kaldi" / "lang" / "words.txt"
JSONL = DATA / "json" / "alternatives.jsonl"
JSON_LIST = DATA / "json" / "alternatives.json"
UTTS = ["dev0000", "dev0001", "dev0002"]


def read(path, **opts):
    return read_nbest_inputs([path], ImportOptions(**opts))


def lse(*xs):
    m = max(xs)
    return m + math.log(sum(math.exp(x - m) for x in xs))


def fails(path, *needles, **opts):
    with pytest.raises(NBestFormatError) as e:
        read(path, **opts)
    for n in needles:
        assert n in str(e.value), str(e.value)
    return str(e.value)


# --- ESPnet ---------------------------------------------------------------------------------------

def test_espnet_output_dir():
    utts, report = read(ESPNET)
    assert report.inputs == [(str(ESPNET), "espnet")] and [u.utt for u in utts] == UTTS
    h = utts[0].hyps
    assert [x.id for x in h] == ["1", "2", "3"] and [x.am for x in h] == [-14.2031, -14.9870, -15.5129]
    assert all(x.graph == 0.0 for u in utts for x in u.hyps)
    assert h[1].words == "he is a double minded man unstable and all his ways".split()
    # dev0001's 3best repeats its 1best: merged by log-sum-exp; dev0002 has two hypotheses only
    assert len(utts[1].hyps) == 2 and utts[1].hyps[0].am == pytest.approx(lse(-20.6651, -21.7311))
    assert len(utts[2].hyps) == 2 and report.merged == 1 and report.merged_utterances == 1
    assert any("merged 1 duplicate hypothesis" in m for m in report.messages())


def test_espnet_asr_sh_layout_and_a_best_recog_dir(tmp_path):
    """asr.sh decodes in jobs: <decode dir>/logdir/output.J/{n}best_recog, each with some utterances."""
    decode = tmp_path / "decode_test"
    for job, utts in ((1, UTTS[:2]), (2, UTTS[2:])):
        for src in ESPNET.iterdir():
            dst = decode / "logdir" / f"output.{job}" / src.name
            dst.mkdir(parents=True)
            for name in ("text", "score", "token"):
                lines = [x for x in (src / name).read_text().splitlines() if x.split()[0] in utts]
                (dst / name).write_text("".join(x + "\n" for x in lines))
    (decode / "text").write_text("dev0000 merged one-best files are ignored\n")
    got, _ = read(decode)
    assert [u.utt for u in got] == UTTS
    assert [[h.am for h in u.hyps] for u in got] == [[h.am for h in u.hyps] for u in read(ESPNET)[0]]
    one, _ = read(ESPNET / "1best_recog")  # the parent is read
    assert len(one) == 3 and len(one[0].hyps) == 3


@pytest.mark.parametrize("text,value", [("tensor(-12.34)", -12.34), ("tensor(-12.34, device='cuda:0')", -12.34),
                                        ("tensor([-1.5])", -1.5), ("-7", -7.0), ("np.float32(-0.25)", -0.25),
                                        (" 3.5e-1 ", 0.35)])
def test_score_numbers_as_toolkits_print_them(text, value):
    assert parse_number(text, "f:1") == value


@pytest.mark.parametrize("text", ["tensor(nan)", "tensor(abc)", "", "inf"])
def test_bad_score_numbers(text):
    with pytest.raises(NBestFormatError, match="f:1"):
        parse_number(text, "f:1")


@pytest.mark.parametrize("edit,needles", [
    (("2best_recog/score", "dev0001 tensor(-21.0042)\n", "dev0001 tensor(oops)\n"), ["2best_recog/score:2",
                                                                                      "expected a number"]),
    (("1best_recog/score", "dev0002 tensor(-18.0007)\n", ""), ["1best_recog/text:3", "dev0002", "no line in"]),
    (("1best_recog/text", "dev0001 ", "dev0000 "), ["1best_recog/text:2", "already on line 1"]),
])
def test_espnet_malformed(tmp_path, edit, needles):
    d = tmp_path / "out"
    shutil.copytree(ESPNET, d)
    name, old, new = edit
    body = (d / name).read_text()
    assert old in body
    (d / name).write_text(body.replace(old, new, 1))
    fails(d, *needles)


def test_espnet_missing_score_file(tmp_path):
    d = tmp_path / "out"
    shutil.copytree(ESPNET, d)
    (d / "2best_recog" / "score").unlink()
    fails(d, "2best_recog/score", "not found")


# --- NeMo -----------------------------------------------------------------------------------------

def test_nemo_candidates_with_manifest():
    utts, report = read(NEMO, manifest=MANIFEST)
    assert report.inputs[0][1] == "nemo" and [u.utt for u in utts] == UTTS
    assert [h.am for h in utts[0].hyps] == [-31.52, -32.07, -33.96] and utts[0].hyps[0].graph == 0.0
    assert utts[1].hyps[2].words[-3:] == ["scribes", "questioning", "them"]
    assert len(utts[2].hyps) == 2 and utts[2].hyps[1].am == pytest.approx(lse(-41.5, -41.5))
    assert any("beam 3, alpha 0.5, beta 1.0" in m for m in report.messages())


def test_nemo_beam_size_inferred_or_given(tmp_path):
    plain = tmp_path / "beams.tsv"
    shutil.copy(NEMO, plain)
    assert [len(u.hyps) for u in read(plain, manifest=MANIFEST)[0]] == [3, 3, 2]  # 9 lines / 3 rows
    fails(plain, "9 candidate lines", "3 manifest rows x beam 2", "--beam-size", manifest=MANIFEST, beam_size=2)
    plain.write_text("".join(plain.read_text().splitlines(keepends=True)[:8]))
    fails(plain, "8 candidate lines do not divide evenly among the 3 rows", "--beam-size", manifest=MANIFEST)
    shorter = tmp_path / "preds_out_width4_alpha0.5_beta1.0.tsv"
    shutil.copy(NEMO, shorter)
    fails(shorter, "beam 4 (the beam width in the file name)", "fewer candidates", manifest=MANIFEST)


def test_nemo_needs_manifest_and_names_bad_lines(tmp_path):
    fails(NEMO, "--manifest")
    bad = tmp_path / "preds.tsv"
    bad.write_text("a b\t-1.0\nno tab here\n")
    fails(bad, "preds.tsv:2", "text<TAB>score", manifest=MANIFEST, format="nemo")
    bad.write_text("a b\t-1.0\na c\tloud\n")
    fails(bad, "preds.tsv:2", "expected a number", manifest=MANIFEST, format="nemo")


def test_manifest_ids(tmp_path):
    m = tmp_path / "m.json"
    m.write_text('{"audio_filepath": "a/x1.wav"}\n\n{"audio_filepath": "b/x2.flac", "utt_id": "spk1-x2"}\n')
    assert manifest_ids(m) == ["x1", "spk1-x2"]
    m.write_text('{"audio_filepath": "a/x1.wav"}\n{"audio_filepath": "b/x1.wav"}\n')
    with pytest.raises(NBestFormatError, match=r"m.json:2: utterance id 'x1' already on line 1"):
        manifest_ids(m)
    m.write_text('{"audio_filepath": "a/x1.wav"}\n{"text": "no audio"}\n')
    with pytest.raises(NBestFormatError, match=r"m.json:2: expected an object with 'audio_filepath'"):
        manifest_ids(m)


# --- Kaldi ----------------------------------------------------------------------------------------

def test_kaldi_archives_dir():
    utts, report = read(KALDI, words=WORDS)
    assert report.inputs[0][1] == "kaldi" and [u.utt for u in utts] == UTTS  # archives.1 and archives.2
    h = utts[0].hyps[0]
    assert h.id == "1" and h.am == -612.0142 and h.graph == -72.0956
    assert h.words == "he is a double minded man and stable and all his ways".split()
    assert [len(u.hyps) for u in utts] == [3, 3, 3] and report.merged == 0


def test_kaldi_ids_need_words_txt_and_symbols_do_not(tmp_path):
    fails(KALDI, "archives.1/words", "--words words.txt")
    d = tmp_path / "archives.1"
    shutil.copytree(KALDI / "archives.1", d)
    table = dict(reversed(x.split()) for x in WORDS.read_text().splitlines())
    (d / "words_text").write_text("".join(" ".join([x.split()[0]] + [table[i] for i in x.split()[1:]]) + "\n"
                                          for x in (d / "words").read_text().splitlines()))
    utts, _ = read(d)  # words_text: no symbol table needed
    assert utts[0].hyps[0].words[:3] == ["he", "is", "a"]


def test_kaldi_explicit_archives(tmp_path):
    """A word archive as input, the cost archives by option (here the graph cost without the old LM)."""
    a = KALDI / "archives.1"
    utts, report = read(a / "words", words=WORDS, lm_costs=a / "lmwt.nolm", ac_costs=a / "acwt")
    assert report.inputs[0][1] == "kaldi" and utts[0].hyps[0].graph == -4.1021 and len(utts) == 2
    fails(KALDI, "2 archives.N directories", words=WORDS, lm_costs=a / "lmwt.nolm")


@pytest.mark.parametrize("names,old,new,needles", [
    (["acwt"], "dev0000-2 629.8309\n", "", ["archives.1/words:2", "'dev0000-2' has no entry in", "acwt"]),
    (["lmwt.withlm"], "dev0001-3 117.8862", "dev0001-4 117.8862", ["lmwt.withlm:6", "'dev0001-4'"]),
    (["acwt"], "dev0000-3 606.8945", "dev0000-3 -inf", ["acwt:3", "finite"]),
    (["words"], "dev0000-1 14 ", "dev0000-1 14 999 ", ["words:1", "word id 999 is not in"]),
    (["words", "acwt", "lmwt.withlm"], "dev0000-1", "dev0000_1", ["words:1", "'dev0000_1' is not 'utterance-N'"]),
])
def test_kaldi_malformed(tmp_path, names, old, new, needles):
    d = tmp_path / "archives.1"
    shutil.copytree(KALDI / "archives.1", d)
    for name in names:
        body = (d / name).read_text()
        assert old in body
        (d / name).write_text(body.replace(old, new))
    fails(d, *needles, words=WORDS)


def test_kaldi_binary_archive(tmp_path):
    d = tmp_path / "archives.1"
    shutil.copytree(KALDI / "archives.1", d)
    (d / "acwt").write_bytes(b"dev0000-1 \0B\4\x00\x00\x80?")
    fails(d, "acwt", "binary Kaldi archive", "ark,t:", words=WORDS)


# --- JSON -----------------------------------------------------------------------------------------

def test_json_lines_and_json_list_agree():
    a, ra = read(JSONL)
    b, rb = read(JSON_LIST)
    assert (ra.inputs[0][1], rb.inputs[0][1]) == ("jsonl", "json")
    assert [[(h.words, h.am, h.graph) for h in u.hyps] for u in a] == [[(h.words, h.am, h.graph) for h in u.hyps]
                                                                      for u in b]
    assert a[0].hyps[0].am == -612.0142 and a[0].hyps[0].graph == -72.0956
    assert a[1].hyps[0].graph == 0.0 and a[1].hyps[0].am == pytest.approx(lse(-130.2, -132.6))  # "score": combined


@pytest.mark.parametrize("hyp,needle", [
    ({"text": "a b", "score": -1, "am": -2}, "give 'score' (one combined score) or 'am'/'graph', not both"),
    ({"text": ["a"]}, "hyps[0].text: expected a string"),
    ({"text": "a", "words": ["a"]}, "give 'words' or 'text', not both"),
    ({"words": ["a b"]}, "hyps[0].words: expected a list of words without spaces"),
    ({"text": "a", "score": "high"}, "hyps[0].score: expected a finite number"),
])
def test_json_hypothesis_errors(tmp_path, hyp, needle):
    p = tmp_path / "h.jsonl"
    p.write_text(json.dumps({"utt": "u0", "hyps": [{"text": "ok"}]}) + "\n" + json.dumps({"utt": "u1", "hyps": [hyp]}))
    fails(p, "h.jsonl:2", needle)


def test_json_list_errors_name_the_line(tmp_path):
    p = tmp_path / "h.json"
    p.write_text('[\n {"utt": "u0", "hyps": [{"text": "a"}]},\n {"utt": "u1",\n  "hyps": [{"words": 3}]}\n]\n')
    fails(p, "h.json:3: [1]: hyps[0].words")
    p.write_text('[\n {"utt": "u0", "hyps": [{"text": "a"}]}\n {"utt": "u1"}]')
    fails(p, "h.json:3: expected ',' or ']'")
    p.write_text('[{"utt": "u0", "hyps": [{"text": "a"}]},\n {"utt": \n')
    fails(p, "h.json:", "not valid JSON")
    p.write_text("[]")
    fails(p, "no utterances")


# --- detection, merging, several inputs -----------------------------------------------------------

@pytest.mark.parametrize("path,name,opts", [
    (ESPNET, "espnet", {}), (NEMO, "nemo", {}), (KALDI, "kaldi", {}), (KALDI / "archives.1" / "words", "kaldi", {}),
    (JSONL, "jsonl", {}), (JSON_LIST, "json", {}), (TEST_DATA / "nbest.tsv", "tsv", {}),
])
def test_detection(path, name, opts):
    assert detect_format(path, ImportOptions(**opts)).name == name


def test_detection_failures_say_what_was_expected(tmp_path):
    (tmp_path / "empty_dir").mkdir()
    fails(tmp_path / "empty_dir", "neither an ESPnet inference output", "archives.N/")
    odd = tmp_path / "hyps.txt"
    odd.write_text("dev0000 he is a man\n")
    msg = fails(odd, "hyps.txt:1: not an n-best format")
    assert all(f.name in msg for f in NBEST_FORMATS)
    fails(tmp_path / "missing.tsv", "missing.tsv: file not found")
    with pytest.raises(ConfigError, match="must be one of auto, tsv"):
        ImportOptions(format="csv")
    with pytest.raises(ConfigError, match="beam size must be >= 1"):
        ImportOptions(beam_size=0)


def test_the_table_names_every_reader():
    assert set(FORMATS) == {"tsv", "jsonl", "json", "espnet", "nemo", "kaldi"}
    assert all(f.description and f.detection and callable(f.read) for f in NBEST_FORMATS)


def _utt(*hyps):
    return Utterance("u", [Hypothesis(words=w.split(), am=am, graph=g, id=str(i)) for i, (w, am, g) in
                           enumerate(hyps)])


def test_merge_keeps_the_best_fields_in_the_first_place():
    u = _utt(("a b", -5.0, -1.0), ("c", -4.0, -1.0), ("a b", -3.0, -2.5), ("a b", -9.0, 0.0))
    (m,), removed, touched = merge_duplicates([u], "logsumexp")
    assert (removed, touched) == (2, 1) and [h.words for h in m.hyps] == [["a", "b"], ["c"]]
    best = m.hyps[0]
    assert best.id == "2" and best.graph == -2.5  # the best of the three by am + graph (-5.5)
    assert best.am + best.graph == pytest.approx(lse(-6.0, -5.5, -9.0))
    (mx,), _, _ = merge_duplicates([u], "max")
    assert (mx.hyps[0].am, mx.hyps[0].graph, mx.hyps[0].id) == (-3.0, -2.5, "2")
    same, removed, _ = merge_duplicates([_utt(("a", -1.0, 0.0), ("b", -2.0, 0.0))])
    assert removed == 0 and same[0].hyps[1].words == ["b"]


def test_empty_hypotheses_merge_too():
    (m,), removed, _ = merge_duplicates([_utt(("", -1.0, 0.0), ("", -1.0, 0.0))], "logsumexp")
    assert removed == 1 and m.hyps[0].words == [] and m.hyps[0].am == pytest.approx(-1.0 + math.log(2))


def test_an_utterance_comes_from_one_input():
    with pytest.raises(NBestFormatError, match="utterance 'dev0000' appears also in"):
        read_nbest_inputs([JSONL, JSON_LIST])
    with pytest.raises(NBestFormatError, match="dev0000"):
        read_nbest_inputs([ESPNET, NEMO], ImportOptions(manifest=MANIFEST))


# --- the decoder adapters of examples/ ------------------------------------------------------------

def _example(name):
    spec = importlib.util.spec_from_file_location(name, REPO / "examples" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _round_trip(mod, records, tmp_path):
    p = tmp_path / "n.jsonl"
    mod.write_jsonl(records, p)
    return read_nbest_jsonl(p)


def test_vosk_adapter(tmp_path):
    mod = _example("vosk_to_jsonl")
    seg1 = json.dumps({"alternatives": [{"confidence": 210.5, "text": "he is a"}, {"confidence": 208.0,
                                                                                     "text": "he was a"}]})
    final = {"alternatives": [{"confidence": 150.25, "text": "double minded man", "result": []},
                              {"confidence": 149.0, "text": "double mind man"}]}
    (u,) = _round_trip(mod, [mod.vosk_record("dev0000", [seg1, {"alternatives": [{"confidence": 0, "text": ""}]},
                                                          final], n=3)], tmp_path)
    assert [" ".join(h.words) for h in u.hyps] == ["he is a double minded man", "he is a double mind man",
                                                   "he was a double minded man"]
    assert u.hyps[0].am == 360.75 and u.hyps[2].am == 358.25 and u.hyps[0].graph == 0.0
    with pytest.raises(ValueError, match="SetMaxAlternatives"):
        mod.vosk_record("x", [{"text": "no alternatives"}])


def test_pyctcdecode_adapter(tmp_path):
    mod = _example("pyctcdecode_to_jsonl")
    beams = [("he is a man", None, [("he", (0, 3))], -4.5, -11.25), ("he is man", None, [], -4.0, -12.0)]
    (u,) = _round_trip(mod, [mod.pyctcdecode_record("dev0000", beams)], tmp_path)
    assert (u.hyps[0].am, u.hyps[0].graph) == (-4.5, -6.75) and u.hyps[1].words == ["he", "is", "man"]


def test_torchaudio_adapter(tmp_path):
    mod = _example("torchaudio_ctc_to_jsonl")

    class Hyp:  # a CTCHypothesis as torchaudio returns it
        def __init__(self, tokens, words, score):
            self.tokens, self.words, self.score, self.timesteps = tokens, words, score, []

    tokens = ["-", "|", "h", "e", "i", "s"]
    hyps = [Hyp([1, 2, 3, 1, 4, 5, 1], [], -7.5), {"tokens": [], "words": ["he", "is"], "score": -8.0}]
    (u,) = _round_trip(mod, [mod.torchaudio_record("dev0000", hyps, tokens)], tmp_path)
    assert [h.words for h in u.hyps] == [["he", "is"], ["he", "is"]] and u.hyps[0].am == -7.5
    assert u.hyps[0].graph == 0.0


def test_hf_generate_adapter(tmp_path):
    mod = _example("hf_generate_to_jsonl")
    texts = [" He is a man.", " He is, a man!", " Peter began.", " Peter began"]
    recs = mod.hf_generate_records(["u1", "u2"], texts, [-0.5, -0.75, -0.2, -0.3], 2, lengths=[4, 4, 2, 2],
                                   length_penalty=1.0)
    u1, u2 = _round_trip(mod, recs, tmp_path)
    assert u1.hyps[0].words == ["he", "is", "a", "man"] and u1.hyps[0].am == -2.0 and u2.hyps[1].am == -0.6
    with pytest.raises(ValueError, match="3 texts"):
        mod.hf_generate_records(["u1"], texts[:3], [0.0] * 3, 2)


# --- end to end: rescore and tune -----------------------------------------------------------------

def _rescored(out):
    best = dict(x.split(" ", 1) for x in (out / "best.txt").read_text().splitlines())
    return best, [json.loads(x) for x in (out / "nbest.jsonl").read_text().splitlines()]


def _check_scores(out, kenlm_model, am_scale, graph_scale, ngram_weight):
    best, lists = _rescored(out)
    lm = NgramLM(kenlm_model)
    assert sorted(best) == UTTS
    for rec in lists:
        totals = []
        for h in rec["hyps"]:
            assert h["ngram"] == pytest.approx(float(np.sum(lm.token_logprobs(h["words"]))))
            want = am_scale * h["am"] + graph_scale * h["graph"] + ngram_weight * h["ngram"]
            assert h["total"] == pytest.approx(want)
            totals.append(h["total"])
        assert totals == sorted(totals, reverse=True) and best[rec["utt"]] == " ".join(rec["hyps"][0]["words"])
    return {r["utt"]: r["hyps"] for r in lists}


@pytest.mark.parametrize("fmt", ["espnet", "nemo", "kaldi", "jsonl", "json"])
def test_rescore_each_format(tmp_path, kenlm_model, fmt):
    args = {"espnet": [ESPNET], "nemo": [NEMO, "--manifest", MANIFEST], "kaldi": [KALDI, "--words", WORDS],
            "jsonl": [JSONL], "json": [JSON_LIST]}[fmt]
    scales = {"kaldi": (0.1, 1.0)}.get(fmt, (1.0, 0.0))
    out = tmp_path / "out"
    proc = run_cli("rescore", *args, "--ngram", kenlm_model, "--set", f"am_scale={scales[0]}", "--set",
                   f"graph_scale={scales[1]}", "--ngram-weight", "0.7", "--refs", DATA / "ref.txt", "-o", out,
                   "--quiet")
    assert proc.returncode == 0, proc.stderr
    hyps = _check_scores(out, kenlm_model, *scales, 0.7)
    assert "%WER" in (out / "wer.txt").read_text()
    if fmt == "kaldi":
        assert {(h["am"], h["graph"]) for h in hyps["dev0000"]} >= {(-612.0142, -72.0956)}
    if fmt == "espnet":
        assert "note: merged 1 duplicate hypothesis" in proc.stderr
        assert sorted(h["am"] for h in hyps["dev0002"]) == [-18.441, -18.0007]
    if fmt == "nemo":
        assert "alpha 0.5, beta 1.0" in proc.stderr and len(hyps["dev0002"]) == 2


def test_rescore_options_reach_the_readers(tmp_path, kenlm_model):
    plain = tmp_path / "candidates.txt"
    shutil.copy(NEMO, plain)
    out = tmp_path / "out"
    proc = run_cli("rescore", plain, "--nbest-format", "nemo", "--manifest", MANIFEST, "--beam-size", "3",
                   "--merge-duplicates", "max", "--ngram", kenlm_model, "-o", out, "--quiet")
    assert proc.returncode == 0, proc.stderr
    _, lists = _rescored(out)
    assert sorted(h["am"] for h in lists[2]["hyps"]) == [-41.5, -40.45] and "keeping the best score" in proc.stderr
    a = KALDI / "archives.1"
    proc = run_cli("rescore", a / "words", "--words", WORDS, "--lm-costs", a / "lmwt.nolm", "--ac-costs", a / "acwt",
                   "--ngram", kenlm_model, "-o", tmp_path / "k", "--quiet")
    assert proc.returncode == 0, proc.stderr
    _, lists = _rescored(tmp_path / "k")
    assert {h["graph"] for h in lists[0]["hyps"]} == {-4.1021, -3.9874, -4.221}


@pytest.mark.parametrize("args,needles", [
    (["{NEMO}"], ["preds_out_width3_alpha0.5_beta1.0.tsv", "--manifest"]),
    (["{KALDI}"], ["archives.1/words", "--words"]),
    (["{NEMO}", "--manifest", "{MANIFEST}", "--beam-size", "2"], ["9 candidate lines"]),
    (["{ESPNET}", "--nbest-format", "csv"], ["must be one of auto"]),
    (["{ESPNET}", "--merge-duplicates", "sum"], ["logsumexp, max"]),
])
def test_rescore_errors_are_one_line(tmp_path, kenlm_model, args, needles):
    paths = {"{NEMO}": NEMO, "{KALDI}": KALDI, "{MANIFEST}": MANIFEST, "{ESPNET}": ESPNET}
    proc = run_cli("rescore", *[paths.get(a, a) for a in args], "--ngram", kenlm_model, "-o", tmp_path / "out")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    lines = [x for x in proc.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), proc.stderr
    for n in needles:
        assert n in lines[0]
    assert not (tmp_path / "out").exists()


def test_malformed_input_through_the_cli(tmp_path, kenlm_model):
    d = tmp_path / "esp"
    shutil.copytree(ESPNET, d)
    (d / "2best_recog" / "score").write_text("dev0000 tensor(-14.9870)\ndev0001 tensor(oops)\n")
    proc = run_cli("rescore", d, "--ngram", kenlm_model, "-o", tmp_path / "out")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "2best_recog/score:2" in proc.stderr and "expected a number" in proc.stderr


def test_tune_on_toolkit_outputs(tmp_path, kenlm_model):
    for name, args in (("espnet", [ESPNET]), ("kaldi", ["--nbest", KALDI, "--words", WORDS]),
                       ("nemo", [NEMO, "--nbest-format", "nemo", "--manifest", MANIFEST])):
        weights = tmp_path / f"{name}.json"
        proc = run_cli("tune", *args, "--refs", DATA / "ref.txt", "--ngram", kenlm_model, "--set", "am_scale=1",
                       "--search", "ngram_weight,word_penalty", "-o", weights, "--quiet")
        assert proc.returncode == 0, (name, proc.stderr)
        assert "tuned WER" in proc.stdout and json.loads(weights.read_text())["dev_utterances"] == 3


def test_nemo_default_decoder_costs_are_negated(tmp_path):
    """NeMo's `default` CTC beam search writes -approx_ctc (>= 0, lower is better): read as am = -score, so the
    lowest cost is the best hypothesis and a note says so."""
    costs = tmp_path / "preds_out_width3_alpha0.5_beta1.0.tsv"
    costs.write_text("".join(f"{line.rpartition(chr(9))[0]}\t{-float(line.rpartition(chr(9))[2])}\n"
                             for line in NEMO.read_text().splitlines() if line.strip()))
    utts, report = read(costs, manifest=MANIFEST)
    want, _ = read(NEMO, manifest=MANIFEST)
    assert [[h.am for h in u.hyps] for u in utts] == [[h.am for h in u.hyps] for u in want]
    assert any("read as costs" in m for m in report.messages())
