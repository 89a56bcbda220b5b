"""``darts-bench compare BASELINE_DIR NEW_DIR``: which table cells of a new run moved beyond their
tolerance from a baseline results dir, as a markdown table (stdout, ``--out FILE``, and appended to
``$GITHUB_STEP_SUMMARY`` when that is set), exit status 1 on a regression.

A results dir is what ``darts-bench run`` writes: ``results.json`` (rows + manifest) and
``table_<task>.csv`` (each metric with its 95% bootstrap CI, and the ``DARTS - surgery`` paired rows).
A CI is read from the numeric ``<column>_lo`` / ``<column>_hi`` pair, or from the ``<column>_ci``
text cell (``[lo, hi]``) of results written before the CSVs held numbers, so either baseline works.
Each numeric cell gets a tolerance from the rule of its column (:func:`tolerance`):

* **exact** (equal by construction on any machine): ``n_<task>``, ``params_added``(``_pct``), row
  identity (``merge``, ``correction``, ``calibration``) and string columns such as
  ``alpacaeval_win_rate_kind``.
* **CI**: a column with a bootstrap CI in the baseline's ``table_<task>.csv`` (headline metrics,
  ``ref_nll``, the paired rows) may move by ``CI_FRACTION`` (0.1) of the baseline CI's half-width:
  about 0.05 standard errors, far above float noise and far below a statistically visible change.
  ``<task>_pos_slope`` uses its own ``_pos_slope_lo`` / ``_hi`` (or ``_pos_slope_ci``) the same way.
* **CI bound** (``<column>_lo`` / ``_hi`` next to ``<column>``): ``CI_FRACTION`` of that CI's
  half-width, as its estimate.
* **count** (pass@k, exact match, win rate, judge consistency: fractions of examples): the CI rule,
  but at least one example's worth (``1/n``, x100 for a win rate in %): a greedy generation whose
  top-2 logits tie within float noise can flip one verdict on another CPU. The table shows by how
  many examples a count cell moved.
* **relative** (token-mean diagnostics without a recorded CI: ``rep_l1``, ``kl_expert``,
  ``agree_top1``, ``gap_closed`` ...): ``max(REL_TOL * |baseline|, ABS_TOL)`` (1% / 1e-3).
* **derived** (``bias_grows``, ``pos_slope_ci``, ``*_flag``, ``*_note``: recomputed from other cells): a change
  is listed for information; the cells it derives from carry the verdict.

Rows or columns of the baseline missing from the new run are regressions; new ones are listed.
The manifests' platform, Python, package versions, seed, pool key, limits and task versions are
shown side by side. Runs of different experiments (config values, suite, seed or limits:
:func:`config_changes`) are refused (:class:`ConfigChangeError`, exit status 2) unless
``--allow-config-change``; then the differences are flagged and the comparison says little.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

CI_FRACTION = 0.1
REL_TOL = 1e-2
ABS_TOL = 1e-3
IDENTITY = ("model",)
EXACT_COLUMNS = ("merge", "correction", "calibration", "params_added", "params_added_pct")
DERIVED_SUFFIXES = ("_bias_grows", "_pos_slope_ci", "_flag", "_note")
COUNT_PATTERNS = ("pass@", "_em_", "win_rate", "judge_consistency")
_CI_RE = re.compile(r"\[\s*([-+0-9.eE]+|nan|inf|-inf)\s*,\s*([-+0-9.eE]+|nan|inf|-inf)\s*\]")


@dataclass
class Cell:
    """One compared cell: ``status`` is ``regression``, ``changed`` (within tolerance), ``info``
    (derived or new) or ``same``."""

    row: str
    column: str
    baseline: Any
    new: Any
    status: str
    tolerance: float | None = None
    rule: str = ""
    note: str = ""


class CompareError(ValueError):
    """A results dir cannot be compared (missing or malformed ``results.json``)."""


class ConfigChangeError(CompareError):
    """The two runs were made with different configurations, suites, seeds or limits."""


#: config keys that name places (and where trackers log), not the experiment
CONFIG_PLACES = ("work_dir", "out_dir", "data_dir", "loggers", "tracking")


def _config_diff(a: Any, b: Any, where: str, out: list[str]) -> None:
    """Differing values of keys present on both sides (a key on one side only is a newer or older
    schema, whose default the other run used, not a change of the experiment)."""
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) & set(b)):
            _config_diff(a[k], b[k], f"{where}.{k}" if where else str(k), out)
    elif a != b:
        out.append(f"{where}: {json.dumps(a, sort_keys=True)} -> {json.dumps(b, sort_keys=True)}")


def config_changes(mb: dict, mn: dict) -> list[str]:
    """What makes two runs different experiments: the seed, the suite, the example limits and the
    config's values (less :data:`CONFIG_PLACES`), as ``"key: baseline -> new"`` lines."""
    out: list[str] = []
    for key in ("seed", "suite", "limits"):
        if key in mb and key in mn and mb[key] != mn[key]:
            out.append(f"{key}: {json.dumps(mb[key], sort_keys=True)} -> {json.dumps(mn[key], sort_keys=True)}")
    cb = {k: v for k, v in (mb.get("config") or {}).items() if k not in CONFIG_PLACES}
    cn = {k: v for k, v in (mn.get("config") or {}).items() if k not in CONFIG_PLACES}
    _config_diff(cb, cn, "config", out)
    return out


