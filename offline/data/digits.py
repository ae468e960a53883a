"""Far-OOD digits for the Fashion-MNIST setting: scikit-learn's 8x8 digits upsampled to 28x28, in two disjoint
halves (validation, test)."""

from __future__ import annotations

import numpy as np

from offline.data.common import stratified_indices

DIGITS_SOURCE = "sklearn.datasets.load_digits, 8x8 values 0..16 upsampled bilinear to 28x28 uint8 0..255"


def upsample_digits(images: np.ndarray, size: int = 28) -> np.ndarray:
    """sklearn digits ``(N, 8, 8)`` float in 0..16 -> uint8 ``(N, size, size)`` in 0..255 (bilinear)."""
    import torch
    import torch.nn.functional as F

    x = torch.as_tensor(np.asarray(images, dtype=np.float32) * (255.0 / 16.0)).unsqueeze(1)  # (N, 1, 8, 8)
    x = F.interpolate(x, size=(size, size), mode="bilinear", align_corners=False)  # (N, 1, size, size)
    return x.squeeze(1).round().clamp(0, 255).to(torch.uint8).numpy()


def digits_ood(max_ood: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(images, val indices, test indices)``: every digit upsampled, uint8 ``(1797, 28, 28)``, and up to
    ``max_ood`` indices per set, stratified by digit, from two disjoint halves of a permutation drawn from ``rng``."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    dperm = rng.permutation(len(digits.target))
    half = len(dperm) // 2
    dval, dtest = dperm[:half], dperm[half:]  # disjoint halves, then subsampled stratified by digit
    dval = dval[stratified_indices(digits.target[dval], max_ood, rng)]
    dtest = dtest[stratified_indices(digits.target[dtest], max_ood, rng)]
    return upsample_digits(digits.images), dval, dtest
