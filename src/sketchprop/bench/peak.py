"""Peak memory of training steps, each measured in a fresh process: the process's resident-size
readings (Linux ``/proc``, else ``getrusage``) and the runner that starts a child process and reads
back its result.

A child is ``python -m <module> <request JSON>``; the module ends with
``if __name__ == "__main__": child_main(<its measuring function>)``, which prints ``RESULT <JSON>``.
CUDA needs none of this: the allocator's peak can be reset within one process.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import sketchprop


def reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS mark (VmHWM) of this process; False where Linux lacks it."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def vm_hwm() -> int | None:
    """The process's peak resident size since the last :func:`reset_peak_rss` (None off Linux)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def peak_rss() -> int:
    """The process's peak resident size since it started."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)


def current_rss() -> int:
    """The process's resident size now (its peak where ``/proc`` is missing)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return peak_rss()


def run_child(module: str, request: dict, what: str, timeout: int = 1800) -> dict:
    """Run ``python -m module <request>`` in a fresh process and return its ``RESULT`` JSON."""
    cmd = [sys.executable, "-m", module, json.dumps(request)]
    env = dict(os.environ)
    # The child imports this same sketchprop (a checkout's src/, or site-packages).
    here = str(Path(sketchprop.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [here, env.get("PYTHONPATH")]))
    # glibc: blocks of 64 KiB and more come from mmap and go back to the system when freed, so the
    # peak RSS follows the peak of live tensors instead of the allocator's high-water mark.
    env.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")
    env.setdefault("MALLOC_TRIM_THRESHOLD_", "0")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise RuntimeError(f"memory child failed for {what}:\n{proc.stderr[-3000:]}")


def child_main(measure: Callable[[dict], dict]) -> None:
    """The child's side: ``measure`` the request given as the first argument, print its result."""
    print("RESULT " + json.dumps(measure(json.loads(sys.argv[1]))))
