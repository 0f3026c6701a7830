"""The model zoo: models we did not write, as a user brings them, at two sizes.

Each row is a transformers (or timm) architecture built from its own config class with
random weights (no downloads): `tiny` (a few layers, narrow: parity on gloo in seconds, in the
row's `dtype`) and `real` (the published size in bf16: built on the meta device and planned
for a cluster). `spec(row,
size)` returns an `autopar.models.ModelSpec`: `build()` (on the current default device),
`example_batch(b, seq_len=, generator=, device=)` and `loss_fn(out, targets)`; everything is
picklable, and transformers is imported only when a row is built.

What a user must do, and what autopar does for them, per row, is `Row.notes`; the rows'
objectives are synthetic (cross-entropy of the logits against random targets), enough to
check parity and to time a plan.

It reads and writes no `node.meta` keys. Guarantees: `spec` raises ValueError naming the rows
for an unknown row, and `RowUnavailable` (with the reason) for a row whose library cannot be
imported here.
"""
from __future__ import annotations

import functools
import importlib
import importlib.util
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import ModelSpec, image_batch, token_batch


REAL_DTYPE = "bfloat16"  # real sizes train in bf16 (the planner adds fp32 master weights and Adam states)


class RowUnavailable(RuntimeError):
    """The row's library cannot be used on this machine (the message says why)."""


@dataclass(frozen=True)
class Row:
    name: str
    library: str  # "transformers" | "timm"
    arch: str  # the class the user instantiates
    task: str  # "causal_lm" | "masked_lm" | "seq2seq" | "image"
    tiny: dict  # config kwargs
    real: dict
    real_name: str  # the published model whose config `real` is
    real_batch: int  # global batch for the cluster plan
    real_seq: int | None  # sequence length (decoder length for seq2seq is real_seq // 4)
    meshes: tuple = ()  # gloo parity meshes: (mesh kwargs, parallelize options)
    dtype: str = "float32"  # parity dtype
    notes: str = ""
    extra: dict = field(default_factory=dict)
    breadth: bool = False  # beyond the list: tiny parity only (dp x tp, fp64), no real-size plan

    def available(self) -> str | None:
        """None when the row's library imports here, else the reason it does not."""
        return unavailable(self.library)


def unavailable(library: str) -> str | None:
    if importlib.util.find_spec(library) is None:
        if library == "timm":
            return ("timm is not installed: it imports torchvision, and PyPI has no CPU build of torchvision for "
                    "torch 2.13 (its wheel links libtorch_cuda.so / libc10_cuda.so, which the CPU torch lacks); "
                    "installing it replaces the CPU torch. It needs a torchvision build for the installed torch, not an autopar "
                    "change; transformers' ResNet-50 row covers the architecture")
        return f"{library} is not installed (pip install {library}, constrained to the installed torch)"
    if library == "timm":
        try:
            importlib.import_module("timm")
        except Exception as e:  # noqa: BLE001 - any import failure is the reason
            return f"timm does not import here: {type(e).__name__}: {e}"
    return None


_LLAMA_TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, max_position_embeddings=64)
_DP_TP = ({"dp": 2, "tp": 2}, {"hardware": "h100-sxm"})  # plan tp for a GPU (on gloo tiny models stay replicated)
_PP_DP = ({"pp": 2, "dp": 2}, {})
_PLANNER = ({"world_size": 4}, {"hardware": "h100-sxm"})
_DECODER_MESHES = (_PLANNER, _DP_TP, _PP_DP)

