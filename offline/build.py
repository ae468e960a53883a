"""Build a Hydra artifact: ``python offline/build.py --config FILE --out DIR [--section.key VALUE ...]``.

Thin entry point: configuration parsing and validation live in ``offline.config``,
the work in ``offline.pipeline``. Every config value can be overridden by a flag;
``--help`` lists them all.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from offline.config import ConfigError, add_arguments, load_config, overrides_from_args  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="offline/build.py",
        description="Build a Hydra ensemble artifact (manifest, fused weights, exports, report) from a config.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--config", required=True, help="YAML config (examples in offline/configs/)")
    parser.add_argument("--out", required=True, help="artifact directory to write")
    parser.add_argument("--force", action="store_true", help="overwrite a non-empty --out directory")
    add_arguments(parser)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        cfg = load_config(args.config, overrides_from_args(args, skip=("config", "out", "force")))
        out = Path(args.out)
        if out.exists() and any(out.iterdir()) and not args.force:
            raise ConfigError(f"--out {out} is not empty; pass --force to overwrite")
        from offline.pipeline import build

        build(cfg, out)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
