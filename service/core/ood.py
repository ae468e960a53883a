"""Out-of-distribution scores of the fused ensemble's outputs: pure functions, torch only.

Shared by the builder (fitting the threshold, choosing the served score) and the
server (every answer), so both compute exactly the same numbers. Every score here
is an *outlier* score: higher means more likely out of distribution. The values
follow pytorch-ood's definitions, so they can be checked against it:

* ``energy``: ``-T · logsumexp(logits / T)`` per member (Liu et al. 2020).
* ``max_logit``: ``-max_c logits`` per member (Hendrycks et al. 2022).
* ``mahalanobis``: half the squared Mahalanobis distance of a member's penultimate
  feature to its closest class mean, with one covariance shared by the classes
  (Lee et al. 2018): ``0.5 · min_k (f - μ_k)ᵀ Σ⁻¹ (f - μ_k)``.
* ``relative_mahalanobis``: the class distance minus the distance under one
  background Gaussian of all ID features, which cancels directions every input
  varies in (Ren et al. 2021; better on near-OOD): ``min_k d_k² - d_0²``.

Per-member scores ``(B, M)`` are combined across members by the mean of their
standardised values (each member's score minus its ID-validation mean, over its
standard deviation), so members on different scales weigh the same.

* ``mahalanobis_layers``: the Mahalanobis score on more than the last feature. The fused model
  also returns every block's output but the last's, pooled over the tokens, per member
  (``layer features (B, M, L-1, d)``); a class-conditional Gaussian is fitted per member and
  selected layer like the last feature's. Per layer the members' standardised distances are
  averaged; then the last feature's combined score and each selected layer's are standardised
  once more on ID validation, and the input's score is the largest of them (``reduce="max"``). Early layers see
  low-level shifts (noise, blank frames, gradients, photographs) that the last feature, trained
  to separate the classes, maps next to some class; the last feature sees semantic shifts
  (other objects drawn like the classes) that early layers find typical. The maximum flags an
  input that any of them finds foreign; the layers it reads are chosen at build time on
  validation data (:class:`LayerStats` ``ids``), and so is how the columns are combined
  (:data:`LAYER_REDUCTIONS`): the largest column (``max``), their mean (``mean``), or the mean over
  members of each member's own largest standardised column (``members``: every member scores the
  input as a one-member model would, and the ensemble averages the members' verdicts).

Statistics (class means, precisions) are fitted at build time on ID features and
stored in the artifact; :class:`GaussianStats` holds them for scoring. The
distances are computed in float64: ``Σ⁻¹`` of a 384-d feature has a large
condition number, and float32 loses digits on the squared distances.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from service.core.scores import FEATURE_SCORES, OOD_METRICS, PER_MEMBER_SCORES, SCORES, SUMMARY_SCORES
from service.core.uncertainty import summarize

__all__ = [
    "FEATURE_SCORES",
    "LAYER_REDUCTIONS",
    "LayerStats",
    "layer_pair_scores",
    "reduce_layers",
    "layer_scores",
    "layer_tensors",
    "layers_from_tensors",
    "layers_max",
    "HIGHER_IS_ID",
    "PER_MEMBER_SCORES",
    "GaussianStats",
    "OODStats",
    "combine",
    "energy",
    "ensemble_scores",
    "fit_norms",
    "member_scores",
    "ood_from_tensors",
    "ood_tensors",
    "mahalanobis",
    "max_logit",
    "relative_mahalanobis",
    "quadratic_norms",
    "squared_distances",
    "standardize",
    "stats_from_tensors",
    "stats_tensors",
]


def energy(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Energy ``(..., )`` of logits ``(..., C)``: ``-T · logsumexp(logits / T)`` (higher = more OOD)."""
    return -temperature * torch.logsumexp(logits.float() / temperature, dim=-1)


def max_logit(logits: torch.Tensor) -> torch.Tensor:
    """Negated maximum logit ``(..., )`` of logits ``(..., C)`` (higher = more OOD)."""
    return -logits.float().max(dim=-1).values


