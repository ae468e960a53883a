"""The guarantees stage of a build: what the server needs to answer with stated guarantees, fitted on the
calibration split alone (:attr:`offline.data.Data.calibration`), which nothing else of the build touched.

* **Prediction sets**: the served ensemble's probabilities (at its temperature) on the calibration split, their
  true-label nonconformity scores sorted, marginal and per class (:class:`service.core.conformal.SetCalibrator`,
  ``guarantees.method``): any ``alpha`` is served per request.
* **OOD p-values**: the served OOD score of every calibration input, sorted (outlier-oriented: MSP negated);
  ``p = (1 + #{s_i >= s}) / (n + 1)`` per request, the flag ``p <= ood_alpha``.
* **Answers with a risk bound**: per target risk ``eps`` (``guarantees.risks``), the confidence threshold of the
  rule "accept iff the OOD score passes the build's OOD threshold and the ensemble's confidence (MSP) is at least
  ``lam``", certified by Learn-then-Test with fixed-sequence testing and a binomial p-value on the calibration split
  (:func:`service.core.conformal.selective_thresholds`). Both parts of the rule are fixed before the split is looked
  at: the OOD threshold is the one fitted on validation data (``uncertainty.ood_threshold``), and the candidate
  ``lam`` are quantiles of the validation inputs' confidence, so the guarantee needs no assumption on the model:
  with probability at least ``1 - delta`` over the draw of the calibration split, the error rate among the
  accepted in-distribution inputs is at most ``eps`` (each target on its own).
* **The drift alarm's reference**: the calibration scores (the OOD p-values' above) set the alarm's bets
  (:mod:`service.core.drift`). The file still holds the drift bins' edges of the artifact format (quantiles of the
  validation inputs' scores), which the server's alarm no longer reads.
* **The harmful-shift alarm's source risk**: how many calibration inputs the served model gets wrong (top label, the
  calibration record's ``errors``, out of ``ood.n``); the server bounds the source risk from it (Clopper-Pearson,
  :meth:`service.core.online.HarmfulShiftAlarm.from_errors`) and tests labelled traffic against that bound.

Everything goes into ``guarantees.safetensors`` and the manifest's ``guarantees`` block
(:class:`service.core.artifact.GuaranteesSpec`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from offline.method.corruptions import SHIFT_PREFIX
from service.core.conformal import (
    SetCalibrator,
    binomial_p_value,
    keep_top,
    min_accepted,
    min_alpha,
    ood_p_values,
    selective_thresholds,
)
from service.core.drift import DriftMonitor
from service.core.guarantees import GUARANTEES_FILE, outlier_oriented

__all__ = [
    "GUARANTEES_FILE",
    "CalibrationOutputs",
    "Fitted",
    "calibration_errors",
    "calibration_record",
    "drift_edges",
    "evaluate_guarantees",
    "fit_guarantees",
    "grid_of",
]

GRID = 201  # candidate confidence thresholds: quantiles of the validation confidences at i / (GRID - 1)
# a target's candidates start where the validation inputs' accept rate promises this many times the fewest accepted
# calibration inputs at which the target can be certified at all (service.core.conformal.min_accepted): a first
# candidate accepting fewer would end the fixed sequence at once
GRID_MARGIN = 1.25
# ... and the first candidate is one the validation inputs certify with room to spare (p-value at most delta / 5 on
# at least this many inputs): a start certified by a lucky handful of validation inputs fails on calibration
START_MIN_INPUTS = 30
START_LEVEL = 0.2
# how the manifest describes the candidate grid and the drift bins
GRID_SOURCE = (
    "quantiles of the validation confidences of the inputs passing the OOD cut; each target's "
    "from where validation alone would certify it"
)
DRIFT_EDGES_SOURCE = "quantiles of the validation inputs' OOD scores"


@dataclass
class CalibrationOutputs:
    """The served model on one split: ensemble probabilities ``(N, C)`` at the served temperature, labels ``(N,)``,
    the served OOD score ``(N,)`` (as served: MSP higher = ID, the others higher = OOD)."""

    probs: np.ndarray
    labels: np.ndarray
    ood_score: np.ndarray


@dataclass
class Fitted:
    """The fitted guarantees: tensors for ``guarantees.safetensors`` and the manifest block."""

    tensors: dict[str, torch.Tensor]
    spec: dict[str, Any]
    sets: SetCalibrator
    rules: list[Any] = field(default_factory=list)


def grid_of(confidences: np.ndarray, size: int = GRID) -> np.ndarray:
    """Candidate thresholds ``(G,)``: the distinct quantiles of ``confidences`` at ``i / (size - 1)``."""
    if confidences.size == 0:
        return np.asarray([1.0])
    return np.unique(np.quantile(confidences, np.linspace(0.0, 1.0, size)))


def target_grid(
    grid: np.ndarray,
    val_conf: np.ndarray,
    val_correct: np.ndarray,
    n_val: int,
    n_cal: int,
    eps: float,
    delta: float,
) -> np.ndarray:
    """The candidates of one target ``eps``, tested from the highest down (fixed sequence, which stops at the first
    candidate it cannot certify): ``grid`` from the highest threshold at which the validation inputs alone would
    certify the target with room to spare (binomial p-value at most ``START_LEVEL * delta`` on at least
    ``START_MIN_INPUTS`` of those passing the OOD cut: ``val_conf`` and ``val_correct``, of ``n_val`` inputs in
    all) and, scaled to the ``n_cal`` calibration inputs, promise at least
    ``GRID_MARGIN`` times the fewest accepted inputs that can be certified at all; without one, from the first
    that promises those. Validation only: the candidates are fixed before the calibration split is looked at,
    which the guarantee needs."""
    need = GRID_MARGIN * min_accepted(eps, delta)
    acc = val_conf[None, :] >= grid[:, None]  # (G, N_val)
    n_acc = acc.sum(1)
    errors = (acc & ~val_correct[None, :]).sum(1)
    enough = n_acc * n_cal / max(n_val, 1) >= need
    p_val = binomial_p_value(errors, np.maximum(n_acc, 1), eps)
    certified = enough & (n_acc >= START_MIN_INPUTS) & (p_val <= START_LEVEL * delta)
    start = grid[certified].max() if certified.any() else (grid[enough].max() if enough.any() else grid.min())
    return grid[grid <= start]


def drift_edges(val_scores: np.ndarray, bins: int) -> np.ndarray:
    """The drift alarm's bin edges ``(bins - 1,)``: quantiles of outlier-oriented validation scores at ``i / bins``."""
    return np.quantile(np.asarray(val_scores, dtype=np.float64), np.arange(1, bins) / bins)