def _breadth_rows() -> list[Row]:
    """More transformers architectures, each with one mesh (dp2 x tp2, planned for H100s; the MoE
    also dp2 x ep2) in fp64, where sharding leaves nothing but summation order: parity to 1e-6
    after 3 AdamW steps catches a wrong rule that fp32 noise would hide."""
    mesh = (_DP_TP,)
    enc = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    spec = [
        ("hf-gemma", "GemmaForCausalLM", "causal_lm", dict(_LLAMA_TINY, head_dim=16)),
        ("hf-gemma2", "Gemma2ForCausalLM", "causal_lm", dict(_LLAMA_TINY, head_dim=16)),
        ("hf-phi3", "Phi3ForCausalLM", "causal_lm", dict(_LLAMA_TINY, pad_token_id=0)),
        ("hf-opt", "OPTForCausalLM", "causal_lm",
         dict(vocab_size=128, hidden_size=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=4,
              max_position_embeddings=64, word_embed_proj_dim=64, dropout=0.0, attention_dropout=0.0, pad_token_id=1)),
        ("hf-gpt-neox", "GPTNeoXForCausalLM", "causal_lm",
         dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              max_position_embeddings=64, hidden_dropout=0.0, attention_dropout=0.0)),
        ("hf-falcon", "FalconForCausalLM", "causal_lm",
         dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, hidden_dropout=0.0,
              attention_dropout=0.0)),
        ("hf-qwen2-moe", "Qwen2MoeForCausalLM", "causal_lm",
         dict(_LLAMA_TINY, moe_intermediate_size=32, shared_expert_intermediate_size=64, num_experts=4,
              num_experts_per_tok=2)),
        ("hf-roberta", "RobertaForMaskedLM", "masked_lm", dict(enc, max_position_embeddings=80, pad_token_id=1)),
        ("hf-deberta-v2", "DebertaV2ForMaskedLM", "masked_lm", dict(enc, max_position_embeddings=64)),
        ("hf-distilbert", "DistilBertForMaskedLM", "masked_lm",
         dict(vocab_size=128, dim=64, hidden_dim=128, n_layers=2, n_heads=4, dropout=0.0, attention_dropout=0.0,
              max_position_embeddings=64)),
        ("hf-swin", "SwinForImageClassification", "image",
         dict(image_size=32, patch_size=4, embed_dim=16, depths=[1, 1], num_heads=[2, 4], window_size=4,
              num_labels=10, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, drop_path_rate=0.0)),
        ("hf-convnext", "ConvNextForImageClassification", "image",
         dict(image_size=32, hidden_sizes=[16, 32], depths=[1, 1], num_stages=2, num_labels=10, drop_path_rate=0.0)),
    ]
    moe_mesh = (({"dp": 2, "ep": 2}, {}),)
    # fp32 for the MoE: transformers' grouped experts call torch._grouped_mm, which takes no fp64
    return [Row(n, "transformers", arch, task, cfg, {}, "", 0, None, mesh + (moe_mesh if "moe" in n else ()),
                dtype="float32" if "moe" in n else "float64", breadth=True) for n, arch, task, cfg in spec]


