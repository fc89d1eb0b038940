"""A table of (path, label) rows: CSV, or Parquet when the file ends in .parquet / .pq."""

from __future__ import annotations

import csv
import pathlib

import numpy as np

from ..decode import DEFAULT_MAX_PIXELS
from ..storage import Storage, is_remote, local_copy, local_path, parent, safe_url
from ._cache import ArrayFile, ArrayFileWriter, cache_path, file_fingerprint, legacy_prefix, open_cached, remove_stale
from ._files import FileDataset, file_settings
from ._fingerprint import content_fingerprint

COLUMNS = ("path", "label")
PARQUET_SUFFIXES = (".parquet", ".pq")


def _read_table(path: str):
    """The table's ``path`` (string) and ``label`` columns as a pyarrow Table."""
    import pyarrow as pa
    import pyarrow.csv as pv
    import pyarrow.parquet as pq

    is_parquet = path.lower().endswith(PARQUET_SUFFIXES)
    try:
        if is_parquet:
            names = pq.read_schema(path).names
        else:
            with open(path, newline="", encoding="utf-8-sig") as f:
                names = next(csv.reader(f), [])
    except (OSError, UnicodeDecodeError, csv.Error, pa.ArrowException) as e:
        if isinstance(e, FileNotFoundError):
            raise FileNotFoundError(f"{path}: manifest not found") from None
        raise ValueError(f"{path}: cannot read the manifest's {'schema' if is_parquet else 'header'}: {e}") from None
    for col in COLUMNS:
        if col not in names:
            raise ValueError(f"{path}: manifest has no column {col!r} (its columns: {', '.join(map(str, names)) or 'none'})")
    try:
        if is_parquet:
            return pq.read_table(path, columns=list(COLUMNS))
        # streamed in 16 MB blocks (read_csv holds the whole file as well as the table: a 10M-row,
        # 559 MB CSV peaked at 1.49 GB RSS that way, 0.79 GB streamed; the same table either way)
        reader = pv.open_csv(
            path,
            read_options=pv.ReadOptions(block_size=16 << 20),
            convert_options=pv.ConvertOptions(
                include_columns=list(COLUMNS),
                column_types={"path": pa.string()},
                null_values=[""],  # only empty cells are missing; "NA" may be a class
                strings_can_be_null=True,
            ),
        )
        return pa.Table.from_batches(list(reader), schema=reader.schema)
    except (OSError, pa.ArrowException) as e:
        raise ValueError(f"{path}: cannot read the manifest: {e}") from None


def _check_no_nulls(path: str, name: str, column) -> None:
    import pyarrow.compute as pc

    if column.null_count:
        row = int(pc.index(pc.is_null(column), True).as_py())
        raise ValueError(f"{path}: row {row} (0-based, header not counted) has no {name}")


def _path_chunks(column) -> tuple[np.ndarray, list[np.ndarray]]:
    """(offsets int64 [n + 1], data chunks) of a string column, from its arrow buffers (no Python strings)."""
    import pyarrow as pa

    n = len(column)
    offsets = np.empty(n + 1, dtype=np.int64)
    offsets[0] = 0
    pieces = []
    row = 0
    for chunk in column.chunks:
        m = len(chunk)
        if m == 0:
            continue
        _, off_buf, data_buf = chunk.buffers()
        off_dtype = np.int64 if pa.types.is_large_string(chunk.type) else np.int32
        offs = np.frombuffer(off_buf, dtype=off_dtype)[chunk.offset : chunk.offset + m + 1]
        start, end = int(offs[0]), int(offs[-1])
        offsets[row + 1 : row + m + 1] = offs[1:] - start + offsets[row]
        if end > start:
            pieces.append(np.frombuffer(data_buf, dtype=np.uint8)[start:end])
        row += m
    return offsets, pieces


def _labels(path: str, column) -> tuple[np.ndarray, list[str]]:
    """(labels int64 [n], classes) from an integer or string label column."""
    import pyarrow as pa
    import pyarrow.compute as pc

    t = column.type
    if pa.types.is_dictionary(t):
        column = column.cast(t.value_type)
        t = column.type
    if getattr(pa.types, "is_string_view", lambda _: False)(t):
        column = column.cast(pa.large_string())
        t = column.type
    if pa.types.is_integer(t):
        labels = column.to_numpy().astype(np.int64, copy=False)
        if len(labels) and labels.min() < 0:
            row = int(np.argmax(labels < 0))
            raise ValueError(f"{path}: row {row} (0-based, header not counted) has a negative label {labels[row]}")
        return labels, [str(i) for i in range(int(labels.max()) + 1)]
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        unique = pc.unique(column)
        unique = unique.take(pc.array_sort_indices(unique))
        labels = pc.index_in(column, value_set=unique).to_numpy().astype(np.int64, copy=False)
        return labels, unique.to_pylist()
    raise ValueError(f"{path}: label column has type {t}; expected integers or strings")


