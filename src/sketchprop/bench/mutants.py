"""Mutation check of the test suite (not a benchmark of the library): plant one small bug at a time
and confirm that the tests catch it.

Each mutant names a file, an exact snippet that occurs there once, its replacement, what the bug
is, and the tests expected to catch it (pytest node ids, optionally narrowed by ``-k``). The check
copies ``src/``, ``tests/``, ``configs/``, ``scripts/`` and ``pyproject.toml`` to a temporary
folder, runs the union of the selected tests there once unchanged (they must pass), then for each
mutant writes the mutated file into the copy, runs its tests with ``PYTHONPATH`` pointing at the
copy's ``src``, and restores the file. The working tree is never modified.

It prints a table (mutant, caught, by which tests) and exits non-zero if any mutant survives, a
snippet is no longer found exactly once (the mutant is stale), or the unchanged copy fails.

``scripts/mutation_check.py`` runs it (``make mutants``).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from .common import ROOT

# What the temporary copy holds: everything the tests read.
COPIED = ["src", "tests", "configs", "scripts", "pyproject.toml"]


@dataclass(frozen=True)
class Mutant:
    """One planted bug: where, what it replaces, what it breaks, and the tests that must fail."""

    id: str
    file: str
    old: str | tuple[str, ...]
    new: str | tuple[str, ...]
    what: str
    tests: tuple[str, ...]
    k: str | None = None


SK, FN, LY, PA, GL, VA, AL = ("src/sketchprop/sketches.py", "src/sketchprop/functional.py",
                              "src/sketchprop/layers.py", "src/sketchprop/patching/linear.py",
                              "src/sketchprop/glue/metric.py", "src/sketchprop/variance.py",
                              "src/sketchprop/allocation.py")
UNBIASED = "tests/test_layers.py::test_weight_gradient_unbiased"
FAST_UNBIASED = "tests/test_bench_scripts.py::test_fast_path_unbiased"
SIGNS = "tests/test_variance.py::test_transform_and_random_signs"
IMP = "tests/test_importance.py"

MUTANTS: list[Mutant] = [
    # ------------------------------------------------------------------ each sketch's scale
    Mutant("gaussian-scale", SK,
           "s = s.mul_(1.0 / math.sqrt(k)).to(a.dtype)",
           "s = s.mul_(1.0 / math.sqrt(k + 1)).to(a.dtype)",
           "Gaussian entries N(0, 1/(k+1)): E[S S^T] = k/(k+1) I, 6% low at k = 16",
           (f"{UNBIASED}[gaussian]", f"{FAST_UNBIASED}[gaussian]")),
    Mutant("rademacher-scale", SK,
           "s = (bits * 2 - 1).to(a.dtype).mul_(1.0 / math.sqrt(k))",
           "s = (bits * 2 - 1).to(a.dtype).mul_(1.0 / math.sqrt(k + 1))",
           "Rademacher entries +-1/sqrt(k+1): 6% low at k = 16",
           (f"{UNBIASED}[rademacher]", f"{FAST_UNBIASED}[rademacher]")),
    Mutant("transform-scale", SK,
           "return self.transform_rows(a, rows, d, idx, math.sqrt(n / k)).to(a.dtype)",
           "return self.transform_rows(a, rows, d, idx, math.sqrt(n / (k + 1))).to(a.dtype)",
           "dct/dft sampled rows scaled sqrt(n/(k+1)): 6% low at k = 16",
           (f"{UNBIASED}[dct]", f"{UNBIASED}[dft]", f"{FAST_UNBIASED}[dct]",
            f"{FAST_UNBIASED}[dft]")),
    Mutant("dct-dc-weight", SK,
           "c = torch.where(idx == 0, math.sqrt(1.0 / n), math.sqrt(2.0 / n)) * scale",
           "c = torch.where(idx == 0, math.sqrt(2.0 / n), math.sqrt(2.0 / n)) * scale",
           "DCT's DC row weighted sqrt(2/n) like the others: not orthonormal",
           (f"{SIGNS}[dct-16]", "tests/test_variance.py::test_expected_variance_by_enumeration",
            f"{UNBIASED}[dct]"), k="dct"),
    Mutant("dft-nyquist-weight", SK,
           "(idx >= 1) & (idx <= n_im)), math.sqrt(2.0 / n)",
           "(idx >= 1) & (idx <= n // 2)), math.sqrt(2.0 / n)",
           "DFT's Nyquist row (even n) weighted sqrt(2/n): not orthonormal",
           (f"{SIGNS}[dft-16]", "tests/test_variance.py::test_expected_variance_by_enumeration"),
           k="dft"),
    Mutant("blocksrht-padding-scale", SK,
           ".mul_(math.sqrt(n_pad / k))",
           ".mul_(math.sqrt(n / k))",
           "block SRHT scaled by the rows before padding to whole blocks: low when B % 8 != 0",
           (f"{FAST_UNBIASED}[blocksrht]",
            "tests/test_variance.py::test_expected_variance_matches_monte_carlo[blocksrht]")),
    Mutant("rowsample-scale", SK,
           "return a.index_select(0, src.view(-1)).mul_(math.sqrt(n / k))",
           "return a.index_select(0, src.view(-1)).mul_(math.sqrt(n / (k + 1)))",
           "row sampling scaled sqrt(n/(k+1)): 6% low at k = 16",
           (f"{UNBIASED}[rowsample]", f"{FAST_UNBIASED}[rowsample]")),
    # ------------------------------------------------------------------ each sketch's randomness
    Mutant("signs-dropped", SK,
           "return (bits * 2 - 1).to(dtype)",
           "return (bits * 0 + 1).to(dtype)",
           "no random signs in dct/dft/blocksrht (still unbiased; variance and mixing wrong)",
           (SIGNS, "tests/test_variance.py::test_expected_variance_matches_monte_carlo"),
           k="dct or dft or blocksrht"),
    Mutant("signs-shared", SK,
           "bits = torch.randint(0, 2, (n,), generator=g, device=device, dtype=torch.int8)",
           "bits = torch.randint(0, 2, (1,), generator=g, device=device, dtype=torch.int8)"
           ".expand(n)",
           "one random sign for all rows instead of one per row",
           (SIGNS,)),
    Mutant("rows-first-k", SK,
           "return torch.randperm(n, generator=g, device=device)[:k].sort().values",
           "return torch.arange(k, device=device)",
           "always the first k rows: no row sampling",
           ("tests/test_variance.py::test_row_sampling_is_uniform_without_replacement",
            f"{UNBIASED}[rowsample]", f"{UNBIASED}[dct]")),
    Mutant("rows-never-last", SK,
           "return torch.randperm(n, generator=g, device=device)[:k].sort().values",
           "return torch.randperm(n - 1, generator=g, device=device)[:k].sort().values",
           "the last row is never sampled",
           ("tests/test_variance.py::test_row_sampling_is_uniform_without_replacement",
            f"{UNBIASED}[rowsample]")),
    Mutant("gaussian-seed-ignored", SK,
           "g = _generator(seed, a.device)\n        s = torch.randn(",
           "g = _generator(0, a.device)\n        s = torch.randn(",
           "the Gaussian sketch ignores its seed: the same S on every call",
           ("tests/test_layers.py::test_fresh_sketch_per_call_same_sketch_per_seed[gaussian]",
            "tests/test_bench_scripts.py::test_fast_path_draws_a_new_sketch_per_seed[gaussian]",
            f"{UNBIASED}[gaussian]")),
    Mutant("rademacher-zero-one", SK,
           "s = (bits * 2 - 1).to(a.dtype)",
           "s = bits.to(a.dtype)",
           "Rademacher entries 0/1 instead of -1/+1",
           (f"{UNBIASED}[rademacher]", f"{FAST_UNBIASED}[rademacher]")),
    # ------------------------------------------------------------------ dX and db
    Mutant("dx-scaled", FN,
           "dx = (dy2 @ weight).reshape(ctx.x_shape)",
           "dx = (dy2 @ weight).reshape(ctx.x_shape) * 1.01",
           "input gradient 1% off",
           ("tests/test_layers.py::test_forward_dx_db_exact",
            "tests/test_layers.py::test_non_contiguous_input")),
    Mutant("db-drops-a-row", FN,
           "db = dy2.sum(0)",
           "db = dy2[1:].sum(0)",
           "bias gradient leaves out the first row",
           ("tests/test_layers.py::test_forward_dx_db_exact",)),
    # ------------------------------------------------------------------ patching filters
    Mutant("targets-anchored", PA,
           "(inc is None or inc.search(name))",
           "(inc is None or inc.match(name))",
           "targets matched at the start of the name only",
           ("tests/test_patching.py::test_targets_regex",)),
    Mutant("targets-ignored", PA,
           "(inc is None or inc.search(name))",
           "(inc is None or True)",
           "targets ignored: every nn.Linear patched",
           ("tests/test_patching.py::test_targets_regex",)),
    Mutant("exclude-anchored", PA,
           "and not (exc is not None and exc.search(name))",
           "and not (exc is not None and exc.match(name))",
           "exclude matched at the start of the name only",
           ("tests/test_patching.py::test_exclude_regex_is_searched_anywhere_in_the_name",)),
    Mutant("exclude-ignored", PA,
           "and not (exc is not None and exc.search(name))",
           "and not (exc is not None and False)",
           "exclude ignored",
           ("tests/test_patching.py::test_patches_every_linear_with_head_unless_excluded",
            "tests/test_patching.py::test_exclude_regex_is_searched_anywhere_in_the_name")),
    # ------------------------------------------------------------------ Conv1D, lm_head
    Mutant("conv1d-restored-as-linear", LY,
           "                conv = Conv1D(self.nf, self.nx)",
           "                conv = nn.Linear(self.nx, self.nf)",
           "unpatch puts an nn.Linear holding the (in, out) weight in place of a Conv1D",
           ("tests/test_layers.py::test_extra_repr_shared_parameters_and_back[conv1d]",
            "tests/test_patching.py::test_gpt2_conv1d_layers_patched_lm_head_left_exact_and_tied")),
    Mutant("lm-head-patched", PA,
           'DEFAULT_EXCLUDE = r"(^|\\.)lm_head(\\.|$)"',
           "DEFAULT_EXCLUDE = None",
           "the default patches a language model's lm_head (tied to the input embedding)",
           ("tests/test_patching.py::test_gpt2_conv1d_layers_patched_lm_head_left_exact_and_tied",
            "tests/test_architectures.py::test_every_family_and_a_conv_net")),
    Mutant("lm-head-unpatched-by-resize", PA,
           "    _swap(model, back)\n    return out",
           "    return out",
           "resize_token_embeddings leaves the plain nn.Linear transformers made in a patched "
           "output layer's place",
           ("tests/test_stacks.py::test_resize_token_embeddings_keeps_a_patched_output_layer_patched",)),
    # ------------------------------------------------------------------ peft
    Mutant("mask-hook-on-peft-wrapper", PA,
           "    holder = model if owner is None else owner",
           "    holder = model",
           "the mask hook stays on a peft model: the model merge_and_unload returns reads a stale mask",
           ("tests/test_peft.py::test_a_model_merged_after_patching_reads_its_own_padding",)),
    # ------------------------------------------------------------------ distributed wrappers
    Mutant("dtensor-parameters-unseen", "src/sketchprop/wrappers.py",
           "any(isinstance(p, dtensor) for p in module.parameters())",
           "False",
           "a module whose parameters fully_shard sharded (not itself an FSDP module) is swapped: "
           "it keeps the sharded DTensors and fails in DTensor code",
           ("tests/test_stacks.py::test_patching_a_sharded_model_refuses_before_changing_it",),
           k="fsdp2"),
    Mutant("ddp-wrapper-patched", "src/sketchprop/wrappers.py",
           "        model = model.module\n",
           "        break\n",
           "a DDP wrapper is patched itself: names gain 'module.', the transformers parts are left",
           ("tests/test_stacks.py::test_sharded_exact_configurations_give_one_process_gradients",),
           k="ddp"),
    # ------------------------------------------------------------------ padding rows
    Mutant("encoder-mask-on-decoder", LY,
           "                mask = None\n        context.set_mask(mask)",
           "                pass\n        context.set_mask(mask)",
           "an encoder-decoder's mask also skips decoder rows when both sequences are as long",
           ("tests/test_patching.py::test_t5_skip_padding_exact_sketch_gives_exact_gradient",)),
    Mutant("skip-padding-ignored", LY,
           "rows = self.context.rows_for(x, self.name) if (self.skip_padding and self.context) else None",
           "rows = None",
           "skip_padding has no effect: the sketch covers padding rows",
           ("tests/test_patching.py::test_skip_padding_sketch_covers_only_real_rows",
            "tests/test_patching.py::test_skip_padding_ignores_what_padding_rows_hold",
            "tests/test_patching.py::test_skip_padding_exact_sketch_gives_exact_gradient_and_"
            "fewer_rows")),
    Mutant("padding-mask-inverted", LY,
           "rows = mask.reshape(-1).nonzero().squeeze(1)",
           "rows = (mask.reshape(-1) == 0).nonzero().squeeze(1)",
           "the padding rows are kept and the real rows skipped",
           ("tests/test_patching.py::test_skip_padding_exact_sketch_gives_exact_gradient_and_"
            "fewer_rows",
            "tests/test_patching.py::test_skip_padding_sketch_covers_only_real_rows")),
    Mutant("gaussian-ignores-rows", SK,
           "a = _take(a, rows)\n        g = _generator(seed, a.device)\n        s = torch.randn(",
           "g = _generator(seed, a.device)\n        s = torch.randn(",
           "the Gaussian sketch ignores the rows index (mixes padding rows in)",
           ("tests/test_patching.py::test_skip_padding_ignores_what_padding_rows_hold[gaussian]",
            "tests/test_patching.py::test_skip_padding_sketch_covers_only_real_rows",
            "tests/test_bench_scripts.py::test_fast_path_is_one_linear_map"),
           k="gaussian or covers_only_real_rows"),
    # ------------------------------------------------------------------ GLUE metrics
    Mutant("matthews-shifted", GL,
           '"matthews": lambda: matthews_corrcoef(labels, preds),',
           '"matthews": lambda: matthews_corrcoef(labels, np.roll(preds, 1)),',
           "MCC of predictions shifted by one example",
           ("tests/test_metrics.py::test_matthews_cola",
            "tests/test_metrics.py::test_cola_run_reports_the_mcc_of_its_predictions")),
    Mutant("accuracy-shifted", GL,
           '"accuracy": lambda: accuracy_score(labels, preds),',
           '"accuracy": lambda: accuracy_score(labels, np.roll(preds, 1)),',
           "accuracy of predictions shifted by one example",
           ("tests/test_metrics.py::test_accuracy_and_f1",
            "tests/test_metrics.py::test_accuracy_binary_tasks",
            "tests/test_metrics.py::test_accuracy_three_classes_mnli")),
    Mutant("f1-class-swap", GL,
           '"f1": lambda: f1_score(labels, preds),',
           '"f1": lambda: f1_score(labels, preds, pos_label=0),',
           "F1 of the negative class",
           ("tests/test_metrics.py::test_accuracy_and_f1",)),
    Mutant("argmax-thresholded", GL,
           "preds = predictions.argmax(-1) if predictions.ndim > 1 else predictions",
           "preds = (predictions[:, 1] > 0).astype(int) if predictions.ndim > 1 else predictions",
           "class-1 logit thresholded at 0 instead of the argmax",
           ("tests/test_metrics.py::test_matthews_cola", "tests/test_metrics.py::test_accuracy_and_f1",
            "tests/test_metrics.py::test_accuracy_three_classes_mnli")),
    Mutant("pearson-thresholded", GL,
           '"pearson": lambda: pearsonr(preds, labels)[0],',
           '"pearson": lambda: pearsonr(np.round(preds), labels)[0],',
           "Pearson of rounded scores",
           ("tests/test_metrics.py::test_regression_hand_values",)),
    Mutant("spearman-is-pearson", GL,
           '"spearman": lambda: spearmanr(preds, labels)[0],',
           '"spearman": lambda: pearsonr(preds, labels)[0],',
           "Spearman computed as Pearson",
           ("tests/test_metrics.py::test_regression_hand_values",)),
    Mutant("spearman-shifted", GL,
           '"spearman": lambda: spearmanr(preds, labels)[0],',
           '"spearman": lambda: spearmanr(np.roll(preds, 1), labels)[0],',
           "Spearman of scores shifted by one example",
           ("tests/test_metrics.py::test_regression_hand_values",)),
    # ------------------------------------------------------------------ variance bookkeeping
    Mutant("ratio-swapped", VA,
           "return b_proj / (b - 1) * d2_rmm_value / d2_sgd_value",
           "return b_proj / (b - 1) * d2_sgd_value / d2_rmm_value",
           "normalized_ratio with D2_RMM and D2_SGD swapped",
           ("tests/test_variance.py::test_d2_rmm_alpha_and_ratio_on_a_hand_example",)),
    # ------------------------------------------------------------------ importance sampling
    Mutant("importance-no-floor", SK,
           "(1 - self.floor) * s / total + self.floor * uniform, uniform)",
           "s / total, uniform)",
           "no uniform floor: rows the estimate scores zero are never drawn",
           (f"{IMP}::test_every_row_can_be_drawn_whatever_the_estimate",)),
    Mutant("importance-scale-m", SK,
           "(m * p.index_select(0, drawn)).rsqrt()]).float()",
           "((m + 1) * p.index_select(0, drawn)).rsqrt()]).float()",
           "drawn rows scaled 1/sqrt((m+1) p): the drawn part is m/(m+1) low",
           (f"{IMP}::test_unbiased_with_an_estimate_learned_on_another_pattern",
            f"{UNBIASED}[importance]")),
    Mutant("importance-top-in-draws", SK,
           "in_rest[top] = False",
           "in_rest[top] = True",
           "the top set can also be drawn: its rows are counted twice",
           (f"{IMP}::test_every_row_can_be_drawn_whatever_the_estimate",
            f"{UNBIASED}[importance]")),
    Mutant("importance-backward-own-plan", FN,
           "sdy = ImportancePlan(index, scale, ntop).apply(dy2)",
           "sdy = ImportancePlan(index.flip(0), scale, ntop).apply(dy2)",
           "backward pairs the scales with other rows than forward did",
           (f"{IMP}::test_unbiased_with_an_estimate_learned_on_another_pattern",)),
    Mutant("importance-position-modulo", SK,
           "return (r % t if t > 1 else torch.zeros_like(r)), t",
           "return (r // t if t > 1 else torch.zeros_like(r)), t",
           "a row's position taken as its example: the estimate cannot learn [CLS]",
           (f"{IMP}::test_cls_only_gradient_is_learned",)),
    Mutant("importance-online-rest", VA,
           "return total + ((total if rest is None else rest) - m * diag) / (m - 1)",
           "return total + (total - m * diag) / (m - 1)",
           "online |X^T Y|^2 estimate ignores the top set (the i.i.d. formula on all of dW)",
           (f"{IMP}::test_variance_formula_and_online_estimator",)),
    Mutant("allocation-budget", AL,
           "lo, hi = (mid, hi) if spend(mid) < budget else (lo, mid)",
           "lo, hi = (mid, hi) if spend(mid) < 1.1 * budget else (lo, mid)",
           "the allocation spends 10% more rows than the uniform rates",
           (f"{IMP}::test_allocation_keeps_the_byte_total_and_moves_rows",)),
    Mutant("allocation-groups-split", LY,
           "self.allocation.share(self.name, owner.name)",
           "pass",
           "layers that share a sketch are allocated apart (and stop sharing it)",
           (f"{IMP}::test_allocation_moves_shared_sketches_together",)),
]

# ---------------------------------------------------------------------------------------------
# Run identity (src/sketchprop/glue/runs.py): mutants of how a run is named, filed and found again.
RU = "src/sketchprop/glue/runs.py"
IDENT = "tests/test_pipeline.py::test_identity_covers_every_setting_that_changes_the_result"
RUN_IDENTITY: list[Mutant] = [
    Mutant("identity-drops-train-key", RU,
           'NOT_RESULT_TRAIN_KEYS = ("seed", "logging_steps", "checkpoint", "resume")',
           'NOT_RESULT_TRAIN_KEYS = ("seed", "logging_steps", "checkpoint", "resume", "max_steps")',
           "max_steps left out of the identity: a short check run stands in for the full run",
           (IDENT, "tests/test_pipeline.py::test_a_short_run_never_stands_in_for_the_full_run"),
           k="max_steps or short_run"),
    Mutant("identity-ignores-adapter", RU,
           '        "adapter": adapter,\n',
           "",
           "the adapter left out of the identity: LoRA runs of two ranks share one file",
           ("tests/test_pipeline.py::test_identity_covers_every_adapter_key",)),
    Mutant("identity-ignores-data-limits", RU,
           'limits = {k: config["data"].get(k) for k in ("max_train_samples", "max_eval_samples")}',
           "limits = {}",
           "the data limits left out of the identity",
           (IDENT,), k="max_train_samples or max_eval_samples"),
    Mutant("identity-ignores-data-content", RU,
           'digest.update((Path(glue_dir) / task_dir / name).read_bytes())',
           "pass",
           "the data hash covers file names, not their content",
           ("tests/test_pipeline.py::test_identity_follows_the_data_files_not_their_folder",)),
    Mutant("recipe-hash-includes-seed", RU,
           'recipe = {k: v for k, v in ident.items() if k != "seed"}',
           "recipe = dict(ident)",
           "the recipe hash changes with the seed (seeds no longer aggregate)",
           ("tests/test_runs.py::test_recipe_hash_ignores_the_seed_only",)),
    Mutant("done-ignores-identity", RU,
           'if before.get("identity") != self.ident:',
           "if False:",
           "a filed result of another run under the same name is taken as done",
           ("tests/test_pipeline.py::test_a_file_of_another_run_under_the_same_name_is_refused",)),
    Mutant("keep-ignored", RU,
           "root = Path(results_dir if keep else scratch_results_dir)",
           "root = Path(results_dir)",
           "runs not kept are filed in the tracked results folder",
           ("tests/test_pipeline.py::test_runs_not_kept_leave_the_tracked_results_alone",)),
    Mutant("resume-takes-incomplete", RU,
           "        if _complete(path):\n            return path, passed",
           "        if True:\n            return path, passed",
           "resume from the newest checkpoint even if it is incomplete",
           ("tests/test_pipeline.py::test_resume_passes_over_an_incomplete_checkpoint",)),
    Mutant("claim-ignores-holder", RU,
           "            if why is None:\n                raise Claimed(",
           "            if False:\n                raise Claimed(",
           "a live claim is taken over: two runs of one identity train at once",
           ("tests/test_claims.py::test_a_claim_is_exclusive_and_released",
            "tests/test_claims.py::test_overwrite_does_not_break_a_live_claim",
            "tests/test_claims.py::test_two_concurrent_runs_one_trains_the_other_refuses")),
    Mutant("claim-never-abandoned", RU,
           "        if info[\"age\"] > self.stale:",
           "        if False:",
           "a claim whose heartbeat stopped is never taken over",
           ("tests/test_claims.py::test_a_claim_from_another_host_is_abandoned_by_its_heartbeat_age",)),
    Mutant("claim-kept-after-run", RU,
           "        if self._mine():\n            self.path.unlink(missing_ok=True)",
           "        pass",
           "a finished or interrupted run leaves its claim behind",
           ("tests/test_claims.py::test_a_claim_is_exclusive_and_released",
            "tests/test_claims.py::test_two_concurrent_runs_one_trains_the_other_refuses")),
    Mutant("seed-on-context", FN,
           ('saved.append(seed_tensor(seed) if needs_seed else None)',
            "seed = 0 if seed is None else int(seed)"),
           ('saved.append(None)\n        ctx.seed_int = int(seed)',
            "seed = ctx.seed_int"),
           "the seed kept on the autograd context: checkpointing pairs two different sketches",
           ("tests/test_checkpointing.py::test_weight_gradient_unbiased_under_checkpointing",)),
]
# ---------------------------------------------------------------------------------------------

MUTANTS += RUN_IDENTITY


def copy_tree(dst: Path) -> None:
    """Copy what the tests need (:data:`COPIED`) into ``dst``."""
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", ".pytest_cache")
    for name in COPIED:
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(src, dst / name, ignore=ignore)
        else:
            shutil.copy2(src, dst / name)


def pytest_args(mutant: Mutant) -> list[str]:
    """The mutant's tests as pytest arguments."""
    return [*mutant.tests, *(["-k", mutant.k] if mutant.k else [])]


