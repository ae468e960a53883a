"""What a batch reads: a folder of images, or a CSV, JSONL or Parquet file with a named text or image-path column,
streamed in chunks in the input's order so that memory stays flat however long the input is.

Each input is ``(id, raw)``: the id is the image's path relative to the folder, the ``--id-column`` value, or the row
number; ``raw`` is the text, or the image file's bytes (a relative path is read from the table file's folder).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from service.core.errors import InvalidInput
from service.core.jsonl import json_objects

__all__ = ["IMAGE_SUFFIXES", "Source", "open_source"]

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff")
TABLE_SUFFIXES = (".csv", ".jsonl", ".parquet")


class BatchInputError(InvalidInput):
    """The batch's input cannot be read as asked (one line: the file and what is wrong)."""


@dataclass
class Source:
    """One input of a batch run: where it is, what kind, and the column to read."""

    path: Path
    kind: str  # "folder", "csv", "jsonl" or "parquet"
    column: str | None = None  # the text or image-path column of a table
    id_column: str | None = None
    images: bool = True  # a folder, or a column of image paths (else texts)

    def count(self) -> int:
        """How many inputs there are (a pass over the table's ids alone; a folder's listing)."""
        return sum(len(ids) for ids, _ in self._chunks(4096))

    def chunks(
        self, size: int, skip: int = 0, stop: int | None = None
    ) -> Iterator[tuple[list[str], list[str | bytes]]]:
        """``(ids, raws)`` of ``size`` inputs at a time, in order, inputs ``skip`` to ``stop`` (None: the end)."""
        seen = 0
        for ids, raws in self._chunks(size):
            lo, hi = seen, seen + len(ids)
            seen = hi
            if hi <= skip:
                continue
            if stop is not None and lo >= stop:
                return
            a, b = max(0, skip - lo), len(ids) if stop is None else min(len(ids), stop - lo)
            yield ids[a:b], [self._read(r) for r in raws[a:b]]

    def _read(self, raw: str) -> str | bytes:
        if not self.images:
            return raw
        path = Path(raw) if Path(raw).is_absolute() else (self._root / raw)
        try:
            return path.read_bytes()
        except OSError as e:
            raise BatchInputError(f"{path}: cannot read the image ({e.strerror or e})") from None

    @property
    def _root(self) -> Path:
        return self.path if self.kind == "folder" else self.path.parent

    def _chunks(self, size: int) -> Iterator[tuple[list[str], list[str]]]:
        rows = {"folder": self._folder, "csv": self._csv, "jsonl": self._jsonl, "parquet": self._parquet}[self.kind]()
        ids: list[str] = []
        raws: list[str] = []
        for rid, raw in rows:
            ids.append(rid)
            raws.append(raw)
            if len(ids) == size:
                yield ids, raws
                ids, raws = [], []
        if ids:
            yield ids, raws

    def _folder(self) -> Iterator[tuple[str, str]]:
        files = sorted(p for p in self.path.rglob("*") if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES)
        for p in files:
            rel = p.relative_to(self.path).as_posix()
            yield rel, rel

    def _value(self, row: dict, n: int, where: str) -> tuple[str, str]:
        assert self.column is not None
        if self.column not in row:
            raise BatchInputError(f"{self.path}: {where} has no column {self.column!r}; it has {sorted(row)}")
        value = row[self.column]
        if not isinstance(value, str) or not value:
            raise BatchInputError(f"{self.path}: {where}: column {self.column!r} is not a non-empty string")
        rid = str(row.get(self.id_column, n)) if self.id_column else str(n)
        if self.id_column and self.id_column not in row:
            raise BatchInputError(f"{self.path}: {where} has no id column {self.id_column!r}")
        return rid, value

    def _jsonl(self) -> Iterator[tuple[str, str]]:
        with self.path.open(encoding="utf-8") as f:
            try:
                for n, (lineno, row) in enumerate(json_objects(f)):
                    yield self._value(row, n, f"line {lineno}")
            except ValueError as e:
                raise BatchInputError(f"{self.path}: {e}") from None

    def _table_batches(self) -> Iterator[list[dict]]:
        import pyarrow.csv as pa_csv
        import pyarrow.parquet as pq

        columns = [c for c in (self.column, self.id_column) if c]
        try:
            if self.kind == "parquet":
                pf = pq.ParquetFile(self.path)
                missing = [c for c in columns if c not in pf.schema_arrow.names]
                if missing:
                    raise BatchInputError(f"{self.path}: no column {missing[0]!r}; it has {pf.schema_arrow.names}")
                batches = pf.iter_batches(batch_size=4096, columns=columns)
            else:
                opts = pa_csv.ConvertOptions(column_types={c: "string" for c in columns})
                batches = pa_csv.open_csv(self.path, convert_options=opts)
            for b in batches:
                yield b.to_pylist()
        except BatchInputError:
            raise
        except Exception as e:  # pyarrow's own errors: a malformed file, a column missing
            raise BatchInputError(f"{self.path}: cannot read it as {self.kind} ({str(e).splitlines()[0]})") from None

    def _rows_of_table(self) -> Iterator[tuple[str, str]]:
        n = 0
        for rows in self._table_batches():
            for row in rows:
                yield self._value(row, n, f"row {n}")
                n += 1

    _csv = _rows_of_table
    _parquet = _rows_of_table


def open_source(path: str | Path, column: str | None, id_column: str | None, modality: str) -> Source:
    """The batch input at ``path`` for a model of ``modality`` (``image`` or ``text``); a one-line error naming what
    is wrong otherwise."""
    p = Path(path)
    if not p.exists():
        raise BatchInputError(f"{p}: no such file or folder")
    if p.is_dir():
        if modality != "image":
            raise BatchInputError(f"{p}: a folder is read as images, but the model takes {modality}")
        return Source(p, "folder")
    kind = p.suffix.lower().lstrip(".")
    if f".{kind}" not in TABLE_SUFFIXES:
        raise BatchInputError(f"{p}: read a folder of images, or a .csv, .jsonl or .parquet file (got {p.suffix!r})")
    if not column:
        raise BatchInputError(f"{p}: name the column to read with --column (the text, or the image path)")
    return Source(p, kind, column, id_column, images=modality == "image")
