r"""The gated MLP (``down(act(gate(x)) * up(x))``: Llama's, Gemma's, Phi-3's, ModernBERT's GLU) that
keeps its gate and up outputs (``mlp="recompute"``) or only its input (``mlp="input"``) for backward.

**Found by what it computes** (:func:`gated_layout`): a module whose children are two or three
linear projections, one activation (SiLU, exact or tanh GELU, told apart by their values) and
dropouts of ``p == 0``, and whose forward, on a random input with random weights, is
``down(act(gate(x)) * up(x))`` for some assignment of its projections: separate gate and up
(Llama's ``gate_proj``, ``up_proj``; Gemma's, GELU-gated) or one fused projection whose output's
two halves are the gate and up (Phi-3's ``gate_up_proj``, gate first; ModernBERT's ``Wi``, its
first half through the activation too), whatever the names.

**Gated MLP** (``mlp="recompute"``, :func:`gated_mlp_forward`): ``down(act(g) * u)`` keeps the gate
and up projections' outputs and makes ``act`` and the product again in backward
(:class:`GateProduct`); where ``down`` is a trainable ``nn.Linear``, its input (that product) is
made again too, for its weight gradient (:class:`GatedDown`). Exact: backward uses PyTorch's own
``silu_backward`` or ``gelu_backward``. ``mlp="input"`` (:func:`gated_mlp_input_forward`) keeps the
MLP's input only and computes the gate and up projections again in backward, from the weights
forward used (``nn.Linear``, ``RandomizedLinear``, peft LoRA layers of those without LoRA dropout,
adapters on and not merged; taken in forward, so adapters switched or disabled before backward
do not matter, and a weight changed in place raises; checked bit for bit on the first call and
on every call while hooks are on the projections; any other MLP keeps the gate and up outputs):
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
input ``x~``: ``u~`` is unbiased, but ``act(g~)`` and ``act'(g~)`` are not linear in the code,
so the gradients reaching the gate and up projections carry a bias of second order in the
rounding (measured, with the other coded parts, by the lean benchmarks).
"""

from __future__ import annotations

import itertools
import math
import warnings
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..codes import SharedCode, code_of, make_code
from ..compiling import eager_island
from ..functional import first_order, not_a_view
from ..rng import SeedStream
from .projections import _autocast_dtype, _linear_weights, forward_hooks_on


def _gelu_new(x: Tensor) -> Tensor:
    """GPT-2's ``gelu_new``, by transformers' ops in their order (not ``F.gelu``'s tanh form,
    which rounds otherwise)."""
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


def _by_autograd(f):
    """The backward ``(dy, g) -> dg`` of an activation written as ops: autograd's own, on ``g``."""
    def backward(dy: Tensor, g: Tensor) -> Tensor:
        with torch.enable_grad():
            g = g.detach().requires_grad_(True)
            return torch.autograd.grad(f(g), g, dy)[0]
    return backward


#: The activations an MLP may use: each function and its backward (PyTorch's own), by name.
GATES = {
    "relu": (F.relu, partial(torch.ops.aten.threshold_backward, threshold=0)),
    "silu": (F.silu, torch.ops.aten.silu_backward),
    "gelu": (F.gelu, partial(torch.ops.aten.gelu_backward, approximate="none")),
    "gelu_tanh": (partial(F.gelu, approximate="tanh"),
                  partial(torch.ops.aten.gelu_backward, approximate="tanh")),
    "gelu_new": (_gelu_new, _by_autograd(_gelu_new)),
}
#: From a code (``mlp="coded"``: not exact anyway), the activation computed as another of
#: :data:`GATES`: GPT-2's ``gelu_new`` as PyTorch's tanh GELU, the same function to rounding (as
#: the GELU part's ``CompactTanhGELU`` computes it), one fused kernel each way where ``gelu_new``
#: is eight ops forward and autograd through them backward (GPT-2's step under lean at hidden
#: 384: 1.40x exact's, against 1.13x with its MLP stored, measured).
CODED_AS = {"gelu_new": "gelu_tanh"}


