"""The CUDA paths give the CPU's numbers: every model family's incremental = full invariant
on the GPU, prefix-shared and blocked tree scoring, lattice rescoring, training under bf16
autocast, and the service with its model resident on the GPU. Skipped where CUDA is absent
(CI has no GPU); run on a GPU host with `pytest tests/test_cuda.py`."""

from __future__ import annotations

import json
import os
import random

import numpy as np
import pytest
import torch
from conftest import REPO, TEST_DATA, run_cli
from test_state_contract import IDS, VARIANTS, shrunk

from smallstate_lm.checkpoint import load_model
from smallstate_lm.device import PRECISIONS
from smallstate_lm.models import build_model
from smallstate_lm.rescoring.nbest.lists import read_nbest
from smallstate_lm.scoring.scorer import NeuralScorer
from smallstate_lm.vocab import Vocabulary
from smallstate_lm.weights import Weights

# Another device can stand in (SMALLSTATE_TEST_DEVICE=cpu checks the tests themselves without a GPU).
DEV = os.environ.get("SMALLSTATE_TEST_DEVICE", "cuda")
pytestmark = pytest.mark.skipif(DEV.startswith("cuda") and not torch.cuda.is_available(), reason="needs a CUDA device")

V = 40
TOL = 1e-4  # float32 on two devices: different kernels, different summation orders


@pytest.fixture(autouse=True)
def _exact_fp32():
    # TF32 would make fp32 matmuls and convolutions round to 10-bit mantissas on the GPU
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


@torch.no_grad()
def _cpu_full_and_incremental(variant, dtype: torch.dtype = torch.float32):
    """A variant's fp32 log-probs on the CPU, and a copy's on DEV in `dtype`, from one call and token by token."""
    name, kv, extra = variant
    torch.manual_seed(0)
    cpu = build_model(shrunk(name, kv, **extra)).eval()
    gpu = build_model(shrunk(name, kv, **extra)).eval()
    gpu.load_state_dict(cpu.state_dict())
    gpu.to(device=DEV, dtype=dtype)
    tokens = torch.randint(0, V, (3, 11))
    want, _ = cpu.score(tokens, cpu.initial_state(3))
    full, _ = gpu.score(tokens.to(DEV), gpu.initial_state(3))
    state, parts = gpu.initial_state(3), []
    for t in range(tokens.shape[1]):
        lp, state = gpu.score(tokens[:, t : t + 1].to(DEV), state)
        parts.append(lp)
    return want, full, torch.cat(parts, 1)


@pytest.mark.parametrize("variant", VARIANTS, ids=IDS)
def test_incremental_equals_full_on_cuda_and_matches_cpu(variant):
    want, full, incremental = _cpu_full_and_incremental(variant)
    assert (incremental - full).abs().max().item() <= TOL
    assert (full.cpu() - want).abs().max().item() <= TOL


def _hypotheses(seed: int, n_utts: int = 4) -> tuple[Vocabulary, list[list[list[str]]]]:
    vocab = Vocabulary.build([[f"w{i}" for i in range(60)]])
    rng = random.Random(seed)
    groups = []
    for _ in range(n_utts):
        stem = [f"w{rng.randrange(60)}" for _ in range(rng.randrange(2, 8))]
        tails = [[f"w{rng.randrange(60)}" for _ in range(rng.randrange(1, 9))] for _ in range(rng.randrange(1, 12))]
        groups.append([stem[: rng.randrange(len(stem) + 1)] + tail for tail in tails])
    return vocab, groups


def _cpu_and_device_models(vocab: Vocabulary, dtype: torch.dtype = torch.float32):
    """A small model on the CPU and a copy of it on DEV in `dtype`."""
    torch.manual_seed(0)
    model = build_model(shrunk("small", False).replace(vocab_size=len(vocab))).eval()
    copy = build_model(shrunk("small", False).replace(vocab_size=len(vocab))).eval()
    copy.load_state_dict(model.state_dict())
    return model, copy.to(device=DEV, dtype=dtype)


