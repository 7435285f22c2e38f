"""Reduced-precision inference (`--precision bf16|fp16`): every model keeps its state contract with its
weights and state cast, agrees with fp32 to the precision's rounding, and the commands and the service
take the option and refuse a wrong one in one line."""

import json

import pytest
import torch
from conftest import REPO, TEST_DATA, run_cli
from test_state_contract import IDS, VARIANTS, V, shrunk

from smallstate_lm.checkpoint import MODEL_FILE, load_model, save_checkpoint
from smallstate_lm.device import PRECISIONS
from smallstate_lm.errors import CheckpointError, ConfigError
from smallstate_lm.models import build_model
from smallstate_lm.service.settings import Settings

# Natural-log probabilities of a tiny random model (near-uniform over V=40, about -3.7 each): bf16 keeps
# 8 bits of mantissa, fp16 11, so a few roundings through the layers stay well inside these.
TOL = {"bf16": 0.05, "fp16": 0.01}
HALF = [p for p in PRECISIONS if p != "fp32"]


@pytest.fixture(params=VARIANTS, ids=IDS)
def model(request):
    """The fp32 model of each variant; each test casts a copy."""
    torch.manual_seed(0)
    name, kv, extra = request.param
    return build_model(shrunk(name, kv, **extra)).eval()


def cast(model, precision):
    half = build_model(model.cfg).eval()
    half.load_state_dict(model.state_dict())
    return half.to(PRECISIONS[precision])


@pytest.mark.parametrize("precision", HALF)
@torch.no_grad()
def test_half_precision_keeps_the_contract_and_agrees_with_fp32(model, precision):
    half, tol = cast(model, precision), TOL[precision]
    tokens = torch.randint(0, V, (3, 11))
    ref, _ = model.score(tokens, model.initial_state(3))
    full, state = half.score(tokens, half.initial_state(3))
    assert full.dtype == torch.float32, "log-probs stay float32 whatever the weights are"
    assert (full - ref).abs().max() <= tol
    floating = [t for t in state._tensors() if t.is_floating_point()]
    assert floating and all(t.dtype == PRECISIONS[precision] for t in floating), "the state is stored narrow"
    # incremental equals full, in this precision
    state, parts = half.initial_state(3), []
    for t in range(tokens.shape[1]):
        lp, state = half.score(tokens[:, t : t + 1], state)
        parts.append(lp)
    assert (torch.cat(parts, 1) - full).abs().max() <= tol
    if half.score_tree is not None:
        parents = torch.tensor([[-1, 0, 1, 1, 3, -1]])
        tree = half.score_tree(tokens[:1, :6], parents)
        path, _ = half.score(tokens[:1, [0, 1, 3, 4]], half.initial_state(1))
        assert tree.dtype == torch.float32 and (tree[0, [0, 1, 3, 4]] - path[0]).abs().max() <= tol


def test_load_model_casts_and_counts_state_bytes_in_the_precision(tiny_lm_dir):
    fp32 = load_model(tiny_lm_dir, precision="fp32")
    bf16 = load_model(tiny_lm_dir, precision="bf16")
    assert next(bf16.model.parameters()).dtype == torch.bfloat16
    assert next(fp32.model.parameters()).dtype == torch.float32
    with pytest.raises(ConfigError, match="precision must be one of fp32, bf16, fp16, got 'fp8'"):
        load_model(tiny_lm_dir, precision="fp8")


def test_weights_that_overflow_fp16_are_refused_with_the_way_out(tiny_lm_dir, tmp_path):
    lm = load_model(tiny_lm_dir)
    with torch.no_grad():  # logits beyond fp16's 65504: finite in fp32 and bf16, infinite in fp16
        lm.model.output.bias.fill_(1e5)
        lm.model.output.bias[0] = -1e5
    save_checkpoint(tmp_path / MODEL_FILE, lm.model, lm.vocab)
    load_model(tmp_path, precision="fp32")
    with pytest.raises(CheckpointError, match=r"not finite .*overflow in fp16\? try precision bf16 or fp32"):
        load_model(tmp_path, precision="fp16")


def test_rescore_in_bf16_scores_as_fp32_does(tiny_lm_dir, kenlm_model, tmp_path):
    totals = {}
    for precision in ("fp32", "bf16"):
        out = tmp_path / precision
        proc = run_cli("rescore", TEST_DATA / "nbest.tsv", "--lm", tiny_lm_dir, "--ngram", kenlm_model, "--device",
                       "cpu", "--precision", precision, "-o", out, "--quiet")
        assert proc.returncode == 0, proc.stderr
        totals[precision] = {(u["utt"], h["id"]): h["neural"] for line in (out / "nbest.jsonl").open()
                             for u in [json.loads(line)] for h in u["hyps"]}
    assert totals["fp32"].keys() == totals["bf16"].keys()
    # a hypothesis's neural score sums ~10 token log-probs, each within bf16's rounding
    assert max(abs(totals["fp32"][k] - totals["bf16"][k]) for k in totals["fp32"]) <= 0.5


@pytest.mark.parametrize("command", [["rescore", str(TEST_DATA / "nbest.tsv"), "-o", "OUT"],
                                     ["eval", "--model", "LM", "--text", str(TEST_DATA / "ref.txt")],
                                     ["serve", "--lm", "LM"]])
def test_a_wrong_precision_is_one_line_before_anything_loads(command, tiny_lm_dir, tmp_path):
    args = [str(tmp_path / "out") if a == "OUT" else str(tiny_lm_dir) if a == "LM" else a for a in command]
    proc = run_cli(*args, "--precision", "half")
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().count("\n") == 0 and "precision must be fp32, bf16 or fp16, got 'half'" in proc.stderr
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_service_settings_take_a_precision():
    assert Settings(precision="bf16").precision == "bf16"
    with pytest.raises(ConfigError, match="setting precision must be fp32, bf16 or fp16"):
        Settings(precision="int8")


def test_lattice_rescorers_are_built_in_the_precision_asked(tiny_lm_dir, kenlm_model):
    from smallstate_lm.rescoring.expand.rescorer import ExpandConfig
    from smallstate_lm.rescoring.runs.lattice_run import build_lattice_rescorer
    from smallstate_lm.weights import Weights

    for precision, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        r = build_lattice_rescorer(tiny_lm_dir, kenlm_model, Weights(), ExpandConfig(), "cpu", precision)
        assert next(r.model.parameters()).dtype == dtype


def test_tune_on_lattices_takes_a_precision(tiny_lm_dir, kenlm_model, tmp_path):
    lattices = REPO / "lattices"
    proc = run_cli("tune", *sorted(lattices.glob("*.lat.fst"))[:3], "--words", lattices / "words.txt", "--refs",
                   lattices / "ref.txt", "--lm", tiny_lm_dir, "--ngram", kenlm_model, "--device", "cpu",
                   "--precision", "bf16", "--search", "word_penalty", "-o", tmp_path / "w.json", "--quiet")
    assert proc.returncode == 0, proc.stderr
    assert json.loads((tmp_path / "w.json").read_text())["lm_weight"] >= 0
