r"""The SiLU-gated MLP (Llama's ``down(silu(gate(x)) * up(x))``) that keeps its gate and up
outputs (``mlp="recompute"``) or only its input (``mlp="input"``) for backward.

**Gated MLP** (``mlp="recompute"``, :func:`gated_mlp_forward`): ``down(silu(gate(x)) * up(x))``
keeps the gate and up projections' outputs and makes ``silu`` and the product again in backward
(:class:`SiluProduct`); where ``down`` is a trainable ``nn.Linear``, its input (that product) is
made again too, for its weight gradient (:class:`GatedDown`). Exact: backward uses PyTorch's own
``silu_backward``. ``mlp="input"`` (:func:`gated_mlp_input_forward`) keeps the MLP's input only
and computes the gate and up projections again in backward, from the weights forward used
(``nn.Linear``, ``RandomizedLinear``, peft LoRA layers of those without LoRA dropout, adapters on
and not merged; taken in forward, so adapters switched or disabled before backward do not
matter, and a weight changed in place raises; checked bit for bit on the first call and on
every call while hooks are on the projections; any other MLP keeps the gate and up outputs):
one activation of the hidden size instead of two of the MLP's width, for two more matmuls per
MLP. Exact. ``mlp="auto"`` (the default, :func:`gated_mlp_auto_forward`) takes ``"input"`` where the
gate and up weights are frozen (LoRA) and ``"recompute"`` where they train. Why, measured on a
Llama shape (hidden 768, MLP 2048, GQA 12/4, 4x256 tokens, CPU): with LoRA + sketch + compact,
``"input"`` keeps 0.28x exact's saved bytes against 0.47x, and its step takes 0.99x exact's
time against 0.86x; fully fine-tuned, where the two more matmuls come on top of the weight
gradients' own, compact's step took 1.24x exact's with ``"input"`` against 1.06x.

**Coded** (``mlp="coded"``, :class:`CodedGatedMLP`, the lean preset): as ``"input"``, with the
input kept as the ``b``-bit code that its RMSNorm filed (or one made here), the same code that the
gate and up projections' ``b``-bit codes are: nothing of the MLP's width is kept but the down
projection's own input code. Backward makes ``g~ = gate(x~)`` and ``u~ = up(x~)`` from the decoded
input ``x~``: ``u~`` is unbiased, but ``silu(g~)`` and ``silu'(g~)`` are not linear in the code,
so the gradients reaching the gate and up projections carry a bias of second order in the
rounding (measured, with the other coded parts, by the lean benchmarks).
"""

from __future__ import annotations

import inspect
import re
import warnings

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..codes import SharedCode, code_of, make_code
from ..compiling import eager_island
from ..functional import first_order
from ..rng import SeedStream
from .projections import _autocast_dtype, _linear_weights, forward_hooks_on


class SiluProduct(torch.autograd.Function):
    """``silu(g) * u``, keeping ``g`` and ``u`` (SiLU's output and the product are made again in
    backward). Gradients are autograd's: the same ``silu_backward`` on the same values."""

    @staticmethod
    def forward(ctx, g: Tensor, u: Tensor) -> Tensor:
        ctx.save_for_backward(g, u)
        return F.silu(g) * u

    @staticmethod
    @first_order
    def backward(ctx, dy: Tensor):
        g, u = ctx.saved_tensors
        dg = torch.ops.aten.silu_backward(dy * u, g) if ctx.needs_input_grad[0] else None
        du = dy * F.silu(g) if ctx.needs_input_grad[1] else None
        return dg, du


