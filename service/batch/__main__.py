"""``python -m service.batch``: :func:`service.batch.cli.main`."""

from service.batch.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
