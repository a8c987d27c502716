"""Module surgery on what else backward keeps: :func:`patch_activations` swaps dropout, GELU and
LayerNorm modules for their compact forms, gives gated MLPs, RMSNorms and a causal LM's loss
forwards of their own, switches the attention function (the parts:
:mod:`sketchprop.activations`) and puts the generic floor on the model's forward;
:func:`unpatch_activations` undoes it."""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable

from torch import nn

from .. import activations as act
from ..activations.attention_models import (
    _attention_keeps_no_probabilities,
    _attention_owner,
    _attention_refusal,
)
from ..activations.mlp import forget_mlp_check
from ..activations.norms import KEPT, forget_rms_form
from ..quantize import BITS, DEFAULT_GROUP, check_group
from ..wrappers import _transformers_owner, bound, give_forwards, model_to_patch, take_forwards
from .linear import _select, _swap

__all__ = ["LM_LOSS", "MLP", "PARTS_OFF", "PRESETS", "RMSNORM", "activation_defaults",
           "patch_activations", "unpatch_activations"]

# The logger of the package: one name for what the patch functions say.
log = logging.getLogger("sketchprop.patching")

_ACTIVATIONS = "_sketchprop_activations"


def _is_dropout(module: nn.Module) -> bool:
    return type(module) is nn.Dropout


class _Default:
    """A ``patch_activations`` argument left at its default, the recommended value: that part
    applies where the model has what it replaces, and is left (and said so) where it has not."""

    def __init__(self, value):
        self.value = value

    def __repr__(self) -> str:
        return repr(self.value)

    def __eq__(self, other) -> bool:  # equal to its value: signature defaults read as values
        return self.value == (other.value if isinstance(other, _Default) else other)

    def __hash__(self) -> int:
        return hash(self.value)


#: ``mlp=``, ``rmsnorm=`` and ``lm_loss=`` values (:mod:`sketchprop.activations.mlp`, ``.norms``, ``.loss``).
MLP = ("stored", "recompute", "input", "auto", "coded")
RMSNORM = ("stored", "compact", "coded")
LM_LOSS = ("stored", "chunked")
#: ``preset=`` values: the parts' values a preset gives where its call does not (``"compact"``:
#: the signature's defaults; ``"lean"``: norm outputs and attention and MLP inputs kept once, as
#: the codes the next layers share, GELU's derivative at 4 bits, and the generic floor at 4 bits
#: for the rest: the measured choice, docs/library.md "Its bits and the GELU code").
PRESETS = {"compact": {}, "lean": {"layernorm": "coded", "attention": "coded", "rmsnorm": "coded",
                                   "mlp": "coded", "experts": "coded", "gelu_bits": 4,
                                   "floor_bits": 4}}
#: The value that turns each part of :func:`patch_activations` off.
PARTS_OFF = {"dropout": "stored", "attention": "stored", "gelu_bits": None, "layernorm": "stored",
             "mlp": "stored", "rmsnorm": "stored", "lm_loss": "stored", "floor_bits": None,
             "experts": "stored"}


def _patterns(targets, exclude) -> str:
    return "" if targets is None and exclude is None else \
        f" that targets={targets!r} exclude={exclude!r} match"


