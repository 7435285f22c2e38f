"""Subword LMs: a SentencePiece tokenizer trained with the LM, kept in its checkpoint, and words scored as the sum
of their pieces wherever the LM scores words (n-best lists, perplexity per word)."""

import json

import numpy as np
import pytest
import torch
from conftest import DATA, run_cli

from smallstate_lm.checkpoint import MODEL_FILE, export_model, load_model, save_checkpoint
from smallstate_lm.errors import CheckpointError, ConfigError
from smallstate_lm.files import read_sentences
from smallstate_lm.models import build_model, get_preset
from smallstate_lm.scoring.scorer import NeuralScorer
from smallstate_lm.subword import TOKENIZER_FILE, SubwordVocabulary, TokenizerSpec, train_tokenizer
from smallstate_lm.train import load_vocabulary
from smallstate_lm.vocab import EOS_ID, UNK_ID, Vocabulary

SENTENCES = [["in", "the", "beginning", "god", "created", "the", "heaven"],
             ["and", "the", "earth", "was", "without", "form"],
             ["and", "god", "said", "let", "there", "be", "light"]]


@pytest.fixture(scope="module")
def bpe_vocab() -> SubwordVocabulary:
    return train_tokenizer(read_sentences(DATA / "train.txt")[:2000], TokenizerSpec.parse("bpe:200"))


@pytest.fixture(scope="module")
def bpe_lm(bpe_vocab, tmp_path_factory):
    torch.manual_seed(0)
    model = build_model(get_preset("tiny").replace(vocab_size=len(bpe_vocab), dropout=0.0, n_layers=1))
    d = tmp_path_factory.mktemp("bpelm")
    save_checkpoint(d / MODEL_FILE, model, bpe_vocab)
    return d


def test_specs_parse_and_bad_ones_are_named():
    assert TokenizerSpec.parse("word").kind == "word"
    assert (TokenizerSpec.parse("bpe:500").kind, TokenizerSpec.parse("bpe:500").size) == ("bpe", 500)
    spec = TokenizerSpec.parse("unigram:64")
    assert (spec.kind, spec.size, str(spec)) == ("unigram", 64, "unigram:64")
    for bad in ("bpe", "bpe:", "bpe:0", "bpe:x", "char:10", "bpe:5"):
        with pytest.raises(ConfigError, match="--tokenizer"):
            TokenizerSpec.parse(bad)


def test_a_sentence_is_its_words_pieces_end_to_end(bpe_vocab):
    # what tries over pieces rely on: a prefix of words gives a prefix of pieces
    sp = bpe_vocab._sp
    for words in SENTENCES:
        assert bpe_vocab.encode(words) == sp.encode(" ".join(words))
        assert sum(bpe_vocab.token_counts(words)) == len(bpe_vocab.encode(words))
    assert bpe_vocab.words[:3] == ["<s>", "</s>", "<unk>"] and len(bpe_vocab) == 200
    assert "beginning" in bpe_vocab and "日本" not in bpe_vocab  # a character never seen is <unk>
    assert UNK_ID in bpe_vocab.encode(["日本"])


def test_a_words_log_prob_is_the_sum_of_its_pieces(bpe_lm):
    lm = load_model(bpe_lm)
    vocab = lm.vocab
    assert vocab.subword
    scorer = NeuralScorer(lm.model, vocab, "cpu", batch_tokens=512, share_prefixes=True)
    padded = NeuralScorer(lm.model, vocab, "cpu", batch_tokens=512, share_prefixes=False)
    shared = scorer.token_logprobs([SENTENCES])[0]
    rows = padded.token_logprobs([SENTENCES])[0]
    for words, per_word, row in zip(SENTENCES, shared, rows):
        pieces = vocab.encode(words) + [EOS_ID]
        with torch.no_grad():
            full, _ = lm.model.score(torch.tensor([pieces]), lm.model.initial_state(1, "cpu"))
        full = full[0].double().numpy()
        assert len(per_word) == len(words) + 1  # one per word, and </s>
        counts = vocab.token_counts(words) + [1]
        ends = np.cumsum(counts)
        expect = [full[e - c:e].sum() for c, e in zip(counts, ends)]
        np.testing.assert_allclose(per_word, expect, rtol=0, atol=1e-4)
        np.testing.assert_allclose(row, per_word, rtol=0, atol=1e-4)  # prefix sharing or padded rows alike


