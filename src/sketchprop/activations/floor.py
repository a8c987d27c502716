r"""The generic floor (``patch_activations(model, floor_bits=b)``): whatever no other part handles,
kept as one ``b``-bit code per storage.

The structural parts of this package know what an operation needs in backward (a seed for a
dropout mask, Q, K, V made again from the block input, a norm's output). Everything else a model
saves for backward, by any operation of any architecture, passes through autograd's
saved-tensor hooks (``torch.autograd.graph.saved_tensors_hooks``); the floor installs them
around the model's forward (a forward pre-hook enters them, a forward hook leaves them, on an
exception too) and keeps each saved floating activation as the ``b``-bit code of
:mod:`sketchprop.quantize` (groups of ``group`` values along the storage, stochastic rounding:
unbiased, its dither from the library's counter-based stream, so eager and compiled codecs draw
the same bits and each rank draws its own), and each saved bool mask at one bit. A storage that
several backward functions read (a norm's output saved by the norm and by the next linear
layer, one tensor and its views) is coded once: every reader decodes the same code.

What is unbiased: a backward that reads a saved tensor linearly (a weight gradient ``dY^T X``,
a product's other factor) gets its exact gradient in expectation. One that reads it through a
non-linear function (a softmax's, a GELU's or a norm's backward, the attention's) is evaluated
at the decoded point, a bias of the order of the rounding's variance, measured per family in
``results/bench/architectures.md`` (its bias column). A ReLU's output (saved by its autograd
node, ``ReluBackward0``, or, in place on a view, by the view's ``AsStridedBackward0`` over
``CopySlices``; its backward keeps the gradient where the output is positive) keeps one more bit
per value, which values are positive, so that the mask is exact: without it, a small positive
value rounded to 0 lost its gradient; in place on part of a storage whose other values are
negative, that storage is kept as it is. (Other non-negative tensors with zeros, a masked
softmax's probabilities, need no bit: their backward reads no sign.) A saved input that
backward compares with a threshold or reads its sign (a leaky ReLU's, a clamp's, hardtanh's,
abs's) keeps a bias from values within a level of it.

Never coded, kept as they are:

- parameters and their views (frozen ones, peft base layers, FSDP's unsharded ones: each is an
  ``nn.Parameter`` while it is used), the model's buffers, and, under autocast, a cast that
  has a parameter's shape and needs no gradient (a frozen weight cast to half precision);
- tensors saved by a custom ``autograd.Function`` (``ctx.save_for_backward``): what
  the library's own parts keep (already compact, or exact on purpose), reentrant
  checkpointing's block inputs, other libraries' fused kernels; except what a part hands to the
  floor (:func:`offer`): the attention's Q, K and V where it cannot make them again from its
  block's input (fused or other projections, QK-norm), and the block input that
  ``attention="recompute"`` makes them again from (its projections' saves of it are coded, so
  one code serves both), which it would otherwise keep in full;
- tensors below :data:`MIN_NUMEL` elements (a code saves little there and costs a call), tensors
  with a non-finite value (the code's range would be), complex and one-byte tensors.

Integer tensors (a max-pool's indices) are kept exactly, in the narrowest integer type that holds
their values.

What the floor keeps goes on to any saved-tensor hooks that were active outside the model
(:class:`~sketchprop.measure.SavedTensorMeter`, offloading): the meter counts the codes, not
the activations they stand for. An activation changed in place after it was saved raises in
backward, as autograd does without hooks (which stop checking versions), while the activation
is alive. Under ``torch.compile`` the hooks are not installed (one warning): a compiled graph
saves its own tensors.

Under non-reentrant checkpointing (``use_reentrant=False``), the checkpoint's hooks take what its
block saves, and the block's inputs, which the checkpoint saves as autograd saves, are coded: the
recompute reads their code. Reentrant checkpointing keeps its inputs as a custom Function's
saves, as they are. A floored module called inside another floored model's forward leaves its
saves to the outer floor (nested hooks would see each other, not the op that saves).
"""

from __future__ import annotations

import sys
import threading
import warnings
import weakref

import torch
from torch import Tensor, nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils.weak import WeakTensorKeyDictionary

