"""Transformer-XL: relative positions, the memory, its cap and training through it."""

import math

import pytest
import torch

from smallstate_lm.errors import ConfigError
from smallstate_lm.models import build_model, get_preset
from smallstate_lm.models.transformer_xl import RelativeAttention, rel_shift, sinusoid

V = 30


def tiny(**over):
    cfg = get_preset("xl-small").replace(vocab_size=V, n_layers=2, ff_per_layer=1, d_model=16, n_heads=2, d_ff=24,
                                         d_embed=8, dropout=0.0, mem_len=6)
    return cfg.replace(**over)


def model_of(**over):
    torch.manual_seed(0)
    return build_model(tiny(**over)).eval()


def test_rel_shift_puts_each_distance_at_its_key():
    # 3 queries after S = 1 memory position, K = 4 keys; query i sits at key position
    # 1 + i. Column r of the input is distance K - 1 - r = 3 - r; entry = 10 * (i + 1) + distance.
    x = torch.tensor([[13.0, 12, 11, 10],
                      [23, 22, 21, 20],
                      [33, 32, 31, 30]])
    out = rel_shift(x)
    # out[i, j] must hold distance (1 + i) - j of row i wherever j is not after the query.
    expected = torch.tensor([[11.0, 10, 0, 0],
                             [22, 21, 20, 0],
                             [33, 32, 31, 30]])
    causal = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]], dtype=torch.bool)
    assert torch.equal(out[causal], expected[causal])


def _attention_by_formula(attn, h, n_query, u, v, allowed):
    """score(i, j) = ((q_i + u).k_j + (q_i + v).W_r R_{i-j}) / sqrt(Dh), pair by pair."""
    B, K, d = h.shape
    H, Dh, S = attn.h, attn.dh, K - n_query
    q = attn.q(h).view(B, K, H, Dh)  # (B, K, H, Dh)
    k = attn.k(h).view(B, K, H, Dh)  # (B, K, H, Dh)
    val = attn.v(h).view(B, K, H, Dh)  # (B, K, H, Dh)
    out = torch.zeros(B, n_query, H, Dh)
    for b in range(B):
        for hd in range(H):
            for i in range(n_query):
                qi = q[b, S + i, hd]
                scores = []
                for j in range(K):
                    r = attn.w_r(sinusoid(torch.tensor([float(S + i - j)]), d))[0].view(H, Dh)[hd]  # (Dh,)
                    s = ((qi + u[hd]) @ k[b, j, hd] + (qi + v[hd]) @ r) / math.sqrt(Dh)
                    scores.append(s if allowed[i, j] else torch.tensor(float("-inf")))
                p = torch.softmax(torch.stack(scores), 0)  # (K,)
                out[b, i, hd] = p @ val[b, :, hd]
    return attn.o(out.reshape(B, n_query, d))  # (B, n_query, d)


def _attention_case():
    torch.manual_seed(0)
    cfg = tiny()
    attn = RelativeAttention(cfg).eval()
    u = torch.randn(cfg.n_heads, cfg.d_model // cfg.n_heads, requires_grad=True)
    v = torch.randn(cfg.n_heads, cfg.d_model // cfg.n_heads, requires_grad=True)
    S, T = 2, 3
    h = torch.randn(2, S + T, cfg.d_model)
    dist = (torch.arange(T)[:, None] + S) - torch.arange(S + T)[None, :]
    allowed = (dist >= 0) & (dist <= 3)  # a window that cuts off the oldest key for the last query
    pos = sinusoid(torch.arange(S + T - 1, -1, -1), cfg.d_model)
    return attn, h, T, u, v, allowed, pos


def test_relative_attention_equals_the_formula():
    attn, h, T, u, v, allowed, pos = _attention_case()
    got = attn(h, T, pos, allowed, u, v)
    ref = _attention_by_formula(attn, h, T, u, v, allowed)
    assert (got - ref).abs().max() <= 1e-5


def test_relative_attention_gradients_equal_the_formula():
    attn, h, T, u, v, allowed, pos = _attention_case()
    w = torch.randn(2, T, h.shape[2])  # a random linear read-out of the outputs
    g_got = torch.autograd.grad((attn(h, T, pos, allowed, u, v) * w).sum(), [u, v, attn.w_r.weight])
    g_ref = torch.autograd.grad((_attention_by_formula(attn, h, T, u, v, allowed) * w).sum(),
                                [u, v, attn.w_r.weight])
    for a, b in zip(g_got, g_ref):
        assert (a - b).abs().max() <= 1e-5


@torch.no_grad()
def test_second_segment_on_memories_equals_one_pass():
    # mem_len 8 covers segment 1 (5 tokens) and the whole history of segment 2.
    m = model_of(mem_len=8)
    tokens = torch.randint(0, V, (2, 8), generator=torch.Generator().manual_seed(1))
    full, _ = m.score(tokens, m.initial_state(2))
    _, s1 = m.score(tokens[:, :5], m.initial_state(2))
    lp2, _ = m.score(tokens[:, 5:], s1)
    assert (lp2 - full[:, 5:]).abs().max() <= 1e-5


@torch.no_grad()
def test_context_reaches_n_layers_times_mem_len_back():
    # 2 layers, window 3: target t depends on inputs at positions >= t - 6, i.e. tokens[t - 7:].
    m = model_of(mem_len=3)
    tokens = torch.randint(0, V, (1, 12), generator=torch.Generator().manual_seed(2))
    base, _ = m.score(tokens, m.initial_state(1))
    changed = tokens.clone()
    changed[0, 2] = (changed[0, 2] + 1) % V
    lp, _ = m.score(changed, m.initial_state(1))
    assert (lp[0, 10:] - base[0, 10:]).abs().max() <= 1e-6
    assert (lp[0, 9] - base[0, 9]).abs() > 1e-6


@torch.no_grad()
def test_memories_are_capped_at_mem_len_and_nbytes_counts_them():
    m = model_of(mem_len=6)
    cfg = m.cfg
    assert m.max_history == 6 and m.state_numel_per_position() == cfg.n_layers * cfg.d_model
    B = 3
    state = m.initial_state(B)
    assert state.nbytes == 0
    for n_tokens, kept in ((4, 4), (5, 6), (3, 6)):  # 4 positions run, then 9, then 12
        _, state = m.score(torch.randint(0, V, (B, n_tokens)), state)
        assert all(t.shape == (B, kept, cfg.d_model) for t in state.mems)
        assert state.nbytes == B * kept * m.state_numel_per_position() * 4


def test_detached_state_carries_no_graph_and_training_reaches_u_v_w_r():
    m = model_of(dropout=0.1).train()
    tokens = torch.randint(0, V, (2, 14), generator=torch.Generator().manual_seed(3))
    lp1, s1 = m.score(tokens[:, :7], m.initial_state(2))
    assert all(t.grad_fn is not None for t in s1.mems)
    carried = s1.detach()
    assert all(t.grad_fn is None and not t.requires_grad for t in carried.mems)
    lp2, _ = m.score(tokens[:, 7:], carried)
    loss = -(lp1.mean() + lp2.mean())
    loss.backward()
    grads = [m.u.grad, m.v.grad] + [layer.attn.w_r.weight.grad for layer in m.layers]
    for g in grads:
        assert g is not None and torch.isfinite(g).all() and g.abs().sum() > 0


def test_odd_d_model_is_a_config_error():
    with pytest.raises(ConfigError, match="even d_model"):
        build_model(tiny(d_model=15, n_heads=3))
