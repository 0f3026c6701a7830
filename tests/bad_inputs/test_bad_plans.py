"""Plan files that are malformed, mistyped, or made for another model or mesh.

`Plan.from_json` / `Plan.load` refuse what is not a plan with a PlanFormatError (a ValueError)
naming the field and the expected type or range; `build.plan_check.check_plan_against_graph`
refuses a plan whose names or sizes do not fit the captured model and mesh, listing them, and a
plan stamped for another model, explaining how the models differ. A refused plan changes
nothing: the plan file and the graph are as they were. The positive controls (real plans pass,
a fitting plan passes) keep the checks from refusing everything.
"""
from __future__ import annotations

import copy
import json

import pytest

from autopar.build.plan_check import PlanMismatchError, axis_notes, check_plan_against_graph, stamp
from autopar.tools.model_source import resolve
from autopar.passes.plan import Plan, PlanFormatError
from autopar.tools.planning import capture_meta
from autopar.runtime.placement import Layout, R, S


@pytest.fixture(scope="module")
def gpt():
    return capture_meta(resolve("gpt-tiny"), 8, 32)


def _good() -> dict:
    p = Plan(mesh={"dp": 2, "tp": 2}, zero_stage=1, param_layouts={"lm_head.weight": Layout.of({"dp": R, "tp": S(0)})},
             strategies={"tp": {"lm_head:linear#0": "R,S(0)->S(2)"}}, fusions=["rms_norm"], recompute={"layers.0": "full"})
    return p.to_dict()


# --- the file's format -----------------------------------------------------------------------------
@pytest.mark.parametrize("edit, words", [
    (lambda d: d.update(zero_stage="2"), ["'zero_stage'", "integer from 0 to 3", "'2' (a string)"]),
    (lambda d: d.update(zero_stage=4), ["'zero_stage'", "integer from 0 to 3", "4"]),
    (lambda d: d["mesh"].update(tp=0), ["'mesh', axis 'tp'", "positive integer", "0"]),
    (lambda d: d.pop("mesh"), ["'mesh' is missing"]),
    (lambda d: d.update(mesh=[2, 2]), ["'mesh'", "non-empty object"]),
    (lambda d: d.update(n_microbatches=2.0), ["'n_microbatches'", "integer >= 1", "2.0 (a number)"]),
    (lambda d: d.update(bucket_mb=True), ["'bucket_mb'", "positive number", "True (a boolean)"]),
    (lambda d: d.update(dp_axis="data"), ["'dp_axis'", "'data' is not an axis"]),
    (lambda d: d["param_layouts"].update(x={"tp": "S(x)"}), ["'param_layouts', entry 'x'", "not a placement"]),
    (lambda d: d["param_layouts"].update(x={"pp": "S(0)"}), ["axis 'pp' is not an axis of the plan's mesh"]),
    (lambda d: d["param_layouts"].update(x="S(0)"), ["entry 'x'", "expected a layout"]),
    (lambda d: d["strategies"]["tp"].update(k=3), ["'strategies', axis 'tp', node 'k'", "strategy string"]),
    (lambda d: d.update(schedule="1f2b"), ["'schedule'", "unknown schedule '1f2b'", "1f1b"]),
    (lambda d: d["recompute"].update({"layers.1": "some"}), ["'recompute', module 'layers.1'", "'selective'"]),
    (lambda d: d.update(fusions=["swigloo"]), ["'fusions', entry 'swigloo'", "unknown fusion rule"]),
    (lambda d: d.update(split_points=["layers.1", "layers.1"]), ["'split_points'", "more than once"]),
    (lambda d: d.update(notes="fast"), ["'notes'", "list of strings"]),
    (lambda d: d.update(version=2), ["'version': 2 is not supported", "version 1"]),
    (lambda d: d.update(speed=1), ["unknown plan fields ['speed']"]),
])
def test_a_mistyped_plan_file_names_the_field_and_the_expected_type(tmp_path, unchanged, edit, words):
    d = _good()
    edit(d)
    f = tmp_path / "plan.json"
    f.write_text(json.dumps(d))
    with unchanged(tmp_path), pytest.raises(PlanFormatError) as e:
        Plan.load(str(f))
    assert isinstance(e.value, ValueError) and str(f) in str(e.value)
    for w in words:
        assert w in str(e.value), str(e.value)


