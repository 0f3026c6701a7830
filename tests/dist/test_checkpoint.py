"""Distributed checkpoints (runtime/checkpoint.py, autopar/checkpoint_api.py) on gloo.

* Resharding, exact: a checkpoint written under one plan loads under another with every
  parameter and every optimizer state (AdamW's exp_avg, exp_avg_sq, step) bit-for-bit equal:
  dp=2 ZeRO-3 -> tp=4; ZeRO-3 (dp=2) -> ZeRO-1 (dp=2 x tp=2); pp=2 x dp=2 -> one process.
  "Equal" is checked independently of the checkpoint code: each rank returns the tensors it
  holds with its coordinates, and the test puts the full tensors back together by
  concatenation (ZeRO rows inside tp pieces). The model is gpt-tiny-tied, so the tied
  embedding / LM head (one tensor under two names; two copies on two pipeline stages) is
  covered. Each reloaded model then trains one more step; its loss equals the saving plan's
  next loss up to the summation order of the plans (1e-5 absolute, as the tp parity tests).
* Safety: a truncated file, a flipped byte, a missing manifest and a save that failed half-way
  are refused (CheckpointError naming the file) or leave nothing behind, and the previous
  checkpoint still loads; `.metadata` is read with an allow-list unpickler that refuses any
  other class.
* Interchange: a checkpoint (or the live pipeline model) exports to a safetensors file that
  loads strictly into the original nn.Module with equal values; a safetensors file imports
  into a dp=2 ZeRO-3 GPT, and a transformers `save_pretrained` directory into a tp=2
  LlamaForCausalLM, each rank reading exactly the elements it keeps (counted), values equal.
"""
from __future__ import annotations

import io
import json
import os
import pickle
import shutil

import pytest
import torch
import torch.distributed as dist

import autopar
from autopar import checkpoint_api as api
from autopar import models
from autopar.runtime import checkpoint as ck
from autopar.runtime import checkpoint_files as files
from harness import capture_before_fork, world

MODEL = "gpt-tiny-tied"
H100 = {"hardware": "h100-sxm"}  # gloo's profile would (rightly) replicate a tiny model at tp=4
LOSS_ATOL = 1e-5
ADAMW = dict(lr=1e-2)


def _spec():
    return models.get(MODEL)


def _model():
    torch.manual_seed(0)
    return _spec().build()


def _batch(step: int):
    (x,), y = _spec().example_batch(8, generator=torch.Generator().manual_seed(100 + step))
    return (x,), y


def _parallel(mesh_kw, **opts):
    x, _ = _batch(0)
    pm = autopar.parallelize(_model(), autopar.mesh(**mesh_kw), example_inputs=x, **opts)
    return pm, autopar.optimizer(pm, torch.optim.AdamW, **ADAMW)


def _train(pm, opt, steps: range) -> list[float]:
    losses = []
    for i in steps:
        losses.append(pm.step(_batch(i), _spec().loss_fn).item())
        opt.step()
        opt.zero_grad()
    return losses


