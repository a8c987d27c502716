"""The GLUE fine-tuning pipeline around the library (needs the ``glue`` extra):

    config   the Hydra schemas (one dataclass per config group) and validation
    setup    the checks made before any heavy work, and the choice of setup (cpu or paper)
    data     GLUE from the hub or from the original TSV files, tokenizing, toy files for tests
    metric   the GLUE metrics x100, named as in the paper; hf_metric wraps them for ``evaluate``
    model    the model a run trains, its adapter and its patches
    runs     what identifies a run, where its files go, resuming, sweep summaries
    train    one training run and the Hydra entry (``python -m sketchprop.train``)
    paths    the repository root; paths and commands as records write them (no hydra: the
             benchmarks use it too)
    migrate  bringing committed result files up to date (``scripts/migrate_runs.py``)
"""
