"""What the benchmarks share: the checkout's paths, options (threads, lists, sketches), the device,
the environment a run records, interleaved timing with bracketed ratios, markdown tables and the
JSON + markdown files every benchmark writes.

Torch only: no hydra, datasets or wandb at import (the recorded command is made by
``sketchprop.glue.paths.portable_command``).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from sketchprop.glue.paths import REPO_ROOT, portable, portable_command
from sketchprop.measure import usable_cores
from sketchprop.sketches import SKETCHES, BlockSRHT, Sketch

#: What the benchmark tables call ``lean``: the lean preset's structural parts (norm outputs and
#: attention and MLP inputs as shared codes) with the 2-bit GELU code and without the floor,
#: which the preset itself adds (``preset="lean"``: ``floor_bits=4, gelu_bits=4``;
#: ``int4+lean(gelu4)+floor4`` in results/bench/architectures.md). The tables that measure lean
#: alone keep measuring that.
LEAN_PARTS = {"preset": "lean", "gelu_bits": 2, "floor_bits": None}


def for_model(model: torch.nn.Module, activations: dict) -> dict:
    """``patch_activations`` arguments for ``model``: ``gelu_bits`` only where it has a GELU that
    the GELU part takes (not a gated MLP's, where the MLP part is on; a part given explicitly
    that the model lacks is an error)."""
    from sketchprop.activations import gated_layout, is_exact_gelu, is_tanh_gelu, takes_mlp

    takes = takes_mlp(activations.get("mlp", "coded" if activations.get("preset") == "lean"
                                      else "auto"))
    gates = {id(getattr(m, gated_layout(m).act)) for m in model.modules() if takes(m)}
    if activations.get("gelu_bits") is None or any(
            id(m) not in gates and (is_exact_gelu(m) or is_tanh_gelu(m)) for m in model.modules()):
        return dict(activations)
    return {k: v for k, v in activations.items() if k != "gelu_bits"}


def lean_parts(model: torch.nn.Module) -> dict:
    """:data:`LEAN_PARTS` for ``model`` (:func:`for_model`)."""
    return for_model(model, LEAN_PARTS)

ROOT = REPO_ROOT  # the checkout
RESULTS = ROOT / "results" / "bench"
# The GLUE files shipped with the code (data/glue/SOURCES.md); GLUE_DIR points elsewhere.
GLUE = ROOT / "data" / "glue"


class BadArgs(ValueError):
    """An option a benchmark cannot run with, found before any work: its entry point reports it
    as a usage error (exit status 2)."""


def default_glue_dir() -> str:
    """``$GLUE_DIR`` when set, else the shipped ``data/glue``."""
    return os.environ.get("GLUE_DIR") or str(GLUE)


def add_threads_arg(parser) -> None:
    """``--threads``: torch threads while measuring (default: every core this process may use)."""
    parser.add_argument("--threads", type=int, default=usable_cores(),
                        help="torch threads while measuring (default: the cores this process may "
                             f"use, here {usable_cores()})")


def parse_list(text: str, kind=str) -> list:
    """A comma-separated option as a list of ``kind``, empty items dropped."""
    return [kind(v) for v in text.split(",") if v.strip()]


def sketch_from_spec(spec: str) -> Sketch:
    """A sketch by name, or ``blocksrht:B`` for a block-SRHT with block size ``B``."""
    if ":" in spec:
        name, arg = spec.split(":", 1)
        if name != "blocksrht":
            raise ValueError(f"only blocksrht takes a parameter, got {spec!r}")
        return BlockSRHT(name=f"blocksrht:{int(arg)}", block=int(arg))
    if spec not in SKETCHES:
        raise ValueError(f"unknown sketch {spec!r}; choose one of {sorted(SKETCHES)} "
                         "or blocksrht:B")
    return SKETCHES[spec]


def setup_device(name: str, threads: int | None, *, quiet: bool = False) -> torch.device:
    """Set torch's thread count (``None``: every usable core) and return the device; the thread
    count is printed unless ``quiet`` (child processes whose stdout is parsed)."""
    threads = threads or usable_cores()
    if threads < 1:
        raise SystemExit(f"--threads must be >= 1, got {threads}")
    torch.set_num_threads(threads)
    if not quiet:
        print(f"torch threads: {torch.get_num_threads()} (this process may use {usable_cores()} "
              f"cores)", flush=True)
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda given but torch.cuda.is_available() is False")
    return dev


ALLOCATORS = ("keep", "default")
_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4  # glibc's mallopt parameters (malloc.h)


def set_allocator(mode: str) -> str:
    """Set how the C allocator treats freed memory for the rest of the process, and describe it.

    ``keep``: glibc keeps every page it has faulted in (``mallopt``: no trimming of the heap's top,
    no ``mmap`` for large blocks), as a caching allocator does (PyTorch's on CUDA). ``default``:
    glibc as it is, which hands large freed blocks back to the OS and faults them in again, zeroed,
    when the next step allocates. Why it matters for timing: under ``default`` a step's time
    depends on how much memory the steps before it freed (in an interleaved benchmark, another
    method's), and a method that stores more pays more page faults, so a ratio to ``exact`` mixes
    the method's own cost with the allocator's. Call before the timed work; not reversible."""
    if mode not in ALLOCATORS:
        raise BadArgs(f"allocator must be one of {', '.join(ALLOCATORS)}, got {mode!r}")
    if mode == "default":
        return "default (glibc's: large freed blocks go back to the OS)"
    if platform.libc_ver()[0] != "glibc":
        return "default (not glibc: the keep setting is glibc's mallopt)"
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    if not (libc.mallopt(_M_TRIM_THRESHOLD, -1) and libc.mallopt(_M_MMAP_MAX, 0)):
        raise RuntimeError("glibc's mallopt refused the keep setting")
    return "keep (glibc's mallopt: no heap trimming, no mmap; faulted pages are reused)"


def parse_shapes(text: str, quick: bool) -> list[tuple[int, int]]:
    """``8x128,16x128`` as ``[(8, 128), (16, 128)]``; ``quick`` clamps them to at most 4 x 64
    (duplicates dropped): long enough that real rows have padding."""
    try:
        shapes = [tuple(int(v) for v in s.split("x")) for s in parse_list(text)]
    except ValueError:
        shapes = []
    if not shapes or any(len(s) != 2 or min(s) < 1 for s in shapes):
        raise BadArgs(f"--shapes must be BATCHxSEQ[,BATCHxSEQ...], got {text!r}")
    if quick:
        shapes = [(min(b, 4), min(s, 64)) for b, s in shapes]
    return list(dict.fromkeys(shapes))


def parse_threads(text: str) -> list[int]:
    """``1,all`` as thread counts; ``all`` is every core this process may use."""
    out = []
    for v in parse_list(text):
        if v != "all" and not (v.isdigit() and int(v) >= 1):
            raise BadArgs(f"--threads must be positive counts or 'all', got {text!r}")
        out.append(usable_cores() if v == "all" else int(v))
    if not out:
        raise BadArgs("--threads names no thread count")
    return list(dict.fromkeys(out))


def shape_of(text: str) -> tuple[int, ...]:
    """``16x12x128x128`` as a tuple."""
    try:
        shape = tuple(int(v) for v in text.split("x"))
    except ValueError:
        shape = ()
    if not shape or min(shape) < 1:
        raise BadArgs(f"a shape is NxMx... in positive integers, got {text!r}")
    return shape


def counting_faults(fn, counts: list):
    """``fn``, appending to ``counts`` the page faults of this process (minor: pages the OS
    mapped, and zeroed, for it) during each call: what a step pays for memory the allocator
    handed back to the OS (:func:`set_allocator`)."""
    def call():
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        fn()
        counts.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    return call


def sync(dev: torch.device) -> None:
    """Wait for the device's queued work (CUDA); a no-op on CPU."""
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def cpu_model() -> str:
    """The CPU's model name with its family, model number and L3 size (``lscpu``), else what
    ``platform`` knows. The numbers are kept because a hypervisor may show only a vendor's name
    ("AMD EPYC"), and two CPU generations under one name time the same code differently."""
    try:  # C locale: the labels untranslated
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10,
                             env={**os.environ, "LC_ALL": "C"}).stdout
    except (OSError, subprocess.SubprocessError, UnicodeDecodeError):
        out = ""
    info: dict[str, str] = {}
    for key, _, value in (line.partition(":") for line in out.splitlines()):
        info.setdefault(key.strip(), value.strip())  # the first CPU's, where several are listed
    if not info.get("Model name"):
        return platform.processor() or platform.machine()
    detail = [f"{label} {info[key].split(' (')[0]}" for key, label in
              (("CPU family", "family"), ("Model", "model"), ("L3 cache", "L3")) if info.get(key)]
    return info["Model name"] + (f" ({', '.join(detail)})" if detail else "")


def git_commit() -> str | None:
    """The checkout's short commit hash (None outside git)."""
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                             text=True, timeout=10)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def git_dirty() -> bool | None:
    """Whether tracked files outside ``results/`` differ from the commit (the run measured
    uncommitted code). Result files are not code: a suite of runs rewrites them one by one."""
    try:
        out = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".",
                              ":(exclude)results"], cwd=ROOT, capture_output=True, text=True,
                             timeout=10)
        return bool(out.stdout.strip()) if out.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


