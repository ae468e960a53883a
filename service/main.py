"""``service.main:app``, the ASGI app's documented name (uvicorn and friends): :mod:`service.entrypoints.app`."""

from service.entrypoints.app import app, create_app

__all__ = ["app", "create_app"]
