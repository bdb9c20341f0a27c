"""Reading JSONL rows, with every problem reported as file:line before training starts."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


class DataError(ValueError):
    """A bad data file or row; the message names the file and line."""


@dataclass(frozen=True)
class Row:
    source: str  # "file:line", for error messages
    data: dict


def read_jsonl(path: str | Path) -> list[Row]:
    p = Path(path)
    if not p.is_file():
        raise DataError(f"data file '{p}' does not exist")
    rows = []
    with open(p, "rb") as f:  # bytes, so a line that is not UTF-8 is reported with its number
        for line_no, raw in enumerate(f, start=1):
            where = f"{p}:{line_no}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataError(f"{where}: not UTF-8 text (byte {raw[e.start]:#04x} at column {e.start + 1}); "
                                "save the file as UTF-8") from None
            if not line.strip():
                continue
            try:
                obj = json.loads(line.rstrip("\r\n"))  # a string left open is 'Unterminated', not a control character
            except json.JSONDecodeError as e:
                # some of json's messages end in "at" ('Unterminated string starting at'): the column completes them
                raise DataError(f"{where}: not valid JSON ({e.msg.removesuffix(' at')} at column {e.colno})") from None
            except RecursionError:
                raise DataError(f"{where}: JSON nested too deeply to read") from None
            if not isinstance(obj, dict):
                raise DataError(f"{where}: each line must be a JSON object, got {type(obj).__name__}")
            if "\\u" in line:  # only a JSON escape can produce a lone surrogate
                _check_surrogates(obj, where)
            rows.append(Row(where, obj))
    if not rows:
        raise DataError(f"data file '{p}' has no rows")
    return rows


def _check_surrogates(obj, where: str) -> None:
    """"\\ud800" is valid JSON but not text: no tokenizer or file can take it."""
    stack = [obj]
    while stack:
        x = stack.pop()
        if isinstance(x, dict):
            stack.extend(x.keys())
            stack.extend(x.values())
        elif isinstance(x, list):
            stack.extend(x)
        elif isinstance(x, str):
            try:
                x.encode("utf-8")
            except UnicodeEncodeError as e:
                raise DataError(f"{where}: a string holds a lone surrogate ({x[e.start]!r}), which is not text; "
                                "fix the row's \\u escapes") from None


def require_str(row: Row, key: str, allow_empty: bool = False) -> str:
    value = row.data.get(key)
    if not isinstance(value, str):
        raise DataError(f"{row.source}: '{key}' must be a string, got {type(value).__name__}")
    if not allow_empty and not value:
        raise DataError(f"{row.source}: '{key}' is empty")
    return value
