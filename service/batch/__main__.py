"""``python -m service.batch``: :func:`service.batch.command.main`."""

from service.batch.command import main

if __name__ == "__main__":
    raise SystemExit(main())
