r"""The experts of a mixture-of-experts layer, made again in backward from their input
(``experts="recompute"``: exact) or from one ``b``-bit code of it (``experts="coded"``, the lean
preset).

transformers' MoE models hold their experts as 3-D parameters (Mixtral's and Qwen3-MoE's
``gate_up_proj[E, 2F, H]`` and ``down_proj[E, H, F]``), each expert's slice applied by
``F.linear`` to the tokens the router sent it: no ``nn.Linear`` for :func:`~sketchprop.patch_linear`
to patch, and a gated MLP per expert whose gate, up and product outputs autograd keeps for every
routed token (``k`` copies of the MLP's width per token). **Found by what they hold**
(:func:`is_experts`): a module whose own parameters all share a leading dimension ``E > 1``, at
least two of them 3-D (the per-expert matrices; per-expert biases are 2-D), whose children hold no
parameters (its activation), whatever its names or its dispatch (a loop over the experts, grouped
or batched matmuls).

**Recompute** (:class:`CodedExperts` with no bits): the experts' forward runs without autograd,
keeping its input and its other arguments; backward runs it again under autograd (the same values:
exact). **Coded** (:class:`CodedExperts`): the same, keeping the ``b``-bit code of its input (the
one filed under it by the norm before, or one made here; groups of ``group`` columns, stochastic
rounding) and its other arguments as they are (the router's choices and weights: ``k`` values per
token); backward runs the forward again on the decoded input, with the router's weights, under
autograd, and hands on the gradients of the input, of every parameter and of the router's weights.
The router itself is left exact. What it keeps: ``b / 32`` of the input's float32 bytes, against
autograd's several activations of the MLP's width per routed token; what it costs: the experts'
forward once more in backward (as checkpointing would). The weight gradients of the first
projection are linear in the code: unbiased; those after the gate (the down projection's, and every
input gradient through the gate's derivative) are evaluated at the decoded point, a bias of second
order in the rounding (measured per family in ``results/bench/architectures.md``). Float32 training
with gradients only; elsewhere the module's own forward.
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

#: ``experts=`` values: the experts' activations kept by autograd, their input kept and the
#: experts made again in backward, or a code of their input kept.
EXPERTS = ("stored", "recompute", "coded")


def is_experts(module: nn.Module) -> bool:
    """Whether ``module`` holds a mixture of experts as stacked parameters (module docstring,
    "Found by what they hold"): two or more 3-D parameters, every parameter of its own sharing
    their leading dimension, no parameters in its children, not one of PyTorch's layers (a
    convolution's weight is 3-D too)."""
    params = [p for _, p in module.named_parameters(recurse=False)]
    return (sum(p.dim() == 3 for p in params) >= 2 and all(p.dim() >= 2 for p in params)
            and len({p.shape[0] for p in params}) == 1 and params[0].shape[0] > 1
            and not type(module).__module__.startswith("torch.")
            and not any(True for c in module.children() for _ in c.parameters()))


class _ExpertsFromCode(torch.autograd.Function):
    """The experts' output, keeping their input ``x`` (or its ``code``) and their other tensor
    arguments; backward runs ``forward`` again on it (decoded) under autograd."""

    @staticmethod
    def forward(ctx, module: nn.Module, code: SharedCode | None, shape: torch.Size,
                n_params: int, keys: tuple[str, ...], x: Tensor, *rest):
        params, args = rest[:n_params], rest[n_params:]
        ctx.module, ctx.shape, ctx.dtype = module, shape, x.dtype
        ctx.autocast = _autocast_dtype(x)
        ctx.spec = None if code is None else code.spec
        ctx.n_params, ctx.keys, ctx.n_args = n_params, keys, len(args)
        ctx.tensor_args = [isinstance(a, Tensor) for a in args]
        ctx.plain = [None if t else a for a, t in zip(args, ctx.tensor_args, strict=True)]
        ctx.save_for_backward(x.detach() if code is None else code.payload, *params,
                              *(a for a in args if isinstance(a, Tensor)))
        # The random state forward starts from, for backward's run to draw the same numbers (a
        # dropout in the experts' forward), as torch.utils.checkpoint does.
        ctx.devices = [x.device] if x.device.type == "cuda" else []
        ctx.rng = torch.get_rng_state(), [torch.cuda.get_rng_state(d) for d in ctx.devices]
        with torch.no_grad():
            out = _call(module, x, args, keys)
        if not isinstance(out, Tensor):
            raise TypeError(f"{type(module).__name__} returns {type(out).__name__}, not one tensor: "
                            "experts='recompute' and 'coded' make one output again; pass "
                            "experts='stored'")
        return out

    @staticmethod
    @first_order
    def backward(ctx, dy: Tensor):
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
        wanted = [t for t in (*inputs, *params, *args) if isinstance(t, Tensor)
                  and t.requires_grad]
        grads = iter(torch.autograd.grad(out, wanted, dy, allow_unused=True))
        result = [next(grads) if t.requires_grad else None for t in inputs]
        result += [next(grads) if p.requires_grad else None for p in params]
        result += [next(grads) if isinstance(a, Tensor) and a.requires_grad else None
                   for a in args]
        return (None, None, None, None, None, *result)


def _call(module: nn.Module, x: Tensor, args, keys: tuple[str, ...]) -> Tensor:
    """The module's own forward (its class's), the last ``len(keys)`` arguments by keyword."""
    split = len(args) - len(keys)
    return type(module).forward(module, x, *args[:split], **dict(zip(keys, args[split:],
                                                                     strict=True)))


class CodedExperts:
    """The forward :func:`~sketchprop.patch_activations` gives a mixture of experts under
    ``experts="coded"`` (``bits`` bits) or ``experts="recompute"`` (``bits`` None; module
    docstring). ``name`` (the module's qualified name) seeds the rounding's stream. A class, so
    that ``torch.save(model)`` can pickle it."""

    def __init__(self, module: nn.Module, bits: int | None, group: int, name: str = ""):
        self.module, self.bits, self.group = module, bits, group
        self.seeds = SeedStream("experts", name)

    @eager_island
    def __call__(self, x: Tensor, *args, **kwargs) -> Tensor:
        module = self.module
        params = [p for _, p in module.named_parameters(recurse=False)]
        # A parametrization (peft's LoRA on the experts' parameters, put on for its call) makes
        # the weights of parameters this forward does not see: the module's own forward.
        if parametrize.is_parametrized(module) or not (module.training and torch.is_grad_enabled()
                and (self.bits is None or x.dtype == torch.float32)
                and (x.requires_grad or any(p.requires_grad for p in params))):
            return type(module).forward(module, x, *args, **kwargs)
        code = None if self.bits is None else (
            code_of(x) or make_code(x, self.bits, self.group, self.seeds.next()))
        keys = tuple(kwargs)
        return _ExpertsFromCode.apply(module, code, x.shape, len(params), keys, x, *params,
                                      *args, *kwargs.values())
