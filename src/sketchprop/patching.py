"""Module surgery: swap linear layers (``nn.Linear`` and transformers' ``Conv1D``) for
:class:`RandomizedLinear` and back.

Every argument and every match is checked before the first module is replaced, so a bad call leaves
the model untouched. The replacement reuses the original ``weight`` and ``bias`` Parameters: state_dict
keys, tied weights, optimizer parameter groups and pretrained loading are unchanged.
"""

from __future__ import annotations

import inspect
import re
from collections import Counter
from collections.abc import Mapping

from torch import Tensor, nn

from .allocation import ALLOCATIONS, VarianceAllocation
from .layers import DEFAULT_MIN_ROWS, RandomizedLinear, SketchContext, conv1d_class, resolve_rho
from .sketches import get_sketch
from .variance import VarianceTracker, estimator_design, select_layers

__all__ = ["DEFAULT_EXCLUDE", "patch_linear", "unpatch_linear", "find_linear"]

_HOOKS = "_sketchprop_hooks"

#: Left exact unless ``exclude`` says otherwise: a language model's output layer. Its weight is tied
#: to the input embedding in most language models (GPT-2, Llama, T5), so a sketched gradient there
#: adds noise to every token's embedding, and its memory is the logits it produces, not its input.
DEFAULT_EXCLUDE = r"(^|\.)lm_head(\.|$)"


def _is_linear(module: nn.Module) -> bool:
    """An ``nn.Linear`` (not a subclass: see :func:`patch_linear`) or transformers' Conv1D."""
    conv1d = conv1d_class()
    return type(module) is nn.Linear or (conv1d is not None and type(module) is conv1d)


def _compile(pattern: str | None, what: str) -> re.Pattern | None:
    if pattern is None:
        return None
    try:
        return re.compile(pattern)
    except re.error as err:
        raise ValueError(f"{what} is not a valid regex: {pattern!r} ({err})") from None


def find_linear(model: nn.Module, targets: str | None = None,
                exclude: str | None = DEFAULT_EXCLUDE) -> list[str]:
    """Qualified names of the linear layers (``nn.Linear``, transformers' ``Conv1D``) of ``model``
    that ``patch_linear`` would replace.

    A name is selected when ``targets`` (a regex, ``re.search``) matches it, or ``targets`` is None,
    and ``exclude`` does not match it. Modules already patched are not selected.
    """
    return [name for name, mod in _matching(model, targets, exclude) if _is_linear(mod)]


def _matching(model: nn.Module, targets: str | None, exclude: str | None):
    inc, exc = _compile(targets, "targets"), _compile(exclude, "exclude")
    return [(name, mod) for name, mod in model.named_modules()
            if (inc is None or inc.search(name)) and not (exc is not None and exc.search(name))]


def _no_match(model: nn.Module, targets: str | None, exclude: str | None) -> str:
    """Why nothing was selected: how many linear layers the model has, and the types of the
    matched modules that hold weights of their own (a layer type patch_linear does not know)."""
    n_linear = sum(_is_linear(m) for m in model.modules())
    others = Counter(type(mod).__name__ for _, mod in _matching(model, targets, exclude)
                     if not _is_linear(mod) and next(mod.parameters(recurse=False), None) is not None)
    message = (f"targets={targets!r} exclude={exclude!r} match no nn.Linear or Conv1D "
               f"(the model has {n_linear})")
    if others:
        listed = ", ".join(f"{name} ({n})" for name, n in sorted(others.items()))
        message += (f"; the modules they match with weights of their own are {listed}, which "
                    f"patch_linear does not replace (it knows nn.Linear and transformers' Conv1D)")
    return message


#: Arguments of an encoder-decoder's forward that give the decoder's sequence length.
_DECODER_INPUTS = ("decoder_input_ids", "decoder_inputs_embeds", "labels")


