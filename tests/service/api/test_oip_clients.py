"""The Open Inference Protocol through two real clients, against a real uvicorn server on loopback (sockets, HTTP/1.1):
NVIDIA Triton's ``tritonclient.http`` (JSON tensors and the binary tensor extension) and the KServe SDK's
``InferenceRESTClient`` (protocol v2). The numbers the clients read equal /predict's for the same inputs."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import pytest
import uvicorn

from service.entrypoints.app import create_app
from tests.fixtures.tiny_artifact import TINY_LABELS
from tests.service.helpers import b64, noise_images, png, settings_for

httpclient = pytest.importorskip("tritonclient.http", reason="pip install 'tritonclient[http]' (dev extra)")
kserve = pytest.importorskip("kserve", reason="pip install kserve (dev extra)")

TEXTS = ["I love this phone", "terrible service, never again", "the match ended in a draw"]
KEY = "oip-clients-key"


def auth() -> dict[str, str]:
    """The bearer header, a fresh dict each call: tritonclient adds its own headers to the dict it is given."""
    return {"Authorization": f"Bearer {KEY}"}


@dataclass
class Live:
    port: int
    url: str  # host:port, as tritonclient takes it
    base: str  # http://host:port, as the KServe client takes it


@pytest.fixture(scope="module")
def live(artifacts: dict[str, Path]) -> Iterator[Live]:
    """``create_app`` with both tiny models and an API key, served by uvicorn in a thread on a free port."""
    app = create_app(settings_for(artifacts["vit"], artifacts["bert"], api_key=KEY))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, loop="asyncio", http="h11", log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 120
        while not server.started and thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert server.started, "the server did not start"
        yield Live(port, f"127.0.0.1:{port}", f"http://127.0.0.1:{port}")
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


def predict_probs(live: Live, body: dict) -> np.ndarray:
    """/predict's ensemble probabilities ``(B, C)`` in label order, over HTTP."""
    r = httpx.post(f"{live.base}/predict", json={**body, "top_k": len(TINY_LABELS)}, headers=auth(), timeout=30)
    assert r.status_code == 200, r.text
    preds = r.json()["predictions"]
    return np.array(
        [[next(t["prob"] for t in p["top_k"] if t["label"] == lab) for lab in TINY_LABELS] for p in preds],
        dtype=np.float32,
    )


def model_version(live: Live, name: str) -> str:
    models = httpx.get(f"{live.base}/v1/models", headers=auth(), timeout=30).json()["models"]
    return next(m["version"] for m in models if m["name"] == name)


# ----------------------------------------------------------------------------------------- tritonclient
@pytest.fixture
def triton(live: Live) -> Iterator[httpclient.InferenceServerClient]:
    client = httpclient.InferenceServerClient(url=live.url, connection_timeout=30, network_timeout=60)
    yield client
    client.close()


def test_triton_health_and_metadata(triton: httpclient.InferenceServerClient, live: Live):
    assert triton.is_server_live() and triton.is_server_ready()  # the probes need no token
    assert triton.is_model_ready("tiny-bert", headers=auth())
    version = model_version(live, "tiny-bert")
    assert triton.is_model_ready("tiny-bert", model_version=version, headers=auth())
    assert not triton.is_model_ready("tiny-bert", model_version="0", headers=auth())
    meta = triton.get_model_metadata("tiny-bert", headers=auth())
    assert meta["name"] == "tiny-bert" and meta["versions"] == [version]
    assert meta["inputs"] == [{"name": "text", "datatype": "BYTES", "shape": [-1]}]
    assert {o["name"] for o in meta["outputs"]} >= {"probabilities", "label", "ood_flag", "mutual_information"}
    server = triton.get_server_metadata(headers=auth())
    assert server["name"] == "hydra-serve" and "binary_tensor_data" in server["extensions"]
    with pytest.raises(httpclient.InferenceServerException, match="unknown model 'nope'"):
        triton.get_model_metadata("nope", headers=auth())
    with pytest.raises(httpclient.InferenceServerException, match="missing bearer token"):
        triton.get_model_metadata("tiny-bert")


def test_triton_infer_json_tensors(triton: httpclient.InferenceServerClient, live: Live):
    text = httpclient.InferInput("text", [len(TEXTS)], "BYTES")
    text.set_data_from_numpy(np.array(TEXTS, dtype=object), binary_data=False)
    names = ["probabilities", "label", "mutual_information", "ood_flag", "member_probabilities"]
    outputs = [httpclient.InferRequestedOutput(n, binary_data=False) for n in names]
    res = triton.infer("tiny-bert", [text], outputs=outputs, request_id="triton-1", headers=auth())
    body = res.get_response()
    assert (body["id"], body["model_name"], body["model_version"]) == (
        "triton-1",
        "tiny-bert",
        model_version(live, "tiny-bert"),
    )
    probs = res.as_numpy("probabilities")
    assert probs.shape == (3, 4) and probs.dtype == np.float32
    np.testing.assert_array_equal(probs, predict_probs(live, {"texts": TEXTS}))  # equal, not close
    labels = [x.decode() if isinstance(x, bytes) else x for x in res.as_numpy("label")]
    assert labels == [TINY_LABELS[j] for j in probs.argmax(1)]
    assert res.as_numpy("ood_flag").dtype == bool and res.as_numpy("mutual_information").shape == (3,)
    members = res.as_numpy("member_probabilities")
    assert members.shape == (3, 3, 4)
    np.testing.assert_allclose(members.mean(1), probs, atol=1e-6)


