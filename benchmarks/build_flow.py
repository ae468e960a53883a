"""How far a build config travels: the project files and call edges a build crosses from its entry point.

Runs one tiny build (a random-init BERT saved as a user's checkpoint, 60 labelled lines of a CSV; the same
shape as the tests' user build) through ``offline.build.main`` with ``sys.setprofile`` on, and records every
call whose callee is a function of ``service/`` or ``offline/``. The caller is the nearest project frame up
the stack (a model's ``forward`` called by torch counts as called by the project code that called torch).
Counted once per distinct edge ``caller function -> callee function``, so a loop over batches is one edge:

* ``files``: project files with at least one function on the path;
* ``edges``: distinct call edges between project functions;
* ``entries[module]``: distinct edges that enter the module from another file (how often a reader following
  the flow has to come back to it); the largest is the hub;
* ``climbs``: distinct edges from ``offline`` into ``service.core`` (the builder using the shared library).

The same counts for the config's own path (``config_path``): only the calls that receive the build config,
directly or inside an argument that holds it (a build context), i.e. the route a reader follows from
``build.main`` to the artifact to see what a config key does.

Usage::

    python -m benchmarks.build_flow [--json out.json]
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
import tempfile
from collections import Counter
from pathlib import Path
from types import FrameType
from typing import Any

from tests.fixtures.tiny_bert import tiny_bert_config

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("service", "offline")
WORDS = {
    "billing": ["invoice", "charged twice", "refund", "payment failed", "my card"],
    "delivery": ["parcel late", "courier", "tracking number", "not delivered", "wrong address"],
    "praise": ["great service", "thank you", "love it", "very helpful", "excellent support"],
}


def project_file(filename: str) -> str | None:
    """``offline/stages.py`` for a file of the project's two packages, else None."""
    try:
        rel = Path(filename).resolve().relative_to(ROOT)
    except ValueError:
        return None
    return str(rel) if rel.parts and rel.parts[0] in PACKAGES else None


def user_files(folder: Path) -> tuple[Path, Path]:
    """A tiny random BERT classifier saved with its tokenizer, and a CSV of 60 labelled texts."""
    import torch
    from transformers import BertForSequenceClassification, BertTokenizerFast

    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    vocab += sorted({w for texts in WORDS.values() for t in texts for w in t.split()})
    (folder / "vocab.txt").write_text("\n".join(vocab) + "\n")
    tok = BertTokenizerFast(vocab_file=str(folder / "vocab.txt"))
    torch.manual_seed(0)
    config = tiny_bert_config(vocab_size=len(vocab), num_hidden_layers=3, num_labels=1000)
    ckpt = folder / "ckpt"
    BertForSequenceClassification(config).save_pretrained(ckpt)
    tok.save_pretrained(ckpt)
    data = folder / "tickets.csv"
    with data.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["text", "label"])
        for i in range(60):
            label = list(WORDS)[i % 3]
            w.writerow([f"{WORDS[label][i % 5]} please {i}", label])
    return ckpt, data


def flags(ckpt: Path, data: Path) -> list[str]:
    over: dict[str, object] = {
        "name": "tickets",
        "family": "bert",
        "base.source": f"hf:{ckpt}",
        "base.preset": "bert_fast",
        "base.steps": 4,
        "base.max_length": 24,
        "data.setting": "text-file",
        "data.path": str(data),
        "data.max_train": 30,
        "data.max_val": 15,
        "data.max_test": 15,
        "hydra.prune_per_layer": 1,
        "hydra.calib_samples": 8,
        "hydra.finetune_steps": 2,
        "export.torchscript": False,
        "export.bf16_check": False,
    }
    return [f for k, v in over.items() for f in (f"--{k}", v if isinstance(v, str) else json.dumps(v))]


Edge = tuple[str, str, str, str]


def carries_config(frame: FrameType) -> bool:
    """Whether one of the call's arguments is the build config or an object that holds it."""
    from offline.config import BuildConfig

    code = frame.f_code
    n = code.co_argcount + code.co_kwonlyargcount
    for name in code.co_varnames[:n]:
        value = frame.f_locals.get(name)
        if isinstance(value, BuildConfig):
            return True
        held = getattr(value, "__dict__", None)
        if isinstance(held, dict) and any(isinstance(v, BuildConfig) for v in held.values()):
            return True
    return False


def trace(argv: list[str]) -> tuple[set[Edge], set[Edge]]:
    """Distinct ``(caller file, caller function, callee file, callee function)`` of one ``build.main(argv)``: all
    of them, and those whose call carries the build config."""
    from offline.build import main

    edges: set[Edge] = set()
    config_edges: set[Edge] = set()

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        if event != "call":
            return
        callee = project_file(frame.f_code.co_filename)
        if callee is None:
            return
        up = frame.f_back
        while up is not None and project_file(up.f_code.co_filename) is None:
            up = up.f_back
        if up is not None:
            edge = (project_file(up.f_code.co_filename) or "", up.f_code.co_qualname, callee, frame.f_code.co_qualname)
            if edge not in edges:
                edges.add(edge)
                if carries_config(frame):
                    config_edges.add(edge)

    sys.setprofile(profile)
    try:
        rc = main(argv)
    finally:
        sys.setprofile(None)
    if rc != 0:
        raise SystemExit(f"the traced build failed with exit status {rc}")
    return edges, config_edges


def summarise(edges: set[Edge]) -> dict[str, Any]:
    files = {e[0] for e in edges} | {e[2] for e in edges}
    crossing = [e for e in edges if e[0] != e[2]]
    entries = Counter(e[2] for e in crossing)
    climbs = sum(1 for e in crossing if e[0].startswith("offline/") and e[2].startswith("service/core/"))
    return {
        "files": len(files),
        "edges": len(edges),
        "crossing_edges": len(crossing),
        "climbs_offline_to_core": climbs,
        "entries": dict(entries.most_common()),
        "file_list": sorted(files),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", type=Path, help="write the summary here")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        ckpt, data = user_files(Path(tmp))
        config = Path(tmp) / "empty.yaml"
        config.write_text("{}\n")  # every setting from the flags
        out = Path(tmp) / "artifact"
        edges, config_edges = trace(["--config", str(config), "--out", str(out), "--no-progress", *flags(ckpt, data)])
    summary = {**summarise(edges), "config_path": summarise(config_edges)}
    for title, part in (("every call", summary), ("the config's path", summary["config_path"])):
        print(
            f"{title}: files {part['files']}, call edges {part['edges']} ({part['crossing_edges']} between "
            f"files), offline -> service.core {part['climbs_offline_to_core']}"
        )
        for module, n in list(part["entries"].items())[:8]:
            print(f"  entered {n:3d} times: {module}")
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
