"""Module surgery on linear layers: :func:`patch_linear` swaps ``nn.Linear`` and transformers'
``Conv1D`` for :class:`~sketchprop.RandomizedLinear` (``RandomizedConv1D``), :func:`unpatch_linear`
swaps them back; and the selection by type and qualified-name regexes that
:func:`~sketchprop.patching.activations.patch_activations` shares."""

from __future__ import annotations

import logging
import re
from collections import Counter
from collections.abc import Callable, Mapping

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.linear import NonDynamicallyQuantizableLinear
from torch.nn.utils import parametrize

from ..allocation import ALLOCATIONS, VarianceAllocation
from ..layers import (
    CONTEXT_ATTRIBUTE,
    DEFAULT_MIN_ROWS,
    MaskHook,
    RandomizedLinear,
    SketchContext,
    conv1d_class,
    resolve_rho,
)
from ..quantize import DEFAULT_GROUP, check_bits, check_group
from ..sketches import get_sketch
from ..tracking import select_layers
from ..variance import VarianceTracker, estimator_design
from ..wrappers import _transformers_owner, bound, model_to_patch

__all__ = ["DEFAULT_EXCLUDE", "find_linear", "patch_linear", "unpatch_linear"]

_HOOKS = "_sketchprop_hooks"
log = logging.getLogger("sketchprop.patching")

#: Left exact unless ``exclude`` says otherwise: a language model's output layer. Its weight is tied
#: to the input embedding in most language models (GPT-2, Llama, T5), so a sketched gradient there
#: adds noise to every token's embedding, and its memory is the logits it produces, not its input.
DEFAULT_EXCLUDE = r"(^|\.)lm_head(\.|$)"


def _compile(pattern: str | None, what: str) -> re.Pattern | None:
    if pattern is None:
        return None
    try:
        return re.compile(pattern)
    except re.error as err:
        raise ValueError(f"{what} is not a valid regex: {pattern!r} ({err})") from None


def _select(model: nn.Module, kind: Callable[[nn.Module], bool], targets: str | None,
            exclude: str | None) -> list[str]:
    """Qualified names of the modules of ``model`` of the ``kind`` that ``targets`` (a regex,
    ``re.search``; None: all) matches and ``exclude`` does not, in module order."""
    inc, exc = _compile(targets, "targets"), _compile(exclude, "exclude")
    return [
        name
        for name, mod in model.named_modules()
        if kind(mod)
        and (inc is None or inc.search(name))
        and not (exc is not None and exc.search(name))
    ]


def _no_match(what: str, targets, exclude, model: nn.Module, kind, by: str) -> ValueError:
    """Why nothing was selected: how many modules of the kind the model has, and the types of the
    matched modules that hold weights of their own (a layer type the surgery does not know)."""
    count = sum(kind(m) for m in model.modules())
    def other_layer(m: nn.Module) -> bool:
        return not kind(m) and next(m.parameters(recurse=False), None) is not None

    others = Counter(type(model.get_submodule(name)).__name__
                     for name in _select(model, other_layer, targets, exclude))
    message = f"targets={targets!r} exclude={exclude!r} match no {what} (the model has {count})"
    if others:
        listed = ", ".join(f"{name} ({n})" for name, n in sorted(others.items()))
        message += (f"; the modules they match with weights of their own are {listed}, which "
                    f"{by} does not replace")
    return ValueError(message)


def _swap(model: nn.Module, replacements: Mapping[str, nn.Module]) -> list[str]:
    """Put each module of ``replacements`` in place of the module its name points to; returns the
    names. Everything is checked and built before this is called: it only assigns."""
    for name, new in replacements.items():
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, new)
    return list(replacements)


