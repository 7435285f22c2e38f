"""Adaptive span: the mask, the span loss and clamping, the report, and the cache
that shrinks with the spans."""

import pytest
import torch

from smallstate_lm.errors import ConfigError
from smallstate_lm.models import build_model, get_preset
from smallstate_lm.models.adaptive_span import AdaptiveSpanMask

V = 40
TOL = 1e-5


def tiny(**extra):
    cfg = get_preset("span-small").replace(vocab_size=V, n_layers=2, ff_per_layer=1, d_model=16, n_heads=2,
                                           d_ff=32, d_embed=None, dropout=0.0, span_max=8, span_ramp=2,
                                           span_init=0.5)
    return cfg.replace(**extra)


def set_spans(model, spans_per_layer):
    """Set every layer's spans z (in positions)."""
    with torch.no_grad():
        for m, z in zip(model.span_masks(), spans_per_layer):
            m.span.copy_(torch.tensor(z, dtype=torch.float32) / m.max_span)


def test_mask_values_on_a_worked_example():
    # z = 3, R = 2: m(x) = clamp((2 + 3 - x) / 2, 0, 1) -> 1 up to x = 3, 0.5 at x = 4, 0 from x = 5 on
    mask = AdaptiveSpanMask(n_heads=1, max_span=8, ramp=2, init=3 / 8)
    m = mask(torch.arange(7))
    assert torch.allclose(m, torch.tensor([[1.0, 1.0, 1.0, 1.0, 0.5, 0.0, 0.0]]))
    assert mask.max_history() == 5  # ceil(3) + 2


def test_mask_is_zero_from_the_maximum_span_on():
    mask = AdaptiveSpanMask(n_heads=1, max_span=4, ramp=2, init=1.0)  # z = 4: the ramp would reach x = 5
    assert torch.equal(mask(torch.arange(6)), torch.tensor([[1.0, 1.0, 1.0, 1.0, 0.0, 0.0]]))
    assert mask.max_history() == 4  # capped at S


def test_log_mask_softmax_equals_masking_weights_and_renormalising():
    torch.manual_seed(0)
    mask = AdaptiveSpanMask(n_heads=3, max_span=8, ramp=2, init=0.0)
    with torch.no_grad():
        mask.span.copy_(torch.tensor([0.1, 0.45, 0.9]))
    dist = torch.arange(8)
    scores = torch.randn(3, 8)
    w = scores.softmax(-1) * mask(dist)
    expected = w / w.sum(-1, keepdim=True)
    got = (scores + mask.log_mask(dist)).softmax(-1)
    assert torch.allclose(got, expected, atol=1e-6)


@torch.no_grad()
def test_trimmed_cache_gives_the_same_scores_as_the_whole_history():
    torch.manual_seed(0)
    model = build_model(tiny()).eval()
    set_spans(model, [[0.5, 2.7], [1.0, 0.0]])  # max_history = ceil(2.7) + 2 = 5 < S = 8
    tokens = torch.randint(0, V, (2, 20))
    results = []
    for trim in (True, False):
        model.trim_cache = trim
        state, parts = model.initial_state(2), []
        for a, b in ((0, 7), (7, 8), (8, 15), (15, 20)):
            lp, state = model.score(tokens[:, a:b], state)
            parts.append(lp)
        results.append((torch.cat(parts, 1), state.length))
    (trimmed, n_trimmed), (whole, n_whole) = results
    assert (n_trimmed, n_whole) == (5, 20)  # <s> and 19 tokens have been run
    assert (trimmed - whole).abs().max() <= TOL


@torch.no_grad()
def test_state_shrinks_with_the_spans():
    torch.manual_seed(0)
    model = build_model(tiny()).eval()
    tokens = torch.randint(0, V, (2, 11))
    set_spans(model, [[8.0, 8.0], [8.0, 0.0]])
    _, big = model.score(tokens, model.initial_state(2))
    set_spans(model, [[0.0, 0.0], [1.5, 0.0]])
    _, small = model.score(tokens, model.initial_state(2))
    assert (big.length, model.max_history, small.length) == (8, 4, 4)  # ceil(1.5) + 2 = 4
    assert small.nbytes * 2 == big.nbytes


@torch.no_grad()
def test_span_bounds_how_far_back_a_token_matters():
    # spans 0, R = 2: each layer sees distances 0 and 1, so two layers see 2 inputs back
    torch.manual_seed(0)
    model = build_model(tiny()).eval()
    set_spans(model, [[0.0, 0.0], [0.0, 0.0]])
    tokens = torch.randint(0, V, (1, 10))
    changed = tokens.clone()
    changed[0, 3] = (changed[0, 3] + 1) % V
    lp, _ = model.score(tokens, model.initial_state(1))
    lp2, _ = model.score(changed, model.initial_state(1))
    # token 3 is the input that predicts target 4, so it reaches targets 4, 5 and 6 only
    assert (lp2[0, :3] - lp[0, :3]).abs().max() <= TOL
    assert (lp2[0, 4:7] - lp[0, 4:7]).abs().min() > 0
    assert (lp2[0, 7:] - lp[0, 7:]).abs().max() <= TOL


def test_span_loss_is_the_coefficient_times_the_summed_spans():
    model = build_model(tiny(span_loss=0.01))
    set_spans(model, [[1.0, 2.0], [3.0, 8.0]])
    assert abs(model.aux_loss().item() - 0.01 * 14.0) < 1e-6


def test_after_step_clamps_spans_to_the_allowed_range():
    model = build_model(tiny())
    with torch.no_grad():
        model.span_masks()[0].span.copy_(torch.tensor([-0.3, 1.7]))
    model.after_step()
    assert model.span_masks()[0].span.tolist() == [0.0, 1.0]


def test_span_loss_and_token_loss_both_train_the_spans():
    # spans start at 0, the edge `after_step` clamps to: gradients must still reach them
    torch.manual_seed(0)
    model = build_model(tiny(span_loss=0.1, span_init=0.0)).train()
    tokens = torch.randint(0, V, (3, 9))
    model.aux_loss().backward()
    grad_aux = model.span_masks()[0].span.grad.clone()
    assert torch.allclose(grad_aux, torch.full((2,), 0.1 * 8))  # d(0.1 * 8 * span) / d span
    model.zero_grad()
    lp, _ = model.score(tokens, model.initial_state(3), torch.tensor([9, 5, 2]))
    (-lp.sum()).backward()
    assert all(m.span.grad.abs().sum() > 0 for m in model.span_masks())
    assert model.layers[0].attn.bias.pos.grad.abs().sum() > 0


def test_report_lists_each_layers_spans_in_positions():
    model = build_model(tiny(n_layers=3))
    rep = model.report()
    spans = [v for k, v in rep.items() if k.startswith("spans")]
    assert len(spans) == 3 and all(s == [4.0, 4.0] for s in spans)  # span_init 0.5 of S = 8
    assert rep["max_history"] == 6


def test_config_errors_are_clear():
    with pytest.raises(ConfigError, match="span_max"):
        build_model(tiny(span_max=0))
    with pytest.raises(ConfigError, match="shared_kv"):
        build_model(tiny(shared_kv=True))
