"""The `autopar` command line: plan, dump, tune, run and verify a model on a mesh.

    autopar plan   MODEL (--world-size N | --mesh dp=8,tp=8) [--hardware h100-8x] [--top 5] [--json]
    autopar dump   MODEL (--world-size N | --mesh ...) [--hardware ...] [--out out/dump]
    autopar tune   MODEL (--world-size N | --mesh ...) [--hardware cpu-gloo] [--out out/tune]
    autopar run    (SCRIPT.py [ARGS...] | MODEL) --plan plan.json [--slurm job.sbatch --nodes 8]
    autopar verify MODEL --plan plan.json          (or --mesh/--world-size to plan first)
    autopar demo   [--model gpt-tiny] [--world-size 4]   the quick-start job: train and check parity
    autopar capture --model llama3-70b                    capture on meta; print time, RAM, ops

MODEL is a reference model name (gpt-tiny, llama3-70b, llama-70b ...), a transformers config
(a local config.json or a directory holding one), or package.module:factory.

Exit codes: 0 success; 1 a parity check or a launched run failed; 2 bad usage or input (the
message says what to change); 3 a launched world failed (its log in the message); 130 interrupted.
"""
from __future__ import annotations

import argparse
import os
import resource
import sys
import time
from collections import Counter

from autopar.tools.demo import cmd_demo


def cmd_capture(a) -> int:
    import torch

    import autopar
    from autopar.models import get

    spec = get(a.model)
    t0 = time.perf_counter()
    with torch.device("meta"):
        model = spec.build()
    inputs, _ = spec.example_batch(a.batch, seq_len=a.seq, device="meta")
    gm = autopar.capture(model, inputs)
    dt = time.perf_counter() - t0
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    ops = Counter(str(n.target).replace("aten.", "") for n in gm.graph.nodes if n.op == "call_function")
    n_params = sum(p.numel() for p in model.parameters())
    print(f"{a.model}: {n_params / 1e9:.2f} B parameters, captured on meta by "
          f"{gm.meta['autopar_capture']['path']} in {dt:.1f} s, peak RAM {rss:.2f} GiB, "
          f"{len(gm.graph.nodes)} nodes")
    for op, n in ops.most_common(8):
        print(f"  {n:>6}  {op}")
    return 0


# ------------------------------------------------------------------------ shared helpers
EXAMPLES = {
    "plan": """examples:
  autopar plan gpt-tiny --world-size 4 --hardware cpu-gloo --top 5
  autopar plan llama3-8b --mesh dp=8,tp=8 --hardware h100-64 --seq 4096 --batch 64
  autopar plan ./my_llama_config/ --world-size 16 --hardware h100-sxm --json > plan.json
  autopar plan mypkg.models:build --world-size 8            (build() returns a ModelSpec or a module)""",
    "dump": """examples:
  autopar dump gpt-tiny --mesh pp=2,dp=1,tp=2 --hardware cpu-gloo --out out/dump
  then open out/dump/report.html in a browser; plan.json is what run and verify take""",
    "tune": """examples:
  autopar tune gpt-tiny --world-size 2 --hardware cpu-gloo --out out/tune        (CPU, ~1 minute)
  autopar tune llama3-8b --world-size 8 --hardware h100-8x --seq 2048 --full     (on the GPU node)
  interrupted? run the same command again: finished phases are kept (--fresh starts over)""",
    "run": """examples:
  autopar run gpt-tiny --plan out/tune/plan.json --steps 10           (torchrun on this node)
  autopar run train.py --plan plan.json -- --lr 3e-4                  (your script reads $AUTOPAR_PLAN)
  autopar run train.py --plan plan.json --slurm job.sbatch --nodes 8 --gpus-per-node 8""",
    "verify": """examples:
  autopar verify gpt-tiny --plan out/dump/plan.json
  autopar verify gpt-tiny --mesh dp=2,tp=2 --hardware cpu-gloo       (plan, then verify)""",
}


