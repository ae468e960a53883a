"""One batch of inputs through the server's own path, without HTTP: the runtime the server would load for the artifact
(:func:`service.runtime.load_runtime`), its decoding and preprocessing, its model pass and uncertainty
(``Runtime._run``), its guarantees (sets, OOD p-values, risk decisions) and the answer's fields as ``/predict``
builds them (:func:`service.api.answers.build_predictions`). So a row's numbers are the server's for the same input.

The online drift alarm is not fed (``Query.monitor`` false): a batch is tested once, as a whole, at its end
(:mod:`service.batch.batch_summary`). Inputs are decoded in a thread pool while the model runs the previous chunk;
an input that cannot be decoded gets a row with its ``error`` and no answer, and the others go on.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from service.api.answers import build_predictions
from service.core.errors import ServiceError
from service.runtime import Query, Runtime, load_runtime
from service.runtime.interface import fill_scores
from service.settings import Settings
from service.store import PredictionStore

__all__ = ["COLUMNS", "BatchOptions", "BatchScorer"]

# a row's columns, in order (docs/batch.md): the id, then the answer's headline fields, then the whole answer as JSON
COLUMNS = (
    "id",
    "error",
    "label",
    "confidence",
    "entropy",
    "mutual_information",
    "margin",
    "ood_score",
    "ood_p_value",
    "ood_flag",
    "prediction_set",
    "accept",
    "reason",
    "suspended",
    "answer",
)


@dataclass(frozen=True)
class BatchOptions:
    """What each row holds, as a ``/predict`` request would ask it."""

    top_k: int = 5
    members: bool = False  # each member's top label and probability (return_members)
    scores: bool = False  # every OOD score the model computes (return_scores)
    alpha: float | None = None  # the prediction sets' miscoverage (None: the model's)
    ood_alpha: float | None = None
    risk: float | None = None  # the risk target of accept (None: the model's)

    def query(self) -> Query:
        return Query(
            top_k=max(self.top_k, 2),  # the margin reads the second label
            return_members=self.members,
            return_scores=self.scores,
            alpha=self.alpha,
            ood_alpha=self.ood_alpha,
            risk=self.risk,
            monitor=False,
        )


class BatchScorer:
    """The artifact loaded once; :meth:`rows` scores chunks of raw inputs into rows (one per input, in order).

    :meth:`record_into` a prediction store: each answer is then recorded there as the server records its answers, as
    the answer ``"<run id>:<position>"`` (one prediction, index 0), so that labels sent back for it reach the store
    as ``/feedback`` labels do (docs/batch.md, "Labels back")."""

    def __init__(self, artifact: str | Path, settings: Settings, options: BatchOptions) -> None:
        self.rt: Runtime = load_runtime(artifact, settings)
        self.run_id: str | None = None  # set by record_into
        if self.rt.task != "classification":
            raise ServiceError(f"{artifact}: hydra-predict scores classifier artifacts; this one is {self.rt.task}")
        self.options = options
        self.query = options.query()
        self.rt.check_query(self.query)

    @property
    def modality(self) -> str:
        return self.rt.modality

    def record_into(self, store: PredictionStore, run_id: str) -> None:
        """Record every answer from now on in ``store`` as ``"<run_id>:<position>"``."""
        self.rt.attach_monitor(store)
        self.run_id = run_id

    def describe(self) -> dict[str, Any]:
        """The model and options a run's rows came from (kept beside the parts: a resume must match it)."""
        return {"model": self.rt.name, "version": self.rt.version, "options": vars(self.options)}

    def prepare(self, ids: Sequence[str], raws: Sequence[str | bytes]) -> tuple[list[Any], dict[int, str]]:
        """The chunk decoded and preprocessed as the server does: ``(prepared inputs, {index: error})``; one bad
        input is an error of its own row."""
        try:
            return self.rt.prepare(list(raws), "inputs", base64_encoded=False), {}
        except ServiceError:
            prepared, errors = [], {}
            for i, raw in enumerate(raws):
                try:
                    prepared += self.rt.prepare([raw], "inputs", base64_encoded=False)
                except ServiceError as e:
                    errors[i] = f"{ids[i]}: {e}"
            return prepared, errors

    def score(
        self, ids: Sequence[str], prepared: list[Any], errors: dict[int, str], first: int = 0
    ) -> list[dict[str, Any]]:
        """Rows of one prepared chunk whose first input is input ``first`` of the run: the model's pass, the
        uncertainty, the guarantees, the answer's fields (and, recording, the answers in the store)."""
        rt, preds = self.rt, []
        if prepared:
            results = rt._run(prepared)
            if self.query.return_scores:
                fill_scores(results, getattr(rt, "ood_stats", None), rt.temperature)
            if rt.guarantees is not None:
                rt._guarantees(results, self.query)
            preds = build_predictions(
                results,
                rt.labels,
                top_k=self.query.top_k,
                return_members=self.query.return_members,
                metric=rt.ood_metric,
                threshold=rt.ood_threshold,
                return_scores=self.query.return_scores,
                guarantees=rt.guarantees,
            )
            if rt.monitor is not None:
                answered = [first + i for i in range(len(ids)) if i not in errors]
                for pos, r in zip(answered, results, strict=True):
                    rt.monitor.record(f"{self.run_id}:{pos}", [r], None, False)
        answers = iter(preds)
        return [_error_row(rid, errors[i]) if i in errors else _row(rid, next(answers)) for i, rid in enumerate(ids)]

    def rows(
        self, chunks: Iterator[tuple[list[str], list[str | bytes]]], threads: int = 2, first: int = 0
    ) -> Iterator[list[dict]]:
        """Rows chunk by chunk (the first chunk's first input is input ``first`` of the run), the next chunk decoded
        in ``threads`` threads while the model runs this one."""
        with ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix="hydra-decode") as pool:
            pending: tuple[list[str], Future, int] | None = None
            for ids, raws in chunks:
                nxt = (ids, pool.submit(self.prepare, ids, raws), first)
                first += len(ids)
                if pending is not None:
                    yield self._scored(pending)
                pending = nxt
            if pending is not None:
                yield self._scored(pending)

    def _scored(self, pending: tuple[list[str], Future, int]) -> list[dict[str, Any]]:
        ids, future, first = pending
        prepared, errors = future.result()
        return self.score(ids, prepared, errors, first)


def _row(rid: str, p: dict[str, Any]) -> dict[str, Any]:
    top = p.get("top_k") or []
    sel = p.get("selective") or {}
    conformal = p.get("conformal") or {}
    ood = p["ood"]
    return {
        "id": rid,
        "error": None,
        "label": p["label"],
        "confidence": p["confidence"],
        "entropy": p["uncertainty"]["entropy"],
        "mutual_information": p["uncertainty"]["mutual_information"],
        "margin": top[0]["prob"] - top[1]["prob"] if len(top) > 1 else None,
        "ood_score": ood["score"],
        "ood_p_value": ood.get("p_value"),
        "ood_flag": ood["flag"],
        "prediction_set": conformal.get("set"),
        "accept": sel.get("accept"),
        "reason": sel.get("reason"),
        "suspended": sel.get("suspended", False),
        "answer": json.dumps(p, separators=(",", ":")),
    }


def _error_row(rid: str, error: str) -> dict[str, Any]:
    return {c: None for c in COLUMNS} | {"id": rid, "error": error, "suspended": False}
