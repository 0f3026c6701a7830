"""`autopar.export_state_dict(model)` (no path) stages its checkpoint in a private temporary
folder. It used to stage straight in the shared temp folder, where the save's clean-up of
interrupted saves (`clean_staging`: every `.<name>.tmp-<token>` beside it) deleted the staging
folder of another job exporting at the same moment (found by the plan fuzz, tests/fuzz: a
CheckpointSaveError ENOENT in one of two jobs sharing /tmp)."""
import os
import shutil
import tempfile

import torch

import autopar
from autopar.models.gpt import GPT, GPTConfig


def test_an_export_leaves_another_jobs_staging_folder_in_the_shared_temp_folder_alone():
    torch.manual_seed(0)
    model = GPT(GPTConfig.tiny())
    pm = autopar.parallelize(model, autopar.mesh(dp=1), example_inputs=torch.randint(0, 128, (2, 16)))
    other = os.path.join(tempfile.gettempdir(), f".autopar-export-{os.urandom(6).hex()}.tmp-{os.urandom(6).hex()}")
    os.makedirs(other)
    before = set(os.listdir(tempfile.gettempdir()))
    try:
        sd = autopar.export_state_dict(pm)
        assert os.path.isdir(other), "the export removed another save's staging folder"
        assert set(model.state_dict()) <= set(sd) and torch.equal(sd["lm_head.weight"], model.lm_head.weight)
        leftover = [n for n in set(os.listdir(tempfile.gettempdir())) - before if n.startswith("autopar-export-")]
        assert not leftover, f"the export left {leftover} behind"
    finally:
        shutil.rmtree(other, ignore_errors=True)
