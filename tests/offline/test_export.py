"""TorchScript and ONNX exports of the tiny fused models match eager; a tampered export fails the check."""

from __future__ import annotations

import copy

import pytest
import torch

from offline.models.export import (
    BF16_TOLERANCE,
    ExportMismatch,
    bf16_agreement,
    check_parity,
    export_onnx,
    export_torchscript,
    input_order,
)
from service.core.backends import onnx_session
from service.core.fused import tiny_config
from service.core.registry import build_model

TOL = 1e-4


def _vit_batch(b: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"pixel_values": torch.randn(b, 1, 16, 16, generator=g)}


def _bert_batch(b: int, t: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 30522, (b, t), generator=g)
    mask = torch.ones(b, t, dtype=torch.long)
    for i in range(b):  # every other sequence padded, to a different length
        if i % 2 == 1:
            mask[i, 2 + i % (t - 2) :] = 0
    ids[mask == 0] = 0  # [PAD]
    return {"input_ids": ids, "attention_mask": mask}


def _model(family: str, shared_norms: bool) -> torch.nn.Module:
    """Random fused model; ``shared_norms``: every member keeps the same LayerNorm affine (members pruned from
    one base model, not fine-tuned), which the fused model runs as one LayerNorm; else they differ per member."""
    torch.manual_seed(0)
    model = build_model(tiny_config(family)).eval()
    with torch.no_grad():  # random biases (and norms) too, so that no path hides behind a zero init
        for name, p in model.named_parameters():
            if "norm" in name and shared_norms:
                p.add_(torch.randn_like(p[:1]) * 0.1)  # the same change for every member
            else:
                p.add_(torch.randn_like(p) * 0.1)
    return model


# ViT with shared LayerNorms, BERT with per-member ones: both LayerNorm paths of the fused model are exported
CASES = {
    "vit": (
        lambda: {"pixel_values": _vit_batch(2, 0)["pixel_values"]},
        lambda: [_vit_batch(b, 10 + b) for b in (1, 3, 5)],
    ),
    "bert": (lambda: _bert_batch(2, 9, 0), lambda: [_bert_batch(b, t, 10 * b + t) for b in (1, 3, 5) for t in (7, 13)]),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request, tmp_path_factory):
    family = request.param
    example, batches = CASES[family]
    model = _model(family, shared_norms=family == "vit")
    return family, model, example(), batches(), tmp_path_factory.mktemp(family)


def test_torchscript_parity(case):
    family, model, example, batches, d = case
    export_torchscript(model, example, d / "model.ts")
    diff = check_parity(model, d / "model.ts", "torchscript", batches, TOL)
    assert 0.0 <= diff <= TOL


def test_onnx_parity_dynamic_axes(case):
    family, model, example, batches, d = case
    export_onnx(model, example, d / "model.onnx", output_names=["logits"])
    sess = onnx_session(d / "model.onnx")
    names = [i.name for i in sess.get_inputs()]
    assert names == input_order(model, example) == list(example)
    assert sess.get_outputs()[0].name == "logits"
    # batch (and sequence) axes are symbolic, not the example's sizes
    assert all(isinstance(i.shape[0], str) for i in sess.get_inputs())
    if family == "bert":
        assert all(isinstance(i.shape[1], str) for i in sess.get_inputs())
    diff = check_parity(model, d / "model.onnx", "onnx", batches, TOL)
    assert 0.0 <= diff <= TOL
    out = sess.run(None, {k: v.numpy() for k, v in batches[-1].items()})[0]
    assert out.shape == (batches[-1][names[0]].shape[0], 3, 4)  # (B, M, C)


@pytest.mark.parametrize("kind", ["torchscript", "onnx"])
def test_tampered_export_raises(case, kind):
    family, model, example, batches, d = case
    path = d / f"tampered.{kind}"
    if kind == "torchscript":
        export_torchscript(model, example, path)
    else:
        export_onnx(model, example, path, output_names=["logits"])
    changed = copy.deepcopy(model)
    with torch.no_grad():
        head = changed.head if family == "vit" else changed.classifier
        head.bias[1, 0, 2] += 0.01  # member 1, class 2: eager now differs from the export by exactly 0.01
    with pytest.raises(ExportMismatch, match=r"batch 0 .*max abs diff 0\.01 > tolerance 0\.0001"):
        check_parity(changed, path, kind, batches, TOL)
    # within a looser tolerance the same export passes, and the measured difference is the change
    assert check_parity(changed, path, kind, batches, 0.02) == pytest.approx(0.01, abs=1e-5)


