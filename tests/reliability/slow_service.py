"""``python -m tests.reliability.slow_service``: ``python -m service`` in which every batch holding an all-white
image of the tiny ViT sleeps ``RELIABILITY_DELAY_S`` seconds first, so that a test can keep requests in flight
while it sends SIGTERM; other inputs run at full speed. Test helper only."""

from __future__ import annotations

import os
import sys
import time
from typing import Any

from service.entrypoints.cli import main
from service.runtime import ClassifierRuntime

DELAY_S = float(os.environ.get("RELIABILITY_DELAY_S", "0.5"))
# an all-white image after the tiny ViT's normalisation: (255 / 255 - 0.5) / 0.25
WHITE = 2.0

_run = ClassifierRuntime._run


def _slow_run(self: ClassifierRuntime, items: list[Any]) -> list[Any]:
    if any(getattr(x, "dim", lambda: 0)() == 3 and float(x.min()) >= WHITE for x in items):
        time.sleep(DELAY_S)
    return _run(self, items)


ClassifierRuntime._run = _slow_run  # type: ignore[method-assign]

if __name__ == "__main__":
    sys.exit(main())
