"""A model built on the meta device trains exactly as the same model built with real weights:
`parallelize(meta_model, mesh, weights=...)` under dp + ZeRO-3, dp x tp, pp x dp and dp x ep,
on 4 gloo processes, with weights from the modules' own init (`autopar.ModuleInit(seed)`) and
from a safetensors file, against the same plan run from real weights on every rank (the
parity matrix's path) and against one process.

Tolerances: meta + weights against real weights under the same plan: exact (the same program
on the same values: losses and parameters bitwise equal). Against one process: losses 1e-5
absolute (sharded sums change the order of additions)."""
import os

import pytest
import torch

import autopar
from autopar.models import get
from harness import capture_before_fork, world

BATCH, STEPS = 8, 3
CELLS = [  # (model, mesh, parallelize options)
    ("gpt-tiny", {"dp": 4}, {"zero_stage": 3}),
    ("gpt-tiny", {"dp": 2, "tp": 2}, {"zero_stage": 1, "hardware": "h100-sxm"}),
    ("gpt-tiny", {"pp": 2, "dp": 2}, {"n_microbatches": 2, "pins": {"schedule": "1f1b"}}),
    ("moe-tiny", {"dp": 2, "ep": 2}, {}),
]


def _train(spec, pm):
    opt = autopar.optimizer(pm, torch.optim.AdamW, lr=1e-2)
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(STEPS):
        x, y = spec.example_batch(BATCH, generator=g)
        losses.append(pm.step((x, y), spec.loss_fn).item())
        opt.step()
        opt.zero_grad()
    return losses, pm.engine.gather_full_state_dict()


def _cells(rank, ws, files):
    out = []
    for name, mesh_kw, opts in CELLS:
        spec = get(name)
        x0, _ = spec.example_batch(BATCH, generator=torch.Generator().manual_seed(1))
        torch.manual_seed(0)
        real = autopar.parallelize(spec.build(), autopar.mesh(**mesh_kw), example_inputs=x0, **opts)
        runs = {"real": _train(spec, real)}
        for kind, weights in (("init", autopar.ModuleInit(seed=0)), ("file", files[name])):
            torch.manual_seed(1234)  # the source decides the values, not the RNG state here
            with torch.device("meta"):
                model = spec.build()
            pm = autopar.parallelize(model, autopar.mesh(**mesh_kw), example_inputs=x0, weights=weights, **opts)
            assert not any(t.is_meta for t in pm.program.parameters()), f"{name} {mesh_kw} {kind}: meta left"
            assert any(n.startswith("weights from") for n in pm.plan.notes), pm.plan.notes
            runs[kind] = _train(spec, pm)
        out.append(runs)
    return out


def _reference_losses(name):
    spec = get(name)
    torch.manual_seed(0)
    model = spec.build()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(STEPS):
        x, y = spec.example_batch(BATCH, generator=g)
        loss = spec.loss_fn(model(*x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.fixture(scope="module")
def weight_files(tmp_path_factory):
    from safetensors.torch import save_file

    d = tmp_path_factory.mktemp("weights")
    files = {}
    for name in sorted({c[0] for c in CELLS}):
        torch.manual_seed(0)
        model = get(name).build()
        sd = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
        files[name] = os.path.join(d, f"{name}.safetensors")
        save_file(sd, files[name])
    return files


def test_meta_models_with_init_or_file_weights_train_as_real_weights_under_zero3_tp_pp_ep(weight_files):
    for name in sorted({c[0] for c in CELLS}):  # captured here once: the ranks' real and meta builds reuse it
        torch.manual_seed(0)
        x0, _ = get(name).example_batch(BATCH, generator=torch.Generator().manual_seed(1))
        capture_before_fork(get(name).build(), x0)
    results = world(4, _cells, weight_files, timeout_s=600)
    refs = {name: _reference_losses(name) for name in {c[0] for c in CELLS}}
    for i, (name, mesh_kw, _opts) in enumerate(CELLS):
        for rank, per_rank in enumerate(results):
            runs = per_rank[i]
            real_losses, real_sd = runs["real"]
            torch.testing.assert_close(torch.tensor(real_losses), torch.tensor(refs[name]), rtol=0, atol=1e-5)
            for kind in ("init", "file"):
                losses, sd = runs[kind]
                assert losses == real_losses, f"{name} {mesh_kw} {kind} rank {rank}: {losses} != {real_losses}"
                assert sd.keys() == real_sd.keys(), f"{name} {mesh_kw} {kind}: {sorted(sd.keys() ^ real_sd.keys())}"
                for k in real_sd:
                    torch.testing.assert_close(sd[k], real_sd[k], rtol=0, atol=0,
                                               msg=lambda m: f"{name} {mesh_kw} {kind} rank {rank} {k}: {m}")
