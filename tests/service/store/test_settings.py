"""The store's settings: on by default with SQLite under the state directory, off with HYDRA_STORE=off,
PostgreSQL through psycopg whatever the URL's spelling, and a bad URL refused at start-up."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from service.settings import Settings
from service.store import FeedbackItem, PredictionStore, StoreConfig, StoreUnavailable, open_store
from service.store.database import resolve_url
from tests.service.store.test_store import LABELS, rec


def test_default_is_sqlite_in_the_state_directory(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "xdg"))
    config = StoreConfig.from_settings(Settings())
    assert config is not None and config.url == f"sqlite:///{tmp_path / 'xdg' / 'hydra-serve' / 'store.db'}"
    monkeypatch.delenv("XDG_STATE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    default = StoreConfig.from_settings(Settings())
    assert default is not None and default.url.endswith("/home/.local/state/hydra-serve/store.db")
    monkeypatch.setenv("HYDRA_STATE_DIR", str(tmp_path / "state"))
    config = StoreConfig.from_settings(Settings())
    assert config is not None and config.url == f"sqlite:///{tmp_path / 'state' / 'store.db'}"


def test_settings_reach_the_store(monkeypatch):
    env = {
        "HYDRA_STORE_QUEUE": "77",
        "HYDRA_STORE_FLUSH_ROWS": "5",
        "HYDRA_STORE_FLUSH_MS": "50",
        "HYDRA_STORE_RETENTION_DAYS": "7",
        "HYDRA_STORE_MAX_ROWS": "5000",
        "HYDRA_STORE_PROBS": "false",
        "HYDRA_MAX_TEXT_CHARS": "300",
    }
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    config = StoreConfig.from_settings(Settings())
    assert config is not None
    got = (config.queue, config.flush_rows, config.flush_ms, config.retention_days, config.max_rows, config.probs)
    assert got == (77, 5, 50.0, 7.0, 5000, False) and config.max_label_chars == 300


def test_off(monkeypatch):
    monkeypatch.setenv("HYDRA_STORE", "off")
    assert StoreConfig.from_settings(Settings()) is None and open_store(Settings()) is None


def test_postgresql_urls_and_secrets(monkeypatch, tmp_path):
    monkeypatch.setenv("HYDRA_STORE_URL", "postgres://hydra:s3cret@db.example:5432/hydra")
    settings = Settings()
    assert "s3cret" not in repr(settings)
    config = StoreConfig.from_settings(settings)
    assert config is not None and config.url == "postgresql+psycopg://hydra:s3cret@db.example:5432/hydra"
    for spelling in ("postgresql://u@h/d", "postgresql+psycopg://u@h/d", "POSTGRES://u@h/d"):
        assert resolve_url(spelling, None) == "postgresql+psycopg://u@h/d"
    store = PredictionStore(StoreConfig(url=config.url, connect_timeout_s=0.5))
    try:
        assert store.backend == "postgresql" and "s3cret" not in store.where and "***" in store.where
    finally:
        store.close(timeout=0.1)
    monkeypatch.setenv("HYDRA_STORE_URL", "")
    assert Settings().store_url is None
    assert resolve_url(f"sqlite:///{tmp_path / 'x.db'}", "/ignored") == f"sqlite:///{tmp_path / 'x.db'}"


@pytest.mark.parametrize("url", ["mysql://u@h/d", "redis://h", "store.db"])
def test_a_bad_url_refuses_start_up(monkeypatch, url):
    monkeypatch.setenv("HYDRA_STORE_URL", url)
    with pytest.raises(ValidationError, match="HYDRA_STORE_URL"):
        Settings()


def test_an_unwritable_state_directory_does_not_stop_the_server(tmp_path):
    """A state directory that cannot be created: the store opens, records are queued, feedback is unavailable."""
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    store = PredictionStore(StoreConfig(url=resolve_url(None, blocker / "state")))
    try:
        assert store.record([rec("a", 0)]) == 1
        with pytest.raises(StoreUnavailable):
            store.add_feedback("m", LABELS, [FeedbackItem("a", 0, "cat")])
        stats = store.stats()
        assert not stats.up and "NotADirectoryError" in (stats.last_error or "") and stats.queued == 1
    finally:
        store.close(timeout=0.1)
