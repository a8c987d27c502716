r"""A language model's loss by chunks of tokens, the logits made again in backward
(``lm_loss="chunked"``).

**Language-model loss** (``lm_loss="chunked"``, :func:`chunked_lm_loss`): the cross-entropy of a
causal LM (or of an encoder-decoder LM of :data:`SEQ2SEQ_LMS`: T5) computed by chunks of
tokens, whose logits are made again in backward, so the ``(tokens, vocabulary)`` logits never
exist at once and backward keeps only the final hidden states and one float32 log-sum-exp per
token, as Liger-Kernel's fused linear cross-entropy and Apple's Cut Cross-Entropy do. Exact;
logits soft-capped as Gemma 2 caps them where its config says so. Patched in, it replaces the
model's forward while the model trains with labels (the loss of ``model(**batch)`` is this one,
and ``logits`` is None, as with Liger's patches); without labels, without gradients or in eval
mode the forward is the model's own and returns logits.
"""

from __future__ import annotations

import inspect
import threading

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..compiling import eager_island
from ..functional import first_order
from ..wrappers import plain_class
from .floor import offer
from .projections import _autocast_dtype

#: Logits per chunk of :func:`chunked_lm_loss` by default (64 MiB in float32): chunks of a few
#: rows would read the whole output weight once per chunk, which on a CPU costs more than the
#: matmuls (16-row chunks made a Llama-shaped step 3x slower).
CHUNK_LOGITS = 2**24


