"""Capture gives an ATen graph equal to eager on every reference model, annotated nodes,
opaque leaves that still train, and errors that name the module and suggest leaf_modules."""
import os
import resource

import pytest
import torch
import torch.nn as nn

import autopar
from autopar.models import get
from autopar.passes import ir


@pytest.mark.parametrize("name", ["gpt-tiny", "gpt-tiny-tied", "moe-tiny", "moe-tiny-capacity", "mlp-tiny", "vit-tiny"])
def test_capture_of_each_tiny_reference_model_equals_eager_and_is_annotated(name):
    spec = get(name)
    torch.manual_seed(0)
    model = spec.build()
    inputs, _ = spec.example_batch(4, generator=torch.Generator().manual_seed(0))
    gm = autopar.capture(model, inputs)
    assert gm.meta["autopar_capture"]["path"] == "export"
    out = model(*inputs)
    got = torch.utils._pytree.tree_unflatten(list(gm(*inputs)), gm.meta["autopar_out_spec"])
    torch.testing.assert_close(got, out)
    # a different batch size runs on the same graph (dynamic batch dim)
    inputs2, _ = spec.example_batch(2, generator=torch.Generator().manual_seed(1))
    got2 = torch.utils._pytree.tree_unflatten(list(gm(*inputs2)), gm.meta["autopar_out_spec"])
    torch.testing.assert_close(got2, model(*inputs2))
    params = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    seen = set()
    for n in gm.graph.nodes:
        i = ir.info(n)
        if i.kind == "param":
            seen.add(i.param)
        if n.op == "call_function" and i.shape is not None:
            assert i.dtype is not None
    assert seen <= params and len(seen) >= len(set(model.parameters()))
    linears = [n for n in gm.graph.nodes if n.target is torch.ops.aten.linear.default]
    assert linears and all(ir.info(n).module for n in linears)


def test_gpt_nodes_keep_module_paths_and_high_level_ops():
    spec = get("gpt-tiny")
    model = spec.build()
    inputs, _ = spec.example_batch(2)
    gm = autopar.capture(model, inputs)
    targets = {n.target for n in gm.graph.nodes if n.op == "call_function"}
    for op in (torch.ops.aten.rms_norm.default, torch.ops.aten.scaled_dot_product_attention.default,
               torch.ops.aten.embedding.default, torch.ops.aten.silu.default):
        assert op in targets
    wq = [n for n in gm.graph.nodes if n.op == "get_attr" and n.target == "layers.1.attn.wq.weight"][0]
    use = next(iter(wq.users))
    assert ir.info(use).module == "layers.1.attn.wq"


class _DataDependent(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        if x.sum() > 0:  # data-dependent branch: no tracer can keep it
            return self.lin(x)
        return -self.lin(x)


class _Host(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 8)
        self.block = _DataDependent()
        self.out = nn.Linear(8, 4)

    def forward(self, x):
        return self.out(self.block(torch.relu(self.inp(x))))


def test_untraceable_module_error_names_the_module_and_suggests_leaf_modules():
    with pytest.raises(autopar.CaptureError) as e:
        autopar.capture(_Host(), (torch.randn(4, 8),))
    msg = str(e.value)
    assert "'block'" in msg and "leaf_modules=['block']" in msg and "x.sum() > 0" in msg


_USER_MODEL = """
import torch.nn as nn


class Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        if x.sum() > 0:
            return self.lin(x)
        return x


class Host(nn.Module):
    def __init__(self):
        super().__init__()
        self.pre = nn.Linear(8, 8)
        self.block = Branchy()

    def forward(self, x):
        return self.block(self.pre(x))
"""


def test_user_code_inside_a_folder_named_autopar_is_still_named_in_the_error(tmp_path, monkeypatch):
    # a clone of this repository is a folder named autopar: the user's frames must not be taken
    # for the toolkit's just because their path contains "/autopar/" or "/passes/"
    folder = tmp_path / "autopar" / "passes"
    folder.mkdir(parents=True)
    (folder / "user_model_in_autopar_dir.py").write_text(_USER_MODEL)
    monkeypatch.syspath_prepend(str(folder))
    import user_model_in_autopar_dir as um

    from autopar.capture import is_library_file

    assert not is_library_file(um.__file__)
    assert is_library_file(autopar.capture.__code__.co_filename) and is_library_file(torch.__file__)
    with pytest.raises(autopar.CaptureError) as e:
        autopar.capture(um.Host(), (torch.randn(4, 8),))
    msg = str(e.value)
    assert "'block'" in msg and "leaf_modules=['block']" in msg and "x.sum() > 0" in msg
    assert "user_model_in_autopar_dir.py" in msg


def test_leaf_module_becomes_one_opaque_node_that_still_trains():
    torch.manual_seed(0)
    m = _Host()
    x = torch.randn(4, 8)
    gm = autopar.capture(m, (x,), leaf_modules=["block"])
    leaves = [n for n in gm.graph.nodes if n.target is torch.ops.autopar.leaf.default]
    assert len(leaves) == 1
    torch.testing.assert_close(gm(x)[0], m(x))
    gm(x)[0].square().sum().backward()
    m(x).square().sum().backward()
    got = dict(gm.named_parameters())
    for name, p in m.named_parameters():
        torch.testing.assert_close(got[name].grad, p.grad, msg=name)


def test_unknown_leaf_module_is_a_clear_error():
    with pytest.raises(ValueError, match="not submodules"):
        autopar.capture(_Host(), (torch.randn(4, 8),), leaf_modules=["nope"])


def test_transformers_gpt2_and_llama_capture_equal_eager():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=100,
                                                                n_positions=32, use_cache=False)).eval()
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, use_cache=False)).eval()
    ids = torch.randint(0, 100, (2, 16))
    for model in (gpt2, llama):
        gm = autopar.capture(model, (ids,))
        out = torch.utils._pytree.tree_unflatten(list(gm(ids)), gm.meta["autopar_out_spec"])
        torch.testing.assert_close(out["logits"], model(ids).logits)


@pytest.mark.skipif(os.environ.get("AUTOPAR_SLOW_TESTS") != "1", reason="70B meta capture takes ~20 s; "
                    "run with AUTOPAR_SLOW_TESTS=1 (benchmarks/bench_capture.py prints the figures)")
def test_llama3_70b_captures_on_meta_in_under_1gb():
    spec = get("llama3-70b")
    with torch.device("meta"):
        model = spec.build()
    inputs, _ = spec.example_batch(1, seq_len=128, device="meta")
    gm = autopar.capture(model, inputs)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss < 2**20  # KiB -> < 1 GiB
    assert sum(1 for n in gm.graph.nodes if n.target is torch.ops.aten.linear.default) == 80 * 7 + 1


def test_transformers_default_use_cache_is_switched_off_for_capture_and_restored():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    m = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1))
    assert m.config.use_cache is True  # the default a user gets
    x = torch.randint(0, 64, (2, 8))
    gm = autopar.capture(m, (x,))
    assert gm.meta["autopar_capture"]["adjusted"] == ["config.use_cache=False (a KV cache is for generation)"]
    assert m.config.use_cache is True
    torch.testing.assert_close(gm(x)[0], m(x, use_cache=False).logits, atol=1e-6, rtol=0)
