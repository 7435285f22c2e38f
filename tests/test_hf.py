"""`--lm hf:DIR`: Hugging Face causal LMs (a GPT-2 and a Llama made here: tokenizers trained on the bundled text,
random weights) behind the state contract: the same log-probs as transformers' own forward, incremental equals
full, prefix sharing equals padded rows, lattices and n-best lists through the CLI and the service, and bad
directories refused in one line."""

import json
import shutil

import numpy as np
import pytest
import torch
from conftest import DATA, run_cli
from test_state_tradeoff import module

transformers = pytest.importorskip("transformers")

from smallstate_lm.errors import WorkLimitError  # noqa: E402
from smallstate_lm.lms import load_neural as load_model  # noqa: E402
from smallstate_lm.scoring.scorer import NeuralScorer  # noqa: E402
from smallstate_lm.scoring.trie import PrefixTrie  # noqa: E402
from smallstate_lm.state import pad_batch  # noqa: E402
from smallstate_lm.vocab import EOS_ID  # noqa: E402

SENTENCES = [["in", "the", "beginning", "god", "created", "the", "heaven"],
             ["in", "the", "beginning", "was", "the", "word"],
             ["and", "the", "earth", "was", "without", "form"],
             ["jehoshaphat", "wept"], ["a"]]


def make(tmp_path_factory, arch: str, **kw):
    out = tmp_path_factory.mktemp(f"hf-{arch}")
    return module("make_hf_model").make(out, arch, DATA / "train.txt", **{"vocab_size": 400, "d": 32, "lines": 3000,
                                                                          **kw})


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def hf_dir(request, tmp_path_factory):
    return make(tmp_path_factory, request.param)


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory):
    return make(tmp_path_factory, "gpt2")


def reference(lm, words) -> np.ndarray:
    """transformers' own forward over BOS + the sentence's pieces + EOS: each target's log-prob."""
    m, hf = lm.model, lm.model.hf
    ids = [int(m.to_hf[t]) for t in [0] + lm.vocab.encode(words) + [EOS_ID]]
    with torch.no_grad():
        logp = torch.log_softmax(hf(input_ids=torch.tensor([ids])).logits[0].float(), -1)
    return np.array([float(logp[i, ids[i + 1]]) for i in range(len(ids) - 1)])


def test_log_probs_equal_transformers_own_forward_padded_and_shared(hf_dir):
    lm = load_model(f"hf:{hf_dir}")
    assert lm.vocab.subword and lm.model.score_tree is not None
    for share in (False, True):
        scorer = NeuralScorer(lm.model, lm.vocab, share_prefixes=share)
        got = scorer.encoded_logprobs([[lm.vocab.encode(s) + [EOS_ID] for s in SENTENCES]])[0]
        for words, lp in zip(SENTENCES, got):
            np.testing.assert_allclose(lp, reference(lm, words), rtol=0, atol=1e-4)
    # per word: the sum of its pieces
    per_word = NeuralScorer(lm.model, lm.vocab).token_logprobs([SENTENCES])[0]
    for words, lp in zip(SENTENCES, per_word):
        assert len(lp) == len(words) + 1
        assert lp.sum() == pytest.approx(reference(lm, words).sum(), abs=1e-4)


def test_incremental_equals_full_through_select_cat_and_compact(hf_dir):
    lm = load_model(f"hf:{hf_dir}")
    m, vocab = lm.model, lm.vocab
    seqs = [vocab.encode(s) + [EOS_ID] for s in SENTENCES]
    refs = [reference(lm, s) for s in SENTENCES]
    with torch.no_grad():
        st = m.initial_state(1)
        one = []
        for t in seqs[0]:  # token by token
            lp, st = m.score(torch.tensor([[t]]), st)
            one.append(float(lp[0, 0]))
        np.testing.assert_allclose(one, refs[0], rtol=0, atol=1e-4)
        # two calls of ragged rows, the state reordered, split and joined between them
        cut = [min(2, len(s)) for s in seqs]
        t1, l1 = pad_batch([s[:c] for s, c in zip(seqs, cut)])
        lp1, st = m.score(t1, m.initial_state(len(seqs)), l1)
        order = [3, 0, 4, 2, 1]
        st = type(st).cat([st.select(order[:2]), st.select(order[2:])]).compact()
        t2, l2 = pad_batch([seqs[i][cut[i]:] for i in order])
        lp2, _ = m.score(t2, st, l2)
        for r, i in enumerate(order):
            got = np.concatenate([lp1[i, : cut[i]].numpy(), lp2[r, : len(seqs[i]) - cut[i]].numpy()])
            np.testing.assert_allclose(got, refs[i], rtol=0, atol=1e-4)
        # step's distribution holds score's log-prob
        dist, _ = m.step(torch.tensor([seqs[2][:3]]), m.initial_state(1))
        assert float(dist[0, seqs[2][3]]) == pytest.approx(refs[2][3], abs=1e-4)


