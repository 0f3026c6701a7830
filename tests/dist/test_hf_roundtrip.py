"""Hugging Face checkpoints in and out at real-size semantics, on small models the test builds:
a transformers Llama and a Qwen3-MoE are saved by transformers' own `save_pretrained`; each of
4 gloo ranks builds the model on the meta device and `parallelize(..., weights=DIR)` reads
only its slices under ZeRO-3, dp x tp, pp x dp and dp x ep; three AdamW steps; then
`autopar.save_pretrained` writes the result and plain transformers loads it: its logits equal
those of one process trained the same way.

The Llama cells run in fp64 (checkpoint, training, saved checkpoint), where sharding leaves
nothing but the order of additions: losses and logits within 1e-9. In fp32 that order alone is
as far off as the parallel run: one process with the batch split in 2 (dp=2), every Linear's
contraction summed in 2 halves (tp=2), or in fp64, moves the eval logits by 1.2e-5, 8.2e-5 and
6.8e-5 after the three steps (AdamW lr 1e-2 turns last-bit gradient differences into lr-sized
steps), and dp2 x tp2 missed the old fp32 bound (1e-4) by a hair (1.35e-4). Qwen3-MoE stays
fp32 (transformers' grouped experts call torch._grouped_mm, which takes no fp64): logits 1e-4
absolute and relative, losses 1e-5 absolute."""
import os

import pytest
import torch
import torch.nn.functional as F

import autopar
from harness import capture_before_fork, world

transformers = pytest.importorskip("transformers")

BATCH, SEQ, STEPS, VOCAB = 8, 16, 3, 128
DTYPE = {"llama": torch.float64, "qwen3-moe": torch.float32}
TOL = {torch.float64: {"loss": dict(rtol=0, atol=1e-9), "logits": dict(rtol=1e-9, atol=1e-9)},
       torch.float32: {"loss": dict(rtol=0, atol=1e-5), "logits": dict(rtol=1e-4, atol=1e-4)}}
CELLS = [  # (architecture, mesh, parallelize options)
    ("llama", {"dp": 4}, {"zero_stage": 3}),
    ("llama", {"dp": 2, "tp": 2}, {"hardware": "h100-sxm"}),
    ("llama", {"pp": 2, "dp": 2}, {"n_microbatches": 2, "pins": {"schedule": "1f1b"}}),
    ("qwen3-moe", {"dp": 2, "ep": 2}, {}),
]


def _config(arch):
    common = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  vocab_size=VOCAB, use_cache=False, attention_dropout=0.0)
    if arch == "llama":
        return transformers.LlamaConfig(intermediate_size=128, **common)
    return transformers.Qwen3MoeConfig(intermediate_size=128, moe_intermediate_size=32, num_experts=4,
                                       num_experts_per_tok=2, norm_topk_prob=True, **common)


def _build(arch):
    cls = transformers.LlamaForCausalLM if arch == "llama" else transformers.Qwen3MoeForCausalLM
    return cls(_config(arch)).to(DTYPE[arch])


def _logits(out):
    return out.logits if hasattr(out, "logits") else out[0]


def _loss(out, y):
    return F.cross_entropy(_logits(out).flatten(0, 1), y.flatten())


def _batches():
    g = torch.Generator().manual_seed(7)
    toks = [torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g) for _ in range(STEPS + 1)]
    return [(t[:, :-1].contiguous(), t[:, 1:].contiguous()) for t in toks]


def _reference(arch, src):
    model = transformers.AutoModelForCausalLM.from_pretrained(src)
    assert all(p.dtype == DTYPE[arch] for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    *train, (x_eval, _) = _batches()
    losses = []
    for x, y in train:
        loss = _loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    with torch.no_grad():
        return losses, _logits(model(x_eval))


def _cells(rank, ws, sources, out_root):
    results = []
    for i, (arch, mesh_kw, opts) in enumerate(CELLS):
        *train, (x_eval, _) = _batches()
        with torch.device("meta"):
            model = _build(arch)
        pm = autopar.parallelize(model, autopar.mesh(**mesh_kw), example_inputs=(train[0][0],),
                                 weights=sources[arch], **opts)
        assert not any(t.is_meta for t in pm.program.parameters())
        assert all(t.dtype == DTYPE[arch] for t in pm.program.parameters())
        opt = autopar.optimizer(pm, torch.optim.AdamW, lr=1e-2)
        losses = []
        for x, y in train:
            losses.append(pm.step((x, y), _loss).item())
            opt.step()
            opt.zero_grad()
        out = os.path.join(out_root, f"cell{i}")
        autopar.save_pretrained(pm, out)
        logits = None
        if rank == 0:
            files = sorted(os.listdir(out))
            assert "config.json" in files and any(f.endswith(".safetensors") for f in files), files
            loaded = transformers.AutoModelForCausalLM.from_pretrained(out)
            assert all(p.dtype == DTYPE[arch] for p in loaded.parameters())
            with torch.no_grad():
                logits = _logits(loaded(x_eval))
        results.append((losses, logits))
    return results


def test_hf_checkpoint_to_meta_parallel_training_to_hf_checkpoint_matches_one_process(tmp_path):
    sources = {}
    for arch in sorted({c[0] for c in CELLS}):
        torch.manual_seed(0)
        sources[arch] = str(tmp_path / f"src-{arch}")
        _build(arch).save_pretrained(sources[arch])
    refs = {arch: _reference(arch, src) for arch, src in sources.items()}
    for arch in sources:  # captured here once (a real model and its meta twin share the capture memo's entry)
        capture_before_fork(_build(arch), (_batches()[0][0],))
    results = world(4, _cells, sources, str(tmp_path / "out"), timeout_s=900)
    for i, (arch, mesh_kw, _opts) in enumerate(CELLS):
        ref_losses, ref_logits = refs[arch]
        tol = TOL[DTYPE[arch]]
        for rank, per_rank in enumerate(results):
            losses, logits = per_rank[i]
            f64 = lambda v: torch.tensor(v, dtype=torch.float64)
            torch.testing.assert_close(f64(losses), f64(ref_losses), **tol["loss"],
                                       msg=lambda m: f"{arch} {mesh_kw} rank {rank} losses: {m}")
            if rank == 0:
                assert logits.dtype == ref_logits.dtype == DTYPE[arch]
                torch.testing.assert_close(logits, ref_logits, **tol["logits"],
                                           msg=lambda m: f"{arch} {mesh_kw} logits after save_pretrained: {m}")
