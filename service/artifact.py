"""The artifact on disk (CONTRACT.md §1): write the manifest with file hashes, read and verify it.

Used by the offline builder (:func:`write_manifest`) and the server
(:func:`load_manifest`, :func:`verify_files`). Only the standard library here.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

__all__ = [
    "FORMAT_VERSION",
    "REQUIRED_FIELDS",
    "ArtifactError",
    "file_sha256",
    "list_files",
    "write_manifest",
    "load_manifest",
    "verify_files",
    "validate_manifest",
]

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
REQUIRED_FIELDS = (
    "format_version",
    "name",
    "family",
    "task",
    "base_model",
    "members",
    "heads",
    "strategy",
    "preprocessing",
    "uncertainty",
    "files",
    "exports",
    "metrics",
)


class ArtifactError(RuntimeError):
    """An artifact that cannot be used: missing or corrupt file, bad manifest. The message names the file."""


def file_sha256(path: str | Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def list_files(root: Path) -> list[Path]:
    """Every regular file under ``root`` except the manifest and hidden files, sorted."""
    return sorted(
        p
        for p in root.rglob("*")
        if p.is_file() and p.name != MANIFEST and not any(part.startswith(".") for part in p.relative_to(root).parts)
    )


def write_manifest(out: str | Path, manifest: dict[str, Any]) -> Path:
    """Add ``files`` (sha256 and size of every file in ``out``) to ``manifest`` and write ``manifest.json``."""
    out = Path(out)
    manifest = dict(manifest)
    manifest["files"] = {
        p.relative_to(out).as_posix(): {"sha256": file_sha256(p), "size": p.stat().st_size} for p in list_files(out)
    }
    validate_manifest(manifest, out)
    path = out / MANIFEST
    path.write_text(json.dumps(manifest, indent=2, sort_keys=False, default=_json_default) + "\n")
    return path


def _json_default(o: Any) -> Any:
    if hasattr(o, "tolist"):
        return o.tolist()
    if isinstance(o, Path):
        return str(o)
    raise TypeError(f"{type(o).__name__} is not JSON serialisable")


def validate_manifest(manifest: dict[str, Any], where: str | Path = "manifest") -> None:
    """Check the fields CONTRACT.md §1 requires; raise :class:`ArtifactError` naming the first problem."""
    missing = [k for k in REQUIRED_FIELDS if k not in manifest]
    if missing:
        raise ArtifactError(f"{where}: manifest lacks required fields {missing}")
    if manifest["format_version"] != FORMAT_VERSION:
        raise ArtifactError(f"{where}: format_version {manifest['format_version']!r} is not {FORMAT_VERSION}")
    if manifest["family"] not in ("vit", "bert", "clip"):
        raise ArtifactError(f"{where}: family {manifest['family']!r} is not vit, bert or clip")
    if manifest["task"] not in ("classification", "zero-shot"):
        raise ArtifactError(f"{where}: task {manifest['task']!r} is not classification or zero-shot")
    if manifest["task"] == "classification" and not manifest.get("labels"):
        raise ArtifactError(f"{where}: a classification artifact needs its labels")
    m = manifest["members"]
    if not isinstance(m, int) or m < 1:
        raise ArtifactError(f"{where}: members must be an integer >= 1, got {m!r}")
    if len(manifest["heads"]) != m:
        raise ArtifactError(f"{where}: heads lists {len(manifest['heads'])} members, members is {m}")
    unc = manifest["uncertainty"]
    for k in ("temperature", "ood_score", "ood_threshold"):
        if k not in unc:
            raise ArtifactError(f"{where}: uncertainty lacks {k!r}")


def load_manifest(root: str | Path) -> dict[str, Any]:
    """Read and validate ``root/manifest.json``."""
    root = Path(root)
    path = root / MANIFEST
    if not path.is_file():
        raise ArtifactError(f"{path}: no manifest.json (is {root} an artifact directory?)")
    try:
        manifest = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ArtifactError(f"{path}: unreadable manifest ({e})") from e
    if not isinstance(manifest, dict):
        raise ArtifactError(f"{path}: the manifest must be a JSON object")
    validate_manifest(manifest, path)
    return manifest


def verify_files(root: str | Path, manifest: dict[str, Any]) -> None:
    """Check every file the manifest lists exists with its size and sha256; raise naming the first bad file."""
    root = Path(root).resolve()
    for rel, meta in manifest["files"].items():
        path = (root / rel).resolve()
        if root not in path.parents:
            raise ArtifactError(f"{root}: manifest lists {rel!r}, which is outside the artifact")
        if not path.is_file():
            raise ArtifactError(f"{path}: listed in the manifest but missing")
        if path.stat().st_size != meta["size"]:
            raise ArtifactError(f"{path}: size {path.stat().st_size} != {meta['size']} in the manifest (corrupt?)")
        digest = file_sha256(path)
        if digest != meta["sha256"]:
            raise ArtifactError(f"{path}: sha256 {digest[:12]}… != {meta['sha256'][:12]}… in the manifest (corrupt?)")