from ..codes import SharedCode, mark_shared
from ..compiling import fused
from ..packing import pack_codes, unpack_codes
from ..quantize import QuantSpec, check_bits, check_group, quantize
from ..rng import SeedStream

__all__ = ["FLOOR_DTYPES", "MIN_NUMEL", "Floor", "offer"]

#: Storages of fewer elements are kept as they are.
MIN_NUMEL = 4096
#: The floating types the floor codes (one-byte floats would gain little at 8 bits and lose range).
FLOOR_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
# Integer types and the narrower ones their values may fit (exact: a max-pool's int64 indices
# fit 16 bits for a map of up to 2^15 positions).
_NARROWER = {torch.int64: (torch.int8, torch.int16, torch.int32),
             torch.int32: (torch.int8, torch.int16)}

_FUNCTION_APPLY = torch.autograd.Function.apply.__func__.__code__
_RELU = "ReluBackward"  # the node of torch.relu, F.relu and nn.ReLU (in place too)
_local = threading.local()  # per thread: the open hook contexts of the floors, innermost last


def _relu_output(t: Tensor) -> bool:
    """Whether ``t`` may be a ReLU's output by its autograd node: ReLU's own, or an in-place op
    on a view (a ReLU in place on a slice), whose node autograd hides behind ``CopySlices``
    (where that op was another, a bit a value is spent for nothing)."""
    name = type(t.grad_fn).__name__
    return _RELU in name or (name.startswith("AsStridedBackward") and any(
        type(n).__name__ == "CopySlices" for n, _ in t.grad_fn.next_functions))


def _stack() -> list:
    stack = getattr(_local, "stack", None)
    if stack is None:
        stack = _local.stack = []
    return stack


def _open() -> _Call | None:
    """The floor call open in this thread (its hooks are the ones autograd calls), or None."""
    return next((call for call in reversed(_stack()) if call is not None), None)


def offer(*tensors: Tensor) -> bool:
    """Let a floor open in this thread code ``tensors`` when the custom ``autograd.Function``
    calling this saves them (its saves are otherwise kept as they are); nothing without one.
    Returns whether a floor took them."""
    call = _open()
    if call is not None:
        for t in tensors:
            call.offered[t] = True
    return call is not None


class _Coded:
    """How a storage's payload decodes: its ``n`` values as a ``QuantSpec`` code (floats, one
    row of ``n``), its bits one per bit (bool), or its integers in a narrower type. A ReLU's
    output has a bit per value after its code, set where the value is positive (``signs``: the
    code's bytes before it)."""

    __slots__ = ("spec", "n", "dtype", "narrow", "signs")

    def __init__(self, spec: QuantSpec | None, n: int, dtype: torch.dtype, narrow=None,
                 signs: int | None = None):
        self.spec, self.n, self.dtype, self.narrow, self.signs = spec, n, dtype, narrow, signs

    def decode(self, payload: Tensor) -> Tensor:
        if self.narrow is not None:
            return payload.to(self.dtype)
        if self.spec is None:
            return _unpack_mask(payload, self.n)
        if self.signs is None:
            return SharedCode(payload, self.spec).decode().view(-1)
        x = SharedCode(payload[:self.signs], self.spec).decode().view(-1)
        return _keep_positive(x, payload[self.signs:])


# The bit codes' passes, each one fused function (sketchprop.compiling.fused), as the codes'.
@fused
def _pack_mask(flat: Tensor) -> Tensor:
    return pack_codes(flat.view(torch.uint8), 1)


@fused
def _unpack_mask(packed: Tensor, n: int) -> Tensor:
    return unpack_codes(packed, 1, n).view(torch.bool)


@fused
def _pack_positive(flat: Tensor) -> Tensor:
    return pack_codes((flat > 0).view(torch.uint8), 1)


@fused
def _keep_positive(x: Tensor, packed: Tensor) -> Tensor:
    """``x`` where the packed bits say positive, 0 elsewhere; a positive value that the rounding
    took to 0 comes back as the smallest normal number, so that exactly the positive ones are
    (an upward bias of at most that number)."""
    # (a product by the 0/1 bits, not torch.where on them as bools: inductor's CPU code cannot
    # vectorize that cast)
    positive = unpack_codes(packed, 1, x.numel()).to(x.dtype)
    return x.clamp_min(torch.finfo(x.dtype).tiny) * positive


