"""The sharding search on one process: what the ILP promises about its answers.

(Running the plans it picks is tests/dist/test_tensor_parallel.py; each rule's strategies
are run on gloo by tests/dist/test_shard_rules_sweep.py.)"""
import pytest
import torch

import autopar
from autopar.models import get
from autopar.passes.plan import Plan
from autopar.passes.rules.sharding import strategies_for
from autopar.runtime.placement import Layout, S
from autopar.search.shard_ilp import solve_sharding


def _gm(name, batch=8):
    spec = get(name)
    torch.manual_seed(0)
    x, _ = spec.example_batch(batch, generator=torch.Generator().manual_seed(0))
    return autopar.capture(spec.build(), x)


@pytest.fixture(scope="module")
def gpt():
    return _gm("gpt-tiny")


def test_objective_equals_the_plans_recounted_communication(gpt):
    for hw in ("cpu-gloo", "h100-sxm"):
        sol = solve_sharding(gpt, "tp", 2, hardware=hw)
        assert sol.status == "optimal" and sol.gap is not None and sol.gap <= 1e-6
        # the formulation's communication term is what the rewrite will insert, conversion by conversion
        assert sol.comm_s == pytest.approx(sol.recounted_comm_s, rel=1e-6, abs=1e-12)


def test_identical_layers_share_variables_and_get_the_same_strategies(gpt):
    sol = solve_sharding(gpt, "tp", 2, hardware="h100-sxm")
    assert sol.repeated_layers == 1  # gpt-tiny has two identical blocks
    by_key = sol.strategies()
    l0 = {k.replace("layers.0", "L"): v for k, v in by_key.items() if k.startswith("layers.0")}
    l1 = {k.replace("layers.1", "L"): v for k, v in by_key.items() if k.startswith("layers.1")}
    assert l0 == l1
    untied = solve_sharding(gpt, "tp", 2, hardware="h100-sxm", tie_layers=False)
    assert untied.objective_s == pytest.approx(sol.objective_s, rel=1e-6)  # tying lost nothing here


def test_pins_are_honoured_and_bad_pins_are_clear_errors(gpt):
    sol = solve_sharding(gpt, "tp", 2, hardware="h100-sxm", param_pins={"lm_head.weight": S(1)})
    assert sol.param_placements()["lm_head.weight"] == S(1)
    with pytest.raises(ValueError, match="lm_head.weight is not valid here"):
        solve_sharding(gpt, "tp", 2, param_pins={"lm_head.weight": S(2)})


def test_memory_limit_forces_sharding():
    gm = _gm("gpt-tiny")
    free = solve_sharding(gm, "tp", 4, hardware="cpu-gloo")
    assert not free.param_placements()  # on gloo a tiny model is cheapest replicated
    limit = free.memory_bytes * 0.6
    tight = solve_sharding(gm, "tp", 4, hardware="cpu-gloo", memory_limit=limit)
    assert tight.param_placements() and tight.memory_bytes <= limit
    assert tight.objective_s >= free.objective_s
    with pytest.raises(ValueError, match="memory limit"):
        solve_sharding(gm, "tp", 4, hardware="cpu-gloo", memory_limit=1000)


def test_uneven_dims_are_excluded_with_the_reason():
    gm = _gm("vit-tiny")
    sol = solve_sharding(gm, "tp", 2, hardware="h100-sxm")
    assert any("does not divide by tp=2" in e for e in sol.excluded)
    # no chosen strategy shards an uneven dim
    for n, s in sol.chosen.items():
        if isinstance(s.out, type(S(0))):
            shape = n.meta["autopar"].shape if n.meta["autopar"].shape is not None else None
            if shape is not None and isinstance(shape[s.out.dim], int):
                assert shape[s.out.dim] % 2 == 0, (n.name, s)


def test_op_without_rule_is_replicated_and_listed():
    class Odd(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(8, 8)

        def forward(self, x):
            return torch.special.i0(self.lin(x))  # no sharding rule for i0

    gm = autopar.capture(Odd(), (torch.randn(4, 8),))
    node = next(n for n in gm.graph.nodes if "i0" in str(n.target))
    v = strategies_for(node, "tp", 2)
    assert v.unruled and [str(s) for s in v.strategies] == ["R->R"]
    sol = solve_sharding(gm, "tp", 2)
    assert sol.unruled["aten.special_i0.default"] == 1


def test_plan_with_strategies_round_trips_through_json(gpt):
    sol = solve_sharding(gpt, "tp", 2, hardware="h100-sxm")
    plan = Plan(mesh={"tp": 2}, dp_axis=None, strategies={"tp": sol.strategies()},
                param_layouts={k: Layout.of({"tp": p}) for k, p in sol.param_placements().items()})
    back = Plan.from_json(plan.to_json())
    assert back.strategies == plan.strategies and back.param_layouts == plan.param_layouts
