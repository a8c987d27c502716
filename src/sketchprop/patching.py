"""Module surgery, the one place that does it: :func:`patch_linear` swaps linear layers
(``nn.Linear`` and transformers' ``Conv1D``) for :class:`RandomizedLinear`,
:func:`patch_activations` swaps dropout and GELU modules for their compact forms
(:mod:`sketchprop.activations`) and switches the attention function; each has an inverse.

Both follow one pattern: select modules by type and by regexes on their qualified names, check
every argument and every match, build every replacement, and only then change the model
(:func:`_swap`), so a bad call leaves it untouched. A replacement reuses the original's Parameters
(the compact activations have none): state_dict keys, tied weights, optimizer parameter groups and
pretrained loading are unchanged.
"""

from __future__ import annotations

import inspect
import re
from collections import Counter
from collections.abc import Callable, Mapping

from torch import Tensor, nn

from . import activations as act
from .allocation import ALLOCATIONS, VarianceAllocation
from .layers import DEFAULT_MIN_ROWS, RandomizedLinear, SketchContext, conv1d_class, resolve_rho
from .quantize import DEFAULT_GROUP, check_bits, check_group
from .sketches import get_sketch
from .tracking import select_layers
from .variance import VarianceTracker, estimator_design

__all__ = ["DEFAULT_EXCLUDE", "patch_linear", "unpatch_linear", "find_linear",
           "patch_activations", "unpatch_activations"]

_HOOKS = "_sketchprop_hooks"
_CONTEXT = "_sketchprop_context"
_ACTIVATIONS = "_sketchprop_activations"

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


def _is_linear(module: nn.Module) -> bool:
    """An ``nn.Linear`` (not a subclass: see :func:`patch_linear`) or transformers' Conv1D."""
    conv1d = conv1d_class()
    return type(module) is nn.Linear or (conv1d is not None and type(module) is conv1d)


def find_linear(model: nn.Module, targets: str | None = None,
                exclude: str | None = DEFAULT_EXCLUDE) -> list[str]:
    """Qualified names of the linear layers (``nn.Linear``, transformers' ``Conv1D``) of ``model``
    that ``patch_linear`` would replace.

    A name is selected when ``targets`` (a regex, ``re.search``) matches it, or ``targets`` is None,
    and ``exclude`` does not match it. Modules already patched are not selected.
    """
    return _select(model, _is_linear, targets, exclude)


#: Arguments of an encoder-decoder's forward that give the decoder's sequence length.
_DECODER_INPUTS = ("decoder_input_ids", "decoder_inputs_embeds", "labels")


def _mask_hook(model: nn.Module):
    """A forward pre-hook that hands the call's ``attention_mask`` to the model's
    :class:`SketchContext` (the one its layers share). The context is looked up on the model
    called, not captured: a ``copy.deepcopy`` of the model (hooks included) feeds its own copy.

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
        context = getattr(module, _CONTEXT, None)
        if context is None:
            return
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
    bits: int | None = None,
    group: int = DEFAULT_GROUP,
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
            an unknown ``allocate``, or ``bits`` / ``group`` out of their range. Nothing is
            changed when it raises.
    """
    sketch_obj = get_sketch(sketch)
    bits, group = check_bits(bits), check_group(group)
    if getattr(model, _HOOKS, None) is not None:
        raise ValueError("model is already patched; call unpatch_linear(model) first")
    names = find_linear(model, targets, exclude)
    if not names:
        raise _no_match("nn.Linear or Conv1D", targets, exclude, model, _is_linear,
                        "patch_linear (it knows nn.Linear and transformers' Conv1D)")
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

    hooks = []
    if skip_padding:
        hooks.append(model.register_forward_pre_hook(_mask_hook(model), with_kwargs=True))
        setattr(model, _CONTEXT, context)
    setattr(model, _HOOKS, hooks)
    return _swap(model, new)


