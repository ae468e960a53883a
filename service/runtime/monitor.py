"""The live monitor of one served model: its answers recorded in the prediction store, the labels that come back
applied to shared online state, and the live figures read back (docs/monitoring.md, docs/api.md "Feedback").

What it does, and when:

* **Record** (:meth:`LiveMonitor.record`, on the event loop, never blocks): every served prediction of a request
  goes to the store's writer queue (:meth:`service.store.PredictionStore.record`) under the answer's id (its
  ``X-Request-ID``) and its position in the answer. The server's own warm-up and probe inputs are not recorded.
* **Apply** (:meth:`LiveMonitor.apply`, blocking, in a worker thread: after each feedback batch and on a monitor
  read): the labelled rows after the state's cursor (the label time of the last label applied, with the answers
  labelled at that very time) are read in label order and applied, by compare-and-set of one JSON state per model
  and version in the store (:meth:`~service.store.PredictionStore.update_state`), so that every replica applies
  every label once and all see one sequence of states. The state holds three trackers of
  :mod:`service.core.online`:

  - :class:`~service.core.online.AdaptiveConformal` at the model's default ``alpha``. Each labelled answer (the
    model's own labels, not foreign) counts as a miss when its true label is outside the set rebuilt from its
    stored probabilities at the **current** ``alpha_t`` (:func:`~service.core.online.raw_misses`: a set empty
    before the top label was put in misses too). So the labels, in the order they were accepted, drive one ACI
    sequence with no label waiting (``D = 1``), and its guarantee is deterministic: for ANY sequence of answers and
    labels, ``|misses / T - alpha| <= (max(alpha_1, 1 - alpha_1) + gamma) / (gamma T)`` after ``T`` labels. Answers
    stored without probabilities (``HYDRA_STORE_PROBS=false``) count the miss of the set that was served.
    ``adaptive: true`` requests get the set at the ``alpha_t`` this replica last read (refreshed in the background
    when older than :data:`REFRESH_S`).
  - :class:`~service.core.online.HarmfulShiftAlarm` of the top label's 0/1 error (a foreign input is an error),
    with the source bound from the calibration split's errors (the manifest's ``guarantees.calibration.errors``);
    an artifact without that count has no alarm, and the monitor says why.
  - :class:`~service.core.online.QualityWindow` over the last :data:`WINDOW` labelled answers and over all.
* **Read** (:meth:`LiveMonitor.report`, blocking): the state after applying, plus the label-free accuracy estimate
  over the last :data:`WINDOW` served answers and over every stored one, read from the store then.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from service.core.guarantees import Guarantees
from service.core.online import (
    AdaptiveConformal,
    Counts,
    Figure,
    HarmfulShiftAlarm,
    Quality,
    QualityWindow,
    estimate_figure,
    raw_misses,
)
from service.core.online_risk import OnlineRisk
from service.core.recall import merge_stored
from service.metrics import Metrics
from service.store import FOREIGN, PredictionStore, Rows, records_from_items
from service.store.records import ServedItem

__all__ = ["FIGURES", "REFRESH_S", "STALE_S", "WINDOW", "LiveMonitor", "MonitorState"]

log = logging.getLogger("hydra.monitor")

WINDOW = 1_000  # answers in the recent window (issue 32: "a recent window of 1,000")
REFRESH_S = 1.0  # an adaptive request refreshes this replica's alpha_t when its copy is older than this
STALE_S = 5.0  # under the drift alarm the online rule accepts only from a copy of the shared state read this recently
# the live figures, as hydra_live_quality's `figure` label names them
FIGURES = ("accuracy", "coverage", "accepted_error", "ood_precision", "ood_recall", "estimated_accuracy")


@dataclass
class MonitorState:
    """The shared state of one model and version, as the store keeps it (one JSON value)."""

    adaptive: AdaptiveConformal | None
    alarm: HarmfulShiftAlarm | None
    window: QualityWindow
    cursor: float | None = None  # label time of the last label applied
    at_cursor: list[list[Any]] = field(default_factory=list)  # [id, index] of the labels applied at that time
    risk: dict[str, OnlineRisk] = field(default_factory=dict)  # the online accept rule of each target, by str(risk)

    def to_json(self) -> dict[str, Any]:
        return {
            "adaptive": None if self.adaptive is None else self.adaptive.to_state(),
            "alarm": None if self.alarm is None else self.alarm.to_state(),
            "window": self.window.to_state(),
            "cursor": self.cursor,
            "at_cursor": self.at_cursor,
            "risk": {k: r.to_state() for k, r in self.risk.items()},
        }

    @classmethod
    def from_json(cls, value: dict[str, Any], fresh_risk: dict[str, OnlineRisk] | None = None) -> MonitorState:
        """The state back from :meth:`to_json`; a state written before the online rules (no ``risk``) gets
        ``fresh_risk``."""
        a, h = value.get("adaptive"), value.get("alarm")
        risk = value.get("risk")
        return cls(
            adaptive=None if a is None else AdaptiveConformal.from_state(a),
            alarm=None if h is None else HarmfulShiftAlarm.from_state(h),
            window=QualityWindow.from_state(value["window"]),
            cursor=value.get("cursor"),
            at_cursor=[list(k) for k in value.get("at_cursor", [])],
            risk=dict(fresh_risk or {}) if risk is None else {k: OnlineRisk.from_state(v) for k, v in risk.items()},
        )


def _runs(mask: np.ndarray) -> list[tuple[int, int]]:
    """``(start, stop)`` of the runs of equal values in ``mask (n,)``."""
    edges = [0, *(np.flatnonzero(mask[1:] != mask[:-1]) + 1).tolist(), int(mask.size)]
    return [(a, b) for a, b in zip(edges[:-1], edges[1:], strict=True) if b > a]


def _figure(f: Figure) -> dict[str, Any]:
    return asdict(f)


class LiveMonitor:
    """One model's (and version's) live monitor over ``store`` (module docstring)."""

    def __init__(
        self,
        store: PredictionStore,
        name: str,
        version: str,
        guarantees: Guarantees | None,
        calibration_errors: int | None,
        metrics: Metrics | None = None,
    ) -> None:
        self.store, self.name, self.version = store, name, version
        self.guarantees, self.metrics = guarantees, metrics
        self.key = f"monitor/{name}/{version}"
        self.recall_key = f"recall/{name}/{version}"  # the recalls of the drift alarm's episodes (service.core.recall)
        self.calibration_errors = calibration_errors
        self._cached = self.fresh()
        self._read_at = -math.inf  # monotonic time of the last read of the shared state
        self._refreshing = threading.Lock()

    # ------------------------------------------------------------------------------------------------ recalls
    def keep_recall(self, run: str, started_at: int, changed_at: int, answers: list[Any], incomplete: bool) -> None:
        """Add recalled answers to the store's list (every replica's, across restarts), in the background: a store
        that is down never slows an answer (the recall stays in the server's own book)."""

        def run_() -> None:
            try:
                self.store.update_state(
                    self.recall_key, lambda v: merge_stored(v, run, started_at, changed_at, answers, incomplete)
                )
            except Exception as e:
                log.warning("%s: the recall of the episode at input %d was not stored (%s)", self.name, started_at, e)

        threading.Thread(target=run_, name=f"recall-{self.name}", daemon=True).start()

    def stored_recalls(self) -> list[dict[str, Any]]:
        """The store's recall list, oldest first (blocking; :class:`StoreUnavailable` when the database is down)."""
        entry = self.store.get_state(self.recall_key)
        return list(entry.value) if entry is not None and isinstance(entry.value, list) else []

    # ------------------------------------------------------------------------------------------------ state
    def fresh(self) -> MonitorState:
        """The state before any label: ACI at ``alpha_1 = alpha``, the alarm (or None), empty windows."""
        g = self.guarantees
        adaptive = AdaptiveConformal(g.alpha) if g is not None else None
        return MonitorState(adaptive, self._new_alarm(), QualityWindow(WINDOW), risk=self._new_rules())

    def _new_rules(self) -> dict[str, OnlineRisk]:
        """A fresh online accept rule per target risk of the model, each at its certified threshold."""
        g = self.guarantees
        if g is None or g.ranks is None:  # an artifact built before the online rules: none
            return {}
        return {str(r): OnlineRisk.starting_at(r, lam, g.ranks) for r, lam in sorted(g.rules.items())}

    def _state(self, value: Any) -> MonitorState:
        return self.fresh() if value is None else MonitorState.from_json(value, self._new_rules())

    def _new_alarm(self) -> HarmfulShiftAlarm | None:
        g, k = self.guarantees, self.calibration_errors
        return HarmfulShiftAlarm.from_errors(k, g.n) if g is not None and k is not None else None

    @property
    def alarm_unavailable(self) -> str | None:
        """Why there is no harmful-shift alarm (None: there is one)."""
        if self.guarantees is None:
            return "the model was built without a calibration split: no source risk to compare with"
        if self.calibration_errors is None:
            return (
                "the artifact's manifest does not record the calibration split's errors "
                "(guarantees.calibration.errors): rebuild it to get the alarm"
            )
        return None

    @property
    def state(self) -> MonitorState:
        """This replica's last copy of the shared state."""
        return self._cached

    # ----------------------------------------------------------------------------------------------- record
    def record(
        self, answer_id: str, results: Sequence[ServedItem], labels: Sequence[str] | None, adaptive: bool
    ) -> None:
        """Queue one answer's predictions for the store (never blocks; ``labels``: a zero-shot request's own)."""
        records = records_from_items(
            answer_id, self.name, self.version, results, labels=labels, adaptive=adaptive, probs=self.store.config.probs
        )
        self.store.record(records)

    def adaptive_sets(self, probs: np.ndarray) -> tuple[np.ndarray, np.ndarray, float]:
        """``(sets (B, C), filled (B,), alpha_t)`` of ``probs (B, C)`` at this replica's ``alpha_t``."""
        g, a = self.guarantees, self._cached.adaptive
        assert g is not None and a is not None
        self.refresh()
        return a.sets(g.sets, probs, g.mondrian)

    def online_rule(self, risk: float) -> OnlineRisk | None:
        """This replica's copy of the online accept rule of target ``risk`` (None: not one of the model's targets);
        read again in the background when older than :data:`REFRESH_S`."""
        self.refresh()
        return self._cached.risk.get(str(risk))

    @property
    def age(self) -> float:
        """Seconds since this replica last read the shared state (``inf`` before the first read)."""
        return time.monotonic() - self._read_at

    def refresh(self) -> None:
        """Read the shared state again in the background when this replica's copy is older than :data:`REFRESH_S`."""
        if self.age > REFRESH_S:
            self._refresh_in_background()

    def _refresh_in_background(self) -> None:
        if not self._refreshing.acquire(blocking=False):
            return

        def run() -> None:
            try:
                self.apply()
            except Exception as e:  # the store is down: keep the copy; the next adaptive request tries again
                log.warning("%s: monitor state not refreshed (%s)", self.name, e)
            finally:
                self._refreshing.release()

        threading.Thread(target=run, name=f"monitor-{self.name}", daemon=True).start()

    # ------------------------------------------------------------------------------------------------ apply
    def _new_rows(self, st: MonitorState) -> tuple[Rows, np.ndarray]:
        """The labelled rows from the cursor on, and ``(n,)`` bool: those not applied yet."""
        rows = self.store.labelled(self.name, self.version, since=st.cursor)
        done = {(k[0], int(k[1])) for k in st.at_cursor}
        keep = np.array(
            [(i, int(j)) not in done for i, j in zip(rows.ids, rows.index, strict=True)], dtype=bool
        ).reshape(-1)
        return rows, keep

    def _apply_rows(self, st: MonitorState, rows: Rows) -> None:
        """Apply labelled ``rows`` (label order) to the three trackers of ``st``."""
        foreign = rows.foreign
        if st.adaptive is not None and self.guarantees is not None:
            st.adaptive.update(self._misses(st.adaptive, rows, self.guarantees))
        g = self.guarantees
        if st.risk and g is not None and g.ranks is not None:
            take = rows.has_accept  # answers a risk rule decided (the model's own labels, or foreign ones)
            ranks, wrong = g.ranks.rank(rows.confidence[take]), ~rows.correct[take]
            eligible = g.eligible(rows.ood_score[take])
            for rule in st.risk.values():
                rule.update(ranks, wrong, eligible)
        if st.alarm is not None:
            st.alarm.update((~rows.correct).astype(np.float64))
        for a, b in _runs(rows.has_set):
            st.window.labelled(
                rows.correct[a:b],
                np.clip(rows.confidence[a:b], 0.0, 1.0),
                rows.ood_flag[a:b],
                foreign[a:b],
                covered=rows.covered[a:b] if rows.has_set[a] else None,
                accepted=rows.accept[a:b] & rows.has_accept[a:b],
            )
        t = rows.label_time
        last = float(t[-1])
        at = [[i, int(j)] for i, j, tt in zip(rows.ids, rows.index, t, strict=True) if tt == last]
        st.at_cursor = (st.at_cursor + at) if st.cursor == last else at
        st.cursor = last

    def _misses(self, aci: AdaptiveConformal, rows: Rows, g: Guarantees) -> np.ndarray:
        """``err_t`` of the labelled answers ACI takes (own labels, a set served, not foreign), one at a time: the
        set rebuilt at the current ``alpha_t`` from the stored probabilities, else the served set's miss."""
        take = rows.has_set & (rows.label != FOREIGN)
        probs = rows.probs if rows.probs is not None and rows.probs.shape[1] == g.sets.num_classes else None
        out: list[bool] = []
        probe = AdaptiveConformal(aci.alpha, aci.gamma, aci.alpha_1, aci.labelled, aci.misses)
        for i in np.flatnonzero(take).tolist():
            if probs is None:
                miss = not bool(rows.covered[i])
            else:
                p = probs[i : i + 1].astype(np.float64)  # (1, C)
                sets, filled, _ = probe.sets(g.sets, p, g.mondrian)
                miss = bool(raw_misses(sets[:, int(rows.label[i])], filled)[0])
            probe.update([miss])
            out.append(miss)
        return np.array(out, dtype=bool)

    def apply(self) -> MonitorState:
        """Apply every label not applied yet to the shared state (blocking; :class:`StoreUnavailable` when the
        database is down) and keep a copy; the state."""
        entry = self.store.get_state(self.key)
        st = self._state(None if entry is None else entry.value)
        _, keep = self._new_rows(st)
        if keep.any():

            def change(value: Any) -> dict[str, Any]:
                cur = self._state(value)
                rows, new = self._new_rows(cur)
                if new.any():
                    self._apply_rows(cur, _select(rows, new))
                return cur.to_json()

            st = self._state(self.store.update_state(self.key, change).value)
        self._cached, self._read_at = st, time.monotonic()
        self.publish()
        return st

    # ------------------------------------------------------------------------------------------------- read
    def report(self, drift_alarm_at: int | None = None) -> dict[str, Any]:
        """The live figures now (docs/api.md, ``GET /v1/models/{name}/monitor``), blocking. ``drift_alarm_at``: the
        input at which the model's drift alarm went on, while it is on: the label-free estimate is then withheld
        (``estimate.reliable`` false, its figures null, its gauges NaN). It trusts the model's probabilities, which a
        shift makes overconfident, so it reads too high exactly then."""
        st = self.apply()
        recent_served = self.store.served(self.name, self.version, last=WINDOW)
        n, total, var = self.store.confidence_sums(self.name, self.version)
        recent = _with_estimate(st.window.window(), _served_counts(recent_served))
        overall = _with_estimate(st.window.overall(), Counts(served=n, served_sum=total, served_var=var))
        why = None
        if drift_alarm_at is not None:
            why = (
                f"the drift alarm is on since input {drift_alarm_at}: the traffic is not like the calibration "
                "split, and the label-free estimate (the mean confidence) reads too high under such a shift; "
                "read the labelled figures"
            )
            recent, overall = _withheld(recent), _withheld(overall)
        self.publish(recent, overall, estimate_withheld=why is not None)
        return {
            "model": self.name,
            "version": self.version,
            "labelled": overall.labelled,
            "accuracy": overall.accuracy.value,
            "coverage": overall.coverage.value,
            "estimated_accuracy": overall.estimated_accuracy.value,
            "estimate": {"reliable": why is None, "reason": why},
            "coverage_target": None if self.guarantees is None else 1 - self.guarantees.alpha,
            "windows": {"recent": _quality_json(recent, WINDOW), "all": _quality_json(overall, None)},
            "adaptive": self._adaptive_json(st),
            "online_risk": {k: _rule_json(r, self.guarantees) for k, r in st.risk.items()}
            if self.guarantees is not None
            else {},
            "harmful_shift": self._alarm_json(st),
        }

    def _adaptive_json(self, st: MonitorState) -> dict[str, Any] | None:
        a = st.adaptive
        if a is None:
            return None
        return {
            "alpha": a.alpha,
            "alpha_t": a.alpha_t,
            "gamma": a.gamma,
            "alpha_1": a.alpha_1,
            "labels_applied": a.labelled,
            "misses": a.misses,
            "miscoverage": a.miscoverage,
            "bound": None if a.labelled == 0 else a.bound(1),
        }

    def _alarm_json(self, st: MonitorState) -> dict[str, Any]:
        h = st.alarm
        if h is None:
            return {"available": False, "reason": self.alarm_unavailable}
        return {
            "available": True,
            "alarm": h.alarm,
            "alarm_at": h.alarm_at,
            "threshold": h.threshold,
            "source_upper": h.source_upper,
            "tolerance": h.tolerance,
            "delta": h.delta_test * 2,
            "risk": h.risk,
            "labelled": h.labelled,
            "statistic": h.log_statistic / math.log(10),  # log10 of the test's capital
            "alarm_level": -math.log10(h.delta_test),
        }

    # ---------------------------------------------------------------------------------------------- metrics
    def publish(
        self, recent: Quality | None = None, overall: Quality | None = None, estimate_withheld: bool = False
    ) -> None:
        """Set this model's live gauges from the cached state (and the figures, when given; ``estimate_withheld``:
        the label-free estimate's gauges are NaN, under the drift alarm)."""
        m, st = self.metrics, self._cached
        if m is None:
            return
        recent = recent or st.window.window()
        overall = overall or st.window.overall()
        m.labelled_predictions.labels(self.name).set(overall.labelled)
        for window, q in (("recent", recent), ("all", overall)):
            for fig in FIGURES:
                f: Figure = getattr(q, fig)
                if f.value is None and fig == "estimated_accuracy" and not estimate_withheld:
                    continue  # not read from the store here: keep the last value
                for bound in ("value", "low", "high"):
                    v = getattr(f, bound)
                    m.live_quality.labels(self.name, fig, window, bound).set(math.nan if v is None else v)
        if self.guarantees is not None:
            m.coverage_target.labels(self.name).set(1 - self.guarantees.alpha)
        if st.adaptive is not None:
            m.adaptive_alpha.labels(self.name).set(st.adaptive.alpha_t)
        if st.alarm is not None:
            m.harmful_shift_alarm.labels(self.name).set(1 if st.alarm.alarm else 0)
            m.harmful_shift_statistic.labels(self.name).set(st.alarm.log_statistic / math.log(10))


def _select(rows: Rows, keep: np.ndarray) -> Rows:
    """The rows where ``keep (n,)`` holds."""
    idx = np.flatnonzero(keep)
    out: dict[str, Any] = {}
    for name, value in vars(rows).items():
        if isinstance(value, list):
            out[name] = [value[i] for i in idx.tolist()]
        elif isinstance(value, np.ndarray):
            out[name] = value[idx]
        else:
            out[name] = value
    return Rows(**out)


def _rule_json(r: OnlineRisk, g: Guarantees) -> dict[str, Any]:
    """One online accept rule as ``GET /v1/models/{name}/monitor`` shows it."""
    assert g.ranks is not None
    return {
        "risk": r.risk,
        "threshold": g.ranks.threshold(r.level),
        "level": r.level,
        "gamma": r.gamma,
        "labels_applied": r.labelled,
        "accepted": r.accepted,
        "errors": r.errors,
        "error_rate": r.error_rate,
        "bound": None if r.accepted == 0 else r.bound(1),
    }


def _withheld(q: Quality) -> Quality:
    """``q`` with its label-free estimate (and the estimate's error against the labels) withheld: no value."""
    keys = ("estimated_accuracy", "estimated_on_labelled", "estimate_error")
    none = {k: Figure(None, None, None, getattr(q, k).n) for k in keys}
    return Quality(**{**{k: getattr(q, k) for k in q.__dataclass_fields__}, **none})


def _served_counts(rows: Rows) -> Counts:
    p = np.clip(rows.confidence, 0.0, 1.0)
    return Counts(served=rows.n, served_sum=float(p.sum()), served_var=float((p * (1 - p)).sum()))


def _with_estimate(q: Quality, served: Counts) -> Quality:
    """``q`` with its label-free estimate from ``served``'s sums."""
    est = estimate_figure(served.served_sum, served.served_var, served.served)
    return Quality(
        **{**{k: getattr(q, k) for k in q.__dataclass_fields__}, "served": served.served, "estimated_accuracy": est}
    )


def _quality_json(q: Quality, size: int | None) -> dict[str, Any]:
    return {
        "size": size,
        "labelled": q.labelled,
        "served": q.served,
        **{k: _figure(getattr(q, k)) for k in FIGURES},
        "estimated_on_labelled": _figure(q.estimated_on_labelled),
        "estimate_error": _figure(q.estimate_error),
    }
