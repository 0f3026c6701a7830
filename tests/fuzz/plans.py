"""Random parallel plans on 4 gloo ranks, each against one process (issue 21, item 7).

`make_plan(seed, index)` is a pure function of its arguments (a `random.Random` seeded by the
string "seed:index"): the same seed gives the same plans on any machine. A plan names a model
(gpt-tiny, gpt-tiny-tied, moe-tiny with its load-balancing loss on, and two transformers
decoders: Llama and Qwen3), its dtype, a mesh of 4 ranks over dp / tp / pp / ep / cp (ep only
for the MoE) in a random axis order, and the `autopar.parallelize` keywords: zero_stage,
offload, memory_budget (else, a quarter of the time, the planner's recompute pinned "full" or
"selective", drawn from a stream of its own so earlier draws stay), n_microbatches, a pipeline
schedule when pp > 1, pinned fusions (or the fusion search), the h100-sxm hardware profile (so tp shards the tiny models) and the
context-parallel method. The draws lean towards plans the support matrix says run (batch
sizes that divide, few recompute-with-ep or pp-with-cp cells), so that most plans train.

`run_plans(plans)` runs them in gloo worlds of 4 ranks, many plans a world. Each rank builds
the model (seed 0), calls `parallelize`, trains 3 AdamW steps (lr 1e-2) on the same batches as
one process and exports the full state dict (`autopar.export_state_dict`), writing what it got
to a file per plan and rank. The verdict of a plan, from those files and a one-process
reference computed here:

  match          every rank's loss of every step and every exported parameter within the
                 tolerance of the plan's dtype (fp64: 1e-9 absolute; fp32: loss 1e-5,
                 parameters 1e-4, as tests/dist and autopar/tools/zoo_check.py state them;
                 a transformers model whose program sums fp32 partial values is held to
                 fp32's, see NARROW_SUM_MODELS; its line then ends in "[fp32 sums]")
  refused: ...   `parallelize` or `autopar.optimizer` raised a ValueError on every rank
                 before the first step (the message's first line)
  MISMATCH ...   it trained, but a loss or parameter is off (max errors given)
  CRASH ...      any other exception, or a ValueError at or after the first step, or a
                 refusal on some ranks only (where it happened and the exception's last line)
  HANG ...       a collective timed out (60 s), or a plan ran past `plan_timeout_s` (or the
                 plan's own "timeout_s"; a watchdog on every rank dumps the stacks and ends
                 the rank)

A crashed or hung rank ends its process at once (`os._exit`); the other ranks then fail in
the collective that agrees on each plan's end, and the world stops. Its finished plans keep
their verdicts, the plan that failed gets its own, and the remaining plans run in a new world.

The MoE's router statistics are those of the data ranks (dp x ep) per micro-batch (plans with
micro-batches pass moe_aux_stats="micro_batch": the default "global" refuses them for an MoE
with an auxiliary loss; docs/support_matrix.md footnote 16), so the reference computes every
step's loss as the mean over micro-batches of the loss on the rows the data ranks hold in that
micro-batch (micro-batch i: the i-th slice of every data rank's piece of the batch); for the
other models this equals the whole batch's loss.

It reads and writes no `node.meta` keys. Run from a shell: `bash scripts/fuzz.sh [N] [seed]`.
"""
from __future__ import annotations

import faulthandler
import gc
import json
import os
import random
import shutil
import sys
import tempfile
import time
import traceback

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/, for harness

