"""The model zoo's coverage matrix, a test per row (autopar.models.zoo, autopar.tools.zoo_check).

Each row is a transformers (or timm) model built from a small config with random weights, as
a user brings it: capture -> plan -> run on gloo (4 processes) under each of the row's meshes
(the joint planner's choice for 4 ranks, dp x tp, pp x dp; ep for Mixtral; pp x tp for Llama),
each against one process with the same seed and batches, and each also from a meta build
(every rank materializing only its part) in the same world (a row's meshes share one world,
one after another): the loss of every step, the global
gradient norm of the first step and every parameter and buffer after 3 AdamW steps, with the
tolerances in autopar/tools/zoo_check.py (fp32: loss 1e-5, gradient norm 1e-5 relative, parameters
1e-4; hf-llama and hf-mistral, whose fp32 rounding floor sits at that bound, run in fp64, as do the ResNet rows and the breadth rows: 1e-6, 1e-9, 1e-6). Each mesh must also print its plan and
write its graph dump. Llama and BERT also train from a keyword batch with `labels` on the
model's own loss, as transformers users write it.

timm rows run when timm imports; on the CPU machine it cannot be installed without replacing
the CPU torch (no CPU torchvision), so they are reported with that reason.
"""
import os

import pytest

transformers = pytest.importorskip("transformers")  # imported before the worlds fork

from autopar.tools import zoo_check  # noqa: E402
from autopar.models import zoo  # noqa: E402

DUMP_FILES = {"plan.json", "graph_captured.py", "report.txt", "passes.json", "rank0_program.py"}


@pytest.mark.parametrize("name", zoo.names())
def test_zoo_row(name, tmp_path):
    why = zoo.get(name).available()
    if why:
        pytest.skip(f"red: {why}")
    results = zoo_check.parity(name, dump_root=str(tmp_path))
    assert len(results) == len(zoo.get(name).meshes)
    for r in results:
        assert not r.error, f"{r.line()}\n{r.error}"
        # the row's meshes ran one after another in one world; a failure there that no mesh
        # shows alone is a state one parallelize leaves to the next
        assert not r.shared_world_error, r.shared_world_error
        assert r.ok
        assert r.from_meta, r.line()  # every mesh also trained from a meta build, with the same result
        want = r.asked.get("world_size") or 0
        if want:  # the planner chose a mesh of that many ranks
            n = 1
            for v in r.mesh.values():
                n *= v
            assert n == want, r.mesh
        else:
            assert {k: v for k, v in r.mesh.items() if v > 1} == r.asked
        assert r.plan_text and "mesh" in r.plan_text, r.plan_text[:300]
        assert DUMP_FILES <= set(r.dump_files), r.dump_files
        if r.mesh.get("pp", 1) > 1:
            assert {"stage0.py", "stage1.py", "schedule.txt"} <= set(r.dump_files)
        tag = "_".join(f"{k}{v}" for k, v in r.asked.items())
        assert os.path.getsize(tmp_path / name / tag / "graph_captured.py") > 1000


def test_timm_rows_state_their_reason_when_timm_is_missing():
    for name in ("timm-resnet50", "timm-vit"):
        row = zoo.get(name)
        why = row.available()
        if why is None:
            continue  # timm imports here: test_zoo_row runs the row
        with pytest.raises(zoo.RowUnavailable, match="timm"):
            zoo.build(name, "tiny")
        with pytest.raises(zoo.RowUnavailable):
            zoo_check.parity(name)


def test_unknown_row_names_the_rows():
    with pytest.raises(ValueError, match="hf-llama"):
        zoo.spec("hf-llamma")
    with pytest.raises(ValueError, match="tiny"):
        zoo.spec("hf-llama", "huge")


@pytest.mark.parametrize("name", ["hf-llama", "hf-bert"])
def test_keyword_batch_with_labels_trains_on_the_models_own_loss(name):
    """The transformers way: `model(**{"input_ids": ..., "labels": ...}).loss`; parallelize takes
    the dict as example_inputs and model.step((batch, None), lambda out, _: out["loss"])."""
    meshes = [({"dp": 2, "tp": 2}, {"hardware": "h100-sxm"}), ({"pp": 2, "dp": 2}, {})]
    for r in zoo_check.parity(name, meshes=meshes, style="labels"):
        assert not r.error, f"{r.line()}\n{r.error}"
        assert not r.shared_world_error, r.shared_world_error
        assert r.ok and {k: v for k, v in r.mesh.items() if v > 1} == r.asked


def test_a_mesh_that_fails_in_the_rows_shared_world_fails_alone():
    """The row's meshes share a world; when one fails there, each runs again in its own world, so
    the error is that mesh's and the other mesh still passes (with the shared world's error kept)."""
    meshes = [({"dp": 2}, {"precision": "fp12"}), ({"dp": 2}, {})]  # an unknown precision: a ValueError
    bad, good = zoo_check.parity("hf-gpt2", meshes=meshes)
    assert "fp12" in bad.error and not bad.ok, bad.error
    assert good.ok and not good.error, f"{good.line()}\n{good.error}"
    assert "fp12" in good.shared_world_error and "fp12" in bad.shared_world_error
