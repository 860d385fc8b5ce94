"""Writing an experiment's figures: JSON (everything) and CSV (one row per point)."""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any


def scalar_columns(rows: list[dict[str, Any]]) -> list[str]:
    """Columns of every scalar figure, in first-seen order (lists stay in the JSON)."""
    columns: list[str] = []
    for row in rows:
        for key, value in row.items():
            if key not in columns and not isinstance(value, list | dict):
                columns.append(key)
    return columns


def write(out_dir: Path, name: str, document: dict[str, Any],
          rows: list[dict[str, Any]]) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path = out_dir / f"{name}.json"
    json_path.write_text(json.dumps(document, indent=2) + "\n")
    csv_path = out_dir / f"{name}.csv"
    columns = scalar_columns(rows)
    with csv_path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=columns, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    return [json_path, csv_path]