def unpatch_linear(model: nn.Module) -> list[str]:
    """Put the original layers (``nn.Linear`` or ``Conv1D``, same Parameters) back in place of
    every :class:`RandomizedLinear` and remove the hooks ``patch_linear`` added. Returns the names."""
    names = _select(model, lambda m: isinstance(m, RandomizedLinear), None, None)
    _swap(model, {name: model.get_submodule(name).to_linear() for name in names})
    for hook in getattr(model, _HOOKS, None) or []:
        hook.remove()
    for attribute in (_HOOKS, _CONTEXT):
        if hasattr(model, attribute):
            delattr(model, attribute)
    return names


def _is_dropout(module: nn.Module) -> bool:
    return type(module) is nn.Dropout


def _attention_owner(model: nn.Module) -> nn.Module:
    """The transformers model whose attention function ``model`` calls: ``model`` itself, or the
    base model a wrapper holds (a peft model's ``get_base_model()``). Raises unless its attention
    can be switched through ``AttentionInterface``."""
    try:
        from transformers import PreTrainedModel
    except ImportError:  # pragma: no cover
        PreTrainedModel = None  # noqa: N806
    owner = model
    if PreTrainedModel is not None and not isinstance(owner, PreTrainedModel) \
            and callable(getattr(owner, "get_base_model", None)):
        owner = owner.get_base_model()
    if PreTrainedModel is None or not isinstance(owner, PreTrainedModel):
        raise ValueError(f"attention='recompute' needs a transformers PreTrainedModel, got "
                         f"{type(model).__name__}; pass attention='stored'")
    if not owner._can_set_attn_implementation():
        raise ValueError(f"{type(owner).__name__} does not call its attention through "
                         "transformers' AttentionInterface; pass attention='stored'")
    return owner