def _gated(gate_fn: str, g: Tensor, u: Tensor | None) -> Tensor:
    """``act(g) * u``, or ``act(g)`` for a plain MLP (no up projection: ``u`` None)."""
    h = GATES[gate_fn][0](g)
    return h if u is None else h * u


def gate_of(module: nn.Module) -> str | None:
    """The name in :data:`GATES` of the function a parameter-free ``module`` computes, told by
    its values on a random input; None where it is none of them."""
    if list(module.parameters()) or list(module.children()):
        return None
    z = 4 * torch.randn(256, generator=torch.Generator().manual_seed(0))
    try:
        with torch.no_grad():
            out = module(z)
    except Exception:  # not a function of one tensor
        return None
    return next((name for name, (f, _) in GATES.items()
                 if isinstance(out, Tensor) and torch.equal(out, f(z))), None)


@dataclass(frozen=True)
class GatedLayout:
    """How a gated MLP computes (:func:`gated_layout`): its children's names (``gate`` and ``up``
    the same where one projection is fused, ``half`` then the index of the gate's half of its
    output; None where they are separate; ``up`` empty for a plain MLP, ``down(act(gate(x)))``),
    its gate's name in :data:`GATES`, and its dropouts."""

    gate: str
    up: str
    down: str
    act: str
    gate_fn: str
    half: int | None = None
    drops: tuple[str, ...] = ()

    def projections(self, mlp: nn.Module) -> list[nn.Module]:
        """The gate and up projections (one, where fused)."""
        return [getattr(mlp, n) for n in dict.fromkeys((self.gate, self.up)) if n]

    def gate_up(self, mlp: nn.Module, x: Tensor) -> tuple[Tensor, Tensor]:
        """The gate and up outputs, by the MLP's own projection modules."""
        if self.half is None:
            return getattr(mlp, self.gate)(x), getattr(mlp, self.up)(x) if self.up else None
        return _halves(getattr(mlp, self.gate)(x), self.half)


def _halves(y: Tensor, half: int) -> tuple[Tensor, Tensor]:
    halves = y.chunk(2, dim=-1)
    return halves[half], halves[1 - half]


def _features(module: nn.Module) -> tuple[int, int] | None:
    """``(in, out)`` of a linear layer: ``nn.Linear``'s features, or transformers' Conv1D's."""
    shape = getattr(module, "in_features", None), getattr(module, "out_features", None)
    if not all(isinstance(n, int) for n in shape):
        shape = getattr(module, "nx", None), getattr(module, "nf", None)
    return shape if all(isinstance(n, int) for n in shape) else None


def _candidates(mlp: nn.Module) -> list[GatedLayout]:
    """The layouts ``mlp``'s children could have, by their kinds and shapes alone."""
    if list(mlp.named_parameters(recurse=False)):
        return []
    children = dict(mlp.named_children())
    shapes = {n: f for n, c in children.items() if (f := _features(c)) is not None}
    drops = tuple(n for n, c in children.items() if isinstance(c, nn.Dropout))
    rest = [n for n in children if n not in shapes and n not in drops]
    if len(shapes) not in (2, 3) or len(rest) != 1 \
            or any(children[n].p != 0 for n in drops):
        return []
    gate_fn = gate_of(children[rest[0]])
    if gate_fn is None:
        return []
    found = []
    for names in itertools.permutations(shapes):
        (h, f), *_, (f_down, h_down) = (shapes[n] for n in names)
        if h != h_down:
            continue
        if len(names) == 3 and shapes[names[1]] == (h, f) and f == f_down:
            found.append(GatedLayout(names[0], names[1], names[2], rest[0], gate_fn, None, drops))
        elif len(names) == 2 and f == 2 * f_down:
            found += [GatedLayout(names[0], names[0], names[1], rest[0], gate_fn, half, drops)
                      for half in (0, 1)]
        elif len(names) == 2 and f == f_down:
            found.append(GatedLayout(names[0], "", names[1], rest[0], gate_fn, None, drops))
    return found


