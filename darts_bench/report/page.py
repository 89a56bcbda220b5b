"""``<out>/index.html``: the report as one self-contained page (no network, no server).

It holds the compact table (with its markers and legend), the claims, the figures (PNG files of the
results dir inlined as base64) and a sample browser: for one example of one task, the prompt, the
target and the raw completions of a merge and of its corrected rows (first split, first sweep
variant and head seed of each method: ``ties``, ``ties+surgery``, ``ties+darts``) side by side, each
with its verdict, and the first character where they differ highlighted. The browser's data is a
JSON block in the page; an example is selected by the menus or by the URL fragment
``#task=TASK&merge=MERGE&ex=INDEX``. Rendered with a Jinja2 template
(``darts_bench/report/templates/index.html.j2``, autoescaped).
"""

from __future__ import annotations

import base64
import json
import math
import re
from importlib import metadata
from pathlib import Path
from typing import Any

import pandas as pd

from darts_bench.api import Example, Task, TaskResult
from darts_bench.artifacts import atomic_write_text
from darts_bench.rows import Row

TEMPLATE = "index.html.j2"
#: a display cell that starts with a number (right-aligned in the page's tables)
NUMBER = re.compile(r"^[-+]?(\d|\.\d|nan|inf)")


def first_difference(texts: list[str]) -> int | None:
    """The first character index at which ``texts`` do not all agree (a text that ends there while
    another goes on counts as differing); None when all are equal or fewer than two are given."""
    if len(texts) < 2 or all(t == texts[0] for t in texts):
        return None
    n = min(len(t) for t in texts)
    for i in range(n):
        if len({t[i] for t in texts}) > 1:
            return i
    return n


def comparison_groups(rows: list[Row], methods: list[str]) -> dict[str, list[str]]:
    """Per merge, the rows the sample browser puts side by side: the merge, then for each correction
    method (in ``methods`` order) its first row in table order (first calibration split, sweep
    variant and head seed)."""
    groups: dict[str, list[str]] = {}
    for r in rows:
        if r.merge and r.correction == "none":
            groups.setdefault(r.merge, []).insert(0, r.model)
    for method in methods:
        for m in groups:
            first = next((r.model for r in rows if r.merge == m and r.correction == method), None)
            if first is not None:
                groups[m].append(first)
    return groups


def _json_cell(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


def browser_data(tasks: dict[str, tuple[Task, list[Example]]], results: dict[str, dict[str, TaskResult]],
                 groups: dict[str, list[str]]) -> dict[str, Any]:
    """The sample browser's JSON: ``{"tasks": {task: {"examples": [{"id", "prompt", "target"}],
    "groups": {merge: {"rows": [row], "cells": [[{"response", "extracted", "verdict"}] per example]
    per row, "first_diff": [int | None per example]}}}}}`` from each task's
    :meth:`~darts_bench.api.Task.sample_fields` (the first response of each example; tasks without
    per-example samples are left out)."""
    out: dict[str, Any] = {"tasks": {}}
    for tname, (task, examples) in tasks.items():
        tgroups = {}
        shown: list[dict[str, Any]] | None = None
        for merge, names in groups.items():
            names = [n for n in names if n in results and results[n][tname].samples]
            if not names:
                continue
            cells = []
            for n in names:
                col = []
                fields = [task.sample_fields(e, s) for e, s in zip(examples, results[n][tname].samples)]
                for f in fields:
                    col.append({"response": f["responses"][0] if f["responses"] else "",
                                "extracted": _json_cell(f["extracted"][0]) if f["extracted"] else None,
                                "verdict": _json_cell(f["verdict"][0]) if f["verdict"] else None})
                cells.append(col)
                if shown is None:  # the prompt and target as the first shown row was given them
                    shown = [{"id": e.id, "prompt": f["prompt"], "target": str(f["target"])}
                             for e, f in zip(examples, fields)]
            tgroups[merge] = {"rows": names, "cells": cells,
                              "first_diff": [first_difference([c[i]["response"] for c in cells])
                                             for i in range(len(examples))]}
        if tgroups:
            out["tasks"][tname] = {"examples": shown, "groups": tgroups}
    return out


def _table(df: pd.DataFrame) -> dict[str, Any]:
    cells = [["" if v is None or (isinstance(v, float) and math.isnan(v)) else
              (f"{v:.4g}" if isinstance(v, float) else str(v)) for v in r] for r in df.itertuples(index=False)]
    return {"columns": [str(c) for c in df.columns], "rows": cells}


def render_page(*, name: str, protocol_line: str, compact: pd.DataFrame, legend: list[tuple[str, str]],
                claims: pd.DataFrame, figures: list[tuple[str, bytes]], browser: dict[str, Any],
                verdicts: list[str] | None = None) -> str:
    """The page's HTML (str): the verdicts first (``verdicts``: one sentence per decided line, ``**``
    marking the verdict), then ``compact`` / ``claims`` (display tables; ``compact.attrs["folded"]``: the
    columns folded away); ``legend``: (marker, text) pairs; ``figures``: (name, PNG bytes), inlined as
    base64; ``browser``: :func:`browser_data`."""
    from darts_bench.report.decide import NEXT_FILES

    import jinja2
    from markupsafe import Markup

    env = jinja2.Environment(loader=jinja2.FileSystemLoader(Path(__file__).parent / "templates"),
                             autoescape=jinja2.select_autoescape(["html", "j2"]), undefined=jinja2.StrictUndefined)
    env.tests["number_like"] = lambda v: bool(NUMBER.match(str(v)))
    # inside <script> nothing is unescaped: keep the JSON valid and unable to close the element
    js = json.dumps(browser, ensure_ascii=False, allow_nan=False)
    js = js.replace("&", "\\u0026").replace("<", "\\u003c").replace(">", "\\u003e")
    try:
        version = metadata.version("darts-bench")
    except metadata.PackageNotFoundError:
        version = "unknown"
    return env.get_template(TEMPLATE).render(
        name=name, version=version,
        protocol_lines=[re.sub(r"[*`]", "", ln).lstrip("- ").strip() for ln in protocol_line.splitlines() if ln.strip()], compact=_table(compact), legend=[(m, t.replace("`", "")) for m, t in legend],
        claims=_table(claims), figures=[{"name": n, "data": base64.b64encode(b).decode("ascii")} for n, b in figures],
        browser_json=Markup(js), verdicts=[v.split("**") for v in verdicts or []], next_files="; ".join(NEXT_FILES),
        folded=", ".join(f"{c} = {v}" for c, v in (compact.attrs.get("folded") or {}).items()))


def write_page(out_dir: Path, *, name: str, protocol_line: str, compact: pd.DataFrame,
               legend: list[tuple[str, str]], claims: pd.DataFrame, figure_files: list[str],
               tasks: dict[str, tuple[Task, list[Example]]], results: dict[str, dict[str, TaskResult]],
               rows: list[Row], methods: list[str], verdicts: list[str] | None = None) -> Path:
    """Write ``<out_dir>/index.html`` atomically (:func:`render_page`; ``figure_files`` relative to
    ``out_dir``) and return its path.

    Raises:
        FileNotFoundError: a listed figure file is missing.
    """
    figures = [(f, (Path(out_dir) / f).read_bytes()) for f in figure_files]
    html = render_page(name=name, protocol_line=protocol_line, compact=compact, legend=legend, claims=claims,
                       figures=figures, browser=browser_data(tasks, results, comparison_groups(rows, methods)),
                       verdicts=verdicts)
    path = Path(out_dir) / "index.html"
    atomic_write_text(path, html)
    return path
