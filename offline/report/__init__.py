"""The build report: latency measurement, ``report.json``, a readable ``report.md`` and PNG plots.

``write_report`` takes one row per method (``single``, ``member_0``.., ``hydra``,
``ensemble_unfused``, zero-shot builds also ``single_ts``), each the output of
``offline.method.ensemble_metrics.evaluate_predictions`` plus ``method``, ``params`` and
``latency_ms``, and the member probabilities behind them for the plots.

Like is compared with like: the main ID table says the temperature its rows are
at (all at ``T = 1``, or a ``T`` column), and a second table shows every method at
its *own* temperature fitted on ID validation data (``row["calibrated"]``). For
OOD detection, ``row["ood_scores"]`` gives each method's AUROC / FPR95 with every
OOD score, so ``single`` + a score (what the features give) sits next to
``hydra`` + the same score (what the ensemble adds); ``extra`` says how the served
score was chosen on the OOD validation sets and how its flag does on test data.
All of these inputs are optional: a report without them renders as before.

The modules, each one part of the report:

- ``write``: ``write_report``, the entry point, writing the three outputs;
- ``summary``: the headline numbers per method for the manifest (``summary_of``);
- ``markdown``: report.md's sections in order, over ``id_tables``, ``ood_tables``, ``by_class``,
  ``shift_tables`` and ``guarantee_tables``;
- ``markdown_tables`` and ``values``: markdown tables, and numbers as cells and as strict JSON;
- ``plots``: the PNG plots (matplotlib ``Figure`` directly, so no global backend is touched);
- ``latency``: ``measure_latency``, the latency of the rows.

May import: :mod:`offline.method` and ``service.core``; nothing else of the builder.
"""

from __future__ import annotations

from offline.report.by_class import per_class
from offline.report.latency import measure_latency
from offline.report.plots import PLOT_FILES, SERVED_PLOT
from offline.report.summary import HEADLINE, summary_of
from offline.report.write import write_report

__all__ = ["measure_latency", "write_report", "summary_of", "per_class", "HEADLINE", "PLOT_FILES", "SERVED_PLOT"]