def _mask_hook(context: SketchContext, model: nn.Module):
    """A forward pre-hook that hands the call's ``attention_mask`` to ``context``.

    Rows are matched to the mask by shape. In an encoder-decoder (T5) the mask is the encoder's,
    and a decoder sequence of the same length would be masked by it although its rows carry
    gradient: such a call skips no rows (the weight gradient stays unbiased, it saves less).
    """
    try:
        signature = inspect.signature(model.forward)
    except (TypeError, ValueError):
        signature = None
    encoder_decoder = bool(getattr(getattr(model, "config", None), "is_encoder_decoder", False))

    def hook(module, args, kwargs):
        arguments = kwargs
        if signature is not None and args:
            try:
                arguments = signature.bind_partial(*args, **kwargs).arguments
            except TypeError:
                pass
        mask = arguments.get("attention_mask")
        if encoder_decoder and isinstance(mask, Tensor) and mask.dim() == 2:
            decoder = (arguments.get(key) for key in _DECODER_INPUTS)
            if any(isinstance(t, Tensor) and t.dim() >= 2 and t.shape[1] == mask.shape[1]
                   for t in decoder):
                mask = None
        context.set_mask(mask)

    return hook


def patch_linear(
    model: nn.Module,
    sketch: str = "gaussian",
    rho: float | Mapping[str, float] = 0.1,
    targets: str | None = None,
    exclude: str | None = DEFAULT_EXCLUDE,
    share_inputs: bool = True,
    skip_padding: bool = True,
    min_rows: int = DEFAULT_MIN_ROWS,
    seed: int = 0,
    track_variance=None,
    allocate: str = "uniform",
) -> list[str]:
    """Replace the linear layers of ``model`` in place by :class:`RandomizedLinear`.

    Linear layers are ``nn.Linear`` modules (exactly that type: a subclass may be used otherwise,
    as ``nn.MultiheadAttention`` reads its output projection's weight without calling it) and
    transformers' ``Conv1D`` (GPT-2's; its ``(in, out)`` weight is kept as it is, see
    :class:`RandomizedLinear`).

    Args:
        model: any ``nn.Module``; patched in place.
        sketch: a name in :data:`~sketchprop.SKETCHES`.
        rho: compression rate in (0, 1], or a mapping ``{regex: rho}`` (first match wins) for a rate per
            layer; every selected layer must match a key.
        targets: regex on qualified module names (``re.search``); default: every linear layer.
        exclude: regex of names to leave alone (e.g. ``"classifier"``); default
            :data:`DEFAULT_EXCLUDE`, a language model's ``lm_head``. None excludes nothing.
        share_inputs: layers that read the same tensor (Q, K, V) share one sketch and one stored
            ``S^T X``, instead of storing ``3 * rho`` of their common input.
        skip_padding: rows where the model's ``attention_mask`` is 0 are left out of ``B``. Their
            output gradient is exactly zero in encoder classification and in a causal LM padded on
            the right with padding labels -100 (as HF's collators make them), so the estimate stays
            unbiased and the whole row budget goes to real tokens. Do not use it where padding rows
            carry gradient: a causal LM padded on the left predicts its first real token from a
            padding row. In an encoder-decoder it skips the encoder's padding rows.
        min_rows: ``B_proj`` is at least this many rows (at most ``B``).
        seed: run seed; each layer's sketch stream is seeded by it and the layer's name.
        track_variance: layers whose gradient variance to record each step (see
            :mod:`sketchprop.variance`): a regex on the replaced names, a list of them, or True for
            all. Each gets a :class:`~sketchprop.variance.VarianceTracker` (``B`` floats of saved
            memory per forward); read the records with ``sketchprop.variance.collect(model)``.
        allocate: ``"uniform"`` (every layer at its ``rho``) or ``"variance"``: keep the total
            stored bytes of the uniform rates and move rows between layers to minimise the summed
            normalised gradient variance, learned online (:mod:`sketchprop.allocation`).

    Returns:
        The qualified names of the replaced modules, in module order.

    Raises:
        ValueError: unknown sketch, ``rho`` outside (0, 1], invalid regex, a model already patched,
            patterns that match no linear layer (the message names the types of the matched
            modules that hold weights of their own: a layer type it does not know), a
            ``track_variance`` that selects no replaced layer (or names one that is not replaced),
            or an unknown ``allocate``. Nothing is changed when it raises.
    """
    sketch_obj = get_sketch(sketch)
    if getattr(model, _HOOKS, None) is not None:
        raise ValueError("model is already patched; call unpatch_linear(model) first")
    names = find_linear(model, targets, exclude)
    if not names:
        raise ValueError(_no_match(model, targets, exclude))
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
        hooks.append(model.register_forward_pre_hook(_mask_hook(context, model),
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
    """Put the original layers (``nn.Linear`` or ``Conv1D``, same Parameters) back in place of
    every :class:`RandomizedLinear` and remove the hooks ``patch_linear`` added. Returns the names."""
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
