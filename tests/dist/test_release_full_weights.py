"""After `parallelize` of a real model, nothing autopar keeps holds the user's full tensors
where the program holds shards (tp-sharded weights, ZeRO-3 rows): a user who drops the model
gets the memory back. `pm.global_graph`, which describes the model for checkpoints and
save_pretrained, keeps meta tensors of the same shapes and tying."""
import gc
import weakref

import torch

import autopar
from autopar.models import get
from harness import world


def _release_world(rank, ws):
    out = {}
    for cell, name, mesh_kw, opts in (("tp2", "gpt-tiny", {"tp": 2}, {"hardware": "h100-sxm"}),
                                      ("zero3", "gpt-tiny-tied", {"dp": 2}, {"zero_stage": 3})):
        sp = get(name)
        x, y = sp.example_batch(8, generator=torch.Generator().manual_seed(1))
        torch.manual_seed(0)
        model = sp.build()
        full = dict(model.named_parameters())
        pm = autopar.parallelize(model, autopar.mesh(**mesh_kw), example_inputs=x, **opts)
        if cell == "tp2":  # the names the plan cuts over tp: the program holds their shards
            names = [n for n, lay in pm.plan.param_layouts.items()
                     if any(a == "tp" and type(p).__name__ == "Shard" for a, p in lay.axes)]
        else:  # ZeRO-3: every parameter lives as this rank's rows
            names = list(full)
        refs = {n: weakref.ref(full[n]) for n in names if n in full}
        tied = [sorted(g) for g in autopar.build.model_tensors.model_tensors(pm.global_graph, pm.plan)["aliases"]]
        devices = {t.device.type for t in pm.global_graph.parameters()}
        del model, full
        gc.collect()
        alive = sorted(n for n, r in refs.items() if r() is not None)
        loss = float(pm.step((x, y), sp.loss_fn))  # the program still trains without the user's model
        out[cell] = (len(refs), alive, devices, tied, loss)
    return out


def test_parallelize_keeps_no_full_tensor_of_what_it_shards():
    res = world(2, _release_world)[0]
    for cell, (n_checked, alive, devices, tied, loss) in res.items():
        assert n_checked > 0, cell  # the plan did shard something: the check is not empty
        assert alive == [], f"{cell}: the user's full tensors are still held for {alive}"
        assert devices == {"meta"}, (cell, devices)
        assert loss == loss and loss > 0, (cell, loss)
    # gpt-tiny-tied ties its embedding and head: the description keeps them one tensor
    assert res["zero3"][3] == [["lm_head.weight", "tok_emb.weight"]], res["zero3"][3]
