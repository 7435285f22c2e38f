"""The state contract's invariants (smallstate_lm/state.py) for every preset (shrunk in width, not in structure)."""

import random

import pytest
import torch

from smallstate_lm.models import PRESETS, build_model, get_preset

V = 40
TOL = 1e-5


def shrunk(name: str, shared_kv: bool, **extra):
    """The preset at d=32 with its caps small enough that an 11-token test crosses them."""
    cfg = get_preset(name)
    caps = {}
    if cfg.mem_len:
        caps["mem_len"] = 6
    if cfg.span_max:
        caps.update(span_max=8, span_ramp=4, span_init=0.5)
    if cfg.n_persistent:
        caps["n_persistent"] = 4
    if cfg.arch == "active_memory":
        caps["conv_kernel"] = 4
    return cfg.replace(**{"vocab_size": V, "d_model": 32, "n_heads": 4, "d_ff": 48,
                          "d_embed": 16 if cfg.d_embed else None, "dropout": 0.0, "shared_kv": shared_kv,
                          **caps, **extra})


# Transformer presets with and without shared K/V (with rotary positions the values are the
# rotated keys), each transformer preset also with the other position scheme; every other
# preset as it is.
VARIANTS = [(name, kv, {}) for name in PRESETS for kv in (False, True) if PRESETS[name].arch == "transformer"]
VARIANTS += [(name, False, {"pos": "none" if PRESETS[name].pos == "rotary" else "rotary"}) for name in PRESETS
             if PRESETS[name].arch == "transformer"]
VARIANTS += [(name, False, {}) for name in PRESETS if PRESETS[name].arch != "transformer"]
IDS = [f"{n}{'-kv' if kv else ''}{'-pos=' + extra['pos'] if extra else ''}" for n, kv, extra in VARIANTS]


@pytest.fixture(params=VARIANTS, ids=IDS)
def model(request):
    torch.manual_seed(0)
    name, kv, extra = request.param
    return build_model(shrunk(name, kv, **extra)).eval()


def full_and_tokens(model, B=3, T=11):
    tokens = torch.randint(0, V, (B, T))
    with torch.no_grad():
        logp, state = model.score(tokens, model.initial_state(B))
    return tokens, logp, state


@torch.no_grad()
def test_token_by_token_equals_one_call(model):
    tokens, full, _ = full_and_tokens(model)
    state, parts = model.initial_state(tokens.shape[0]), []
    for t in range(tokens.shape[1]):
        lp, state = model.score(tokens[:, t : t + 1], state)
        parts.append(lp)
    assert (torch.cat(parts, 1) - full).abs().max() <= TOL


@torch.no_grad()
def test_random_splits_equal_one_call(model):
    tokens, full, _ = full_and_tokens(model)
    rng = random.Random(1)
    for _ in range(3):
        cuts = sorted(rng.sample(range(1, tokens.shape[1]), 3))
        state, parts = model.initial_state(tokens.shape[0]), []
        for a, b in zip([0] + cuts, cuts + [tokens.shape[1]]):
            lp, state = model.score(tokens[:, a:b], state)
            parts.append(lp)
        assert (torch.cat(parts, 1) - full).abs().max() <= TOL


@torch.no_grad()
def test_later_tokens_never_change_earlier_scores(model):
    tokens, full, _ = full_and_tokens(model)
    for j in (1, 5, 10):
        changed = tokens.clone()
        changed[:, j] = (changed[:, j] + 7) % V
        lp, _ = model.score(changed, model.initial_state(tokens.shape[0]))
        assert (lp[:, :j] - full[:, :j]).abs().max() <= TOL
        assert (lp[:, j] - full[:, j]).abs().max() > 0  # the changed target itself does change


@torch.no_grad()
def test_select_branching_equals_recomputing_each_branch(model):
    prefix = torch.randint(0, V, (2, 5))
    _, state = model.score(prefix, model.initial_state(2))
    rows = [0, 0, 1, 1, 1]
    branches = torch.randint(0, V, (5, 4))
    lp, _ = model.score(branches, state.select(rows))
    for i, r in enumerate(rows):
        whole = torch.cat([prefix[r], branches[i]])[None]
        ref, _ = model.score(whole, model.initial_state(1))
        assert (lp[i] - ref[0, 5:]).abs().max() <= TOL


@torch.no_grad()
def test_padded_batch_equals_rows_alone_across_calls(model):
    tokens = torch.randint(0, V, (3, 7))
    lengths = torch.tensor([7, 3, 0])
    lp1, s1 = model.score(tokens, model.initial_state(3), lengths)
    more = torch.randint(0, V, (3, 4))
    lp2, s2 = model.score(more, s1, torch.tensor([2, 4, 4]))
    for b in range(3):
        n1, n2 = int(lengths[b]), [2, 4, 4][b]
        whole = torch.cat([tokens[b, :n1], more[b, :n2]])[None]
        ref, _ = model.score(whole, model.initial_state(1))
        got = torch.cat([lp1[b, :n1], lp2[b, :n2]])
        assert (got - ref[0]).abs().max() <= TOL
        assert (lp1[b, n1:] == 0).all() and (lp2[b, n2:] == 0).all()
    # the padded state still continues exactly like the rows alone
    last = torch.randint(0, V, (3, 1))
    lp3, _ = model.score(last, s2)
    for b in range(3):
        whole = torch.cat([tokens[b, : int(lengths[b])], more[b, : [2, 4, 4][b]], last[b]])[None]
        ref, _ = model.score(whole, model.initial_state(1))
        assert abs(float(lp3[b, 0] - ref[0, -1])) <= TOL


