import json
import math

import pytest
import torch

from smallstate_lm.checkpoint import load_model
from smallstate_lm.data import StreamBatcher, encode_sentences
from smallstate_lm.errors import ConfigError
from smallstate_lm.evaluate import evaluate_file
from smallstate_lm.files import read_sentences
from smallstate_lm.train import TrainConfig, train
from smallstate_lm.vocab import Vocabulary


def tc(corpus, out, **kw):
    base = dict(train=str(corpus[0]), valid=str(corpus[1]), out=str(out), preset="tiny", batch_tokens=2048,
                lr=3e-3, warmup_steps=10, valid_every=10, patience=0, progress=False, device="cpu")
    base.update(kw)
    return TrainConfig(**base)


def read_log(out):
    return [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]


def test_validation_perplexity_falls_monotonically(small_corpus, tmp_path):
    out = tmp_path / "run"
    summary = train(tc(small_corpus, out, max_steps=40))
    ppls = [r["valid_ppl"] for r in read_log(out) if r.get("event") == "valid"]
    assert len(ppls) == 4
    assert all(b < a for a, b in zip(ppls, ppls[1:])), ppls
    assert summary["best_valid_ppl"] == min(ppls)
    assert (out / "model.pt").exists() and (out / "last.pt").exists() and (out / "vocab.txt").exists()


def test_resume_continues_from_the_saved_step_with_the_same_losses(small_corpus, tmp_path):
    whole, split = tmp_path / "whole", tmp_path / "split"
    train(tc(small_corpus, whole, max_steps=16, valid_every=8))
    first = train(tc(small_corpus, split, max_steps=16, valid_every=8, stop_after=8))
    assert first["steps"] == 8 and first["stop_reason"] == "stop_after"
    second = train(tc(small_corpus, split, max_steps=16, valid_every=8, resume=True))
    assert second["steps"] == 16
    steps_whole = {r["step"]: r["loss"] for r in read_log(whole) if "loss" in r}
    log_split = [r for r in read_log(split) if "loss" in r]
    assert [r["step"] for r in log_split] == list(range(1, 17))  # resumed at step 9, not from 1
    for r in log_split:
        assert math.isclose(r["loss"], steps_whole[r["step"]], rel_tol=0, abs_tol=1e-6), r["step"]


def test_checkpoint_reloads_the_exact_model_and_eval_counts_like_token_by_token(small_corpus, tmp_path):
    out = tmp_path / "run"
    train(tc(small_corpus, out, max_steps=10))
    lm = load_model(out)
    report = evaluate_file(out, small_corpus[1])
    # Perplexity recomputed one sentence at a time, one token at a time, through the state.
    seqs = encode_sentences(read_sentences(small_corpus[1])[:40], lm.vocab)
    total, n = 0.0, 0
    with torch.no_grad():
        for s in seqs:
            state = lm.model.initial_state(1)
            for tok in s:
                lp, state = lm.model.score(torch.tensor([[tok]]), state)
                total += float(lp)
                n += 1
    head = evaluate_file(out, _head(small_corpus[1], tmp_path, 40))
    assert math.isclose(head["perplexity"], math.exp(-total / n), rel_tol=1e-5)
    assert head["tokens"] == n == sum(len(s) for s in seqs)  # words + one </s> each
    assert report["state_numel_per_position"] == 2 * 2 * 64
    assert report["state_bytes_per_position"] == 2 * 2 * 64 * 4


def _head(path, tmp_path, n):
    p = tmp_path / "head.txt"
    p.write_text("\n".join(path.read_text().splitlines()[:n]) + "\n")
    return p


def test_sgd_newbob_halves_the_rate_when_validation_stalls(small_corpus, tmp_path):
    out = tmp_path / "sgd"
    # threshold 1.0: no validation can improve by 100%, so every one after the first halves the rate
    train(tc(small_corpus, out, optimizer="sgd", lr=0.5, max_steps=15, valid_every=5, newbob_threshold=1.0))
    lrs = {r["step"]: r["lr"] for r in read_log(out) if "lr" in r}
    assert lrs[1] == lrs[5] == 0.5
    assert lrs[6] == lrs[10] == 0.5  # the first validation has nothing to compare against
    assert lrs[11] == 0.25


def test_early_stopping_after_patience_validations_without_improvement(small_corpus, tmp_path):
    out = tmp_path / "stall"
    # a zero learning rate never improves after the first validation
    s = train(tc(small_corpus, out, lr=0.0, max_steps=100, valid_every=3, patience=2))
    assert s["stop_reason"] == "early_stopping" and s["steps"] == 9


def test_init_from_continues_from_a_checkpoint(small_corpus, tmp_path):
    first = tmp_path / "first"
    s1 = train(tc(small_corpus, first, max_steps=20))
    second = tmp_path / "second"
    s2 = train(tc(small_corpus, second, max_steps=1, lr=0.0, init_from=str(first / "model.pt")))
    assert math.isclose(s2["best_valid_ppl"], s1["best_valid_ppl"], rel_tol=1e-6)  # same weights, no update


XL_TINY = {"d_model": 32, "n_heads": 2, "d_ff": 64, "d_embed": 16, "n_layers": 2, "mem_len": 16, "dropout": 0.0}


