"""Synthetic far-OOD images for the Fashion-MNIST setting's test sets: noise and textures, seeded."""

from __future__ import annotations

import numpy as np

NOISE_KINDS = ("uniform", "blobs", "stripes", "checkerboard")  # in the order synthetic_images cycles through them


def synthetic_images(n: int, seed: int, size: int = 28) -> np.ndarray:
    """Seeded far-OOD images uint8 ``(n, size, size)``: uniform noise, smooth blobs, stripes, checkerboards."""
    import torch
    import torch.nn.functional as F

    rng = np.random.default_rng(seed)
    out = np.empty((n, size, size), dtype=np.uint8)
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float32)
    for i in range(n):
        kind = i % 4
        if kind == 0:  # white noise
            img = rng.uniform(0, 1, (size, size))
        elif kind == 1:  # smooth blobs: low-resolution noise upsampled
            k = int(rng.integers(3, 8))
            low = torch.as_tensor(rng.uniform(0, 1, (1, 1, k, k)), dtype=torch.float32)
            img = F.interpolate(low, size=(size, size), mode="bilinear", align_corners=False)[0, 0].numpy()
        elif kind == 2:  # oriented sinusoidal stripes
            theta, freq, phase = rng.uniform(0, np.pi), rng.uniform(0.15, 0.9), rng.uniform(0, 2 * np.pi)
            img = 0.5 + 0.5 * np.sin(freq * (np.cos(theta) * xx + np.sin(theta) * yy) + phase)
        else:  # checkerboard with a random cell size and offset
            cell = int(rng.integers(2, 8))
            ox, oy = rng.integers(0, cell, 2)
            img = (((xx + ox) // cell + (yy + oy) // cell) % 2).astype(np.float32)
        lo, hi = rng.uniform(0, 0.4), rng.uniform(0.6, 1.0)  # random contrast
        out[i] = np.clip((lo + (hi - lo) * img) * 255, 0, 255).round().astype(np.uint8)
    return out
