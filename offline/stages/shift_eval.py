"""The report's shift section: every method on corrupted copies of ID test inputs (:mod:`offline.method.corruptions`).

Where the inputs drift away from the training data without leaving its classes, an ensemble's uncertainty is known
to help most (Ovadia et al. 2019). ``data.shift_inputs`` ID test inputs (the first of the test split, which is
drawn at random and stratified) are copied under every corruption of the modality at each severity; every
method runs on each copy like on any evaluation set (:func:`offline.stages.datasets.shift_sets`, ``EvalSets.shift``).
Per method and copy the section gives, at the method's own temperature fitted on ID validation (the same
treatment for every method): accuracy, ECE, NLL, Brier and AURC; and with a calibration split, the accept rate and the
error among accepted answers of the method's own risk rule at the served risk target (``guarantees.risk``, its
guarantees fitted on the calibration split as the served model's are:
:func:`offline.method.guarantee_fits.evaluate_guarantees`).

    data.shift_sets(ctx, pre)  ->  {"noise@1": Batches, ...}    (data.shift_inputs > 0, a classifier)
    shift_metrics(methods, sets)  ->  {method: {"noise@1": {"acc", "ece", "nll", "brier", "aurc"}, ...}}
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from offline.method.calibration import fit_temperature
from offline.method.corruptions import SHIFT_PREFIX
from offline.method.ensemble_metrics import evaluate_predictions
from offline.stages.datasets import EvalSets

__all__ = ["shift_metrics", "shift_report", "shift_summary"]


def shift_metrics(methods: dict[str, Any], sets: EvalSets) -> dict[str, dict[str, dict[str, float]]]:
    """Per method (:class:`offline.stages.evaluation.Method`, its runs on every set of ``sets``) and shifted copy:
    accuracy, ECE, NLL, Brier, AURC at the method's own temperature on ID validation; empty without shifted copies or
    without validation."""
    if not sets.shift or sets.val is None:
        return {}
    y_val = sets.labels("val")
    out: dict[str, dict[str, dict[str, float]]] = {}
    for name, m in methods.items():
        T = fit_temperature(m.runs["val"][0], y_val)
        rows = {}
        for set_name in sets.shift:
            logits = m.runs[SHIFT_PREFIX + set_name][0]
            probs = torch.softmax(logits.double() / T, -1).numpy()
            metrics = evaluate_predictions(probs, sets.labels(SHIFT_PREFIX + set_name).numpy(), {})
            rows[set_name] = {k: metrics[k] for k in ("acc", "ece", "nll", "brier", "aurc")}
        out[name] = rows
    return out


def shift_summary(per_set: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    """One method's figures per copy (``{"noise@1": {metric: value}}``) averaged per severity (``"1"``, ``"2"``,
    ``"3"``, over the corruptions) and over everything (``"mean"``); a metric missing from some copy (``None``:
    nothing accepted) is averaged over the copies that have it."""
    groups: dict[str, list[dict[str, float]]] = {}
    for set_name, row in per_set.items():
        groups.setdefault(set_name.rsplit("@", 1)[1], []).append(row)
        groups.setdefault("mean", []).append(row)
    out = {}
    for key, rows in groups.items():
        metrics = {k for r in rows for k in r}
        out[key] = {
            k: float(np.mean(v)) if (v := [r[k] for r in rows if r.get(k) is not None]) else None
            for k in sorted(metrics)
        }
    return out  # type: ignore[return-value]


def shift_report(metrics: dict[str, dict[str, dict[str, float]]], guarantees: dict[str, Any] | None) -> dict[str, Any]:
    """The report's ``shift`` block (empty without shifted copies): ``methods``, per method its figures per copy
    (:func:`shift_metrics`; with a guarantees report also ``accept_rate`` and ``accepted_error``, the accept rate and
    the error among accepted answers of the method's risk rule at the default target ``risk``) and their
    :func:`shift_summary`."""
    if not metrics:
        return {}
    rules = {name: row.get("shift") or {} for name, row in ((guarantees or {}).get("methods") or {}).items()}
    risk = next((r["risk"] for per_set in rules.values() for r in per_set.values()), None)
    methods = {}
    for name, per_set in metrics.items():
        rule = rules.get(name, {})
        sets = {k: {**v, **_accepted(rule.get(k))} for k, v in per_set.items()}
        methods[name] = {"sets": sets, "summary": shift_summary(sets)}
    return {"risk": risk, "methods": methods}


def _accepted(rule: dict[str, Any] | None) -> dict[str, Any]:
    """A risk rule's row on a shifted copy (:func:`offline.method.guarantee_fits.selective_table`) as the section's
    figures."""
    return {} if rule is None else {"accept_rate": rule["test_accept_rate"], "accepted_error": rule["test_risk"]}
