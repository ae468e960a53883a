"""The OOD scores: one table, :data:`SCORES`, that every list of score names in the project is derived from.

Each entry says what a score is to the rest of the code: its name (what the manifest, the API and the report call
it), its direction (``higher_is_id``: only the MSP grows on in-distribution inputs; the others are outlier scores),
what it is computed from (``needs``), the per-member scores it combines (``members``, what
:func:`service.core.ood.member_scores` computes for it), whether a zero-shot build can serve it (``zero_shot``:
label-free, no class statistics of a fixed label set), where the report lists it (``report_rank``) and the function
of :mod:`service.core.ood` that combines its ensemble value (``combine``; the probability scores come from
:func:`service.core.uncertainty.summarize`, the per-member ones by :func:`service.core.ood.combine`).

Derived here, and imported by the modules that use them: :data:`OOD_METRICS` (direction by name),
:data:`SUMMARY_SCORES`, :data:`LOGIT_SCORES`, :data:`FEATURE_SCORES`, :data:`PER_MEMBER_SCORES`,
:data:`MEMBER_NEEDS`, :data:`ZERO_SHOT_SCORES`, :data:`REPORT_ORDER`. Adding a score is one entry here, plus its
function (a ``combine`` named here, or a per-member score in :func:`service.core.ood.member_scores`) and its tests;
``tests/service/test_scores.py`` fails while an entry is incomplete.

Imports only the standard library: the manifest (pydantic, no torch) reads it.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "FEATURE_SCORES",
    "LOGIT_SCORES",
    "MEMBER_NEEDS",
    "NEEDS",
    "OOD_METRICS",
    "PER_MEMBER_SCORES",
    "REPORT_ORDER",
    "SCORES",
    "SUMMARY_SCORES",
    "ZERO_SHOT_SCORES",
    "Score",
    "flag_side",
    "outlier_sign",
]

# what a score is computed from: the ensemble's probabilities (a summary of the members' logits), the members'
# logits and the artifact's OOD statistics, their penultimate features, the pooled layer features
NEEDS = ("probabilities", "logits", "features", "layer_features")


@dataclass(frozen=True)
class Score:
    """One OOD score (see the module docstring for each field)."""

    name: str
    higher_is_id: bool
    needs: tuple[str, ...]
    report_rank: int
    members: tuple[str, ...] = ()
    zero_shot: bool = False
    combine: str | None = None

    def __post_init__(self) -> None:
        bad = [n for n in self.needs if n not in NEEDS]
        if bad or not self.needs:
            raise ValueError(f"score {self.name!r}: needs must be some of {NEEDS}, got {self.needs}")


_ENTRIES = (
    Score("msp", True, ("probabilities",), 0, zero_shot=True),
    Score("entropy", False, ("probabilities",), 3, zero_shot=True),
    Score("mutual_information", False, ("probabilities",), 4, zero_shot=True),
    Score("energy", False, ("logits",), 2, members=("energy",)),
    Score("max_logit", False, ("logits",), 1, members=("max_logit",)),
    Score("mahalanobis", False, ("features",), 5, members=("mahalanobis",), zero_shot=True),
    Score("relative_mahalanobis", False, ("features",), 6, members=("relative_mahalanobis",)),
    Score(
        "mahalanobis_mi",
        False,
        ("probabilities", "features"),
        7,
        members=("mahalanobis",),
        combine="mahalanobis_mi",
    ),
    Score(
        "mahalanobis_energy",
        False,
        ("logits", "features"),
        8,
        members=("mahalanobis", "energy"),
        combine="mahalanobis_energy",
    ),
    Score(
        "mahalanobis_layers",
        False,
        ("features", "layer_features"),
        9,
        members=("mahalanobis",),
        zero_shot=True,
        combine="mahalanobis_layers",
    ),
)
SCORES: dict[str, Score] = {s.name: s for s in _ENTRIES}

OOD_METRICS: dict[str, bool] = {s.name: s.higher_is_id for s in _ENTRIES}  # True: higher = in distribution
SUMMARY_SCORES = tuple(s.name for s in _ENTRIES if s.needs == ("probabilities",))  # fields of summarize
FEATURE_SCORES = tuple(s.name for s in _ENTRIES if "features" in s.needs)  # need the features output
LOGIT_SCORES = tuple(s.name for s in _ENTRIES if "logits" in s.needs and "features" not in s.needs)
PER_MEMBER_SCORES = tuple(s.name for s in _ENTRIES if s.members == (s.name,))  # one value per member, combined
MEMBER_NEEDS: dict[str, tuple[str, ...]] = {s.name: s.members for s in _ENTRIES if s.members}
ZERO_SHOT_SCORES = tuple(s.name for s in _ENTRIES if s.zero_shot)
REPORT_ORDER = tuple(s.name for s in sorted(_ENTRIES, key=lambda s: s.report_rank))


def outlier_sign(metric: str) -> float:
    """The direction of the score ``metric``, read here and nowhere else: ``outlier_sign(metric) * score`` is the score
    with higher = more OOD (the MSP negated: it grows on in-distribution inputs; every other score as it is). A score
    is past a threshold toward OOD when ``sign * score > sign * threshold``; negation is exact, so comparing the
    oriented values decides exactly as comparing the raw ones the other way round."""
    if metric not in SCORES:
        raise ValueError(f"unknown OOD score {metric!r}; expected one of {sorted(SCORES)}")
    return -1.0 if SCORES[metric].higher_is_id else 1.0


def flag_side(metric: str) -> str:
    """The side of its threshold on which a flagged score of ``metric`` lies, in words: "below" or "above"."""
    return "below" if outlier_sign(metric) < 0 else "above"
