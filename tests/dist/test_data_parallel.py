"""Data parallel end to end on gloo: dp=2 and dp=4 match one process after three AdamW steps
(loss every step, parameters after), with gradient accumulation, on the reference GPT and MoE;
and bad input fails with a clear error on every rank."""
import os

import pytest
import torch

import autopar
from autopar.models import get
from harness import capture_before_fork, world

# fp32, 3 AdamW steps at lr 1e-2. The only difference from one process is the order of the
# gradient sum (the all-reduce), a few ulps; Adam's m/sqrt(v) amplifies it for gradient
# entries near zero, up to ~4e-5 absolute on weights of scale 2e-2 (measured with dp=4).
# So: losses to 1e-5, parameters to 1e-4 absolute (1% of one step's largest move).
RTOL, ATOL, LOSS_ATOL = 1e-4, 1e-4, 1e-5
BATCH = 8


def _build(name):
    torch.manual_seed(0)
    spec = get(name)
    return spec.build(), spec.loss_fn, spec.example_batch


def _one_process(name, steps=3, n_micro=1):
    model, loss_fn, batch = _build(name)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        x, y = batch(BATCH, generator=g)
        loss = loss_fn(model(*x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.named_parameters()}


def _parallel(rank, ws, names, steps=3, n_micro=1, dump_dir=None, zero_stage=0):
    out = {}
    for name in names:
        model, loss_fn, batch = _build(name)
        g = torch.Generator().manual_seed(1)
        x0, _ = batch(BATCH, generator=torch.Generator().manual_seed(1))
        pm = autopar.parallelize(model, autopar.mesh(dp=ws), example_inputs=x0, n_microbatches=n_micro,
                                 zero_stage=zero_stage)
        opt = autopar.optimizer(pm, torch.optim.AdamW, lr=1e-2)
        losses = []
        for _ in range(steps):
            x, y = batch(BATCH, generator=g)
            loss = pm.step((x, y), loss_fn)
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        if dump_dir and name == names[0]:
            pm.dump(dump_dir)
        if zero_stage == 0:
            params = {k: v.detach().clone() for k, v in pm.program.module.named_parameters()}
        else:
            params = pm.engine.gather_full_state_dict()
        out[name] = (losses, params)
    return out


def _check(results, names, n_micro=1):
    for name in names:
        ref_losses, ref_params = _one_process(name, n_micro=n_micro)
        for rank, res in enumerate(results):
            losses, params = res[name]
            torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=RTOL, atol=LOSS_ATOL,
                                       msg=f"{name} rank {rank} losses")
            for k, v in ref_params.items():
                torch.testing.assert_close(params[k], v, rtol=RTOL, atol=ATOL, msg=f"{name} rank {rank} {k}")


# moe-tiny with its load-balancing loss on (aux_loss_coef 0.01): the router statistics are
# averaged over dp, so the auxiliary loss is the global batch's, as one process computes it
NAMES = ["gpt-tiny", "moe-tiny"]


@pytest.fixture(scope="module", autouse=True)
def _captured_here():
    """Each model captured here once for the module's worlds (seven of them): the forked ranks
    find it in the capture memo instead of each tracing it again (harness.capture_before_fork)."""
    for name in NAMES:
        model, _loss_fn, batch = _build(name)
        capture_before_fork(model, batch(BATCH, generator=torch.Generator().manual_seed(1))[0])


def test_dp2_gpt_and_moe_match_single_process_after_three_adamw_steps(tmp_path):
    results = world(2, _parallel, NAMES, dump_dir=str(tmp_path / "dump"))
    _check(results, NAMES)
    files = sorted(os.listdir(tmp_path / "dump"))
    assert {"plan.json", "rank0_program.py", "rank1_program.py", "graph_captured.py", "report.txt"} <= set(files)
    plan = autopar.Plan.from_json((tmp_path / "dump" / "plan.json").read_text())
    assert plan.mesh == {"dp": 2} and plan.zero_stage == 0
    prog = (tmp_path / "dump" / "rank0_program.py").read_text()
    assert "{dp: S(0)}" in prog and "{dp: R}" in prog


def test_dp4_gpt_and_moe_match_single_process_after_three_adamw_steps():
    _check(world(4, _parallel, NAMES), NAMES)


def test_dp2_with_two_microbatches_matches_single_process():
    _check(world(2, _parallel, ["gpt-tiny"], n_micro=2), ["gpt-tiny"])


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_dp2_each_zero_stage_through_parallelize_matches_single_process(stage):
    _check(world(2, _parallel, ["gpt-tiny"], zero_stage=stage), ["gpt-tiny"])


def _bad_inputs(rank, ws):
    errors = {}
    model, loss_fn, batch = _build("gpt-tiny")
    x, y = batch(BATCH)
    try:
        autopar.parallelize(model, autopar.mesh(dp=ws + 1), example_inputs=x)
    except ValueError as e:
        errors["mesh"] = str(e)
    try:
        autopar.parallelize(model, autopar.mesh(dp=ws), example_inputs=batch(3)[0])
    except ValueError as e:
        errors["example"] = str(e)
    pm = autopar.parallelize(model, autopar.mesh(dp=ws), example_inputs=x)
    try:
        pm.step(batch(5), loss_fn)
    except ValueError as e:
        errors["step"] = str(e)
    try:
        pm.step(x, loss_fn)
    except ValueError as e:
        errors["shape"] = str(e)
    return errors


def test_bad_input_is_a_clear_error_on_every_rank():
    for errors in world(2, _bad_inputs):
        assert "world size" in errors["mesh"] and "product" in errors["mesh"]
        assert "does not divide by dp=2" in errors["example"]
        assert "5 rows" in errors["step"] and "dp=2" in errors["step"]
        assert "batch=(inputs, targets)" in errors["shape"]


def _sampled(rank, ws):
    mesh = autopar.mesh(dp=2, tp=ws // 2)
    return list(iter(autopar.sampler(list(range(10)), mesh, shuffle=False)))


def test_sampler_splits_samples_over_dp_and_repeats_them_over_tp():
    got = world(4, _sampled)
    assert got[0] == got[1] and got[2] == got[3]          # tp peers read the same samples
    assert sorted(got[0] + got[2]) == list(range(10))     # dp ranks read disjoint halves


def test_mesh_without_processes_checks_the_world_size():
    with pytest.raises(ValueError, match="product is 8"):
        autopar.mesh(world_size=8, dp=2, tp=2)
    m = autopar.mesh(world_size=8, dp=2, tp=4)
    assert m.coords(5) == {"dp": 1, "tp": 1} and m.axis_ranks("tp", 5) == [4, 5, 6, 7]
