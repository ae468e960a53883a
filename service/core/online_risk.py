"""Online selective risk control: the accept rule's confidence threshold moved by every label that comes back.

The certified rule of :mod:`service.core.selective` ("accept when the OOD cut is passed and the confidence is at
least ``lambda``") holds its risk bound only while traffic is exchangeable with the calibration split. Under a shift
its error among accepted answers can be anything. The online rule keeps the same form and moves its threshold with
the labels, as conformal PID control's quantile tracker moves a set's threshold (Angelopoulos, Candes & Tibshirani
2023, "Conformal PID control for time series prediction"; Feldman et al. 2023, "Achieving risk control in online
learning settings", for a risk): each labelled answer that the rule accepts at the current level moves it by

    u_{t+1} = u_t + gamma * (wrong_t - r)

up by ``gamma (1 - r)`` after a wrong answer, down by ``gamma r`` after a right one; answers it does not accept
leave it alone. The loss ``accept_t * (wrong_t - r)`` is the selective risk's own: its sum is ``E - r N``, with
``N`` the accepted labelled answers and ``E`` the wrong ones among them, so the level is

    u_t = u_1 + gamma * (E - r N)

two counts, whatever the order the labels came in (the state, like :class:`~service.core.online.
AdaptiveConformal`'s).

**The scale.** The level is a rank among the calibration split's confidences: an answer of confidence ``c`` has rank
``q(c) = #{calibration confidences <= c} / (n + 1)`` in ``[0, n / (n + 1)]``, and the rule accepts it when it is
eligible (the OOD cut passed) and ``q(c) >= u_t``. Starting at ``u_1 = q(lambda)``, the rank of the certified
threshold (itself a calibration confidence), it accepts exactly what the certified rule accepts. On this scale one
step is the same share of answers for every model: a sentiment model whose confidences end at 0.95 and an image model
whose end at 0.99 move alike (on the confidence or its logit a step that suits one sticks the other above all its
confidences).

**Guarantee** (deterministic: nothing is random; it holds for ANY sequence of inputs and labels, under any shift,
an adversary's too). An answer is accepted only when ``q(c) >= u_t``, and ``q(c) < 1``, so a step up starts below
1 and ``u`` never exceeds ``1 + gamma (1 - r) D``, with ``D`` the most answers ever waiting at once for their label
(``D = 1`` when each label is decided at the level current when it comes back, as :meth:`OnlineRisk.update` does).
Telescoping the update::

    E / N  <=  r + (1 + gamma (1 - r) D - u_1) / (gamma N)

after ``N`` accepted labelled answers: the error among accepted answers over the labelled stream tends to at most
``r``, at a rate ``1 / N``. It bounds the average over the stream, not any one answer's chance of error. It holds for
the decisions taken at the level of each label's time, which are the served ones when labels come back before the
next answer. Foreign inputs (labels outside the model's) count as wrong.

What it does not promise: a high accept rate. When even the most confident answers err more than ``r`` the level
climbs above every rank and the rule accepts nothing (the safe failure); it comes back down only through answers it
accepts, so a rule that climbed past every confidence the traffic reaches stays there.

``gamma = 0.1`` by default, chosen by the simulation in ``tests/service/core/test_online_risk.py`` on the default
models' calibration and validation outputs (never their test split), under shifts made from them: a larger step
climbs faster after a shift (the realised excess over ``r`` is the distance climbed over ``gamma N``) at the price of
a noisier level and fewer answers accepted.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from typing import Any

import numpy as np
import torch

__all__ = ["GAMMA", "ConfidenceRanks", "OnlineRisk"]

GAMMA = 0.1  # the step, in ranks (module docstring)

Array = np.ndarray | torch.Tensor | Sequence[float]


@dataclass(frozen=True)
class ConfidenceRanks:
    """The scale of the online rules: the calibration split's confidences ``(n,)``, ascending."""

    confidences: np.ndarray

    def __post_init__(self) -> None:
        c = np.asarray(self.confidences, dtype=np.float64)
        if c.ndim != 1 or c.size == 0 or not np.all(np.isfinite(c)) or np.any(np.diff(c) < 0):
            raise ValueError(f"confidences must be a non-empty finite ascending (n,) array, got shape {c.shape}")
        object.__setattr__(self, "confidences", c)

    @property
    def n(self) -> int:
        return int(self.confidences.shape[0])

    def rank(self, conf: Array) -> np.ndarray:
        """``q(c) = #{calibration confidences <= c} / (n + 1)`` of confidences ``(...)`` -> ``(...)`` in
        ``[0, n / (n + 1)]``."""
        c = np.asarray(conf, dtype=np.float64)
        return np.searchsorted(self.confidences, c, side="right") / (self.n + 1.0)

    def threshold(self, level: float) -> float | None:
        """The confidence at which ``q(c) >= level`` starts: accepting ``q(c) >= level`` is accepting ``c >=`` it.
        0.0 at ``level <= 0`` (every answer), None above every calibration confidence (none)."""
        k = math.ceil(level * (self.n + 1) - 1e-9)  # q(c) >= level  <=>  #{cal <= c} >= k
        if k <= 0:
            return 0.0
        return None if k > self.n else float(self.confidences[k - 1])


