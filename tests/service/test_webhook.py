"""The drift alarm's webhook (service/webhook.py): real HTTP servers on loopback receive the posts; a server that
fails is retried, one that refuses is not, one that hangs never slows the caller; a bad URL or header is refused at
start-up in one line; through the app, the post carries the answers the recall lists."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from pydantic import ValidationError

from service import webhook
from service.entrypoints.app import create_app
from service.settings import Settings, settings_errors
from service.webhook import AlarmWebhook, check_header, check_url
from tests.service.api.test_recall import _drift_artifact, _shift
from tests.service.helpers import settings_for


@contextmanager
def hook_server(statuses: list[int], hang_s: float = 0.0) -> Iterator[tuple[str, list[dict]]]:
    """A loopback HTTP server answering POSTs with ``statuses`` in turn (the last one after that); the requests it
    got: ``{"headers", "body"}``."""
    got: list[dict] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 (http.server's name)
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            got.append({"headers": dict(self.headers), "body": body})
            time.sleep(hang_s)
            self.send_response(statuses[min(len(got) - 1, len(statuses) - 1)])
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/hook", got
    finally:
        server.shutdown()
        server.server_close()


def test_a_failing_hook_is_retried_and_a_refusing_one_is_not():
    with hook_server([503, 502, 200]) as (url, got):
        hook = AlarmWebhook(url, "Authorization: Bearer s3cret", delays=(0.01, 0.01, 0.01))
        hook.post({"alarm_at": 7})
        assert hook.wait(10)
        assert len(got) == 3 and hook.sent == 1 and hook.failed == 0
        assert all(g["headers"]["Authorization"] == "Bearer s3cret" and g["body"] == {"alarm_at": 7} for g in got)
    with hook_server([404]) as (url, got):
        hook = AlarmWebhook(url, delays=(0.01, 0.01))
        hook.post({"alarm_at": 8})
        assert hook.wait(10) and len(got) == 1 and hook.failed == 1  # a 4xx is the hook's answer: not retried


def test_a_hook_that_hangs_or_is_down_never_slows_the_caller(monkeypatch, caplog):
    monkeypatch.setattr(webhook, "TIMEOUT_S", 0.2)
    with hook_server([200], hang_s=2.0) as (url, got):
        hook = AlarmWebhook(url, delays=(0.01,))
        t0 = time.perf_counter()
        for k in range(5):
            hook.post({"alarm_at": k})
        assert time.perf_counter() - t0 < 0.05  # queued, not sent, by the caller
        assert hook.wait(20) and hook.failed == 5 and len(got) == 10  # each tried twice, each timed out
    hook = AlarmWebhook("http://127.0.0.1:9/down", delays=(0.01,))  # nothing listens on port 9
    hook.post({"alarm_at": 1})
    assert hook.wait(10) and hook.failed == 1
    assert "alarm webhook: the post of the alarm at input 1 failed" in caplog.text


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"HYDRA_ALARM_WEBHOOK": "hooks.example/alarm"}, "must be an http:// or https:// URL with a host"),
        ({"HYDRA_ALARM_WEBHOOK": "ftp://hooks.example/a"}, "must be an http:// or https:// URL with a host"),
        ({"HYDRA_ALARM_WEBHOOK_HEADER": "Bearer abc"}, "must be 'Name: value'"),
    ],
)
def test_a_bad_url_or_header_is_refused_at_start_up(monkeypatch, env, message):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(ValidationError, match=message) as e:
        Settings()
    (line,) = settings_errors(e.value)  # what the server prints: one line, naming the variable
    assert line.startswith("HYDRA_ALARM_WEBHOOK") and message in line and "abc" not in line  # no token echoed
    assert check_url(" https://h.example/x ") == "https://h.example/x"
    assert check_header("X-Token: a b") == ("X-Token", "a b")


def test_the_app_posts_the_alarm_with_the_recalled_answers(tmp_path: Path):
    name = "tiny-hook"
    with hook_server([200]) as (url, got):
        settings = settings_for(
            _drift_artifact(tmp_path / "vit", name), alarm_webhook=url, alarm_webhook_header="X-Token: t0k"
        )
        with TestClient(create_app(settings)) as c:
            _shift(c, name)
            (rec,) = c.get(f"/v1/models/{name}/drift").json()["recalled"]
            hook = c.app.state.hydra.runtimes[name].webhook
            assert hook.wait(10)
    (post,) = got
    body = post["body"]
    assert post["headers"]["X-Token"] == "t0k" and body["event"] == "drift_alarm" and body["model"] == name
    assert (body["alarm_at"], body["changed_at"]) == (rec["started_at"], rec["changed_at"])
    assert [a["id"] for a in body["recalled"]] == [a["id"] for a in rec["answers"]]