def _held(pm, opt) -> dict:
    """Every tensor this rank holds, with where it sits: {name: (tp index, dp row index or
    None, pp stage, {"value": t, "exp_avg": t, ...})}. Read from the engines directly."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    coords = pm.mesh.coords(rank)
    engines = ck.engines_of(pm.engine)
    out = {}
    for e in engines:
        inner = e.optimizer.optim if e.optimizer is not None else None
        for s in e.slots:
            rows = e.stage >= 1 and e.k > 1
            d = {"value": s.master.detach().clone()}
            if inner is not None:
                d.update({k: v.detach().clone() for k, v in inner.state.get(s.master, {}).items()})
            for n in [s.name, *s.aliases]:
                out[n] = (coords.get("tp", 0), e.index if rows else None, d)
    layouts = {k: {a: str(p) for a, p in lay.axes} for k, lay in pm.plan.param_layouts.items()}
    return {"held": out, "layouts": layouts}


def _full(per_rank: list[dict]) -> dict[str, dict[str, torch.Tensor]]:
    """Put the full tensors back together from every rank's pieces: ZeRO rows (dim 0) inside
    each tp piece, tp pieces along the plan's dim. Replicas must agree exactly."""
    layouts = per_rank[0]["layouts"]
    names = sorted({n for r in per_rank for n in r["held"]})
    out = {}
    for n in names:
        pieces: dict[tuple, dict] = {}
        for r in per_rank:
            if n not in r["held"]:
                continue
            tp, dp, d = r["held"][n]
            key = (tp, dp)
            if key in pieces:
                for k, v in d.items():
                    assert torch.equal(pieces[key][k], v), f"replicas of {n} {k} differ"
            else:
                pieces[key] = d
        place = layouts.get(n, {}).get("tp", "R")
        tps = sorted({tp for tp, _ in pieces}) if place.startswith("S(") else [min(tp for tp, _ in pieces)]
        full = {}
        for k in next(iter(pieces.values())):
            parts = []
            for tp in tps:
                rows = sorted((dp, d[k]) for (t, dp), d in pieces.items() if t == tp and dp is not None)
                if rows:
                    parts.append(torch.cat([v.reshape(-1, *v.shape[1:]) for _, v in rows]) if rows[0][1].dim() else rows[0][1])
                else:
                    parts.append(next(d[k] for (t, dp), d in pieces.items() if t == tp))
            v = torch.cat(parts, dim=int(place[2:-1])) if place.startswith("S(") and parts[0].dim() else parts[0]
            full[k] = v
        out[n] = full
    return out


def _value(full: dict, name: str) -> torch.Tensor:
    """The value of `name`, or of its tied partner (a pipeline stage names the tied weight once)."""
    tied = {"tok_emb.weight": "lm_head.weight", "lm_head.weight": "tok_emb.weight"}
    return (full[name] if name in full else full[tied[name]])["value"]


def _assert_same(got: dict, want: dict, what: str) -> None:
    assert got, f"{what}: nothing to compare"
    common = sorted(set(got) & set(want))
    assert len(common) >= len(got) - 1, f"{what}: names {sorted(set(got) - set(want))} not in the saved state"
    n_checked = 0
    for n in common:
        assert sorted(got[n]) == sorted(want[n]), f"{what} {n}: state keys {sorted(got[n])} vs {sorted(want[n])}"
        for k in want[n]:
            a, b = got[n][k], want[n][k]
            assert a.shape == b.shape and a.dtype == b.dtype, f"{what} {n}.{k}: {a.shape}/{a.dtype} vs {b.shape}/{b.dtype}"
            assert torch.equal(a, b), f"{what} {n}.{k}: max diff {(a.float() - b.float()).abs().max().item()}"
            n_checked += 1
    assert n_checked >= 3 * len(common), f"{what}: optimizer state missing ({n_checked} tensors for {len(common)} names)"


# --- worlds ---------------------------------------------------------------------------------------
class _CountingSource(ck.StateSource):
    read_numel = 0

    def read(self, name, offset, shape):
        t = super().read(name, offset, shape)
        self.read_numel += t.numel()
        return t


def _save_dp2_zero3(rank, ws, root):
    pm, opt = _parallel({"dp": 2}, zero_stage=3)
    # start from a safetensors file, each rank reading only its own rows
    src = _CountingSource(f"{root}/init.safetensors")
    api.import_state_dict(pm, src)
    imported = _held(pm, opt)
    _train(pm, opt, range(2))
    api.save(pm, f"{root}/z3", optimizer=opt, step=2, extra={"data_epoch": 0})
    held = _held(pm, opt)
    nxt = _train(pm, opt, range(2, 3))
    local = sum(s.master.numel() for s in pm.engine.slots)
    return {**held, "next_loss": nxt[0], "imported": imported, "read": src.read_numel, "local": local,
            "hf": _import_transformers(root)}


