"""Tiny random-init models of the real architectures (timm ViT, transformers BERT)."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch

from offline.config import BuildConfig, load_config


def tiny_vit(depth: int = 3, heads: int = 4, num_classes: int = 5, **kw):
    from timm.models.vision_transformer import VisionTransformer

    torch.manual_seed(0)
    model = VisionTransformer(
        img_size=16, patch_size=4, in_chans=1, embed_dim=32, depth=depth, num_heads=heads, num_classes=num_classes, **kw
    ).eval()
    with torch.no_grad():  # timm zero-inits the head: widen so that heads change the answers
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.3)
    return model


def tiny_bert(layers: int = 3, heads: int = 4, num_labels: int = 3):
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    cfg = BertConfig(
        vocab_size=100,
        hidden_size=32,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        intermediate_size=64,
        num_labels=num_labels,
        max_position_embeddings=64,
        attn_implementation="eager",
    )
    model = BertForSequenceClassification(cfg).eval()
    with torch.no_grad():  # BERT's init (std 0.02) makes outputs nearly input-independent; widen it
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.3)
    return model


def bert_batch(batch: int = 4, seq: int = 9, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 100, (batch, seq), generator=g)
    mask = torch.ones(batch, seq, dtype=torch.long)
    mask[1, 5:] = 0  # padded sequences
    mask[-1, 2:] = 0
    return {"input_ids": ids, "attention_mask": mask}


@pytest.fixture
def vit():
    return tiny_vit()


@pytest.fixture
def bert():
    return tiny_bert()


# ----------------------------------------------------------------------------- what a user brings
LABELS = ["billing", "delivery", "praise"]
WORDS = {
    "billing": ["invoice", "charged twice", "refund", "payment failed", "my card"],
    "delivery": ["parcel late", "courier", "tracking number", "not delivered", "wrong address"],
    "praise": ["great service", "thank you", "love it", "very helpful", "excellent support"],
}


def save_minilm_like(folder: Path, hidden: int, heads: int, max_positions: int = 512) -> None:
    """A random 2-layer BertForSequenceClassification with a 1000-label head and MiniLM's vocabulary (MLP width
    ``2 * hidden``), saved in ``folder`` with MiniLM's tokenizer, as a user's checkpoint is."""
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

    from offline.train import minilm_path

    cfg = BertConfig(
        vocab_size=30522,
        hidden_size=hidden,
        num_hidden_layers=2,
        num_attention_heads=heads,
        intermediate_size=2 * hidden,
        max_position_embeddings=max_positions,
        num_labels=1000,
    )
    torch.manual_seed(0)
    BertForSequenceClassification(cfg).save_pretrained(folder)
    AutoTokenizer.from_pretrained(minilm_path()).save_pretrained(folder)


@pytest.fixture(scope="module")
def user_files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A tiny random BertForSequenceClassification with a 1000-label head (save_pretrained, with a tokenizer) and
    a CSV of 150 labelled texts."""
    return write_user_files(tmp_path_factory.mktemp("user"))


def write_user_files(root: Path) -> tuple[Path, Path]:
    """:func:`user_files`' checkpoint and CSV written under ``root``: ``(checkpoint folder, CSV)``."""
    save_minilm_like(root / "ckpt", hidden=48, heads=4, max_positions=64)
    with open(root / "tickets.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["text", "label"])
        for i in range(150):
            label = LABELS[i % 3]
            w.writerow([f"{WORDS[label][i % 5]} ticket {i}", label])
    return root / "ckpt", root / "tickets.csv"


def ticket_build(ckpt: Path, data: Path, **extra: object) -> dict[str, object]:
    """Config overrides of a tiny build from ``user_files`` (the HF checkpoint and its CSV), plus ``extra``."""
    return {
        "name": "tickets",
        "family": "bert",
        "base.source": f"hf:{ckpt}",
        "base.preset": "bert_fast",
        "base.steps": 6,
        "base.max_length": 24,
        "data.setting": "text-file",
        "data.path": str(data),
        "data.max_train": 90,
        "data.max_val": 30,
        "data.max_test": 30,
        "hydra.prune_per_layer": 1,
        "hydra.calib_samples": 8,
        "hydra.finetune_steps": 2,
        "export.torchscript": False,
        "export.bf16_check": False,
        **extra,
    }


def ticket_config(ckpt: Path, data: Path, **extra: object) -> BuildConfig:
    """The loaded config of :func:`ticket_build` (no YAML file)."""
    return load_config(None, ticket_build(ckpt, data, **extra))
