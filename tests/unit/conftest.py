"""The single-process tests' collector thresholds: fewer, larger cyclic-GC passes.

The unit tests keep captured graphs, cost tables and plans alive in module fixtures and caches
(hundreds of thousands of objects), and build and drop as many per test; at CPython's default
thresholds (700, 10, 10) the collector ran 3,247 times in tests/unit/test_one_cost_model.py and
took 4.6 of its 21.6 CPU-s, 2.5 at (20000, 20, 20) in 74 runs (measured with `gc.callbacks`,
2026-11-26). Garbage is still collected, in fewer passes; what a test asserts is unchanged.

It reads and writes no node.meta. Guarantees: only the thresholds change, in this pytest
process; gloo ranks forked from it inherit them (and freeze what they inherit at start,
runtime/launch.py), subprocesses start with CPython's defaults.
"""
import gc

gc.set_threshold(20000, 20, 20)