def run_pytest(copy: Path, args: list[str], timeout: int) -> tuple[int, list[str], str]:
    """``(return code, failed node ids, output tail)`` of pytest in ``copy``."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(copy / "src"), env.get("PYTHONPATH")]))
    env.setdefault("OMP_NUM_THREADS", "1")
    env.update({"HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline", "TOKENIZERS_PARALLELISM": "false"})
    cmd = [sys.executable, "-m", "pytest", "-q", "-rf", "-p", "no:cacheprovider", *args]
    try:
        proc = subprocess.run(cmd, cwd=copy, env=env, capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired:
        return -1, [], f"timed out after {timeout} s"
    out = proc.stdout + proc.stderr
    failed = re.findall(r"^FAILED (\S+)", out, flags=re.MULTILINE)
    return proc.returncode, failed, out[-3000:]


def check_import(copy: Path) -> None:
    """Refuse to go on unless the copy imports its own ``sketchprop``."""
    env = {**os.environ, "PYTHONPATH": str(copy / "src")}
    where = subprocess.run([sys.executable, "-c", "import sketchprop; print(sketchprop.__file__)"],
                           cwd=copy, env=env, capture_output=True, text=True, check=True).stdout
    if not Path(where.strip()).resolve().is_relative_to(copy.resolve()):
        raise SystemExit(f"the copy imports sketchprop from {where.strip()}, not from {copy}")


def catchers(failed: list[str]) -> str:
    """Failed node ids, the cases of one parametrized test folded into a count."""
    cases: dict[str, list[str]] = {}
    for node in failed:
        node = node.removeprefix("tests/")
        cases.setdefault(node.split("[")[0], []).append(node)
    out = []
    for base, nodes in cases.items():
        out.append(nodes[0] if len(nodes) == 1 else f"{base} ({len(nodes)} cases)")
    return ", ".join(out)


def run(args) -> int:
    """The check as ``scripts/mutation_check.py`` runs it (its options in ``args``: ``only``,
    ``list``, ``timeout``): the exit status, 1 if a mutant survived or went stale."""
    ids = [m.id for m in MUTANTS]
    if len(set(ids)) != len(ids):
        raise SystemExit("mutant ids are not unique")
    chosen = MUTANTS
    if args.only:
        unknown = sorted(set(args.only) - set(ids))
        if unknown:
            raise SystemExit(f"unknown mutants {unknown}; see --list")
        chosen = [m for m in MUTANTS if m.id in args.only]
    if args.list:
        for m in chosen:
            print(f"{m.id:26s} {m.file:30s} {m.what}")
        return 0

    start = time.time()
    rows, bad = [], 0
    with tempfile.TemporaryDirectory(prefix="mutants-") as tmp:
        copy = Path(tmp)
        copy_tree(copy)
        check_import(copy)

        # The selected tests must pass on the unchanged copy, or a failure would mean nothing.
        baseline = sorted({t for m in chosen for t in m.tests})
        code, failed, tail = run_pytest(copy, baseline, args.timeout * 2)
        if code != 0:
            print(tail)
            print(f"the unchanged copy fails the selected tests (exit {code}): {failed}")
            return 1
        print(f"baseline: {len(baseline)} selections pass unchanged ({time.time() - start:.0f} s)",
              flush=True)

        for m in chosen:
            path = copy / m.file
            original = path.read_text()
            # A mutant is one snippet, or several planted together (a tuple of each).
            olds, news = ((m.old,), (m.new,)) if isinstance(m.old, str) else (m.old, m.new)
            counts = [original.count(o) for o in olds]
            if counts != [1] * len(olds):
                rows.append((m, "stale", f"snippets found {counts} times in {m.file}"))
                bad += 1
                continue
            t0 = time.time()
            mutated = original
            for o, n in zip(olds, news, strict=True):
                mutated = mutated.replace(o, n)
            path.write_text(mutated)
            try:
                code, failed, tail = run_pytest(copy, pytest_args(m), args.timeout)
            finally:
                path.write_text(original)
            if code == 1 and failed:
                rows.append((m, "yes", catchers(failed)))
            else:
                status = "no" if code == 0 else f"error (exit {code})"
                rows.append((m, status, tail.strip().splitlines()[-1] if tail.strip() else ""))
                bad += 1
            print(f"{m.id}: {rows[-1][1]} ({time.time() - t0:.0f} s)", flush=True)

    print()
    print("| mutant | file | what | caught | by |")
    print("|---|---|---|---|---|")
    for m, status, by in rows:
        print(f"| {m.id} | {m.file.removeprefix('src/sketchprop/')} | {m.what} | {status} | {by} |")
    print(f"\n{len(rows) - bad} of {len(rows)} mutants caught in {time.time() - start:.0f} s")
    return 1 if bad else 0
