"""Build the server's embedded default artifacts once: ``python -m offline.default --out artifacts/default``.

Each fast config under ``offline/configs`` (``text-fast``, ``image-fast``,
``zeroshot-fast``) is built into ``<out>/<modality>``. An artifact
is rebuilt only when it is missing, incomplete, or was built from a different
config file or different weights named in it (``base.path``, ``base.image_init``: the repository's pretrained
backbone); their sha256 are recorded next to it. Relative paths in the configs are relative to the repository.

``--serve`` (what ``make serve`` runs) serves as soon as the first artifact is ready: it builds the quickest one first
(:data:`ORDER`), starts ``python -m service`` on every default folder (``HYDRA_ARTIFACTS``), and builds the others
while the server answers; the server loads each when its build is done. Each folder still to build has a note
beside it until then (:mod:`service.core.building`), which the server shows in ``/readyz`` and ``/v1/models``.
Builds run one after another, each on every core (the first one alone, so that nothing delays the first answer).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from offline.build import build
from offline.config import BuildConfig, load_config
from service.core.building import BuildNote, clear_note, write_note

ROOT = Path(__file__).resolve().parents[1]
DEFAULTS = {"text": "text-fast.yaml", "image": "image-fast.yaml", "zeroshot": "zeroshot-fast.yaml"}
SERVED = ("text", "image", "zeroshot")  # built by default
ORDER = ("zeroshot", "text", "image")  # the order of the builds: the quickest first, so that make serve answers soon
# the builds' length on 2 cores of the machines CI runs on (docs/build.md), for the server's "about N s left"
EXPECTED_S = {"zeroshot": 170.0, "text": 250.0, "image": 280.0}
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


def _note(cfg: BuildConfig, default: str, config: Path, eta_s: float) -> BuildNote:
    """The note of the default ``default`` (a key of :data:`DEFAULTS`: the zero-shot model takes images)."""
    return BuildNote(
        name=cfg.name,
        task="zero-shot" if default == "zeroshot" else "classification",
        modality="text" if default == "text" else "image",
        config=str(config.relative_to(ROOT)),
        pid=os.getpid(),
        started=time.time(),
        eta_s=eta_s,
    )


def build_one(modality: str, config: Path, out: Path) -> None:
    """Build one default artifact into ``out`` and stamp it with the config it was built from."""
    print(f"[default] building {out} from {config.relative_to(ROOT)} (a few minutes, once)", flush=True)
    t0 = time.perf_counter()
    build(load_config(config), out)
    stamp = {"config": str(config.relative_to(ROOT)), "config_sha256": _config_hash(config)}
    _stamp(out).write_text(json.dumps(stamp))
    print(f"[default] built {out} in {time.perf_counter() - t0:.0f} s", flush=True)


def _start_server(folders: list[Path]) -> subprocess.Popen[bytes]:
    """``python -m service`` on ``HYDRA_ARTIFACTS``, or on ``folders`` when it is not set."""
    env = dict(os.environ)
    env.setdefault("HYDRA_ARTIFACTS", ",".join(str(f) for f in folders))
    return subprocess.Popen([sys.executable, "-m", "service"], cwd=ROOT, env=env)


def serve_while_building(todo: list[tuple[str, Path, Path]], folders: list[Path]) -> int:
    """Build the first of ``todo`` unless an artifact is already current, start the server, build the rest while
    it serves (each announced by a note beside its folder until it is done), then wait for the server to stop; the
    server's exit status."""
    eta = 0.0
    for modality, config, out in todo:
        eta += EXPECTED_S.get(modality, 300.0)
        write_note(out, _note(load_config(config), modality, config, eta))
    server: subprocess.Popen[bytes] | None = None
    current = len(todo) < sum(1 for m in DEFAULTS if m in SERVED)
    try:
        for i, (modality, config, out) in enumerate(todo):
            if server is None and (current or i > 0):
                server = _start_server(folders)
            try:
                build_one(modality, config, out)
            finally:
                clear_note(out)  # built, or failed: the server says which (a folder without a manifest failed)
            if server is not None and server.poll() is not None:
                return server.returncode
        if server is None:
            server = _start_server(folders)
        print("[default] every default artifact is built", flush=True)
        return server.wait()
    except KeyboardInterrupt:  # Ctrl-C reaches the server too: it drains and stops
        return server.wait(timeout=60) if server is not None else 130
    finally:
        for _, _, out in todo:
            clear_note(out)
        if server is not None and server.poll() is None:
            server.terminate()
            server.wait(timeout=60)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="artifacts/default", help="folder holding one artifact per modality")
    ap.add_argument("--only", nargs="*", choices=sorted(DEFAULTS), help="build only these modalities")
    ap.add_argument(
        "--serve",
        action="store_true",
        help="start python -m service (HYDRA_ARTIFACTS) once the first artifact is built; build the rest meanwhile",
    )
    args = ap.parse_args(argv)
    out_root = Path(args.out).resolve()
    os.chdir(ROOT)  # the configs name the backbone relative to the repository

    todo: list[tuple[str, Path, Path]] = []
    for modality in ORDER:
        if (args.only and modality not in args.only) or (not args.only and modality not in SERVED):
            continue
        config = ROOT / "offline" / "configs" / DEFAULTS[modality]
        if not config.is_file():
            continue
        out = out_root / modality
        if is_current(out, config):
            print(f"[default] {out} is up to date")
            continue
        todo.append((modality, config, out))
    if args.serve:
        folders = [out_root / m for m in ORDER if m in SERVED and (not args.only or m in args.only)]
        return serve_while_building(todo, folders)
    for modality, config, out in todo:
        build_one(modality, config, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
