"""Fine-tune a GLUE task with sketched linear layers: ``python -m sketchprop.train [overrides]``.

    python -m sketchprop.train task=cola model=roberta-base method=gaussian method.rho=0.1
    python -m sketchprop.train -m method.rho=0.5,0.2,0.1 task=cola,mrpc      # a sweep

This module is the training run itself; what identifies a run, where its result is filed, when it is
skipped or resumed, and what a sweep reports are in :mod:`sketchprop.glue.runs`. Under ``torchrun``
every rank trains and only rank 0 writes files.

Everything that can fail cheaply (config values, an existing result, missing data, an unreachable
hub) is checked before the first heavy import.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import shlex
import shutil
import signal
import sys
import time
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from . import data as glue
from . import paths, runs
from .config import CONFIG_DIR, REPO_ROOT, Config, ConfigError, _run_id, validate
from .model import model_and_data, patch
from .setup import check_sources

log = logging.getLogger(__name__)

__all__ = ["main", "run", "run_files"]

RunError = runs.RunError  # raised by run() as well as by the bookkeeping

#: Set by the SIGTERM handler. The handler also raises KeyboardInterrupt at once, but code that
#: catches every exception (some libraries do, around optional imports) can swallow that; the
#: trainer callback checks this flag at every step, so a SIGTERM always stops the run.
_TERMINATED: list[int] = []


# ---------------------------------------------------------------------------------------------
# Names


def _experiment(conf: Config) -> str:
    if conf.experiment_name:
        return conf.experiment_name
    if HydraConfig.initialized():
        return HydraConfig.get().runtime.choices.get("experiment") or "default"
    return "default"


def _sketch_rho(conf: Config) -> tuple[str, float]:
    sketch = conf.method.sketch.value
    return (sketch, 1.0) if sketch == "exact" else (sketch, float(conf.method.rho))


def _world_size() -> int:
    """Processes in this run (torchrun sets WORLD_SIZE); known before torch is imported."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def run_files(conf: Config, cfg: DictConfig, glue_dir: Path | None) -> runs.RunFiles:
    """The run's identity and where its files go (see :mod:`sketchprop.glue.runs`)."""
    config = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
    data = runs.data_source(glue_dir, conf.task.dir, glue.task_files(conf.task), glue.HUB_DATASET)
    ident = runs.identity(config, data, _world_size())
    return runs.RunFiles.of(ident, _experiment(conf), conf.results_dir, conf.scratch_results_dir,
                            conf.checkpoints_dir, conf.keep, conf.model.name)


# ---------------------------------------------------------------------------------------------
# Checks before any heavy work


def _hardware(device) -> str:
    """What the numbers ran on: the GPU name, or the CPU model and the torch thread count."""
    import torch

    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    model = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{model}, {os.cpu_count()} cores, {torch.get_num_threads()} torch threads"


# ---------------------------------------------------------------------------------------------
# Model


# ---------------------------------------------------------------------------------------------
# Trainer pieces


def _history_callback():
    from transformers import TrainerCallback

    class EpochLogs(TrainerCallback):
        """Log at every epoch end, so the per-epoch train loss can be read from the log history;
        stop on a non-finite loss, or after SIGTERM. Remembers the token count at which this
        process started training (a resumed run counts only its own tokens)."""

        tokens_at_start = 0

        def on_train_begin(self, args, state, control, **kwargs):
            self.tokens_at_start = state.num_input_tokens_seen

        def on_epoch_end(self, args, state, control, **kwargs):
            control.should_log = True

        def on_step_end(self, args, state, control, **kwargs):
            if _TERMINATED:
                raise KeyboardInterrupt(f"signal {_TERMINATED[0]}")

        def on_log(self, args, state, control, logs=None, **kwargs):
            loss = (logs or {}).get("loss")
            if loss is not None and not math.isfinite(loss):
                raise FloatingPointError(
                    f"training loss is {loss} at step {state.global_step} (epoch "
                    f"{state.epoch:.2f}); the run stops here and writes no result. Try a lower "
                    f"train.learning_rate or train.precision=fp32")

    return EpochLogs()