def _llama(seed: int):
    import transformers

    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, use_cache=False))


def _llama_ids():
    return torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(0))


def _import_transformers(root):
    """A transformers checkpoint directory (save_pretrained) into a tp=2 Llama, piece by piece."""
    pm = autopar.parallelize(_llama(seed=1), autopar.mesh(tp=2), example_inputs=(_llama_ids(),), **H100)
    opt = autopar.optimizer(pm, torch.optim.AdamW, lr=1e-3)
    src = _CountingSource(f"{root}/hf")
    names = api.import_state_dict(pm, src)
    local = sum(s.master.numel() for s in pm.engine.slots)
    return {**_held(pm, opt), "read": src.read_numel, "local": local, "names": len(names),
            "sharded": sum(1 for lay in pm.plan.param_layouts.values() if not lay.is_replicated())}


def _four_ranks(rank, ws, root):
    out = {}
    # dp=2 ZeRO-3 -> tp=4, and ZeRO-3 -> ZeRO-1 on dp=2 x tp=2
    for name, mesh_kw, opts in [("tp4", {"tp": 4}, H100), ("dp2tp2z1", {"dp": 2, "tp": 2}, {**H100, "zero_stage": 1})]:
        pm, opt = _parallel(mesh_kw, **opts)
        info = api.load(pm, f"{root}/z3", optimizer=opt)
        held = _held(pm, opt)
        nxt = _train(pm, opt, range(2, 3))
        out[name] = {**held, "info": info, "next_loss": nxt[0], "sharded": bool(pm.plan.param_layouts)}
    # pp=2 x dp=2: train, save twice (the second asynchronously), then a save that fails half-way
    pm, opt = _parallel({"pp": 2, "dp": 2})
    _train(pm, opt, range(2))
    api.save(pm, f"{root}/pp/step_2", optimizer=opt, step=2)
    _train(pm, opt, range(2, 3))
    h = api.save(pm, f"{root}/pp/step_3", optimizer=opt, step=3, async_save=True)
    held = _held(pm, opt)  # taken while the save runs: the save wrote its own copy
    nxt = _train(pm, opt, range(3, 4))
    assert h.wait() == f"{root}/pp/step_3"
    real = files.sha256
    files.sha256 = (lambda p: (_ for _ in ()).throw(OSError("disk gone"))) if rank == 1 else real
    try:
        api.save(pm, f"{root}/pp/step_4", optimizer=opt, step=4)
        failed = None
    except RuntimeError as e:
        failed = str(e)
    finally:
        files.sha256 = real
    # export from the live pipeline model (collective): its state after the 4th step
    api.export_state_dict(pm, f"{root}/export_live.safetensors")
    out["pp"] = {**held, "next_loss": nxt[0], "failed_save": failed, "final": _held(pm, opt)}
    return out


# --- tests ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("ckpt"))
    torch.manual_seed(7)
    ck.write_state_dict(_spec().build().state_dict(), f"{root}/init.safetensors")
    _llama(seed=2).save_pretrained(f"{root}/hf")  # model.safetensors + config.json
    # each structure the ranks parallelize, captured once here: the forked ranks reuse the graph
    capture_before_fork(_model(), _batch(0)[0])
    capture_before_fork(_llama(seed=1), (_llama_ids(),))
    two = world(2, _save_dp2_zero3, root)
    four = world(4, _four_ranks, root)
    return root, two, four


