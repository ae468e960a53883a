"""Streams through a running server: what the answers do when the traffic shifts, and when it does not.

The report's shift section measures shifted copies in batch. This drives ``python -m service`` (loopback, the
default ``HYDRA_DRIFT_POLICY=abstain``, a fresh server and prediction store per stream) one input per request, in
order, as a client would send them, and counts from each stream's first input:

* **shifted streams**: ``--inputs`` (640) in-distribution inputs under each of the project's own corruptions
  (:mod:`offline.method.corruptions`) at each of its five severities. Per stream: accuracy; the accept rate and the
  error among accepted answers, with the exact one-sided binomial test of "error above the risk target" (scipy) and a 95
  % Clopper-Pearson interval; the input at which the drift alarm went on (the first answer it suspended); the
  accepts it suspended (answers the certified rule would have accepted: ``hydra_guarantees_suspended_total``);
  the same accept figures for the certified rule as if no alarm (the answers' confidence against the rule's
  threshold and OOD cut: what the server answered before the policy); the share flagged; the label-free estimate's
  gap (the mean confidence minus the accuracy) and whether ``/monitor`` called it unreliable at the end.
* **clean streams**: ``--clean-streams`` (5) streams of ``--clean-inputs`` (2,000) in-distribution inputs: answers
  suspended (false suspensions) and the accept rate against the certified rule's on the same answers.
* **labelled streams**: one shifted stream per model (``--labelled``, 2,400 inputs), ``adaptive: true`` and each
  answer's true label sent back through ``POST /v1/models/{name}/feedback`` before the next request: the online
  rule's realised error among accepted answers against the certified rule's on the same stream.
* **workers** (``--workers 1 2 4``): each shifted and clean stream once per ``HYDRA_WORKERS`` value, its inputs
  still sent one at a time and in order, but round-robin over two connections per worker (the kernel hands each
  connection to one worker, so every worker answers some): the first suspension with N workers against one.
* **false suspensions on cached outputs**: ``--cached-streams`` (100) streams of 10,000 in-distribution inputs
  drawn from each default model's cached outputs (``tests/fixtures/outputs``), through the alarm's own procedure:
  the share of answers that would be suspended, and the streams with any, against the alarm's bound (``m / A``).

The inputs: images, the garments of the Fashion-MNIST test file (the truth from torchvision's class list); texts,
the negative and positive tweets in none of the build's splits (its data setting redrawn from its recorded config:
drawn like its calibration split, never trained on). Nothing here is fitted: every threshold is the artifact's.

    python -m benchmarks.stream --image artifacts/default/image --text artifacts/default/text

Writes ``benchmarks/results/stream/stream.json``, ``stream.md`` and ``plots/stream.png``.
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
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks import harness, result_json
from benchmarks.stream_figures import labels_to_half, lorden_bound, recall_figures
from benchmarks.stream_report import markdown, plot

ROOT = Path(__file__).resolve().parents[1]
SEVERITIES = (1, 2, 3, 4, 5)
LABELLED = {
    "image": ("noise", 2),
    "text": ("typos", 5),
    "zeroshot": ("noise", 2),
}  # the labelled streams' corruption and severity
STREAM_SEED = 7  # the corruptions' seed (the report's shift section uses its own)


# ----------------------------------------------------------------------------------------------- inputs
def image_pool(manifest: dict[str, Any]) -> tuple[np.ndarray, np.ndarray]:
    """The garments of the Fashion-MNIST test file ``(N, 28, 28) uint8`` and their labels as indices into the
    model's labels, by the data set's own class names (torchvision's list)."""
    import torchvision

    from offline import data as data_mod

    names = torchvision.datasets.FashionMNIST.classes
    fdir = data_mod.fashion_dir()
    x = data_mod.read_idx_images(fdir / data_mod.FASHION_FILES["test_images"])
    y = data_mod.read_idx_labels(fdir / data_mod.FASHION_FILES["test_labels"])
    labels = list(manifest["labels"])
    keep = np.array([i for i, v in enumerate(y.tolist()) if names[v] in labels])
    return x[keep], np.array([labels.index(names[int(y[i])]) for i in keep])


def text_pool(manifest: dict[str, Any]) -> tuple[list[str], np.ndarray]:
    """The negative and positive tweets in none of the build's splits (its setting redrawn from its recorded
    config) and their labels as indices into the model's labels."""
    from offline import data as data_mod
    from offline.data.common import dedup_labelled

    cfg = manifest["build"]["config"]["data"]
    keys = ("max_train", "max_val", "max_test", "max_ood", "seed", "max_calibration")
    d = data_mod.tweet_setting(data_mod.Sizes(**{k: cfg[k] for k in keys}, max_fit=cfg.get("max_fit")))
    used = {t for split in (d.train, d.val, d.test, d.fit, d.calibration) if split is not None for t in split.inputs}
    raw_texts, raw_labels, _ = data_mod.read_tweets()
    texts, names, _ = dedup_labelled(raw_texts, raw_labels)
    labels = list(manifest["labels"])
    keep = [(t, labels.index(n)) for t, n in zip(texts, names, strict=True) if n in labels and t not in used]
    return [t for t, _ in keep], np.array([j for _, j in keep])


def _png(pixels: np.ndarray) -> str:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


def stream_inputs(
    modality: str, pool: tuple[Any, np.ndarray], n: int, seed: int, corruption: str | None, severity: int | None
) -> tuple[list[dict[str, str]], np.ndarray]:
    """``n`` inputs drawn from ``pool`` (without replacement while it lasts), corrupted as asked: the request bodies'
    input fields and the true labels."""
    from offline.method.corruptions import corrupt

    x, y = pool
    rng = np.random.default_rng(seed)
    idx = np.concatenate([rng.permutation(len(y)) for _ in range(math.ceil(n / len(y)))])[:n]
    picked = x[idx] if modality == "image" else [x[i] for i in idx]
    if corruption is not None and severity is not None:
        picked = corrupt(picked, corruption, severity, seed=STREAM_SEED, modality=modality)
    if modality == "image":
        return [{"image": _png(a)} for a in picked], y[idx]
    return [{"text": t} for t in picked], y[idx]


# ----------------------------------------------------------------------------------------------- driving
async def _drive(
    port: int,
    model: str,
    bodies: list[dict[str, str]],
    truth: np.ndarray,
    labels: list[str],
    labelled: bool,
    connections: int = 1,
) -> list[dict[str, Any]]:
    """One request per input, in order (round-robin over ``connections`` keep-alive connections: with several workers,
    each connection is one worker's); with ``labelled`` the answer's true label goes back before the next request.
    One record per input: what the answer said, and whether the certified rule would have accepted it (its
    threshold from ``GET /v1/models``, its OOD cut from the answer)."""
    info = next(m for m in (await _get(port, "/v1/models"))["models"] if m["name"] == model)
    g = info["guarantees"]
    lam = g["risks"][str(g["risk"])]
    conns = [harness.Connection(port) for _ in range(connections)]
    out = []
    try:
        for i, (body, y) in enumerate(zip(bodies, truth.tolist(), strict=True)):
            conn = conns[i % connections]
            req = {**body, "model": model, **({"adaptive": True} if labelled else {})}
            status, hdrs, data = await conn.request("POST", "/predict", json.dumps(req).encode())
            if status != 200:
                raise RuntimeError(f"/predict: {status} {data[:300]!r}")
            (p,) = json.loads(data)["predictions"]
            s, score = p["selective"], p["ood"]["score"]
            cut_ok = score >= s["ood_threshold"] if p["ood"]["metric"] == "msp" else score <= s["ood_threshold"]
            out.append(
                {
                    "correct": p["label_index"] == y,
                    "confidence": p["confidence"],
                    "flag": p["ood"]["flag"],
                    "accept": s["accept"],
                    "suspended": s["suspended"],
                    "rule": s["rule"],
                    "would_accept": bool(lam is not None and cut_ok and p["confidence"] >= lam),
                    "id": hdrs["x-request-id"],
                    "p_value": p["ood"].get("p_value"),
                }
            )
            if labelled:
                fb = {"feedback": [{"id": hdrs["x-request-id"], "index": 0, "label": labels[y]}]}
                status, _, data = await conn.request("POST", f"/v1/models/{model}/feedback", json.dumps(fb).encode())
                if status != 200 or json.loads(data)["results"][0]["status"] != "accepted":
                    raise RuntimeError(f"feedback: {status} {data[:300]!r}")
    finally:
        for conn in conns:
            await conn.close()
    return out


async def _get(port: int, path: str) -> Any:
    status, _, data = await harness.request(port, "GET", path, timeout=30.0)
    if status != 200:
        raise RuntimeError(f"GET {path}: {status} {data[:300]!r}")
    return data.decode() if path == "/metrics" else json.loads(data)


def _metric(text: str, name: str, **labels: str) -> float:
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    for line in text.splitlines():
        if line.startswith(f"{name}{{{want}}} "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def run_stream(
    artifact: Path,
    manifest: dict[str, Any],
    bodies: list[dict[str, str]],
    truth: np.ndarray,
    labelled: bool = False,
    workers: int = 1,
) -> dict[str, Any]:
    """A fresh server (and store) of ``workers`` workers for one stream: the per-input records and what the server
    said at its end."""
    name = manifest["name"]
    with tempfile.TemporaryDirectory(prefix="hydra-stream-") as tmp:
        port = harness.free_port()
        env = {"HYDRA_STORE": "true", "HYDRA_STATE_DIR": tmp, "HYDRA_LOG_LEVEL": "warning"}
        env["HYDRA_WORKERS"] = str(workers)
        proc = harness.start_server(artifact, port, env, log_file=Path(tmp) / "server.log")
        try:
            harness.wait_ready(port, proc)
            t0 = time.perf_counter()
            conns = 1 if workers == 1 else 2 * workers
            labels = list(manifest["labels"])
            records = asyncio.run(_drive(port, name, bodies, truth, labels, labelled, conns))
            seconds = time.perf_counter() - t0
            metrics = asyncio.run(_get(port, "/metrics"))
            drift = asyncio.run(_get(port, f"/v1/models/{name}/drift"))
            monitor = asyncio.run(_get(port, f"/v1/models/{name}/monitor"))
        finally:
            harness.stop_server(proc)
    return {
        "records": records,
        "seconds": round(seconds, 1),
        "withheld": _metric(metrics, "hydra_guarantees_suspended_total", model=name, withheld="true"),
        "drift": {k: drift[k] for k in ("alarm", "alarm_at", "episodes", "inputs")},
        "recalled": drift.get("recalled", []),
        "estimate_reliable_at_end": monitor["estimate"]["reliable"],
        "online_risk": monitor.get("online_risk"),
    }


# ----------------------------------------------------------------------------------------------- figures
def accepted_figures(correct: np.ndarray, accept: np.ndarray, risk: float) -> dict[str, Any]:
    """The accept rate and the error among accepted answers, its 95 % Clopper-Pearson interval and the exact
    one-sided binomial p-value of "the error is above ``risk``" (scipy)."""
    from scipy import stats

    n, k = int(accept.sum()), int((accept & ~correct).sum())
    out: dict[str, Any] = {"accept_rate": float(accept.mean()), "accepted": n, "accepted_errors": k}
    if n == 0:
        return {**out, "accepted_error": None, "interval": None, "p_above_risk": 1.0}
    ci = stats.binomtest(k, n).proportion_ci(0.95, method="exact")
    return {
        **out,
        "accepted_error": k / n,
        "interval": [ci.low, ci.high],
        "p_above_risk": float(stats.binomtest(k, n, risk, alternative="greater").pvalue),
    }


def stream_figures(run: dict[str, Any], risk: float, prefix: int = 0, arl: float = 1e5) -> dict[str, Any]:
    """Everything of one stream, counted from the shift's first input (after ``prefix`` clean inputs, which only
    the false suspensions before the shift and the recall's precision read)."""
    early = run["records"][:prefix]
    r = run["records"][prefix:]
    correct = np.array([x["correct"] for x in r])
    accept = np.array([x["accept"] for x in r])
    fixed = np.array([x["would_accept"] for x in r])
    suspended = np.array([x["suspended"] for x in r])
    first = int(np.argmax(suspended)) + 1 if suspended.any() else None
    conf = np.array([x["confidence"] for x in r])
    return {
        "inputs": len(r),
        "accuracy": float(correct.mean()),
        "served": accepted_figures(correct, accept, risk),
        "certified_rule_without_alarm": accepted_figures(correct, fixed, risk),
        "first_suspended_input": first,
        "suspended_answers": int(suspended.sum()),
        "accepts_suspended": int(run["withheld"]),
        "flagged": float(np.mean([x["flag"] for x in r])),
        "estimate_gap": float(conf.mean() - correct.mean()),
        "estimate_reliable_at_end": run["estimate_reliable_at_end"],
        "drift_at_end": run["drift"],
        "seconds": run["seconds"],
        "prefix": prefix,
        "suspended_before_shift": sum(1 for x in early if x["suspended"]),
        "lorden_bound": lorden_bound([x["p_value"] for x in r if x.get("p_value") is not None], arl),
        **(recall_figures(run, prefix) if "recalled" in run else {}),
    }


def cached_false_suspensions(streams: int, length: int, seed: int = 0) -> dict[str, Any]:
    """On each default model's cached outputs: ``streams`` streams of ``length`` in-distribution inputs (the test
    split's served scores, drawn with replacement) through the alarm's own procedure, from a fresh start."""
    from service.core.drift import DriftMonitor
    from tests.fixtures.cached_outputs import OUTPUTS, load_outputs

    out = {}
    for path in OUTPUTS:
        d = load_outputs(path)
        cal, test = d["calibration"]["score"], d["test"]["score"]
        mon = DriftMonitor(cal, delta=0.01)  # the builder's default drift delta
        rng = np.random.default_rng(seed)
        _, on = mon.simulate(rng.choice(test, size=(streams, length)))
        out[path.stem] = {
            "streams": streams,
            "inputs": length,
            "answers_suspended": float(on.mean()),
            "streams_with_a_suspension": int(on.any(axis=1).sum()),
            "bound_streams": min(1.0, length / mon.arl) * streams,  # P(alarm within m inputs) <= m / A (+ delta)
            "arl": mon.arl,
        }
    return out


def replica_simulation(replicas: tuple[int, ...] = (1, 2, 4), runs: int = 200, seed: int = 0) -> dict[str, Any]:
    """Each replica's own alarm against one alarm shared by the fleet (any replica's alarm suspends every answer), on
    the default models' cached outputs: ``R`` replicas behind a random load balancer, in-distribution traffic (the
    test split's served scores) until a shift to 30 % of an OOD set's inputs, which reaches either every replica
    (``all``) or only replica 0 (``one``: sticky routing, one client's traffic). Per design: the fleet's inputs from
    the shift to the first suspension of an answer to shifted traffic (median over runs), whether answers to
    unshifted traffic got suspended (``one``), and on 10,000 in-distribution inputs per replica the share of runs
    with a false suspension."""
    from service.core.drift import DriftMonitor
    from tests.fixtures.cached_outputs import OUTPUTS, load_outputs

    out: dict[str, Any] = {}
    for path in OUTPUTS:
        d = load_outputs(path)
        mon = DriftMonitor(d["calibration"]["score"], delta=0.01)
        rng = np.random.default_rng(seed)
        oods = [d[k]["score"] for k in d if k.startswith("ood:")]
        rows = []
        for r in replicas:
            for reach in ("all", "one"):
                rows.append(_shift_reaching(mon, d["test"]["score"], oods, r, reach, runs, rng))
            n_fleets = max(runs // 4, 1)  # false suspensions: 10,000 ID inputs per replica
            _, on = mon.simulate(rng.choice(d["test"]["score"], size=(n_fleets * r, 10_000)))
            per_fleet = on.any(axis=1).reshape(n_fleets, r)
            rows.append(
                {
                    "replicas": r,
                    "false_suspension_runs_own_per_replica": float(per_fleet.mean()),
                    "false_suspension_runs_shared": float(per_fleet.any(axis=1).mean()),
                    "bound_own_per_replica": 10_000 / mon.arl,
                    "bound_shared": min(1.0, r * 10_000 / mon.arl),
                }
            )
        out[path.stem] = rows
    return out


def _shift_reaching(
    mon: Any, idt: np.ndarray, oods: list[np.ndarray], r: int, reach: str, runs: int, rng: np.random.Generator
) -> dict[str, Any]:
    """One row of :func:`replica_simulation`: ``runs`` fleets of ``r`` replicas, the shift reaching ``reach``."""
    before, after = 400 * r, 3000 * r  # fleet inputs before and after the shift
    first_own, first_shared, good_suspended = [], [], []
    for k in range(runs):
        who = rng.integers(0, r, before + after)  # the replica of each fleet input
        shifted = np.zeros(before + after, dtype=bool)
        shifted[before:] = rng.random(after) < 0.3
        if reach == "one":
            shifted &= who == 0
        x = np.where(shifted, rng.choice(oods[k % len(oods)], before + after), rng.choice(idt, before + after))
        on = np.zeros(before + after, dtype=bool)  # the serving replica's own alarm, per fleet input
        for j in range(r):
            mine = np.flatnonzero(who == j)
            on[mine] = mon.simulate(x[mine][None, :])[1][0]
        fleet = np.maximum.accumulate(on)  # shared: once any replica's alarm fired (it stays on here)
        first_own.append(int(np.argmax(shifted & on)) - before + 1 if (shifted & on).any() else None)
        first_shared.append(int(np.argmax(shifted & fleet)) - before + 1 if (shifted & fleet).any() else None)
        good = (who != 0) & (np.arange(before + after) >= before)
        good_suspended.append((bool((good & on).any()), bool((good & fleet).any())))
    row: dict[str, Any] = {
        "replicas": r,
        "shift_reaches": reach,
        "own_first_suspension_median": _median(first_own),
        "shared_first_suspension_median": _median(first_shared),
    }
    if reach == "one":
        row["unshifted_replicas_suspended_own"] = float(np.mean([g[0] for g in good_suspended]))
        row["unshifted_replicas_suspended_shared"] = float(np.mean([g[1] for g in good_suspended]))
    return row


def _median(values: list[int | None]) -> float | None:
    got = [v for v in values if v is not None]
    return float(np.median(got)) if got and len(got) * 2 >= len(values) else None


# ----------------------------------------------------------------------------------------------- the run
def run(args: argparse.Namespace) -> dict[str, Any]:
    from offline.method.corruptions import corruptions
    from service.core.drift import HORIZON

    doc: dict[str, Any] = {"models": {}, "shifted": [], "clean": [], "labelled": []}
    # the zero-shot model serves its build's labels through /predict: the image pool and corruptions, its own rows
    models = (("image", "image", args.image), ("text", "text", args.text), ("zeroshot", "image", args.zeroshot))
    for modality, media, artifact in models:
        if artifact is None:
            continue
        artifact = artifact.resolve()
        man = json.loads((artifact / "manifest.json").read_text())
        if not man.get("guarantees"):
            raise SystemExit(f"stream: {man['name']} was built without a calibration split: no guarantees to stream")
        risk = float(man["guarantees"]["selective"]["default_risk"])
        arl = HORIZON / float(man["guarantees"]["drift"]["delta"])
        pool = image_pool(man) if media == "image" else text_pool(man)
        doc["models"][modality] = {"name": man["name"], "risk": risk, "pool": len(pool[1])}
        kinds = [c for c in corruptions(media) if not args.only or c in args.only]
        for k, (kind, sev) in enumerate([(c, s) for c in kinds for s in args.severities]):
            bodies, y = stream_inputs(media, pool, args.inputs, 100 + k, kind, sev)
            if args.prefix:  # clean inputs first: the shift begins at input prefix + 1
                calm, y0 = stream_inputs(media, pool, args.prefix, 500 + k, None, None)
                bodies, y = calm + bodies, np.concatenate([y0, y])
            for n in args.workers:
                res = run_stream(artifact, man, bodies, y, workers=n)
                row = {
                    "modality": modality,
                    "corruption": kind,
                    "severity": sev,
                    "workers": n,
                    **stream_figures(res, risk, args.prefix, arl),
                }
                doc["shifted"].append(row)
                _progress(row)
        for s in range(args.clean_streams):
            bodies, y = stream_inputs(media, pool, args.clean_inputs, 1000 + s, None, None)
            for n in args.workers:
                row = {
                    "modality": modality,
                    "corruption": None,
                    "severity": 0,
                    "stream": s,
                    "workers": n,
                    **stream_figures(run_stream(artifact, man, bodies, y, workers=n), risk),
                }
                doc["clean"].append(row)
                _progress(row)
        if args.labelled:
            doc["labelled"].append(_labelled_row(artifact, man, modality, media, pool, args.labelled, risk))
    if args.cached_streams:
        doc["cached_false_suspensions"] = cached_false_suspensions(args.cached_streams, 10_000)
        doc["replicas"] = replica_simulation()
    return doc


def _labelled_row(
    artifact: Path, man: dict[str, Any], modality: str, media: str, pool: Any, inputs: int, risk: float
) -> dict[str, Any]:
    """The labelled stream of one model: adaptive requests, each true label sent back before the next."""
    kind, sev = LABELLED[modality]
    bodies, y = stream_inputs(media, pool, inputs, 2000, kind, sev)
    res = run_stream(artifact, man, bodies, y, labelled=True)
    row = {"modality": modality, "corruption": kind, "severity": sev, **stream_figures(res, risk)}
    row["online_risk_at_end"] = (res["online_risk"] or {}).get(str(risk))
    alarm = row["first_suspended_input"]
    row |= labels_to_half(res["records"], risk, alarm - 1) if alarm else {"labels_to_half": None}
    _progress(row)
    return row


def _paired_first_suspensions(rows: list[dict[str, Any]], modality: str, workers: int) -> list[tuple[int, int]]:
    """``(one worker's first suspended input, the same stream's with workers)`` for the streams suspended in both."""
    key = lambda r: (r["corruption"], r.get("severity"))  # noqa: E731
    ones = {key(r): r["first_suspended_input"] for r in rows if r["modality"] == modality and r.get("workers", 1) == 1}
    return [
        (ones[key(r)], r["first_suspended_input"])
        for r in rows
        if r["modality"] == modality
        and r.get("workers", 1) == workers
        and ones.get(key(r)) is not None
        and r["first_suspended_input"] is not None
    ]


def _progress(row: dict[str, Any]) -> None:
    s, f = row["served"], row["certified_rule_without_alarm"]
    err = "-" if s["accepted_error"] is None else f"{100 * s['accepted_error']:.1f}"
    ferr = "-" if f["accepted_error"] is None else f"{100 * f['accepted_error']:.1f}"
    print(
        f"{row['modality']} {row['corruption']}@{row['severity']}: acc {100 * row['accuracy']:.1f}, "
        f"accepted {s['accepted']} err {err} (p {s['p_above_risk']:.3g}) | certified rule {f['accepted']} err {ferr}"
        f" | alarm {row['first_suspended_input']} | {row.get('workers', 1)} worker(s) | {row['seconds']} s",
        flush=True,
    )


def _alarm_checks(doc: dict[str, Any], m: str) -> dict[str, bool]:
    """The alarm's delay against Lorden's bound, the recall's coverage and precision, and the clean prefixes."""
    out: dict[str, bool] = {}
    rows = [r for r in doc["shifted"] if r["modality"] == m and r.get("workers", 1) == 1]
    scoped = [r for r in rows if r.get("lorden_bound") is not None and r["lorden_bound"] <= 50]
    out[f"{m}: first suspension within 1.5 x Lorden's bound, every stream whose bound is <= 50"] = all(
        r["first_suspended_input"] is not None and r["first_suspended_input"] <= 1.5 * r["lorden_bound"] for r in scoped
    )
    fired = [r for r in rows if r["first_suspended_input"]]
    wrong = sum(r.get("wrong_accepts_before_alarm", 0) for r in fired)
    if wrong:
        got = sum(r.get("wrong_accepts_recalled", 0) for r in fired)
        out[f"{m}: the recalls list >= 90 % of the wrong accepts given before the alarm"] = got >= 0.9 * wrong
    listed = sum(r.get("recalled", 0) for r in rows)
    if listed:
        after = sum(round(r["recall_precision"] * r["recalled"]) for r in rows if r.get("recalled"))
        out[f"{m}: >= 80 % of the recalled answers were given after the shift began"] = after >= 0.8 * listed
    out[f"{m}: no answer suspended before the shift began"] = all(not r.get("suspended_before_shift") for r in rows)
    return out


def checks(doc: dict[str, Any]) -> dict[str, bool]:
    """The issue's targets on these streams."""
    out: dict[str, bool] = {}
    clean_acc = {m: np.mean([r["accuracy"] for r in doc["clean"] if r["modality"] == m]) for m in doc["models"]}
    for m in doc["models"]:
        shifted = [r for r in doc["shifted"] if r["modality"] == m and clean_acc[m] - r["accuracy"] >= 0.05]
        out[f"{m}: every stream costing >= 5 points: error among accepted not above the target (p >= 0.025)"] = all(
            r["served"]["p_above_risk"] >= 0.025 for r in shifted
        )
        big = [r for r in doc["shifted"] if r["modality"] == m and clean_acc[m] - r["accuracy"] >= 0.10]
        out[f"{m}: streams costing >= 10 points: first suspension within 20 inputs"] = all(
            r["first_suspended_input"] is not None and r["first_suspended_input"] <= 20 for r in big
        )
        clean = [r for r in doc["clean"] if r["modality"] == m]
        out[f"{m}: clean streams: no answer suspended"] = all(r["suspended_answers"] == 0 for r in clean)
        out[f"{m}: clean streams: accept rate within 2 points of the certified rule's"] = all(
            abs(r["served"]["accept_rate"] - r["certified_rule_without_alarm"]["accept_rate"]) <= 0.02 for r in clean
        )
    for r in doc["labelled"]:  # the target is on a stream where the certified rule misses
        err, fixed = r["served"]["accepted_error"], r["certified_rule_without_alarm"]["accepted_error"]
        risk = doc["models"][r["modality"]]["risk"]
        if fixed is not None and fixed > risk + 0.01:
            out[
                f"{r['modality']} labelled stream (the certified rule errs {100 * fixed:.1f} %): online error among "
                "accepted <= target + 1 point"
            ] = err is not None and err <= risk + 0.01
    for m in doc["models"]:
        for n in sorted({r.get("workers", 1) for r in doc["shifted"]} - {1}):
            pairs = _paired_first_suspensions(doc["shifted"], m, n)
            if pairs:
                out[f"{m}: first suspension with {n} workers within 1.1 x one worker's, every stream"] = all(
                    b <= 1.1 * a for a, b in pairs
                )
    for m in doc["models"]:
        out.update(_alarm_checks(doc, m))
    for name, c in (doc.get("cached_false_suspensions") or {}).items():
        out[f"{name}: cached ID streams with a suspension within the bound"] = (
            c["streams_with_a_suspension"] <= c["bound_streams"]
        )
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--image", type=Path, default=None, help="the image classifier's artifact")
    p.add_argument("--text", type=Path, default=None, help="the text classifier's artifact")
    p.add_argument("--zeroshot", type=Path, default=None, help="the zero-shot artifact (its build's labels)")
    p.add_argument("--inputs", type=int, default=640, help="inputs per shifted stream")
    p.add_argument("--prefix", type=int, default=100, help="clean inputs before each shift (0: shifted from input 1)")
    p.add_argument("--severities", type=int, nargs="+", default=list(SEVERITIES))
    p.add_argument("--only", nargs="*", default=None, help="these corruptions only")
    p.add_argument("--clean-streams", type=int, default=5)
    p.add_argument("--clean-inputs", type=int, default=2000)
    p.add_argument("--labelled", type=int, default=2400, help="inputs of each labelled stream (0: none)")
    p.add_argument("--cached-streams", type=int, default=100)
    p.add_argument(
        "--workers", type=int, nargs="+", default=[1], help="HYDRA_WORKERS of each stream's server (each a run)"
    )
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "stream")
    args = p.parse_args(argv)
    if args.image is None and args.text is None and args.zeroshot is None:
        p.error("give --image, --text and/or --zeroshot")
    doc = run(args)
    doc["command"] = "python -m benchmarks.stream " + shlex.join(argv if argv is not None else sys.argv[1:])
    doc["machine"] = harness.machine()
    doc["checks"] = checks(doc)
    args.out.mkdir(parents=True, exist_ok=True)
    result_json.write(args.out / "stream.json", doc)
    (args.out / "stream.md").write_text(markdown(doc))
    plot(doc, args.out / "plots" / "stream.png")
    harness.print_checks(doc["checks"])
    return 0 if all(doc["checks"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
