"""The runtimes package: one registry, the answer built as the response models dump, the eager-only device policy."""

from __future__ import annotations

import json

import pytest
import torch

from service.api.answers import build_predictions
from service.api.schemas import PredictResponse
from service.core.backends import BackendConfigError
from service.runtime import RUNTIMES, ClassifierRuntime, CLIPZeroShotRuntime, summarize_rows
from service.runtime.plan import resolve_plan
from tests.service.helpers import manifest_of

LABELS = ["cat", "dog", "ship"]


def test_registry_is_filled_at_import():
    assert RUNTIMES == {"classification": ClassifierRuntime, "zero-shot": CLIPZeroShotRuntime}


def test_answer_is_the_response_model_and_members_only_when_asked():
    results = summarize_rows(torch.randn(2, 4, 3, generator=torch.Generator().manual_seed(0)), 1.5, "msp", 0.5)
    for members in (False, True):
        preds = build_predictions(results, LABELS, top_k=9, return_members=members, metric="msp", threshold=0.5)
        timing = {"queue_ms": 0.0, "inference_ms": 1.0, "total_ms": 2.0}
        answer = {"id": "r1", "model": "m", "model_version": "v1", "predictions": preds, "timing": timing}
        body = json.loads(json.dumps(answer))
        # what the client reads fits the documented schema, and is exactly its dump without unset fields
        assert PredictResponse.model_validate(body).model_dump(exclude_none=True) == body
        for p, r in zip(body["predictions"], results, strict=True):
            assert ("members" in p) is members
            assert len(p["top_k"]) == len(LABELS)  # clamped to the label count
            assert p["label"] == LABELS[r.prediction] and p["confidence"] == pytest.approx(float(r.probs.max()))
            assert list(p["ood"]) == ["flag", "score", "metric", "threshold"] + (["reason"] if r.ood_flag else [])
            if members:
                assert len(p["members"]) == 4


HW = {"cuda_available": False, "cpu_bf16": True, "onnx_available": True}
ZS = manifest_of("zero-shot", name="zs", precision={"bf16": {"ok": True}})


@pytest.mark.parametrize(
    ("kw", "want"),
    [
        # CPU: fp32 even with native bf16 and a bf16 agreement on record; bf16 only when asked for
        ({}, ("torch", "cpu", "fp32")),
        ({"precision": "bf16"}, ("torch", "cpu", "bf16")),
        # CUDA: bf16 autocast; an explicit fp32 wins
        ({"cuda_available": True}, ("torch", "cuda", "bf16")),
        ({"cuda_available": True, "precision": "fp32"}, ("torch", "cuda", "fp32")),
        # the exported backends are the classifiers': torch eager whatever HYDRA_BACKEND says
        ({"backend": "onnx"}, ("torch", "cpu", "fp32")),
    ],
)
def test_eager_only_plan(kw, want):
    p = resolve_plan(ZS, eager_only=True, **{**HW, **kw})
    assert (p.backend, p.device, p.precision) == want
    assert p.reason.startswith(f"zero-shot runs torch eager; precision {want[2]}")
    assert ("applies to classifiers only" in p.reason) == ("backend" in kw)


def test_eager_only_plan_refuses_a_missing_gpu():
    with pytest.raises(BackendConfigError, match="zs: HYDRA_DEVICE=cuda but no CUDA device is visible"):
        resolve_plan(ZS, device="cuda", eager_only=True, **HW)