class GatedDown(torch.autograd.Function):
    """``F.linear(silu(g) * u, weight, bias)``, keeping ``g``, ``u`` and the weight: the down
    projection's input is made again in backward for its weight gradient. Autocast's casts are
    done by hand (``dtype``: the matmul's dtype), so backward computes in the forward's dtypes."""

    @staticmethod
    def forward(ctx, g: Tensor, u: Tensor, weight: Tensor, bias: Tensor | None,
                dtype: torch.dtype) -> Tensor:
        ctx.dtype = dtype
        ctx.save_for_backward(g, u, weight)
        ctx.has_bias = bias is not None
        with torch.autocast(g.device.type, enabled=False):
            h = (F.silu(g) * u).to(dtype)
            return F.linear(h, weight.to(dtype), None if bias is None else bias.to(dtype))

    @staticmethod
    @first_order
    def backward(ctx, dy: Tensor):
        g, u, weight = ctx.saved_tensors
        s = F.silu(g)
        h = (s * u).to(ctx.dtype)
        dy = dy.to(ctx.dtype)
        dw = db = None
        if ctx.needs_input_grad[2]:
            dw = dy.reshape(-1, dy.shape[-1]).T.matmul(h.reshape(-1, h.shape[-1])).to(weight.dtype)
        if ctx.has_bias and ctx.needs_input_grad[3]:
            db = dy.reshape(-1, dy.shape[-1]).sum(0).to(weight.dtype)
        dh = dy.matmul(weight.to(ctx.dtype)).to(g.dtype)
        dg = torch.ops.aten.silu_backward(dh * u, g) if ctx.needs_input_grad[0] else None
        du = dh * s if ctx.needs_input_grad[1] else None
        return dg, du, dw, db, None


_GATED = re.compile(r"self\.down_proj\(\s*self\.act_fn\(\s*self\.gate_proj\(\s*(\w+)\s*\)\s*\)"
                    r"\s*\*\s*self\.up_proj\(\s*\1\s*\)\s*\)")


def _is_silu(module) -> bool:
    if type(module) is nn.SiLU:
        return True
    try:
        from transformers.activations import SiLUActivation
    except ImportError:  # pragma: no cover
        return False
    return type(module) is SiLUActivation


def is_gated_mlp(module: nn.Module) -> bool:
    """Whether ``module`` is a SiLU-gated MLP of Llama's form: ``gate_proj``, ``up_proj``,
    ``down_proj`` and a SiLU ``act_fn``, its forward ``down_proj(act_fn(gate_proj(x)) *
    up_proj(x))`` (read from its class's source)."""
    if not (all(isinstance(getattr(module, n, None), nn.Module)
                for n in ("gate_proj", "up_proj", "down_proj"))
            and _is_silu(getattr(module, "act_fn", None))):
        return False
    try:
        source = inspect.getsource(type(module).forward)
    except (OSError, TypeError):
        return False
    return _GATED.search(source) is not None


_INPUT_CHECKED = "_sketchprop_projections_checked"


def _projection_plan(module: nn.Module) -> tuple | None:
    """How ``module(x)`` is computed, with the tensors it uses taken now: ``("linear", weight,
    bias)`` for an ``nn.Linear`` or a :class:`~sketchprop.layers.RandomizedLinear` (whose output is
    that ``F.linear``); ``("lora", base, adapters, cast)`` for a peft LoRA ``Linear`` built of those
    (plain LoRA, no dropout, adapters on and not merged), ``adapters`` its active ones as ``(A, B,
    scaling, A's dtype)``; None for anything else. Taken in forward, so that backward makes the
    output again as forward computed it, whatever the module's adapters are set to by then."""
    pair = _linear_weights(module)
    if pair is not None:
        return ("linear", *pair)
    names = ("base_layer", "lora_A", "lora_B", "lora_dropout", "scaling", "active_adapters")
    if not all(hasattr(module, n) for n in names) or getattr(module, "merged", True) \
            or getattr(module, "disable_adapters", True) or getattr(module, "lora_variant", None):
        return None
    base = _projection_plan(module.base_layer)
    if base is None:
        return None
    adapters = []
    for name in module.active_adapters:
        if name not in module.lora_A.keys():
            continue
        if type(module.lora_dropout[name]) is not nn.Identity:
            return None
        a, b = _projection_plan(module.lora_A[name]), _projection_plan(module.lora_B[name])
        if a is None or b is None:
            return None
        adapters.append((a, b, module.scaling[name], module.lora_A[name].weight.dtype))
    return ("lora", base, tuple(adapters), getattr(module, "cast_input_dtype_enabled", True))


def _plan_value(plan: tuple, x: Tensor) -> Tensor:
    """The output a :func:`_projection_plan` describes, for input ``x`` (peft's arithmetic)."""
    if plan[0] == "linear":
        return F.linear(x, plan[1], plan[2])
    _, base, adapters, cast = plan
    result = _plan_value(base, x)
    dtype = result.dtype
    for a, b, scaling, a_dtype in adapters:
        xa = x.to(a_dtype) if cast and x.dtype != a_dtype else x
        result = result + _plan_value(b, _plan_value(a, xa)) * scaling
    return result.to(dtype)


