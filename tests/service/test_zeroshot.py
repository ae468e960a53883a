"""The zero-shot runtime (service/runtime/zeroshot.py) behind /zero-shot and /predict, on a tiny random fused CLIP."""

from __future__ import annotations

import io
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient
from PIL import Image
from safetensors.torch import save_file

from service.core.artifact import OODSpec, load_manifest, write_manifest
from service.core.fused_clip import FusedCLIP, zero_shot_logits
from service.core.preprocess import ImagePreprocessor, TextPreprocessor
from service.core.registry import build_model
from service.core.uncertainty import summarize
from service.entrypoints.app import create_app
from service.runtime import RUNTIMES, CLIPZeroShotRuntime, TextCache
from tests.fixtures.tiny_artifact import CLIP_PREP, make_tiny_clip_artifact
from tests.service.helpers import assert_error, b64, settings_for

LABELS = ["cat", "dog", "ship"]
TEMPERATURE = 1.3
PREP = CLIP_PREP


@pytest.fixture(scope="module")
def zs_artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny zero-shot artifact written like offline/pipelines/zeroshot_build.py (torch weights, tokenizer,
    manifest)."""
    return make_tiny_clip_artifact(tmp_path_factory.mktemp("zs") / "tiny-clip", labels=LABELS, temperature=TEMPERATURE)


@pytest.fixture(scope="module")
def zs_client(zs_artifact: Path) -> Iterator[TestClient]:
    with TestClient(create_app(settings_for(zs_artifact))) as c:
        yield c


def rgb_png(seed: int) -> bytes:
    arr = np.random.default_rng(seed).integers(0, 256, (16, 16, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")
    return buf.getvalue()


def reference_probs(root: Path, images: list[bytes], labels: list[str], template: str) -> dict[str, torch.Tensor]:
    """Direct computation: FusedCLIP from the artifact, embeddings, zero_shot_logits, summarize."""
    m = load_manifest(root)
    model = build_model(m.model.config)
    from safetensors.torch import load_file

    model.load_state_dict(load_file(str(root / m.model.weights)))
    model.eval()
    assert isinstance(model, FusedCLIP)
    pre = ImagePreprocessor(m.preprocessing, 10**8)
    tpre = TextPreprocessor(m.preprocessing.text, root)
    batch = tpre.collate(tpre.encode([template.format(label=lab) for lab in labels]))
    with torch.no_grad():
        img = model.encode_image(torch.stack([pre(x) for x in images]))  # (B, M, D)
        txt = model.encode_text(batch["input_ids"], batch["attention_mask"])  # (L, M, D)
        logits = zero_shot_logits(img, txt, model.logit_scale.exp(), model.logit_bias)  # (B, M, L)
    return summarize(logits, m.uncertainty.temperature)


def probs_of(pred: dict, labels: list[str]) -> np.ndarray:
    """Ensemble probabilities in ``labels`` order from an answer's full top_k."""
    by = {t["label"]: t["prob"] for t in pred["top_k"]}
    return np.array([by[lab] for lab in labels])


def cache_count(client: TestClient, result: str) -> float:
    prefix = f'hydra_zero_shot_text_cache_total{{model="tiny-clip",result="{result}"}} '
    lines = [ln for ln in client.get("/metrics").text.splitlines() if ln.startswith(prefix)]
    return float(lines[0].split()[-1]) if lines else 0.0


def test_registered_and_described(zs_client: TestClient):
    assert RUNTIMES["zero-shot"] is CLIPZeroShotRuntime
    (model,) = zs_client.get("/v1/models").json()["models"]
    assert (model["task"], model["modality"], model["backend"], model["device"], model["precision"]) == (
        "zero-shot",
        "image",
        "torch",
        "cpu",
        "fp32",
    )
    assert model["labels"] == LABELS
    zs = model["zero_shot"]  # what the runtime describes reaches the answer
    assert zs["template"] and "{label}" in zs["template"]
    assert isinstance(zs["embed_dim"], int) and zs["embed_dim"] > 0
    assert isinstance(zs["text_cache_size"], int)