class Progress:
    """Progress bars on a terminal (rich), plain lines elsewhere: phases, events, steps."""

    def __init__(self, enabled: bool):
        import rich.progress as rp
        from rich.console import Console

        self.console = Console(stderr=True)
        self.live = enabled and self.console.is_terminal
        self.tasks: dict[str, int] = {}
        self.bar = rp.Progress(rp.SpinnerColumn(), rp.TextColumn("{task.description}"), rp.BarColumn(),
                               rp.MofNCompleteColumn(), rp.TimeElapsedColumn(), console=self.console,
                               transient=False) if self.live else None

    def __enter__(self):
        if self.bar is not None:
            self.bar.__enter__()
        return self

    def __exit__(self, *exc):
        if self.bar is not None:
            self.bar.__exit__(*exc)

    def say(self, msg: str) -> None:
        if self.bar is not None:
            self.bar.console.print(msg)
        else:
            print(msg, file=sys.stderr, flush=True)

    def step(self, msg: str) -> None:
        self.event({"task": "work", "desc": msg})

    def event(self, e: dict) -> None:
        name = e.get("task", "work")
        if self.bar is None:
            if "total" in e:
                self.say(f"  {e.get('desc', name)}: {e['total']} items")
            elif name in ("work", "plan") and e.get("desc"):
                self.say(f"  {e['desc']}")
            return
        if name not in self.tasks:
            self.tasks[name] = self.bar.add_task(e.get("desc", name), total=e.get("total"))
        tid = self.tasks[name]
        if "total" in e:
            self.bar.update(tid, total=e["total"], completed=0, description=e.get("desc", name))
        if e.get("advance") or e.get("desc"):
            self.bar.update(tid, advance=e.get("advance", 0), description=e.get("desc", name))


def _add_model(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", metavar="MODEL",
                   help="a reference model (gpt-tiny, llama3-8b, llama-70b ...), a transformers config "
                        "(config.json or its directory), or package.module:factory")


def _add_mesh(p: argparse.ArgumentParser, required: bool = True) -> None:
    g = p.add_mutually_exclusive_group(required=required)
    g.add_argument("--world-size", type=int, metavar="N", help="number of devices; the planner chooses the mesh")
    g.add_argument("--mesh", metavar="AXES", help="a fixed mesh, e.g. dp=8,tp=8 or pp=2,dp=4,tp=8")


def _add_shape(p: argparse.ArgumentParser, hardware: str | None) -> None:
    from importlib.util import find_spec  # cost.hardware.profile_names(), not running autopar.cost (~1 CPU-s)

    where = os.path.join(find_spec("autopar.cost").submodule_search_locations[0], "profiles")
    shipped = sorted(f[:-5] for f in os.listdir(where) if f.endswith(".json"))
    p.add_argument("--hardware", default=hardware, metavar="PROFILE",
                   help=f"hardware profile name or .json file (default {hardware}); shipped: " + " ".join(shipped))
    p.add_argument("--batch", type=int, help="global batch size (default: 8, or the world size when larger)")
    p.add_argument("--seq", type=int, help="sequence length (default: the model's)")


def _add_pins(p: argparse.ArgumentParser) -> None:
    p.add_argument("--zero-stage", type=int, choices=(0, 1, 2, 3), help="pin the ZeRO stage")
    p.add_argument("--microbatches", type=int, help="pin the number of micro-batches")
    p.add_argument("--schedule", help="pin the pipeline schedule (1f1b, gpipe, interleaved_1f1b, zb_h1, zbv)")
    p.add_argument("--moe-aux-stats", choices=("global", "micro_batch"), default="global",
                   help="MoE load-balancing statistics: over the whole batch (one micro-batch) or per micro-batch")
    p.add_argument("--recompute", choices=("auto", "none", "full", "selective"), help="pin the blocks' recompute "
                   "(auto: as little as fits, each block whole or selective, whichever is faster)")
    p.add_argument("--memory-limit", type=float, metavar="GIB", help="per-device memory limit in GiB")
    p.add_argument("--planner", choices=("auto", "joint", "fallback"), default="auto", help="joint: "
                   "autopar.search.planner; fallback: plan the mesh as parallelize does; auto: joint when it imports")


