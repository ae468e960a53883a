"""What the machine is: the CPU's name and its native bf16 support (Linux ``/proc/cpuinfo``; a fallback elsewhere).

Facts, not policy: the server's plan (:mod:`service.runtime.plan`) and the builder's compute choice read them, and every
measurement names the CPU it ran on. The file to read is a parameter, so tests pass their own.
"""

from __future__ import annotations

import platform
from pathlib import Path

__all__ = ["cpu_bf16_flags", "cpu_has_native_bf16", "cpu_name"]


def cpu_bf16_flags(cpuinfo: str | Path = "/proc/cpuinfo") -> list[str] | None:
    """The native bf16 flags the CPU lists (``avx512_bf16``, ``amx_bf16``; Linux), None when unreadable."""
    try:
        text = Path(cpuinfo).read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[-1].split())
            return [f for f in ("avx512_bf16", "amx_bf16") if f in flags]
    return None


def cpu_name(cpuinfo: str | Path = "/proc/cpuinfo") -> str:
    """The CPU's model name (Linux ``model name``), else what ``platform`` knows: the machine named in every
    measurement (benchmarks, the backbone's record)."""
    try:
        for line in Path(cpuinfo).read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_has_native_bf16(cpuinfo: str | Path = "/proc/cpuinfo") -> bool:
    """True when the CPU flags list ``avx512_bf16`` or ``amx_bf16`` (Linux; False when unreadable)."""
    return bool(cpu_bf16_flags(cpuinfo))