def _computes_linear(module: nn.Linear) -> bool:
    """Whether an ``nn.Linear`` subclass computes ``F.linear(x, weight, bias)`` and holds nothing
    else: no parameters, buffers, children or parametrizations besides its float ``(out, in)``
    ``weight`` Parameter and its ``bias`` (what :class:`~sketchprop.RandomizedLinear` keeps), and
    a forward that is the same map (to float rounding) on a random input with random weights, in
    training and in eval mode (a dropout of the weight differs in training)."""
    weight = module.weight
    if parametrize.is_parametrized(module) or list(module.children()) or list(module.buffers()) \
            or not isinstance(weight, nn.Parameter) or not weight.is_floating_point() \
            or tuple(weight.shape) != (module.out_features, module.in_features) \
            or {n for n, _ in module.named_parameters()} - {"weight", "bias"}:
        return False
    if type(module).forward is nn.Linear.forward:
        return True
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, module.in_features, generator=g).to(weight.device, weight.dtype)
    random = {n: torch.randn(p.shape, generator=g).to(p.device, p.dtype)
              for n, p in module.named_parameters()}
    tol = 1e-5 if weight.dtype in (torch.float32, torch.float64) else 1e-2
    mode = module.training
    try:
        with torch.no_grad():
            for training in (True, False):
                module.train(training)
                got = torch.func.functional_call(module, random, (x,))
                want = F.linear(x, random["weight"], random.get("bias"))
                if not (isinstance(got, torch.Tensor) and torch.allclose(
                        got, want, rtol=tol, atol=tol * float(want.abs().max()))):
                    return False
        return True
    except Exception:  # a forward that cannot run on this input is not the linear map
        return False
    finally:
        module.train(mode)


def _is_linear(module: nn.Module) -> bool:
    """A layer :func:`patch_linear` replaces: an ``nn.Linear``, a subclass whose forward is the
    same linear map (Falcon's ``FalconLinear``), or transformers' Conv1D. Not
    ``nn.MultiheadAttention``'s output projection, which its owner reads without calling it."""
    conv1d = conv1d_class()
    if type(module) is nn.Linear or (conv1d is not None and type(module) is conv1d):
        return True
    return isinstance(module, nn.Linear) and not isinstance(
        module, (RandomizedLinear, NonDynamicallyQuantizableLinear)) and _computes_linear(module)


def _left_linear(model: nn.Module) -> dict[str, str]:
    """The ``nn.Linear`` subclasses of ``model`` that :func:`patch_linear` leaves, by type."""
    return {n: type(m).__name__ for n, m in model.named_modules() if isinstance(m, nn.Linear)
            and not isinstance(m, RandomizedLinear) and not _is_linear(m)}


