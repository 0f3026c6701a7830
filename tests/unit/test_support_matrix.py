"""docs/support_matrix.md, checked: every combination the matrix marks refused ("R") is still
refused before any step, with its message, every test the matrix cites as evidence exists,
and the counts its Gaps section states are those of table A.

No process group: the refusals are raised while checking a mesh or a plan against the captured
graph (`build.plan_check`), while choosing the context-parallel exchange (`search.context`),
or while building a pipeline rank's program (`runtime.program`), all of which run in
one process. One cell also goes through `autopar.parallelize` end to end, to show the public
path refuses where the checker does. Reads no node.meta; writes nothing.

A cell that starts working (no ValueError) or whose message loses its key phrase fails here:
then update the matrix (make it P with a parity test, or fix the message).
"""
import os
import re

import pytest
import torch
import torch.nn as nn

from autopar.build.plan_check import check_mesh_fits, check_plan_against_graph
from autopar.capture import capture
from autopar.models import get
from autopar.passes.plan import Plan
from autopar.runtime import collectives as C
from autopar.runtime.mesh import make_mesh
from autopar.runtime.program import Program
from autopar.search.context import plan_context

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DOC = os.path.join(ROOT, "docs", "support_matrix.md")


def _graph(name: str, dynamic_seq: bool = False):
    spec = get(name)
    torch.manual_seed(0)
    inputs, _ = spec.example_batch(4)
    return capture(spec.build(), inputs if isinstance(inputs, tuple) else (inputs,), dynamic_seq=dynamic_seq)


@pytest.fixture(scope="module")
def gpt():
    return _graph("gpt-tiny")


@pytest.fixture(scope="module")
def moe():
    return _graph("moe-tiny")


@pytest.fixture(scope="module")
def moe_capped():  # moe-tiny with a capacity: its drops depend on the whole batch's token order
    from autopar.models import MoE, MoEConfig

    torch.manual_seed(0)
    return capture(MoE(MoEConfig.tiny(capacity_factor=1.0)), (torch.zeros(4, 16, dtype=torch.long),))


def test_ep_with_cp_passes_the_checker_for_a_dropless_router(moe):
    # dropless ep x cp trains (tests/dist/test_moe_context_recompute.py)
    check_mesh_fits(moe, {"ep": 2, "cp": 2})
    check_plan_against_graph(Plan(mesh={"ep": 2, "cp": 2}, dp_axis=None), moe, {"ep": 2, "cp": 2})


# --- mesh pairs the checker refuses (autopar/build/plan_check.py) ------------------------------
MESH_REFUSALS = [  # (matrix cell, model, mesh, key phrase of the message)
    ("ep x cp with a capacity", "moe_capped", {"ep": 2, "cp": 2},
     r"cp=2 with ep=2 needs dropless routing, but MoE block 'layers\.0\.moe' has a capacity .*whole batch.*"
     r"use capacity_factor=None, or put the cp ranks on dp or tp"),
    ("sp as a mesh axis", "gpt", {"dp": 2, "sp": 2}, r"axes \['sp'\] are not carried out by this version"),
]


@pytest.mark.parametrize("cell, model, sizes, words", MESH_REFUSALS, ids=[c[0] for c in MESH_REFUSALS])
def test_a_refused_mesh_is_refused_before_planning(cell, model, sizes, words, request):
    with pytest.raises(ValueError, match=words):
        check_mesh_fits(request.getfixturevalue(model), sizes)


@pytest.mark.parametrize("cell, model, sizes, words", MESH_REFUSALS[:1], ids=[c[0] for c in MESH_REFUSALS[:1]])
def test_a_given_plan_for_a_refused_mesh_is_refused_whole(cell, model, sizes, words, request):
    plan = Plan(mesh=dict(sizes), dp_axis=None)
    with pytest.raises(ValueError, match=words):
        check_plan_against_graph(plan, request.getfixturevalue(model), sizes)