def _assert_close(want, got, tol: float) -> None:
    for w_utt, g_utt in zip(want, got):
        for w, g in zip(w_utt, g_utt):
            np.testing.assert_allclose(g, w, atol=tol, rtol=0)


@pytest.mark.parametrize("share, cap", [(False, None), (True, None), (True, 64 * 1024)],
                         ids=["padded", "tree", "tree-blocked"])
def test_neural_scorer_on_cuda_matches_cpu(share, cap):
    vocab, groups = _hypotheses(3)
    model, model_gpu = _cpu_and_device_models(vocab)
    want = NeuralScorer(model, vocab, "cpu", share_prefixes=share, max_work_bytes=cap).token_logprobs(groups)
    got = NeuralScorer(model_gpu, vocab, DEV, share_prefixes=share, max_work_bytes=cap).token_logprobs(groups)
    _assert_close(want, got, TOL)


def test_wide_tries_keep_the_dense_pass_on_cuda_where_blocks_pay_on_a_cpu():
    """The byte count that sends a CPU's wide shallow tries to blocks does not on a GPU, where launches bound a
    small model's time and blocks launch more."""
    if not DEV.startswith("cuda"):
        pytest.skip("the GPU's choice of plan (the suite run on the CPU has none)")
    vocab = Vocabulary.build([[f"w{i}" for i in range(60)]])
    model, model_gpu = _cpu_and_device_models(vocab)
    # an n-best list's shape: 144 hypotheses of 3 words, a wide trie 4 deep with </s>
    n_rows, max_nodes, total, depth, path_len = 1, 12 + 72 + 144 + 144, 12 + 72 + 144 + 144, 4, 144 * 5
    cap = 256 * 2**20
    assert model.tree_plan(n_rows, max_nodes, total, depth, path_len, cap).blocked
    assert not model_gpu.tree_plan(n_rows, max_nodes, total, depth, path_len, cap).blocked


def test_path_choice_on_cuda_matches_cpu():
    """The scorer measures both paths on the device (as the service and rescore do on CUDA) and gives the CPU's
    numbers whichever it takes."""
    vocab, groups = _hypotheses(9)
    model, model_gpu = _cpu_and_device_models(vocab)
    want = NeuralScorer(model, vocab, "cpu").token_logprobs(groups)
    scorer = NeuralScorer(model_gpu, vocab, DEV)
    costs = scorer.choose_paths(rounds=1)
    assert costs.tree_node_s > 0 and costs.padded_token_s > 0
    _assert_close(want, scorer.token_logprobs(groups), TOL)


HALF_TOL = {"bf16": 0.05, "fp16": 0.01}  # as tests/test_precision.py: near-uniform log-probs of a tiny model


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("variant", VARIANTS, ids=IDS)
def test_reduced_precision_on_cuda_keeps_incremental_equals_full(variant, precision):
    want, full, incremental = _cpu_full_and_incremental(variant, PRECISIONS[precision])
    assert full.dtype == torch.float32
    assert (incremental - full).abs().max().item() <= HALF_TOL[precision]
    assert (full.cpu() - want).abs().max().item() <= HALF_TOL[precision]


def test_a_reduced_precision_model_on_cuda_keeps_attention_off_cudnn(tiny_lm_dir):
    """cuDNN attention builds a graph per new shape, and scoring's shapes change with every call."""
    before = torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(True)
    try:
        load_model(tiny_lm_dir, device=DEV, precision="fp32")
        assert torch.backends.cuda.cudnn_sdp_enabled(), "fp32 leaves torch's choice alone"
        load_model(tiny_lm_dir, device=DEV, precision="bf16")
        assert torch.backends.cuda.cudnn_sdp_enabled() == (not DEV.startswith("cuda"))
    finally:
        torch.backends.cuda.enable_cudnn_sdp(before)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("share", [False, True], ids=["padded", "tree"])
def test_neural_scorer_in_reduced_precision_on_cuda_matches_fp32_cpu(share, precision):
    vocab, groups = _hypotheses(5)
    model, half = _cpu_and_device_models(vocab, PRECISIONS[precision])
    want = NeuralScorer(model, vocab, "cpu", share_prefixes=share).token_logprobs(groups)
    got = NeuralScorer(half, vocab, DEV, share_prefixes=share).token_logprobs(groups)
    _assert_close(want, got, HALF_TOL[precision])