ROWS: dict[str, Row] = {r.name: r for r in [
    Row("hf-gpt2", "transformers", "GPT2LMHeadModel", "causal_lm",
        dict(n_layer=2, n_head=4, n_embd=64, vocab_size=128, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0,
             attn_pdrop=0.0, bos_token_id=0, eos_token_id=0),
        dict(n_layer=48, n_head=25, n_embd=1600, vocab_size=50257, n_positions=1024),
        "gpt2-xl (1.5B)", 512, 1024, _DECODER_MESHES,
        notes="Conv1D (weight stored transposed) and tied LM head: handled by the sharding rules"),
    Row("hf-llama", "transformers", "LlamaForCausalLM", "causal_lm", dict(_LLAMA_TINY),
        dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
             num_key_value_heads=8, max_position_embeddings=8192, rope_theta=500000.0),
        "Llama-3-8B", 256, 4096, _DECODER_MESHES + (({"pp": 2, "tp": 2}, {"hardware": "h100-sxm"}),), dtype="float64",
        notes="fp64: in fp32 its one-process rounding floor (6.4e-5 with tp's summation order) sits at the 1e-4 bound"),
    Row("hf-mistral", "transformers", "MistralForCausalLM", "causal_lm", dict(_LLAMA_TINY, sliding_window=None),
        dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
             num_key_value_heads=8, max_position_embeddings=32768, sliding_window=4096),
        "Mistral-7B-v0.1", 256, 4096, _DECODER_MESHES, dtype="float64",
        notes="fp64: in fp32 its one-process rounding floor sits at the 1e-4 bound, as hf-llama's"),
    Row("hf-qwen2", "transformers", "Qwen2ForCausalLM", "causal_lm", dict(_LLAMA_TINY),
        dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
             num_key_value_heads=4, max_position_embeddings=32768, rope_theta=1000000.0),
        "Qwen2-7B", 256, 4096, _DECODER_MESHES, notes="q/k/v biases"),
    Row("hf-mixtral", "transformers", "MixtralForCausalLM", "causal_lm",
        dict(_LLAMA_TINY, num_local_experts=4, num_experts_per_tok=2),
        dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
             num_key_value_heads=8, max_position_embeddings=32768, num_local_experts=8, num_experts_per_tok=2),
        "Mixtral-8x7B", 256, 4096,
        (_PLANNER, ({"dp": 2, "ep": 2}, {}), ({"ep": 2, "tp": 2}, {"hardware": "h100-sxm"}), _PP_DP),
        notes="grouped (E, ...) expert weights: detected as MoE, ep-sharded along the expert dim"),
    Row("hf-bert", "transformers", "BertForMaskedLM", "masked_lm",
        dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, max_position_embeddings=64),
        dict(vocab_size=30522, hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16,
             max_position_embeddings=512),
        "bert-large", 1024, 512, _DECODER_MESHES,
        notes="tied word embedding / MLM decoder"),
    Row("hf-t5", "transformers", "T5ForConditionalGeneration", "seq2seq",
        dict(vocab_size=128, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4, dropout_rate=0.0,
             decoder_start_token_id=0),
        dict(vocab_size=32128, d_model=1024, d_kv=64, d_ff=4096, num_layers=24, num_heads=16, decoder_start_token_id=0),
        "t5-large (770M)", 512, 512, _DECODER_MESHES + (({"pp": 4}, {}),),
        notes="inputs (input_ids, None, decoder_input_ids): the None attention mask is passed through, also to "
              "pipeline stage 0; the shared embedding is read on three stages at pp=4 (one tied group)"),
    Row("hf-vit", "transformers", "ViTForImageClassification", "image",
        dict(image_size=32, patch_size=8, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_labels=10, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0),
        dict(image_size=224, patch_size=16, hidden_size=1024, intermediate_size=4096, num_hidden_layers=24,
             num_attention_heads=16, num_labels=1000),
        "ViT-L/16", 2048, None, _DECODER_MESHES),
    Row("hf-resnet50", "transformers", "ResNetForImageClassification", "image",
        dict(embedding_size=16, hidden_sizes=[32, 64, 128, 256], depths=[1, 1, 1, 1], layer_type="bottleneck",
             num_labels=10, image_size=32),
        dict(embedding_size=64, hidden_sizes=[256, 512, 1024, 2048], depths=[3, 4, 6, 3], layer_type="bottleneck",
             num_labels=1000, image_size=224),
        "ResNet-50 (microsoft/resnet-50's config)", 4096, None, _DECODER_MESHES, dtype="float64",
        notes="BatchNorm: statistics are synchronised over the batch axes (the sync_batchnorm pass), so dp keeps "
              "one-process parity; checked in float64 because batch norm over 8 samples of 1x1 maps makes fp32 "
              "itself noisy (one process, fp32 vs fp64: 5.5e-3 apart after 3 AdamW steps)"),
    *_breadth_rows(),
    Row("timm-resnet50", "timm", "resnet50", "image", dict(num_classes=10), dict(num_classes=1000),
        "timm resnet50", 4096, None, (_PLANNER, _DP_TP, _PP_DP), dtype="float64",
        extra={"tiny_image": 32, "real_image": 224}),
    Row("timm-vit", "timm", "vit_small_patch16_224", "image",
        dict(img_size=32, patch_size=8, embed_dim=64, depth=2, num_heads=4, num_classes=10),
        dict(num_classes=1000), "timm vit_small_patch16_224", 2048, None, _DECODER_MESHES,
        extra={"tiny_image": 32, "real_image": 224}),
]}


def names() -> list[str]:
    return list(ROWS)


def get(name: str) -> Row:
    if name not in ROWS:
        raise ValueError(f"unknown zoo row {name!r}; rows: {', '.join(ROWS)}")
    return ROWS[name]


# --- building ---------------------------------------------------------------------------------
def build(name: str, size: str) -> nn.Module:
    """The row's model at `size` ("tiny" | "real") on the current default device, random weights."""
    row = get(name)
    why = row.available()
    if why:
        raise RowUnavailable(f"{name}: {why}")
    kw = dict(row.tiny if size == "tiny" else row.real)
    if row.library == "timm":
        import timm  # noqa: PLC0415

        model = timm.create_model(row.arch, pretrained=False, **kw)
    else:
        import transformers  # noqa: PLC0415

        model_cls = getattr(transformers, row.arch)
        model = model_cls(model_cls.config_class(**kw))
    return model.to(getattr(torch, row.dtype if size == "tiny" else REAL_DTYPE))


