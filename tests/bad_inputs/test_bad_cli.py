"""The command line given bad meshes, plan files, models and arguments: exit code 2, one
`error:` line on stderr naming the argument and what to change, no traceback, and nothing
written in the working directory (each test runs in an empty one and checks it stays so).

Meshes: every axis the README documents (pp, dp, ep, tp) is accepted by every command; a mesh
that cannot split the model (tp dividing none of its weights' dims, pp above its pipeline
units, ep without MoE blocks) is refused with the dimension and the sizes that would work,
before any process starts or file is written. The positive controls plan an ep mesh on the
MoE model and a tp mesh that fits.
"""
from __future__ import annotations

import json
import textwrap

import pytest

from autopar.tools.cli import main
from autopar.tools.model_source import resolve
from autopar.passes.plan import Plan
from autopar.tools.planning import capture_meta


@pytest.fixture
def cwd(tmp_path, monkeypatch):
    d = tmp_path / "work"
    d.mkdir()
    monkeypatch.chdir(d)
    return d


def _fails(argv, words, capsys, cwd, unchanged):
    with unchanged(cwd):
        rc = main(argv)
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "Traceback" not in err
    lines = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1, err
    for w in words:
        assert w in lines[0], lines[0]
    return lines[0]


# --- meshes --------------------------------------------------------------------------------------
def test_a_tp_size_that_divides_none_of_the_weights_is_refused_with_sizes_that_would(capsys, cwd, unchanged):
    _fails(["plan", "gpt-tiny", "--mesh", "tp=3", "--no-progress", "--out", "plan.json"],
           ["tp=3 divides no dimension of the model's weights", "tp sizes that would: 2, 4, 8"], capsys, cwd, unchanged)


@pytest.mark.parametrize("cmd", ["plan", "dump", "tune", "verify"])
def test_every_command_accepts_an_ep_axis_and_refuses_it_on_a_model_without_experts(cmd, capsys, cwd, unchanged):
    argv = [cmd, "gpt-tiny", "--mesh", "dp=2,ep=2", "--no-progress"]
    if cmd in ("dump", "tune"):
        argv += ["--out", "out"]
    _fails(argv, ["ep=2 but the model has no mixture-of-experts block", "give those ranks to dp"], capsys, cwd,
           unchanged)


def test_an_ep_mesh_on_the_moe_model_plans_its_experts(capsys, cwd):
    rc = main(["plan", "moe-tiny", "--mesh", "dp=2,ep=2", "--hardware", "cpu-gloo", "--planner", "fallback",
               "--json", "--no-progress"])
    cap = capsys.readouterr()
    assert rc == 0, cap.err
    plan = Plan.from_dict(json.loads(cap.out)["plan"])
    assert plan.mesh == {"dp": 2, "ep": 2}
    assert plan.extra["expert"]["ep"] == 2 and len(plan.extra["expert"]["blocks"]) == 2
    assert plan.graph["n_tensors"] > 0  # stamped with the model's fingerprint


@pytest.mark.parametrize("mesh, words", [
    ("pp=9", ["pp=9 needs at least 9 pipeline units", "the model has 5", "use pp from 2 to 5"]),
    ("cp=2", ["axis 'cp'", "context parallelism", "pp, dp, ep, tp"]),
    ("dp=0", ["name=size with a positive size", "'dp=0'"]),
    ("dp=2,dp=2", ["names axis 'dp' twice"]),
    (",", ["--mesh is empty"]),
])
def test_a_mesh_that_cannot_be_run_is_refused_naming_it(mesh, words, capsys, cwd, unchanged):
    _fails(["plan", "gpt-tiny", "--mesh", mesh, "--no-progress"], words, capsys, cwd, unchanged)


def test_a_batch_that_the_mesh_cannot_split_is_refused_with_a_multiple_that_would(capsys, cwd, unchanged):
    _fails(["plan", "gpt-tiny", "--mesh", "dp=4", "--batch", "6", "--no-progress"],
           ["--batch 6 does not divide by dp=4 x micro-batches=1 = 4", "use a multiple of 4 (e.g. 8)"],
           capsys, cwd, unchanged)


# --- plan files ----------------------------------------------------------------------------------
@pytest.mark.parametrize("text, words", [
    ('{"mesh": {"dp": 2}', ["is not valid JSON", "line 1 column"]),
    ('{"mesh": {"dp": 2}, "zero_stage": "3"}', ["'zero_stage'", "integer from 0 to 3"]),
    ('{"mesh": {"dp": 2}, "n_microbatches": -1, "schedule": "fast"}', ["'n_microbatches'", "unknown schedule 'fast'"]),
])
def test_run_with_a_malformed_or_mistyped_plan_file_names_the_field(text, words, capsys, cwd, unchanged):
    (cwd / "plan.json").write_text(text)
    _fails(["run", "gpt-tiny", "--plan", "plan.json", "--dry-run"], ["plan.json", *words], capsys, cwd, unchanged)


