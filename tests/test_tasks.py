"""Algorithmic tasks: generators, batch layout, masked loss, teacher-forced argmax
accuracy, the length curriculum (rule and a real run) and user errors."""

import json
import random
from collections import Counter

import pytest
import torch
from conftest import run_cli

from smallstate_lm.errors import ConfigError
from smallstate_lm.models import build_model, get_preset
from smallstate_lm.tasks import (
    SEP,
    TASKS,
    Curriculum,
    TaskConfig,
    from_bits,
    get_task,
    greedy_correct,
    make_batch,
    output_loss,
    run_task,
    to_bits,
)
from smallstate_lm.vocab import EOS_ID, SPECIALS, UNK_ID

# Two layers of width 32: fast enough for real training runs inside a test.
TINY = {"d_model": 32, "d_embed": 32, "d_ff": 64, "ff_per_layer": 1, "n_heads": 2, "dropout": 0.0}


def lsb_first_int(bits: list[str]) -> int:
    """Parse least-significant-first binary with Python's own int(), not the module's helper."""
    return int("".join(reversed(bits)), 2)


def examples(name: str, lengths=range(1, 9), per_length: int = 20):
    rng = random.Random(7)
    for n in lengths:
        for _ in range(per_length):
            yield n, *TASKS[name].make(rng, n)


def tiny_model(task_name: str):
    torch.manual_seed(0)
    vocab = get_task(task_name).vocabulary()
    return build_model(get_preset("tiny").replace(vocab_size=len(vocab), **TINY)), vocab


def test_to_bits_is_least_significant_first():
    # 6 = 0*1 + 1*2 + 1*4 + 0*8
    assert to_bits(6, 4) == ["0", "1", "1", "0"]
    assert from_bits(["0", "1", "1", "0"]) == 6


@pytest.mark.parametrize("name", ["copy", "reverse"])
def test_copy_and_reverse(name):
    for n, x, y in examples(name):
        assert len(x) == n and all(c.isdigit() for c in x)
        assert y == (x if name == "copy" else [x[i] for i in range(n - 1, -1, -1)])


def test_sort_outputs_the_input_digits_in_ascending_order():
    for n, x, y in examples("sort"):
        assert len(x) == n
        assert Counter(y) == Counter(x)
        assert all(int(a) <= int(b) for a, b in zip(y, y[1:]))


def test_not_flips_every_bit():
    for n, x, y in examples("not"):
        assert len(x) == len(y) == n
        assert all({a, b} == {"0", "1"} for a, b in zip(x, y))


def test_remember_recalls_the_digits_after_a_blank_gap():
    for n, x, y in examples("remember"):
        assert x[n:] == ["_"] * n
        assert all(c.isdigit() for c in x[:n])
        assert y == x[:n]


@pytest.mark.parametrize("name,op,width", [("addition", "+", lambda n: n + 1), ("multiply", "*", lambda n: 2 * n)])
def test_arithmetic_outputs_are_correct(name, op, width):
    seen_carry = False
    for n, x, y in examples(name):
        assert x.count(op) == 1
        a, b = x[: x.index(op)], x[x.index(op) + 1:]
        assert len(a) == len(b) == n and len(y) == width(n)
        va, vb = lsb_first_int(a), lsb_first_int(b)
        assert lsb_first_int(y) == (va + vb if op == "+" else va * vb)
        seen_carry |= y[-1] == "1"
    assert seen_carry  # the top output bit is exercised, not always zero


@pytest.mark.parametrize("name", list(TASKS))
def test_vocabulary_covers_every_symbol_with_specials_first(name):
    vocab = get_task(name).vocabulary()
    assert vocab.words[:3] == list(SPECIALS)
    for _, x, y in examples(name, per_length=5):
        assert UNK_ID not in vocab.encode(x + [SEP] + y)


def test_batch_targets_are_the_outputs_and_final_eos_only():
    task = get_task("addition")
    vocab = task.vocabulary()
    sizes = [3, 1, 5]
    batch = make_batch(task, vocab, random.Random(0), sizes)
    sep = vocab.index[SEP]
    for i, n in enumerate(sizes):
        row = batch.tokens[i, : batch.lengths[i]].tolist()
        assert row[-1] == EOS_ID and len(row) == (2 * n + 1) + 1 + (n + 1) + 1  # a+b, =, sum, </s>
        first_out = row.index(sep) + 1
        expected = [first_out <= t < len(row) for t in range(batch.tokens.shape[1])]
        assert batch.target[i].tolist() == expected


