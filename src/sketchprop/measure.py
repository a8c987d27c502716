"""Measurements: bytes saved for backward, peak memory, and fair timing.

- :class:`SavedTensorMeter` counts the bytes autograd saves for backward inside its ``with`` block,
  each storage once, Parameters excluded: exact, and the same on CPU and GPU.
- :func:`peak_memory_bytes`: CUDA allocator peak, or the process peak RSS on CPU.
- :func:`time_fn`: warm-up, synchronize, median of repeats.
"""

from __future__ import annotations

import resource
import statistics
import sys
import time
from collections.abc import Callable, Iterable

import torch
from torch import nn

__all__ = ["SavedTensorMeter", "peak_memory_bytes", "reset_peak_memory", "time_fn", "synchronize"]


def _storage_key(t: torch.Tensor) -> tuple:
    st = t.untyped_storage()
    return (t.device.type, t.device.index, st.data_ptr(), st.nbytes())


class SavedTensorMeter:
    """Count unique storages saved for backward while the block runs.

    >>> with SavedTensorMeter(model.parameters()) as meter:
    ...     loss = model(**batch).loss
    >>> meter.bytes          # activation bytes kept alive for backward

    Storages of the given ``params`` (weights saved by linear layers) are excluded: they are not
    activation memory. Tensors are only inspected, never copied or kept.
    """

    def __init__(self, params: Iterable[torch.Tensor] | nn.Module | None = None):
        if isinstance(params, nn.Module):
            params = params.parameters()
        self._exclude = {_storage_key(p) for p in (params or [])}
        self._seen: dict[tuple, int] = {}
        self._ctx = None

    def _pack(self, t: torch.Tensor):
        if t.layout == torch.strided and not t.is_meta:
            key = _storage_key(t)
            if key not in self._exclude and key[2] != 0:
                self._seen[key] = key[3]
        return t

    def __enter__(self) -> SavedTensorMeter:
        self._ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc):
        self._ctx.__exit__(*exc)
        return False

    @property
    def bytes(self) -> int:
        return sum(self._seen.values())

    @property
    def count(self) -> int:
        return len(self._seen)


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
