"""Shared test set-up: make `tests/` importable (for `harness`) and keep torch single-threaded
per process so that spawned gloo worlds do not oversubscribe the CI machine's cores."""
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("OMP_NUM_THREADS", "1")