def patch_activations(
    model: nn.Module,
    dropout: str = _Default("seeded"),
    attention: str = _Default("recompute"),
    gelu_bits: int | None = _Default(act.DEFAULT_GELU_BITS),
    gelu_code: str = _Default(act.DEFAULT_GELU_CODE),
    layernorm: str = _Default("output"),
    mlp: str = _Default("auto"),
    rmsnorm: str = _Default("compact"),
    lm_loss: str = _Default("chunked"),
    floor_bits: int | None = _Default(None),
    experts: str = _Default("stored"),
    targets: str | None = None,
    exclude: str | None = None,
    preset: str = "compact",
    code_bits: int = 4,
    code_group: int = DEFAULT_GROUP,
) -> list[str]:
    """Make what ``model`` saves for backward besides its linear inputs compact, in place.

    Called with no options it applies each part of the recommended set that the model has, and
    tells what it applied and what it left: the returned names, and one line logged (INFO, logger
    ``sketchprop.patching``). It raises only when nothing at all applies. A part given explicitly
    raises when the model has nothing it applies to, with the option to change in the message.
    (The modules of :mod:`sketchprop.activations`, one per part, say what each part keeps and why
    the defaults are what they are.) Composes with :func:`patch_linear`, in either order, and
    with peft adapters.

    Args:
        model: any ``nn.Module`` (in DDP or FSDP1, the model inside); attention and the loss
            need a transformers model (or a peft model around one).
        dropout: ``"seeded"`` (:class:`~sketchprop.activations.SeededDropout` in place of each
            ``nn.Dropout``: the mask is made again from a saved seed), ``"packed"`` (the mask is
            kept at one bit per element) or ``"stored"`` (left as it is). Exact.
        attention: ``"recompute"`` (the model's attention function becomes
            :func:`~sketchprop.activations.recompute_attention`: the probabilities and their
            dropout mask are recomputed in backward, and Q, K, V too, from the self-attention
            block's input, through whatever linear projections make them, found on the first call
            by what they compute: separate or fused QKV, GPT-2's Conv1D, any names, a QK-norm
            between (:func:`~sketchprop.activations.is_attention_block`); grouped key/value heads
            are kept unrepeated; exact) or ``"stored"``. Left to its default, it is left on a model
            whose SDPA or flash attention has no dropout and whose blocks are rotary (a Llama fine-
            tuned without attention dropout): that attention keeps no probabilities, the exact
            recompute does not make rotated Q and K again, and recomputing would save at most its
            output and, in a padded batch, SDPA's per-layer float mask, for a second pass in
            backward. ``"coded"``: as ``"recompute"``, from a ``code_bits``-bit code of the block's
            input (:class:`~sketchprop.activations.CodeAttentionInput`; not exact), Q and K rotated
            again in a rotary block (applied there even where ``"recompute"`` is left by default).
        gelu_bits: bits of the code of GELU's derivative kept instead of its input
            (:class:`~sketchprop.activations.CompactGELU` in place of each exact GELU module,
            :class:`~sketchprop.activations.CompactTanhGELU` in place of each tanh-form GELU, GPT-2's
            ``gelu_new``), or None to leave GELU as it is.
        gelu_code: ``"stochastic"`` (unbiased) or ``"optimal"`` (deterministic, biased).
        layernorm: ``"output"`` (:class:`~sketchprop.activations.OutputLayerNorm` in place of each
            ``nn.LayerNorm``: backward works from the output, which the next block keeps anyway
            in a post-LN encoder, and per-row statistics, not from the input; exact to float32
            rounding), ``"coded"`` (:class:`~sketchprop.activations.CodedLayerNorm`: from a
            ``code_bits``-bit code of the output, shared with the next layers; a bias of second
            order) or ``"stored"``.
        mlp: ``"recompute"``: each gated MLP (``down(act(gate(x)) * up(x))``, a SiLU or GELU gate,
            gate and up separate or fused: Llama's, Gemma's, Phi-3's, ModernBERT's; found by what
            it computes, :func:`~sketchprop.activations.gated_layout`; its GELU module is then not
            the GELU part's) keeps the gate and up outputs only
            (:func:`~sketchprop.activations.gated_mlp_forward`; exact); ``"input"``: it keeps its
            input only, and backward computes the gate and up projections again
            (:func:`~sketchprop.activations.gated_mlp_input_forward`; exact; two more matmuls per
            MLP; a plain MLP in one module, ``down(act(up(x)))`` with a ReLU, SiLU or GELU: T5's,
            DistilBERT's, its up projection again, :func:`~sketchprop.activations.is_plain_mlp`);
            ``"auto"``: ``"input"`` where the gate and up projections' full-size weights are
            frozen (LoRA: a step that stays under exact's time), else ``"recompute"``, decided on
            each call (an MLP whose gate or up projection is not a plain or LoRA linear layer, or
            has LoRA dropout, keeps the gate and up outputs under ``"input"`` too); ``"coded"``: as
            ``"input"``, plain MLPs too, from the ``code_bits``-bit code of the input
            (:class:`~sketchprop.activations.CodedGatedMLP`; not exact); or ``"stored"``.
        rmsnorm: ``"compact"``: each RMSNorm of Llama's, Gemma's ``(1 + weight)`` or T5's form (found
            by what it computes, :func:`~sketchprop.activations.rms_norm_form`, whatever its
            name; QK-norms and sandwich norms too) keeps its input and one statistic per
            row (:class:`~sketchprop.activations.RMSNormFunction`; exact), ``"coded"``
            (:class:`~sketchprop.activations.CodedRMSNorm`: a ``code_bits``-bit code of its
            output, shared with the next layers; a bias of second order) or ``"stored"``.
        lm_loss: ``"chunked"``: a causal LM (or T5, :data:`~sketchprop.activations.loss.SEQ2SEQ_LMS`)
            trained with labels computes its loss by chunks of tokens, the logits (soft-capped
            where its config says so: Gemma 2) made again in backward
            (:func:`~sketchprop.activations.chunked_lm_loss`; exact; ``logits`` is None in the
            output while it trains with labels), or ``"stored"``.
        experts: ``"recompute"``: each mixture of experts held as stacked parameters (Mixtral's,
            Qwen3-MoE's ``gate_up_proj[E, 2F, H]``, found by its parameters' shapes,
            :func:`~sketchprop.activations.is_experts`) keeps its input and its router's choices
            and weights only, and runs again in backward (exact; the experts' forward once more);
            ``"coded"``: from the ``code_bits``-bit code of its input
            (:class:`~sketchprop.activations.CodedExperts`; not exact); or ``"stored"``.
        floor_bits: 8, 4 or 2: the generic floor (:mod:`sketchprop.activations.floor`): every
            tensor the model saves for backward that no other part handles, kept as one
            ``floor_bits``-bit code per storage (groups of ``code_group``, unbiased rounding;
            bool masks at one bit; parameters, buffers, small and non-finite tensors and the
            parts' own saves as they are), by saved-tensor hooks the model's forward opens and
            closes; any model. None: off (the default; 4 under ``preset="lean"``).
        targets / exclude: regexes on qualified module names selecting the dropout, GELU,
            LayerNorm, MLP and RMSNorm modules, as in :func:`patch_linear`.
        preset: ``"compact"`` (the defaults above) or ``"lean"``: ``layernorm``, ``rmsnorm``,
            ``attention`` and ``mlp`` ``"coded"`` too, so that each norm's output and attention
            block input is kept once, as one ``code_bits``-bit code (groups of ``code_group``) that
            the norm's backward, the attention's and the gated MLP's recompute and the next
            linear layers read (shared with
            :func:`patch_linear`'s codes of the same width and group: ``bits=4`` with the
            defaults; :mod:`sketchprop.codes`), ``gelu_bits=4``, and the floor at
            ``floor_bits=4`` for whatever no part handles (the measured choice: docs/library.md,
            "Its bits and the GELU code"). Biased at second order (docs/library.md, "Lean").
            Options given explicitly override the preset's (``floor_bits=None`` leaves the
            floor off).
        code_bits / code_group: width (8, 4 or 2) and columns per scale of the ``"coded"`` parts.

    Returns:
        The qualified names of the modules replaced (dropout, GELU) or given a forward of their
        own (MLP, RMSNorm; the output layer for the loss), in module order. The attention switch is
        not a module: it shows in ``model.config._attn_implementation``, which ``save_pretrained``
        does not store, so a model saved while patched loads as the plain model.

    Raises:
        ValueError: an unknown value; every part off; a model already patched; an option given
            explicitly whose part the model lacks (or the patterns do not match); patterns that
            match no module of any part; nothing to apply; ``layernorm="output"`` on a sharded
            model (:mod:`sketchprop.wrappers`). Nothing is changed when it raises.
    """
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {list(PRESETS)}")
    if isinstance(code_bits, bool) or code_bits not in BITS:
        raise ValueError(f"code_bits must be one of {list(BITS)}, got {code_bits!r}")
    code_group = check_group(code_group)
    options = {"dropout": dropout, "attention": attention, "gelu_bits": gelu_bits,
               "gelu_code": gelu_code, "layernorm": layernorm, "mlp": mlp, "rmsnorm": rmsnorm,
               "lm_loss": lm_loss, "floor_bits": floor_bits, "experts": experts}
    given = {k: not isinstance(v, _Default) for k, v in options.items()}
    (dropout, attention, gelu_bits, gelu_code, layernorm, mlp, rmsnorm, lm_loss, floor_bits,
     experts) = (
        PRESETS[preset].get(k, v.value) if isinstance(v, _Default) else v
        for k, v in options.items())
    if floor_bits is not None and (isinstance(floor_bits, bool) or floor_bits not in BITS):
        raise ValueError(f"floor_bits must be one of {list(BITS)} or None, got {floor_bits!r}")
    for name, value, allowed in (("dropout", dropout, act.DROPOUT),
                                 ("attention", attention, act.ATTENTION),
                                 ("layernorm", layernorm, act.LAYERNORM), ("mlp", mlp, MLP),
                                 ("rmsnorm", rmsnorm, RMSNORM), ("lm_loss", lm_loss, LM_LOSS),
                                 ("experts", experts, act.EXPERTS)):
        if value not in allowed:
            raise ValueError(f"unknown {name} {value!r}; choose one of {list(allowed)}")
    if gelu_bits is not None:
        act.CompactGELU(gelu_bits, gelu_code)  # raises for bad bits or code
    model = model_to_patch(model, "patch_activations", (nn.LayerNorm,) * (layernorm != "stored"),
                           ", or pass layernorm='stored'")
    values = {"dropout": dropout, "attention": attention, "gelu_bits": gelu_bits,
              "layernorm": layernorm, "mlp": mlp, "rmsnorm": rmsnorm, "lm_loss": lm_loss,
              "floor_bits": floor_bits, "experts": experts}
    if all(values[k] == off for k, off in PARTS_OFF.items()):
        raise ValueError(", ".join(f"{k}={v!r}" for k, v in PARTS_OFF.items())
                         + ": nothing to patch")
    if getattr(model, _ACTIVATIONS, None) is not None:
        raise ValueError("model's activations are already patched; call unpatch_activations(model) "
                         "first")
    where = _patterns(targets, exclude)
    applied: dict[str, int] = {}
    left: dict[str, str] = {}
    notes: dict[str, str] = {}

    def leave(part: str, reason: str) -> None:
        """A part that does not apply: an error where the caller asked for it, else a note."""
        if given[part]:
            raise ValueError(f"{part}={values[part]!r}: {reason}; pass {part}={PARTS_OFF[part]!r} "
                             "to leave it as it is")
        left[part] = reason

    def select(part: str, kind, what: str) -> list[str]:
        names = _select(model, kind, targets, exclude)
        if not names:
            count = sum(kind(m) for m in model.modules())
            leave(part, f"the model has no {what}{where}" if not count or not where else
                  f"targets={targets!r} exclude={exclude!r} match none of the model's {count} "
                  f"{what}")
        return names

    new: dict[str, nn.Module] = {}
    forwards: dict[str, tuple[nn.Module, Callable]] = {}
    selected = 0
    if dropout != "stored":
        names = select("dropout", _is_dropout, "nn.Dropout")
        kind = act.SeededDropout if dropout == "seeded" else act.PackedDropout
        new.update({n: kind.from_dropout(model.get_submodule(n)) for n in names})
        applied["dropout"], selected = len(names), selected + len(names)
    # Made again from their input (mlp="input", "coded"), plain MLPs too: down(act(up(x))).
    is_mlp = act.takes_mlp(mlp)
    # An MLP's forward under the mlp part computes its activation itself: its GELU module is unused.
    gates = {id(getattr(m, act.gated_layout(m).act))
             for m in map(model.get_submodule, _select(model, is_mlp, targets, exclude))}
    if gelu_bits is not None:
        names = select("gelu_bits", lambda m: id(m) not in gates and (act.is_exact_gelu(m)
                                                                    or act.is_tanh_gelu(m)),
                       "GELU module (nn.GELU, transformers' gelu, gelu_new or gelu_pytorch_tanh) "
                       "outside a gated MLP")
        for n in names:
            kind = act.CompactTanhGELU if act.is_tanh_gelu(model.get_submodule(n)) \
                else act.CompactGELU
            new[n] = kind(gelu_bits, gelu_code, name=n).train(model.get_submodule(n).training)
        applied["gelu_bits"], selected = len(names), selected + len(names)
    if layernorm != "stored":
        names = select("layernorm", act.is_layernorm, "nn.LayerNorm")
        for n in names:
            norm = model.get_submodule(n)
            new[n] = act.OutputLayerNorm.from_layernorm(norm) if layernorm == "output" else \
                act.CodedLayerNorm.from_layernorm(norm, code_bits, code_group, name=n)
        applied["layernorm"], selected = len(names), selected + len(names)
    for part, on, kind, what, forward in (
            ("mlp", mlp != "stored", is_mlp, "gated MLP (down(act(gate(x)) * up(x)), a SiLU or "
             "GELU gate, gate and up separate or fused)" + (
                 " or plain MLP (down(act(up(x))))" if mlp in ("input", "coded") else ""),
             {"input": act.gated_mlp_input_forward, "recompute": act.gated_mlp_forward,
              "auto": act.gated_mlp_auto_forward}.get(mlp, act.CodedGatedMLP)),
            ("rmsnorm", rmsnorm != "stored", act.is_rms_norm, "RMSNorm (Llama's or Gemma's form)",
             act.rms_norm_forward if rmsnorm == "compact" else act.CodedRMSNorm)):
        if on:
            names = select(part, kind, what)
            # A coded part's forward is an object with its own seed stream; the others are the
            # functions bound to their module.
            forwards.update({n: (model.get_submodule(n),
                                 forward(model.get_submodule(n), code_bits, code_group, name=n)
                                 if isinstance(forward, type) else
                                 bound(forward, model.get_submodule(n))) for n in names})
            applied[part], selected = len(names), selected + len(names)
            if part == "mlp" and mlp == "auto" and names:
                frozen = sum(act.keeps_input(model.get_submodule(n)) for n in names)
                notes["mlp"] = f"; its input kept where the gate and up weights are frozen: " \
                               f"{frozen} now"
    if experts != "stored":
        names = select("experts", act.is_experts, "mixture of experts held as stacked parameters")
        forwards.update({n: (model.get_submodule(n), act.CodedExperts(
            model.get_submodule(n), code_bits if experts == "coded" else None, code_group, name=n))
            for n in names})
        applied["experts"], selected = len(names), selected + len(names)
    if where and not selected:
        raise ValueError(f"targets={targets!r} exclude={exclude!r} match no module that "
                         "patch_activations replaces (dropout, GELU, LayerNorm, gated MLP, "
                         "RMSNorm, experts)")
    owner = _transformers_owner(model)
    if lm_loss != "stored":
        reason = "not a transformers model" if owner is None else act.lm_loss_refusal(owner)
        if reason is not None:
            leave("lm_loss", reason)
        else:
            head = owner.get_output_embeddings()
            name = next(n for n, m in model.named_modules() if m is head)
            forwards[name] = (owner, act.LMLossForward(owner))
            applied["lm_loss"] = 1
    if attention != "stored":
        # Coded, an attention block of its own (not through the interface: DeBERTa's) is made
        # again whole from the code of its input.
        own = [n for n, m in model.named_modules() if act.is_own_attention(m)
               and not act.is_attention_block(m)] if attention == "coded" else []
        try:
            attention_owner = _attention_owner(model)
            reason = _attention_refusal(attention_owner)
            # Coded, a Llama-style attention keeps the code of its input in place of Q, K, V.
            if reason is None and not given["attention"] and not (
                    attention == "coded" and any(map(act.has_rope_projections, model.modules()))):
                reason = _attention_keeps_no_probabilities(model, attention_owner)
        except ValueError as err:
            if given["attention"] and not own:
                raise
            reason = str(err).split("; pass attention=")[0]
        forwards.update({n: (model.get_submodule(n), act.RecomputedModule(
            model.get_submodule(n), code_bits, code_group, name=n, option="attention"))
            for n in own})
        if own:
            notes["own_attention"] = f"attention='coded' on {len(own)} attention block" \
                f"{'s' * (len(own) != 1)} of their own"
            selected += len(own)
        if reason is not None and not own:
            leave("attention", reason)
        elif reason is not None:
            left["attention"] = reason
        else:
            applied["attention"] = 1
    if floor_bits is not None:
        applied["floor_bits"] = 1
    if (not applied or not any(applied.values())) and "own_attention" not in notes:
        raise ValueError("nothing to patch: " + "; ".join(f"{k}: {v}" for k, v in left.items()))

    order = [n for n, _ in model.named_modules()]
    new = {n: new[n] for n in order if n in new}
    state = {"modules": {n: model.get_submodule(n) for n in new}, "attention": None,
             "forwards": forwards, "names": sorted([*new, *forwards], key=order.index)}
    state["given"] = give_forwards(model, forwards, "patch_activations")
    if applied.get("attention"):
        owner = _attention_owner(model)
        state["attention"] = owner.config._attn_implementation
        owner.set_attn_implementation(act.register_attention())
        # Self-attention modules hand their input to the attention function, which keeps it in
        # place of Q, K and V where it can make them again (sketchprop.activations.attention).
        state["hooks"] = [
            hook for n, m in owner.named_modules() if act.is_attention_block(m)
            and (attention == "coded" or not act.takes_rope(m))
            for hook in (m.register_forward_pre_hook(
                act.keep_attention_input if attention == "recompute" else
                act.CodeAttentionInput(code_bits, code_group, name=n), with_kwargs=True),
                         m.register_forward_hook(act.drop_attention_input, with_kwargs=True,
                                                 always_call=True))]
    # The floor's hooks open around the model's forward: whatever the parts above leave.
    state["floor"] = act.Floor(floor_bits, code_group, name=type(model).__name__).install(model) \
        if floor_bits is not None else []
    setattr(model, _ACTIVATIONS, state)
    _swap(model, new)
    log.info("patch_activations(%s): applied %s; left %s", type(model).__name__,
             ", ".join([f"{k}={values[k]!r} ({n} module{'s' * (n != 1)}{notes.get(k, '')})"
                        if k not in ("attention", "floor_bits")
                        else f"{k}={values[k]!r}" for k, n in applied.items() if n]
                       + ([notes["own_attention"]] if "own_attention" in notes else [])) or "none",
             "; ".join(f"{k} ({v})" for k, v in left.items()) or "nothing")
    return state["names"]