def test_zero_shot_matches_direct_computation(zs_client: TestClient, zs_artifact: Path):
    labels, template = ["truck", "frog", "airplane", "horse"], "a blurry picture of the {label}"
    images = [rgb_png(1), rgb_png(2)]
    body = {
        "images": [b64(x) for x in images],
        "labels": labels,
        "template": template,
        "top_k": 4,
        "return_members": True,
    }
    r = zs_client.post("/zero-shot", json=body)
    assert r.status_code == 200, r.text
    preds = r.json()["predictions"]
    ref = reference_probs(zs_artifact, images, labels, template)
    assert len(preds) == 2
    for i, p in enumerate(preds):
        np.testing.assert_allclose(probs_of(p, labels), ref["probs"][i].numpy(), atol=1e-5)
        assert p["label"] == labels[int(ref["prediction"][i])] and p["label_index"] == int(ref["prediction"][i])
        assert p["uncertainty"]["mutual_information"] == pytest.approx(float(ref["mutual_information"][i]), abs=1e-5)
        assert p["ood"]["threshold"] == 0.5 and p["ood"]["flag"] == (float(ref["msp"][i]) < 0.5)
        assert [m["label"] for m in p["members"]] == [labels[j] for j in ref["member_probs"][i].argmax(-1).tolist()]
    # labels follow the request order: reversing them permutes the probabilities the same way
    r2 = zs_client.post("/zero-shot", json={**body, "labels": labels[::-1]})
    for p, q in zip(preds, r2.json()["predictions"], strict=True):
        np.testing.assert_allclose(probs_of(q, labels[::-1]), probs_of(p, labels[::-1]), atol=1e-6)
        assert q["label"] == p["label"] and q["label_index"] == len(labels) - 1 - p["label_index"]


def test_text_cache_hit_on_second_call(zs_client: TestClient):
    body = {"image": b64(rgb_png(3)), "labels": ["apple", "pear", "plum"], "template": "{label}, a fruit"}
    hits, misses = cache_count(zs_client, "hit"), cache_count(zs_client, "miss")
    first = zs_client.post("/zero-shot", json=body)
    assert cache_count(zs_client, "miss") == misses + 1 and cache_count(zs_client, "hit") == hits
    second = zs_client.post("/zero-shot", json=body)
    assert cache_count(zs_client, "miss") == misses + 1 and cache_count(zs_client, "hit") == hits + 1
    assert first.json()["predictions"] == second.json()["predictions"]
    # another template is another entry; multipart uses the same cache
    files = [("file", ("a.png", rgb_png(3), "image/png"))]
    r = zs_client.post(
        "/zero-shot", files=files, data={"labels": '["apple", "pear", "plum"]', "template": "{label}, a fruit"}
    )
    assert r.status_code == 200, r.text
    assert cache_count(zs_client, "hit") == hits + 2
    np.testing.assert_allclose(
        probs_of(r.json()["predictions"][0], ["apple", "pear", "plum"]),
        probs_of(first.json()["predictions"][0], ["apple", "pear", "plum"]),
        atol=1e-6,
    )


def test_text_cache_is_bounded_lru():
    cache = TextCache(2)
    a, b, c = ((("a",), "t"), (("b",), "t"), (("c",), "t"))
    cache.put(a, torch.zeros(1))
    cache.put(b, torch.ones(1))
    assert cache.get(a) is not None  # a is now the most recent
    cache.put(c, torch.ones(1))
    assert len(cache) == 2 and cache.get(b) is None and cache.get(a) is not None and cache.get(c) is not None


def test_predict_uses_fixed_labels(zs_client: TestClient, zs_artifact: Path):
    img = rgb_png(4)
    r = zs_client.post("/predict", json={"image": b64(img), "top_k": 3})
    assert r.status_code == 200, r.text
    (p,) = r.json()["predictions"]
    ref = reference_probs(zs_artifact, [img], LABELS, "A photo of a {label}.")
    np.testing.assert_allclose(probs_of(p, LABELS), ref["probs"][0].numpy(), atol=1e-5)
    # same answer through /zero-shot with the fixed labels and template
    z = zs_client.post("/zero-shot", json={"image": b64(img), "labels": LABELS, "top_k": 3})
    np.testing.assert_allclose(probs_of(z.json()["predictions"][0], LABELS), probs_of(p, LABELS), atol=1e-6)
    # texts are not an image model's input
    assert_error(zs_client.post("/predict", json={"text": "hello"}), 400, "invalid_input", "text")


