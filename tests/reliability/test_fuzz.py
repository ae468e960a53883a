"""Property-based fuzzing of the HTTP API from its own OpenAPI schema (schemathesis), in-process against the ASGI
app with tiny models loaded: valid and invalid bodies (JSON and multipart) for every operation. No answer may be a
5xx, every answer must match the schema (declared status code, content type, body), and invalid data must be
refused with a 4xx.

The cases are drawn with hypothesis from ``APIOperation.as_strategy`` (``tests/fixtures/schema_fuzz.py`` says why).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import schemathesis
from schemathesis import GenerationMode
from schemathesis.specs.openapi.checks import negative_data_rejection

from service.entrypoints.app import create_app
from tests.fixtures import schema_fuzz
from tests.service.helpers import settings_for

CHECKS = [*schema_fuzz.CHECKS, negative_data_rejection]
OPERATIONS = [
    "GET /healthz",
    "GET /readyz",
    "GET /metrics",
    "GET /v1/models",
    "POST /predict",
    "POST /zero-shot",
    "GET /v1/models/{model_name}/drift",
    "POST /v1/models/{model_name}/drift/reset",
    "POST /v1/models/{model_name}/feedback",
    "GET /v1/models/{model_name}/monitor",
]
# examples per operation and generation mode: a bounded run (about 20 s on 2 busy cores)
MAX_EXAMPLES = 15


@pytest.fixture(scope="module")
def api_schema(artifacts: dict[str, Path]) -> Iterator[schemathesis.BaseSchema]:
    app = create_app(settings_for(artifacts["vit"], artifacts["bert"], max_items=4, max_text_chars=2000))
    yield from schema_fuzz.asgi_schema(app)


def test_every_operation_is_fuzzed(api_schema: schemathesis.BaseSchema) -> None:
    labels = sorted(r.ok().label for r in api_schema.get_all_operations())
    assert labels == sorted(OPERATIONS)


CASES = [pytest.param(op, GenerationMode.POSITIVE, id=f"{op}-valid") for op in OPERATIONS] + [
    pytest.param(op, GenerationMode.NEGATIVE, id=f"{op}-invalid")
    for op in OPERATIONS
    if op in ("POST /predict", "POST /zero-shot")
]  # the others take no body, or (feedback) none the fuzzer can make invalid: tests/service/test_feedback.py
# sends it garbage JSON, bad items and oversized batches


@pytest.mark.parametrize(("label", "mode"), CASES)
def test_no_5xx_and_every_answer_matches_the_schema(
    api_schema: schemathesis.BaseSchema, label: str, mode: GenerationMode
) -> None:
    seen = schema_fuzz.status_counts(api_schema, label, mode, MAX_EXAMPLES, CHECKS)
    assert seen and max(seen) < 500, seen
    if mode is GenerationMode.NEGATIVE:
        assert all(400 <= code < 500 for code in seen), seen
    elif label == "POST /predict":
        assert 200 in seen, seen  # some generated inputs are real texts or images that reach the model
    ready = api_schema.find_operation_by_label("GET /readyz").Case().call()
    assert ready.status_code == 200  # the server is still ready after the fuzzing