@torch.no_grad()
def test_step_distribution_matches_score(model):
    tokens, full, state = full_and_tokens(model)
    dist, st = model.step(tokens[:, :6], model.initial_state(tokens.shape[0]))
    assert dist.shape == (tokens.shape[0], V)
    assert torch.allclose(dist.logsumexp(-1), torch.zeros(tokens.shape[0]), atol=1e-5)
    assert (dist.gather(1, tokens[:, 6:7])[:, 0] - full[:, 6]).abs().max() <= TOL
    lp, _ = model.score(tokens[:, 6:], st)  # step leaves the same state as score
    assert (lp - full[:, 6:]).abs().max() <= TOL


@torch.no_grad()
def test_cat_and_assemble_equal_the_rows_alone(model):
    """States of different history lengths stacked (cat) or gathered row by row
    (assemble), compacted, continue exactly like each row alone."""
    a_tok, b_tok = torch.randint(0, V, (2, 3)), torch.randint(0, V, (3, 7))
    _, sa = model.score(a_tok, model.initial_state(2))
    _, sb = model.score(b_tok, model.initial_state(3))
    hist = [a_tok[0], a_tok[1], b_tok[0], b_tok[1], b_tok[2]]
    nxt = torch.randint(0, V, (5, 4))
    cat = type(sa).cat([sa, sb]).compact()
    order = [3, 0, 4, 1, 2]  # row i of the result comes from hist[order[i]]
    asm = type(sa).assemble([(sa, torch.tensor([0, 1]), torch.tensor([1, 3])),
                             (sb, torch.tensor([0, 1, 2]), torch.tensor([4, 0, 2]))], 5).compact()
    lp_cat, _ = model.score(nxt, cat)
    lp_asm, _ = model.score(nxt[order], asm)
    for i in range(5):
        ref, _ = model.score(torch.cat([hist[i], nxt[i]])[None], model.initial_state(1))
        assert (lp_cat[i] - ref[0, -4:]).abs().max() <= TOL
    for i, src in enumerate(order):
        ref, _ = model.score(torch.cat([hist[src], nxt[src]])[None], model.initial_state(1))
        assert (lp_asm[i] - ref[0, -4:]).abs().max() <= TOL


def test_adaptive_softmax_keeps_the_invariants():
    torch.manual_seed(0)
    m = build_model(shrunk("tiny", False, softmax="adaptive", adaptive_cutoffs=[10, 25],
                           tie_embeddings=False)).eval()
    tokens, full, _ = full_and_tokens(m)
    with torch.no_grad():
        state, parts = m.initial_state(3), []
        for t in range(tokens.shape[1]):
            lp, state = m.score(tokens[:, t : t + 1], state)
            parts.append(lp)
        dist, _ = m.step(tokens[:, :0], m.initial_state(3))
    assert (torch.cat(parts, 1) - full).abs().max() <= TOL
    assert torch.allclose(dist.exp().sum(-1), torch.ones(3), atol=1e-5)


def test_score_checks_its_arguments(model):
    state = model.initial_state(2)
    with pytest.raises(ValueError, match="batch"):
        model.score(torch.zeros(3, 2, dtype=torch.long), state)
    with pytest.raises(ValueError, match="token ids"):
        model.score(torch.full((2, 2), V, dtype=torch.long), state)
    with pytest.raises(ValueError, match="lengths"):
        model.score(torch.zeros(2, 2, dtype=torch.long), state, torch.tensor([3, 1]))


@torch.no_grad()
def test_tree_attention_equals_scoring_each_path(model):
    if model.score_tree is None:
        pytest.skip("no tree attention for this model; the scorer walks tries through select()")
    # trie: 0:a -> 1:b -> {2:c, 3:d -> 4:e}, 5:f (a second root)
    tok = torch.randint(0, V, (1, 6))
    parents = torch.tensor([[-1, 0, 1, 1, 3, -1]])
    lp = model.score_tree(tok, parents)
    for path in ([0, 1, 2], [0, 1, 3, 4], [5]):
        ref, _ = model.score(tok[:, path], model.initial_state(1))
        assert (lp[0, path] - ref[0]).abs().max() <= TOL
    # padded rows in one batch give the same numbers
    tok2 = torch.cat([tok, torch.randint(0, V, (1, 6))])
    par2 = torch.cat([parents, torch.tensor([[-1, 0, 0, 9, 9, 9]])])
    lp2 = model.score_tree(tok2, par2, torch.tensor([6, 3]))
    assert (lp2[0] - lp[0]).abs().max() <= TOL and (lp2[1, 3:] == 0).all()


@torch.no_grad()
def test_step_with_no_tokens_gives_the_distribution_after_the_history(model):
    tokens, full, state = full_and_tokens(model)
    dist, st = model.step(tokens[:, :0], state)
    assert dist.shape == (tokens.shape[0], V)
    assert torch.allclose(dist.logsumexp(-1), torch.zeros(tokens.shape[0]), atol=1e-5)
    nxt = torch.randint(0, V, (tokens.shape[0], 1))
    lp, _ = model.score(nxt, st)
    assert (dist.gather(1, nxt)[:, 0] - lp[:, 0]).abs().max() <= TOL


@torch.no_grad()
def test_a_state_holds_no_hidden_buffers(model):
    """A capped state after a long call must not keep the call's whole buffers alive."""
    _, state = model.score(torch.randint(0, V, (2, 40)), model.initial_state(2))
    held = sum(t.untyped_storage().nbytes() for t in {t.untyped_storage().data_ptr(): t
                                                       for t in state._tensors()}.values())
    assert held <= 2 * state.total_nbytes + 1024