def test_prefix_sharing_in_sub_tries_equals_one_trie(gpt2_dir):
    lm = load_model(f"hf:{gpt2_dir}")
    seqs = [lm.vocab.encode(s) + [EOS_ID] for s in SENTENCES]
    whole = NeuralScorer(lm.model, lm.vocab).encoded_logprobs([seqs])[0]
    trie = PrefixTrie(seqs)
    lm.model.max_tree_nodes = 12  # forces the utterance into several sub-tries
    try:
        split = NeuralScorer(lm.model, lm.vocab).encoded_logprobs([seqs])[0]
    finally:
        lm.model.max_tree_nodes = None
    assert trie.n_nodes > 12
    for a, b in zip(whole, split):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)


def test_a_hypothesis_past_the_models_positions_is_refused(tmp_path_factory):
    lm = load_model(f"hf:{make(tmp_path_factory, 'gpt2', positions=8)}")
    long = lm.vocab.encode(SENTENCES[0]) + [EOS_ID]
    assert len(long) > 8
    for share in (False, True):
        with pytest.raises(WorkLimitError, match="past the model's 8 positions"):
            NeuralScorer(lm.model, lm.vocab, share_prefixes=share).encoded_logprobs([[long]])
    fits = lm.vocab.encode(["a"]) + [EOS_ID]
    assert len(NeuralScorer(lm.model, lm.vocab).encoded_logprobs([[fits]])[0][0]) == len(fits)


def test_a_lattice_rescored_with_exact_histories_equals_its_paths_scored_by_transformers(gpt2_dir, kenlm_model):
    from test_expand import SAUSAGE_COSTS, SYMS, direct_total, sausage_text

    from smallstate_lm.ngram import NgramLM
    from smallstate_lm.rescoring.expand.rescorer import ExpandConfig, LatticeRescorer
    from smallstate_lm.rescoring.formats.lattice_io import read_fst_text
    from smallstate_lm.rescoring.lattices.lattice import SymbolTable
    from smallstate_lm.weights import Weights

    lm, ngram = load_model(f"hf:{gpt2_dir}"), NgramLM(kenlm_model)
    sym = SymbolTable.from_words(SYMS)
    lat = read_fst_text(sausage_text(sym), sym, name="sausage")
    w = Weights(am_scale=0.1, graph_scale=0.5, lm_weight=0.7, ngram_weight=0.4, word_penalty=-0.1)
    exp = LatticeRescorer(w, lm.model, lm.vocab, ngram, ExpandConfig(max_ngram_order=None, beam=1e9)).expand(lat)
    best = exp.nbest(w, 4)
    assert len(best) == 4
    scorer = NeuralScorer(lm.model, lm.vocab)
    for h in best:
        assert h.total == pytest.approx(direct_total(h.words, w, SAUSAGE_COSTS, ngram, scorer), abs=1e-4)
        assert scorer.token_logprobs([[h.words]])[0][0].sum() == pytest.approx(reference(lm, h.words).sum(),
                                                                              abs=1e-4)


