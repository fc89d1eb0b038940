"""A table of (path, label) rows: CSV, or Parquet when the file ends in .parquet / .pq."""

from __future__ import annotations

import csv
import pathlib

import numpy as np

from batchd.sampler import check_weights

from ..decode import DEFAULT_MAX_PIXELS
from ..storage import Storage, is_remote, local_copy, local_path, parent, safe_url
from ._cache import ArrayFile, ArrayFileWriter, cache_path, file_fingerprint, legacy_prefix, open_cached, remove_stale
from ._files import FileDataset, file_settings
from ._fingerprint import content_fingerprint

COLUMNS = ("path", "label")
PARQUET_SUFFIXES = (".parquet", ".pq")


def _read_table(path: str, weight_column: str | None = None):
    """The table's ``path`` (string) and ``label`` columns (and ``weight_column``) as a pyarrow Table."""
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
    columns = list(COLUMNS) + ([weight_column] if weight_column else [])
    for col in columns:
        if col not in names:
            what = "weight_column " if col == weight_column else ""
            raise ValueError(f"{path}: manifest has no {what}column {col!r} (its columns: "
                             f"{', '.join(map(str, names)) or 'none'})")
    try:
        if is_parquet:
            return pq.read_table(path, columns=columns)
        # streamed in 16 MB blocks (read_csv holds the whole file as well as the table: a 10M-row,
        # 559 MB CSV peaked at 1.49 GB RSS that way, 0.79 GB streamed; the same table either way)
        reader = pv.open_csv(
            path,
            read_options=pv.ReadOptions(block_size=16 << 20),
            convert_options=pv.ConvertOptions(
                include_columns=columns,
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


def _weights(path: str, name: str, column) -> np.ndarray:
    """float64 [n] from the numeric ``weight_column``; ValueError naming the row of a null,
    negative, NaN or infinite weight, or all zero (``batchd.sampler.check_weights``)."""
    import pyarrow as pa

    if not (pa.types.is_integer(column.type) or pa.types.is_floating(column.type)):
        raise ValueError(f"{path}: weight_column {name!r} has type {column.type}; expected numbers")
    _check_no_nulls(path, f"weight (column {name!r})", column)
    weights = column.to_numpy().astype(np.float64)
    try:
        check_weights(weights, f"weight_column {name!r}")
    except ValueError as e:  # "weight_column 'w'[3] is nan; ..." -> the row
        bad = ~np.isfinite(weights) | (weights < 0)
        if bad.any():
            row = int(np.argmax(bad))
            raise ValueError(f"{path}: row {row} (0-based, header not counted) has weight {float(weights[row])!r} in "
                             f"weight_column {name!r}; weights must be finite and non-negative") from None
        raise ValueError(f"{path}: {e}") from None
    return weights


def _build(table_path: str, out: pathlib.Path, fingerprint, weight_column: str | None = None) -> None:
    import pyarrow as pa

    try:
        _build_from_arrow(table_path, out, fingerprint, weight_column)
    finally:
        pa.default_memory_pool().release_unused()  # else the pool keeps ~1.6 GB after a 10M-row CSV


def _build_from_arrow(table_path: str, out: pathlib.Path, fingerprint, weight_column: str | None = None) -> None:
    import pyarrow as pa

    table = _read_table(table_path, weight_column)
    if table.num_rows == 0:
        raise ValueError(f"{table_path}: manifest has no rows")
    paths, labels_col = table.column("path"), table.column("label")
    weights = _weights(table_path, weight_column, table.column(weight_column)) if weight_column else None
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
        if weights is not None:
            w.add("weights", weights)
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

    ``cfg.weight_column``: a numeric column of per-sample weights for weighted sampling
    (``weights()``, float64 [n]; ``batchd.WeightedRandomSampler("dataset", ...)``), read with the
    index; ValueError naming the row of a missing, negative, NaN or infinite weight, or all zero.
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
        weight_column = getattr(cfg, "weight_column", None)
        identity = options.fingerprint_part() if remote else None
        if weight_column:  # another index (it holds the weights): its own file
            identity = {"storage": identity, "weight_column": weight_column}
        out = cache_path(cache_dir, self.kind, safe_url(table_path), fingerprint, identity=identity)
        index = None
        if build:
            try:
                index = ArrayFile(out)
            except (FileNotFoundError, ValueError):
                if remote:
                    _build_remote(storage, table_path, out, fingerprint, weight_column)
                else:
                    _build(table_path, out, fingerprint, weight_column)
                remove_stale(out, legacy_prefix(self.kind, safe_url(table_path)) if remote else None)
        if index is None:
            index = open_cached(out, what=f"dataset {name!r} ({self.kind}, {safe_url(table_path)})")
        self._attach(index, root)
        self._weights = index.arrays.get("weights") if weight_column else None

    def weights(self) -> np.ndarray | None:
        return None if self._weights is None else np.asarray(self._weights, np.float64)


def _build_remote(storage: Storage, url: str, out: pathlib.Path, fingerprint, weight_column: str | None = None) -> None:
    """Build the index of a manifest on remote storage from a local copy next to ``out``
    (streamed to disk, deleted afterwards: memory stays as for a local table)."""
    with local_copy(storage, url, out) as copy:
        try:
            _build(copy, out, fingerprint, weight_column)
        except ValueError as e:  # name the manifest, not our copy
            raise ValueError(str(e).replace(copy, safe_url(url))) from None
