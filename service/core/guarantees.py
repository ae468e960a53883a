"""The guarantees an answer carries, as the server applies them: prediction sets, OOD p-values, answers with a risk
bound, and the drift alarm's reference. Fitted by the builder on the artifact's calibration split
(``offline/method/guarantee_fits.py``), stored in ``guarantees.safetensors`` and the manifest's ``guarantees`` block.

What each guarantee holds over (docs/api.md, "Guarantees", says the same for users): the calibration split is a
random sample of in-distribution inputs that nothing else of the build touched. If the inputs a model serves are
exchangeable with that split (drawn from the same distribution, in no particular order), then

* a prediction set at ``alpha`` contains the true label with probability at least ``1 - alpha`` (marginal: on
  average over inputs, and over the draw of the split; with ``mondrian`` at least ``1 - alpha`` for every class);
  finite-sample, whatever the model: with ``n`` calibration inputs it needs ``alpha >= 1 / (n + 1)``, and below
  that the set is every label (``all_labels``);
* the OOD flag ``p_value <= ood_alpha`` fires on at most ``ood_alpha`` of in-distribution inputs;
* with probability at least ``1 - delta`` over the draw of the split, the error rate among the inputs the rule of
  a risk target ``eps`` accepts is at most ``eps``.

A zero-shot model's OOD score is label-free (its p-values hold for any labels); its sets and risk rules hold for
the build's own labels and template only, so ``/zero-shot`` requests with other labels get neither.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from safetensors.torch import load_file

from service.core.artifact import ArtifactError, Manifest
from service.core.conformal import SetCalibrator, keep_top, ood_p_values
from service.core.drift import DriftMonitor
from service.core.online_risk import ConfidenceRanks
from service.core.scores import outlier_sign

__all__ = ["GUARANTEES_FILE", "Answer", "Guarantees", "load_guarantees", "outlier_oriented"]

GUARANTEES_FILE = "guarantees.safetensors"
QHAT_CACHE = 256  # set thresholds kept per model (distinct alpha levels requested)


def outlier_oriented(scores: np.ndarray, metric: str) -> np.ndarray:
    """``scores`` of the OOD score ``metric`` with higher = more OOD (MSP, where higher = in distribution, negated)."""
    return outlier_sign(metric) * np.asarray(scores, dtype=np.float64)


@dataclass(frozen=True)
class Answer:
    """One request's guarantees (:meth:`Guarantees.answer`); the set fields are None when the request gets no sets
    or risk rules (zero-shot with other labels)."""

    p_values: list[float]  # (B,) conformal OOD p-values
    sets: np.ndarray | None = None  # (B, C) bool, never empty
    below_min_alpha: bool = False
    filled: np.ndarray | None = None  # (B,) bool: the set was empty at alpha and holds the prediction alone
    accepts: list[bool] | None = None  # (B,) the risk rule's decisions
    eligible: list[bool] | None = None  # (B,) the rule's OOD cut passed (the confidence threshold aside)


@dataclass(frozen=True)
class Guarantees:
    """One artifact's fitted guarantees (:func:`load_guarantees`)."""

    sets: SetCalibrator
    ood_scores: np.ndarray  # (n,) outlier-oriented served scores of the calibration split, ascending
    metric: str  # the served OOD score
    ood_threshold: float  # the risk rules' OOD cut (the build's validation threshold, as served)
    rules: dict[float, float | None]  # target risk -> confidence threshold (None: none certified, accepts nothing)
    alpha: float  # defaults
    ood_alpha: float
    risk: float
    mondrian: bool
    delta: float
    drift_delta: float
    drift_bins: int
    drift_edges: np.ndarray  # (bins - 1,)
    label_free: bool  # zero-shot: the OOD score does not depend on the labels
    # the calibration confidences, the scale of the online accept rules (None: an artifact built before them)
    ranks: ConfidenceRanks | None = None
    # the set thresholds asked for so far, by (alpha, mondrian): a quantile of the sorted calibration scores is the
    # same for every request at one level, and computing it is most of a set's cost at batch 1
    _qhats: dict[tuple[float, bool], tuple[np.ndarray, bool]] = field(default_factory=dict, repr=False, compare=False)
    # set by __post_init__ from the fields above
    _cal: list[float] = field(init=False, repr=False, compare=False)
    _sign: float = field(init=False, repr=False, compare=False)
    _cut: float = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # the per-request path in Python scalars (a numpy call costs microseconds after the model ran): the sorted
        # calibration scores as a list for bisect, the risk rules' OOD cut outlier-oriented
        object.__setattr__(self, "_cal", self.ood_scores.tolist())
        object.__setattr__(self, "_sign", outlier_sign(self.metric))
        object.__setattr__(self, "_cut", self._sign * float(self.ood_threshold))

    def answer(self, scores: list[float], probs: np.ndarray | None, alpha: float, risk: float) -> Answer:
        """One request's guarantees (:class:`Answer`) of served scores ``(B,)`` and the ensemble's probabilities
        ``(B, C)`` float64 (None: no sets or risk rules for this request). The same numbers as :meth:`p_values`,
        :meth:`prediction_sets` and :meth:`accepts`."""
        n, cal, sign = len(self._cal), self._cal, self._sign
        oriented = [sign * s for s in scores]
        p = [(1.0 + n - bisect.bisect_left(cal, o)) / (n + 1.0) if o == o else math.nan for o in oriented]
        if probs is None:
            return Answer(p)
        sets, below, filled = self.prediction_sets(probs, alpha, checked=True)
        lam, cut = self.rules[risk], self._cut
        eligible = [o <= cut for o in oriented]
        if lam is None:
            return Answer(p, sets, below, filled, [False] * len(scores), eligible)
        conf = probs.max(axis=1).tolist()
        accepts = [e and c >= lam for e, c in zip(eligible, conf, strict=True)]
        return Answer(p, sets, below, filled, accepts, eligible)

    def flag_threshold(self, ood_alpha: float) -> float | None:
        """The served score's threshold of the OOD flag at ``ood_alpha``: ``p_value <= ood_alpha`` exactly when the
        score is above it (MSP: below it), so ``ood.threshold`` is the rule the flag applies. None when no score is
        flagged at this level (``ood_alpha < 1 / (n + 1)``).

        With ``c = #{s_i >= s}``, ``p = (1 + c) / (n + 1)`` is at most ``ood_alpha`` iff ``c <= k``, the largest such
        count, iff the outlier-oriented score is above the ``(n - k)``-th smallest calibration score."""
        n = len(self._cal)
        k = math.floor(ood_alpha * (n + 1)) - 1  # the same float expression as the p-value, checked both ways
        while k + 1 < n and (2.0 + k) / (n + 1.0) <= ood_alpha:
            k += 1
        while k >= 0 and (1.0 + k) / (n + 1.0) > ood_alpha:
            k -= 1
        return None if k < 0 else self._sign * self._cal[n - k - 1]

    @property
    def n(self) -> int:
        return int(self.ood_scores.shape[0])

    @property
    def min_alpha(self) -> float:
        """The smallest ``alpha`` with a finite set threshold: ``1 / (n + 1)``, with the sets' ``delta``
        ``1 - delta^(1/n)`` (per class for Mondrian: the largest class minimum)."""
        m = self.sets.min_alpha(self.mondrian)
        return float(np.max(m))

    def p_values(self, scores: np.ndarray) -> np.ndarray:
        """Conformal OOD p-values ``(B,)`` of served scores ``(B,)``: ``(1 + #{s_i >= s}) / (n + 1)``."""
        return ood_p_values(outlier_oriented(scores, self.metric), self.ood_scores)

    def prediction_sets(
        self, probs: np.ndarray, alpha: float, mondrian: bool | None = None, checked: bool = False
    ) -> tuple[np.ndarray, bool, np.ndarray]:
        """``(sets (B, C) bool, below_min_alpha, filled (B,))``: the conformal sets of ``probs (B, C)`` at ``alpha``,
        never empty (:func:`~service.core.conformal.keep_top`: ``filled`` marks the sets that were empty and got the
        prediction); ``below_min_alpha`` when ``alpha`` is below what the split supports (for some class, with
        Mondrian sets): no finite threshold exists there, so those labels are always in (marginal: every set is every
        label)."""
        m = self.mondrian if mondrian is None else mondrian
        key = (float(alpha), bool(m))
        cached = self._qhats.get(key)
        if cached is None:
            if len(self._qhats) >= QHAT_CACHE:  # requests may ask for any level: keep the cache bounded
                self._qhats.clear()
            q = np.asarray(self.sets.qhat(alpha, m))
            cached = self._qhats[key] = (q, bool(np.any(np.isinf(q))))
        sets, filled = keep_top(self.sets.sets_at(probs, cached[0], checked), probs)
        return sets, cached[1], filled

    def accepts(self, probs: np.ndarray, scores: np.ndarray, risk: float) -> np.ndarray:
        """``(B,)`` bool: the rule of target ``risk`` (certified at build time) on probabilities ``(B, C)`` and
        served OOD scores ``(B,)``: the OOD cut passed and the confidence at least the certified threshold."""
        lam = self.rules[risk]
        if lam is None:
            return np.zeros(probs.shape[0], dtype=bool)
        return self.eligible(scores) & (probs.max(axis=1) >= lam)

    def eligible(self, scores: np.ndarray) -> np.ndarray:
        """``(B,)`` bool: served OOD scores ``(B,)`` not past the risk rules' OOD cut (the build's threshold)."""
        return outlier_oriented(scores, self.metric) <= self._cut

    def monitor(self, shared: Path | None = None) -> DriftMonitor:
        """A fresh drift alarm whose reference is the calibration split's scores (:mod:`service.core.drift`); with
        ``shared``, its state in that file, shared by every process that opens it (:mod:`service.core.drift_shared`:
        the workers of one server)."""
        if shared is not None:
            from service.core.drift_shared import SharedDriftMonitor

            return SharedDriftMonitor(shared, self.ood_scores, delta=self.drift_delta)
        return DriftMonitor(self.ood_scores, delta=self.drift_delta)


