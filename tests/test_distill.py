"""Distillation of a student LM from a frozen teacher: the loss, the teacher cache, the CLI."""

import json

import pytest
import torch
from conftest import run_cli

from smallstate_lm.checkpoint import load_model
from smallstate_lm.distill import (
    CacheBuild,
    DistillConfig,
    TeacherCache,
    build_teacher_cache,
    get_teacher_cache,
    make_loss_fn,
    teacher_targets,
)
from smallstate_lm.errors import ConfigError
from smallstate_lm.models import build_model, get_preset

V = 24


def peaked(model):
    """Larger random weights than the initialisation, so the distributions are far
    from uniform (an untrained model's are all close to 1/V, which would hide errors)."""
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.7)
    return model


def teacher_model():
    cfg = get_preset("tiny").replace(vocab_size=V, d_model=16, n_heads=2, d_ff=32, d_embed=8, dropout=0.0)
    return peaked(build_model(cfg)).eval().requires_grad_(False)


def student_model():
    return peaked(build_model(get_preset("lstm-small").replace(vocab_size=V, d_model=16, d_embed=8, dropout=0.0)))


def batch():
    tokens = torch.randint(0, V, (3, 6))
    lengths = torch.tensor([6, 4, 2])
    return tokens, lengths


@torch.no_grad()
def dists_by_steps(model, tokens, lengths):
    """Next-token log-distributions of each real position, one prefix at a time
    through `step` (independent of `log_probs_all`): a list of (V,) per position."""
    out = []
    for b in range(tokens.shape[0]):
        for t in range(int(lengths[b])):
            dist, _ = model.step(tokens[b : b + 1, :t], model.initial_state(1))
            out.append(dist[0])
    return torch.stack(out)  # (N, V)


def labels(tokens, lengths):
    return torch.cat([tokens[b, : int(lengths[b])] for b in range(tokens.shape[0])])


@pytest.mark.parametrize("arch", ["lstm", "transformer"])
@torch.no_grad()
def test_log_probs_all_match_score_and_step(arch):
    m = student_model().eval() if arch == "lstm" else teacher_model()
    tokens, lengths = batch()
    lp_all, _ = m.log_probs_all(tokens, m.initial_state(3), lengths)
    lp, _ = m.score(tokens, m.initial_state(3), lengths)
    assert torch.allclose(lp_all.gather(2, tokens[:, :, None])[:, :, 0], lp, atol=1e-5)
    real = torch.arange(6)[None] < lengths[:, None]
    assert torch.allclose(lp_all[real], dists_by_steps(m, tokens, lengths), atol=1e-5)
    assert (lp_all[~real] == 0).all()


def test_lambda_zero_is_plain_cross_entropy():
    student, tokens, lengths = student_model(), *batch()
    loss_fn = make_loss_fn(DistillConfig(teacher="-", lam=0.0), teacher_model(), None)
    loss, n = loss_fn(student, tokens, lengths, [0, 1, 2])
    lp, _ = student.score(tokens, student.initial_state(3), lengths)
    assert n == 12
    assert torch.allclose(loss, -lp.sum() / 12, atol=1e-6)


def test_lambda_one_with_top_k_equal_to_the_vocabulary_is_cross_entropy_to_the_teacher():
    teacher, student, (tokens, lengths) = teacher_model(), student_model(), batch()
    loss_fn = make_loss_fn(DistillConfig(teacher="-", lam=1.0, top_k=V), teacher, None)
    loss, _ = loss_fn(student, tokens, lengths, [0, 1, 2])
    q, p = dists_by_steps(teacher, tokens, lengths), dists_by_steps(student.eval(), tokens, lengths)
    want = -(q.exp() * p).sum(-1).mean()
    assert torch.allclose(loss, want, atol=1e-5)


def test_temperature_softens_both_sides_and_scales_the_term_by_its_square():
    teacher, student, (tokens, lengths) = teacher_model(), student_model(), batch()
    loss_fn = make_loss_fn(DistillConfig(teacher="-", lam=1.0, temperature=2.0), teacher, None)
    loss, _ = loss_fn(student, tokens, lengths, [0, 1, 2])
    q, p = dists_by_steps(teacher, tokens, lengths), dists_by_steps(student.eval(), tokens, lengths)
    want = 4.0 * -(torch.softmax(q / 2, -1) * torch.log_softmax(p / 2, -1)).sum(-1).mean()
    assert torch.allclose(loss, want, atol=1e-5)


@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_many_importance_weighted_samples_approach_the_full_term(temperature):
    teacher, student, (tokens, lengths) = teacher_model(), student_model(), batch()
    full, _ = make_loss_fn(DistillConfig(teacher="-", lam=1.0, temperature=temperature), teacher, None)(
        student, tokens, lengths, [0, 1, 2])
    sampled, _ = make_loss_fn(DistillConfig(teacher="-", lam=1.0, temperature=temperature, sampled=20000),
                              teacher, None, seed=3)(student, tokens, lengths, [0, 1, 2])
    # Within 0.3%; at temperature 2, unweighted draws from the teacher would be 1% off here.
    assert abs(float(sampled.detach() / full.detach()) - 1) < 3e-3


def test_a_step_leaves_the_teacher_unchanged_and_without_gradients():
    teacher, student, (tokens, lengths) = teacher_model(), student_model().train(), batch()
    before = {k: v.clone() for k, v in teacher.state_dict().items()}
    loss, _ = make_loss_fn(DistillConfig(teacher="-", lam=0.5, top_k=5), teacher, None)(
        student, tokens, lengths, [0, 1, 2])
    loss.backward()
    with torch.no_grad():  # a plain SGD step on the student
        for p in student.parameters():
            p.sub_(0.1 * p.grad)
    assert all(p.grad is None for p in teacher.parameters())
    assert all(torch.equal(v, before[k]) for k, v in teacher.state_dict().items())
    assert not teacher.training
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in student.parameters())


