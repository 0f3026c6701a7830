"""From a local Hugging Face checkpoint to training under a plan in one command, and back:
`autopar run CKPT_DIR --nproc 2 --save OUT` (the joint planner plans for 2 ranks, each rank
builds the model on meta and reads its slices of the checkpoint, trains, and writes a Hugging
Face checkpoint transformers loads); `autopar verify CKPT_DIR --plan` checks a tp plan from
the checkpoint against one process from the same checkpoint; a missing --weights exits 2.

Every command calls the CLI's entry point, `autopar.tools.cli.main` (what `python -m autopar`
runs; tests/unit/test_cli.py starts that as a process), in this process: `run` still launches its
ranks under torchrun as a user's `autopar run` does, and `verify` forks its world. A new Python
process per command re-imported torch, autopar and transformers for nothing checked here
(measured: `run` 2.0 and `verify` 4.5 CPU-s in the CLI's own process, most of it imports)."""
import os

import pytest
import torch

from autopar.tools.cli import main

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    d = tmp_path_factory.mktemp("hf")
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=128, use_cache=False)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(d / "ckpt")
    return d


def test_run_from_a_checkpoint_directory_trains_and_saves_a_checkpoint_transformers_loads(checkpoint, monkeypatch,
                                                                                         capfd):
    monkeypatch.chdir(checkpoint)
    rc = main(["run", "ckpt", "--nproc", "2", "--steps", "2", "--save", "trained"])
    out, err = capfd.readouterr()  # the torchrun ranks' output too (file descriptors, not sys.stdout)
    assert rc == 0, out[-2000:] + err[-3000:]
    assert "weights from" in out and "saved a Hugging Face checkpoint" in out, out
    out = checkpoint / "trained"
    assert (out / "config.json").exists() and any(f.endswith(".safetensors") for f in os.listdir(out))
    before = transformers.AutoModelForCausalLM.from_pretrained(checkpoint / "ckpt")
    after = transformers.AutoModelForCausalLM.from_pretrained(out)
    changed = [n for (n, a), (_, b) in zip(before.state_dict().items(), after.state_dict().items())
               if a.shape == b.shape and not torch.equal(a, b)]
    assert len(changed) > 10, "two AdamW steps must have changed the weights"


def test_verify_a_tp_plan_from_the_checkpoint_against_one_process(checkpoint, monkeypatch, capfd):
    monkeypatch.chdir(checkpoint)
    rc = main(["plan", "ckpt", "--mesh", "tp=2", "--hardware", "h100-sxm", "--out", "tp.json"])
    assert rc == 0, capfd.readouterr().err[-2000:]
    assert (checkpoint / "tp.json").exists()
    capfd.readouterr()
    rc = main(["verify", "ckpt", "--plan", "tp.json"])
    out, err = capfd.readouterr()
    assert rc == 0, out[-2000:] + err[-3000:]
    assert "parity: OK" in out


def test_a_missing_weights_path_exits_2_naming_it(checkpoint, monkeypatch, capsys):
    before = sorted(os.listdir(checkpoint))
    monkeypatch.chdir(checkpoint)
    rc = main(["run", "ckpt/config.json", "--nproc", "2", "--weights", "nowhere.safetensors"])
    err = capsys.readouterr().err
    assert rc == 2 and "nowhere.safetensors" in err, err[-2000:]
    assert sorted(os.listdir(checkpoint)) == before
