"""Keys of what ``offline.method.ensemble_metrics.evaluate_predictions`` returns, shared by the metrics and the report
tests."""

from __future__ import annotations

# per method: the float metrics on the ID test set and on the pooled OOD inputs
EVAL_SCALAR_KEYS = (
    "acc",
    "nll",
    "brier",
    "ece",
    "aece",
    "aurc",
    "mi_id",
    "disagreement_id",
    "entropy_id",
    "msp_id",
    "mi_ood",
    "disagreement_ood",
)
# per OOD set: the entry of result["ood"][name]
EVAL_OOD_SET_KEYS = frozenset({"auroc", "fpr95", "aupr_in", "aupr_out", "mi", "disagreement"})