def test_loss_counts_only_output_positions():
    model, vocab = tiny_model("copy")
    batch = make_batch(get_task("copy"), vocab, random.Random(0), [4, 2, 5])
    logp, _ = model.score(batch.tokens, model.initial_state(3), batch.lengths)
    expected = -logp[batch.target].mean()
    every_real = -logp[torch.arange(logp.shape[1])[None] < batch.lengths[:, None]].mean()
    loss = output_loss(model, batch)
    assert torch.allclose(loss, expected, atol=1e-6)
    assert not torch.allclose(loss, every_real, atol=1e-3)  # the input positions would change it


def test_greedy_correct_matches_argmax_of_each_prefix_scored_alone():
    model, vocab = tiny_model("sort")
    model.eval()
    batch = make_batch(get_task("sort"), vocab, random.Random(1), [4] * 24)
    hit = greedy_correct(model, batch)
    ref = torch.zeros_like(hit)
    B, T = batch.tokens.shape
    with torch.no_grad():
        for t in range(T):
            if batch.target[0, t]:
                dist, _ = model.step(batch.tokens[:, :t], model.initial_state(B))
                ref[:, t] = dist.argmax(-1) == batch.tokens[:, t]
    assert torch.equal(hit, ref)
    assert 0 < int(hit.sum()) < int(batch.target.sum())  # neither vacuous nor trivially all right


def test_curriculum_grows_by_one_only_on_a_perfect_batch():
    cur = Curriculum(length=5, max_length=7)
    assert not cur.record(0.99) and (cur.length, cur.solved) == (5, 0)
    assert cur.record(1.0) and (cur.length, cur.solved) == (6, 5)
    assert not cur.record(0.0) and (cur.length, cur.solved) == (6, 5)
    assert cur.record(1.0) and (cur.length, cur.solved) == (7, 6)
    assert not cur.finished
    assert cur.record(1.0) and (cur.length, cur.solved) == (7, 7)
    assert cur.finished
    assert [h["length"] for h in cur.history] == [5, 6, 7]


def test_real_copy_run_grows_only_after_perfect_held_out_batches():
    r = run_task(TaskConfig(task="copy", preset="tiny", overrides=TINY, steps=400, eval_every=20, eval_batch=32,
                            start_length=1, seed=3, final_examples=64, progress=False))
    assert r["solved_length"] >= 2  # it grew past the start length
    evals = r["evals"]  # [step, length, held-out exact-match accuracy]
    assert evals[0][1] == 1 and any(acc < 1.0 for _, _, acc in evals)
    for (_, n, acc), (_, n_next, _) in zip(evals, evals[1:]):
        assert n_next == (n + 1 if acc == 1.0 else n)
    assert [h["length"] for h in r["solved_at"]] == list(range(1, r["solved_length"] + 1))
    # the check after the budget is the last entry; it solves its length only when perfect
    assert evals[-1][1:] == [r["final_length"], r["final_accuracy"]]
    assert r["final_length"] == r["solved_length"] + (r["final_accuracy"] < 1.0)


def test_unknown_task_names_the_choices():
    with pytest.raises(ConfigError, match="unknown task 'sorting'.*multiply"):
        get_task("sorting")


def test_unknown_preset_is_a_config_error():
    with pytest.raises(ConfigError, match="unknown preset 'huge'"):
        run_task(TaskConfig(task="copy", preset="huge", steps=1, progress=False))


@pytest.mark.parametrize("args,needle", [(["--task", "sorting", "--model", "tiny"], "unknown task 'sorting'"),
                                         (["--task", "copy", "--model", "huge"], "unknown preset 'huge'")])
def test_cli_bad_names_exit_2_with_one_line(args, needle):
    proc = run_cli("tasks", *args, "--steps", "1", "--quiet")
    assert proc.returncode == 2
    lines = [x for x in proc.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and needle in lines[0], proc.stderr


def test_cli_prints_one_json_record():
    proc = run_cli("tasks", "--task", "not", "--model", "tiny", *[f"--set={k}={v}" for k, v in TINY.items()],
                   "--steps", "3", "--eval-every", "2", "--threads", "1", "--quiet")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout.strip().splitlines()
    assert len(out) == 1
    r = json.loads(out[0])
    assert (r["task"], r["model"], r["steps"], r["final_length"]) == ("not", "tiny", 3, 5)
    assert "task not, model tiny" in proc.stderr
