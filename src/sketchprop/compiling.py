r"""How the library meets ``torch.compile``: each patched part runs as an eager island, and each
codec inside it is one compiled kernel of its own.

``torch.compile(model)`` traces a model's Python into graphs. The parts this library puts into a
model keep Python state that a traced graph cannot hold: per-layer generators seeded by Python
ints and call counts (a graph would guard on each call's seed and recompile at every step),
thread-local padding masks, weak references to shared sketches, and saved-tensor hooks read
during checkpointing. Traced anyway, they crashed (a random int16 view), recompiled every step,
or, under inductor, changed the numbers: inductor may fold the bfloat16 round trip of the b-bit
codes' group ends, which the unbiased rounding relies on.

So every patched forward (the randomized linear layers, seeded dropout, the GELU code, LayerNorm
and RMSNorm from their output, the gated MLP, the recomputed attention and the chunked LM loss),
the mask hook of ``skip_padding`` and :func:`~sketchprop.functional.sketched_linear` are wrapped
in :func:`eager_island`: the compiler stops
before it, the part runs eagerly with its own streams, and compilation resumes after it. The
compiled model then draws the same bits in the same order as the eager one, and its gradients
are the eager model's (up to the float reassociation of the compiled parts in between); a new
step, seed or rank reuses the graphs.

**Fused codecs.** Inside the islands, the codecs (quantize and pack, unpack and dequantize, the
dropout mask, the GELU code and its decode, LayerNorm's backward from its output) are each one
function of tensors, with no Python branching on tensor values and random bits from
:mod:`sketchprop.rng` keyed by a 0-d tensor:
:func:`fused` compiles each on its own (inductor: C++ on CPU, Triton on CUDA) into one loop
that reads its input once, where eager would make a pass over memory per operation. Shapes are
dynamic and keys are tensors, so a new step, batch shape or seed reuses the kernel; inductor's
cache keeps it across processes. Compiled and eager give the same random bits; float results may
differ by the reassociation of a sum (a code may then round the other way, rarely). Where no
compiler works (no C++ compiler, no Triton) the first call says so in one line and the codecs
run eagerly from then on; ``SKETCHPROP_CODECS=eager`` (or :func:`eager_codecs`) chooses eager.
"""

from __future__ import annotations

import contextlib
import functools
import os
import warnings
from collections.abc import Callable
from typing import TypeVar

import torch
from torch._dynamo.exc import BackendCompilerFailed, FailOnRecompileLimitHit

F = TypeVar("F", bound=Callable)


def eager_island(fn: F) -> F:
    """``fn`` run eagerly inside a compiled model: ``torch.compiler.disable(fn)``, with the reason
    in the compiler's graph-break log. (It loads the compiler with the library, about 1.5 s on
    this machine's CPU, which transformers loads anyway. Made lazily at the first compiled call
    instead, the wrapper's own frame would be compiled, once per call signature, until the
    compiler's recompile limit.)"""
    return torch.compiler.disable(fn, reason=f"sketchprop's {fn.__qualname__} runs eagerly "
                                              "(sketchprop.compiling says why)")


#: The environment switch: ``SKETCHPROP_CODECS=eager`` runs every fused codec eagerly.
CODECS_ENV = "SKETCHPROP_CODECS"
_no_compiler: set[str] = set()  # device types whose compiler failed once: eager from then on
_eager_depth = 0  # open eager_codecs() contexts
RECOMPILE_LIMIT = 64  # compiled variants of one fused function at most


@contextlib.contextmanager
def eager_codecs():
    """Within this context every fused codec runs eagerly, as with ``SKETCHPROP_CODECS=eager``
    (the same random bits; a benchmark times both ways with it)."""
    global _eager_depth
    _eager_depth += 1
    try:
        yield
    finally:
        _eager_depth -= 1


def codecs_compiled(device_type: str) -> bool:
    """Whether the fused codecs run compiled on ``device_type`` (see the module docstring)."""
    if _eager_depth:
        return False
    mode = os.environ.get(CODECS_ENV, "compiled")
    if mode not in ("compiled", "eager"):
        raise ValueError(f"{CODECS_ENV} must be 'compiled' or 'eager', got {mode!r}")
    return mode == "compiled" and device_type not in _no_compiler


# Shapes dynamic, Python numbers (code width, group, probabilities) constants: symbolic ones would
# make every index a division, and the loops scalar. One graph per dtype, grad flag, constant set
# and (at most twice) per shape: more than the compiler's default limit of 8 for a function that
# serves every layer.
_SETTINGS = {"specialize_int": True, "specialize_float": True, "recompile_limit": RECOMPILE_LIMIT}


@contextlib.contextmanager
def _settings():
    """The compiler settings of the fused codecs, set around a call (``config.patch`` costs
    about 20 us a call, as much as the rest of a compiled call's overhead; plain setattr does
    not)."""
    config = torch._dynamo.config
    old = {k: getattr(config, k) for k in _SETTINGS}
    for k, v in _SETTINGS.items():
        setattr(config, k, v)
    try:
        yield
    finally:
        for k, v in old.items():
            setattr(config, k, v)


def fused(fn: F) -> F:
    """``fn`` (a function of tensors and constants, no Python branching on tensor values) compiled
    on its own at its first call: ``torch.compile(fn, fullgraph=True)``, with
    inductor's ``emulate_precision_casts`` so that a bfloat16 round trip stays one (the codes'
    group ends rely on it). The device is the first tensor argument's. Falls back to ``fn``
    eagerly, with a one-line warning, where compiling fails; ``fn.eager`` is the eager function."""
    # dynamic=None: compiled for the first shapes, then once more with the sizes that changed
    # made symbolic (the batch's rows), those that did not (a group of 64) kept constant.
    compiled = torch.compile(fn, fullgraph=True, options={"emulate_precision_casts": True})
    limit_warned = []

    @functools.wraps(fn)
    def call(*args, **kwargs):
        device = next(a.device.type for a in args if isinstance(a, torch.Tensor))
        if not codecs_compiled(device):
            return fn(*args, **kwargs)
        try:
            with _settings():
                return compiled(*args, **kwargs)
        except FailOnRecompileLimitHit:  # the graphs compiled so far stay in use
            if not limit_warned:
                limit_warned.append(True)
                warnings.warn(f"sketchprop: {fn.__qualname__} has {RECOMPILE_LIMIT} compiled "
                              "variants; new ones run eagerly", stacklevel=2)
            return fn(*args, **kwargs)
        except BackendCompilerFailed as err:  # no C++ compiler, no Triton: not a wrong input
            _no_compiler.add(device)
            warnings.warn(f"sketchprop: the codecs run eagerly on {device} (slower): compiling "
                          f"{fn.__qualname__} failed ({type(err.inner_exception).__name__}); "
                          f"{CODECS_ENV}=eager skips the attempt", stacklevel=2)
            return fn(*args, **kwargs)

    call.eager = fn
    return call
