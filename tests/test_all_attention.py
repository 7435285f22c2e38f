"""All-attention: the joint softmax over context and persistent slots, the
persistent vectors, and the span variant against the generic state invariants."""

import math

import pytest
import test_state_contract as contract
import torch

from smallstate_lm.errors import ConfigError
from smallstate_lm.models import build_model, get_preset
from smallstate_lm.models.adaptive_span import Geometry

# `contract`: the generic invariant checks of tests/test_state_contract.py, reused as plain functions
V = contract.V


def tiny(**extra):
    cfg = get_preset("allatt-small").replace(vocab_size=V, n_layers=2, d_model=16, n_heads=2, d_embed=None,
                                             dropout=0.0, n_persistent=4)
    return cfg.replace(**extra)


def heads(model, x):
    """Queries and keys of layer 0's attention for inputs x (B, n, d): each (B, H, n, Dh)."""
    attn = model.layers[0].attn
    B, n, d = x.shape
    q = attn.q(x).view(B, n, attn.h, attn.dh).transpose(1, 2)  # (B, H, n, Dh)
    k = attn.k(x).view(B, n, attn.h, attn.dh).transpose(1, 2)  # (B, H, n, Dh)
    return attn, q, k


@pytest.mark.parametrize("span_max", [0, 4])
@torch.no_grad()
def test_weights_over_context_and_persistent_slots_sum_to_one(span_max):
    torch.manual_seed(0)
    model = build_model(tiny(span_max=span_max, span_ramp=1, span_init=0.0)).eval()
    attn, q, k = heads(model, torch.randn(2, 6, 16))
    # row 1 has two cached positions of left padding in front of its 4 real ones
    cache_mask = torch.tensor([[True, True], [False, False]])
    geo = Geometry.build(4, 2, cache_mask, span_max or None, q.device)
    w = attn.weights(q[:, :, 2:], k, geo)  # (B, H, 4, 6 + 4)
    assert w.shape == (2, 2, 4, 10)
    assert torch.allclose(w.sum(-1), torch.ones(2, 2, 4), atol=1e-6)
    ctx, pers = w[..., :6], w[..., 6:]
    assert (ctx.masked_select(~geo.allowed.expand_as(ctx)) == 0).all()  # future and padding
    assert (pers > 0).all()  # persistent slots are never masked
    if span_max:  # span 0, ramp 1: a query sees only itself in its context
        assert torch.equal(ctx > 0, torch.eye(6, dtype=torch.bool)[2:].expand_as(ctx))


@torch.no_grad()
def test_persistent_vectors_alone_answer_a_query_without_context():
    torch.manual_seed(0)
    model = build_model(tiny()).eval()
    attn = model.layers[0].attn
    q = torch.randn(1, 2, 1, 8)  # (B, H, n, Dh)
    none = torch.empty(1, 2, 0, 8)
    geo = Geometry(dist=torch.empty(1, 0, dtype=torch.long), allowed=torch.ones(1, 1, 1, 0, dtype=torch.bool))
    y = attn.attend(q, none, none, geo)
    # by hand, with the reparameterisation k = sqrt(Dh) k', v = sqrt(N) v'
    k = attn.pk * math.sqrt(8)  # (H, N, Dh)
    v = attn.pv * math.sqrt(4)
    w = ((q[0] @ k.transpose(1, 2)) / math.sqrt(8)).softmax(-1)  # (H, 1, N)
    assert torch.allclose(y[0], w @ v, atol=1e-6)


def test_persistent_vectors_start_at_the_papers_scales():
    torch.manual_seed(0)
    attn = build_model(tiny(d_model=64, n_heads=2, n_persistent=256)).layers[0].attn  # Dh = 32, N = 256
    assert abs(attn.pk.std().item() - 1 / math.sqrt(32)) < 0.01
    assert abs(attn.pv.std().item() - 1 / math.sqrt(256)) < 0.002
    k, v = attn.persistent()
    assert abs(k.std().item() - 1.0) < 0.05 and abs(v.std().item() - 1.0) < 0.05


def test_no_feed_forward_sublayers_allowed():
    with pytest.raises(ConfigError, match="ff_per_layer"):
        build_model(tiny(ff_per_layer=1))


def test_history_is_unbounded_without_a_span_and_capped_with_one():
    assert build_model(tiny()).max_history is None
    spanned = build_model(tiny(span_max=8, span_ramp=2, span_init=0.25))
    assert spanned.max_history == 4  # ceil(0.25 * 8) + 2
    assert spanned.aux_loss().item() > 0 and len(spanned.report()) == 3  # 2 layers + max_history


# The span variant, shrunk like the generic contract tests, through the same checks.
@pytest.fixture
def span_model():
    torch.manual_seed(0)
    cfg = contract.shrunk("allatt-small", False, span_max=8, span_ramp=4, span_init=0.25)
    return build_model(cfg).eval()


@pytest.mark.parametrize("check", [
    contract.test_token_by_token_equals_one_call,
    contract.test_random_splits_equal_one_call,
    contract.test_later_tokens_never_change_earlier_scores,
    contract.test_select_branching_equals_recomputing_each_branch,
    contract.test_padded_batch_equals_rows_alone_across_calls,
    contract.test_step_distribution_matches_score,
    contract.test_cat_and_assemble_equal_the_rows_alone,
], ids=lambda f: f.__name__.removeprefix("test_"))
def test_span_variant_keeps_the_invariants(span_model, check):
    assert span_model.max_history == 6  # ceil(2) + 4: the 11-token checks cross it
    check(span_model)
