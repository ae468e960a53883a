"""What `make serve`'s image models answer for real test images, checked against the data set's own names.

Starts ``python -m service`` on 127.0.0.1 (loopback only) with the image classifier and the zero-shot artifact and
sends every image of the Fashion-MNIST test file through HTTP (``POST /predict``, ``POST /zero-shot``; JSON,
``--batch`` images a request). The truth is the IDX file's label read through torchvision's class list (an
independent source), never the project's own constant.

Classifier (``/predict`` at ``alpha`` 0.1 and the model's default OOD level and risk):

* accuracy per class on the in-distribution (garment) images, by true name, next to the build report's;
* coverage of the 90 % prediction sets; the error among answers marked ``accept`` against the risk target;
* the near-OOD images (footwear, bags): share flagged, and share answered as a garment at confidence >= 0.9 with
  no flag; the share of in-distribution images flagged;
* the same on the training file's reserved images the build left unused: drawn like the calibration split, they
  are where the guarantees' premise (exchangeability) holds, unlike the test file.

Zero-shot (``/zero-shot``): the garments with the build's labels and with a user's own label words (lower case,
singular), accuracy per class; footwear and bags against the garment words: flagged or answered with low
confidence; and the mixed list of a user who names some footwear too.

    python -m benchmarks.truth --image artifacts/default/image --zeroshot artifacts/default/zeroshot

Writes ``benchmarks/results/truth.json`` and ``truth.md``; exits 1 when a target of the issue is missed.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import math
import shlex
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks import harness

USER_WORDS = {
    "T-shirt/top": "t-shirt",
    "Trouser": "trouser",
    "Pullover": "pullover",
    "Dress": "dress",
    "Coat": "coat",
    "Shirt": "shirt",
}  # a user's own label words for the six garments
MIXED_WORDS = ["sandal", "shirt", "sneaker", "coat", "trouser"]  # a user who names footwear too
CONFIDENT = 0.9  # "answered as a garment with confidence" (the cut)
LOW = 0.5  # a zero-shot answer below it is "low confidence"


def _png(pixels: np.ndarray) -> str:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


async def _post(conn: harness.Connection, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    status, _, data = await conn.request("POST", path, json.dumps(body).encode())
    answer = json.loads(data)
    if status != 200:
        raise RuntimeError(f"{path}: {status} {answer}")
    return answer["predictions"]


async def _answers(port: int, path: str, images: list[str], extra: dict[str, Any], batch: int) -> list[dict]:
    conn = harness.Connection(port)
    try:
        out: list[dict[str, Any]] = []
        for i in range(0, len(images), batch):
            out += await _post(conn, path, {"images": images[i : i + batch], **extra})
        return out
    finally:
        await conn.close()


def _rate(x: list[bool]) -> float | None:
    return float(np.mean(x)) if x else None


def _se(p: float, n: int) -> float:
    return math.sqrt(max(p * (1 - p), 1e-12) / max(n, 1))


def classifier_truth(preds: list[dict], truth: list[str], garments: list[str]) -> dict[str, Any]:
    """Per-class accuracy (garments), coverage, accepted-answer error, flags; ``truth``: each image's true name."""
    per_class = {}
    for g in garments:
        hits = [p["label"] == t for p, t in zip(preds, truth, strict=True) if t == g]
        per_class[g] = {"n": len(hits), "accuracy": _rate(hits)}
    idp = [(p, t) for p, t in zip(preds, truth, strict=True) if t in garments]
    near = [p for p, t in zip(preds, truth, strict=True) if t not in garments]
    accepted = [p["label"] != t for p, t in idp if (p.get("selective") or {}).get("accept")]
    risk = next(((p.get("selective") or {}).get("risk") for p, _ in idp), None)
    return {
        "id_images": len(idp),
        "accuracy": _rate([p["label"] == t for p, t in idp]),
        "per_class": per_class,
        "coverage_alpha_0.1": _rate([t in p["conformal"]["set"] for p, t in idp]),
        "mean_set_size": float(np.mean([p["conformal"]["size"] for p, _ in idp])),
        "risk_target": risk,
        "accept_rate": len(accepted) / max(len(idp), 1),
        "accepted_error": _rate(accepted),
        "accepted": len(accepted),
        "id_flagged": _rate([p["ood"]["flag"] for p, _ in idp]),
        "near_images": len(near),
        "near_flagged": _rate([p["ood"]["flag"] for p in near]),
        "near_confident_unflagged": _rate([p["confidence"] >= CONFIDENT and not p["ood"]["flag"] for p in near]),
        "near_flagged_by_class": {
            c: _rate([p["ood"]["flag"] for p, t in zip(preds, truth, strict=True) if t == c])
            for c in dict.fromkeys(t for t in truth if t not in garments)
        },
    }