def test_the_cli_rescores_lattices_and_lists_with_an_hf_lm(gpt2_dir, kenlm_model, tmp_path):
    lattices = sorted((DATA.parent / "lattices").glob("slt-*.lat.fst"))[:3]
    r = run_cli("rescore", *map(str, lattices), "--words", str(DATA.parent / "lattices" / "words.txt"),
                "--lm", f"hf:{gpt2_dir}", "--ngram", str(kenlm_model), "-o", str(tmp_path / "lat"))
    assert r.returncode == 0, r.stderr
    assert len((tmp_path / "lat" / "best.txt").read_text().splitlines()) == len(lattices)
    nbest = tmp_path / "nbest.jsonl"
    hyps = [{"words": " ".join(s), "am": -10.0 - i} for i, s in enumerate(SENTENCES[:3])]
    nbest.write_text(json.dumps({"utt": "u1", "hyps": hyps}) + "\n")
    r = run_cli("rescore", str(nbest), "--lm", f"hf:{gpt2_dir}", "-o", str(tmp_path / "nb"))
    assert r.returncode == 0, r.stderr
    lm = load_model(f"hf:{gpt2_dir}")
    out = [json.loads(x) for x in (tmp_path / "nb" / "nbest.jsonl").read_text().splitlines()]
    scored = {tuple(h["words"]): h for h in out[0]["hyps"]}
    for s in SENTENCES[:3]:
        assert scored[tuple(s)]["neural"] == pytest.approx(reference(lm, s).sum(), abs=1e-3)


@pytest.mark.parametrize("damage, message", [
    ("missing", "no such directory"),
    ("no-safetensors", "no *.safetensors weights"),
    ("not-causal", "is not a causal LM"),
    ("tokenizer-mismatch", "do not belong together"),
])
def test_a_bad_hf_directory_is_one_error_line(gpt2_dir, tmp_path, damage, message):
    d = tmp_path / "model"
    if damage != "missing":
        shutil.copytree(gpt2_dir, d)
    if damage == "no-safetensors":
        (d / "model.safetensors").unlink()
    elif damage == "not-causal":
        cfg = json.loads((d / "config.json").read_text())
        cfg.update(model_type="t5", architectures=["T5Model"])
        (d / "config.json").write_text(json.dumps(cfg))
    elif damage == "tokenizer-mismatch":
        cfg = json.loads((d / "config.json").read_text())
        small = transformers.GPT2LMHeadModel(transformers.GPT2Config(**{**cfg, "vocab_size": 50}))
        small.save_pretrained(d, safe_serialization=True)
    nbest = tmp_path / "nbest.jsonl"
    nbest.write_text(json.dumps({"utt": "u", "hyps": [{"words": "in the beginning", "am": -1.0}]}) + "\n")
    r = run_cli("rescore", str(nbest), "--lm", f"hf:{d}", "-o", str(tmp_path / "out"))
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and message in lines[0], r.stderr
    assert not (tmp_path / "out").exists()


def test_the_service_rescores_lists_and_lattices_with_an_hf_lm(gpt2_dir, kenlm_model, tmp_path):
    import httpx
    from test_server import Server, post

    lm = load_model(f"hf:{gpt2_dir}")
    srv = Server(f"hf:{gpt2_dir}", kenlm_model, log=tmp_path / "server.log")
    try:
        hyps = [{"words": s, "am_score": -10.0 - i} for i, s in enumerate(SENTENCES[:3])]
        r = post(srv, "/rescore", {"utterances": [{"id": "u", "hypotheses": hyps}], "return_token_logprobs": True})
        assert r.status_code == 200, r.text
        for h in r.json()["utterances"][0]["hypotheses"]:
            assert len(h["token_logprobs"]["neural"]) == len(h["words"]) + 1
            assert h["neural"] == pytest.approx(reference(lm, h["words"]).sum(), abs=1e-3)
        text = "".join(f"0\t1\t{w}\t{w}\t1,10\n" for w in ("the", "a")) + "1\t2\tlord\tlord\t1,10\n2\t0,0\n"
        r = post(srv, "/rescore", {"utterances": [{"id": "l", "lattice": {"format": "openfst-text", "data": text}}],
                                   "nbest": 2})
        assert r.status_code == 200, r.text
        for h in r.json()["utterances"][0]["hypotheses"]:
            assert h["neural"] == pytest.approx(reference(lm, h["words"]).sum(), abs=1e-3)
        # longer than the model's 256 positions: a client error naming the limit
        long = ["jehoshaphat"] * 150  # under max_words, over the positions in pieces
        r = post(srv, "/rescore", {"utterances": [{"id": "x", "hypotheses": [{"words": long, "am_score": -1.0}]}]})
        assert 400 <= r.status_code < 500 and "256 positions" in r.text, r.text
        models = httpx.get(srv.url + "/v1/models", timeout=10).json()
        assert models["neural"]["tokenizer"] == lm.vocab.spec
    finally:
        assert srv.stop() == 0, srv.log.read_text()
