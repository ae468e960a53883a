"""Every HTTP example of README.md and docs/api.md, run as written against the server of ``make serve``.

The ``curl`` lines are read from the Markdown itself (so a doc that drifts from the server fails here), parsed as
bash would (quotes, line continuations, ``$(base64 -w0 FILE)``, pipes to ``grep``), and sent in-process to an app
serving tiny models with the default artifacts' names, tasks and labels (``offline/configs/*-fast.yaml``). Each
answers 2xx, or the status its trailing comment names (``# 422 invalid_input``), with the shape documented for its
route. ``FILE`` arguments (``-F file=@shirt.png``) are generated images.
"""

from __future__ import annotations

import base64
import io
import json
import re
import shlex
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fastapi.testclient import TestClient
from PIL import Image

from service.api.schemas import FeedbackResponse, ModelsResponse, PredictResponse
from service.entrypoints.app import create_app
from tests.fixtures.tiny_artifact import make_tiny_artifact, make_tiny_clip_artifact
from tests.service.helpers import settings_for

ROOT = Path(__file__).resolve().parents[3]
DOCS = [ROOT / "README.md", ROOT / "docs" / "api.md"]
FASHION = ["T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Shirt"]
TEXT, IMAGE, ZERO_SHOT = "tweets-minilm-fast", "fashion-vit-fast", "fashion-zeroshot-fast"
LABELS = {TEXT: ["negative", "positive"], IMAGE: FASHION, ZERO_SHOT: FASHION}  # the zero-shot model's fixed ones


def image_file(name: str) -> bytes:
    """A generated image for ``name`` (its format from the extension; the same bytes for the same name)."""
    seed = sum(name.encode())
    arr = np.random.default_rng(seed).integers(0, 256, (28, 28, 3), dtype=np.uint8)
    buf = io.BytesIO()
    fmt = {".jpg": "JPEG", ".jpeg": "JPEG", ".webp": "WEBP"}.get(Path(name).suffix.lower(), "PNG")
    Image.fromarray(arr).save(buf, format=fmt)
    return buf.getvalue()


# ----------------------------------------------------------------------------- the examples, from the Markdown
@dataclass
class Example:
    """One ``curl`` command of the docs, parsed."""

    where: str  # file:line
    url: str
    method: str = "GET"
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes | None = None
    fields: list[tuple[str, str]] = field(default_factory=list)  # -F name=value
    files: list[tuple[str, str]] = field(default_factory=list)  # -F name=@file
    include_headers: bool = False  # -i
    grep: list[tuple[str, bool]] = field(default_factory=list)  # | grep [-i] PATTERN
    comment: str = ""


def _bash_blocks(path: Path) -> Iterator[tuple[int, str]]:
    """``(first line number, text)`` of each bash code block."""
    lines = path.read_text().splitlines()
    start = None
    for i, line in enumerate(lines):
        if start is None and line.strip() in ("```bash", "```sh"):
            start = i + 1
        elif start is not None and line.strip() == "```":
            yield start + 1, "\n".join(lines[start:i])
            start = None


def _commands(text: str) -> Iterator[tuple[int, str]]:
    """The commands of a block, as bash reads them: ``\\`` continues a line, an open quote too."""
    buf: list[str] = []
    first = 0
    for n, line in enumerate(text.splitlines()):
        if not buf:
            first = n
        buf.append(line[:-1] if line.endswith("\\") else line)
        if line.endswith("\\"):
            continue
        joined = "\n".join(buf)
        try:
            shlex.split(joined, comments=True)
        except ValueError:  # an open quote: the command goes on
            continue
        yield first, joined
        buf = []


def _split_comment(cmd: str) -> tuple[str, str]:
    """``cmd`` and its trailing ``# comment`` (a ``#`` outside quotes, after a blank)."""
    quote = None
    for i, ch in enumerate(cmd):
        if quote:
            if ch == quote:
                quote = None
            elif ch == "\\" and quote == '"':
                continue
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or cmd[i - 1].isspace()):
            return cmd[:i], cmd[i + 1 :].strip()
    return cmd, ""


