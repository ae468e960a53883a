"""The nine everyday foreign images through a real server: what `make serve`'s image models answer for them.

Starts ``python -m service`` on 127.0.0.1 (loopback only) with an image classifier artifact and a zero-shot
artifact, then posts each of :func:`offline.data.foreign.nine_inputs` (RGB noise 400x300, grey noise 28x28, white,
mid-grey, a gradient, a checkerboard, a photo of a building, a photo of a flower, black) as a PNG file to
``POST /predict`` (the classifier) and ``POST /zero-shot`` (the build's labels, and a second, foreign label set:
the flag must not depend on the labels). Records each answer's label, confidence, OOD flag, score, threshold and
p-value, prediction set and risk decision.

    python -m benchmarks.nine_inputs --image artifacts/default/image --zeroshot artifacts/default/zeroshot

Writes ``benchmarks/results/nine_inputs.json`` and ``nine_inputs.md``; exits 1 if an input is not flagged.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import shlex
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks import harness

OTHER_LABELS = ["cat", "car", "tree", "house", "person", "boat"]  # a request's own candidate labels


def png(pixels: np.ndarray) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


def multipart(fields: list[tuple[str, str | bytes]]) -> tuple[bytes, str]:
    """A ``multipart/form-data`` body (files as ``image.png``) and its content type."""
    boundary = "hydra-nine-inputs"
    out = io.BytesIO()
    for name, value in fields:
        out.write(f"--{boundary}\r\n".encode())
        if isinstance(value, bytes):
            out.write(f'Content-Disposition: form-data; name="{name}"; filename="image.png"\r\n'.encode())
            out.write(b"Content-Type: image/png\r\n\r\n" + value + b"\r\n")
        else:
            out.write(f'Content-Disposition: form-data; name="{name}"\r\n\r\n{value}\r\n'.encode())
    out.write(f"--{boundary}--\r\n".encode())
    return out.getvalue(), f"multipart/form-data; boundary={boundary}"


def summary(answer: dict[str, Any]) -> dict[str, Any]:
    p = answer["predictions"][0]
    ood = p.get("ood") or {}
    conformal = p.get("conformal") or {}
    selective = p.get("selective") or {}
    return {
        "label": p["label"],
        "confidence": round(p["confidence"], 4),
        "flag": ood.get("flag"),
        "score": ood.get("score"),
        "threshold": ood.get("threshold"),
        "metric": ood.get("metric"),
        "p_value": ood.get("p_value"),
        "set": conformal.get("set"),
        "accept": selective.get("accept"),
    }


async def ask(port: int, path: str, fields: list[tuple[str, str | bytes]]) -> dict[str, Any]:
    body, ctype = multipart(fields)
    status, _, data = await harness.request(port, "POST", path, body, headers={"content-type": ctype})
    answer = json.loads(data)
    if status != 200:
        raise RuntimeError(f"{path}: {status} {answer}")
    return summary(answer)


def answers(port: int, names: dict[str, str], build_labels: list[str]) -> list[dict[str, Any]]:
    """Each of the nine inputs posted to ``/predict`` and to ``/zero-shot`` with the build's labels and with
    :data:`OTHER_LABELS`: one row per input."""
    from offline.data.foreign import nine_inputs

    rows = []
    for x in nine_inputs():
        f = png(x.pixels)
        rows.append(
            {
                "input": x.name,
                "kind": x.kind,
                "shape": list(x.pixels.shape),
                "predict": asyncio.run(ask(port, "/predict", [("file", f), ("model", names["image"])])),
                "zero_shot": asyncio.run(
                    ask(
                        port,
                        "/zero-shot",
                        [("file", f), ("labels", json.dumps(build_labels)), ("model", names["zeroshot"])],
                    )
                ),
                "zero_shot_other_labels": asyncio.run(
                    ask(
                        port,
                        "/zero-shot",
                        [("file", f), ("labels", json.dumps(OTHER_LABELS)), ("model", names["zeroshot"])],
                    )
                ),
            }
        )
    return rows


def _p(value: float | None) -> str:
    """A p-value as the table shows it: ``–`` where the model answered none (built without a calibration split)."""
    return "–" if value is None else f"{value:.4f}"


def markdown(doc: dict[str, Any]) -> list[str]:
    """The lines of ``nine_inputs.md``: one table line per input, then how many of the nine each route flagged."""
    names, flagged = doc["models"], doc["flagged_of_9"]
    lines = [
        f"# The nine foreign inputs through `python -m service` ({names['image']}, {names['zeroshot']})",
        "",
        f"`{doc['command']}`",
        "",
        "| input | /predict answer | flag | p-value | /zero-shot answer | flag | p-value | flag, other labels |",
        "|---|---|---|---:|---|---|---:|---|",
    ]
    for r in doc["inputs"]:
        a, z, o = r["predict"], r["zero_shot"], r["zero_shot_other_labels"]
        lines.append(
            f"| {r['input']} | {a['label']} {100 * a['confidence']:.0f} % | {'yes' if a['flag'] else 'no'} | "
            f"{_p(a['p_value'])} | {z['label']} {100 * z['confidence']:.0f} % | "
            f"{'yes' if z['flag'] else 'no'} | {_p(z['p_value'])} | {'yes' if o['flag'] else 'no'} |"
        )
    return lines + [
        "",
        f"Flagged: /predict {flagged['predict']} of 9, /zero-shot {flagged['zero_shot']} of 9 (other labels: "
        f"{flagged['zero_shot_other_labels']} of 9). Machine: {harness.cpu_name()}.",
    ]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--image", type=Path, default=Path("artifacts/default/image"), help="image classifier artifact")
    p.add_argument("--zeroshot", type=Path, default=Path("artifacts/default/zeroshot"), help="zero-shot artifact")
    p.add_argument("--out", type=Path, default=harness.ROOT / "benchmarks" / "results" / "nine_inputs.json")
    args = p.parse_args(argv)
    image, zeroshot = args.image.resolve(), args.zeroshot.resolve()
    names = {
        k: json.loads((a / "manifest.json").read_text())["name"] for k, a in (("image", image), ("zeroshot", zeroshot))
    }
    build_labels = json.loads((zeroshot / "manifest.json").read_text())["labels"]
    with harness.serving([image, zeroshot], "hydra-nine-") as port:
        rows = answers(port, names, build_labels)
    flagged = {k: sum(bool(r[k]["flag"]) for r in rows) for k in ("predict", "zero_shot", "zero_shot_other_labels")}
    command = "python -m benchmarks.nine_inputs " + shlex.join(argv if argv is not None else sys.argv[1:])
    doc = {
        "command": command.strip(),
        "models": names,
        "other_labels": OTHER_LABELS,
        "flagged_of_9": flagged,
        "inputs": rows,
        "machine": harness.machine(),
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    out = harness.write_result(doc, args.out, "nine_inputs.json")
    lines = markdown(doc)
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if all(v == 9 for v in flagged.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
