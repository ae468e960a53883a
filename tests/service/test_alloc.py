"""The server puts large CPU activations on transparent huge pages (``THP_MEM_ALLOC_ENABLE``, set in
``service/entrypoints/app.py`` before torch is imported): a freed and re-allocated 64 MiB activation costs a few dozen
page faults per call instead of 16k."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

PROBE = """
import resource
if {server}:
    import service.main  # noqa: F401  (first import: sets the allocator environment, then imports torch)
import torch
def step():
    x = torch.empty(16 * 2**20)  # 64 MiB, above glibc's largest mmap threshold: mapped afresh every call
    x.fill_(1.0)
    return float(x[-1])
step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(4):
    step()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(server: bool) -> int:
    env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    code = PROBE.format(server=server)
    # run from the repository root: `python -c` imports from the working directory first
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env, cwd=ROOT)
    return int(out.stdout.strip().splitlines()[-1])


def _thp_available() -> bool:
    try:
        mode = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return False
    return "[madvise]" in mode  # "always" gives every large mapping huge pages anyway: nothing to compare


@pytest.mark.skipif(platform.system() != "Linux" or not _thp_available(), reason="needs Linux THP in madvise mode")
def test_server_import_puts_large_activations_on_huge_pages():
    pages = 4 * 64 * 2**20 // 4096  # four 64 MiB tensors in 4 KiB pages
    plain, server = _faults(False), _faults(True)
    assert plain > 0.9 * pages, plain  # torch's default: every call faults its 64 MiB in again, page by page
    assert server < 0.1 * pages, server  # 2 MiB pages: 32 faults per tensor (plus stragglers)