def seqs_for_cache():
    g = torch.Generator().manual_seed(5)
    return [torch.randint(3, V, (n,), generator=g).tolist() + [1] for n in (4, 1, 7, 3, 9)]


def test_top_k_cache_round_trip_gives_the_live_teacher_targets(tmp_path):
    teacher, seqs = teacher_model(), seqs_for_cache()
    cache = build_teacher_cache(teacher, seqs, "top_k", 5, batch_tokens=16)
    cache.save(tmp_path / "c.pt")
    back = TeacherCache.load(tmp_path / "c.pt")
    assert back.key == cache.key and back.mode == "top_k"
    for a, b in ((back.ids, cache.ids), (back.logq, cache.logq), (back.offsets, cache.offsets)):
        assert a.dtype == b.dtype and torch.equal(a, b)
    # Rows 2 and 4 looked up from the file equal the teacher run on them now (float16 log-probs).
    from smallstate_lm.state import pad_batch

    tokens, lengths = pad_batch([seqs[2], seqs[4]])
    got = back.lookup([2, 4], tokens.shape[1], lengths, "cpu")
    live = teacher_targets(teacher, tokens, lengths, "top_k", 5)
    real = torch.arange(tokens.shape[1])[None] < lengths[:, None]
    assert torch.equal(got.ids[real], live.ids[real])
    assert torch.allclose(got.logq[real], live.logq[real], atol=2e-2, rtol=1e-3)


def test_an_existing_cache_is_loaded_and_a_stale_one_refused(tmp_path):
    teacher, seqs, path = teacher_model(), seqs_for_cache(), tmp_path / "c.pt"
    get_teacher_cache(path, teacher, seqs, "top_k", 5, CacheBuild(16, "cpu"))
    stamp = path.stat().st_mtime_ns
    again = get_teacher_cache(path, teacher, seqs, "top_k", 5, CacheBuild(16, "cpu"))
    assert path.stat().st_mtime_ns == stamp and again.ids.shape == (sum(map(len, seqs)), 5)
    with pytest.raises(ConfigError, match="another number of targets"):
        get_teacher_cache(path, teacher, seqs, "top_k", 6, CacheBuild(16, "cpu"))
    with pytest.raises(ConfigError, match="another training text"):
        get_teacher_cache(path, teacher, seqs[:-1], "top_k", 5, CacheBuild(16, "cpu"))


@pytest.fixture
def short_corpus(small_corpus, tmp_path):
    tr, va = tmp_path / "train.txt", tmp_path / "valid.txt"
    tr.write_text("\n".join(small_corpus[0].read_text().splitlines()[:200]) + "\n")
    va.write_text("\n".join(small_corpus[1].read_text().splitlines()[:40]) + "\n")
    return tr, va


def test_cli_distills_a_loadable_student_in_the_teacher_vocabulary(short_corpus, tiny_lm_dir, tmp_path):
    out, cache = tmp_path / "student", tmp_path / "teacher.cache"
    r = run_cli("distill", "--teacher", tiny_lm_dir, "--student-preset", "lstm-small", "--train", short_corpus[0],
                "--valid", short_corpus[1], "--out", out, "--set", "d_model=32", "--set", "d_embed=16",
                "--max-steps", "2", "--valid-every", "2", "--batch-tokens", "512", "--top-k", "8",
                "--teacher-cache", cache, "--quiet", "--threads", "1", "--device", "cpu")
    assert r.returncode == 0, r.stderr
    student, teacher = load_model(out), load_model(tiny_lm_dir)
    assert student.config.arch == "lstm" and student.vocab.words == teacher.vocab.words
    assert cache.exists()
    summary = json.loads(r.stdout[r.stdout.index("{"):])
    assert summary["steps"] == 2 and summary["kd"] == "top_k" and summary["k"] == 8


def test_cli_teacher_without_a_model_is_one_line_exit_2(short_corpus, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    r = run_cli("distill", "--teacher", empty, "--train", short_corpus[0], "--valid", short_corpus[1],
                "--out", tmp_path / "s")
    assert r.returncode == 2
    assert r.stderr.strip().count("\n") == 0 and "model.pt" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "s").exists()


def test_top_k_and_sampled_together_are_refused():
    with pytest.raises(ConfigError, match="not both"):
        DistillConfig(teacher="-", top_k=4, sampled=4).validate()


def test_cli_distill_gives_the_student_its_own_defaults(monkeypatch, tmp_path):
    from typer.testing import CliRunner

    import smallstate_lm.distill as distill_module
    from smallstate_lm.cli import app

    seen = []
    monkeypatch.setattr(distill_module, "distill", lambda tc, dc: seen.append((tc, dc)) or {})
    r = CliRunner().invoke(app, ["distill", "--teacher", "t", "--train", "a.txt", "--valid", "b.txt",
                                 "-o", str(tmp_path / "s"), "--lambda", "0.25"])
    assert r.exit_code == 0, r.output
    tc, dc = seen[0]
    assert (tc.preset, tc.warmup_steps, tc.batch_tokens, tc.max_epochs) == ("lstm-small", 200, 4096, 20)
    assert dc.lam == 0.25 and dc.teacher == "t" and dc.top_k is None