def _probe(mlp: nn.Module, layouts: list[GatedLayout]) -> GatedLayout | None:
    """The one of ``layouts`` whose composition is ``mlp``'s forward bit for bit, on a random
    input with random weights (its own untouched), in training mode (each evaluation drawing the
    same random numbers) and in eval mode; None where none is."""
    g = torch.Generator().manual_seed(0)
    params = dict(mlp.named_parameters())
    if not params:
        return None
    p0 = next(iter(params.values()))

    def shape(name: str, p: Tensor) -> tuple[int, ...]:
        # A linear layer's from its features: a sharded weight (FSDP1's view of its shard,
        # outside forward) has not its own.
        owner, _, leaf = name.rpartition(".")
        layer = mlp.get_submodule(owner)
        if isinstance(layer, nn.Linear) and leaf in ("weight", "bias"):
            return (layer.out_features, layer.in_features)[:2 if leaf == "weight" else 1]
        return tuple(p.shape)

    random = {n: torch.randn(shape(n, p), generator=g).to(p0.device, p.dtype)
              for n, p in params.items()}
    modes = {m: m.training for m in mlp.modules()}

    def call(name: str, x: Tensor) -> Tensor:
        child = getattr(mlp, name)
        return torch.func.functional_call(
            child, {k[len(name) + 1:]: v for k, v in random.items() if k.startswith(name + ".")},
            (x,))

    def composed(layout: GatedLayout, x: Tensor) -> Tensor:
        if layout.half is None:
            gate, up = call(layout.gate, x), call(layout.up, x) if layout.up else None
        else:
            gate, up = _halves(call(layout.gate, x), layout.half)
        return call(layout.down, _gated(layout.gate_fn, gate, up))

    def seeded(fn, *args) -> Tensor:
        # In training, each evaluation draws the same numbers: a LoRA dropout of a projection
        # draws alike in both, a dropout of the MLP's own only in its forward (then no match).
        with torch.random.fork_rng(devices=[p0.device] if p0.device.type == "cuda" else []):
            torch.manual_seed(0)
            return fn(*args)

    def matches(layout: GatedLayout) -> bool:
        x = torch.randn(3, _features(getattr(mlp, layout.gate))[0],
                        generator=torch.Generator().manual_seed(1)).to(p0.device, p0.dtype)
        for training in (True, False):  # its computation in either mode
            mlp.train(training)
            try:
                want = seeded(torch.func.functional_call, mlp, random, (x,))
                if not (isinstance(want, Tensor) and torch.equal(seeded(composed, layout, x),
                                                                 want)):
                    return False
            except Exception:  # a module that cannot run on this input is not this layout
                return False
        return True

    try:
        with torch.no_grad():
            return next((layout for layout in layouts if matches(layout)), None)
    finally:
        for m, mode in modes.items():
            m.training = mode


_LAYOUT = "_sketchprop_gated_layout"


def gated_layout(module: nn.Module) -> GatedLayout | None:
    """How ``module`` computes, if it is a gated MLP (module docstring, "Found by what it
    computes"); None where it is not. Kept in the module once found."""
    layout = module.__dict__.get(_LAYOUT)
    if layout is None:
        candidates = _candidates(module)
        layout = _probe(module, candidates) if candidates else None
        if layout is not None:
            module.__dict__[_LAYOUT] = layout
    return layout


def is_gated_mlp(module: nn.Module) -> bool:
    """Whether ``module`` is a gated MLP, ``down(act(gate(x)) * up(x))`` with a SiLU or GELU
    gate, separate or fused gate and up projections (:func:`gated_layout`)."""
    layout = gated_layout(module)
    return layout is not None and bool(layout.up)


def takes_mlp(mlp: str):
    """The MLPs ``mlp=`` (a mode of :func:`~sketchprop.patch_activations`) gives a forward of its
    own: gated ones, and plain ones too under ``"input"`` and ``"coded"``; none under
    ``"stored"``."""
    if mlp == "stored":
        return lambda module: False
    if mlp in ("input", "coded"):
        return lambda module: gated_layout(module) is not None
    return is_gated_mlp


