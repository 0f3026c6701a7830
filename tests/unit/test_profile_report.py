"""tests/profile_report.py: the per-module summary of the rank profiles that AUTOPAR_TEST_PROFILE
writes (tests/conftest.py) names the autopar functions a rank spent its CPU in, summed over
every rank's file of one test module, and leaves other modules' files out."""
import cProfile
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import profile_report  # noqa: E402

from autopar.passes import ir  # noqa: E402


def _busy(n: int) -> None:
    for i in range(n):
        ir.NodeInfo(shape=(i, 2), dtype="float32", module=f"layers.{i}").describe()


def test_the_report_sums_a_modules_rank_profiles_and_names_the_autopar_functions(tmp_path):
    for rank, n in ((0, 3000), (1, 1000)):
        prof = cProfile.Profile(time.process_time)
        prof.runcall(_busy, n)
        prof.dump_stats(tmp_path / f"tests.dist.test_a.py.{100 + rank}.r{rank}.prof")
    prof = cProfile.Profile(time.process_time)
    prof.runcall(_busy, 10)
    prof.dump_stats(tmp_path / "tests.dist.test_b.py.200.r0.prof")
    text = profile_report.report(str(tmp_path), top=5, module="test_a")
    assert "== tests.dist.test_a.py: 2 rank runs" in text, text
    assert "test_b" not in text
    describe = next(line for line in text.splitlines() if "ir.py" in line and "(describe)" in line)
    assert describe.split()[3] == "4000x", describe  # 3000 + 1000 calls over the two ranks


def test_the_sampler_attributes_the_cpu_a_rank_spent_to_the_functions_on_its_stack(tmp_path):
    sampler = profile_report.Sampler()
    t0 = time.process_time()
    sampler.start()
    try:
        while time.process_time() - t0 < 0.5:
            _busy(200)
    finally:
        sampler.stop()
    spent = time.process_time() - t0
    sampler.dump(str(tmp_path / "tests.dist.test_c.py.300.r0.samples.json"))
    text = profile_report.report(str(tmp_path), top=10)
    total = float(text.splitlines()[0].split(" rank runs, ")[1].split()[0])
    assert 0.5 * spent <= total <= 1.2 * spent, (total, spent)  # a sample per 5 ms of CPU
    describe = next(line for line in text.splitlines() if "ir.py" in line and "(describe)" in line)
    assert float(describe.split()[0]) > 0.05, describe


def test_the_sampler_counts_the_cpu_of_long_c_calls():
    # a large matmul delivers its profiling signal once it returns, however many 5 ms intervals it
    # took: each sample weighs the CPU since the previous one (unweighted: 0.17 of 2.0 CPU-s)
    import torch

    a = torch.randn(900, 900, dtype=torch.float64)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    sampler = profile_report.Sampler()
    t0 = time.process_time()
    sampler.start()
    try:
        while time.process_time() - t0 < 0.5:
            a @ a
    finally:
        sampler.stop()
        torch.set_num_threads(threads)
    spent = time.process_time() - t0
    assert 0.9 * spent <= sampler.seconds <= 1.01 * spent, (sampler.seconds, spent, sampler.samples)
