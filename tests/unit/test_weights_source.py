"""`autopar.build.weights.WeightSource` in one process: every kind of source, every bad input.

Kinds: a `.safetensors` file, a Hugging Face directory (config.json + model.safetensors, and
sharded with model.safetensors.index.json, written by transformers' own save_pretrained), an
`autopar.save` directory (DCP), a mapping. Each reads full tensors and slices equal to the
originals, converting dtypes on the fly. Bad inputs each raise a ValueError (OSError for an
unreadable directory) naming the file or the tensors: missing, unexpected, mis-shaped and
non-convertible tensors in one message; a truncated file, trailing bytes, a corrupt header,
an index naming a missing shard, another architecture's config.json.
"""
from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import save_file

import autopar
from autopar import checkpoint_api as api
from autopar import models
from autopar.build.weights import WeightSource, dtype_kind
from autopar.runtime.checkpoint_files import StateSource, read_safetensors_header


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(6, 5, generator=g), "b": torch.randn(5, generator=g).to(torch.bfloat16),
            "steps": torch.arange(7, dtype=torch.int64), "scale": torch.tensor(2.5)}


def _expected(sd: dict[str, torch.Tensor]) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    return {k: (tuple(v.shape), v.dtype) for k, v in sd.items()}


def _llama(tied: bool = True):
    import transformers

    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, use_cache=False, tie_word_embeddings=tied))


def _reads_back(src: WeightSource, sd: dict[str, torch.Tensor]) -> None:
    assert sorted(src.names()) == sorted(sd)
    for n, v in sd.items():
        assert n in src and src.shape(n) == tuple(v.shape) and src.dtype(n) == v.dtype, n
        full = src.read(n, (0,) * v.dim(), tuple(v.shape))
        assert full.dtype == v.dtype and torch.equal(full, v), n
        if v.dim() >= 1 and v.shape[0] >= 3:
            off = (1,) + (0,) * (v.dim() - 1)
            shape = (2,) + tuple(v.shape[1:])
            piece = src.read(n, off, shape, dtype=torch.float64)
            assert piece.dtype == torch.float64 and torch.equal(piece, v[1:3].double()), n


# --- every kind of source ---------------------------------------------------------------------------
def test_safetensors_file_reads_full_tensors_and_slices_converting_dtype(tmp_path):
    sd = _tensors()
    save_file(sd, tmp_path / "m.safetensors")
    src = WeightSource(tmp_path / "m.safetensors")
    assert src.kind == "safetensors" and src.config is None
    _reads_back(src, sd)
    assert torch.equal(src.read("w", (2, 1), (3, 2)), sd["w"][2:5, 1:3])
    src.check(_expected(sd))  # fits: no error
    with pytest.raises(ValueError, match=r"piece of shape \(3, 2\) at offset \(5, 0\) of 'w'"):
        src.read("w", (5, 0), (3, 2))


def test_mapping_source_reads_like_a_file():
    sd = _tensors()
    src = WeightSource(sd)
    assert src.kind == "mapping"
    _reads_back(src, sd)
    assert src.read("b", (1,), (2,), dtype=torch.float32).dtype == torch.float32


def test_hf_directory_single_file_and_sharded_with_index_read_and_check(tmp_path):
    model = _llama(tied=True)
    model.save_pretrained(tmp_path / "one")
    model.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    sd = model.state_dict()
    persistent = {k: v for k, v in sd.items() if k != "lm_head.weight"}  # transformers writes one tied name
    aliases = [("lm_head.weight", "model.embed_tokens.weight")]
    expected = _expected(sd)
    for d in ("one", "sharded"):
        src = WeightSource(tmp_path / d)
        assert src.kind == "hf" and src.config["model_type"] == "llama"
        _reads_back(src, persistent)
        got = src.check(expected, aliases=aliases, expected_config={"model_type": "llama",
                                                                    "architectures": ["LlamaForCausalLM"]})
        assert got["lm_head.weight"] == "model.embed_tokens.weight"
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 3
    # the index decides what the directory holds: a stray file beside the shards is not read
    save_file({"stray": torch.zeros(2)}, tmp_path / "sharded" / "leftover.safetensors")
    src = WeightSource(tmp_path / "sharded")
    assert "stray" not in src and sorted(src.names()) == sorted(index["weight_map"])
    os.remove(tmp_path / "sharded" / "model.safetensors.index.json")
    assert "stray" in WeightSource(tmp_path / "sharded")  # without an index every file counts


def test_dcp_directory_from_autopar_save_reads_slices_and_imports(tmp_path):
    spec = models.get("mlp-tiny")
    torch.manual_seed(0)
    model = spec.build()
    (x,), _ = spec.example_batch(4, generator=torch.Generator().manual_seed(1))
    pm = autopar.parallelize(model, autopar.mesh(dp=1), example_inputs=x)
    autopar.save(pm, tmp_path / "ckpt")
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    src = WeightSource(tmp_path / "ckpt")
    assert src.kind == "dcp"
    _reads_back(src, sd)
    src.check(_expected(sd))
    # a WeightSource is a StateSource: it fills another plan's engines
    torch.manual_seed(1)
    other = spec.build()
    pm2 = autopar.parallelize(other, autopar.mesh(dp=1), example_inputs=x)
    assert isinstance(src, StateSource)
    api.import_state_dict(pm2, src)
    for n, v in api.export_state_dict(pm2).items():
        if n in sd:
            assert torch.equal(v, sd[n]), n