class Floor:
    """The saved-tensor hooks of one model (module docstring): ``bits`` (8, 4 or 2) per value in
    groups of ``group``; ``name`` seeds the rounding's stream (with ``torch.initial_seed()`` and
    the rank). :meth:`install` puts it on a model; a class, so that ``torch.save(model)``
    pickles it."""

    def __init__(self, bits: int = 4, group: int = 64, name: str = ""):
        self.bits, self.group = check_bits(bits), check_group(group)
        if self.bits is None:
            raise ValueError("the floor needs bits (8, 4 or 2)")
        self.seeds = SeedStream("floor", name)
        self.model_ref = None
        self._warned = False

    def __getstate__(self) -> dict:
        return {"bits": self.bits, "group": self.group, "seeds": self.seeds, "model_ref": None,
                "_warned": False}

    def install(self, model: nn.Module) -> list:
        """Enter the hooks before each forward of ``model`` and leave them after it; returns the
        hook handles."""
        return [model.register_forward_pre_hook(self.enter, with_kwargs=True),
                model.register_forward_hook(self.leave, with_kwargs=True, always_call=True)]

    # -------------------------------------------------------------------- around the forward

    def enter(self, module: nn.Module, args, kwargs) -> None:
        """Forward pre-hook: in training with gradients, open the hooks for this call."""
        # A floor inside another one's forward (a floored block of a floored model) leaves the
        # saves to the outer one: nested hooks would see each other's calls, not Function.apply.
        outer = _open()
        if outer is not None:  # what the outer floor keeps as it is includes this model's own
            outer.keep(module)
        on = module.training and torch.is_grad_enabled() and outer is None
        # (is_dynamo_compiling, not is_compiling: that one is process-wide, and a compile in
        # another thread would turn this floor off)
        if on and torch.compiler.is_dynamo_compiling():
            if not self._warned:
                self._warned = True
                warnings.warn("sketchprop: the activation floor is off under torch.compile (the "
                              "compiled graph saves its own tensors)", stacklevel=2)
            on = False
        if not on:
            _stack().append(None)
            return
        call = _Call(self, module, torch._C._autograd._top_saved_tensors_default_hooks(False))
        call.hooks = torch.autograd.graph.saved_tensors_hooks(call.pack, call.unpack)
        call.hooks.__enter__()
        _stack().append(call)

    def leave(self, module: nn.Module, args, kwargs, output) -> None:
        """Forward hook (also on an exception): close what :meth:`enter` opened."""
        stack = _stack()
        if stack:
            call = stack.pop()
            if call is not None:
                call.hooks.__exit__(None, None, None)
                call.done()


def _where(t: Tensor) -> tuple | None:
    """``(device, address)`` of ``t``'s storage; None where it has none to read (a sharded
    parameter between its uses, a DTensor)."""
    try:
        return t.device, t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return None


