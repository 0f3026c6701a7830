"""Precision and offload as Plan fields: JSON round trip, old plans, bad values, the named
recipes, the engine options they give, and the cost model's model-state bytes per precision."""
from __future__ import annotations

import json
import os

import pytest
import torch
import torch.nn as nn

from autopar.capture import capture
from autopar.cost import estimate
from autopar.passes.plan import PRECISIONS, Plan, PlanFormatError, engine_options, precision_fields


def _mlp(dtype=torch.float32):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8)).to(dtype)


def test_precision_fields_round_trip_through_json_and_old_plans_load_with_defaults():
    for name in PRECISIONS:
        for off in (False, True):
            p = Plan(mesh={"dp": 2}, zero_stage=1, **precision_fields(name, off))
            q = Plan.from_json(p.to_json())
            assert q == p
            assert (q.param_dtype, q.master_dtype, q.reduce_dtype, q.optim_dtype, q.loss_scale) == PRECISIONS[name]
            assert q.offload is off
    old = json.loads(Plan(mesh={"dp": 2}).to_json())
    for f in ("param_dtype", "master_dtype", "reduce_dtype", "optim_dtype", "offload", "loss_scale"):
        old.pop(f)
    q = Plan.from_dict(old)
    assert (q.param_dtype, q.master_dtype, q.reduce_dtype, q.optim_dtype, q.offload, q.loss_scale) == \
        (None, None, None, None, False, None)


def test_bad_precision_values_are_errors_naming_the_value_and_the_choices():
    with pytest.raises(ValueError, match=r"unknown precision 'bf32'.*'fp32', 'bf16', 'bf16-mixed', 'fp16-mixed'"):
        precision_fields("bf32")
    with pytest.raises(ValueError, match="offload must be True or False, got 'yes'"):
        precision_fields("bf16", "yes")
    d = json.loads(Plan(mesh={"dp": 2}).to_json())
    for field, value, says in [("param_dtype", "float32", "one of ['fp32', 'bf16', 'fp16', 'fp64']"),
                               ("offload", 1, "expected true or false"),
                               ("loss_scale", "static", "expected null or \"dynamic\""),
                               ("master_dtype", "fp32", "master weights are fp32 copies of bf16/fp16")]:
        bad = {**d, field: value}
        with pytest.raises(PlanFormatError, match=field):
            Plan.from_dict(bad)
        with pytest.raises(PlanFormatError) as e:
            Plan.from_dict(bad)
        assert says in str(e.value)
    with pytest.raises(PlanFormatError, match="optim_dtype"):
        Plan(mesh={"dp": 2}, param_dtype="bf16", master_dtype="fp32", optim_dtype="bf16")
    with pytest.raises(PlanFormatError, match="loss_scale"):
        Plan(mesh={"dp": 2}, param_dtype="bf16", master_dtype="fp32", loss_scale="dynamic")


