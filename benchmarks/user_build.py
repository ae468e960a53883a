"""A user's image-folder build on CPU, timed stage by stage: the build a platform team runs first.

    .venv/bin/python -m benchmarks.user_build --out benchmarks/results/user_build
    .venv/bin/python -m benchmarks.user_build --rerun --resume     # and check the artifact bit for bit
    .venv/bin/python -m benchmarks.user_build --resume --against <a recorded model_sha256> --tag resume

The user's model and data, generated (seeded) so that anyone can rerun it: a timm ``vit_tiny_patch16_224``
checkpoint in the standard layout (1000-class head, random weights: the arithmetic is a pretrained one's), and a
folder of 180 RGB photos-like images of 48 to 320 pixels in 3 classes (JPEG and PNG). The build: the model at
224 px, 150 base fine-tuning steps, Taylor scoring, M = 3 members of 20 steps each, ONNX export; the build's own
``build.precision`` (``auto`` unless ``--precision``). ``--rerun`` builds again into a fresh folder and compares
``model.safetensors``; ``--resume`` stops a build during base training with SIGKILL (5 s after its first
checkpoint, or after ``--kill-after`` seconds), completes it with the same command and compares. Writes
``<out>/user_build.json`` with the machine, the wall time and every stage's time from the manifest.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks.bench_fusion import cpu_name
from offline.compute import resolve_precision

ROOT = Path(__file__).resolve().parents[1]
CLASSES = {"forest": (40, 160, 60), "sea": (30, 80, 200), "sand": (220, 190, 120)}
IMAGES_PER_CLASS = 60


def make_folder(root: Path, seed: int = 0) -> Path:
    """180 RGB images of 48-320 px in 3 class subfolders, JPEG and PNG, with texture (seeded)."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    for name, colour in CLASSES.items():
        (root / name).mkdir(parents=True, exist_ok=True)
        for i in range(IMAGES_PER_CLASS):
            w, h = (int(v) for v in rng.integers(48, 321, 2))
            base = np.asarray(colour, dtype=np.float64) + rng.normal(0, 25, 3)
            yy, xx = np.mgrid[0:h, 0:w]
            wave = 30 * np.sin(xx / rng.uniform(4, 20) + rng.uniform(0, 6))[..., None]
            px = np.clip(base + wave + rng.normal(0, 20, (h, w, 3)), 0, 255).astype(np.uint8)
            ext = "jpg" if i % 2 else "png"
            Image.fromarray(px).save(root / name / f"img{i:03d}.{ext}")
    return root


def make_checkpoint(path: Path, seed: int = 0) -> Path:
    """timm's vit_tiny_patch16_224 with random weights, saved as a user's safetensors checkpoint."""
    import timm
    import torch
    from safetensors.torch import save_file

    torch.manual_seed(seed)
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, num_classes=1000)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path))
    return path


def config(folder: Path, ckpt: Path, precision: str) -> dict:
    return {
        "name": "user-vit-tiny",
        "family": "vit",
        "base": {"source": "timm:vit_tiny_patch16_224", "path": str(ckpt), "preset": "vit_pretrained", "steps": 150},
        "data": {
            "setting": "image-folder",
            "path": str(folder),
            "max_train": 1000,
            "max_val": 30,
            "max_test": 30,
            "max_calibration": 0,
        },
        "hydra": {"members": 3, "strategy": "taylor", "prune_per_layer": 1, "calib_samples": 64, "finetune_steps": 20},
        "export": {"torchscript": False, "onnx": True, "bf16_check": False},
        "build": {"precision": precision},
    }


