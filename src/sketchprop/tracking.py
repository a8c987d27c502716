"""Variance tracking on a patched model: attach :class:`~sketchprop.variance.VarianceTracker` s to
its :class:`~sketchprop.layers.RandomizedLinear` layers, collect their records, log them from a
Trainer.

The estimators themselves live in :mod:`sketchprop.variance`, which does not know the layers.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

from torch import nn

from .layers import RandomizedLinear
from .variance import VarianceTracker, estimator_design

__all__ = [
    "select_layers",
    "track_variance",
    "trackers",
    "collect",
    "VarianceCallback",  # noqa: F822 (built on first access, see __getattr__)
]

def select_layers(names: Sequence[str], spec) -> list[str]:
    """The names in ``names`` chosen by ``spec``: a regex (``re.search``), a list of exact names, or
    True (all). ``ValueError`` names a bad regex, unknown names, or a spec that selects nothing."""
    if spec is None or spec is False:
        return []
    if spec is True:
        return list(names)
    if isinstance(spec, str):
        try:
            pattern = re.compile(spec)
        except re.error as err:
            raise ValueError(f"track_variance is not a valid regex: {spec!r} ({err})") from None
        chosen = [n for n in names if pattern.search(n)]
        if not chosen:
            raise ValueError(f"track_variance={spec!r} matches none of the patched layers")
        return chosen
    spec = list(spec)
    unknown = [s for s in spec if s not in names]
    if unknown:
        raise ValueError(f"track_variance names layers that are not patched: {unknown}")
    if not spec:
        raise ValueError("track_variance is an empty list")
    return [n for n in names if n in set(spec)]


def _randomized(model: nn.Module) -> dict[str, RandomizedLinear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, RandomizedLinear)}


def track_variance(model: nn.Module, spec=True) -> list[str]:
    """Attach a :class:`VarianceTracker` to the patched layers of ``model`` that ``spec`` selects
    (see :func:`select_layers`); returns their names. A layer already tracked keeps its tracker."""
    layers = _randomized(model)
    chosen = select_layers(list(layers), spec)
    for name in chosen:
        estimator_design(layers[name].sketch, 2, 1)  # raises for an unsupported kind
        if layers[name].tracker is None:
            layers[name].tracker = VarianceTracker(name)
    return chosen


def trackers(model: nn.Module) -> dict[str, VarianceTracker]:
    """``{layer name: tracker}`` for every tracked layer of ``model``."""
    return {n: m.tracker for n, m in _randomized(model).items()
            if isinstance(m.tracker, VarianceTracker)}


def collect(model: nn.Module) -> list[dict]:
    """All variance records of ``model``'s tracked layers, ordered by step then module order."""
    out = []
    for tracker in trackers(model).values():
        out.extend(tracker.records)
    return sorted(out, key=lambda r: r["step"])  # stable: module order within a step


class _VarianceCallback:
    """HF ``Trainer`` callback for the variance trackers of a patched model.

    - ``on_step_begin`` stamps every tracker with the step being computed (``global_step + 1``, the
      step HF logs it under; gradient-accumulation micro-batches share it).
    - ``on_log`` (main process): the records since the last log, averaged per layer, as
      ``variance/<layer>/<field>`` for ``d2_sgd, d2_rmm, ratio, alpha``; sent to ``log_fn`` if
      given, else to the active wandb run (with ``train/global_step``, as HF's WandbCallback
      does), and kept in ``latest``.
    - ``records`` (any time, e.g. after ``trainer.train()``): every record, for ``result.json``.

    ``track``: if given (a regex, a list of layer names, or True), ``on_train_begin`` attaches
    trackers to those patched layers itself (:func:`track_variance`), so a pipeline need not pass
    ``track_variance`` to ``patch_linear``. ``model`` may be given, or is taken from the Trainer's
    callback arguments. The class subclasses
    ``transformers.TrainerCallback``; it is built on first access so that importing sketchprop does
    not import transformers.
    """

    FIELDS = ("d2_sgd", "d2_rmm", "ratio", "alpha")

    def __init__(self, model: nn.Module | None = None,
                 log_fn: Callable[[dict], None] | None = None, track=None):
        self.model = model
        self.log_fn = log_fn
        self.track = track
        self.latest: dict[str, float] = {}
        self._logged: dict[str, int] = {}

    def _trackers(self, model=None) -> dict[str, VarianceTracker]:
        if self.model is None and model is not None:
            self.model = model
        return trackers(self.model) if self.model is not None else {}

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self._trackers(model)
        if self.track is not None and self.model is not None:
            track_variance(self.model, self.track)
        return control

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        for tracker in self._trackers(model).values():
            tracker.step = state.global_step + 1
        return control

    def on_log(self, args, state, control, model=None, logs=None, **kwargs):
        new = []
        for name, tracker in self._trackers(model).items():
            records = tracker.records
            new.extend(records[self._logged.get(name, 0):])
            self._logged[name] = len(records)
        if not new or not getattr(state, "is_world_process_zero", True):
            return control
        metrics = self.summarize(new)
        self.latest = metrics
        if self.log_fn is not None:
            self.log_fn(dict(metrics))
        else:
            try:
                import wandb
            except ImportError:  # pragma: no cover
                wandb = None
            if wandb is not None and wandb.run is not None:
                wandb.run.log({**metrics, "train/global_step": state.global_step})
        return control

    @classmethod
    def summarize(cls, records: list[dict]) -> dict[str, float]:
        """Per-layer means of ``FIELDS`` over ``records`` (None values skipped)."""
        sums: dict[str, list[float]] = {}
        for r in records:
            for f in cls.FIELDS:
                if r.get(f) is not None:
                    sums.setdefault(f"variance/{r['layer']}/{f}", []).append(r[f])
        return {key: sum(v) / len(v) for key, v in sums.items()}

    @property
    def records(self) -> list[dict]:
        return collect(self.model) if self.model is not None else []


_CALLBACK_CLASS: type | None = None


def __getattr__(name: str):
    if name == "VarianceCallback":
        global _CALLBACK_CLASS
        if _CALLBACK_CLASS is None:
            try:
                from transformers import TrainerCallback
            except ImportError:  # pragma: no cover
                TrainerCallback = object  # noqa: N806
            _CALLBACK_CLASS = type("VarianceCallback", (_VarianceCallback, TrainerCallback),
                                   {"__doc__": _VarianceCallback.__doc__, "__module__": __name__})
        return _CALLBACK_CLASS
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
