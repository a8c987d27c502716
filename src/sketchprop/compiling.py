r"""How the library's parts meet ``torch.compile``: each patched part runs as an eager island.

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
step, seed or rank reuses the graphs. What the islands give up is fusion inside them: making the
codecs themselves compiled kernels is the work :mod:`sketchprop.rng` prepares.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

F = TypeVar("F", bound=Callable)


def eager_island(fn: F) -> F:
    """``fn`` run eagerly inside a compiled model: ``torch.compiler.disable(fn)``, with the reason
    in the compiler's graph-break log. (It loads the compiler with the library, about 1.5 s on
    this machine's CPU, which transformers loads anyway. Made lazily at the first compiled call
    instead, the wrapper's own frame would be compiled, once per call signature, until the
    compiler's recompile limit.)"""
    return torch.compiler.disable(fn, reason=f"sketchprop's {fn.__qualname__} runs eagerly "
                                              "(sketchprop.compiling says why)")