def is_plain_mlp(module: nn.Module) -> bool:
    """Whether ``module`` is a plain MLP in one module, ``down(act(up(x)))`` with a ReLU, SiLU or
    GELU activation (T5's ``DenseReluDense``, DistilBERT's ``FFN``; :func:`gated_layout`): made
    again from its input under ``mlp="input"`` and ``"coded"`` only (the other modes leave it to
    the GELU part)."""
    layout = gated_layout(module)
    return layout is not None and not layout.up


class GateProduct(torch.autograd.Function):
    """``act(g) * u``, keeping ``g`` and ``u`` (the gate's output and the product are made again in
    backward). Gradients are autograd's: the same ``silu_backward`` or ``gelu_backward`` on the
    same values."""

    @staticmethod
    def forward(ctx, g: Tensor, u: Tensor, gate_fn: str) -> Tensor:
        ctx.gate_fn = gate_fn
        ctx.save_for_backward(g, u)
        return _gated(gate_fn, g, u)

    @staticmethod
    @first_order
    def backward(ctx, dy: Tensor):
        g, u = ctx.saved_tensors
        f, df = GATES[ctx.gate_fn]
        dg = df(dy if u is None else dy * u, g) if ctx.needs_input_grad[0] else None
        du = dy * f(g) if u is not None and ctx.needs_input_grad[1] else None
        return dg, du, None


class GatedDown(torch.autograd.Function):
    """``F.linear(act(g) * u, weight, bias)``, keeping ``g``, ``u`` and the weight: the down
    projection's input is made again in backward for its weight gradient. Autocast's casts are
    done by hand (``dtype``: the matmul's dtype), so backward computes in the forward's dtypes."""

    @staticmethod
    def forward(ctx, g: Tensor, u: Tensor, weight: Tensor, bias: Tensor | None,
                dtype: torch.dtype, gate_fn: str) -> Tensor:
        ctx.dtype, ctx.gate_fn = dtype, gate_fn
        ctx.save_for_backward(g, u, weight)
        ctx.has_bias = bias is not None
        with torch.autocast(g.device.type, enabled=False):
            h = _gated(gate_fn, g, u).to(dtype)
            return not_a_view(F.linear(h, weight.to(dtype),
                                       None if bias is None else bias.to(dtype)))

    @staticmethod
    @first_order
    def backward(ctx, dy: Tensor):
        g, u, weight = ctx.saved_tensors
        f, df = GATES[ctx.gate_fn]
        s = f(g)
        h = (s if u is None else s * u).to(ctx.dtype)
        dy = dy.to(ctx.dtype)
        dw = db = None
        if ctx.needs_input_grad[2]:
            dw = dy.reshape(-1, dy.shape[-1]).T.matmul(h.reshape(-1, h.shape[-1])).to(weight.dtype)
        if ctx.has_bias and ctx.needs_input_grad[3]:
            db = dy.reshape(-1, dy.shape[-1]).sum(0).to(weight.dtype)
        dh = dy.matmul(weight.to(ctx.dtype)).to(g.dtype)
        dg = df(dh if u is None else dh * u, g) if ctx.needs_input_grad[0] else None
        du = dh * s if u is not None and ctx.needs_input_grad[1] else None
        return dg, du, dw, db, None, None


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


def _plans_value(plans: tuple, half: int | None, x: Tensor) -> tuple[Tensor, Tensor]:
    """The gate and up outputs the projections' plans give for ``x``: one plan each, or one fused
    plan whose output's ``half`` is the gate."""
    if half is None:
        values = [_plan_value(plan, x) for plan in plans]
        return values[0], values[1] if len(values) > 1 else None  # a plain MLP: no up
    return _halves(_plan_value(plans[0], x), half)


