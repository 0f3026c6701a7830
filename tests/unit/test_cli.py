"""The command line: every subcommand on CPU, its outputs opened and checked.

demo trains and reports parity; capture prints time and RAM; plan prints the plan and its
predictions (and JSON that parses, with alternatives); dump writes graphs that compile,
a plan that loads, a schedule grid that parses and an HTML report that headless Chromium
renders without script errors (skipped, with the reason, where no Chromium is installed);
run writes a Slurm script that bash accepts; verify plans, runs the plan on two gloo
processes and reports parity; user errors exit 2 with a message that says what to change.
(`tune` and `run` under torchrun: tests/dist/test_cli_tune.py.)
"""
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import textwrap
import zlib
from html.parser import HTMLParser
from xml.etree import ElementTree

import pytest

from autopar.tools.cli import main
from autopar.passes.plan import Plan
from autopar.runtime.schedules import Schedule


def test_demo_trains_on_two_processes_reports_parity_and_writes_a_dump(tmp_path, capsys):
    rc = main(["demo", "--world-size", "2", "--steps", "2", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "parity: OK" in out and "autopar plan on mesh {'dp': 2}" in out
    assert json.loads((tmp_path / "plan.json").read_text())["mesh"] == {"dp": 2}
    assert (tmp_path / "rank1_program.py").exists()


def test_demo_with_indivisible_batch_exits_2(capsys):
    assert main(["demo", "--world-size", "3", "--batch", "8"]) == 2
    assert "does not divide" in capsys.readouterr().err


def test_capture_command_prints_time_ram_and_ops(capsys):
    assert main(["capture", "--model", "gpt-tiny", "--seq", "16", "--batch", "2"]) == 0
    out = capsys.readouterr().out
    assert "captured on meta by export" in out and "peak RAM" in out and "linear" in out


# ------------------------------------------------------------------------ plan
def test_plan_json_has_the_plan_its_predictions_and_ranked_alternatives(capsys):
    rc = main(["plan", "gpt-tiny", "--world-size", "4", "--hardware", "cpu-gloo", "--top", "3", "--json"])
    cap = capsys.readouterr()
    assert rc == 0, cap.err
    d = json.loads(cap.out)
    plan = Plan.from_dict(d["plan"])
    assert plan.world_size == 4
    assert d["planner"] in ("joint", "fallback") and d["planner_note"]
    assert d["predicted"]["step_s"] > 0 and d["predicted"]["peak_bytes"] > 0
    alts = d["alternatives"]
    assert 1 <= len(alts) <= 3 and alts[0]["mesh"] == plan.mesh
    steps = [a["step_s"] for a in alts if a["fits"]]
    assert steps == sorted(steps), "alternatives are not ranked by predicted step time"
    assert all(a["step_s"] > 0 for a in alts)


def test_plan_recompute_pin_writes_selective_blocks_with_their_kept_nodes(capsys, tmp_path):
    """`--recompute selective`: every block recomputed "selective", the GEMMs and fused attention it
    keeps written into the plan (`recompute_save`); the fallback planner refuses the pin."""
    out_plan = tmp_path / "plan.json"
    rc = main(["plan", "gpt-tiny", "--mesh", "dp=2", "--hardware", "cpu-gloo", "--recompute", "selective",
               "--out", str(out_plan), "--no-progress"])
    assert rc == 0, capsys.readouterr().err
    plan = Plan.from_json(out_plan.read_text())
    assert plan.recompute and set(plan.recompute.values()) == {"selective"}
    assert set(plan.extra["recompute_save"]) == set(plan.recompute)
    kept = {k.split(":")[1].split("#")[0] for keys in plan.extra["recompute_save"].values() for k in keys}
    assert kept == {"linear", "scaled_dot_product_attention"}  # GEMMs and the fused attention kernel
    assert plan.predicted["recompute_s"] > 0
    assert main(["plan", "gpt-tiny", "--mesh", "dp=2", "--hardware", "cpu-gloo", "--recompute", "full",
                 "--planner", "fallback", "--no-progress"]) == 2
    assert "pin of the joint planner" in capsys.readouterr().err


def test_plan_table_on_a_fixed_mesh_with_the_fallback_planner_shows_tp_and_predictions(capsys, tmp_path):
    out_plan = tmp_path / "plan.json"
    rc = main(["plan", "gpt-tiny", "--mesh", "dp=1,tp=2", "--hardware", "cpu-gloo", "--planner", "fallback",
               "--top", "2", "--out", str(out_plan), "--no-progress"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "planner" in out and "fallback" in out and "predicted step time" in out and "top 1 of 1" in out
    plan = Plan.from_json(out_plan.read_text())
    assert plan.mesh == {"dp": 1, "tp": 2} and plan.strategies.get("tp") and plan.param_layouts
    assert plan.extra["cli"]["model"] == "gpt-tiny"
    # the step time includes the tensor-parallel collectives the shard pass inserts
    assert plan.predicted["comm_s"] > 0


def test_plan_builds_a_transformers_config_and_a_module_factory(tmp_path, capsys, monkeypatch):
    cfg = tmp_path / "tiny_llama"
    cfg.mkdir()
    (cfg / "config.json").write_text(json.dumps({
        "model_type": "llama", "vocab_size": 96, "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 64}))
    rc = main(["plan", str(cfg), "--world-size", "2", "--hardware", "cpu-gloo", "--seq", "16", "--json",
               "--planner", "fallback"])
    cap = capsys.readouterr()
    assert rc == 0, cap.err
    d = json.loads(cap.out)
    assert d["model"].startswith("llama:") and d["predicted"]["step_s"] > 0
    (tmp_path / "my_models.py").write_text(textwrap.dedent("""
        import torch, torch.nn as nn
        def build():
            return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
        def example_inputs(batch_size, seq_len):
            return torch.randn(batch_size, 16)
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    rc = main(["plan", "my_models:build", "--world-size", "2", "--hardware", "cpu-gloo", "--json",
               "--planner", "fallback"])
    cap = capsys.readouterr()
    assert rc == 0, cap.err
    assert json.loads(cap.out)["plan"]["mesh"]["dp"] >= 1


@pytest.mark.parametrize("argv, words", [
    (["plan", "gtp-tiny", "--world-size", "2"], ["unknown model 'gtp-tiny'", "Did you mean 'gpt-tiny'"]),
    (["plan", "gpt-tiny", "--mesh", "dp=two"], ["--mesh 'dp=two'", "name=size"]),
    (["plan", "gpt-tiny", "--mesh", "dp=2,xp=2"], ["axis 'xp'"]),
    (["plan", "gpt-tiny", "--world-size", "2", "--hardware", "h900"], ["unknown hardware profile 'h900'"]),
    (["verify", "gpt-tiny"], ["--plan plan.json", "--mesh"]),
    (["run", "gpt-tiny", "--plan", "no/such/plan.json"], ["does not exist", "autopar plan"]),
])
def test_user_errors_exit_2_and_say_what_to_change(argv, words, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    for w in words:
        assert w in err, err


@pytest.mark.parametrize("cmd", ["plan", "dump", "tune", "run", "verify"])
def test_every_command_has_help_with_examples(cmd, capsys):
    with pytest.raises(SystemExit) as e:
        main([cmd, "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "examples:" in out and f"autopar {cmd}" in out


# ------------------------------------------------------------------------ dump
class _Tags(HTMLParser):
    def __init__(self):
        super().__init__()
        self.tags, self.refs = [], []

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)
        self.refs += [v for k, v in attrs if k in ("src", "href") and v]


@pytest.fixture(scope="module")
def pp_tp_dump(tmp_path_factory):
    out = tmp_path_factory.mktemp("dump")
    rc = main(["dump", "gpt-tiny", "--mesh", "pp=2,tp=2", "--hardware", "cpu-gloo", "--out", str(out),
               "--no-progress", "--top", "3"])
    assert rc == 0
    return out


def test_dump_writes_rank_programs_plan_schedule_and_report_that_parse(pp_tp_dump):
    d = pp_tp_dump
    plan = Plan.from_json((d / "plan.json").read_text())
    assert plan.mesh["pp"] == 2 and plan.split_points and plan.strategies.get("tp")
    ranks = (d / "ranks.txt").read_text().splitlines()
    assert len(ranks) == 4
    for r in range(4):
        code = (d / f"rank{r}_program.py").read_text()
        compile(code, f"rank{r}_program.py", "exec")
        assert f"rank {r} coords" in code and "runs stages" in code
    for s in range(2):
        compile((d / f"stage{s}.py").read_text(), f"stage{s}.py", "exec")
    sched = Schedule.from_grid((d / "schedule.txt").read_text())
    assert sched.n_ranks == 2 and sched.n_microbatches == plan.n_microbatches
    est = json.loads((d / "estimate.json").read_text())
    assert est["step_s"] > 0 and est["mesh"] == plan.mesh
    rep = json.loads((d / "plan_report.json").read_text())
    assert rep["predicted"]["step_s"] > 0 and rep["alternatives"]
    ElementTree.fromstring((d / "schedule.svg").read_text())


def test_dump_html_report_is_self_contained_and_has_every_section(pp_tp_dump):
    html = (pp_tp_dump / "report.html").read_text()
    p = _Tags()
    p.feed(html)
    assert not p.refs, f"the report references outside files: {p.refs[:5]}"
    for section in ("Graph with placements", "Stage map", "Recompute and fusion decisions", "Memory per rank",
                    "Pipeline schedule", "Alternatives"):
        assert f"<h2>{section}" in html, section
    svgs = re.findall(r"<svg.*?</svg>", html, flags=re.S)
    assert len(svgs) >= 4  # graph, stage map, memory, Gantt
    for s in svgs:
        ElementTree.fromstring(s)  # well-formed
    assert html.count('class="node"') > 20 and "#e45756" in svgs[0]  # ops drawn, collectives among them
    assert "rank 3" in html and "stage 1" in html


def _chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable", "chrome",
                 "headless_shell"):
        path = shutil.which(name)
        if path:
            return path
    return None


def _png_pixels(path) -> tuple[int, int, bytes]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, idat, size = 8, b"", None
    while pos < len(data):
        n, kind = struct.unpack(">I4s", data[pos:pos + 8])
        body = data[pos + 8:pos + 8 + n]
        if kind == b"IHDR":
            size = struct.unpack(">II", body[:8])
        elif kind == b"IDAT":
            idat += body
        pos += 12 + n
    return size[0], size[1], zlib.decompress(idat)


def test_dump_html_report_renders_in_headless_chromium_without_errors(pp_tp_dump, tmp_path):
    exe = _chromium()
    if exe is None:
        pytest.skip("no headless Chromium on this machine (looked for chromium, google-chrome, headless_shell); "
                    "install one (apt-get install chromium) to run the screenshot test")
    url = (pp_tp_dump / "report.html").resolve().as_uri()
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--enable-logging=stderr", "--v=0"]
    dom = subprocess.run([exe, *flags, "--dump-dom", url], capture_output=True, text=True, timeout=120)
    assert dom.returncode == 0, dom.stderr[-2000:]
    assert 'data-ready="1"' in dom.stdout, "the page's script did not finish loading"
    assert "data-errors" not in dom.stdout, re.findall(r'data-errors="[^"]*"', dom.stdout)
    console_errors = [ln for ln in dom.stderr.splitlines() if "CONSOLE" in ln and ("Uncaught" in ln or "Error" in ln)]
    assert not console_errors, console_errors
    shot = tmp_path / "report.png"
    r = subprocess.run([exe, *flags, f"--screenshot={shot}", "--window-size=1280,2400", url],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and shot.exists(), r.stderr[-2000:]
    w, h, raw = _png_pixels(shot)
    assert (w, h) == (1280, 2400)
    assert len(set(raw[::7])) > 40, "the screenshot is (nearly) blank"


# ------------------------------------------------------------------------ run (no processes)
def test_run_writes_a_slurm_script_that_bash_accepts(tmp_path, capsys):
    plan = Plan(mesh={"dp": 4, "tp": 4})
    (tmp_path / "plan.json").write_text(plan.to_json())
    (tmp_path / "train.py").write_text("print('hi')\n")
    script = tmp_path / "job.sbatch"
    rc = main(["run", str(tmp_path / "train.py"), "--plan", str(tmp_path / "plan.json"), "--slurm", str(script),
               "--nodes", "2", "--partition", "gpu", "--", "--lr", "3e-4"])
    out = capsys.readouterr().out
    assert rc == 0, out
    text = script.read_text()
    assert "#SBATCH --nodes=2" in text and "#SBATCH --gpus-per-node=8" in text and "#SBATCH --partition=gpu" in text
    assert "torch.distributed.run" in text and "--nnodes=$SLURM_JOB_NUM_NODES" in text and "--lr 3e-4" in text
    assert f"AUTOPAR_PLAN={tmp_path / 'plan.json'}" in text
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    assert main(["run", str(tmp_path / "train.py"), "--plan", str(tmp_path / "plan.json"), "--slurm",
                 str(script), "--nodes", "3"]) == 2
    assert "choose them so that the product is 16" in capsys.readouterr().err


def test_run_dry_run_prints_the_torchrun_command(tmp_path, capsys):
    (tmp_path / "plan.json").write_text(Plan(mesh={"dp": 2}).to_json())
    rc = main(["run", "gpt-tiny", "--plan", str(tmp_path / "plan.json"), "--dry-run", "--job-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0
    assert "--nproc-per-node=2" in out and "-m autopar.tools.worker" in out
    job = json.loads((tmp_path / "job.json").read_text())
    assert job["kind"] == "train" and job["model"] == "gpt-tiny" and job["batch"] % 2 == 0


# ------------------------------------------------------------------------ verify
def test_verify_plans_a_tp_mesh_runs_it_on_two_processes_and_reports_parity(capsys):
    rc = main(["verify", "gpt-tiny", "--mesh", "dp=1,tp=2", "--steps", "2", "--no-progress"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "parity: OK" in out and "2 gloo processes vs one process" in out
    losses = [ln.split() for ln in out.splitlines() if re.match(r"^\s+\d+\s+\d", ln)]
    assert len(losses) == 2 and all(float(a[3]) <= 1e-5 + 1e-4 * abs(float(a[2])) for a in losses)


def test_verify_a_zoo_row_with_tied_weights_under_pp_checks_every_name(capsys):
    """T5 ties shared / encoder / decoder embeddings; under pp they live on different stages."""
    pytest.importorskip("transformers")
    rc = main(["verify", "hf-t5:tiny", "--mesh", "pp=2", "--steps", "2", "--no-progress"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "parity: OK" in out and "no rank returned" not in out


def test_verify_refuses_a_plan_larger_than_max_procs(tmp_path, capsys):
    (tmp_path / "plan.json").write_text(Plan(mesh={"dp": 4, "tp": 4}).to_json())
    assert main(["verify", "gpt-tiny", "--plan", str(tmp_path / "plan.json")]) == 2
    assert "--max-procs 8" in capsys.readouterr().err


def test_module_entry_point_runs_the_cli():
    r = subprocess.run([sys.executable, "-m", "autopar", "plan", "--help"], capture_output=True, text=True,
                       timeout=120, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert r.returncode == 0 and "--world-size" in r.stdout
