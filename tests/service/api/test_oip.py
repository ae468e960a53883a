"""The Open Inference Protocol (KServe V2) REST routes in-process: health, metadata, readiness, inference in JSON and
binary tensors, output selection, the protocol's errors, auth, limits and metrics. The answers are checked against
/predict's for the same inputs (and /predict's against the model run directly in test_api.py); real protocol
clients are test_oip_clients.py."""

from __future__ import annotations

import json
import struct
import time
from pathlib import Path

import numpy as np
import pytest
from fastapi.testclient import TestClient

from service.api.oip import DEFAULT_OUTPUTS, OUTPUTS
from service.entrypoints.app import create_app
from service.runtime import ClassifierRuntime
from tests.fixtures.tiny_artifact import TINY_LABELS
from tests.service.helpers import b64, hold_warmup, noise_images, png, settings_for
from tests.service.test_zeroshot import LABELS as ZS_LABELS
from tests.service.test_zeroshot import probs_of, reference_probs, rgb_png, zs_artifact  # noqa: F401 (fixture)

TEXTS = ["I love this phone", "terrible service, never again", "stocks fell sharply today"]


def tensor(name: str, data: list, datatype: str = "BYTES", shape: list[int] | None = None) -> dict:
    return {"name": name, "shape": shape or [len(data)], "datatype": datatype, "data": data}


def outputs_of(body: dict) -> dict[str, dict]:
    return {o["name"]: o for o in body["outputs"]}


def assert_oip_error(r, status: int, *fragments: str) -> str:
    """The protocol's error body, exactly: ``{"error": "<message>"}``, the message naming what is wrong."""
    assert r.status_code == status, r.text[:500]
    body = r.json()
    assert set(body) == {"error"} and isinstance(body["error"], str), body
    for f in fragments:
        assert f in body["error"], (f, body["error"])
    assert "Traceback" not in r.text
    return body["error"]


def predict_probs(client: TestClient, body: dict) -> list[list[float]]:
    """/predict's ensemble probabilities per input, in label order (from the full top_k)."""
    preds = client.post("/predict", json={**body, "top_k": len(TINY_LABELS)}).json()["predictions"]
    return [[next(t["prob"] for t in p["top_k"] if t["label"] == lab) for lab in TINY_LABELS] for p in preds]


def version_of(client: TestClient, name: str) -> str:
    return next(m["version"] for m in client.get("/v1/models").json()["models"] if m["name"] == name)


# ----------------------------------------------------------------------------- health and metadata
def test_server_health_and_metadata(client: TestClient):
    assert client.get("/v2").json() == {"name": "hydra-serve", "version": "0.1.0", "extensions": ["binary_tensor_data"]}
    assert client.get("/v2/health/live").json() == {"live": True}
    r = client.get("/v2/health/ready")
    assert r.status_code == 200 and r.json() == {"ready": True}
    assert "/v2/models/{model_name}/infer" not in client.get("/openapi.json").json()["paths"]  # the protocol's docs


def test_model_metadata_and_versions(client: TestClient):
    version = version_of(client, "tiny-vit")
    meta = client.get("/v2/models/tiny-vit").json()
    assert meta == client.get(f"/v2/models/tiny-vit/versions/{version}").json()
    assert (meta["name"], meta["versions"], meta["platform"]) == ("tiny-vit", [version], "hydra-serve_onnx")
    assert meta["inputs"] == [
        {"name": "image", "datatype": "BYTES", "shape": [-1]},
        {"name": "pixel_values", "datatype": "FP32", "shape": [-1, 1, 16, 16]},
    ]
    shapes = {o["name"]: (o["datatype"], o["shape"]) for o in meta["outputs"]}
    assert shapes == {
        "probabilities": ("FP32", [-1, 4]),
        "member_probabilities": ("FP32", [-1, 3, 4]),
        "label": ("BYTES", [-1]),
        "msp": ("FP32", [-1]),
        "entropy": ("FP32", [-1]),
        "mutual_information": ("FP32", [-1]),
        "disagreement": ("FP32", [-1]),
        "ood_score": ("FP32", [-1]),
        "ood_flag": ("BOOL", [-1]),
    }
    assert client.get("/v2/models/tiny-bert").json()["inputs"] == [{"name": "text", "datatype": "BYTES", "shape": [-1]}]
    assert client.get(f"/v2/models/tiny-vit/versions/{version}/ready").json() == {"name": "tiny-vit", "ready": True}
    assert client.get("/v2/models/tiny-bert/ready").status_code == 200
    assert_oip_error(client.get("/v2/models/nope"), 404, "unknown model 'nope'", "tiny-bert")
    assert_oip_error(client.get("/v2/models/nope/ready"), 404, "unknown model")
    assert_oip_error(client.get("/v2/models/tiny-vit/versions/0/ready"), 404, "no version '0'", version)
    body = {"inputs": [tensor("text", ["hello"])]}
    assert_oip_error(client.post("/v2/models/tiny-bert/versions/0/infer", json=body), 404, "no version")