def test_dp2_zero3_checkpoint_loads_exactly_under_tp4_and_under_zero1_dp2_tp2(runs):
    root, two, four = runs
    saved = _full(two)
    for name in ("tp4", "dp2tp2z1"):
        per = [r[name] for r in four]
        assert per[0]["sharded"], f"{name}: the plan shards nothing, so this checks no resharding"
        assert per[0]["info"]["step"] == 2 and per[0]["info"]["extra"] == {"data_epoch": 0}
        _assert_same(_full(per), saved, f"dp2 ZeRO-3 -> {name}")
        for r in per:
            assert abs(r["next_loss"] - two[0]["next_loss"]) <= LOSS_ATOL, (name, r["next_loss"], two[0]["next_loss"])
    m = json.load(open(f"{root}/z3/autopar_manifest.json"))
    assert m["mesh"] == {"dp": 2} and ["lm_head.weight", "tok_emb.weight"] in m["aliases"]
    assert json.load(open(f"{root}/z3/plan.json"))["zero_stage"] == 3


def _one_process_load(root):
    pm, opt = _parallel({"dp": 1})
    info = api.load(pm, f"{root}/pp/step_3", optimizer=opt)
    held = _held(pm, opt)
    nxt = _train(pm, opt, range(3, 4))
    return {**held, "info": info, "next_loss": nxt[0]}


def test_pp2_dp2_checkpoint_loads_exactly_into_one_process_and_failed_save_leaves_no_trace(runs):
    root, _two, four = runs
    one = _one_process_load(root)  # no torch.distributed in this process
    assert one["info"]["step"] == 3 and one["info"]["mesh"] == {"pp": 2, "dp": 2}
    _assert_same(_full([one]), _full([r["pp"] for r in four]), "pp2 x dp2 -> one process")
    assert abs(one["next_loss"] - four[0]["pp"]["next_loss"]) <= LOSS_ATOL
    # the save that failed on rank 1 failed on every rank and left no directory behind
    for r in four:
        assert r["pp"]["failed_save"] and "disk gone" in r["pp"]["failed_save"], r["pp"]["failed_save"]
    assert sorted(os.listdir(f"{root}/pp")) == ["step_2", "step_3"]
    assert api.latest_checkpoint(f"{root}/pp") == f"{root}/pp/step_3"


