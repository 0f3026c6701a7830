"""Shared test set-up: make `tests/` importable (for `harness`) and keep torch single-threaded
per process so that spawned gloo worlds do not oversubscribe the CI machine's cores.

Before the first test under tests/dist, the pytest process warms itself once
(`harness.warm_parent`): it imports what every rank imports and runs one capture and one
plan of gpt-tiny on meta. Ranks forked from it then start warm instead of each paying the
first torch.export and the planner's imports again (measured: ~2 CPU-s a rank, ~120 worlds
in the suite). The planner's in-memory plan cache is cleared after it, so no rank reuses
that plan. Set AUTOPAR_TEST_WARM=0 to skip it.

With AUTOPAR_TEST_MODULE_TIMES=1 (scripts/test.sh sets it) the summary lists the seconds each
test module took (setup, call and teardown of its tests: a module's shared world is in the
setup of its first test), slowest first.
"""
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("OMP_NUM_THREADS", "1")

import harness  # noqa: E402  (registers the fork server's imports before any world starts)

_DIST = os.path.join(os.path.dirname(os.path.abspath(__file__)), "dist") + os.sep


@pytest.fixture(autouse=True)
def _warm_before_worlds(request):
    if str(request.node.path).startswith(_DIST):
        harness.warm_parent()
    yield



_MODULE_SECONDS: dict[str, float] = {}


def pytest_runtest_logreport(report):
    module = report.nodeid.split("::")[0]
    _MODULE_SECONDS[module] = _MODULE_SECONDS.get(module, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter):
    if os.environ.get("AUTOPAR_TEST_MODULE_TIMES") != "1" or not _MODULE_SECONDS:
        return
    rows = sorted(_MODULE_SECONDS.items(), key=lambda kv: -kv[1])
    terminalreporter.write_sep("=", f"seconds per test module ({len(rows)} modules, {sum(_MODULE_SECONDS.values()):.0f} s)")
    for module, secs in rows:
        if secs >= 1.0:
            terminalreporter.write_line(f"{secs:8.1f}s  {module}")