WORLD, BATCH, SEQ, STEPS, LR = 4, 8, 16, 3, 1e-2
TOLERANCES = {"float64": {"loss": 1e-9, "param": 1e-9}, "float32": {"loss": 1e-5, "param": 1e-4}}
# moe-tiny's router softmax is fp32 in the model (models/moe.py), so in an fp64 model its
# load-balancing term (~0.04) still rounds at fp32 and the summation order shows in the loss:
# 3.7e-9 measured under dp4 x 2 micro-batches, parameters within 5e-14
MOE_FP64_LOSS = 2e-8
# transformers' Llama and Qwen3 compute RMSNorm in fp32 inside an fp64 model (hidden.to(float32),
# mean of squares, rsqrt, .to(input dtype)). Where tp shards the feature dim through such a norm,
# each rank sums its features' squares in fp32 and the partial sums meet in an fp32 all-reduce:
# a legitimate reordering of the model's own fp32 sum. Measured (seed 20261126, plans 9, 88, 185:
# hf-qwen3 cp2 x tp2): the parallel run equals, to loss 8.9e-16 / params 1.2e-14, one process
# whose hidden-size norms add their two halves' fp32 means the same way, and that one process is
# loss 4.6e-8 / params 1.7e-5 from the plain one after 3 AdamW steps (fp32 rounding, amplified by
# AdamW on near-zero gradients). So a plan of these models whose program sums values of a
# narrower float than the model's (`narrow_sums`) is held to fp32's tolerances, any other to its
# dtype's. A P(sum) passes no narrowing cast (passes/rules/sharding_table.py exact_cast: that
# rounded each partial, Llama cp2 x tp2 ending 2e-5 off, tests/dist/test_context_tp_hf.py), so
# an fp32 partial sum comes only from an fp32 op the plan splits.
NARROW_SUM_MODELS = ("hf-llama", "hf-qwen3")
MODELS = {"gpt-tiny": 0.25, "gpt-tiny-tied": 0.15, "moe-tiny": 0.25, "hf-llama": 0.175, "hf-qwen3": 0.175}
FUSIONS = ["add_rms_norm", "rms_norm", "rope", "swiglu", "cross_entropy", "linear_cross_entropy", "softmax"]
SCHEDULES = ["gpipe", "1f1b", "interleaved_1f1b", "zb_h1", "zbv"]
FAILURES = ("MISMATCH", "CRASH", "HANG")


# --- the plans --------------------------------------------------------------------------------
def _meshes(model: str) -> list[tuple[dict, float]]:
    """Every way to factor 4 ranks over the model's axes, each with weight 1 (pp x cp and ep x
    cp, refused until 2026-11-26, train now: tests/dist/test_pipeline_context.py,
    tests/dist/test_moe_context_recompute.py)."""
    axes = ["dp", "tp", "pp", "cp"] + (["ep"] if model == "moe-tiny" else [])
    out = [({a: 4}, 1.0) for a in axes]
    for i, a in enumerate(axes):
        for b in axes[i + 1:]:
            out.append(({a: 2, b: 2}, 1.0))
    return out


def make_plan(seed: int, index: int) -> dict:
    """Plan `index` of the fuzz with `seed`: a pure function of the two (JSON-able dict)."""
    r = random.Random(f"{seed}:{index}")
    model = r.choices(list(MODELS), weights=list(MODELS.values()))[0]
    dtype = "float32" if model.startswith("gpt") and r.random() < 0.15 else "float64"
    meshes = _meshes(model)
    mesh = dict(r.choices([m for m, _ in meshes], weights=[w for _, w in meshes])[0])
    order = list(mesh)
    if r.random() < 0.3:
        r.shuffle(order)
    else:
        order.sort(key=["dp", "pp", "ep", "cp", "tp"].index)
    mesh = {a: mesh[a] for a in order}
    dp, pp, ep, cp, tp = (mesh.get(a, 1) for a in ("dp", "pp", "ep", "cp", "tp"))
    data = dp * ep
    kw: dict = {}
    kw["zero_stage"] = r.randrange(4) if dp > 1 or r.random() < 0.2 else 0
    if r.random() < 0.2:
        kw["offload"] = True
    fits = [m for m in (1, 2, 4) if BATCH % (data * m) == 0]
    if pp > 1:
        fits = [m for m in fits if m > 1] or fits
    m = r.choice(fits) if r.random() < 0.92 else r.choice([1, 2, 4, 8])
    if m > 1:
        kw["n_microbatches"] = m
        if model.startswith("moe"):  # per-micro-batch router statistics (the default refuses them); no draw
            kw["moe_aux_stats"] = "micro_batch"
    pins: dict = {}
    if pp > 1:
        pins["schedule"] = r.choice(SCHEDULES)
    if r.random() < 0.35:  # every schedule (zb_h1 / zbv: a stage holding regions runs its backward whole)
        kw["memory_budget"] = r.choice([0.0, 0.3, 0.6])
    r2 = random.Random(f"{seed}:{index}:recompute")  # its own stream: the draws above stay as they were
    if "memory_budget" not in kw and r2.random() < 0.25:  # the planner's blocks, whole or selective
        pins["recompute"] = r2.choice(["full", "selective"])
    f = r.random()
    if f < 0.35:
        pins["fusions"] = sorted(r.sample(FUSIONS, r.randint(1, len(FUSIONS))))
    elif f < 0.8:
        pins["fusions"] = []
    # else: the fusion search chooses
    if r.random() < (0.6 if tp > 1 else 0.2):
        kw["hardware"] = "h100-sxm"
    if cp > 1:
        kw["context_method"] = r.choice(["ring", "ulysses", "auto"])
    if pins:
        kw["pins"] = pins
    return {"seed": seed, "index": index, "model": model, "dtype": dtype, "mesh": mesh, "kw": kw}