def test_damaged_checkpoints_are_refused_and_the_previous_one_still_loads(runs, tmp_path):
    root, _two, _four = runs
    good = f"{root}/pp/step_2"
    cases = {}
    for what in ("truncated", "corrupted", "no_manifest", "bad_metadata_class"):
        bad = str(tmp_path / "ck" / f"step_{9 if what == 'truncated' else 8}_{what}")
        shutil.copytree(f"{root}/pp/step_3", bad)
        data = sorted(f for f in os.listdir(bad) if f.endswith(".distcp"))[0]
        if what == "truncated":
            with open(os.path.join(bad, data), "r+b") as f:
                f.truncate(os.path.getsize(os.path.join(bad, data)) // 2)
        elif what == "corrupted":
            with open(os.path.join(bad, data), "r+b") as f:
                f.seek(700)
                b = f.read(1)
                f.seek(700)
                f.write(bytes([b[0] ^ 0x40]))
        elif what == "no_manifest":
            os.remove(os.path.join(bad, files.MANIFEST))
        cases[what] = bad
    for what, needle in [("truncated", "truncated"), ("corrupted", "corrupted"), ("no_manifest", "autopar_manifest.json is missing")]:
        with pytest.raises(ck.CheckpointError, match=needle):
            ck.verify_checkpoint(cases[what])
    # a truncated file is caught by sizes alone; a flipped byte needs the hashes
    with pytest.raises(ck.CheckpointError, match="truncated"):
        ck.verify_checkpoint(cases["truncated"], "size")
    ck.verify_checkpoint(cases["corrupted"], "size")
    # .metadata naming any class outside DCP's metadata is refused before it is built
    evil = cases["bad_metadata_class"]
    with open(os.path.join(evil, ".metadata"), "wb") as f:
        pickle.dump(io.StringIO("not metadata"), f)
    with pytest.raises(ck.CheckpointError, match="refusing to unpickle"):
        ck.read_metadata(evil)
    # among damaged newer checkpoints, the newest good one is found; loading the damaged one
    # raises, the previous one loads
    ckroot = str(tmp_path / "ck")
    shutil.copytree(good, os.path.join(ckroot, "step_2"))
    assert api.latest_checkpoint(ckroot, verify="full") == os.path.join(ckroot, "step_2")
    pm, opt = _parallel({"dp": 1})
    with pytest.raises(ck.CheckpointError, match="corrupted"):
        api.load(pm, cases["corrupted"], optimizer=opt)
    info = api.load(pm, os.path.join(ckroot, "step_2"), optimizer=opt)
    assert info["step"] == 2
    # saving over an existing checkpoint needs overwrite=True and swaps it whole
    with pytest.raises(ValueError, match="overwrite=True"):
        api.save(pm, os.path.join(ckroot, "step_2"), optimizer=opt, step=2)
    _train(pm, opt, range(2, 3))
    api.save(pm, os.path.join(ckroot, "step_2"), optimizer=opt, step=3, overwrite=True)
    assert api.load(pm, os.path.join(ckroot, "step_2"), optimizer=opt)["step"] == 3
    assert not [n for n in os.listdir(ckroot) if n.startswith(".step_2")]
    # a save interrupted before its rename leaves only a hidden temporary directory
    os.makedirs(os.path.join(ckroot, ".step_5.tmp-abc"))
    assert api.latest_checkpoint(ckroot, verify="full") == os.path.join(ckroot, "step_2")


def test_export_loads_into_the_original_model_and_import_reads_only_local_rows(runs, tmp_path):
    root, two, four = runs
    from safetensors.torch import load_file

    # export from a checkpoint (one process) and from the live pipeline model (collective)
    for src in (f"{root}/pp/step_3", None):
        out = str(tmp_path / "m.safetensors")
        model = _spec().build()
        if src is not None:
            api.export_state_dict(src, out, like=model)
            full = _full([r["pp"] for r in four])
        else:
            out = f"{root}/export_live.safetensors"
            full = _full([r["pp"]["final"] for r in four])
        sd = load_file(out)
        if src is None:
            # without `like`, the captured graph's buffers come along: GPT's RoPE tables, which
            # the original model keeps non-persistent
            assert set(sd) - set(model.state_dict()) == {"rope_cos", "rope_sin"}
            sd = {k: v for k, v in sd.items() if not k.startswith("rope_")}
        model.load_state_dict(sd)  # strict
        for n, p in model.named_parameters(remove_duplicate=False):
            assert torch.equal(p.detach(), _value(full, n)), n
    # the dp=2 ZeRO-3 run started from a safetensors file: values equal, each rank read its rows
    ref = load_file(f"{root}/init.safetensors")
    full = _full([r["imported"] for r in two])
    for n, v in ref.items():
        if n in full:
            assert torch.equal(full[n]["value"], v), n
    assert {"tok_emb.weight", "layers.0.attn.wq.weight"} <= set(full)
    total = sum(v.numel() for n, v in ref.items() if n != "lm_head.weight")  # tied to tok_emb.weight
    for r in two:  # each rank read exactly the rows it keeps, half the model
        assert r["read"] == r["local"] and r["read"] <= total // 2 + 64, (r["read"], r["local"], total)
    assert sum(r["read"] for r in two) == total
    # a transformers checkpoint directory into tp=2, each rank reading its pieces only
    hf = load_file(f"{root}/hf/model.safetensors")
    per = [r["hf"] for r in two]
    assert per[0]["sharded"] >= 8 and per[0]["names"] == len(hf)
    full = _full(per)
    assert set(full) == set(hf)
    for n, v in hf.items():
        assert torch.equal(full[n]["value"], v), n
    for r in per:
        assert r["read"] == r["local"] < sum(v.numel() for v in hf.values()), (r["read"], r["local"])