def _history(log_history: list[dict], conf: Config) -> list[dict]:
    """Per evaluation (each epoch end): the dev metrics, named as in the paper, and the mean
    training loss since the previous evaluation."""
    evals: dict[int, dict] = {}
    losses: list[tuple[int, float, int]] = []  # (step, loss, steps it averages)
    last_step = 0
    for entry in log_history:
        step = entry["step"]
        if "loss" in entry:
            losses.append((step, entry["loss"], step - last_step))
            last_step = step
        for dev in conf.task.dev:
            prefix = f"eval_{dev.split}_"
            for metric in conf.task.metrics:
                key = prefix + metric.value
                if key in entry:
                    record = evals.setdefault(step, {"epoch": round(entry["epoch"], 4),
                                                     "step": step})
                    record[metric.value + dev.suffix] = entry[key]
            if prefix + "loss" in entry:
                record = evals.setdefault(step, {"epoch": round(entry["epoch"], 4), "step": step})
                record["eval_loss" + dev.suffix] = entry[prefix + "loss"]
    history, previous = [], 0
    for step in sorted(evals):
        window = [(loss, n) for s, loss, n in losses if previous < s <= step]
        total = sum(n for _, n in window)
        evals[step]["train_loss"] = sum(loss * n for loss, n in window) / total if total else None
        history.append(evals[step])
        previous = step
    return history


def _with_memory_log(trainer_class):
    """``trainer_class`` whose every training log entry carries the peak memory so far
    (``memory/peak_bytes``: CUDA allocator peak, or the process peak RSS on CPU), so the logger
    (wandb) plots memory beside the loss."""
    from ..measure import peak_memory_bytes

    class MemoryLoggingTrainer(trainer_class):
        def log(self, logs, *args, **kwargs):
            if "loss" in logs:
                logs = {**logs, "memory/peak_bytes": peak_memory_bytes(self.args.device)}
            return super().log(logs, *args, **kwargs)

    return MemoryLoggingTrainer


def _metric_names(conf: Config) -> list[str]:
    return [m.value + d.suffix for d in conf.task.dev for m in conf.task.metrics]


def _saved_activation_bytes(model, collator, train_split, batch_size: int, device, autocast) -> int:
    """Bytes autograd saves for backward in one training forward on the first training batch."""
    import torch

    from ..measure import SavedTensorMeter

    batch = collator([train_split[i] for i in range(min(batch_size, len(train_split)))])
    batch = {k: v.to(device) for k, v in batch.items()}
    was_training = model.training
    model.train()
    # Dropout draws from the global RNG: leave its state as training will find it.
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        with autocast, SavedTensorMeter(model) as meter:
            model(**batch)  # the batch has labels: the loss is part of the graph
    model.train(was_training)
    return meter.bytes


def _wandb_init(conf: Config, cfg: DictConfig, output_dir: Path, files: runs.RunFiles):
    import wandb

    sketch, rho = _sketch_rho(conf)
    stem = runs.run_stem(files.ident)
    # The group is the recipe (the identity less the seed): a sweep's seeds aggregate in it.
    return wandb.init(
        project=conf.logger.project, entity=conf.logger.entity, mode=conf.logger.mode.value,
        group=f"{files.experiment}/{conf.task.name}/{stem.rsplit('-seed', 1)[0]}-"
              f"{runs.recipe_hash(files.ident)}",
        name=f"{conf.task.name}-{stem}", dir=str(output_dir),
        tags=[conf.task.name, conf.model.name, sketch, f"rho{rho}"],
        config={**runs.portable_config(cfg), "identity": files.ident,
                "recipe": runs.recipe_hash(files.ident)})


#: result.json keys copied into the wandb summary, so that a sweep's runs can be compared on the
#: dashboard (memory and speed against rho) without opening a file.
SUMMARY_KEYS = ("peak_memory_bytes", "saved_activation_bytes", "tokens_per_second",
                "train_samples_per_second", "seconds_per_step", "torch_threads")


# ---------------------------------------------------------------------------------------------
# The run


def _threads(conf: Config) -> int:
    """``threads``, or the number of cores this process may use."""
    from ..measure import usable_cores

    return conf.threads if conf.threads is not None else usable_cores()


#: The checkout this process's code was loaded from, read once: a commit made during a long run, or
#: between the jobs of a sweep (which share one process), is not the code that runs.
_CODE_COMMIT: tuple[str | None, bool | None] | None = None


def _code_commit() -> tuple[str | None, bool | None]:
    global _CODE_COMMIT
    if _CODE_COMMIT is None:
        _CODE_COMMIT = runs.git_commit(REPO_ROOT)
    return _CODE_COMMIT


#: Exit status of a run refused because another process holds its identity (EX_TEMPFAIL: the
#: same command may succeed later, when that run has finished, and is then skipped).
EXIT_CLAIMED = 75


class Interrupted(KeyboardInterrupt):
    """Ctrl-C or SIGTERM during a run; the message says how to continue it."""


