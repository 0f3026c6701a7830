"""Resolve the command line's model argument into something that builds, feeds and trains.

Three spellings, tried in this order:

  * a reference model name from `autopar.models` (`gpt-tiny`, `llama3-70b` ...; the short
    aliases `llama-7b`, `llama-8b`, `llama-70b`, `llama-405b`, `mixtral`, `vit` work too);
  * a zoo row (`autopar.models.zoo`: `hf-llama` at its published size, `hf-llama:tiny` small);
  * a transformers config: a local `config.json` file or a directory holding one (built with
    `AutoModelForCausalLM.from_config`, `use_cache=False`, fed random token ids);
  * `package.module:factory`: `factory()` returns an `autopar.models.ModelSpec`, or an
    `nn.Module` whose module also defines `example_inputs(batch_size, seq_len)` (a tensor or a
    tuple of tensors). A bare module trains on a stated synthetic loss (mean of the squared
    float outputs): enough to time a plan and check parity, not to learn anything.

`ModelSource.build()` builds on the current default device (so `with torch.device("meta")`
costs no memory); `example_batch(b, seq_len=, generator=, device=)` returns (inputs, targets)
as `ModelSpec.example_batch` does. Everything is re-resolvable from its text, which is what
launched workers receive.

It reads and writes no `node.meta` keys. Guarantees: an unknown name raises ValueError naming
the known models, the closest match and the other two spellings.
"""
from __future__ import annotations

import difflib
import functools
import importlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

ALIASES = {"llama-7b": "llama2-7b", "llama2": "llama2-7b", "llama-8b": "llama3-8b", "llama-70b": "llama3-70b",
           "llama-405b": "llama3-405b", "mixtral": "mixtral-8x7b", "vit": "vit-b16", "gpt": "gpt-tiny"}


@dataclass(frozen=True)
class ModelSource:
    text: str  # what the user typed: re-resolving it gives the same model
    name: str  # a short name for reports
    kind: str  # "registry" | "transformers" | "factory"
    build: Callable[[], nn.Module]
    example_batch: Callable[..., Any]  # (batch_size, *, seq_len=None, generator=None, device="cpu")
    loss_fn: Callable
    loss_text: str
    default_seq: int | None  # the sequence length used when none is given (None: no sequence dim)

    def describe(self) -> str:
        return f"{self.name} ({self.kind}{'' if self.text == self.name else ': ' + self.text})"


def resolve(text: str) -> ModelSource:
    """The ModelSource for a model argument (see the module docstring)."""
    from autopar import models
    from autopar.models import zoo

    name = ALIASES.get(text, text)
    if name in models.names():
        spec = models.get(name)
        cfg = spec.config
        seq = getattr(cfg, "max_seq_len", None)
        return ModelSource(text, name, "registry", spec.build, spec.example_batch, spec.loss_fn,
                           "the model's own loss (autopar.models)", seq)
    zoo_source = _zoo(text)
    if zoo_source is not None:
        return zoo_source
    path = Path(text)
    if path.is_dir() and (path / "config.json").exists():
        return _transformers(text, path / "config.json")
    if path.is_file() and path.suffix == ".json":
        return _transformers(text, path)
    if ":" in text and not path.exists():
        return _factory(text)
    close = difflib.get_close_matches(text, list(models.names()) + list(ALIASES), n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    raise ValueError(f"unknown model {text!r}.{hint} Give a reference model ({', '.join(models.names())}), "
                     f"a zoo row (real size; ':tiny' for the small config: {', '.join(zoo.names())}), "
                     "a transformers config (a local config.json or a directory holding one), or "
                     "'package.module:factory' returning a ModelSpec or an nn.Module")


# ------------------------------------------------------------------------ zoo rows
def _zoo(text: str) -> ModelSource | None:
    from autopar.models import zoo

    name, _, size = text.partition(":")
    if name not in zoo.names() or size not in ("", "tiny", "real"):
        return None
    row, size = zoo.get(name), size or "real"
    sp = zoo.spec(name, size)
    seq = (16 if size == "tiny" else row.real_seq) if row.task != "image" else None
    return ModelSource(text, sp.name, "zoo", sp.build, sp.example_batch, sp.loss_fn,
                       "cross-entropy of the logits against random targets", seq)


# ------------------------------------------------------------------------ transformers
def causal_lm_loss(out: Any, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of a causal LM's logits (a tensor or an output with .logits)."""
    logits = out.logits if hasattr(out, "logits") else (out[0] if isinstance(out, (tuple, list)) else out)
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1))


def _build_hf(config_path: str) -> nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    d = json.loads(Path(config_path).read_text())
    kind = d.pop("model_type", None)
    if kind is None:
        raise ValueError(f"{config_path} has no 'model_type'; a transformers config.json names its architecture")
    try:
        cfg = AutoConfig.for_model(kind, **d)
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{config_path}: transformers cannot build a config of model_type {kind!r}: {e}") from None
    cfg.use_cache = False
    return AutoModelForCausalLM.from_config(cfg)


