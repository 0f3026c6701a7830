"""From a local Hugging Face checkpoint to training under a plan in one command, and back:
`autopar run CKPT_DIR --nproc 2 --save OUT` (the joint planner plans for 2 ranks, each rank
builds the model on meta and reads its slices of the checkpoint, trains, and writes a Hugging
Face checkpoint transformers loads); `autopar verify CKPT_DIR --plan` checks a tp plan from
the checkpoint against one process from the same checkpoint; a missing --weights exits 2.

`run` and `verify` run as the user types them (a new Python process each); `plan` and the
refused `run`, where the process is not what is checked, call the CLI's `main` in this process
(each subprocess re-imports torch and transformers: seconds of CPU)."""
import os
import subprocess
import sys

import pytest
import torch

from autopar.tools.cli import main

transformers = pytest.importorskip("transformers")


def _cli(*args, cwd):
    return subprocess.run([sys.executable, "-m", "autopar", *args], capture_output=True, text=True, cwd=cwd,
                          timeout=600)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    d = tmp_path_factory.mktemp("hf")
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=128, use_cache=False)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(d / "ckpt")
    return d


def test_run_from_a_checkpoint_directory_trains_and_saves_a_checkpoint_transformers_loads(checkpoint):
    r = _cli("run", "ckpt", "--nproc", "2", "--steps", "2", "--save", "trained", cwd=checkpoint)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert "weights from" in r.stdout and "saved a Hugging Face checkpoint" in r.stdout, r.stdout
    out = checkpoint / "trained"
    assert (out / "config.json").exists() and any(f.endswith(".safetensors") for f in os.listdir(out))
    before = transformers.AutoModelForCausalLM.from_pretrained(checkpoint / "ckpt")
    after = transformers.AutoModelForCausalLM.from_pretrained(out)
    changed = [n for (n, a), (_, b) in zip(before.state_dict().items(), after.state_dict().items())
               if a.shape == b.shape and not torch.equal(a, b)]
    assert len(changed) > 10, "two AdamW steps must have changed the weights"


def test_verify_a_tp_plan_from_the_checkpoint_against_one_process(checkpoint, monkeypatch, capsys):
    monkeypatch.chdir(checkpoint)
    rc = main(["plan", "ckpt", "--mesh", "tp=2", "--hardware", "h100-sxm", "--out", "tp.json"])
    assert rc == 0, capsys.readouterr().err[-2000:]
    assert (checkpoint / "tp.json").exists()
    r = _cli("verify", "ckpt", "--plan", "tp.json", cwd=checkpoint)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert "parity: OK" in r.stdout


def test_a_missing_weights_path_exits_2_naming_it(checkpoint, monkeypatch, capsys):
    before = sorted(os.listdir(checkpoint))
    monkeypatch.chdir(checkpoint)
    rc = main(["run", "ckpt/config.json", "--nproc", "2", "--weights", "nowhere.safetensors"])
    err = capsys.readouterr().err
    assert rc == 2 and "nowhere.safetensors" in err, err[-2000:]
    assert sorted(os.listdir(checkpoint)) == before