def _substitute(cmd: str) -> str:
    """``$(base64 -w0 FILE)`` -> the base64 of the generated FILE; ``$HYDRA_API_KEY`` -> a token."""
    cmd = re.sub(r"\$\(base64 -w0 ([\w.-]+)\)", lambda m: base64.b64encode(image_file(m.group(1))).decode(), cmd)
    return cmd.replace("$HYDRA_API_KEY", "docs-example-key")


def parse_curl(where: str, cmd: str) -> Example | None:
    """A curl command to the local server as an :class:`Example`; None for anything else."""
    code, comment = _split_comment(_substitute(cmd))
    lex = shlex.shlex(code, posix=True, punctuation_chars="|")
    lex.whitespace_split = True
    tokens = list(lex)
    if not tokens or tokens[0] != "curl":
        return None
    stages, current = [], []
    for t in tokens:
        if t == "|":
            stages.append(current)
            current = []
        else:
            current.append(t)
    stages.append(current)
    ex = Example(where=where, url="", comment=comment)
    args = iter(stages[0][1:])
    for a in args:
        if a in ("-H", "--header"):
            k, v = next(args).split(":", 1)
            ex.headers[k.strip()] = v.strip()
        elif a in ("-d", "--data"):
            ex.body, ex.method = next(args).encode(), "POST"
        elif a in ("-F", "--form"):
            name, value = next(args).split("=", 1)
            (ex.files if value.startswith("@") else ex.fields).append(
                (name, value.lstrip("@") if value.startswith("@") else value)
            )
            ex.method = "POST"
        elif a in ("-X", "--request"):
            ex.method = next(args)
        elif re.fullmatch(r"-[a-zA-Z]+", a):
            ex.include_headers |= "i" in a
        else:
            ex.url = a
    for stage in stages[1:]:
        if stage[0] == "grep":
            ex.grep.append((stage[-1], "-i" in stage))
        else:
            assert stage[0] == "head", f"{where}: a pipe to {stage[0]} is not understood here"
    if not re.match(r"(https?://)?(localhost|127\.0\.0\.1):8000/", ex.url):
        return None
    return ex


def doc_examples() -> list[Example]:
    out = []
    for path in DOCS:
        for start, block in _bash_blocks(path):
            for offset, cmd in _commands(block):
                ex = parse_curl(f"{path.relative_to(ROOT)}:{start + offset}", cmd)
                if ex is not None:
                    out.append(ex)
    return out


EXAMPLES = doc_examples()


# ----------------------------------------------------------------------------- the default server, tiny
@pytest.fixture(scope="module")
def default_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    """The three default artifacts' names, tasks and labels, as tiny models; the classifiers with a calibration
    split (the builder's default guarantees: risks 1, 2, 5 and 10 %), as the default artifacts have."""
    root = tmp_path_factory.mktemp("default")
    text = make_tiny_artifact(root / "text", "bert", name=TEXT, labels=LABELS[TEXT], exports=(), seed=1, guarantees={})
    image = make_tiny_artifact(root / "image", "vit", name=IMAGE, labels=LABELS[IMAGE], exports=(), guarantees={})
    zero_shot = make_tiny_clip_artifact(root / "zeroshot", name=ZERO_SHOT, labels=LABELS[ZERO_SHOT])
    # the prediction store on, as by default (in a tmp folder): the feedback examples need it
    with TestClient(create_app(settings_for(text, image, zero_shot, store=True, state_dir=str(root / "state")))) as c:
        yield c


def send(client: TestClient, ex: Example) -> Any:
    path = re.sub(r"^(https?://)?[^/]+", "", ex.url)
    if ex.method == "GET":
        return client.get(path, headers=ex.headers)
    if ex.files or ex.fields:
        files = [(name, (f, image_file(f), "application/octet-stream")) for name, f in ex.files]
        data: dict[str, list[str]] = {}
        for name, value in ex.fields:
            data.setdefault(name, []).append(value)
        return client.post(path, files=files, data=data, headers=ex.headers)
    return client.post(path, content=ex.body, headers=ex.headers)


