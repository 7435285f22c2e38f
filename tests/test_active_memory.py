"""Active-memory mixers: their special cases, the window state and its fixed size."""

import pytest
import torch

from smallstate_lm.errors import ConfigError
from smallstate_lm.models import build_model, get_preset
from smallstate_lm.models.active_memory import CONV1D_MIN_T, CGRUMixer, HighwayConvMixer
from smallstate_lm.vocab import BOS_ID

V, K = 30, 4


def tiny(name: str, **extra):
    sizes = dict(vocab_size=V, d_model=16, n_heads=2, d_ff=32, d_embed=8, n_layers=2, ff_per_layer=1,
                 dropout=0.0, conv_kernel=K)
    cfg = get_preset(name).replace(**{**sizes, **extra})
    torch.manual_seed(0)
    return build_model(cfg).eval()


def mixer_inputs(k: int = K, T: int = 5, d: int = 16):
    return torch.randn(2, k - 1, d), torch.randn(2, T, d)


@torch.no_grad()
def test_persistent_conv_with_zero_padding_equals_zero_padded_conv():
    pconv, conv = tiny("pconv-small"), tiny("conv-small")
    conv.load_state_dict({n: p for n, p in pconv.state_dict().items() if n != "padding"})
    tokens = torch.randint(0, V, (2, 6))
    ref, _ = conv.score(tokens, conv.initial_state(2))
    learned, _ = pconv.score(tokens, pconv.initial_state(2))
    assert (learned - ref).abs().max() > 1e-4  # the padding vectors do reach the scores
    pconv.padding.zero_()
    got, _ = pconv.score(tokens, pconv.initial_state(2))
    assert (got - ref).abs().max() <= 1e-6


@torch.no_grad()
def test_highway_conv_with_closed_gate_is_identity():
    torch.manual_seed(0)
    mixer = HighwayConvMixer(get_preset("hconv-small").replace(d_model=16, conv_kernel=K))
    mixer.gate.weight.zero_()
    mixer.gate.bias.fill_(-5.0)  # 1.2 sigmoid(-5) - 0.1 < 0, so the gate is exactly 0
    past, u = mixer_inputs()
    y, _ = mixer(u, [past])
    assert torch.equal(y, u)


@torch.no_grad()
def test_cgru_with_open_update_gate_is_identity():
    torch.manual_seed(0)
    mixer = CGRUMixer(get_preset("cgru-small").replace(d_model=16, conv_kernel=K))
    mixer.update.weight.zero_()
    mixer.update.bias.fill_(5.0)  # 1.2 sigmoid(5) - 0.1 > 1, so the update gate is exactly 1
    past, u = mixer_inputs()
    y, _ = mixer(u, [past, torch.randn_like(past)])
    assert torch.equal(y, u)


@torch.no_grad()
def test_window_holds_each_rows_last_k_minus_1_inputs():
    """Row 0 has more than k-1 inputs, row 1 fewer: its window keeps padding in front."""
    model = tiny("conv-small")
    tokens = torch.randint(1, V, (2, 6))
    _, state = model.score(tokens, model.initial_state(2), torch.tensor([6, 1]))

    def first_mixer_input(ids):  # what layer 0's convolution reads for these input tokens
        return model.layers[0].norm(model.embed_proj(model.embed(ids)))

    bos = torch.tensor([BOS_ID])
    row0 = first_mixer_input(torch.cat([bos, tokens[0, :5]])[-(K - 1):])  # inputs: <s> and every target but the last
    row1 = torch.cat([torch.zeros(1, 16), first_mixer_input(bos)])  # inputs: <s> only (the target is pending)
    assert state.windows[0].shape == (2, K - 1, 16)
    assert torch.allclose(state.windows[0][0], row0, atol=1e-6)
    assert torch.allclose(state.windows[0][1, 1:], row1, atol=1e-6) and (state.windows[0][1, 0] == 0).all()


@pytest.mark.parametrize("name", ["conv-small", "cgru-small"])
@torch.no_grad()
def test_fixed_state_size_does_not_grow_with_history(name):
    model = tiny(name)
    sizes = []
    for T in (2, 3 * K):
        _, state = model.score(torch.randint(0, V, (3, T)), model.initial_state(3))
        assert state.nbytes == 0
        fixed = sum(t.numel() for t in state.windows + (state.gated or []))
        assert fixed == 3 * model.state_numel_fixed()
        sizes.append(state.total_nbytes)
    assert sizes[0] == sizes[1]
    assert model.state_numel_per_position() == 0 and model.max_history == K - 1


@torch.no_grad()
def test_attention_memory_grows_by_state_numel_per_position():
    model = tiny("sa-hconv-small")
    _, s5 = model.score(torch.randint(0, V, (3, 5)), model.initial_state(3))
    _, s9 = model.score(torch.randint(0, V, (3, 4)), s5)
    per_position = model.state_numel_per_position()
    assert per_position == 2 * 2 * 16
    assert s9.nbytes - s5.nbytes == 3 * 4 * per_position * 4
    assert sum(t.numel() for t in s9.windows) == 3 * model.state_numel_fixed()
    assert model.max_history is None


@torch.no_grad()
def test_long_call_equals_token_by_token():
    """A call long enough to take the F.conv1d path agrees with single-token calls."""
    model = tiny("sa-cgru-small")
    tokens = torch.randint(0, V, (2, CONV1D_MIN_T + 2))
    full, _ = model.score(tokens, model.initial_state(2))
    state, parts = model.initial_state(2), []
    for t in range(tokens.shape[1]):
        lp, state = model.score(tokens[:, t : t + 1], state)
        parts.append(lp)
    assert (torch.cat(parts, 1) - full).abs().max() <= 1e-5


@pytest.mark.parametrize("name", ["sa-pconv-small", "cgru-small"])
def test_training_reaches_every_parameter(name):
    model = tiny(name, dropout=0.1).train()
    tokens = torch.randint(0, V, (3, 7))
    logp, _ = model.score(tokens, model.initial_state(3), torch.tensor([7, 4, 2]))
    (-logp.sum()).backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert missing == []


def test_kernel_narrower_than_two_is_a_config_error():
    with pytest.raises(ConfigError, match="conv_kernel"):
        tiny("conv-small").cfg.replace(conv_kernel=1)