def zero_shot_truth(preds: list[dict], truth: list[str], words: dict[str, str]) -> dict[str, Any]:
    """Accuracy per garment when the labels are ``words`` (true name -> the word sent)."""
    per = {g: _rate([p["label"] == w for p, t in zip(preds, truth, strict=True) if t == g]) for g, w in words.items()}
    return {"accuracy": _rate([p["label"] == words[t] for p, t in zip(preds, truth, strict=True)]), "per_class": per}


def reserved_images(manifest: dict[str, Any]) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """The build's own reserved images, its data setting redrawn once from its recorded config: ``calibration`` (the
    split its guarantees were calibrated on) and ``unused`` (the train file's reserved images in none of its
    validation, fit and calibration splits, no model trained on them: drawn like the calibration split, so
    exchangeable with it, where the test file is not). Each ``(images (N, 28, 28) uint8, official labels (N,))``,
    garments only."""
    from offline import data as data_mod

    cfg = manifest["build"]["config"]["data"]
    sizes = {k: cfg[k] for k in ("max_train", "max_val", "max_test", "max_ood", "seed", "max_calibration")}
    d = data_mod.fashion_mnist_setting(data_mod.Sizes(**sizes, max_fit=cfg.get("max_fit")))
    assert d.calibration is not None
    used = {x.tobytes() for split in (d.val, d.fit, d.calibration) for x in split.inputs}
    xtr, ytr, _, _ = data_mod.read_fashion(data_mod.fashion_dir())
    _, reserved = data_mod.fashion_pools(ytr)
    keep = np.asarray([i for i in reserved if xtr[i].tobytes() not in used])
    official = np.asarray(data_mod.FASHION_ID_CLASSES)
    return {"calibration": (d.calibration.inputs, official[d.calibration.labels]), "unused": (xtr[keep], ytr[keep])}


def _report_per_class(artifact: Path) -> dict[str, Any]:
    rep = json.loads((artifact / "report.json").read_text())
    return ((rep.get("extra") or {}).get("per_class") or {}).get("hydra") or {}


def _test_images(per_class: int) -> tuple[list[str], list[str], list[str]]:
    """The data set's own class names, and the first ``per_class`` test images of each class as base64 PNGs with
    their true names."""
    import torchvision

    from offline import data as data_mod

    names = torchvision.datasets.FashionMNIST.classes  # the data set's own names
    fdir = data_mod.fashion_dir()
    x = data_mod.read_idx_images(fdir / data_mod.FASHION_FILES["test_images"])
    y = data_mod.read_idx_labels(fdir / data_mod.FASHION_FILES["test_labels"])
    keep = np.concatenate([np.flatnonzero(y == c)[:per_class] for c in range(10)])
    return names, [_png(x[i]) for i in keep], [names[int(y[i])] for i in keep]


