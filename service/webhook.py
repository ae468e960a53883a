"""The drift alarm's webhook (``HYDRA_ALARM_WEBHOOK``): a POST of the alarm and its recalled answers to a URL the
operator gives, off the request path.

Each worker posts, when it lists a new recall (:mod:`service.core.recall`), the model, the episode (``alarm_at``,
``changed_at``) and the answers it gave in the window (request IDs, place, accept): with several workers, one post
per worker that gave some. The body is JSON; ``HYDRA_ALARM_WEBHOOK_HEADER`` (``Name: value``, e.g. ``Authorization:
Bearer <token>``) is sent with it.

**Never in the way of an answer.** Posts go through a bounded queue to one daemon thread: a post that waits for a
full queue is dropped and logged, not waited for. Each post has a timeout (:data:`TIMEOUT_S`) and is retried with
exponential backoff (:data:`DELAYS_S`) on a connection error, a timeout or a 5xx answer; a 4xx answer is not retried
(the hook refused it). When every try failed, one line in the log says so.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
import urllib.error
import urllib.request
from typing import Any
from urllib.parse import urlsplit

__all__ = ["DELAYS_S", "TIMEOUT_S", "AlarmWebhook", "check_header", "check_url", "webhook_for"]

log = logging.getLogger("hydra.service")

TIMEOUT_S = 5.0  # per try
DELAYS_S = (0.5, 2.0, 8.0)  # waits before the 2nd, 3rd and 4th try
QUEUE = 64  # posts waiting at most


def check_url(url: str) -> str:
    """``url`` if it is an absolute http(s) URL with a host, else ``ValueError`` saying what is wrong."""
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"HYDRA_ALARM_WEBHOOK must be an http:// or https:// URL with a host, got {url!r}")
    return url.strip()


def check_header(header: str) -> tuple[str, str]:
    """``(name, value)`` of ``Name: value``, else ``ValueError`` (the value is not echoed: it may be a token)."""
    name, sep, value = header.partition(":")
    if not sep or not name.strip() or not value.strip() or any(c in name for c in " \t\r\n"):
        raise ValueError("HYDRA_ALARM_WEBHOOK_HEADER must be 'Name: value' (e.g. 'Authorization: Bearer <token>')")
    return name.strip(), value.strip()


class AlarmWebhook:
    """Posts JSON bodies to ``url`` from a thread of its own (module docstring)."""

    def __init__(self, url: str, header: str | None = None, delays: tuple[float, ...] = DELAYS_S) -> None:
        self.url = check_url(url)
        self.headers = {"Content-Type": "application/json"}
        if header:
            name, value = check_header(header)
            self.headers[name] = value
        self.delays = delays
        self.sent = 0
        self.failed = 0
        self._queue: queue.Queue[dict[str, Any]] = queue.Queue(QUEUE)
        self._thread = threading.Thread(target=self._run, name="alarm-webhook", daemon=True)
        self._thread.start()

    def post(self, body: dict[str, Any]) -> None:
        """Queue ``body`` for the thread; never blocks (a full queue drops it, with a log line)."""
        try:
            self._queue.put_nowait(body)
        except queue.Full:
            self.failed += 1
            log.error("alarm webhook: %d posts are waiting; this one is dropped", QUEUE)

    def wait(self, timeout: float = 30.0) -> bool:
        """Whether every queued post was tried to its end within ``timeout`` seconds (tests)."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self._queue.unfinished_tasks == 0:
                return True
            time.sleep(0.01)
        return False

    def _run(self) -> None:
        while True:
            body = self._queue.get()
            try:
                self._send(body)
            finally:
                self._queue.task_done()

    def _send(self, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        why = ""
        for attempt in range(len(self.delays) + 1):
            if attempt:
                time.sleep(self.delays[attempt - 1])
            req = urllib.request.Request(self.url, data=data, headers=self.headers, method="POST")
            try:
                with urllib.request.urlopen(req, timeout=TIMEOUT_S) as resp:  # noqa: S310 (the operator's URL)
                    resp.read()
                self.sent += 1
                return
            except urllib.error.HTTPError as e:
                why = f"HTTP {e.code}"
                if e.code < 500:
                    break  # refused: trying again would be refused again
            except (urllib.error.URLError, TimeoutError, OSError) as e:
                why = str(getattr(e, "reason", e)) or type(e).__name__
        self.failed += 1
        log.error(
            "alarm webhook: the post of the alarm at input %s failed (%s); not retried", body.get("alarm_at"), why
        )


_HOOKS: dict[tuple[str, str | None], AlarmWebhook] = {}
_HOOKS_LOCK = threading.Lock()


def webhook_for(url: str | None, header: str | None) -> AlarmWebhook | None:
    """The process's webhook for ``url`` and ``header`` (one thread for every model), None without a URL."""
    if not url:
        return None
    with _HOOKS_LOCK:
        hook = _HOOKS.get((url, header))
        if hook is None:
            hook = _HOOKS[(url, header)] = AlarmWebhook(url, header)
        return hook
