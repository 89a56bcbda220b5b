"""Markdown tables of the report's files (table.md, claims.md, the README findings): one formatter, so a
number reads the same everywhere (floats to 4 significant digits, missing values empty)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd


def _fmt(v: Any) -> str:
    if v is None or (isinstance(v, float) and np.isnan(v)):
        return ""
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def to_markdown(df: pd.DataFrame) -> str:
    """``df`` as a GitHub markdown table (header, separator, one line per row), ending in a newline."""
    cols = list(df.columns)
    lines = ["| " + " | ".join(cols) + " |", "|" + "|".join("---" for _ in cols) + "|"]
    for _, r in df.iterrows():
        lines.append("| " + " | ".join(_fmt(r[c]) for c in cols) + " |")
    return "\n".join(lines) + "\n"