def _positive(name: str, v: int | None) -> None:
    if v is not None and v < 1:
        raise ValueError(f"{name} must be >= 1, got {v}")


def _mesh_args(a) -> tuple[dict | None, int | None]:
    from autopar.tools.planning import parse_mesh

    if a.mesh:
        return parse_mesh(a.mesh), None
    _positive("--world-size", a.world_size)
    return None, a.world_size


def _plan_result(a, prog: Progress):
    from autopar.tools.model_source import resolve
    from autopar.tools.planning import plan_model

    mesh, world = _mesh_args(a)
    _positive("--batch", a.batch)
    _positive("--seq", a.seq)
    source = resolve(a.model)
    return plan_model(source, mesh=mesh, world_size=world, hardware=a.hardware, batch=a.batch, seq=a.seq,
                      zero_stage=a.zero_stage, n_microbatches=a.microbatches, schedule=a.schedule,
                      memory_limit=a.memory_limit * 2**30 if a.memory_limit else None, top=max(a.top, 1),
                      planner=a.planner, step=prog.step, moe_aux_stats=a.moe_aux_stats, recompute=a.recompute)


# ------------------------------------------------------------------------ plan
def cmd_plan(a) -> int:
    import json

    from autopar.tools.planning import _jsonable
    from autopar.tools.plan_view import plan_text

    with Progress(not a.no_progress and not a.json) as prog:
        r = _plan_result(a, prog)
    if a.out:
        with open(a.out, "w") as f:
            f.write(r.best.plan.to_json() + "\n")
    if a.json:
        print(json.dumps(_jsonable(r.to_dict(a.top)), indent=2))
    else:
        print(plan_text(r, a.top))
        print(f"planned in {r.seconds.get('capture_s', 0):.1f} s capture + {r.seconds.get('search_s', 0):.1f} s search"
              + (f"; plan written to {a.out}" if a.out else ""))
    return 0


# ------------------------------------------------------------------------ dump
def cmd_dump(a) -> int:
    from autopar.tools.plan_dump import write_dump
    from autopar.tools.plan_view import plan_text

    with Progress(not a.no_progress) as prog:
        r = _plan_result(a, prog)
        files = write_dump(r, a.out, all_ranks=a.all_ranks, top=a.top, step=prog.step)
    print(plan_text(r, a.top))
    names = sorted(os.path.basename(f) for f in files)
    print(f"\ndump written to {a.out}/: {', '.join(names)}")
    print(f"open {os.path.join(a.out, 'report.html')} in a browser for the graph, stages, memory and schedule")
    return 0


# ------------------------------------------------------------------------ tune
def cmd_tune(a) -> int:
    from autopar.tools.planning import parse_mesh
    from autopar.tools.tune import TuneConfig, tune

    mesh = parse_mesh(a.mesh) if a.mesh else None
    _positive("--world-size", a.world_size)
    for n in ("batch", "seq", "top", "steps"):
        _positive(f"--{n}", getattr(a, n))
    if a.warmup < 0:
        raise ValueError(f"--warmup must be >= 0, got {a.warmup}")
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    hardware = a.hardware or ("h100-8x" if device == "cuda" else "cpu-gloo")
    try:
        sizes = [int(x) for x in a.sizes.split(",")] if a.sizes else None
    except ValueError:
        raise ValueError(f"--sizes {a.sizes!r}: give message sizes in bytes separated by commas, e.g. "
                         "1024,1048576") from None
    if sizes is not None and any(x < 1 for x in sizes):
        raise ValueError(f"--sizes {a.sizes!r}: message sizes must be >= 1 byte")
    batch = a.batch
    if mesh:  # before any process starts or any file is written: the mesh must fit the model
        from autopar.tools.planning import check_mesh_for_model  # noqa: PLC0415

        batch = check_mesh_for_model(a.model, mesh, batch, a.seq)
    cfg = TuneConfig(model=a.model, out=a.out, hardware=hardware, mesh=mesh, world_size=a.world_size,
                     batch=batch, seq=a.seq, top=a.top, warmup=a.warmup, steps=a.steps, quick=not a.full,
                     sizes=sizes, launcher=a.launcher, device=device, weights=weights_arg(a))
    with Progress(not a.no_progress) as prog:
        res = tune(cfg, fresh=a.fresh, say=prog.say, event=prog.event)
    print((res.out / "tune_report.txt").read_text().rstrip())
    if res.resumed:
        print(f"resumed: kept the finished phases {', '.join(res.resumed)}")
    print(f"wrote {', '.join(res.files)}")
    return 0


