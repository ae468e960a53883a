"""What the server benchmarks share: a ``python -m service`` process on loopback, an HTTP client, request bodies.

Used by ``benchmarks/bench_server.py``, ``benchmarks/load_test.py``, ``benchmarks/sigterm_test.py`` and the tests
that run a real server (``tests/reliability``). Only 127.0.0.1 is ever used: nothing leaves the machine.

* the server process: :func:`free_port`, :func:`server_env`, :func:`start_server`, :func:`wait_ready`,
  :func:`stop_server`, :func:`serving` (all four around a block), :func:`rss_mb`;
* the client: :class:`Connection` (keep-alive HTTP/1.1 on asyncio streams), :func:`request` (one request on a
  fresh connection), :func:`error_code` (the error code of an answer, docs/api.md);
* the bodies: :func:`payload` (one ``/predict`` body of an artifact's modality);
* the scripts' common frame: :func:`add_artifact_arguments` and :func:`open_artifact` (``--artifact DIR`` or
  ``--tiny FAMILY``, a tiny random artifact built by the test fixtures), :func:`open_run` (a work folder, the
  artifact and one request body), :func:`result_head` (a result's command and artifact), :func:`machine`,
  :func:`write_result`, :func:`print_checks`.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import os
import platform
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks import result_json
from service.core.hardware import cpu_name  # the CPU named in every result

ROOT = Path(__file__).resolve().parents[1]
HOST = "127.0.0.1"  # loopback only, always

TEXT = "The new phone arrived two days late, but the screen is gorgeous and the battery easily lasts a whole day."

__all__ = [
    "HOST",
    "ROOT",
    "TEXT",
    "Connection",
    "add_artifact_arguments",
    "cpu_name",
    "error_code",
    "free_port",
    "machine",
    "open_artifact",
    "payload",
    "print_checks",
    "request",
    "open_run",
    "result_head",
    "rss_mb",
    "group_rss_mb",
    "server_env",
    "serving",
    "start_server",
    "stop_server",
    "tiny_artifact",
    "wait_ready",
    "write_result",
]


# ----------------------------------------------------------------------------- the server process
def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the OS picks it)."""
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def server_env(artifact: Path, port: int, extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a loopback server: offline Hugging Face, the artifact, host and port, one worker (``extra``
    may ask for more: ``HYDRA_WORKERS``). ``HYDRA_*`` variables of the caller's environment are left out: the server
    runs with exactly the settings given."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HYDRA_")}
    env.update(
        {
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "HYDRA_ARTIFACTS": str(artifact),
            "HYDRA_HOST": HOST,
            "HYDRA_PORT": str(port),
            "HYDRA_LOG_LEVEL": "info",
            "HYDRA_WORKERS": "1",
        }
    )
    env.update(extra or {})
    return env


def start_server(
    artifact: Path,
    port: int,
    extra_env: dict[str, str] | None = None,
    *,
    log_file: Path | None = None,
    module: str = "service",
    inherit_output: bool = False,
    new_session: bool = False,
) -> subprocess.Popen:
    """``python -m <module>`` on 127.0.0.1:``port`` (:func:`server_env` plus ``extra_env``).

    Its stdout and stderr go to ``log_file``; without one, to this process's own (``inherit_output``) or nowhere.
    ``new_session``: the server leads a process group of its own (its workers can be signalled as one).
    """
    cmd, env = [sys.executable, "-m", module], server_env(artifact, port, extra_env)
    if log_file is not None:
        with open(log_file, "wb") as log:  # the child holds its own descriptor
            return subprocess.Popen(
                cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=new_session
            )
    out = None if inherit_output else subprocess.DEVNULL
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=out, start_new_session=new_session)


def wait_ready(port: int, proc: subprocess.Popen, timeout: float = 180.0) -> float:
    """Poll ``/readyz`` until 200; seconds it took. Raises ``RuntimeError`` if the server exits or times out."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with status {proc.returncode} before it was ready")
        try:
            status, _, _ = asyncio.run(request(port, "GET", "/readyz", timeout=2.0))
            if status == 200:
                return time.monotonic() - t0
        except (OSError, asyncio.TimeoutError, ValueError):  # noqa: UP041 (3.10: not the builtin)
            pass
        time.sleep(0.2)
    raise RuntimeError(f"the server was not ready after {timeout} s")


def stop_server(proc: subprocess.Popen, timeout: float = 60.0) -> int:
    """SIGTERM, wait; kill if it does not stop. The exit status (negative: killed by that signal)."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    return proc.returncode


