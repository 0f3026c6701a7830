"""The joint planner's in-process cache hands out copies: a caller that edits the plan or the
report it got (notes, nested extra entries, the report's reasons) changes nothing that a later
identical request gets back."""
import copy

import torch

import autopar
from autopar.models import get
from autopar.search.planner import clear_cache, plan_for


def test_edits_to_a_returned_plan_and_report_do_not_reach_the_next_caller():
    torch.manual_seed(0)
    spec = get("gpt-tiny")
    x, _ = spec.example_batch(8, generator=torch.Generator().manual_seed(0))
    gm = autopar.capture(spec.build(), x)
    clear_cache()
    p1, r1 = plan_for(gm, 2, "cpu-gloo")
    first = copy.deepcopy((p1.to_dict(), r1.to_dict()))  # to_dict may share lists with the plan
    p1.notes.append("edited by the first caller")
    p1.extra["planner"]["edited"] = True  # a nested entry
    p1.predicted["step_s"] = -1.0
    r1.notes.append("edited reason")
    p2, r2 = plan_for(gm, 2, "cpu-gloo")
    assert r2.search.get("cached") is True  # the same request, answered from the cache
    assert p2.to_dict() == first[0]
    second = r2.to_dict()
    second["search"] = first[1]["search"]  # only the timing and the "cached" flag may differ
    assert second == first[1]
