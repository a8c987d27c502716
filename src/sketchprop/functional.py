"""The autograd Function behind :class:`~sketchprop.layers.RandomizedLinear`.

Forward computes ``Y = X W^T + b`` exactly and keeps, for backward, only what each gradient needs:

- ``dX = dY W``            needs ``W`` (a Parameter: no activation memory);
- ``db = sum_rows dY``     needs nothing;
- ``dW ~= (S^T dY)^T (S^T X)`` needs the sketch ``S^T X`` and the seed that regenerates ``S``.

``X`` itself is never saved. The sketch ``S^T X`` is formed by the caller (under ``no_grad``) so that
layers reading the same tensor can share one sketch; this Function only stores it.

A data-dependent sketch (``importance``) cannot be regenerated from a seed without ``X``: forward
passes its plan (the ``k`` row indices, ``k`` scales and the top-set size), which is saved in the
seed's place, and backward applies it to ``dY``.

The seed is saved as a tensor (8 bytes), beside the sketch it made, not as a Python attribute of
the autograd context. Activation checkpointing (``torch.utils.checkpoint``, HF
``gradient_checkpointing_enable``) discards the saved tensors in forward and recomputes them in
backward, while backward keeps the *original* context: a recomputed forward draws a fresh seed and
forms a fresh ``S'^T X``, and only a seed saved as a tensor is replaced along with it. Backward then
pairs ``S'^T X`` with ``S'^T dY``, an unbiased estimate as before; a seed kept on the context would
pair ``S'^T X`` with ``S^T dY``, whose expectation is zero for independent ``S`` and ``S'``.

What backward reads (the sketch, codes, a layer's output) was made without a graph, so a gradient of
a gradient through it (``create_graph=True``: a gradient penalty, meta-learning) would miss terms.
:func:`first_order` marks the backward of this Function and of every Function of
:mod:`sketchprop.activations`: differentiated again, its gradients raise.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import once_differentiable

from .compiling import eager_island
from .quantize import dequantize
from .sketches import ImportancePlan, Sketch

__all__ = ["SketchedLinearFunction", "first_order", "seed_tensor", "sketched_linear"]


def not_a_view(out: Tensor) -> Tensor:
    """``out`` as a tensor of its own (same storage, no copy) where it is a view: ``F.linear`` on
    a 3-D input with a bias returns a view of its 2-D product, and a custom Function's output that
    is a view of a tensor made inside it cannot be changed in place (Falcon adds to its MLP's
    output in place), where the plain layer's can."""
    if not out._is_view():
        return out
    return out.new_empty(0).set_(out.untyped_storage(), out.storage_offset(), out.shape,
                                 out.stride())


def first_order(backward):
    """``backward`` of an autograd Function whose saved tensors carry no graph, made to refuse a
    second derivative: under ``create_graph=True`` its gradients come out with a node that raises
    ("trying to differentiate twice ...") when they are differentiated again. torch's
    ``once_differentiable`` alone marks them only where the incoming gradients carry a graph;
    where they do not (the first Function backward meets, a loss), the gradients would come out
    as constants and a second derivative would silently miss their terms."""
    inner = once_differentiable(backward)

    @functools.wraps(backward)
    def wrapper(ctx, *grads):
        if torch.is_grad_enabled():  # backward runs with grad mode on only for create_graph=True
            grads = tuple(g.detach().requires_grad_() if isinstance(g, Tensor) and
                          g.is_floating_point() and not g.requires_grad else g for g in grads)
        return inner(ctx, *grads)
    return wrapper