def test_checkpoints_and_exports_keep_the_tokenizer(bpe_lm, bpe_vocab, tmp_path):
    lm = load_model(bpe_lm)
    assert lm.vocab.words == bpe_vocab.words and lm.vocab.model == bpe_vocab.model
    out = tmp_path / "release"
    export_model(bpe_lm, out)
    assert (out / TOKENIZER_FILE).read_bytes() == bpe_vocab.model
    again = load_vocabulary(out)
    assert again.subword and again.encode(SENTENCES[0]) == bpe_vocab.encode(SENTENCES[0])
    assert load_model(out).vocab.encode(SENTENCES[1]) == bpe_vocab.encode(SENTENCES[1])


def test_a_checkpoint_without_a_tokenizer_loads_as_words(tiny_lm_dir):
    lm = load_model(tiny_lm_dir)
    assert type(lm.vocab) is Vocabulary and not lm.vocab.subword
    assert lm.vocab.token_counts(["in", "the"]) == [1, 1]


def test_a_broken_tokenizer_in_a_checkpoint_is_a_clear_error(bpe_lm, tmp_path):
    obj = torch.load(bpe_lm / MODEL_FILE, weights_only=False)
    obj["vocab"]["tokenizer"]["model"] = "bm90IGEgbW9kZWw="  # base64 of "not a model"
    torch.save(obj, tmp_path / MODEL_FILE)
    with pytest.raises(CheckpointError, match="not a SentencePiece model"):
        load_model(tmp_path)


def test_a_lattice_rescored_with_exact_histories_equals_its_paths_scored_one_by_one(bpe_lm, kenlm_model):
    """Each arc feeds its word's pieces to the LM in one step: every path's neural score is its pieces' sum."""
    from test_expand import SAUSAGE_COSTS, SYMS, direct_total, sausage_text

    from smallstate_lm.ngram import NgramLM
    from smallstate_lm.rescoring.expand.rescorer import ExpandConfig, LatticeRescorer
    from smallstate_lm.rescoring.formats.lattice_io import read_fst_text
    from smallstate_lm.rescoring.lattices.lattice import SymbolTable
    from smallstate_lm.weights import Weights

    lm, ngram = load_model(bpe_lm), NgramLM(kenlm_model)
    assert max(lm.vocab.token_counts(SYMS[:-1])) > 1  # some word here is more than one piece
    sym = SymbolTable.from_words(SYMS)
    lat = read_fst_text(sausage_text(sym), sym, name="sausage")
    w = Weights(am_scale=0.1, graph_scale=0.5, lm_weight=0.7, ngram_weight=0.4, word_penalty=-0.1)
    exact = ExpandConfig(max_ngram_order=None, beam=1e9)  # every history kept, no path pruned
    exp = LatticeRescorer(w, lm.model, lm.vocab, ngram, exact).expand(lat)
    scorer = NeuralScorer(lm.model, lm.vocab)
    best = exp.nbest(w, 4)
    assert len(best) == 4
    for h in best:
        assert h.total == pytest.approx(direct_total(h.words, w, SAUSAGE_COSTS, ngram, scorer), abs=1e-4)