@contextmanager
def serving(artifacts: list[Path], prefix: str) -> Iterator[int]:
    """A quiet server of ``artifacts`` (the first is ``HYDRA_ARTIFACTS``' default) on a free port, ready: the port.

    Its log goes to a temporary folder named ``prefix...``; the server is stopped and the folder removed after the
    block."""
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        port = free_port()
        env = {"HYDRA_ARTIFACTS": ",".join(str(a) for a in artifacts), "HYDRA_LOG_LEVEL": "warning"}
        proc = start_server(artifacts[0], port, env, log_file=Path(tmp) / "server.log")
        try:
            wait_ready(port, proc)
            yield port
        finally:
            stop_server(proc)


def rss_mb(pid: int) -> dict[str, float]:
    """Resident memory of a process from ``/proc/<pid>/status``: ``rss`` (VmRSS) and ``peak`` (VmHWM), MiB."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out["rss" if key == "VmRSS" else "peak"] = round(int(value.split()[0]) / 1024, 1)
    return out


def group_rss_mb(pgid: int) -> dict[str, dict[str, float]]:
    """:func:`rss_mb` of every live process of process group ``pgid`` (a server and its workers), by pid."""
    out = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[2]) == pgid:
                out[entry.name] = rss_mb(int(entry.name))
        except (OSError, ValueError):  # exited meanwhile
            continue
    return out


# ----------------------------------------------------------------------------- a minimal HTTP/1.1 client
class Connection:
    """Keep-alive HTTP/1.1 on asyncio streams: microseconds of CPU per request (httpx takes ~1 ms), so that the
    clients, on the same cores as the server, take little from it. Reconnects after an error."""

    def __init__(self, port: int, host: str = HOST) -> None:
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def request(
        self, method: str, path: str, body: bytes = b"", headers: dict[str, str] | None = None, close: bool = False
    ) -> tuple[int, dict[str, str], bytes]:
        """(status, lower-cased headers, body). Raises ``OSError`` / ``ValueError`` (``IncompleteReadError``)."""
        try:
            if self.writer is None:
                self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
            assert self.reader is not None
            head = f"{method} {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\nContent-Length: {len(body)}\r\n"
            if body and not any(k.lower() == "content-type" for k in headers or {}):
                head += "Content-Type: application/json\r\n"
            for k, v in (headers or {}).items():
                head += f"{k}: {v}\r\n"
            if close:
                head += "Connection: close\r\n"
            self.writer.write((head + "\r\n").encode() + body)
            await self.writer.drain()
            status_line = await self.reader.readline()
            if not status_line:
                raise ConnectionResetError("connection closed before any response byte")
            status = int(status_line.split()[1])
            hdrs: dict[str, str] = {}
            while (line := await self.reader.readline()) not in (b"\r\n", b""):
                name, _, value = line.decode("latin-1").partition(":")
                hdrs[name.strip().lower()] = value.strip()
            data = await self.reader.readexactly(int(hdrs.get("content-length", "0")))
        except BaseException:
            await self.close()
            raise
        if close or hdrs.get("connection", "").lower() == "close":
            await self.close()
        return status, hdrs, data

    async def post_counted(
        self, path: str, body: bytes, timeout: float, tally: Any
    ) -> tuple[int, dict[str, str], bytes] | None:
        """A POST answered within ``timeout`` seconds, else None: after a timeout (the connection closed; counted in
        ``tally.timeouts``) or a connection error (``tally.connection_errors``, then a short pause), the load
        clients' loop goes on to its next request."""
        try:
            return await asyncio.wait_for(self.request("POST", path, body), timeout)
        except asyncio.TimeoutError:  # noqa: UP041 (3.10: not the builtin)
            tally.timeouts += 1
            await self.close()
        except (OSError, ValueError, asyncio.IncompleteReadError):
            tally.connection_errors += 1
            await asyncio.sleep(0.05)
        return None

    async def close(self) -> None:
        """Close the connection (the next request opens a new one)."""
        writer, self.writer, self.reader = self.writer, None, None
        if writer is not None:
            writer.close()
            try:
                await writer.wait_closed()
            except OSError:
                pass


async def request(
    port: int,
    method: str,
    path: str,
    body: bytes = b"",
    *,
    timeout: float = 10.0,
    headers: dict[str, str] | None = None,
) -> tuple[int, dict[str, str], bytes]:
    """One request on a fresh connection (closed after)."""
    conn = Connection(port)
    try:
        return await asyncio.wait_for(conn.request(method, path, body, headers, close=True), timeout)
    finally:
        await conn.close()


async def burst(port: int, body: bytes, n: int = 200) -> None:
    """A warm-up burst of ``n`` ``POST /predict`` from 8 clients before the clock starts: the first requests compile
    and fill caches."""
    conns = [Connection(port) for _ in range(8)]
    left = [n]

    async def go(c: Connection) -> None:
        while left[0] > 0:
            left[0] -= 1
            await c.request("POST", "/predict", body)
        await c.close()

    await asyncio.gather(*(go(c) for c in conns))


