"""Which rows of a self-attention block's input backward reads, and whether the ones it made again
are forward's: shared by the recompute of :mod:`~sketchprop.activations.attention` (exact and
coded).

A padded batch's padding rows are neither live queries nor keys any query may attend to
(:func:`needed_rows`), so backward need not make their Q, K, V again. From the exact block input
(``attention="recompute"``) the rows it makes must be forward's bit for bit, yet a product over
fewer rows may round differently (MKL on an AMD EPYC: float32 with 1-3 rows, or with 5-11 on two
threads; float64 unless a multiple of 4). So forward keeps, on a padded batch (:func:`padded`), a
fingerprint of Q, K and V per row (:func:`fingerprints`), and backward keeps the rows it made only
where they match it (:func:`same_rows`), and raises where all of them made again do not; on a
batch without padding it keeps the first row's, which backward's product over every row (forward's
own) must give again.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..compiling import fused


def needed_rows(dout: Tensor, mask: Tensor | None, shape: torch.Size) -> Tensor | None:
    """The rows (flat indices into the ``B * L`` rows of the block input, of shape ``shape``) whose
    Q, K or V backward reads, or None for all of them. A row is read when it is a live query
    (a nonzero output gradient), a key that some query may attend to (the mask allows it; a
    masked key's probability is exactly 0, so its K and V meet only zeros), or any row of a
    sequence where a live query may attend to no key (its softmax spreads over the masked keys).
    Padded rows are neither: skipping them is where a padded batch's recompute saves its time
    (the exact recompute checks the rows it made against forward's: :func:`fingerprint`)."""
    if mask is None or mask.dim() != 4 or dout.dim() != 4 or len(shape) != 3:
        return None
    (b, length), (mb, _, mq, mk) = shape[:2], mask.shape
    if (dout.shape[0], dout.shape[2]) != (b, length) or mk != length or mb not in (1, b) \
            or mq not in (1, length):
        return None
    allowed = attendable(mask)
    live = dout.ne(0).any(-1).any(1)  # (B, L) queries
    key = allowed.any(-2).any(1).expand(b, length)  # keys some query may attend to
    blind = (~allowed.any(-1)).any(1).expand(b, length)  # queries that may attend to no key
    needed = live | key | (blind & live).any(-1, keepdim=True)
    return None if bool(needed.all()) else needed.flatten().nonzero().squeeze(1)


def attendable(mask: Tensor) -> Tensor:
    """A boolean or additive attention mask as booleans (True: may attend)."""
    return mask if mask.dtype == torch.bool else mask > torch.finfo(mask.dtype).min


def padded(mask: Tensor | None) -> bool:
    """Whether ``mask`` (``B or 1, H or 1, Lq, Lk``) has a key that no query may attend to (a
    padded batch's padding): rows that :func:`needed_rows` may leave out."""
    return mask is not None and mask.dim() == 4 and not bool(attendable(mask).any(-2).all())


# Fingerprint weights by (words per row, device); below 2^31, so that a row of up to 2^16 16-bit
# words sums to less than 2^62 in int64: no overflow, which C++ (the compiled sum) leaves undefined.
_WEIGHTS: dict[tuple, Tensor] = {}
_MAX_WORDS = 2**16


@fused
def _weighted_words(words: Tensor, weights: Tensor) -> Tensor:
    return (words.to(torch.int64) * weights).sum((-2, -1))


def fingerprint(t: Tensor) -> Tensor | None:
    """``(B, H, L, D) -> (B, L)`` int64: per row, the sum of the 16-bit words of its ``H x D``
    values, each times a fixed weight below 2^31. An integer sum, so one row's fingerprint is the
    same whatever the batch, layout or compiler around it. A value moved by a float step (any
    change within one of its words) changes it; larger changes, and changes to several values,
    go unseen only where the weights happen to balance them (about 2^-31). None where the values
    do not lie in rows of whole words (a last dimension with a stride, 1-byte values) or a row
    holds more than 2^16 words."""
    if t.stride(-1) != 1 or t.element_size() < 2 \
            or t.shape[1] * t.shape[-1] * t.element_size() // 2 > _MAX_WORDS:
        return None
    words = t.transpose(1, 2).view(torch.int16)  # (B, L, H, D * itemsize / 2)
    key = (tuple(words.shape[-2:]), words.device)
    weights = _WEIGHTS.get(key)
    if weights is None:
        gen = torch.Generator().manual_seed(0)
        weights = _WEIGHTS[key] = torch.randint(1, 2**31, key[0], generator=gen).to(key[1])
    return _weighted_words(words, weights)


def fingerprints(q: Tensor, k: Tensor, v: Tensor) -> Tensor | None:
    """Q's, K's and V's :func:`fingerprint` stacked (``3, B, L``), or None where one has none."""
    prints = [fingerprint(t) for t in (q, k, v)]
    return None if any(p is None for p in prints) else torch.stack(prints)


def same_rows(qkv: list[Tensor], prints: Tensor, rows: Tensor | None) -> bool:
    """Whether Q, K, V made again match forward's fingerprints ``prints`` on the flat ``rows``
    (None: every row)."""
    made = fingerprints(*qkv)
    if made is None:
        return False
    if rows is None:
        return torch.equal(made, prints)
    return torch.equal(made.flatten(1).index_select(1, rows),
                       prints.flatten(1).index_select(1, rows))