def fit_guarantees(
    g: Any,
    cal: CalibrationOutputs,
    val: CalibrationOutputs,
    metric: str,
    ood_threshold: float,
    split_record: dict[str, Any],
    label_free: bool = False,
) -> Fitted:
    """The guarantees of ``g`` (the config's ``guarantees`` section) fitted on the calibration split ``cal``; the
    validation split ``val`` fixes the candidate thresholds and the drift bins (never the calibration split).

    ``metric``, ``ood_threshold``: the served OOD score and its validation threshold (the rule's OOD cut).
    ``label_free``: the OOD score does not depend on the labels (zero-shot): its p-values hold for any labels,
    the sets and the risk rules only for the build's labels.
    """
    sets = SetCalibrator.fit(cal.probs, cal.labels, g.method, g.k_reg, g.lam, g.set_delta)
    ood = np.sort(outlier_oriented(cal.ood_score, metric))
    rules, sizes = risk_rules(g, cal, val, metric, ood_threshold)
    edges = drift_edges(outlier_oriented(val.ood_score, metric), g.drift_bins)
    tensors = {
        **sets.to_tensors("conformal."),
        **{k: torch.from_numpy(np.ascontiguousarray(v, dtype=np.float64)) for k, v in _arrays(cal, ood, edges).items()},
    }
    n = int(cal.labels.shape[0])
    spec = {
        "file": GUARANTEES_FILE,
        "calibration": calibration_record(split_record, cal),
        "conformal": {
            "method": g.method,
            "k_reg": g.k_reg,
            "lam": g.lam,
            "alpha": g.alpha,
            "mondrian": g.mondrian,
            "delta": g.set_delta,
            "min_alpha": float(sets.min_alpha()),
            "min_alpha_per_class": [float(a) for a in sets.min_alpha(mondrian=True)],
            "labels": "the build's" if label_free else "the model's",
        },
        "ood": {
            "score": metric,
            "alpha": g.ood_alpha,
            "n": n,
            "min_alpha": float(min_alpha(n)),
            "label_free": label_free,
        },
        "selective": {
            "delta": g.delta,
            "p_value": g.p_value,
            "confidence": "msp",
            "default_risk": g.risk,
            "ood_cut": {"score": metric, "threshold": ood_threshold},
            "grid": {"from": GRID_SOURCE, "sizes": sizes},
            "targets": [rule_record(r) for r in rules],
        },
        "drift": {"delta": g.drift_delta, "bins": g.drift_bins, "seed": 0, "edges": DRIFT_EDGES_SOURCE},
    }
    return Fitted(tensors, spec, sets, rules)


