"""The README's "Use it in your own code" snippets, run as they are written. They name
``roberta-base``; here that name is replaced by a folder holding a tiny random RoBERTa and a
word-level tokenizer (no download), and the names the README says are yours (``loader``,
``train_dataset``) are provided."""

import re

import pytest
import torch
from datasets import Dataset
from torch import nn
from transformers import AutoModelForSequenceClassification, RobertaConfig

from sketchprop import RandomizedLinear
from sketchprop.config import REPO_ROOT
from sketchprop.train import _word_tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")

SENTENCES = ["the cat sees the dog", "a red bird runs near the old house", "the river is blue",
             "an old stone tree", "the dog runs with a cat", "a new house near the river"] * 3


def snippets() -> list[str]:
    text = (REPO_ROOT / "README.md").read_text()
    section = text.split("\n## Use it in your own code\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", section, flags=re.S)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A folder that from_pretrained reads as it would roberta-base's."""
    folder = tmp_path_factory.mktemp("tiny-roberta")
    tokenizer = _word_tokenizer(SENTENCES, vocab_size=100)
    config = RobertaConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2,
                           num_attention_heads=2, intermediate_size=64,
                           max_position_embeddings=40, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    AutoModelForSequenceClassification.from_config(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder, tokenizer


def local(code: str, folder) -> str:
    assert '"roberta-base"' in code
    return code.replace('"roberta-base"', repr(str(folder)))


def test_the_section_has_three_snippets():
    assert len(snippets()) == 3


def test_plain_pytorch_loop():
    namespace = {}
    during = []

    def loader():
        g = torch.Generator().manual_seed(0)
        for _ in range(3):
            model = namespace["model"]  # the snippet has made and patched it by now
            during.append((type(model[0]), model[0].weight, model[0].weight.detach().clone()))
            yield torch.randn(4, 16, 512, generator=g), torch.randn(4, 16, 512, generator=g)

    namespace["loader"] = loader()
    exec(snippets()[0], namespace)
    model = namespace["model"]
    assert [t for t, _, _ in during] == [RandomizedLinear] * 3
    assert type(model[0]) is nn.Linear and type(model[2]) is nn.Linear  # unpatched at the end
    _, weight, start = during[0]
    assert model[0].weight is weight and not torch.equal(weight.detach(), start)  # it trained


def test_hugging_face_trainer(checkpoint, tmp_path, monkeypatch):
    folder, tokenizer = checkpoint
    monkeypatch.chdir(tmp_path)  # the snippet's output folder "out"
    data = dict(tokenizer(SENTENCES, truncation=True, max_length=32))
    data["labels"] = [i % 2 for i in range(len(SENTENCES))]
    namespace = {"train_dataset": Dataset.from_dict(data)}
    exec(local(snippets()[1], folder), namespace)
    model, trainer = namespace["model"], namespace["trainer"]
    assert trainer.state.global_step == 9  # 18 examples, batch 8, 3 epochs
    query = model.roberta.encoder.layer[0].attention.self.query
    assert isinstance(query, RandomizedLinear) and type(model.classifier.dense) is nn.Linear
    fresh = AutoModelForSequenceClassification.from_pretrained(folder, num_labels=2)
    assert not torch.equal(query.weight.detach(),
                           fresh.roberta.encoder.layer[0].attention.self.query.weight)


def test_peft_lora(checkpoint):
    folder, tokenizer = checkpoint
    namespace = {}
    exec(local(snippets()[2], folder), namespace)
    model = namespace["model"]
    patched = [n for n, m in model.named_modules() if isinstance(m, RandomizedLinear)]
    assert len(patched) == 4 and all(n.endswith(("query.lora_A.default", "value.lora_A.default"))
                                     for n in patched)
    batch = tokenizer(SENTENCES[:4], padding=True, return_tensors="pt")
    model(**batch, labels=torch.tensor([0, 1, 0, 1])).loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    assert all(grads[f"{n}.weight"] is not None for n in patched)
    assert all(g is None for n, g in grads.items() if "base_layer" in n)
    assert any(g is not None and g.abs().sum() > 0 for n, g in grads.items() if "lora_B" in n)
