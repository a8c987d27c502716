r"""Normalisations that keep less for backward: LayerNorm from its output
(``layernorm="output"``) or a code of it (``layernorm="coded"``), and Llama's RMSNorm from its
input and one statistic per row (``rmsnorm="compact"``) or a code of its output
(``rmsnorm="coded"``).

**LayerNorm** (:class:`OutputLayerNorm`, ``layernorm="output"``): keeps its output ``y`` and
the per-row ``1 / std`` instead of its input, and makes the normalised input again in backward,
``x^ = (y - beta) / gamma`` (Tempo, Andoorveedu et al. 2022; Approx-BP's shared normalisation
memory). Where the output is kept anyway (a post-LN block's output is the next self-attention
block's input, which ``attention="recompute"`` keeps, and exact linear layers keep their
inputs), the input's bytes are saved; elsewhere the output takes the input's place, the same
size. Columns whose ``|gamma| < 0.01 (1 + |beta|)`` (zero, or too small to divide by without
losing float32 accuracy) keep their input columns instead; a half-precision input keeps the
stored path (its output, in float32 under autocast, would be larger). Exact to float32
rounding: the gradients are within 1e-5 (relative) of the stored path's. Its backward (``x^`` made
again, then the three gradients) is one fused function, one pass over the rows where the native
backward given ``x^`` would need two more.

**Coded** (:class:`CodedLayerNorm`, ``layernorm="coded"``, the lean preset): as ``"output"``,
but the output is kept as a ``b``-bit code (groups of 64 columns by default, stochastic rounding:
unbiased), filed for the next layers to share (:mod:`sketchprop.codes`): the next linear layers'
``b``-bit codes of their input and the next attention block's input are then this one code.
Backward decodes it, ``x~ = (y~ - beta) / gamma``. The weight's gradient ``sum dY x~`` and the
input's first two terms are linear in ``x~``: unbiased. The input's last term,
``x~_i mean_j(gamma_j dY_j x~_j)``, is quadratic in the code: its bias is
``Var(e_i / gamma_i) / n`` (``e`` the rounding error of ``y``, ``n`` the width) times that
element's own first term, ``gamma_i dY_i / std``; measured on real activations by
``scripts/lean_check.py``. A column with a small ``gamma`` divides its rounding error by it: those
below the floor above keep their input, as in ``"output"``, and so do those whose ``|gamma|`` is
below a tenth of the largest in their group of columns (the code's step is set by the group's
largest output; on MiniLM these are the same columns).

**RMSNorm** (``rmsnorm="compact"``, :class:`RMSNormFunction`): keeps its input and one float32
statistic per row (``1 / rms``); backward makes the normalised input again. Exact. Applied to
any module with one 1-D weight and a float ``eps`` (or ``variance_epsilon``) that computes one
of the forms transformers' models use, whatever its name (:data:`RMS_FORMS`): Llama's ``weight
* (x / rms(x))``, cast to the input's dtype before the product, Gemma's ``((x / rms(x)) * (1 +
weight))``, cast after it, or T5's, cast to the weight's dtype (:func:`rms_norm_form`, checked on
a random input and weight, in float32 and with bfloat16 inputs and weights, before anything
changes). T5's, and any with an input of another dtype than its weight (bfloat16 activations
under autocast, a float32 weight), keeps its input only and runs its ops again in backward
(:class:`_RecomputedRMSNorm`, bit for bit the module's gradients).

**Coded RMSNorm** (:class:`CodedRMSNorm`, ``rmsnorm="coded"``, the lean preset): as LayerNorm's
"Coded", for RMSNorm: the output is kept as a ``b``-bit code, filed for the next layers (Q, K, V
and the attention's recompute after ``input_layernorm``; gate and up and the gated MLP's recompute
after ``post_attention_layernorm``), with ``1 / rms`` per row, and backward makes the normalised
input again as ``y~ / weight`` (``y~ / (1 + weight)`` in Gemma's form). The weight's gradient is
linear in the code: unbiased; the input's last term, ``n~_i mean_j(dn_j n~_j)``, is quadratic: a
bias of ``Var(e / w) / n`` of the element's first term, as LayerNorm's. Columns whose scale
(``|weight|``, or ``|1 + weight|``) is below 0.01, or below a tenth of the largest in their group
of columns, keep their input.
Float32 only (a half precision model keeps the compact path).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..codes import SharedCode, file_code
from ..compiling import eager_island, fused
from ..functional import first_order
from ..quantize import DEFAULT_GROUP, check_bits, check_group, quantize
from ..rng import SeedStream

#: ``layernorm=`` values: LayerNorm keeps its input (the model's own), its output, or a code of its
#: output that the next layers share.
LAYERNORM = ("stored", "output", "coded")

# A column whose |gamma| is below this times (1 + |beta|) keeps its input: dividing by it would
# lose float32 accuracy (the error of x^ grows as |beta| / |gamma| times float32's epsilon).
_GAMMA_FLOOR = 1e-2
# Coded, a column whose |gamma| is below this times the largest in its group keeps its input too.
_GROUP_FLOOR = 0.1


@fused
def _layer_norm_backward(dy: Tensor, y: Tensor, rstd: Tensor, weight: Tensor | None,
                         bias: Tensor | None, kept: Tensor | None, cols: Tensor | None,
                         mean: Tensor | None, need_dx: bool, need_dw: bool,
                         need_db: bool) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """LayerNorm's ``(dx, dw, db)`` from its output ``y`` (2-D), ``1 / std`` per row and the input
    columns listed in ``kept`` (with the row means): one fused function
    (:func:`~sketchprop.compiling.fused`), where the native backward would need ``x^`` made first
    in passes of its own."""
    xhat = y if bias is None else y - bias
    if weight is not None:
        xhat = xhat / weight
    if kept is not None:
        xhat = xhat.index_copy(-1, kept, (cols - mean) * rstd)
    g = dy if weight is None else dy * weight
    dx = dw = db = None
    if need_dx:
        dx = (g - g.mean(-1, keepdim=True) - xhat * (g * xhat).mean(-1, keepdim=True)) * rstd
    if need_dw and weight is not None:
        dw = (dy * xhat).sum(0)
    if need_db and bias is not None:
        db = dy.sum(0)
    return dx, dw, db


def _backward_from_output(ctx, dy, y, rstd, weight, bias, kept, cols, mean):
    """:func:`_layer_norm_backward` for the gradients ``ctx`` needs."""
    return _layer_norm_backward(dy, y, rstd, weight, bias, kept, cols, mean,
                                *ctx.needs_input_grad[:3])


#: Where a norm's kept columns are cached (in the module's ``__dict__``; unpatching drops it).
KEPT = "_sketchprop_kept_columns"


def _kept_columns(module: nn.Module, bias: Tensor | None,
                  group: int | None = None, offset: float = 0.0) -> Tensor | None:
    """Indices of the columns of ``module``'s norm that keep their input (None: none): those whose
    scale ``|weight + offset|`` is below the floor, and where the output is coded in groups of
    ``group`` columns, those below a tenth of the largest in their group. Computed again only
    when ``gamma`` or ``beta`` changed (one host sync per optimizer step)."""
    weight = module.weight
    if weight is None:
        return None
    key = (weight.data_ptr(), weight._version, None if bias is None else
           (bias.data_ptr(), bias._version), group, offset)
    cached = module.__dict__.get(KEPT)
    if cached is None or cached[0] != key:
        with torch.no_grad():
            w = (weight + offset).abs().reshape(-1)
            floor = _GAMMA_FLOOR * (1 + (0 if bias is None else bias.abs().reshape(-1)))
            small = w < floor
            if group is not None:
                # The code's step is set by its group's largest output; decoded and divided by a
                # much smaller weight, it would grow by their ratio.
                peak = F.pad(w, (0, -w.numel() % group)).view(-1, group).amax(1)
                small |= w < _GROUP_FLOOR * peak.repeat_interleave(group)[:w.numel()]
            kept = small.nonzero().squeeze(1)
        cached = module.__dict__[KEPT] = (key, kept if kept.numel() else None)
    return cached[1]


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
    @first_order
    def backward(ctx, dy):
        return *_backward_from_output(ctx, dy, *ctx.saved_tensors), None, None


class _CodedLayerNormFunction(torch.autograd.Function):
    """:class:`_OutputLayerNormFunction` that saves a ``bits``-bit code of its output (a
    :class:`~sketchprop.codes.SharedCode`, appended to ``made`` for the caller to file) in place of
    the output."""

    @staticmethod
    def forward(ctx, x, weight, bias, eps: float, kept: Tensor | None, bits: int, group: int,
                seed: int, made: list):
        y, mean, rstd = torch.native_layer_norm(x, (x.shape[-1],), weight, bias, eps)
        cols = None if kept is None else x.index_select(-1, kept)
        payload, spec, _ = quantize(y, bits, group, seed)
        made.append(SharedCode(payload, spec))
        ctx.spec = spec
        ctx.save_for_backward(payload, rstd, weight, bias, kept, cols,
                              None if kept is None else mean)
        return y

    @staticmethod
    @first_order
    def backward(ctx, dy):
        payload, *rest = ctx.saved_tensors
        y = SharedCode(payload, ctx.spec).decode()
        return *_backward_from_output(ctx, dy, y, *rest), *[None] * 6


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
        return _kept_columns(self, self.bias)

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
            return self._normalize(x.reshape(-1, n), weight, bias, kept, x.shape)

    def _normalize(self, x2: Tensor, weight, bias, kept, shape) -> Tensor:
        return _OutputLayerNormFunction.apply(x2, weight, bias, self.eps, kept).view(shape)


class CodedLayerNorm(OutputLayerNorm):
    """:class:`OutputLayerNorm` that keeps a ``bits``-bit code of its output (groups of ``group``
    columns, stochastic rounding: :mod:`sketchprop.quantize`) in place of the output, filed under
    the output for the next layers to share (:mod:`sketchprop.codes`). Module docstring,
    "Coded". ``name`` (the module's qualified name) seeds the rounding's stream, with
    ``torch.initial_seed()`` and the rank. In eval mode it is :class:`OutputLayerNorm`: exact."""

    @classmethod
    def from_layernorm(cls, norm: nn.LayerNorm, bits: int = 4, group: int = DEFAULT_GROUP,
                       name: str = "") -> CodedLayerNorm:
        new = super().from_layernorm(norm)
        new.bits, new.group = check_bits(bits), check_group(group)
        if new.bits is None:
            raise ValueError("CodedLayerNorm needs bits (8, 4 or 2)")
        new.seeds = SeedStream("layernorm", name)
        return new

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, bits={self.bits}, group={self.group}"

    def _kept_columns(self) -> Tensor | None:
        return _kept_columns(self, self.bias, self.group)

    def _normalize(self, x2: Tensor, weight, bias, kept, shape) -> Tensor:
        if not self.training:
            return super()._normalize(x2, weight, bias, kept, shape)
        made: list = []
        y = _CodedLayerNormFunction.apply(x2, weight, bias, self.eps, kept, self.bits, self.group,
                                          self.seeds.next(), made).view(shape)
        file_code(y, made[0])  # the tensor the next layers get
        return y


def is_layernorm(module: nn.Module) -> bool:
    """Whether ``module`` is an ``nn.LayerNorm`` (that type, not a subclass), which
    :class:`OutputLayerNorm` replaces."""
    return type(module) is nn.LayerNorm


# RMSNorm.


#: The RMSNorm forms :func:`rms_norm_form` tells apart (module docstring, "RMSNorm").
RMS_FORMS = ("llama", "gemma", "t5")


def rms_norm_value(x: Tensor, weight: Tensor, eps: float, form: str = "llama") -> Tensor:
    """An RMSNorm's output over ``x``'s last dimension, by the module's own ops in their order, in
    one of :data:`RMS_FORMS`: Llama's ``weight * n.to(x.dtype)``, Gemma's ``(n * (1 +
    weight)).to(x.dtype)``, ``n = x.float() * rsqrt(mean(x^2) + eps)``, or T5's ``weight *
    (x * rsqrt(...))``, cast to the weight's dtype first where it is half precision."""
    xf = x.to(torch.float32)
    r = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if form == "t5":
        n = x * r
        if weight.dtype in (torch.float16, torch.bfloat16):
            n = n.to(weight.dtype)
        return weight * n
    if form == "gemma":
        return (xf * r * (1.0 + weight.float())).to(x.dtype)
    return weight * (xf * r).to(x.dtype)


class _RecomputedRMSNorm(torch.autograd.Function):
    """An RMSNorm of a form without a backward of its own here (T5's), keeping its input only:
    backward runs :func:`rms_norm_value` again under autograd, the very ops of the module, so
    its gradients are the module's bit for bit."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, eps: float, form: str) -> Tensor:
        ctx.eps, ctx.form = eps, form
        ctx.save_for_backward(x, weight)
        return rms_norm_value(x, weight, eps, form)

    @staticmethod
    @first_order
    def backward(ctx, dy: Tensor):
        x, weight = ctx.saved_tensors
        x, weight = (t.detach().requires_grad_(need)
                     for t, need in zip((x, weight), ctx.needs_input_grad[:2], strict=True))
        with torch.enable_grad():
            y = rms_norm_value(x, weight, ctx.eps, ctx.form)
        wanted = [t for t in (x, weight) if t.requires_grad]
        grads = iter(torch.autograd.grad(y, wanted, dy))
        return (*(next(grads) if t.requires_grad else None for t in (x, weight)), None, None)


class RMSNormFunction(torch.autograd.Function):
    """An RMSNorm keeping its input ``x`` and the float32 ``rsqrt`` per row; backward makes the
    normalised input ``n = x.float() * rsqrt(mean(x^2) + eps)`` again. ``offset=False``: Llama's
    ``weight * n.to(x.dtype)``; ``offset=True``: Gemma's ``(n * (1 + weight.float())).to(x.dtype)``."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, eps: float, offset: bool = False) -> Tensor:
        xf = x.to(torch.float32)
        r = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        ctx.offset = offset
        ctx.save_for_backward(x, weight, r)
        if offset:
            return (xf * r * (1.0 + weight.float())).to(x.dtype)
        return weight * (xf * r).to(x.dtype)

    @staticmethod
    @first_order
    def backward(ctx, dy: Tensor):
        x, weight, r = ctx.saved_tensors
        xf = x.to(torch.float32)
        dw = None
        if ctx.needs_input_grad[1]:
            n = xf * r if ctx.offset else (xf * r).to(x.dtype)
            dw = ((dy.float() if ctx.offset else dy) * n).reshape(-1, n.shape[-1]).sum(0)
            dw = dw.to(weight.dtype)
        dx = None
        if ctx.needs_input_grad[0]:
            dxhat = dy.float() * (1.0 + weight.float()) if ctx.offset else \
                (dy * weight).to(x.dtype).to(torch.float32)
            # d/dx of x * r(x), r = (mean(x^2) + eps)^-1/2: dxhat * r - x r^3 mean(dxhat * x).
            dot = (dxhat * xf).mean(-1, keepdim=True)
            dx = (dxhat * r - xf * r.pow(3) * dot).to(x.dtype)
        return dx, dw, None, None


class _CodedRMSNormFunction(torch.autograd.Function):
    """:class:`RMSNormFunction` on a 2-D float32 ``x`` that saves a ``bits``-bit code of its
    output (a :class:`~sketchprop.codes.SharedCode`, appended to ``made`` for the caller to file),
    the ``rsqrt`` per row and the input columns listed in ``kept``, not the input: backward makes
    the normalised input again as ``y~ / s``, ``s`` the scale (``weight``, or ``1 + weight``
    where ``offset`` is 1). ``code_cols``: columns of the code's rows, a multiple of ``x``'s
    (a token's heads under a QK-norm: rows narrower than a group would pad each to a whole one)."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, eps: float, kept: Tensor | None, bits: int,
                group: int, seed: int, made: list, offset: float = 0.0,
                code_cols: int | None = None) -> Tensor:
        r = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        y = x * r * (1.0 + weight) if offset else weight * (x * r)
        payload, spec, _ = quantize(y.reshape(-1, code_cols or y.shape[-1]), bits, group, seed)
        made.append(SharedCode(payload, spec))
        ctx.spec, ctx.offset = spec, offset
        ctx.save_for_backward(payload, weight, r, kept,
                              None if kept is None else x.index_select(-1, kept))
        return y

    @staticmethod
    @first_order
    def backward(ctx, dy: Tensor):
        payload, weight, r, kept, cols = ctx.saved_tensors
        scale = weight + ctx.offset
        n = SharedCode(payload, ctx.spec).decode().reshape(-1, scale.shape[-1])
        n = n.mul_(scale.reciprocal())
        if kept is not None:
            n.index_copy_(-1, kept, cols * r)
        dw = (dy * n).sum(0) if ctx.needs_input_grad[1] else None
        dx = None
        if ctx.needs_input_grad[0]:
            dn = dy * scale
            # As RMSNormFunction's, with x r = n: r (dn - n mean(dn n)).
            dx = (dn - n * (dn * n).mean(-1, keepdim=True)).mul_(r)
        return dx, dw, *[None] * 8


def _rms_eps(module: nn.Module) -> float | None:
    for name in ("variance_epsilon", "eps"):
        eps = getattr(module, name, None)
        if isinstance(eps, float):
            return eps
    return None


#: Where an RMSNorm's form is kept once found (in the module's ``__dict__``; unpatching drops it).
_FORM = "_sketchprop_rms_form"


def _find_form(module: nn.Module) -> str | None:
    w = getattr(module, "weight", None)
    eps = _rms_eps(module)
    if not (isinstance(w, nn.Parameter) and w.dim() == 1 and eps is not None
            and len(list(module.parameters())) == 1 and not list(module.children())):
        return None
    # At a width of its own: the forms do not depend on it, and a sharded weight (FSDP1's view
    # of its shard, outside forward) has none to read.
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 48, generator=g).to(w.device)
    weight = torch.randn(48, generator=g).to(w.device)
    with torch.no_grad():
        for form in RMS_FORMS:
            try:  # float32, then a bfloat16 input and weight: the casts' places tell them apart
                if all(torch.equal(torch.func.functional_call(module, {"weight": v}, (t,)),
                                   rms_norm_value(t, v, eps, form))
                       for t, v in ((x, weight), (x.bfloat16(), weight),
                                    (x, weight.bfloat16()))):
                    return form
            except Exception:  # a norm that cannot run on this input is not one we know
                return None
    return None


def rms_norm_form(module: nn.Module) -> str | None:
    """How ``module`` computes, if it is an RMSNorm: one of :data:`RMS_FORMS` (module
    docstring, "RMSNorm"), None where it is none of them. Found from what it computes on a random
    input and weight (its own weight untouched), whatever its name; kept in the module once
    found."""
    form = module.__dict__.get(_FORM)
    if form is None:
        form = _find_form(module)
        if form is not None:
            module.__dict__[_FORM] = form
    return form


def forget_rms_form(module: nn.Module) -> None:
    module.__dict__.pop(_FORM, None)


def is_rms_norm(module: nn.Module) -> bool:
    """Whether ``module`` is an RMSNorm of one of the forms :class:`RMSNormFunction` computes
    (:func:`rms_norm_form`)."""
    return rms_norm_form(module) is not None


@eager_island
def rms_norm_forward(self: nn.Module, x: Tensor) -> Tensor:
    """The forward :func:`~sketchprop.patch_activations` gives an RMSNorm (bound to it)."""
    if not (torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad)):
        return type(self).forward(self, x)
    form = rms_norm_form(self)
    if form == "t5" or x.dtype != self.weight.dtype:
        # T5's, and a half precision input under a float32 weight (autocast): the module's ops
        # again, bit for bit where the fused backward below would round otherwise.
        return _RecomputedRMSNorm.apply(x, self.weight, _rms_eps(self), form)
    return RMSNormFunction.apply(x, self.weight, _rms_eps(self), form == "gemma")


class CodedRMSNorm:
    """The forward :func:`~sketchprop.patch_activations` gives an RMSNorm under
    ``rmsnorm="coded"`` (the lean preset): in training with gradients, on float32, it keeps a
    ``bits``-bit code of its output (groups of ``group`` columns, stochastic rounding), filed for
    the next layers to share, and one statistic per row (:class:`_CodedRMSNormFunction`); elsewhere
    :func:`rms_norm_forward`'s. ``name`` (the module's qualified name) seeds the rounding's
    stream. A class, so that ``torch.save(model)`` can pickle it; module docstring, "RMSNorm"."""

    def __init__(self, module: nn.Module, bits: int, group: int = DEFAULT_GROUP, name: str = ""):
        self.module, self.bits, self.group = module, check_bits(bits), check_group(group)
        self.seeds = SeedStream("rmsnorm", name)

    @eager_island
    def __call__(self, x: Tensor) -> Tensor:
        module = self.module
        if not (module.training and x.dtype == torch.float32
                and module.weight.dtype == torch.float32):
            return rms_norm_forward(module, x)
        if not (torch.is_grad_enabled() and (x.requires_grad or module.weight.requires_grad)):
            return type(module).forward(module, x)
        made: list = []
        offset = float(rms_norm_form(module) == "gemma")  # T5's is Llama's in float32
        # A QK-norm's rows are heads (batch, tokens, heads, head_dim): narrower than a group,
        # each would be padded to a whole one (4x the bytes at 16 columns), so the code's rows
        # are a token's heads. No linear layer reads such a code: it is not filed.
        heads = x.dim() >= 4 and x.shape[-1] < self.group
        y = _CodedRMSNormFunction.apply(x.reshape(-1, x.shape[-1]), module.weight,
                                        _rms_eps(module),
                                        _kept_columns(module, None, self.group, offset),
                                        self.bits, self.group, self.seeds.next(), made,
                                        offset, x.shape[-2] * x.shape[-1] if heads else None
                                        ).view(x.shape)
        if not heads:
            file_code(y, made[0])
        return y