def test_triton_infer_binary_tensors(triton: httpclient.InferenceServerClient, live: Live):
    """The binary tensor extension both ways: raw image bytes in, binary outputs back (Triton's default)."""
    imgs = [png(a) for a in noise_images(3, seed=11)]
    image = httpclient.InferInput("image", [3], "BYTES")
    image.set_data_from_numpy(np.array(imgs, dtype=object), binary_data=True)
    res = triton.infer("tiny-vit", [image], headers=auth())  # no outputs named: all defaults, binary
    probs = res.as_numpy("probabilities")
    np.testing.assert_array_equal(probs, predict_probs(live, {"images": [b64(x) for x in imgs]}))
    assert [x.decode() for x in res.as_numpy("label")] == [TINY_LABELS[j] for j in probs.argmax(1)]
    assert res.as_numpy("member_probabilities") is None  # only when asked for
    # a preprocessed FP32 tensor, binary: the same answer
    x = np.stack([((a.astype(np.float32) / 255 - 0.5) / 0.25)[None] for a in noise_images(3, seed=11)])
    pixels = httpclient.InferInput("pixel_values", list(x.shape), "FP32")
    pixels.set_data_from_numpy(x, binary_data=True)
    res2 = triton.infer(
        "tiny-vit", [pixels], outputs=[httpclient.InferRequestedOutput("probabilities")], headers=auth()
    )
    np.testing.assert_allclose(res2.as_numpy("probabilities"), probs, atol=1e-6)
    with pytest.raises(httpclient.InferenceServerException, match="not taken by model 'tiny-vit'"):
        bad = httpclient.InferInput("text", [1], "BYTES")
        bad.set_data_from_numpy(np.array(["hello"], dtype=object))
        triton.infer("tiny-vit", [bad], headers=auth())


# ----------------------------------------------------------------------------------------- KServe SDK
def kserve_call(coro_fn):
    """Run ``coro_fn(client)`` with a fresh KServe REST client (protocol v2, no retries)."""

    async def run():
        client = kserve.InferenceRESTClient(kserve.RESTConfig(protocol="v2", retries=0, timeout=60))
        try:
            return await coro_fn(client)
        finally:
            await client.close()

    return asyncio.run(run())


def test_kserve_health(live: Live):
    async def check(client):
        return (
            await client.is_server_live(live.base),
            await client.is_server_ready(live.base),
            await client.is_model_ready(live.base, "tiny-vit", headers=auth()),
        )

    assert kserve_call(check) == (True, True, True)


def test_kserve_infer(live: Live):
    imgs = [png(a) for a in noise_images(2, seed=12)]
    encoded = [b64(x) for x in imgs]

    async def infer(client):
        image = kserve.InferInput("image", [2], "BYTES", data=encoded)  # JSON: base64 strings
        request = kserve.InferRequest(model_name="tiny-vit", infer_inputs=[image], request_id="kserve-1")
        return await client.infer(live.base, request, model_name="tiny-vit", headers=auth())

    res = kserve_call(infer)
    assert (res.id, res.model_name) == ("kserve-1", "tiny-vit")  # (the SDK does not read model_version back)
    out = {o.name: o for o in res.outputs}
    probs = out["probabilities"].as_numpy()
    np.testing.assert_array_equal(probs.astype(np.float32), predict_probs(live, {"images": encoded}))
    assert list(out["label"].as_numpy()) == [TINY_LABELS[j] for j in probs.argmax(1)]
    assert out["ood_flag"].as_numpy().dtype == bool

    async def binary(client):  # the KServe client's binary inputs (raw bytes of the image files)
        image = kserve.InferInput("image", [2], "BYTES")
        image.set_data_from_numpy(np.array(imgs, dtype=object), binary_data=True)
        request = kserve.InferRequest(model_name="tiny-vit", infer_inputs=[image])
        return await client.infer(live.base, request, model_name="tiny-vit", headers=auth())

    res2 = kserve_call(binary)
    probs2 = next(o for o in res2.outputs if o.name == "probabilities").as_numpy()
    np.testing.assert_array_equal(probs2, probs)

    async def refused(client):
        request = kserve.InferRequest(
            model_name="tiny-vit", infer_inputs=[kserve.InferInput("image", [1], "BYTES", data=["!!"])]
        )
        return await client.infer(live.base, request, model_name="tiny-vit", headers=auth())

    with pytest.raises(httpx.HTTPStatusError, match="not valid base64.*400 Bad Request"):
        kserve_call(refused)
