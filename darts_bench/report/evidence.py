"""The evidence files of a results dir, the per-cell claim tests computed from them, and their loading
(:func:`load_run`); :mod:`darts_bench.report.recompute` recomputes claims.md and every interval from them.

``<out>/evidence/examples.jsonl.gz``: one line per (row, task, example), the per-example numbers the
task intervals resample::

    {"row": "ties+darts#s0", "task": "gsm8k", "index": 3, "example": "<Example.id>",
     "values": {"em_strict": 1.0, "ref_nll_sum": 41.2, "ref_nll_tokens": 37.0, ...},   # TaskResult.per_example
     "outcome": {"strict": "18", "gold": "18", ...}}   # the sample's numbers, flags and short strings

``<out>/evidence/sequences.jsonl.gz``: one line per (merge, task, split, variant, seed, position set,
held-out sequence), from each heads artifact's ``diagnostics.json`` ``per_sequence`` (position sets
``gen`` / ``prompt`` / ``reference``), with the routed head rows' sums (``darts@routed``, ...: the
task-agnostic diagnostics, :func:`with_routed_rows`) beside the oracle rows of the same sequences::

    {"merge": "ties", "task": "gsm8k", "split": "transductive", "variant": "", "seed": 0, "set": "gen",
     "sequence": 7, "n_tokens": 31, "boot_seed": 123, "rows": {"none": {"kl_sum": ..., "agree_sum": ...,
     "floor_sum": ..., "l1_sum": ...}, "surgery": {...}, "darts": {...}}}

Sums are in nats (KL, floor), counts (agreement: tokens whose top-1 matches the expert's) and L1
units; a token-mean signal of a set of sequences is the ratio of their summed sums to their summed
``n_tokens``, so every sequence-bootstrap interval recomputes from these lines. Bytes are
deterministic (keys sorted, gzip ``mtime=0``), so a rerun with equal numbers leaves git clean.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Iterable

import numpy as np
import pandas as pd

from darts_bench.api import get_task
from darts_bench.artifacts import atomic_write_bytes
from darts_bench.data import jsonl_bytes, read_jsonl
from darts_bench.evidence import RUN_N_BOOT
from darts_bench.report.stats import (RATIO_KEYS, bootstrap_indices, crossed_bootstrap, mcnemar_exact, nested_bootstrap,
                                      pick_counts)

EXAMPLES_FILE = "evidence/examples.jsonl.gz"
SEQUENCES_FILE = "evidence/sequences.jsonl.gz"
#: bootstrap replicates of the per-cell tests (claims.md); the per-run sequence intervals the train stage
#: records use darts_bench.evidence.RUN_N_BOOT
CELL_N_BOOT = 2000
#: a behaviour family's per-sequence position set (families without one have no per-cell test)
FAMILY_SET = {"_gen": "gen", "_prompt": "prompt", "_ref": "reference"}
#: the diagnostics key holding the per-run intervals of a position set
SET_INTERVALS = {"gen": "intervals_gen", "prompt": "intervals_prompt", "reference": "intervals_reference"}
BEHAVIOUR = ("kl_expert", "agree_top1", "gap_closed")
#: the longest sample string kept in ``outcome`` (longer ones are texts: samples/ holds them)
MAX_OUTCOME_CHARS = 40


# ------------------------------------------------------------------------------------------ files
def write_jsonl_gz(path: Path, records: Iterable[dict]) -> None:
    """Write ``records`` to ``path`` atomically (temp file + rename) as gzip-compressed JSON lines,
    keys sorted, compact separators (:func:`darts_bench.data.jsonl_bytes`: gzip header mtime 0), so
    the same records give the same bytes. Read back with :func:`darts_bench.data.read_jsonl`."""
    atomic_write_bytes(path, jsonl_bytes(records, sort_keys=True, compact=True, compress=True))


def _num(v: Any) -> Any:
    if isinstance(v, (np.integer, np.floating)):
        return v.item()
    return v


def example_records(results: dict[str, dict[str, Any]], row_names: list[str], task_names: list[str]) -> list[dict]:
    """The lines of ``examples.jsonl.gz`` for these rows and tasks (:class:`~darts_bench.api.TaskResult`
    objects or their dict form): per-example lists whose length is the example count, and the
    sample's numeric, boolean and short string fields (``outcome``).

    Raises:
        ValueError: a result whose example ids cannot be read (:func:`darts_bench.report.stats.example_ids`).
    """
    from darts_bench.report.stats import _fields, example_ids

    out = []
    for row in row_names:
        for t in task_names:
            res = results[row].get(t)
            if res is None:
                continue
            per, id_recs = _fields(res)
            samples = res.get("samples", []) if isinstance(res, dict) else res.samples
            n = len(id_recs)
            ids = example_ids(id_recs, n, f"{row} {t}") if n else []
            lists = {k: v for k, v in per.items() if isinstance(v, (list, tuple)) and len(v) == n}
            for i, ex in enumerate(ids):
                s = samples[i] if i < len(samples) else {}
                outcome = {k: _num(v) for k, v in s.items() if k not in ("id", "task_id")
                           and (v is None or isinstance(v, (bool, int, float, np.integer, np.floating))
                                or (isinstance(v, str) and len(v) <= MAX_OUTCOME_CHARS))}
                out.append({"row": row, "task": t, "index": i, "example": ex,
                            "values": {k: _num(v[i]) for k, v in lists.items()}, "outcome": outcome})
    return out


def sequence_records(runs: dict[tuple, dict], run_seed: int) -> list[dict]:
    """The lines of ``sequences.jsonl.gz`` from each run's ``per_sequence`` (runs keyed (merge, task,
    split[, variant, seed]); runs without one give none). ``boot_seed`` is the seed of that run's
    sequence intervals: the seed the run's diagnostics recorded (``bootstrap.seed``: the train stage's
    ``split_seed(head seed, task, split)``), else ``derive_seed(head seed or run_seed, "split", task, split)``.

    Raises:
        ValueError: a set whose per-row lists differ in length from its ``sequence`` list.
    """
    from darts_bench.stages import derive_seed

    out = []
    for key, d in runs.items():
        m, t, split = key[:3]
        variant, seed = (key[3], key[4]) if len(key) > 4 else ("", None)
        boot = (d.get("bootstrap") or {}).get("seed")
        if boot is None:
            boot = derive_seed(run_seed if seed is None else seed, "split", t, split)
        for set_name, ps in sorted((d.get("per_sequence") or {}).items()):
            seqs, n_tok = list(ps["sequence"]), list(ps["n_tokens"])
            rows = {r: v for r, v in ps.items() if r not in ("sequence", "n_tokens")}
            for r, v in rows.items():
                for q, vals in v.items():
                    if len(vals) != len(seqs):
                        raise ValueError(f"{m}/{t}/{split}{variant}#s{seed} per_sequence[{set_name!r}][{r!r}][{q!r}]: "
                                         f"{len(vals)} values for {len(seqs)} sequences")
            for i, sq in enumerate(seqs):
                out.append({"merge": m, "task": t, "split": split, "variant": variant, "seed": seed, "set": set_name,
                            "sequence": _num(sq), "n_tokens": _num(n_tok[i]), "boot_seed": boot,
                            "rows": {r: {q: _num(vals[i]) for q, vals in v.items()} for r, v in rows.items()}})
    return out


def with_routed_rows(runs: dict[tuple, dict], agnostic_runs: dict[tuple, dict] | None) -> dict[tuple, dict]:
    """``runs`` (keyed (merge, task, split, variant, seed)) with each routed head row's per-sequence sums added to
    the ``per_sequence`` of its run as row ``<method>@routed`` (``darts@routed``, ``surgery@routed``): the train
    stage's task-agnostic diagnostics (``agnostic_runs``, :func:`darts_bench.stages.train.agnostic_artifact`:
    ``{"routed": diagnostics}``) computed by the same :func:`darts_bench.stages.train.diagnose_seeds` pass on the
    same held-out sequences and reference answers as the run's oracle rows, so :func:`sequence_records` writes them
    into the oracle rows' lines. The routed diagnostics' ``none`` row is the run's own and is not repeated; runs
    without a routed diagnostics (no ``surgery.task_agnostic: [routed]``) are returned unchanged (new dicts only
    where rows are added).

    Raises:
        ValueError: a routed diagnostics without a run of the same key, or whose position set's sequence ids or
            token counts differ from the run's (the two artifacts were diagnosed on different held-out splits:
            delete the task-agnostic artifact named in the train stage's log so it is diagnosed again).
    """
    out = dict(runs)
    for key, agn in (agnostic_runs or {}).items():
        routed = (agn or {}).get("routed")
        if not routed or not routed.get("per_sequence"):
            continue
        if key not in runs:
            raise ValueError(f"routed diagnostics {key}: no heads run of that (merge, task, split, variant, seed) "
                             f"among {len(runs)} runs; the task-agnostic rows need their oracle heads' run")
        d = runs[key]
        ps = {s: dict(v) for s, v in (d.get("per_sequence") or {}).items()}
        for set_name, rps in routed["per_sequence"].items():
            own = ps.get(set_name)
            if own is None:
                continue
            if list(rps["sequence"]) != list(own["sequence"]) or list(rps["n_tokens"]) != list(own["n_tokens"]):
                raise ValueError(f"routed diagnostics {key} per_sequence[{set_name!r}]: sequence ids or token counts "
                                 "differ from the oracle heads' run (diagnosed on different held-out splits); delete "
                                 "that task-agnostic artifact (heads/<merge>-<task>-<split>-agnostic-<key>) and rerun")
            for r, v in rps.items():
                if r not in ("sequence", "n_tokens", "none"):
                    own[f"{r}@routed"] = v
        out[key] = {**d, "per_sequence": ps}
    return out


# ------------------------------------------------------------------------------ per-cell tests
def _examples_by_row(examples: list[dict]) -> dict[tuple[str, str], dict[str, Any]]:
    out: dict[tuple[str, str], dict[str, Any]] = {}
    for e in sorted(examples, key=lambda e: (e["row"], e["task"], e["index"])):
        g = out.setdefault((e["row"], e["task"]), {"ids": [], "values": {}})
        g["ids"].append(str(e["example"]))
        for k, v in e["values"].items():
            g["values"].setdefault(k, []).append(math.nan if v is None else float(v))
    return out


def _family_parts(family: str) -> tuple[str, str | None]:
    for suffix, set_name in FAMILY_SET.items():
        if family.endswith(suffix) and family[: -len(suffix)] in BEHAVIOUR:
            return family[: -len(suffix)], set_name
    return family, None


def _cell_seed(run_seed: int, *parts: Any) -> int:
    from darts_bench.stages import derive_seed

    return derive_seed(run_seed, "claim-cell", *parts)


def _pairs(meta: dict[str, dict[str, Any]]) -> dict[tuple, dict[Any, tuple[str, str]]]:
    """(merge, split, variant) -> seed -> (darts row, surgery row)."""
    by = {}
    for name, m in meta.items():
        if m.get("correction") in ("darts", "surgery"):
            by[(m["merge"], m["calibration"], m["variant"] or "", m["seed"], m["correction"])] = name
    out: dict[tuple, dict[Any, tuple[str, str]]] = {}
    for (merge, split, variant, seed, corr), name in sorted(by.items(), key=lambda kv: str(kv[0])):
        if corr == "darts" and (merge, split, variant, seed, "surgery") in by:
            out.setdefault((merge, split, variant), {})[seed] = (name, by[(merge, split, variant, seed, "surgery")])
    return out


def _task_cell(fam: str, t: str, pairs: dict[Any, tuple[str, str]], ex: dict, seed: int,
               primary: dict[str, str] | None = None) -> dict[str, Any] | None:
    task = get_task(t)
    col = ((primary or {}).get(t) or task.primary_metrics[0]) if fam == "primary" else f"{t}_{fam}"
    key = task.per_example_key(col) if fam == "primary" else fam
    seeds = sorted(pairs, key=str)
    sides = [(ex.get((pairs[s][0], t)), ex.get((pairs[s][1], t))) for s in seeds]
    if any(a is None or b is None for a, b in sides):
        return None
    ids = sides[0][0]["ids"]
    for a, b in sides:
        if sorted(a["ids"]) != sorted(ids) or sorted(b["ids"]) != sorted(ids):
            raise ValueError(f"cell {t} seeds {seeds}: the DARTS and Surgery rows hold different examples")
    keys = RATIO_KEYS.get(key, (key,))
    if not all(k in g["values"] for a, b in sides for g in (a, b) for k in keys):
        return None

    def aligned(g: dict, k: str) -> np.ndarray:
        pos = {i: j for j, i in enumerate(g["ids"])}
        return np.asarray([g["values"][k][pos[i]] for i in ids], dtype=np.float64)

    from darts_bench.report.seeds import direction

    d = direction(col, t)
    base = {"metric": fam, "column": col, "task": t, "n_seeds": len(seeds), "unit": "examples", "direction": d}
    if key in RATIO_KEYS:
        num, den = keys
        sums = {f"{side}_{q}": np.stack([aligned(g[j], k) for g in sides])
                for j, side in enumerate(("a", "b")) for q, k in (("num", num), ("den", den))}
        keep = np.isfinite(np.stack(list(sums.values()))).all(axis=(0, 1))
        sums = {k: v[:, keep] for k, v in sums.items()}
        r = crossed_bootstrap(sums, lambda s: s["a_num"] / s["a_den"] - s["b_num"] / s["b_den"], CELL_N_BOOT, seed)
        return {**base, "test": "crossed bootstrap (seeds x examples), token-weighted", "estimate": r["value"],
                "ci_low": r["ci_low"], "ci_high": r["ci_high"], "n_units": r["n_units"], "p": None}
    a = np.stack([aligned(g[0], key) for g in sides])
    b = np.stack([aligned(g[1], key) for g in sides])
    keep = np.isfinite(a).all(0) & np.isfinite(b).all(0)
    a, b = a[:, keep], b[:, keep]
    scale = task.metric_scale.get(col, 1.0)
    if np.isin(a, (0.0, 1.0)).all() and np.isin(b, (0.0, 1.0)).all():
        mc = mcnemar_exact(a, b)
        better = (mc["a_better"], mc["b_better"]) if d > 0 else (mc["b_better"], mc["a_better"])
        return {**base, "test": "McNemar exact", "estimate": mc["diff"] * scale, "ci_low": None, "ci_high": None,
                "n_units": mc["n"], "p": mc["p"], "darts_better": better[0], "surgery_better": better[1]}
    r = crossed_bootstrap({"a": a, "b": b, "n": np.ones_like(a)}, lambda s: (s["a"] - s["b"]) / s["n"], CELL_N_BOOT, seed)
    return {**base, "test": "crossed bootstrap (seeds x examples)", "estimate": r["value"] * scale,
            "ci_low": r["ci_low"] * scale, "ci_high": r["ci_high"] * scale, "n_units": r["n_units"], "p": None}


def gap_closed_share(none_kl, head_kl, floor, n):
    """Share of the plain merge's closable KL gap a head closes, ``(KL_none - KL_head) / (KL_none - floor)``
    from summed KLs (nats) and token counts (any matching shapes); NaN where the gap is <= 1e-12 nats/token."""
    g = (none_kl - floor) / n
    return np.where(g > 1e-12, (none_kl - head_kl) / n / np.where(g > 1e-12, g, 1.0), np.nan)


BEHAVIOUR_STAT = {
    "kl_expert": lambda s: (s["darts_kl_sum"] - s["surgery_kl_sum"]) / s["n_tokens"],
    "agree_top1": lambda s: (s["darts_agree_sum"] - s["surgery_agree_sum"]) / s["n_tokens"],
    "gap_closed": lambda s: (gap_closed_share(s["none_kl_sum"], s["darts_kl_sum"], s["none_floor_sum"], s["n_tokens"])
                             - gap_closed_share(s["none_kl_sum"], s["surgery_kl_sum"], s["none_floor_sum"], s["n_tokens"])),
}


def _behaviour_cell(fam: str, t: str, merge: str, split: str, variant: str, seqs: dict, seed: int) -> dict | None:
    sig, set_name = _family_parts(fam)
    if set_name is None:
        return None
    per_seed = {s: v for (m, tt, sp, va, s, st), v in seqs.items()
                if (m, tt, sp, va, st) == (merge, t, split, variant, set_name)}
    if not per_seed:
        return None
    seeds = sorted(per_seed, key=str)
    need = [("none", "kl_sum"), ("none", "floor_sum"), ("darts", "kl_sum"), ("surgery", "kl_sum"),
            ("darts", "agree_sum"), ("surgery", "agree_sum")]

    def seed_sums(s, ids) -> dict[str, list[float]]:
        d = {f"{r}_{q}": [per_seed[s][i]["rows"][r][q] for i in ids] for r, q in need}
        d["n_tokens"] = [per_seed[s][i]["n_tokens"] for i in ids]
        return d

    ids = sorted(per_seed[seeds[0]])
    if all(sorted(per_seed[s]) == ids for s in seeds):  # one held-out split for all seeds: crossed factors
        per = [seed_sums(s, ids) for s in seeds]
        sums = {k: np.asarray([p[k] for p in per], dtype=np.float64) for k in per[0]}
        r = crossed_bootstrap(sums, BEHAVIOUR_STAT[sig], CELL_N_BOOT, seed)
        how = "crossed bootstrap (seeds x sequences"
    else:  # each head seed drew its own held-out split: seeds, then each seed's own sequences
        r = nested_bootstrap([seed_sums(s, sorted(per_seed[s])) for s in seeds], BEHAVIOUR_STAT[sig], CELL_N_BOOT,
                             seed)
        how = "nested bootstrap (seeds, then each seed's own held-out sequences"
    from darts_bench.report.seeds import SIGNAL_DIRECTION

    return {"metric": fam, "column": f"{t}_{fam}", "task": t, "n_seeds": len(seeds), "unit": "held-out sequences",
            "direction": SIGNAL_DIRECTION[fam], "test": f"{how}, {set_name} positions)",
            "estimate": r["value"], "ci_low": r["ci_low"], "ci_high": r["ci_high"], "n_units": r["n_units"], "p": None}


def cell_tests(examples: list[dict], sequences: list[dict], meta: dict[str, dict[str, Any]], task_names: list[str],
               run_seed: int, families: Iterable[str] | None = None,
               primary: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """Per (family, merge, task, split, variant) cell: the test of the seed-mean DARTS - Surgery
    difference, from the evidence records alone. Task families (``primary``, ``ref_nll``): exact
    McNemar when the per-example values are 0/1 (:func:`darts_bench.report.stats.mcnemar_exact`),
    else :func:`~darts_bench.report.stats.crossed_bootstrap` over seeds x examples (token-weighted
    for ``ref_nll``); behaviour families with a position set (``kl_expert_gen``, ``..._ref``): the
    crossed bootstrap over seeds x held-out sequences of that set. Each cell's bootstrap seed derives
    from ``run_seed`` and the cell. Examples with a NaN on any side or seed are left out.

    Returns:
        dicts with ``metric, column, merge, task, split, variant, n_seeds, unit, direction, test,
        estimate`` (darts - surgery, the column's units), ``ci_low, ci_high`` (None for McNemar),
        ``n_units, p`` (McNemar), ``darts_better, surgery_better`` (McNemar).
    Raises:
        ValueError: the seeds of a cell hold different examples or held-out sequences.
    """
    from darts_bench.report.seeds import COMPARED

    ex = _examples_by_row(examples)
    seqs: dict[tuple, dict] = {}
    for s in sequences:
        seqs.setdefault((s["merge"], s["task"], s["split"], s["variant"], s["seed"], s["set"]), {})[s["sequence"]] = s
    out = []
    for fam in families or COMPARED:
        for (merge, split, variant), pairs in _pairs(meta).items():
            for t in task_names:
                seed = _cell_seed(run_seed, fam, merge, t, split, variant)
                if fam in ("primary", "ref_nll"):
                    c = _task_cell(fam, t, pairs, ex, seed, primary)
                else:
                    c = _behaviour_cell(fam, t, merge, split, variant, seqs, seed)
                if c is not None:
                    out.append({**c, "merge": merge, "split": split, "variant": variant})
    return out


# ------------------------------------------------------------------------ per-run intervals
def run_intervals_from_sequences(lines: list[dict], n_boot: int = RUN_N_BOOT) -> dict[str, dict]:
    """The per-run sequence-bootstrap intervals of one (run, position set) from its sequence lines, as
    :func:`darts_bench.surgery.intervals.behaviour_intervals` computes them from per-token values
    (same resamples: :func:`~darts_bench.report.stats.bootstrap_indices` ``(n_sequences, n_boot,
    boot_seed)`` over the sorted sequence ids; a token mean of the picked sequences is their summed
    sums over their summed token counts).

    Returns:
        ``{row: {"kl_expert", "agree_top1"[, "gap_closed"]}, "paired": {...}}`` with ``value``,
        ``ci_low``, ``ci_high``, ``n_sequences``, ``n_dropped`` per signal.
    """
    lines = sorted(lines, key=lambda r: r["sequence"])
    n_tok = np.asarray([r["n_tokens"] for r in lines], dtype=np.float64)
    rows = list(lines[0]["rows"])
    q = {(r, k): np.asarray([ln["rows"][r][k] for ln in lines], dtype=np.float64)
         for r in rows for k in ("kl_sum", "agree_sum", "floor_sum")}
    picks = bootstrap_indices(len(lines), n_boot, int(lines[0]["boot_seed"]))
    counts = pick_counts(picks, len(lines))

    def iv(stat) -> dict:
        reps = np.asarray([stat(c) for c in counts])
        ok = np.isfinite(reps)
        lo, hi = np.percentile(reps[ok], [2.5, 97.5]) if ok.any() else (math.nan, math.nan)
        return {"value": float(stat(np.ones(len(lines)))), "ci_low": float(lo), "ci_high": float(hi),
                "n_sequences": len(lines), "n_dropped": int((~ok).sum())}

    def mean(r, k):
        return lambda c: float(c @ q[(r, k)] / (c @ n_tok))

    def gap(r):
        def f(c):
            n = c @ n_tok
            g = (c @ q[("none", "kl_sum")] - c @ q[("none", "floor_sum")]) / n
            return float((c @ q[("none", "kl_sum")] - c @ q[(r, "kl_sum")]) / n / g) if g > 1e-12 else math.nan
        return f

    out: dict[str, dict] = {}
    for r in rows:
        out[r] = {"kl_expert": iv(mean(r, "kl_sum")), "agree_top1": iv(mean(r, "agree_sum"))}
        if r != "none":
            out[r]["gap_closed"] = iv(gap(r))
    if "darts" in rows and "surgery" in rows:
        out["paired"] = {"kl_expert": iv(lambda c: mean("darts", "kl_sum")(c) - mean("surgery", "kl_sum")(c)),
                         "agree_top1": iv(lambda c: mean("darts", "agree_sum")(c) - mean("surgery", "agree_sum")(c)),
                         "gap_closed": iv(lambda c: gap("darts")(c) - gap("surgery")(c)), "pair": "darts - surgery"}
    return out


# --------------------------------------------------------------------- claims and recomputation
def runs_from_results(payload: dict) -> dict[tuple, dict]:
    """The (merge, task, split, variant, seed) -> diagnostics of a ``results.json`` (its ``runs``, or
    its ``diagnostics`` with the manifest's one variant and head seed), in the order written.

    Raises:
        ValueError: a key that does not parse against the manifest's calibration splits.
    """
    man = payload["manifest"]
    splits = sorted(man["config"]["calibration"]["splits"], key=len, reverse=True)
    out = {}
    if payload.get("runs"):
        for key, d in payload["runs"].items():
            m, t, rest = key.split("/", 2)
            split = next((s for s in splits if rest.startswith(s)), None)
            if split is None or "#s" not in rest:
                raise ValueError(f"results.json runs key {key!r}: no split of {splits} and '#s<seed>'")
            tag, seed = rest[len(split):].rsplit("#s", 1)
            out[(m, t, split, tag, None if seed == "None" else int(seed))] = d
    else:
        seed = man["head_seeds"][0]
        for key, d in payload["diagnostics"].items():
            m, t, split = key.split("/", 2)
            out[(m, t, split, "", seed)] = d
    return out


def load_run(results_dir: Path) -> dict[str, Any]:
    """What :func:`claims_from` needs, read from a results dir: ``results.json``, ``table.csv`` and
    the evidence files.

    Raises:
        FileNotFoundError: a file is missing (named); ValueError: ``results.json`` predates the
            evidence files (no ``manifest.row_meta``).
    """
    d = Path(results_dir)
    for f in ("results.json", "table.csv", EXAMPLES_FILE, SEQUENCES_FILE):
        if not (d / f).is_file():
            raise FileNotFoundError(f"{d}: no {f} (written by darts-bench report since the evidence files)")
    from darts_bench.report.decide import merge_labels

    payload = json.loads((d / "results.json").read_text())
    man = payload["manifest"]
    if "row_meta" not in man:
        raise ValueError(f"{d}/results.json: no manifest.row_meta (written before the evidence files)")
    meta = man["row_meta"]
    table = pd.read_csv(d / "table.csv", float_precision="round_trip")
    rows = [{k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in r.items()}
            for r in table.to_dict(orient="records") if r["model"] in meta]
    return {"payload": payload, "meta": meta, "rows": rows, "runs": runs_from_results(payload),
            "methods": list(man["config"]["surgery"]["methods"]),
            "with_heads": [t for t, e in man["task_experts"].items() if e is not None],
            "examples": read_jsonl(d / EXAMPLES_FILE, allow_empty=True),
            "sequences": read_jsonl(d / SEQUENCES_FILE, allow_empty=True),
            "run_seed": int(man["seed"]), "name": man["config"]["name"],
            "primary": man.get("primary_metrics"),
            "merge_methods": merge_labels(man["config"].get("merges", [])),
            # the pre-registered claims section (never the current config's): absent before pre-registration
            "claims_cfg": (man.get("preregistration") or {}).get("claims"),
            "preregistered": bool((man.get("preregistration") or {}).get("recorded_at")),
            "splits": list(man["config"]["calibration"]["splits"]),
            "planted": [m["name"] for m in man["config"].get("merges", []) if m.get("planted_drift")]}


def _close(a: Any, b: Any, rel: float = 1e-9) -> bool:
    fa = float("nan") if a is None or a == "" else float(a)
    fb = float("nan") if b is None or b == "" else float(b)
    if math.isnan(fa) or math.isnan(fb):
        return math.isnan(fa) and math.isnan(fb)
    return abs(fa - fb) <= rel * max(1.0, abs(fa), abs(fb))


# ------------------------------------------------------------------------ README findings block
#: the results dirs whose claims the README's findings block shows, in order
FINDINGS_RUNS = ("smollm2-135m", "tiny")
#: the results dirs whose compact table (table.md's first table) and per-task routing accuracy the block
#: also shows (the reference tier; tiny's 79 rows are in its own table.md)
FINDINGS_TABLE_RUNS = ("smollm2-135m",)
FINDINGS_BEGIN, FINDINGS_END = "<!-- findings:begin -->", "<!-- findings:end -->"


def compact_table_md(table_md: str) -> str | None:
    """The first markdown table of a ``table.md`` text (its compact table: the lines from the first
    ``| model |`` header up to the first line that is not a table row), or None when it has none."""
    lines = table_md.split("\n")
    start = next((i for i, ln in enumerate(lines) if ln.startswith("| model |")), None)
    if start is None:
        return None
    end = next((i for i in range(start, len(lines)) if not lines[i].startswith("|")), len(lines))
    return "\n".join(lines[start:end])


def routing_accuracy_table(table_csv: Path) -> pd.DataFrame | None:
    """``model`` and ``<task>_routing_acc`` of the ``@routed`` rows of a ``table.csv`` (the router's
    accuracy on each task's held-out calibration prompts, a share), or None without routed rows."""
    df = pd.read_csv(table_csv)
    cols = [c for c in df.columns if c.endswith("_routing_acc")]
    rows = df[df["model"].str.contains("@routed", regex=False)]
    if not cols or rows.empty:
        return None
    return rows[["model", *cols]].reset_index(drop=True)


def findings_block(results_root: Path, runs: Iterable[str] = FINDINGS_RUNS,
                   tables: Iterable[str] = FINDINGS_TABLE_RUNS) -> str:
    """The README's generated findings: per results dir, its claims table (``results.json``
    ``claims``: the verdicts claims.md gives, by one rule), and for the dirs in ``tables`` its
    compact table (:func:`compact_table_md`) and routing accuracy (:func:`routing_accuracy_table`),
    between the begin / end markers.

    Raises:
        FileNotFoundError: a listed results dir has no ``results.json``.
    """
    from darts_bench.report.markdown import to_markdown

    parts = [FINDINGS_BEGIN, "<!-- generated by scripts/readme_findings.py from results/: do not edit by hand -->"]
    for name in runs:
        f = Path(results_root) / name / "results.json"
        if not f.is_file():
            raise FileNotFoundError(f"findings block: no {f}")
        claims = json.loads(f.read_text()).get("claims") or []
        parts.append(f"\n**`results/{name}`** (verdicts and evidence from `results/{name}/claims.md`):\n")
        cols = ["claim", "statement", "verdict", "evidence"]
        parts.append(to_markdown(pd.DataFrame(claims, columns=cols)).rstrip("\n") if claims else "(no claims)")
        if name in tables:
            compact = compact_table_md((f.parent / "table.md").read_text())
            if compact:
                parts.append(f"\nIts compact table (`results/{name}/table.md`; every column: `table.csv`):\n")
                parts.append(compact)
            acc = routing_accuracy_table(f.parent / "table.csv")
            if acc is not None:
                parts.append(f"\nRouting accuracy of the `@routed` rows per task (`results/{name}/table.csv`, "
                             "`<task>_routing_acc`: the router's share of held-out calibration prompts sent to "
                             "their own task's head):\n")
                parts.append(to_markdown(acc).rstrip("\n"))
    parts.append(FINDINGS_END)
    return "\n".join(parts)


def readme_block(text: str) -> str | None:
    """The findings block of a README text (markers included, each on a line of its own: a marker
    quoted inside a sentence is not one), or None when it has none.

    Raises:
        ValueError: a begin marker without an end marker line after it.
    """
    lines = text.split("\n")
    if FINDINGS_BEGIN not in lines:
        return None
    start = lines.index(FINDINGS_BEGIN)
    if FINDINGS_END not in lines[start:]:
        raise ValueError(f"README: {FINDINGS_BEGIN} without {FINDINGS_END}")
    end = lines.index(FINDINGS_END, start)
    return "\n".join(lines[start:end + 1])