def describe(plan: dict) -> str:
    """One line: model, dtype, mesh, keywords."""
    mesh = "x".join(f"{a}{s}" for a, s in plan["mesh"].items())
    kw = dict(plan["kw"])
    pins = kw.pop("pins", {})
    parts = [f"{k}={v}" for k, v in kw.items()]
    if "schedule" in pins:
        parts.append(pins["schedule"])
    if "recompute" in pins:
        parts.append(f"recompute={pins['recompute']}")
    if "fusions" in pins:
        parts.append(f"fusions={','.join(pins['fusions']) or 'none'}")
    dt = "" if plan["dtype"] == "float64" else " fp32"
    return f"{plan['model']}{dt} {mesh} {' '.join(parts)}"


# --- models, batches, one process --------------------------------------------------------------
def build(model: str, dtype: str) -> torch.nn.Module:
    """The model, seed 0, in `dtype`."""
    torch.manual_seed(0)
    if model == "hf-qwen3":
        from transformers import Qwen3Config, Qwen3ForCausalLM  # noqa: PLC0415

        cfg = Qwen3Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
                          use_cache=False)
        cfg._attn_implementation = "sdpa"
        net = Qwen3ForCausalLM(cfg)
    elif model.startswith("hf-"):
        from autopar.models import zoo  # noqa: PLC0415

        net = zoo.build(model, "tiny")
    else:
        from autopar.models import get  # noqa: PLC0415

        net = get(model).build()
    return net.to(getattr(torch, dtype))


def loss_fn(out, y):
    """Cross-entropy of the logits, plus the MoE's load-balancing loss when the model returns one."""
    if isinstance(out, torch.Tensor):
        logits, aux = out, 0.0
    elif isinstance(out, (tuple, list)):
        logits, aux = out[0], out[1]
    else:
        logits, aux = out["logits"], 0.0
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1)) + aux


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(STEPS):
        ids = torch.randint(0, 128, (BATCH, SEQ + 1), generator=g)
        out.append((ids[:, :-1].contiguous(), ids[:, 1:].contiguous()))
    return out


def row_groups(data: int, m: int) -> list[list[int]]:
    """Rows of the global batch in each micro-batch when `data` ranks split it and each rank its
    piece into m micro-batches (micro-batch i: the i-th slice of every rank's piece)."""
    piece = BATCH // data
    k = piece // m
    return [[r * piece + i * k + j for r in range(data) for j in range(k)] for i in range(m)]


def reference(model: str, dtype: str, data: int, m: int) -> tuple[list[float], dict]:
    """One process: losses of every step (mean over `row_groups(data, m)`) and the state dict after."""
    net = build(model, dtype)
    opt = torch.optim.AdamW(net.parameters(), lr=LR, **({} if dtype == "float64" else {"eps": 1e-6}))
    groups = row_groups(data, m) if BATCH % (data * m) == 0 else [list(range(BATCH))]
    losses = []
    for x, y in batches():
        loss = sum(loss_fn(net(x[g]), y[g]) for g in groups) / len(groups)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in net.state_dict().items()}


