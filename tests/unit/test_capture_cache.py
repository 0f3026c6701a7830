"""The capture memo (autopar/capture_cache.py): a second capture of the same structure reuses
the graph, bound to the second model's own tensors; anything the graph may depend on misses."""
import dataclasses
import functools

import torch
import torch.nn as nn
import torch.nn.functional as F

import autopar
from autopar import capture_cache
from autopar.capture import capture


class Net(nn.Module):
    def __init__(self, clamp=False, tie=False):
        super().__init__()
        self.emb = nn.Embedding(32, 16)
        self.fc = nn.Linear(16, 16)
        self.head = nn.Linear(16, 32, bias=False)
        if tie:
            self.head.weight = self.emb.weight
        self.register_buffer("scale", torch.full((16,), 0.5))
        self.clamp = clamp

    def forward(self, ids):
        h = F.gelu(self.fc(self.emb(ids))) * self.scale
        if self.clamp:
            h = h.clamp(-0.1, 0.1)
        return self.head(h)


def _ids(b=4, s=8):
    return torch.randint(0, 32, (b, s), generator=torch.Generator().manual_seed(0))


def _fresh(seed=0, **kw):
    torch.manual_seed(seed)
    return Net(**kw)


def test_second_capture_is_a_hit_bound_to_the_second_models_tensors():
    capture_cache.clear()
    ids = _ids()
    g1 = autopar.capture(_fresh(0), (ids,))
    assert not g1.meta["autopar_capture"].get("cached")
    m2 = _fresh(1)  # other values, same structure
    g2 = autopar.capture(m2, (ids,))
    assert g2.meta["autopar_capture"]["cached"] is True
    assert g2.code == g1.code
    own = dict(m2.named_parameters())
    for name, p in g2.named_parameters():
        assert p is own[name], name
    assert dict(g2.named_buffers())["scale"] is m2.scale
    (out,) = g2(ids)
    torch.testing.assert_close(out, m2(ids), rtol=0, atol=0)
    # the annotations came along: parameters are parameters, the buffer a buffer
    kinds = {n.target: autopar.passes.ir.info(n).kind for n in g2.graph.nodes if n.op == "get_attr"}
    assert kinds["scale"] == "buffer" and kinds["fc.weight"] == "param"


def test_a_meta_twin_traced_for_the_cpu_reuses_the_real_capture_and_keeps_its_meta_tensors():
    capture_cache.clear()
    ids = _ids()
    g1 = autopar.capture(_fresh(), (ids,))
    with torch.device("meta"):
        meta = Net()
    g2 = autopar.capture(meta, (ids,), device="cpu")
    assert g2.meta["autopar_capture"]["cached"] is True
    assert g2.code == g1.code
    assert all(t.is_meta for t in g2.parameters())
    assert dict(g2.named_parameters())["fc.weight"] is meta.fc.weight


def test_what_the_graph_depends_on_misses():
    capture_cache.clear()
    ids = _ids()
    autopar.capture(_fresh(), (ids,))
    assert not autopar.capture(_fresh(clamp=True), (ids,)).meta["autopar_capture"].get("cached")
    # the clamp variant was stored on its own and now hits
    assert autopar.capture(_fresh(clamp=True), (ids,)).meta["autopar_capture"]["cached"] is True
    cases = {
        "tied weights": (_fresh(tie=True), (ids,)),
        "input shape": (_fresh(), (_ids(4, 6),)),
        "eval mode": (_fresh().eval(), (ids,)),
    }
    for what, (model, args) in cases.items():
        g = autopar.capture(model, args)
        assert not g.meta["autopar_capture"].get("cached"), what
    hooked = _fresh()
    hooked.fc.register_forward_hook(lambda m, i, o: o * 2)
    assert not autopar.capture(hooked, (ids,)).meta["autopar_capture"].get("cached")


class _Apply(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x)


_NEG = lambda x: -x  # noqa: E731 - two module-level lambdas: one name, "<lambda>", two functions
_TWICE = lambda x: 2 * x  # noqa: E731


