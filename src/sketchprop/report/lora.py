"""LoRA with and without the sketch on its adapters (``experiment=lora_cpu``, its own learning
rate), paired by seed as :mod:`sketchprop.report.comparisons` pairs the others.

Writes ``results/tables/lora.md|csv``.
"""

from __future__ import annotations

from pathlib import Path

from .common import key_of
from .comparisons import comparisons

# LoRA (experiment=lora_cpu, its own learning rate): the sketch on the adapters against LoRA alone.
LORA = key_of("exact", "lora")
LORA_COMPARISONS = [("cola", key_of("blocksrht", "lora+ours", 0.1), LORA)]


def lora(runs: list[dict], stem: Path, experiment: str = "lora_cpu") -> None:
    """:data:`LORA_COMPARISONS` paired by seed, written as ``stem``.md|csv."""
    comparisons(runs, experiment, stem, LORA_COMPARISONS,
                "LoRA with and without the sketch on its adapters")