def weights_arg(a) -> str | None:
    """--weights as an absolute path, or MODEL itself when it is a checkpoint directory (a
    config.json beside *.safetensors); None: the model's own initialization."""
    w = getattr(a, "weights", None)
    model = getattr(a, "model", None) or getattr(a, "target", None)
    if w is None and model and os.path.isdir(model) and any(f.endswith(".safetensors") for f in os.listdir(model)):
        w = model
    if w is None:
        return None
    if not os.path.exists(w):
        raise ValueError(f"--weights {w}: no such file or directory; give a .safetensors file, a Hugging Face "
                         "checkpoint directory or an autopar checkpoint")
    return os.path.abspath(w)


# ------------------------------------------------------------------------ run
def cmd_run(a) -> int:
    import json
    import shlex
    import tempfile

    from autopar.tools.launcher import rank_env, run_command, slurm_script, torchrun_command
    from autopar.passes.plan import Plan

    if a.plan is None and (a.precision or a.offload):
        raise ValueError("--precision / --offload pin fields of a plan: give --plan FILE (from `autopar plan ... "
                         "--out plan.json`)")
    if a.plan is None:  # the joint planner chooses, in the job, for --nproc ranks
        if a.target.endswith(".py"):
            raise ValueError("a training script reads its plan from $AUTOPAR_PLAN: give --plan FILE")
        if not a.nproc:
            raise ValueError("without --plan, give --nproc N: the joint planner plans for N ranks")
        _positive("--nproc", a.nproc)
        plan, plan_path, world, cli = None, "", a.nproc, {}
    else:
        if not os.path.exists(a.plan):
            raise ValueError(f"--plan {a.plan} does not exist; make one with `autopar plan ... --out plan.json`, "
                             "`autopar dump` or `autopar tune`, or leave --plan out and give --nproc N")
        plan = Plan.load(a.plan)
        plan_path = os.path.abspath(a.plan)
        world = plan.world_size
        cli = plan.extra.get("cli", {})
        if a.precision or a.offload:  # the plan's precision fields are what the ranks run
            from autopar.passes.plan import precision_fields  # noqa: PLC0415

            plan = plan.pin(**precision_fields(a.precision, True if a.offload else None))
            fd, plan_path = tempfile.mkstemp(prefix="autopar_plan_", suffix=".json")
            with os.fdopen(fd, "w") as f:
                f.write(plan.to_json() + "\n")
    args = list(a.args)
    if a.target.endswith(".py"):
        if not os.path.exists(a.target):
            raise ValueError(f"training script {a.target} does not exist")
        target = [os.path.abspath(a.target), *args]
        what = f"{a.target} (reads the plan from $AUTOPAR_PLAN)"
    else:
        for n in ("steps", "batch", "seq"):
            _positive(f"--{n}", getattr(a, n))
        from autopar.tools.planning import batch_split, check_batch_split, check_plan_fits  # noqa: PLC0415

        batch = a.batch or cli.get("batch") or (max(8, batch_split(plan)) if plan else max(8, world))
        seq = a.seq if a.seq is not None else cli.get("seq")
        if plan is not None:
            check_batch_split(batch, plan, "--batch" if a.batch else "the plan's batch (plan.extra['cli']['batch'])")
            check_plan_fits(a.target, plan, batch, seq)  # a clear error now rather than on every rank
        save = os.path.abspath(a.save) if a.save else None
        if save and os.path.exists(save) and not os.path.isdir(save):
            raise ValueError(f"--save {a.save} is a file; give a directory for the Hugging Face checkpoint")
        job = {"kind": "train", "model": a.target, "plan": plan_path, "steps": a.steps, "batch": batch,
               "seq": seq, "lr": a.lr, "weights": weights_arg(a), "save": save}
        job_dir = a.job_dir or tempfile.mkdtemp(prefix="autopar_run_")
        os.makedirs(job_dir, exist_ok=True)
        job_path = os.path.abspath(os.path.join(job_dir, "job.json"))
        with open(job_path, "w") as f:
            json.dump(job, f, indent=2)
        target = ["-m", "autopar.tools.worker", job_path]
        what = f"{a.target} for {a.steps} steps, global batch {job['batch']}"
    env = {"AUTOPAR_PLAN": plan_path} if plan_path else {}
    if a.slurm:
        nodes = a.nodes
        gpn = a.gpus_per_node or -(-world // nodes)
        if nodes < 1 or gpn < 1 or nodes * gpn != world:
            fits = ", ".join(f"{n} x {world // n}" for n in range(1, world + 1) if world % n == 0)
            raise ValueError(f"--nodes {nodes} x --gpus-per-node {gpn} = {nodes * gpn} ranks, but the plan's mesh "
                             f"{plan.mesh} has {world}; choose them so that the product is {world} "
                             f"(nodes x ranks per node: {fits})")
        text = slurm_script(job_name=f"autopar-{os.path.basename(a.target).removesuffix('.py')}", nodes=nodes,
                            gpus_per_node=gpn, target=target, env=env, partition=a.partition, time_limit=a.time)
        with open(a.slurm, "w") as f:
            f.write(text)
        print(f"wrote {a.slurm}: {nodes} nodes x {gpn} ranks running {what} under the plan {a.plan}")
        print(f"submit it with: sbatch {a.slurm}   (paths in it must be visible from every node)")
        return 0
    nproc = a.nproc or world
    if nproc != world:
        raise ValueError(f"--nproc {nproc} differs from the plan's {world} ranks ({plan and plan.mesh}); the plan fixes the "
                         "world size: make a plan for this many ranks, or use --slurm for several nodes")
    import torch

    if torch.cuda.is_available() and nproc > torch.cuda.device_count():
        why = (f"the plan needs {nproc} ranks but this node has {torch.cuda.device_count()} GPUs; "
               f"use --slurm FILE --nodes N to run on several nodes")
        if not a.dry_run:
            raise ValueError(why)
        print(f"note: {why}", file=sys.stderr)  # a dry run still shows the command
    cmd = torchrun_command(nproc, target)
    print(f"launching {what} on {nproc} local ranks: " + (f"AUTOPAR_PLAN={plan_path} " if plan_path else "")
          + shlex.join(cmd), flush=True)
    if a.dry_run:
        return 0
    rc = run_command(cmd, env=rank_env(nproc, env))
    return 0 if rc == 0 else (130 if rc == 130 else 1)


# ------------------------------------------------------------------------ verify
def cmd_verify(a) -> int:
    import json

    from autopar.passes.plan import Plan
    from autopar.tools.verify import LOSS_ATOL, LOSS_RTOL, PARAM_TOL, verify

    if a.plan:
        if a.mesh or a.world_size:
            raise ValueError("give either --plan or --mesh/--world-size (to plan first), not both")
        if not os.path.exists(a.plan):
            raise ValueError(f"--plan {a.plan} does not exist; make one with `autopar plan ... --out plan.json`")
        plan = Plan.load(a.plan)
        source = f"plan {a.plan}"
        if a.max_procs >= plan.world_size:  # (verify refuses larger plans itself, before any capture)
            from autopar.tools.planning import check_plan_fits  # noqa: PLC0415
            from autopar.tools.verify import small_batch  # noqa: PLC0415

            check_plan_fits(a.model, plan, small_batch(plan, a.batch), a.seq, small_seq=True)
    elif a.mesh or a.world_size:
        with Progress(not a.no_progress) as prog:
            r = _plan_result(argparse.Namespace(**{**vars(a), "top": 1}), prog)
        plan = r.best.plan
        source = f"{r.planner} planner on {a.hardware}"
    else:
        raise ValueError("give a plan to verify (--plan plan.json) or a mesh to plan first (--mesh / --world-size)")
    res = verify(a.model, plan, batch=a.batch, seq=a.seq, steps=a.steps, max_procs=a.max_procs,
                 weights=weights_arg(a))
    if a.json:
        print(json.dumps(res.to_dict(), indent=2))
        return 0 if res.ok else 1
    print(f"verify {res.model} on {','.join(f'{k}={v}' for k, v in res.mesh.items())} ({source}): "
          f"{plan.world_size} gloo processes vs one process, batch {res.batch}"
          + (f" x seq {res.seq}" if res.seq else "") + f", AdamW lr 1e-2, {res.steps} steps")
    print(f"{'step':>4}  {'plan loss':>12}  {'one process':>12}  {'|diff|':>9}")
    for i, (l, r_) in enumerate(zip(res.losses, res.ref_losses)):
        print(f"{i:>4}  {l:>12.6f}  {r_:>12.6f}  {abs(l - r_):>9.2e}")
    print(f"parameters after {res.steps} steps: max |plan - one process| = {res.worst_param[1]:.2e} "
          f"({res.worst_param[0]}); tolerance {PARAM_TOL:g}; losses {LOSS_ATOL:g} + {LOSS_RTOL:g} x |loss|")
    if res.missing:
        print(f"parameters no rank returned: {', '.join(res.missing)}")
    print(f"parity: {'OK' if res.ok else 'FAILED'}   ({res.seconds:.1f} s)")
    return 0 if res.ok else 1


# ------------------------------------------------------------------------ parser
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="autopar", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Make a PyTorch model train on many devices: plan how to split it, look at the plan, "
                    "measure the machine, run it.",
        epilog="""a first session:
  autopar plan gpt-tiny --world-size 4 --hardware cpu-gloo --top 5   what would run, and how fast
  autopar dump gpt-tiny --world-size 4 --hardware cpu-gloo           graphs per rank + report.html
  autopar tune gpt-tiny --world-size 2                               measure this machine, try plans
  autopar run gpt-tiny --plan out/tune/plan.json --steps 10          train under the plan (torchrun)
  autopar verify gpt-tiny --plan out/tune/plan.json                  parity against one process
`autopar COMMAND --help` explains each command. Exit codes: 0 ok, 1 parity or training failed,
2 bad input (the message says what to change), 3 a launched world failed, 130 interrupted.""")
    sub = p.add_subparsers(dest="cmd", metavar="COMMAND")

    def command(name: str, help_: str, description: str) -> argparse.ArgumentParser:
        c = sub.add_parser(name, help=help_, description=description, epilog=EXAMPLES.get(name),
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        return c

    c = command("plan", "capture on meta, search, print the plan and its predictions",
                "Capture MODEL on the meta device (no memory for weights), search how to split it over the "
                "mesh, and print the chosen plan with its predicted step time and memory per rank.")
    _add_model(c)
    _add_mesh(c)
    _add_shape(c, "h100-sxm")
    _add_pins(c)
    c.add_argument("--top", type=int, default=1, metavar="K", help="also list the K best candidates")
    c.add_argument("--json", action="store_true", help="print JSON (plan, predictions, alternatives) for machines")
    c.add_argument("--out", metavar="FILE", help="write the chosen plan to FILE (plan.json)")
    c.add_argument("--no-progress", action="store_true", help="no progress bars")
    c.set_defaults(fn=cmd_plan)

    c = command("dump", "write per-rank graphs, plan.json, the schedule and an HTML report",
                "Plan MODEL as `autopar plan` does, then write into --out: plan.json, each rank's rewritten "
                "graph as Python, the pipeline schedule (grid and Gantt chart), and report.html: the graph "
                "with placements, the stage map, recompute and fusion decisions, memory per rank, the Gantt "
                "chart. Nothing needs a GPU or the model's weights.")
    _add_model(c)
    _add_mesh(c)
    _add_shape(c, "h100-sxm")
    _add_pins(c)
    c.add_argument("--out", default="out/dump", help="output folder (default out/dump)")
    c.add_argument("--all-ranks", action="store_true",
                   help="one program file per rank (default: one per distinct program; ranks.txt maps the rest)")
    c.add_argument("--top", type=int, default=5, metavar="K", help="alternatives kept in the report")
    c.add_argument("--no-progress", action="store_true")
    c.set_defaults(fn=cmd_dump)

    c = command("tune", "measure this machine, fit the hardware profile, run the best plans, keep the fastest",
                "On the target machine: time matmuls over shapes and dtypes, memory bandwidth, kernel launch "
                "overhead and every collective on every mesh axis over message sizes (under torchrun); fit "
                "the hardware profile to them; plan; run the best --top plans for a few real steps; refit the "
                "per-kernel overhead to the measured steps; write profile.json, plan.json (the fastest "
                "measured) and a predicted-versus-measured report. Re-running the same command resumes.")
    _add_model(c)
    _add_mesh(c)
    c.add_argument("--hardware", default=None, metavar="PROFILE",
                   help="profile to start from (default cpu-gloo on CPU, h100-8x on GPUs)")
    c.add_argument("--batch", type=int, help="global batch size (default: 8, or the world size when larger)")
    c.add_argument("--seq", type=int, help="sequence length (default: the model's)")
    c.add_argument("--out", default="out/tune", help="output and resume folder (default out/tune)")
    c.add_argument("--top", type=int, default=3, metavar="K", help="plans run for real (default 3)")
    c.add_argument("--warmup", type=int, default=2, help="untimed steps per plan (default 2)")
    c.add_argument("--steps", type=int, default=5, help="timed steps per plan (default 5)")
    c.add_argument("--full", action="store_true", help="larger microbenchmark sizes (default: quick)")
    c.add_argument("--sizes", metavar="BYTES,...", help="collective message sizes in bytes")
    c.add_argument("--launcher", choices=("torchrun", "fork"), default="torchrun",
                   help="how the ranks start (fork: a gloo world forked from this process; CPU only)")
    c.add_argument("--fresh", action="store_true", help="start over instead of resuming")
    c.add_argument("--weights", metavar="PATH", help="the plans start from this checkpoint (default: MODEL itself "
                   "when it is a checkpoint directory), each rank reading only its slices")
    c.add_argument("--no-progress", action="store_true")
    c.set_defaults(fn=cmd_tune)

    c = command("run", "launch training under a plan: torchrun on this node, or a Slurm script",
                "Launch TARGET with the plan: a training script (run as `torchrun SCRIPT ARGS`, with "
                "AUTOPAR_PLAN set to the plan's path; the script calls torch.distributed.init_process_group() "
                "and passes plan=autopar.Plan.from_json(open(os.environ['AUTOPAR_PLAN']).read()) and "
                "autopar.mesh(**plan.mesh) to autopar.parallelize), "
                "or a model (trained on random batches for --steps steps, loss and step time printed). "
                "With --slurm, write an sbatch script for several nodes instead of starting anything.")
    c.add_argument("target", metavar="TARGET", help="SCRIPT.py, or a model as for plan; the script's own "
                   "arguments go last, after --")
    c.add_argument("--plan", help="the plan file (from plan --out, dump or tune); without it the joint planner "
                   "plans for --nproc ranks in the job")
    c.add_argument("--weights", metavar="PATH", help="start from this checkpoint: a .safetensors file, a Hugging Face "
                   "checkpoint directory or an autopar checkpoint; each rank builds the model on meta and reads only "
                   "its slices (default: MODEL itself when it is a checkpoint directory)")
    c.add_argument("--save", metavar="DIR", help="write the trained weights to DIR as a Hugging Face checkpoint "
                   "(sharded safetensors + index + config.json)")
    c.add_argument("--nproc", type=int, help="local ranks (default: the plan's world size)")
    c.add_argument("--precision", choices=("fp32", "bf16", "bf16-mixed", "fp16-mixed"),
                   help="pin the plan's precision: pure fp32/bf16 (the model's dtype must match), or 16-bit "
                        "compute with fp32 masters, states and gradient reduction (fp16: dynamic loss scaling)")
    c.add_argument("--offload", action="store_true", help="masters and optimizer states in CPU memory")
    c.add_argument("--steps", type=int, default=10, help="steps for a model target (default 10)")
    c.add_argument("--batch", type=int, help="global batch for a model target (default: the plan's)")
    c.add_argument("--seq", type=int, help="sequence length for a model target (default: the plan's)")
    c.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate for a model target")
    c.add_argument("--job-dir", help="where a model target's job file goes (default: a temporary folder)")
    c.add_argument("--dry-run", action="store_true", help="print the command, start nothing")
    c.add_argument("--slurm", metavar="FILE", help="write an sbatch script to FILE instead of running")
    c.add_argument("--nodes", type=int, default=1, help="nodes for --slurm (default 1)")
    c.add_argument("--gpus-per-node", type=int, help="ranks per node for --slurm (default: world / nodes)")
    c.add_argument("--partition", help="Slurm partition")
    c.add_argument("--time", default="01:00:00", help="Slurm time limit (default 01:00:00)")
    c.set_defaults(fn=cmd_run, args=[])

    c = command("verify", "run a plan on small shapes against one process and report parity",
                "Train MODEL under the plan on a local CPU world (one gloo process per rank) and as a plain "
                "module on one process, from the same seed and batches, and compare the losses of every step "
                "and every parameter after the last one. Exit code 1 when they differ beyond tolerance.")
    _add_model(c)
    c.add_argument("--plan", help="the plan file to verify")
    c.add_argument("--weights", metavar="PATH", help="both runs start from this checkpoint (default: MODEL itself "
                   "when it is a checkpoint directory); the parallel ranks build on meta and read their slices")
    _add_mesh(c, required=False)
    c.add_argument("--hardware", default="cpu-gloo", help="profile to plan with when no --plan (default cpu-gloo)")
    _add_pins(c)
    c.add_argument("--batch", type=int, help="global batch (default: small, a multiple of dp x micro-batches)")
    c.add_argument("--seq", type=int, help="sequence length (default: min(16, the model's))")
    c.add_argument("--steps", type=int, default=3, help="AdamW steps compared (default 3)")
    c.add_argument("--max-procs", type=int, default=8, help="largest world started (default 8)")
    c.add_argument("--json", action="store_true", help="print the result as JSON")
    c.add_argument("--no-progress", action="store_true")
    c.set_defaults(fn=cmd_verify)

    d = sub.add_parser("demo", help="parallelise a reference model on a local CPU world, train, check parity")
    d.add_argument("--model", default="gpt-tiny", help="reference model name (autopar.models.names())")
    d.add_argument("--world-size", type=int, default=4, help="number of local gloo processes")
    d.add_argument("--steps", type=int, default=5)
    d.add_argument("--batch", type=int, default=8, help="global batch size")
    d.add_argument("--zero-stage", type=int, default=0)
    d.add_argument("--out", default="out/demo", help="dump directory")
    d.set_defaults(fn=cmd_demo)
    c = sub.add_parser("capture", help="capture a (real-size) reference model on meta; print time and RAM")
    c.add_argument("--model", default="llama3-70b")
    c.add_argument("--batch", type=int, default=1)
    c.add_argument("--seq", type=int, default=128)
    c.set_defaults(fn=cmd_capture)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    script_args: list[str] = []
    if argv[:1] == ["run"] and "--" in argv:  # `autopar run train.py --plan p.json -- --lr 3e-4`
        cut = argv.index("--")
        argv, script_args = argv[:cut], argv[cut + 1:]
    a = parser.parse_args(argv)
    if a.cmd == "run":
        a.args = script_args
    if a.cmd is None:
        a = parser.parse_args(["demo", *argv])
    from autopar.capture import CaptureError
    from autopar.tools.launcher import LaunchError
    from autopar.runtime.launch import WorldError

    try:
        return a.fn(a)
    except (ValueError, CaptureError) as e:  # bad input: the model, the mesh, a plan file, an argument
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (LaunchError, WorldError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 3
    except KeyboardInterrupt:
        print("interrupted" + ("; run the same command again to resume" if a.cmd == "tune" else ""),
              file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