def test_inputs_must_match_forward_signature(case):
    family, model, example, batches, d = case
    with pytest.raises(ValueError, match="missing"):
        export_torchscript(model, {"wrong": next(iter(example.values()))}, d / "bad.ts")
    with pytest.raises(ValueError, match="unknown export kind"):
        check_parity(model, d / "bad.ts", "tflite", batches, TOL)


def test_bf16_agreement_report(case):
    family, model, example, batches, d = case
    r = bf16_agreement(model, batches, temperature=1.5)
    assert set(r) >= {"argmax_agreement", "max_abs_diff", "tolerance", "ok", "n"}
    assert r["n"] == sum(next(iter(b.values())).shape[0] for b in batches)
    assert set(r["max_abs_diff"]) == set(BF16_TOLERANCE) == {"msp", "entropy", "mutual_information"}
    assert 0.0 <= r["argmax_agreement"] <= 1.0
    # bf16 really ran: the logits differ a little, the uncertainty fields stay within tolerance
    assert 0.0 < r["max_abs_logit_diff"] < 0.5
    assert all(0.0 <= v <= BF16_TOLERANCE[k] for k, v in r["max_abs_diff"].items())
    assert r["ok"] is (r["argmax_agreement"] >= 0.99)


def test_shared_eager_reference_gives_the_same_checks(case):
    """The build computes the fp32 eager outputs once for the TorchScript, ONNX and bf16 checks."""
    from offline.models.export import eager_outputs

    family, model, example, batches, d = case
    export_torchscript(model, example, d / "shared.ts")
    ref = eager_outputs(model, batches)
    assert check_parity(model, d / "shared.ts", "torchscript", batches, TOL, reference=ref) == check_parity(
        model, d / "shared.ts", "torchscript", batches, TOL
    )
    assert bf16_agreement(model, batches, 1.5, reference=ref) == bf16_agreement(model, batches, 1.5)
    # a reference that is not the model's own output is what gets compared against
    shifted = [tuple(o + 0.01 for o in r) for r in ref]
    with pytest.raises(ExportMismatch, match="max abs diff 0.01"):
        check_parity(model, d / "shared.ts", "torchscript", batches, TOL, reference=shifted)
    with pytest.raises(ValueError, match="reference outputs"):
        bf16_agreement(model, batches, 1.5, reference=ref[:1])


@pytest.mark.parametrize("kind", ["torchscript", "onnx"])
def test_exports_carry_the_features_and_the_check_covers_them(case, kind):
    """With ``with_features`` the exports give (logits (B, M, C), features (B, M, D)); a features-only difference
    fails the parity check, naming output 1."""
    from offline.models.export import eager_outputs, export_checked

    family, model, example, batches, d = case
    model.with_features = True
    path = d / ("feat.ts" if kind == "torchscript" else "feat.onnx")
    diff = export_checked(model, kind, path, batches, TOL, ["logits", "features"])
    assert 0.0 <= diff <= TOL
    ref = eager_outputs(model, batches)
    logits, feats = ref[0]
    assert logits.shape[:2] == feats.shape[:2] and feats.shape[2] == model.dim
    shifted = [(r[0], r[1] + 0.01) for r in ref]
    with pytest.raises(ExportMismatch, match="output 1"):
        check_parity(model, path, kind, batches, TOL, reference=shifted)


def test_bf16_flag_agreement_compares_the_served_flags(case):
    """The served flag under bf16 autocast vs fp32, on the model's own outputs (logits and features)."""
    from offline.models.export import bf16_flag_agreement, eager_outputs

    family, model, example, batches, d = case
    model.with_features = True
    ref = eager_outputs(model, batches)
    assert bf16_flag_agreement(model, batches, ref, lambda outs: torch.ones(len(outs[0]), dtype=torch.bool)) == 1.0
    median = float(torch.cat([r[1].norm(dim=-1).mean(1) for r in ref]).median())
    share = bf16_flag_agreement(model, batches, ref, lambda outs: outs[1].norm(dim=-1).mean(1) > median)
    assert 0.8 <= share <= 1.0  # features move a little in bf16: flags right at the threshold may flip