def _chunk_rows(rows: int, hidden: int, vocab: int, chunk_size: int | None) -> int:
    """Rows per chunk: ``chunk_size``, or as many as make :data:`CHUNK_LOGITS` logits, at least
    one."""
    if chunk_size is not None:
        return chunk_size
    return max(1, min(rows, CHUNK_LOGITS // vocab))


def _capped(logits: Tensor, softcap: float | None) -> tuple[Tensor, Tensor | None]:
    """``softcap * tanh(logits / softcap)`` (Gemma 2's ``final_logit_softcapping``, in its
    order of operations) and the ``tanh``; the logits as they are and None without a cap."""
    if softcap is None:
        return logits, None
    tanh = logits.div(softcap).tanh_()
    return tanh * softcap, tanh


class _ChunkedCrossEntropy(torch.autograd.Function):
    """Sum over rows of ``-log softmax(cap(h W^T + b))[target]``, by chunks of rows, times
    ``scale``; keeps ``h``, the weight and each row's log-sum-exp (float32)."""

    @staticmethod
    def forward(ctx, h: Tensor, weight: Tensor, bias: Tensor | None, target: Tensor, scale: float,
                chunk: int, dtype: torch.dtype, softcap: float | None = None) -> Tensor:
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        lse = torch.empty(h.shape[0], dtype=torch.float32, device=h.device)
        with torch.autocast(h.device.type, enabled=False):
            w = weight.to(dtype)
            b = None if bias is None else bias.to(dtype)
            for i in range(0, h.shape[0], chunk):
                logits = _capped(F.linear(h[i:i + chunk].to(dtype), w, b), softcap)[0].float()
                lse[i:i + chunk] = torch.logsumexp(logits, -1)
                picked = logits.gather(1, target[i:i + chunk, None])[:, 0]
                total += (lse[i:i + chunk] - picked).sum()
        # Under the floor, the hidden states are kept as its code (the logits it would have coded
        # otherwise are made again from them): in full, they were the largest save left where
        # the vocabulary is small, T5's at hidden 384. Without a floor, exact.
        offer(h)
        ctx.save_for_backward(h, weight, bias, target, lse)
        ctx.scale, ctx.chunk, ctx.dtype, ctx.softcap = scale, chunk, dtype, softcap
        return total * scale

    @staticmethod
    @first_order
    def backward(ctx, dloss: Tensor):
        h, weight, bias, target, lse = ctx.saved_tensors
        w = weight.to(ctx.dtype)
        b = None if bias is None else bias.to(ctx.dtype)
        want_h, want_w, want_b = ctx.needs_input_grad[:3]
        dh = torch.empty_like(h) if want_h else None
        dw = torch.zeros(weight.shape, dtype=torch.float32, device=h.device) if want_w else None
        db = torch.zeros(weight.shape[0], dtype=torch.float32, device=h.device) \
            if want_b and bias is not None else None
        factor = dloss.float() * ctx.scale
        for i in range(0, h.shape[0], ctx.chunk):
            hc = h[i:i + ctx.chunk].to(ctx.dtype)
            logits, tanh = _capped(F.linear(hc, w, b), ctx.softcap)
            # d loss / d logits = softmax - one_hot(target), times the upstream factor.
            dlogits = logits.float().sub_(lse[i:i + ctx.chunk, None]).exp_()
            rows = torch.arange(dlogits.shape[0], device=h.device)
            dlogits[rows, target[i:i + ctx.chunk]] -= 1
            dlogits.mul_(factor)
            if tanh is not None:  # through the cap, as autograd goes: * softcap, tanh's, / softcap
                dlogits.mul_(ctx.softcap).mul_(1 - tanh.float() ** 2).div_(ctx.softcap)
            if db is not None:
                db += dlogits.sum(0)
            dlogits = dlogits.to(ctx.dtype)
            if dh is not None:
                dh[i:i + ctx.chunk] = dlogits.matmul(w).to(h.dtype)
            if dw is not None:
                dw += dlogits.T.matmul(hc).float()
        return (dh, None if dw is None else dw.to(weight.dtype),
                None if db is None else db.to(bias.dtype), None, None, None, None, None)


def chunked_lm_loss(hidden_states: Tensor, weight: Tensor, labels: Tensor | None = None,
                    bias: Tensor | None = None, *, shift_labels: Tensor | None = None,
                    ignore_index: int = -100, num_items_in_batch: Tensor | int | None = None,
                    chunk_size: int | None = None, softcap: float | None = None) -> Tensor:
    """A causal LM's cross-entropy loss from its final hidden states and its output layer's
    ``weight`` (and ``bias``), never forming all the logits at once: exactly transformers'
    ``ForCausalLMLoss`` on ``F.linear(hidden_states, weight, bias)``.

    ``labels`` (``(batch, length)``, ``ignore_index`` where no loss) are shifted left by one, as
    transformers does (or pass ``shift_labels`` already shifted). The mean is over the tokens that
    have a label, or the sum divided by ``num_items_in_batch`` where given (gradient accumulation,
    as HF's Trainer passes it). Rows without a label are left out before any logit is computed.

    Tokens are taken by chunks of ``chunk_size`` rows (default: as many as make 2^24 logits, 64
    MiB in float32); backward computes each chunk's logits again from the
    hidden states it kept and the per-token log-sum-exp. Under the generic floor
    (``floor_bits``) the hidden states are kept as its code, as the recomputed attention's Q, K, V
    are: not exact there. Under autocast the logits are computed in
    autocast's dtype and the softmax in float32, as the unpatched model does. ``softcap`` caps the
    logits to ``softcap * tanh(logits / softcap)`` first (Gemma 2's ``final_logit_softcapping``).

    To use it without :func:`~sketchprop.patch_activations` (a peft or hand-written loop)::

        out = model.model(input_ids, attention_mask=mask)   # the decoder, without its head
        loss = chunked_lm_loss(out.last_hidden_state, model.lm_head.weight, labels)
    """
    if shift_labels is None:
        if labels is None:
            raise ValueError("chunked_lm_loss needs labels or shift_labels")
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    if shift_labels.shape != hidden_states.shape[:-1]:
        raise ValueError(f"labels of shape {tuple(shift_labels.shape)} do not match hidden states "
                         f"of shape {tuple(hidden_states.shape)}")
    if chunk_size is not None and not (isinstance(chunk_size, int) and chunk_size >= 1):
        raise ValueError(f"chunk_size must be a positive integer or None, got {chunk_size!r}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be positive or None, got {softcap!r}")
    h = hidden_states.reshape(-1, hidden_states.shape[-1])
    target = shift_labels.reshape(-1).to(h.device)
    keep = (target != ignore_index).nonzero()[:, 0]
    h, target = h.index_select(0, keep), target.index_select(0, keep)
    if num_items_in_batch is None:
        scale = 1.0 / keep.numel() if keep.numel() else float("nan")
    else:
        scale = 1.0 / float(num_items_in_batch)
    dtype = _autocast_dtype(h) or torch.promote_types(h.dtype, weight.dtype)
    chunk = _chunk_rows(h.shape[0], h.shape[1], weight.shape[0], chunk_size)
    return _ChunkedCrossEntropy.apply(h, weight, bias, target, scale, chunk, dtype, softcap)


#: Config attributes that, set, make a model change its logits after the output layer (besides
#: the soft caps of :data:`_SOFTCAPS`, which the chunked loss applies).
_LOGIT_POSTPROCESSING = ("logit_scale", "logits_scaling", "output_multiplier_scale",
                         "lm_head_multiplier")
#: Config attributes of a soft cap on the logits, ``cap * tanh(logits / cap)`` (Gemma 2's and
#: Gemma 3n's, RecurrentGemma's).
_SOFTCAPS = ("final_logit_softcapping", "logits_soft_cap")


def _configs(owner: nn.Module) -> list:
    """The model's config and, a multimodal model's, its text model's (where Gemma 3n keeps its
    cap)."""
    config = getattr(owner, "config", None)
    text = config.get_text_config() if callable(getattr(config, "get_text_config", None)) else None
    return [c for c in (config, text) if c is not None]


def _softcaps(owner: nn.Module) -> set[float]:
    """The soft caps ``owner``'s configs give its logits (one, or none, unless they disagree)."""
    return {float(getattr(c, k)) for c in _configs(owner) for k in _SOFTCAPS
            if getattr(c, k, None) is not None}


def logit_softcap(owner: nn.Module) -> float | None:
    """The soft cap ``owner`` puts on its logits after its output layer, or None (two caps that
    disagree: :func:`lm_loss_refusal` refuses the model)."""
    caps = _softcaps(owner)
    return min(caps) if caps else None

#: Encoder-decoder LMs whose training loss is ``CrossEntropyLoss()`` (a mean over the labelled
#: tokens, labels not shifted) of their output layer on what it reads, and whose decoder reads
#: ``prepare_decoder_input_ids_from_labels(labels)`` when given no decoder input. (BART, Pegasus
#: and Marian add a ``final_logits_bias`` after the output layer: not listed.)
SEQ2SEQ_LMS = ("T5ForConditionalGeneration", "MT5ForConditionalGeneration",
               "UMT5ForConditionalGeneration")


def _causal_lm_names() -> set[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return {n for v in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values()
            for n in ((v,) if isinstance(v, str) else v)}


def lm_loss_refusal(owner: nn.Module) -> str | None:
    """Why the chunked loss cannot replace ``owner``'s (a transformers model), or None when it
    can: a causal LM with transformers' standard loss or an encoder-decoder LM of
    :data:`SEQ2SEQ_LMS`, a plain ``nn.Linear`` output layer, and no change to its logits after
    that layer but a soft cap."""
    from transformers.loss.loss_utils import LOSS_MAPPING

    name = plain_class(owner).__name__  # LlamaForCausalLM for fully_shard's FSDPLlamaForCausalLM
    if name not in SEQ2SEQ_LMS:
        if name not in _causal_lm_names():
            return f"{name} is not a transformers causal LM (nor an encoder-decoder LM of " \
                   "sketchprop.activations.loss.SEQ2SEQ_LMS)"
        # transformers' own rule (PreTrainedModel.loss_function), without its warning.
        loss = owner.__dict__.get("_loss_function") or LOSS_MAPPING.get(
            getattr(owner, "loss_type", None), LOSS_MAPPING["ForCausalLM"])
        if loss is not LOSS_MAPPING["ForCausalLM"]:
            return f"{name}'s loss is not transformers' ForCausalLM loss"
    if "labels" not in inspect.signature(type(owner).forward).parameters:
        return f"{name}.forward takes no labels"
    head = owner.get_output_embeddings() if hasattr(owner, "get_output_embeddings") else None
    if type(head) is not nn.Linear:
        return f"its output layer is {type(head).__name__}, not an nn.Linear"
    for config in _configs(owner):
        for key in _LOGIT_POSTPROCESSING:
            if getattr(config, key, None) not in (None, 1, 1.0):
                return f"it changes its logits after the output layer (config.{key})"
    if len(_softcaps(owner)) > 1:
        return "its config and its text config give different caps on its logits"
    return None


_LOSS_KWARGS = ("num_items_in_batch", "ignore_index", "shift_labels")
# Per thread: the output layers whose input this thread's chunked forward takes (by id), and
# what each saw. The layer's forward is swapped while any thread's chunked forward runs through
# it, under the lock: two threads training one model each swap and restore it once.
_capturing = threading.local()
_swap = threading.Lock()


class _Capture:
    """An output layer's forward during chunked forwards: in a thread whose chunked forward runs
    through the layer, it hands over its input and returns an empty tensor; in any other
    thread, it is the layer's own forward."""

    def __init__(self, head: nn.Linear):
        # a forward the instance had of its own (another library's wrapper), restored after
        self.head, self.users, self.previous = head, 0, head.__dict__.get("forward")

    def __call__(self, x: Tensor) -> Tensor:
        seen = getattr(_capturing, "heads", {}).get(id(self.head))
        if seen is None:
            return nn.Linear.forward(self.head, x) if self.previous is None else self.previous(x)
        seen["hidden"] = x
        return x.new_empty(*x.shape[:-1], 0)


def _by_name(forward, owner: nn.Module, args: tuple, kwargs: dict) -> dict:
    """A call's arguments to ``forward`` (a model's, unbound) as keywords; raises TypeError as
    the call would, where they do not bind."""
    sig = inspect.signature(forward)
    bound = sig.bind(owner, *args, **kwargs).arguments
    out = {}
    for i, (name, value) in enumerate(bound.items()):
        kind = sig.parameters[name].kind
        if i == 0:
            continue  # the model itself
        if kind is inspect.Parameter.VAR_POSITIONAL:
            raise TypeError(f"{type(owner).__name__}.forward takes *{name}: pass its inputs by "
                            "name under lm_loss='chunked'")
        if kind is inspect.Parameter.VAR_KEYWORD:
            out.update(value)
        else:
            out[name] = value
    return out


class LMLossForward:
    """A causal LM's forward that computes its training loss with :func:`chunked_lm_loss`: the
    model's own forward runs without labels while its output layer hands over its input (and
    returns an empty tensor), and the loss comes from that input (an encoder-decoder LM's decoder
    given the decoder input its labels make, and its labels not shifted). Without labels, without
    gradients, in eval mode, with ``return_dict=False`` or once the output layer is no longer an
    ``nn.Linear``, it is the model's own forward. Its signature is the model's (HF's Trainer reads
    it); a ``copy.deepcopy`` of the model calls its own copy."""

    def __init__(self, owner: nn.Module):
        self.owner = owner

    @property
    def __signature__(self) -> inspect.Signature:
        return inspect.signature(type(self.owner).forward.__get__(self.owner))

    def __call__(self, *args, **kwargs):
        owner = self.owner
        if args:  # by name: labels and an encoder-decoder's decoder input may come by position
            kwargs = _by_name(type(owner).forward, owner, args, kwargs)
            args = ()
        labels = kwargs.pop("labels", None)
        head = owner.get_output_embeddings()
        if labels is None or not (owner.training and torch.is_grad_enabled()) \
                or kwargs.get("return_dict") is False or type(head) is not nn.Linear:
            # The class's function called with the model: Dynamo resolves a bound method of the
            # class's forward (type(owner).forward.__get__(owner)) to the instance's forward, this
            # object, and a compiled eval forward recursed without end.
            return type(owner).forward(owner, *args, labels=labels, **kwargs)
        return self._chunked(head, labels, *args, **kwargs)

    # Eager under torch.compile: it swaps the output layer's forward for the call (a graph cannot
    # trace that), so a compiled model's training forward with labels runs eagerly here.
    @eager_island
    def _chunked(self, head: nn.Linear, labels: Tensor, *args, **kwargs):
        owner = self.owner
        original = type(owner).forward.__get__(owner)
        seq2seq = plain_class(owner).__name__ in SEQ2SEQ_LMS
        if seq2seq and kwargs.get("decoder_input_ids") is None \
                and kwargs.get("decoder_inputs_embeds") is None:
            kwargs["decoder_input_ids"] = owner.prepare_decoder_input_ids_from_labels(labels)
        seen = {}
        mine = _capturing.__dict__.setdefault("heads", {})
        mine[id(head)] = seen
        with _swap:
            capture = head.__dict__.get("forward")
            if not isinstance(capture, _Capture):
                capture = head.forward = _Capture(head)
            capture.users += 1
        try:
            out = original(*args, **kwargs)
        finally:
            del mine[id(head)]
            with _swap:
                capture.users -= 1
                if not capture.users:
                    if capture.previous is None:
                        del head.forward
                    else:
                        head.forward = capture.previous
        softcap = logit_softcap(owner)
        if seq2seq:  # CrossEntropyLoss(): labels as they are, a mean over the labelled tokens
            options = {"shift_labels": labels}
        else:
            options = {k: kwargs[k] for k in _LOSS_KWARGS if k in kwargs}
        loss = chunked_lm_loss(seen["hidden"], head.weight, labels, head.bias, softcap=softcap,
                               **options)
        fields = {k: v for k, v in out.items() if k not in ("loss", "logits")}
        return type(out)(loss=loss, logits=None, **fields)
