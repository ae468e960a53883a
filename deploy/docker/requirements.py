"""Print the pinned requirements of this project from ``pyproject.toml``, one per line, for ``pip install -r``.

The image installs its dependencies from this list before it copies the source, so
that a change to the code does not rebuild the (multi-GB) dependency layer:

    python deploy/docker/requirements.py pyproject.toml onnx > /tmp/requirements.txt

Runtime ``dependencies`` come first, then each named extra; an extra that refers
to this project itself (``hydra-serve[offline,onnx]``) is expanded in place.
Standard library only (``tomllib``, Python 3.11+).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import tomllib

_SELF = re.compile(r"^\s*(?P<name>[A-Za-z0-9_.-]+)\s*\[(?P<extras>[^\]]*)\]\s*$")


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirements(pyproject: str | Path, extras: list[str]) -> list[str]:
    """The runtime requirements plus those of ``extras`` (self-references expanded), without duplicates, in order.

    Raises ``KeyError`` naming the extra when ``extras`` names one that ``pyproject`` does not define.
    """
    project = tomllib.loads(Path(pyproject).read_text())["project"]
    me = _canonical(project["name"])
    optional: dict[str, list[str]] = project.get("optional-dependencies", {})
    out: list[str] = []
    seen_extras: set[str] = set()

    def add(reqs: list[str]) -> None:
        for req in reqs:
            m = _SELF.match(req)
            if m and _canonical(m["name"]) == me:
                expand([e.strip() for e in m["extras"].split(",") if e.strip()])
            elif req not in out:
                out.append(req)

    def expand(names: list[str]) -> None:
        for extra in names:
            if extra in seen_extras:
                continue
            if extra not in optional:
                raise KeyError(f"extra {extra!r} is not defined in {pyproject}; defined: {sorted(optional)}")
            seen_extras.add(extra)
            add(optional[extra])

    add(project.get("dependencies", []))
    expand(extras)
    return out


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    print("\n".join(requirements(argv[0], [e for a in argv[1:] for e in a.split(",") if e])))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
