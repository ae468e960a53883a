"""Two workers of one ``python -m service`` (``HYDRA_WORKERS=2``) share the prediction store as replicas do, on SQLite
and on PostgreSQL: answers given by either worker take labels sent to either, and every worker's monitor then
shows the same figures, the adaptive sets' and the online rule's state included."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from pathlib import Path

from benchmarks import harness
from tests.fixtures.tiny_artifact import TINY_LABELS, make_tiny_artifact
from tests.reliability.test_workers import workers_of
from tests.service.helpers import b64, noise_images, png

ROOT = Path(__file__).resolve().parents[3]


async def _post(port: int, path: str, doc: dict) -> tuple[int, dict, dict]:
    st, hdrs, data = await harness.request(port, "POST", path, json.dumps(doc).encode(), timeout=20.0)
    return st, hdrs, json.loads(data)


def test_two_workers_agree_through_the_store(store_url: str, tmp_path: Path):
    art = make_tiny_artifact(tmp_path / "vit", "vit", name="tiny-ws", guarantees={"risks": [0.5], "risk": 0.5})
    port = harness.free_port()
    extra = {"HYDRA_WORKERS": "2", "HYDRA_STORE_URL": store_url, "HYDRA_STORE_FLUSH_MS": "20"}
    (tmp_path / "state").mkdir(exist_ok=True)
    extra |= {"HYDRA_LOG_LEVEL": "warning"}
    proc = harness.start_server(art, port, extra, log_file=tmp_path / "server.log", new_session=True)
    try:
        harness.wait_ready(port, proc, timeout=120)
        assert len(workers_of(proc.pid)) == 2
        images = [b64(png(a)) for a in noise_images(30, seed=9)]

        async def run() -> list[dict]:
            # every request on a connection of its own: the kernel spreads them over both workers
            answers = [await _post(port, "/predict", {"image": im, "adaptive": True}) for im in images]
            assert all(st == 200 for st, _, _ in answers)
            items = [
                {"id": h["x-request-id"], "index": 0, "label": TINY_LABELS[(i * 5) % len(TINY_LABELS)]}
                for i, (_, h, _) in enumerate(answers)
            ]
            for k in range(0, len(items), 5):  # feedback in small batches, each to whichever worker takes it
                st, _, body = await _post(port, "/v1/models/tiny-ws/feedback", {"feedback": items[k : k + 5]})
                assert st == 200 and {r["status"] for r in body["results"]} == {"accepted"}, body
            reads = []
            for _ in range(8):
                st, _, data = await harness.request(port, "GET", "/v1/models/tiny-ws/monitor", timeout=20.0)
                assert st == 200
                reads.append(json.loads(data))
            return reads

        reads = asyncio.run(run())
        keys = [
            (
                r["labelled"],
                r["accuracy"],
                r["adaptive"]["labels_applied"],
                r["adaptive"]["alpha_t"],
                r["online_risk"]["0.5"]["labels_applied"],
                r["online_risk"]["0.5"]["level"],
            )
            for r in reads
        ]
        assert len(set(keys)) == 1 and keys[0][0] == 30 and keys[0][2] == 30, keys
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
