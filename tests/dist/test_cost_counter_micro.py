"""`cost.estimate(...).collectives()` against what the runtime sent (`runtime.collectives.COUNTER`)
with micro-batches, and the router statistics of an MoE model without expert parallelism, in one
gloo world of 2 ranks, one training step through `autopar.parallelize`:

- moe-tiny on dp = 2 (ep = 1), one micro-batch: the 4 router statistics (2 blocks x the
  load-balancing loss's two reductions over tokens) are all-reduced over dp by the pass that
  `plan.extra["router_stats"]` drives; estimate prices them (`expert_comm.router_stat_events`)
  beside the gradient all-reduce: calls and bytes equal;
- the same with 2 micro-batches (moe_aux_stats="micro_batch"): the statistics once per
  micro-batch, the gradient all-reduce once (the first micro-batch runs under no_sync): equal;
- moe-tiny on ep = 2 with 2 micro-batches: the dispatcher's all-gathers and all-to-alls, the
  statistics' and the non-expert gradients' all-reduces (`moe.grad_avg`, in every micro-batch's
  backward) twice each: calls equal, all-gather and all-reduce bytes equal, the all-to-alls'
  bytes within 2 % of estimate's balanced routing (as tests/dist/test_cost_counter_ep.py);
- gpt-tiny on tp = 2 with 2 micro-batches, estimate of the rank's rewritten graph (its tensor-
  parallel collectives are graph nodes) at the global batch: every collective twice, calls equal,
  all-reduce bytes equal. (The all-gathers' bytes are not compared: the shard pass leaves the
  global head count in the `val` of the gathered attention input, so estimate reads twice the
  bytes the rank sends; a fault of the graph's meta, reported, not of the count.)

Before: estimate counted every graph and expert collective once per step, whatever the
micro-batches, and priced no router statistic without ep. The reported-loss all-reduce
(`metric_all_reduce`) is left out, as in tests/dist/test_cost_counter.py.
"""
import torch

import autopar
from autopar.cost import analyze, estimate
from autopar.models import get
from autopar.runtime import collectives as C
from harness import world

WS, BATCH = 2, 8
CASES = [("moe-tiny", {"dp": WS}, 1), ("moe-tiny", {"dp": WS}, 2), ("moe-tiny", {"ep": WS}, 2),
         ("gpt-tiny", {"tp": WS}, 2)]


def _step(rank: int, ws: int):
    out = []
    for name, mesh, micro in CASES:
        torch.manual_seed(0)
        spec = get(name)
        (x,), y = spec.example_batch(BATCH, generator=torch.Generator().manual_seed(1))
        opts = {"n_microbatches": micro} if micro > 1 else {}
        if micro > 1 and name.startswith("moe"):
            opts["moe_aux_stats"] = "micro_batch"
        pm = autopar.parallelize(spec.build(), autopar.mesh(**mesh), example_inputs=x, **opts)
        opt = autopar.optimizer(pm, torch.optim.AdamW, lr=1e-3)
        C.COUNTER.reset()
        pm.step((x, y), spec.loss_fn)
        opt.step()
        counted = C.COUNTER.snapshot()
        if "tp" in mesh:  # tp's collectives are nodes of the rank's graph
            est = estimate(pm.graph_module, pm.plan, "cpu-gloo", global_batch=BATCH)
        else:
            est = estimate(analyze(pm.global_graph, "cpu-gloo"), pm.plan, "cpu-gloo", batch_is_global=True)
        out.append((counted, est.collectives(), pm.plan.n_microbatches, len((pm.plan.extra.get("router_stats") or
                                                                             {}).get("keys", []))))
    return out


def test_collectives_per_micro_batch_and_router_statistics_without_ep_equal_the_cost_model():
    for rank, res in enumerate(world(WS, _step)):
        for (name, mesh, micro), (counted, want, m, n_stats) in zip(CASES, res):
            where = (rank, name, mesh, micro)
            axis = next(iter(mesh))
            assert m == micro, where
            assert counted.pop(f"metric_all_reduce@{axis}", {"calls": 1, "bytes": 4}) == {"calls": 1, "bytes": 4}
            assert set(counted) == set(want), (where, counted, want)
            for key in counted:
                assert counted[key]["calls"] == want[key]["calls"], (where, key, counted[key], want[key])
            if axis == "dp":  # gradients and the router statistics: bytes equal too
                assert n_stats == 4, where
                assert counted == want, where
                assert want["all_reduce@dp"]["calls"] == 1 + n_stats * micro, (where, want)
            elif axis == "ep":
                for key in ("all_gather@ep", "all_reduce@ep"):
                    assert counted[key]["bytes"] == want[key]["bytes"], (where, key)
                torch.testing.assert_close(float(counted["all_to_all@ep"]["bytes"]),
                                           float(want["all_to_all@ep"]["bytes"]), rtol=0.02, atol=0.0)
                assert want["all_gather@ep"]["calls"] == 2 * micro, (where, want)  # 2 blocks, per micro-batch
            else:
                assert counted["all_reduce@tp"] == want["all_reduce@tp"], where
                assert want["all_reduce@tp"]["calls"] % micro == 0, (where, want)
