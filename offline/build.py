"""Build a Hydra artifact: ``python offline/build.py --config FILE --out DIR [--section.key VALUE ...]``.

The same command, installed: ``hydra-build`` (``[project.scripts]`` in ``pyproject.toml``), or
``python -m offline.build``.

Thin entry point: configuration parsing and validation live in ``offline.config``;
:func:`build` dispatches by family to the classifier pipeline (``offline.pipelines.classifier_build``:
``vit``, ``bert``) or the zero-shot one (``offline.pipelines.zeroshot_build``: ``clip``), both
chains of ``offline.stages`` over one build context. Every config value can be
overridden by a flag; ``--help`` lists them all.
"""

from __future__ import annotations

import argparse
import difflib
import logging
import sys
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

if __name__ == "__main__" and not __package__:
    # `python offline/build.py` (the documented command) runs this file as a script, its own folder first on the
    # path: the repository goes there instead, so this checkout's packages are the ones imported (not an installed
    # copy). The project's one path bootstrap: `hydra-build` and `python -m offline.build` need none.
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import torch  # noqa: E402

from offline import train  # noqa: E402
from offline.config import BuildConfig, ConfigError, add_arguments, load_config, overrides_from_args  # noqa: E402
from offline.families import ADAPTERS  # noqa: E402
from offline.pipelines import classifier_build as pipeline  # noqa: E402
from offline.pipelines import zeroshot_build  # noqa: E402
from offline.train import lit
from service.core.jsonlog import json_formatter  # noqa: E402
from service.core.progress import DEFAULT_EVERY  # noqa: E402
from service.core.progress import set_enabled as set_progress  # noqa: E402
from service.core.progress import set_every as set_progress_every  # noqa: E402

# the command's own flags: every other flag is a config override (``--hydra.members 5``)
NOT_OVERRIDES = ("config", "out", "force", "no_progress", "stage", "member", "progress_every", "log_format")


# the pipeline of each task (a family's row says its task): what `build` runs
PIPELINES: dict[str, Callable[[BuildConfig, Path], Path]] = {
    "classification": pipeline.build,
    "zero-shot": zeroshot_build.build_zero_shot,
}


def pipeline_of(family: str) -> Callable[[BuildConfig, Path], Path]:
    """The pipeline that builds ``family``: its task's (:data:`PIPELINES`)."""
    if family not in ADAPTERS:
        raise ConfigError(f"family {family!r} has no pipeline; known: {sorted(ADAPTERS)}")
    return PIPELINES[ADAPTERS[family].row.task]


def configure_logging(log_format: str | None = None) -> None:
    """INFO logs on stderr: ``text`` lines, or one JSON object per line (``json``, like the server's
    ``HYDRA_LOG_FORMAT=json``: the progress lines' fields are its keys); None keeps what is set (default text)."""
    root = logging.getLogger()
    if getattr(configure_logging, "_handler", None) is not None:
        if log_format is None or log_format == configure_logging._format:  # type: ignore[attr-defined]
            return
        root.removeHandler(configure_logging._handler)  # type: ignore[attr-defined]
    handler = logging.StreamHandler(sys.stderr)
    log_format = log_format or "text"
    handler.setFormatter(
        json_formatter() if log_format == "json" else logging.Formatter("%(asctime)s %(name)s: %(message)s")
    )
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    configure_logging._handler = handler  # type: ignore[attr-defined]
    configure_logging._format = log_format  # type: ignore[attr-defined]


def check_presets(cfg: BuildConfig) -> None:
    """The training presets the config names exist (checked before any data or weights load)."""
    known = sorted(lit.LIT_PRESETS) if cfg.base.source == "lit" else sorted(train.PRESETS)
    if cfg.base.preset not in known:
        raise ConfigError(
            f"base.preset {cfg.base.preset!r} is not a preset of base.source {cfg.base.source!r}; "
            f"known: {', '.join(known)}"
        )
    if cfg.hydra.finetune_preset is not None and cfg.hydra.finetune_preset not in train.PRESETS:
        raise ConfigError(
            f"hydra.finetune_preset {cfg.hydra.finetune_preset!r} is not a preset; "
            f"known: {', '.join(sorted(train.PRESETS))}"
        )


def build(cfg: BuildConfig, out: str | Path, stage: str | None = None, member: int | None = None) -> Path:
    """Build the artifact of ``cfg`` into ``out`` with its family's pipeline and return it; or run one ``stage``
    of a classifier build (:data:`offline.pipelines.classifier_build.STAGES`; ``member``: the member of
    ``--stage member``)."""
    configure_logging()
    run = pipeline_of(cfg.family)
    check_presets(cfg)
    if stage is not None and run is not pipeline.build:
        raise ConfigError(f"--stage is for classifier builds (vit, bert); a {cfg.family} build runs in one process")
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    if stage is None:
        return run(cfg, Path(out))
    return pipeline.build(cfg, Path(out), stage=stage, member=member)


