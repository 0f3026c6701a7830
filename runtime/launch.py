"""Spawn a local world of N processes on gloo (CPU) or NCCL, run one function on every rank,
and bring back each rank's result or its traceback.

Used by the test harness, `autopar verify` and the quick-start job. It never hangs: the whole
world has a deadline, c10d collectives have a timeout, and a failed or silent rank is
reported by number with its traceback (or as "did not finish").

Processes are forked (~0.1 s a world) unless this process has initialised CUDA: a forked
child cannot use CUDA then ("Cannot re-initialize CUDA in forked subprocess"), so an NCCL
world starts by spawn. With a GPU build of torch (CUDA or ROCm libraries, GPU or not) a forked
child cannot run autograd once its parent has, so ranks fork from a fork server instead
(`fn` and its arguments must then pickle: module-level functions). A gloo world stays forked: its ranks run on the CPU (a mesh follows the
job's backend, `runtime.mesh.default_device_type`) and never touch CUDA.

The fork server imports `FORKSERVER_PRELOAD` once when it starts (torch and autopar; a caller
adds more with `preload_in_fork_server` before its first world, e.g. the test harness adds
transformers), so a rank does not import them again: importing torch's CUDA build and
transformers costs ~5 CPU-s a process. Only imports: none of these modules initialises CUDA or
runs a backward pass on import, which the fork server must never do.

`init_job_process_group` is the one place autopar starts a job's default group: NCCL bound to
the rank's GPU (`device_id`, so NCCL neither guesses the device from the rank nor forms its
communicator lazily) when a GPU is visible, gloo otherwise.
"""
from __future__ import annotations

import datetime
import gc
import multiprocessing as mp
import os
import pickle
import signal
import socket
import sys
import tempfile
import time
import traceback
from typing import Any, Callable


def local_cuda_device() -> "torch.device":
    """This rank's GPU: LOCAL_RANK (torchrun, or run_world) modulo the visible GPUs."""
    import torch

    n = torch.cuda.device_count()
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", os.environ.get("RANK", "0"))) % max(n, 1))


def init_job_process_group(backend: str | None = None, *, timeout_s: float | None = None, **kwargs: Any) -> str:
    """`dist.init_process_group` for this rank; returns the backend. `backend` None: NCCL when a
    GPU is visible, gloo otherwise. Under NCCL the rank's GPU (`local_cuda_device`) becomes the
    current device and is passed as `device_id`. `kwargs` go to init_process_group (init_method,
    rank, world_size, store).

    `timeout_s`: the job's collective timeout, in seconds: a collective (of the default group
    and of every mesh axis group, which inherit it) that waits longer for a rank fails on the
    ranks that wait, naming the collective and the ranks that stopped
    (runtime/collective_errors.py). None: $AUTOPAR_COLLECTIVE_TIMEOUT_S, else 60 s
    (runtime/timeouts.py)."""
    import torch
    import torch.distributed as dist

    from .timeouts import collective_timeout_s

    seconds = collective_timeout_s(timeout_s)
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if "nccl" in backend:
        dev = local_cuda_device()
        torch.cuda.set_device(dev)
        kwargs.setdefault("device_id", dev)
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=seconds), **kwargs)
    return backend


FORKSERVER_PRELOAD: list[str] = ["torch", "autopar"]


def preload_in_fork_server(*modules: str) -> None:
    """Have the fork server import `modules` too when it starts (it starts with the first
    fork-server world of this process; later calls do not reach a running server). A module
    that does not import is skipped by the server. Each must import without initialising CUDA."""
    FORKSERVER_PRELOAD.extend(m for m in modules if m not in FORKSERVER_PRELOAD)


