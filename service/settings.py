"""Server configuration: ``HYDRA_*`` environment variables (docs/api.md lists them), validated at start-up.

Every field maps to one variable, ``HYDRA_<FIELD>`` (case-insensitive). List
fields (``artifacts``, ``cors_origins``) are comma-separated strings.
"""

from __future__ import annotations

import importlib.util
from typing import Annotated, Literal

from pydantic import Field, SecretStr, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from service.store.dialects import BACKENDS

__all__ = ["DRIFT_POLICIES", "STORE_SCHEMES", "Settings", "settings_errors"]

# database URLs the prediction store takes (service/store/database.py): SQLite, and PostgreSQL through psycopg 3
# the URL schemes HYDRA_STORE_URL may name: every store backend's (service.store.dialects.BACKENDS)
STORE_SCHEMES = frozenset(scheme for backend in BACKENDS.values() for scheme in backend.schemes)
# what an answer does while its model's drift alarm is on (docs/api.md "Guarantees"): abstain from accepting, mark the
# guarantees suspended but answer as without the alarm, or nothing
DRIFT_POLICIES = ("abstain", "mark", "off")


def _split_commas(value: object) -> object:
    """``"a, b,,c"`` -> ``["a", "b", "c"]``; lists pass through stripped."""
    if value is None:
        return []
    if isinstance(value, str):
        value = value.split(",")
    if isinstance(value, (list, tuple)):
        return [str(v).strip() for v in value if str(v).strip()]
    return value


def _secret_text(value: SecretStr | None) -> str | None:
    """The text of a secret setting, or None when it is unset or blank (an empty variable means unset)."""
    text = value.get_secret_value() if value is not None else ""
    return text if text.strip() else None


def _installed(module: str) -> bool:
    """Whether ``module`` can be imported (without importing it)."""
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a parent package is missing
        return False