def _arrays(cal: CalibrationOutputs, ood: np.ndarray, edges: np.ndarray) -> dict[str, np.ndarray]:
    """The guarantees' arrays besides the sets': the calibration split's outlier-oriented OOD scores (sorted), the
    drift bins, and its confidences (sorted), the scale of the server's online accept rules
    (``service/core/online_risk.py``)."""
    return {"ood.scores": ood, "drift.edges": edges, "selective.confidences": np.sort(cal.probs.max(axis=1))}


def calibration_errors(cal: CalibrationOutputs) -> int:
    """How many calibration inputs the served model gets wrong: top label (``argmax`` of ``probs (N, C)``, ties to
    the first label, as served) other than the true label ``labels (N,)``."""
    return int((np.asarray(cal.probs).argmax(axis=1) != np.asarray(cal.labels)).sum())


def calibration_record(split_record: dict[str, Any], cal: CalibrationOutputs) -> dict[str, Any]:
    """The manifest's ``guarantees.calibration``: the split's provenance (``split_record``, copied: it is also the
    record of ``data.id.calibration``) and ``errors``, the served model's wrong top labels on it
    (:func:`calibration_errors`), out of the ``ood.n`` calibration inputs: the source risk that the server's
    harmful-shift alarm (:meth:`service.core.online.HarmfulShiftAlarm.from_errors`) bounds."""
    return {**split_record, "errors": calibration_errors(cal)}


def risk_rules(
    g: Any, cal: CalibrationOutputs, val: CalibrationOutputs, metric: str, ood_threshold: float
) -> tuple[list[Any], list[int]]:
    """The answers with a risk bound: per target risk of ``g.risks``, the confidence threshold certified on the
    calibration split among the inputs passing the OOD cut, tested over that target's candidates from validation
    (:func:`target_grid`); and each target's candidate count."""
    cut = outlier_oriented(np.asarray([ood_threshold]), metric)[0]
    eligible = outlier_oriented(cal.ood_score, metric) <= cut
    val_eligible = outlier_oriented(val.ood_score, metric) <= cut
    conf = cal.probs.max(axis=1)
    correct = cal.probs.argmax(axis=1) == cal.labels
    val_conf = val.probs.max(axis=1)[val_eligible]
    val_correct = (val.probs.argmax(axis=1) == val.labels)[val_eligible]
    grid = grid_of(val_conf)
    n = int(cal.labels.shape[0])
    rules, sizes = [], []
    for eps in g.risks:  # each target its own candidates (its first must accept enough inputs to be certifiable)
        own = target_grid(grid, val_conf, val_correct, len(val.labels), n, eps, g.delta)
        rules += selective_thresholds(conf, correct, [eps], g.delta, eligible=eligible, p_value=g.p_value, grid=own)
        sizes.append(int(own.size))
    return rules, sizes


def rule_record(r: Any) -> dict[str, Any]:
    """One certified (or not) target of the manifest's ``selective.targets``."""
    return {
        "risk": r.eps,
        "certified": r.threshold is not None,
        "threshold": r.threshold,
        "calibration_accept_rate": r.accept_rate,
        "calibration_risk": None if r.n_accepted == 0 else r.risk,
        "n_accepted": r.n_accepted,
        "p_value": r.p_value,
    }


