"""The OpenAPI document against the server it describes (schemathesis): cases drawn from ``/openapi.json`` for every
operation, sent in-process to the app serving the suite's tiny models plus a zero-shot one (so that ``/zero-shot``
answers too), valid bodies (JSON and multipart) for every operation and invalid ones for the inference routes.

Checked on every answer: no 5xx, its status declared for the operation, its content type and body those the
document declares (the error envelope for every 4xx/5xx). ``tests/reliability/test_fuzz.py`` fuzzes the
classifiers alone; this one is the document's own check, zero-shot included, bounded to about 15 s on 2 busy cores.

Cases are drawn with hypothesis from ``APIOperation.as_strategy`` (``tests/fixtures/schema_fuzz.py`` says why).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.specs.openapi.checks import negative_data_rejection

from service.entrypoints.app import create_app
from tests.fixtures import schema_fuzz
from tests.fixtures.tiny_artifact import make_tiny_clip_artifact
from tests.service.helpers import settings_for

CHECKS = schema_fuzz.CHECKS
INFERENCE = ("POST /predict", "POST /zero-shot")
# examples per operation and mode: the inference routes get more (two media types, many fields)
MAX_EXAMPLES = {"POST /predict": 100, "POST /zero-shot": 100}
OTHERS = 10


@pytest.fixture(scope="module")
def api_schema(
    artifacts: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[schemathesis.BaseSchema]:
    zero_shot = make_tiny_clip_artifact(tmp_path_factory.mktemp("fuzz") / "tiny-clip")
    app = create_app(settings_for(artifacts["vit"], artifacts["bert"], zero_shot, max_items=4, max_text_chars=2000))
    yield from schema_fuzz.asgi_schema(app)


def operations(schema: schemathesis.BaseSchema) -> list[str]:
    return sorted(r.ok().label for r in schema.get_all_operations())


def test_the_document_declares_only_the_contract_error_body(api_schema: schemathesis.BaseSchema) -> None:
    raw = api_schema.raw_schema
    assert "HTTPValidationError" not in str(raw)
    assert set(INFERENCE) <= set(operations(api_schema))


CASES = [
    (op, GenerationMode.POSITIVE)
    for op in (
        *INFERENCE,
        "GET /v1/models",
        "GET /readyz",
        "GET /healthz",
        "GET /metrics",
        "GET /v1/models/{model_name}/drift",
        "POST /v1/models/{model_name}/drift/reset",
    )
]
CASES += [(op, GenerationMode.NEGATIVE) for op in INFERENCE]


@pytest.mark.parametrize(("label", "mode"), CASES, ids=[f"{op}-{m.value}" for op, m in CASES])
def test_every_answer_is_declared_and_matches_its_schema(
    api_schema: schemathesis.BaseSchema, label: str, mode: GenerationMode
) -> None:
    checks = CHECKS + [negative_data_rejection] if mode is GenerationMode.NEGATIVE else CHECKS
    seen = schema_fuzz.status_counts(api_schema, label, mode, MAX_EXAMPLES.get(label, OTHERS), checks)
    assert seen and max(seen) < 500, seen
    if mode is GenerationMode.NEGATIVE:
        assert all(400 <= code < 500 for code in seen), seen
    ready = api_schema.find_operation_by_label("GET /readyz").Case().call()
    assert ready.status_code == 200  # still serving after the cases


@pytest.mark.parametrize("label", INFERENCE)
def test_the_documented_request_is_answered_as_declared(api_schema: schemathesis.BaseSchema, label: str) -> None:
    """The request the document gives as its example (what Swagger UI's "Try it out" sends) reaches the model: 200,
    and the answer matches the declared PredictResponse. Random images are rarely decodable, so the drawn cases
    above seldom get this far on /zero-shot."""
    operation = api_schema.find_operation_by_label(label)
    (strategy,) = operation.get_strategies_from_examples()
    seen: list[int] = []

    @given(case=strategy)
    @settings(max_examples=1, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    def run(case: schemathesis.Case) -> None:
        seen.append(case.call_and_validate(checks=CHECKS).status_code)

    run()
    assert seen == [200]