def _build(table_path: str, out: pathlib.Path, fingerprint) -> None:
    import pyarrow as pa

    try:
        _build_from_arrow(table_path, out, fingerprint)
    finally:
        pa.default_memory_pool().release_unused()  # else the pool keeps ~1.6 GB after a 10M-row CSV


def _build_from_arrow(table_path: str, out: pathlib.Path, fingerprint) -> None:
    import pyarrow as pa

    table = _read_table(table_path)
    if table.num_rows == 0:
        raise ValueError(f"{table_path}: manifest has no rows")
    paths, labels_col = table.column("path"), table.column("label")
    del table
    if not (pa.types.is_string(paths.type) or pa.types.is_large_string(paths.type)):
        try:
            paths = paths.cast(pa.large_string())
        except pa.ArrowException:
            raise ValueError(f"{table_path}: path column has type {paths.type}; expected strings") from None
    _check_no_nulls(table_path, "path", paths)
    _check_no_nulls(table_path, "label", labels_col)
    labels, classes = _labels(table_path, labels_col)
    del labels_col
    offsets, pieces = _path_chunks(paths)
    empty = np.flatnonzero(offsets[1:] == offsets[:-1])
    if len(empty):
        raise ValueError(f"{table_path}: row {int(empty[0])} (0-based, header not counted) has an empty path")
    content = content_fingerprint(Manifest.kind, [table_path])
    with ArrayFileWriter(out) as w:
        w.add_chunks("path_bytes", np.uint8, (int(offsets[-1]),), pieces)
        w.add("path_offsets", offsets)
        w.add("labels", labels)
        w.meta.update(kind=Manifest.kind, source=fingerprint, classes=classes, fingerprint=content)


class Manifest(FileDataset):
    """Rows of a CSV or Parquet table with columns ``path`` and ``label`` (others ignored).

    Sample ``i`` is row ``i``. Paths are relative to ``cfg.root`` (default: the table's folder);
    absolute paths are used as they are. Integer labels are used as they are (classes
    ``"0".."max"``); string labels become their position among the sorted distinct values
    (classes = those values). load_image(i): uint8 [H, W, 3] RGB; source(i): the row's path.

    The server (``build=True``) reads the table once with pyarrow and writes the packed index
    (see ``_files``) to ``cache_dir``, keyed by the table's path, size and mtime; it reuses an
    index already there. Workers (``build=False``) only map it. ``fingerprint``: a hash of the
    table file's content, computed with the index (the image files are not read). The constructor raises
    FileNotFoundError if the table is missing, ValueError (naming the file, and the column or
    row) for a missing ``path``/``label`` column, a null or empty value, a negative or
    non-integer, non-string label, or an empty table, and ``_cache.IndexMissingError``
    (``build=False``) if the server has not built the index. load_image raises SampleError.
    """

    kind = "manifest"

    def __init__(self, name: str, cfg, cache_dir: pathlib.Path, *, build: bool, max_pixels: int = DEFAULT_MAX_PIXELS):
        super().__init__(name, max_pixels=max_pixels, **file_settings(cfg))
        options = self.storage_options
        remote = is_remote(str(cfg.path))
        table_path = str(cfg.path) if remote else local_path(cfg.path)
        if cfg.root is not None:
            root = str(cfg.root).rstrip("/") if is_remote(str(cfg.root)) else local_path(cfg.root)
        else:
            root = parent(table_path)
        storage = Storage(table_path, options)
        try:
            if remote:
                fingerprint = {"url": safe_url(table_path), **storage.info(table_path), **options.fingerprint_part()}
            else:
                fingerprint = file_fingerprint(table_path)
        except FileNotFoundError:
            raise FileNotFoundError(f"{safe_url(table_path)}: manifest not found (dataset {name!r})") from None
        out = cache_path(cache_dir, self.kind, safe_url(table_path), fingerprint,
                         identity=options.fingerprint_part() if remote else None)
        index = None
        if build:
            try:
                index = ArrayFile(out)
            except (FileNotFoundError, ValueError):
                if remote:
                    _build_remote(storage, table_path, out, fingerprint)
                else:
                    _build(table_path, out, fingerprint)
                remove_stale(out, legacy_prefix(self.kind, safe_url(table_path)) if remote else None)
        if index is None:
            index = open_cached(out, what=f"dataset {name!r} ({self.kind}, {safe_url(table_path)})")
        self._attach(index, root)


def _build_remote(storage: Storage, url: str, out: pathlib.Path, fingerprint) -> None:
    """Build the index of a manifest on remote storage from a local copy next to ``out``
    (streamed to disk, deleted afterwards: memory stays as for a local table)."""
    with local_copy(storage, url, out) as copy:
        try:
            _build(copy, out, fingerprint)
        except ValueError as e:  # name the manifest, not our copy
            raise ValueError(str(e).replace(copy, safe_url(url))) from None
