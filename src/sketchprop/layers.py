"""``RandomizedLinear``: an ``nn.Linear`` whose weight gradient is computed from a sketch, and
``RandomizedConv1D``, the same on transformers' ``Conv1D`` (made when first needed); the
:class:`SketchContext` the layers of one model share, and the :class:`MaskHook` that feeds it."""

from __future__ import annotations

import abc
import inspect
import math
import re
import sys
import threading
import weakref
from collections import OrderedDict, deque
from collections.abc import Mapping
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .codes import code_of, filed_spec
from .compiling import eager_island
from .functional import SketchedLinearFunction, seed_tensor
from .quantize import DEFAULT_GROUP, QuantSpec, check_bits, check_group, payload_rows, quantize
from .rng import process_rank, stable_seed
from .sketches import SKETCHES, GradNormEstimate, Sketch, get_sketch, num_proj_rows

__all__ = ["RandomizedLinear", "SketchContext", "MaskHook", "CONTEXT_ATTRIBUTE", "DEFAULT_MIN_ROWS",
           "check_rho", "conv1d_class", "randomized_conv1d_class", "resolve_rho"]

# Below this many rows a sketch saves next to nothing and adds the most variance (the classifier head
# sees one row per example), so such layers keep their input exactly. The authors clamp at 3 rows.
DEFAULT_MIN_ROWS = 16


def check_rho(rho) -> float:
    """Return ``rho`` as a float in (0, 1]; raise ``ValueError`` naming it otherwise."""
    try:
        value = float(rho)
    except (TypeError, ValueError):
        raise ValueError(f"rho must be a number in (0, 1], got {rho!r}") from None
    if not 0.0 < value <= 1.0:
        raise ValueError(f"rho must be in (0, 1], got {rho!r}")
    return value


def conv1d_class() -> type | None:
    """transformers' ``Conv1D`` (GPT-2's linear layer, weight stored ``(in, out)``), or None when
    transformers is not loaded. A model that holds a ``Conv1D`` has loaded it; sketchprop does not
    import transformers (seconds) for the models that hold none."""
    return getattr(sys.modules.get("transformers.pytorch_utils"), "Conv1D", None)