def run(cfg: DictConfig, output_dir: str | os.PathLike | None = None, callbacks=()) -> dict | None:
    """Train and evaluate one configuration; returns the result (None when skipped).

    ``output_dir`` is the run folder (default: Hydra's). ``callbacks`` are extra HF
    ``TrainerCallback`` objects (tests use them to interrupt a run). Raises
    :class:`~sketchprop.glue.runs.Claimed` when another process is running the same identity.
    """
    start = time.time()
    conf = validate(cfg)
    output_dir = Path(output_dir if output_dir is not None else HydraConfig.get().runtime.output_dir)
    glue_dir = check_sources(conf)
    files = run_files(conf, cfg, glue_dir)
    if _finished(files, conf):
        return None
    _code_commit()  # the commit this process loaded, read before a long run gives time to move HEAD
    # Rank 0 holds the claim for the whole run (under torchrun the other ranks follow it).
    with files.claim() if _rank() == 0 else contextlib.nullcontext():
        if _finished(files, conf):  # it finished while this process was starting
            return None
        threads = _threads(conf)
        lora = conf.adapter if conf.adapter.name.value == "lora" else None
        print(f"run: {conf.task.name}, {conf.model.name}{f' with LoRA r={lora.r}' if lora else ''}, "
              f"{conf.method.sketch.value}"
              f"{'' if conf.method.sketch.value == 'exact' else f' rho={conf.method.rho:g}'}"
              f"{f' bits={conf.method.bits}' if conf.method.bits else ''}, "
              f"seed {conf.train.seed}, data from "
              f"{'the hub ' + glue.HUB_DATASET if glue_dir is None else glue_dir}, {threads} torch "
              f"threads; identity {runs.run_stem(files.ident)}", flush=True)
        raw = glue.load_glue(conf.task, glue_dir, conf.data.max_train_samples,
                             conf.data.max_eval_samples)
        args = _training_args(conf, files, threads)
        resume_from = files.resume_point(conf.train.resume, conf.overwrite, args.process_index == 0)
        with args.main_process_first(desc="tokenize"):
            tokenizer, model, data = model_and_data(conf, raw)
        patched, compact = patch(conf, model)
        wandb_run = None
        if conf.logger.name == "wandb" and args.process_index == 0:
            wandb_run = _wandb_init(conf, cfg, output_dir, files)
        try:
            trainer, out, epoch_logs, peak = _train(conf, model, tokenizer, data, args, files,
                                                    resume_from, callbacks)
            result = _result(conf, cfg, files, trainer, out, epoch_logs, peak, data, threads,
                             patched, compact, resume_from, output_dir)
            if trainer.is_world_process_zero():
                result["wall_seconds"] = time.time() - start
                files.finish(result, output_dir)
                log.info("result: %s %s", files.index, json.dumps(result["metrics"]))
                if wandb_run is not None:
                    wandb_run.summary.update({
                        **{f"final/{k}": v for k, v in result["metrics"].items()},
                        **{f"best/{k}": v for k, v in result["best_metrics"].items()},
                        **{k: result[k] for k in SUMMARY_KEYS}, "recipe": result["recipe"],
                        "identity": files.ident})
            return result
        finally:
            if wandb_run is not None:
                wandb_run.finish()


def _finished(files: runs.RunFiles, conf: Config) -> bool:
    if files.done(conf.overwrite):
        print(f"skip: {files.index} exists (overwrite=true reruns it)", flush=True)
        return True
    return False


def _rank() -> int:
    """This process's rank under torchrun (0 alone); known before torch is imported."""
    return int(os.environ.get("RANK", "0"))


def _training_args(conf: Config, files: runs.RunFiles, threads: int):
    """HF ``TrainingArguments`` from the recipe; sets the torch thread count."""
    import torch
    from transformers import TrainingArguments

    torch.set_num_threads(threads)
    tc = conf.train
    return TrainingArguments(
        output_dir=str(files.checkpoints),
        per_device_train_batch_size=tc.batch_size,
        per_device_eval_batch_size=tc.eval_batch_size,
        learning_rate=tc.learning_rate,
        weight_decay=tc.weight_decay,
        adam_beta1=tc.adam_beta1,
        adam_beta2=tc.adam_beta2,
        adam_epsilon=tc.adam_epsilon,
        lr_scheduler_type=tc.lr_scheduler,
        warmup_steps=tc.warmup_ratio,  # a value below 1 is a fraction of the training steps
        num_train_epochs=tc.epochs,
        max_steps=tc.max_steps,
        eval_strategy="epoch",
        save_strategy="epoch" if tc.checkpoint else "no",
        save_total_limit=1,
        logging_strategy="steps",
        logging_steps=tc.logging_steps,
        logging_nan_inf_filter=False,  # a NaN loss must reach the log, where it stops the run
        include_num_input_tokens_seen="non_padding",
        bf16=tc.precision.value == "bf16",
        fp16=tc.precision.value == "fp16",
        seed=tc.seed,
        report_to=["wandb"] if conf.logger.name == "wandb" else "none",
        run_name=f"{conf.task.name}-{runs.run_stem(files.ident)}",
        dataloader_pin_memory=torch.cuda.is_available(),
        use_cpu=not torch.cuda.is_available(),  # also what makes torchrun on CPUs use DDP (gloo)
        ddp_find_unused_parameters=False,  # every parameter of these models gets a gradient
    )