def run_build(cfg_path: Path, out: Path, kill_after: float | None = None) -> float:
    """``offline/build.py`` as a user runs it (stderr to a file); the wall time; SIGKILL after ``kill_after`` s, or
    (``kill_after == 0``) 5 s after the first training checkpoint (``state-*.pt``) appears under ``out``."""
    cmd = [
        sys.executable,
        str(ROOT / "offline" / "build.py"),
        "--config",
        str(cfg_path),
        "--out",
        str(out),
        "--progress-every",
        "30",
    ]
    t0 = time.perf_counter()
    with open(out.parent / f"{out.name}.log", "a") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, stderr=log, stdout=log)
        if kill_after == 0:  # wait for a checkpoint to resume from, then a little into the next steps
            while proc.poll() is None and not any(out.rglob("state-*.pt")):
                time.sleep(1.0)
            kill_after = 5.0
        try:
            proc.wait(timeout=kill_after)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            return time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"build failed ({proc.returncode}); see {out.parent / f'{out.name}.log'}")
    return time.perf_counter() - t0


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "user_build"))
    ap.add_argument("--precision", default="auto", choices=("auto", "fp32", "bf16"))
    ap.add_argument("--rerun", action="store_true", help="build again and compare the weights bit for bit")
    ap.add_argument("--resume", action="store_true", help="kill a build during base training, resume, compare")
    ap.add_argument(
        "--kill-after",
        type=float,
        default=0.0,
        help="seconds before the SIGKILL; 0 (default): 5 s after the first training checkpoint is saved",
    )
    ap.add_argument("--tag", default=None, help="name of this run in the results (default: the precision)")
    ap.add_argument(
        "--against",
        default=None,
        metavar="SHA256",
        help="with --resume: compare the resumed build with this recorded model.safetensors hash "
        "instead of building the reference first (a recorded run's model_sha256)",
    )
    args = ap.parse_args(argv)
    if args.against and not (args.resume and not args.rerun):
        ap.error("--against goes with --resume alone")
    return args


def _builds(args: argparse.Namespace, cfg_path: Path, work: Path, result: dict) -> None:
    """The reference build (unless ``--against``), then the rerun and the resumed build, compared with it; their
    facts go into ``result``."""
    if args.against:  # the reference is a recorded run's
        result["model_sha256"] = args.against
    else:
        wall = run_build(cfg_path, work / "a")
        manifest = json.loads((work / "a" / "manifest.json").read_text())
        result.update(
            wall_s=round(wall, 1),
            stages_s=manifest["build"]["timings_s"],
            model_sha256=sha256(work / "a" / "model.safetensors"),
            test_accuracy=manifest["metrics"].get("hydra", {}).get("acc"),
        )
    if args.rerun:
        run_build(cfg_path, work / "b")
        result["rerun_identical"] = sha256(work / "b" / "model.safetensors") == result["model_sha256"]
    if args.resume:
        killed_at = run_build(cfg_path, work / "c", kill_after=args.kill_after)
        killed = sorted(p.name for p in (work / "c").rglob("state-*.pt"))
        run_build(cfg_path, work / "c")
        result["resume"] = {
            "killed_after_s": round(killed_at, 1),
            "checkpoints_left": killed,
            "identical": sha256(work / "c" / "model.safetensors") == result["model_sha256"],
        }


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    work = Path(tempfile.mkdtemp(prefix="user-build-"))
    try:
        folder = make_folder(work / "photos")
        ckpt = make_checkpoint(work / "vit_tiny.safetensors")
        import yaml

        cfg_path = work / "build.yaml"
        cfg_path.write_text(yaml.safe_dump(config(folder, ckpt, args.precision)))
        result = {
            "machine": {"cpu": cpu_name(), "cores": os.cpu_count(), "platform": platform.platform()},
            "precision": args.precision,
            "resolved_precision": resolve_precision(args.precision, torch.device("cpu")),
        }
        _builds(args, cfg_path, work, result)
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        name = args.tag or args.precision
        path = out / "user_build.json"
        doc = json.loads(path.read_text()) if path.is_file() else {}
        doc[name] = result
        path.write_text(json.dumps(doc, indent=2) + "\n")
        print(json.dumps(result, indent=2))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