@dataclass(frozen=True)
class GaussianStats:
    """Per-member class-conditional Gaussians with a shared covariance, plus one background Gaussian.

    Shapes: ``means (M, C, D)``, ``precision (M, D, D)`` (inverse of the covariance shared by the classes),
    ``background_mean (M, D)``, ``background_precision (M, D, D)``. Float64.
    """

    means: torch.Tensor
    precision: torch.Tensor
    background_mean: torch.Tensor
    background_precision: torch.Tensor
    mean_norms: torch.Tensor = field(init=False, repr=False)  # (M, C) μᵀPμ of the class means, derived
    background_norms: torch.Tensor = field(init=False, repr=False)  # (M, 1) the same of the background mean

    def __post_init__(self) -> None:
        m, c, d = self.means.shape
        expected = {"precision": (m, d, d), "background_mean": (m, d), "background_precision": (m, d, d)}
        for name, shape in expected.items():
            got = tuple(getattr(self, name).shape)
            if got != shape:
                raise ValueError(f"GaussianStats.{name} has shape {got}, expected {shape} (means are {(m, c, d)})")
        # μᵀPμ of every centre, computed once (M·K·D² multiply-adds; per request it would dominate the scores)
        object.__setattr__(self, "mean_norms", quadratic_norms(self.means, self.precision))  # (M, C)
        bg = self.background_mean.unsqueeze(1)
        object.__setattr__(self, "background_norms", quadratic_norms(bg, self.background_precision))  # (M, 1)

    @property
    def members(self) -> int:
        return int(self.means.shape[0])

    @property
    def dim(self) -> int:
        return int(self.means.shape[2])


def squared_distances(
    features: torch.Tensor, means: torch.Tensor, precision: torch.Tensor, mean_norms: torch.Tensor | None = None
) -> torch.Tensor:
    """Squared Mahalanobis distances ``(B, M, K)`` of member features ``(B, M, D)`` to ``K`` means per member.

    Computed as ``fᵀPf - 2 μₖᵀPf + μₖᵀPμₖ``: one ``(D, D)`` product per input and member, whatever ``K``
    (the direct ``(f - μₖ)ᵀP(f - μₖ)`` costs ``K`` of them: for 1,000 classes of a 768-d feature, 1.8 G
    multiply-adds per input against 2.3 M here). Float64 keeps the cancellation exact to ~1e-10 relative.

    Args:
        features: ``(B, M, D)``, each member's feature of each input.
        means: ``(M, K, D)``, per member ``K`` centres (class means, or one background mean with ``K = 1``).
        precision: ``(M, D, D)``, per member the inverse covariance (symmetric).
        mean_norms: ``(M, K)``, the ``μₖᵀPμₖ`` when already computed (:class:`GaussianStats` caches them).
    """
    if features.dim() != 3 or features.shape[1:] != (means.shape[0], means.shape[2]):
        raise ValueError(f"features must be (B, M={means.shape[0]}, D={means.shape[2]}), got {tuple(features.shape)}")
    f = features.to(torch.float64)
    mu, p = means.to(torch.float64), precision.to(torch.float64)
    # batched matrix products per member (what einsum dispatches to, without its per-call parsing)
    pf = torch.matmul(f.transpose(0, 1), p).transpose(0, 1)  # (M, B, D) @ (M, D, D) -> (B, M, D)
    f_norm = (f * pf).sum(-1, keepdim=True)  # (B, M, 1)
    cross = torch.matmul(pf.transpose(0, 1), mu.transpose(1, 2)).transpose(0, 1)  # (M, B, D) @ (M, D, K) -> (B, M, K)
    if mean_norms is None:
        mean_norms = quadratic_norms(mu, p)
    return (f_norm - 2.0 * cross + mean_norms.unsqueeze(0)).clamp_min(0.0)  # (B, M, K)


def quadratic_norms(means: torch.Tensor, precision: torch.Tensor) -> torch.Tensor:
    """``μₖᵀPμₖ`` ``(M, K)`` of means ``(M, K, D)`` under precisions ``(M, D, D)``, float64."""
    mu = means.to(torch.float64)
    return torch.einsum("mkd,mkd->mk", torch.einsum("mkd,mde->mke", mu, precision.to(torch.float64)), mu)


def mahalanobis(features: torch.Tensor, stats: GaussianStats) -> torch.Tensor:
    """Per-member Mahalanobis score ``(B, M)``: half the squared distance to the closest class mean."""
    return 0.5 * squared_distances(features, stats.means, stats.precision, stats.mean_norms).min(dim=-1).values


def relative_mahalanobis(features: torch.Tensor, stats: GaussianStats) -> torch.Tensor:
    """Per-member relative Mahalanobis score ``(B, M)``: ``min_k d_k² - d_0²`` (d_0: background Gaussian)."""
    d_k = squared_distances(features, stats.means, stats.precision, stats.mean_norms)  # (B, M, C)
    bg = stats.background_mean.unsqueeze(1)  # (M, 1, D)
    d_0 = squared_distances(features, bg, stats.background_precision, stats.background_norms)  # (B, M, 1)
    return (d_k - d_0).min(dim=-1).values


