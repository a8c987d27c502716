r"""Normalisations that keep less for backward: LayerNorm from its output
(``layernorm="output"``) and Llama's RMSNorm from its input and one statistic per row
(``rmsnorm="compact"``).

**LayerNorm** (:class:`OutputLayerNorm`, ``layernorm="output"``): keeps its output ``y`` and
the per-row ``1 / std`` instead of its input, and makes the normalised input again in backward,
``x^ = (y - beta) / gamma`` (Tempo, Andoorveedu et al. 2022; Approx-BP's shared normalisation
memory). Where the output is kept anyway (a post-LN block's output is the next self-attention
block's input, which ``attention="recompute"`` keeps, and exact linear layers keep their
inputs), the input's bytes are saved; elsewhere the output takes the input's place, the same
size. Columns whose ``|gamma| < 0.01 (1 + |beta|)`` (zero, or too small to divide by without
losing float32 accuracy) keep their input columns instead; a half-precision input keeps the
stored path (its output, in float32 under autocast, would be larger). Exact to float32
rounding: the gradients are within 1e-5 (relative) of the stored path's.

**RMSNorm** (``rmsnorm="compact"``, :class:`RMSNormFunction`): keeps its input and one float32
statistic per row (``1 / rms``); backward makes the normalised input again. Exact. Applied to
modules named ``*RMSNorm`` that compute ``weight * (x / rms(x))`` (checked on a random input
and weight before anything changes; Gemma's ``(1 + weight)`` form is left as it is).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from ..compiling import eager_island

#: ``layernorm=`` values: LayerNorm keeps its input (the model's own) or its output.
LAYERNORM = ("stored", "output")

# A column whose |gamma| is below this times (1 + |beta|) keeps its input: dividing by it would
# lose float32 accuracy (the error of x^ grows as |beta| / |gamma| times float32's epsilon).
_GAMMA_FLOOR = 1e-2


class _OutputLayerNormFunction(torch.autograd.Function):
    """LayerNorm over the last dimension of a 2-D ``x`` that saves its output, ``1 / std`` per row
    and the input columns listed in ``kept`` (with the row means), not the input."""

    @staticmethod
    def forward(ctx, x, weight, bias, eps: float, kept: Tensor | None):
        y, mean, rstd = torch.native_layer_norm(x, (x.shape[-1],), weight, bias, eps)
        cols = None if kept is None else x.index_select(-1, kept)
        ctx.save_for_backward(y, rstd, weight, bias, kept, cols, None if kept is None else mean)
        return y

    @staticmethod
    def backward(ctx, dy):
        y, rstd, weight, bias, kept, cols, mean = ctx.saved_tensors
        if weight is None:
            xhat = y if bias is None else y - bias
        else:  # (y - beta) / gamma as y / gamma - beta / gamma: one new tensor, two passes
            inverse = weight.reciprocal()
            xhat = y * inverse
            if bias is not None:
                xhat.sub_(bias * inverse)
        if kept is not None:
            xhat.index_copy_(-1, kept, (cols - mean).mul_(rstd))
        need = ctx.needs_input_grad
        # The native backward given x^ with mean 0 and 1 / std = 1 returns dX / rstd.
        dx, dw, db = torch.ops.aten.native_layer_norm_backward(
            dy, xhat, (y.shape[-1],), torch.zeros_like(rstd), torch.ones_like(rstd), weight, bias,
            [need[0], need[1] and weight is not None, need[2] and bias is not None])
        return None if dx is None else dx.mul_(rstd), dw, db, None, None


class OutputLayerNorm(nn.LayerNorm):
    """``nn.LayerNorm`` whose backward works from its output and per-row statistics (module
    docstring, "LayerNorm"); same Parameters, same forward. Made by :meth:`from_layernorm`."""

    @classmethod
    def from_layernorm(cls, norm: nn.LayerNorm) -> OutputLayerNorm:
        new = cls(norm.normalized_shape, eps=norm.eps, elementwise_affine=False, device="meta")
        new.elementwise_affine = norm.elementwise_affine
        new.weight, new.bias = norm.weight, norm.bias
        new.train(norm.training)
        return new

    def _kept_columns(self) -> Tensor | None:
        """Indices of the columns that keep their input (None: none), computed again only when
        ``gamma`` or ``beta`` changed (one host sync per optimizer step)."""
        weight, bias = self.weight, self.bias
        if weight is None:
            return None
        key = (weight.data_ptr(), weight._version, None if bias is None else
               (bias.data_ptr(), bias._version))
        cached = self.__dict__.get("_kept")
        if cached is None or cached[0] != key:
            with torch.no_grad():
                floor = _GAMMA_FLOOR * (1 + (0 if bias is None else bias.abs()))
                kept = (weight.abs() < floor).reshape(-1).nonzero().squeeze(1)
            cached = self.__dict__["_kept"] = (key, kept if kept.numel() else None)
        return cached[1]

    @eager_island
    def forward(self, x: Tensor) -> Tensor:
        if not (torch.is_grad_enabled() and (x.requires_grad or any(
                p is not None and p.requires_grad for p in (self.weight, self.bias)))) \
                or x.dtype not in (torch.float32, torch.float64):
            return super().forward(x)
        n = math.prod(self.normalized_shape)
        weight = None if self.weight is None else self.weight.reshape(n).to(x.dtype)
        bias = None if self.bias is None else self.bias.reshape(n).to(x.dtype)
        kept = self._kept_columns()
        # Autocast computes a float32 LayerNorm in float32: the Function runs without it.
        with torch.autocast(x.device.type, enabled=False):
            y = _OutputLayerNormFunction.apply(x.reshape(-1, n), weight, bias, self.eps, kept)
        return y.view(x.shape)


def is_layernorm(module: nn.Module) -> bool:
    """Whether ``module`` is an ``nn.LayerNorm`` (that type, not a subclass), which
    :class:`OutputLayerNorm` replaces."""
    return type(module) is nn.LayerNorm


# RMSNorm.


class RMSNormFunction(torch.autograd.Function):
    """Llama's RMSNorm, ``weight * (x.float() * rsqrt(mean(x^2) + eps)).to(x.dtype)``, keeping
    ``x`` and the float32 ``rsqrt`` per row; backward makes the normalised input again."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        xf = x.to(torch.float32)
        r = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, r)
        return weight * (xf * r).to(x.dtype)

    @staticmethod
    def backward(ctx, dy: Tensor):
        x, weight, r = ctx.saved_tensors
        xf = x.to(torch.float32)
        dw = None
        if ctx.needs_input_grad[1]:
            n = (xf * r).to(x.dtype)
            dw = (dy * n).reshape(-1, n.shape[-1]).sum(0).to(weight.dtype)
        dx = None
        if ctx.needs_input_grad[0]:
            dxhat = (dy * weight).to(x.dtype).to(torch.float32)
            # d/dx of x * r(x), r = (mean(x^2) + eps)^-1/2: dxhat * r - x r^3 mean(dxhat * x).
            dot = (dxhat * xf).mean(-1, keepdim=True)
            dx = (dxhat * r - xf * r.pow(3) * dot).to(x.dtype)
        return dx, dw, None


