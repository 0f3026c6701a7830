"""The per-rank step memory measurement, for the tests: it lives in the package
(`autopar.tools.step_memory`, which `autopar tune` uses too); see its docstring."""
from autopar.tools.step_memory import StepPeak, alive_storages, memory_records, step_peak

__all__ = ["StepPeak", "alive_storages", "memory_records", "step_peak"]