def test_several_bad_fields_are_all_named_at_once():
    d = _good()
    d.update(zero_stage=-1, n_microbatches=0, schedule=7)
    with pytest.raises(PlanFormatError) as e:
        Plan.from_dict(d)
    for f in ("'zero_stage'", "'n_microbatches'", "'schedule'"):
        assert f in str(e.value)


@pytest.mark.parametrize("text, words", [
    ('{"mesh": {"dp": 2},', ["is not valid JSON", "line 1 column"]),
    ("[1, 2]", ["holds a list, not a plan"]),
    ("", ["is not valid JSON"]),
    ('{"mesh": {"dp": 2}, "zero_stage": NaN}', ["'zero_stage'", "nan"]),
])
def test_malformed_json_is_a_format_error_not_a_json_decode_error(tmp_path, text, words):
    f = tmp_path / "plan.json"
    f.write_text(text)
    with pytest.raises(PlanFormatError) as e:
        Plan.load(str(f))
    for w in words:
        assert w in str(e.value), str(e.value)


def test_a_missing_plan_file_is_named(tmp_path):
    with pytest.raises(PlanFormatError, match="there is no plan file at .*nope.json"):
        Plan.load(str(tmp_path / "nope.json"))


def test_every_plan_autopar_writes_passes_the_schema(gpt):
    from autopar.search.planner import plan_for

    plan, _ = plan_for(gpt, {"dp": 2, "tp": 2}, "h100-sxm", global_batch=8, top_k=1)
    stamp(plan, gpt)
    back = Plan.from_json(plan.to_json())
    assert back.to_dict() == json.loads(plan.to_json())
    assert back.graph["fingerprint"] and back.strategies["tp"]


# --- the plan against the model and the mesh --------------------------------------------------------
def _fit_plan(gpt) -> Plan:
    p = Plan(mesh={"dp": 1, "tp": 2}, param_layouts={"lm_head.weight": Layout.of({"dp": R, "tp": S(0)})},
             strategies={"tp": {"lm_head:linear#0": "R,S(0)->S(2)"}}, recompute={"layers.0": "full"})
    stamp(p, gpt)
    return p


def test_a_fitting_plan_passes_and_the_graph_is_not_touched(gpt):
    before = gpt.code
    assert check_plan_against_graph(_fit_plan(gpt), gpt, {"dp": 1, "tp": 2}) == []
    assert gpt.code == before


def test_a_plan_for_another_model_is_refused_whole_with_the_difference_explained(gpt):
    other = capture_meta(resolve("gpt-tiny-tied"), 8, 32)  # same names and shapes; the head is tied
    p = _fit_plan(other)
    with pytest.raises(PlanMismatchError) as e:
        check_plan_against_graph(p, gpt, {"dp": 1, "tp": 2})
    msg = str(e.value)
    assert "none of it was applied" in msg and "the plan is for another model" in msg
    assert p.graph["fingerprint"] in msg and "differ in name, shape or tying" in msg