# ----------------------------------------------------------------------------- what each route answers
def _inputs(ex: Example) -> tuple[int, dict[str, Any]]:
    """The number of inputs an inference example sends, and its options."""
    if ex.files:
        opts = {k: v for k, v in ex.fields}
        return len(ex.files), {k: json.loads(v) if k in ("top_k", "return_members") else v for k, v in opts.items()}
    body = json.loads(ex.body or b"{}")
    for many in ("texts", "images"):
        if many in body:
            return len(body[many]), body
    return 1, body


def check_inference(ex: Example, path: str, answer: dict[str, Any]) -> None:
    PredictResponse.model_validate(answer)
    n, opts = _inputs(ex)
    assert len(answer["predictions"]) == n
    body = {} if ex.files else json.loads(ex.body or b"{}")
    if "model" in opts:
        assert answer["model"] == opts["model"]
    elif path == "/zero-shot":
        assert answer["model"] == ZERO_SHOT
    else:
        assert answer["model"] == (TEXT if "text" in body or "texts" in body else IMAGE)
    labels = opts.get("labels")
    if isinstance(labels, str):  # multipart: a JSON list or one field per label
        labels = json.loads(labels) if labels.startswith("[") else [v for k, v in ex.fields if k == "labels"]
    for p in answer["predictions"]:
        if labels is not None:
            assert p["label"] in labels
        count = len(labels) if labels else len(LABELS[answer["model"]])
        assert len(p["top_k"]) == min(int(opts.get("top_k", 5)), count)  # clamped to the label count
        assert ("members" in p) == bool(opts.get("return_members", False))


def check_shape(ex: Example, r: Any) -> None:
    """The shape each route documents, for a 2xx answer."""
    path = re.sub(r"^(https?://)?[^/]+", "", ex.url)
    names = {TEXT, IMAGE, ZERO_SHOT}
    if path in ("/predict", "/zero-shot"):
        check_inference(ex, path, r.json())
    elif path == "/healthz":
        assert r.json() == {"status": "ok"}
    elif path == "/readyz":
        assert r.json()["status"] == "ready" and set(r.json()["models"]) == names
    elif path == "/v1/models":
        models = ModelsResponse.model_validate(r.json()).models
        assert {m.name for m in models} == names
        listed = re.search(r"\[\{([^}]*)\}\]", ex.comment)  # README: {"models": [{name, family, ...}]}
        for key in re.findall(r"\w+", listed.group(1)) if listed else []:
            assert all(key in m.model_dump() for m in models), key
    elif re.fullmatch(r"/v1/models/[\w.-]+/drift", path):
        assert {"model", "alarm", "log10_statistic", "log10_threshold", "inputs", "alarm_at", "delta"} <= set(r.json())
    elif re.fullmatch(r"/v1/models/[\w.-]+/feedback", path):
        FeedbackResponse.model_validate(r.json())
    elif path == "/metrics":
        assert "hydra_predictions_total" in r.text
    elif path == "/openapi.json":
        assert {"/predict", "/zero-shot", "/v1/models"} <= set(r.json()["paths"])
    elif m := re.fullmatch(r"/v2/models/([\w.-]+)", path):
        meta = r.json()
        assert meta["name"] == m.group(1) and set(meta) == {"name", "versions", "platform", "inputs", "outputs"}
    elif m := re.fullmatch(r"/v2/models/([\w.-]+)/infer", path):
        body, answer = json.loads(ex.body), r.json()
        assert answer["model_name"] == m.group(1)
        if "id" in body:
            assert answer["id"] == body["id"]
        wanted = [o["name"] for o in body.get("outputs", [])]
        assert not wanted or [o["name"] for o in answer["outputs"]] == wanted
        batch = body["inputs"][0]["shape"][0]
        assert all(o["shape"][0] == batch for o in answer["outputs"])
    else:
        raise AssertionError(f"{ex.where}: no documented shape for {path}; add one here")


