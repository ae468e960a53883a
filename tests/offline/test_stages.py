"""The build's shared stages (offline/stages/): evaluation batches through the server's preprocessing, the
members' fine-tuning recipe levers, features from a model's classifier head."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image
from torch import nn

from offline.config import ConfigError, load_config
from offline.data import Data, Split
from offline.stages.datasets import collect, eval_batches, head_module, with_features
from offline.stages.finetune import MEMBER_SEED_STRIDE, member_data, member_train_config, reinit_head
from service.core.preprocess import ImagePreprocessor


def _cfg(**hydra):
    over = {"family": "vit", "hydra.finetune_steps": 5, "hydra.prune_per_layer": 1}
    return load_config(None, {**over, **{f"hydra.{k}": v for k, v in hydra.items()}})


def test_member_recipe_defaults_keep_one_batch_order_and_levers_apply():
    same = [member_train_config(_cfg(), i) for i in range(3)]
    assert {t.seed for t in same} == {0}  # the default recipe: every member sees the same batches
    own = [member_train_config(_cfg(member_data="order"), i) for i in range(3)]
    assert [t.seed for t in own] == [MEMBER_SEED_STRIDE * (i + 1) for i in range(3)]
    t = member_train_config(_cfg(label_smoothing=0.2, lr=1e-4, augment=True), 0)
    assert (t.label_smoothing, t.lr, t.hflip, t.steps) == (0.2, 1e-4, True, 5)


def test_member_recipe_values_are_checked():
    for key, value in (("member_data", "shuffle"), ("label_smoothing", 1.5), ("lr", 0)):
        with pytest.raises(ConfigError, match=f"hydra.{key}"):
            _cfg(**{key: value})


def _data(n: int = 50) -> Data:
    x = np.arange(n * 4, dtype=np.uint8).reshape(n, 2, 2)
    y = np.arange(n) % 2
    split = Split(x, y)
    return Data("image", ["a", "b"], split, split, split, {}, {}, {})


def test_bootstrap_members_draw_their_own_resample_of_train():
    data = _data()
    cfg = _cfg(member_data="bootstrap")
    a, b, a2 = member_data(data, cfg, 1), member_data(data, cfg, 2), member_data(data, cfg, 1)
    assert len(a.train) == len(data.train) and np.array_equal(a.train.inputs, a2.train.inputs)
    assert not np.array_equal(a.train.inputs, b.train.inputs)
    assert len(np.unique(a.train.inputs[:, 0, 0])) < len(data.train)  # with replacement: repeats
    assert member_data(data, _cfg(member_data="order"), 1) is data


def test_reinit_head_is_seeded_and_changes_only_the_head():
    model = nn.Sequential()
    model.body = nn.Linear(4, 4)
    model.head = nn.Linear(4, 3)
    body = model.body.weight.clone()
    reinit_head(model, 7)
    w7 = model.head.weight.clone()
    reinit_head(model, 7)
    assert torch.equal(model.head.weight, w7) and torch.equal(model.body.weight, body)
    assert float(model.head.bias.detach().abs().sum()) == 0.0 and float(w7.abs().max()) <= 0.04 + 1e-6
    reinit_head(model, 8)
    assert not torch.equal(model.head.weight, w7)


def test_with_features_returns_the_heads_input():
    model = nn.Sequential()
    model.body = nn.Linear(4, 6)
    model.head = nn.Linear(6, 3)
    fn = with_features(lambda b: model.head(model.body(b["x"])), model)
    x = torch.randn(5, 4)
    logits, feats = fn({"x": x})
    assert torch.allclose(feats, model.body(x)) and logits.shape == (5, 3)
    run_logits, run_feats, run_layers = collect(fn, [({"x": x}, torch.zeros(5))])
    assert run_logits.shape == (5, 1, 3) and run_feats.shape == (5, 1, 6)  # single models: M = 1
    assert run_layers is None
    with pytest.raises(ValueError, match="no linear head"):
        head_module(nn.Sequential(nn.Linear(2, 2)))


def test_with_features_pools_every_block_but_the_last_as_the_fused_model_does():
    """Layer features of a single model: each block's output (but the last's) averaged over the tokens, over the
    real tokens only when the batch has an attention mask (padding left out)."""

    class Blocks(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList([nn.Linear(4, 4) for _ in range(3)])
            self.head = nn.Linear(4, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, 4) -> (B, 2), the first token read out
            for b in self.blocks:
                x = b(x)
            return self.head(x[:, 0])

    model = Blocks()
    x = torch.randn(2, 5, 4)
    with torch.no_grad():
        h0 = model.blocks[0](x)
        h1 = model.blocks[1](h0)
        fn = with_features(lambda b: model(b["x"]), model, list(model.blocks))
        _, feats, layers = fn({"x": x})
        assert layers.shape == (2, 2, 4) and torch.allclose(feats, model.blocks[2](h1)[:, 0])
        torch.testing.assert_close(layers, torch.stack([h0.mean(1), h1.mean(1)], dim=1))
        mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
        _, _, masked = fn({"x": x, "attention_mask": mask})
        torch.testing.assert_close(masked[0, 0], h0[0, :3].mean(0))
        torch.testing.assert_close(masked[1, 1], h1[1].mean(0))
        logits, _, collected = collect(fn, [({"x": x}, torch.zeros(2))])
    assert logits.shape == (2, 1, 2) and collected.shape == (2, 1, 2, 4)  # single models: M = 1


def test_image_eval_batches_are_the_servers_tensors():
    spec = {"type": "image", "size": [6, 6], "mean": [0.3], "std": [0.2], "interpolation": "bicubic", "channels": 3}
    pre = ImagePreprocessor(spec, 1 << 20)
    images = np.random.default_rng(0).integers(0, 256, (3, 9, 7), dtype=np.uint8)  # resized and made RGB
    ((batch, y),) = eval_batches(pre, images, [1, 0, 1])[0]
    want = torch.stack([pre.to_tensor(Image.fromarray(a)) for a in images])
    assert torch.equal(batch["pixel_values"], want) and batch["pixel_values"].shape == (3, 3, 6, 6)
    assert y.tolist() == [1, 0, 1]


def test_zero_shot_configs_refuse_class_scores_before_any_work():
    """Zero-shot labels come per request: no class statistics (energy, relative Mahalanobis); the label-free
    distances to the ID images (mahalanobis, mahalanobis_layers) are allowed."""
    for score in ("energy", "relative_mahalanobis", "mahalanobis_mi"):
        with pytest.raises(ConfigError, match="zero-shot builds serve"):
            load_config(None, {"family": "clip", "hydra.prune_total": 2, "calibration.ood_score": score})
    for score in ("mahalanobis", "mahalanobis_layers", "msp"):
        load_config(None, {"family": "clip", "hydra.prune_total": 2, "calibration.ood_score": score})
