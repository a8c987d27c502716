"""Hydra config schemas: one dataclass per config group, registered in the ConfigStore.

Every YAML file of a group starts from its schema (``defaults: [/schema/<group>@_here_, _self_]``)
and the root config from :class:`Config`, so a misspelt key or a value of the wrong type fails when
the config is composed. The sketch name and the metric names are enums (also checked at compose
time). Ranges (``rho`` in (0, 1], positive sizes, ...) are checked by each schema's
``__post_init__``, which OmegaConf runs only when it builds the objects: :func:`validate` does that,
and the training entry point calls it before anything else.

Groups (files under ``configs/``): task, model, method, adapter, activations, train, logger, experiment
(``# @package _global_`` overrides of the root :class:`Config`, so they may set any key),
hydra/launcher.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import math
import os
import typing
from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

from .. import activations
from ..allocation import ALLOCATIONS
from ..layers import DEFAULT_MIN_ROWS
from ..patching import PRESETS
from ..quantize import BITS, DEFAULT_GROUP
from ..sketches import SKETCHES
from .paths import REPO_ROOT

__all__ = [
    "CONFIG_DIR",
    "REPO_ROOT",
    "AdapterConfig",
    "ActivationsConfig",
    "Config",
    "ConfigError",
    "DataConfig",
    "LoggerConfig",
    "MethodConfig",
    "ModelConfig",
    "TaskConfig",
    "TrainConfig",
    "compose",
    "validate",
]

#: ``configs/`` at the repository root, where ``python -m sketchprop.train`` reads its configs.
CONFIG_DIR = REPO_ROOT / "configs"


class ConfigError(ValueError):
    """A config value is out of range; the message names the key, the value and the fix."""


# Enums make OmegaConf reject an unknown name at compose time, listing the valid ones.
SketchName = enum.Enum("SketchName", {name: name for name in SKETCHES}, type=str)
Metric = enum.Enum("Metric", {m: m for m in ("matthews", "accuracy", "f1", "pearson", "spearman")},
                   type=str)
Precision = enum.Enum("Precision", {p: p for p in ("fp32", "bf16", "fp16")}, type=str)
Allocate = enum.Enum("Allocate", {a: a for a in ALLOCATIONS}, type=str)
WandbMode = enum.Enum("WandbMode", {m: m for m in ("offline", "online", "disabled")}, type=str)
AdapterName = enum.Enum("AdapterName", {a: a for a in ("none", "lora")}, type=str)
DropoutMode = enum.Enum("DropoutMode", {m: m for m in activations.DROPOUT}, type=str)
AttentionMode = enum.Enum("AttentionMode", {m: m for m in activations.ATTENTION}, type=str)
GeluCodeName = enum.Enum("GeluCodeName", {m: m for m in activations.GELU_CODES}, type=str)
LayerNormMode = enum.Enum("LayerNormMode", {m: m for m in activations.LAYERNORM}, type=str)
Preset = enum.Enum("Preset", {m: m for m in PRESETS}, type=str)


def _check(ok: bool, key: str, value: Any, expected: str) -> None:
    if not ok:
        raise ConfigError(f"{key}={value!r} is invalid: expected {expected}")


@dataclass
class DevSet:
    """One dev set of a task: the hub split, the TSV file, and a suffix for its metric names."""

    split: str = "validation"
    file: str = "dev.tsv"
    suffix: str = ""  # "_mm" for MNLI mismatched, as HF run_glue names it


@dataclass
class TaskConfig:
    """A GLUE task: its data, how to score it, and the authors' batch size and learning rate."""

    name: str = MISSING  # the nyu-mll/glue config name: cola, sst2, ...
    dir: str = MISSING  # its folder in the classic GLUE layout: CoLA, SST-2, ...
    text_columns: list[str] = MISSING  # one column, or a sentence pair
    labels: list[str] = MISSING  # label names in hub order; one entry (the score) for regression
    metrics: list[Metric] = MISSING  # the first is the paper's metric (picks the best epoch)
    dev: list[DevSet] = field(default_factory=lambda: [DevSet()])
    batch_size: int = MISSING
    learning_rate: float = MISSING

    @property
    def regression(self) -> bool:
        return len(self.labels) == 1

    def __post_init__(self):
        _check(len(self.text_columns) in (1, 2), "task.text_columns", self.text_columns,
               "one column or a pair")
        _check(len(self.labels) >= 1, "task.labels", self.labels, "at least one label")
        _check(len(self.metrics) >= 1, "task.metrics", self.metrics, "at least one metric")
        _check(self.batch_size >= 1, "task.batch_size", self.batch_size, "an integer >= 1")
        _check(self.learning_rate > 0, "task.learning_rate", self.learning_rate, "a number > 0")