# ----------------------------------------------------------------------------- inference
def test_text_infer_equals_predict(client: TestClient):
    r = client.post("/v2/models/tiny-bert/infer", json={"id": "req-7", "inputs": [tensor("text", TEXTS)]})
    assert r.status_code == 200, r.text
    body = r.json()
    assert (body["model_name"], body["model_version"], body["id"]) == (
        "tiny-bert",
        version_of(client, "tiny-bert"),
        "req-7",
    )
    out = outputs_of(body)
    # every output but member_probabilities, in order (the guarantees' only where the model has a calibration split)
    assert list(out) == [n for n in DEFAULT_OUTPUTS if not OUTPUTS[n].guarantee]
    probs = out["probabilities"]
    assert (probs["datatype"], probs["shape"]) == ("FP32", [3, 4])
    expected = predict_probs(client, {"texts": TEXTS})
    assert np.array(probs["data"]).reshape(3, 4).tolist() == expected  # the same numbers, not close ones
    answer = client.post("/predict", json={"texts": TEXTS}).json()
    for i, p in enumerate(answer["predictions"]):
        assert out["label"]["data"][i] == p["label"]
        for key in ("msp", "entropy", "mutual_information", "disagreement"):
            assert out[key]["data"][i] == pytest.approx(p["uncertainty"][key], abs=1e-6), key
        assert out["ood_score"]["data"][i] == pytest.approx(p["ood"]["score"], abs=1e-6)
        assert out["ood_flag"]["data"][i] is p["ood"]["flag"]


def test_image_infer_base64_and_preprocessed_tensor(client: TestClient):
    imgs = noise_images(2, seed=5)
    encoded = [b64(png(a)) for a in imgs]
    r = client.post("/v2/models/tiny-vit/infer", json={"inputs": [tensor("image", encoded)]})
    assert r.status_code == 200, r.text
    probs = outputs_of(r.json())["probabilities"]["data"]
    assert np.array(probs).reshape(2, 4).tolist() == predict_probs(client, {"images": encoded})
    # the same images preprocessed by the client: (u8 / 255 - 0.5) / 0.25, shape [B, 1, 16, 16]
    x = np.stack([((a.astype(np.float32) / 255 - 0.5) / 0.25)[None] for a in imgs])
    pix = tensor("pixel_values", x.tolist(), "FP32", list(x.shape))  # nested lists, row-major
    r2 = client.post("/v2/models/tiny-vit/infer", json={"inputs": [pix]})
    assert r2.status_code == 200, r2.text
    np.testing.assert_allclose(outputs_of(r2.json())["probabilities"]["data"], probs, atol=1e-6)
    # [B, 1] BYTES and a data URL are fine too
    r3 = client.post(
        "/v2/models/tiny-vit/infer",
        json={"inputs": [tensor("image", [["data:image/png;base64," + encoded[0]]], shape=[1, 1])]},
    )
    np.testing.assert_allclose(outputs_of(r3.json())["probabilities"]["data"], probs[:4], atol=1e-6)