# --- one rank ---------------------------------------------------------------------------------
def _last_line(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}".strip().splitlines()
    return text[0][:300] if isinstance(e, ValueError) else text[-1][:300]


def run_plan(plan: dict, rank: int = 0, out_dir: str | None = None) -> dict:
    """This rank's run of one plan: {"stage": "refused" | "ok" | "crash", "where", "error",
    "losses", "sd" (rank 0), "trace"}. `plan["inject"]` = {"rank", "step", "what": "raise" |
    "hang"} makes that rank fail after that step (the harness's own test)."""
    import autopar  # noqa: PLC0415

    out: dict = {"stage": "crash", "where": "build", "error": "", "losses": [], "sd": {}, "trace": ""}
    net = build(plan["model"], plan["dtype"])
    data = batches()
    kw = json.loads(json.dumps(plan["kw"]))  # a fresh copy: parallelize may keep the pins
    try:
        pm = autopar.parallelize(net, autopar.mesh(**plan["mesh"]), example_inputs=(data[0][0],), **kw)
        opt = autopar.optimizer(pm, torch.optim.AdamW, lr=LR, **({} if plan["dtype"] == "float64" else {"eps": 1e-6}))
    except ValueError as e:
        out.update(stage="refused", error=_last_line(e), trace=traceback.format_exc()[-3000:])
        return out
    except Exception as e:  # noqa: BLE001 - every failure is this plan's verdict
        out.update(error=_last_line(e), trace=traceback.format_exc()[-3000:])
        return out
    try:
        out["narrow_sums"] = narrow_sums(pm, plan["dtype"])
        for k, (x, y) in enumerate(data):
            out["where"] = f"step {k + 1}"
            out["losses"].append(pm.step(((x,), y), loss_fn).item())
            bad = plan.get("inject") or {}
            if bad.get("rank") == rank and bad.get("step") == k + 1:
                if bad["what"] == "hang":
                    time.sleep(10**6)
                raise RuntimeError(f"injected failure on rank {rank} after step {k + 1}")
            opt.step()
            opt.zero_grad()
        out["where"] = "export_state_dict"
        # exported through this world's own directory: export_state_dict(pm) without a path stages
        # in the shared temp dir, where another process's save removes its staging directory
        # (runtime/checkpoint_save.py clean_staging; seen as a CheckpointSaveError ENOENT)
        where = os.path.join(out_dir or tempfile.gettempdir(), f"{plan['index']}.export.pt")
        out["sd"] = {k: v.detach().clone() for k, v in autopar.export_state_dict(pm, where, like=net).items()}
        if rank == 0 and os.path.exists(where):
            os.remove(where)
    except Exception as e:  # noqa: BLE001
        out.update(error=_last_line(e), trace=traceback.format_exc()[-3000:])
        return out
    out.update(stage="ok", where="")
    return out


def rank_main(rank: int, ws: int, plans: list[dict], out_dir: str, plan_timeout_s: float) -> list[int]:
    """Run `plans` in order on this rank; write `<index>.<rank>.pt` per plan. Ends the process
    (os._exit) on a crash, and when another rank did (the agreement after each plan fails)."""
    import torch.distributed as dist  # noqa: PLC0415

    done = []
    for plan in plans:
        i = plan["index"]
        with open(os.path.join(out_dir, f"{i}.{rank}.stack"), "w") as stack:
            # a plan may carry its own watchdog ("timeout_s": the harness's own test of a hang)
            faulthandler.dump_traceback_later(plan.get("timeout_s", plan_timeout_s), exit=True, file=stack)
            t0 = time.perf_counter()
            try:
                res = run_plan(plan, rank, out_dir)
            finally:
                faulthandler.cancel_dump_traceback_later()
        res["seconds"] = time.perf_counter() - t0
        torch.save(res, os.path.join(out_dir, f"{i}.{rank}.pt.part"))
        os.replace(os.path.join(out_dir, f"{i}.{rank}.pt.part"), os.path.join(out_dir, f"{i}.{rank}.pt"))
        if res["stage"] == "crash":
            os._exit(3)  # the others may sit in a collective this rank never joins: end the world now
        try:
            stages = [None] * ws
            dist.all_gather_object(stages, (i, res["stage"]))
        except Exception:  # noqa: BLE001 - another rank ended: this world is over
            os._exit(4)
        if len(set(stages)) != 1:
            os._exit(5)  # ranks disagree (one refused, one trained): the world is out of step
        del res
        gc.collect()
        done.append(i)
    return done


