"""Sequence parallelism beside expert parallelism, planned on one process (no ranks): the
support matrix's sp x ep cell, whose training run is tests/dist/test_compose_context.py ("sp x
ep at 16 x 256 tokens").

moe-tiny at 16 sequences of 256 tokens on tp2 x ep2 with the CPU profile: the tp search, given the
expert pins `parallelize` gives it (`build.plan_complete.expert_node_pins`), shards the norms
outside the MoE blocks on the sequence (S(1) on tp) while every node the expert pass needs whole
stays replicated on tp; the joint planner, given that mesh, emits the same kind of plan. These
are the cheap twins of the dist cell: a cost-model change that stops sp from being chosen here
fails them in seconds, before the 4-rank world says the same.
"""
import dataclasses

import pytest
import torch

from autopar.build.plan_complete import expert_node_pins
from autopar.capture import capture
from autopar.models import MoE, MoEConfig
from autopar.passes.plan import Plan
from autopar.runtime.mesh import make_mesh
from autopar.runtime.placement import Replicate
from autopar.search.expert import plan_experts
from autopar.search.shard_search import search_sharding

BATCH, SEQ = 16, 256  # 8 sequences an ep rank; at 4 x 256 the search picks no sp (the dist test's docstring)


@pytest.fixture(scope="module")
def gm():
    torch.manual_seed(0)
    model = MoE(dataclasses.replace(MoEConfig.tiny(), max_seq_len=SEQ)).double()
    return capture(model, (torch.randint(0, 128, (BATCH, SEQ)),))


def _sequence_sharded_norms(plan: Plan) -> list[str]:
    return sorted(k for k, lay in plan.node_layouts.items()
                  if ":rms_norm" in k and ".moe" not in k and str(dict(lay.axes).get("tp")) == "S(1)")


def test_tp_search_beside_ep_shards_the_sequence_outside_the_moe_blocks_and_keeps_them_whole(gm):
    mesh = make_mesh(tp=2, ep=2)
    plan = Plan(mesh=dict(mesh.sizes), dp_axis=None)
    plan.extra["expert"] = plan_experts(gm, mesh, dp_axis=None, n_microbatches=1)
    pins = expert_node_pins(plan, mesh)
    assert pins and pins["tp"], "tp2 x ep2 on an MoE model: the expert pass's nodes are pinned"
    search_sharding(plan, gm, mesh, "cpu-gloo", node_pins=pins)
    norms = _sequence_sharded_norms(plan)
    # both blocks' attention and ffn norms and the final norm: the residual stream is sequence-sharded
    assert {"layers.0.attn_norm:rms_norm#0", "layers.1.ffn_norm:rms_norm#0", "norm:rms_norm#0"} <= set(norms), norms
    whole = [k for k in pins["tp"] if k in plan.node_layouts and not isinstance(plan.node_layouts[k]["tp"], Replicate)]
    assert not whole, f"nodes the expert pass needs replicated on tp were sharded: {whole}"


def test_joint_planner_on_a_tp2_ep2_mesh_emits_sequence_parallelism(gm):
    from autopar.search.planner import clear_cache, plan_for

    clear_cache()
    plan, _report = plan_for(gm, {"tp": 2, "ep": 2}, "cpu-gloo")
    assert plan.mesh == {"ep": 2, "tp": 2} and plan.extra.get("expert", {}).get("blocks"), plan.mesh
    assert _sequence_sharded_norms(plan), "the planner's tp2 x ep2 plan shards no norm on the sequence"
