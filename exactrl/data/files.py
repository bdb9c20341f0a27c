"""Reading a data file into rows, whatever its format: JSONL (exactrl/data/jsonl.py), Parquet,
Arrow, or a directory written by the datasets library's ``save_to_disk``. Every row is a dict
named by where it came from, so the same row checks and file:row errors apply to all of them.

Columnar formats give every row every column; a column a row does not use holds null there,
so nulls are dropped, as the key would be absent from that row in JSONL."""

from __future__ import annotations

from pathlib import Path

from exactrl.data.jsonl import DataError, Row, read_jsonl

INSTALL = "pip install 'exactrl[data]' (the datasets library, which brings pyarrow)"


def read_rows(path: str | Path) -> list[Row]:
    """The rows of ``path``: .parquet, .arrow, a save_to_disk directory, else JSONL."""
    p = Path(path)
    if not p.exists():
        raise DataError(f"data file '{p}' does not exist")
    if p.is_dir():
        return _rows(p, _saved_dataset(p))
    if p.suffix == ".parquet":
        return _rows(p, _parquet(p))
    if p.suffix == ".arrow":
        return _rows(p, _arrow(p))
    return read_jsonl(p)


def _rows(p: Path, records: list[dict]) -> list[Row]:
    """Rows named ``file:row i`` (0-based, as dataset[i] and pandas number them)."""
    rows = [Row(f"{p}:row {i}", {k: v for k, v in record.items() if v is not None}) for i, record in enumerate(records)]
    if not rows:
        raise DataError(f"data file '{p}' has no rows")
    return rows


def _parquet(p: Path) -> list:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"reading the Parquet file '{p}' needs pyarrow: {INSTALL}") from None
    try:
        return pq.read_table(p).to_pylist()
    except (OSError, ValueError) as e:  # pyarrow's ArrowInvalid is a ValueError
        raise DataError(f"cannot read '{p}' as Parquet: {e}") from None


def _arrow(p: Path) -> list:
    """An Arrow IPC file: the stream format the datasets library writes (its cache files and
    save_to_disk shards), or the random-access file format (Feather v2) other tools write."""
    try:
        import pyarrow as pa
    except ImportError:
        raise DataError(f"reading the Arrow file '{p}' needs pyarrow: {INSTALL}") from None
    errors = []
    for open_ in (pa.ipc.open_stream, pa.ipc.open_file):
        try:
            with pa.memory_map(str(p)) as source:
                return open_(source).read_all().to_pylist()
        except (OSError, ValueError) as e:
            errors.append(str(e))
    raise DataError(f"cannot read '{p}' as an Arrow IPC stream or file: {errors[-1]}")


def _saved_dataset(p: Path) -> list:
    """A directory written by Dataset.save_to_disk, read with the datasets library itself."""
    if (p / "dataset_dict.json").is_file():
        splits = sorted(d.name for d in p.iterdir() if (d / "state.json").is_file())
        raise DataError(f"'{p}' holds a DatasetDict (splits {splits}): give one split's directory, e.g. {p / splits[0]}"
                        if splits else f"'{p}' holds a DatasetDict without splits")
    if not (p / "state.json").is_file():
        raise DataError(f"data directory '{p}' is not a save_to_disk dataset (no state.json); give a .jsonl, .parquet "
                        "or .arrow file, or a directory written by Dataset.save_to_disk")
    try:
        from datasets import load_from_disk
    except ImportError:
        raise DataError(f"reading the saved dataset '{p}' needs the datasets library: {INSTALL}") from None
    try:
        return load_from_disk(str(p)).to_list()
    except (OSError, ValueError) as e:
        raise DataError(f"cannot read the saved dataset '{p}': {e}") from None
