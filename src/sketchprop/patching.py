"""Module surgery: swap ``nn.Linear`` layers for :class:`RandomizedLinear` and back.

Every argument and every match is checked before the first module is replaced, so a bad call leaves
the model untouched. The replacement reuses the original ``weight`` and ``bias`` Parameters: state_dict
keys, optimizer parameter groups and pretrained loading are unchanged.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Mapping

from torch import nn

from .allocation import ALLOCATIONS, VarianceAllocation
from .layers import DEFAULT_MIN_ROWS, RandomizedLinear, SketchContext, resolve_rho
from .sketches import get_sketch
from .tracking import select_layers
from .variance import VarianceTracker, estimator_design

__all__ = ["patch_linear", "unpatch_linear", "find_linear"]

_HOOKS = "_sketchprop_hooks"


def _compile(pattern: str | None, what: str) -> re.Pattern | None:
    if pattern is None:
        return None
    try:
        return re.compile(pattern)
    except re.error as err:
        raise ValueError(f"{what} is not a valid regex: {pattern!r} ({err})") from None


def find_linear(model: nn.Module, targets: str | None = None, exclude: str | None = None) -> list[str]:
    """Qualified names of the ``nn.Linear`` modules of ``model`` that ``patch_linear`` would replace.

    A name is selected when ``targets`` (a regex, ``re.search``) matches it, or ``targets`` is None,
    and ``exclude`` does not match it. Modules already patched are not selected.
    """
    inc, exc = _compile(targets, "targets"), _compile(exclude, "exclude")
    return [
        name
        for name, mod in model.named_modules()
        if type(mod) is nn.Linear
        and (inc is None or inc.search(name))
        and not (exc is not None and exc.search(name))
    ]


def _mask_hook(context: SketchContext, forward):
    try:
        signature = inspect.signature(forward)
    except (TypeError, ValueError):
        signature = None

    def hook(module, args, kwargs):
        mask = kwargs.get("attention_mask")
        if mask is None and signature is not None and args:
            try:
                mask = signature.bind_partial(*args, **kwargs).arguments.get("attention_mask")
            except TypeError:
                mask = None
        context.set_mask(mask)

    return hook


def patch_linear(
    model: nn.Module,
    sketch: str = "gaussian",
    rho: float | Mapping[str, float] = 0.1,
    targets: str | None = None,
    exclude: str | None = None,
    share_inputs: bool = True,
    skip_padding: bool = True,
    min_rows: int = DEFAULT_MIN_ROWS,
    seed: int = 0,
    track_variance=None,
    allocate: str = "uniform",
) -> list[str]:
    """Replace ``nn.Linear`` modules of ``model`` in place by :class:`RandomizedLinear`.

    Args:
        model: any ``nn.Module``; patched in place.
        sketch: a name in :data:`~sketchprop.SKETCHES`.
        rho: compression rate in (0, 1], or a mapping ``{regex: rho}`` (first match wins) for a rate per
            layer; every selected layer must match a key.
        targets: regex on qualified module names (``re.search``); default: every ``nn.Linear``.
        exclude: regex of names to leave alone (e.g. ``"classifier"``).
        share_inputs: layers that read the same tensor (Q, K, V) share one sketch and one stored
            ``S^T X``, instead of storing ``3 * rho`` of their common input.
        skip_padding: rows where the model's ``attention_mask`` is 0 are left out of ``B``. Their
            output gradient is exactly zero in encoder classification, so the estimate stays unbiased
            and the whole row budget goes to real tokens. Do not use it where padding rows carry
            gradient.
        min_rows: ``B_proj`` is at least this many rows (at most ``B``).
        seed: run seed; each layer's sketch stream is seeded by it and the layer's name.
        track_variance: layers whose gradient variance to record each step (see
            :mod:`sketchprop.variance`): a regex on the replaced names, a list of them, or True for
            all. Each gets a :class:`~sketchprop.variance.VarianceTracker` (``B`` floats of saved
            memory per forward); read the records with ``sketchprop.tracking.collect(model)``.
        allocate: ``"uniform"`` (every layer at its ``rho``) or ``"variance"``: keep the total
            stored bytes of the uniform rates and move rows between layers to minimise the summed
            normalised gradient variance, learned online (:mod:`sketchprop.allocation`).

    Returns:
        The qualified names of the replaced modules, in module order.

    Raises:
        ValueError: unknown sketch, ``rho`` outside (0, 1], invalid regex, a model already patched,
            patterns that match no ``nn.Linear``, a ``track_variance`` that selects no replaced
            layer (or names one that is not replaced), or an unknown ``allocate``. Nothing is
            changed when it raises.
    """
    sketch_obj = get_sketch(sketch)
    if getattr(model, _HOOKS, None) is not None:
        raise ValueError("model is already patched; call unpatch_linear(model) first")
    names = find_linear(model, targets, exclude)
    if not names:
        n_linear = sum(type(m) is nn.Linear for m in model.modules())
        raise ValueError(
            f"targets={targets!r} exclude={exclude!r} match no nn.Linear "
            f"(the model has {n_linear})"
        )
    rates = {name: resolve_rho(rho, name) for name in names}
    if int(min_rows) < 1:
        raise ValueError(f"min_rows must be >= 1, got {min_rows!r}")
    if allocate not in ALLOCATIONS:
        raise ValueError(f"unknown allocate {allocate!r}; choose one of {list(ALLOCATIONS)}")
    if allocate == "variance":
        estimator_design(sketch_obj, 2, 1)  # the allocation uses the same online estimator
    allocation = VarianceAllocation() if allocate == "variance" else None
    tracked = set(select_layers(names, track_variance))
    if tracked:
        estimator_design(sketch_obj, 2, 1)  # raises for a kind without an online estimator

    context = SketchContext()
    hooks = []
    if skip_padding:
        hooks.append(model.register_forward_pre_hook(_mask_hook(context, model.forward),
                                                     with_kwargs=True))
    setattr(model, _HOOKS, hooks)
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        new = RandomizedLinear.from_linear(
            getattr(parent, child), sketch=sketch_obj, rho=rates[name], min_rows=min_rows,
            seed=seed, name=name, share_inputs=share_inputs, skip_padding=skip_padding,
            context=context,
        )
        if name in tracked:
            new.tracker = VarianceTracker(name)
        new.allocation = allocation
        setattr(parent, child, new)
    return names


def unpatch_linear(model: nn.Module) -> list[str]:
    """Put plain ``nn.Linear`` modules (same Parameters) back in place of every
    :class:`RandomizedLinear` and remove the hooks ``patch_linear`` added. Returns the names."""
    names = [n for n, m in model.named_modules() if isinstance(m, RandomizedLinear)]
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        setattr(parent, child, getattr(parent, child).to_linear())
    for hook in getattr(model, _HOOKS, None) or []:
        hook.remove()
    if hasattr(model, _HOOKS):
        delattr(model, _HOOKS)
    return names
