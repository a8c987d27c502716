"""The training stacks users put a patched model into, in more than one process: every rank draws
its own random bits (sketches, the GELU code's rounding), whatever ran before the process group
existed."""

import json
import socket
import subprocess
import sys
import textwrap

import pytest

RANK_SCRIPT = textwrap.dedent("""
    import json, sys
    import torch
    import torch.distributed as dist
    from torch import nn
    from sketchprop import patch_activations, patch_linear

    rank, port, part, out = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
    torch.manual_seed(0)  # the same weights and input on both ranks
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8))
    if part == "sketch":
        patch_linear(model, sketch="gaussian", rho=0.25, min_rows=1)
    elif part == "exact":
        patch_linear(model, sketch="exact")
    else:
        patch_activations(model, gelu_bits=2)
    x = torch.randn(64, 16)
    model(x).square().sum().backward()  # a sanity step before the process group exists
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    model.zero_grad()
    model(x).square().sum().backward()
    grads = torch.cat([p.grad.flatten() for p in model.parameters()])
    both = [torch.empty_like(grads) for _ in range(2)]
    dist.all_gather(both, grads)
    if rank == 0:
        json.dump({"equal": torch.equal(both[0], both[1])}, open(out, "w"))
    dist.destroy_process_group()
""")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("part, equal", [("sketch", False), ("gelu", False), ("exact", True)])
def test_each_rank_draws_its_own_bits_after_a_step_before_the_group(tmp_path, part, equal):
    """Two gloo processes, same weights and input, one step before ``init_process_group``: the
    gradients after it differ between the ranks where bits are drawn (a sketch, the stochastic
    GELU code) and are equal where none are (the exact sketch), so the difference is the bits."""
    port, out = str(_free_port()), tmp_path / "out.json"
    procs = [subprocess.Popen([sys.executable, "-c", RANK_SCRIPT, str(rank), port, part, str(out)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for rank in (0, 1)]
    logs = [p.communicate(timeout=120)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(logs)[-3000:]
    assert json.loads(out.read_text())["equal"] is equal
