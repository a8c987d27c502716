"""Measurements: bytes saved for backward, peak memory, and fair timing.

- :class:`SavedTensorMeter` counts the bytes autograd saves for backward inside its ``with`` block,
  each storage once, Parameters excluded: exact, and the same on CPU and GPU.
- :func:`peak_memory_bytes`: CUDA allocator peak, or the process peak RSS on CPU.
- :func:`time_fn`: warm-up, synchronize, median of repeats.
"""

from __future__ import annotations

import os
import resource
import statistics
import sys
import time
from collections.abc import Callable, Iterable

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from .codes import is_filed_payload

__all__ = ["SavedTensorMeter", "peak_memory_bytes", "reset_peak_memory", "synchronize", "time_fn",
           "usable_cores"]


def _storage_key(t: torch.Tensor) -> tuple:
    st = t.untyped_storage()
    return (t.device.type, t.device.index, st.data_ptr(), st.nbytes())


class SavedTensorMeter:
    """Count unique storages saved for backward while the block runs.

    >>> with SavedTensorMeter(model.parameters()) as meter:
    ...     loss = model(**batch).loss
    >>> meter.bytes          # activation bytes kept alive for backward

    Storages of the given ``params`` (weights saved by linear layers) are excluded: they are not
    activation memory. Tensors are only inspected, never copied.

    ``meter.label`` may be set while the block runs (from module hooks, say); each counted storage
    records the labels it was saved under (``records``: ``(nbytes, labels)`` pairs).

    ``discard=True`` counts a forward pass that will never be backpropagated without keeping what
    it saves: each saved tensor is dropped at once (``backward`` then fails), except those saved
    under a label in ``keep_labels`` and the payloads of shared codes (:mod:`sketchprop.codes`),
    so the saved bytes of a batch whose activations would not fit in memory can still be counted.
    Keep what else later code finds again through weak references (the sketches
    ``share_inputs`` shares), or it is recomputed and counted twice. A storage is
    recognised by address and size while it is alive; a weak reference tells a freed storage whose
    address was reused apart from the same one saved twice.
    """

    def __init__(self, params: Iterable[torch.Tensor] | nn.Module | None = None, *,
                 discard: bool = False, keep_labels: Iterable[str] = ()):
        if isinstance(params, nn.Module):
            params = params.parameters()
        self._exclude = {_storage_key(p) for p in (params or [])}
        self.discard = discard
        self.keep_labels = set(keep_labels)
        self.label: str | None = None
        self.records: list[tuple[int, set]] = []
        self._live: dict[tuple, tuple] = {}  # storage key -> (weak reference, index in records)
        self._kept: list[torch.Tensor] = []
        self._ctx = None

    def _pack(self, t: torch.Tensor):
        if t.layout == torch.strided and not t.is_meta:
            key = _storage_key(t)
            if key not in self._exclude and key[2] != 0:
                entry = self._live.get(key)
                if entry is None or entry[0].expired():
                    entry = (StorageWeakRef(t.untyped_storage()), len(self.records))
                    self._live[key] = entry
                    self.records.append((key[3], set()))
                self.records[entry[1]][1].add(self.label)
        if not self.discard:
            # A tensor with history is kept as a detached alias: a saved output (``exp``'s, say)
            # returned as is would hold its own grad_fn, a cycle through C++ that keeps the whole
            # graph alive after the loss is dropped unless backward runs. Autograd re-attaches
            # the history on unpack, so gradients (double backward included) are unchanged.
            # Others are kept as they are, so what code finds again through a weak reference
            # to the tensor (``share_inputs``' sketches) stays alive as it does unmetered.
            return t.detach() if t.grad_fn is not None else t
        # What later code finds again through a weak reference: kept, or it would be made and
        # counted again (the lean preset's shared codes; keep_labels for the rest)
        if self.label in self.keep_labels or is_filed_payload(t):
            self._kept.append(t)
        return None

    @staticmethod
    def _unpack(t):
        if t is None:
            raise RuntimeError("this graph was recorded under SavedTensorMeter(discard=True): "
                               "its saved tensors were dropped and it cannot be backpropagated")
        return t

    def __enter__(self) -> SavedTensorMeter:
        self._ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc):
        self._ctx.__exit__(*exc)
        self._live.clear()
        self._kept.clear()
        return False

    @property
    def bytes(self) -> int:
        return sum(n for n, _ in self.records)

    @property
    def count(self) -> int:
        return len(self.records)


def usable_cores() -> int:
    """The number of cores this process may run on (its CPU affinity), at least 1: the default
    torch thread count of training runs and benchmarks."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # no affinity outside Linux
        return max(1, os.cpu_count() or 1)


def synchronize(device: torch.device | str | None = None) -> None:
    if torch.cuda.is_available() and (device is None or torch.device(device).type == "cuda"):
        torch.cuda.synchronize()


def reset_peak_memory(device: torch.device | str | None = None) -> None:
    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_bytes(device: torch.device | str | None = None) -> int:
    """CUDA ``max_memory_allocated`` for a CUDA device; otherwise the process peak RSS.

    The RSS peak never goes down within a process: compare configurations in fresh processes.
    """
    if device is not None and torch.device(device).type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)  # Linux reports KiB


def time_fn(fn: Callable[[], object], *, warmup: int = 3, repeats: int = 10,
            device: torch.device | str | None = None) -> float:
    """Median wall seconds of ``fn()`` after ``warmup`` calls, synchronizing around each call."""
    for _ in range(warmup):
        fn()
    synchronize(device)
    times = []
    for _ in range(repeats):
        synchronize(device)
        t0 = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)