def test_requested_outputs_and_member_probabilities(client: TestClient):
    body = {"inputs": [tensor("text", TEXTS[:2])], "outputs": [{"name": "member_probabilities"}, {"name": "label"}]}
    out = outputs_of(client.post("/v2/models/tiny-bert/infer", json=body).json())
    assert list(out) == ["member_probabilities", "label"]
    mp = np.array(out["member_probabilities"]["data"]).reshape(out["member_probabilities"]["shape"])
    assert mp.shape == (2, 3, 4)
    answer = client.post("/predict", json={"texts": TEXTS[:2], "return_members": True}).json()
    for i, p in enumerate(answer["predictions"]):
        assert [TINY_LABELS[j] for j in mp[i].argmax(-1)] == [m["label"] for m in p["members"]]
        np.testing.assert_allclose(mp[i].max(-1), [m["confidence"] for m in p["members"]], atol=1e-6)
    full = outputs_of(client.post("/v2/models/tiny-bert/infer", json={"inputs": body["inputs"]}).json())
    np.testing.assert_allclose(mp.mean(1).reshape(-1), full["probabilities"]["data"], atol=1e-6)
    assert set(OUTPUTS) == set(DEFAULT_OUTPUTS) | {"member_probabilities"}


def binary_request(header: dict, chunks: list[bytes]) -> tuple[bytes, dict[str, str]]:
    text = json.dumps(header).encode()
    return text + b"".join(chunks), {"Inference-Header-Content-Length": str(len(text))}


def bytes_elements(items: list[bytes]) -> bytes:
    return b"".join(struct.pack("<I", len(x)) + x for x in items)


def split_binary_answer(r) -> tuple[dict, dict[str, np.ndarray]]:
    """The JSON part of a binary answer and its binary outputs decoded."""
    n = int(r.headers["inference-header-content-length"])
    head, raw = json.loads(r.content[:n]), r.content[n:]
    arrays, offset = {}, 0
    for o in head["outputs"]:
        if "parameters" not in o:
            continue
        size = o["parameters"]["binary_data_size"]
        chunk, offset = raw[offset : offset + size], offset + size
        if o["datatype"] == "BYTES":
            items, i = [], 0
            while i < len(chunk):
                (k,) = struct.unpack_from("<I", chunk, i)
                items.append(chunk[i + 4 : i + 4 + k].decode())
                i += 4 + k
            arrays[o["name"]] = np.array(items, dtype=object)
        else:
            dtype = {"FP32": "<f4", "BOOL": "?"}[o["datatype"]]
            arrays[o["name"]] = np.frombuffer(chunk, dtype=dtype).reshape(o["shape"])
    assert offset == len(raw)
    return head, arrays


def test_binary_tensors_both_ways(client: TestClient):
    imgs = [png(a) for a in noise_images(2, seed=9)]
    header = {
        "inputs": [
            {
                "name": "image",
                "shape": [2],
                "datatype": "BYTES",
                "parameters": {"binary_data_size": len(bytes_elements(imgs))},
            }
        ],
        "parameters": {"binary_data_output": True},
        "outputs": [
            {"name": "probabilities"},
            {"name": "label"},
            {"name": "ood_flag"},
            {"name": "msp", "parameters": {"binary_data": False}},
        ],
    }
    content, headers = binary_request(header, [bytes_elements(imgs)])
    r = client.post("/v2/models/tiny-vit/infer", content=content, headers=headers)
    assert r.status_code == 200, r.text[:300]
    assert r.headers["content-type"] == "application/octet-stream"
    head, arrays = split_binary_answer(r)
    assert arrays["probabilities"].tolist() == predict_probs(client, {"images": [b64(x) for x in imgs]})
    msp = outputs_of(head)["msp"]
    assert "data" in msp and msp["data"] == pytest.approx(arrays["probabilities"].max(1).tolist(), abs=1e-7)
    assert arrays["label"].tolist() == [TINY_LABELS[j] for j in arrays["probabilities"].argmax(1)]
    assert arrays["ood_flag"].dtype == bool and arrays["ood_flag"].shape == (2,)
    # a binary FP32 input
    x = np.stack([((a.astype(np.float32) / 255 - 0.5) / 0.25)[None] for a in noise_images(2, seed=9)]).astype("<f4")
    header = {
        "inputs": [
            {
                "name": "pixel_values",
                "shape": list(x.shape),
                "datatype": "FP32",
                "parameters": {"binary_data_size": x.nbytes},
            }
        ]
    }
    content, headers = binary_request(header, [x.tobytes()])
    r2 = client.post("/v2/models/tiny-vit/infer", content=content, headers=headers)
    assert r2.status_code == 200 and r2.headers["content-type"] == "application/json", r2.text
    np.testing.assert_allclose(
        outputs_of(r2.json())["probabilities"]["data"], arrays["probabilities"].reshape(-1), atol=1e-6
    )