class GatedFromInput(torch.autograd.Function):
    """``act(g) * u`` for ``g = gate(x)``, ``u = up(x)``, keeping ``x`` only: backward computes
    ``g`` and ``u`` again from ``x`` by the plans taken in forward (:func:`_projection_plan`, one
    per projection, one where fused with the gate's ``half``; under the forward's autocast). The
    plans' weights are saved too (no copy), so a change made to them in place between forward and
    backward raises, as it does for any saved tensor. The gradients reach the projections through
    the graphs their own forward built."""

    @staticmethod
    def forward(ctx, g: Tensor, u: Tensor, x: Tensor, plans: tuple, half: int | None,
                gate_fn: str, autocast: torch.dtype | None,
                code: SharedCode | None = None) -> Tensor:
        if code is not None:
            gate_fn = CODED_AS.get(gate_fn, gate_fn)
        ctx.plans, ctx.half, ctx.gate_fn, ctx.autocast = plans, half, gate_fn, autocast
        ctx.code = None if code is None else (code.spec, x.shape, x.dtype)
        # With a code of x (mlp="coded"), its payload in x's place.
        ctx.save_for_backward(x.detach() if code is None else code.payload,
                              *(t for plan in plans for t in _plan_tensors(plan)))
        return _gated(gate_fn, g, u)

    @staticmethod
    @first_order
    def backward(ctx, dy: Tensor):
        x = ctx.saved_tensors[0]  # unpacking checks that no saved weight changed in place
        if ctx.code is not None:
            spec, shape, dtype = ctx.code
            x = SharedCode(x, spec).decode(dtype).view(shape)
        with torch.no_grad(), torch.autocast(x.device.type, dtype=ctx.autocast or torch.bfloat16,
                                             enabled=ctx.autocast is not None):
            g, u = _plans_value(ctx.plans, ctx.half, x)
        f, df = GATES[ctx.gate_fn]
        dg = df(dy if u is None else dy * u, g) if ctx.needs_input_grad[0] else None
        du = dy * f(g) if u is not None and ctx.needs_input_grad[1] else None
        return dg, du, None, None, None, None, None, None


def _recomputable(mlp: nn.Module, layout: GatedLayout, x: Tensor, g: Tensor, u: Tensor,
                  plans: tuple) -> bool:
    """Whether ``mlp``'s gate and up outputs are made again from ``x`` by ``plans``, bit for bit:
    checked on the first call (one extra projection) and on every call while hooks may change the
    outputs; a module that fails keeps g and u from then on, with a warning."""
    checked = mlp.__dict__.get(_INPUT_CHECKED)
    if checked is None or (checked and forward_hooks_on(
            m for proj in layout.projections(mlp) for m in proj.modules())):
        with torch.no_grad():
            checked = all(b is None or torch.equal(a, b) for a, b in
                          zip(_plans_value(plans, layout.half, x), (g, u), strict=True))
        mlp.__dict__[_INPUT_CHECKED] = checked
        if not checked:
            warnings.warn(f"{type(mlp).__name__}'s gate and up outputs are not its projections of "
                          "its input; mlp='input' keeps them for this module", stacklevel=3)
    return checked


def _plans(mlp: nn.Module, layout: GatedLayout) -> tuple | None:
    plans = tuple(_projection_plan(p) for p in layout.projections(mlp))
    return None if None in plans else plans


def keeps_input(mlp: nn.Module) -> bool:
    """Whether ``mlp="auto"`` keeps this gated MLP's input now: its gate and up weights frozen and
    its projections plain or LoRA linear layers that can be made again (no LoRA dropout, adapters
    on and not merged)."""
    return frozen_projections(mlp) and _plans(mlp, gated_layout(mlp)) is not None


def forget_mlp_check(module: nn.Module) -> None:
    module.__dict__.pop(_INPUT_CHECKED, None)
    module.__dict__.pop(_LAYOUT, None)


def _own_forward_needed(mlp: nn.Module, layout: GatedLayout) -> bool:
    """Whether the module's own forward runs in this call: a dropout of the MLP draws (its ``p``
    set above 0 after patching), or a hook may act on its activation or down projection, which
    the parts' forwards do not call as modules (they compute the gate, and call the down
    projection's weight)."""
    return any(getattr(mlp, n).p != 0 and getattr(mlp, n).training for n in layout.drops) \
        or forward_hooks_on([getattr(mlp, layout.act), *getattr(mlp, layout.down).modules()]) \
        or bool(getattr(mlp, layout.down)._backward_hooks
                or getattr(mlp, layout.down)._backward_pre_hooks)