def parse_ci(text: Any) -> tuple[float, float] | None:
    """``(lo, hi)`` from a table cell such as ``[0.12, 0.3]`` (suffixes ignored); None if absent."""
    if not isinstance(text, str):
        return None
    m = _CI_RE.search(text)
    if not m:
        return None
    lo, hi = float(m.group(1)), float(m.group(2))
    return (lo, hi) if math.isfinite(lo) and math.isfinite(hi) else None


def row_ci(row: Any, column: str) -> tuple[float, float] | None:
    """The CI of ``row[column]``: the numeric ``<column>_lo`` / ``<column>_hi`` pair when both are
    finite, else the ``<column>_ci`` text cell (:func:`parse_ci`); None if neither is there."""
    lo, hi = _num(row.get(column + "_lo")), _num(row.get(column + "_hi"))
    if lo is not None and hi is not None and math.isfinite(lo) and math.isfinite(hi):
        return lo, hi
    return parse_ci(row.get(column + "_ci"))


def _ci_bound_of(column: str, row: Any) -> str | None:
    """The estimate column whose CI bound ``column`` is (``x_lo`` / ``x_hi`` with ``x`` in the row)."""
    if column.endswith(("_lo", "_hi")) and column[:-3] in row:
        return column[:-3]
    return None


def load_results(d: Path) -> dict:
    """``results.json`` plus every ``table_<task>.csv`` of a results dir.

    Raises:
        CompareError: the dir or its ``results.json`` is missing, unreadable or has no ``rows``.
    """
    d = Path(d)
    f = d / "results.json"
    if not f.is_file():
        raise CompareError(f"{d}: no results.json (not a darts-bench results dir?)")
    try:
        payload = json.loads(f.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CompareError(f"{f}: cannot read ({e})") from None
    if not isinstance(payload.get("rows"), list):
        raise CompareError(f"{f}: no 'rows' list")
    tables = {}
    for t in sorted(d.glob("table_*.csv")):
        tables[t.stem[len("table_"):]] = pd.read_csv(t, dtype=object, keep_default_na=False)
    payload["tables"] = tables
    return payload


def _num(v: Any) -> float | None:
    if v is None or isinstance(v, bool):
        return None
    if isinstance(v, (int, float)):
        return float(v)
    if isinstance(v, str):
        if v.strip() == "":
            return None
        try:
            return float(v)
        except ValueError:
            return None
    return None


def _missing(v: Any) -> bool:
    return v is None or (isinstance(v, float) and math.isnan(v)) or v == ""


def _n_examples(row: dict, column: str) -> int | None:
    for k, v in row.items():
        if k.startswith("n_") and column.startswith(k[2:] + "_") and isinstance(v, (int, float)) and v > 0:
            return int(v)
    return None


def tolerance(column: str, base_row: dict, ci: tuple[float, float] | None) -> tuple[float | None, str]:
    """``(tolerance, rule)`` of one cell; tolerance None means "exact" or "derived" (see the module doc)."""
    if column.endswith(DERIVED_SUFFIXES):
        return None, "derived"
    if column in EXACT_COLUMNS or column.startswith("n_"):
        return 0.0, "exact"
    if column.endswith("_pos_slope"):
        ci = row_ci(base_row, column)
    est = _ci_bound_of(column, base_row)
    if est is not None:  # a CI bound moves with its estimate: the estimate's CI rule
        ci = row_ci(base_row, est)
        half = (ci[1] - ci[0]) / 2 if ci else None
        if half is not None:
            return CI_FRACTION * half, f"{CI_FRACTION:g} x CI half-width (CI bound)"
    half = (ci[1] - ci[0]) / 2 if ci else None
    if any(p in column for p in COUNT_PATTERNS):
        n = _n_examples(base_row, column)
        scale = 100.0 if "win_rate" in column else 1.0
        step = scale / n if n else 0.0
        tol = max(CI_FRACTION * half if half is not None else 0.0, step)
        return tol, f"count (one example = {step:.4g})"
    if half is not None:
        return CI_FRACTION * half, f"{CI_FRACTION:g} x CI half-width"
    base = _num(base_row.get(column))
    return max(REL_TOL * abs(base or 0.0), ABS_TOL), f"relative {REL_TOL:g} (no CI recorded)"


def _compare_cell(row: str, col: str, b: Any, n: Any, base_row: dict, ci) -> Cell:
    tol, rule = tolerance(col, base_row, ci)
    if _missing(b) and _missing(n):
        return Cell(row, col, b, n, "same", tol, rule)
    if rule == "derived":
        return Cell(row, col, b, n, "same" if b == n else "info", None, rule)
    bn, nn = _num(b), _num(n)
    if bn is None or nn is None:  # strings, or a cell that appeared/disappeared
        status = "same" if b == n else "regression"
        note = "" if status == "same" else ("cell emptied" if _missing(n) else "cell filled" if _missing(b) else "")
        return Cell(row, col, b, n, status, tol, "exact" if tol == 0.0 else rule, note)
    diff = nn - bn
    if diff == 0:
        return Cell(row, col, b, n, "same", tol, rule)
    note = ""
    if rule.startswith("count"):
        k = _n_examples(base_row, col)
        if k:
            scale = 100.0 if "win_rate" in col else 1.0
            note = f"{abs(diff) * k / scale:.3g} examples"
    status = "regression" if (not math.isfinite(diff) or abs(diff) > tol) else "changed"
    return Cell(row, col, b, n, status, tol, rule, note)


def compare(baseline_dir: Path, new_dir: Path, allow_config_change: bool = False) -> tuple[list[Cell], dict]:
    """Every cell of the baseline's rows and per-task tables against the new run's.

    Returns ``(cells, manifests)`` with ``manifests`` = ``{"baseline": ..., "new": ...}``.
    Raises:
        CompareError: either dir is not a readable results dir.
        ConfigChangeError: the runs differ in config, suite, seed or limits
            (:func:`config_changes`) and ``allow_config_change`` is false.
    """
    base, new = load_results(Path(baseline_dir)), load_results(Path(new_dir))
    changes = config_changes(base.get("manifest") or {}, new.get("manifest") or {})
    if changes and not allow_config_change:
        listed = "; ".join(changes[:8]) + (f"; ... {len(changes) - 8} more" if len(changes) > 8 else "")
        raise ConfigChangeError(
            f"refusing to compare {new_dir} with {baseline_dir}: they are runs of different experiments "
            f"({len(changes)} difference(s): {listed}), so moved cells would be the configuration's doing, "
            "not regressions. Rerun with the baseline's config, or pass --allow-config-change to compare anyway")
    cells: list[Cell] = []
    b_rows = {r["model"]: r for r in base["rows"]}
    n_rows = {r["model"]: r for r in new["rows"]}
    # CI per (row, column) from the baseline's per-task tables
    cis: dict[tuple[str, str], tuple[float, float]] = {}
    for t, df in base["tables"].items():
        for _, r in df.iterrows():
            for c in df.columns:
                if c == "model" or c.endswith(("_ci", "_lo", "_hi")):
                    continue
                ci = row_ci(r, c)
                if ci:
                    cis[(r["model"], c)] = ci
    b_cols = list(dict.fromkeys(c for r in base["rows"] for c in r))
    n_cols = set(c for r in new["rows"] for c in r)
    for c in b_cols:
        if c not in n_cols and c not in IDENTITY:
            cells.append(Cell("(all rows)", c, "present", "missing", "regression", None, "exact", "column removed"))
    for c in sorted(n_cols - set(b_cols)):
        cells.append(Cell("(all rows)", c, "missing", "present", "info", None, "", "new column"))
    for name, br in b_rows.items():
        nr = n_rows.get(name)
        if nr is None:
            cells.append(Cell(name, "(row)", "present", "missing", "regression", None, "exact", "row removed"))
            continue
        for c in b_cols:
            if c in IDENTITY or c not in n_cols:
                continue
            cells.append(_compare_cell(name, c, br.get(c), nr.get(c), br, cis.get((name, c))))
    for name in n_rows:
        if name not in b_rows:
            cells.append(Cell(name, "(row)", "missing", "present", "info", None, "", "new row"))
    # the paired DARTS - surgery rows live only in the per-task tables
    for t, bdf in base["tables"].items():
        ndf = new["tables"].get(t)
        paired = [r for _, r in bdf.iterrows() if " - " in str(r["model"])]
        if ndf is None:
            if paired:
                cells.append(Cell(f"table_{t}", "(table)", "present", "missing", "regression", None, "exact"))
            continue
        n_by = {r["model"]: r for _, r in ndf.iterrows()}
        for br in paired:
            nr = n_by.get(br["model"])
            if nr is None:
                cells.append(Cell(br["model"], "(row)", "present", "missing", "regression", None, "exact", "row removed"))
                continue
            for c in bdf.columns:
                if c == "model" or c.endswith("_ci") or c.endswith(DERIVED_SUFFIXES):
                    continue
                est = _ci_bound_of(c, br)
                ci = row_ci(br, est if est is not None else c)
                b, n = _num(br.get(c)), _num(nr.get(c)) if c in nr else None
                if (b is None or math.isnan(b)) and (n is None or math.isnan(n)):
                    continue  # empty on both sides (e.g. no CI without token counts)
                if ci is None:
                    status = "same" if b == n else "regression"
                    cells.append(Cell(br["model"], c, b, n, status, 0.0, "exact (no CI)"))
                    continue
                tol = CI_FRACTION * (ci[1] - ci[0]) / 2
                if b is None or n is None:
                    cells.append(Cell(br["model"], c, b, n, "regression", tol, "paired CI", "cell emptied/filled"))
                    continue
                d = n - b
                status = "same" if d == 0 else ("regression" if abs(d) > tol else "changed")
                cells.append(Cell(br["model"], c, b, n, status, tol, f"{CI_FRACTION:g} x paired CI half-width"))
    return cells, {"baseline": base.get("manifest") or {}, "new": new.get("manifest") or {}}


def _fmt(v: Any) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:.6g}"
    return str(v).replace("|", "\\|")


