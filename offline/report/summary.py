"""The headline numbers of each method that go into the manifest's ``metrics`` field."""

from __future__ import annotations

from collections.abc import Mapping

from offline.report.values import jsonable

# the numbers of each method that go into the manifest's `metrics` field
HEADLINE = ("acc", "nll", "brier", "ece", "aece", "aurc", "mi_id", "mi_ood", "disagreement_id", "disagreement_ood")
OOD_KEYS = ("auroc", "fpr95", "aupr_in", "aupr_out")


def summary_of(rows: list[dict]) -> dict[str, dict]:
    """Headline numbers per method (for the manifest): ID metrics, OOD averages over sets, params, median latency,
    and, where the row has ``calibrated``, ECE / NLL at the method's own fitted temperature (``ece_ts``, ``nll_ts``,
    ``temperature_ts``)."""
    out: dict[str, dict] = {}
    for r in rows:
        s = {k: r[k] for k in HEADLINE if k in r}
        s.update({k: v for k, v in r.get("ood_avg", {}).items() if k in OOD_KEYS})
        if "params" in r:
            s["params"] = int(r["params"])
        lat = r.get("latency_ms", {})
        s["latency_ms"] = {b: v["median_ms"] for b, v in lat.items() if isinstance(v, Mapping) and "median_ms" in v}
        s.update({f"{k}_ts": v for k, v in (r.get("calibrated") or {}).items() if k in ("ece", "nll", "temperature")})
        out[r["method"]] = jsonable(s)
    return out
