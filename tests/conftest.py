"""Shared test set-up: make `tests/` importable (for `harness`) and keep torch single-threaded
per process so that spawned gloo worlds do not oversubscribe the CI machine's cores.

Before the first tests/dist module (its module fixtures included), the pytest process warms itself once
(`harness.warm_parent`): it imports what every rank imports and runs one capture and one
plan of gpt-tiny on meta. Ranks forked from it then start warm instead of each paying the
first torch.export and the planner's imports again (measured: ~2 CPU-s a rank, ~120 worlds
in the suite). The planner's in-memory plan cache is cleared after it, so no rank reuses
that plan. Set AUTOPAR_TEST_WARM=0 to skip it.

With AUTOPAR_TEST_MODULE_TIMES=1 (scripts/test.sh sets it) the summary lists the seconds each
test module took (setup, call and teardown of its tests: a module's shared world is in the
setup of its first test), slowest first, with the CPU seconds it cost (this process and the
children it reaped: the ranks of its worlds, its subprocesses), the number to compare on a
shared machine where wall-clock time is noisy.

With AUTOPAR_TEST_PROFILE=dir every rank of every world started through `harness.world` or
`autopar.runtime.launch.run_world` is profiled and writes dir/<test module>.<pid>.r<rank>.*
(read them with `python tests/profile_report.py dir`): by default a CPU-time sampler
(`profile_report.Sampler`, a stack every 5 ms of the rank's CPU, ~1% overhead), or with
AUTOPAR_TEST_PROFILE_MODE=cprofile, cProfile (exact call counts, but its per-call cost inflates
small Python functions: the pass manager's fingerprint averaged 11.6 ms a call under cProfile in
zoo ranks, 0.6 ms unprofiled on hf-llama tiny; two zoo rows cost about 4x their CPU-s).
"""
import os
import resource
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("OMP_NUM_THREADS", "1")

import harness  # noqa: E402  (registers the fork server's imports before any world starts)
from autopar.runtime.launch import preload_in_fork_server

import autopar

# autopar/__init__.py loads its public names on first use: load them here (as importing any autopar
# module did before), so that ranks forked from this process inherit them instead of each importing
# autopar.api, DCP and the planner's floors again (~1 CPU-s a rank); a fork server imports them too
autopar.parallelize  # noqa: B018
preload_in_fork_server("autopar.api", "autopar.checkpoint_api")

_DIST = os.path.join(os.path.dirname(os.path.abspath(__file__)), "dist") + os.sep


@pytest.fixture(scope="module", autouse=True)
def _warm_before_worlds(request):
    # module scope: before the module's own module-scoped fixtures, which start most worlds (a
    # function-scoped warm-up ran after them, so the first module of a session forked cold ranks)
    if str(request.path).startswith(_DIST):
        harness.warm_parent()
    yield



def pytest_collection_modifyitems(config, items):
    """AUTOPAR_TEST_FIRST="path.py ...": those test modules run first, in that order, the others
    after them in their usual order (scripts/test.sh puts first the dist modules whose pytest
    process works alone between worlds, while the other half of the suite still runs beside them)."""
    first = os.environ.get("AUTOPAR_TEST_FIRST", "").split()
    if first:
        rank = {m: i for i, m in enumerate(first)}
        items.sort(key=lambda it: rank.get(it.nodeid.split("::")[0], len(first)))  # stable: the rest keep their order


_MODULE_SECONDS: dict[str, float] = {}
_MODULE_CPU: dict[str, float] = {}


def _cpu_seconds() -> float:
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    t0 = _cpu_seconds()
    yield
    module = item.nodeid.split("::")[0]
    _MODULE_CPU[module] = _MODULE_CPU.get(module, 0.0) + _cpu_seconds() - t0


def pytest_runtest_logreport(report):
    module = report.nodeid.split("::")[0]
    _MODULE_SECONDS[module] = _MODULE_SECONDS.get(module, 0.0) + report.duration


def _profile_worlds(out_dir: str) -> None:
    """Wrap every world's rank function in a profiler (AUTOPAR_TEST_PROFILE)."""
    import functools

    import autopar.runtime.launch as launch

    os.makedirs(out_dir, exist_ok=True)
    plain = launch.run_world

    def profiled_run_world(n, fn, *args, **kwargs):
        return plain(n, functools.partial(_profiled_rank, fn, out_dir), *args, **kwargs)

    launch.run_world = profiled_run_world
    harness.run_world = profiled_run_world


def _profiled_rank(fn, out_dir, rank, n, *args, **kwargs):
    import profile_report

    module = os.environ.get("PYTEST_CURRENT_TEST", "unknown").split("::")[0].replace("/", ".")
    stem = os.path.join(out_dir, f"{module}.{os.getpid()}.r{rank}")
    if os.environ.get("AUTOPAR_TEST_PROFILE_MODE", "sample") == "cprofile":
        import cProfile
        import time

        prof = cProfile.Profile(time.process_time)  # CPU: waiting on a peer or a core costs nothing
        try:
            return prof.runcall(fn, rank, n, *args, **kwargs)
        finally:
            prof.dump_stats(stem + ".prof")
    sampler = profile_report.Sampler()
    sampler.start()
    try:
        return fn(rank, n, *args, **kwargs)
    finally:
        sampler.stop()
        sampler.dump(stem + ".samples.json")


if os.environ.get("AUTOPAR_TEST_PROFILE"):
    _profile_worlds(os.environ["AUTOPAR_TEST_PROFILE"])


def pytest_terminal_summary(terminalreporter):
    if os.environ.get("AUTOPAR_TEST_MODULE_TIMES") != "1" or not _MODULE_SECONDS:
        return
    rows = sorted(_MODULE_SECONDS.items(), key=lambda kv: -kv[1])
    terminalreporter.write_sep("=", f"seconds per test module ({len(rows)} modules, {sum(_MODULE_SECONDS.values()):.0f} s, "
                                    f"{sum(_MODULE_CPU.values()):.0f} CPU-s)")
    for module, secs in rows:
        if secs >= 1.0:
            terminalreporter.write_line(f"{secs:8.1f}s  {_MODULE_CPU.get(module, 0.0):8.1f} CPU-s  {module}")
