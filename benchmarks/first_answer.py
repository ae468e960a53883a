"""How long a new user waits: ``git clone`` of this repository, then ``make serve``, until the first answer and until
every default model is ready.

    python -m benchmarks.first_answer                  # clones HEAD into a temporary folder (about 12 min, 2 cores)
    python -m benchmarks.first_answer --clone DIR      # into DIR (kept)

It clones the committed ``HEAD`` (with nothing that is not committed: no virtualenv, no artifacts, no data cache),
runs ``make serve`` there on a free port, and polls the server once a second: the time of the first ``200`` answer
to the ``try:`` command the server prints (a real request for the first model built), the time each model appears
in ``/v1/models``, and the time all three are served; then it stops the server with SIGINT. Packages come from the
machine's pip cache when it has them, as on a user's second project. The result names the CPU and the phases (what
the log says: install and data, each build). Nothing else should run meanwhile.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from benchmarks import harness

ROOT = Path(__file__).resolve().parents[1]
MODELS = 3


def _get(url: str) -> tuple[int, Any]:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, None
    except (OSError, ValueError):
        return 0, None


def _try(command: str, cwd: Path) -> int:
    """Run the server's ``try:`` command; the HTTP status it got (``curl -w``)."""
    argv = shlex.split(command)
    out = subprocess.run([*argv, "-o", "/dev/null", "-w", "%{http_code}"], cwd=cwd, capture_output=True, text=True)
    return int(out.stdout.strip() or 0)


def measure(
    clone: Path, port: int, limit_s: float, t0: float, command: list[str] | None = None, models: int = MODELS
) -> dict[str, Any]:
    """``command`` (``make serve``) in ``clone`` until ``models`` models are served; every time in seconds from
    ``t0`` (the clone's start)."""
    env = {**os.environ, "HYDRA_PORT": str(port)}
    env.pop("VIRTUAL_ENV", None)
    log_path = clone / "make-serve.log"
    with log_path.open("w") as log:
        proc = subprocess.Popen(
            command or ["make", "serve"],
            cwd=clone,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    first: dict[str, Any] | None = None
    seen: dict[str, float] = {}
    try:
        # until every model is served and the printed command answered (its line may follow the readiness)
        while time.monotonic() - t0 < limit_s and proc.poll() is None and (len(seen) < models or first is None):
            time.sleep(1.0)
            now = time.monotonic() - t0
            status, doc = _get(f"http://127.0.0.1:{port}/v1/models")
            if status != 200 or doc is None:
                continue
            for m in doc["models"]:
                seen.setdefault(m["name"], round(now, 1))
            if first is None:
                tries = re.findall(r"try: (curl .*)$", log_path.read_text(), flags=re.M)
                if tries and _try(tries[0], clone) == 200:
                    first = {"seconds": round(time.monotonic() - t0, 1), "command": tries[0]}
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C: make, the builder and the server all get it
            try:
                proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                proc.kill()
    log = log_path.read_text()
    builds = {m: float(s) for m, s in re.findall(r"\[default\] built \S+/(\w+) in (\d+) s", log)}
    return {
        "first_answer": first,
        "models_ready_s": seen,
        "all_ready_s": max(seen.values()) if len(seen) == models else None,
        "builds_s": builds,
        "exit_status": proc.returncode,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clone", type=Path, default=None, help="clone into this folder (kept); default: a temporary one")
    ap.add_argument("--limit", type=float, default=1800.0, help="give up after this many seconds")
    ap.add_argument("--out", type=Path, default=None, help="JSON result (default benchmarks/results/first_answer.json)")
    ap.add_argument("--command", default="make serve", help="what serves in the clone (a test's: a tiny server)")
    ap.add_argument("--models", type=int, default=MODELS, help="the models served when everything is ready")
    args = ap.parse_args(argv)
    tmp = tempfile.TemporaryDirectory(prefix="hydra-first-answer-") if args.clone is None else None
    clone = args.clone or Path(tmp.name) / "hydra-serve"  # type: ignore[union-attr]
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    t0 = time.monotonic()
    subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)
    cloned = time.monotonic() - t0
    result = {
        # the clone's folder is left out: it lies outside the repository
        "command": "python -m benchmarks.first_answer"
        + (" --clone DIR" if args.clone else "")
        + ("" if args.command == "make serve" else f" --command {shlex.quote(args.command)} --models {args.models}"),
        "commit": head,
        "clone_s": round(cloned, 1),
        **measure(clone, harness.free_port(), args.limit, t0, shlex.split(args.command), args.models),
    }
    path = harness.save_run(result, args.out, "first_answer.json")
    print(json.dumps({k: v for k, v in result.items() if k != "command"}, indent=1))
    print(f"wrote {path}")
    if tmp is not None:
        tmp.cleanup()
    return 0 if result["first_answer"] and result["all_ready_s"] else 1


if __name__ == "__main__":
    sys.exit(main())