def _rms_eps(module: nn.Module) -> float | None:
    for name in ("variance_epsilon", "eps"):
        eps = getattr(module, name, None)
        if isinstance(eps, float):
            return eps
    return None


def is_rms_norm(module: nn.Module) -> bool:
    """Whether ``module`` is an RMSNorm of Llama's form: a class named ``*RMSNorm`` with a 1-D
    ``weight``, a float ``variance_epsilon`` (or ``eps``), no other parameters or submodules, whose
    output on a random input and a random weight is :class:`RMSNormFunction`'s (checked here,
    without changing the module)."""
    w = getattr(module, "weight", None)
    eps = _rms_eps(module)
    if not (type(module).__name__.endswith("RMSNorm") and isinstance(w, nn.Parameter)
            and w.dim() == 1 and eps is not None and len(list(module.parameters())) == 1
            and not list(module.children())):
        return False
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, w.shape[0], generator=g).to(w.device)
    weight = torch.randn(w.shape[0], generator=g).to(w.device)
    with torch.no_grad():
        try:
            got = torch.func.functional_call(module, {"weight": weight}, (x,))
        except Exception:  # a norm that cannot run on this input is not one we know
            return False
        return torch.equal(got, RMSNormFunction.apply(x, weight, eps))


@eager_island
def rms_norm_forward(self: nn.Module, x: Tensor) -> Tensor:
    """The forward :func:`~sketchprop.patch_activations` gives an RMSNorm (bound to it)."""
    if not (torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad)):
        return type(self).forward(self, x)
    return RMSNormFunction.apply(x, self.weight, _rms_eps(self))