def test_training_on_cuda_under_bf16_autocast_loads_on_cpu(small_corpus, tmp_path):
    from smallstate_lm.train import TrainConfig, train

    out = tmp_path / "run"
    summary = train(TrainConfig(train=str(small_corpus[0]), valid=str(small_corpus[1]), out=str(out), preset="tiny",
                                batch_tokens=2048, lr=3e-3, warmup_steps=10, valid_every=20, patience=0,
                                progress=False, device=DEV, max_steps=40))
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    ppls = [r["valid_ppl"] for r in log if r.get("event") == "valid"]
    assert len(ppls) == 2 and ppls[1] < ppls[0] and np.isfinite(summary["best_valid_ppl"])
    cpu, gpu = load_model(out, device="cpu"), load_model(out, device=DEV)
    tokens = torch.tensor([[1, 5, 9, 2, 7]])
    with torch.no_grad():
        a, _ = cpu.model.score(tokens, cpu.model.initial_state(1))
        b, _ = gpu.model.score(tokens.to(DEV), gpu.model.initial_state(1))
    assert (a - b.cpu()).abs().max().item() <= TOL


def test_lattice_rescoring_on_cuda_matches_cpu(tiny_lm_dir):
    from smallstate_lm.rescoring.expand.rescorer import ExpandConfig, build_rescorer
    from smallstate_lm.rescoring.formats.lattice_io import read_fst
    from smallstate_lm.rescoring.lattices.lattice import SymbolTable

    lat_dir = REPO / "lattices"
    syms = SymbolTable.read(lat_dir / "words.txt")
    lattices = [read_fst(p, syms) for p in sorted(lat_dir.glob("*.fst"))[:6]]
    w = Weights(graph_scale=1.0, am_scale=0.1, lm_weight=0.5, ngram_weight=0.0, word_penalty=0.0)
    results = {}
    for device in ("cpu", DEV):
        rescorer = build_rescorer(w, load_model(tiny_lm_dir, device=device), None, ExpandConfig(max_ngram_order=3),
                                  device)
        results[device] = [rescorer.expand(lat) for lat in lattices]
    for a, b in zip(results["cpu"], results[DEV]):
        assert a.best_words(w) == b.best_words(w)
        np.testing.assert_allclose(b.final_costs(w), a.final_costs(w), atol=1e-3, rtol=0)
        np.testing.assert_allclose(b.arc_costs(w), a.arc_costs(w), atol=1e-3, rtol=0)


def test_service_on_cuda_matches_the_cpu_cli(tiny_lm_dir, tmp_path):
    from test_server import Server, nbest_request

    proc = run_cli("rescore", TEST_DATA / "nbest.tsv", "--lm", tiny_lm_dir, "-o", tmp_path / "out", "--quiet",
                   "--device", "cpu")
    assert proc.returncode == 0, proc.stderr
    want = {json.loads(line)["utt"]: json.loads(line)["hyps"]
            for line in (tmp_path / "out" / "nbest.jsonl").read_text().splitlines()}
    server = Server(tiny_lm_dir, None, "drain_seconds=0", log=tmp_path / "server.log", device=DEV)
    try:
        import httpx

        metrics = httpx.get(server.url + "/metrics", timeout=10).text
        assert f'device="{DEV}' in metrics
        r = httpx.post(server.url + "/rescore", json=nbest_request(read_nbest(TEST_DATA / "nbest.tsv")), timeout=60)
        assert r.status_code == 200, r.text
        for utt in r.json()["utterances"]:
            got = utt["hypotheses"]
            assert [h["words"] for h in got] == [h["words"] for h in want[utt["id"]]]
            for g, h in zip(got, want[utt["id"]]):
                assert g["neural"] == pytest.approx(h["neural"], abs=TOL * (1 + len(h["words"])))
    finally:
        assert server.stop() == 0, server.log.read_text()
