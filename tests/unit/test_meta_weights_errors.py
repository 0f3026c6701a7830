"""A weight source that does not fit a meta model is refused by `parallelize` with one clear
error naming the tensors or the file, before anything is built or trained, and nothing is
written; a model left partly on meta never reaches its first step."""
import os

import pytest
import torch
from safetensors.torch import save_file

import autopar
from autopar.models import get


def _meta_gpt():
    with torch.device("meta"):
        return get("gpt-tiny").build()


def _state():
    torch.manual_seed(0)
    return {k: v.detach().clone().contiguous() for k, v in get("gpt-tiny").build().state_dict().items()}


def _parallelize(weights, **kw):
    x, _ = get("gpt-tiny").example_batch(4)
    return autopar.parallelize(_meta_gpt(), autopar.mesh(dp=1, device_type="cpu"), example_inputs=x, weights=weights, **kw)


def _files(d):
    return sorted(os.listdir(d))


def test_a_missing_tensor_is_named_before_anything_runs(tmp_path):
    sd = _state()
    del sd["layers.1.ffn.w2.weight"]
    save_file(sd, tmp_path / "m.safetensors")
    before = _files(tmp_path)
    with pytest.raises(ValueError, match=r"missing 1 tensors: \['layers.1.ffn.w2.weight'\]"):
        _parallelize(str(tmp_path / "m.safetensors"))
    assert _files(tmp_path) == before


def test_a_wrong_shape_names_both_shapes(tmp_path):
    sd = _state()
    sd["norm.weight"] = torch.ones(7)
    save_file(sd, tmp_path / "m.safetensors")
    with pytest.raises(ValueError, match=r"norm.weight.*\[7\].*\[64\]"):
        _parallelize(str(tmp_path / "m.safetensors"))


def test_an_unexpected_tensor_and_an_integer_weight_are_both_reported(tmp_path):
    sd = _state()
    sd["extra.bias"] = torch.zeros(3)
    sd["norm.weight"] = torch.ones(64, dtype=torch.int32)
    save_file(sd, tmp_path / "m.safetensors")
    with pytest.raises(ValueError) as e:
        _parallelize(str(tmp_path / "m.safetensors"))
    assert "extra.bias" in str(e.value) and "norm.weight" in str(e.value) and "int32" in str(e.value)


def test_a_truncated_file_is_named(tmp_path):
    p = tmp_path / "m.safetensors"
    save_file(_state(), p)
    data = p.read_bytes()
    p.write_bytes(data[: len(data) - 100])
    with pytest.raises(ValueError, match="m.safetensors"):
        _parallelize(str(p))


def test_a_missing_path_is_a_clear_error():
    with pytest.raises((ValueError, OSError), match="nope"):
        _parallelize("/nonexistent/nope.safetensors")


def test_non_strict_weights_keep_what_the_source_lacks_initialized_by_the_modules():
    sd = _state()
    del sd["layers.0.attn.wq.weight"]
    pm = _parallelize(sd, strict_weights=False)
    assert not any(t.is_meta for t in pm.program.parameters())


def test_a_real_model_given_weights_takes_the_sources_values():
    torch.manual_seed(5)
    model = get("gpt-tiny").build()
    x, y = get("gpt-tiny").example_batch(4)
    sd = _state()
    pm = autopar.parallelize(model, autopar.mesh(dp=1, device_type="cpu"), example_inputs=x, weights=sd)
    torch.manual_seed(0)
    ref = get("gpt-tiny").build()
    torch.testing.assert_close(pm(*x), ref(*x), rtol=0, atol=0)


def test_an_autopar_checkpoint_directory_is_a_weight_source(tmp_path):
    spec = get("gpt-tiny")
    x, _ = spec.example_batch(4)
    torch.manual_seed(0)
    real = autopar.parallelize(spec.build(), autopar.mesh(dp=1, device_type="cpu"), example_inputs=x)
    autopar.save(real, str(tmp_path / "ckpt"))
    pm = _parallelize(str(tmp_path / "ckpt"))
    assert any("dcp" in n for n in pm.plan.notes), pm.plan.notes
    torch.testing.assert_close(pm(*x), real(*x), rtol=0, atol=0)