def test_functions_held_by_a_module_are_keyed_by_identity():
    capture_cache.clear()
    x = torch.randn(3, 4)
    assert "neg" in autopar.capture(_Apply(_NEG), (x,)).code
    g = autopar.capture(_Apply(_TWICE), (x,))
    assert not g.meta["autopar_capture"].get("cached") and "mul" in g.code
    assert autopar.capture(_Apply(_TWICE), (x,)).meta["autopar_capture"]["cached"] is True
    act = autopar.capture(_Apply(F.gelu), (x,))  # one function object in every instance: shared
    assert autopar.capture(_Apply(F.gelu), (x,)).meta["autopar_capture"]["cached"] is True and "gelu" in act.code


def test_rewriting_a_returned_graph_leaves_the_stored_one_untouched():
    capture_cache.clear()
    ids = _ids()
    g1 = autopar.capture(_fresh(), (ids,))
    code = g1.code
    for n in list(g1.graph.nodes):  # a pass rewriting the graph it was given
        if n.op == "call_function" and "gelu" in str(n.target):
            n.meta["val"] = None
            n.target = torch.ops.aten.relu.default
            n.args = n.args[:1]
    g1.recompile()
    assert g1.code != code
    g2 = autopar.capture(_fresh(), (ids,))
    assert g2.meta["autopar_capture"]["cached"] is True
    assert g2.code == code
    assert all(n.meta.get("val") is not None for n in g2.graph.nodes if n.op == "call_function")


def test_off_switch_and_bound(monkeypatch):
    capture_cache.clear()
    ids = _ids()
    monkeypatch.setenv("AUTOPAR_CAPTURE_CACHE", "0")
    autopar.capture(_fresh(), (ids,))
    assert not autopar.capture(_fresh(), (ids,)).meta["autopar_capture"].get("cached")
    monkeypatch.delenv("AUTOPAR_CAPTURE_CACHE")
    monkeypatch.setattr(capture_cache, "MAX_ENTRIES", 4)  # the bound at work, in 6 captures rather than 18
    for b in range(1, capture_cache.MAX_ENTRIES + 2):
        autopar.capture(_fresh(), (_ids(b, 8),))
    assert len(capture_cache._MEMO) == capture_cache.MAX_ENTRIES
    # the oldest (batch 1) was dropped, the newest is kept
    assert not autopar.capture(_fresh(), (_ids(1, 8),)).meta["autopar_capture"].get("cached")
    assert autopar.capture(_fresh(), (_ids(capture_cache.MAX_ENTRIES + 1, 8),)).meta["autopar_capture"]["cached"]


def test_leaf_modules_are_never_stored():
    capture_cache.clear()
    ids = _ids()
    autopar.capture(_fresh(), (ids,), leaf_modules=["fc"])
    assert not capture_cache._MEMO


def test_a_transformers_config_differing_only_in_a_private_field_misses():
    """transformers keeps the attention implementation outside to_dict(): eager attention
    captured after sdpa must not reuse the sdpa graph."""
    import pytest

    transformers = pytest.importorskip("transformers")
    capture_cache.clear()
    cfg = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=32, use_cache=False)
    ids = torch.randint(0, 64, (2, 8))
    torch.manual_seed(0)
    sdpa = transformers.LlamaForCausalLM(transformers.LlamaConfig(attn_implementation="sdpa", **cfg))
    g1 = autopar.capture(sdpa, (ids,))
    torch.manual_seed(0)
    eager = transformers.LlamaForCausalLM(transformers.LlamaConfig(attn_implementation="eager", **cfg))
    g2 = autopar.capture(eager, (ids,))
    assert not g2.meta["autopar_capture"].get("cached")
    assert "scaled_dot_product_attention" in g1.code and "scaled_dot_product_attention" not in g2.code