def patch_activations(
    model: nn.Module,
    dropout: str = "seeded",
    attention: str = "recompute",
    gelu_bits: int | None = act.DEFAULT_GELU_BITS,
    gelu_code: str = act.DEFAULT_GELU_CODE,
    layernorm: str = "output",
    targets: str | None = None,
    exclude: str | None = None,
) -> list[str]:
    """Make what ``model`` saves for backward besides its linear inputs compact, in place.

    Called with no options it applies the recommended set (:mod:`sketchprop.activations` says
    what each part keeps and why the defaults are what they are). Composes with
    :func:`patch_linear`, in either order.

    Args:
        model: a transformers model of the BERT / RoBERTa families, or (without the attention
            part) any ``nn.Module``.
        dropout: ``"seeded"`` (:class:`~sketchprop.activations.SeededDropout` in place of each
            ``nn.Dropout``: the mask is made again from a saved seed), ``"packed"`` (the mask is
            kept at one bit per element) or ``"stored"`` (left as it is). Exact.
        attention: ``"recompute"`` (the model's attention function becomes
            :func:`~sketchprop.activations.recompute_attention`: the probabilities and their
            dropout mask are recomputed in backward, and Q, K, V too, from the self-attention
            block's input, where its projections are linear layers; exact) or ``"stored"``.
        gelu_bits: bits of the code of GELU's derivative kept instead of its input
            (:class:`~sketchprop.activations.CompactGELU` in place of each exact GELU module), or
            None to leave GELU as it is.
        gelu_code: ``"stochastic"`` (unbiased) or ``"optimal"`` (deterministic, biased).
        layernorm: ``"output"`` (:class:`~sketchprop.activations.OutputLayerNorm` in place of each
            ``nn.LayerNorm``: backward works from the output, which the next block keeps anyway
            in a post-LN encoder, and per-row statistics, not from the input; exact to float32
            rounding) or ``"stored"``. A model without ``nn.LayerNorm`` is left as it is.
        targets / exclude: regexes on qualified module names selecting the dropout, GELU and
            LayerNorm modules, as in :func:`patch_linear`.

    Returns:
        The qualified names of the replaced modules, in module order. The attention switch is not
        a module: it shows in ``model.config._attn_implementation``, which ``save_pretrained``
        does not store, so a model saved while patched loads as the plain model.

    Raises:
        ValueError: an unknown value; every part off; a model already patched; a part whose
            modules the patterns do not match (no ``nn.Dropout``, no exact GELU); attention on a
            model that cannot switch its attention function. Nothing is changed when it raises.
    """
    if dropout not in act.DROPOUT:
        raise ValueError(f"unknown dropout {dropout!r}; choose one of {list(act.DROPOUT)}")
    if attention not in act.ATTENTION:
        raise ValueError(f"unknown attention {attention!r}; choose one of {list(act.ATTENTION)}")
    if layernorm not in act.LAYERNORM:
        raise ValueError(f"unknown layernorm {layernorm!r}; choose one of {list(act.LAYERNORM)}")
    if gelu_bits is not None:
        act.CompactGELU(gelu_bits, gelu_code)  # raises for bad bits or code
    if dropout == "stored" and attention == "stored" and gelu_bits is None \
            and layernorm == "stored":
        raise ValueError("dropout='stored', attention='stored', gelu_bits=None and "
                         "layernorm='stored': nothing to patch")
    if getattr(model, _ACTIVATIONS, None) is not None:
        raise ValueError("model's activations are already patched; call unpatch_activations(model) "
                         "first")
    new: dict[str, nn.Module] = {}
    if dropout != "stored":
        names = _select(model, _is_dropout, targets, exclude)
        if not names:
            raise _no_match("nn.Dropout", targets, exclude, model, _is_dropout,
                            "patch_activations")
        kind = act.SeededDropout if dropout == "seeded" else act.PackedDropout
        new.update({n: kind.from_dropout(model.get_submodule(n)) for n in names})
    if gelu_bits is not None:
        names = _select(model, act.is_exact_gelu, targets, exclude)
        if not names:
            raise _no_match("exact GELU module (nn.GELU() or transformers' GELUActivation)",
                            targets, exclude, model, act.is_exact_gelu, "patch_activations")
        for n in names:
            new[n] = act.CompactGELU(gelu_bits, gelu_code, name=n).train(
                model.get_submodule(n).training)
    if layernorm == "output":
        new.update({n: act.OutputLayerNorm.from_layernorm(model.get_submodule(n))
                    for n in _select(model, act.is_layernorm, targets, exclude)})
    if attention == "recompute":
        owner = _attention_owner(model)

    if not new and attention == "stored":
        raise ValueError(f"targets={targets!r} exclude={exclude!r} match no module of the parts "
                         "asked for: nothing to patch")
    new = {n: new[n] for n, _ in model.named_modules() if n in new}  # module order
    state = {"modules": {n: model.get_submodule(n) for n in new}, "attention": None}
    if attention == "recompute":
        state["attention"] = owner.config._attn_implementation
        owner.set_attn_implementation(act.register_attention())
        # Self-attention modules hand their input to the attention function, which keeps it in
        # place of Q, K and V where it can make them again (sketchprop.activations).
        state["hooks"] = [
            hook for m in owner.modules() if act.has_projections(m)
            for hook in (m.register_forward_pre_hook(act.keep_attention_input, with_kwargs=True),
                         m.register_forward_hook(act.drop_attention_input, with_kwargs=True,
                                                 always_call=True))]
    setattr(model, _ACTIVATIONS, state)
    return _swap(model, new)


def unpatch_activations(model: nn.Module) -> list[str]:
    """Undo :func:`patch_activations`: the original dropout and GELU modules back in place, the
    previous attention function back on. Returns the names of the modules put back."""
    state = getattr(model, _ACTIVATIONS, None)
    if state is None:
        return []
    for name, original in state["modules"].items():  # the mode the model has now, not at patching
        original.train(model.get_submodule(name).training)
    names = _swap(model, state["modules"])
    if state["attention"] is not None:
        owner = _attention_owner(model)
        owner.set_attn_implementation(state["attention"])
        for hook in state["hooks"]:
            hook.remove()
        for m in owner.modules():
            act.forget_attention_check(m)
    delattr(model, _ACTIVATIONS)
    return names
