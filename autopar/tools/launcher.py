"""Start processes for the command line: torchrun on this node, a forked gloo world, or a
Slurm batch script for several nodes.

  torchrun_command(nproc, target)   the torchrun command line (`python -m torch.distributed.run
                                    --standalone --nproc-per-node N ...`)
  launch_job(job, nproc, ...)       run an `autopar.tools.worker` job under torchrun (or forked), follow
                                    its progress events, raise LaunchError with the log's tail
  run_command(cmd, env)             run a command, its output passed through; returns its code
  slurm_script(...)                 the text of an sbatch script that runs torchrun on every node

Threads: each rank gets `cpu_count // nproc` intra-op threads (OMP_NUM_THREADS) unless the
environment already sets them, so ranks on one CPU node do not oversubscribe it.

Reads and writes no node.meta keys.
"""
from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable


class LaunchError(RuntimeError):
    """A launched world failed; the message holds the end of its log."""


def torchrun_command(nproc: int, target: list[str], *, python: str | None = None) -> list[str]:
    return [python or sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            *target]


def rank_env(nproc: int, extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // max(nproc, 1))))
    env.update(extra or {})
    return env


def _tail(path: Path, n: int = 60) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no log)"


def _follow(progress: Path, pos: int, on_event: Callable[[dict], None] | None) -> int:
    if on_event is None or not progress.exists():
        return pos
    with open(progress) as f:
        f.seek(pos)
        chunk = f.read()
    complete = chunk[: chunk.rfind("\n") + 1]
    for line in complete.splitlines():
        try:
            on_event(json.loads(line))
        except json.JSONDecodeError:
            continue
    return pos + len(complete)


def launch_job(job: dict[str, Any], nproc: int, *, job_path: Path, log_path: Path, launcher: str = "torchrun",
               on_event: Callable[[dict], None] | None = None, timeout_s: float = 3600.0) -> None:
    """Run `job` (an `autopar.tools.worker` job, written to `job_path`) on `nproc` local ranks."""
    job_path.parent.mkdir(parents=True, exist_ok=True)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    job_path.write_text(json.dumps(job, indent=2) + "\n")
    progress = Path(job["progress"]) if job.get("progress") else None
    pos = progress.stat().st_size if progress is not None and progress.exists() else 0
    if launcher == "fork":
        from autopar import parallelize  # noqa: F401 - autopar's public names load on first use: here, not per rank
        from autopar.runtime.launch import WorldError, run_world
        from autopar.tools.worker import forked

        try:
            run_world(nproc, forked, job, timeout_s=timeout_s, collective_timeout_s=float(job.get("timeout_s", 300)))
        except WorldError as e:
            log_path.write_text(str(e))
            raise LaunchError(f"the {job['kind']} job failed on a forked world of {nproc}:\n{str(e)[-4000:]}") from None
        finally:
            if progress is not None:
                _follow(progress, pos, on_event)
        return
    if launcher != "torchrun":
        raise ValueError(f"unknown launcher {launcher!r}; use torchrun or fork")
    cmd = torchrun_command(nproc, ["-m", "autopar.tools.worker", str(job_path)])
    with open(log_path, "w") as log:
        log.write("$ " + shlex.join(cmd) + "\n")
        log.flush()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=rank_env(nproc))
        deadline = time.monotonic() + timeout_s
        try:
            while proc.poll() is None:
                if progress is not None:
                    pos = _follow(progress, pos, on_event)
                if time.monotonic() > deadline:
                    proc.kill()
                    raise LaunchError(f"the {job['kind']} job ran past {timeout_s:.0f} s; log {log_path}:\n"
                                      + _tail(log_path))
                time.sleep(0.2)
        except KeyboardInterrupt:
            proc.terminate()
            proc.wait(timeout=30)
            raise
        if progress is not None:
            _follow(progress, pos, on_event)
    if proc.returncode != 0:
        raise LaunchError(f"the {job['kind']} job exited with code {proc.returncode} under torchrun; "
                          f"log {log_path}:\n" + _tail(log_path))


def run_command(cmd: list[str], env: dict[str, str] | None = None) -> int:
    """Run `cmd` with its output passed through; its exit code."""
    try:
        return subprocess.call(cmd, env=env)
    except KeyboardInterrupt:
        return 130


def slurm_script(*, job_name: str, nodes: int, gpus_per_node: int, target: list[str], env: dict[str, str],
                 partition: str | None = None, time_limit: str = "01:00:00", port: int = 29500,
                 python: str = "python") -> str:
    """An sbatch script: one task per node, each running torchrun with `gpus_per_node` ranks,
    rendezvous (c10d) on the first node of the allocation."""
    lines = ["#!/bin/bash", f"#SBATCH --job-name={job_name}", f"#SBATCH --nodes={nodes}",
             "#SBATCH --ntasks-per-node=1", f"#SBATCH --gpus-per-node={gpus_per_node}",
             f"#SBATCH --time={time_limit}", "#SBATCH --output=%x-%j.out"]
    if partition:
        lines.append(f"#SBATCH --partition={partition}")
    lines += ["set -euo pipefail", "",
              "# the first node of the allocation hosts the rendezvous",
              'head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)']
    lines += [f"export {k}={shlex.quote(v)}" for k, v in sorted(env.items())]
    torchrun = [python, "-m", "torch.distributed.run", "--nnodes=$SLURM_JOB_NUM_NODES",
                f"--nproc-per-node={gpus_per_node}", "--rdzv-id=$SLURM_JOB_ID", "--rdzv-backend=c10d",
                f'--rdzv-endpoint="$head:{port}"']
    lines += ["", "srun --kill-on-bad-exit=1 " + " ".join(torchrun) + " \\", "    "
              + " ".join(shlex.quote(t) for t in target), ""]
    return "\n".join(lines)