def test_zero_shot_over_oip(zs_artifact: Path):  # noqa: F811 (the fixture)
    with TestClient(create_app(settings_for(zs_artifact))) as c:
        meta = c.get("/v2/models/tiny-clip").json()
        assert [i["name"] for i in meta["inputs"]] == ["image", "pixel_values", "labels"]
        assert next(o["shape"] for o in meta["outputs"] if o["name"] == "probabilities") == [-1, -1]
        img = rgb_png(6)
        labels = ["truck", "frog", "airplane"]
        body = {
            "inputs": [tensor("image", [b64(img)]), tensor("labels", labels)],
            "parameters": {"template": "a blurry picture of the {label}"},
        }
        out = outputs_of(c.post("/v2/models/tiny-clip/infer", json=body).json())
        ref = reference_probs(zs_artifact, [img], labels, "a blurry picture of the {label}")
        np.testing.assert_allclose(out["probabilities"]["data"], ref["probs"][0].numpy(), atol=1e-5)
        assert out["probabilities"]["shape"] == [1, 3] and out["label"]["data"] == [labels[int(ref["prediction"][0])]]
        # without labels: the model's fixed labels, as /predict
        fixed = outputs_of(c.post("/v2/models/tiny-clip/infer", json={"inputs": body["inputs"][:1]}).json())
        p = c.post("/predict", json={"image": b64(img), "top_k": 3}).json()["predictions"][0]
        assert fixed["probabilities"]["data"] == probs_of(p, ZS_LABELS).tolist()
        bad = {**body, "parameters": {"template": "no placeholder"}}
        assert_oip_error(c.post("/v2/models/tiny-clip/infer", json=bad), 422, "parameters.template", "{label}")
        dup = {"inputs": [body["inputs"][0], tensor("labels", ["cat", "cat"])]}
        assert_oip_error(c.post("/v2/models/tiny-clip/infer", json=dup), 422, "duplicate labels")


# ----------------------------------------------------------------------------- errors
# (body, status, what the message names)
BAD_REQUESTS = [
    ({"inputs": []}, 422, "inputs"),
    ({"inputs": [tensor("txt", ["a"])]}, 400, "['txt'] not taken by model 'tiny-bert'", "['text']"),
    ({"inputs": [tensor("text", [1, 2])]}, 400, "text: BYTES data in JSON must be strings"),
    ({"inputs": [tensor("text", ["a", "b"], shape=[3])]}, 400, "text: 2 values for shape [3]"),
    ({"inputs": [tensor("text", ["a"], "INT8")]}, 400, "text: INT8 data must be numbers"),
    ({"inputs": [tensor("text", [1], "INT8")]}, 400, "text: datatype must be BYTES"),
    ({"inputs": [tensor("text", ["a"], "STRING")]}, 400, "datatype 'STRING' is not one of"),
    ({"inputs": [tensor("text", ["a", "b"], shape=[1, 2])]}, 400, "text: shape must be [B] or [B, 1]"),
    ({"inputs": [tensor("text", ["a"]), tensor("text", ["b"])]}, 400, "'text' is given twice"),
    ({"inputs": [tensor("text", ["  "])]}, 400, "text: empty text"),
    ({"inputs": [{"name": "text", "shape": [1], "datatype": "BYTES"}]}, 400, "text: no data"),
    ({"inputs": [tensor("text", ["a"])], "outputs": [{"name": "logits"}]}, 400, "'logits' is not an output"),
    ({"inputs": [tensor("text", ["a"])], "outputs": [{"name": "msp"}, {"name": "msp"}]}, 400, "asked for twice"),
    ({"inputs": [tensor("text", ["a"])], "parameters": {"binary_data_output": "yes"}}, 400, "binary_data_output"),
    ({"inputs": [tensor("text", ["a"])], "model_name": "tiny-vit"}, 400, "differs from the path's model"),
    ({"inputs": [tensor("text", ["a"])], "extra": 1}, 422, "extra: unknown field"),
    (
        {"inputs": [tensor("text", ["a"])], "outputs": [{"name": "label", "parameters": {"classification": 2}}]},
        400,
        "classification extension",
    ),
]