def test_two_gpts_built_from_two_equal_config_objects_share_one_capture():
    """A dataclass config is keyed by its fields, not by identity: two `GPTConfig.tiny()` are
    two objects with equal fields, and the second model's capture is a hit bound to its own
    tensors; a config differing in one field misses."""
    import dataclasses

    from autopar.models.gpt import GPT, GPTConfig

    capture_cache.clear()
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    g1 = autopar.capture(GPT(GPTConfig.tiny()), (ids,))
    assert not g1.meta["autopar_capture"].get("cached")
    torch.manual_seed(1)
    m2 = GPT(GPTConfig.tiny())
    assert m2.config is not GPTConfig.tiny()
    g2 = autopar.capture(m2, (ids,))
    assert g2.meta["autopar_capture"]["cached"] is True and g2.code == g1.code
    own = dict(m2.named_parameters())
    assert all(p is own[name] for name, p in g2.named_parameters())
    (out,) = g2(ids)
    torch.testing.assert_close(out, m2(ids), rtol=0, atol=0)
    # eps is read by the forward but changes no shape: only the key can tell the two apart
    eps = GPT(dataclasses.replace(GPTConfig.tiny(), norm_eps=1e-3))
    g3 = autopar.capture(eps, (ids,))
    assert not g3.meta["autopar_capture"].get("cached")
    (out3,) = g3(ids)
    torch.testing.assert_close(out3, eps(ids), rtol=0, atol=0)


@dataclasses.dataclass
class _ScaleCfg:
    scale: float
    dims: list  # an unhashable field: keyed by its items


class _Scaled(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(x).sum(self.cfg.dims) * self.cfg.scale


def test_a_dataclass_config_with_an_unhashable_field_is_keyed_by_value():
    capture_cache.clear()
    x = torch.randn(2, 3, 4)
    autopar.capture(_Scaled(_ScaleCfg(2.0, [1])), (x,))
    assert autopar.capture(_Scaled(_ScaleCfg(2.0, [1])), (x,)).meta["autopar_capture"]["cached"] is True
    for what, cfg in {"another scale": _ScaleCfg(3.0, [1]), "another list": _ScaleCfg(2.0, [2])}.items():
        m = _Scaled(cfg)
        g = autopar.capture(m, (x,))
        assert not g.meta["autopar_capture"].get("cached"), what
        (out,) = g(x)
        torch.testing.assert_close(out, m(x), rtol=0, atol=0, msg=what)


def test_counts_tell_hits_from_misses():
    capture_cache.clear()
    before = capture_cache.counts()
    ids = _ids()
    autopar.capture(_fresh(), (ids,))
    autopar.capture(_fresh(), (ids,))
    after = capture_cache.counts()
    assert (after["hits"] - before["hits"], after["misses"] - before["misses"], after["entries"]) == (1, 1, 1)


# two structures the memo used to miss in every forked rank of the zoo (helper-35): hf-gemma's
# functools.partial activation and hf-falcon's tensor constant that torch.export lifts into the graph
class _Gelu(nn.Module):
    def __init__(self, approximate="tanh"):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.act = functools.partial(F.gelu, approximate=approximate)  # a new object per instance

    def forward(self, x):
        return self.act(self.lin(x))


class _Lifted(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return self.lin(x) * torch.tensor([2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0])  # a constant export lifts


def test_two_instances_with_equal_partials_share_a_capture_and_another_keyword_does_not():
    capture_cache.clear()
    x = torch.randn(4, 8)
    torch.manual_seed(0)
    capture(_Gelu(), (x,))
    before = capture_cache.counts()
    torch.manual_seed(1)
    m2 = _Gelu()
    gm = capture(m2, (x,))
    assert capture_cache.counts()["hits"] == before["hits"] + 1
    torch.testing.assert_close(gm(x)[0] if isinstance(gm(x), (tuple, list)) else gm(x), m2(x), atol=0, rtol=0)
    capture(_Gelu(approximate="none"), (x,))
    assert capture_cache.counts()["misses"] == before["misses"] + 1  # the keyword is in the key


def test_a_lifted_tensor_constant_is_kept_with_the_graph_so_a_second_instance_hits():
    capture_cache.clear()
    x = torch.randn(4, 8)
    gm1 = capture(_Lifted(), (x,))
    lifted = [n for n, _b in gm1.named_buffers() if n not in dict(_Lifted().named_buffers())]
    assert lifted, "the graph holds a constant the model does not"
    before = capture_cache.counts()
    torch.manual_seed(1)
    m2 = _Lifted()
    gm2 = capture(m2, (x,))
    assert capture_cache.counts()["hits"] == before["hits"] + 1, (lifted, capture_cache.counts())
    out = gm2(x)
    torch.testing.assert_close(out[0] if isinstance(out, (tuple, list)) else out, m2(x), atol=0, rtol=0)