def find_linear(model: nn.Module, targets: str | None = None,
                exclude: str | None = DEFAULT_EXCLUDE) -> list[str]:
    """Qualified names of the linear layers (``nn.Linear``, transformers' ``Conv1D``) of ``model``
    that ``patch_linear`` would replace.

    A name is selected when ``targets`` (a regex, ``re.search``) matches it, or ``targets`` is None,
    and ``exclude`` does not match it. Modules already patched are not selected.
    """
    return _select(model, _is_linear, targets, exclude)


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
    bits: int | None = None,
    group: int = DEFAULT_GROUP,
) -> list[str]:
    """Replace the linear layers of ``model`` in place by :class:`RandomizedLinear`.

    Linear layers are ``nn.Linear`` modules, subclasses of it whose forward is the same linear
    map (checked on a random input: Falcon's ``FalconLinear``; ``nn.MultiheadAttention``'s output
    projection, read by its owner without a call, is not one), and transformers' ``Conv1D``
    (GPT-2's; its ``(in, out)`` weight is kept as it is, in a ``RandomizedConv1D``, see
    :class:`RandomizedLinear`). The subclasses it leaves are named in one line logged (INFO,
    logger ``sketchprop.patching``).

    On a transformers model, or a peft model around one, the padding hook and the layers' shared
    state go on the transformers model (which ``merge_and_unload`` returns), and its
    ``resize_token_embeddings`` keeps a patched output layer patched (holding the resized
    Parameters) where transformers would put a plain ``nn.Linear`` in its place.

    Args:
        model: any ``nn.Module``, patched in place (in DDP or FSDP1, the model inside).
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
            memory per forward); read the records with ``sketchprop.tracking.collect(model)``.
        allocate: ``"uniform"`` (every layer at its ``rho``) or ``"variance"``: keep the total
            stored bytes of the uniform rates and move rows between layers to minimise the summed
            normalised gradient variance, learned online (:mod:`sketchprop.allocation`).
        bits: store the rows each layer keeps for its weight gradient (the sketch's, or ``X``
            itself with ``sketch="exact"``) as packed 8-, 4- or 2-bit codes with unbiased
            stochastic rounding (:mod:`sketchprop.quantize`); None (default) stores them as they
            are. ``dX`` and ``db`` stay exact.
        group: columns per scale of the codes (default
            :data:`~sketchprop.quantize.DEFAULT_GROUP`).

    Returns:
        The qualified names of the replaced modules, in module order.

    Raises:
        ValueError: unknown sketch, ``rho`` outside (0, 1], invalid regex, a model already patched,
            patterns that match no linear layer (the message names the types of the matched
            modules that hold weights of their own: a layer type it does not know), a
            ``track_variance`` that selects no replaced layer (or names one that is not replaced),
            an unknown ``allocate``, ``bits`` / ``group`` out of their range, or a sharded model
            (patch, then shard: :mod:`sketchprop.wrappers`). Nothing is changed when it raises.
    """
    model = model_to_patch(model, "patch_linear", (nn.Linear, conv1d_class()))
    sketch_obj = get_sketch(sketch)
    bits, group = check_bits(bits), check_group(group)
    if getattr(model, _HOOKS, None) is not None:
        raise ValueError("model is already patched; call unpatch_linear(model) first")
    names = find_linear(model, targets, exclude)
    if not names:
        raise _no_match("nn.Linear or Conv1D", targets, exclude, model, _is_linear,
                        "patch_linear (it knows nn.Linear, its subclasses that compute the "
                        "linear map, and transformers' Conv1D)")
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
    new = {}
    for name in names:
        layer = RandomizedLinear.from_linear(
            model.get_submodule(name), sketch=sketch_obj, rho=rates[name], min_rows=min_rows,
            seed=seed, name=name, share_inputs=share_inputs, skip_padding=skip_padding,
            context=context, bits=bits, group=group,
        )
        if name in tracked:
            layer.tracker = VarianceTracker(name)
        layer.allocation = allocation
        new[name] = layer

    # The hooks and the context go on the transformers model (a peft model's base model, which
    # peft calls with the mask; merge_and_unload keeps the hook), which also starts each call.
    owner = _transformers_owner(model)
    holder = model if owner is None else owner
    hooks = []
    if skip_padding or share_inputs:
        hooks.append(holder.register_forward_pre_hook(MaskHook(holder, skip_padding),
                                                      with_kwargs=True))
        setattr(holder, CONTEXT_ATTRIBUTE, context)
    setattr(holder, _HOOKS, hooks)
    if owner is not None:
        owner.__dict__["resize_token_embeddings"] = bound(_resize_token_embeddings, owner)
    left = _left_linear(model)
    if left:
        log.info("patch_linear(%s): left %s (their forward is not the linear map)",
                 type(model).__name__, ", ".join(f"{n} ({t})" for n, t in left.items()))
    return _swap(model, new)


def unpatch_linear(model: nn.Module) -> list[str]:
    """Put the original layers (``nn.Linear`` or ``Conv1D``, same Parameters) back in place of
    every :class:`RandomizedLinear` and remove the hooks ``patch_linear`` added. Returns the names."""
    model = model_to_patch(model, "unpatch_linear", (RandomizedLinear,))
    names = _select(model, lambda m: isinstance(m, RandomizedLinear), None, None)
    _swap(model, {name: model.get_submodule(name).to_linear() for name in names})
    for module in model.modules():  # the model, or the peft base model that holds the hooks
        own = vars(module)
        for hook in own.pop(_HOOKS, None) or []:
            hook.remove()
        own.pop(CONTEXT_ATTRIBUTE, None)
        if getattr(own.get("resize_token_embeddings"), "func", None) is _resize_token_embeddings:
            del own["resize_token_embeddings"]
    return names


def _resize_token_embeddings(model: nn.Module, *args, **kwargs):
    """transformers' ``resize_token_embeddings`` on a patched model (it takes the method's place).
    The resize replaces an untied output layer by a plain ``nn.Linear`` of the new size: the
    patched layer takes that layer's Parameters and its place back, its settings and seed stream
    kept, so that the model stays patched."""
    patched = {n: m for n, m in model.named_modules() if isinstance(m, RandomizedLinear)}
    out = type(model).resize_token_embeddings(model, *args, **kwargs)
    back = {}
    for name, layer in patched.items():
        new = model.get_submodule(name)
        if new is not layer and type(new) is type(layer.to_linear()):
            layer.hold(new)
            back[name] = layer
    _swap(model, back)
    return out