class WorldError(RuntimeError):
    """One or more ranks of a spawned world failed or did not finish. `transport_setup_crash`:
    the failure was gloo's transport crashing while a group connected, nothing else."""

    transport_setup_crash = False


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(rank: int, world_size: int, init_file: str, backend: str, fn: Callable, args: tuple,
           kwargs: dict, queue, threads: int, collective_timeout_s: float | None):
    # The objects this rank inherited (a forked rank: the parent's imports, captured graphs, test
    # state) move to the garbage collector's permanent generation, so the rank's collections skip
    # them instead of walking them and touching every page they live on (copy on write): a full
    # `gc.collect()` in a rank forked from a test process holding ~450 k objects took 0.26-0.31
    # CPU-s, under 1 ms frozen (the fuzz's ranks collect after every plan: 23 -> 14 CPU-s). A
    # cycle among inherited objects that becomes garbage here lives until the rank exits; what
    # the rank allocates is collected as before. The parent's own collector is untouched.
    gc.freeze()
    import torch
    import torch.distributed as dist

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size))
    torch.set_num_threads(threads)
    try:
        init_job_process_group(backend, timeout_s=collective_timeout_s, init_method=f"file://{init_file}",
                               rank=rank, world_size=world_size)
        try:
            result = fn(rank, world_size, *args, **kwargs)
        finally:
            try:
                dist.destroy_process_group()
            except Exception:  # a failed collective may leave the group unusable
                pass
        # pickle by value here: the queue's own pickler would pass tensors as shared-memory
        # handles that die with this process
        try:
            payload = pickle.dumps(result)
        except Exception:
            payload = pickle.dumps(repr(result))
        queue.put((rank, True, payload))
    except BaseException:
        queue.put((rank, False, traceback.format_exc()))


def _exit_text(code: int | None) -> str:
    """A child's exit code in words: "exited with code 1", "killed by SIGABRT"."""
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"


def default_start_method(backend: str) -> str:
    """fork, unless the world will use CUDA (an NCCL backend) and this process has initialised
    CUDA already (a forked child could not use it: spawn), or torch is a GPU build (forkserver:
    the autograd engine of a CUDA/ROCm build refuses to run in a child forked after its parent
    ran a backward pass, "Unable to handle autograd's threading in combination with fork-based
    multiprocessing", GPU or not; the fork server is a fresh interpreter that never ran one)."""
    import torch

    if "nccl" in backend and torch.cuda.is_initialized():
        return "spawn"
    if torch.version.cuda or getattr(torch.version, "hip", None):
        return "forkserver"
    return "fork"


# What a peer of a rank that gloo's TCP transport aborted reports while the group connects
# (gloo's listener turns a failed accept() into an uncaught exception on its event thread:
# the rank dies of SIGABRT mid-handshake). Seen once in CI on an overloaded 2-core machine.
TRANSPORT_SETUP_CRASH = "Gloo connectFullMesh failed"


def run_world(world_size: int, fn: Callable, *args: Any, backend: str = "gloo", timeout_s: float = 300.0,
              collective_timeout_s: float | None = None, threads: int | None = None,
              start_method: str | None = None, transport_retries: int = 0, **kwargs: Any) -> list[Any]:
    """Run `fn(rank, world_size, *args, **kwargs)` on `world_size` fresh processes.

    Returns the list of per-rank results (must pickle; otherwise their repr). Raises
    `WorldError` naming each failed rank with its traceback, or the ranks that did not
    finish within `timeout_s` (and how each rank that did not report ended: killed by a
    signal, or still running). `collective_timeout_s`: the job's collective timeout (None:
    $AUTOPAR_COLLECTIVE_TIMEOUT_S, else 60 s; see `init_job_process_group`).
    `start_method` (or AUTOPAR_START_METHOD) picks fork or spawn;
    by default fork, except for an NCCL world in a process that has initialised CUDA (spawn:
    `fn` must then be importable by name).
    `transport_retries`: how many times to start the world afresh when it failed only because
    gloo's transport crashed while a group connected (a rank reports `TRANSPORT_SETUP_CRASH`
    and every other failure is a rank that stopped); each retry is printed to stderr. Any
    other failure is raised at once. `fn` must then be safe to run again.
    """
    for attempt in range(transport_retries + 1):
        try:
            return _run_world_once(world_size, fn, args, kwargs, backend, timeout_s, collective_timeout_s,
                                   threads, start_method)
        except WorldError as e:
            if attempt == transport_retries or not e.transport_setup_crash:
                raise
            print(f"autopar run_world: gloo's transport crashed while a group connected; starting the "
                  f"world again ({attempt + 1} of {transport_retries}):\n{str(e)[-2000:]}", file=sys.stderr,
                  flush=True)
    raise AssertionError("unreachable")


