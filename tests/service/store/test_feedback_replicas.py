"""Two replicas on one store (SQLite file, and a real PostgreSQL server): each answers, labels come in through the
other, and both monitors agree on every figure; a third app on the same database after both stopped keeps the
labels and the adaptive state (docs/api.md "Feedback and live quality")."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fastapi.testclient import TestClient

from service.entrypoints.app import create_app
from tests.fixtures.tiny_artifact import TINY_LABELS
from tests.service.helpers import settings_for
from tests.service.test_feedback import NAME, artifact, predict, send


def replica(art: Path, url: str) -> TestClient:
    return TestClient(create_app(settings_for(art, store=True, store_url=url, store_flush_ms=10.0)))


def written(c: TestClient) -> None:
    """Wait until this replica's answers are in the database (a label sent to another replica finds them)."""
    assert c.app.state.hydra.store.flush(10.0)  # type: ignore[attr-defined]


def monitor(c: TestClient) -> dict[str, Any]:
    r = c.get(f"/v1/models/{NAME}/monitor")
    assert r.status_code == 200, r.text
    return r.json()


def test_two_replicas_agree_and_a_restart_keeps_the_state(store_url: str, tmp_path: Path) -> None:
    art = artifact(tmp_path / "vit")
    with replica(art, store_url) as a, replica(art, store_url) as b:
        rid_a, _ = predict(a, 8, seed=21, adaptive=True)
        rid_b, _ = predict(b, 8, seed=22)
        written(a)
        written(b)
        labels = [TINY_LABELS[(i * 5) % 4] for i in range(8)]
        assert send(b, [(rid_a, i, y) for i, y in enumerate(labels)]) == ["accepted"] * 8
        assert send(a, [(rid_b, i, y) for i, y in enumerate(labels)]) == ["accepted"] * 8
        assert send(a, [(rid_a, 0, labels[0])]) == ["duplicate"]  # labelled through the other replica
        ma, mb = monitor(a), monitor(b)
    assert ma["labelled"] == mb["labelled"] == 16
    for key in ("accuracy", "coverage", "estimated_accuracy", "windows", "adaptive", "harmful_shift"):
        assert ma[key] == mb[key], key
    assert ma["adaptive"]["labels_applied"] == 16
    with replica(art, store_url) as c:
        again = monitor(c)
    assert again["labelled"] == 16 and again["adaptive"] == ma["adaptive"]
    assert again["windows"]["all"]["accuracy"] == ma["windows"]["all"]["accuracy"]