def resumable_only(out: Path) -> bool:
    """``out`` is empty or an unfinished build: it holds ``.checkpoints``, the resumable state a build keeps until
    the very end (the builder makes it before writing anything else and removes it after the manifest), so the same
    command resumes a build stopped anywhere, even while it wrote the artifact's files."""
    names = {p.name for p in out.iterdir()}
    return not names or ".checkpoints" in names


class OneLineParser(argparse.ArgumentParser):
    """argparse, whose errors are one line (what is wrong, exit status 2) instead of the usage of every flag."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (--help lists every option)\n")


def unknown_flags(parser: argparse.ArgumentParser, extras: list[str]) -> str:
    """What ``parse_known_args`` left over, as one message: each unknown flag with the closest valid ones."""
    flags = [e.split("=", 1)[0] for e in extras if e.startswith("-")]
    if not flags:
        return f"unexpected argument(s) {' '.join(extras)}; every option is a flag (--section.key VALUE)"
    known = [o for action in parser._actions for o in action.option_strings if o.startswith("--")]
    parts = []
    for flag in flags:
        close = closest_flags(flag, known)
        parts.append(f"{flag} (did you mean {' or '.join(close)}?)" if close else flag)
    return f"unknown flag{'s' if len(parts) > 1 else ''} {', '.join(parts)}"


def closest_flags(flag: str, known: list[str], n: int = 3, cutoff: float = 0.8) -> list[str]:
    """The ``n`` flags of ``known`` most like ``flag`` (difflib's ratio, at least ``cutoff``): the whole flag, or
    its key alone at 0.9 of its ratio: ``--members`` finds ``--hydra.members`` (a section left out), while a shared
    ``--hydra.`` alone does not make ``--hydra.lr`` look like ``--hydra.membres``."""

    def key(f: str) -> str:
        return f.lstrip("-").rsplit(".", 1)[-1]

    def score(k: str) -> float:
        return max(
            difflib.SequenceMatcher(None, flag, k).ratio(),
            0.9 * difflib.SequenceMatcher(None, key(flag), key(k)).ratio(),
        )

    scored = sorted(((score(k), k) for k in known), key=lambda t: -t[0])
    return [k for s, k in scored[:n] if s >= cutoff]


def make_parser() -> argparse.ArgumentParser:
    """The command's parser: its own flags, then one ``--section.key`` flag per config value."""
    parser = OneLineParser(
        prog="offline/build.py",
        description="Build a Hydra ensemble artifact (manifest, fused weights, exports, report) from a config.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        # flags in full: a prefix of a config key (--hydra.seed for --hydra.seeds) is a typo to name, not to guess
        allow_abbrev=False,
    )
    parser.add_argument("--config", required=True, help="YAML config (examples in offline/configs/)")
    parser.add_argument("--out", required=True, help="artifact directory to write")
    parser.add_argument("--force", action="store_true", help="overwrite a non-empty --out directory")
    parser.add_argument(
        "--no-progress",
        action="store_true",
        help="no progress bars: progress lines instead (the default when stderr is not a terminal, "
        "e.g. CI or a Kubernetes Job)",
    )
    parser.add_argument(
        "--progress-every",
        type=float,
        default=DEFAULT_EVERY,
        help="seconds between a long stage's progress lines when no bar is drawn",
    )
    parser.add_argument(
        "--log-format",
        choices=("text", "json"),
        default="text",
        help="log lines as text, or one JSON object per line (progress lines' fields as keys)",
    )
    parser.add_argument(
        "--stage",
        choices=pipeline.STAGES,
        default=None,
        help="run one stage of a classifier build in --out (shared by the stages): base, score, "
        "member (with --member K; members fine-tune in parallel), finish; default: all of them",
    )
    parser.add_argument("--member", type=int, default=None, help="the member --stage member fine-tunes (0..M-1)")
    add_arguments(parser)
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line; an unknown flag ends it in one line naming the flag and the closest valid ones (exit 2)."""
    parser = make_parser()
    args, extras = parser.parse_known_args(argv)
    if extras:
        parser.error(unknown_flags(parser, extras))
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        if args.no_progress:
            set_progress(False)
        if not args.progress_every > 0:
            raise ConfigError(f"--progress-every must be > 0 seconds, got {args.progress_every}")
        set_progress_every(args.progress_every)
        configure_logging(args.log_format)
        cfg = load_config(args.config, overrides_from_args(args, skip=NOT_OVERRIDES))
        out = Path(args.out)
        if out.exists() and not resumable_only(out) and not args.force and args.stage in (None, "finish"):
            raise ConfigError(f"--out {out} is not empty; pass --force to overwrite")
        if args.member is not None and args.stage != "member":
            raise ConfigError("--member K goes with --stage member")
        build(cfg, out, args.stage, args.member)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