def _run_world_once(world_size: int, fn: Callable, args: tuple, kwargs: dict, backend: str, timeout_s: float,
                    collective_timeout_s: float | None, threads: int | None, start_method: str | None) -> list[Any]:
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    method = start_method or os.environ.get("AUTOPAR_START_METHOD") or default_start_method(backend)
    ctx = mp.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(list(FORKSERVER_PRELOAD))  # each rank forks from a server that imported them
    if threads is None:
        threads = max(1, (os.cpu_count() or 1) // world_size)
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="autopar_world_") as tmp:
        init_file = os.path.join(tmp, "init")
        procs = [ctx.Process(target=_child, args=(r, world_size, init_file, backend, fn, args, kwargs,
                                                   queue, threads, collective_timeout_s), daemon=True)
                 for r in range(world_size)]
        for p in procs:
            p.start()
        results: dict[int, tuple[bool, Any]] = {}
        deadline = time.monotonic() + timeout_s
        while len(results) < world_size and time.monotonic() < deadline:
            try:
                rank, ok, payload = queue.get(timeout=0.2)
                results[rank] = (ok, payload)
                if not ok:
                    # give the others a moment to report their own errors, then stop
                    grace = time.monotonic() + 5.0
                    while len(results) < world_size and time.monotonic() < grace:
                        try:
                            r2, ok2, p2 = queue.get(timeout=0.2)
                            results[r2] = (ok2, p2)
                        except Exception:
                            pass
                    break
            except Exception:
                dead = [r for r, p in enumerate(procs) if not p.is_alive() and p.exitcode not in (0, None)
                        and r not in results]
                if dead:
                    # a child died without reporting (segfault, os._exit): drain, then report
                    time.sleep(0.5)
                    while True:
                        try:
                            rank, ok, payload = queue.get_nowait()
                            results[rank] = (ok, payload)
                        except Exception:
                            break
                    for r in dead:
                        results.setdefault(r, (False, f"rank {r} {_exit_text(procs[r].exitcode)} "
                                                      "without reporting"))
                    break
        exits: dict[int, str] = {}  # how each rank that did not report ended
        for r, p in enumerate(procs):
            if p.is_alive():
                p.kill()
                exits[r] = "still running, killed"
            p.join(timeout=5)
            exits.setdefault(r, _exit_text(p.exitcode))
    failed = {r: v for r, (ok, v) in results.items() if not ok}
    missing = [r for r in range(world_size) if r not in results]
    if failed or missing:
        parts = []
        for r in sorted(failed):
            parts.append(f"--- rank {r} failed:\n{failed[r]}")
        if missing:
            why = "stopped after another rank failed" if failed else f"did not finish within {timeout_s:.0f} s"
            ends = ", ".join(f"rank {r}: {exits[r]}" for r in missing)
            parts.append(f"--- ranks {missing} {why} ({ends})")
        err = WorldError(f"{len(failed)} of {world_size} ranks failed, {len(missing)} did not report\n"
                         + "\n".join(parts))
        setup = [r for r, v in failed.items() if TRANSPORT_SETUP_CRASH in str(v)]
        # only the transport's crash: every failed rank reports it (or stopped without a report)
        err.transport_setup_crash = bool(setup) and len(setup) == len(failed)
        raise err
    return [pickle.loads(results[r][1]) for r in range(world_size)]
