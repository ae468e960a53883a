"""Per class: accuracy and the confusion matrix of the ensemble prediction, by the data's own class names, and
their section of report.md."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from offline.report.markdown_tables import table
from offline.report.values import pct


def per_class(labels: np.ndarray, member_probs: np.ndarray, names: Sequence[str]) -> dict[str, Any]:
    """Accuracy per class and the confusion matrix of the ensemble prediction ``mean_m member_probs (N, M, C)``
    against ``labels (N,)``, keyed by the class ``names`` (in logit order): ``{"accuracy": {name: fraction},
    "support": {name: count}, "confusion": [[count]] (rows: true class, columns: predicted)}``."""
    pred = np.asarray(member_probs).mean(axis=1).argmax(axis=-1)  # (N,)
    y = np.asarray(labels)
    c = len(names)
    conf = np.zeros((c, c), dtype=np.int64)
    np.add.at(conf, (y, pred), 1)
    support = conf.sum(axis=1)
    acc = {n: (float(conf[i, i] / support[i]) if support[i] else None) for i, n in enumerate(names)}
    return {"accuracy": acc, "support": {n: int(support[i]) for i, n in enumerate(names)}, "confusion": conf.tolist()}


def per_class_section(doc: Mapping[str, Any]) -> list[str]:
    """Accuracy per class for every method, then Hydra's (else the first method's) confusion matrix, by the data's
    own class names."""
    pc = doc.get("per_class") or {}
    if not pc:
        return []
    names = list(next(iter(pc.values()))["accuracy"])
    methods = list(pc)
    md = [
        "",
        "## Per class (ID test, by the data's class names)",
        "",
        "Accuracy % of each method's prediction on the test images of each class (n: test images of it).",
        "",
    ]
    body = [[n, str(pc[methods[0]]["support"][n])] + [pct(pc[m]["accuracy"][n]) for m in methods] for n in names]
    md += table(["class", "n", *methods], body)
    shown = "hydra" if "hydra" in pc else methods[0]
    md += ["", f"### Confusion matrix ({shown}; rows: true class, columns: predicted)", ""]
    conf = pc[shown]["confusion"]
    md += table(["true \\ predicted", *names], [[n, *(str(v) for v in conf[i])] for i, n in enumerate(names)])
    return md + [""]
