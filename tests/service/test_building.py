"""A model still being built (``make serve`` serves its first default model while it builds the others): the server
starts without it, ``/readyz`` and ``/v1/models`` list it as building, a request for it gets 503 ``not_ready``
naming it, and it is served once its builder's note is gone; a build that stops is listed as failed. And
``python -m offline.default --serve`` starts the server after its first build, with a note beside each folder still
to build."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from service import lifecycle
from service.core.building import BuildNote, clear_note, note_path, read_note, write_note
from service.entrypoints.app import create_app
from tests.fixtures.tiny_artifact import make_tiny_artifact
from tests.service.helpers import b64, png, settings_for


@pytest.fixture(autouse=True)
def quick_poll(monkeypatch):
    monkeypatch.setattr(lifecycle, "BUILD_POLL_S", 0.05)


def _note(name: str, modality: str = "text", pid: int | None = None) -> BuildNote:
    return BuildNote(
        name=name,
        task="classification",
        modality=modality,
        config="offline/configs/text-fast.yaml",
        pid=pid or os.getpid(),
        started=time.time() - 30,
        eta_s=200.0,
    )


def _wait(c: TestClient, until, timeout: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        doc = c.get("/v1/models").json()
        if until(doc):
            return doc
        time.sleep(0.05)
    raise AssertionError(f"not reached in {timeout} s: {doc}")


def test_a_model_being_built_is_listed_refused_by_name_and_served_once_built(tmp_path: Path):
    ready = make_tiny_artifact(tmp_path / "image", "vit", name="tiny-vit")
    later = tmp_path / "text"
    write_note(later, _note("tiny-bert"))
    with TestClient(create_app(settings_for(ready, later))) as c:
        r = c.get("/readyz")
        assert r.status_code == 200, r.text
        assert r.json()["models"] == ["tiny-vit"] and [b["name"] for b in r.json()["building"]] == ["tiny-bert"]
        (built,) = c.get("/v1/models").json()["building"]
        assert built["status"] == "building" and built["elapsed_s"] >= 30 and 0 < built["eta_s"] <= 170
        # the built model answers; the one being built is refused, by name and by modality, with a 503 naming it
        assert c.post("/predict", json={"image": b64(png())}).status_code == 200
        for body in ({"text": "hello", "model": "tiny-bert"}, {"text": "hello"}):
            r = c.post("/predict", json=body)
            assert r.status_code == 503 and r.json()["error"]["code"] == "not_ready", r.text
            assert "'tiny-bert' is still being built" in r.json()["error"]["message"]
        # the build finishes: the artifact is written, then the note is removed
        make_tiny_artifact(later, "bert", name="tiny-bert", seed=1)
        clear_note(later)
        doc = _wait(c, lambda d: len(d["models"]) == 2)
        assert doc["building"] == [] and {m["name"] for m in doc["models"]} == {"tiny-vit", "tiny-bert"}
        r = c.post("/predict", json={"text": "hello", "model": "tiny-bert"})
        assert r.status_code == 200 and r.json()["model"] == "tiny-bert", r.text
        assert set(c.get("/readyz").json()["models"]) == {"tiny-vit", "tiny-bert"}


def test_nothing_built_yet_is_not_ready_and_says_what_is_being_built(tmp_path: Path):
    later = tmp_path / "image"
    write_note(later, _note("tiny-vit", "image"))
    with TestClient(create_app(settings_for(later))) as c:
        r = c.get("/readyz")
        assert r.status_code == 503 and "every model is still being built (tiny-vit)" in r.text, r.text
        r = c.post("/predict", json={"image": b64(png())})
        assert r.status_code == 503 and "'tiny-vit' is still being built" in r.text, r.text
        make_tiny_artifact(later, "vit", name="tiny-vit")
        clear_note(later)
        _wait(c, lambda d: len(d["models"]) == 1)
        assert c.get("/readyz").status_code == 200
        assert c.post("/predict", json={"image": b64(png())}).status_code == 200


def test_a_build_that_stops_is_listed_as_failed_and_says_why(tmp_path: Path):
    ready = make_tiny_artifact(tmp_path / "image", "vit", name="tiny-vit")
    gone, empty = tmp_path / "text", tmp_path / "other"
    write_note(gone, _note("tiny-bert", pid=2**22 + 12345))  # no such process
    write_note(empty, _note("tiny-other"))
    with TestClient(create_app(settings_for(ready, gone, empty))) as c:
        clear_note(empty)  # the builder removed its note without writing an artifact: the build failed
        doc = _wait(c, lambda d: len(d["failed"]) == 2)
        why = {f["name"]: f["reason"] for f in doc["failed"]}
        assert "builder process" in why["tiny-bert"] and "is gone" in why["tiny-bert"]
        assert "ended without an artifact" in why["tiny-other"]
        r = c.post("/predict", json={"text": "x", "model": "tiny-bert"})
        assert r.status_code == 503 and "'tiny-bert' is not served: its build stopped" in r.text, r.text
        assert c.get("/readyz").status_code == 200  # the built model is served


def test_the_note_is_written_whole_and_read_back(tmp_path: Path):
    art = tmp_path / "text"
    assert read_note(art) is None
    note = _note("m")
    write_note(art, note)
    assert note_path(art) == tmp_path / ".text.building.json" and read_note(art) == note
    note_path(art).write_text("{half")
    assert read_note(art) is None  # unreadable: not a build in progress
    clear_note(art)
    clear_note(art)  # twice is fine
    assert not note_path(art).exists()


def test_the_ready_line_names_a_command_to_try(tmp_path: Path, caplog):
    ready = make_tiny_artifact(tmp_path / "image", "vit", name="tiny-vit")
    caplog.set_level("INFO", logger="hydra.service")
    with TestClient(create_app(settings_for(ready))):
        pass
    tries = [r.getMessage() for r in caplog.records if r.getMessage().startswith("try: ")]
    assert tries == ["try: curl -s localhost:8000/predict -F file=@docs/images/trouser.png -F model=tiny-vit"]
    assert (Path(__file__).resolve().parents[2] / "docs" / "images" / "trouser.png").is_file()


def test_serve_while_building_starts_the_server_after_the_first_build(tmp_path: Path, monkeypatch):
    """The quickest default first, the server started once it is built with a note beside each folder still to
    build, each note removed when its build ends, the server's exit status returned."""
    from offline import default

    events: list[str] = []

    class Server:
        returncode = None

        def __init__(self, cmd, cwd, env):
            assert env["HYDRA_ARTIFACTS"] == ",".join(str(tmp_path / "d" / m) for m in ("zeroshot", "text", "image"))
            assert cmd[1:] == ["-m", "service"]
            notes = sorted(p.name.split(".")[1] for p in (tmp_path / "d").glob(".*.building.json"))
            events.append("serve while building " + ",".join(notes))

        def wait(self, timeout=None):
            return 0

    def fake_build(modality, config, out):
        assert read_note(out) is not None and read_note(out).eta_s > 0
        events.append(f"build {modality}")

    monkeypatch.delenv("HYDRA_ARTIFACTS", raising=False)  # without it: the folders it builds, the quickest first
    monkeypatch.setattr(default.subprocess, "Popen", Server)

    def poll(self):  # serving while it builds
        self.returncode = None if len(events) < 4 else 0
        return self.returncode

    Server.poll = poll
    monkeypatch.setattr(default, "build_one", fake_build)
    monkeypatch.setattr(default, "is_current", lambda out, config: False)
    assert default.main(["--out", str(tmp_path / "d"), "--serve"]) == 0
    assert events == ["build zeroshot", "serve while building image,text", "build text", "build image"]
    assert not list((tmp_path / "d").glob(".*.building.json"))


def test_a_built_artifact_that_does_not_verify_is_listed_as_failed(tmp_path: Path):
    ready = make_tiny_artifact(tmp_path / "image", "vit", name="tiny-vit")
    later = tmp_path / "text"
    write_note(later, _note("tiny-bert"))
    with TestClient(create_app(settings_for(ready, later))) as c:
        make_tiny_artifact(later, "bert", name="tiny-bert", seed=1)
        (later / "model.safetensors").write_bytes(b"not the weights")  # a build that wrote a broken file
        clear_note(later)
        doc = _wait(c, lambda d: len(d["failed"]) == 1)
        (failed,) = doc["failed"]
        assert failed["name"] == "tiny-bert" and "could not be served" in failed["reason"]
        assert "model.safetensors" in failed["reason"] and [m["name"] for m in doc["models"]] == ["tiny-vit"]
        assert c.post("/predict", json={"image": b64(png())}).status_code == 200  # the built model goes on