def load_guarantees(root: Path, manifest: Manifest) -> Guarantees | None:
    """The artifact's guarantees (manifest ``guarantees``; None without), checked against the model: a file that
    does not fit refuses the artifact at start-up, naming it."""
    spec = manifest.guarantees
    if spec is None:
        return None
    path = Path(root) / spec.file
    try:
        t = load_file(str(path))
        sets = SetCalibrator.from_tensors(t, "conformal.", spec.conformal.delta)
        ood = t["ood.scores"].double().numpy()
        edges = t["drift.edges"].double().numpy()
        conf = t.get("selective.confidences")
        ranks = None if conf is None else ConfidenceRanks(conf.double().numpy())
    except (OSError, ValueError, KeyError) as e:
        raise ArtifactError(f"{path}: unreadable guarantees ({e})") from e
    labels = manifest.labels or []
    if sets.num_classes != len(labels):
        raise ArtifactError(f"{path}: prediction sets for {sets.num_classes} classes, the model has {len(labels)}")
    sel, o, drift = spec.selective, spec.ood, spec.drift
    if ood.shape != (sets.scores.shape[0],) or np.any(np.diff(ood) < 0):
        raise ArtifactError(f"{path}: {ood.shape[0]} OOD calibration scores (sorted) for {sets.scores.shape[0]} inputs")
    if ranks is not None and ranks.n != ood.shape[0]:
        raise ArtifactError(f"{path}: {ranks.n} calibration confidences for {ood.shape[0]} calibration inputs")
    if edges.shape != (drift.bins - 1,):
        raise ArtifactError(f"{path}: {edges.shape[0]} drift bin edges for {drift.bins} bins")
    served = manifest.uncertainty.ood_score
    if o.score != served:
        raise ArtifactError(f"{path}: OOD p-values of {o.score!r}, the artifact serves {served!r}")
    return Guarantees(
        sets=sets,
        ood_scores=ood,
        metric=served,
        ood_threshold=sel.ood_cut.threshold,
        rules={r.risk: r.threshold for r in sel.targets},
        alpha=spec.conformal.alpha,
        ood_alpha=o.alpha,
        risk=sel.default_risk,
        mondrian=spec.conformal.mondrian,
        delta=sel.delta,
        drift_delta=drift.delta,
        drift_bins=drift.bins,
        drift_edges=edges,
        label_free=o.label_free,
        ranks=ranks,
    )