@pytest.mark.parametrize("change, words", [
    (lambda p: p.param_layouts.update({"lm_head.wieght": Layout.of({"dp": R, "tp": S(0)})}),
     ["param_layouts names 1 parameters the model does not have", "'lm_head.wieght'", "did you mean 'lm_head.weight'"]),
    (lambda p: p.param_layouts.update({"norm.weight": Layout.of({"dp": R, "tp": S(1)})}),
     ["param_layouts['norm.weight'] shards dim 1", "shape (64,)"]),
    (lambda p: p.strategies["tp"].update({"layers.9.attn:linear#0": "R,S(0)->S(2)"}),
     ["strategies['tp'] names 1 nodes", "'layers.9.attn:linear#0'"]),
    (lambda p: p.node_layouts.update({"nowhere:add#0": Layout.of({"dp": R, "tp": S(0)})}),
     ["node_layouts names 1 nodes", "'nowhere:add#0'"]),
    (lambda p: setattr(p, "split_points", ["layers.1"]),
     ["split points ['layers.1'] but the mesh has no pp axis", "add pp=2"]),
    (lambda p: p.recompute.update({"layers.7": "full"}), ["recompute names 1 modules", "'layers.7'"]),
])
def test_a_plan_naming_what_the_model_does_not_have_is_refused_naming_it(gpt, change, words):
    p = _fit_plan(gpt)
    p.graph = {}  # a hand-written plan: checked name by name
    change(p)
    with pytest.raises(PlanMismatchError) as e:
        check_plan_against_graph(p, gpt, {"dp": 1, "tp": 2})
    for w in words:
        assert w in str(e.value), str(e.value)


def test_a_layout_that_does_not_divide_the_dimension_names_the_sizes_that_would(gpt):
    p = Plan(mesh={"dp": 1, "tp": 3}, param_layouts={"tok_emb.weight": Layout.of({"dp": R, "tp": S(0)})})
    with pytest.raises(PlanMismatchError) as e:
        check_plan_against_graph(p, gpt, {"dp": 1, "tp": 3})
    assert "shards dim 0 (size 128) over tp=3, which does not divide it; tp sizes that would: 2, 4, 8" in str(e.value)


def test_a_plan_for_another_mesh_or_axis_order_is_refused(gpt):
    p = _fit_plan(gpt)
    with pytest.raises(PlanMismatchError, match=r"the plan is for mesh dp=1,tp=2 but the mesh is tp=2,dp=1"):
        check_plan_against_graph(p, gpt, {"tp": 2, "dp": 1})
    q = Plan(mesh={"pp": 8, "dp": 1})
    with pytest.raises(PlanMismatchError, match=r"pp=8 needs at least 8 pipeline units, but the model has 5"):
        check_plan_against_graph(q, gpt, {"pp": 8, "dp": 1})


def test_a_plan_whose_graph_was_captured_differently_is_applied_with_a_warning(gpt):
    p = _fit_plan(gpt)
    p.graph = dict(p.graph, ops="0000000000000000", fingerprint="1111111111111111", n_ops=999)
    notes = check_plan_against_graph(copy.deepcopy(p), gpt, {"dp": 1, "tp": 2})
    assert len(notes) == 1 and "warning" in notes[0] and "999 ops" in notes[0] and "applied" in notes[0]


def test_a_sharding_axis_left_sharding_nothing_gets_an_explicit_warning():
    p = Plan(mesh={"dp": 2, "tp": 2}, strategies={"tp": {"lm_head:linear#0": "R,R->R"}}, zero_stage=2)
    notes = axis_notes(p)
    assert any("tp=2 shards nothing" in n and "give these ranks to dp" in n for n in notes), notes
    p.strategies["tp"]["lm_head:linear#0"] = "R,S(0)->S(2)"
    assert axis_notes(p) == []
    assert any("zero_stage=1 with dp=1 shards nothing" in n for n in axis_notes(Plan(mesh={"dp": 1}, zero_stage=1)))
    # under cp, ZeRO shards over dp+cp: dp=1 x cp=2 does shard, so no warning
    assert not any("shards nothing" in n for n in axis_notes(Plan(mesh={"dp": 1, "cp": 2}, zero_stage=3)))


def test_a_plan_for_the_same_model_in_another_precision_is_applied_with_a_warning(gpt):
    import torch

    p = _fit_plan(gpt)
    half = capture_meta(resolve("gpt-tiny"), 8, 32)
    half.to(torch.bfloat16)
    notes = check_plan_against_graph(p, half, {"dp": 1, "tp": 2})
    assert len(notes) == 1 and "other dtypes" in notes[0] and "applied" in notes[0]
