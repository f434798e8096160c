"""Small output helpers shared by the CLI and the benchmarks: aligned tables, JSON, CSV."""

from __future__ import annotations

import csv
import json
import math
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        if math.isnan(v):
            return "-"
        return f"{v:,.0f}" if abs(v) >= 1e5 else f"{v:.4g}"
    if isinstance(v, int):
        return f"{v:,}"
    return str(v)


def table(rows: Sequence[dict[str, Any]], columns: Iterable[str] | None = None) -> str:
    """Rows as an aligned plain-text table (first row's keys unless ``columns`` is given)."""
    if not rows:
        return "(no rows)"
    cols = list(columns) if columns is not None else list(rows[0])
    cells = [[_fmt(r.get(c, "")) for c in cols] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    line = lambda vals: "  ".join(v.rjust(w) for v, w in zip(vals, widths, strict=True))
    return "\n".join([line(cols), line(["-" * w for w in widths]), *map(line, cells)])


def output_dir(path: Path, flag: str = "--out") -> Path:
    """``path`` made ready for a run's results before any work starts (created with its parents); one that is a
    file, or cannot be created or written, is a ``ValueError`` naming ``flag``, not a traceback after the run.

    >>> output_dir(Path("/dev/null"))
    Traceback (most recent call last):
    ValueError: --out /dev/null is a file, not a folder
    """
    if path.exists() and not path.is_dir():
        raise ValueError(f"{flag} {path} is a file, not a folder")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"{flag} {path}: cannot create the folder ({exc.strerror or exc})") from None
    if not os.access(path, os.W_OK):
        raise ValueError(f"{flag} {path}: the folder is not writable")
    return path


def write_json(path: Path, obj: Any) -> None:
    """``obj`` as standard JSON: a NaN or infinite figure (not measured, not defined) is ``null``, as JSON has no
    NaN (``json.dumps`` would write a bare ``NaN`` that other readers refuse)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_json_safe(obj), indent=2, allow_nan=False) + "\n")


def _json_safe(obj: Any) -> Any:
    """``obj`` with every non-finite float as ``None`` and other non-JSON numbers (numpy, torch) as floats.

    >>> _json_safe({"a": [1.0, float("nan")], "b": float("inf"), "c": "x"})
    {'a': [1.0, None], 'b': None, 'c': 'x'}
    """
    if isinstance(obj, dict):
        return {k: _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_json_safe(v) for v in obj]
    if obj is None or isinstance(obj, (str, bool, int)):
        return obj
    value = float(obj)
    return value if math.isfinite(value) else None


def write_csv(path: Path, rows: Sequence[dict[str, Any]]) -> None:
    """``rows`` as CSV; a NaN or infinite figure is an empty cell, as a missing one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        if not rows:
            return
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows({k: "" if isinstance(v, float) and not math.isfinite(v) else v for k, v in r.items()} for r in rows)
