"""The artifact contract, owned here: an artifact directory, its ``manifest.json`` written once and read back typed.

The format is documented for users in ``docs/artifact.md``; its typed model is :mod:`service.core.manifest`
(:class:`Manifest` and a model per block, re-exported here). A builder constructs the :class:`Manifest` from its
blocks; :func:`write_manifest` is the one writer: it adds the ``files`` table (sha256 and size of every file),
validates and writes the document. :func:`load_manifest` is the one reader: it validates a manifest read from
disk through the same models, so a field the writer could not produce is refused at load time, naming the field,
and returns the typed :class:`Manifest`. :func:`verify_files` then checks every listed file against its hash, and
:func:`artifact_version` names the model version the API shows.

Like its model, it imports only the standard library and pydantic (see :mod:`service.core.manifest`).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from service.core import manifest as _manifest
from service.core.manifest import *  # noqa: F403  (the typed model, re-exported whole: its __all__)
from service.core.manifest import VERSION_PATTERN, Manifest

__all__ = [
    *_manifest.__all__,
    "MANIFEST",
    "ArtifactError",
    "artifact_version",
    "file_sha256",
    "list_files",
    "load_manifest",
    "parse_manifest",
    "verify_files",
    "write_manifest",
]

MANIFEST = "manifest.json"


class ArtifactError(RuntimeError):
    """An artifact that cannot be used: missing or corrupt file, bad manifest. The message names the file."""


# ----------------------------------------------------------------------------- writing
def list_files(root: Path) -> list[Path]:
    """Every regular file under ``root`` except the manifest and hidden files, sorted."""
    return sorted(
        p
        for p in root.rglob("*")
        if p.is_file() and p.name != MANIFEST and not any(part.startswith(".") for part in p.relative_to(root).parts)
    )


def write_manifest(out: str | Path, manifest: Manifest) -> Path:
    """Add ``files`` (sha256 and size of every file in ``out``) to ``manifest``, validate and write it as
    ``out/manifest.json`` (whole or not at all: a stopped build never leaves half a manifest); raises
    :class:`ArtifactError` naming the first bad field."""
    out = Path(out)
    doc = manifest.to_dict()
    doc["files"] = {
        p.relative_to(out).as_posix(): {"sha256": file_sha256(p), "size": p.stat().st_size} for p in list_files(out)
    }
    doc = parse_manifest(doc, out).to_dict()
    path = out / MANIFEST
    tmp = out / f".{MANIFEST}.tmp"  # hidden: never listed; renamed over the manifest in one step
    tmp.write_text(json.dumps(doc, indent=2) + "\n")
    os.replace(tmp, path)
    return path


def file_sha256(path: str | Path, chunk: int = 1 << 20) -> str:
    """Hex sha256 of a file, read in 1 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


# ----------------------------------------------------------------------------- reading
def _where(loc: tuple[Any, ...]) -> str:
    return ".".join(str(p) for p in loc if not (isinstance(p, str) and p.startswith(("function-", "tagged-union"))))


def parse_manifest(doc: Mapping[str, Any], where: str | Path = "manifest") -> Manifest:
    """Validate a manifest's JSON form through :class:`Manifest`; :class:`ArtifactError` names the first bad field."""
    try:
        return Manifest.from_document(doc)
    except ValidationError as e:
        err = e.errors(include_url=False)[0]
        field = _where(err["loc"])
        msg = err["msg"].removeprefix("Value error, ")
        raise ArtifactError(f"{where}: manifest field {field or '(top level)'}: {msg}") from None


def load_manifest(root: str | Path) -> Manifest:
    """Read ``root/manifest.json`` and validate every field; return the typed :class:`Manifest`."""
    root = Path(root)
    path = root / MANIFEST
    if not path.is_file():
        raise ArtifactError(f"{path}: no manifest.json (is {root} an artifact directory?)")
    try:
        doc = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ArtifactError(f"{path}: unreadable manifest ({e})") from e
    if not isinstance(doc, dict):
        raise ArtifactError(f"{path}: the manifest must be a JSON object")
    if "files" not in doc:
        raise ArtifactError(f"{path}: manifest field files: Field required (write it with write_manifest)")
    return parse_manifest(doc, path)


def verify_files(root: str | Path, manifest: Manifest) -> None:
    """Check every file the manifest lists exists with its size and sha256; raise naming the first bad file."""
    root = Path(root).resolve()
    if manifest.files is None:
        raise ArtifactError(f"{root}: the manifest lists no files (write it with write_manifest)")
    for rel, entry in manifest.files.items():
        path = (root / rel).resolve()
        if root not in path.parents:
            raise ArtifactError(f"{root}: manifest lists {rel!r}, which is outside the artifact")
        if not path.is_file():
            raise ArtifactError(f"{path}: listed in the manifest but missing")
        if path.stat().st_size != entry.size:
            raise ArtifactError(f"{path}: size {path.stat().st_size} != {entry.size} in the manifest (corrupt?)")
        digest = file_sha256(path)
        if digest != entry.sha256:
            raise ArtifactError(f"{path}: sha256 {digest[:12]}… != {entry.sha256[:12]}… in the manifest (corrupt?)")


def artifact_version(manifest: Manifest) -> str:
    """The model version of a validated manifest: its ``version``, else ``build.version``, else the first 12 hex
    digits of the sha256 of the manifest document itself (canonical JSON, as read from disk). The manifest holds
    the sha256 of every file, and :func:`verify_files` checks them at load, so the hash covers the weights, the
    exports, the tokenizer and every setting of the manifest (labels, temperature, OOD threshold): any change to
    what the model answers changes it."""
    recorded = manifest.recorded_version
    if recorded is not None:
        if not re.fullmatch(VERSION_PATTERN, recorded):
            raise ArtifactError(
                f"manifest build.version {recorded!r} is not a version (letters, digits, '.', '_', '-')"
            )
        return recorded
    return manifest.content_sha256()[:12]