@eager_island
def gated_mlp_input_forward(self: nn.Module, x: Tensor, code: SharedCode | None = None,
                            version: int = 0) -> Tensor:
    """The forward of ``mlp="input"``: the gated MLP keeps its input only, and backward computes
    the gate and up projections again (two more matmuls of the MLP's width per token); where they
    cannot be made again bit for bit, :func:`gated_mlp_forward`'s. With ``code`` (a code of ``x``
    at its ``version``: :class:`CodedGatedMLP`), it keeps the code and backward computes them from
    the decoded input, unless ``x`` changed in place since (a hook on a projection): then ``x``."""
    layout = gated_layout(self)
    if _own_forward_needed(self, layout):
        return type(self).forward(self, x)
    g, u = layout.gate_up(self, x)
    if code is not None and x._version != version:
        code = None
    if not (torch.is_grad_enabled() and (g.requires_grad or (u is not None and u.requires_grad))):
        return _gated_rest(self, layout, g, u)
    plans = _plans(self, layout)
    if plans is None or not _recomputable(self, layout, x, g, u, plans):
        return _gated_rest(self, layout, g, u)
    return getattr(self, layout.down)(GatedFromInput.apply(
        g, u, x, plans, layout.half, layout.gate_fn, _autocast_dtype(x), code))


class CodedGatedMLP:
    """The forward of ``mlp="coded"`` (the lean preset): as ``mlp="input"``, keeping a ``bits``-bit
    code of the MLP's input in place of the input: the one filed under it (the RMSNorm's, under
    ``rmsnorm="coded"``) or one made and filed here, before the gate and up projections run, so that
    their ``bits``-bit codes are the same one (:mod:`sketchprop.codes`). Backward computes the gate
    and up outputs from the decoded input: not exact (the gate is not linear; module docstring,
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


def _gated_rest(self: nn.Module, layout: GatedLayout, g: Tensor, u: Tensor) -> Tensor:
    down = getattr(self, layout.down)
    if not (torch.is_grad_enabled() and (g.requires_grad or (u is not None and u.requires_grad))):
        return down(_gated(layout.gate_fn, g, u))
    if type(down) is nn.Linear and down.weight.requires_grad:  # decided per call: patch_linear
        dtype = _autocast_dtype(g) or torch.promote_types(g.dtype, (g if u is None else u).dtype)
        return GatedDown.apply(g, u, down.weight, down.bias, dtype, layout.gate_fn)
    return down(GateProduct.apply(g, u, layout.gate_fn))


@eager_island
def gated_mlp_forward(self: nn.Module, x: Tensor) -> Tensor:
    """The forward :func:`~sketchprop.patch_activations` gives a gated MLP (bound to it): the
    model's own arithmetic, keeping the gate and up outputs only (module docstring)."""
    layout = gated_layout(self)
    if _own_forward_needed(self, layout):
        return type(self).forward(self, x)
    return _gated_rest(self, layout, *layout.gate_up(self, x))


def _full_weight(module: nn.Module) -> Tensor | None:
    """A projection's full-size weight: its own, or (peft adapters) its base layer's."""
    while isinstance(getattr(module, "base_layer", None), nn.Module):
        module = module.base_layer
    weight = getattr(module, "weight", None)
    return weight if isinstance(weight, Tensor) else None


def frozen_projections(mlp: nn.Module) -> bool:
    """Whether a gated MLP's gate and up projections' full-size weights are frozen (LoRA)."""
    weights = [_full_weight(p) for p in gated_layout(mlp).projections(mlp)]
    return all(w is not None and not w.requires_grad for w in weights)


@eager_island
def gated_mlp_auto_forward(self: nn.Module, x: Tensor) -> Tensor:
    """The forward of ``mlp="auto"`` (the default): :func:`gated_mlp_input_forward`'s where the
    gate and up projections' full-size weights are frozen (LoRA), :func:`gated_mlp_forward`'s
    where they train. Decided on each call, so freezing before or after patching is the same."""
    if frozen_projections(self):
        return gated_mlp_input_forward(self, x)
    return gated_mlp_forward(self, x)