@pytest.mark.parametrize(("body", "status", "fragments"), [(b, s, f) for b, s, *f in BAD_REQUESTS])
def test_bad_requests_get_the_protocols_error(client: TestClient, body: dict, status: int, fragments: list[str]):
    assert_oip_error(client.post("/v2/models/tiny-bert/infer", json=body), status, *fragments)


def test_bad_image_and_tensor_inputs(client: TestClient):
    url = "/v2/models/tiny-vit/infer"
    assert_oip_error(client.post(url, json={"inputs": [tensor("image", ["!!"])]}), 400, "image: not valid base64")
    both = {"inputs": [tensor("image", [b64(png(1))]), tensor("pixel_values", [0.0] * 256, "FP32", [1, 1, 16, 16])]}
    assert_oip_error(client.post(url, json=both), 400, "exactly one of ['image', 'pixel_values']")
    wrong = tensor("pixel_values", [0.0] * 768, "FP32", [1, 3, 16, 16])
    assert_oip_error(client.post(url, json={"inputs": [wrong]}), 400, "pixel_values: shape must be [B, 1, 16, 16]")
    nan = {"inputs": [tensor("pixel_values", [0.0] * 255 + [float("nan")], "FP32", [1, 1, 16, 16])]}
    r = client.post(url, content=json.dumps(nan), headers={"content-type": "application/json"})
    assert_oip_error(r, 400, "finite")
    assert_oip_error(client.post(url, content=b"{", headers={"content-type": "application/json"}), 400, "malformed")
    assert_oip_error(client.post(url, content=b"", headers={"content-type": "application/json"}), 400, "empty")
    r = client.post(url, content=b"x", headers={"content-type": "text/plain"})
    assert_oip_error(r, 415, "text/plain")
    body = json.dumps({"inputs": [tensor("image", [b64(png(1))])]}).encode()
    r = client.post(url, content=body, headers={"content-type": "application/json", "content-encoding": "gzip"})
    assert_oip_error(r, 415, "gzip")
    # binary data that does not add up
    header = {"inputs": [{"name": "image", "shape": [1], "datatype": "BYTES", "parameters": {"binary_data_size": 99}}]}
    content, headers = binary_request(header, [bytes_elements([png(1)])[:20]])
    assert_oip_error(client.post(url, content=content, headers=headers), 400, "binary_data_size 99 does not fit")
    header["inputs"][0]["parameters"]["binary_data_size"] = 10
    content, headers = binary_request(header, [struct.pack("<I", 50) + b"012345"])
    assert_oip_error(client.post(url, content=content, headers=headers), 400, "longer than the data left")
    content, headers = binary_request({"inputs": [tensor("image", [b64(png(1))])]}, [b"trailing"])
    assert_oip_error(client.post(url, content=content, headers=headers), 400, "8 bytes of binary data follow")
    r = client.post(url, content=content, headers={"Inference-Header-Content-Length": "99999"})
    assert_oip_error(r, 400, "Inference-Header-Content-Length 99999")
    assert client.get("/v2/health/ready").status_code == 200  # still serving


