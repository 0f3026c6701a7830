"""scripts/gpu_check.py, the GPU acceptance run, checked where there is no GPU: its dry run
(the same driver on the CPU at tiny sizes, gloo world of 1) trains every row of the matrix
and writes the table; a failed row makes the exit status 1; without a GPU and without
--dry-run it refuses with status 2. The kernels, transformers and command-line sections
run elsewhere in the suite already (test_kernels, test_cost_models, test_cli) and are left
out here to keep this under a minute."""
from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu_check.py"


def _module():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def test_dry_run_trains_every_row_and_writes_one_table(tmp_path):
    out = tmp_path / "gpu_check.txt"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--out", str(out), "--skip",
                           "kernels,hf,cli"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    table = out.read_text()
    rows = [ln.split("|")[1].strip() for ln in table.splitlines()[3:]]
    assert rows == ["eager", "torch.compile", "autopar dp", "autopar zero1", "autopar zero2", "autopar zero3",
                    "autopar fusions off", "autopar recompute 0.5", "autopar dp fp32", "autopar zero3 fp32", "autopar zero3 offload",
                    "runtime ZeRO-3", "runtime ZeRO-3 + offload", "save / load / export (ZeRO-3)", "meta build + weights= (ZeRO-3)",
                    "ring fused (cp=1, float32)", "ring math (cp=1, float32)", "ulysses (cp=1, float32)",
                    "ring packed documents (cp=1, float32)"], table
    assert "19 ok, 0 failed" in table.splitlines()[0]
    assert table in proc.stdout  # the table is printed last, as written


def test_a_failed_row_makes_the_exit_status_1_and_shows_in_the_table(tmp_path):
    gc = _module()
    ctx = gc.Ctx(True, torch.device("cpu"), tmp_path / "t.txt")
    ctx.add("train", "eager", True, step_ms=1.0)
    assert gc.finish(ctx) == 0
    gc._guard(ctx, "api", "broken", lambda: 1 / 0)
    assert gc.finish(ctx) == 1
    text = (tmp_path / "t.txt").read_text()
    assert "| FAIL" in text and "ZeroDivisionError" in text and "1 ok, 1 failed" in text
    assert (tmp_path / "gpu_check_api_broken.traceback.txt").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible: the full run would start")
def test_without_a_gpu_the_full_run_refuses_with_status_2(tmp_path, capsys):
    # the script's main in this process (a subprocess would import torch again for one refusal)
    rc = _module().main(["--out", str(tmp_path / "t.txt")])
    err = capsys.readouterr().err
    assert rc == 2 and "--dry-run" in err, err
    assert not (tmp_path / "t.txt").exists()
