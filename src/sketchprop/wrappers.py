"""Models inside wrappers (distributed ones, ``torch.compile``'s): which orders of patching and
wrapping work, the model a patch call changes, and a clear refusal where an order cannot work.

- DDP (``DistributedDataParallel``) hooks the Parameters themselves, which a patch reuses: patching
  works before or after wrapping. After, the patch calls change the model inside (``ddp.module``),
  so names, patterns and inverses are those of the plain model. The same for ``torch.compile``'s
  wrapper (its ``_orig_mod``): the layers' names, and so their random streams, are the plain
  model's.
- FSDP2 (``fully_shard``) records, for each parameter, the module that holds it, and puts the
  sharded or the gathered parameter on that module around each forward and backward. A module
  swapped in afterwards is not among them: it would keep the sharded DTensors and fail in DTensor
  code at its first forward. FSDP1 (``FullyShardedDataParallel``) keeps the parameters in flat
  parameters and hands views of them to the modules it recorded: a module swapped in afterwards
  holds stale views (or cannot take them: they are not Parameters) and fails too. So on a
  sharded model a call that would replace modules holding parameters (``patch_linear``,
  ``patch_activations`` with ``layernorm="output"`` or ``"coded"``, and their inverses) refuses
  before changing anything; the rest of ``patch_activations`` (dropout, GELU, the gated MLP,
  RMSNorm, the loss, attention) replaces no parameters and works on a sharded model too.

transformers' hub kernels (``use_kernels``; from transformers 5.25 ``from_pretrained`` turns them on)
re-run ``kernelize`` at each ``train()``/``eval()`` that changes mode, which puts back each mapped
module's own forward (Llama's RMSNorm, say) or the hub's over one given in place: patched memory
silently unpatched. A patch that gives such a module a forward first turns the kernels off on the
transformers models that hold it (:func:`hub_kernels_off`; the inverse turns them back on), and
:class:`ForwardGuard` refuses to run a model whose given forwards were replaced anyway.

torch.distributed is never imported here: a model wrapped by one of them has imported it, so the
classes are looked up among the loaded modules (an absent one wraps nothing).
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable

from torch import nn

__all__ = ["model_to_patch", "plain_class"]


def _loaded(module: str, name: str) -> type | None:
    return getattr(sys.modules.get(module), name, None)


def _fsdp2_class() -> type | None:
    return _loaded("torch.distributed.fsdp", "FSDPModule")


def plain_class(module: nn.Module) -> type:
    """The class of ``module``, or for a module ``fully_shard`` was applied to, the class its
    ``FSDP<Name>`` class was made from."""
    cls, fsdp = type(module), _fsdp2_class()
    if fsdp is not None and issubclass(cls, fsdp):
        return next(base for base in cls.__mro__ if not issubclass(base, fsdp))
    return cls


def _inner(model: nn.Module) -> nn.Module:
    """The model inside DDP and FSDP1 root wrappers (their ``module``) and ``torch.compile``'s
    (its ``_orig_mod``), or ``model`` itself."""
    wrappers = tuple(filter(None, (
        _loaded("torch.nn.parallel.distributed", "DistributedDataParallel"),
        _loaded("torch.distributed.fsdp.fully_sharded_data_parallel", "FullyShardedDataParallel"))))
    compiled = _loaded("torch._dynamo.eval_frame", "OptimizedModule")
    while True:
        if wrappers and isinstance(model, wrappers):
            model = model.module
        elif compiled is not None and isinstance(model, compiled):
            model = model._orig_mod
        else:
            return model


def _sharded_by(module: nn.Module) -> str | None:
    """The wrapper that manages ``module``'s parameters: ``"fully_shard"`` (FSDP2),
    ``"FullyShardedDataParallel"`` (FSDP1), or None."""
    fsdp2, dtensor = _fsdp2_class(), _loaded("torch.distributed.tensor", "DTensor")
    if (fsdp2 is not None and isinstance(module, fsdp2)) or (
            dtensor is not None and any(isinstance(p, dtensor) for p in module.parameters())):
        return "fully_shard"
    if getattr(module, "_is_fsdp_managed_module", False):  # FSDP1 marks the modules it wraps
        return "FullyShardedDataParallel"
    return None


def model_to_patch(model: nn.Module, call: str, replaces: tuple[type | None, ...] = (),
                   also: str = "") -> nn.Module:
    """The model the patch function ``call`` (its name) changes: ``model``, or the model inside a
    DDP or FSDP1 wrapper.

    Raises:
        ValueError: the model holds modules of a ``replaces`` type (those ``call`` would replace:
            modules with parameters) whose parameters ``fully_shard`` or
            ``FullyShardedDataParallel`` manage. The message names the order to use; ``also`` (a
            clause) adds another way out.
    """
    model = _inner(model)
    replaces = tuple(filter(None, replaces))
    sharded: dict[str, list[str]] = {}
    for name, module in model.named_modules():
        by = _sharded_by(module) if replaces and isinstance(module, replaces) else None
        if by is not None:
            sharded.setdefault(by, []).append(name or type(module).__name__)
    if sharded:
        by, names = next(iter(sharded.items()))
        shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        order = (f"unpatch before {by}, or unpatch a model that is not sharded (one the trained "
                 "state_dict loads into: its keys are the plain model's)" if call.startswith("un")
                 else f"call {call}(model, ...) then {by}(...)")
        raise ValueError(
            f"{call} must run before {by}: the modules it would replace ({shown}) hold parameters "
            f"{by} manages, and {by} would go on handing them to the old modules; {order}{also}")
    return model


# A transformers model inside a peft wrapper, and forwards given to modules in place.


def _transformers_owner(model: nn.Module) -> nn.Module | None:
    """The transformers model inside ``model`` (itself, or a peft model's base model), or None.
    transformers is not imported: a model of it has loaded it."""
    modeling = sys.modules.get("transformers.modeling_utils")
    if modeling is None:
        return None
    PreTrainedModel = modeling.PreTrainedModel  # noqa: N806
    owner = model
    if not isinstance(owner, PreTrainedModel) and callable(getattr(owner, "get_base_model", None)):
        owner = owner.get_base_model()
    return owner if isinstance(owner, PreTrainedModel) else None


def override_forward(module: nn.Module, forward: Callable) -> None:
    """Give ``module`` its own ``forward`` (an instance attribute, as :func:`restore_forward` finds
    it): its type, parameters, submodules and state_dict stay as they are."""
    module.__dict__["forward"] = forward


def bound(fn: Callable, module: nn.Module) -> Callable:
    """``fn`` bound to ``module``: a partial, which pickles (``torch.save(model)``) where a bound
    method of a function that is not the module's own attribute does not."""
    return functools.partial(fn, module)


def restore_forward(module: nn.Module, forward: Callable) -> None:
    """Undo :func:`override_forward` where ``forward`` is still the module's own forward."""
    if module.__dict__.get("forward") is forward:
        del module.__dict__["forward"]


# transformers' hub kernels, which replace forwards given in place.


def hub_kernels_off(model: nn.Module, modules: list[nn.Module]) -> list[nn.Module]:
    """Turn transformers' hub kernels off (``reset_kernels``) on each transformers model in
    ``model`` that has them on and holds one of ``modules`` whose class ``kernelize`` maps (a
    ``kernel_layer_name``); return those models, for the inverse to turn them on again."""
    mapped = {id(m) for m in modules if hasattr(type(m), "kernel_layer_name")}
    owners = [m for m in model.modules() if getattr(m, "use_kernels", False) is True
              and callable(getattr(m, "reset_kernels", None))
              and any(id(sub) in mapped for sub in m.modules())]
    for owner in owners:
        owner.reset_kernels()
    return owners


class ForwardGuard:
    """A forward pre-hook that refuses to run the model once a forward given in place
    (:func:`override_forward`) is no longer the module's: replaced by transformers' hub kernels
    (``kernelize``, or ``train()``/``eval()`` with ``use_kernels`` on), the module would run its own
    forward and silently keep what the patch saves."""

    def __init__(self, forwards: dict[str, tuple[nn.Module, Callable]], call: str):
        self.forwards, self.call = forwards, call

    # Traced under torch.compile too: Dynamo guards on each module's forward, so a replaced one
    # retraces and raises here (a compiled model never calls the hook eagerly).
    def __call__(self, model: nn.Module, args) -> None:
        for name, (module, forward) in self.forwards.items():
            if module.__dict__.get("forward") is not forward:
                raise RuntimeError(
                    f"the forward {self.call} gave {name or type(module).__name__} was replaced "
                    "(transformers' hub kernels do it: kernelize(), or train()/eval() while "
                    f"use_kernels is on); un{self.call}(model), set_use_kernels(False) on the "
                    "outermost transformers model (the one from_pretrained returned), then "
                    f"{self.call} again")


def give_forwards(model: nn.Module, forwards: dict[str, tuple[nn.Module, Callable]],
                  call: str) -> dict:
    """Give each module of ``forwards`` (name: (module, forward)) its forward in place
    (:func:`override_forward`), hub kernels first turned off where they would replace it
    (:func:`hub_kernels_off`), and guard ``model`` (:class:`ForwardGuard`). Returns what
    :func:`take_forwards` undoes."""
    owners = hub_kernels_off(model, [module for module, _ in forwards.values()])
    for module, forward in forwards.values():
        override_forward(module, forward)
    return {"kernels": owners,
            "guard": model.register_forward_pre_hook(ForwardGuard(forwards, call))}


def take_forwards(forwards: dict[str, tuple[nn.Module, Callable]], given: dict) -> None:
    """Undo :func:`give_forwards`: the modules' own forwards and the hub kernels back."""
    given["guard"].remove()
    for module, forward in forwards.values():
        restore_forward(module, forward)
    for owner in given["kernels"]:
        owner.set_use_kernels(True)

