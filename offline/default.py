"""Build the server's embedded default artifacts once: ``python -m offline.default --out artifacts/default``.

Each fast config under ``offline/configs`` (``text-fast``, ``image-fast``,
``zeroshot-fast``) is built into ``<out>/<modality>``. An artifact
is rebuilt only when it is missing, incomplete, or was built from a different
config file or different weights named in it (``base.path``, ``base.image_init``: the repository's pretrained
backbone); their sha256 are recorded next to it. Relative paths in the configs are relative to the repository.

When several are stale they build side by side, each in its own process with its share of the cores
(``--jobs``; default: as many as there are cores, at most one per artifact), every output line prefixed with
its modality. Small models on few cores use a second torch thread poorly, so two one-thread builds finish
sooner than the same two built one after the other on two threads (the figure is in the README). A build
that fails does not stop the others; the command then exits 1 naming it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from offline.build import build
from offline.config import load_config

ROOT = Path(__file__).resolve().parents[1]
DEFAULTS = {"text": "text-fast.yaml", "image": "image-fast.yaml", "zeroshot": "zeroshot-fast.yaml"}
SERVED = ("text", "image", "zeroshot")  # built by default


def _config_hash(path: Path) -> str:
    """sha256 of the config file and of every weights file it names (a retrained backbone rebuilds too)."""
    h = hashlib.sha256(path.read_bytes())
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


def _pump(name: str, proc: subprocess.Popen[str]) -> None:
    """Copy a child's output to ours line by line, each line prefixed with its name."""
    assert proc.stdout is not None
    for line in proc.stdout:
        print(f"[{name}] {line}", end="", flush=True)


def run_side_by_side(jobs: Sequence[tuple[str, list[str]]], width: int, threads: int) -> list[str]:
    """Run each ``(name, argv)`` as a child process, at most ``width`` at a time, each with ``threads`` torch
    threads; return the names of those that failed. Interrupting stops every running child."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), PYTHONUNBUFFERED="1")
    pending = list(jobs)
    running: dict[str, tuple[subprocess.Popen[str], threading.Thread]] = {}
    failed: list[str] = []
    try:
        while pending or running:
            while pending and len(running) < width:
                name, argv = pending.pop(0)
                proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                pump = threading.Thread(target=_pump, args=(name, proc), daemon=True)
                pump.start()
                running[name] = (proc, pump)
            done = [name for name, (proc, _) in running.items() if proc.poll() is not None]
            if not done:
                time.sleep(0.2)
            for name in done:
                proc, pump = running.pop(name)
                pump.join()
                if proc.returncode != 0:
                    failed.append(name)
    finally:
        for proc, _ in running.values():
            proc.terminate()
    return failed


def _build_one(modality: str, config: Path, out: Path) -> None:
    print(f"[default] building {out} from {config.relative_to(ROOT)} (a few minutes, once)", flush=True)
    build(load_config(config), out)
    stamp = {"config": str(config.relative_to(ROOT)), "config_sha256": _config_hash(config)}
    _stamp(out).write_text(json.dumps(stamp))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="artifacts/default", help="folder holding one artifact per modality")
    ap.add_argument("--only", nargs="*", choices=sorted(DEFAULTS), help="build only these modalities")
    ap.add_argument("--jobs", type=int, default=0, help="builds side by side (default 0: one per core)")
    args = ap.parse_args(argv)
    if args.jobs < 0:
        ap.error(f"--jobs must be >= 0, got {args.jobs}")
    out_root = Path(args.out).resolve()
    os.chdir(ROOT)  # the configs name the backbone relative to the repository

    stale = []
    for modality, name in DEFAULTS.items():
        if (args.only and modality not in args.only) or (not args.only and modality not in SERVED):
            continue
        config = ROOT / "offline" / "configs" / name
        if not config.is_file():
            continue
        if is_current(out_root / modality, config):
            print(f"[default] {out_root / modality} is up to date")
        else:
            stale.append((modality, config))
    cores = os.cpu_count() or 1
    width = min(len(stale), args.jobs or cores)
    if width <= 1:
        for modality, config in stale:
            _build_one(modality, config, out_root / modality)
        return 0
    me = [sys.executable, "-m", "offline.default", "--out", str(out_root), "--jobs", "1", "--only"]
    failed = run_side_by_side([(m, [*me, m]) for m, _ in stale], width, threads=max(1, cores // width))
    for modality in failed:
        print(f"[default] building {out_root / modality} failed; its log is above, prefixed [{modality}]")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