def test_limits_auth_and_unknown_paths(artifacts: dict[str, Path]):
    key = "oip-secret"
    app = create_app(settings_for(artifacts["bert"], api_key=key, max_items=2, max_text_chars=20))
    with TestClient(app) as c:
        auth = {"Authorization": f"Bearer {key}"}
        for path in ("/v2/health/live", "/v2/health/ready"):  # the kubelet's probes carry no token
            assert c.get(path).status_code == 200
        assert_oip_error(c.get("/v2/models/tiny-bert"), 401, "bearer token")
        assert_oip_error(c.get("/v2", headers={"Authorization": "Bearer wrong"}), 401, "invalid bearer token")
        body = {"inputs": [tensor("text", ["a", "b", "c"])]}
        assert_oip_error(c.post("/v2/models/tiny-bert/infer", json=body), 401)
        r = c.post("/v2/models/tiny-bert/infer", json=body, headers=auth)
        assert_oip_error(r, 400, "3 inputs, above the limit of 2 (HYDRA_MAX_ITEMS)")
        long = {"inputs": [tensor("text", ["x" * 21])]}
        assert_oip_error(c.post("/v2/models/tiny-bert/infer", json=long, headers=auth), 400, "HYDRA_MAX_TEXT_CHARS")
        assert_oip_error(c.get("/v2/nothing/here", headers=auth), 404, "no endpoint")
        assert_oip_error(c.put("/v2/models/tiny-bert/infer", headers=auth), 405, "PUT is not allowed")
        metrics = c.get("/metrics").text
    assert 'hydra_request_duration_seconds_count{endpoint="/v2/models/{model_name}/infer",status="401"} 1.0' in metrics
    assert 'hydra_request_duration_seconds_count{endpoint="/v2/models/{model_name}/infer",status="400"} 2.0' in metrics


def test_not_ready_while_warming_up(artifacts: dict[str, Path], monkeypatch: pytest.MonkeyPatch):
    started, release = hold_warmup(monkeypatch, ClassifierRuntime)
    app = create_app(settings_for(artifacts["bert"], load_in_background=True))
    with TestClient(app) as c:
        try:
            assert started.wait(60), "warm-up never began"
            assert c.get("/v2/health/live").status_code == 200
            assert_oip_error(c.get("/v2/health/ready"), 503, "not ready", "warming up")
            assert_oip_error(c.get("/v2/models/tiny-bert/ready"), 503, "not ready")
            assert c.get("/v2/models/tiny-bert").json()["name"] == "tiny-bert"  # metadata answers meanwhile
            body = {"inputs": [tensor("text", ["hello"])]}
            assert_oip_error(c.post("/v2/models/tiny-bert/infer", json=body), 503, "not ready")
        finally:
            release.set()
        for _ in range(600):
            if c.get("/v2/health/ready").status_code == 200:
                break
            time.sleep(0.1)
        assert c.get("/v2/models/tiny-bert/ready").json() == {"name": "tiny-bert", "ready": True}


def test_batched_with_predict_and_counted(artifacts: dict[str, Path]):
    """OIP and /predict requests, concurrent, go through one batcher per model and one prediction counter."""
    app = create_app(settings_for(artifacts["bert"], max_wait_ms=50.0))
    with TestClient(app) as c:
        from concurrent.futures import ThreadPoolExecutor

        def oip(i: int) -> list[float]:
            r = c.post("/v2/models/tiny-bert/infer", json={"inputs": [tensor("text", [TEXTS[i % 3]])]})
            return outputs_of(r.json())["probabilities"]["data"]

        def rest(i: int) -> list[float]:
            return predict_probs(c, {"text": TEXTS[i % 3]})[0]

        with ThreadPoolExecutor(8) as pool:
            got = list(pool.map(lambda i: (oip if i % 2 else rest)(i), range(12)))
        for i, probs in enumerate(got):
            np.testing.assert_allclose(probs, got[i % 6], atol=1e-6)  # same text, same answer, whatever the route
        metrics = c.get("/metrics").text
    served = [ln for ln in metrics.splitlines() if ln.startswith('hydra_predictions_total{model="tiny-bert"')]
    assert sum(float(ln.split()[-1]) for ln in served) == 13  # the warm-up input and the twelve requests
