"""The structure rules a newcomer can rely on, checked: short files, short functions and short signatures in
``service/``, ``offline/`` and ``benchmarks/``, and formatted code.

(Import rules, three layers (``offline`` and the server over ``service.core``) and no cycles, are import-linter
contracts in ``pyproject.toml``, run by ``make test`` as ``lint-imports``.)
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("service", "offline", "benchmarks")
MAX_FILE_LINES = 600
MAX_FUNCTION_LINES = 60
MAX_PARAMETERS = 8  # self / cls not counted
# model forward passes stay whole: each is one read from input to output, with a shape comment per step
EXEMPT = frozenset({"forward", "_forward"})
# signatures over the limit, each with its reason
WIDE = {
    "circuit_ranking": "Algorithm 1's inputs as the paper names them (ID and OOD batches, labels, score, budget, "
    "per-layer cap); the benchmarks call it positionally",
    "finetune_member": "a member's run: the model and its data (adapter, member, data, preprocessing, tokenizer, "
    "recipe) and the run's bookkeeping (resume, progress label, teacher); no two of them travel together elsewhere",
}


def _sources(packages: tuple[str, ...] = PACKAGES) -> list[Path]:
    return [p for pkg in packages for p in sorted((ROOT / pkg).rglob("*.py"))]


def _functions(path: Path) -> list[ast.FunctionDef | ast.AsyncFunctionDef]:
    tree = ast.parse(path.read_text(), filename=str(path))
    return [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]


def long_functions(packages: tuple[str, ...] = PACKAGES, limit: int = MAX_FUNCTION_LINES) -> list[str]:
    """``path:line name (n lines)`` of every function longer than ``limit`` lines (decorators excluded)."""
    out = []
    for path in _sources(packages):
        for node in _functions(path):
            n = node.end_lineno - node.lineno + 1
            if n > limit and node.name not in EXEMPT:
                out.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({n} lines)")
    return out


def long_signatures(packages: tuple[str, ...] = PACKAGES, limit: int = MAX_PARAMETERS) -> list[str]:
    """``path:line name (n parameters)`` of every function taking more than ``limit`` parameters."""
    out = []
    for path in _sources(packages):
        for node in _functions(path):
            a = node.args
            params = [*a.posonlyargs, *a.args, *a.kwonlyargs] + [x for x in (a.vararg, a.kwarg) if x is not None]
            n = len(params) - (1 if params and params[0].arg in ("self", "cls") else 0)
            if n > limit and node.name not in WIDE:
                out.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({n} parameters)")
    return out


def long_files(packages: tuple[str, ...] = PACKAGES, limit: int = MAX_FILE_LINES) -> list[str]:
    """``path (n lines)`` of every file longer than ``limit`` lines."""
    counts = {p: p.read_text().count("\n") for p in _sources(packages)}
    return [f"{p.relative_to(ROOT)} ({n} lines)" for p, n in counts.items() if n > limit]


def test_no_function_is_longer_than_60_lines():
    assert long_functions() == []


def test_no_signature_takes_more_than_8_parameters():
    assert long_signatures() == []


def test_no_file_is_longer_than_600_lines():
    assert long_files() == []


def test_the_code_is_formatted_and_nothing_opts_out():
    """``ruff format --check`` passes on every package and the tests, and no line opts out of the formatter."""
    ruff = Path(sys.executable).with_name("ruff")
    if not ruff.is_file():
        pytest.skip("ruff is not installed next to this interpreter")
    dirs = [*PACKAGES, "tests", "deploy"]
    checked = subprocess.run([str(ruff), "format", "--check", *dirs], cwd=ROOT, capture_output=True, text=True)
    assert checked.returncode == 0, checked.stdout[-2000:]
    marker = "fmt: " + "skip"
    skipped = [str(p.relative_to(ROOT)) for p in _sources((*PACKAGES, "tests", "deploy")) if marker in p.read_text()]
    assert skipped == []


def test_nothing_cites_a_spec_outside_the_repository():
    """User docs live in docs/ (artifact.md, api.md); no file points at a spec the repository does not hold."""
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split("\n")
    paths = [ROOT / p for p in listed if p and (ROOT / p).is_file() and not p.endswith(".png")]
    cited = [str(p.relative_to(ROOT)) for p in paths if "CONTRACT" + ".md" in p.read_text(errors="ignore")]
    assert cited == []
    assert (ROOT / "docs" / "artifact.md").is_file() and (ROOT / "docs" / "api.md").is_file()


def server_modules() -> set[str]:
    """Every module and package directly under ``service/`` but the core: the server."""
    found = {p.stem for p in (ROOT / "service").glob("*.py") if p.stem != "__init__"}
    found |= {p.parent.name for p in (ROOT / "service").glob("*/__init__.py")}
    return {f"service.{m}" for m in found - {"core"}}


def test_the_layer_contracts_list_every_server_module():
    """import-linter cannot say "all of service but the core": the contracts list the server's modules by name, and
    this keeps the lists whole, so a new server module is forbidden to the core and the builder from its first day."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    by_source = {tuple(c["source_modules"]): set(c["forbidden_modules"]) for c in contracts if c["type"] == "forbidden"}
    for source in (("service.core",), ("offline",)):
        listed = {m for m in by_source[source] if m.startswith("service.")}
        assert listed == server_modules(), source


def test_the_installed_commands_name_the_documented_entry_points():
    """``hydra-build``, ``hydra-serve`` and ``hydra-predict`` (``[project.scripts]``) run what
    ``python offline/build.py``, ``python -m service`` and ``python -m service.batch`` run."""
    import importlib

    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts == {
        "hydra-build": "offline.build:main",
        "hydra-serve": "service.entrypoints.cli:main",
        "hydra-predict": "service.batch.command:main",
    }
    for target in scripts.values():
        module, _, name = target.partition(":")
        assert callable(getattr(importlib.import_module(module), name))


def shared_module_names(packages: tuple[str, ...] = PACKAGES) -> dict[str, list[str]]:
    """Module file names that stand in more than one place of ``packages`` (package dunders aside: ``__init__``,
    ``__main__``), each with its paths."""
    by_name: dict[str, list[str]] = {}
    for path in _sources(packages):
        if not path.name.startswith("__"):
            by_name.setdefault(path.name, []).append(str(path.relative_to(ROOT)))
    return {name: paths for name, paths in by_name.items() if len(paths) > 1}


def test_no_two_modules_share_a_name():
    """A module's name says which one it is: no two files of the server, the builder and the benchmarks share one
    (``guarantees.py`` was four files once: the mathematics, a build step, a report section and the core)."""
    assert shared_module_names() == {}
