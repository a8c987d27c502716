"""What the parts that make a projection's output again in backward (attention's Q, K, V, the
gated MLP's gate and up, the loss's logits) share: a linear module's ``(weight, bias)``,
whether forward hooks may change its output, and the dtype autocast gives its matmul.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..layers import _Sketched, conv1d_class


def _autocast_dtype(x: Tensor) -> torch.dtype | None:
    """The dtype autocast gives a matmul on ``x``'s device, or None when autocast is off."""
    kind = x.device.type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else None


def forward_hooks_on(modules) -> bool:
    """Whether a forward hook or pre-hook may act on any of ``modules`` in this call: one of their
    own, or a global one."""
    from torch.nn.modules import module as nn_module

    return bool(nn_module._global_forward_pre_hooks or nn_module._global_forward_hooks) or any(
        m._forward_pre_hooks or m._forward_hooks for m in modules)


def _linear_weights(module) -> tuple[Tensor, Tensor | None] | None:
    """``(weight, bias)`` such that ``module(x) == F.linear(x, weight, bias)``: nn.Linear,
    transformers' Conv1D (its ``(in, out)`` weight transposed) and the library's layers in their
    place (:class:`~sketchprop.layers.RandomizedLinear`, whose forward is that ``F.linear``);
    None for anything else (peft's LoRA layers, subclasses with a forward of their own)."""
    if type(module) is nn.Linear:
        return module.weight, module.bias
    if isinstance(module, _Sketched):
        return (module.weight.T if module.fan_in_fan_out else module.weight), module.bias
    conv1d = conv1d_class()
    if conv1d is not None and type(module) is conv1d:
        return module.weight.T, module.bias
    return None
