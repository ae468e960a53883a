"""Build the server's embedded default artifacts once: ``python -m offline.default --out artifacts/default``.

Each fast config under ``offline/configs`` (``text-fast``, ``image-fast``,
``zeroshot-fast``) is built into ``<out>/<modality>``. An artifact
is rebuilt only when it is missing, incomplete, or was built from a different
config file or different weights named in it (``base.path``, ``base.image_init``: the repository's pretrained
backbone); their sha256 are recorded next to it. Relative paths in the configs are relative to the repository.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from pathlib import Path

from offline.build import build
from offline.config import load_config

ROOT = Path(__file__).resolve().parents[1]
DEFAULTS = {"text": "text-fast.yaml", "image": "image-fast.yaml", "zeroshot": "zeroshot-fast.yaml"}
SERVED = ("text", "image", "zeroshot")  # built by default
# bumped when the builder writes what an artifact built before lacks, so that a cached default is rebuilt once:
# 2 = the calibration confidences of the online accept rules, label-free layer candidates, the shifted validation set
BUILDER_EPOCH = 2


def _config_hash(path: Path) -> str:
    """sha256 of the config file and of every weights file it names (a retrained backbone rebuilds too)."""
    h = hashlib.sha256(path.read_bytes())
    h.update(f"builder epoch {BUILDER_EPOCH}".encode())
    cfg = load_config(path)
    for ref in (cfg.base.path, cfg.base.image_init):
        if ref and (ROOT / ref).is_file():
            h.update(hashlib.sha256((ROOT / ref).read_bytes()).digest())
    return h.hexdigest()


def _stamp(out: Path) -> Path:
    """Kept beside the artifact (not inside it): the artifact's file list stays exactly what its manifest lists."""
    return out.parent / f".{out.name}.built-from.json"


def is_current(out: Path, config: Path) -> bool:
    stamp = _stamp(out)
    if not (out / "manifest.json").is_file() or not stamp.is_file():
        return False
    return json.loads(stamp.read_text()).get("config_sha256") == _config_hash(config)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default="artifacts/default", help="folder holding one artifact per modality")
    ap.add_argument("--only", nargs="*", choices=sorted(DEFAULTS), help="build only these modalities")
    args = ap.parse_args(argv)
    out_root = Path(args.out).resolve()
    os.chdir(ROOT)  # the configs name the backbone relative to the repository

    for modality, name in DEFAULTS.items():
        if (args.only and modality not in args.only) or (not args.only and modality not in SERVED):
            continue
        config = ROOT / "offline" / "configs" / name
        if not config.is_file():
            continue
        out = out_root / modality
        if is_current(out, config):
            print(f"[default] {out} is up to date")
            continue
        print(f"[default] building {out} from {config.relative_to(ROOT)} (a few minutes, once)", flush=True)
        build(load_config(config), out)
        stamp = {"config": str(config.relative_to(ROOT)), "config_sha256": _config_hash(config)}
        _stamp(out).write_text(json.dumps(stamp))
    return 0


if __name__ == "__main__":
    sys.exit(main())