# --- verdicts ---------------------------------------------------------------------------------
_REFS: dict = {}


def _ref(plan: dict):
    mesh = plan["mesh"]
    data = mesh.get("dp", 1) * mesh.get("ep", 1)
    m = plan["kw"].get("n_microbatches", 1)
    key = (plan["model"], plan["dtype"], data, m)
    if key not in _REFS:
        _REFS[key] = reference(*key)
    return _REFS[key]


def _secondary(text: str) -> bool:
    """An error a rank gets because a peer ended (its own cause is on that peer)."""
    return any(w in text for w in ("Connection closed by peer", "Connection reset by peer", "Broken pipe"))


def _hung(text: str) -> bool:
    t = text.lower()
    return "timed out" in t or "timeout" in t


def narrow_sums(pm, dtype: str) -> list[str]:
    """This rank's collectives that sum (all-reduce, reduce-scatter) floating values narrower than
    `dtype`, by node name: each adds partial results an op of the model computed in that narrower
    precision (NARROW_SUM_MODELS). A model without one rank graph (`graph_module`): none found."""
    gm = getattr(pm, "graph_module", None)
    if not isinstance(gm, torch.fx.GraphModule):
        return []
    eps = torch.finfo(getattr(torch, dtype)).eps
    out = []
    sums = ("autopar.all_reduce.default", "autopar.reduce_scatter.default")
    # recomputed regions keep their nodes in subgraphs
    nodes = [n for m in gm.modules() if isinstance(m, torch.fx.GraphModule) for n in m.graph.nodes]
    for n in nodes:
        if n.op == "call_function" and str(n.target) in sums:
            v = n.args[0].meta.get("val") if isinstance(n.args[0], torch.fx.Node) else None
            if isinstance(v, torch.Tensor) and v.is_floating_point() and torch.finfo(v.dtype).eps > eps:
                out.append(n.name)
    return out


def tolerance(plan: dict, narrow: bool = False) -> dict:
    """{"loss", "param"}: absolute tolerances for this plan's model and dtype; `narrow`: its
    program sums values of a narrower float (`narrow_sums`)."""
    if narrow and plan["model"] in NARROW_SUM_MODELS:
        return dict(TOLERANCES["float32"])
    tol = dict(TOLERANCES[plan["dtype"]])
    if plan["model"].startswith("moe") and plan["dtype"] == "float64":
        tol["loss"] = MOE_FP64_LOSS
    return tol


