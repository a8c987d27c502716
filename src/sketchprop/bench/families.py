"""The model families the library is checked on, each built from a config with random weights (no
download), at a tiny width and at a width of several code groups per row, and one padded batch.

Each family is one entry of :data:`FAMILIES`: the transformers model class, its config class and
the config's keys for the width, the depth, the heads and the MLP (names differ by family, as
``hidden_size`` against ``d_model`` or ``n_embd``). :func:`build` fills them from a :class:`Width`;
:func:`make_batch` gives the batch the family's head trains on: token ids padded on the right
(as transformers' collators pad) with a loss target, or images for ViT. Dropout is off, so that
an unpatched and a patched model draw nothing and their gradients can be compared.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class Width:
    """A model's width: hidden size, heads, MLP width, layers, vocabulary."""

    hidden: int
    heads: int
    mlp: int
    layers: int = 2
    vocab: int = 128


#: One code group a row at most (hidden 64): what most tests use, for speed.
TINY = Width(hidden=64, heads=4, mlp=128)
#: Several code groups a row (6 of 64), heads of 32, MLP 4x: where a layout bug shows.
WIDE = Width(hidden=384, heads=12, mlp=1536)


@dataclass(frozen=True)
class Family:
    """How to build one family: ``model`` and ``config`` are transformers class names; ``keys``
    the config's names for (hidden, heads, MLP width, layers, vocabulary), None where it has
    none; ``extra`` further config values; ``kind`` what its head trains on (``"classify"``:
    sequence labels, ``"lm"``: causal LM labels, ``"seq2seq"``: target tokens, ``"image"``)."""

    model: str
    config: str
    keys: tuple[str, str, str, str, str | None]
    kind: str
    extra: tuple[tuple[str, object], ...] = ()


_BERT_KEYS = ("hidden_size", "num_attention_heads", "intermediate_size", "num_hidden_layers",
              "vocab_size")
_NO_DROPOUT_BERT = (("hidden_dropout_prob", 0.0), ("attention_probs_dropout_prob", 0.0))
_DECODER = (("pad_token_id", 0), ("bos_token_id", 1), ("eos_token_id", 2),
            ("tie_word_embeddings", False))

FAMILIES: dict[str, Family] = {
    "bert": Family("BertForSequenceClassification", "BertConfig", _BERT_KEYS, "classify",
                   _NO_DROPOUT_BERT),
    "roberta": Family("RobertaForSequenceClassification", "RobertaConfig", _BERT_KEYS, "classify",
                      (*_NO_DROPOUT_BERT, ("pad_token_id", 1))),
    "distilbert": Family("DistilBertForSequenceClassification", "DistilBertConfig",
                         ("dim", "n_heads", "hidden_dim", "n_layers", "vocab_size"), "classify",
                         (("dropout", 0.0), ("attention_dropout", 0.0), ("seq_classif_dropout",
                                                                          0.0))),
    "deberta-v2": Family("DebertaV2ForSequenceClassification", "DebertaV2Config", _BERT_KEYS,
                         "classify", (*_NO_DROPOUT_BERT, ("relative_attention", True),
                                      ("position_buckets", 16), ("pos_att_type",
                                                                 ["p2c", "c2p"]))),
    "modernbert": Family("ModernBertForSequenceClassification", "ModernBertConfig", _BERT_KEYS,
                         "classify", (("pad_token_id", 0), ("bos_token_id", 1),
                                      ("eos_token_id", 2), ("cls_token_id", 1),
                                      ("sep_token_id", 2), ("global_attn_every_n_layers", 2),
                                      ("local_attention", 16))),
    "t5": Family("T5ForConditionalGeneration", "T5Config",
                 ("d_model", "num_heads", "d_ff", "num_layers", "vocab_size"), "seq2seq",
                 (("dropout_rate", 0.0), ("pad_token_id", 0), ("eos_token_id", 1),
                  ("decoder_start_token_id", 0), ("relative_attention_num_buckets", 8))),
    "llama": Family("LlamaForCausalLM", "LlamaConfig", _BERT_KEYS, "lm", _DECODER),
    "qwen2": Family("Qwen2ForCausalLM", "Qwen2Config", _BERT_KEYS, "lm", _DECODER),
    "qwen3": Family("Qwen3ForCausalLM", "Qwen3Config", _BERT_KEYS, "lm", _DECODER),
    "mistral": Family("MistralForCausalLM", "MistralConfig", _BERT_KEYS, "lm",
                      (*_DECODER, ("sliding_window", 16))),
    "gemma2": Family("Gemma2ForCausalLM", "Gemma2Config", _BERT_KEYS, "lm",
                     (*_DECODER, ("sliding_window", 16))),
    "gemma3": Family("Gemma3ForCausalLM", "Gemma3TextConfig", _BERT_KEYS, "lm",
                     (*_DECODER, ("sliding_window", 16))),
    "phi3": Family("Phi3ForCausalLM", "Phi3Config", _BERT_KEYS, "lm",
                   (*_DECODER, ("resid_pdrop", 0.0), ("embd_pdrop", 0.0))),
    "gpt2": Family("GPT2LMHeadModel", "GPT2Config",
                   ("n_embd", "n_head", "n_inner", "n_layer", "vocab_size"), "lm",
                   (("resid_pdrop", 0.0), ("embd_pdrop", 0.0), ("attn_pdrop", 0.0),
                    ("bos_token_id", 0), ("eos_token_id", 0))),
    "mixtral": Family("MixtralForCausalLM", "MixtralConfig", _BERT_KEYS, "lm",
                      (*_DECODER, ("num_local_experts", 4), ("num_experts_per_tok", 2))),
    "qwen3-moe": Family("Qwen3MoeForCausalLM", "Qwen3MoeConfig",
                        ("hidden_size", "num_attention_heads", "moe_intermediate_size",
                         "num_hidden_layers", "vocab_size"), "lm",
                        (*_DECODER, ("num_experts", 4), ("num_experts_per_tok", 2),
                         ("decoder_sparse_step", 1))),
    "vit": Family("ViTForImageClassification", "ViTConfig",
                  (*_BERT_KEYS[:4], None), "image",
                  (*_NO_DROPOUT_BERT, ("image_size", 32), ("patch_size", 8), ("num_labels", 3))),
}