def test_train_eval_and_rescore_with_a_bpe_lm(small_corpus, kenlm_model, tmp_path):
    train, valid = small_corpus
    out = tmp_path / "run"
    r = run_cli("train", "--train", train, "--valid", valid, "-o", out, "--preset", "tiny", "--set", "n_layers=1",
                "--tokenizer", "bpe:300", "--max-steps", "5", "--quiet")
    assert r.returncode == 0, r.stderr
    assert (out / TOKENIZER_FILE).is_file()
    r = run_cli("eval", "--model", out, "--text", valid, "--ngram", kenlm_model, "--json")
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    assert rep["tokenizer"] == "bpe:300" and rep["tokens"] > rep["words"] + rep["sentences"]
    # one total log-prob, two ways of counting: per word and per piece
    n_words = rep["words"] + rep["sentences"]
    assert rep["perplexity"] == pytest.approx(np.exp(-rep["logprob_sum_ln"] / n_words))
    assert rep["perplexity_per_token"] == pytest.approx(np.exp(-rep["logprob_sum_ln"] / rep["tokens"]))
    assert rep["interpolation"]["perplexity"] <= rep["interpolation"]["ngram_perplexity"] + 1e-9
    nbest = tmp_path / "nbest.jsonl"
    nbest.write_text("".join(json.dumps({"utt": f"u{i}", "hyps": [{"words": s, "am": -10.0},
                                                                   {"words": s[:-1] + ["earth"], "am": -10.5}]}) + "\n"
                             for i, s in enumerate(SENTENCES)))
    r = run_cli("rescore", nbest, "--lm", out, "--ngram", kenlm_model, "-o", tmp_path / "out")
    assert r.returncode == 0, r.stderr
    r = run_cli("rescore", nbest, "--lm", out, "--ngram", kenlm_model, "-o", tmp_path / "out2", "--jobs", "2")
    assert r.returncode == 0, r.stderr
    one = [json.loads(line) for line in (tmp_path / "out" / "nbest.jsonl").read_text().splitlines()]
    two = [json.loads(line) for line in (tmp_path / "out2" / "nbest.jsonl").read_text().splitlines()]
    for a, b in zip(one, two, strict=True):  # two worker processes, the same answers
        assert [h["words"] for h in a["hyps"]] == [h["words"] for h in b["hyps"]]
        assert [h["neural"] for h in a["hyps"]] == pytest.approx([h["neural"] for h in b["hyps"]], abs=1e-5)
    ranked = one[0]["hyps"]
    lm = load_model(out)
    for h in ranked:  # each hypothesis's neural score: its pieces' log-probs, summed, from one pass of the model
        pieces = lm.vocab.encode(h["words"]) + [EOS_ID]
        with torch.no_grad():
            full, _ = lm.model.score(torch.tensor([pieces]), lm.model.initial_state(1, "cpu"))
        assert h["neural"] == pytest.approx(float(full.sum()), abs=1e-3)


def test_bad_tokenizer_options_are_one_error_line(small_corpus, tmp_path):
    train, valid = small_corpus
    for extra, message in ((["--tokenizer", "bpe:x"], "expected word, bpe:N or unigram:N"),
                           (["--tokenizer", "bpe:300", "--max-vocab", "100"], "leave out")):
        r = run_cli("train", "--train", train, "--valid", valid, "-o", tmp_path / "x", "--preset", "tiny",
                    "--max-steps", "1", "--quiet", *extra)
        assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_the_service_scores_lists_and_lattices_with_a_subword_lm(bpe_lm, kenlm_model, tmp_path):
    import httpx
    from test_server import Server, post

    lm = load_model(bpe_lm)

    def pieces_sum(words):
        with torch.no_grad():
            tokens = torch.tensor([lm.vocab.encode(words) + [EOS_ID]])
            full, _ = lm.model.score(tokens, lm.model.initial_state(1, "cpu"))
        return float(full.sum())

    srv = Server(bpe_lm, kenlm_model, log=tmp_path / "server.log")
    try:
        hyps = [{"words": SENTENCES[0], "am_score": -10.0}, {"words": SENTENCES[1], "am_score": -11.0}]
        r = post(srv, "/rescore", {"utterances": [{"id": "u", "hypotheses": hyps}], "return_token_logprobs": True})
        assert r.status_code == 200, r.text
        for h in r.json()["utterances"][0]["hypotheses"]:
            assert len(h["token_logprobs"]["neural"]) == len(h["words"]) + 1  # per word, and </s>
            assert h["neural"] == pytest.approx(pieces_sum(h["words"]), abs=1e-3)
        # a lattice: each arc's word fed as its pieces
        text = "".join(f"0\t1\t{w}\t{w}\t1,10\n" for w in ("the", "a")) + "1\t2\tlord\tlord\t1,10\n2\t0,0\n"
        r = post(srv, "/rescore", {"utterances": [{"id": "l", "lattice": {"format": "openfst-text", "data": text}}],
                                   "nbest": 2})
        assert r.status_code == 200, r.text
        for h in r.json()["utterances"][0]["hypotheses"]:
            assert h["neural"] == pytest.approx(pieces_sum(h["words"]), abs=1e-3)
        # a word no piece can write: 422 naming it
        r = post(srv, "/rescore", {"utterances": [{"id": "u", "hypotheses": [{"words": ["the", "日本"],
                                                                            "am_score": -1.0}]}]})
        assert r.status_code == 422 and "日本" in r.json()["detail"], r.text
        models = httpx.get(srv.url + "/v1/models", timeout=10).json()
        assert models["neural"]["tokenizer"] == lm.vocab.spec and models["neural"]["vocab_size"] == len(lm.vocab)
    finally:
        assert srv.stop() == 0, srv.log.read_text()