def _sample(x: Tensor) -> Tensor:
    """At most 256 entries of ``x`` spread over its rows and columns (a copy): enough to tell the
    inputs of two model calls apart, as the bit-identical recomputation of one matches it."""
    x2 = x.detach().reshape(-1, x.shape[-1])
    index = torch.arange(0, x2.shape[0], max(1, x2.shape[0] // 256), device=x.device)
    return x2[index, index % x2.shape[1]]


class _Call:
    """One model call made with gradients: its padding rows and, under checkpointing, samples of
    what each layer saw (by layer name), by which a recomputation finds the call it redoes."""

    __slots__ = ("shape", "rows", "skip", "samples", "claimed")

    def __init__(self, shape: tuple[int, ...], rows: Tensor):
        self.shape, self.rows = shape, rows
        # What the layers are given: None where no row is padding, so that a batch of full-length
        # rows takes exact's path (no gather of X in forward nor of dY in backward).
        self.skip = None if rows.shape[0] == math.prod(shape) else rows
        self.samples: dict[str, list[Tensor]] = {}
        self.claimed = False

    def matches(self, name: str, sample: Tensor) -> bool:
        return any(s.shape == sample.shape and torch.equal(s, sample)
                   for s in self.samples.get(name, ()))


def _checkpointed_pass() -> bool:
    """Whether saved tensors are being packed by a hook (non-reentrant checkpointing's first pass,
    or offloading): what a layer saves now may be recomputed in backward."""
    return torch._C._autograd._top_saved_tensors_default_hooks(False) is not None


class SketchContext:
    """State shared by the layers patched in one model.

    - the non-padding token rows of a model call, taken from its ``attention_mask`` by a forward
      pre-hook (``skip_padding``). They are per call and per thread: each thread's forward reads
      the rows of its own current call. A recomputation in backward (activation checkpointing,
      reentrant or not) reads the rows of the call it recomputes: the context remembers the
      last :attr:`RECENT` calls made with gradients; those not yet claimed by a backward are the
      candidates, and when several of the recomputed input's shape remain (two forwards before
      one backward, or threads), samples of each layer's input taken in the first pass tell them
      apart. A recomputation that matches no call, or several with different padding, raises.
    - a cache of sketches by input tensor (``share_inputs``): layers that read the same tensor
      (Q, K, V) reuse one ``S^T X`` and its seed (or plan, for a data-dependent sketch), and learn
      who formed it. Entries hold weak references to the input and the sketch, so the cache never
      keeps either alive, and are forgotten when a model call begins. Where the sketch is gone
      while its input is not (a non-reentrant checkpoint's first pass keeps no saved tensor),
      the sharing layers form it again from the owner's draw, the same bits: each saves what it
      will save in the recomputation.
    """

    #: Model calls remembered for recomputation in backward.
    RECENT = 16

    def __init__(self):
        self._local = threading.local()
        self._recent: deque[_Call] = deque(maxlen=self.RECENT)
        self._tasks: OrderedDict[int, list[_Call]] = OrderedDict()
        self._lock = threading.Lock()
        self._shared: dict[tuple, tuple] = {}

    def __getstate__(self) -> dict:  # a copy (deepcopy, pickle) starts without calls
        return {}

    def __setstate__(self, state: dict) -> None:
        self.__init__()

    def _call(self) -> _Call | None:
        return getattr(self._local, "call", None)

    @property
    def mask_shape(self) -> tuple[int, ...] | None:
        call = self._call()
        return None if call is None else call.shape

    @property
    def rows(self) -> Tensor | None:
        call = self._call()
        return None if call is None else call.rows

    def set_mask(self, mask: Tensor | None) -> None:
        """A model call begins, with ``mask`` its ``attention_mask`` (None: none). The sketches
        shared so far are forgotten: a call never forms one from an earlier call's draw."""
        self._shared.clear()
        if mask is None or mask.dim() != 2:
            self._local.call = None
            return
        rows = mask.reshape(-1).nonzero().squeeze(1)
        call = self._local.call = _Call(tuple(mask.shape), rows)
        if torch.is_grad_enabled():
            with self._lock:
                self._recent.append(call)

    def note(self, x: Tensor, name: str) -> None:
        """A layer's forward without gradients inside a call made with them (a reentrant
        checkpoint's first pass): keep a sample of its input for the recomputation."""
        call = self._call()
        if call is None or call.shape != tuple(x.shape[:-1]):
            return
        with self._lock:  # another thread may be appending a call
            pending = call in self._recent
        if pending:
            call.samples.setdefault(name, []).append(_sample(x))

    def rows_for(self, x: Tensor, name: str | None = None) -> Tensor | None:
        """The non-padding rows of the call that ``x`` (the input of layer ``name``) belongs to,
        or None when ``x`` is not shaped as its mask or no row of its call is padding."""
        shape = tuple(x.shape[:-1])
        if torch._C._current_graph_task_id() != -1:  # in backward: a checkpoint's recomputation
            return self._recomputed_rows(x, shape, name)
        call = self._call()
        if call is None or call.shape != shape:
            return None
        if name is not None and _checkpointed_pass():
            call.samples.setdefault(name, []).append(_sample(x))
        return call.skip

    def _recomputed_rows(self, x: Tensor, shape: tuple, name: str | None) -> Tensor | None:
        task = torch._C._current_graph_task_id()
        with self._lock:
            if task not in self._tasks:  # the calls this backward may recompute
                self._tasks[task] = [c for c in self._recent if not c.claimed]
                for c in self._tasks[task]:
                    c.claimed = True
                while len(self._tasks) > self.RECENT:
                    self._tasks.popitem(last=False)
            pending = [c for c in self._tasks[task] if c.shape == shape]
            recent = [c for c in self._recent if c.shape == shape]
        if len(pending) == 1:
            return pending[0].skip
        if not recent:
            return None  # no call with a mask of this shape: none with padding rows to skip
        sample = _sample(x)
        for candidates in (pending, recent):
            found = [c for c in candidates if name is not None and c.matches(name, sample)]
            if found and all(torch.equal(c.rows, found[0].rows) for c in found):
                return found[0].skip
        raise RuntimeError(
            f"skip_padding: the recomputation of layer {name!r} in backward (activation "
            f"checkpointing) cannot tell which of {len(recent)} recent model calls shaped "
            f"{shape} it redoes, and their padding differs; run backward after each forward, "
            "or patch with skip_padding=False")

    def lookup(self, key: tuple, x: Tensor, layer) -> tuple | None:
        """``(sx, seed, plan, owner, qvar, draw, whole)`` stored for input ``x`` under ``key`` by
        another layer, or None. ``sx`` is None where the sketch is gone but ``draw`` forms it
        again: a non-reentrant checkpoint's first pass keeps no saved tensor."""
        hit = self._shared.get(key)
        if hit is None:
            return None
        x_ref, sx_ref, *rest = hit
        sx, owner, draw = sx_ref(), rest[2], rest[4]
        if x_ref() is not x or (sx is None and (owner is layer or draw is None)):
            del self._shared[key]  # (its owner again: the recomputation, which forms its own)
            return None
        return (sx, *rest)

    def store(self, key: tuple, x: Tensor, sx: Tensor, seed, plan, owner, qvar, draw,
              whole: bool) -> None:
        """File ``sx``, what ``owner`` formed of ``x`` (``whole``: of every row, padding or
        not) with the draw ``draw`` (None: not formed by the owner, nothing to form again)."""
        for k in [k for k, (xr, *_) in self._shared.items() if xr() is None]:
            del self._shared[k]
        self._shared[key] = (weakref.ref(x), weakref.ref(sx), seed, plan, owner, qvar, draw,
                             whole)


#: The attribute of a patched model that holds its layers' :class:`SketchContext`.
CONTEXT_ATTRIBUTE = "_sketchprop_context"

#: Arguments of an encoder-decoder's forward that give the decoder's sequence length.
_DECODER_INPUTS = ("decoder_input_ids", "decoder_inputs_embeds", "labels")


class MaskHook:
    """A forward pre-hook that hands the call's ``attention_mask`` to the model's
    :class:`SketchContext` (the one its layers share, its attribute :data:`CONTEXT_ATTRIBUTE`;
    :func:`~sketchprop.patch_linear` sets both). The context is looked up on the model called, not
    captured: a ``copy.deepcopy`` of the model (hooks included) feeds its own copy. A
    class, not a closure, so that ``torch.save(model)`` can pickle it.

    Rows are matched to the mask by shape. In an encoder-decoder (T5) the mask is the encoder's,
    and a decoder sequence of the same length would be masked by it although its rows carry
    gradient: such a call skips no rows (the weight gradient stays unbiased, it saves less).
    """

    def __init__(self, model: nn.Module, skip_padding: bool = True):
        self.encoder_decoder = bool(getattr(getattr(model, "config", None), "is_encoder_decoder",
                                            False))
        # False: only the start of each call matters (shared sketches); no padding rows are
        # found, so no mask.nonzero(), which waits for a GPU, runs
        self.skip_padding = skip_padding
        self._signature: inspect.Signature | None = None  # of the forward, read at the first call

    def __getstate__(self) -> dict:
        return {"encoder_decoder": self.encoder_decoder, "skip_padding": self.skip_padding,
                "_signature": None}

    def _bind(self, module: nn.Module, args, kwargs) -> dict:
        if not args:
            return kwargs
        if self._signature is None:
            try:
                self._signature = inspect.signature(module.forward)
            except (TypeError, ValueError):
                return kwargs
        try:
            return self._signature.bind_partial(*args, **kwargs).arguments
        except TypeError:
            return kwargs

    @eager_island
    def __call__(self, module, args, kwargs):
        context = getattr(module, CONTEXT_ATTRIBUTE, None)
        if context is None:
            return
        if not getattr(self, "skip_padding", True):  # (a hook pickled before it had the flag)
            context.set_mask(None)
            return
        arguments = self._bind(module, args, kwargs)
        mask = arguments.get("attention_mask")
        if self.encoder_decoder and isinstance(mask, Tensor) and mask.dim() == 2:
            decoder = (arguments.get(key) for key in _DECODER_INPUTS)
            if any(isinstance(t, Tensor) and t.dim() >= 2 and t.shape[1] == mask.shape[1]
                   for t in decoder):
                mask = None
        context.set_mask(mask)


class _Sketched:
    """The computation :class:`RandomizedLinear` and ``RandomizedConv1D`` share (a mixin before
    their ``nn.Module`` base): configuration, the seed stream, forward."""

    fan_in_fan_out = False  # True: ``weight`` is stored (in, out), as transformers' Conv1D

    def _configure(self, sketch="gaussian", rho=0.1, min_rows=DEFAULT_MIN_ROWS, seed=0, name="",
                   share_inputs=False, skip_padding=False, context=None, bits=None,
                   group=DEFAULT_GROUP):
        self.sketch = get_sketch(sketch)
        self.rho = check_rho(rho)
        self.bits, self.group = check_bits(bits), check_group(group)
        if int(min_rows) < 1:
            raise ValueError(f"min_rows must be >= 1, got {min_rows!r}")
        self.min_rows = int(min_rows)
        self.seed, self.name = int(seed), name
        self.share_inputs, self.skip_padding = share_inputs, skip_padding
        self.context = context
        self.tracker = None  # set by variance tracking
        self.allocation = None  # a VarianceAllocation, set by patch_linear(allocate="variance")
        # The running gradient-norm estimate of a data-dependent sketch; layers that share one
        # sketch (share_inputs) share it too.
        self.grad_norms = GradNormEstimate() if self.sketch.data_dependent else None
        self._gen: torch.Generator | None = None
        self._gen_rank: int | None = None  # the rank ``_gen`` was seeded for
        self.calls = 0

    @classmethod
    def from_linear(cls, linear: nn.Module, sketch: str | Sketch = "gaussian", rho: float = 0.1,
                    **kwargs) -> RandomizedLinear:
        """Wrap ``linear`` (``nn.Linear``, a subclass of its map, or Conv1D), reusing its Parameters."""
        conv1d = conv1d_class()
        if conv1d is not None and isinstance(linear, conv1d):
            kind, shape = randomized_conv1d_class(), (linear.nf, linear.nx)
        elif isinstance(linear, nn.Linear):
            kind, shape = RandomizedLinear, (linear.in_features, linear.out_features,
                                             linear.bias is not None)
        else:
            raise TypeError(f"expected nn.Linear or transformers' Conv1D, got {type(linear).__name__}")
        new = kind(*shape, device="meta", sketch=sketch, rho=rho, **kwargs)
        new.hold(linear)
        if kind is RandomizedLinear and type(linear) is not nn.Linear:  # kept, to be put back
            new.__dict__["_replaced"] = linear
        return new.train(linear.training)

    def hold(self, linear: nn.Module) -> None:
        """Compute with the ``weight`` and ``bias`` Parameters of ``linear``, a plain layer of this
        layer's kind (``nn.Linear`` or ``Conv1D``), whatever their size."""
        self.weight, self.bias = linear.weight, linear.bias
        if self.fan_in_fan_out:
            self.in_features, self.out_features = self.nx, self.nf = self.weight.shape
        else:
            self.out_features, self.in_features = self.weight.shape

    def extra_repr(self) -> str:
        fan = ", fan_in_fan_out=True" if self.fan_in_fan_out else ""
        bits = f", bits={self.bits}, group={self.group}" if self.bits else ""
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}{fan}, sketch={self.sketch.name}, rho={self.rho:g}"
                f"{bits}")

    def num_rows(self, n: int) -> tuple[int, int, bool]:
        """``(k, k_uniform, allocated)`` for a call covering ``n`` rows: the rows sketched, the rows
        at the uniform ``rho``, and whether the allocation set ``k`` (it moves rows between the
        layers whose ``k`` follows ``rho``, not those held at ``min_rows``)."""
        k = num_proj_rows(n, self.rho, self.min_rows)
        allocated = (self.allocation is not None and k < n
                     and math.ceil(self.rho * n - 1e-9) >= self.min_rows)
        if not allocated:
            return k, k, False
        return self.allocation.rows(self.name, k, n, self.min_rows), k, True

    def _next_seed(self) -> int:
        # Each rank draws its own sketches. The rank is read at every draw: a stream begun before
        # the process group existed (a sanity step before init_process_group) was rank 0's on
        # every process, and kept, the ranks' noise would no longer average out.
        rank = process_rank()
        if self._gen is None or self._gen_rank != rank:
            self._gen = torch.Generator().manual_seed(stable_seed(self.seed, self.name, rank))
            self._gen_rank = rank
        self.calls += 1
        return int(torch.randint(0, 2**62, (), generator=self._gen))

    @eager_island
    def forward(self, x: Tensor) -> Tensor:
        # (out, in) as F.linear wants it; for a Conv1D weight a transposed view, through which the
        # gradient reaches the (in, out) Parameter.
        weight = self.weight.T if self.fan_in_fan_out else self.weight
        if not torch.is_grad_enabled() or not (x.requires_grad or self.weight.requires_grad):
            if self.skip_padding and self.context is not None and not torch.is_grad_enabled():
                self.context.note(x, self.name)  # a reentrant checkpoint's first pass, maybe
            return F.linear(x, weight, self.bias)
        bias, inp = self.bias, x
        device_type = x.device.type
        autocast = torch.is_autocast_enabled(device_type)
        if autocast:
            # Cast as autocast would for F.linear; the Function then runs with autocast off.
            dtype = torch.get_autocast_dtype(device_type)
            inp, weight = x.to(dtype), weight.to(dtype)
            bias = bias.to(dtype) if bias is not None else None

        rows = self.context.rows_for(x, self.name) if (self.skip_padding and self.context) else None
        n = x.numel() // x.shape[-1] if rows is None else rows.shape[0]
        k, k_uniform, allocated = self.num_rows(n)
        sketch = self.sketch if k < n else SKETCHES["exact"]

        sx, seed, plan, tstate, hooks = None, 0, None, None, []
        quant = qvar = None
        if self.weight.requires_grad:
            key = (sketch.name, k, inp.dtype, rows is not None, self.bits, self.group)
            shared = self.share_inputs and self.context is not None
            hit = self.context.lookup(key, x, self) if shared else None
            # b-bit rows: the rounding variances feed the variance estimates, when any reads them.
            want_qvar = self.tracker is not None or (allocated and not sketch.exact)
            # A code of x filed by the part that made x (the lean preset): saved, not made again,
            # where it is what this layer would make (sketchprop.codes). It covers every row
            # (backward keeps the real ones); where its payload is gone (a non-reentrant
            # checkpoint's first pass keeps no saved tensor) this layer codes every row itself,
            # as the recomputation will save. The variances want a code of the rows they estimate.
            spec = None if (self.bits is None or not sketch.exact or want_qvar) else filed_spec(x)
            whole = spec is not None and (spec.bits, spec.group, spec.rows, spec.cols) == (
                self.bits, self.group, x.numel() // self.in_features, self.in_features)
            filed = code_of(x) if whole else None
            if hit is not None:
                sx, seed, plan, owner, qvar, draw, whole = hit
                if sx is None:  # formed again, the same: what the recomputation will save
                    sx = self._form(inp, sketch, k, draw, None if whole else rows, plan)[0]
                self._join(owner)
            elif filed is not None:
                sx = filed.payload
                if shared:
                    self.context.store(key, x, sx, seed, plan, self, qvar, None, True)
            else:
                draw = self._next_seed()
                if sketch.data_dependent:
                    with torch.no_grad():
                        weights = self.grad_norms.weights(tuple(x.shape), rows, x.device)
                        plan = sketch.plan(inp.detach().reshape(-1, self.in_features), k, draw,
                                           rows, weights)
                else:  # one seed tensor per sketch: layers sharing the sketch save it once
                    seed = seed_tensor(draw)
                sx, qvar = self._form(inp, sketch, k, draw, None if whole else rows, plan,
                                      want_qvar)
                if shared:
                    self.context.store(key, x, sx, seed, plan, self, qvar, draw, whole)
            if self.bits is not None:
                # the rows sx codes: k, the real rows or every row (a filed code, or a layer that
                # shares sx and coded every row)
                stored = payload_rows(sx, self.bits, self.group, self.in_features)
                quant = QuantSpec(self.bits, self.group, stored, self.in_features, inp.dtype)
            if sketch.data_dependent:
                hooks.append(self.grad_norms.hook())
            if allocated and not sketch.exact:
                hooks.append(self.allocation.hook(self.name, sketch, k, k_uniform, n,
                                                  self.min_rows))
            if self.tracker is not None:  # variance tracking: B row norms, saved for backward
                with torch.no_grad():
                    tstate = self.tracker.forward(inp.detach().reshape(-1, self.in_features),
                                                  rows, k, sketch)

        with torch.autocast(device_type, enabled=False) if autocast else nullcontext():
            return SketchedLinearFunction.apply(inp, weight, bias, sx, sketch, k, seed, rows,
                                                self.tracker, tstate, plan, tuple(hooks), quant,
                                                qvar)

    def _form(self, inp: Tensor, sketch: Sketch, k: int, draw: int, rows, plan,
              want_qvar: bool = False) -> tuple[Tensor, Tensor | None]:
        """``S^T X`` of the rows ``rows`` of ``inp`` (all for None), by ``plan`` for a
        data-dependent sketch, else drawn with ``draw``; with ``bits`` its codes (one payload
        per sketch: layers sharing it code once), and their rounding variances if wanted."""
        qvar = None
        with torch.no_grad():
            x2 = inp.detach().reshape(-1, self.in_features)
            sx = plan.apply(x2) if plan is not None else sketch.apply(x2, k, draw, rows)
            if self.bits is not None:
                sx, _, qvar = quantize(sx, self.bits, self.group, draw, want_qvar)
        return sx, qvar

    def _join(self, owner: _Sketched) -> None:
        """This layer reuses the sketch ``owner`` formed: learn one gradient-norm estimate for
        both (the sketch serves both) and move rows together."""
        if owner is self:
            return
        if self.grad_norms is not None and owner.grad_norms is not None:
            self.grad_norms = owner.grad_norms
        if self.allocation is not None:
            self.allocation.share(self.name, owner.name)


class RandomizedLinear(_Sketched, nn.Linear, metaclass=abc.ABCMeta):
    """A linear layer with exact forward, exact ``dX``/``db``, and a randomized weight gradient.

    The forward pass stores ``S^T X`` (``B_proj x N_in`` with ``B_proj = max(min_rows,
    ceil(rho * B))``, never more than ``B``) instead of ``X``; backward regenerates ``S`` from the
    call's seed and returns ``dW = (S^T dY)^T (S^T X)``, an unbiased estimate of ``dY^T X``. When
    ``B_proj`` reaches ``B`` the layer stores its input rows and is exact.

    Each forward call draws a fresh seed from the layer's own generator, seeded by ``seed`` (the run
    seed), the layer ``name`` and the distributed rank; the global RNG is never touched, so dropout
    streams stay as in the exact model. The ``importance`` sketch depends on ``X`` and on the
    layer's running gradient-norm estimate (``grad_norms``, updated in backward): forward saves its
    row indices and scales instead of a seed (:class:`~sketchprop.sketches.Importance`).

    Under activation checkpointing the forward of a checkpointed block runs twice: the recomputation
    in backward draws a new seed and forms a new sketch, and backward uses that pair (the seed is a
    saved tensor, see :mod:`sketchprop.functional`), so the weight gradient stays unbiased; the
    generator simply advances twice per step.

    :meth:`from_linear` of transformers' ``Conv1D`` gives a ``RandomizedConv1D``: a ``Conv1D``, not
    an ``nn.Linear``, so that peft adapts it as the layer it replaced (the ``(in, out)`` weight,
    ``fan_in_fan_out`` as peft names it, merged the right way round). It computes with the
    transpose of that weight, a view: the Parameter, its state_dict key and any weight tied to it
    are unchanged. It counts as a ``RandomizedLinear`` (``isinstance``, a virtual subclass).

    With ``bits`` (8, 4 or 2) the stored rows (the sketch, or ``X`` itself when the sketch is
    exact) are kept as packed ``bits``-bit codes, ``group`` columns sharing a scale, rounded
    stochastically so that ``dW`` stays unbiased (:mod:`sketchprop.quantize`); the rounding's
    random numbers come from the same per-layer stream as the sketch's seeds.

    Args:
        sketch: a name in :data:`~sketchprop.SKETCHES` or a :class:`~sketchprop.sketches.Sketch`.
        rho: compression rate in (0, 1].
        min_rows: lower bound on ``B_proj``.
        bits / group: code width of the stored rows (None: as they are) and columns per scale.
        seed: run seed. ``name``: the layer's qualified name (part of its seed).
        share_inputs / skip_padding: use the :class:`SketchContext` ``context`` (set by
            :func:`~sketchprop.patch_linear`) to share sketches of one input and skip padding rows.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        device=None,
        dtype=None,
        *,
        sketch: str | Sketch = "gaussian",
        rho: float = 0.1,
        min_rows: int = DEFAULT_MIN_ROWS,
        seed: int = 0,
        name: str = "",
        share_inputs: bool = False,
        skip_padding: bool = False,
        context: SketchContext | None = None,
        bits: int | None = None,
        group: int = DEFAULT_GROUP,
    ):
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self._configure(sketch, rho, min_rows, seed, name, share_inputs, skip_padding, context,
                        bits, group)

    def to_linear(self) -> nn.Linear:
        """The ``nn.Linear`` (or subclass) this layer replaced, holding the same Parameters."""
        lin = self.__dict__.get("_replaced") or nn.Linear(
            self.in_features, self.out_features, bias=self.bias is not None, device="meta")
        lin.weight, lin.bias = self.weight, self.bias
        return lin.train(self.training)


def randomized_conv1d_class() -> type:
    """``RandomizedConv1D``: :class:`RandomizedLinear`'s computation on transformers' ``Conv1D``
    (see there), a ``Conv1D`` subclass. Made at the first call, as it imports transformers; kept
    as ``sketchprop.layers.RandomizedConv1D``, where unpickling finds it."""
    with _CONV1D_LOCK:  # one class: an instance of a second would not pickle
        made = globals().get("RandomizedConv1D")
        if made is None:
            made = globals()["RandomizedConv1D"] = _make_randomized_conv1d()
    return made


_CONV1D_LOCK = threading.Lock()


def _make_randomized_conv1d() -> type:
    from transformers.pytorch_utils import Conv1D

    class RandomizedConv1D(_Sketched, Conv1D):
        """:class:`RandomizedLinear` on transformers' ``Conv1D``: see there."""

        __qualname__ = "RandomizedConv1D"
        __repr__ = nn.Module.__repr__  # Conv1D's own shows nf and nx only
        fan_in_fan_out = True

        def __init__(self, nf: int, nx: int, device=None, **config):
            with torch.device(device) if device is not None else nullcontext():
                super().__init__(nf, nx)
            self.in_features, self.out_features = nx, nf
            self._configure(**config)

        def to_linear(self) -> nn.Module:
            """The ``Conv1D`` this layer replaced, holding the same Parameters."""
            with torch.device("meta"):  # its own weight is replaced at once: allocate nothing
                conv = Conv1D(self.nf, self.nx)
            conv.weight, conv.bias = self.weight, self.bias
            return conv.train(self.training)

    RandomizedLinear.register(RandomizedConv1D)
    return RandomizedConv1D


def __getattr__(name: str):
    if name == "RandomizedConv1D":  # unpickling one in a process that has not made the class yet
        return randomized_conv1d_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def resolve_rho(rho: float | Mapping[str, float], name: str) -> float:
    """``rho`` for layer ``name``: a number, or the first regex key of a mapping found in ``name``."""
    if isinstance(rho, Mapping):
        for pattern, value in rho.items():
            if re.search(pattern, name):
                return check_rho(value)
        raise ValueError(f"no key of the rho mapping {dict(rho)} matches layer {name!r}")
    return check_rho(rho)