def _train(conf: Config, model, tokenizer, data, args, files: runs.RunFiles, resume_from,
           callbacks):
    """Train (continuing from ``resume_from``); the trainer, its output, the epoch-log callback
    and the peak memory."""
    from transformers import DataCollatorWithPadding, Trainer

    from .. import measure

    epoch_logs = _history_callback()
    if conf.method.track_variance and conf.method.patches:
        from ..tracking import VarianceCallback

        callbacks = [VarianceCallback(model=model), *callbacks]
    trainer = _with_memory_log(Trainer)(
        model=model, args=args, data_collator=DataCollatorWithPadding(tokenizer),
        processing_class=tokenizer, train_dataset=data["train"],
        eval_dataset={d.split: data[d.split] for d in conf.task.dev},
        compute_metrics=glue.compute_metrics(conf.task), callbacks=[epoch_logs, *callbacks])
    measure.reset_peak_memory(args.device)
    try:
        out = trainer.train(resume_from_checkpoint=str(resume_from) if resume_from else None)
    except KeyboardInterrupt:
        last, _ = runs.newest_complete_checkpoint(files.checkpoints)
        where = (f"it continues from {last}" if last is not None else
                 "no checkpoint was complete yet (one is saved at each epoch end), so it "
                 "starts again")
        raise Interrupted(
            f"interrupted at step {trainer.state.global_step}. Run the same command again "
            f"and {where}:\n  {shlex.join(sys.orig_argv)}") from None
    return trainer, out, epoch_logs, measure.peak_memory_bytes(args.device)


def _result(conf: Config, cfg: DictConfig, files: runs.RunFiles, trainer, out, epoch_logs, peak,
            data, threads: int, patched: list[str], compact: list[str], resume_from,
            output_dir: Path) -> dict:
    """The result record (``result.json``; its ``wall_seconds`` is set by the caller)."""
    import torch

    tc, device = conf.train, trainer.args.device
    autocast = torch.autocast(device.type, dtype=torch.bfloat16 if tc.precision.value == "bf16"
                              else torch.float16, enabled=tc.precision.value != "fp32")
    saved = _saved_activation_bytes(trainer.model, trainer.data_collator, data["train"],
                                    tc.batch_size, device, autocast)
    history = _history(trainer.state.log_history, conf)
    if not history:
        raise runs.RunError("training ended without an evaluation; nothing to report")
    paper_metric = _metric_names(conf)[0]
    best = max(history, key=lambda h: -math.inf if h.get(paper_metric) is None
               else h[paper_metric])
    runtime = out.metrics["train_runtime"]
    steps_here = trainer.state.global_step - (_step_of(resume_from) if resume_from else 0)
    tokens = trainer.state.num_input_tokens_seen - epoch_logs.tokens_at_start
    sketch, rho = _sketch_rho(conf)
    commit, dirty = _code_commit()
    result = {
        "task": conf.task.name,
        "model": conf.model.name,
        "sketch": sketch,
        "rho": rho,
        "bits": conf.method.bits,
        "seed": tc.seed,
        "identity": files.ident,
        "recipe": runs.recipe_hash(files.ident),
        "kept": files.kept,
        "epochs": round(trainer.state.epoch, 4),
        "metrics": {k: history[-1].get(k) for k in _metric_names(conf)},
        "best_metrics": {"epoch": best["epoch"], **{k: best.get(k) for k in _metric_names(conf)}},
        "history": history,
        # Train loss at every logging step (Figure 5 draws it against the per-epoch dev loss).
        "loss_curve": [{"step": e["step"], "epoch": e.get("epoch"), "loss": runs.finite(e["loss"])}
                       for e in trainer.state.log_history if "loss" in e and "step" in e],
        "train_samples_per_second": out.metrics["train_samples_per_second"],
        "tokens_per_second": tokens / runtime if runtime > 0 else None,
        "seconds_per_step": runtime / steps_here if steps_here > 0 else None,
        "peak_memory_bytes": peak,
        "saved_activation_bytes": saved,
        "gradient_checkpointing": tc.gradient_checkpointing,
        "device": (f"cuda ({torch.cuda.get_device_name(device)})" if device.type == "cuda"
                   else device.type),
        "hardware": _hardware(device),
        "torch_threads": threads,
        "world_size": trainer.args.world_size,
        "torch_version": torch.__version__,
        "git_commit": commit,
        "git_dirty": dirty,
        "wall_seconds": None,  # set just before writing
        "experiment": files.experiment,
        "train_loss": out.metrics.get("train_loss"),
        "train_runtime": runtime,
        "global_step": trainer.state.global_step,
        "patched_layers": len(patched),
        "compact_modules": len(compact),
        # Paths relative to the repository, the model as configured: see runs.portable_config.
        "resumed_from_checkpoint": paths.portable(resume_from) if resume_from else None,
        "run_dir": paths.portable(output_dir.resolve()),
        "command": paths.portable_command(sys.orig_argv),
        "overrides": (paths.portable_overrides(list(HydraConfig.get().overrides.task))
                      if HydraConfig.initialized() else None),
        "config": runs.portable_config(cfg),
    }
    if conf.method.track_variance and conf.method.patches:
        from ..tracking import collect

        result["variance"] = collect(trainer.model)
    return result


