"""What a runtime is asked (:class:`Query`) and what it answers (:class:`Outcome`: per-input uncertainty and
guarantees, :class:`ItemResult`): plain data, shared by the runtimes, the guarantees' path and the protocols."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from service.core.artifact import DEFAULT_TEMPLATE
from service.runtime.batching import BatchResult

__all__ = ["ItemResult", "Outcome", "Query"]


@dataclass
class ItemResult:
    """Uncertainty of one input, from its member logits ``(M, C)``."""

    probs: np.ndarray  # (C,) ensemble probabilities
    member_probs: np.ndarray  # (M, C)
    prediction: int
    msp: float
    entropy: float
    expected_entropy: float
    mutual_information: float
    disagreement: float
    ood_score: float
    ood_flag: bool
    scores: dict[str, float] | None = None  # every OOD score computed for this input (return_scores)
    # this input's rows of the model's outputs (logits, features, layer features), kept while only the served score
    # was computed, so that a request asking for every score gets them (service.runtime.interface.fill_scores)
    outputs: tuple[Any, Any, Any] | None = None
    # the guarantees (models with a calibration split; Runtime.outcome sets them for the request's levels)
    p_value: float | None = None  # conformal OOD p-value; ood_flag is then p_value <= ood_alpha
    ood_alpha: float | None = None
    flag_threshold: float | None = None  # the score threshold equivalent to p_value <= ood_alpha (None: never)
    prediction_set: np.ndarray | None = None  # (C,) bool, never empty
    set_alpha: float | None = None
    below_min_alpha: bool = False
    set_filled: bool = False  # no label passed the set's threshold: the set is the prediction alone
    accept: bool | None = None  # the risk rule of target ``risk``
    risk: float | None = None
    alpha_t: float | None = None  # the set is the adaptive one, built at this level (request option adaptive)
    # the drift alarm's word on the guarantees (HYDRA_DRIFT_POLICY): suspended while it is on (None: no guarantees)
    suspended: bool | None = None
    alarm_at: int | None = None  # the input at which the alarm went on, while it is on
    drift_input: int | None = None  # this input's number in the alarm's stream (None: not fed, or policy off)
    rule: str | None = None  # which accept rule decided: "certified" (the build's) or "online" (adaptive requests)
    rule_threshold: float | None = None  # that rule's confidence threshold now (None: it accepts nothing)
    abstain: str | None = None  # why the answer is not accepted whatever its confidence (the alarm), None else


@dataclass
class Outcome:
    """One request through the model: a result per input, in order, over ``labels``, and its batch timings."""

    results: list[ItemResult]
    labels: list[str]  # the model's own labels, or a zero-shot request's
    batch: BatchResult


@dataclass(frozen=True)
class Query:
    """What a request asks of a runtime besides its inputs."""

    top_k: int = 5
    return_members: bool = False
    # zero-shot: the request's candidate labels and prompt template; None: the model's own labels (/predict)
    labels: list[str] | None = None
    template: str = DEFAULT_TEMPLATE
    return_scores: bool = False  # add every OOD score computed to the answer
    alpha: float | None = None  # the prediction sets' miscoverage (None: the model's default)
    ood_alpha: float | None = None  # the OOD flag's level (None: the model's default)
    risk: float | None = None  # the risk target of selective.accept (None: the model's default)
    monitor: bool = True  # feed the drift test (False: the server's own warm-up and probe inputs)
    adaptive: bool = False  # the prediction sets of the online (adaptive) method (service.runtime.monitor)