def test_the_docs_have_examples_of_every_route():
    routes = {re.sub(r"^(https?://)?[^/]+", "", ex.url) for ex in EXAMPLES}
    for path in (
        "/healthz",
        "/readyz",
        "/metrics",
        "/v1/models",
        "/predict",
        "/zero-shot",
        "/openapi.json",
        f"/v2/models/{TEXT}/infer",
    ):
        assert path in routes, path
    assert len(EXAMPLES) >= 25, [ex.where for ex in EXAMPLES]
    assert not any("my-text" in ex.url or b"my-text" in (ex.body or b"") for ex in EXAMPLES)


@pytest.mark.parametrize("ex", EXAMPLES, ids=[ex.where for ex in EXAMPLES])
def test_every_http_example_answers_as_documented(default_server: TestClient, ex: Example):
    r = send(default_server, ex)
    expected = re.match(r"(\d{3})\b\W*(\w+)?", ex.comment)
    if expected:  # an example of an error: the status and code of its comment
        assert r.status_code == int(expected.group(1)), (ex.where, r.text[:300])
        if expected.group(2):
            assert r.json()["error"]["code"] == expected.group(2), r.text
    else:
        assert 200 <= r.status_code < 300, (ex.where, r.text[:500])
        check_shape(ex, r)
    shown = "".join(f"{k}: {v}\n" for k, v in r.headers.items()) * ex.include_headers + r.text
    for pattern, ignore_case in ex.grep:
        flags = re.IGNORECASE | re.MULTILINE if ignore_case else re.MULTILINE
        assert re.search(pattern, shown, flags), (ex.where, pattern)


# ----------------------------------------------------------------------------- documented answers
def _json_after(path: Path, heading: str) -> Any:
    """The first JSON code block after ``heading``."""
    text = path.read_text()
    block = re.search(r"```json\n(.*?)\n```", text[text.index(heading) :], re.DOTALL)
    assert block, heading
    return json.loads(block.group(1))


def test_the_documented_model_list_has_the_fields_the_server_sends(default_server: TestClient):
    """docs/api.md's ``GET /v1/models`` example: its entry has every field of the server's entries, and its
    ``guarantees`` block (and its ``drift``) exactly the server's keys; an uncertified risk target is ``null``."""
    (doc,) = _json_after(ROOT / "docs" / "api.md", "## GET /v1/models")["models"]
    live = {m["name"]: m for m in default_server.get("/v1/models").json()["models"]}
    served = live[doc["name"]]
    assert set(doc) == set(served)
    assert set(doc["guarantees"]) == set(served["guarantees"])
    assert set(doc["guarantees"]["drift"]) == set(served["guarantees"]["drift"])
    assert set(doc["guarantees"]["risks"]) == set(served["guarantees"]["risks"])  # the builder's default targets
    assert doc["labels"] == served["labels"] == FASHION
    assert live[ZERO_SHOT]["guarantees"] is None  # documented: null without a calibration split
    text = (ROOT / "docs" / "api.md").read_text()
    for key in served["guarantees"]:
        assert f"`guarantees.{key}`" in text or f"`.{key}`" in text, key  # each field has a row


def test_the_documented_metadata_lists_the_servers_inputs_and_outputs(default_server: TestClient):
    doc = _json_after(ROOT / "docs" / "api.md", "**Metadata** of the default image classifier")
    served = default_server.get(f"/v2/models/{doc['name']}").json()
    assert [i["name"] for i in doc["inputs"]] == [i["name"] for i in served["inputs"]]
    assert [o["name"] for o in doc["outputs"]] == [o["name"] for o in served["outputs"]]
    assert next(o for o in doc["outputs"] if o["name"] == "probabilities")["shape"] == [-1, len(FASHION)]