def test_engine_options_follow_the_plan_fields():
    bf16, fp32 = {torch.bfloat16}, {torch.float32}
    assert engine_options(Plan(mesh={"dp": 2}), bf16) == {}  # default: the model's own dtype, pure
    assert engine_options(Plan(mesh={"dp": 2}, **precision_fields("bf16-mixed")), fp32) == \
        {"param_dtype": torch.bfloat16, "loss_scale": None, "reduce_dtype": torch.float32}
    assert engine_options(Plan(mesh={"dp": 2}, **precision_fields("fp16-mixed", True)), {torch.float16}) == \
        {"param_dtype": torch.float16, "loss_scale": "dynamic", "reduce_dtype": torch.float32, "offload": True}
    assert engine_options(Plan(mesh={"dp": 2}, **precision_fields("bf16")), bf16) == {}
    with pytest.raises(ValueError, match=r"param_dtype 'bf16'.*\['float32'\].*model.to\(torch.bfloat16\).*'bf16-mixed'"):
        engine_options(Plan(mesh={"dp": 2}, **precision_fields("bf16")), fp32)
    with pytest.raises(ValueError, match=r"param_dtype 'fp32'.*\['bfloat16'\]"):
        engine_options(Plan(mesh={"dp": 2}, **precision_fields("fp32")), bf16)


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_predicted_model_state_bytes_follow_the_plan_precision(zero):
    model = _mlp(torch.bfloat16)
    gm = capture(model, (torch.randn(4, 16, dtype=torch.bfloat16),))
    n = sum(p.numel() for p in model.parameters())
    rows = {name: -(-p.shape[0] // 2) for name, p in model.named_parameters()}
    # rank 0's dim-0 rows (torch.chunk over dp=2)
    n_rows = sum(rows[name] * (p.numel() // p.shape[0]) for name, p in model.named_parameters())
    n_opt = n_rows if zero >= 1 else n
    n_param = n_rows if zero == 3 else n
    steps = 4 * len(list(model.parameters()))  # AdamW's fp32 `step` per parameter

    def mem(**fields):
        return estimate(gm, Plan(mesh={"dp": 2}, zero_stage=zero, **fields), "cpu-gloo").memory

    pure = mem()  # a bf16 model, no precision: bf16 params, grads and AdamW states, no masters
    assert pure["params"] == 2 * n_param and pure["master"] == 0
    assert pure["optimizer"] == 2 * 2 * n_opt + steps
    assert pure["grads"] == 2 * (n_rows if zero >= 2 else n)
    assert mem(**precision_fields("bf16")) == pure
    mixed = mem(**precision_fields("bf16-mixed"))  # bf16 params, fp32 masters + AdamW states
    if zero < 3:
        assert mixed["params"] == 2 * n_param and mixed["master"] == 4 * n_opt
    else:  # ZeRO-3 keeps the fp32 master rows as the module's parameters: no bf16 shard, no copy
        assert mixed["params"] == 4 * n_rows and mixed["master"] == 0
    assert mixed["optimizer"] == 2 * 4 * n_opt + steps
    assert mixed["grads"] == (0 if zero >= 2 else 2 * n) + 4 * n_opt  # + the masters' fp32 gradients
    assert mixed["peak"] > pure["peak"] and mixed["offloaded"] == 0
    fp32 = mem(param_dtype="fp32", optim_dtype="fp32")  # the same bf16 graph priced as fp32 params
    assert fp32["params"] == 4 * n_param and fp32["master"] == 0 and fp32["optimizer"] == 2 * 4 * n_opt + steps
    off = mem(**precision_fields("bf16-mixed", True))
    assert {k: off[k] for k in ("params", "master", "optimizer", "grads")} == \
        {k: mixed[k] for k in ("params", "master", "optimizer", "grads")}
    assert off["offloaded"] == mixed["master"] + mixed["optimizer"] + 4 * n_opt + (mixed["params"] if zero == 3 else 0)
    assert off["peak"] < mixed["peak"]


def test_cli_run_pins_the_precision_into_the_plan_the_ranks_read(tmp_path, capsys):
    from autopar.tools.cli import main

    plan_file, script = tmp_path / "plan.json", tmp_path / "train.py"
    plan_file.write_text(Plan(mesh={"dp": 2}, zero_stage=1).to_json())
    script.write_text("pass\n")
    assert main(["run", str(script), "--plan", str(plan_file), "--precision", "bf16-mixed", "--offload",
                 "--dry-run"]) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if "AUTOPAR_PLAN=" in ln)
    path = line.split("AUTOPAR_PLAN=")[1].split()[0]
    pinned = Plan.load(path)
    os.remove(path)  # cmd_run leaves it for the ranks it launches
    assert pinned == Plan(mesh={"dp": 2}, zero_stage=1, **precision_fields("bf16-mixed", True))
    assert main(["run", "gpt-tiny", "--nproc", "2", "--precision", "bf16", "--dry-run"]) != 0
    assert "--precision / --offload pin fields of a plan: give --plan FILE" in capsys.readouterr().err


def test_parallelize_refuses_an_unknown_precision_before_any_work():
    import autopar

    with pytest.raises(ValueError, match=r"unknown precision 'bf16_mixed'; choose one of \['fp32', 'bf16', "
                                         r"'bf16-mixed', 'fp16-mixed'\]"):
        autopar.parallelize(_mlp(), None, example_inputs=torch.zeros(2, 16), precision="bf16_mixed")