def test_verify_refuses_a_plan_made_for_another_model_before_starting_any_process(capsys, cwd, unchanged,
                                                                                 monkeypatch):
    from autopar.build.plan_check import stamp
    from autopar.runtime import launch

    plan = Plan(mesh={"dp": 2})
    stamp(plan, capture_meta(resolve("gpt-tiny-tied"), 4, 16))
    (cwd / "plan.json").write_text(plan.to_json())
    monkeypatch.setattr(launch, "run_world", lambda *a, **k: pytest.fail("a world was started"))
    _fails(["verify", "gpt-tiny", "--plan", "plan.json", "--no-progress"],
           ["the plan is for another model", "fingerprint", "Plan this model again"], capsys, cwd, unchanged)


def test_run_refuses_a_plan_naming_parameters_the_model_lacks(capsys, cwd, unchanged):
    from autopar.runtime.placement import Layout, S

    plan = Plan(mesh={"dp": 1, "tp": 2}, param_layouts={"decoder.head.weight": Layout.of({"tp": S(0)})})
    (cwd / "plan.json").write_text(plan.to_json())
    _fails(["run", "gpt-tiny", "--plan", "plan.json", "--dry-run", "--job-dir", "job"],
           ["none of it was applied", "'decoder.head.weight'"], capsys, cwd, unchanged)


def test_run_refuses_a_batch_the_plan_cannot_split_before_writing_its_job(capsys, cwd, unchanged):
    (cwd / "plan.json").write_text(Plan(mesh={"dp": 4}).to_json())
    _fails(["run", "gpt-tiny", "--plan", "plan.json", "--batch", "6", "--dry-run", "--job-dir", "job"],
           ["--batch 6 does not divide by dp x ep x micro-batches = 4", "e.g. 8"], capsys, cwd, unchanged)


def test_run_slurm_with_a_node_count_that_does_not_make_the_world_lists_those_that_do(capsys, cwd, unchanged):
    (cwd / "plan.json").write_text(Plan(mesh={"dp": 4}).to_json())
    (cwd / "train.py").write_text("print('train')\n")
    _fails(["run", "train.py", "--plan", "plan.json", "--slurm", "job.sbatch", "--nodes", "3"],
           ["--nodes 3 x --gpus-per-node 2 = 6 ranks", "has 4", "1 x 4, 2 x 2, 4 x 1"], capsys, cwd, unchanged)


# --- models --------------------------------------------------------------------------------------
def _module(cwd, monkeypatch, name: str, body: str) -> None:
    mods = cwd.parent / "mods"  # outside the working directory (imports write __pycache__)
    mods.mkdir(exist_ok=True)
    (mods / f"{name}.py").write_text(textwrap.dedent(body))
    monkeypatch.syspath_prepend(str(mods))


def test_a_factory_that_raises_is_named_with_its_error(capsys, cwd, unchanged, monkeypatch):
    _module(cwd, monkeypatch, "raising_models", """
        def build():
            raise RuntimeError("no config file")
    """)
    _fails(["plan", "raising_models:build", "--world-size", "2"],
           ["calling raising_models:build() (on the meta device) failed", "RuntimeError: no config file"],
           capsys, cwd, unchanged)


def test_a_factory_feeding_float_token_ids_names_the_input_and_the_embedding(capsys, cwd, unchanged, monkeypatch):
    _module(cwd, monkeypatch, "float_id_models", """
        import torch
        from autopar.models import get

        def build():
            return get("gpt-tiny").build()

        def example_inputs(batch, seq):
            return torch.rand(batch, 16) * 100  # token ids as floats
    """)
    _fails(["plan", "float_id_models:build", "--world-size", "2", "--no-progress"],
           ["float_id_models:build", "float32 (8, 16)", "nn.Embedding 'tok_emb'", "integer token ids", ".long()"],
           capsys, cwd, unchanged)


def test_a_transformers_config_that_is_not_an_object_is_refused(capsys, cwd, unchanged):
    (cwd / "config.json").write_text("[1, 2, 3]")
    _fails(["plan", "config.json", "--world-size", "2"], ["config.json holds a JSON list", "not a transformers config"],
           capsys, cwd, unchanged)