def activation_defaults() -> dict[str, object]:
    """:func:`patch_activations`' default for each of its options that has one (``dropout`` to
    ``lm_loss``), as plain values."""
    return {k: p.default.value for k, p in inspect.signature(patch_activations).parameters.items()
            if isinstance(p.default, _Default)}


def unpatch_activations(model: nn.Module) -> list[str]:
    """Undo :func:`patch_activations`: the original dropout and GELU modules back in place, the
    modules' own forwards back, the previous attention function back on, the floor's hooks off.
    Returns the names
    :func:`patch_activations` returned."""
    model = model_to_patch(model, "unpatch_activations", (act.OutputLayerNorm,))
    state = getattr(model, _ACTIVATIONS, None)
    if state is None:
        return []
    for name, original in state["modules"].items():  # the mode the model has now, not at patching
        original.train(model.get_submodule(name).training)
    _swap(model, state["modules"])
    for module, _ in state["forwards"].values():
        forget_mlp_check(module)
        forget_rms_form(module)
        module.__dict__.pop(KEPT, None)  # a coded RMSNorm's cached columns
    take_forwards(state["forwards"], state["given"])
    if state["attention"] is not None:
        owner = _attention_owner(model)
        owner.set_attn_implementation(state["attention"])
        for hook in state["hooks"]:
            hook.remove()
        for m in owner.modules():
            act.forget_attention_check(m)
    for hook in state.get("floor", ()):
        hook.remove()
    delattr(model, _ACTIVATIONS)
    return state["names"]
