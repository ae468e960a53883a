"""Fitting the OOD statistics of :mod:`service.ood` on ID features, at build time.

Per member: the class means of its penultimate features, and one covariance shared by
the classes (the within-class scatter), estimated with Ledoit-Wolf shrinkage
(scikit-learn): with a few hundred inputs per class and a 384- or 768-d feature the
sample covariance is singular or nearly so, and its inverse would amplify noise
directions. The background Gaussian of relative Mahalanobis is fitted the same way on
all features around their overall mean.
"""

from __future__ import annotations

import numpy as np
import torch
from sklearn.covariance import LedoitWolf

from service.ood import GaussianStats

__all__ = ["fit_gaussians", "shrunk_precision"]


def shrunk_precision(centered: np.ndarray) -> np.ndarray:
    """Inverse of the Ledoit-Wolf shrunk covariance of already centred rows ``(N, D)`` -> ``(D, D)`` float64."""
    lw = LedoitWolf(assume_centered=True, store_precision=True).fit(centered.astype(np.float64))
    return lw.precision_


def fit_gaussians(features: torch.Tensor, labels: torch.Tensor, classes: int) -> GaussianStats:
    """Fit :class:`GaussianStats` on ID ``features (N, M, D)`` with labels ``(N,)`` in ``0..classes-1``.

    Raises ``ValueError`` naming the class when one has no input (its mean would be undefined).
    """
    if features.dim() != 3 or labels.shape != (features.shape[0],):
        raise ValueError(f"features (N, M, D) and labels (N,), got {tuple(features.shape)}, {tuple(labels.shape)}")
    f = features.detach().to(torch.float64).cpu().numpy()  # (N, M, D)
    y = labels.cpu().numpy()
    counts = np.bincount(y, minlength=classes)
    if (counts == 0).any():
        raise ValueError(f"class {int(np.argmin(counts))} has no input to fit its mean on")
    means = np.stack([f[y == k].mean(0) for k in range(classes)], axis=1)  # (M, C, D)
    within = f - means.transpose(1, 0, 2)[y]  # (N, M, D): each input minus its class mean
    overall = f - f.mean(0, keepdims=True)  # (N, M, D)
    members = range(f.shape[1])
    return GaussianStats(
        means=torch.from_numpy(means),
        precision=torch.from_numpy(np.stack([shrunk_precision(within[:, m]) for m in members])),
        background_mean=torch.from_numpy(f.mean(0)),
        background_precision=torch.from_numpy(np.stack([shrunk_precision(overall[:, m]) for m in members])),
    )