class SketchedLinearFunction(torch.autograd.Function):
    """``Y = X W^T + b`` with exact ``dX``, ``db`` and a sketched ``dW``.

    Args (to ``apply``): ``x`` (``..., N_in``), ``weight``, ``bias`` (or None), ``sx`` (``k x N_in``,
    the stored sketch, or None when ``weight`` needs no gradient), ``sketch``, ``k``, ``seed`` (an
    int or a 0-d int64 tensor, saved for backward; see the module docstring), ``rows`` (indices of
    the rows the sketch covers, or None for all), ``tracker`` (an optional
    :class:`~sketchprop.variance.VarianceTracker`) and ``tstate`` (the tensor its ``forward``
    returned; saved for backward, then passed to ``tracker.backward``), ``plan`` (an
    :class:`~sketchprop.sketches.ImportancePlan` for a data-dependent sketch, saved instead of the
    seed), ``hooks`` (callables ``hook(dy2, x_shape, rows, sx, sdy, dw, ntop, qvar)`` run after
    the weight gradient: the gradient-norm estimate and the row allocation learn from them),
    ``quant`` (a :class:`~sketchprop.quantize.QuantSpec` when ``sx`` is the packed payload of
    :func:`~sketchprop.quantize.quantize`, decoded in backward; with ``rows``, a code of every row
    is cut to them: :mod:`sketchprop.codes`) and ``qvar`` (the stored rows'
    rounding variances, saved only for the tracker and the hooks).
    """

    @staticmethod
    def forward(ctx, x, weight, bias, sx, sketch: Sketch, k: int, seed: int, rows, tracker,
                tstate=None, plan=None, hooks=(), quant=None, qvar=None):
        out = not_a_view(F.linear(x, weight, bias))
        need_x, need_w, _ = ctx.needs_input_grad[:3]
        ctx.sketch, ctx.k, ctx.tracker, ctx.hooks, ctx.quant = sketch, k, tracker, hooks, quant
        ctx.x_shape = x.shape
        ctx.has_rows = rows is not None
        # Save only what the requested gradients need: a frozen weight keeps no sketch at all, and
        # the exact "sketch" (A itself) needs no seed.
        saved = [weight if need_x else None, sx if need_w else None]
        saved.append(rows if (need_w and rows is not None) else None)
        saved.append(tstate if (need_w and tracker is not None) else None)
        needs_seed = need_w and sketch.name != "exact" and plan is None
        saved.append(seed_tensor(seed) if needs_seed else None)
        saved.extend([plan.index, plan.scale, plan.ntop] if (need_w and plan is not None)
                     else [None, None, None])
        saved.append(qvar if (need_w and (tracker is not None or hooks)) else None)
        ctx.save_for_backward(*saved)
        return out

    @staticmethod
    @first_order
    def backward(ctx, dy: Tensor):
        weight, sx, rows, tstate, seed, index, scale, ntop, qvar = ctx.saved_tensors
        seed = 0 if seed is None else int(seed)
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        dy2 = dy.reshape(-1, dy.shape[-1])
        dx = dw = db = None
        if need_x:
            dx = (dy2 @ weight).reshape(ctx.x_shape)
        if need_w:
            if ctx.quant is not None:
                sx = dequantize(sx, ctx.quant)
                if ctx.sketch.exact and rows is not None and sx.shape[0] != rows.shape[0]:
                    # a code of every row (sketchprop.codes): keep the real ones
                    sx = sx.index_select(0, rows)
            if index is not None:
                sdy = ImportancePlan(index, scale, ntop).apply(dy2)
                ntop = int(ntop)
            else:
                sdy = ctx.sketch.apply(dy2, ctx.k, seed, rows)
                ntop = 0
            dw = sdy.T @ sx
            if ctx.tracker is not None:
                ctx.tracker.backward(tstate, dy2, rows, sdy, sx, dw, ctx.sketch, ctx.k, ntop,
                                     qvar)
            for hook in ctx.hooks:
                hook(dy2, ctx.x_shape, rows, sx, sdy, dw, ntop, qvar)
        if need_b:
            db = dy2.sum(0)
        return dx, dw, db, None, None, None, None, None, None, None, None, None, None, None


def seed_tensor(seed) -> Tensor:
    """``seed`` as a 0-d int64 CPU tensor (a tensor passes through unchanged)."""
    if isinstance(seed, Tensor):
        return seed
    return torch.tensor(int(seed), dtype=torch.int64)


@eager_island
def sketched_linear(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    sketch: Sketch,
    k: int,
    seed: int,
    rows: Tensor | None = None,
    sx: Tensor | None = None,
    tracker=None,
) -> Tensor:
    """Functional form: ``F.linear`` whose weight gradient is sketched with ``k`` rows.

    ``sx`` may be passed in (a sketch shared with other layers); otherwise it is formed here. A
    data-dependent sketch needs its state: use :class:`~sketchprop.layers.RandomizedLinear`.
    """
    if sketch.data_dependent:
        raise TypeError(f"sketch {sketch.name!r} depends on X and a per-layer state; "
                        "use RandomizedLinear")
    tstate = None
    if weight.requires_grad and torch.is_grad_enabled():
        with torch.no_grad():
            x2 = x.detach().reshape(-1, x.shape[-1])
            if sx is None:
                sx = sketch.apply(x2, k, seed, rows)
            if tracker is not None:
                tstate = tracker.forward(x2, rows, k, sketch)
    return SketchedLinearFunction.apply(x, weight, bias, sx, sketch, k, seed, rows, tracker,
                                        tstate)