def error_code(status: int, body: bytes) -> str:
    """The error code of an answer (docs/api.md; ``ok`` for 2xx; ``http_<status>`` when the body is not an error
    body of the API)."""
    if 200 <= status < 300:
        return "ok"
    try:
        return str(json.loads(body)["error"]["code"])
    except (ValueError, KeyError, TypeError):
        return f"http_{status}"


# ----------------------------------------------------------------------------- what to send
def payload(manifest: dict[str, Any], seed: int = 0) -> dict[str, Any]:
    """One ``/predict`` body of the artifact's modality: a noise image of the model's size (a JPEG from 64 pixels a
    side on, as a camera sends; a PNG below), or a sentence."""
    prep = manifest["preprocessing"]
    if prep["type"] == "text":
        return {"text": TEXT}
    from PIL import Image  # only image artifacts need Pillow

    h, w = prep["size"]
    shape = (h, w) if int(prep.get("channels", 3)) == 1 else (h, w, 3)
    buf = io.BytesIO()
    pixels = np.random.default_rng(seed).integers(0, 256, shape, dtype=np.uint8)
    Image.fromarray(pixels).save(buf, format="JPEG" if min(h, w) >= 64 else "PNG")
    return {"image": base64.b64encode(buf.getvalue()).decode()}


def tiny_artifact(out: Path, family: str, full: bool = False) -> Path:
    """A tiny random ``family`` (``vit`` / ``bert``) artifact named ``tiny-<family>`` in ``out/<family>``, to check
    a script without a built model. ``full``: with what a default artifact serves besides the model (OOD statistics
    serving ``mahalanobis_layers`` for images, ``mahalanobis`` for text, and the guarantees), so that a server's
    per-request work is the default's."""
    # torch and the builder's export code are loaded only when a tiny artifact is asked for: the load scripts'
    # clients otherwise stay light
    from tests.fixtures.tiny_artifact import make_tiny_artifact

    if family == "vit_b16":
        return vit_b16_artifact(Path(out) / family)
    if not full:
        return make_tiny_artifact(Path(out) / family, family, name=f"tiny-{family}")
    score = "mahalanobis_layers" if family == "vit" else "mahalanobis"
    return make_tiny_artifact(
        Path(out) / family,
        family,
        name=f"tiny-{family}",
        ood=True,
        ood_score=score,
        ood_threshold=None,
        guarantees={"risks": [0.05, 0.5], "risk": 0.5},
    )


def vit_b16_artifact(out: Path) -> Path:
    """A ViT-B/16-sized artifact with random weights (224 x 224 RGB, 12 blocks of width 768, 3 members keeping 8 of 12
    heads, 10 classes), served with what a default artifact serves (``mahalanobis_layers`` and the guarantees): the
    model a server benchmark on a GPU needs to be the bottleneck. Eager only (no exports): it runs on CUDA."""
    from service.core.manifest import ImagePreprocessing
    from tests.fixtures.tiny_artifact import make_tiny_artifact

    cfg = {
        "arch": "vit",
        "members": 3,
        "img_size": [224, 224],
        "patch_size": 16,
        "in_chans": 3,
        "dim": 768,
        "head_dim": 64,
        "num_heads": [8] * 12,
        "mlp_hidden": 3072,
        "num_classes": 10,
        "act": "gelu",
        "eps": 1e-6,
    }
    prep = ImagePreprocessing(
        size=(224, 224), mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225], interpolation="bicubic", channels=3
    )
    return make_tiny_artifact(
        out,
        "vit",
        name="vit-b16-random",
        config=cfg,
        labels=[f"class_{i}" for i in range(10)],
        preprocessing=prep,
        exports=(),
        ood=True,
        ood_score="mahalanobis_layers",
        ood_threshold=None,
        guarantees={"risks": [0.05, 0.5], "risk": 0.5},
    )


# ----------------------------------------------------------------------------- the scripts' common frame
def add_artifact_arguments(p: argparse.ArgumentParser) -> None:
    """``--artifact DIR`` or ``--tiny {vit,bert}``, one of them required: what the script serves."""
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--artifact", type=Path, help="artifact directory to serve")
    src.add_argument(
        "--tiny",
        choices=["vit", "bert", "vit_b16"],
        help="build a tiny random artifact of this family instead (vit_b16: ViT-B/16-sized, random weights)",
    )


def page_head(title: str, doc: dict[str, Any], machine: str) -> list[str]:
    """A result page's first lines: its title, the command that wrote it (``doc["command"]``) and its machine."""
    return [f"# {title}", "", f"`{doc['command']}`", "", f"Machine: {machine}"]


