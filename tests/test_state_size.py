"""State numbers per position for the full-size presets, and the bytes a state holds."""

import pytest
import torch

from smallstate_lm.models import build_model, get_preset

EXPECTED = {"8L-3F-sharedkv": 6_144, "8L-3F": 12_288, "32L-1F": 49_152}


@pytest.mark.parametrize("name", list(EXPECTED))
def test_full_size_state_numel_and_nbytes(name):
    cfg = get_preset(name).replace(vocab_size=64, dropout=0.0)
    with torch.device("meta"):
        model = build_model(cfg)
    # Real (uninitialised) CPU memory at full width; the values do not matter for sizes.
    model = model.to_empty(device="cpu").eval()
    for p in model.parameters():
        p.data.normal_(0, 0.02)
    assert model.state_numel_per_position() == EXPECTED[name]
    B, T = 2, 5
    with torch.no_grad():
        state = model.initial_state(B)
        assert state.nbytes == 0
        _, state = model.score(torch.randint(0, 64, (B, T)), state)
    assert state.nbytes == B * T * EXPECTED[name] * 4
    bf = state.map_tensors(lambda t: t.to(torch.bfloat16) if t.is_floating_point() else t)
    assert bf.nbytes == B * T * EXPECTED[name] * 2