def manifest_rows(mb: dict, mn: dict) -> list[tuple[str, str, str, bool]]:
    """``(field, baseline, new, differs)`` for the manifest fields that explain a moved cell."""
    out = []

    def add(name, a, b):
        out.append((name, _fmt(a), _fmt(b), a != b))

    add("platform", mb.get("platform"), mn.get("platform"))
    add("cpu", json.dumps(mb.get("cpu"), sort_keys=True) if mb.get("cpu") else None,
        json.dumps(mn.get("cpu"), sort_keys=True) if mn.get("cpu") else None)
    add("python", mb.get("python"), mn.get("python"))
    pk = sorted(set(mb.get("packages") or {}) | set(mn.get("packages") or {}))
    for p in pk:
        add(f"package {p}", (mb.get("packages") or {}).get(p), (mn.get("packages") or {}).get(p))
    add("seed", mb.get("seed"), mn.get("seed"))
    add("suite", mb.get("suite"), mn.get("suite"))
    add("pool key", (mb.get("pool") or {}).get("key"), (mn.get("pool") or {}).get("key"))
    add("limits", json.dumps(mb.get("limits"), sort_keys=True), json.dumps(mn.get("limits"), sort_keys=True))
    add("task versions", json.dumps(mb.get("task_versions"), sort_keys=True),
        json.dumps(mn.get("task_versions"), sort_keys=True))
    # the sections whose values differ by the rule that refuses a comparison (config_changes: keys on one side
    # only are a newer or older schema, not a change of the experiment)
    diff_keys = sorted({c.split(":", 1)[0].split(".")[1] for c in config_changes(mb, mn) if c.startswith("config.")})
    add("config sections that differ", "", ", ".join(diff_keys) or "none")
    out[-1] = (out[-1][0], out[-1][1], out[-1][2], bool(diff_keys))
    return out