# --- bad inputs -----------------------------------------------------------------------------------
def test_check_names_every_mismatch_in_one_error(tmp_path):
    sd = _tensors()
    save_file(sd, tmp_path / "m.safetensors")
    src = WeightSource(tmp_path / "m.safetensors")
    expected = _expected(sd)
    del expected["scale"]  # the source has one the model lacks: unexpected
    expected["extra.weight"] = ((3,), torch.float32)  # the model has one the source lacks: missing
    expected["w"] = ((5, 6), torch.float32)  # transposed
    expected["steps"] = ((7,), torch.float32)  # int in the source, float in the model
    expected["b"] = ((5,), torch.float16)  # bf16 -> fp16 converts: no complaint
    with pytest.raises(ValueError) as e:
        src.check(expected)
    msg = str(e.value)
    assert str(tmp_path / "m.safetensors") in msg
    assert "missing 1 tensors: ['extra.weight']" in msg
    assert "unexpected 1 tensors" in msg and "'scale'" in msg
    assert "'w' is [6, 5] in the source but [5, 6] in the model" in msg
    assert "'steps' is int64 in the source but the model's is float32" in msg
    assert "'b'" not in msg
    del expected["extra.weight"], expected["w"], expected["steps"]
    expected.update(w=((6, 5), torch.float64), steps=((7,), torch.int32))
    src.check(expected, allow_unexpected=True)  # widths within a kind convert; 'scale' allowed
    assert dtype_kind(torch.bfloat16) == "float" and dtype_kind(torch.bool) == "bool"


def test_other_architectures_config_is_refused(tmp_path):
    model = _llama()
    model.save_pretrained(tmp_path / "hf")
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    cfg.update(model_type="mistral", architectures=["MistralForCausalLM"])
    (tmp_path / "hf" / "config.json").write_text(json.dumps(cfg))
    src = WeightSource(tmp_path / "hf")
    with pytest.raises(ValueError, match=r"config.json is of another model: model_type 'mistral' \(the model is "
                                         r"'llama'\), architectures \['MistralForCausalLM'\]"):
        src.check(_expected(model.state_dict()), aliases=[("lm_head.weight", "model.embed_tokens.weight")],
                  expected_config={"model_type": "llama", "architectures": ["LlamaForCausalLM"]})


def test_truncated_trailing_and_corrupt_files_are_named_at_open(tmp_path):
    save_file(_tensors(), tmp_path / "ok.safetensors")
    data = (tmp_path / "ok.safetensors").read_bytes()
    cases = {
        "cut.safetensors": (data[:-10], r"is truncated: \d+ bytes, but its header places tensor data up to byte"),
        "cut_header.safetensors": (data[:40], "is truncated: 40 bytes, too few for the safetensors header"),
        "tiny.safetensors": (data[:5], "is truncated: 5 bytes"),
        "long.safetensors": (data + b"\0" * 8, "has 8 bytes after the last tensor"),
        "json.safetensors": (data[:8] + b"#" * 12 + data[20:], "has a corrupt safetensors header"),
        "offsets.safetensors": (data.replace(b'"shape":[6,5]', b'"shape":[6,6]'), r"corrupt safetensors header.*"
                                r"spans bytes"),
    }
    for name, (raw, pattern) in cases.items():
        (tmp_path / name).write_bytes(raw)
        with pytest.raises(ValueError, match=pattern) as e:
            WeightSource(tmp_path / name)
        assert str(tmp_path / name) in str(e.value), name
        with pytest.raises(ValueError):
            read_safetensors_header(str(tmp_path / name))
    # inside a directory the damaged shard is named too
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "model.safetensors").write_bytes(data[:-3])
    with pytest.raises(ValueError, match="model.safetensors' is truncated"):
        WeightSource(tmp_path / "d")


def test_index_naming_a_missing_shard_names_both(tmp_path):
    _llama().save_pretrained(tmp_path / "hf", max_shard_size="20KB")
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    gone = sorted(set(index["weight_map"].values()))[1]
    os.remove(tmp_path / "hf" / gone)
    with pytest.raises(ValueError) as e:
        WeightSource(tmp_path / "hf")
    msg = str(e.value)
    assert "model.safetensors.index.json" in msg and gone in msg and "does not exist" in msg


def test_unreadable_or_absent_directory_raises_with_the_path(tmp_path, monkeypatch):
    d = tmp_path / "hf"
    d.mkdir()
    save_file(_tensors(), d / "model.safetensors")
    real = os.listdir

    def denied(path="."):  # root reads every directory whatever its mode: deny as the OS would
        if os.path.abspath(path) == str(d):
            raise PermissionError(13, "Permission denied", str(path))
        return real(path)

    monkeypatch.setattr(os, "listdir", denied)
    with pytest.raises(OSError, match="cannot read the weights directory") as e:
        WeightSource(d)
    assert e.value.filename == str(d) and e.value.errno == 13
    monkeypatch.undo()
    with pytest.raises(ValueError, match="there is no state dict at"):
        WeightSource(tmp_path / "nothing_here")
