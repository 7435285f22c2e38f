"""The LSTM LM beyond the generic contract tests: state layout, padded rows, full distributions."""

import pytest
import torch

from smallstate_lm.models import build_model, get_preset

V = 30


def tiny_lstm(**extra):
    cfg = get_preset("lstm-small").replace(vocab_size=V, d_model=16, d_embed=8, dropout=0.0, **extra)
    return build_model(cfg).eval()


@torch.no_grad()
def test_state_is_h_and_c_per_layer_batch_first_and_does_not_grow():
    m = tiny_lstm()
    s0 = m.initial_state(3)
    _, s = m.score(torch.randint(0, V, (3, 9)), s0)
    for st in (s0, s):
        assert st.h.shape == st.c.shape == (3, 2, 16)  # (B, n_layers, d_model)
        assert st.nbytes == 0  # nothing stored per position
        assert st.total_nbytes == m.state_numel_fixed() * 3 * 4
    assert m.state_numel_per_position() == 0 and m.state_numel_fixed() == 2 * 2 * 16
    assert m.max_history == 0


@torch.no_grad()
def test_padded_rows_end_in_their_own_state_and_an_empty_row_keeps_its_state():
    m = tiny_lstm()
    _, s0 = m.score(torch.randint(0, V, (3, 2)), m.initial_state(3))  # a non-initial start state
    tokens = torch.randint(0, V, (3, 5))
    lengths = torch.tensor([5, 0, 2])
    lp, s = m.score(tokens, s0, lengths)
    assert torch.equal(s.h[1], s0.h[1]) and torch.equal(s.c[1], s0.c[1])
    assert (lp[1] == 0).all() and (lp[2, 2:] == 0).all()
    for b in (0, 2):
        _, alone = m.score(tokens[b : b + 1, : int(lengths[b])], s0.select([b]))
        assert torch.allclose(s.h[b], alone.h[0], atol=1e-6) and torch.allclose(s.c[b], alone.c[0], atol=1e-6)


@torch.no_grad()
def test_every_row_empty_leaves_the_state_unchanged():
    m = tiny_lstm()
    s0 = m.initial_state(2)
    lp, s = m.score(torch.randint(0, V, (2, 4)), s0, torch.tensor([0, 0]))
    assert (lp == 0).all() and torch.equal(s.h, s0.h) and torch.equal(s.c, s0.c)


@torch.no_grad()
def test_log_probs_all_are_distributions_whose_targets_are_the_scores():
    m = tiny_lstm()
    tokens, lengths = torch.randint(0, V, (3, 6)), torch.tensor([6, 4, 0])
    s0 = m.initial_state(3)
    lp_all, s_all = m.log_probs_all(tokens, s0, lengths)
    lp, s = m.score(tokens, s0, lengths)
    assert lp_all.shape == (3, 6, V)
    assert torch.allclose(lp_all.gather(2, tokens[:, :, None])[:, :, 0], lp, atol=1e-6)
    real = torch.arange(6)[None] < lengths[:, None]
    assert torch.allclose(lp_all[real].logsumexp(-1), torch.zeros(int(real.sum())), atol=1e-5)
    assert (lp_all[~real] == 0).all()
    assert torch.equal(s_all.h, s.h) and torch.equal(s_all.c, s.c)


def test_training_gradients_reach_every_parameter_through_a_padded_batch():
    m = build_model(get_preset("lstm-small").replace(vocab_size=V, d_model=16, d_embed=8, dropout=0.1)).train()
    tokens, lengths = torch.randint(0, V, (4, 7)), torch.tensor([7, 3, 1, 5])
    logp, _ = m.score(tokens, m.initial_state(4), lengths)
    (-logp.sum()).backward()
    for name, p in m.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


@pytest.mark.parametrize("d_embed", [None, 8])
def test_embedding_projection_only_when_widths_differ(d_embed):
    m = tiny_lstm() if d_embed else build_model(get_preset("lstm-small").replace(
        vocab_size=V, d_model=16, d_embed=None, dropout=0.0))
    assert (m.embed_proj is None) == (d_embed is None) and (m.output.proj is None) == (d_embed is None)
    assert m.output.weight is m.embed.weight  # tied
    # 4 gates x (input + recurrent) weights and two biases per layer, plus the embedding side
    e = d_embed or 16
    lstm = 2 * (4 * 16 * 16 * 2 + 2 * 4 * 16)
    proj = 0 if d_embed is None else 2 * e * 16
    assert sum(p.numel() for p in m.parameters()) == V * e + V + lstm + proj
