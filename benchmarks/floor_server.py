"""The floor of a Python image-serving frontend: what ``POST /predict`` costs with no model and no uncertainty.

A bare FastAPI endpoint on the same stack as ``python -m service`` (uvicorn, uvloop and httptools when installed):
it reads the JSON body, decodes the base64 PNG with Pillow, normalises it into a float32 array as a model's
preprocessing would, and answers a small JSON body written with ``orjson``. ``benchmarks/bench_server.py`` drives
it beside the server with the same client and body, so "server / floor" is the share of a bare frontend's rate that
hydra-serve keeps.

    python -m benchmarks.floor_server --port 8100
"""

from __future__ import annotations

import argparse
import base64
import io
import sys

import numpy as np
import orjson
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import Response
from PIL import Image

app = FastAPI()
MEAN, STD = 0.5, 0.25  # a model's normalisation: the work is the same whatever the numbers


@app.post("/predict")
async def predict(request: Request) -> Response:
    body = orjson.loads(await request.body())
    raw = base64.b64decode(body["image"], validate=True)
    with Image.open(io.BytesIO(raw)) as im:
        pixels = np.asarray(im.convert("L"), dtype=np.float32)
    x = (pixels / 255.0 - MEAN) / STD  # (H, W), as the preprocessing of a grey model
    return Response(orjson.dumps({"label": "x", "confidence": float(x.mean())}), media_type="application/json")


@app.get("/readyz")
async def ready() -> dict[str, bool]:
    return {"ready": True}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    args = p.parse_args(argv)
    from service.entrypoints.http_server import http_stack  # the server's own choice of loop and parser

    loop, http = http_stack("auto", "auto")
    uvicorn.run(app, host=args.host, port=args.port, loop=loop, http=http, log_level="warning", access_log=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
