"""``GET /docs`` in a real browser: headless Chromium (Debian's ``chromium``) driven by Playwright against a real
``python -m service`` serving the default server's three artifacts as tiny models. Swagger UI renders the server's
OpenAPI 3.1 document, lists every documented route, and "Try it out" on ``POST /predict`` with the documented
example body gets a 200 answer with a label; any console error fails the test.

``HYDRA_DOCS_SCREENSHOT=docs/images/swagger-ui.png`` (``make docs-screenshot``) also saves the page as a screenshot.
Without Chromium the test is skipped, saying so (``.ci/run`` installs it).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from benchmarks.harness import free_port, start_server, wait_ready
from tests.fixtures.tiny_artifact import make_tiny_artifact, make_tiny_clip_artifact

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium (apt-get install chromium)")

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    root = tmp_path_factory.mktemp("docs-browser")
    parts = [
        make_tiny_artifact(root / "text", "bert", name="tweets-minilm-fast", labels=["negative", "positive"]),
        make_tiny_artifact(root / "image", "vit", name="fashion-vit-fast"),
        make_tiny_clip_artifact(root / "zeroshot", name="fashion-zeroshot-fast"),
    ]
    port = free_port()
    env = {"HYDRA_ARTIFACTS": ",".join(str(p) for p in parts), "HYDRA_STORE": "false"}
    proc = start_server(parts[0], port, env, log_file=root / "server.log")
    try:
        wait_ready(port, proc, timeout=120)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.kill()
        proc.wait(10)


def test_swagger_ui_renders_every_route_and_tries_predict(server: str) -> None:
    import httpx
    from playwright.sync_api import sync_playwright

    spec = httpx.get(f"{server}/openapi.json").json()
    assert spec["openapi"].startswith("3.1")
    documented = {(method.upper(), path) for path, ops in spec["paths"].items() for method in ops}
    errors: list[str] = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(f"{server}/docs")
            page.wait_for_selector(".opblock-summary", timeout=15_000)
            assert page.locator("text=Unable to render this definition").count() == 0
            shown = set()
            for block in page.locator(".opblock").all():
                method = block.locator(".opblock-summary-method").inner_text().strip()
                path = block.locator(".opblock-summary-path").get_attribute("data-path")
                shown.add((method, path))
            assert shown == documented
            if target := os.environ.get("HYDRA_DOCS_SCREENSHOT"):
                page.screenshot(path=str(ROOT / target), full_page=True)  # every route
            predict = page.locator(".opblock-post").filter(has=page.locator('[data-path="/predict"]'))
            predict.locator(".opblock-summary").click()
            predict.get_by_role("button", name="Try it out").click()
            predict.get_by_role("button", name="Execute").click()
            status = predict.locator(".live-responses-table tbody .response-col_status").first
            status.wait_for(timeout=15_000)
            assert status.inner_text().strip() == "200"
            answer = predict.locator(".live-responses-table tbody .response-col_description pre").first.inner_text()
            body = json.loads(answer)
            assert body["predictions"][0]["label"]
        finally:
            browser.close()
    assert not errors, errors
