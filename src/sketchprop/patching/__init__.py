"""Module surgery, the one place that does it (the modules ``linear`` and ``activations``):
:func:`patch_linear` swaps linear layers (``nn.Linear`` and transformers' ``Conv1D``) for
:class:`RandomizedLinear` (``RandomizedConv1D``), :func:`patch_activations` swaps dropout, GELU
and LayerNorm modules for their compact forms, gives gated MLPs, RMSNorms and a causal LM's loss
forwards of their own, switches the attention function (the parts: :mod:`sketchprop.activations`)
and puts the generic floor on the model's forward; each has an inverse.

Both follow one pattern: select modules by type and by regexes on their qualified names, check
every argument and every match, build every replacement, and only then change the model
(:func:`_swap`), so a bad call leaves it untouched. A replacement reuses the original's Parameters
(the compact activations have none): state_dict keys, tied weights, optimizer parameter groups and
pretrained loading are unchanged.
"""

from .activations import (
    LM_LOSS,
    MLP,
    PARTS_OFF,
    PRESETS,
    RMSNORM,
    activation_defaults,
    patch_activations,
    unpatch_activations,
)
from .linear import DEFAULT_EXCLUDE, _is_linear, find_linear, patch_linear, unpatch_linear  # noqa: F401

__all__ = ["DEFAULT_EXCLUDE", "LM_LOSS", "MLP", "PARTS_OFF", "PRESETS", "RMSNORM", "patch_linear",
           "unpatch_linear", "find_linear", "patch_activations", "unpatch_activations",
           "activation_defaults"]