def standardize(scores: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """Per-member scores ``(B, M)`` standardised by each member's ID statistics ``mean (M,)``, ``std (M,)``."""
    if scores.dim() != 2 or scores.shape[1] != mean.numel() or mean.shape != std.shape:
        raise ValueError(f"scores (B, M) with mean and std (M,): got {tuple(scores.shape)}, {tuple(mean.shape)}")
    return (scores.to(torch.float64) - mean.to(torch.float64)) / std.to(torch.float64).clamp_min(1e-12)


def combine(scores: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """One score ``(B,)`` from per-member scores ``(B, M)``: the mean of the members' standardised scores."""
    return standardize(scores, mean, std).mean(dim=1)


STATS_KEYS = ("means", "precision", "background_mean", "background_precision")


def stats_tensors(stats: GaussianStats, prefix: str = "gaussian.") -> dict[str, torch.Tensor]:
    """The tensors of ``stats`` by name, for a safetensors file (``prefix`` + field name)."""
    return {prefix + k: getattr(stats, k).contiguous() for k in STATS_KEYS}


def stats_from_tensors(tensors: dict[str, torch.Tensor], prefix: str = "gaussian.") -> GaussianStats:
    """:class:`GaussianStats` back from :func:`stats_tensors`' names (shapes checked)."""
    missing = [prefix + k for k in STATS_KEYS if prefix + k not in tensors]
    if missing:
        raise ValueError(f"OOD statistics lack {missing}")
    return GaussianStats(**{k: tensors[prefix + k].to(torch.float64) for k in STATS_KEYS})


# ----------------------------------------------------------------------------- the served scores
# Every score the server can serve and its direction: the registry, service.core.scores (True: higher = in
# distribution, MSP only). The probability scores come from service.core.uncertainty.summarize, the logit scores from
# the members' logits; the feature scores need the members' penultimate features and the artifact's statistics.
HIGHER_IS_ID = OOD_METRICS
# how mahalanobis_layers combines its columns (:func:`reduce_layers`); the index is what the artifact stores
LAYER_REDUCTIONS = ("max", "mean", "members")


@dataclass(frozen=True)
class LayerStats:
    """The statistics of ``mahalanobis_layers``: which layers it reads and their Gaussians and norms.

    ``ids (K,)``: indices into the layer features' layer axis (block ``i``'s pooled output), ascending.
    ``gaussians``: one :class:`GaussianStats` whose ``M·K`` "members" are (member, layer) pairs, member-major
    (pair ``m·K + k`` is member ``m``'s layer ``ids[k]``). ``pair_norms``: mean and standard deviation ``(M·K,)`` of
    each pair's Mahalanobis score on ID validation inputs. ``column_norms``: mean and standard deviation ``(K+1,)`` of
    the combined columns on ID validation: column 0 the last feature's combined ``mahalanobis``, column ``1+k``
    layer ``ids[k]``'s member mean of standardised scores. ``reduce``: how the columns become one score, one of
    :data:`LAYER_REDUCTIONS` (:func:`reduce_layers`).
    """

    ids: tuple[int, ...]
    gaussians: GaussianStats
    pair_norms: tuple[torch.Tensor, torch.Tensor]
    column_norms: tuple[torch.Tensor, torch.Tensor]
    reduce: str = "max"

    def __post_init__(self) -> None:
        k = len(self.ids)
        pairs = self.gaussians.members
        if k == 0 or pairs % k:
            raise ValueError(f"LayerStats: {pairs} (member, layer) Gaussians for {k} layers")
        if any(t.shape != (pairs,) for t in self.pair_norms) or any(t.shape != (k + 1,) for t in self.column_norms):
            raise ValueError(
                f"LayerStats norms must be ({pairs},) and ({k + 1},), got "
                f"{[tuple(t.shape) for t in (*self.pair_norms, *self.column_norms)]}"
            )
        if list(self.ids) != sorted(set(self.ids)) or min(self.ids) < 0:
            raise ValueError(f"LayerStats.ids must be distinct, ascending and >= 0, got {list(self.ids)}")
        if self.reduce not in LAYER_REDUCTIONS:
            raise ValueError(f"LayerStats.reduce must be one of {list(LAYER_REDUCTIONS)}, got {self.reduce!r}")

    @property
    def members(self) -> int:
        return self.gaussians.members // len(self.ids)


@dataclass(frozen=True)
class OODStats:
    """What the scores need besides the model's outputs, fitted at build time and stored in the artifact.

    ``gaussians``: the members' class-conditional Gaussians (None: no feature scores). ``norms``: per score, the
    mean and standard deviation of its per-member values on ID validation inputs, ``(M,)`` each (``(1,)`` for
    ``mutual_information``), which put members (and MI) on one scale before they are combined. ``layers``: the
    statistics of ``mahalanobis_layers`` (None: the artifact does not serve it).
    """

    gaussians: GaussianStats | None
    norms: dict[str, tuple[torch.Tensor, torch.Tensor]]
    layers: LayerStats | None = None


def layer_pair_scores(layer_features: torch.Tensor, stats: LayerStats) -> torch.Tensor:
    """Each (member, selected layer)'s Mahalanobis score standardised by ``pair_norms`` ``(B, M, K)``, from the layer
    features ``(B, M, L-1, d)``."""
    B, M = layer_features.shape[:2]
    k = len(stats.ids)
    if M != stats.members or max(stats.ids) >= layer_features.shape[2]:
        raise ValueError(
            f"layer features {tuple(layer_features.shape)} do not fit statistics of {stats.members} "
            f"members and layers {list(stats.ids)}"
        )
    f = layer_features[:, :, list(stats.ids)]  # (B, M, K, d)
    md = mahalanobis(f.reshape(B, M * k, f.shape[-1]), stats.gaussians)  # (B, M*K)
    return standardize(md, *stats.pair_norms).view(B, M, k)


def layer_scores(layer_features: torch.Tensor, stats: LayerStats) -> torch.Tensor:
    """Each selected layer's combined score ``(B, K)`` from the layer features ``(B, M, L-1, d)``: the members' mean of
    :func:`layer_pair_scores` (not yet ``column_norms``)."""
    return layer_pair_scores(layer_features, stats).mean(dim=1)


def layers_max(
    last: torch.Tensor, layers: torch.Tensor, column_norms: tuple[torch.Tensor, torch.Tensor]
) -> torch.Tensor:
    """``mahalanobis_layers`` ``(B,)``: the largest of the last feature's combined score ``last (B,)`` and the
    layers' ``layers (B, K)``, each column standardised by ``column_norms`` ``(K+1,)``."""
    cols = torch.cat([last.to(torch.float64).unsqueeze(1), layers.to(torch.float64)], dim=1)  # (B, K+1)
    return standardize(cols, *column_norms).max(dim=1).values


def reduce_layers(columns: torch.Tensor, column_norms: tuple[torch.Tensor, torch.Tensor], reduce: str) -> torch.Tensor:
    """``mahalanobis_layers`` ``(B,)`` from the members' standardised columns ``(B, M, K+1)`` (column 0: each
    member's standardised last-feature ``mahalanobis``, column ``1+k``: :func:`layer_pair_scores`' layer ``k``).

    ``max`` / ``mean``: the members' mean per column (the combined columns), each standardised by ``column_norms``,
    then their largest or their mean. ``members``: each member's largest column (a one-member model's ``max``: its
    columns are already on the ID validation scale), averaged over the members.
    """
    cols = columns.to(torch.float64)
    if reduce == "members":
        return cols.max(dim=2).values.mean(dim=1)
    z = standardize(cols.mean(dim=1), *column_norms)  # (B, K+1)
    if reduce == "max":
        return z.max(dim=1).values
    if reduce == "mean":
        return z.mean(dim=1)
    raise ValueError(f"unknown layer reduction {reduce!r}; known: {list(LAYER_REDUCTIONS)}")


# what each served score combines of the per-member scores (ensemble_scores(..., only=...) computes just these):
# its registry entry's ``members`` (service.core.scores)


def member_scores(
    logits: torch.Tensor,
    features: torch.Tensor | None,
    stats: GaussianStats | None,
    temperature: float = 1.0,
    names: tuple[str, ...] | None = None,
) -> dict[str, torch.Tensor]:
    """Per-member outlier scores ``(B, M)`` from member logits ``(B, M, C)`` and features ``(B, M, D)``.

    ``energy`` and ``max_logit`` use the logits divided by ``temperature``; the Mahalanobis scores need
    ``features`` and ``stats`` and are left out without them. ``names``: only these (default every one).
    """
    want = (lambda k: True) if names is None else (lambda k: k in names)
    out = {}
    if want("energy"):
        out["energy"] = energy(logits, temperature)
    if want("max_logit"):
        out["max_logit"] = max_logit(logits.float() / temperature)
    if features is not None and stats is not None:
        if want("mahalanobis"):
            out["mahalanobis"] = mahalanobis(features, stats)
        if want("relative_mahalanobis"):
            out["relative_mahalanobis"] = relative_mahalanobis(features, stats)
    return out


def ensemble_scores(
    logits: torch.Tensor,
    features: torch.Tensor | None,
    stats: OODStats | None,
    temperature: float = 1.0,
    summary: dict[str, torch.Tensor] | None = None,
    layer_features: torch.Tensor | None = None,
    only: str | None = None,
) -> dict[str, torch.Tensor]:
    """Every score :data:`HIGHER_IS_ID` names that the inputs allow, one value per input ``(B,)``, float64; with
    ``only``, the probability scores and that score alone (what a request that asks for no other needs: each score
    is computed the same way, on the same rows, either way).

    ``msp``, ``entropy``, ``mutual_information`` are the ensemble's (``summary``: a
    :func:`service.core.uncertainty.summarize` of the same logits, computed here when not given); the per-member scores
    are combined by the mean of their standardised values (:func:`combine`, with ``stats.norms``);
    ``mahalanobis_mi`` adds the standardised mutual information to the combined Mahalanobis score, so an input
    the members disagree on counts as more foreign than its distance alone says; ``mahalanobis_energy`` adds the
    combined energy (a feature-space distance and a logit-space score, in the spirit of ViM, Wang et al. 2022:
    inputs far from the classes' features but given confident logits, and the reverse); ``mahalanobis_layers``
    (with ``layer_features`` ``(B, M, L-1, d)`` and ``stats.layers``) the last feature's and the selected layers'
    standardised scores combined as ``stats.layers.reduce`` says (:func:`reduce_layers`). Without ``stats`` only the
    probability scores are given.
    """
    s = summary if summary is not None else summarize(logits, temperature)
    out = {k: s[k].to(torch.float64) for k in SUMMARY_SCORES}
    entry = SCORES.get(only) if only is not None else None
    if stats is None or (only is not None and (entry is None or not entry.members)):
        return out
    names = None if entry is None else entry.members
    per_member = member_scores(logits, features, stats.gaussians, temperature, names)
    for name, values in per_member.items():
        if name in stats.norms:
            out[name] = combine(values, *stats.norms[name])
    for name, fn in COMBINED.items():  # the scores made of others, in the registry's order (service.core.scores)
        if only is None or only == name:
            value = fn(out, per_member, stats, layer_features)
            if value is not None:
                out[name] = value
    return out


# ----------------------------------------------------------------------------- the scores made of others
# Each takes the ensemble scores computed so far, the per-member scores, the statistics and the layer features, and
# gives its value (B,), or None where its inputs are missing. service.core.scores names them (Score.combine).
def mahalanobis_mi(
    out: dict[str, torch.Tensor], per_member: dict[str, torch.Tensor], stats: OODStats, layers: torch.Tensor | None
) -> torch.Tensor | None:
    """The combined Mahalanobis score plus the standardised mutual information: an input the members disagree on
    counts as more foreign than its distance alone says."""
    if "mahalanobis" not in out or "mutual_information" not in stats.norms:
        return None
    mi = standardize(out["mutual_information"].unsqueeze(1), *stats.norms["mutual_information"]).squeeze(1)
    return out["mahalanobis"] + mi


def mahalanobis_energy(
    out: dict[str, torch.Tensor], per_member: dict[str, torch.Tensor], stats: OODStats, layers: torch.Tensor | None
) -> torch.Tensor | None:
    """The combined Mahalanobis score plus the combined energy: feature space and logit space."""
    return out["mahalanobis"] + out["energy"] if "mahalanobis" in out and "energy" in out else None


def mahalanobis_layers(
    out: dict[str, torch.Tensor], per_member: dict[str, torch.Tensor], stats: OODStats, layers: torch.Tensor | None
) -> torch.Tensor | None:
    """The last feature's and the selected layers' standardised scores, combined as ``stats.layers.reduce`` says."""
    if "mahalanobis" not in out or stats.layers is None or layers is None:
        return None
    last = standardize(per_member["mahalanobis"], *stats.norms["mahalanobis"]).unsqueeze(2)  # (B, M, 1)
    columns = torch.cat([last, layer_pair_scores(layers, stats.layers)], dim=2)  # (B, M, K+1)
    return reduce_layers(columns, stats.layers.column_norms, stats.layers.reduce)


def _combined() -> dict[str, Callable[..., torch.Tensor | None]]:
    """The registry's ``combine`` functions by score name, each found in this module (an unknown one: an error)."""
    found = {}
    for s in SCORES.values():
        if s.combine is not None:
            fn = globals().get(s.combine)
            if not callable(fn):
                raise ImportError(f"service.core.scores: score {s.name!r} names combine {s.combine!r}, not in ood.py")
            found[s.name] = fn
    return found


COMBINED = _combined()  # checked at import: a registry entry naming a function that is not here stops the server


def fit_norms(scores: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Per score, the per-member mean and standard deviation ``(M,)`` of ID scores ``(N, M)`` (``(N,)``: one)."""
    out = {}
    for name, values in scores.items():
        v = values.to(torch.float64)
        v = v.unsqueeze(1) if v.dim() == 1 else v
        out[name] = (v.mean(0), v.std(0).clamp_min(1e-12))
    return out


def layer_tensors(stats: LayerStats, prefix: str = "layers.") -> dict[str, torch.Tensor]:
    """The tensors of :class:`LayerStats` by name (``prefix`` + field), for a safetensors file."""
    return {
        prefix + "ids": torch.tensor(stats.ids, dtype=torch.int64),
        **stats_tensors(stats.gaussians, prefix + "gaussian."),
        prefix + "pair_norms.mean": stats.pair_norms[0].contiguous(),
        prefix + "pair_norms.std": stats.pair_norms[1].contiguous(),
        prefix + "column_norms.mean": stats.column_norms[0].contiguous(),
        prefix + "column_norms.std": stats.column_norms[1].contiguous(),
        prefix + "reduce": torch.tensor([LAYER_REDUCTIONS.index(stats.reduce)], dtype=torch.int64),
    }


def layers_from_tensors(tensors: dict[str, torch.Tensor], prefix: str = "layers.") -> LayerStats | None:
    """:class:`LayerStats` back from :func:`layer_tensors`' names (None when there are none; shapes checked)."""
    if prefix + "ids" not in tensors:
        return None
    f64 = lambda k: tensors[prefix + k].to(torch.float64)  # noqa: E731
    reduce = tensors.get(prefix + "reduce")  # absent in artifacts written before the choice: the largest column
    if reduce is not None and not 0 <= int(reduce.flatten()[0]) < len(LAYER_REDUCTIONS):
        raise ValueError(f"OOD statistics name an unknown layer reduction {int(reduce.flatten()[0])}")
    try:
        return LayerStats(
            ids=tuple(int(i) for i in tensors[prefix + "ids"].tolist()),
            gaussians=stats_from_tensors(tensors, prefix + "gaussian."),
            pair_norms=(f64("pair_norms.mean"), f64("pair_norms.std")),
            column_norms=(f64("column_norms.mean"), f64("column_norms.std")),
            reduce="max" if reduce is None else LAYER_REDUCTIONS[int(reduce.flatten()[0])],
        )
    except KeyError as e:
        raise ValueError(f"OOD statistics lack {e}") from e


def ood_tensors(stats: OODStats) -> dict[str, torch.Tensor]:
    """The tensors of ``stats`` by name, for the artifact's safetensors file."""
    out = stats_tensors(stats.gaussians) if stats.gaussians is not None else {}
    for name, (mean, std) in stats.norms.items():
        out[f"norm.{name}.mean"] = mean.contiguous()
        out[f"norm.{name}.std"] = std.contiguous()
    if stats.layers is not None:
        out.update(layer_tensors(stats.layers))
    return out


def ood_from_tensors(tensors: dict[str, torch.Tensor]) -> OODStats:
    """:class:`OODStats` back from :func:`ood_tensors`' names."""
    gaussians = stats_from_tensors(tensors) if any(k.startswith("gaussian.") for k in tensors) else None
    names = {k.split(".")[1] for k in tensors if k.startswith("norm.")}
    norms = {
        n: (tensors[f"norm.{n}.mean"].to(torch.float64), tensors[f"norm.{n}.std"].to(torch.float64))
        for n in sorted(names)
    }
    return OODStats(gaussians, norms, layers_from_tensors(tensors))