class _Call:
    """The hooks of one forward call: what it coded, by storage, so that a storage saved twice
    is coded once; the hooks that were active outside it, to which it hands what it keeps."""

    def __init__(self, floor: Floor, model: nn.Module, outer):
        self.floor, self.outer = floor, outer
        self.kept, self.frozen_shapes = set(), set()
        self.keep(model)
        self.codes: dict[tuple, tuple] = {}
        self.offered = WeakTensorKeyDictionary()  # custom Functions' saves it may code (offer)
        self.hooks = None

    def keep(self, model: nn.Module) -> None:
        """Keep ``model``'s parameters and buffers as they are (this call's model, or a floored
        model called inside its forward)."""
        self.kept |= {_where(p) for p in (*model.parameters(), *model.buffers())}
        # a frozen weight's cast (autocast's) and its transpose: no gradient, the weight's shape
        self.frozen_shapes |= {s for p in model.parameters() if not p.requires_grad
                               for s in (tuple(p.shape), tuple(p.shape)[::-1])}

    def done(self) -> None:
        # the payloads live on in what autograd saved; the map and the offers go
        self.codes, self.offered = {}, WeakTensorKeyDictionary()

    def _keep_as_is(self, t: Tensor) -> bool:
        if t.layout != torch.strided or t.is_meta or t.dtype not in (*FLOOR_DTYPES, torch.bool,
                                                                      *_NARROWER):
            return True
        if isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter):
            return True
        storage = t.untyped_storage()
        if storage.nbytes() < MIN_NUMEL * t.element_size():
            return True
        if (t.device, storage.data_ptr()) in self.kept:
            return True
        # a frozen weight cast by autocast: a new tensor with the weight's shape and no gradient
        return not t.requires_grad and tuple(t.shape) in self.frozen_shapes

    def _code(self, t: Tensor) -> tuple[_Coded, Tensor] | None:
        """How ``t``'s storage is coded and its payload: found where this call coded it already,
        else made (None where the storage holds a non-finite value)."""
        storage = t.untyped_storage()
        # the version too: a save after an in-place change must not read the code made before it
        key = (t.device, storage.data_ptr(), storage.nbytes(), t.dtype, t._version)
        hit = self.codes.get(key)
        if hit is not None and not hit[0].expired():  # (expired: another storage, same address)
            return hit[1]
        n = storage.nbytes() // t.element_size()
        flat = t.new_empty(0).set_(storage, 0, (n,), (1,))
        with torch.no_grad():
            if t.dtype == torch.bool:
                coded, payload = _Coded(None, n, t.dtype), _pack_mask(flat)
            elif t.dtype in _NARROWER:  # integers (pooling indices): the width they need, exact
                lo, hi = flat.aminmax()
                narrow = next((d for d in _NARROWER[t.dtype] if torch.iinfo(d).min <= lo
                               and hi <= torch.iinfo(d).max), t.dtype)
                if narrow == t.dtype:
                    return None
                coded, payload = _Coded(None, n, t.dtype, narrow), flat.to(narrow)
            else:
                lo, hi = flat.aminmax()  # (NaN comes out of both)
                if not bool(torch.isfinite(lo) & torch.isfinite(hi)):
                    return None
                relu = _relu_output(t)
                if relu and lo < 0:  # an op in place on part of a storage, negatives elsewhere
                    if bool(t.detach().amin() == 0):  # a ReLU's, by its values: its mask
                        return None  # needs the part's signs: kept as it is, exact
                    relu = False
                payload, spec, _ = quantize(flat.view(1, n), self.floor.bits, self.floor.group,
                                            self.floor.seeds.next())
                coded = _Coded(spec, n, t.dtype)
                if relu and lo == 0:
                    # A ReLU's output, whose backward passes the gradient where it is positive:
                    # rounding took small positive values to 0 about as often as they are small,
                    # and their gradients with them (a bias), so which values are positive is
                    # kept too, one bit each. (The ReLU's own save comes first: the storage's.)
                    coded.signs = payload.numel()
                    payload = torch.cat([payload, _pack_positive(flat)])
        mark_shared(payload)  # a meter that drops what it sees keeps it: its readers share it
        # Held until the forward ends, so that every save of the storage in this call shares it.
        self.codes[key] = (StorageWeakRef(storage), (coded, payload))
        return coded, payload

    def pack(self, t: Tensor):
        # A custom Function's saves are packed as its apply() returns (its forward ran with grad
        # mode off, as the hook does for every save): that frame calls this one.
        custom = sys._getframe(1).f_code is _FUNCTION_APPLY and t not in self.offered
        found = None if custom or self._keep_as_is(t) else self._code(t)
        if found is None:
            kind, what, meta = "tensor", t, None
        else:
            (coded, what), kind = found, "code"
            # the version, to raise in backward where the tensor was changed in place since
            meta = (coded, tuple(t.shape), t.stride(), t.storage_offset(), weakref.ref(t),
                    t._version)
        if self.outer is not None:  # outer hooks (a meter, offloading) take what is kept
            what = self.outer[0](what)
        return kind, what, meta

    def unpack(self, packed):
        kind, what, meta = packed
        if self.outer is not None:
            what = self.outer[1](what)
        if kind == "tensor":
            return what
        coded, shape, stride, offset, ref, version = meta
        t = ref()
        if t is not None and t._version != version:
            raise RuntimeError(
                "one of the variables needed for gradient computation has been modified by an "
                f"inplace operation: a tensor of shape {list(shape)} that sketchprop's activation "
                f"floor coded at version {version} is now at version {t._version}")
        return coded.decode(what).as_strided(shape, stride, offset)
