"""The guarantees of each answer, as a runtime applies them after the model ran: the request's OOD p-values and flag,
prediction sets and risk decision, what the drift alarm says of them now (``HYDRA_DRIFT_POLICY``), the online accept
rule of adaptive requests, and the guarantees' metrics (docs/api.md "Guarantees" and "The drift alarm and the
answers").

:class:`GuaranteedAnswers` is a part of :class:`service.runtime.interface.Runtime`: it reads the runtime's
``guarantees``, ``drift`` (the alarm, fed on the request path while the policy reads it), ``monitor`` (the shared
online state) and ``settings``, and writes each :class:`~service.runtime.results.ItemResult`'s guarantee fields.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import numpy as np

from service.core.drift import DriftFeed, DriftMonitor
from service.core.drift_shared import DriftStateError
from service.core.errors import InvalidInput, NotReady
from service.core.guarantees import Answer, Guarantees, outlier_oriented
from service.core.online_risk import OnlineRisk
from service.core.recall import Answered, AnswerLog, RecallBook
from service.core.scores import outlier_sign
from service.fleet import server_run
from service.metrics import Metrics
from service.runtime.monitor import STALE_S, LiveMonitor
from service.runtime.results import ItemResult, Query
from service.settings import Settings
from service.webhook import AlarmWebhook, webhook_for

__all__ = ["GuaranteedAnswers"]

log = logging.getLogger("hydra.runtime")
recall_log = logging.getLogger("hydra.predictions")  # the prediction log: each recalled answer marked there


class GuaranteedAnswers:
    """The guarantees' path of a runtime (module docstring); the runtime sets the attributes below."""

    name: str
    settings: Settings
    metrics: Metrics | None
    guarantees: Guarantees | None
    drift: DriftFeed | None
    drift_error: str | None
    monitor: LiveMonitor | None
    _children: dict[tuple[str, ...], Any]
    _drift_episodes: int
    _fed_to: int | None  # the alarm's input count right after this request's inputs went in
    _answers: AnswerLog  # this process's answers given while the alarm was off
    recall_book: RecallBook
    webhook: AlarmWebhook | None  # HYDRA_ALARM_WEBHOOK (service.webhook)
    version: str
    _recall_marks: tuple[int, int | None] | None  # the episode whose recall this process has listed
    # (alarm_at, labels the online rules had then) of the last drift alarm episode an answer saw
    _alarm_mark: tuple[int | None, int]

    def sets_hold(self, query: Query) -> bool:
        """Whether the prediction sets and risk rules hold for this request (the calibration's labels); a runtime
        whose requests may bring other labels says no for those (zero-shot)."""
        return True

    def _guarantees(self, results: list[ItemResult], query: Query) -> None:
        """Each result's OOD p-value and flag at the request's level, prediction set and risk decision, and what the
        drift alarm says of them now (:meth:`_alarm_now`, this request's inputs taken into it first, unless the
        policy is ``off``). The guarantees' metrics need none of the answer: they are updated after it."""
        g = self.guarantees
        assert g is not None
        scores = [r.ood_score for r in results]
        ood_alpha = g.ood_alpha if query.ood_alpha is None else query.ood_alpha
        alpha = g.alpha if query.alpha is None else query.alpha
        risk = g.risk if query.risk is None else query.risk
        probs = None
        if self.sets_hold(query):  # (B, C) float64
            probs = results[0].probs[None, :] if len(results) == 1 else np.stack([r.probs for r in results])
            probs = probs.astype(np.float64, copy=False)
        ans = g.answer(scores, probs, alpha, risk)
        p_list, sets, accepted = ans.p_values, ans.sets, ans.accepts
        alarm_at = self._alarm_now(scores, query)
        last = self._fed_to if query.monitor else None  # this request's inputs are the last fed: their numbers
        unread = self.drift_error  # the shared alarm could not be read: nothing is certified
        alpha_t, rule, lam, abstain = None, "certified", g.rules[risk], None
        withheld = 0
        if query.adaptive and self.monitor is not None and probs is not None:  # check_query: sets hold
            sets, filled, alpha_t = self.monitor.adaptive_sets(probs)
            ans = Answer(p_list, sets, False, filled, accepted, ans.eligible)
            online = self.monitor.online_rule(risk)
            if online is not None:  # None: an artifact built before the online rules (no calibration confidences)
                rule = "online"
                accepted, lam, abstain = self._online(online, probs, ans.eligible, alarm_at)
        if unread is not None and accepted is not None:
            withheld = sum(accepted)
            accepted = [False] * len(results)
            abstain = f"the drift alarm's state cannot be read ({unread}): nothing is accepted until it can"
        elif rule == "certified" and alarm_at is not None and accepted is not None and self._abstains:
            withheld = sum(accepted)
            accepted = [False] * len(results)
            abstain = (
                f"the drift alarm is on since input {alarm_at}: the traffic is not like the calibration split, so the "
                "certified rule does not hold now and accepts nothing until the alarm clears (adaptive requests get "
                "the online rule, once labels come back through the feedback route)"
            )
        cut = g.flag_threshold(ood_alpha)
        suspended = alarm_at is not None or unread is not None
        for i, r in enumerate(results):
            r.p_value, r.ood_alpha, r.ood_flag, r.flag_threshold = p_list[i], ood_alpha, p_list[i] <= ood_alpha, cut
            r.suspended, r.alarm_at = suspended, alarm_at
            r.drift_input = None if last is None else last - len(results) + 1 + i
            if sets is not None and accepted is not None and ans.filled is not None:
                r.prediction_set, r.set_alpha, r.below_min_alpha = sets[i], alpha, ans.below_min_alpha
                r.set_filled = bool(ans.filled[i])
                r.accept, r.risk, r.alpha_t = accepted[i], risk, alpha_t
                r.rule, r.rule_threshold, r.abstain = rule, lam, abstain
        record = (scores if query.monitor and self._lazy_drift else None, p_list, sets, accepted)
        try:  # after the answer: the loop runs it once this request's task yields (while the model runs others)
            asyncio.get_running_loop().call_soon(self._record, *record, risk, suspended, withheld)
        except RuntimeError:  # no event loop (a direct call): now
            self._record(*record, risk, suspended, withheld)

    @property
    def _lazy_drift(self) -> bool:
        """Whether the drift alarm is fed after the answer, in chunks (policy ``off``: no answer reads it)."""
        return self.settings.drift_policy == "off"

    def _alarm_now(self, scores: list[float], query: Query) -> int | None:
        """The input at which the drift alarm went on, if it is on now and the policy lets it speak (None: off, or
        ``HYDRA_DRIFT_POLICY=off``). This request's scores go into the alarm first (not the server's own warm-up and
        probe inputs), so the answer that turns it on is the first it suspends."""
        self._fed_to = None
        if self.drift is None or self._lazy_drift:
            return None
        g = self.guarantees
        assert g is not None
        try:
            if query.monitor:
                sign = outlier_sign(g.metric)  # outlier-oriented: MSP negated
                self.drift.add([sign * s for s in scores])
            monitor = self.drift.flush(notify=False)  # the metrics follow at the next scrape (refresh_drift)
            at, self._fed_to = monitor.alarm_at, monitor.count
        except DriftStateError as e:
            self._drift_failed(e)
            return None
        self.drift_error = None
        if at is not None and self.monitor is not None and self._alarm_mark[0] != at:
            # a new episode: the online rule takes labels from here (its copy read again now, in the background)
            rules = self.monitor.state.risk
            self._alarm_mark = (at, max((r.labelled for r in rules.values()), default=0))
            self.monitor.refresh()
        return at

    @property
    def _abstains(self) -> bool:
        """Whether answers abstain from accepting while the drift alarm is on (``HYDRA_DRIFT_POLICY=abstain``)."""
        return self.settings.drift_policy == "abstain"

    def _online(
        self, rule: OnlineRisk, probs: np.ndarray, eligible: list[bool] | None, alarm_at: int | None
    ) -> tuple[list[bool], float | None, str | None]:
        """The online accept rule ``rule`` on ``probs (B, C)``: ``(accepts, its confidence threshold, why it
        abstains)``. Under the drift alarm (policy ``abstain``) it accepts only once labels came back since the alarm
        went on, and only from a copy of the shared state read within :data:`~service.runtime.monitor.STALE_S`
        seconds: a prediction store that is down keeps the answers abstaining."""
        g, mon = self.guarantees, self.monitor
        assert g is not None and g.ranks is not None and mon is not None
        b = probs.shape[0]
        lam = g.ranks.threshold(rule.level)
        if alarm_at is not None and self._abstains:
            since = f"the drift alarm is on since input {alarm_at}"
            if mon.age > STALE_S:
                why = (
                    f"{since}, and the online rule's state could not be read from the prediction store for "
                    f"{mon.age:.0f} s: nothing is accepted until it can"
                )
                return [False] * b, lam, why
            if rule.labelled <= self._alarm_mark[1]:
                why = f"{since}, and no label has come back since: nothing is accepted until labels do"
                return [False] * b, lam, why
        accepts = rule.accepts(g.ranks.rank(probs.max(axis=1)), eligible).tolist()
        return accepts, lam, None

    def _record(
        self,
        scores: list[float] | None,
        p: list[float],
        sets: np.ndarray | None,
        accepted: list[bool] | None,
        risk: float,
        suspended: bool = False,
        withheld: int = 0,
    ) -> None:
        """The drift test fed when no answer reads it (``scores``; None for the server's own warm-up and probe inputs,
        and when :meth:`_alarm_now` fed it already) and the guarantees' metrics: p-values, set sizes, accept
        decisions, answers given while the alarm suspended the guarantees (``withheld`` of them would have been
        accepted)."""
        g = self.guarantees
        if g is None:
            return
        if scores is not None and self.drift is not None:
            try:
                self.drift.add(outlier_oriented(np.asarray(scores, dtype=np.float64), g.metric))
            except DriftStateError as e:
                self._drift_failed(e)
        if self.metrics is None:
            return
        p_hist = self._child("ood_p_value")
        for v in p:
            p_hist.observe(v)
        if sets is not None and accepted is not None:
            size_hist = self._child("set_size")
            for n_labels in sets.sum(axis=1).tolist():
                size_hist.observe(n_labels)
            n_acc = sum(accepted)
            if n_acc:
                self._child("selective", str(risk), "true").inc(n_acc)
            if len(accepted) - n_acc:
                self._child("selective", str(risk), "false").inc(len(accepted) - n_acc)
        if suspended:
            if withheld:
                self._child("suspended", "true").inc(withheld)
            if len(p) - withheld:
                self._child("suspended", "false").inc(len(p) - withheld)

    def _child(self, metric: str, *labels: str) -> Any:
        """The metric ``metric`` of this model with the further ``labels`` (prometheus_client's lookup costs
        microseconds a call, so each child is looked up once)."""
        key = (metric, *labels)
        child = self._children.get(key)
        if child is None:
            assert self.metrics is not None
            child = self._children[key] = getattr(self.metrics, metric).labels(self.name, *labels)
        return child

    def _drift_metrics(self, monitor: DriftMonitor) -> None:
        """The drift gauges and episode counter after the monitor advanced (or was reset)."""
        if self.metrics is not None:
            self._child("drift_alarm").set(1 if monitor.alarm else 0)
            self._child("drift_statistic").set(monitor.log10_statistic)
            self._child("drift_inputs").set(monitor.count)
            started = monitor.episodes_started_here - self._drift_episodes  # summed over workers
            self._child("drift_episodes").inc(started)  # 0 too: the series exists from start-up
            self._drift_episodes += started

    # ----------------------------------------------------------------------------------------- the recall
    def _init_recall(self, shared: Path | None) -> None:
        """The answers given while the alarm is off and the recalls of its episodes (service.core.recall), shared by
        the workers in a file beside the alarm's state ``shared``; the alarm's webhook (``HYDRA_ALARM_WEBHOOK``)."""
        self._fed_to = None
        self._answers = AnswerLog()
        self.recall_book = RecallBook(None if shared is None else shared.with_suffix(".recall"), run=server_run())
        self._recall_marks = None
        hook, header = self.settings.alarm_webhook, self.settings.alarm_webhook_header
        self.webhook = webhook_for(
            hook.get_secret_value() if hook else None, header.get_secret_value() if header else None
        )

    def note_answers(self, request_id: str, results: list[ItemResult]) -> None:
        """Keep this request's answers given while the alarm was off, for a recall (:mod:`service.core.recall`); list
        them at once if the latest episode's window holds them (an answer recorded after its episode was seen)."""
        if self.drift is None:
            return
        answers = [
            Answered(r.drift_input, request_id, i, r.accept)
            for i, r in enumerate(results)
            if r.drift_input is not None and not r.suspended
        ]
        self._answers.add(answers)
        self._check_recall(answers)

    def _check_recall(self, new: list[Answered]) -> None:
        """On a new alarm episode, list this process's answers of its window; later, the late ones among ``new``."""
        assert self.drift is not None
        marks = self.drift.monitor.last_marks
        if marks is None or marks[1] is None:
            return
        started, changed = marks[0], marks[1]
        if marks != self._recall_marks:
            self._recall_marks = marks
            got, incomplete = self._answers.window(changed, started)
            self._publish_recall(started, changed, got, incomplete)
        else:
            late = [a for a in new if changed <= a.input < started]
            if late:
                self._publish_recall(started, changed, late, False)

    def _publish_recall(self, started: int, changed: int, answers: list[Answered], incomplete: bool) -> None:
        """Add to the recall book; count, log and store the answers it did not list yet."""
        try:
            new = self.recall_book.add(started, changed, answers, incomplete)
        except OSError as e:  # the shared file: the recall is advice, the answers go on
            log.error("%s: the recall of the episode at input %d could not be written: %s", self.name, started, e)
            return
        if self.metrics is not None:
            for flag in (True, False):
                n = sum(1 for a in new if bool(a.accepted) is flag)
                if n:
                    self._child("drift_recalled", "true" if flag else "false").inc(n)
        log.warning(
            "%s: the drift alarm went on at input %d; the shift is estimated to have begun at input %d: %d answers "
            "given in between are recalled here (%d accepted)",
            self.name,
            started,
            changed,
            len(new),
            sum(1 for a in new if a.accepted),
        )
        for a in new:
            fields = {"model": self.name, "recalled": True, "alarm_at": started, "changed_at": changed}
            recall_log.warning("recalled %s[%d]", a.id, a.index, extra={**fields, **a.as_dict()})
        if self.monitor is not None and new:
            self.monitor.keep_recall(self.recall_book.run, started, changed, new, incomplete)
        if self.webhook is not None and new:
            self.webhook.post(
                {
                    "event": "drift_alarm",
                    "model": self.name,
                    "version": self.version,
                    "run": self.recall_book.run,
                    "alarm_at": started,
                    "changed_at": changed,
                    "recalled": [a.as_dict() for a in new],
                    "incomplete": incomplete,
                }
            )

    def recalls(self) -> list[dict[str, Any]]:
        """The recalls of the last episodes (oldest first), every worker's that has seen its episode."""
        if self.drift is None:
            return []
        self._check_recall([])
        return [r.as_dict() for r in self.recall_book.recalls()]

    def refresh_drift(self) -> None:
        """Take the buffered inputs into the drift alarm, so that its metrics are those of every input served (a
        ``/metrics`` scrape; fewer than ``DriftFeed.every`` inputs wait there, so this is short)."""
        if self.drift is not None:
            try:
                self.drift.flush()
            except DriftStateError as e:
                self._drift_failed(e)

    def _drift_failed(self, e: DriftStateError) -> None:
        """The shared drift state could not be read: answers abstain and the server is not ready until it can."""
        if self.drift_error is None:
            log.error("%s: %s; answers abstain and /readyz answers 503 until it can be read", self.name, e)
        self.drift_error = str(e)

    def reset_drift(self) -> dict[str, Any]:
        """Restart the drift alarm's statistic (after an investigation): an open alarm episode closes, the history and
        the input count go on."""
        if self.drift is None:
            raise InvalidInput(
                f"model {self.name!r} has no drift test (it was built without a calibration split)", status=409
            )
        before = self.drift_state()
        try:
            self.drift.reset()
        except DriftStateError as e:
            self._drift_failed(e)
            raise NotReady(f"model {self.name!r}: {e}") from e
        return {"model": self.name, "before": before, "after": self.drift_state()}

    def drift_state(self, answers: bool = True) -> dict[str, Any] | None:
        """The drift alarm now (:meth:`service.core.drift.DriftMonitor.state`), every input served included, with the
        recalls of its last episodes (``recalled``; without their ``answers`` unless ``answers``: the model list
        carries the counts, the drift route the lists)."""
        if self.drift is None:
            return None
        try:
            state = self.drift.flush().state()
        except DriftStateError as e:
            self._drift_failed(e)
            raise NotReady(f"model {self.name!r}: {e}") from e
        recalled = self.recalls()
        if not answers:
            recalled = [{k: v for k, v in r.items() if k != "answers"} for r in recalled]
        return {**state, "recalled": recalled}
