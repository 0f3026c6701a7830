"""The command line: the quick-start demo reports parity and writes a dump; bad usage exits 2."""
import json

from autopar.cli import main


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