def _plan_tensors(plan: tuple) -> list[Tensor]:
    """The weights and biases a plan uses (kept by backward to catch a change made in place)."""
    if plan[0] == "linear":
        return [t for t in plan[1:] if t is not None]
    _, base, adapters, _ = plan
    return [*_plan_tensors(base), *(t for a, b, _, _ in adapters
                                    for t in (*_plan_tensors(a), *_plan_tensors(b)))]


class GatedFromInput(torch.autograd.Function):
    """``silu(g) * u`` for ``g = gate(x)``, ``u = up(x)``, keeping ``x`` only: backward computes
    ``g`` and ``u`` again from ``x`` by the plans taken in forward (:func:`_projection_plan`,
    under the forward's autocast). The plans' weights are saved too (no copy), so a change made
    to them in place between forward and backward raises, as it does for any saved tensor. The
    gradients reach ``gate`` and ``up`` through the graphs their own forward built."""

    @staticmethod
    def forward(ctx, g: Tensor, u: Tensor, x: Tensor, plans: tuple,
                autocast: torch.dtype | None, code: SharedCode | None = None) -> Tensor:
        ctx.plans, ctx.autocast = plans, autocast
        ctx.code = None if code is None else (code.spec, x.shape, x.dtype)
        # With a code of x (mlp="coded"), its payload in x's place.
        ctx.save_for_backward(x.detach() if code is None else code.payload,
                              *(t for plan in plans for t in _plan_tensors(plan)))
        return F.silu(g) * u

    @staticmethod
    @first_order
    def backward(ctx, dy: Tensor):
        x = ctx.saved_tensors[0]  # unpacking checks that no saved weight changed in place
        if ctx.code is not None:
            spec, shape, dtype = ctx.code
            x = SharedCode(x, spec).decode(dtype).view(shape)
        with torch.no_grad(), torch.autocast(x.device.type, dtype=ctx.autocast or torch.bfloat16,
                                             enabled=ctx.autocast is not None):
            g, u = (_plan_value(plan, x) for plan in ctx.plans)
        dg = torch.ops.aten.silu_backward(dy * u, g) if ctx.needs_input_grad[0] else None
        du = dy * F.silu(g) if ctx.needs_input_grad[1] else None
        return dg, du, None, None, None, None


def _recomputable(mlp: nn.Module, x: Tensor, g: Tensor, u: Tensor, plans: tuple) -> bool:
    """Whether ``mlp``'s gate and up outputs are made again from ``x`` by ``plans``, bit for bit:
    checked on the first call (one extra projection) and on every call while hooks may change the
    outputs; a module that fails keeps g and u from then on, with a warning."""
    checked = mlp.__dict__.get(_INPUT_CHECKED)
    if checked is None or (checked and forward_hooks_on(
            m for proj in (mlp.gate_proj, mlp.up_proj) for m in proj.modules())):
        with torch.no_grad():
            checked = all(torch.equal(_plan_value(plan, x), t)
                          for plan, t in zip(plans, (g, u), strict=True))
        mlp.__dict__[_INPUT_CHECKED] = checked
        if not checked:
            warnings.warn(f"{type(mlp).__name__}'s gate and up outputs are not its projections of "
                          "its input; mlp='input' keeps them for this module", stacklevel=3)
    return checked


def keeps_input(mlp: nn.Module) -> bool:
    """Whether ``mlp="auto"`` keeps this gated MLP's input now: its gate and up weights frozen and
    both projections plain or LoRA linear layers that can be made again (no LoRA dropout, adapters
    on and not merged)."""
    return frozen_projections(mlp) and None not in (_projection_plan(mlp.gate_proj),
                                                    _projection_plan(mlp.up_proj))


def forget_mlp_check(module: nn.Module) -> None:
    module.__dict__.pop(_INPUT_CHECKED, None)


