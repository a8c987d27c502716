"""The model a run trains: the tokenizer and classifier (pretrained, or a small random RoBERTa for
tests), its adapter (peft LoRA), and the patches its method and activations settings ask for."""

from __future__ import annotations

import logging
from pathlib import Path

from . import data as glue
from .config import AdapterConfig, Config

log = logging.getLogger(__name__)

__all__ = ["add_adapter", "build_model", "model_and_data", "patch"]


def _word_tokenizer(texts, vocab_size: int):
    """A RoBERTa-style word-level tokenizer learned from ``texts`` (no download)."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    # RoBERTa's special-token ids: <s>=0, <pad>=1, </s>=2, <unk>=3.
    specials = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]
    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(texts, trainers.WordLevelTrainer(vocab_size=vocab_size,
                                                             special_tokens=specials))
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", pair="<s> $A </s> </s> $B </s>",
        special_tokens=[("<s>", 0), ("</s>", 2)])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
        pad_token="<pad>", cls_token="<s>", sep_token="</s>", mask_token="<mask>",
        model_input_names=["input_ids", "attention_mask"])


def build_model(conf: Config, train_split):
    """The tokenizer and ``AutoModelForSequenceClassification`` with a fresh head for the task."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer, RobertaConfig

    task = conf.task
    labels = {} if task.regression else {
        "id2label": dict(enumerate(task.labels)),
        "label2id": {name: i for i, name in enumerate(task.labels)}}
    head = dict(num_labels=len(task.labels), **labels,
                problem_type="regression" if task.regression else "single_label_classification")
    if conf.model.random is not None:
        arch = conf.model.random
        texts = (text for column in task.text_columns for text in train_split[column])
        tokenizer = _word_tokenizer(texts, arch.vocab_size)
        config = RobertaConfig(
            vocab_size=len(tokenizer), hidden_size=arch.hidden_size,
            num_hidden_layers=arch.num_hidden_layers, num_attention_heads=arch.num_attention_heads,
            intermediate_size=arch.intermediate_size, type_vocab_size=1,
            max_position_embeddings=conf.train.max_length + 2,  # RoBERTa offsets positions by 2
            pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id, **head)
        return tokenizer, AutoModelForSequenceClassification.from_config(config)
    path = str(Path(conf.model.name_or_path).expanduser())
    tokenizer = AutoTokenizer.from_pretrained(path)
    return tokenizer, AutoModelForSequenceClassification.from_pretrained(path, **head)


def add_adapter(model, adapter: AdapterConfig):
    """``model`` with its adapter: for ``adapter=lora`` a peft LoRA model (the model's weights
    frozen; the adapters and the new head, peft's ``modules_to_save`` for sequence classification,
    train); for ``adapter=none`` the model itself."""
    if adapter.name.value == "none":
        return model
    from peft import LoraConfig, TaskType, get_peft_model

    return get_peft_model(model, LoraConfig(
        task_type=TaskType.SEQ_CLS, r=adapter.r, lora_alpha=adapter.alpha,
        lora_dropout=adapter.dropout, target_modules=list(adapter.target_modules)))



def model_and_data(conf: Config, raw):
    """The seeded model (with its adapter) and tokenizer, and the tokenized splits."""
    from transformers import set_seed

    set_seed(conf.train.seed)  # the new classifier head (or the whole random model) starts the same
    tokenizer, model = build_model(conf, raw["train"])
    data = glue.tokenize(raw, tokenizer, conf.task, conf.train.max_length)
    if conf.train.gradient_checkpointing:
        # Non-reentrant: saved tensors go through saved_tensors_hooks, so the saved-activation
        # count sees what checkpointing keeps.
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return tokenizer, add_adapter(model, conf.adapter), data


def patch(conf: Config, model) -> tuple[list[str], list[str]]:
    """Patch the model's linear layers as the method says, and its activations as
    ``activations`` says; the names patched, of each."""
    from .. import patch_activations, patch_linear

    patched = []
    m = conf.method
    if m.patches:
        patched = patch_linear(model, sketch=m.sketch.value, rho=m.rho, targets=m.targets,
                               exclude=m.exclude, share_inputs=m.share_inputs,
                               skip_padding=m.skip_padding, min_rows=m.min_rows,
                               seed=conf.train.seed, track_variance=m.track_variance,
                               allocate=m.allocate.value, bits=m.bits, group=m.group)
    log.info("%s: %d linear layers patched with %s, rho=%s%s", conf.model.name, len(patched),
             m.sketch.value, m.rho, f", {m.bits}-bit rows (group {m.group})" if m.bits else "")
    compact, a = [], conf.activations
    if not a.stored:
        compact = patch_activations(model, dropout=a.dropout.value, attention=a.attention.value,
                                    gelu_bits=a.gelu_bits, gelu_code=a.gelu_code.value,
                                    layernorm=a.layernorm.value, preset=a.preset.value,
                                    code_bits=a.code_bits, code_group=m.group,
                                    floor_bits=a.floor_bits)
        log.info("%s: activations %s (dropout %s, attention %s, GELU %s-bit %s, LayerNorm %s, "
                 "floor %s-bit): %d modules", conf.model.name, a.preset.value, a.dropout.value,
                 a.attention.value, a.gelu_bits, a.gelu_code.value, a.layernorm.value,
                 a.floor_bits, len(compact))
    return patched, compact

