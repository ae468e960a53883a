"""The answers the README's first screen shows (``<!-- answer: FILE -->`` before a JSON block) are the server's:
every field shown is a field of the answer, of the type the server sends, for the same image file; and, where the
default artifacts are built (``make artifacts``; ``.ci/run`` builds them), the same decisions exactly and the same
numbers to the digits shown, give or take what a rebuild on another CPU and bf16 serving move them by
(``tests/fixtures/readme_spread.json``, measured by ``tests/fixtures/readme_spread.py``, times :data:`MARGIN`). So the
README cannot go stale: a changed answer fails here, on any machine."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from service.entrypoints.app import create_app
from tests.fixtures.tiny_artifact import make_tiny_artifact
from tests.service.helpers import settings_for

ROOT = Path(__file__).resolve().parents[3]
README = ROOT / "README.md"
SPREAD = ROOT / "tests" / "fixtures" / "readme_spread.json"
MARGIN = 3.0  # times the largest move measured between builds and precisions
DEFAULT_IMAGE = ROOT / "artifacts" / "default" / "image"
GARMENTS = ["T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Shirt"]


class Shown(float):
    """A number as the README writes it: its value and how many decimals it shows."""

    decimals: int

    def __new__(cls, text: str) -> Shown:
        out = super().__new__(cls, float(text))
        out.decimals = len(text.split(".")[1]) if "." in text else 0
        return out


def shown_answers() -> list[tuple[str, dict[str, Any]]]:
    """``(image file, the JSON shown)`` for each marked answer of the README."""
    text = README.read_text()
    found = re.findall(r"<!-- answer: (\S+) -->\s*```json\n(.*?)```", text, flags=re.S)
    return [(path, json.loads(body, parse_float=Shown, parse_int=Shown)) for path, body in found]


ANSWERS = shown_answers()


def post(client: TestClient, image: str) -> dict[str, Any]:
    r = client.post("/predict", files=[("file", (Path(image).name, (ROOT / image).read_bytes(), "image/png"))])
    assert r.status_code == 200, r.text
    return r.json()


def _same_shape(shown: Any, served: Any, where: str) -> None:
    if isinstance(shown, dict):
        assert isinstance(served, dict), where
        for key, value in shown.items():
            assert key in served, f"{where}.{key}: shown in the README, not in the answer"
            _same_shape(value, served[key], f"{where}.{key}")
    elif isinstance(shown, list):
        assert isinstance(served, list), where
        for i, (a, b) in enumerate(zip(shown, served, strict=False)):
            _same_shape(a, b, f"{where}[{i}]")
    elif isinstance(shown, Shown):
        assert isinstance(served, (int, float)) and not isinstance(served, bool), where
    else:
        assert type(served) is type(shown), f"{where}: {type(shown).__name__} shown, {type(served).__name__} sent"


def _same_values(shown: Any, served: Any, where: str, moved: dict[str, float], field: str = "") -> None:
    """Decisions (labels, flags, sets, accepts) exactly; a number to the digits shown, give or take ``MARGIN`` times
    the largest move of its field (``moved``, keyed by the field's path without list indices)."""
    if isinstance(shown, dict):
        for key, value in shown.items():
            _same_values(value, served[key], f"{where}.{key}", moved, f"{field}.{key}" if field else key)
    elif isinstance(shown, list):
        assert len(shown) == len(served), where
        for i, (a, b) in enumerate(zip(shown, served, strict=True)):
            _same_values(a, b, f"{where}[{i}]", moved, field)
    elif isinstance(shown, Shown):  # the served value, rounded as the README rounds it, within the measured spread
        tol = 0.5 * 10**-shown.decimals + MARGIN * moved.get(field, 0.0) + 1e-12
        assert abs(served - shown) <= tol, f"{where}: {shown} shown, {served} sent (tolerance {tol:.3g})"
    else:
        assert served == shown, f"{where}: {shown!r} shown, {served!r} sent"


def test_the_spread_was_measured_on_every_shown_number_and_moved_no_decision():
    doc = json.loads(SPREAD.read_text())
    assert all(not v["decisions"] for v in doc["variants"].values()), doc["variants"]
    assert len(doc["variants"]) >= 4  # two builds at least, each in fp32 and bf16
    fields: set[str] = set()

    def numbers(shown: Any, field: str = "") -> None:
        if isinstance(shown, dict):
            for k, v in shown.items():
                numbers(v, f"{field}.{k}" if field else k)
        elif isinstance(shown, list):
            for v in shown:
                numbers(v, field)
        elif isinstance(shown, Shown):
            fields.add(field)

    for _, shown in ANSWERS:
        numbers(shown)
    assert fields <= set(doc["max_move"]), fields - set(doc["max_move"])


def test_the_readme_shows_an_accepted_and_a_flagged_answer():
    assert len(ANSWERS) == 2
    (_, accepted), (_, flagged) = ANSWERS
    assert accepted["predictions"][0]["selective"]["accept"] is True
    assert flagged["predictions"][0]["ood"]["flag"] is True
    assert all((ROOT / image).is_file() for image, _ in ANSWERS)


def test_every_field_shown_is_a_field_of_the_answer(tmp_path):
    art = make_tiny_artifact(
        tmp_path / "image",
        "vit",
        name="fashion-vit-fast",
        labels=GARMENTS,
        exports=(),
        guarantees={},
        ood=True,
        ood_score="mahalanobis_layers",
        ood_threshold=None,
    )
    with TestClient(create_app(settings_for(art))) as c:
        for image, shown in ANSWERS:
            _same_shape(shown, post(c, image), image)


@pytest.mark.skipif(
    not (DEFAULT_IMAGE / "manifest.json").is_file(), reason="needs the default artifacts (make artifacts)"
)
@pytest.mark.parametrize(
    "serving", [{"backend": "onnx"}, {"backend": "auto", "precision": "auto"}], ids=["onnx-fp32", "as-make-serve"]
)
def test_the_default_server_gives_the_answers_shown(serving: dict[str, str]):
    """In fp32 from ONNX (what the README shows), and as ``make serve`` serves on this machine (bf16 where the CPU
    has it)."""
    moved = json.loads(SPREAD.read_text())["max_move"]
    with TestClient(create_app(settings_for(DEFAULT_IMAGE, **serving))) as c:
        for image, shown in ANSWERS:
            _same_values(shown, post(c, image), image, moved)