def render(cells: list[Cell], manifests: dict, baseline_dir: str, new_dir: str, max_listed: int = 200) -> str:
    """The markdown report: verdict line, cells beyond tolerance, changes within tolerance, manifests."""
    reg = [c for c in cells if c.status == "regression"]
    changed = [c for c in cells if c.status == "changed"]
    info = [c for c in cells if c.status == "info"]
    n_cmp = sum(c.status != "info" for c in cells)
    lines = [f"# darts-bench compare\n", f"baseline `{baseline_dir}` vs new `{new_dir}`: {n_cmp} cells compared\n"]
    if reg:
        lines.append(f"**REGRESSION: {len(reg)} cells moved beyond their tolerance** "
                     f"({len(changed)} more changed within tolerance)\n")
    else:
        lines.append(f"**no regression** ({len(changed)} cells changed within tolerance, "
                     f"{n_cmp - len(changed)} identical)\n")
    mrows = manifest_rows(manifests["baseline"], manifests["new"])
    if config_changes(manifests["baseline"], manifests["new"]):  # the refusal's rule: silent when nothing changed
        lines.append("\nWarning: the two runs differ in seed, suite or config (see the manifest table): "
                     "moved cells may be the configuration's doing.\n")

    def table(title: str, cs: list[Cell]) -> None:
        if not cs:
            return
        lines.append(f"\n## {title} ({len(cs)})\n")
        lines.append("| row | column | baseline | new | change | tolerance | rule | note |")
        lines.append("|---|---|---|---|---|---|---|---|")
        for c in cs[:max_listed]:
            bn, nn = _num(c.baseline), _num(c.new)
            ch = f"{nn - bn:+.3g}" if bn is not None and nn is not None else ""
            tol = "" if c.tolerance is None else f"{c.tolerance:.3g}"
            lines.append(f"| {_fmt(c.row)} | {_fmt(c.column)} | {_fmt(c.baseline)} | {_fmt(c.new)} | {ch} | "
                         f"{tol} | {c.rule} | {c.note} |")
        if len(cs) > max_listed:
            lines.append(f"\n... {len(cs) - max_listed} more not listed")

    table("Cells beyond tolerance", reg)
    table("Changed within tolerance", changed)
    table("Information (derived cells, new rows or columns)", info)
    lines.append("\n## Manifests side by side\n")
    lines.append("| field | baseline | new | differs |")
    lines.append("|---|---|---|---|")
    for name, a, b, d in mrows:
        if name.startswith("package ") and not d:
            continue
        lines.append(f"| {name} | {a} | {b} | {'yes' if d else ''} |")
    same_pk = sum(1 for name, _, _, d in mrows if name.startswith("package ") and not d)
    lines.append(f"\n{same_pk} package versions identical (not listed).\n")
    return "\n".join(lines) + "\n"


