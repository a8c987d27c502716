"""The report: the paper's tables and figures rebuilt from the files under ``results/`` alone.

One module per table or figure, each writing its own files:

- :mod:`~sketchprop.report.common`: what they share: loading run and memory files, method keys
  and labels, paired statistics, the controlled benchmark's ratios, formatting, writing tables
  (markdown and CSV) and figures;
- :mod:`~sketchprop.report.table2`: ``tables/table2.md|csv`` (score per task and method);
- :mod:`~sketchprop.report.table3`: ``tables/table3.md|csv`` (saved bytes and peaks per task and
  batch) and ``table3_roberta`` (peaks from training runs);
- :mod:`~sketchprop.report.table4`: ``tables/table4.md|csv`` (CoLA per sketch and rate, speed from
  the benchmark);
- :mod:`~sketchprop.report.comparisons`: ``tables/comparisons.md|csv`` (named pairs by seed);
- :mod:`~sketchprop.report.lora`: ``tables/lora.md|csv`` (LoRA with and without the sketch);
- :mod:`~sketchprop.report.tuning`: ``tables/tuning.md|csv`` (the CPU recipe's learning rate);
- :mod:`~sketchprop.report.frontier`: ``tables/frontier.md|csv``, ``figures/frontier.png``;
- :mod:`~sketchprop.report.figure3`: ``figures/figure3_memory.png``;
- :mod:`~sketchprop.report.figure4`: ``figures/figure4_variance.png`` (``scripts/plot_variance.py``);
- :mod:`~sketchprop.report.figure5`: ``figures/figure5_loss.png``;
- :mod:`~sketchprop.report.figure6`: ``figures/figure6_throughput.png``;
- :mod:`~sketchprop.report.budget`: the pick-by-budget table (``scripts/pick_budget.py``);
- :mod:`~sketchprop.report.summary`: the README's short frontier table (the rows on a front);
- :mod:`~sketchprop.report.stacks`: the training-stacks table of ``docs/training-stacks.md``,
  read off the tests' stack markers;
- :mod:`~sketchprop.report.embed`: the tables the README and docs pages embed;
- :mod:`~sketchprop.report.build`: all of the above but Figure 4 and the budget (``make tables``).

Speed comes only from the controlled benchmark (``results/bench``): each configuration timed in
one process, interleaved with the exact baseline, every sample divided by the baseline samples
around it. The training runs' own times were taken on cores shared with other jobs and are not
shown as speed anywhere. Methods are compared by seed: seed s gives every method the same
classifier initialisation and the same data order, so the tables show the mean paired difference
(with its standard error and the number of pairs) beside the unpaired mean ± sd. No number is typed
here except the paper's own, which are labelled as such.
"""
