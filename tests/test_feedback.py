"""The feedback-memory LM: what goes into the memory, when, and how much of it is kept."""

import random

import pytest
import torch

from smallstate_lm.errors import ConfigError
from smallstate_lm.models import build_model, count_parameters, get_preset

V = 30
TOL = 1e-5


def tiny(**overrides):
    cfg = get_preset("feedback-small").replace(vocab_size=V, n_layers=2, ff_per_layer=2, d_model=16, n_heads=2,
                                               d_ff=24, d_embed=8, dropout=0.0)
    return cfg.replace(**overrides)


def model_with_mixed_layers(**overrides):
    """A tiny model whose layer weights are far from uniform, so each layer's share shows."""
    torch.manual_seed(0)
    m = build_model(tiny(**overrides)).eval()
    with torch.no_grad():
        m.memory_logits.copy_(torch.tensor([0.5, -1.0, 1.5]))
    return m


def test_layer_weights_are_a_softmax_summing_to_one():
    m = model_with_mixed_layers()
    w = m.memory_weights().detach()
    assert w.shape == (3,)  # the embedding output and both layers
    assert bool((w > 0).all())
    assert abs(float(w.sum()) - 1.0) < 1e-6
    assert torch.allclose(w, torch.exp(m.memory_logits) / torch.exp(m.memory_logits).sum())
    assert abs(sum(m.report()["memory_weights"]) - 1.0) < 1e-3


@torch.no_grad()
def test_memory_entry_is_the_weighted_sum_of_every_layer_output():
    m = model_with_mixed_layers()
    layer_in, layer_out, memory = [], [], []
    hooks = [m.layers[0].register_forward_pre_hook(lambda mod, args: layer_in.append(args[0].clone())),
             m.memory_norm.register_forward_pre_hook(lambda mod, args: memory.append(args[0].clone()))]
    hooks += [layer.register_forward_hook(lambda mod, args, out: layer_out.append(out.clone())) for layer in m.layers]
    m.score(torch.randint(0, V, (2, 4)), m.initial_state(2))
    for h in hooks:
        h.remove()
    w = m.memory_weights()
    assert len(memory) == 4 and len(layer_in) == 4 and len(layer_out) == 8
    for t in range(4):
        expected = w[0] * layer_in[t] + w[1] * layer_out[2 * t] + w[2] * layer_out[2 * t + 1]
        assert (memory[t] - expected).abs().max() <= 1e-6


@torch.no_grad()
def test_memory_of_a_step_is_built_after_all_its_layers_ran():
    m = model_with_mixed_layers()
    events = []
    hooks = [layer.register_forward_hook(lambda mod, args, out, i=i: events.append(f"layer{i}"))
             for i, layer in enumerate(m.layers)]
    hooks.append(m.memory_norm.register_forward_hook(lambda mod, args, out: events.append("memory")))
    m.score(torch.randint(0, V, (1, 3)), m.initial_state(1))
    assert events == ["layer0", "layer1", "memory"] * 3
    events.clear()
    m.step(torch.randint(0, V, (1, 2)), m.initial_state(1))
    # step also reads out its newest token, whose memory entry waits for the next call
    assert events == ["layer0", "layer1", "memory"] * 2 + ["layer0", "layer1"]
    for h in hooks:
        h.remove()


@torch.no_grad()
def test_changing_a_token_changes_no_earlier_memory_entry():
    m = model_with_mixed_layers()
    tokens = torch.randint(0, V, (2, 8))
    _, ref = m.score(tokens, m.initial_state(2))
    assert ref.length == 8  # entries for <s> and tokens[:, :7]; tokens[:, 7] is still pending
    for j in (0, 3, 7):
        changed = tokens.clone()
        changed[:, j] = (changed[:, j] + 11) % V
        _, st = m.score(changed, m.initial_state(2))
        # entry i holds the step whose input is token i-1: entries 0..j cannot see token j
        assert torch.equal(st.keys[:, : j + 1], ref.keys[:, : j + 1])
        assert torch.equal(st.values[:, : j + 1], ref.values[:, : j + 1])
        if j + 1 < 8:
            assert (st.keys[:, j + 1] - ref.keys[:, j + 1]).abs().max() > 1e-4


@torch.no_grad()
def test_first_step_attends_to_its_own_input():
    m = model_with_mixed_layers()
    dist, st = m.step(torch.zeros(2, 0, dtype=torch.long), m.initial_state(2))
    assert st.length == 0
    assert bool(torch.isfinite(dist).all())
    assert torch.allclose(dist.logsumexp(-1), torch.zeros(2), atol=1e-5)


@pytest.mark.parametrize("shared", [True, False])
@torch.no_grad()
def test_state_numel_shared_kv_versus_per_layer(shared):
    m = model_with_mixed_layers(feedback_shared_kv=shared)
    groups = 1 if shared else 2
    assert m.state_numel_per_position() == 2 * groups * 16
    _, st = m.score(torch.randint(0, V, (3, 5)), m.initial_state(3))
    assert st.keys.shape == (3, 5, groups, 16)
    assert st.nbytes == 3 * 5 * m.state_numel_per_position() * 4


