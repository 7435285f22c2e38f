"""Rotary positions: attention sees distances only, so cached keys keep their meaning."""

import pytest
import torch

from smallstate_lm.errors import ConfigError
from smallstate_lm.models import build_model, get_preset
from smallstate_lm.models.base import apply_rotary, rotary_tables


def test_rotary_scores_depend_on_the_distance_only():
    torch.manual_seed(0)
    q, k = torch.randn(1, 2, 1, 8), torch.randn(1, 2, 1, 8)

    def logit(pq: int, pk: int) -> torch.Tensor:
        rq = apply_rotary(q, *rotary_tables(torch.tensor([[pq]]), 8))
        rk = apply_rotary(k, *rotary_tables(torch.tensor([[pk]]), 8))
        return (rq * rk).sum(-1)

    assert torch.allclose(logit(7, 3), logit(17, 13), atol=1e-5)
    assert torch.allclose(logit(0, 0), (q * k).sum(-1), atol=1e-6)  # position 0 is the identity
    assert not torch.allclose(logit(7, 3), logit(7, 4), atol=1e-3)


def test_rotary_model_tells_word_order_apart():
    """Without positions the last layer's query sees its history as an unordered set of
    keys; with rotary positions swapping two history tokens changes the prediction."""
    torch.manual_seed(0)
    cfg = get_preset("tiny").replace(vocab_size=30, n_layers=1, dropout=0.0)
    model = build_model(cfg.replace(pos="rotary")).eval()
    a, b = torch.tensor([[5, 6, 7, 8]]), torch.tensor([[6, 5, 7, 8]])  # the same input (7) before the last
    with torch.no_grad():
        la, _ = model.score(a, model.initial_state(1))
        lb, _ = model.score(b, model.initial_state(1))
        flat = build_model(cfg).eval()
        flat.load_state_dict(model.state_dict())
        fa, _ = flat.score(a, flat.initial_state(1))
        fb, _ = flat.score(b, flat.initial_state(1))
    assert abs(float(fa[0, 3] - fb[0, 3])) < 1e-5  # one layer, no positions: order-blind
    assert abs(float(la[0, 3] - lb[0, 3])) > 1e-4


@pytest.mark.parametrize("overrides, message", [
    ({"pos": "rotary", "arch": "lstm"}, "for arch 'transformer' only"),
    ({"pos": "alibi"}, "pos must be"),
])
def test_rotary_config_is_checked(overrides, message):
    with pytest.raises(ConfigError, match=message):
        get_preset("tiny").replace(vocab_size=30, **overrides).validate()
