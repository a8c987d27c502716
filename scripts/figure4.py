"""Figure 4 end to end: a training run with variance tracking, records in its JSON, the plot.

    python scripts/figure4.py experiment=figure4-minilm                  # CPU, MiniLM, CoLA
    python scripts/figure4.py experiment=figure4 --track 'layer\\.6\\.intermediate\\.dense$'
    python scripts/figure4.py experiment=figure4-minilm train.max_steps=20 --out /tmp/f4.png

Everything after the options is a Hydra override of ``configs/config.yaml``, as for
``python -m sketchprop.train``. The run goes through ``sketchprop.train.run`` with a
:class:`sketchprop.variance.VarianceCallback` that attaches trackers to the ``--track`` layers; its
records are stored under ``variance`` in the run's ``result.json`` and in its copy under
``results/runs/``, then ``scripts/plot_variance.py`` draws ``results/figures/figure4_variance.png``.
A run whose JSON already holds ``variance`` records is only re-plotted (``overwrite=true`` reruns).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

DEFAULT_TRACK = r"encoder\.layer\.(3|6)\.intermediate\.dense$"  # MiniLM layer 3 / RoBERTa layer 6


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--track", default=DEFAULT_TRACK,
                        help="regex on patched layer names to track (default: %(default)s)")
    parser.add_argument("--out", default=str(ROOT / "results" / "figures" / "figure4_variance.png"))
    parser.add_argument("--window", type=int, default=25)
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. experiment=figure4")
    args = parser.parse_args(argv)

    import plot_variance
    from hydra import compose, initialize_config_dir

    from sketchprop import train
    from sketchprop.variance import VarianceCallback

    overrides = list(args.overrides)
    keys = {o.split("=", 1)[0].lstrip("+~") for o in overrides}
    experiment = next((o.split("=", 1)[1] for o in overrides
                       if o.split("=", 1)[0].lstrip("+") == "experiment"), None)
    if experiment and "experiment_name" not in keys:
        # Hydra's compose API does not tell train.run the experiment file: name the folder after it.
        overrides.append(f"experiment_name={experiment}")
    with initialize_config_dir(str(train.CONFIG_DIR), version_base="1.3"):
        cfg = compose("config", overrides=overrides)
    conf = train.validate(cfg)
    path = train.result_path(conf)
    if path.exists() and not conf.overwrite:
        old = json.loads(path.read_text())
        if old.get("variance"):
            print(f"{path} has variance records; re-plotting (overwrite=true reruns)")
            print(plot_variance.plot([plot_variance.load_records(path)], args.out, args.window))
            return 0
        cfg.overwrite = True  # a run without records: redo it with tracking

    out_dir = ROOT / "outputs" / "figure4" / time.strftime("%Y-%m-%d_%H-%M-%S")
    callback = VarianceCallback(track=args.track)
    result = train.run(cfg, output_dir=out_dir, callbacks=[callback])
    if result is None:
        print("the run was skipped", file=sys.stderr)
        return 1
    if not result.get("variance"):  # the pipeline does not store them itself (yet)
        result["variance"] = callback.records
        for target in (out_dir / "result.json", path):
            if target.exists():
                train._write_json(target, result)
    print(f"{len(result['variance'])} variance records in {path}")
    label = (f"{conf.task.name} {conf.model.name} {conf.method.sketch.value} "
             f"rho={conf.method.rho}")
    print(plot_variance.plot([(result["variance"], label)], args.out, args.window))
    return 0


if __name__ == "__main__":
    sys.exit(main())