@dataclass
class RandomModel:
    """Size of a randomly initialised RoBERTa (``model.random``) with a locally built tokenizer."""

    hidden_size: int = 32
    num_hidden_layers: int = 2
    num_attention_heads: int = 2
    intermediate_size: int = 64
    vocab_size: int = 2000  # at most this many word-level tokens, learned from the training texts

    def __post_init__(self):
        _check(self.hidden_size % self.num_attention_heads == 0, "model.random.hidden_size",
               self.hidden_size, "a multiple of model.random.num_attention_heads")


@dataclass
class ModelConfig:
    """``name`` goes into results; ``name_or_path`` is a hub id or a folder; null = ``random``."""

    name: str = MISSING
    name_or_path: str | None = None
    random: RandomModel | None = None

    def __post_init__(self):
        _check((self.name_or_path is None) != (self.random is None), "model.name_or_path",
               self.name_or_path, "either a hub id / folder or model.random, not both")


@dataclass
class MethodConfig:
    """How the nn.Linear layers are patched (``sketch: exact`` leaves the model unpatched)."""

    sketch: SketchName = MISSING
    rho: float = MISSING
    targets: str | None = None  # regex on module names; null = every nn.Linear
    exclude: str | None = None  # null patches the classifier head too, as the paper does
    share_inputs: bool = True
    skip_padding: bool = True
    min_rows: int = DEFAULT_MIN_ROWS
    # Regex on patched layer names whose D2_SGD / D2_RMM are recorded every step (result.json
    # key "variance", wandb "variance/<layer>/..."); costs B floats of memory per tracked layer.
    track_variance: str | None = None
    # uniform: every layer at rho; variance: the same stored bytes, rows moved to the layers with
    # the noisiest gradients, learned online (sketchprop.allocation)
    allocate: Allocate = Allocate.uniform
    # Store the rows kept for dW (the sketch's, or X itself with sketch: exact, which then patches
    # the model) as packed b-bit codes with unbiased rounding; null stores them as they are.
    bits: int | None = None
    group: int = DEFAULT_GROUP  # columns per scale of the b-bit codes

    def __post_init__(self):
        _check(0.0 < self.rho <= 1.0, "method.rho", self.rho,
               "a compression rate in (0, 1], e.g. method.rho=0.1")
        _check(self.min_rows >= 1, "method.min_rows", self.min_rows, "an integer >= 1")
        _check(self.bits is None or self.bits in BITS, "method.bits", self.bits,
               f"null or one of {', '.join(map(str, BITS))}, e.g. method.bits=4")
        _check(self.group >= 8 and self.group % 8 == 0, "method.group", self.group,
               "a positive multiple of 8, e.g. method.group=64")

    @property
    def patches(self) -> bool:
        """Whether the linear layers are patched: every sketch, and exact with ``bits``."""
        return self.sketch.value != "exact" or self.bits is not None


@dataclass
class AdapterConfig:
    """Parameter-efficient fine-tuning. ``none``: every weight trains. ``lora``: peft LoRA of rank
    ``r`` on the modules named ``target_modules``; the model's weights are frozen, the adapters and
    the new head train. The keys other than ``name`` belong to ``lora`` and stay null for ``none``."""

    name: AdapterName = MISSING
    r: int | None = None
    alpha: float | None = None  # the adapter's output is scaled by alpha / r
    dropout: float | None = None  # LoRA dropout on the adapter's input
    target_modules: list[str] | None = None  # module names (peft matches them as suffixes)

    def __post_init__(self):
        keys = ("r", "alpha", "dropout", "target_modules")
        if self.name == AdapterName.none:
            for key in keys:
                _check(getattr(self, key) is None, f"adapter.{key}", getattr(self, key),
                       "null with adapter=none (set it with adapter=lora)")
            return
        _check(self.r is not None and self.r >= 1, "adapter.r", self.r, "an integer >= 1")
        _check(self.alpha is not None and self.alpha > 0, "adapter.alpha", self.alpha,
               "a number > 0")
        _check(self.dropout is not None and 0.0 <= self.dropout < 1.0, "adapter.dropout",
               self.dropout, "a probability in [0, 1)")
        _check(bool(self.target_modules), "adapter.target_modules", self.target_modules,
               "a list of module names, e.g. [query, value]")


