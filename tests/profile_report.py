"""Profiles of the ranks of the test worlds: the sampler that writes them and the report that
reads them (AUTOPAR_TEST_PROFILE=dir, tests/conftest.py).

    AUTOPAR_TEST_PROFILE=/tmp/prof python -m pytest tests/dist/test_zoo.py -q
    python tests/profile_report.py /tmp/prof [--top 25] [--module test_zoo] [--all]

`Sampler`: every 5 ms of the process's CPU time (ITIMER_PROF: a rank waiting on a peer or for a
core costs nothing) it records the running Python stack, weighted by the CPU seconds since the
previous sample (a long C call delivers its signal only when it returns: unweighted, a 1200 x
1200 matmul loop of 2.0 CPU-s sampled as 0.17); a function's CPU seconds are the weights of the
samples it was on the stack for (cumulative) or at the top of (self). The file stores seconds
(its "interval_s" is 1.0). About
1% overhead, so small functions are not inflated as under cProfile (AUTOPAR_TEST_PROFILE_MODE=
cprofile writes .prof files, which the report also reads: exact call counts, inflated times).

The report prints, per test module, the summed CPU of its ranks and the autopar functions
(`--all`: every function) with the most cumulative CPU over every rank of every world of that
module. A profile covers the rank's function only: the fork, the gloo set-up and the teardown
around it are outside (compare the module's CPU-s in the AUTOPAR_TEST_MODULE_TIMES=1 summary).
Reading a profile: the garbage collector's time shows as self time of whatever Python code runs
when a collection ends, often weakref callbacks (`weakref.py` / `torch/utils/weak.py` `remove`);
C++ work under a Python hook (autograd calling a gradient hook) is billed to the hook. Do not
profile the pytest process with cProfile at the same time: forked ranks inherit its hook (a
zoo profile read 141 rank CPU-s that way, 76 without).
Reads and writes no node.meta.
"""
from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import pstats
import signal
import time

INTERVAL_S = 0.005
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the checkout is the package


def _ours(file: str) -> bool:
    """Our own code, wherever the checkout lies: a file under it that is not an installed library
    (a virtual environment inside the checkout must not let pytest's or torch's frames in)."""
    path = os.path.abspath(file)
    return path.startswith(_ROOT + os.sep) and "site-packages" not in path.split(os.sep)


class Sampler:
    """CPU-time stack sampler of this process's main thread (see the module docstring)."""

    def __init__(self, interval_s: float = INTERVAL_S):
        self.interval_s = interval_s
        self.samples = 0
        self.seconds = 0.0
        self._last = 0.0
        self.cum: collections.Counter = collections.Counter()
        self.own: collections.Counter = collections.Counter()
        self._old = None

    def _on_signal(self, _signum, frame) -> None:
        # weighted by the CPU time since the previous sample: a long C call (a large matmul, a
        # gloo collective) delivers one signal when it returns, however many intervals it took
        now = time.process_time()
        w, self._last = now - self._last, now
        self.samples += 1
        self.seconds += w
        seen = set()
        top = True
        while frame is not None:
            code = frame.f_code
            key = f"{code.co_filename}:{code.co_firstlineno}({code.co_name})"
            if top:
                self.own[key] += w
                top = False
            if key not in seen:  # recursion counts once
                seen.add(key)
                self.cum[key] += w
            frame = frame.f_back

    def start(self) -> None:
        self._last = time.process_time()
        self._old = signal.signal(signal.SIGPROF, self._on_signal)
        signal.setitimer(signal.ITIMER_PROF, self.interval_s, self.interval_s)

    def stop(self) -> None:
        signal.setitimer(signal.ITIMER_PROF, 0, 0)
        signal.signal(signal.SIGPROF, self._old if self._old is not None else signal.SIG_DFL)

    def dump(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump({"interval_s": 1.0, "samples": self.seconds, "cum": dict(self.cum),
                       "own": dict(self.own)}, f)


def load(directory: str) -> dict[str, list[str]]:
    """{module: [profile paths]} from dir/<module>.<pid>.r<rank>.(prof|samples.json)."""
    by_module: dict[str, list[str]] = collections.defaultdict(list)
    for path in sorted(glob.glob(os.path.join(directory, "*.prof")) + glob.glob(os.path.join(directory, "*.samples.json"))):
        name = os.path.basename(path)
        stem = name[: -len(".samples.json")] if name.endswith(".samples.json") else name[: -len(".prof")]
        by_module[stem.rsplit(".", 2)[0]].append(path)
    return by_module


def _rows(paths: list[str]) -> tuple[float, list[tuple[float, float, str]], str]:
    """(total CPU-s, [(cumulative s, self s or call count, where)], what the second column is)."""
    prof = [p for p in paths if p.endswith(".prof")]
    if prof:
        stats = pstats.Stats(*prof)
        rows = [(ct, nc, f"{file}:{line}({name})")
                for (file, line, name), (_cc, nc, _tt, ct, _callers) in stats.stats.items()]
        return stats.total_tt, rows, "calls"
    cum: collections.Counter = collections.Counter()
    own: collections.Counter = collections.Counter()
    total = 0.0
    for p in paths:
        with open(p) as f:
            d = json.load(f)
        total += d["samples"] * d["interval_s"]
        cum.update({k: v * d["interval_s"] for k, v in d["cum"].items()})
        own.update({k: v * d["interval_s"] for k, v in d["own"].items()})
    return total, [(c, own.get(k, 0.0), k) for k, c in cum.items()], "self s"


def report(directory: str, top: int = 25, module: str | None = None, everything: bool = False) -> str:
    lines = []
    for mod, paths in sorted(load(directory).items()):
        if module and module not in mod:
            continue
        total, rows, second = _rows(paths)
        lines.append(f"== {mod}: {len(paths)} rank runs, {total:.1f} CPU-s inside the rank functions "
                     f"(columns: cumulative s, share, {second}, function)")
        kept = []
        for ct, extra, where in rows:
            file = where.split(":", 1)[0]
            if not everything and not _ours(file):
                continue
            kept.append((ct, extra, os.path.relpath(file, _ROOT) + where[len(file):]
                         if file.startswith(_ROOT + os.sep) else where))
        for ct, extra, where in sorted(kept, reverse=True)[:top]:
            col = f"{int(extra):8d}x" if second == "calls" else f"{extra:8.2f}s"
            lines.append(f"{ct:9.2f} s {ct / max(total, 1e-9):6.1%} {col}  {where}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("directory")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--module")
    ap.add_argument("--all", action="store_true")
    a = ap.parse_args()
    print(report(a.directory, a.top, a.module, a.all))


if __name__ == "__main__":
    main()