def _vocab(row: Row, size: str) -> int:
    return (row.tiny if size == "tiny" else row.real)["vocab_size"]


def _image(row: Row, size: str) -> int:
    cfg = row.tiny if size == "tiny" else row.real
    return int(cfg.get("image_size") or row.extra.get(f"{size}_image", 224))


def _labels(row: Row, size: str) -> int:
    cfg = row.tiny if size == "tiny" else row.real
    return int(cfg.get("num_labels") or cfg.get("num_classes"))


def _seq2seq_batch(batch_size: int, *, seq_len: int | None = None, generator: torch.Generator | None = None,
                   device: Any = "cpu", vocab_size: int, max_seq_len: int):
    """((input_ids, None, decoder_input_ids), decoder targets); decoder length = encoder // 4 (>= 1)."""
    (ids,), _ = token_batch(batch_size, seq_len=seq_len, generator=generator, device=device, vocab_size=vocab_size,
                            max_seq_len=max_seq_len)
    td = max(1, ids.shape[1] // 4)
    (dec,), tgt = token_batch(batch_size, seq_len=td, generator=generator, device=device, vocab_size=vocab_size,
                              max_seq_len=max_seq_len)
    return (ids, None, dec), tgt


def _typed_image_batch(batch_size: int, *, dtype: str, **kw):
    (x,), y = image_batch(batch_size, **kw)
    return (x.to(getattr(torch, dtype)),), y


def logits_loss(out: Any, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of the logits (`out.logits`, `out["logits"]` or a tensor) against targets."""
    logits = out["logits"] if isinstance(out, dict) or hasattr(out, "keys") else out
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def _labels_batch(batch_size: int, *, seq_len: int | None = None, generator: torch.Generator | None = None,
                  device: Any = "cpu", vocab_size: int, max_seq_len: int):
    """({"input_ids": ids, "labels": ids}, None): the model shifts the labels and returns its loss."""
    (ids,), _ = token_batch(batch_size, seq_len=seq_len, generator=generator, device=device, vocab_size=vocab_size,
                            max_seq_len=max_seq_len)
    return {"input_ids": ids, "labels": ids.clone()}, None


def model_loss(out: Any, targets: Any = None) -> torch.Tensor:
    """The loss the model computed itself (`out["loss"]`, from `labels=`)."""
    return out["loss"]


def spec(name: str, size: str = "tiny", style: str = "positional") -> ModelSpec:
    """The row as a ModelSpec at `size`; `example_batch` draws the row's inputs and targets.

    style "positional": ((inputs...), targets) and the cross-entropy of the logits;
    "labels" (language models): ({"input_ids", "labels"}, None) and the model's own loss,
    the way a transformers user calls `model(**batch).loss`."""
    if size not in ("tiny", "real"):
        raise ValueError(f"size must be 'tiny' or 'real', got {size!r}")
    row = get(name)
    if size == "real" and row.breadth:
        raise ValueError(f"{name} is a breadth row (tiny parity only); real-size rows: "
                         f"{', '.join(n for n in ROWS if not ROWS[n].breadth)}")
    if style == "labels":
        if row.task not in ("causal_lm", "masked_lm"):
            raise ValueError(f"style='labels' is for language models; {name} is {row.task}")
        max_seq = 64 if size == "tiny" else int(row.real_seq or 512)
        batch = functools.partial(_labels_batch, vocab_size=_vocab(row, size), max_seq_len=max_seq)
        return ModelSpec(f"{name}:{size}", functools.partial(build, name, size), batch, model_loss, row)
    if style != "positional":
        raise ValueError(f"style must be 'positional' or 'labels', got {style!r}")
    if row.task == "image":
        batch = functools.partial(_typed_image_batch, dtype=row.dtype if size == "tiny" else REAL_DTYPE, in_chans=3,
                                  image_size=_image(row, size), n_classes=_labels(row, size))
    else:
        max_seq = 64 if size == "tiny" else int(row.real_seq or 512)
        fn = _seq2seq_batch if row.task == "seq2seq" else token_batch
        batch = functools.partial(fn, vocab_size=_vocab(row, size), max_seq_len=max_seq)
    return ModelSpec(f"{name}:{size}", functools.partial(build, name, size), batch, logits_loss, row)


__all__ = ["ROWS", "Row", "RowUnavailable", "build", "get", "logits_loss", "model_loss", "names", "spec",
           "unavailable"]
