"""The service's cost model (smallstate_lm/service/cost.py): calibration keeps the quiet runs of its
measurements, and a per-call cost larger than a slice does not shrink the worker's grains to nothing."""

from __future__ import annotations

import time

from smallstate_lm.device import fastest_seconds
from smallstate_lm.service.cost import CostModel


def test_timed_keeps_each_measurements_fastest_run_taken_in_turns():
    calls = {"a": 0, "b": 0}

    def loaded_at_first(name: str):  # load lands on the first rounds of one measurement only
        def fn() -> None:
            calls[name] += 1
            if name == "a" and calls[name] <= 3:
                time.sleep(0.05)
        return fn

    a, b = fastest_seconds(loaded_at_first("a"), loaded_at_first("b"), rounds=5)
    assert calls == {"a": 6, "b": 6}  # one warm-up run, then five rounds of both
    assert a < 0.04 and b < 0.04


def test_a_call_cost_over_the_budget_gives_grains_of_half_a_budget_at_least():
    cm = CostModel(node_s=1e-4, node_depth_s=0.0, call_s=0.2)
    budget = 0.05
    assert cm.grain_nodes(10, budget) == int(budget / 2 / 1e-4)
    # a list of 100,000 nodes is predicted in those grains, not in 12,500 calls of 8 nodes
    seconds = cm.nbest_seconds(100_000, 10, 0, neural=True, ngram=False, step_s=budget)
    assert seconds < 100_000 * 1e-4 + (100_000 // 250 + 1) * 0.2 + 1e-9