@dataclass
class OnlineRisk:
    """The online accept rule of one target risk ``risk`` (module docstring).

    ``start``: ``u_1``, a rank (:meth:`starting_at`: the certified threshold's); ``gamma``: the step in ranks;
    ``labelled``: labelled answers seen (accepted or not), ``accepted``: those the rule accepted at their level,
    ``errors``: the wrong ones among them.
    """

    risk: float
    start: float
    gamma: float = GAMMA
    labelled: int = 0
    accepted: int = 0
    errors: int = 0

    def __post_init__(self) -> None:
        self.risk, self.start, self.gamma = float(self.risk), float(self.start), float(self.gamma)
        if not 0 < self.risk < 1:
            raise ValueError(f"risk must be in (0, 1), got {self.risk!r}")
        if not 0 < self.gamma <= 1:
            raise ValueError(f"gamma must be in (0, 1], got {self.gamma!r}")
        if not 0 <= self.start <= 1:
            raise ValueError(f"start must be a rank in [0, 1], got {self.start!r}")
        if not 0 <= self.errors <= self.accepted <= self.labelled:
            raise ValueError(
                f"need 0 <= errors <= accepted <= labelled, got {self.errors}, {self.accepted}, {self.labelled}"
            )

    @classmethod
    def starting_at(
        cls, risk: float, threshold: float | None, ranks: ConfidenceRanks, gamma: float = GAMMA
    ) -> OnlineRisk:
        """A fresh rule that accepts what the certified rule of confidence ``threshold`` accepts (None: no rule was
        certified; start at 1, above every rank: nothing is accepted)."""
        start = 1.0 if threshold is None else float(ranks.rank([threshold])[0])
        return cls(risk, start, gamma)

    @property
    def level(self) -> float:
        """``u_t = u_1 + gamma (E - r N)`` (not clipped)."""
        return self.start + self.gamma * (self.errors - self.risk * self.accepted)

    def accepts(self, ranks: Array, eligible: Array | None = None) -> np.ndarray:
        """``(B,)`` bool: the rule at ``u_t`` on ranks ``(B,)`` (:meth:`ConfidenceRanks.rank`; ``eligible (B,)``: the
        OOD cut passed)."""
        ok = np.asarray(ranks, dtype=np.float64) >= self.level
        return ok if eligible is None else ok & np.asarray(eligible, dtype=bool)

    def update(self, ranks: Array, wrong: Array, eligible: Array | None = None) -> np.ndarray:
        """Apply labels in arrival order: ranks ``(B,)`` of their answers' confidences, ``wrong (B,)`` bool (foreign
        inputs count as wrong), ``eligible (B,)`` bool (the OOD cut passed; default all). Each answer is decided at
        the level current when its label comes (:attr:`level`), which then moves. Returns those decisions ``(B,)``."""
        q = np.asarray(ranks, dtype=np.float64).ravel()
        w = np.asarray(wrong, dtype=bool).ravel()
        e = np.ones(q.shape, dtype=bool) if eligible is None else np.asarray(eligible, dtype=bool).ravel()
        if not q.shape == w.shape == e.shape:
            raise ValueError(f"ranks, wrong and eligible must be (B,) alike, got {q.shape}, {w.shape}, {e.shape}")
        out = np.zeros(q.shape, dtype=bool)
        start, gamma, r = self.start, self.gamma, self.risk
        n, k = self.accepted, self.errors
        for i, (qi, wi, ei) in enumerate(zip(q.tolist(), w.tolist(), e.tolist(), strict=True)):
            if ei and qi >= start + gamma * (k - r * n):  # a plain loop: each decision needs the level before it
                out[i] = True
                n += 1
                k += int(wi)
        self.labelled += int(q.size)
        self.accepted, self.errors = n, k
        return out

    @property
    def error_rate(self) -> float | None:
        """The realised error among accepted labelled answers, ``E / N`` (None before the first)."""
        return self.errors / self.accepted if self.accepted else None

    def bound(self, delay: int = 1) -> float:
        """The deterministic bound on ``E / N - r`` after the labels applied so far, with at most ``delay`` answers
        waiting for their label at once (``inf`` before the first accepted label)."""
        if delay < 1:
            raise ValueError(f"delay must be >= 1, got {delay}")
        if not self.accepted:
            return math.inf
        return (1 + self.gamma * (1 - self.risk) * delay - self.start) / (self.gamma * self.accepted)

    def to_state(self) -> dict[str, Any]:
        """The state as a plain dict (:meth:`from_state` reads it back)."""
        return asdict(self)

    @classmethod
    def from_state(cls, state: Mapping[str, Any]) -> OnlineRisk:
        """A rule back from :meth:`to_state`'s dict (keys and ranges checked)."""
        names = [f.name for f in fields(cls)]
        if missing := [k for k in names if k not in state]:
            raise ValueError(f"OnlineRisk state lacks {missing}; expected the keys {names}")
        return cls(**{k: state[k] for k in names})