# ----------------------------------------------------------------------------- what the report shows
REPORT_ALPHAS = (0.01, 0.05, 0.1, 0.2)  # the sets' and OOD p-values' levels in the report
DRIFT_ID_INPUTS = 2000  # ID test inputs before the switch in the simulated drift runs
DRIFT_SWITCH_INPUTS = 1000  # inputs of the switch ...
FOREIGN_SHARE = 0.3  # ... this share of them from the OOD test set, the rest ID test
DRIFT_BACK_INPUTS = 1000  # ID test inputs after it (the alarm should clear)
DRIFT_STREAMS = 50  # simulated streams per OOD test set (switch, and burst)
BURST = 5  # foreign inputs in a row inside ID traffic: the alarm should not fire
NULL_STREAMS = 100  # simulated ID streams for the false-alarm check ...
NULL_STREAM_INPUTS = 10_000  # ... of this many inputs each


def coverage_table(fitted: Fitted, test: CalibrationOutputs, mondrian: bool = False) -> dict[str, Any]:
    """Coverage and mean set size on ID test at each of :data:`REPORT_ALPHAS`: marginal, per class, the smallest
    class's."""
    out: dict[str, Any] = {}
    classes = fitted.sets.num_classes
    for a in REPORT_ALPHAS:
        raw = fitted.sets.sets(test.probs, a, mondrian)  # (N, C)
        sets, _ = keep_top(raw, test.probs)  # as served: never empty
        hit = sets[np.arange(len(test.labels)), test.labels]
        per_class = [float(hit[test.labels == c].mean()) if (test.labels == c).any() else None for c in range(classes)]
        valid = [v for v in per_class if v is not None]
        out[str(a)] = {
            "coverage": float(hit.mean()),
            "mean_size": float(sets.sum(1).mean()),
            "per_class": per_class,
            "min_class": min(valid) if valid else None,
            "empty": float((raw.sum(1) == 0).mean()),
        }
    return out


def p_value_table(fitted: Fitted, metric: str, test: CalibrationOutputs, ood: dict[str, np.ndarray]) -> dict:
    """The OOD p-value flag at each level of :data:`REPORT_ALPHAS`: its false-alarm rate on ID test, its recall on
    each OOD test set (``ood``: served scores per set)."""
    cal = np.sort(fitted.tensors["ood.scores"].numpy())
    p_id = ood_p_values(outlier_oriented(test.ood_score, metric), cal)
    p_ood = {k: ood_p_values(outlier_oriented(v, metric), cal) for k, v in ood.items()}
    return {
        str(a): {
            "false_alarm": float((p_id <= a).mean()),
            "recall": {k: float((v <= a).mean()) for k, v in p_ood.items()},
        }
        for a in REPORT_ALPHAS
    }


def selective_table(fitted: Fitted, metric: str, ood_threshold: float, test: CalibrationOutputs) -> list[dict]:
    """Per target: certified, the threshold, and on ID test the realised risk among accepted and the accept rate."""
    cut = outlier_oriented(np.asarray([ood_threshold]), metric)[0]
    eligible = outlier_oriented(test.ood_score, metric) <= cut
    conf, wrong = test.probs.max(1), test.probs.argmax(1) != test.labels
    rows = []
    for r in fitted.rules:
        acc = eligible & (conf >= r.threshold) if r.threshold is not None else np.zeros_like(eligible)
        rows.append(
            {
                "risk": r.eps,
                "certified": r.threshold is not None,
                "threshold": r.threshold,
                "test_accept_rate": float(acc.mean()),
                "test_risk": float(wrong[acc].mean()) if acc.any() else None,
                "calibration_accept_rate": r.accept_rate,
            }
        )
    return rows