#: Families whose heads are grouped (half as many key/value heads as query heads).
_GROUPED = {"llama", "qwen2", "qwen3", "mistral", "gemma2", "gemma3", "mixtral", "qwen3-moe"}


def config_of(name: str, width: Width = TINY, **overrides):
    """The config of family ``name`` at ``width``, with ``overrides`` (config keys) on top."""
    import transformers

    family = FAMILIES[name]
    values = dict(zip(family.keys, (width.hidden, width.heads, width.mlp, width.layers,
                                    width.vocab), strict=True))
    values.pop(None, None)
    if name in _GROUPED:
        values["num_key_value_heads"] = max(1, width.heads // 2)
    if name in ("gemma2", "gemma3", "qwen3", "qwen3-moe"):
        values["head_dim"] = width.hidden // width.heads
    if name == "qwen3-moe":
        values["intermediate_size"] = width.mlp
    if name == "t5":
        values["d_kv"] = width.hidden // width.heads
    values.update(dict(family.extra))
    values.update(overrides)
    return getattr(transformers, family.config)(**values)


def build(name: str, width: Width = TINY, seed: int = 0, attention: str = "eager",
          **overrides) -> nn.Module:
    """Family ``name`` at ``width`` (config ``overrides`` on top), random weights from ``seed``,
    in training mode, with ``attention`` as its attention implementation: eager by default
    (the probabilities computed and kept: the bytes tables' baseline; the patches switch it
    where they apply), ``"sdpa"`` where the family has it (:func:`fastest_attention`)."""
    import transformers
    from transformers.utils import logging as hf_logging

    if name not in FAMILIES:
        raise ValueError(f"unknown family {name!r}; choose one of {list(FAMILIES)}")
    hf_logging.set_verbosity_error()
    config = config_of(name, width, **overrides)
    torch.manual_seed(seed)
    model = getattr(transformers, FAMILIES[name].model)._from_config(
        config, attn_implementation=attention)
    return model.train()


def fastest_attention(name: str) -> str:
    """The fastest attention implementation that computes family ``name``'s own attention:
    ``"sdpa"`` where transformers has it for the family (PyTorch's fused kernels; on a CPU a
    fraction of eager's time at long rows), else ``"eager"`` (DeBERTa-v2's own attention, Gemma 2's
    soft cap, which SDPA lacks). What a fair exact baseline runs."""
    import transformers

    model = getattr(transformers, FAMILIES[name].model)
    return "sdpa" if getattr(model, "_supports_sdpa", False) else "eager"


def make_batch(name: str, model: nn.Module, batch: int = 4, length: int = 48,
               seed: int = 0) -> dict:
    """A batch of ``batch`` rows of ``length`` tokens, the first full and the others shorter
    (down to about half), padded on the right; images for ViT. With the target its head trains
    on: labels, or the tokens themselves with padding at -100."""
    g = torch.Generator().manual_seed(seed)
    config = model.config
    kind = FAMILIES[name].kind
    if kind == "image":
        side = config.image_size
        return {"pixel_values": torch.randn(batch, config.num_channels, side, side, generator=g),
                "labels": torch.randint(0, config.num_labels, (batch,), generator=g)}
    lengths = torch.tensor([length - (length * i) // (2 * batch) for i in range(batch)])
    mask = (torch.arange(length)[None, :] < lengths[:, None]).long()
    pad = config.pad_token_id if config.pad_token_id is not None else 0
    ids = torch.randint(3, config.vocab_size, (batch, length), generator=g).masked_fill(
        mask == 0, pad)
    data = {"input_ids": ids, "attention_mask": mask}
    if kind == "classify":
        data["labels"] = torch.randint(0, config.num_labels, (batch,), generator=g)
    elif kind == "seq2seq":
        out = length // 2
        labels = torch.randint(3, config.vocab_size, (batch, out), generator=g)
        data["labels"] = labels.masked_fill(torch.arange(out)[None, :] >= lengths[:, None] // 2,
                                            -100)
    else:
        data["labels"] = ids.masked_fill(mask == 0, -100)
    return data


#: Each family at its published width: the smallest published checkpoint of the family (named),
#: as ``(checkpoint, Width, config overrides)``: its hidden size, heads, MLP width, vocabulary,
#: head layout (key/value heads, head width) and the rest of the shape that sets what a layer
#: saves (sliding windows, experts, position buckets), 2 layers. Random weights, as every build.
PUBLISHED: dict[str, tuple[str, Width, dict]] = {
    "bert": ("bert-base-uncased", Width(768, 12, 3072, vocab=30522), {}),
    "roberta": ("roberta-base", Width(768, 12, 3072, vocab=50265), {}),
    "distilbert": ("distilbert-base-uncased", Width(768, 12, 3072, vocab=30522), {}),
    "deberta-v2": ("microsoft/deberta-v3-base", Width(768, 12, 3072, vocab=128100),
                   {"position_buckets": 256}),
    "modernbert": ("answerdotai/ModernBERT-base", Width(768, 12, 1152, vocab=50368),
                   {"global_attn_every_n_layers": 3, "local_attention": 128}),
    "t5": ("t5-base", Width(768, 12, 3072, vocab=32128), {"relative_attention_num_buckets": 32}),
    "llama": ("meta-llama/Llama-3.2-1B", Width(2048, 32, 8192, vocab=128256),
              {"num_key_value_heads": 8, "tie_word_embeddings": True}),
    "qwen2": ("Qwen/Qwen2.5-0.5B", Width(896, 14, 4864, vocab=151936),
              {"num_key_value_heads": 2, "tie_word_embeddings": True}),
    "qwen3": ("Qwen/Qwen3-0.6B", Width(1024, 16, 3072, vocab=151936),
              {"num_key_value_heads": 8, "head_dim": 128, "tie_word_embeddings": True}),
    "mistral": ("mistralai/Mistral-7B-v0.1", Width(4096, 32, 14336, vocab=32000),
                {"num_key_value_heads": 8, "sliding_window": 4096}),
    "gemma2": ("google/gemma-2-2b", Width(2304, 8, 9216, vocab=256000),
               {"num_key_value_heads": 4, "head_dim": 256, "sliding_window": 4096,
                "tie_word_embeddings": True}),
    "gemma3": ("google/gemma-3-1b-pt", Width(1152, 4, 6912, vocab=262144),
               {"num_key_value_heads": 1, "head_dim": 256, "sliding_window": 512,
                "tie_word_embeddings": True}),
    "phi3": ("microsoft/Phi-3-mini-4k-instruct", Width(3072, 32, 8192, vocab=32064), {}),
    "gpt2": ("gpt2", Width(768, 12, 3072, vocab=50257), {}),
    "mixtral": ("mistralai/Mixtral-8x7B-v0.1", Width(4096, 32, 14336, vocab=32000),
                {"num_key_value_heads": 8, "num_local_experts": 8, "num_experts_per_tok": 2}),
    "qwen3-moe": ("Qwen/Qwen3-30B-A3B", Width(2048, 32, 768, vocab=151936),
                  {"num_key_value_heads": 4, "head_dim": 128, "num_experts": 128,
                   "num_experts_per_tok": 8, "intermediate_size": 6144}),
    "vit": ("google/vit-base-patch16-224", Width(768, 12, 3072), {"patch_size": 16}),
}

#: The depth of each :data:`PUBLISHED` checkpoint (its config's layers; T5's encoder and decoder
#: have as many each): for the budget of a whole model (``scripts/pick_budget.py --family``).
PUBLISHED_LAYERS: dict[str, int] = {
    "bert": 12, "roberta": 12, "distilbert": 6, "deberta-v2": 12, "modernbert": 22, "t5": 12,
    "llama": 16, "qwen2": 24, "qwen3": 28, "mistral": 32, "gemma2": 26, "gemma3": 26,
    "phi3": 32, "gpt2": 12, "mixtral": 32, "qwen3-moe": 48, "vit": 12,
}
