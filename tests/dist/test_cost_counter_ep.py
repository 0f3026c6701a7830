"""Expert parallelism's collectives as `cost.estimate` predicts them against what the runtime
sent (`runtime.collectives.COUNTER`), in one gloo world of 2 ranks (ep = 2), one training step
through `autopar.parallelize`, on the reference MoE dropless and with the model's capacity:

- calls per collective and axis are equal (the route's count all-gathers, the dispatch and
  combine all-to-alls and their reverses, the router statistics' and the non-expert gradients'
  all-reduces over ep: `cost.expert_comm.ep_events`);
- bytes are equal for the all-gathers and all-reduces; the all-to-alls' bytes follow the
  routing, which estimate takes as balanced: dropless within 2 % of it on every rank (a fresh
  router is nearly uniform on this batch), with a capacity at most the balanced figure (drops
  only remove rows; the second rank drops 15 % of it here).

The reported-loss all-reduce of `Program.step` (`metric_all_reduce`) is left out, as in
tests/dist/test_cost_counter.py.
"""
import torch

import autopar
from autopar.cost import analyze, estimate
from autopar.models import get
from autopar.runtime import collectives as C
from harness import world

WS = 2


def _step(rank: int, ws: int):
    out = {}
    for name in ("moe-tiny", "moe-tiny-capacity"):
        torch.manual_seed(0)
        spec = get(name)
        (x,), y = spec.example_batch(8, generator=torch.Generator().manual_seed(1))
        pm = autopar.parallelize(spec.build(), autopar.mesh(ep=ws), example_inputs=x)
        opt = autopar.optimizer(pm, torch.optim.AdamW, lr=1e-3)
        C.COUNTER.reset()
        pm.step((x, y), spec.loss_fn)
        opt.step()
        counted = C.COUNTER.snapshot()
        est = estimate(analyze(pm.global_graph, "cpu-gloo"), pm.plan, "cpu-gloo", batch_is_global=True)
        out[name] = (counted, est.collectives())
    return out


def test_expert_parallel_collectives_equal_the_cost_model_on_every_rank():
    for rank, res in enumerate(world(WS, _step)):
        for name, (counted, want) in res.items():
            assert counted.pop("metric_all_reduce@ep") == {"calls": 1, "bytes": 4}
            assert set(counted) == set(want) == {"all_gather@ep", "all_to_all@ep", "all_reduce@ep"}, (rank, name)
            for key in counted:
                assert counted[key]["calls"] == want[key]["calls"], (rank, name, key)
                if key != "all_to_all@ep":
                    assert counted[key]["bytes"] == want[key]["bytes"], (rank, name, key)
            got, balanced = counted["all_to_all@ep"]["bytes"], want["all_to_all@ep"]["bytes"]
            if name == "moe-tiny":
                torch.testing.assert_close(float(got), float(balanced), rtol=0.02, atol=0.0)
            else:
                assert 0 < got <= balanced, (rank, name, got, balanced)
