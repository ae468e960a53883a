"""A batch's output: numbered parts of ``part_size`` rows in one folder, each written whole (to a temporary name, then
renamed), so that a run killed at any point and started again with the same command skips the parts that are done and
finishes with no row lost or written twice.

The folder also holds ``run.json``: what the rows came from (the model, its version, the input, the options and the
part size). A second run into the same folder must match it, or it stops in one line instead of mixing two runs.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from service.batch.inputs import BatchInputError
from service.batch.scorer import COLUMNS

__all__ = ["FORMATS", "Parts"]

FORMATS = ("parquet", "jsonl")
RUN_FILE = "run.json"


class Parts:
    """The numbered parts of one run's output folder."""

    def __init__(self, out: str | Path, fmt: str, part_size: int, run: dict[str, Any]) -> None:
        if fmt not in FORMATS:
            raise BatchInputError(f"--format must be one of {', '.join(FORMATS)}, got {fmt!r}")
        if part_size < 1:
            raise BatchInputError(f"--part-size must be >= 1, got {part_size}")
        self.out, self.fmt, self.part_size = Path(out), fmt, part_size
        self.rate: tuple[int, float] = (0, 0.0)  # (inputs scored by this run, seconds it took): the summary's
        self.run = {**run, "format": fmt, "part_size": part_size}
        self.out.mkdir(parents=True, exist_ok=True)
        meta = self.out / RUN_FILE
        if meta.exists():
            before = json.loads(meta.read_text())
            if {k: v for k, v in before.items() if k in self.run} != self.run:
                raise BatchInputError(
                    f"{self.out} holds the output of another run ({RUN_FILE} differs: another model, input or "
                    "options); choose another --out, or remove it"
                )
        else:
            _atomic_write(meta, json.dumps(self.run, indent=1).encode())

    @property
    def run_id(self) -> str:
        """A short hash of what the rows come from (``run.json``): the answers' ids in the store are
        ``"<run id>:<position>"``."""
        return "batch-" + hashlib.sha256(json.dumps(self.run, sort_keys=True).encode()).hexdigest()[:16]

    def path(self, k: int) -> Path:
        return self.out / f"part-{k:05d}.{self.fmt}"

    def done(self) -> int:
        """How many parts are complete, counted from the first (a run resumes after them)."""
        k = 0
        while self.path(k).exists():
            k += 1
        return k

    def write(self, k: int, rows: list[dict[str, Any]]) -> None:
        """Part ``k``, whole or not at all."""
        _atomic_write(self.path(k), _encode(rows, self.fmt))

    def read(self, k: int, columns: tuple[str, ...] = COLUMNS) -> list[dict[str, Any]]:
        """The rows of part ``k`` (only ``columns``)."""
        if self.fmt == "jsonl":
            rows = [json.loads(line) for line in self.path(k).read_text().splitlines() if line]
            return [{c: r.get(c) for c in columns} for r in rows]
        import pyarrow.parquet as pq

        return pq.read_table(self.path(k), columns=list(columns)).to_pylist()

    def all_rows(self, columns: tuple[str, ...] = COLUMNS) -> Iterator[dict[str, Any]]:
        for k in range(self.done()):
            yield from self.read(k, columns)


def _encode(rows: list[dict[str, Any]], fmt: str) -> bytes:
    if fmt == "jsonl":
        return b"".join(json.dumps({c: r.get(c) for c in COLUMNS}).encode() + b"\n" for r in rows)
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.Table.from_pylist([{c: r.get(c) for c in COLUMNS} for r in rows], schema=SCHEMA())
    buf = io.BytesIO()
    pq.write_table(table, buf)
    return buf.getvalue()


def SCHEMA() -> Any:  # noqa: N802  (a constant, built when pyarrow is first needed)
    import pyarrow as pa

    types = {
        "id": pa.string(),
        "error": pa.string(),
        "label": pa.string(),
        "prediction_set": pa.list_(pa.string()),
        "ood_flag": pa.bool_(),
        "accept": pa.bool_(),
        "suspended": pa.bool_(),
        "reason": pa.string(),
        "answer": pa.string(),
    }
    return pa.schema([(c, types.get(c, pa.float64())) for c in COLUMNS])


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
