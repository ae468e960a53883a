"""``python -m service``: :func:`service.entrypoints.cli.main`."""

from service.entrypoints.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