def verdict(plan: dict, ranks: list[dict | None], stacks: list[str]) -> tuple[str, str]:
    """(verdict line, detail for a failure) from each rank's result (None: it wrote none)."""
    missing = [r for r, res in enumerate(ranks) if res is None]
    if missing:
        hung = [r for r in missing if stacks[r].strip()]
        if hung:  # the watchdog dumped these ranks' stacks: where each one was
            return (f"HANG ranks {hung} past the plan timeout",
                    "\n".join(f"--- stack of rank {r} (innermost first):\n{stacks[r][:1500]}" for r in hung))
    crashed = [r for r, res in enumerate(ranks) if res is not None and res["stage"] == "crash"]
    crashed.sort(key=lambda r: _secondary(ranks[r]["error"]))  # the rank that failed first, not its peers
    if crashed:
        res = ranks[crashed[0]]
        kind = "HANG" if _hung(res["error"]) else "CRASH"
        return f"{kind} rank {crashed[0]} at {res['where']}: {res['error'][:200]}", res["trace"]
    if missing:
        return f"CRASH ranks {missing} ended without a result", ""
    stages = {res["stage"] for res in ranks}
    if stages == {"refused"}:
        return f"refused: {ranks[0]['error']}", ""
    if len(stages) > 1:
        who = {r: res["stage"] for r, res in enumerate(ranks)}
        return f"CRASH refused on some ranks only: {who}", next(res["trace"] for res in ranks if res["trace"])
    narrow = bool(ranks[0].get("narrow_sums")) and plan["model"] in NARROW_SUM_MODELS
    tol = tolerance(plan, narrow)
    ref_losses, ref_sd = _ref(plan)
    loss_err = max(abs(a - b) for res in ranks for a, b in zip(res["losses"], ref_losses))
    sd = ranks[0]["sd"]
    absent = sorted(k for k, v in ref_sd.items() if k not in sd and v.is_floating_point())
    param_err, worst = 0.0, ""
    for k, v in ref_sd.items():
        if k in sd and v.is_floating_point() and v.numel():
            if sd[k].shape != v.shape:
                return f"MISMATCH {k} has shape {tuple(sd[k].shape)}, one process {tuple(v.shape)}", ""
            d = float((sd[k].double() - v.double()).abs().max())
            if d > param_err:
                param_err, worst = d, k
    short = [r for r, res in enumerate(ranks) if len(res["losses"]) != STEPS]
    errs = f"loss {loss_err:.1e} param {param_err:.1e}" + (" [fp32 sums]" if narrow else "")
    if absent or short or loss_err > tol["loss"] or param_err > tol["param"] or loss_err != loss_err:
        why = f" missing {absent[:4]}" if absent else ""
        return f"MISMATCH ({errs}, worst {worst}){why}", ""
    return f"match ({errs})", ""


# --- worlds -----------------------------------------------------------------------------------
def _precapture(plans: list[dict]) -> None:
    """Capture each model (x dtype x cp or not) here once before the world forks
    (autopar.capture_cache, which keeps 16): each rank then reuses the graph instead of tracing it
    again (a few CPU-seconds a rank). Plans whose precision casts the model capture their own."""
    from harness import capture_before_fork  # noqa: PLC0415

    seen: set = set()
    for p in plans:
        key = (p["model"], p["dtype"], p["mesh"].get("cp", 1) > 1)
        if key not in seen and len(seen) < 12:
            seen.add(key)
            capture_before_fork(build(p["model"], p["dtype"]), (batches()[0][0],), cp=key[2])


def run_plans(plans: list[dict], *, per_world: int = 12, plan_timeout_s: float = 150.0, on_result=None) -> list[dict]:
    """Run every plan; returns one record per plan, in order: {"plan", "verdict", "detail",
    "seconds"}. `on_result(record)` is called as each is known."""
    from harness import WorldError, warm_parent, world  # noqa: PLC0415

    from autopar import parallelize  # noqa: F401, PLC0415 - the public names load on first use: here, not per rank
    warm_parent()
    records: dict[int, dict] = {}
    pending = list(plans)
    by_index = {p["index"]: p for p in plans}
    while pending:
        chunk = pending[:per_world]
        out_dir = tempfile.mkdtemp(prefix="autopar_fuzz_")
        _precapture(chunk)
        t0 = time.perf_counter()
        world_error = ""
        try:
            world(WORLD, rank_main, chunk, out_dir, plan_timeout_s, timeout_s=plan_timeout_s * len(chunk) + 60)
        except WorldError as e:
            world_error = str(e)
        finished = []
        for p in chunk:
            i = p["index"]
            paths = [os.path.join(out_dir, f"{i}.{r}.pt") for r in range(WORLD)]
            stacks = []
            for r in range(WORLD):
                try:
                    with open(os.path.join(out_dir, f"{i}.{r}.stack")) as f:
                        stacks.append(f.read())
                except OSError:
                    stacks.append("")
            started = any(os.path.exists(os.path.join(out_dir, f"{i}.{r}.stack")) for r in range(WORLD))
            ranks = [torch.load(q, weights_only=False) if os.path.exists(q) else None for q in paths]
            if not started or (all(x is None for x in ranks) and not any(s.strip() for s in stacks)):
                if not finished:  # the world failed before its first plan: blame that plan, go on
                    line = "CRASH the world failed: " + (world_error.strip().splitlines() or ["?"])[-1][:200]
                    records[i] = {"plan": by_index[i], "verdict": line, "detail": world_error[-3000:],
                                  "seconds": time.perf_counter() - t0}
                    finished.append(i)
                    if on_result:
                        on_result(records[i])
                break
            line, detail = verdict(p, ranks, stacks)
            secs = max((x["seconds"] for x in ranks if x is not None), default=time.perf_counter() - t0)
            records[i] = {"plan": p, "verdict": line, "detail": detail, "seconds": secs,
                          "losses": ranks[0]["losses"] if ranks[0] is not None else []}
            finished.append(i)
            if on_result:
                on_result(records[i])
            if any(x is None or x["stage"] == "crash" for x in ranks) or line.startswith(("CRASH", "HANG")):
                break  # the world ended here; what follows runs in a new one
        shutil.rmtree(out_dir, ignore_errors=True)
        pending = [p for p in pending if p["index"] not in records]
    return [records[p["index"]] for p in plans]