def risk_coverage_curve(test: CalibrationOutputs, metric: str, ood_threshold: float, points: int = 50) -> dict:
    """The risk-coverage curve of the rule family on ID test (accept rate, risk among accepted) over confidence
    thresholds, the OOD cut applied: what the certified rules are points of."""
    cut = outlier_oriented(np.asarray([ood_threshold]), metric)[0]
    eligible = outlier_oriented(test.ood_score, metric) <= cut
    conf, wrong = test.probs.max(1), test.probs.argmax(1) != test.labels
    grid = np.unique(np.quantile(conf[eligible], np.linspace(0, 1, points))) if eligible.any() else np.zeros(1)
    acc = eligible[None, :] & (conf[None, :] >= grid[:, None])
    rate = acc.mean(1)
    risk = np.where(acc.sum(1) > 0, (acc & wrong[None, :]).sum(1) / np.maximum(acc.sum(1), 1), np.nan)
    return {"accept_rate": rate.tolist(), "risk": [None if np.isnan(v) else float(v) for v in risk]}


def drift_runs(
    fitted: Fitted, g: Any, metric: str, test: np.ndarray, ood: dict[str, np.ndarray], val: np.ndarray, seed: int = 0
) -> dict[str, Any]:
    """The served drift alarm (:mod:`service.core.drift`, on the calibration split's scores) on simulated streams of
    served scores (outlier-oriented inside), per OOD test set: :data:`DRIFT_STREAMS` streams of
    :data:`DRIFT_ID_INPUTS` ID test inputs, then :data:`DRIFT_SWITCH_INPUTS` inputs of which
    :data:`FOREIGN_SHARE` come from the set, then :data:`DRIFT_BACK_INPUTS` ID inputs (the alarm's delay after the
    switch and its clearing after the return; the statistic along the first stream, log10, every 10th input), and
    :data:`DRIFT_STREAMS` streams with a burst of :data:`BURST` of the set's inputs inside ID traffic (how many fired
    it); then the false alarms of :data:`NULL_STREAMS` ID streams of :data:`NULL_STREAM_INPUTS` inputs resampled
    from ID test and validation scores."""
    mon = DriftMonitor(fitted.tensors["ood.scores"].numpy(), delta=g.drift_delta)
    rng = np.random.default_rng(seed)
    test_o = outlier_oriented(test, metric)
    n_id, n_sw, n_back = DRIFT_ID_INPUTS, DRIFT_SWITCH_INPUTS, DRIFT_BACK_INPUTS
    runs = {}
    for name, scores in ood.items():
        foreign = outlier_oriented(scores, metric)
        mix = rng.random((DRIFT_STREAMS, n_sw)) < FOREIGN_SHARE
        switch = np.where(mix, rng.choice(foreign, mix.shape), rng.choice(test_o, mix.shape))
        stream = np.concatenate(
            [rng.choice(test_o, (DRIFT_STREAMS, n_id)), switch, rng.choice(test_o, (DRIFT_STREAMS, n_back))], 1
        )
        log10_c, on = mon.simulate(stream)
        burst = np.concatenate(
            [
                rng.choice(test_o, (DRIFT_STREAMS, n_id)),
                rng.choice(foreign, (DRIFT_STREAMS, BURST)),
                rng.choice(test_o, (DRIFT_STREAMS, n_back)),
            ],
            1,
        )
        runs[name] = _switch_run(log10_c, on) | {"burst_fired": int(mon.simulate(burst)[1].any(axis=1).sum())}
    pool = outlier_oriented(np.concatenate([test, val]), metric)
    _, on = mon.simulate(rng.choice(pool, (NULL_STREAMS, NULL_STREAM_INPUTS)))
    return {
        "switch_at": n_id,
        "switch_inputs": n_sw,
        "back_at": n_id + n_sw,
        "foreign_share": FOREIGN_SHARE,
        "streams": DRIFT_STREAMS,
        "burst": BURST,
        "log10_threshold": mon.log10_threshold,
        "arl": mon.arl,
        "delta": g.drift_delta,
        "runs": runs,
        "null_streams": NULL_STREAMS,
        "null_stream_inputs": NULL_STREAM_INPUTS,
        "null_alarms": int(on.any(axis=1).sum()),
        "null_bound": min(1.0, g.drift_delta + NULL_STREAM_INPUTS / mon.arl),
    }


