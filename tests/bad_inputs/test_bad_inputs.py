"""Inputs that cannot work: one ValueError naming the argument and what to change, never a
traceback from inside torch, and nothing changed (the model's parameters, the files).

  * parallelize's example inputs (autopar/input_checks.py): a cuda mesh without a GPU, no
    tensors, foreign objects, an empty batch, several devices, float token ids, a batch that
    does not divide by dp x ep x micro-batches; meta inputs are fine (capture needs no data).
  * after a failed capture, the fake forward names the input and the module that cannot take
    it (float ids into an nn.Embedding, the wrong width into an nn.Linear, the model's own
    error); after a capture that worked, an input whose dtype a matrix product refuses.
  * model.step's batch against what was captured: dtype, dims, sizes after the batch dim, meta
    data, rows; loss_fn returning a non-scalar, a non-tensor, an integer or a detached tensor
    (runtime/program.py).
The tests at the end go through `autopar.parallelize` and pass once parallelize calls these
checks (see the lead's wiring).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import autopar
from autopar import models
from autopar.input_checks import (check_captured_graph, check_example_inputs, check_mesh_device, check_step_batch,
                                  explain_capture_failure)

GPU = torch.cuda.is_available()


@pytest.fixture(scope="module")
def gpt():
    spec = models.get("gpt-tiny")
    torch.manual_seed(0)
    model = spec.build()
    (x,), y = spec.example_batch(8, generator=torch.Generator().manual_seed(1))
    return spec, model, x, y


def _state(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _same(model, before) -> None:
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


def _mesh(**axes):
    return autopar.mesh(device_type="cpu", **axes)


# --- parallelize's example inputs --------------------------------------------------------------
@pytest.mark.skipif(GPU, reason="this machine has a GPU: a cuda mesh is fine here")
def test_a_cuda_mesh_on_a_machine_without_a_gpu_is_refused_with_the_fix(gpt):
    mesh = autopar.mesh(dp=1, device_type="cuda")
    with pytest.raises(ValueError) as e:
        check_mesh_device(mesh)
    assert "runs on 'cuda'" in str(e.value) and "no cuda device" in str(e.value) and 'device_type="cpu"' in str(e.value)


@pytest.mark.parametrize("inputs, words", [
    (None, ["example_inputs is None", "a tensor, a tuple"]),
    ("NUMPY", ["example_inputs[0] is a numpy.ndarray", "torch.from_numpy"]),
    ((1, 2.0), ["holds no tensor"]),
    ("EMPTY", ["example_inputs has shape (0, 32): an empty batch"]),
    ("MIXED", ["several devices", "example_inputs[0] on cpu", "example_inputs[1] on meta"]),
    ("FLOAT_IDS", ["example_inputs['input_ids'] is float32 (8, 32)", "token ids, which are integers",
                   "example_inputs['input_ids'].long()"]),
    ("ROWS", ["example_inputs has 6 rows", "dp=2 x micro-batches=2 = 4", "multiple of 4 (e.g. 8)"]),
])
def test_example_inputs_that_cannot_work_name_the_argument(gpt, inputs, words):
    _spec, _model, x, _y = gpt
    inputs = {"NUMPY": (x.numpy(),), "EMPTY": x[:0], "MIXED": (x, x.to("meta")), "FLOAT_IDS": {"input_ids": x.float()},
              "ROWS": x[:6]}.get(inputs, inputs) if isinstance(inputs, str) else inputs
    with pytest.raises(ValueError) as e:
        check_example_inputs(inputs, _mesh(dp=2), n_microbatches=2)
    for w in words:
        assert w in str(e.value), str(e.value)


def test_example_inputs_that_can_work_pass_meta_included(gpt):
    _spec, _model, x, _y = gpt
    check_example_inputs(x, _mesh(dp=2))
    check_example_inputs(x.to("meta"), _mesh(dp=4))  # capture needs shapes only
    check_example_inputs({"input_ids": x, "attention_mask": torch.ones(8, 32)}, _mesh(dp=1))
    check_example_inputs(x[:6], autopar.mesh(world_size=4, device_type="cpu"))  # the planner picks dp


# --- after the capture ---------------------------------------------------------------------------
def test_float_token_ids_are_traced_to_the_embedding_that_cannot_take_them(gpt):
    _spec, model, x, _y = gpt
    before = _state(model)
    why = explain_capture_failure(model, x.float())
    assert isinstance(why, ValueError)
    assert str(why) == ("example_inputs is float32 (8, 32) on cpu, but it feeds nn.Embedding 'tok_emb', which takes "
                        "integer token ids; pass example_inputs.long()")
    _same(model, before)


def test_an_input_of_the_wrong_width_names_the_linear_and_its_features():
    spec = models.get("mlp-tiny")
    model = spec.build()
    why = explain_capture_failure(model, (torch.randn(4, 3),))
    assert "example_inputs[0] reaches nn.Linear 'layers.0.fc' with last dim (3,), but it takes 32 features" in str(why)


def test_the_models_own_error_is_reported_with_the_module_and_the_inputs(gpt):
    _spec, model, _x, _y = gpt
    why = explain_capture_failure(model, torch.randint(0, 10, (8, 100)))
    assert "fails on these example inputs (example_inputs: int64 (8, 100) on cpu)" in str(why)
    assert "sequence length 100 exceeds max_seq_len=32" in str(why)


def test_the_probe_forward_leaves_batch_norm_statistics_as_they_were():
    model = torch.nn.Sequential(torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 2)).train()
    before = _state(model)
    why = explain_capture_failure(model, torch.randn(8, 4, dtype=torch.float64))  # BN runs, the Linear refuses
    assert "example_inputs is float64 (8, 4) on cpu, but Linear '1' has float32 weights; pass example_inputs.float()" \
        == str(why)
    _same(model, before)


def test_inputs_that_capture_returns_none(gpt):
    _spec, model, x, _y = gpt
    assert explain_capture_failure(model, x) is None  # the forward runs: a capture failure is the capture's


def test_a_float64_input_to_float32_weights_is_caught_in_the_captured_graph():
    spec = models.get("mlp-tiny")
    model = spec.build()
    (x,), _ = spec.example_batch(4)
    gm = autopar.capture(model, (x.double(),))  # fake tensors do not check dtypes: the capture works
    with pytest.raises(ValueError) as e:
        check_captured_graph(gm, x.double())
    assert str(e.value) == ("example_inputs reaches linear in module 'layers.0.fc' as float64, but its weight is "
                            "float32: torch will refuse to multiply them; pass the input as float32")
    check_captured_graph(autopar.capture(model, (x,)), x)


# --- model.step ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def trained(gpt):
    spec, model, x, y = gpt
    torch.manual_seed(0)
    pm = autopar.parallelize(spec.build(), _mesh(dp=1), example_inputs=x)
    return pm, x, y


@pytest.mark.parametrize("batch, words", [
    ("FLOAT_IDS", ["batch[0] is float32 (8, 32) on cpu", "captured with int64", "batch[0].to(torch.int64)"]),
    ("META", ["batch[0] is on the meta device", "real data"]),
    ("SEQ", ["batch[0] has shape (8, 5)", "captured with (batch, 32)", "dim 1 must be 32"]),
    ("DIMS", ["batch[0] has 3 dims (8, 32, 1)", "captured with 2"]),
    ("TUPLE2", ["does not have the structure", "got 2 inputs"]),
    ("NOT_PAIR", ["batch=(inputs, targets)", "got Tensor"]),
])
def test_a_step_batch_unlike_the_captured_one_names_the_part_and_the_fix(trained, batch, words):
    pm, x, y = trained
    b = {"FLOAT_IDS": (x.float(), y), "META": (x.to("meta"), y), "SEQ": (x[:, :5], y[:, :5]),
         "DIMS": (x[:, :, None], y), "TUPLE2": ((x, x), y), "NOT_PAIR": x}[batch]
    with pytest.raises(ValueError) as e:
        check_step_batch(b, pm.global_graph, pm.mesh, dp_axis=pm.plan.dp_axis, n_microbatches=1)
    for w in words:
        assert w in str(e.value), str(e.value)


def test_a_step_batch_that_dp_and_micro_batches_cannot_split_is_refused(trained):
    pm, x, y = trained
    with pytest.raises(ValueError, match=r"batch\[0\] has 6 rows: that number does not divide by dp=2 x micro-batches=2 = 4"):
        check_step_batch((x[:6], y[:6]), pm.global_graph, _mesh(dp=2), n_microbatches=2)
    check_step_batch((x, y), pm.global_graph, _mesh(dp=2), n_microbatches=2)  # 8 rows: fine


@pytest.mark.parametrize("loss_fn, words", [
    (lambda o, t: F.cross_entropy(o.flatten(0, 1), t.flatten(), reduction="none"),
     ["must return a scalar", "shape (256,)", "loss.mean()"]),
    (lambda o, t: 1.0, ["loss_fn returned a float, not a tensor"]),
    (lambda o, t: {"loss": o.mean()}, ["returned a dict", "out.loss"]),
    (lambda o, t: F.cross_entropy(o.flatten(0, 1), t.flatten()).detach(), ["does not require grad", "detaching"]),
    (lambda o, t: (o.argmax(-1) == t).sum(), ["int64 tensor", "floating point"]),
])
def test_a_loss_fn_that_returns_what_backward_cannot_use_is_refused_before_backward(trained, loss_fn, words):
    pm, x, y = trained
    before = _state(pm.program.module)
    with pytest.raises(ValueError) as e:
        pm.step((x, y), loss_fn)
    for w in words:
        assert w in str(e.value), str(e.value)
    assert all(p.grad is None for p in pm.program.module.parameters())  # no backward ran
    _same(pm.program.module, before)


# --- through parallelize (pass once parallelize calls the checks) ----------------------------------
@pytest.mark.skipif(GPU, reason="this machine has a GPU: a cuda mesh is fine here")
def test_parallelize_on_a_cuda_mesh_without_a_gpu_says_so(gpt):
    spec, model, x, _y = gpt
    with pytest.raises(ValueError, match="runs on 'cuda' but this machine has no cuda device"):
        autopar.parallelize(model, autopar.mesh(dp=1, device_type="cuda"), example_inputs=x)


def test_parallelize_with_float_token_ids_names_the_input_and_the_embedding(gpt):
    spec, model, x, _y = gpt
    with pytest.raises(ValueError, match=r"example_inputs is float32 \(8, 32\) on cpu, but it feeds nn.Embedding "
                                         r"'tok_emb'"):
        autopar.parallelize(model, _mesh(dp=1), example_inputs=x.float())


def test_parallelize_refuses_a_plan_for_another_model_before_running_a_pass(gpt):
    from autopar.build.plan_check import PlanMismatchError, stamp
    from autopar.passes.plan import Plan

    spec, model, x, _y = gpt
    other = models.get("gpt-tiny-tied")
    plan = Plan(mesh={"dp": 1})
    stamp(plan, autopar.capture(other.build(), (x,)))
    with pytest.raises(PlanMismatchError, match="the plan is for another model"):
        autopar.parallelize(model, _mesh(dp=1), example_inputs=x, plan=plan)


def test_step_with_float_token_ids_names_the_batch_part(trained):
    pm, x, y = trained
    with pytest.raises(ValueError, match=r"batch\[0\] is float32 \(8, 32\) on cpu, but the model was captured with "
                                         r"int64"):
        pm.step((x.float(), y), models.get("gpt-tiny").loss_fn)


def test_parallelize_on_a_tp_size_that_divides_no_weight_refuses_with_sizes_that_would(gpt):
    spec, model, x, _y = gpt
    with pytest.raises(ValueError, match=r"tp=3 divides no dimension of the model's weights .* tp sizes that would: "
                                         r"2, 4, 8"):
        autopar.parallelize(model, _mesh(tp=3), example_inputs=x)
