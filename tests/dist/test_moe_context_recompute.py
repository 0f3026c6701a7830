"""MoE models under context parallelism and with recompute (issue 21), through
`autopar.parallelize` on 4 gloo ranks against one process, in one spawned world:

  * moe x cp (dp2 x cp2, ring): moe-tiny's dropless router numbers each expert's assignments
    with a running count over the tokens (models/moe.py), which only picks a slot in a buffer
    holding every token, so it runs on a chunk of the sequence (passes/context_routing.py); the
    router statistics of the load-balancing loss are averaged over dp and cp;
  * ep x cp (ep2 x cp2, Ulysses): each rank dispatches its chunk's tokens as rows; the router
    statistics are averaged over ep and cp (passes/expert.py);
  * ep x rc (dp2 x ep2, memory_budget=0): each MoE block is one checkpoint region holding the
    expert dispatch; its collectives are kept for backward, not re-run (a step's calls on ep are
    those of a step without recompute: 4 all_to_all and 1 all_gather, the route's counts, a block);
  * ep x cp x rc (ep2 x cp2, ring, memory_budget=0): the three together.

Every cell: moe-tiny in float64 (its router softmax stays fp32), three AdamW steps at lr 1e-2
on the same batches as one process; every step's loss within MOE_LOSS_TOL = 1e-6 (an fp32 value:
one ulp at 4.9 is 4.8e-7) and every exported parameter (`autopar.export_state_dict`) within
1e-9; and the program checked to hold what the cell names. The capacity refusals (cp with a
capacity_factor) are tests/unit/test_context_plan.py's and tests/unit/test_support_matrix.py's.
"""
import functools

import pytest
import torch
import torch.nn.functional as F
from harness import capture_before_fork, world
from reference_train import adamw_steps, token_batches

import autopar

BATCH, SEQ, STEPS, LR, TOL = 8, 16, 3, 1e-2, 1e-9
MOE_LOSS_TOL = 1e-6  # the loss carries the fp32 router's load-balancing term
N_BLOCKS = 2  # MoEConfig.tiny(): 2 layers, each an MoE block


def _build():
    from autopar.models import MoE, MoEConfig

    torch.manual_seed(0)
    return MoE(MoEConfig.tiny()).double()


def _loss(out, y):
    logits, aux = out
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1)) + aux


def _batches():
    return token_batches(STEPS, BATCH, SEQ)


@functools.cache
def _reference():
    losses, model = adamw_steps(_build(), _batches(), _loss, lr=LR)
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


CELLS = [  # (cell, mesh, parallelize keywords, what the program must hold)
    ("moe x cp", dict(dp=2, cp=2), dict(context_method="ring"), ["ring", "stats over cp"]),
    ("ep x cp", dict(ep=2, cp=2), dict(context_method="ulysses"), ["ulysses", "dispatch", "stats over cp"]),
    ("ep x rc", dict(dp=2, ep=2), dict(memory_budget=0.0), ["dispatch", "dispatch in a region", "collectives kept"]),
    ("ep x cp x rc", dict(ep=2, cp=2), dict(context_method="ring", memory_budget=0.0),
     ["ring", "dispatch", "stats over cp", "dispatch in a region", "collectives kept"]),
]


def _holds(pm, calls: dict) -> dict:
    code = "".join(m.code for m in pm.program.modules() if hasattr(m, "code"))
    regions = [m for m in pm.program.modules() if type(m).__name__ == "CheckpointRegion"]
    context = pm.plan.extra.get("context", {}).get("method")
    return {"ring": "ring_attention" in code and context == "ring",
            "ulysses": "ulysses_attention" in code and context == "ulysses",
            "dispatch": "dispatch" in code,
            # the load-balancing statistics are all-reduced (avg) over the cp axis
            "stats over cp": "'cp', 'avg'" in code,
            "dispatch in a region": any("dispatch" in r.body.code for r in regions),
            # forward dispatch + combine, backward their reverse: 4 all_to_all a block, and the
            # route's one all_gather of expert counts; a replay in backward would add to both
            "collectives kept": calls.get(("all_to_all", "ep")) == 4 * N_BLOCKS
            and calls.get(("all_gather", "ep")) == N_BLOCKS}


def _cells(rank, ws, tmp):
    from autopar.runtime.collectives import COUNTER

    out = {}
    for i, (cell, mesh_kw, kw, _names) in enumerate(CELLS):
        batches = _batches()
        try:
            pm = autopar.parallelize(_build(), autopar.mesh(**mesh_kw), example_inputs=(batches[0][0],), **kw)
        except ValueError as e:  # reported per cell, so that one refusal does not hide the others
            out[cell] = f"refused: {e}"
            continue
        opt = autopar.optimizer(pm, torch.optim.AdamW, lr=LR)
        losses, calls = [], {}
        try:
            for x, y in batches:
                COUNTER.reset()
                losses.append(pm.step(((x,), y), _loss).item())
                calls = dict(COUNTER.calls)
                opt.step()
                opt.zero_grad()
        except Exception as e:  # noqa: BLE001 - a failing cell is reported, the world goes on to the next
            out[cell] = f"failed: {type(e).__name__}: {e}"
            continue
        sd = autopar.export_state_dict(pm, f"{tmp}/cell{i}.pt")
        out[cell] = (losses, {k: v.clone() for k, v in sd.items()}, _holds(pm, calls))
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    for cp in (False, True):  # the forked ranks find these in the capture memo
        capture_before_fork(_build(), (_batches()[0][0],), cp=cp)
    return world(4, _cells, str(tmp_path_factory.mktemp("moe_context_recompute")), timeout_s=600)


@pytest.mark.parametrize("cell", [c[0] for c in CELLS])
def test_moe_cell_matches_one_process_after_three_adamw_steps(results, cell):
    names = next(c[3] for c in CELLS if c[0] == cell)
    got = [r[cell] for r in results]
    assert not isinstance(got[0], str), f"{cell}: {got[0]}"
    ref_losses, ref_params = _reference()
    for rank, (losses, _sd, have) in enumerate(got):
        torch.testing.assert_close(torch.tensor(losses, dtype=torch.float64),
                                   torch.tensor(ref_losses, dtype=torch.float64), rtol=0, atol=MOE_LOSS_TOL,
                                   msg=lambda m, rank=rank: f"{cell} rank {rank} losses: {m}")
        missing = [h for h in names if not have[h]]
        assert not missing, f"{cell} rank {rank}: the program lacks {missing}: {have}"
    sd = got[0][1]  # rank 0 holds the export
    assert set(ref_params) <= set(sd), sorted(set(ref_params) - set(sd))
    for k, ref in ref_params.items():
        torch.testing.assert_close(sd[k].to(ref.dtype), ref, rtol=TOL, atol=TOL, msg=lambda m, k=k: f"{cell} {k}: {m}")
