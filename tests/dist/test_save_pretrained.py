"""`autopar.build.save_pretrained`: a parallelised model written back as a Hugging Face
checkpoint, on one gloo world of 2 ranks that runs every plan and every check in turn.

* Parity: a tiny transformers LlamaForCausalLM trains one AdamW step under dp=2 ZeRO-3 (tied
  embeddings, one file), tp=2 (several files + index) and pp=2 (tied: each stage holds the
  tied weight under one name, `lm_head.weight`; about one tensor a file); each saved directory loads
  with `AutoModelForCausalLM.from_pretrained`, its logits equal (atol=rtol=0: same weights,
  same code) to those of the original model class loaded with `export_state_dict`'s weights
  (an independent path: the whole state dict at once), and `safetensors.torch.load_file`
  reads every file with the original names and dtypes: of tied names only
  `model.embed_tokens.weight`, no RoPE buffer (non-persistent). Before training, the
  ZeRO-3 save also equals the original nn.Module's own weights.
* Streaming: rank 0 reads the staged checkpoint one full tensor at a time, each read released
  before the next one (checked with weak references).
* Atomicity: a second save replaces the directory; a save that fails with ENOSPC half-way
  raises OSError naming the directory on both ranks and leaves the old directory byte-for-byte
  intact and no temporary directory behind.
* dtype=bfloat16 writes bf16 floating tensors and records it in config.json.
* WeightSource reads slices of an `autopar.save` checkpoint written by two ranks (ZeRO-3
  rows), across the rows' boundary, equal to the full tensors.
"""
from __future__ import annotations

import errno
import hashlib
import json
import os
import weakref

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import autopar
from autopar import checkpoint_api as api
from autopar.build import save_pretrained as sp
from autopar.build.weights import DcpTensors, WeightSource
from harness import world

H100 = {"hardware": "h100-sxm"}  # gloo's profile would (rightly) replicate a tiny model at tp=2
IDS = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(0))
LABELS = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(1))


def _config(tied: bool):
    import transformers

    return transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                    use_cache=False, tie_word_embeddings=tied)


def _llama(tied: bool, seed: int = 0):
    import transformers

    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(_config(tied))


def _loss(out, labels):
    return F.cross_entropy(out["logits"].flatten(0, 1), labels.flatten())


def _digest(path: str) -> dict[str, str]:
    return {f: hashlib.sha256(open(os.path.join(path, f), "rb").read()).hexdigest() for f in sorted(os.listdir(path))}


class _ReadLog:
    """Wraps DcpTensors.read on rank 0: what was read, and how many earlier reads were still
    alive when each read began."""

    def __init__(self):
        self.reads, self.alive_before, self._refs = [], [], []

    def install(self, monkey):
        orig = DcpTensors.read
        log = self

        def read(src, name, offset, shape, dtype=None):
            log.alive_before.append(sum(r() is not None for r in log._refs))
            t = orig(src, name, offset, shape, dtype)
            log.reads.append((name, tuple(offset), tuple(shape), tuple(src.tensors[name].size)))
            log._refs.append(weakref.ref(t))
            return t

        monkey.append((DcpTensors, "read", orig))
        DcpTensors.read = read


RUNS = [  # name, mesh, parallelize options, tied, save_pretrained options
    ("dp2_zero3", {"dp": 2}, {"zero_stage": 3}, True, {}),
    ("tp2", {"tp": 2}, H100, False, {"max_shard_size": "150KB"}),
    ("pp2", {"pp": 2}, {}, True, {"max_shard_size": 4096}),
]