def run_compare(baseline_dir: str, new_dir: str, out: str | None = None, allow_config_change: bool = False) -> int:
    """Compare, print the markdown, write it to ``out`` and append it to ``$GITHUB_STEP_SUMMARY``.

    Returns the exit status: 0 no regression, 1 regression.
    Raises:
        CompareError: a dir is not a readable results dir.
        ConfigChangeError: different experiments and not ``allow_config_change`` (:func:`compare`).
    """
    cells, manifests = compare(Path(baseline_dir), Path(new_dir), allow_config_change)
    text = render(cells, manifests, baseline_dir, new_dir)
    print(text, end="")
    if out:
        from darts_bench.artifacts import atomic_write_text

        Path(out).parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(Path(out), text)
    summary = os.environ.get("GITHUB_STEP_SUMMARY")
    if summary:
        with open(summary, "a", encoding="utf-8") as f:
            f.write(text)
    return 1 if any(c.status == "regression" for c in cells) else 0


# ------------------------------------------------------------------------------------------------
# committed baselines: a results dir holding BASELINE_MARKER is never overwritten by a run unless asked
def baseline_for(baselines: str | Path, name: str, cpu: dict | None = None) -> Path:
    """The committed regression baseline ``name`` for a machine's CPU: the dir ``<baselines>/<name>-*`` whose
    ``results.json`` ``manifest.cpu`` has the ``model`` and ``isa`` of ``cpu`` (default: this machine's,
    :func:`darts_bench.report.tables.cpu_record`), else ``<baselines>/<name>`` (the first baseline, made before
    the manifest recorded the CPU). Rounding differs between CPUs and the heads amplify it (README
    "Regression baselines"), so a run is held against a baseline made on its own kind of CPU when one exists.

    Raises:
        FileNotFoundError: neither a matching dir nor ``<baselines>/<name>`` exists.
    """
    from darts_bench.report.tables import cpu_record

    cpu = cpu_record() if cpu is None else cpu
    root = Path(baselines)
    for d in sorted(root.glob(f"{name}-*")):
        try:
            got = json.loads((d / "results.json").read_text())["manifest"].get("cpu") or {}
        except (OSError, ValueError, KeyError):
            continue
        if got.get("model") == cpu.get("model") and got.get("isa") == cpu.get("isa"):
            return d
    default = root / name
    if not (default / "results.json").is_file():
        raise FileNotFoundError(f"no regression baseline {name!r} in {root} (neither one for CPU "
                                f"{cpu.get('model')!r} / {cpu.get('isa')} nor {default})")
    return default


BASELINE_MARKER = "BASELINE.md"
REFRESH_ENV = "DARTS_BENCH_REFRESH_BASELINE"


def check_not_baseline(out_dir: Path) -> None:
    """Refuse to write a run's results into a committed baseline dir (one holding ``BASELINE.md``),
    unless ``$DARTS_BENCH_REFRESH_BASELINE=1`` says the refresh is on purpose.

    Raises:
        PermissionError: ``out_dir`` is a baseline and the refresh was not asked for.
    """
    marker = Path(out_dir) / BASELINE_MARKER
    if marker.is_file() and os.environ.get(REFRESH_ENV) != "1":
        raise PermissionError(f"{out_dir} is a committed regression baseline ({marker}); write the run elsewhere "
                              f"(--out DIR) and compare it with `darts-bench compare {out_dir} DIR`, or refresh the "
                              f"baseline on purpose with {REFRESH_ENV}=1")
