"""The pass manager times and verifies passes, writes numbered deterministic dumps with a
header per pass, only on change, and leaves a reproducer when a pass fails; plans round-trip."""
import torch
import pytest

import autopar
from autopar.models import get
from autopar.passes import ir
from autopar.passes.dump import strip_timings
from autopar.passes.pass_manager import PassContext, PassError, PassManager
from autopar.passes.plan import Plan
from autopar.passes.split_batch import split_batch
from autopar.runtime.placement import Layout, R, S, P, parse_placement


def _gm():
    spec = get("gpt-tiny")
    torch.manual_seed(0)
    return autopar.capture(spec.build(), spec.example_batch(4)[0])


def noop(gm, ctx):
    return gm


def add_grad_all_reduce(gm, ctx):
    """Insert an identity-forward collective after the embedding (a toy rewrite)."""
    import autopar.runtime.collectives  # noqa: F401  registers torch.ops.autopar.*
    emb = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.embedding.default)
    with gm.graph.inserting_after(emb):
        new = gm.graph.call_function(torch.ops.autopar.grad_all_reduce.default, (emb, "dp"))
    emb.replace_all_uses_with(new, delete_user_cb=lambda u: u is not new)
    ir.copy_meta(emb, new)
    return gm


def forgets_meta(gm, ctx):
    out = next(n for n in gm.graph.nodes if n.op == "output")
    with gm.graph.inserting_before(out):
        gm.graph.call_function(torch.ops.aten.zeros.default, ([1],))
    return gm


def boom(gm, ctx):
    raise RuntimeError("deliberate")


def test_dumps_are_numbered_headed_only_on_change_and_deterministic(tmp_path):
    ctx = PassContext(plan=Plan(mesh={"dp": 2}), mesh_sizes={"dp": 2})
    texts = []
    for run in range(2):
        d = tmp_path / f"run{run}"
        pm = PassManager([noop, split_batch, add_grad_all_reduce], dump_dir=str(d))
        pm.run(_gm(), ctx)
        files = sorted(p.name for p in d.iterdir())
        assert files == ["00_captured.py", "02_split_batch.py", "03_add_grad_all_reduce.py"]
        head = (d / "03_add_grad_all_reduce.py").read_text().splitlines()[0]
        assert head.startswith("# made by add_grad_all_reduce (") and "+1 grad_all_reduce" in head
        texts.append(strip_timings((d / "03_add_grad_all_reduce.py").read_text()))
        assert [r.changed for r in pm.records] == [False, True, True]
    assert texts[0] == texts[1]
    assert "/root" not in texts[0] and "0x" not in texts[0]


def test_a_dumped_program_runs_and_equals_the_graph(tmp_path):
    gm = _gm()
    x = get("gpt-tiny").example_batch(4)[0]
    ref = gm(*x)[0]
    ctx = PassContext(plan=Plan(mesh={"dp": 1}), mesh_sizes={"dp": 1})
    gm2 = PassManager([split_batch], dump_dir=str(tmp_path)).run(gm, ctx)
    torch.testing.assert_close(gm2(*x)[0], ref)


def test_pass_creating_unannotated_nodes_is_rejected_and_failure_leaves_reproducer(tmp_path):
    ctx = PassContext(plan=Plan(mesh={"dp": 1}), mesh_sizes={"dp": 1})
    with pytest.raises(PassError, match="without autopar annotations"):
        PassManager([forgets_meta]).run(_gm(), ctx)
    with pytest.raises(PassError, match="pass 'boom' failed: RuntimeError: deliberate"):
        PassManager([boom], dump_dir=str(tmp_path)).run(_gm(), ctx)
    assert (tmp_path / "01_boom.FAILED.py").exists()


def test_plan_round_trips_through_json_and_rejects_bad_values():
    p = Plan(mesh={"dp": 2, "tp": 2}, zero_stage=2, param_layouts={"w": Layout.of({"dp": R, "tp": S(1)})},
             split_points=["layers.1"], recompute={"layers.0": "full"})
    assert Plan.from_json(p.to_json()) == p
    for bad in ({"mesh": {"dp": 0}}, {"mesh": {"dp": 2}, "zero_stage": 4}, {"mesh": {"tp": 2}}):
        with pytest.raises(ValueError):
            Plan(**bad)
    with pytest.raises(ValueError, match="unknown plan fields"):
        Plan.from_dict({"mesh": {"dp": 1}, "tp_degree": 2})
    assert [str(parse_placement(s)) for s in ("R", "S(2)", "P(sum)")] == ["R", "S(2)", "P(sum)"]
    assert str(Layout.of({"tp": S(1), "dp": R})) == "{tp: S(1), dp: R}" and str(P("avg")) == "P(avg)"
