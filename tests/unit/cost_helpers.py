"""Shared pieces of the cost-model tests: the models, a capture, and the two measurements
the cost model is checked against (FlopCounterMode, saved_tensors_hooks).

Models: the reference models (autopar.models) and transformers' GPT-2, Llama, Mixtral and
BERT built from small configs with random weights (use_cache=False), all in train mode so
dropout is live where the model has it.

Capture: `torch.export.export(..., strict=False).module()` with export's `_guards_fn` call
removed: the graph `autopar.capture` produces, but with static shapes unless asked, so FLOP
totals are plain ints (test_cost_symbolic checks `autopar.capture`'s dynamic-batch graphs).
"""
from __future__ import annotations

import functools

import torch
import torch.fx as fx
from torch.utils import flop_counter
from torch.utils.flop_counter import FlopCounterMode

import autopar.models as M

REFERENCE = ["gpt-tiny", "gpt-tiny-tied", "moe-tiny", "moe-tiny-capacity", "vit-tiny", "mlp-tiny"]
HF = ["hf-gpt2", "hf-llama", "hf-mixtral", "hf-bert"]
aten = torch.ops.aten



def kv_as_query_heads(q, *kv) -> list[tuple[int, ...]]:
    """Key / value shapes with the query's head count. Grouped-query attention (fewer kv heads,
    `enable_gqa`, as transformers' Llama / Mixtral call SDPA) computes every query head against
    its group's kv head: the FLOPs of the expanded kv. torch 2.13's formulas count it so
    themselves; torch 2.11's assert equal head counts ("sdpa_flop_count: query/key/value shapes
    are incompatible")."""
    return [(s[0], q[1], *s[2:]) for s in kv]


# FlopCounterMode has no entry for the CPU flash-attention kernels; count them with torch's own
# flash formulas (the ones it applies to the CUDA kernels), on the shapes the kernel received.
CPU_FLASH = {
    aten._scaled_dot_product_flash_attention_for_cpu:
        lambda q, k, v, *a, out_shape=None, **kw: flop_counter.sdpa_flop_count(q, *kv_as_query_heads(q, k, v)),
    aten._scaled_dot_product_flash_attention_for_cpu_backward:
        lambda g, q, k, v, *a, out_shape=None, **kw: flop_counter.sdpa_backward_flop_count(
            g, q, *kv_as_query_heads(q, k, v)),
}  # fmt: skip


def hf_model(name: str, experts: str | None = None) -> torch.nn.Module:
    import transformers as T

    common = dict(use_cache=False)
    if name == "hf-gpt2":
        cfg = T.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=64, bos_token_id=0,
                           eos_token_id=0, **common)
        return T.GPT2LMHeadModel(cfg)
    if name == "hf-llama":
        cfg = T.LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                            num_key_value_heads=2, vocab_size=128, **common)
        return T.LlamaForCausalLM(cfg)
    if name == "hf-mixtral":
        cfg = T.MixtralConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                              num_key_value_heads=2, vocab_size=128, num_local_experts=4, num_experts_per_tok=2,
                              **common)
        if experts is not None:
            cfg._experts_implementation = experts
        return T.MixtralForCausalLM(cfg)
    if name == "hf-bert":
        cfg = T.BertConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                           vocab_size=128)
        return T.BertForMaskedLM(cfg)
    raise ValueError(name)


def build(name: str, batch: int = 2, seq: int | None = None, dtype: torch.dtype = torch.float32, **kw):
    """(model in train mode, example args), deterministic."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    if name in M.names():
        spec = M.get(name)
        model = spec.build()
        kwargs = {"seq_len": seq} if seq is not None else {}
        (x,), _ = spec.example_batch(batch, generator=g, **kwargs)
    else:
        model = hf_model(name, **kw)
        x = torch.randint(0, 128, (batch, seq or 16), generator=g)
    model.train()
    model.to(dtype)
    if x.is_floating_point():
        x = x.to(dtype)
    return model, (x,)


def capture(model: torch.nn.Module, args, dynamic_shapes=None) -> fx.GraphModule:
    ep = torch.export.export(model, args, strict=False, dynamic_shapes=dynamic_shapes)
    gm = ep.module()
    for n in list(gm.graph.nodes):
        if n.op == "call_module" and n.target == "_guards_fn":
            gm.graph.erase_node(n)
    gm.recompile()
    return gm


@functools.lru_cache(maxsize=None)
def captured(name: str, dtype: torch.dtype = torch.float32):
    """(model, args, graph) for a model name, cached for the test session."""
    model, args = build(name, dtype=dtype)
    return model, args, capture(model, args)


def float_outputs(out) -> list[torch.Tensor]:
    if hasattr(out, "logits"):
        return [out.logits]
    if isinstance(out, (tuple, list)):
        return [t for t in out if isinstance(t, torch.Tensor) and t.is_floating_point()]
    return [out]


def measure_flops(model, args) -> tuple[dict[str, int], dict[str, int]]:
    """FlopCounterMode counts per module ('Global', 'GPT.layers.0' ...) of one forward, and
    of one backward (of the sum of the outputs). The backward is counted in the same mode as
    a second forward so that FlopCounterMode can attribute it to modules; it is the
    difference of the two."""
    with FlopCounterMode(display=False, custom_mapping=CPU_FLASH) as fwd:
        float_outputs(model(*args))
    with FlopCounterMode(display=False, custom_mapping=CPU_FLASH) as both:
        outs = float_outputs(model(*args))
        sum(o.float().sum() for o in outs).backward()
    model.zero_grad(set_to_none=True)
    f = {k: sum(v.values()) for k, v in fwd.get_flop_counts().items()}
    fb = {k: sum(v.values()) for k, v in both.get_flop_counts().items()}
    by_op = {str(op): n for op, n in fwd.get_flop_counts()["Global"].items()}
    f["ops"] = by_op  # type: ignore[assignment]
    return f, {k: fb[k] - f.get(k, 0) for k in fb}


def measure_saved_bytes(model, args) -> int:
    """Bytes of the distinct storages autograd saves during a forward (saved_tensors_hooks,
    deduplicated by storage pointer), parameters and buffers excluded; then runs backward."""
    state = {t.untyped_storage().data_ptr() for t in list(model.parameters()) + list(model.buffers())}
    storages: dict[int, int] = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in state:
            storages[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        outs = float_outputs(model(*args))
    sum(o.float().sum() for o in outs).backward()
    model.zero_grad(set_to_none=True)
    return sum(storages.values())
