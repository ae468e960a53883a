"""Backend / device / precision policy, and the three backends agreeing on the same artifact."""

from __future__ import annotations

import platform

import pytest
import torch

from service.core.artifact import Manifest, load_manifest
from service.core.backends import BackendConfigError, OnnxBackend, TorchBackend, TorchScriptBackend
from service.core.hardware import cpu_has_native_bf16, cpu_name
from service.core.registry import load_model
from service.runtime.plan import resolve_plan
from tests.fixtures.tiny_artifact import example_inputs
from tests.service.helpers import manifest_of


def manifest(onnx: bool = True, ts: bool = True, bf16_ok: bool | None = True) -> Manifest:
    exports = {}
    if onnx:
        exports["onnx"] = {"file": "model.onnx", "max_abs_diff": 1e-6, "tolerance": 1e-4}
    if ts:
        exports["torchscript"] = {"file": "model.ts", "max_abs_diff": 0.0, "tolerance": 1e-4}
    precision = {"bf16": {"ok": bf16_ok, "argmax_agreement": 0.999}} if bf16_ok is not None else {}
    return manifest_of(exports=exports, precision=precision)


def plan(m: Manifest, **kw) -> tuple[str, str, str]:
    hw = {"cuda_available": False, "cpu_bf16": False, "onnx_available": True}
    hw.update({k: kw.pop(k) for k in list(kw) if k in hw})
    p = resolve_plan(m, **kw, **hw)
    return p.backend, p.device, p.precision


@pytest.mark.parametrize(
    ("m", "kw", "want"),
    [
        # CPU without native bf16: fp32, ONNX Runtime when exported, else eager
        (manifest(), {}, ("onnx", "cpu", "fp32")),
        (manifest(onnx=False), {}, ("torch", "cpu", "fp32")),
        (manifest(), {"onnx_available": False}, ("torch", "cpu", "fp32")),
        # CPU with native bf16: bf16 eager only when the build recorded bf16 agrees
        (manifest(), {"cpu_bf16": True}, ("torch", "cpu", "bf16")),
        (manifest(bf16_ok=False), {"cpu_bf16": True}, ("onnx", "cpu", "fp32")),
        (manifest(bf16_ok=None), {"cpu_bf16": True}, ("onnx", "cpu", "fp32")),
        # CUDA: torch with bf16 autocast
        (manifest(), {"cuda_available": True}, ("torch", "cuda", "bf16")),
        (manifest(), {"cuda_available": True, "device": "cpu"}, ("onnx", "cpu", "fp32")),
        # explicit choices win; auto precision follows an fp32-only export
        (manifest(), {"backend": "torchscript", "cpu_bf16": True}, ("torchscript", "cpu", "fp32")),
        (manifest(), {"backend": "onnx", "cuda_available": True}, ("onnx", "cuda", "fp32")),
        (manifest(), {"precision": "bf16"}, ("torch", "cpu", "bf16")),
        (manifest(), {"precision": "fp32", "backend": "torch"}, ("torch", "cpu", "fp32")),
    ],
)
def test_plan_policy(m, kw, want):
    assert plan(m, **kw) == want


@pytest.mark.parametrize(
    ("m", "kw", "match"),
    [
        (manifest(), {"device": "cuda"}, "no CUDA device"),
        (manifest(onnx=False), {"backend": "onnx"}, "no ONNX export"),
        (manifest(), {"backend": "onnx", "onnx_available": False}, "onnxruntime is not installed"),
        (manifest(ts=False), {"backend": "torchscript"}, "no TorchScript export"),
        (manifest(), {"backend": "onnx", "precision": "bf16"}, "fp32 only"),
        (manifest(), {"backend": "torchscript", "precision": "bf16"}, "fp32 only"),
    ],
)
def test_impossible_plans_are_refused(m, kw, match):
    with pytest.raises(BackendConfigError, match=match):
        plan(m, **kw)