def _run(rank, ws, root):
    out = {}
    for name, mesh_kw, opts, tied, save_kw in RUNS:
        model = _llama(tied)
        original = {k: v.detach().clone() for k, v in model.state_dict().items()}
        pm = autopar.parallelize(model, autopar.mesh(**mesh_kw), example_inputs=(IDS,), **opts)
        r = {"sharded": sum(1 for lay in pm.plan.param_layouts.values() if not lay.is_replicated()),
             "mesh": dict(pm.mesh.sizes), "zero": pm.plan.zero_stage}
        target = f"{root}/{name}"
        if name == "dp2_zero3":  # before training: the original weights, and the read log
            monkey: list = []
            log = _ReadLog()
            if rank == 0:
                log.install(monkey)
            try:
                sp.save_pretrained(pm, target, config=model.config, like=model)
            finally:
                for cls, attr, orig in monkey:
                    setattr(cls, attr, orig)
            r["reads"], r["alive_before"] = log.reads, log.alive_before
            if rank == 0:
                r["untrained"] = {f: _load(os.path.join(target, f)) for f in os.listdir(target)
                                  if f.endswith(".safetensors")}
                r["original"] = original
        opt = autopar.optimizer(pm, torch.optim.AdamW, lr=1e-2)
        pm.step(((IDS,), LABELS), _loss)
        opt.step()
        r["files"] = sp.save_pretrained(pm, target, config=model.config, like=model, **save_kw)
        r["exported"] = api.export_state_dict(pm, like=model)
        if name == "dp2_zero3":
            _atomicity(rank, pm, model, target, r)
            autopar.save(pm, f"{root}/dcp_z3")
            r["bf16"] = sp.save_pretrained(pm, f"{root}/bf16", config=model.config.to_dict(), like=model,
                                           dtype=torch.bfloat16)
        out[name] = r
        dist.barrier()
    return out if rank == 0 else {"enospc": out["dp2_zero3"]["enospc"]}


def _load(path):
    from safetensors.torch import load_file

    return load_file(path)


def _atomicity(rank, pm, model, target, r):
    with open(os.path.join(target, "marker"), "w") as f:  # the replacing save removes it
        f.write("old")
    sp.save_pretrained(pm, target, config=model.config, like=model)
    r["marker_after_replace"] = os.path.exists(os.path.join(target, "marker"))
    before = _digest(target)
    orig = sp.write_safetensors
    calls = []

    def full_disk(path, specs, read, metadata=None):
        calls.append(path)
        if len(calls) == 2:  # the second file: write a little, then the disk is full
            with open(path, "wb") as f:
                f.write(b"partial")
            raise OSError(errno.ENOSPC, "No space left on device")
        return orig(path, specs, read, metadata)

    sp.write_safetensors = full_disk
    try:
        sp.save_pretrained(pm, target, config=model.config, like=model, max_shard_size="100KB")
        r["enospc"] = None
    except OSError as e:
        r["enospc"] = (e.errno, str(e), e.filename)
    finally:
        sp.write_safetensors = orig
    r["digest_kept"] = _digest(target) == before
    r["leftovers"] = sorted(f for f in os.listdir(os.path.dirname(target)) if f.startswith("."))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("save_pretrained"))
    res = world(2, _run, root)
    return root, {**res[0], "rank1": res[1]}


def _hf_names(tied: bool) -> list[str]:
    names = [n for n in _llama(tied).state_dict()]
    return [n for n in names if not (tied and n == "lm_head.weight")]


def _files_state(files: list[str]) -> dict[str, torch.Tensor]:
    sd = {}
    for f in files:
        if f.endswith(".safetensors"):
            part = _load(f)
            assert not set(part) & set(sd), f"{f} repeats {set(part) & set(sd)}"
            sd.update(part)
    return sd


