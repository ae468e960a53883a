"""What a user does: their own Hugging Face checkpoint and a CSV of labelled texts, without OOD data -> build ->
serve -> /predict; the served probabilities are the builder's evaluation-time probabilities for the same text."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch
from fastapi.testclient import TestClient

from offline.build import build
from offline.config import load_config
from offline.train import minilm_path
from service.artifact import load_manifest
from service.main import create_app
from service.models import load_model
from service.preprocess import make_preprocessor
from service.uncertainty import summarize
from tests.service.helpers import settings_for

LABELS = ["billing", "delivery", "praise"]
WORDS = {
    "billing": ["invoice", "charged twice", "refund", "payment failed", "my card"],
    "delivery": ["parcel late", "courier", "tracking number", "not delivered", "wrong address"],
    "praise": ["great service", "thank you", "love it", "very helpful", "excellent support"],
}


@pytest.fixture(scope="module")
def user_files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A tiny random BertForSequenceClassification with a 1000-label head (save_pretrained, with a tokenizer) and
    a CSV of 150 labelled texts."""
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

    root = tmp_path_factory.mktemp("user")
    cfg = BertConfig(vocab_size=30522, hidden_size=48, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=96, max_position_embeddings=64, num_labels=1000)  # fmt: skip
    torch.manual_seed(0)
    BertForSequenceClassification(cfg).save_pretrained(root / "ckpt")
    AutoTokenizer.from_pretrained(minilm_path()).save_pretrained(root / "ckpt")
    with open(root / "tickets.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["text", "label"])
        for i in range(150):
            label = LABELS[i % 3]
            w.writerow([f"{WORDS[label][i % 5]} ticket {i}", label])
    return root / "ckpt", root / "tickets.csv"


def test_hf_checkpoint_and_csv_build_serve_and_predict(user_files, tmp_path):
    ckpt, data = user_files
    cfg = load_config(None, {
        "name": "tickets", "family": "bert", "base.source": f"hf:{ckpt}", "base.preset": "bert_fast",
        "base.steps": 6, "base.max_length": 24, "data.setting": "text-file", "data.path": str(data),
        "data.max_train": 90, "data.max_val": 30, "data.max_test": 30, "hydra.prune_per_layer": 1,
        "hydra.calib_samples": 8, "hydra.finetune_steps": 2, "export.torchscript": False, "export.bf16_check": False,
    })  # fmt: skip
    out = build(cfg, tmp_path / "artifact")
    m = load_manifest(out)
    assert m["labels"] == LABELS  # from the CSV's label column, sorted
    assert m["ood"]["selected"] == m["uncertainty"]["ood_score"] == "mahalanobis"  # no OOD data: the fallback
    assert "no OOD data" in (out / "report.md").read_text()
    texts = ["I was charged twice on my card", "where is my parcel", "thanks, great service"]
    app = create_app(settings_for(out, backend="onnx"))
    with TestClient(app) as c:
        r = c.post("/predict", json={"texts": texts, "top_k": 3})
    assert r.status_code == 200, r.text
    served = torch.tensor([[{t["label"]: t["prob"] for t in p["top_k"]}[label] for label in LABELS]
                           for p in r.json()["predictions"]])  # fmt: skip
    # the builder's evaluation path: the artifact's preprocessing and the fused eager model, at its temperature
    pre = make_preprocessor(m["preprocessing"], out, 1 << 20)
    model = load_model(out / "model.safetensors", m["model"]["config"])
    with torch.inference_mode():
        logits = model(**pre.collate(pre.encode(texts)))
    want = summarize(logits, m["uncertainty"]["temperature"])["probs"]
    torch.testing.assert_close(served, want, atol=1e-4, rtol=0)
