"""`autopar plan`'s table names every parallel dimension of the plan it prints: context
parallelism (cp's size and the attention exchange it runs) and expert parallelism (ep's size and
its MoE blocks) have rows of their own, "none" without them."""
from autopar.passes.plan import Plan
from autopar.tools.plan_view import _context_text, _expert_text


def test_the_context_and_expert_rows_name_the_axis_and_what_runs_on_it():
    plain = Plan(mesh={"dp": 4})
    assert _context_text(plain) == "none" and _expert_text(plain) == "none"
    cp = Plan(mesh={"dp": 2, "cp": 2}, extra={"context": {"method": "ulysses"}})
    assert _context_text(cp) == "cp=2, ulysses attention exchange"
    ep = Plan(mesh={"dp": 2, "ep": 4}, extra={"expert": {"axis": "ep", "blocks": {"layers.0.moe": {}, "layers.1.moe": {}}}})
    assert _expert_text(ep) == "ep=4, 2 MoE blocks"
    assert _expert_text(Plan(mesh={"dp": 1, "ep": 2})) == "ep=2, MoE blocks found at build"
