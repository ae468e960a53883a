"""Training-time image augmentation on the preprocessed tensors ``(B, C, H, W)``: horizontal flips and random
resized crops, each a function of ``(seed, step)`` so that a resumed run or a DataLoader worker draws the same."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

Batch = dict[str, torch.Tensor]

CROP_RATIO = (3 / 4, 4 / 3)  # the crops' aspect ratios (log-uniform), as torchvision's RandomResizedCrop


def flip(batch: Batch, step: int, seed: int) -> Batch:
    """Horizontally flip a seeded half of the images ``(B, C, H, W)`` (deterministic in ``(seed, step)``)."""
    x = batch["pixel_values"]
    g = torch.Generator().manual_seed(seed * 7_919 + step + 1)
    flipped = torch.rand(x.shape[0], generator=g) < 0.5
    x = torch.where(flipped.view(-1, 1, 1, 1), x.flip(-1), x)
    return {**batch, "pixel_values": x}


def affine_crop(x: torch.Tensor, h: torch.Tensor, w: torch.Tensor, cy: torch.Tensor, cx: torch.Tensor) -> torch.Tensor:
    """Each image of ``x`` ``(B, C, H, W)`` cropped to the box of height ``h`` and width ``w`` (fractions of the
    image, ``(B,)``) centred at ``(cy, cx)`` (fractions), resized back to ``(H, W)`` bilinearly."""
    theta = torch.zeros(x.shape[0], 2, 3, dtype=x.dtype)  # (B, 2, 3)
    theta[:, 0, 0], theta[:, 0, 2] = w, 2 * cx - 1  # output [-1, 1] -> the box's x range
    theta[:, 1, 1], theta[:, 1, 2] = h, 2 * cy - 1
    grid = F.affine_grid(theta, list(x.shape), align_corners=False)  # (B, H, W, 2)
    return F.grid_sample(x, grid, mode="bilinear", padding_mode="border", align_corners=False)


def crop(batch: Batch, step: int, seed: int, min_scale: float) -> Batch:
    """Random resized crops of the images (area in ``[min_scale, 1]``, aspect ratio in :data:`CROP_RATIO`),
    seeded by ``(seed, step)``, on the preprocessed tensors (the evaluation transform stays the server's)."""
    x = batch["pixel_values"]
    g = torch.Generator().manual_seed(seed * 15_485_863 + step + 7)
    n = x.shape[0]
    area = torch.empty(n).uniform_(min_scale, 1.0, generator=g)
    ratio = torch.empty(n).uniform_(math.log(CROP_RATIO[0]), math.log(CROP_RATIO[1]), generator=g).exp()
    h, w = (area / ratio).sqrt().clamp(max=1.0), (area * ratio).sqrt().clamp(max=1.0)
    cy = h / 2 + torch.rand(n, generator=g) * (1 - h)
    cx = w / 2 + torch.rand(n, generator=g) * (1 - w)
    return {**batch, "pixel_values": affine_crop(x, h, w, cy, cx)}
