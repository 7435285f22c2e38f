"""Every registered model satisfies `StatefulLM`, optional capabilities included."""

import pytest
import torch
from test_state_contract import V, shrunk

from smallstate_lm.models import MODELS, PRESETS, build_model
from smallstate_lm.state import LMState, StatefulLM

# one preset per registered arch, shrunk like the state-contract tests
ARCH_PRESETS = {arch: next(name for name, cfg in PRESETS.items() if cfg.arch == arch) for arch in MODELS}
OPTIONAL = ("score_tree", "log_probs_all", "aux_loss", "after_step")


@pytest.fixture(params=list(MODELS), ids=list(MODELS))
def model(request):
    torch.manual_seed(0)
    return build_model(shrunk(ARCH_PRESETS[request.param], shared_kv=False)).eval()


def test_every_model_is_a_stateful_lm_with_every_optional_member(model):
    assert isinstance(model, StatefulLM)
    for name in OPTIONAL:
        member = getattr(model, name)
        assert member is None or callable(member), name
    assert model.max_history is None or (isinstance(model.max_history, int) and model.max_history >= 0)
    assert isinstance(model.state_numel_fixed(), int) and model.state_numel_fixed() >= 0
    assert isinstance(model.report(), dict)


def test_class_level_capabilities_match_the_instances():
    """Callers may ask the class (`MODELS[arch].log_probs_all is not None`) before building one."""
    for arch, cls in MODELS.items():
        m = build_model(shrunk(ARCH_PRESETS[arch], shared_kv=False))
        for name in OPTIONAL:
            assert (getattr(cls, name) is None) == (getattr(m, name) is None), (arch, name)


@torch.no_grad()
def test_advertised_score_tree_and_log_probs_all_have_the_documented_shapes(model):
    B, T = 2, 5
    tokens = torch.randint(0, V, (B, T))
    lengths = torch.tensor([T, 3])
    if model.log_probs_all is not None:
        logp, state = model.log_probs_all(tokens, model.initial_state(B), lengths)
        assert logp.shape == (B, T, V) and isinstance(state, LMState)
        assert torch.allclose(logp[0].exp().sum(-1), torch.ones(T), atol=1e-4)
        assert (logp[1, 3:] == 0).all()
    if model.score_tree is not None:
        parents = torch.tensor([[-1, 0, 1, 1, -1], [-1, 0, 0, 9, 9]])
        lp = model.score_tree(tokens, parents, lengths)
        assert lp.shape == (B, T) and (lp[0] < 0).all() and (lp[1, 3:] == 0).all()