def test_the_accepted_neighbours_of_the_refused_meshes_pass_the_checker(gpt, moe):
    # the refusals are about the pair: each axis alone (and cp with dp and tp) passes, and so
    # does pp x ep, which trains (tests/dist/test_ep_pipeline.py), and pp x cp, which trains
    # (tests/dist/test_pipeline_context.py)
    for gm, sizes in [(moe, {"ep": 2}), (moe, {"pp": 2}), (gpt, {"pp": 2}), (gpt, {"dp": 2, "cp": 2}),
                      (gpt, {"tp": 2, "cp": 2}), (moe, {"pp": 2, "ep": 2}), (gpt, {"pp": 2, "cp": 2})]:
        check_mesh_fits(gm, sizes)
    check_plan_against_graph(Plan(mesh={"pp": 2, "ep": 2}, dp_axis=None), moe, {"pp": 2, "ep": 2})
    check_plan_against_graph(Plan(mesh={"pp": 2, "cp": 2}, dp_axis=None), gpt, {"pp": 2, "cp": 2})


# recompute under zb_h1 / zbv trains (tests/dist/test_zero_bubble_recompute.py): no longer refused


# --- tp x cp under Ulysses (autopar/search/context.py) -----------------------------------------
def test_ulysses_is_refused_when_the_heads_per_tp_rank_do_not_divide_by_cp_and_ring_is_not():
    gm = _graph("gpt-tiny", dynamic_seq=True)  # 4 query heads: 2 per rank at tp=2
    with pytest.raises(ValueError, match=r"context_method='ulysses' splits each rank's query heads over cp=4, "
                                         r"which does not divide them \(tp=2\)"):
        plan_context(gm, {"tp": 2, "cp": 4}, "ulysses", "h100-sxm")
    assert plan_context(gm, {"tp": 2, "cp": 4}, "ring", "h100-sxm")["method"] == "ring"
    assert plan_context(gm, {"tp": 2, "cp": 2}, "ulysses", "h100-sxm")["method"] == "ulysses"


# --- pp x fp16-mixed (runtime/program.py) -------------------------------------------------------
# pp x tied weights x ZeRO 1-3 and x bf16-mixed train now (tests/dist/test_pipeline_compose.py);
# fp16 with a loss scale builds under a pipeline, tied or not: one scaler, applied by the last stage
FP16_CELLS = [  # (matrix cell, tied entries, engine options)
    ("pp x tie x fp16-mixed", [((0, "weight"), (1, "weight"))], {"param_dtype": torch.float16, "loss_scale": "dynamic"}),
    ("pp x fp16-mixed", [], {"param_dtype": torch.float16, "loss_scale": "dynamic"}),
    ("pp x fp16 with a static loss scale", [], {"param_dtype": torch.float16, "loss_scale": 1024.0}),
]


def _pipeline_rank0(zero_stage: int, options: dict, tied=(((0, "weight"), (1, "weight")),)) -> Program:
    """Rank 0 of a 2-rank 1F1B pipeline whose weight `weight` is tied to stage 1's."""
    try:
        return Program({0: nn.Linear(4, 4)}, make_mesh(pp=2), n_stages=2, schedule="1f1b", dp_axis=None,
                       zero_stage=zero_stage, tied=list(tied), sync_init=False, engine_options=options)
    finally:
        C.set_active_mesh(None)


@pytest.mark.parametrize("cell, tied, options", FP16_CELLS, ids=[c[0] for c in FP16_CELLS])
def test_fp16_with_a_loss_scale_builds_under_a_pipeline_with_one_scale_applied_by_the_last_stage(cell, tied, options):
    # (refused until issue 21's LossScaleGroup; tests/dist/test_pipeline_fp16.py trains it against one process)
    program = _pipeline_rank0(0, options, tied)
    engines = list(program.engine.engines.values())
    assert engines and all(e.scale_group is not None and e.scaler is engines[0].scaler for e in engines), cell
    assert not any(e.scales_outputs for e in engines), cell  # rank 0 holds stage 0: the loss is stage 1's


@pytest.mark.parametrize("zero, options", [(0, {}), (1, {}), (2, {}), (3, {}), (1, {"param_dtype": torch.bfloat16}),
                                           (3, {"param_dtype": torch.bfloat16}),
                                           (0, {"param_dtype": torch.float16, "loss_scale": None})],
                         ids=["Z0", "Z1", "Z2", "Z3", "Z1 bf16-mixed", "Z3 bf16-mixed", "fp16 without a loss scale"])