def test_per_layer_kv_adds_one_projection_per_extra_layer():
    shared = count_parameters(model_with_mixed_layers(feedback_shared_kv=True))
    per_layer = count_parameters(model_with_mixed_layers(feedback_shared_kv=False))
    assert per_layer - shared == (2 - 1) * 2 * 16 * 16  # presets are bias-free


@torch.no_grad()
def test_mem_len_caps_the_state():
    m = model_with_mixed_layers(mem_len=3)
    assert m.max_history == 3
    assert model_with_mixed_layers(mem_len=0).max_history is None
    tokens = torch.randint(0, V, (2, 7))
    st = m.initial_state(2)
    for t in range(7):
        _, st = m.score(tokens[:, t : t + 1], st)
        assert st.length == min(t + 1, 3)
    _, whole = m.score(tokens, m.initial_state(2))
    assert whole.length == 3
    assert torch.allclose(whole.keys, st.keys, atol=TOL)


@torch.no_grad()
def test_mem_len_window_equals_unbounded_memory_until_the_cap_is_crossed():
    capped, unbounded = model_with_mixed_layers(mem_len=3), model_with_mixed_layers(mem_len=0)
    tokens = torch.randint(0, V, (2, 8))
    a, _ = capped.score(tokens, capped.initial_state(2))
    b, _ = unbounded.score(tokens, unbounded.initial_state(2))
    # target t is predicted by step t, which reads entries [t-3, t): all of them while t <= 3
    assert (a[:, :4] - b[:, :4]).abs().max() <= TOL
    assert (a[:, 4:] - b[:, 4:]).abs().max() > 1e-4


@pytest.mark.parametrize("shared", [True, False])
@torch.no_grad()
def test_mem_len_results_do_not_depend_on_the_split(shared):
    m = model_with_mixed_layers(mem_len=3, feedback_shared_kv=shared)
    tokens = torch.randint(0, V, (3, 10))
    full, _ = m.score(tokens, m.initial_state(3))
    rng = random.Random(0)
    for cuts in ([1, 2, 3, 4, 5, 6, 7, 8, 9], sorted(rng.sample(range(1, 10), 3)), [5]):
        st, parts = m.initial_state(3), []
        for a, b in zip([0] + cuts, cuts + [10]):
            lp, st = m.score(tokens[:, a:b], st)
            parts.append(lp)
        assert (torch.cat(parts, 1) - full).abs().max() <= TOL
    # rows of different lengths in one padded batch, continued in a second call
    lengths = torch.tensor([6, 2, 4])
    lp1, st = m.score(tokens[:, :6], m.initial_state(3), lengths)
    lp2, _ = m.score(tokens[:, 6:], st)
    for r in range(3):
        n = int(lengths[r])
        alone, _ = m.score(torch.cat([tokens[r, :n], tokens[r, 6:]])[None], m.initial_state(1))
        assert (torch.cat([lp1[r, :n], lp2[r]]) - alone[0]).abs().max() <= TOL


@pytest.mark.parametrize("shared", [True, False])
def test_gradients_match_finite_differences(shared):
    """In float64, through two calls (the second padded) so the gradient also crosses
    the state. The hidden states stand in for the log-probs, which the output layer
    computes in float32."""
    m = model_with_mixed_layers(mem_len=3, feedback_shared_kv=shared, bias=True).double()
    torch.manual_seed(1)
    with torch.no_grad():  # away from the initialisation's near-zero activations, where ReLU kinks crowd
        for p in m.parameters():
            p.add_(0.1 * torch.randn_like(p))
    tokens = torch.randint(0, V, (2, 6))
    lengths = torch.tensor([3, 1])
    r = torch.randn(2, 7, 16, dtype=torch.float64)

    def loss():
        h1, st = m._run(tokens[:, :3], m.initial_state(2), None, include_last=False)
        h2, st = m._run(tokens[:, 3:], st, lengths, include_last=True)
        return (h1 * r[:, :3]).sum() + (h2 * r[:, 3:]).sum() + (st.keys * st.values).sum()

    loss().backward()
    gen = torch.Generator().manual_seed(2)
    for name, p in m.named_parameters():
        if name.startswith("output."):  # not part of the hidden states
            continue
        assert p.grad is not None, name
        for _ in range(2):
            i = int(torch.randint(0, p.numel(), (1,), generator=gen))
            flat = p.data.view(-1)
            with torch.no_grad():
                flat[i] += 1e-6
                up = float(loss())
                flat[i] -= 2e-6
                down = float(loss())
                flat[i] += 1e-6
            fd = (up - down) / 2e-6
            assert abs(fd - float(p.grad.view(-1)[i])) <= 1e-6 + 1e-5 * abs(fd), name


def test_training_batch_reaches_every_parameter():
    torch.manual_seed(0)
    m = build_model(tiny(dropout=0.1)).train()
    tokens = torch.randint(0, V, (3, 9))
    logp, _ = m.score(tokens, m.initial_state(3), torch.tensor([9, 4, 7]))
    (-logp.sum() / 20).backward()
    for name, p in m.named_parameters():
        assert p.grad is not None and bool(torch.isfinite(p.grad).all()), name
        assert float(p.grad.abs().max()) > 0, name


def test_keys_as_values_is_refused_with_a_clear_error():
    with pytest.raises(ConfigError, match="shared_kv=False"):
        build_model(tiny(shared_kv=True))
