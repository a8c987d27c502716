"""The package's modules import each other without a cycle, counting imports inside functions: the
closed-form variances and estimators do not need the layer classes."""

import ast
import os
import subprocess
import sys
from pathlib import Path

import sketchprop

PACKAGE = Path(sketchprop.__file__).parent


def module_name(path: Path) -> str:
    """The dotted name of a module of the package, relative to it (``activations.gelu``; a
    subpackage's ``__init__`` is the subpackage)."""
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def internal_imports(path: Path) -> set[str]:
    """Dotted names (relative to the package) of what ``path`` imports from the package anywhere
    (top level or in a function): a module, or for ``from X import a`` also ``X.a``."""
    package = path.parent.relative_to(PACKAGE).parts  # where ``from .`` starts
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = package[:len(package) - node.level + 1]
            target = ".".join([*base, *(node.module or "").split(".")]).strip(".")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "sketchprop":
            target = node.module.removeprefix("sketchprop").lstrip(".")
        else:
            continue
        out.add(target)
        out.update(f"{target}.{alias.name}".strip(".") for alias in node.names)
    return out


def import_graph() -> dict[str, set[str]]:
    paths = [p for p in PACKAGE.rglob("*.py") if p != PACKAGE / "__init__.py"]
    modules = {module_name(p): p for p in paths}
    return {m: (internal_imports(p) & modules.keys()) - {m} for m, p in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node):
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_no_import_cycle():
    graph = import_graph()
    assert graph["layers"] >= {"functional", "sketches"}  # the scan sees real imports
    assert graph["activations.gelu"] >= {"rng", "activations.seeds"}  # and inside subpackages
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_the_scan_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_estimators_do_not_need_the_layers():
    graph = import_graph()
    assert graph["variance"] == {"sketches", "quantize"}  # the closed forms of both kinds
    # quantize's own helpers: the fused-function wrapper, the bit packing and the random stream
    assert graph["sketches"] == set() and graph["quantize"] == {"compiling", "packing", "rng"}


# Blocks the optional dependencies, imports every library module (the pipeline in glue/ and the
# reports in report/, both extras, excepted), patches a small MLP with the defaults and takes a step.
TORCH_ONLY = """
import sys
# As if not installed: importing one raises ModuleNotFoundError, importlib.util.find_spec gives None
# (torch.compiler's import asks it for numpy).
for name in ("transformers", "numpy", "hydra", "omegaconf", "scipy", "peft"):
    sys.modules[name] = None
import importlib, pkgutil, warnings
warnings.simplefilter("ignore")  # torch warns that numpy is missing
import torch
import sketchprop
from sketchprop import patch_activations, patch_linear
for m in pkgutil.walk_packages(sketchprop.__path__, "sketchprop."):
    if not m.name.startswith(("sketchprop.glue", "sketchprop.train", "sketchprop.bench",
                              "sketchprop.report")):
        importlib.import_module(m.name)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Dropout(0.1),
                            torch.nn.LayerNorm(16), torch.nn.Linear(16, 4))
patch_linear(model, exclude=None)
patch_activations(model)
model(torch.randn(5, 8)).square().sum().backward()
print(sorted(type(m).__name__ for m in model))
"""


def test_the_library_imports_with_torch_only():
    """The library needs torch only: transformers and the pipeline's packages are imported inside
    the functions that need them."""
    out = subprocess.run([sys.executable, "-c", TORCH_ONLY], capture_output=True, text=True,
                         timeout=300, env={**os.environ, "PYTHONPATH": str(PACKAGE.parent)})
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[0] == str(sorted(
        ["RandomizedLinear", "CompactGELU", "SeededDropout", "OutputLayerNorm", "RandomizedLinear"]))


#: What ``scripts/gpu_check.sh`` runs on a lent GPU machine, which has torch and transformers only.
GPU_CHECK = """
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {"hydra", "omegaconf", "datasets", "evaluate", "wandb", "peft"}:
            raise ModuleNotFoundError(name)
sys.meta_path.insert(0, Block())
from sketchprop.bench import backward_overhead, layer_step, model_step, saved_tensors
from sketchprop.bench.common import environment
import torch
print(environment(torch.device("cpu"))["command"])
"""


def test_the_gpu_check_needs_torch_and_transformers_only():
    scripts = (PACKAGE.parents[1] / "scripts" / "gpu_check.sh").read_text()
    for script in ("bench_layer", "bench_model", "backward_overhead", "saved_tensors"):
        assert f"scripts/{script}.py" in scripts  # the benchmarks imported above are its own
    out = subprocess.run([sys.executable, "-c", GPU_CHECK], capture_output=True, text=True,
                         timeout=300, env={**os.environ, "PYTHONPATH": str(PACKAGE.parent)})
    assert out.returncode == 0, out.stderr