def _ask_all(port: int, man: dict[str, Any], images: list[str], foot: list[int], batch: int) -> dict[str, Any]:
    """Every request of the run: ``/predict`` on the test images, the unused reserved and the calibration images;
    ``/zero-shot`` on the test images with the build's labels and the user's words, and on the footwear and bags
    (indices ``foot``) with the mixed words."""
    cls = asyncio.run(_answers(port, "/predict", images, {"model": man["image"]["name"], "alpha": 0.1}, batch))
    zs_model = {"model": man["zeroshot"]["name"], "alpha": 0.1}
    build_labels = list(man["zeroshot"]["labels"])
    zs_build = asyncio.run(_answers(port, "/zero-shot", images, {**zs_model, "labels": build_labels}, batch))
    user = [USER_WORDS[g] for g in build_labels]
    zs_user = asyncio.run(_answers(port, "/zero-shot", images, {**zs_model, "labels": user}, batch))
    reserved = reserved_images(man["image"])
    ex_x, ex_y = reserved["unused"]
    cal_x, cal_y = reserved["calibration"]
    ex, cal = (
        asyncio.run(
            _answers(port, "/predict", [_png(v) for v in x], {"model": man["image"]["name"], "alpha": 0.1}, batch)
        )
        for x in (ex_x, cal_x)
    )
    zs_mixed = asyncio.run(
        _answers(port, "/zero-shot", [images[i] for i in foot], {**zs_model, "labels": MIXED_WORDS}, batch)
    )
    return {
        "cls": cls,
        "build_labels": build_labels,
        "zs_build": zs_build,
        "user": user,
        "zs_user": zs_user,
        "ex": ex,
        "ex_y": ex_y,
        "cal": cal,
        "cal_y": cal_y,
        "zs_mixed": zs_mixed,
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    names, images, truth = _test_images(args.per_class)
    image, zeroshot = args.image.resolve(), args.zeroshot.resolve()
    man = {k: json.loads((a / "manifest.json").read_text()) for k, a in (("image", image), ("zeroshot", zeroshot))}
    garments = list(man["image"]["labels"])
    with harness.serving([image, zeroshot], "hydra-truth-") as port:
        got = _ask_all(port, man, images, [i for i, t in enumerate(truth) if t not in garments], args.batch)
    return {
        "models": {k: m["name"] for k, m in man.items()},
        "per_class_images": args.per_class,
        "classifier": classifier_truth(got["cls"], truth, garments),
        "classifier_report_per_class": _report_per_class(image).get("accuracy"),
        "classifier_exchangeable": classifier_truth(got["ex"], [names[int(v)] for v in got["ex_y"]], garments),
        "classifier_calibration_split": classifier_truth(got["cal"], [names[int(v)] for v in got["cal_y"]], garments),
        "zero_shot": _zero_shot(got, truth, garments),
    }


def _zero_shot(got: dict[str, Any], truth: list[str], garments: list[str]) -> dict[str, Any]:
    """The zero-shot tallies of :func:`_ask_all`'s answers ``got``: garments by both label lists, footwear and bags
    against the garment words and against the mixed words."""
    foot = [i for i, t in enumerate(truth) if t not in garments]
    idx_id = [i for i, t in enumerate(truth) if t in garments]

    def pick(ps: list, ix: list[int]) -> list:
        return [ps[i] for i in ix]

    zs_build, zs_user, zs_mixed = got["zs_build"], got["zs_user"], got["zs_mixed"]
    near_user = pick(zs_user, foot)
    return {
        "build_labels": zero_shot_truth(
            pick(zs_build, idx_id), pick(truth, idx_id), {g: g for g in got["build_labels"]}
        ),
        "user_words": {
            **zero_shot_truth(pick(zs_user, idx_id), pick(truth, idx_id), USER_WORDS),
            "labels": got["user"],
        },
        "near_with_user_words": {
            "images": len(foot),
            "flagged": _rate([p["ood"]["flag"] for p in near_user]),
            "flagged_or_low_confidence": _rate([p["ood"]["flag"] or p["confidence"] < LOW for p in near_user]),
            "confident_unflagged": _rate([p["confidence"] >= CONFIDENT and not p["ood"]["flag"] for p in near_user]),
        },
        "mixed_words": {
            "labels": MIXED_WORDS,
            "answers_by_class": {
                c: {
                    w: sum(p["label"] == w for p, t in zip(zs_mixed, pick(truth, foot), strict=True) if t == c)
                    for w in MIXED_WORDS
                }
                for c in dict.fromkeys(pick(truth, foot))
            },
            "flagged": _rate([p["ood"]["flag"] for p in zs_mixed]),
        },
        "id_flagged": _rate([p["ood"]["flag"] for p in pick(zs_user, idx_id)]),
    }


def checks(doc: dict[str, Any]) -> dict[str, bool]:
    """The issue's targets on these answers."""
    c, zs = doc["classifier"], doc["zero_shot"]
    report = doc.get("classifier_report_per_class") or {}
    rep_acc = float(np.mean([v for v in report.values() if v is not None])) if report else None
    risk, err = c["risk_target"], c["accepted_error"]
    return {
        "served accuracy within 1 point of the report's (per-class mean)": rep_acc is not None
        and abs(c["accuracy"] - rep_acc) <= 0.01,
        "every class above 60 %": all(v["accuracy"] > 0.6 for v in c["per_class"].values()),
        "<= 5 % of footwear and bags answered as a garment at >= 0.9 without a flag": c["near_confident_unflagged"]
        <= 0.05,
        "coverage at alpha 0.1 in [0.88, 0.93]": 0.88 <= c["coverage_alpha_0.1"] <= 0.93,
        "coverage at alpha 0.1 in [0.88, 0.93] where the premise holds (unused reserved images)": 0.88
        <= doc["classifier_exchangeable"]["coverage_alpha_0.1"]
        <= 0.93,
        "accepted error <= risk target + 2 standard errors": risk is None
        or err is None
        or err <= risk + 2 * _se(risk, max(c["accepted"], 1)),
        "near-OOD flagged >= 60 %": c["near_flagged"] >= 0.6,
        "ID flagged <= 7 %": c["id_flagged"] <= 0.07,
        "zero-shot, user words within 3 points of the build's labels": abs(
            zs["user_words"]["accuracy"] - zs["build_labels"]["accuracy"]
        )
        <= 0.03,
        "zero-shot, footwear and bags flagged or low confidence (>= 90 %)": zs["near_with_user_words"][
            "flagged_or_low_confidence"
        ]
        >= 0.9,
    }


def _pct(v: float | None) -> str:
    return "–" if v is None else f"{100 * v:.1f}"


def _markdown(doc: dict[str, Any]) -> str:
    """The text of ``truth.md``: the classifier's answers, the zero-shot answers, then the checks."""
    title = f"Real test images by their true names ({doc['models']['image']}, {doc['models']['zeroshot']})"
    truth = f"{doc['machine']['cpu']}. Truth: the IDX labels through torchvision's class list."
    lines = [*harness.page_head(title, doc, truth), ""]
    lines += _classifier_lines(doc) + _zero_shot_lines(doc["zero_shot"])
    lines += ["", "## Checks", ""] + [f"- {'PASS' if v else 'FAIL'} {k}" for k, v in doc["checks"].items()]
    return "\n".join(lines) + "\n"


def _classifier_lines(doc: dict[str, Any]) -> list[str]:
    """``/predict``: accuracy per class next to the report's, then the sets, the risk, the flags, and the same where
    the guarantees' premise holds."""
    c, pct = doc["classifier"], _pct
    e, k = doc["classifier_exchangeable"], doc["classifier_calibration_split"]
    rep = doc.get("classifier_report_per_class") or {}
    lines = [
        "## /predict",
        "",
        "| class | images | served accuracy % | report (build's test sample) % |",
        "|---|---:|---:|---:|",
    ]
    for g, v in c["per_class"].items():
        lines.append(f"| {g} | {v['n']} | {pct(v['accuracy'])} | {pct(rep.get(g))} |")
    return lines + [
        "",
        f"- accuracy on {c['id_images']} garment images: **{pct(c['accuracy'])} %**",
        f"- coverage of the sets at alpha 0.1: **{pct(c['coverage_alpha_0.1'])} %** (mean size "
        f"{c['mean_set_size']:.2f})",
        f"- risk target {c['risk_target']}: accept rate {pct(c['accept_rate'])} %, error among accepted "
        f"**{pct(c['accepted_error'])} %** ({c['accepted']} accepted)",
        f"- flagged: garments {pct(c['id_flagged'])} %, footwear and bags **{pct(c['near_flagged'])} %** "
        f"({', '.join(f'{k} {pct(v)}' for k, v in c['near_flagged_by_class'].items())})",
        f"- footwear and bags answered as a garment at confidence >= {CONFIDENT} with no flag: "
        f"**{pct(c['near_confident_unflagged'])} %**",
        "",
        f"Where the guarantees' premise holds: the {e['id_images']} reserved training-file images the build "
        "left unused, drawn like the calibration split (the test file is a slightly different distribution): "
        f"accuracy {pct(e['accuracy'])} %, coverage at alpha 0.1 **{pct(e['coverage_alpha_0.1'])} %** (mean "
        f"size {e['mean_set_size']:.2f}), error among accepted at risk {e['risk_target']} "
        f"**{pct(e['accepted_error'])} %** ({pct(e['accept_rate'])} % accepted), flagged "
        f"{pct(e['id_flagged'])} %. On the calibration split itself ({k['id_images']} images): accuracy "
        f"{pct(k['accuracy'])} %, coverage {pct(k['coverage_alpha_0.1'])} %.",
        "",
    ]


def _zero_shot_lines(zs: dict[str, Any]) -> list[str]:
    """``/zero-shot``: accuracy per class with both label lists, then the flags and the mixed words' answers."""
    pct = _pct
    lines = [
        "## /zero-shot",
        "",
        "| class | build's labels % | user words % |",
        "|---|---:|---:|",
    ]
    for g, v in zs["build_labels"]["per_class"].items():
        lines.append(f"| {g} | {pct(v)} | {pct(zs['user_words']['per_class'].get(g))} |")
    near = zs["near_with_user_words"]
    lines += [
        "",
        f"- accuracy: build's labels **{pct(zs['build_labels']['accuracy'])} %**, user words "
        f"{zs['user_words']['labels']} **{pct(zs['user_words']['accuracy'])} %**",
        f"- garments flagged: {pct(zs['id_flagged'])} %",
        f"- footwear and bags against the garment words: flagged {pct(near['flagged'])} %, flagged or below "
        f"{LOW} confidence **{pct(near['flagged_or_low_confidence'])} %**, confident and unflagged "
        f"{pct(near['confident_unflagged'])} %",
        f"- a user's mixed words {zs['mixed_words']['labels']} on footwear and bags (flagged "
        f"{pct(zs['mixed_words']['flagged'])} %):",
    ]
    for cls, counts in zs["mixed_words"]["answers_by_class"].items():
        lines.append(f"  - {cls}: " + ", ".join(f"{w} {n}" for w, n in counts.items()))
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--image", type=Path, default=Path("artifacts/default/image"), help="image classifier artifact")
    p.add_argument("--zeroshot", type=Path, default=Path("artifacts/default/zeroshot"), help="zero-shot artifact")
    p.add_argument("--per-class", type=int, default=1000, help="test images of each class (the file has 1,000)")
    p.add_argument("--batch", type=int, default=32, help="images a request")
    p.add_argument("--out", type=Path, default=harness.ROOT / "benchmarks" / "results" / "truth.json")
    args = p.parse_args(argv)
    doc = run(args)
    doc["checks"] = checks(doc)
    doc["command"] = ("python -m benchmarks.truth " + shlex.join(argv if argv is not None else sys.argv[1:])).strip()
    doc["machine"] = harness.machine()
    doc["created"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    out = harness.write_result(doc, args.out, "truth.json")
    md = _markdown(doc)
    out.with_suffix(".md").write_text(md)
    print(md)
    return 0 if all(doc["checks"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