@pytest.mark.parametrize("name", [r[0] for r in RUNS])
def test_save_pretrained_loads_in_transformers_with_the_exported_weights_logits(runs, name):
    import transformers

    root, res = runs
    r, tied = res[name], dict((x[0], x[3]) for x in RUNS)[name]
    want_mesh = dict(next(x[1] for x in RUNS if x[0] == name))
    assert {k: v for k, v in r["mesh"].items() if v > 1} == want_mesh
    if name == "tp2":
        assert r["sharded"] >= 8, "the tp=2 plan shards nothing: the test would not test tp"
    if name == "dp2_zero3":
        assert r["zero"] == 3
    target = os.path.join(root, name)
    assert sorted(r["files"]) == sorted(os.path.join(target, f) for f in os.listdir(target))
    shards = [f for f in r["files"] if f.endswith(".safetensors")]
    if name == "dp2_zero3":
        assert [os.path.basename(f) for f in shards] == ["model.safetensors"]
    else:
        assert len(shards) > 1 and os.path.basename(shards[0]) == f"model-00001-of-{len(shards):05d}.safetensors"
        index = json.load(open(os.path.join(target, "model.safetensors.index.json")))
        assert set(index["weight_map"]) == set(_hf_names(tied))
        assert {os.path.join(target, f) for f in index["weight_map"].values()} == set(shards)
    sd = _files_state(r["files"])
    assert set(sd) == set(_hf_names(tied))
    for n, v in sd.items():
        assert v.dtype == torch.float32, n
        assert torch.equal(v, r["exported"][n]), n
    ref = transformers.LlamaForCausalLM(_config(tied))
    ref.load_state_dict(r["exported"])  # strict: every name of the original model
    got = transformers.AutoModelForCausalLM.from_pretrained(target)
    assert type(got) is transformers.LlamaForCausalLM
    with torch.no_grad():
        torch.testing.assert_close(got(IDS).logits, ref(IDS).logits, rtol=0, atol=0)
    if tied:
        assert got.lm_head.weight.data_ptr() == got.model.embed_tokens.weight.data_ptr()


def test_untrained_zero3_save_equals_the_original_weights_read_one_tensor_at_a_time(runs):
    _root, res = runs
    r = res["dp2_zero3"]
    sd = {k: v for part in r["untrained"].values() for k, v in part.items()}
    assert set(sd) == set(_hf_names(True))
    for n, v in sd.items():
        assert torch.equal(v, r["original"][n]), n
    # one full tensor per read, each name once, no earlier read alive when the next begins
    assert sorted(name for name, *_ in r["reads"]) == sorted(sd)
    for name, offset, shape, full in r["reads"]:
        assert offset == (0,) * len(full) and shape == full, name
    assert r["alive_before"] == [0] * len(r["reads"])


def test_a_save_replaces_the_directory_and_a_failed_save_leaves_the_old_one_intact(runs):
    root, res = runs
    r = res["dp2_zero3"]
    assert r["marker_after_replace"] is False
    assert r["enospc"] and res["rank1"]["enospc"], "the save that ran out of space did not raise"
    for code, msg, filename in (r["enospc"], res["rank1"]["enospc"]):  # rank 0 failed; both ranks raise
        assert code == errno.ENOSPC and filename == os.path.join(root, "dp2_zero3") and "untouched" in msg
    assert r["digest_kept"]
    assert r["leftovers"] == []


def test_bfloat16_save_writes_bf16_and_records_it_in_the_config(runs):
    import transformers

    root, res = runs
    r = res["dp2_zero3"]
    sd = _files_state(r["bf16"])
    assert set(sd) == set(_hf_names(True))
    for n, v in sd.items():
        assert v.dtype == torch.bfloat16 and torch.equal(v, r["exported"][n].to(torch.bfloat16)), n
    cfg = json.load(open(os.path.join(root, "bf16", "config.json")))
    assert cfg["dtype"] == "bfloat16" and cfg["model_type"] == "llama"
    got = transformers.AutoModelForCausalLM.from_pretrained(os.path.join(root, "bf16"), dtype=torch.float32)
    torch.testing.assert_close(got.model.embed_tokens.weight.detach(),
                               r["exported"]["model.embed_tokens.weight"].to(torch.bfloat16).float(), rtol=0, atol=0)


def test_weight_source_reads_slices_across_zero3_rows_of_a_two_rank_checkpoint(runs):
    root, res = runs
    ref = res["dp2_zero3"]["exported"]
    src = WeightSource(os.path.join(root, "dcp_z3"))
    assert src.kind == "dcp" and set(ref) <= set(src.names())
    name = "model.embed_tokens.weight"  # (128, 64): rows 0-63 on rank 0, 64-127 on rank 1
    piece = src.read(name, (60, 5), (8, 10), dtype=torch.float64)
    assert piece.dtype == torch.float64 and torch.equal(piece, ref[name][60:68, 5:15].double())
    for n in ref:
        assert torch.equal(src.read(n, (0,) * ref[n].dim(), tuple(ref[n].shape)), ref[n]), n
