"""Which models :func:`~sketchprop.activations.recompute_attention` stands in for:
``patch_activations`` asks before it changes anything. A model qualifies when transformers calls
its attention through ``AttentionInterface``, its attention is softmax attention (scores capped
or not, no sinks, query heads a multiple of the key/value heads) and its modeling code's eager
attention takes nothing the recompute does not read; the default ``attention="recompute"`` is
also left where it would save next to nothing (an SDPA attention without dropout whose Q, K, V
cannot be made again)."""

from __future__ import annotations

import inspect
import sys

from torch import nn

from .qkv import is_attention_block, takes_rope


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


def _attention_refusal(owner: nn.Module) -> str | None:
    """Why :func:`recompute_attention` cannot stand in for ``owner``'s
    attention (it computes softmax attention, scores capped or not, K/V heads grouped or not),
    or None."""
    config = owner.config
    if any("sinks" in n for n, _ in owner.named_parameters()):
        return f"{type(owner).__name__} has attention sinks"
    heads, kv = getattr(config, "num_attention_heads", None), getattr(config, "num_key_value_heads",
                                                                        None)
    if isinstance(heads, int) and isinstance(kv, int) and (kv < 1 or heads % kv):
        return f"its {heads} query heads are not a multiple of its {kv} key/value heads"
    return _unknown_attention_inputs(owner)


# What an attention function may take besides Q, K, V, the mask, the scaling and the dropout rate,
# and recompute_attention reads: an additive bias (passed its gradient), the score cap, sinks
# (refused where a model has them: _attention_refusal, recompute_attention), the sliding window
# (the mask carries it).
_READ_INPUTS = {"module", "query", "key", "value", "attention_mask", "scaling", "dropout",
                "position_bias", "softcap", "sinks", "s_aux", "sliding_window"}


def _unknown_attention_inputs(owner: nn.Module) -> str | None:
    """Why recompute_attention cannot stand in for the attention of ``owner``'s modules: the
    eager attention function of a module's modeling code (transformers' reference for what the
    attention computes) takes an input that recompute_attention would leave out, or None."""
    seen = set()
    for module in owner.modules():
        fn = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        try:
            params = inspect.signature(fn).parameters.values()
        except (TypeError, ValueError):
            continue
        extra = [p.name for p in params if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)
                 and p.name not in _READ_INPUTS]
        if extra:
            return (f"the attention of {type(module).__name__} ({fn.__module__}."
                    f"eager_attention_forward) takes {extra[0]!r}, which recompute_attention does "
                    "not read: it would be left out, its gradient with it")
    return None


# Config keys of the attention probabilities' dropout rate, across transformers' models.
_ATTENTION_DROPOUT = ("attention_dropout", "attention_probs_dropout_prob", "attn_pdrop",
                      "attn_dropout")


def _attention_dropout_rates(config) -> list[float]:
    """The attention-dropout rates a config gives, its sub-configs' (a vision or audio tower's)
    included."""
    rates, seen, todo = [], set(), [config]
    while todo:
        c = todo.pop()
        if id(c) in seen:
            continue
        seen.add(id(c))
        rates += [float(getattr(c, n)) for n in _ATTENTION_DROPOUT
                  if isinstance(getattr(c, n, None), (int, float))]
        todo += [v for v in vars(c).values() if hasattr(v, "to_dict") and hasattr(v, "model_type")]
    return rates


def _attention_keeps_no_probabilities(model: nn.Module, owner: nn.Module) -> str | None:
    """Why the default ``attention="recompute"`` is left on ``model``, or None where it applies:
    its attention already keeps no probabilities (an SDPA or flash implementation with no
    attention dropout keeps Q, K, V, its output and one statistic per row) and its Q, K, V cannot
    be made again from the block's input by the exact recompute (its blocks are rotary, as
    Llama's: :func:`~sketchprop.activations.qkv.takes_rope`). There the
    recompute saves only the attention's output, where the output projection does not keep it
    anyway (a sketched or LoRA ``o_proj``), and in a padded batch the float mask SDPA keeps per
    layer (the recompute keeps one boolean mask), for a second pass over the attention in
    backward (on a Llama shape on CPU: nothing with exact linear layers, 4% of exact's saved bytes
    with ours at rho 0.1, for about 7% of a step), so the default leaves it; asked for, it
    applies."""
    config = owner.config  # owner: the transformers model whose attention function is switched
    impl = getattr(config, "_attn_implementation", None)
    if impl is None or impl == "eager":
        return None
    rates = _attention_dropout_rates(config)
    # An attention module's own rate counts too: a sub-model's may come from a key of its own.
    rates += [float(m.attention_dropout) for m in model.modules()
              if isinstance(getattr(m, "attention_dropout", None), (int, float))]
    if not rates or any(r > 0 for r in rates) or any(
            is_attention_block(m) and not takes_rope(m) for m in model.modules()):
        return None
    return (f"its {impl} attention has no dropout, so it keeps no probabilities: recomputing "
            f"would save at most its output (and, in a padded batch, a float mask per layer), for "
            f"a second pass in backward; pass attention='recompute' to apply it anyway")