def _hf_batch(batch_size: int, *, seq_len: int | None = None, generator: torch.Generator | None = None,
              device: Any = "cpu", vocab_size: int, max_seq_len: int):
    from autopar.models import token_batch

    return token_batch(batch_size, seq_len=seq_len, generator=generator, device=device, vocab_size=vocab_size,
                       max_seq_len=max_seq_len)


def _transformers(text: str, config_path: Path) -> ModelSource:
    try:
        d = json.loads(config_path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{config_path} is not valid JSON: {e}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot read {config_path}: {e}") from None
    if not isinstance(d, dict):
        raise ValueError(f"{config_path} holds a JSON {type(d).__name__}, not a transformers config (an object "
                         "with model_type, vocab_size ...)")
    vocab = d.get("vocab_size")
    if not isinstance(vocab, int):
        raise ValueError(f"{config_path} has no integer vocab_size; only causal language models are built from "
                         "a config (AutoModelForCausalLM)")
    max_seq = d.get("max_position_embeddings") or d.get("n_positions") or 2048
    if not isinstance(max_seq, int) or isinstance(max_seq, bool) or max_seq < 1:
        raise ValueError(f"{config_path}: max_position_embeddings must be a positive integer, got {max_seq!r}")
    name = d.get("_name_or_path") or config_path.parent.name or config_path.stem
    batch = functools.partial(_hf_batch, vocab_size=vocab, max_seq_len=max_seq)
    return ModelSource(text, f"{d.get('model_type', '?')}:{name}", "transformers",
                       functools.partial(_build_hf, str(config_path)), batch, causal_lm_loss,
                       "next-token cross-entropy of the logits", min(max_seq, 2048))


# ------------------------------------------------------------------------ module:factory
def synthetic_loss(out: Any, targets: Any = None) -> torch.Tensor:
    """Mean of the squared floating-point outputs (the loss of a bare factory module)."""
    from autopar.runtime._torch_compat import pytree

    leaves = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.is_floating_point()]
    if not leaves:
        raise ValueError("the model returned no floating-point tensor to train on")
    return sum(t.float().pow(2).mean() for t in leaves) / len(leaves)


def _module_batch(batch_size: int, *, seq_len: int | None = None, generator: torch.Generator | None = None,
                  device: Any = "cpu", fn: Callable):
    if generator is not None:
        torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=generator)))
    where = f"{getattr(fn, '__module__', '?')}.example_inputs({batch_size}, {seq_len})"
    try:
        with torch.device("cpu"):
            x = fn(batch_size, seq_len)
    except Exception as e:  # noqa: BLE001 - the user's function: say which call failed, in one line
        raise ValueError(f"{where} failed: {type(e).__name__}: {e}") from None
    x = tuple(x) if isinstance(x, (tuple, list)) else (x,)
    if not any(isinstance(t, torch.Tensor) for t in x):
        raise ValueError(f"{where} returned {[type(t).__name__ for t in x]}; it must return the model's input "
                         "tensors (a tensor or a tuple of tensors)")
    if torch.device(device).type == "meta":
        x = tuple(torch.empty_like(t, device="meta") if isinstance(t, torch.Tensor) else t for t in x)
    else:
        x = tuple(t.to(device) if isinstance(t, torch.Tensor) else t for t in x)
    return x, None


def _factory(text: str) -> ModelSource:
    from autopar.models import ModelSpec

    mod_name, _, attr = text.partition(":")
    try:
        mod = importlib.import_module(mod_name)
    except ImportError as e:
        raise ValueError(f"cannot import {mod_name!r} for model {text!r}: {e}. Put its package on PYTHONPATH "
                         "(or run from its directory)") from None
    factory = getattr(mod, attr, None)
    if not callable(factory):
        raise ValueError(f"{mod_name} has no callable {attr!r} (model {text!r}); "
                         f"callables there: {sorted(k for k, v in vars(mod).items() if callable(v))[:12]}")
    try:
        with torch.device("meta"):
            probe = factory()
    except Exception as e:  # noqa: BLE001 - the user's factory: name it and its error in one line
        raise ValueError(f"calling {text}() (on the meta device) failed: {type(e).__name__}: {e}") from None
    if isinstance(probe, ModelSpec):
        spec = probe
        return ModelSource(text, spec.name, "factory", spec.build, spec.example_batch, spec.loss_fn,
                           "the spec's loss", getattr(spec.config, "max_seq_len", None))
    if not isinstance(probe, nn.Module):
        raise ValueError(f"{text}() returned {type(probe).__name__}; return an nn.Module or an "
                         "autopar.models.ModelSpec")
    ex = getattr(mod, "example_inputs", None)
    if not callable(ex):
        raise ValueError(f"{text}() returns a bare nn.Module, so {mod_name} must also define "
                         "example_inputs(batch_size, seq_len) returning its inputs (or return a ModelSpec)")
    return ModelSource(text, attr, "factory", factory, functools.partial(_module_batch, fn=ex), synthetic_loss,
                       "synthetic: mean of the squared outputs", None)
