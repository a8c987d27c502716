"""``RandomizedLinear``: an ``nn.Linear`` whose weight gradient is computed from a sketch."""

from __future__ import annotations

import hashlib
import math
import re
import sys
import weakref
from collections.abc import Mapping
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .functional import SketchedLinearFunction, seed_tensor
from .quantize import DEFAULT_GROUP, QuantSpec, check_bits, check_group, quantize
from .sketches import SKETCHES, GradNormEstimate, Sketch, get_sketch, num_proj_rows

__all__ = ["RandomizedLinear", "SketchContext", "DEFAULT_MIN_ROWS", "check_rho", "conv1d_class",
           "resolve_rho"]

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


def _stable_seed(*parts) -> int:
    """A 63-bit seed from the parts, the same in every process (unlike ``hash``)."""
    digest = hashlib.blake2b("/".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


class SketchContext:
    """State shared by the layers patched in one model.

    - ``rows``: indices of the non-padding token rows of the current batch, taken from the model's
      ``attention_mask`` by a forward pre-hook (``skip_padding``). It stays until the next model call,
      so activation-checkpoint recomputation in backward sees the same rows.
    - a cache of sketches by input tensor (``share_inputs``): layers that read the same tensor
      (Q, K, V) reuse one ``S^T X`` and its seed (or plan, for a data-dependent sketch), and learn
      who formed it. Entries hold weak references to the input and the sketch, so the cache never
      keeps either alive.
    """

    def __init__(self):
        self.mask_shape: tuple[int, ...] | None = None
        self.rows: Tensor | None = None
        self._shared: dict[tuple, tuple] = {}

    def set_mask(self, mask: Tensor | None) -> None:
        if mask is None or mask.dim() != 2:
            self.mask_shape, self.rows = None, None
            return
        self.mask_shape = tuple(mask.shape)
        self.rows = mask.reshape(-1).nonzero().squeeze(1)
        self._shared.clear()

    def rows_for(self, x: Tensor) -> Tensor | None:
        if self.rows is not None and tuple(x.shape[:-1]) == self.mask_shape:
            return self.rows
        return None

    def lookup(self, key: tuple, x: Tensor) -> tuple | None:
        """``(sx, seed, plan, owner, qvar)`` stored for input ``x`` under ``key``, or None."""
        hit = self._shared.get(key)
        if hit is None:
            return None
        x_ref, sx_ref, *rest = hit
        sx = sx_ref()
        if x_ref() is not x or sx is None:
            del self._shared[key]
            return None
        return (sx, *rest)

    def store(self, key: tuple, x: Tensor, sx: Tensor, seed, plan, owner, qvar=None) -> None:
        for k in [k for k, (xr, sr, *_) in self._shared.items() if xr() is None or sr() is None]:
            del self._shared[k]
        self._shared[key] = (weakref.ref(x), weakref.ref(sx), seed, plan, owner, qvar)


class RandomizedLinear(nn.Linear):
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

    A layer made from transformers' ``Conv1D`` (by :meth:`from_linear`) keeps that layer's
    ``(in, out)`` weight (``fan_in_fan_out``, as peft names it) and computes with its transpose, a
    view: the Parameter, its state_dict key and any weight tied to it are unchanged.

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

    def _configure(self, sketch, rho, min_rows, seed, name, share_inputs, skip_padding, context,
                   bits=None, group=DEFAULT_GROUP):
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
        self.calls = 0
        self.fan_in_fan_out = False  # True: ``weight`` is stored (in, out), as transformers' Conv1D

    @classmethod
    def from_linear(cls, linear: nn.Module, sketch: str | Sketch = "gaussian", rho: float = 0.1,
                    **kwargs) -> RandomizedLinear:
        """Wrap ``linear`` (an ``nn.Linear`` or transformers' ``Conv1D``), reusing its ``weight``
        and ``bias`` Parameters (same state_dict keys, ties kept)."""
        conv1d = conv1d_class()
        if conv1d is not None and isinstance(linear, conv1d):
            n_in, n_out, fan_in_fan_out = linear.nx, linear.nf, True
        elif isinstance(linear, nn.Linear):
            n_in, n_out, fan_in_fan_out = linear.in_features, linear.out_features, False
        else:
            raise TypeError(f"expected nn.Linear or transformers' Conv1D, got "
                            f"{type(linear).__name__}")
        new = cls(n_in, n_out, bias=linear.bias is not None, device="meta", sketch=sketch, rho=rho,
                  **kwargs)
        new.weight, new.bias = linear.weight, linear.bias
        new.fan_in_fan_out = fan_in_fan_out
        new.train(linear.training)
        return new

    def to_linear(self) -> nn.Module:
        """The layer this one replaced, holding the same Parameters: an ``nn.Linear``, or
        transformers' ``Conv1D`` for a ``fan_in_fan_out`` layer."""
        if self.fan_in_fan_out:
            with torch.device("meta"):  # its own weight is replaced at once: allocate nothing
                lin = conv1d_class()(self.out_features, self.in_features)
        else:
            lin = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None,
                            device="meta")
        lin.weight, lin.bias = self.weight, self.bias
        lin.train(self.training)
        return lin

    def extra_repr(self) -> str:
        fan = ", fan_in_fan_out=True" if self.fan_in_fan_out else ""
        bits = f", bits={self.bits}, group={self.group}" if self.bits else ""
        return f"{super().extra_repr()}{fan}, sketch={self.sketch.name}, rho={self.rho:g}{bits}"

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
        if self._gen is None:
            rank = 0
            if torch.distributed.is_available() and torch.distributed.is_initialized():
                rank = torch.distributed.get_rank()  # each rank draws its own sketches
            self._gen = torch.Generator().manual_seed(_stable_seed(self.seed, self.name, rank))
        self.calls += 1
        return int(torch.randint(0, 2**62, (), generator=self._gen))

    def forward(self, x: Tensor) -> Tensor:
        # (out, in) as F.linear wants it; for a Conv1D weight a transposed view, through which the
        # gradient reaches the (in, out) Parameter.
        weight = self.weight.T if self.fan_in_fan_out else self.weight
        if not torch.is_grad_enabled() or not (x.requires_grad or self.weight.requires_grad):
            return F.linear(x, weight, self.bias)
        bias, inp = self.bias, x
        device_type = x.device.type
        autocast = torch.is_autocast_enabled(device_type)
        if autocast:
            # Cast as autocast would for F.linear; the Function then runs with autocast off.
            dtype = torch.get_autocast_dtype(device_type)
            inp, weight = x.to(dtype), weight.to(dtype)
            bias = bias.to(dtype) if bias is not None else None

        rows = self.context.rows_for(x) if (self.skip_padding and self.context) else None
        n = x.numel() // x.shape[-1] if rows is None else rows.shape[0]
        k, k_uniform, allocated = self.num_rows(n)
        sketch = self.sketch if k < n else SKETCHES["exact"]

        sx, seed, plan, tstate, hooks = None, 0, None, None, []
        quant = qvar = None
        if self.weight.requires_grad:
            key = (sketch.name, k, inp.dtype, rows is not None, self.bits, self.group)
            shared = self.share_inputs and self.context is not None
            hit = self.context.lookup(key, x) if shared else None
            # b-bit rows: the rounding variances feed the variance estimates, when any reads them.
            want_qvar = self.tracker is not None or (allocated and not sketch.exact)
            if hit is not None:
                sx, seed, plan, owner, qvar = hit
                self._join(owner)
            else:
                draw = self._next_seed()
                x2 = inp.detach().reshape(-1, self.in_features)
                with torch.no_grad():
                    if sketch.data_dependent:
                        weights = self.grad_norms.weights(tuple(x.shape), rows, x.device)
                        plan = sketch.plan(x2, k, draw, rows, weights)
                        sx = plan.apply(x2)
                    else:
                        sx = sketch.apply(x2, k, draw, rows)
                        # One seed tensor per sketch: layers sharing the sketch save it once.
                        seed = seed_tensor(draw)
                    if self.bits is not None:  # one payload per sketch: shared ones code once
                        sx, _, qvar = quantize(sx, self.bits, self.group, draw, want_qvar)
                if shared:
                    self.context.store(key, x, sx, seed, plan, self, qvar)
            if self.bits is not None:
                stored = n if sketch.exact else k
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

    def _join(self, owner: RandomizedLinear) -> None:
        """This layer reuses the sketch ``owner`` formed: learn one gradient-norm estimate for
        both (the sketch serves both) and move rows together."""
        if owner is self:
            return
        if self.grad_norms is not None and owner.grad_norms is not None:
            self.grad_norms = owner.grad_norms
        if self.allocation is not None:
            self.allocation.share(self.name, owner.name)


def resolve_rho(rho: float | Mapping[str, float], name: str) -> float:
    """``rho`` for layer ``name``: a number, or the first regex key of a mapping found in ``name``."""
    if isinstance(rho, Mapping):
        for pattern, value in rho.items():
            if re.search(pattern, name):
                return check_rho(value)
        raise ValueError(f"no key of the rho mapping {dict(rho)} matches layer {name!r}")
    return check_rho(rho)
