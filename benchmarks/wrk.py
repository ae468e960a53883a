"""Load from outside the server: ``wrk`` (Debian's package) driving one POST body, and what a server's processes spent.

``wrk`` is a C client: at a few microseconds per request it is not what limits the rate, as a Python client on the
same cores is. :func:`run_wrk` runs it with a Lua script that sends one JSON body (:func:`post_script`) and parses
its report (requests/s, the latency percentiles of ``--latency``, errors and non-2xx answers). :func:`group_cpu_s`
sums the CPU time of every process of a server's process group (its workers included), so that "CPU milliseconds
per request" counts all of a server's work however many processes do it.

    python -m benchmarks.wrk --check     # is wrk installed? (exit 1 with the install command if not)
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

__all__ = ["INSTALL", "WrkResult", "group_cpu_s", "parse_wrk", "post_script", "run_wrk", "wrk_path"]

INSTALL = "apt-get install -y wrk   (Debian's package; `make wrk` does it)"
_UNITS = {"us": 1e-3, "ms": 1.0, "s": 1e3, "m": 60e3}


def wrk_path() -> str:
    """The ``wrk`` binary, or ``SystemExit`` saying how to install it."""
    path = shutil.which("wrk")
    if path is None:
        raise SystemExit(f"wrk is not installed: {INSTALL}")
    return path


def post_script(path: Path, body: bytes, url_path: str = "/predict") -> Path:
    """A wrk Lua script that POSTs ``body`` (JSON) to ``url_path`` on every request."""
    text = body.decode()
    lua = (
        'wrk.method = "POST"\n'
        f"wrk.path = {_lua_string(url_path)}\n"
        'wrk.headers["Content-Type"] = "application/json"\n'
        f"wrk.body = {_lua_string(text)}\n"
    )
    path.write_text(lua)
    return path


def _lua_string(s: str) -> str:
    """A Lua long string holding ``s`` verbatim (the level of ``=`` chosen so that ``s`` cannot close it)."""
    level = 0
    while f"]{'=' * level}]" in s:
        level += 1
    eq = "=" * level
    return f"[{eq}[{s}]{eq}]"


@dataclass
class WrkResult:
    """One wrk run: ``requests`` answered in ``seconds``, their rate, latency percentiles (ms), socket errors and
    non-2xx answers."""

    connections: int
    seconds: float
    requests: int
    rps: float
    p50_ms: float
    p75_ms: float
    p90_ms: float
    p99_ms: float
    socket_errors: dict[str, int]
    non_2xx: int

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _ms(value: str) -> float:
    m = re.fullmatch(r"([\d.]+)(us|ms|s|m)", value.strip())
    if m is None:
        raise ValueError(f"wrk printed a latency it cannot parse: {value!r}")
    return float(m.group(1)) * _UNITS[m.group(2)]


def parse_wrk(text: str, connections: int) -> WrkResult:
    """The numbers of a ``wrk --latency`` report."""
    pct = {p: _ms(v) for p, v in re.findall(r"^\s*(50|75|90|99)%\s+(\S+)\s*$", text, re.M)}
    done = re.search(r"(\d+) requests in ([\d.]+)(us|ms|s|m)", text)
    rps = re.search(r"Requests/sec:\s+([\d.]+)", text)
    if done is None or rps is None or len(pct) < 4:
        raise ValueError(f"not a wrk --latency report:\n{text}")
    errors = {}
    sock = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", text)
    if sock is not None:
        errors = dict(zip(("connect", "read", "write", "timeout"), map(int, sock.groups()), strict=True))
    non2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", text)
    return WrkResult(
        connections=connections,
        seconds=float(done.group(2)) * _UNITS[done.group(3)] / 1e3,
        requests=int(done.group(1)),
        rps=float(rps.group(1)),
        p50_ms=pct["50"],
        p75_ms=pct["75"],
        p90_ms=pct["90"],
        p99_ms=pct["99"],
        socket_errors=errors,
        non_2xx=int(non2xx.group(1)) if non2xx else 0,
    )


def run_wrk(
    url: str, script: Path, connections: int, seconds: float, threads: int = 2, cpus: str | None = None
) -> WrkResult:
    """``wrk`` against ``url`` for ``seconds`` at ``connections`` (``threads`` client threads, at most one per
    connection; ``cpus``: pin it there with ``taskset``, e.g. ``"1"``)."""
    cmd = [wrk_path(), "--latency", "-t", str(max(1, min(threads, connections))), "-c", str(connections)]
    cmd += ["-d", f"{seconds:g}s", "--timeout", "30s", "-s", str(script), url]
    if cpus is not None:
        cmd = ["taskset", "-c", cpus, *cmd]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds + 60, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"wrk failed ({out.returncode}): {out.stderr.strip() or out.stdout.strip()}")
    return parse_wrk(out.stdout, connections)


def group_cpu_s(pgid: int) -> float:
    """CPU seconds (user + system) of every live process of process group ``pgid``, plus what the group leader's
    reaped children spent (a worker that died and was replaced counts)."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # exited meanwhile
            continue
        # after the command: state ppid pgrp session tty tpgid flags minflt cminflt majflt cmajflt utime stime cutime
        if int(fields[2]) != pgid:
            continue
        total += int(fields[11]) + int(fields[12])
        if int(entry.name) == pgid:
            total += int(fields[13]) + int(fields[14])
    return total / tick


def main(argv: list[str] | None = None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if argv[:1] == ["--check"]:
        if shutil.which("wrk") is None:
            print(f"wrk is not installed: {INSTALL}", file=sys.stderr)
            return 1
        print(shutil.which("wrk"))
        return 0
    print(__doc__)
    return 2


if __name__ == "__main__":
    sys.exit(main())