def test_stream_mode_carries_the_state_across_segments(small_corpus, tmp_path):
    """Running text in consecutive segments: the second segment of a stream is scored on
    the first one's memories, so its loss differs from scoring it from a fresh state."""
    tr, va = small_corpus
    tc = TrainConfig(train=str(tr), valid=str(va), out=str(tmp_path / "xl"), preset="xl-small", overrides=XL_TINY,
                     stream=True, max_len=16, batch_tokens=64, max_steps=30, valid_every=15, progress=False)
    summary = train(tc)
    assert summary["steps"] == 30 and math.isfinite(summary["best_valid_ppl"])
    lm = load_model(tmp_path / "xl").model.eval()
    vocab = Vocabulary.load(tmp_path / "xl" / "vocab.txt")
    sb = StreamBatcher(encode_sentences(read_sentences(tr), vocab), 64, 16)
    assert sb.n_streams == 4
    _, _, seg0 = sb.batch(0)
    _, k, seg1 = sb.batch(1)
    assert k == 1 and torch.equal(seg0[:, -1:], sb.data[:, 15:16])  # rows continue the same stream
    with torch.no_grad():
        _, st = lm.score(seg0, lm.initial_state(4))
        carried, _ = lm.score(seg1, st)
        fresh, _ = lm.score(seg1, lm.initial_state(4))
    assert (carried - fresh).abs().max() > 1e-3


def test_stream_mode_refuses_a_model_with_unbounded_state(small_corpus, tmp_path):
    tr, va = small_corpus
    tc = TrainConfig(train=str(tr), valid=str(va), out=str(tmp_path / "t"), preset="tiny", stream=True,
                     max_steps=2, progress=False)
    with pytest.raises(ConfigError, match="stream mode needs a model whose state is bounded"):
        train(tc)


def test_bf16_autocast_on_cpu_trains_fp32_weights_close_to_fp32_training(small_corpus, tmp_path):
    fp32 = train(tc(small_corpus, tmp_path / "fp32", max_steps=20))
    bf16 = train(tc(small_corpus, tmp_path / "bf16", max_steps=20, precision="bf16"))
    losses = {name: [r["loss"] for r in read_log(tmp_path / name) if "loss" in r] for name in ("fp32", "bf16")}
    # the same batches, so the first step's loss differs only by bf16 rounding
    assert losses["bf16"][0] == pytest.approx(losses["fp32"][0], rel=2e-2)
    assert losses["bf16"][-1] < losses["bf16"][0]
    assert bf16["best_valid_ppl"] == pytest.approx(fp32["best_valid_ppl"], rel=0.1)
    lm = load_model(tmp_path / "bf16")
    assert {p.dtype for p in lm.model.parameters()} == {torch.float32}
    with pytest.raises(ConfigError, match="precision"):
        train(tc(small_corpus, tmp_path / "bad", max_steps=2, precision="fp16"))
    assert not (tmp_path / "bad").exists()


def test_a_token_budget_stops_training_and_spans_the_schedule(small_corpus, tmp_path):
    out = tmp_path / "run"
    summary = train(tc(small_corpus, out, max_tokens=6000, valid_every=1000, valid_at_tokens=[2500],
                       eval_text=str(small_corpus[1]), warmup_steps=1))
    steps = [r for r in read_log(out) if "loss" in r]
    assert summary["stop_reason"] == "max_tokens" and summary["tokens"] == sum(r["tokens"] for r in steps)
    assert sum(r["tokens"] for r in steps[:-1]) < 6000 <= summary["tokens"]
    # the cosine reaches its floor (10% of the peak) at the budget, not at max_epochs
    assert steps[-1]["lr"] < 0.2 * steps[0]["lr"]
    valids = [r for r in read_log(out) if r.get("event") == "valid"]
    # one validation when 2,500 tokens were reached, one at the end; each scores eval_text too
    assert [r["tokens"] >= 2500 for r in valids] == [True, True] and len(valids) == 2
    assert valids[0]["tokens"] - 2500 < max(r["tokens"] for r in steps)
    for r in valids:
        assert r["eval_ppl"] == pytest.approx(r["valid_ppl"], rel=1e-6)  # eval_text is the valid text here


def test_cli_options_come_from_the_config_fields_and_reach_the_config(monkeypatch, tmp_path):
    import dataclasses

    import typer.main
    from typer.testing import CliRunner

    import smallstate_lm.train as train_module
    from smallstate_lm.cli import app

    params = {p.name for p in typer.main.get_command(app).commands["train"].params}
    offered = {f.metadata["cli"]["negated"] or f.name for f in dataclasses.fields(TrainConfig) if "cli" in f.metadata}
    assert params == offered | {"threads"} and "weight_decay" not in params
    seen = []
    monkeypatch.setattr(train_module, "train", lambda tc, loss_fn=None: seen.append(tc) or {})
    r = CliRunner().invoke(app, ["train", "--train", "a.txt", "--valid", "b.txt", "-o", str(tmp_path / "run"),
                                 "--set", "d_model=32", "--valid-at-tokens", "10", "--valid-at-tokens", "20",
                                 "--eval-text", "e.txt", "--quiet"])
    assert r.exit_code == 0, r.output
    tc = seen[0]
    assert tc.overrides == {"d_model": 32} and tc.valid_at_tokens == [10, 20] and tc.eval_text == "e.txt"
    assert not tc.progress and tc.preset == "tiny" and tc.weight_decay == 0.01