def test_weights_tied_across_pipeline_stages_are_accepted_under_every_zero_stage_and_bf16_mixed(zero, options):
    # the rank builds (the tied sum runs on the engines' masters); tests/dist/test_pipeline_compose.py
    # trains these against one process
    program = _pipeline_rank0(zero, options)
    assert program.tied == [((0, "weight"), (1, "weight"))]
    assert {e.stage for e in program.engine.engines.values()} == {zero}


# --- the matrix cites only tests that exist -----------------------------------------------------
CITATION = re.compile(r"(tests/[\w/]+\.py)::(\w+)")


def test_every_test_the_matrix_cites_exists():
    text = open(DOC, encoding="utf-8").read()
    cited = sorted(set(CITATION.findall(text)))
    assert len(cited) >= 15, f"the matrix cites only {len(cited)} tests: did its citation format change?"
    missing = []
    for path, name in cited:
        full = os.path.join(ROOT, path)
        if not os.path.isfile(full):
            missing.append(f"{path} (no such file)")
        elif not re.search(rf"^def {name}\(", open(full, encoding="utf-8").read(), re.M):
            missing.append(f"{path}::{name}")
    assert not missing, f"docs/support_matrix.md cites tests that do not exist: {missing}"


def test_the_counts_the_gaps_section_states_are_those_of_table_a():
    # a cell changed in table A without its count in "Gaps" (or the other way) fails here
    text = open(DOC, encoding="utf-8").read()
    table = text.split("## A. Pairs", 1)[1].split("\n\n", 2)[1]
    counts = {"P": 0, "p": 0, "R": 0, "?": 0, "—": 0}
    for line in table.splitlines()[2:]:
        for cell in [c.strip() for c in line.strip().strip("|").split("|")][1:]:
            if cell:
                counts[cell[0]] += 1
    stated = re.search(r"Counts in table A \((\d+) cells\): (\d+) P, (\d+) p, (\d+) R, (\d+) \?, (\d+) —", text)
    assert stated, "the Gaps section no longer states the counts as 'Counts in table A (N cells): ...'"
    assert [int(g) for g in stated.groups()] == [sum(counts.values())] + list(counts.values()), (stated.group(0), counts)


def test_every_refusal_the_matrix_lists_points_at_a_line_that_raises_it():
    # the Refusals table names file:line; each must be a line of a raise (or of the message it builds)
    text = open(DOC, encoding="utf-8").read().split("## Refusals", 1)[1]
    refs = re.findall(r"`((?:autopar|runtime|passes)/[\w/]+\.py):(\d+)`", text)
    assert len(refs) >= 5, refs
    for path, line in refs:
        src = open(os.path.join(ROOT, path), encoding="utf-8").read().splitlines()
        here = src[int(line) - 1]
        assert "raise ValueError" in here or "problems.append" in here or "out.append" in here, \
            f"{path}:{line} is {here.strip()!r}, not a refusal: the line numbers in the matrix are stale"


# --- the planner never emits what the runtime refuses: pp x tied x (ZeRO 1-3 | 16-bit) ---------
def test_the_planner_pipelines_fp16_with_loss_scaling_and_tied_weights_in_bf16():
    from autopar.passes.plan import precision_fields
    from autopar.search.planner import clear_cache, plan_for

    for name in ("gpt-tiny-tied", "gpt-tiny"):  # fp16 with loss scaling: pipelined, tied or not (LossScaleGroup)
        clear_cache()
        plan, _ = plan_for(_graph(name), 2, "h100-sxm", pins={"pp": 2}, precision=precision_fields("fp16-mixed"))
        assert plan.mesh.get("pp") == 2 and plan.param_dtype == "fp16", (name, plan.mesh, plan.param_dtype)
    gm = _graph("gpt-tiny-tied")
    clear_cache()  # tied weights on two stages with bf16-mixed masters: runtime/pipeline_tied.py runs them
    plan, _ = plan_for(gm, 2, "h100-sxm", pins={"pp": 2}, precision=precision_fields("bf16-mixed"))
    assert plan.mesh.get("pp") == 2 and plan.param_dtype == "bf16", (plan.mesh, plan.param_dtype)
    clear_cache()
    plan, _ = plan_for(gm, 4, "h100-sxm", pins={"pp": 2, "zero_stage": 1}, precision=precision_fields("fp32"))
    assert plan.mesh.get("pp") == 2 and plan.zero_stage == 1, (plan.mesh, plan.zero_stage)

