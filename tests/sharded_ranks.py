"""One rank of ``tests/test_stacks.py``'s sharded and replicated training (FSDP2, FSDP1, DDP), run
as ``python sharded_ranks.py RANK PORT OUT CASES`` in two processes (gloo, CPU).

Each case (stack, order, model, patch) wraps and patches a tiny model in that order (``before``:
patch, then wrap; ``after``: wrap, then patch; ``unpatch``: patch, wrap, then the inverse), trains
three SGD steps on this rank's half of a global batch, and compares with one process training the
plain model on the whole batch. Rank 0 writes what it found to OUT (JSON, one entry per case):
the refusal and whether the model was left as it was, or the gradients' and parameters'
distance to the one process (largest ``|a - b| / (ATOL + RTOL |b|)``: at most 1 is
``torch.allclose``), the losses, whether the parameters changed and are the same on both ranks,
and whether the patch returned the names it returns on the plain model.
"""

import copy
import json
import math
import sys

import torch
import torch.distributed as dist
import transformers as tf
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from sketchprop import patch_activations, patch_linear, unpatch_activations, unpatch_linear

RTOL, ATOL, LR, STEPS = 1e-4, 1e-6, 0.1, 3

PATCHES = {
    "linear-exact": lambda m: patch_linear(m, sketch="exact"),
    "compact-exact": lambda m: patch_activations(m, gelu_bits=None),
    "compact-exact-stored-layernorm": lambda m: patch_activations(m, gelu_bits=None,
                                                                  layernorm="stored"),
    "decoders": lambda m: patch_activations(m, attention="recompute"),
    "sketch": lambda m: patch_linear(m, sketch="gaussian", rho=0.5, min_rows=1),
    "bits": lambda m: patch_linear(m, sketch="exact", bits=4),
    "compact": lambda m: patch_activations(m),
    "sketch-bits-compact": lambda m: patch_linear(m, sketch="gaussian", rho=0.5, bits=4, min_rows=1)
    + patch_activations(m),
    "floor": lambda m: patch_activations(m, dropout="stored", attention="stored", gelu_bits=None,
                                         layernorm="stored", mlp="stored", rmsnorm="stored",
                                         lm_loss="stored", floor_bits=4),
    "bits-lean-floor": lambda m: patch_linear(m, sketch="exact", bits=4)
    + patch_activations(m, preset="lean", floor_bits=4),
}


def build(arch: str):
    torch.manual_seed(0)
    if arch == "roberta":  # no dropout: the seeded masks are not nn.Dropout's
        return tf.RobertaForSequenceClassification(tf.RobertaConfig(
            vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
            intermediate_size=64, max_position_embeddings=40, num_labels=2, pad_token_id=1,
            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))
    return tf.LlamaForCausalLM(tf.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32, pad_token_id=0,
        bos_token_id=1, eos_token_id=2))


def batch(arch: str, step: int) -> dict:
    """Four rows, padded alike in each half: each rank's mean loss weighs as many tokens."""
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(3, 64, (4, 12), generator=g)
    mask = torch.ones_like(ids)
    mask[1::2, 8:] = 0
    labels = torch.tensor([0, 1, 1, 0]) if arch == "roberta" else ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def wrap(model, stack: str, mesh):
    if stack == "fsdp2":
        blocks = model.model.layers if hasattr(model, "model") else model.roberta.encoder.layer
        for block in blocks:
            fully_shard(block, mesh=mesh)
        return fully_shard(model, mesh=mesh)
    if stack == "ddp":
        return DistributedDataParallel(model)
    # fsdp1: use_orig_params=True lets the gradients be gathered; fsdp1-flat, the default, not.
    return FullyShardedDataParallel(model, device_id=torch.device("cpu"),
                                    use_orig_params=stack == "fsdp1")


def full(model, grads: bool = False) -> list:
    """The whole parameters (or their gradients) of the wrapped model, on every rank."""
    if isinstance(model, FullyShardedDataParallel):
        with FullyShardedDataParallel.summon_full_params(model, with_grads=grads):
            return [(p.grad if grads else p).detach().clone() for p in model.parameters()]
    tensors = [p.grad if grads else p.detach() for p in model.parameters()]
    return [t.full_tensor() if isinstance(t, DTensor) else t.clone() for t in tensors]


@torch.no_grad()
def distance(ours: list, ref: list) -> float:
    return max(((a - b).abs() / (ATOL + RTOL * b.abs())).max().item()
               for a, b in zip(ours, ref, strict=True))


def state(model) -> list:
    """What a patch call changes: the module types and the attributes it sets."""
    return [(type(m), sorted(k for k in vars(m) if k.startswith("_sketchprop")))
            for m in model.modules()]


def run(stack: str, order: str, arch: str, patch: str, rank: int, mesh) -> dict:
    model, plain = build(arch).train(), build(arch).train()
    names = PATCHES[patch](copy.deepcopy(plain))
    if order != "after":
        PATCHES[patch](model)
    model = wrap(model, stack, mesh)
    if order != "before":
        before = state(model)
        try:
            if order == "unpatch":
                (unpatch_linear if patch in ("linear-exact", "sketch", "bits") else
                 unpatch_activations)(model)
            else:
                got = PATCHES[patch](model)
        except (ValueError, RuntimeError) as err:
            return {"refused": str(err), "untouched": state(model) == before}
        if order == "unpatch":
            return {"refused": None}
    else:
        got = names
    out = {"refused": None, "names": got == names, "losses": [], "grads": 0.0, "params": 0.0}
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    plain_opt = torch.optim.SGD(plain.parameters(), lr=LR)
    start = full(model)
    for step in range(STEPS):
        b = batch(arch, step)
        loss = model(**{k: v.chunk(2)[rank] for k, v in b.items()}).loss
        loss.backward()
        plain(**b).loss.backward()
        out["losses"].append(loss.item())
        if stack != "fsdp1-flat":  # its gradients cannot be gathered; its parameters are compared
            ref = [p.grad for p in plain.parameters()]
            out["grads"] = max(out["grads"], distance(full(model, grads=True), ref))
        for o in (opt, plain_opt):
            o.step()
            o.zero_grad()
        out["params"] = max(out["params"], distance(full(model), list(plain.parameters())))
    params = full(model)
    flat = torch.cat([p.flatten() for p in params])
    both = [torch.empty_like(flat) for _ in range(2)]
    dist.all_gather(both, flat)
    out.update(finite=all(map(math.isfinite, out["losses"])), synced=torch.equal(*both),
               changed=any(not torch.equal(a, b) for a, b in zip(start, params, strict=True)))
    return out


def main():
    rank, port, path, cases = int(sys.argv[1]), sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    mesh = init_device_mesh("cpu", (2,))
    results = []
    for case in cases:
        results.append(run(*case, rank, mesh))
        dist.barrier()
    if rank == 0:
        with open(path, "w") as f:
            json.dump(results, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
