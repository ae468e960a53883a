"""Uncertainty of an ensemble from its member logits ``(B, M, C)``: pure functions, torch only.

Shared by the offline builder (calibration, report) and the server (every
answer), so both compute exactly the same numbers. Natural logarithms
throughout: entropies are in nats, so two confident members that disagree on
two classes give a mutual information of ln 2.

* ``probs``: the ensemble prediction, the mean of the members' softmax ``(B, C)``.
* ``msp``: maximum of ``probs`` (higher = more confident, more in-distribution).
* ``entropy``: entropy of the mean prediction (total uncertainty).
* ``expected_entropy``: mean of the members' entropies (aleatoric part).
* ``mutual_information``: ``entropy - expected_entropy`` (epistemic part, >= 0).
* ``disagreement``: fraction of members whose argmax differs from the ensemble's.
"""

from __future__ import annotations

import torch

from service.core.scores import OOD_METRICS, SUMMARY_SCORES, outlier_sign

__all__ = ["OOD_METRICS", "SUMMARY_SCORES", "entropy", "summarize", "ood_score", "ood_flag", "member_probs"]

# Every OOD score an artifact can serve and its direction (True: higher = more in-distribution, MSP only), and the
# three :func:`summarize` gives: the registry's (service.core.scores)


def member_probs(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Member probabilities ``(B, M, C)`` from member logits ``(B, M, C)`` scaled by ``1 / temperature``."""
    if logits.dim() != 3:
        raise ValueError(f"member logits must be (B, M, C), got shape {tuple(logits.shape)}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    return torch.softmax(logits.float() / temperature, dim=-1)


def entropy(p: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Shannon entropy in nats along ``dim``; ``0 · log 0 = 0``."""
    return -(torch.special.xlogy(p, p)).sum(dim)


def summarize(logits: torch.Tensor, temperature: float = 1.0) -> dict[str, torch.Tensor]:
    """Every uncertainty field of an answer (docs/api.md) from member logits.

    Args:
        logits: ``(B, M, C)`` member logits.
        temperature: applied to every member's logits before the softmax.

    Returns a dict of tensors: ``member_probs (B, M, C)``, ``probs (B, C)``,
    ``prediction (B,)``, and per input ``(B,)``: ``msp``, ``entropy``,
    ``expected_entropy``, ``mutual_information``, ``disagreement``.
    """
    mp = member_probs(logits, temperature)  # (B, M, C)
    probs = mp.mean(dim=1)  # (B, C)
    msp, prediction = probs.max(dim=-1)
    ent = entropy(probs)
    exp_ent = entropy(mp).mean(dim=1)
    mi = (ent - exp_ent).clamp_min(0.0)  # >= 0 by Jensen; clamp float round-off
    disagreement = (mp.argmax(-1) != prediction.unsqueeze(1)).float().mean(dim=1)
    return {
        "member_probs": mp,
        "probs": probs,
        "prediction": prediction,
        "msp": msp,
        "entropy": ent,
        "expected_entropy": exp_ent,
        "mutual_information": mi,
        "disagreement": disagreement,
    }


def ood_score(summary: dict[str, torch.Tensor], metric: str) -> torch.Tensor:
    """The OOD score ``(B,)`` named ``metric`` (``msp``, ``entropy`` or ``mutual_information``)."""
    if metric not in SUMMARY_SCORES:
        raise ValueError(f"OOD score {metric!r} is not a summary field; expected one of {list(SUMMARY_SCORES)}")
    return summary[metric]


def ood_flag(score: torch.Tensor, metric: str, threshold: float) -> torch.Tensor:
    """True where an input is flagged OOD: MSP below the threshold, every other score (outlier scores) above it."""
    sign = outlier_sign(metric)
    return sign * score > sign * threshold