def environment(dev: torch.device) -> dict:
    """What a run records about where it ran: its command (as a user pastes it in a fresh clone),
    the device and CPU, threads, versions, commit, load average and time."""
    env = {
        "command": portable_command(["python", *sys.orig_argv[1:]]),  # as the filed runs say it
        "device": str(dev),
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "usable_cores": usable_cores(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "git_commit": git_commit(),
        "git_dirty": git_dirty(),
        "loadavg_start": [round(v, 2) for v in os.getloadavg()],
        "time": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }
    if dev.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(dev)
    try:
        import transformers

        env["transformers"] = transformers.__version__
    except ImportError:
        pass
    return env


def interleaved_times(fns: dict[str, Callable[[], object]], dev: torch.device, *, warmup: int,
                      repeats: int, inner: int = 1, base: str | None = None, every: int = 2,
                      on_round=None) -> dict:
    """Time each function ``repeats`` times, interleaved round-robin, bracketed by a baseline.

    Every function is first called ``warmup`` times. A round calls every function once, in an
    order rotated from round to round, with the ``base`` function (default: the first) timed
    before the first, after every ``every`` others and after the last. Each sample is the wall
    time of ``inner`` calls divided by ``inner``, the device synchronized before and after.

    Returns ``{"times": {name: [s, ...]}, "ratios": {name: [...]}}``: each ratio divides a sample by
    the mean of the two baseline samples that bracket it, so a configuration is always compared
    with the baseline measured seconds apart, under the same background load; on a shared
    machine whose speed drifts this is far steadier than a ratio of separate medians.
    """
    base = base or next(iter(fns))
    others = [n for n in fns if n != base]
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    sync(dev)

    def sample(fn) -> float:
        sync(dev)
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        sync(dev)
        return (time.perf_counter() - t0) / inner

    times: dict[str, list[float]] = {name: [] for name in fns}
    ratios: dict[str, list[float]] = {name: [] for name in fns}
    for r in range(repeats):
        shift = r % len(others) if others else 0
        order = others[shift:] + others[:shift]
        prev = sample(fns[base])
        times[base].append(prev)
        pending: list[tuple[str, float]] = []
        for i, name in enumerate(order):
            pending.append((name, sample(fns[name])))
            if len(pending) == every or i == len(order) - 1:
                nxt = sample(fns[base])
                times[base].append(nxt)
                ref = 0.5 * (prev + nxt)
                for n, t in pending:
                    times[n].append(t)
                    ratios[n].append(t / ref)
                ratios[base].append(nxt / prev)
                pending, prev = [], nxt
        if on_round is not None:
            on_round(r, times)
    ratios[base] = [1.0] * len(times[base])
    return {"times": times, "ratios": ratios}


def ratio_stats(measured: dict, base: str) -> dict[str, dict]:
    """Median time per configuration and its ratio to ``base``.

    ``ratio``: the median of the bracketed per-sample ratios (see :func:`interleaved_times`);
    ``ratio_of_medians``: the plain ratio of medians, for comparison.
    """
    times, ratios = measured["times"], measured["ratios"]
    b = statistics.median(times[base])
    out = {}
    for name, ts in times.items():
        med = statistics.median(ts)
        rs = ratios[name]
        q = statistics.quantiles(rs, n=4) if len(rs) >= 2 else [rs[0]] * 3
        out[name] = {
            "median_s": med,
            "ratio": statistics.median(rs),
            "ratio_q1": q[0],
            "ratio_q3": q[2],
            "ratio_of_medians": med / b,
            "samples_s": ts,
            "ratios": rs,
        }
    return out


def fmt_table(headers: Sequence[str], rows: Sequence[Sequence], title: str | None = None) -> str:
    """A GitHub-markdown table."""
    cells = [[str(c) for c in r] for r in rows]
    lines = []
    if title:
        lines += [f"**{title}**", ""]
    lines.append("| " + " | ".join(headers) + " |")
    lines.append("|" + "|".join("---" for _ in headers) + "|")
    lines += ["| " + " | ".join(r) + " |" for r in cells]
    return "\n".join(lines)


def write_outputs(stem: str, payload: dict, tables: str, out_dir: str | os.PathLike | None) -> Path:
    """Write ``<stem>.json`` (everything) and ``<stem>.md`` (the tables) atomically; print where."""
    out = Path(out_dir) if out_dir else RESULTS
    out.mkdir(parents=True, exist_ok=True)
    payload = dict(payload)
    if isinstance(payload.get("args"), dict):  # a committed record names no folder of the machine
        payload["args"] = {k: portable(v) if isinstance(v, str | os.PathLike) else v
                           for k, v in payload["args"].items()}
    payload.setdefault("environment", {}).setdefault(
        "loadavg_end", [round(v, 2) for v in os.getloadavg()])
    env = payload["environment"]
    header = (
        f"<!-- generated by: {env.get('command')} -->\n"
        f"Device {env.get('device')} ({env.get('gpu') or env.get('cpu')}), "
        f"torch {env.get('torch')}, "
        f"{env.get('torch_threads')} torch threads, "
        f"{'allocator ' + env['allocator'] + ', ' if env.get('allocator') else ''}"
        f"load average at start/end "
        f"{env.get('loadavg_start')} / {env.get('loadavg_end')}, {env.get('time')}, "
        f"commit {env.get('git_commit')}"
        f"{' with uncommitted changes' if env.get('git_dirty') else ''}.\n\n"
    )
    for suffix, text in ((".json", json.dumps(payload, indent=1, default=str)),
                         (".md", header + tables + "\n")):
        path = out / f"{stem}{suffix}"
        tmp = path.with_suffix(suffix + ".tmp")
        tmp.write_text(text)
        tmp.replace(path)
    print(f"\nwrote {out / stem}.json and .md")
    return out / f"{stem}.json"


def pct(x: float) -> str:
    """``x`` as a percentage with one decimal."""
    return f"{100 * x:.1f}%"


def r3(x: float) -> str:
    """``x`` with three decimals."""
    return f"{x:.3f}"