def _step_of(checkpoint: Path) -> int:
    return int(checkpoint.name.split("-")[1])


def _raise_interrupt(signum, frame):
    _TERMINATED.append(signum)
    raise KeyboardInterrupt(f"signal {signum}")


def _remove_unused_run_folder(hc) -> None:
    """Remove the run folder of a run that did nothing (skipped or refused), so that every run
    folder holds a run. Only a folder this process named (``..._<pid>``, config.yaml's
    ``hydra.run.dir``) and that holds nothing but Hydra's config copy and this process's log;
    a folder given with ``hydra.run.dir=...`` stays."""
    folder = Path(hc.runtime.output_dir)
    if _rank() != 0 or not folder.is_dir() or not folder.name.endswith(f"_{_run_id()}"):
        return
    logs = [h for h in logging.root.handlers
            if isinstance(h, logging.FileHandler) and Path(h.baseFilename).parent == folder]
    expected = {folder / ".hydra", *(Path(h.baseFilename) for h in logs)}
    hydra_files = list((folder / ".hydra").iterdir()) if (folder / ".hydra").is_dir() else []
    if set(folder.iterdir()) - expected or any(p.suffix != ".yaml" for p in hydra_files):
        return
    for handler in logs:
        logging.root.removeHandler(handler)
        handler.close()
    shutil.rmtree(folder, ignore_errors=True)
    with contextlib.suppress(OSError):
        folder.parent.rmdir()  # the date folder, when this was its only run


@hydra.main(config_path=str(CONFIG_DIR), config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    """The Hydra entry point. Expected failures print a one-paragraph message; in a sweep a
    failed job is recorded and the sweep goes on (:class:`sketchprop.glue.runs.SweepSummary`)."""
    from hydra.types import RunMode

    signal.signal(signal.SIGTERM, _raise_interrupt)
    hc = HydraConfig.get()
    sweep = hc.mode == RunMode.MULTIRUN
    try:
        if run(cfg) is None and not sweep:
            _remove_unused_run_folder(hc)  # skipped: the result exists
    except Interrupted as err:
        print(f"\n{err}", file=sys.stderr, flush=True)
        sys.exit(130)
    except KeyboardInterrupt:
        print(f"\ninterrupted before training started; run the same command again:\n  "
              f"{shlex.join(sys.orig_argv)}", file=sys.stderr, flush=True)
        sys.exit(130)
    except runs.Claimed as err:
        if not sweep:
            print(f"refused: {err}", file=sys.stderr, flush=True)  # its folder goes, with its log
            _remove_unused_run_folder(hc)
            sys.exit(EXIT_CLAIMED)
        log.warning("skipped: %s", err)  # a sweep's job someone else runs: not a failure
        runs.record_skip(Path(hc.runtime.output_dir), err, list(hc.overrides.task))
    except (ConfigError, runs.RunError, glue.GlueDataError, FloatingPointError) as err:
        log.error("%s", err)
        if not sweep:
            sys.exit(1)
        runs.record_failure(Path(hc.runtime.output_dir), err, list(hc.overrides.task))
    except Exception as err:  # a bug: the traceback goes to the log; a sweep still goes on
        if not sweep:
            raise
        log.exception("job failed")
        runs.record_failure(Path(hc.runtime.output_dir), err, list(hc.overrides.task))