def test_bad_inputs(zs_client: TestClient):
    img = b64(rgb_png(5))
    ok = {"image": img, "labels": ["cat", "dog"]}
    assert_error(zs_client.post("/zero-shot", json={**ok, "labels": ["cat"]}), 422, "invalid_input", "labels")
    many = [f"label {i}" for i in range(10_000)]
    assert_error(
        zs_client.post("/zero-shot", json={**ok, "labels": many}), 400, "invalid_input", "labels", "HYDRA_MAX_LABELS"
    )
    assert_error(
        zs_client.post("/zero-shot", json={**ok, "labels": ["cat", " "]}), 400, "invalid_input", "labels[1]", "empty"
    )
    assert_error(
        zs_client.post("/zero-shot", json={**ok, "template": "no placeholder"}), 422, "invalid_input", "template"
    )
    assert_error(
        zs_client.post("/zero-shot", json={**ok, "image": b64(b"not an image at all")}), 400, "invalid_input", "image"
    )
    files = [("file", ("x.txt", b"hello, not an image", "text/plain"))]
    assert_error(
        zs_client.post("/zero-shot", files=files, data={"labels": '["cat", "dog"]'}), 400, "invalid_input", "file"
    )
    # the server still answers after the bad requests
    assert zs_client.post("/zero-shot", json=ok).status_code == 200


# ----------------------------------------------------------------------------- one mistake, one status
def _json_route(c: TestClient, labels: list[str], template: str | None) -> tuple[int, str]:
    body = {"image": b64(rgb_png(9)), "labels": labels, **({"template": template} if template else {})}
    r = c.post("/zero-shot", json=body)
    return r.status_code, assert_error(r, r.status_code, "invalid_input")["error"]["message"]


def _form_route(c: TestClient, labels: list[str], template: str | None) -> tuple[int, str]:
    # one field per label, the way `curl -F labels=a -F labels=b` sends them (one label: one field)
    data = {"labels": labels if len(labels) > 1 else labels[0], **({"template": template} if template else {})}
    r = c.post("/zero-shot", files=[("file", ("a.png", rgb_png(9), "image/png"))], data=data)
    return r.status_code, assert_error(r, r.status_code, "invalid_input")["error"]["message"]


def _oip_route(c: TestClient, labels: list[str], template: str | None) -> tuple[int, str]:
    body = {
        "inputs": [
            {"name": "image", "shape": [1], "datatype": "BYTES", "data": [b64(rgb_png(9))]},
            {"name": "labels", "shape": [len(labels)], "datatype": "BYTES", "data": labels},
        ],
        "parameters": {"template": template} if template else {},
    }
    r = c.post("/v2/models/tiny-clip/infer", json=body)
    assert set(r.json()) == {"error"} and isinstance(r.json()["error"], str), r.text  # the protocol's body
    return r.status_code, r.json()["error"]


ROUTES = {"json": _json_route, "multipart": _form_route, "oip": _oip_route}
# (labels, template, what the message names): each is 422 invalid_input on every route
SAME_MISTAKES = {
    "one-label": (["cat"], None, ["labels", "2"]),
    "template-without-label": (["cat", "dog"], "a photo of a thing", ["template", "{label}"]),
    "duplicate-case": (["dress", "Dress"], None, ["duplicate", "'Dress'", "'dress'"]),
    "duplicate-space": (["dress", "dress "], None, ["duplicate", "'dress '", "'dress'"]),
    "duplicate-inner-space": (["coat", "T-shirt  top", "t-shirt top"], None, ["duplicate", "labels[2]", "labels[1]"]),
    "duplicate-exact": (["cat", "dog", "cat"], None, ["duplicate", "labels[2]", "labels[0]"]),
}


@pytest.mark.parametrize("route", list(ROUTES))
@pytest.mark.parametrize("mistake", list(SAME_MISTAKES))
def test_one_mistake_one_status_on_every_route(zs_client: TestClient, route: str, mistake: str):
    """Too few labels, a template without {label} and labels that are one label once case-folded and stripped are
    422 whether sent as JSON, multipart or the Open Inference Protocol, with a one-line message naming the fault."""
    labels, template, fragments = SAME_MISTAKES[mistake]
    status, message = ROUTES[route](zs_client, labels, template)
    assert status == 422, (route, mistake, message)
    assert "\n" not in message and len(message) < 500, message
    for f in fragments:
        assert f in message, (f, message)


def test_labels_that_differ_after_normalisation_are_served(zs_client: TestClient):
    r = zs_client.post("/zero-shot", json={"image": b64(rgb_png(9)), "labels": ["dress", "dresses", "a dress"]})
    assert r.status_code == 200, r.text


