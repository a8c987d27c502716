r"""One stored code per activation (``patch_activations(model, preset="lean")``).

Several backward passes may read one activation: a post-LN encoder's LayerNorm output is read by
LayerNorm's own backward, by the next linear layers' weight gradient and, as the next block's
input, by the attention's recompute of Q, K and V. Each used to keep its own copy: the float
output for LayerNorm and attention, ``b``-bit codes for the linear layers. Here the part that
makes the activation codes it once (:func:`make_code`: the stochastic ``b``-bit rounding of
:mod:`sketchprop.quantize`, unbiased) and files the code under the tensor; the parts that read
the same tensor later in the forward find it (:func:`code_of`) and save its payload, the same
uint8 tensor, instead of the activation. Readers:

- :class:`~sketchprop.activations.CodedLayerNorm` (``layernorm="coded"``): backward from the
  decoded output;
- :class:`~sketchprop.layers.RandomizedLinear` with ``bits``: where it would code its input rows
  itself (the exact sketch, every row, the code's width and group), it saves this code instead;
- :func:`~sketchprop.activations.recompute_attention` under ``attention="coded"``: Q, K and V made
  again from the decoded block input.

The file is a weak map, both ways: an entry goes when its tensor does, and it holds its payload by
a weak reference, so the map keeps neither alive (the parts that save the payload do; where a
saved-tensor hook takes it, as activation checkpointing's first pass does, it goes at once and
the readers code the tensor themselves: :func:`filed_spec` still tells them what the code was, so
that they save what the recomputation, which finds it, will). A code is found only by the tensor
object it was made for (a view, a copy or a cast of it is another tensor, and codes itself), and
only while that tensor is unchanged: an in-place change (``ReLU(inplace=True)`` after a LayerNorm) bumps its
version, and the code no longer stands for it.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.utils.weak import WeakTensorKeyDictionary

from .quantize import QuantSpec, dequantize, quantize

__all__ = ["SharedCode", "code_of", "filed_spec", "is_filed_payload", "make_code", "mark_shared"]

_filed = WeakTensorKeyDictionary()
_payloads = WeakTensorKeyDictionary()  # every filed payload, while it lives


@dataclass(frozen=True, eq=False)
class SharedCode:
    """A tensor's rows (``spec.rows x spec.cols``: every dimension but the last flattened) as
    the packed payload of :func:`~sketchprop.quantize.quantize`."""

    payload: Tensor
    spec: QuantSpec

    def __post_init__(self):
        # known as a shared payload from the start: the part that makes it saves it for
        # backward before it files it (is_filed_payload)
        mark_shared(self.payload)

    def decode(self, dtype: torch.dtype | None = None) -> Tensor:
        """The coded rows (``rows x cols``) in ``dtype`` (default: the coded tensor's)."""
        spec = self.spec if dtype is None else QuantSpec(self.spec.bits, self.spec.group,
                                                         self.spec.rows, self.spec.cols, dtype)
        return dequantize(self.payload, spec)


def make_code(x: Tensor, bits: int, group: int, seed: int) -> SharedCode:
    """Code ``x`` (its rows: all dimensions but the last) at ``bits`` bits, the rounding's dither
    keyed by ``seed``, and file the code under ``x``; the caller keeps the code alive."""
    with torch.no_grad():
        payload, spec, _ = quantize(x.detach().reshape(-1, x.shape[-1]), bits, group, seed)
    code = SharedCode(payload, spec)
    file_code(x, code)
    return code


def file_code(x: Tensor, code: SharedCode) -> None:
    """File ``code`` (made by the caller, who keeps it alive) under ``x`` as it is now."""
    _filed[x] = (x._version, weakref.ref(code.payload), code.spec)


def mark_shared(payload: Tensor) -> None:
    """Note ``payload`` as one that several readers share (:func:`is_filed_payload`)."""
    _payloads[payload] = True


def is_filed_payload(t: Tensor) -> bool:
    """Whether ``t`` is the payload of a :class:`SharedCode`: what later readers find again
    through a weak reference (a meter that drops saved tensors keeps these, or the readers would
    code again)."""
    return t in _payloads


def code_of(x: Tensor) -> SharedCode | None:
    """The code filed under ``x``, while its payload is alive and ``x`` unchanged since; else
    None."""
    entry = _filed.get(x)
    if entry is None:
        return None
    version, ref, spec = entry
    payload = ref()
    if payload is None or version != x._version:
        return None
    return SharedCode(payload, spec)


def filed_spec(x: Tensor) -> QuantSpec | None:
    """The spec of the code filed under ``x`` while ``x`` is unchanged since, whether or not its
    payload is still alive; else None."""
    entry = _filed.get(x)
    return None if entry is None or entry[0] != x._version else entry[2]