@eager_island
def gated_mlp_input_forward(self: nn.Module, x: Tensor, code: SharedCode | None = None,
                            version: int = 0) -> Tensor:
    """The forward of ``mlp="input"``: the gated MLP keeps its input only, and backward computes
    the gate and up projections again (two more matmuls of the MLP's width per token); where they
    cannot be made again bit for bit, :func:`gated_mlp_forward`'s. With ``code`` (a code of ``x``
    at its ``version``: :class:`CodedGatedMLP`), it keeps the code and backward computes them from
    the decoded input, unless ``x`` changed in place since (a hook on a projection): then ``x``."""
    g, u = self.gate_proj(x), self.up_proj(x)
    if code is not None and x._version != version:
        code = None
    if not (torch.is_grad_enabled() and (g.requires_grad or u.requires_grad)):
        return _gated_rest(self, g, u)
    plans = (_projection_plan(self.gate_proj), _projection_plan(self.up_proj))
    if None in plans or not _recomputable(self, x, g, u, plans):
        return _gated_rest(self, g, u)
    return self.down_proj(GatedFromInput.apply(g, u, x, plans, _autocast_dtype(x), code))


class CodedGatedMLP:
    """The forward of ``mlp="coded"`` (the lean preset): as ``mlp="input"``, keeping a ``bits``-bit
    code of the MLP's input in place of the input: the one filed under it (the RMSNorm's, under
    ``rmsnorm="coded"``) or one made and filed here, before the gate and up projections run, so that
    their ``bits``-bit codes are the same one (:mod:`sketchprop.codes`). Backward computes the gate
    and up outputs from the decoded input: not exact (SiLU is not linear; module docstring,
    "Coded"). Float32 training with gradients only; elsewhere :func:`gated_mlp_forward`'s. ``name``
    (the module's qualified name) seeds the rounding's stream. A class, so that
    ``torch.save(model)`` can pickle it."""

    def __init__(self, module: nn.Module, bits: int, group: int, name: str = ""):
        self.module, self.bits, self.group = module, bits, group
        self.seeds = SeedStream("mlp-input", name)

    @eager_island
    def __call__(self, x: Tensor) -> Tensor:
        mlp = self.module
        if not (mlp.training and torch.is_grad_enabled() and x.dtype == torch.float32):
            return gated_mlp_forward(mlp, x)
        code = code_of(x) or make_code(x, self.bits, self.group, self.seeds.next())
        return gated_mlp_input_forward(mlp, x, code, x._version)


def _gated_rest(self: nn.Module, g: Tensor, u: Tensor) -> Tensor:
    if not (torch.is_grad_enabled() and (g.requires_grad or u.requires_grad)):
        return self.down_proj(self.act_fn(g) * u)
    down = self.down_proj
    if type(down) is nn.Linear and down.weight.requires_grad:  # decided per call: patch_linear
        dtype = _autocast_dtype(g) or torch.promote_types(g.dtype, u.dtype)  # may swap it later
        return GatedDown.apply(g, u, down.weight, down.bias, dtype)
    return down(SiluProduct.apply(g, u))


@eager_island
def gated_mlp_forward(self: nn.Module, x: Tensor) -> Tensor:
    """The forward :func:`~sketchprop.patch_activations` gives a SiLU-gated MLP (bound to it):
    the model's own arithmetic, keeping the gate and up outputs only (module docstring)."""
    return _gated_rest(self, self.gate_proj(x), self.up_proj(x))


def _full_weight(module: nn.Module) -> Tensor | None:
    """A projection's full-size weight: its own, or (peft adapters) its base layer's."""
    while isinstance(getattr(module, "base_layer", None), nn.Module):
        module = module.base_layer
    weight = getattr(module, "weight", None)
    return weight if isinstance(weight, Tensor) else None


def frozen_projections(mlp: nn.Module) -> bool:
    """Whether a gated MLP's gate and up projections' full-size weights are frozen (LoRA)."""
    weights = (_full_weight(mlp.gate_proj), _full_weight(mlp.up_proj))
    return all(w is not None and not w.requires_grad for w in weights)


@eager_island
def gated_mlp_auto_forward(self: nn.Module, x: Tensor) -> Tensor:
    """The forward of ``mlp="auto"`` (the default): :func:`gated_mlp_input_forward`'s where the
    gate and up projections' full-size weights are frozen (LoRA), :func:`gated_mlp_forward`'s
    where they train. Decided on each call, so freezing before or after patching is the same."""
    if frozen_projections(self):
        return gated_mlp_input_forward(self, x)
    return gated_mlp_forward(self, x)