# ----------------------------------------------------------------------------- the label-free OOD flag
@pytest.fixture(scope="module")
def zs_label_free(zs_artifact: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny zero-shot artifact with label-free OOD statistics fitted by the builder's code on random images:
    one Gaussian per member of the image embeddings, the image tower's layer 0; served mahalanobis_layers."""
    import shutil

    from offline.method.ood_fit import background_stats, fit_layer_stats, label_free_scores, with_layers
    from service.core.ood import ood_tensors

    out = tmp_path_factory.mktemp("zs-lf") / "tiny-clip-lf"
    shutil.copytree(zs_artifact, out)
    m = load_manifest(out)
    model = build_model(m.model.config)
    from safetensors.torch import load_file

    model.load_state_dict(load_file(str(out / m.model.weights)))
    pre = ImagePreprocessor(PREP, 10**8)
    with torch.no_grad():
        fit = model.eval().image_features(torch.stack([pre(rgb_png(100 + i)) for i in range(40)]))
        val = model.image_features(torch.stack([pre(rgb_png(200 + i)) for i in range(30)]))
    stats = background_stats(fit[0], val[0])
    layers = fit_layer_stats(fit[1], torch.zeros(40, dtype=torch.int64), 1, val[1], label_free_scores(val[0], stats))
    stats = with_layers(stats, layers)
    save_file(ood_tensors(stats), str(out / "ood.safetensors"))
    served = m.uncertainty.model_copy(update={"ood_score": "mahalanobis_layers", "ood_threshold": 1.0})
    ood = OODSpec(
        scores=["mahalanobis", "mahalanobis_layers"],
        selected="mahalanobis_layers",
        forced=True,
        label_free=True,
        layers=[0],
    )
    outputs = ["logits", "features", "layer_features"]
    update = {
        "uncertainty": served,
        "ood": ood,
        "model": m.model.model_copy(update={"outputs": outputs}),
        "files": None,
    }
    write_manifest(out, m.model_copy(update=update))
    return out


def test_label_free_flag_is_the_builders_and_ignores_the_labels(zs_label_free: Path):
    """The zero-shot OOD score is computed from the image side only: the same for any labels and template, and the
    number the builder's code computes from the image tower's embeddings and layer features."""
    from safetensors.torch import load_file

    from service.core.ood import ensemble_scores, ood_from_tensors

    images = [rgb_png(7), rgb_png(8), bytes(_blank_png())]
    with TestClient(create_app(settings_for(zs_label_free))) as c:
        a = c.post(
            "/zero-shot", json={"images": [b64(x) for x in images], "labels": ["cat", "dog"], "return_scores": True}
        )
        b = c.post(
            "/zero-shot",
            json={
                "images": [b64(x) for x in images],
                "labels": ["a", "b", "c", "d"],
                "template": "{label}",
                "return_scores": True,
            },
        )
    assert a.status_code == 200 and b.status_code == 200, (a.text, b.text)
    m = load_manifest(zs_label_free)
    model = build_model(m.model.config)
    model.load_state_dict(load_file(str(zs_label_free / "model.safetensors")))
    pre = ImagePreprocessor(PREP, 10**8)
    with torch.no_grad():
        emb, layers = model.eval().image_features(torch.stack([pre(x) for x in images]))
    stats = ood_from_tensors(load_file(str(zs_label_free / "ood.safetensors")))
    want = ensemble_scores(torch.zeros(3, 3, 2), emb, stats, 1.0, layer_features=layers)["mahalanobis_layers"]
    for i, (p, q) in enumerate(zip(a.json()["predictions"], b.json()["predictions"], strict=True)):
        assert p["ood"]["metric"] == "mahalanobis_layers"
        assert p["ood"]["score"] == q["ood"]["score"] and p["ood"]["flag"] == q["ood"]["flag"]  # label-free
        assert p["ood"]["score"] == pytest.approx(float(want[i]), rel=1e-5, abs=1e-6)
        assert p["ood"]["flag"] == (float(want[i]) > 1.0)
        assert p["ood"]["scores"]["mahalanobis"] == q["ood"]["scores"]["mahalanobis"]


def _blank_png() -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (16, 16), (255, 255, 255)).save(buf, format="PNG")
    return buf.getvalue()