def load_parser(
    doc: str | None, result: str, clients: int = 32, most: int = 64, clients_flag: str = "--clients"
) -> argparse.ArgumentParser:
    """The flags every load script has: what it serves (:func:`add_artifact_arguments`), its concurrent clients
    (``clients_flag``, 1 to ``most``: the script checks the range), the timeout after which a request is hung,
    and its JSON output (default ``benchmarks/results/<result>``)."""
    p = argparse.ArgumentParser(description=(doc or "").splitlines()[0])
    add_artifact_arguments(p)
    p.add_argument(clients_flag, type=int, default=clients, help=f"concurrent keep-alive clients (1..{most})")
    p.add_argument("--timeout", type=float, default=30.0, help="a request without an answer after this is hung")
    p.add_argument("--out", type=Path, default=None, help=f"JSON output (default benchmarks/results/{result})")
    return p


def add_bands(p: argparse.ArgumentParser, bands: dict[str, tuple[float, str]]) -> None:
    """Pass/fail bands, each a float flag ``--<name>``: ``{name: (default, what it bounds)}``."""
    for name, (default, what) in bands.items():
        p.add_argument(f"--{name}", type=float, default=default, help=f"most {what} (fraction)")


def open_artifact(args: argparse.Namespace, tmp: Path, full: bool = False) -> tuple[Path, dict[str, Any]]:
    """The artifact to serve and its manifest: ``args.artifact``, or a tiny one built under ``tmp`` for
    ``args.tiny`` (``full``: :func:`tiny_artifact`'s). Hugging Face stays offline (the default) in this process and
    in the server."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    artifact = tiny_artifact(tmp, args.tiny, full) if args.tiny else args.artifact.resolve()
    return artifact, json.loads((artifact / "manifest.json").read_text())


def open_run(
    args: argparse.Namespace, prefix: str
) -> tuple[tempfile.TemporaryDirectory[str], Path, dict[str, Any], bytes]:
    """A load script's start: a work folder named ``prefix...``, the artifact and its manifest
    (:func:`open_artifact`) and the ``/predict`` body sent (:func:`payload`, JSON-encoded)."""
    tmp = tempfile.TemporaryDirectory(prefix=prefix)
    artifact, manifest = open_artifact(args, Path(tmp.name))
    return tmp, artifact, manifest, json.dumps(payload(manifest)).encode()


def result_head(
    script: str, argv: list[str] | None, name: str, args: argparse.Namespace, shown: Path
) -> dict[str, str]:
    """A load script's result begins with these: the command that ran ``benchmarks.<script>`` (``argv``, else this
    process's arguments), the artifact's ``name``, and what was served (the tiny family, else ``shown``)."""
    return {
        "command": f"python -m benchmarks.{script} " + shlex.join(argv if argv is not None else sys.argv[1:]),
        "name": name,
        "artifact": f"tiny {args.tiny} (random weights)" if args.tiny else relative_to_root(shown),
    }


def relative_to_root(path: Path) -> str:
    """``path`` from the repository's root when it lies inside it (results name no folder outside the repository)."""
    full = Path(path).resolve()
    return str(full.relative_to(ROOT)) if full.is_relative_to(ROOT) else str(path)


def machine() -> dict[str, Any]:
    """Where the numbers were taken: the CPU's name, CPU count, platform, Python version."""
    return {
        "cpu": cpu_name(),
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
    }


def write_result(result: dict[str, Any], out: Path | None, default_name: str) -> Path:
    """Write ``result`` as JSON (one row a line, :mod:`benchmarks.result_json`) to ``out``, else to
    ``benchmarks/results/<default_name>``; the path written."""
    path = out or ROOT / "benchmarks" / "results" / default_name
    path.parent.mkdir(parents=True, exist_ok=True)
    result_json.write(path, result)
    return path


def save_run(result: dict[str, Any], out: Path | None, default_name: str) -> Path:
    """A load script's result, stamped with the machine and the time it was written, into ``out`` (default
    ``benchmarks/results/<default_name>``, :func:`write_result`)."""
    stamped = {**result, "machine": machine(), "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    return write_result(stamped, out, default_name)


def close_run(tmp: tempfile.TemporaryDirectory[str], checks: dict[str, bool], wrote: object, passed: bool) -> int:
    """A load script's end: its checks and what it wrote printed, its work folder removed; the exit status."""
    print_checks(checks)
    print(f"wrote {wrote}")
    tmp.cleanup()
    return 0 if passed else 1


def print_checks(checks: dict[str, bool]) -> None:
    """One ``PASS`` / ``FAIL`` line per check."""
    for k, v in checks.items():
        print(f"  {'PASS' if v else 'FAIL'} {k}")