def summary(records: list[dict]) -> str:
    counts: dict[str, int] = {}
    for rec in records:
        kind = rec["verdict"].split(" ")[0].rstrip(":")
        counts[kind] = counts.get(kind, 0) + 1
    n = len(records)
    refused = counts.get("refused", 0)
    parts = ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))
    return (f"{n} plans: {parts}; refused fraction {refused / max(n, 1):.0%}; "
            f"failures {sum(counts.get(k, 0) for k in FAILURES)}")


def repro(plan: dict) -> str:
    """The shell line that runs this one plan again."""
    if make_plan(plan["seed"], plan["index"]) == plan:
        return f"bash scripts/fuzz.sh 1 {plan['seed']} --only {plan['index']}"
    return f"bash scripts/fuzz.sh --plan '{json.dumps(plan)}'"


def table_line(rec: dict) -> str:
    p = rec["plan"]
    return f"{p['seed']}:{p['index']:<4d} {describe(p):<90s} {rec['seconds']:6.1f}s  {rec['verdict']}"


def main(argv: list[str]) -> int:
    """`python tests/fuzz/plans.py N SEED [--only i,j,..] [--per-world K]`: a table, then a summary
    and each failure's repro; exit status 1 on any MISMATCH / CRASH / HANG."""
    import argparse  # noqa: PLC0415

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("n", type=int, nargs="?", default=200)
    ap.add_argument("seed", type=int, nargs="?", default=int(time.strftime("%Y%m%d", time.gmtime())))
    ap.add_argument("--only", default="", help="comma-separated plan indices (to reproduce one)")
    ap.add_argument("--plan", action="append", default=[], help="a plan as JSON (as a failure prints it); repeatable")
    ap.add_argument("--per-world", type=int, default=12)
    ap.add_argument("--plan-timeout", type=float, default=150.0)
    a = ap.parse_args(argv)
    idx = [int(s) for s in a.only.split(",") if s] or list(range(a.n))
    plans = [make_plan(a.seed, i) for i in idx]
    if a.plan:  # hand-edited plans, e.g. a failure with one keyword dropped
        plans = [dict(json.loads(t), index=k) for k, t in enumerate(a.plan)]
    print(f"autopar fuzz: {len(plans)} plans, seed {a.seed}, {WORLD} gloo ranks, {STEPS} AdamW steps; "
          f"tolerances {TOLERANCES} (moe-tiny fp64 loss {MOE_FP64_LOSS})", flush=True)
    t0 = time.perf_counter()
    records = run_plans(plans, per_world=a.per_world, plan_timeout_s=a.plan_timeout,
                        on_result=lambda rec: print(table_line(rec), flush=True))
    print(f"\n{summary(records)} in {time.perf_counter() - t0:.0f} s", flush=True)
    bad = [rec for rec in records if rec["verdict"].startswith(FAILURES)]
    for rec in bad:
        p = rec["plan"]
        print(f"\n--- {rec['verdict']}\nrepro: {repro(p)}\n{rec['detail'][-1500:]}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
