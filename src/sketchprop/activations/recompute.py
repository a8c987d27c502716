r"""A module made again in backward from its input, or from one ``b``-bit code of it: what the
parts use for a block whose inside they do not take apart (a mixture of experts held as stacked
parameters, :mod:`~sketchprop.activations.experts`; an attention block that computes its
attention itself, DeBERTa's, under ``attention="coded"``).

:class:`RecomputedModule` runs the module's own forward without autograd, keeping its input (or
the code of it filed by the norm before, or one made here: groups of ``group`` columns, stochastic
rounding) and its other arguments as they are; backward runs the forward again under autograd on
the (decoded) input, from the random state forward started from (a dropout inside draws the same
numbers, as ``torch.utils.checkpoint`` does), under forward's autocast, and hands on the gradients
of the input, of every parameter of the module and of its other floating arguments. From the
input itself: exact, the module's own gradients, for its forward once more in backward. From a
code: a linear read of the input (the first projection's weight gradient) is unbiased; what
passes a non-linear function is evaluated at the decoded point, a bias of second order in the
rounding. The module's own forward runs instead outside training with gradients, on a
half-precision input when coded, under a parametrization (which computes weights from
parameters this forward does not see: peft's LoRA on experts), and on a call with a cache (a
second run would write it twice).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.nn.utils import parametrize

from ..codes import SharedCode, code_of, make_code
from ..compiling import eager_island
from ..functional import first_order
from ..rng import SeedStream
from .projections import _autocast_dtype

# A call with any of these set writes a cache, which a second run would write again.
_CACHES = ("cache", "past_key_values", "past_key_value", "layer_past")


class _FromInput(torch.autograd.Function):
    """The module's output (a tensor, or a tuple of tensors and Nones), keeping its input ``x``
    (or its ``code``) and its other tensor arguments; backward runs its forward again on it
    (decoded) under autograd."""

    @staticmethod
    def forward(ctx, module: nn.Module, code: SharedCode | None, option: str, n_params: int,
                keys: tuple[str, ...], x: Tensor, *rest):
        params, args = rest[:n_params], rest[n_params:]
        ctx.module, ctx.shape, ctx.dtype = module, x.shape, x.dtype
        ctx.autocast = _autocast_dtype(x)
        ctx.spec = None if code is None else code.spec
        ctx.n_params, ctx.keys = n_params, keys
        ctx.tensor_args = [isinstance(a, Tensor) for a in args]
        ctx.plain = [None if t else a for a, t in zip(args, ctx.tensor_args, strict=True)]
        ctx.save_for_backward(x.detach() if code is None else code.payload, *params,
                              *(a for a in args if isinstance(a, Tensor)))
        ctx.devices = [x.device] if x.device.type == "cuda" else []
        ctx.rng = torch.get_rng_state(), [torch.cuda.get_rng_state(d) for d in ctx.devices]
        with torch.no_grad():
            out = _call(module, x, args, keys)
        if not all(o is None or isinstance(o, Tensor)
                   for o in (out if isinstance(out, tuple) else (out,))):
            raise TypeError(f"{type(module).__name__} returns {type(out).__name__} holding other "
                            f"things than tensors: {option}='recompute' and 'coded' make only "
                            f"tensors again; pass {option}='stored'")
        return out

    @staticmethod
    @first_order
    def backward(ctx, *grads: Tensor):
        payload, *saved = ctx.saved_tensors
        params, tensors = saved[:ctx.n_params], iter(saved[ctx.n_params:])
        args = [next(tensors) if t else a for a, t in zip(ctx.plain, ctx.tensor_args,
                                                          strict=True)]
        x = payload.detach() if ctx.spec is None else \
            SharedCode(payload, ctx.spec).decode(ctx.dtype).view(ctx.shape)
        inputs = [x.requires_grad_(ctx.needs_input_grad[5])]
        args = [a.detach().requires_grad_(True) if isinstance(a, Tensor)
                and a.is_floating_point() and need else a
                for a, need in zip(args, ctx.needs_input_grad[6 + ctx.n_params:], strict=True)]
        with torch.random.fork_rng(devices=ctx.devices), torch.enable_grad(), \
                torch.autocast(x.device.type, dtype=ctx.autocast or torch.bfloat16,
                               enabled=ctx.autocast is not None):
            torch.set_rng_state(ctx.rng[0])
            for device, state in zip(ctx.devices, ctx.rng[1], strict=True):
                torch.cuda.set_rng_state(state, device)
            out = _call(ctx.module, x, args, ctx.keys)
        pairs = [(o, g) for o, g in zip(out if isinstance(out, tuple) else (out,), grads,
                                        strict=True)
                 if isinstance(o, Tensor) and o.requires_grad and g is not None]
        wanted = [t for t in (*inputs, *params, *args) if isinstance(t, Tensor)
                  and t.requires_grad]
        found = iter(torch.autograd.grad([o for o, _ in pairs], wanted, [g for _, g in pairs],
                                         allow_unused=True) if pairs and wanted else ())
        result = [next(found) if t.requires_grad else None for t in inputs]
        result += [next(found) if p.requires_grad else None for p in params]
        result += [next(found) if isinstance(a, Tensor) and a.requires_grad else None
                   for a in args]
        return (None, None, None, None, None, *result)


def _call(module: nn.Module, x: Tensor, args, keys: tuple[str, ...]):
    """The module's own forward (its class's), the last ``len(keys)`` arguments by keyword."""
    split = len(args) - len(keys)
    return type(module).forward(module, x, *args[:split], **dict(zip(keys, args[split:],
                                                                     strict=True)))


class RecomputedModule:
    """The forward :func:`~sketchprop.patch_activations` gives a module made again in backward
    from its input (``bits`` None) or a ``bits``-bit code of it (module docstring). ``option``
    names the ``patch_activations`` option in messages and seeds, with ``name`` (the module's
    qualified name), the rounding's stream. A class, so that ``torch.save(model)`` can pickle
    it."""

    def __init__(self, module: nn.Module, bits: int | None, group: int, name: str = "",
                 option: str = "experts"):
        self.module, self.bits, self.group, self.option = module, bits, group, option
        self.seeds = SeedStream(option, name)

    @eager_island
    def __call__(self, x: Tensor, *args, **kwargs):
        module = self.module
        params = [p for p in module.parameters()]
        if any(parametrize.is_parametrized(m) for m in module.modules()) \
                or any(kwargs.get(k) is not None for k in _CACHES) \
                or not (module.training and torch.is_grad_enabled() and isinstance(x, Tensor)
                        and (self.bits is None or x.dtype == torch.float32)
                        and (x.requires_grad or any(p.requires_grad for p in params))):
            return type(module).forward(module, x, *args, **kwargs)
        code = None if self.bits is None else (
            code_of(x) or make_code(x, self.bits, self.group, self.seeds.next()))
        keys = tuple(kwargs)
        return _FromInput.apply(module, code, self.option, len(params), keys, x, *params,
                                *args, *kwargs.values())