def _switch_run(log10_c: np.ndarray, on: np.ndarray) -> dict[str, Any]:
    """The alarm on streams ``(S, T)`` that switch at :data:`DRIFT_ID_INPUTS` and return at the end of the switch:
    the first stream's trace and alarm point, and over all streams the false alarms before the switch, the delays
    (inputs after the switch until the alarm; None: not within the switch) and the clearing after the return."""
    n_id, back = DRIFT_ID_INPUTS, DRIFT_ID_INPUTS + DRIFT_SWITCH_INPUTS
    during = on[:, n_id:back]
    fired = during.any(axis=1)
    delays = np.where(fired, during.argmax(axis=1) + 1, -1)
    after = on[:, back - 1 :]  # (S, 1 + DRIFT_BACK_INPUTS): on at the return, then each ID input after it
    cleared = after[:, 0] & ~after[:, -1]  # on at the return, off by the end
    clear_in = np.where(cleared, (~after).argmax(axis=1), -1)
    first = int(np.argmax(on[0])) + 1 if on[0].any() else None
    return {
        "trace_every_10": [float(v) for v in log10_c[0, 9::10]],
        "alarm_at": first,
        "delay": int(delays[0]) if delays[0] > 0 else None,
        "false_alarm": bool(on[0, :n_id].any()),
        "false_alarms": int(on[:, :n_id].any(axis=1).sum()),
        "fired": int(fired.sum()),
        "delay_median": float(np.median(delays[fired])) if fired.any() else None,
        "delay_max": int(delays[fired].max()) if fired.any() else None,
        "on_at_return": int(after[:, 0].sum()),
        "cleared": int(cleared.sum()),
        "clear_median": float(np.median(clear_in[cleared])) if cleared.any() else None,
        "clear_max": int(clear_in[cleared].max()) if cleared.any() else None,
    }


def evaluate_guarantees(
    g: Any,
    by_method: dict[str, dict[str, CalibrationOutputs]],
    thresholds: dict[str, float],
    metric: str,
    served: str = "hydra",
) -> dict[str, Any]:
    """The report's guarantees section. ``by_method``: per method (Single, members, the Deep Ensemble, Hydra), its
    outputs at its own temperature with its own OOD statistics of the served score's family on ``calibration``,
    ``val``, ``test``, each ``ood:<set>`` and each shifted copy ``shift:<copy>``; ``thresholds``: each method's OOD
    threshold on its own validation scores (the risk rules' cut). Each method gets its guarantees fitted on the
    calibration split as the served model does (and on each shifted copy its rule at the default risk);
    ``served`` also gets the Mondrian sets, the risk-coverage curve and the drift runs."""
    out: dict[str, Any] = {
        "alphas": list(REPORT_ALPHAS),
        "method": g.method,
        "set_delta": g.set_delta,
        "metric": metric,
        "methods": {},
    }
    for name, o in by_method.items():
        fitted = fit_guarantees(g, o["calibration"], o["val"], metric, thresholds[name], {})
        ood = {k[4:]: v.ood_score for k, v in o.items() if k.startswith("ood:")}
        row = {
            "coverage": coverage_table(fitted, o["test"]),
            "p_values": p_value_table(fitted, metric, o["test"], ood),
            "selective": selective_table(fitted, metric, thresholds[name], o["test"]),
            "calibration_size": int(len(o["calibration"].labels)),
        }
        shifted = {k[len(SHIFT_PREFIX) :]: v for k, v in o.items() if k.startswith(SHIFT_PREFIX)}
        if shifted:  # the risk rule at the default target on each shifted copy (the report's shift section)
            row["shift"] = {
                k: next(r for r in selective_table(fitted, metric, thresholds[name], v) if r["risk"] == g.risk)
                for k, v in shifted.items()
            }
        if name == served:
            row["mondrian"] = coverage_table(fitted, o["test"], mondrian=True)
            row["risk_coverage"] = risk_coverage_curve(o["test"], metric, thresholds[name])
            row["drift"] = drift_runs(fitted, g, metric, o["test"].ood_score, ood, o["val"].ood_score)
            row["min_alpha"] = float(fitted.sets.min_alpha())
            row["min_alpha_per_class"] = [float(a) for a in fitted.sets.min_alpha(mondrian=True)]
        out["methods"][name] = row
    return out
