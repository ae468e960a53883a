"""A user's pretrained checkpoint, loaded the ecosystem's way and checked key by key.

A checkpoint whose keys do not match the architecture must stop the build: loading it with
``strict=False`` would serve random weights under a valid manifest. Only the classifier head may
differ (a new class count resets it); any other missing or unexpected key is an error naming the
first few keys.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import timm
from timm.models import load_state_dict
from torch import nn

from .config import ConfigError

__all__ = ["check_keys", "load_timm"]

SHOWN = 5  # keys named in an error message


def check_keys(source: str, missing: Iterable[str], unexpected: Iterable[str], head: Iterable[str] = ()) -> None:
    """Raise :class:`ConfigError` when a checkpoint misses or adds keys other than the classifier head's.

    ``head``: key prefixes of the classifier head (``head.``, ``classifier.``), which may be absent or replaced.
    """
    prefixes = tuple(head)
    bad_missing = sorted(k for k in missing if not (prefixes and k.startswith(prefixes)))
    bad_unexpected = sorted(k for k in unexpected if not (prefixes and k.startswith(prefixes)))
    if bad_missing or bad_unexpected:
        parts = []
        if bad_missing:
            parts.append(f"{len(bad_missing)} missing (e.g. {', '.join(bad_missing[:SHOWN])})")
        if bad_unexpected:
            parts.append(f"{len(bad_unexpected)} unexpected (e.g. {', '.join(bad_unexpected[:SHOWN])})")
        raise ConfigError(f"{source}: the checkpoint's keys do not match the architecture: {'; '.join(parts)}")


def load_timm(name: str, path: str | Path | None, num_classes: int, **kwargs: Any) -> nn.Module:
    """timm model ``name`` with ``num_classes`` outputs, from the local checkpoint ``path`` (``.safetensors``,
    ``.pth``, ``.bin``) as timm loads pretrained weights (``pretrained_cfg_overlay={"file": path}``: its key
    filters apply, the head is reset when the class count differs); without ``path``, random weights.

    The checkpoint's keys are checked against the architecture first (:func:`check_keys`). ``kwargs`` go to
    ``timm.create_model`` (``base.arch``: e.g. ``img_size``, ``depth`` of a smaller variant); its
    ``pretrained_cfg_overlay`` (the checkpoint's own ``mean``, ``std``, ``input_size``, ``crop_pct``, ``num_classes``:
    the head is kept when that class count is the data's) is merged with the file.
    """
    overlay = dict(kwargs.pop("pretrained_cfg_overlay", None) or {})  # e.g. the checkpoint's mean, std, input size
    if path is None:
        return timm.create_model(name, pretrained=False, num_classes=num_classes,
                                 pretrained_cfg_overlay=overlay or None, **kwargs)  # fmt: skip
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"base.path {path} is not a file")
    try:
        ckpt = load_state_dict(str(path))
    except Exception as e:  # a corrupt or foreign file: say which
        raise ConfigError(f"base.path {path}: cannot read a state dict ({type(e).__name__}: {e})") from e
    probe = timm.create_model(name, pretrained=False, pretrained_cfg_overlay=overlay or None, **kwargs)
    head = probe.get_classifier()
    head_names = [n for n, m in probe.named_modules() if m is head]
    expected = set(probe.state_dict())
    check_keys(str(path), expected - set(ckpt), set(ckpt) - expected, head=[f"{n}." for n in head_names])
    try:
        return timm.create_model(name, pretrained=True, pretrained_cfg_overlay={**overlay, "file": str(path)},
                                 num_classes=num_classes, **kwargs)  # fmt: skip
    except RuntimeError as e:  # shapes that do not fit the architecture
        raise ConfigError(f"base.path {path}: does not fit timm {name!r} ({str(e).splitlines()[0]})") from e
