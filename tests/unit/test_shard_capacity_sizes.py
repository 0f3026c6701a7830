"""Sizes torch's symbolic shapes compute with its own functions, in the sharding ILP.

The reference MoE with a capacity (moe-tiny-capacity) captures its capacity C = min(N,
ceil(cf * N * K / E)) as `Min(32*s0, CeilToInt(FloatTrueDiv(2.0*ToFloat(32*s0), 4.0)))`.
`shard_ilp` evaluated sizes with `sympy.sympify(text).subs(...)`, which leaves torch's names
unevaluated, and `float()` raised TypeError: the planner skipped tp for the model ("tp=2 skipped:
the sharding search failed"). `search.sym_size` gives those names their meaning; checked here
against the sizes the capture itself recorded (every node's element count at the example batch),
then through the ILP and the joint planner. tests/dist/test_tp_moe_capacity.py trains the plan.
"""
import math

import pytest
import torch

import autopar
from autopar.models import get
from autopar.passes.rules.sharding import value_shape
from autopar.search.planner import clear_cache, plan_for
from autopar.search.shard_ilp import solve_sharding
from autopar.search.sym_size import numel, size_value


@pytest.fixture(scope="module")
def capacity_graph():
    torch.manual_seed(0)
    spec = get("moe-tiny-capacity")
    x, _ = spec.example_batch(8, generator=torch.Generator().manual_seed(0))
    return autopar.capture(spec.build(), x)


def _hint(d) -> int:
    return d if isinstance(d, int) else int(d.node.hint)


def test_every_size_of_the_capacity_graph_evaluates_to_what_the_capture_recorded(capacity_graph):
    gm = capacity_graph
    ph = next(n for n in gm.graph.nodes if n.op == "placeholder")
    sym = ph.meta["val"].shape[0]
    values = {str(sym.node.expr): _hint(sym)}
    checked = with_functions = 0
    for n in gm.graph.nodes:
        val = n.meta.get("val")
        shape = value_shape(n)
        if not isinstance(val, torch.Tensor) or shape is None:
            continue
        want = math.prod(_hint(d) for d in val.shape)
        assert numel(shape, values) == want, (n.name, shape, want)
        checked += 1
        with_functions += any("CeilToInt" in str(d) for d in shape)
    assert checked > 100 and with_functions >= 2, (checked, with_functions)


def test_torch_size_functions_have_their_python_meaning():
    at = (("s0", 7),)
    assert size_value("Min(32*s0, CeilToInt(FloatTrueDiv(2.0*ToFloat(32*s0), 4.0)))", at) == min(224, math.ceil(112))
    assert size_value("FloorDiv(s0, 2) + PythonMod(s0, 3) + CeilDiv(s0, 4)", at) == 3 + 1 + 2
    assert size_value("Max(1, TruncToInt(IntTrueDiv(s0, 2)))", at) == 3
    with pytest.raises(ValueError, match=r"no value for symbol\(s\) \['s1'\]"):
        size_value("s0*s1", at)
    with pytest.raises(ValueError, match="cannot evaluate"):
        size_value("NotATorchFunction(s0)", at)


def test_the_sharding_ilp_solves_tp2_on_the_capacity_model(capacity_graph):
    sol = solve_sharding(capacity_graph, "tp", 2, mesh={"tp": 2}, hardware="h100-sxm")
    assert sol.status == "optimal", sol.summary()
    assert sol.param_placements(), "h100-sxm: the ILP shards some parameter at tp=2"
    torch.testing.assert_close(sol.comm_s, sol.recounted_comm_s, rtol=1e-6, atol=1e-12)


def test_the_planner_searches_tp_for_the_capacity_model_and_says_nothing_was_skipped(capacity_graph):
    clear_cache()
    plan, report = plan_for(capacity_graph, 2, "h100-sxm")
    assert not report.search.get("ilp_failed"), report.search.get("ilp_failed")
    assert not [n for n in plan.notes + report.notes if "skipped" in n and "tp" in n]
    # pinned to tp = 2, the plan is a tp plan (it was the infeasible error before: no tp candidate costed)
    clear_cache()
    tp_plan, _ = plan_for(capacity_graph, {"tp": 2}, "h100-sxm")
    assert tp_plan.mesh.get("tp") == 2 and tp_plan.strategies.get("tp"), tp_plan.mesh
    assert any(str(lay["tp"]).startswith("S(") for lay in tp_plan.param_layouts.values() if "tp" in dict(lay.axes))