@dataclass
class ActivationsConfig:
    """What backward keeps besides the linear inputs (``sketchprop.patch_activations``). The
    defaults keep everything as the model does (``activations=stored``); ``activations=compact``
    turns the recommended parts on."""

    dropout: DropoutMode = DropoutMode.stored  # seeded: masks made again from a saved seed
    attention: AttentionMode = AttentionMode.stored  # recompute: probabilities redone in backward
    gelu_bits: int | None = None  # bits of the code of GELU's derivative; null keeps its input
    gelu_code: GeluCodeName = GeluCodeName.stochastic  # stochastic (unbiased) or optimal (biased)
    # output: LayerNorm's backward from its output (exact to float32 rounding). Stored here, so
    # that the runs filed before it keep their identity; the library's default set has it on.
    layernorm: LayerNormMode = LayerNormMode.stored
    # lean (activations=lean): LayerNorm outputs and attention inputs kept once, as code_bits-bit
    # codes (groups of method.group) that the next layers share; a label here, the parts say it.
    preset: Preset = Preset.compact
    code_bits: int = 4  # width of the codes the "coded" parts keep
    # the generic floor: what no part handles, as one floor_bits-bit code per saved storage
    floor_bits: int | None = None

    @property
    def stored(self) -> bool:
        """True when nothing is changed: the model is left unpatched."""
        return (self.dropout == DropoutMode.stored and self.attention == AttentionMode.stored
                and self.gelu_bits is None and self.layernorm == LayerNormMode.stored
                and self.preset == Preset.compact and self.floor_bits is None)

    def __post_init__(self):
        _check(self.gelu_bits is None or 1 <= self.gelu_bits <= 8, "activations.gelu_bits",
               self.gelu_bits, "null or an integer in 1..8, e.g. activations.gelu_bits=2")
        _check(self.code_bits in BITS, "activations.code_bits", self.code_bits,
               f"one of {list(BITS)}, e.g. activations.code_bits=4")
        _check(self.floor_bits is None or self.floor_bits in BITS, "activations.floor_bits",
               self.floor_bits, f"null or one of {list(BITS)}, e.g. activations.floor_bits=4")


@dataclass
class TrainConfig:
    """The optimisation recipe; batch size and learning rate default to the task's."""

    seed: int = 1
    epochs: float = MISSING
    max_steps: int = -1  # > 0 overrides epochs (cheap tests and smoke runs)
    batch_size: int = MISSING
    eval_batch_size: int = MISSING
    learning_rate: float = MISSING
    weight_decay: float = MISSING
    adam_beta1: float = MISSING
    adam_beta2: float = MISSING
    adam_epsilon: float = MISSING
    lr_scheduler: str = MISSING  # an HF lr_scheduler_type
    warmup_ratio: float = MISSING
    max_length: int = MISSING
    precision: Precision = Precision.fp32
    logging_steps: int = 50
    # HF gradient checkpointing: keep only each encoder layer's input, recompute the rest in
    # backward (sketchprop.layers.RandomizedLinear says what a recomputed sketch does).
    gradient_checkpointing: bool = False
    checkpoint: bool = True  # save one every epoch (an interrupted run resumes); deleted at the end
    resume: bool = True  # continue an interrupted run from its newest complete checkpoint

    def __post_init__(self):
        _check(math.isfinite(self.epochs) and self.epochs > 0, "train.epochs", self.epochs,
               "a number > 0")
        _check(self.max_steps == -1 or self.max_steps > 0, "train.max_steps", self.max_steps,
               "-1 (use train.epochs) or an integer > 0")
        for key in ("batch_size", "eval_batch_size", "max_length", "logging_steps"):
            _check(getattr(self, key) >= 1, f"train.{key}", getattr(self, key), "an integer >= 1")
        _check(self.learning_rate > 0, "train.learning_rate", self.learning_rate, "a number > 0")
        _check(0.0 <= self.warmup_ratio < 1.0, "train.warmup_ratio", self.warmup_ratio,
               "a fraction in [0, 1)")


@dataclass
class LoggerConfig:
    """``name: wandb`` logs through the HF Trainer; ``name: none`` logs nothing."""

    name: str = MISSING
    project: str = "sketchprop"
    entity: str | None = None
    mode: WandbMode = WandbMode.offline  # logger.mode=online to sync

    def __post_init__(self):
        _check(self.name in ("wandb", "none"), "logger.name", self.name, "'wandb' or 'none'")


@dataclass
class DataConfig:
    glue_dir: str | None = None  # folder in the classic GLUE layout; null = hub nyu-mll/glue
    max_train_samples: int | None = None  # the first N training examples (as HF run_glue)
    max_eval_samples: int | None = None  # the first N examples of each dev set

    def __post_init__(self):
        for key in ("max_train_samples", "max_eval_samples"):
            value = getattr(self, key)
            _check(value is None or value >= 1, f"data.{key}", value, "null or an integer >= 1")