@pytest.mark.parametrize(
    ("flags", "native"),
    [("fpu sse avx512f avx512_bf16 amx_tile", True), ("fpu amx_bf16 amx_tile", True), ("fpu sse4_2 avx2", False)],
)
def test_cpu_bf16_flags(tmp_path, flags, native):
    p = tmp_path / "cpuinfo"
    p.write_text(f"processor\t: 0\nvendor_id\t: X\nflags\t\t: {flags}\n\nprocessor\t: 1\n")
    assert cpu_has_native_bf16(p) is native
    assert cpu_has_native_bf16(tmp_path / "missing") is False


def test_cpu_name(tmp_path):
    p = tmp_path / "cpuinfo"
    p.write_text("processor\t: 0\nvendor_id\t: X\nmodel name\t: AMD EPYC 9654 96-Core Processor\n")
    assert cpu_name(p) == "AMD EPYC 9654 96-Core Processor"
    assert cpu_name(tmp_path / "missing") == (platform.processor() or platform.machine())


@pytest.mark.parametrize("family", ["vit", "bert"])
def test_three_backends_agree(artifacts, family):
    root = artifacts[family]
    m = load_manifest(root)
    names = m.model.inputs
    model = load_model(root / m.model.weights, m.model.config)
    x = example_inputs(family, batch=5, seq=13, seed=7)  # other batch and length than the export traced
    eager = TorchBackend(model, names, "cpu", "fp32")(x)
    assert eager.shape == (5, 3, 4)
    ts = TorchScriptBackend(root / "model.ts", names, "cpu", "fp32")
    for backend in (ts, OnnxBackend(root / "model.onnx", names, "cpu")):
        y = backend(x)
        assert y.dtype == torch.float32 and y.shape == eager.shape
        torch.testing.assert_close(y, eager, atol=1e-4, rtol=1e-4)
    bf16 = TorchBackend(model, names, "cpu", "bf16")(x)
    assert bf16.dtype == torch.float32  # autocast output handed back as fp32
    assert (bf16 - eager).abs().max() < 0.2


@pytest.mark.parametrize("family", ["vit", "bert"])
def test_bf16_backend_stores_gemm_weights_in_bf16_with_the_same_outputs(family):
    """TorchBackend in bf16 keeps its matrix weights in bf16 (cast once, not on every call): the outputs are bit for
    bit those of bf16 autocast over the fp32 model; norms and embeddings stay fp32."""
    import copy

    from service.core.backends import TorchBackend
    from service.core.fused import tiny_config
    from service.core.registry import build_model

    torch.manual_seed(0)
    model = build_model(tiny_config(family)).eval()
    model.with_features = True
    reference = copy.deepcopy(model)
    inputs = (
        {"pixel_values": torch.randn(3, 1, 16, 16)}
        if family == "vit"
        else {"input_ids": torch.randint(0, 1000, (3, 7)), "attention_mask": torch.ones(3, 7, dtype=torch.long)}
    )
    names = list(inputs)
    backend = TorchBackend(model, names, "cpu", "bf16")
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
        want = reference(*(inputs[k] for k in names))
    got = backend.outputs(inputs)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w.float())
    low = {n for n, p in backend.model.named_parameters() if p.dtype == torch.bfloat16}
    assert low and all(
        n.endswith(".weight")
        and ("attn." in n or "mlp." in n or n.split(".")[0] in ("patch_embed", "head", "classifier", "pooler"))
        for n in low
    ), low


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("family", ["vit", "bert"])
def test_cuda_inputs_go_through_reused_pinned_buffers_with_the_same_outputs(artifacts, family):
    """On CUDA each input is staged in a page-locked buffer reused across batches (the copy to the device is
    asynchronous): batches of different sizes, one after another, give what the CPU gives."""
    m = load_manifest(artifacts[family])
    names = list(example_inputs(family, batch=1).keys())
    cuda = TorchBackend(load_model(artifacts[family] / m.model.weights, m.model.config), names, "cuda", "fp32")
    cpu = TorchBackend(load_model(artifacts[family] / m.model.weights, m.model.config), names, "cpu", "fp32")
    for batch, seed in ((4, 1), (2, 2), (4, 3), (7, 4)):
        inputs = example_inputs(family, batch=batch, seed=seed)
        torch.testing.assert_close(cuda(inputs), cpu(inputs), atol=1e-4, rtol=1e-4)
    assert cuda._pinned and all(b.is_pinned() for b in cuda._pinned.values())