class Settings(BaseSettings):
    """The server's settings; construct with keyword arguments in tests, from the environment in production."""

    model_config = SettingsConfigDict(env_prefix="HYDRA_", extra="forbid", case_sensitive=False)

    # artifact directories to serve, comma-separated (each holds a manifest.json)
    artifacts: Annotated[list[str], NoDecode] = Field(default_factory=list)
    # interface `python -m service` binds; loopback unless told otherwise
    host: str = "127.0.0.1"
    # TCP port `python -m service` listens on
    port: int = Field(8000, ge=1, le=65535)
    # event loop of `python -m service`: auto = uvloop when it imports, else asyncio
    # (service/entrypoints/http_server.py)
    loop: Literal["auto", "asyncio", "uvloop"] = "auto"
    # HTTP/1.1 parser of `python -m service`: auto = httptools when it imports, else h11 (pure Python)
    http: Literal["auto", "h11", "httptools"] = "auto"
    # server processes of `python -m service` on one port (service/entrypoints/workers.py): N, or auto = one per core
    # on CPU (they share one drift alarm per model), on CUDA one per two cores, at most 8
    workers: int | Literal["auto"] = "auto"
    # auto = CUDA when available, else CPU
    device: Literal["auto", "cpu", "cuda"] = "auto"
    # auto = onnx on CPU when exported and fp32, torch eager otherwise (see service/runtime/plan.py)
    backend: Literal["auto", "torch", "torchscript", "onnx", "aoti"] = "auto"
    # auto = bf16 on CUDA, bf16 on CPUs with native bf16 when the build recorded bf16 agrees, else fp32
    precision: Literal["auto", "fp32", "bf16"] = "auto"
    # most inputs run through the model in one forward pass
    max_batch: int = Field(32, ge=1, le=4096)
    # longest wait of a queued input for others to join its batch (a lone client under low load does not wait)
    max_wait_ms: float = Field(20.0, ge=0.0, le=10_000.0)
    # how full a batch waits to be under lower load (service/runtime/batching.py): in_system (the most inputs queued
    # plus running in recent batch cycles) or recent (the largest recent batch)
    batch_fill: Literal["in_system", "recent"] = "in_system"
    # most inputs waiting per model; beyond it requests get 503 overloaded
    max_queue: int = Field(512, ge=1)
    # bearer token required on every endpoint but /healthz, /readyz and /metrics; unset = no auth
    api_key: SecretStr | None = None
    # largest request body accepted (bytes), JSON or multipart
    max_body_bytes: int = Field(16 * 1024 * 1024, ge=1024)
    # largest image accepted (width x height), checked before decoding (decompression bombs)
    max_image_pixels: int = Field(40_000_000, ge=1)
    # most inputs (texts or images) in one request
    max_items: int = Field(64, ge=1)
    # longest text accepted, in characters
    max_text_chars: int = Field(10_000, ge=1)
    # most labels in one zero-shot request
    max_labels: int = Field(256, ge=2)
    # log level of the service and uvicorn loggers
    log_level: Literal["critical", "error", "warning", "info", "debug"] = "info"
    # text: human-readable lines; json: one JSON object per line (python-json-logger) and an access line per request
    log_format: Literal["text", "json"] = "text"
    # one log line per prediction (label, confidence, uncertainty, OOD flag; never the input itself)
    log_predictions: bool = False
    # OpenTelemetry tracing of every request (the `otel` extra); spans go where OTEL_EXPORTER_OTLP_* say
    otel: bool = False
    # origins allowed by CORS, comma-separated; empty = CORS off
    cors_origins: Annotated[list[str], NoDecode] = Field(default_factory=list)
    # torch / ONNX Runtime intra-op threads per model; unset = torch's default (physical cores)
    threads: int | None = Field(None, ge=1, le=1024)
    # load and warm up the models after the port is bound (/healthz answers, /readyz is 503 meanwhile); false = before
    # the server accepts connections. Artifact files are verified before either way (a bad file refuses start-up).
    load_in_background: bool = True
    # consecutive failed batches of one model after which /readyz answers 503 until a probe batch succeeds; 0 = never
    unready_after_failures: int = Field(5, ge=0)
    # seconds between probe batches (the warm-up input) while a model is failing
    probe_interval_s: float = Field(5.0, gt=0.0, le=3600.0)
    # the prediction store (service/store, docs/store.md): what was answered, and the feedback labels; off = none
    store: bool = True
    # the store's database: postgresql://user:password@host/db (several replicas share it) or sqlite:///file;
    # unset = SQLite in HYDRA_STATE_DIR
    store_url: SecretStr | None = None
    # folder of the embedded SQLite store; unset = $XDG_STATE_HOME/hydra-serve, else ~/.local/state/hydra-serve
    state_dir: str | None = None
    # predictions older than this many days are deleted (with their feedback)
    store_retention_days: float = Field(30.0, gt=0.0, le=36_500.0)
    # most predictions kept; the oldest beyond it are deleted (with their feedback)
    store_max_rows: int = Field(1_000_000, ge=1_000)
    # most prediction records waiting to be written; beyond it new ones are dropped (and counted)
    store_queue: int = Field(10_000, ge=1)
    # the writer writes once this many records wait, or HYDRA_STORE_FLUSH_MS after the oldest arrived
    store_flush_rows: int = Field(256, ge=1)
    # longest wait of a prediction record before the writer writes it, milliseconds
    store_flush_ms: float = Field(200.0, ge=1.0, le=60_000.0)
    # also store each prediction's probabilities (4 bytes per label), for statistics that need them
    store_probs: bool = True
    # while the model's drift alarm is on: abstain = no answer is accepted by the certified risk rule (only the online
    # rule of adaptive requests, from labels that came back since); mark = answers as without the alarm, their
    # guarantees marked suspended; off = the alarm changes no answer
    drift_policy: Literal["abstain", "mark", "off"] = "abstain"
    # a URL that gets a POST when the drift alarm goes on, with the answers it recalls (service/webhook.py)
    alarm_webhook: SecretStr | None = None
    # a header sent with it, "Name: value" (e.g. "Authorization: Bearer <token>")
    alarm_webhook_header: SecretStr | None = None

    @field_validator("artifacts", "cors_origins", mode="before")
    @classmethod
    def _comma_list(cls, value: object) -> object:
        return _split_commas(value)

    @field_validator("workers", mode="before")
    @classmethod
    def _workers(cls, value: object) -> object:
        v = value.strip().lower() if isinstance(value, str) else value
        if v == "auto":
            return v
        try:
            n = int(v)  # type: ignore[call-overload]
        except (TypeError, ValueError):
            n = 0
        if isinstance(v, bool) or n < 1 or n > 64 or str(n) != str(v).strip():
            raise ValueError(f"HYDRA_WORKERS must be auto or an integer from 1 to 64; got {value!r}")
        return n

    @field_validator("drift_policy", mode="before")
    @classmethod
    def _drift_policy(cls, value: object) -> object:
        v = value.strip().lower() if isinstance(value, str) else value
        if v not in DRIFT_POLICIES:
            raise ValueError(f"HYDRA_DRIFT_POLICY must be one of {', '.join(DRIFT_POLICIES)}; got {value!r}")
        return v

    @field_validator("alarm_webhook", mode="after")
    @classmethod
    def _webhook_url(cls, value: SecretStr | None) -> SecretStr | None:
        from service.webhook import check_url

        text = _secret_text(value)
        return None if text is None else SecretStr(check_url(text))

    @field_validator("alarm_webhook_header", mode="after")
    @classmethod
    def _webhook_header(cls, value: SecretStr | None) -> SecretStr | None:
        from service.webhook import check_header

        text = _secret_text(value)
        if text is None:
            return None
        check_header(text)
        return value

    @field_validator("log_level", "log_format", mode="before")
    @classmethod
    def _lower(cls, value: object) -> object:
        return value.lower() if isinstance(value, str) else value

    @field_validator("api_key", mode="after")
    @classmethod
    def _non_empty_key(cls, value: SecretStr | None) -> SecretStr | None:
        if value is not None and not value.get_secret_value().strip():
            return None  # HYDRA_API_KEY="" means auth off, as if unset
        return value

    @field_validator("otel", mode="after")
    @classmethod
    def _otel_installed(cls, value: bool) -> bool:
        if value and not _installed("opentelemetry.instrumentation.fastapi"):
            raise ValueError("HYDRA_OTEL=true needs OpenTelemetry: pip install 'hydra-serve[otel]'")
        return value

    @field_validator("loop", "http", mode="after")
    @classmethod
    def _server_module_installed(cls, value: str) -> str:
        if value in ("uvloop", "httptools") and not _installed(value):
            raise ValueError(f"{value} is not installed: pip install {value}, or choose auto")
        return value

    @field_validator("store_url", mode="after")
    @classmethod
    def _store_url_scheme(cls, value: SecretStr | None) -> SecretStr | None:
        text = _secret_text(value)  # HYDRA_STORE_URL="" means the default SQLite store, as if unset
        if text is None:
            return None
        scheme = text.strip().partition("://")[0].lower()
        if scheme not in STORE_SCHEMES:
            raise ValueError(
                f"HYDRA_STORE_URL: scheme {scheme!r} is not supported; use one of {sorted(STORE_SCHEMES)} "
                "(postgresql://user:password@host:5432/db or sqlite:////absolute/path.db)"
            )
        return value

    @model_validator(mode="after")
    def _queue_fits_a_request(self) -> Settings:
        if self.max_queue < self.max_items:
            raise ValueError(
                f"max_queue ({self.max_queue}) is below max_items ({self.max_items}): "
                "a full-size request could never be queued; raise HYDRA_MAX_QUEUE"
            )
        return self


def settings_errors(error: ValidationError) -> list[str]:
    """One line per bad setting, naming its variable: ``HYDRA_MAX_BATCH: Input should be greater than or equal to
    1 (got '0')``."""
    out = []
    for e in error.errors():
        field = str(e["loc"][0]).upper() if e["loc"] else ""
        msg = str(e["msg"]).removeprefix("Value error, ")
        if msg.startswith("HYDRA_"):
            out.append(msg)
            continue
        name = f"HYDRA_{field}" if field else "HYDRA_* settings"
        given = f" (got {e['input']!r})" if field and "input" in e else ""
        out.append(f"{name}: {msg}{given}")
    return out