@dataclass
class Config:
    """The root config (``configs/config.yaml``)."""

    task: TaskConfig = MISSING
    model: ModelConfig = MISSING
    method: MethodConfig = MISSING
    adapter: AdapterConfig = MISSING
    activations: ActivationsConfig = MISSING
    train: TrainConfig = MISSING
    logger: LoggerConfig = MISSING
    data: DataConfig = field(default_factory=DataConfig)
    experiment_name: str | None = None  # null: the chosen experiment file's name, else "default"
    keep: bool = False  # file the result under results_dir (tracked; the tables read it)
    results_dir: str = MISSING
    scratch_results_dir: str = MISSING  # where results of runs not kept are filed
    checkpoints_dir: str = MISSING
    overwrite: bool = False  # rerun even if the result JSON exists
    threads: int | None = None  # torch threads; null: the cores this process may use

    def __post_init__(self):
        _check(self.threads is None or self.threads >= 1, "threads", self.threads,
               "null (the cores this process may use) or an integer >= 1")


def _package_model_path(package: str) -> str:
    """``${sp.package_model:pkg}``: the model folder that ``pkg.get_model_path()`` returns."""
    import importlib

    try:
        module = importlib.import_module(package)
    except ImportError:
        raise ConfigError(
            f"model package {package!r} is not installed: pip install {package.replace('_', '-')}"
        ) from None
    return str(module.get_model_path())


def _sweep_subdir(overrides: str, seed: Any) -> str:
    """``${sp.sweep_subdir:...}``: ``<overrides less seed>/seed=<seed>``, never an absolute path."""
    return f"{overrides.replace('/', '_') or 'default'}/seed={seed}"


def _run_id() -> str:
    """``${sp.run_id:}``: the process id that makes a run's folder its own (two runs started in the
    same second get two folders). Under torchrun the launcher's, so the ranks of one run share one."""
    return str(os.getppid() if "TORCHELASTIC_RUN_ID" in os.environ else os.getpid())


def register() -> None:
    """Register the schemas and the ``sp.*`` resolvers (idempotent; done on import)."""
    cs = ConfigStore.instance()
    cs.store(group="schema", name="config", node=Config)
    for group, node in [("task", TaskConfig), ("model", ModelConfig), ("method", MethodConfig),
                        ("adapter", AdapterConfig), ("activations", ActivationsConfig),
                        ("train", TrainConfig),
                        ("logger", LoggerConfig)]:
        cs.store(group="schema", name=group, node=node)
    OmegaConf.register_new_resolver("sp.repo", lambda: str(REPO_ROOT), replace=True)
    OmegaConf.register_new_resolver("sp.package_model", _package_model_path, replace=True)
    OmegaConf.register_new_resolver("sp.sweep_subdir", _sweep_subdir, replace=True)
    OmegaConf.register_new_resolver("sp.run_id", _run_id, replace=True)


register()


def _unknown_keys(node: Any, schema: type, prefix: str = ""):
    """Yield ``(dotted key, closest valid key or None)`` for every key of ``node`` that
    ``schema`` (a dataclass, searched recursively) does not know."""
    if not isinstance(node, DictConfig):
        return
    hints = typing.get_type_hints(schema)
    names = [f.name for f in dataclasses.fields(schema)]
    for key in node.keys():
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=1)
            yield f"{prefix}{key}", (f"{prefix}{close[0]}" if close else None), names
            continue
        kind = hints[key]
        args = [a for a in typing.get_args(kind) if a is not type(None)]
        inner = args[0] if typing.get_origin(kind) is not None and len(args) == 1 else kind
        child = node._get_node(key)
        if dataclasses.is_dataclass(inner) and isinstance(child, DictConfig):
            yield from _unknown_keys(child, inner, f"{prefix}{key}.")
        elif dataclasses.is_dataclass(inner) and OmegaConf.is_list(child):
            for i, item in enumerate(child):
                yield from _unknown_keys(item, inner, f"{prefix}{key}[{i}].")


def validate(cfg: DictConfig) -> Config:
    """Check that every key is known to a schema, resolve ``cfg`` and run every schema's
    checks; returns the typed :class:`Config`.

    Raises :class:`ConfigError` naming the bad key and value (for an unknown key, the closest
    valid one). Keys added with Hydra's ``+`` bypass the schemas at composition; they fail here.
    """
    for key, close, valid in _unknown_keys(cfg, Config):
        hint = f"did you mean {close}?" if close else f"valid keys here: {', '.join(valid)}"
        raise ConfigError(f"unknown config key {key!r}: {hint} (no schema in "
                          f"sketchprop.glue.config defines it)")
    try:
        return OmegaConf.to_object(cfg)
    except ConfigError:
        raise
    except Exception as err:  # OmegaConf's own errors already name the key
        raise ConfigError(str(err)) from None


def compose(overrides: list[str] | tuple[str, ...] = (), config_name: str = "config") -> DictConfig:
    """Compose ``configs/config.yaml`` with Hydra overrides (no run folder) and validate it.

    >>> cfg = compose(["task=rte", "model=minilm", "method.rho=0.2"])
    """
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = hydra_compose(config_name=config_name, overrides=list(overrides))
    validate(cfg)
    return cfg
