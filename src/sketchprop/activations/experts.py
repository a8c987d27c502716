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

from torch import nn

from .recompute import RecomputedModule

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


class CodedExperts(RecomputedModule):
    """The forward :func:`~sketchprop.patch_activations` gives a mixture of experts under
    ``experts="coded"`` (``bits`` bits) or ``experts="recompute"`` (``bits`` None): a
    :class:`~sketchprop.activations.recompute.RecomputedModule` (module docstring). ``name`` (the
    module's qualified name) seeds the rounding's stream."""

    def __init__(self, module: nn.Module, bits: int | None, group: int, name: str = ""):
        super().__init__(module, bits, group, name, option="experts")
