"""The Single model of an artifact, for the cost comparison: the base architecture the members were pruned from, one
stream, every head, no shared trunk, exported with the artifact's own exporters.

The artifact does not carry its base model's weights, and its cost does not depend on them: the Single here is the
same configuration as the fused model with ``members = 1`` and ``num_heads = dim / head_dim`` in every layer (the
unpruned timm ViT or BERT encoder: their attention width equals the model width), random weights, the same outputs
(logits, and the features the served OOD score reads), in eager PyTorch, TorchScript and ONNX as the artifact
exports them. ``benchmarks/bench_server.py`` times it beside the Hydra model with the same backend, precision and
threads: the headline ratio is the server's answers per second over this model's inputs per second at its best
batch.
"""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

__all__ = ["single_config", "single_artifact"]


def single_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """The fused config ``cfg`` as its unpruned base: one member, every head in every layer, no shared trunk."""
    layers = len(cfg["num_heads"])
    heads = cfg["dim"] // cfg["head_dim"]
    if heads * cfg["head_dim"] != cfg["dim"] or heads < max(cfg["num_heads"]):
        raise ValueError(f"cannot infer the base's heads from dim {cfg['dim']} and head_dim {cfg['head_dim']}")
    out = {**copy.deepcopy(cfg), "members": 1, "num_heads": [heads] * layers}
    out.pop("shared_blocks", None)
    return out


def single_artifact(artifact: Path, out: Path, example: dict[str, torch.Tensor]) -> Path:
    """Write the Single of ``artifact`` to ``out`` (weights, the artifact's exports, a manifest that
    :func:`service.runtime.plan.load_backend` reads) and return ``out``; ``example``: a batch of model inputs (the
    preprocessor's) to trace the exports on."""
    from offline.models.export import export_onnx, export_torchscript
    from service.core.registry import build_model

    doc = json.loads((Path(artifact) / "manifest.json").read_text())
    spec = doc["model"]
    cfg = single_config(spec["config"])
    torch.manual_seed(0)
    model = build_model(cfg).eval()
    model.with_features = "features" in spec["outputs"]
    model.with_layer_features = "layer_features" in spec["outputs"]
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = (doc.get("preprocessing") or {}).get("tokenizer")
    if tokenizer:  # the text models' preprocessing reads it from the artifact
        shutil.copytree(Path(artifact) / tokenizer, out / tokenizer, dirs_exist_ok=True)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(out / spec["weights"]))
    exports = doc.get("exports") or {}
    if "torchscript" in exports:
        export_torchscript(model, example, out / exports["torchscript"]["file"])
    if "onnx" in exports:
        export_onnx(model, example, out / exports["onnx"]["file"], list(spec["outputs"]))
    doc.pop("shared_blocks", None)  # one stream from the start: no trunk
    doc.update(
        name=f"{doc['name']}-single",
        members=1,
        heads=[[list(range(h)) for h in cfg["num_heads"]]],
        model={**spec, "config": cfg},
        exports={k: v for k, v in exports.items() if k in ("torchscript", "onnx")},
    )
    (out / "manifest.json").write_text(json.dumps(doc, indent=1))
    return out
