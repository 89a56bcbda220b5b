"""Claim lines decided over (merge, task) cells: one pre-registered primary family per line, a
random-effects verdict with its uncertainty and power, descriptive tests beside it, and an A/A null
control measured on the run's own data.

A *line* compares two kinds of row over the cells of one calibration split: DARTS vs Surgery (claim 3),
DARTS vs the parameter-matched Surgery, each DARTS ingredient vs Surgery, a head vs its plain strong
merge (claim 7), DARTS vs the post-merge baseline with the same task-label budget (EMR-Merging: cross-merge
lines, :data:`CONTRASTS` ``3-emr``, both with the task label, and ``3-emr-routed``, the routed DARTS row vs EMR
routed, neither with it), and DARTS vs Surgery on a merge with a planted drift
(the positive control). Per cell (merge, task, split), the two rows are compared on the same units (held-out
sequences for behaviour families, benchmark examples for task families); head seeds are averaged inside the
cell and their spread is a variance component of the cell.

Per family, the cell estimate and its within-cell variance are computed from the per-sequence (or
per-example) sums of ``evidence/`` by linearisation (the delta method for a ratio of sums; sequences
i.i.d. within a cell):

* ``kl_*`` on the log-ratio scale: ``y = log(sum_i a_i / sum_i b_i)`` with ``a_i``, ``b_i`` the summed
  KL (nats) of sequence ``i`` under the two rows; influence ``u_i = a_i / A - b_i / B``;
* ``agree_top1_*`` and ``ref_nll``: the difference of token means, ``y = (A - B) / N``, influence
  ``u_i = (a_i - b_i - y n_i) / N``;
* ``primary`` (the task's headline metric, per example): the mean paired difference, ``u_i = (d_i - y) / m``;

and ``v = m / (m - 1) * sum_i u_i^2``. With several head seeds, ``y`` is the seed mean and ``v`` the
mean within-seed variance plus the between-seed variance over the number of seeds.

The line's verdict is :func:`darts_bench.report.meta.random_effects` of its primary family over the
cells (the rule is :data:`RULE`, written once: :func:`rule_text` puts it in claims.md's header).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterable

import numpy as np
from scipy import stats

from darts_bench.evidence import TIE_RTOL
from darts_bench.report.meta import MIN_CELLS, MetaResult, random_effects

#: families decided on the log-ratio scale (the rest: differences)
LOG_RATIO = ("kl_expert_gen", "kl_expert_ref")
#: behaviour family -> (per-sequence position set, summed quantity)
BEHAVIOUR_FAMILIES = {"kl_expert_gen": ("gen", "kl_sum"), "kl_expert_ref": ("reference", "kl_sum"),
                      "agree_top1_gen": ("gen", "agree_sum"), "agree_top1_ref": ("reference", "agree_sum")}
#: families where a lower value is better (a negative estimate favours the line's first row)
LOWER_IS_BETTER = ("kl_expert_gen", "kl_expert_ref", "ref_nll")
#: families in plain words (claims.md, the verdict sentences)
FAMILY_WORDS = {"kl_expert_gen": "continuation-token KL to the expert",
                "kl_expert_ref": "reference-answer KL to the expert",
                "agree_top1_gen": "continuation-token top-1 agreement with the expert",
                "agree_top1_ref": "reference-answer top-1 agreement with the expert",
                "ref_nll": "reference-answer NLL", "primary": "the task's headline metric"}
#: the verdict rule of a line (the code below and claims.md's header both read it)
RULE = {
    "supported": "the HKSJ {level} interval of the primary family's random-effects estimate lies wholly on "
                 "the side that favours the line's first row",
    "not supported": "it lies wholly on the other side",
    "inconclusive": "it contains 0 (the line states the minimum detectable effect at 80% power)",
    "insufficient": "fewer than {min_cells} cells with a within-cell variance (ties without variation are left out)",
}
#: the A/A null control flags at most this share of replicates for its line to read `calibrated`
NULL_MAX_RATE = 0.05
#: a DARTS table below this share of its evaluated positions on trained rows is flagged
COVERAGE_WARN = 0.5


#: merge labels (:func:`merge_labels`) of the strong training-free fixes: the SVD merges and any merge with SVC
FIX_METHODS = ("tsv_m", "iso_c", "iso_cts")


def merge_labels(merges: Iterable[Any]) -> dict[str, str]:
    """Merge name -> the label the claim lines group merges by: the method, with ``+svc`` when Singular Value
    Calibration is applied on top (``svc_alpha`` set). ``merges``: :class:`~darts_bench.config.MergeSpec`
    objects or their JSON dicts (a results dir's manifest)."""
    out = {}
    for m in merges:
        d = m if isinstance(m, dict) else m.model_dump(mode="json", by_alias=True)
        out[d["name"]] = d["method"] + ("+svc" if d.get("svc_alpha") else "")
    return out


def is_fix(label: str) -> bool:
    """A strong training-free fix: an SVD merge (:data:`FIX_METHODS`) or any merge with SVC on top."""
    return label in FIX_METHODS or label.endswith("+svc")


def merge_sets(labels: dict[str, str], planted: Iterable[str] = (), present: Iterable[str] | None = None
               ) -> dict[str, set[str]]:
    """Which merges each kind of line (:attr:`Contrast.merges`) reads: ``real`` every merge with heads but the
    planted ones, ``strong`` the data merges, ``fix`` the strong training-free fixes (:func:`is_fix`),
    ``planted`` the merges with a planted drift, ``task_aware`` the first task-aware merge present (EMR: a model
    per task, no heads; in labels order, i.e. the config's: a run with several EMR merges decides the ``3-emr``
    lines against the first only). ``labels``: merge -> label (:func:`merge_labels`);
    ``present``: the merges with evidence (default: every labelled merge). Task-aware merges are in no other set.
    The report (:func:`decide`) and the planner (:func:`darts_bench.plan.power.claims_plan`) both read it."""
    from darts_bench.config import DATA_MERGE_METHODS, TASK_AWARE_METHODS

    planted = set(planted)
    present = set(labels) if present is None else set(present)
    aware = [m for m, lab in labels.items() if lab in TASK_AWARE_METHODS]
    real = present - planted - set(aware)
    return {"real": real, "strong": {m for m in real if labels.get(m) in DATA_MERGE_METHODS},
            "fix": {m for m in real if is_fix(labels.get(m, ""))}, "planted": planted & present,
            "task_aware": set([m for m in aware if m in present][:1])}


@dataclass(frozen=True)
class Contrast:
    """One claim line's pair: rows ``a`` and ``b`` as (variant-tag suffix, row kind) of a cell; a row kind is
    a correction method (``darts``, ``surgery``, ``darts_ew_only``, ...) or ``none`` (the plain merge).
    ``b_control`` names a matched control whose variant tag replaces ``b``'s (``param_matched``).
    ``b_merge`` (``task_aware``): a cross-merge line, whose ``b`` row is a row kind of another merge (the
    :func:`merge_sets` set of that name: the EMR merge's ``emr`` / ``emr@routed`` rows) on the same task, split,
    head seed and held-out sequences as the cell's ``a`` row; the cell is still (merge of ``a``, task)."""

    key: str
    claim: int
    statement: str
    a: str
    b: str
    b_control: str | None = None
    merges: str = "real"  #: real | strong | fix | planted: which merges' cells the line uses
    b_merge: str | None = None  #: task_aware: ``b`` is read from that merge set's merge (cross-merge line)


CONTRASTS = (
    Contrast("3", 3, "DARTS beats Surgery", "darts", "surgery"),
    Contrast("3-matched", 3, "DARTS beats the parameter-matched Surgery (same parameter count)", "darts", "surgery",
             b_control="param_matched"),
    Contrast("3-ew", 3, "entropy weighting alone (no position table) beats Surgery", "darts_ew_only", "surgery"),
    Contrast("3-pos", 3, "the position table alone (no entropy weighting) beats Surgery", "darts_pos_only", "surgery"),
    Contrast("3-ew-vs-darts", 3, "DARTS beats entropy weighting alone (what the position table adds)", "darts",
             "darts_ew_only"),
    Contrast("7-darts", 7, "a DARTS head still helps on top of a strong merge (head vs plain merge)", "darts", "none",
             merges="strong"),
    Contrast("7-surgery", 7, "a Surgery head still helps on top of a strong merge (head vs plain merge)", "surgery",
             "none", merges="strong"),
    Contrast("7-darts-fix", 7, "a DARTS head still helps on top of a strong training-free fix (SVC, TSV-M, Iso-C: "
             "head vs plain merge)", "darts", "none", merges="fix"),
    Contrast("7-surgery-fix", 7, "a Surgery head still helps on top of a strong training-free fix (SVC, TSV-M, "
             "Iso-C: head vs plain merge)", "surgery", "none", merges="fix"),
    Contrast("3-emr", 3, "DARTS beats EMR-Merging with the task's mask and rescaler (the same task-label budget, "
             "oracle)", "darts", "emr", b_merge="task_aware"),
    # the same budget without the label: the routed DARTS row (surgery.task_agnostic: [routed]; the head of the task
    # a router picks per prompt from the merged model's state) vs EMR routed by the base's prompt state
    Contrast("3-emr-routed", 3, "DARTS routed beats EMR-Merging routed (no task label on either side: the same "
             "budget)", "darts@routed", "emr@routed", b_merge="task_aware"),
    Contrast("control", 0, "positive control: DARTS beats Surgery on a planted position-dependent drift", "darts",
             "surgery", merges="planted"),
)


# ------------------------------------------------------------------------------ cell statistics
def _lin_var(u: np.ndarray) -> float:
    m = len(u)
    return float(m / (m - 1) * np.sum((u - u.mean()) ** 2)) if m > 1 else math.nan


def cell_stat(family: str, a: np.ndarray, b: np.ndarray, n: np.ndarray) -> tuple[float, np.ndarray]:
    """One seed's cell estimate and per-unit influence values (module docstring).

    Args:
        family: a :data:`darts_bench.config.ClaimFamily`.
        a, b: ``[m]`` the two rows' per-unit sums (KL nats, agreement counts, NLL nats) or, for ``primary``,
            per-example values.
        n: ``[m]`` token counts per unit (ignored for ``primary``).
    Returns:
        ``(y, u)``; ``y`` is nan where it is undefined (a zero KL total).
    """
    a, b, n = (np.asarray(x, dtype=np.float64) for x in (a, b, n))
    if family in LOG_RATIO:
        A, B = a.sum(), b.sum()
        if A <= 0 or B <= 0:
            return math.nan, np.zeros_like(a)
        return float(math.log(A / B)), a / A - b / B
    if family == "primary":
        d = a - b
        y = float(d.mean())
        return y, (d - y) / len(d)
    N = n.sum()
    y = float((a.sum() - b.sum()) / N)
    return y, (a - b - y * n) / N


@dataclass
class Cell:
    """A (merge, task, split) cell of one line and family: ``y`` (seed mean), ``v`` (within-cell
    variance), the per-unit influence ``u`` (seed mean) keyed by ``units`` (cluster ids shared across
    merges: (task, split, sequence) or (task, example)), ``n_seeds`` and ``n_units``."""

    merge: str
    task: str
    split: str
    y: float
    v: float
    units: list
    u: np.ndarray
    n_seeds: int
    n_units: int


def combine_seeds(merge: str, task: str, split: str, per_seed: list[tuple[float, np.ndarray, list]]) -> Cell | None:
    """A cell from each head seed's ``(y, u, unit ids)`` (:func:`cell_stat`): ``y`` the seed mean, ``v``
    the mean within-seed variance plus the between-seed variance / number of seeds. The influence values
    are averaged over seeds where every seed has the same units (else the cell has none: the
    stratified test leaves it out). None when no seed gives a finite estimate."""
    ok = [(y, u, ids) for y, u, ids in per_seed if math.isfinite(y) and len(u) > 1]
    if not ok:
        return None
    ys = np.asarray([y for y, _, _ in ok])
    within = float(np.mean([_lin_var(u) for _, u, _ in ok]))
    between = float(ys.var(ddof=1) / len(ys)) if len(ys) > 1 else 0.0
    same = all(ids == ok[0][2] for _, _, ids in ok)
    u = np.mean([u for _, u, _ in ok], axis=0) if same else np.zeros(0)
    return Cell(merge, task, split, float(ys.mean()), within + between, list(ok[0][2]) if same else [], u, len(ok),
                len(ok[0][2]))


# ------------------------------------------------------------------------------ gathering cells
def _row_index(meta: dict[str, dict[str, Any]]) -> dict[tuple, str]:
    """(merge, split, variant, seed, row kind) -> row name (``none``: the plain merge, any split); a routed
    head row's kind is its correction (``darts@routed``); shared-head and task-aware rows are left out."""
    out = {}
    for name, m in meta.items():
        if not m.get("merge") or m.get("routing") not in (None, "routed"):
            continue
        if m["correction"] == "none":
            out[(m["merge"], "*", "", m["seed"], "none")] = name
            out[(m["merge"], "*", "", None, "none")] = name
        else:
            out[(m["merge"], m["calibration"], m["variant"] or "", m["seed"], m["correction"])] = name
    return out


def _variant_of(c: Contrast, side: str, base_tag: str) -> str:
    if side == "b" and c.b_control:
        from darts_bench.controls import control_tag

        return control_tag(base_tag, c.b_control)
    return base_tag


def behaviour_cells(family: str, c: Contrast, sequences: list[dict], base_tag: str = "",
                    merges: Iterable[str] | None = None, b_merge: str | None = None) -> dict[str, list[Cell]]:
    """The cells (split -> list) of a behaviour family for line ``c`` from ``sequences.jsonl.gz``'s
    records: per (merge, task, split), each seed's held-out sequences that both rows have.

    A cross-merge line (``c.b_merge``) reads ``b`` from the merge ``b_merge`` (the EMR merge: records of
    variant ``""``) on the same (task, split, seed) and sequence ids: held-out ids are one split per (task,
    split, head seed) of the task's calibration set, the same for every merge (:func:`darts_bench.stages.train.
    task_split`). Its ``b`` values are then shared by the cells of one task: the stratified test clusters
    them (the units are (task, split, sequence) over merges), the random-effects verdict treats the cells as
    independent (the shared side makes their errors correlated: its interval is then too narrow by that
    correlation; the stratified test beside it is the check)."""
    set_name, q = BEHAVIOUR_FAMILIES[family]
    idx: dict[tuple, dict] = {}
    for s in sequences:
        if s["set"] == set_name:
            idx.setdefault((s["merge"], s["task"], s["split"], s["variant"], s["seed"]), {})[s["sequence"]] = s
    va, vb = _variant_of(c, "a", base_tag), _variant_of(c, "b", base_tag)
    keep = set(merges) if merges is not None else None
    groups: dict[tuple, list] = {}
    for (m, t, split, variant, seed), by_seq in sorted(idx.items(), key=lambda kv: str(kv[0])):
        if variant != va or (keep is not None and m not in keep):
            continue
        if c.b_merge:
            other = idx.get((b_merge, t, split, "", seed))
        else:
            other = idx.get((m, t, split, vb, seed))
        if other is None:
            continue
        ids = sorted(set(by_seq) & set(other))
        if not ids or c.a not in by_seq[ids[0]]["rows"] or c.b not in other[ids[0]]["rows"]:
            continue
        a = np.asarray([by_seq[i]["rows"][c.a][q] for i in ids])
        b = np.asarray([other[i]["rows"][c.b][q] for i in ids])
        n = np.asarray([by_seq[i]["n_tokens"] for i in ids])
        y, u = cell_stat(family, a, b, n)
        groups.setdefault((m, t, split), []).append((y, u, [(t, split, i) for i in ids]))
    out: dict[str, list[Cell]] = {}
    for (m, t, split), per_seed in groups.items():
        cell = combine_seeds(m, t, split, per_seed)
        if cell is not None:
            out.setdefault(split, []).append(cell)
    return out


def task_cells(family: str, c: Contrast, examples: list[dict], meta: dict[str, dict[str, Any]],
               task_names: list[str], primary: dict[str, str], splits: list[str], base_tag: str = "",
               merges: Iterable[str] | None = None, b_merge: str | None = None) -> dict[str, list[Cell]]:
    """The cells (split -> list) of ``ref_nll`` or ``primary`` for line ``c`` from ``examples.jsonl.gz``'s
    records: per (merge, task, split), each seed's examples that both rows have (NaN values left out).
    ``primary``: task -> its primary metric column. A cross-merge line (``c.b_merge``) reads ``b`` from the merge
    ``b_merge``: its row of kind ``c.b`` (the oracle ``emr`` row, one for every split; the ``emr@routed`` row
    of the cell's split), the same for every seed."""
    from darts_bench.api import get_task
    from darts_bench.report.stats import RATIO_KEYS

    by: dict[tuple[str, str], dict[str, dict]] = {}
    for e in examples:
        by.setdefault((e["row"], e["task"]), {})[str(e["example"])] = e["values"]
    rows = _row_index(meta)
    va, vb = _variant_of(c, "a", base_tag), _variant_of(c, "b", base_tag)
    keep = set(merges) if merges is not None else None
    seeds = sorted({m["seed"] for m in meta.values() if m.get("merge")}, key=str)
    merge_names = sorted({m["merge"] for m in meta.values() if m.get("merge")})
    cross = {(mm["calibration"] or "*", mm["correction"]): name for name, mm in meta.items()
             if c.b_merge and mm.get("merge") == b_merge}  # (split or * for the oracle, kind) -> row of the EMR merge
    out: dict[str, list[Cell]] = {}
    for t in task_names:
        task = get_task(t)
        if family == "ref_nll":
            k_num, k_den = RATIO_KEYS["ref_nll"]
        else:
            k_num, k_den = task.per_example_key(primary[t]), None
        for split in splits:
            for m in merge_names:
                if keep is not None and m not in keep:
                    continue
                per_seed = []
                for seed in seeds:
                    ra = rows.get((m, split, va, seed, c.a)) if c.a != "none" else rows.get((m, "*", "", seed, "none"))
                    if c.b_merge:
                        rb = cross.get((split, c.b)) or cross.get(("*", c.b))
                    else:
                        rb = (rows.get((m, split, vb, seed, c.b)) if c.b != "none"
                              else rows.get((m, "*", "", seed, "none")) or rows.get((m, "*", "", None, "none")))
                    ea, eb = by.get((ra, t)), by.get((rb, t))
                    if ra is None or rb is None or ea is None or eb is None:
                        continue
                    ids = [i for i in sorted(set(ea) & set(eb))
                           if all(isinstance(x.get(k), (int, float)) and x.get(k) is not None
                                  and math.isfinite(x[k]) for x in (ea[i], eb[i]) for k in (k_num, k_den) if k)]
                    if len(ids) < 2:
                        continue
                    a = np.asarray([ea[i][k_num] for i in ids])
                    b = np.asarray([eb[i][k_num] for i in ids])
                    n = np.asarray([ea[i][k_den] for i in ids]) if k_den else np.ones(len(ids))
                    y, u = cell_stat(family, a, b, n)
                    per_seed.append((y, u, [(t, i) for i in ids]))
                cell = combine_seeds(m, t, split, per_seed) if per_seed else None
                if cell is not None:
                    out.setdefault(split, []).append(cell)
    return out


# ------------------------------------------------------------------------------ tests over cells
def is_tie(y: float, scale: float = 1.0) -> bool:
    """Whether a cell's difference is float noise: ``|y| <= TIE_RTOL * max(1, |scale|)`` (:data:`TIE_RTOL`)."""
    return abs(y) <= TIE_RTOL * max(1.0, abs(scale))


def sign_over_cells(cells: list[Cell], favours: int) -> dict[str, Any]:
    """Exact two-sided sign test over cells (ties by :func:`is_tie` dropped); ``favours`` = -1 when a
    negative estimate favours the first row."""
    wins = sum(1 for c in cells if not is_tie(c.y) and favours * c.y > 0)
    losses = sum(1 for c in cells if not is_tie(c.y) and favours * c.y < 0)
    ties = len(cells) - wins - losses
    p = float(stats.binomtest(wins, wins + losses, 0.5).pvalue) if wins + losses else None
    return {"wins": wins, "ties": ties, "losses": losses, "p": p}


def stratified_test(cells: list[Cell]) -> dict[str, Any] | None:
    """The stratified paired test within the measured cells (descriptive: it speaks of these cells, not of a
    new one): the inverse-variance weighted mean of the cell estimates, with a cluster-robust variance whose
    clusters are the units several merges share (the same held-out sequence or example of a task): each
    cluster's influence is the weighted sum of its units' influence values over cells. Normal z test.
    None when fewer than two cells carry influence values."""
    cs = [c for c in cells if len(c.u) and c.v > 0]
    if len(cs) < 2:
        return None
    w = np.asarray([1.0 / c.v for c in cs])
    W = w.sum()
    mu = float(np.sum(w * np.asarray([c.y for c in cs])) / W)
    infl: dict[Any, float] = {}
    for wc, c in zip(w, cs):
        for unit, ui in zip(c.units, c.u):
            infl[unit] = infl.get(unit, 0.0) + wc / W * float(ui)
    g = np.asarray(list(infl.values()))
    G = len(g)
    var = float(G / (G - 1) * np.sum(g ** 2)) if G > 1 else math.nan
    se = math.sqrt(var) if var > 0 else math.nan
    z = mu / se if se and math.isfinite(se) else math.nan
    return {"estimate": mu, "se": se, "p": float(2 * stats.norm.sf(abs(z))) if math.isfinite(z) else None,
            "clusters": G}


def verdict(res: MetaResult | None, favours: int, n_cells: int, min_cells: int = MIN_CELLS) -> str:
    """The line's verdict from its primary family's random-effects result (:data:`RULE`); ``n_cells``: the
    cells with a within-cell variance (the others are ties without variation)."""
    if res is None:
        return f"insufficient ({n_cells} cells with a within-cell variance < {min_cells})"
    lo, hi = favours * res.ci_low, favours * res.ci_high
    lo, hi = min(lo, hi), max(lo, hi)
    if lo > 0:
        return "supported"
    if hi < 0:
        return "not supported"
    return "inconclusive"


def meta_or_none(cells: list[Cell], alpha: float) -> MetaResult | None:
    usable = [c for c in cells if c.v > 0 and math.isfinite(c.v)]
    if len(usable) < MIN_CELLS:
        return None
    return random_effects([c.y for c in usable], [c.v for c in usable], alpha)


def null_control(cells: list[Cell], family: str, alpha: float, n_rep: int, seed: int,
                 hetero_tau: float = 0.0) -> dict[str, Any] | None:
    """A/A null control of the verdict rule on this line's cells: in each replicate, every cell's influence
    values get random signs (the two rows' labels swapped per unit at random, so each cell's true difference
    is 0; to first order the cell estimate becomes ``sum_i s_i u_i`` with the same within-cell variance), and,
    with ``hetero_tau`` > 0, a cell effect drawn from N(0, hetero_tau^2) is added (cells that disagree around a
    true mean of 0: the case a fixed-effect test gets wrong). The verdict rule (:func:`verdict` of
    :func:`~darts_bench.report.meta.random_effects`) runs on each replicate; the rate of replicates it flags
    (supported or not supported) is returned with its Clopper-Pearson 95% interval. None without enough cells."""
    from statsmodels.stats.proportion import proportion_confint

    cs = [c for c in cells if len(c.u) > 1 and c.v > 0]
    if len(cs) < MIN_CELLS or n_rep <= 0:
        return None
    rng = np.random.default_rng(seed)
    flagged = 0
    for _ in range(n_rep):
        ys, vs = [], []
        for c in cs:
            s = rng.choice((-1.0, 1.0), size=len(c.u))
            u = s * c.u
            ys.append(float(u.sum()) + (rng.normal(0.0, hetero_tau) if hetero_tau > 0 else 0.0))
            vs.append(_lin_var(u))
        v = np.asarray(vs)
        if not (v > 0).all():
            continue
        res = random_effects(ys, vs, alpha)
        flagged += verdict(res, 1, len(ys)) != "inconclusive"
    lo, hi = proportion_confint(flagged, n_rep, alpha=0.05, method="beta")
    return {"replicates": n_rep, "flagged": flagged, "rate": flagged / n_rep, "ci_low": float(lo),
            "ci_high": float(hi), "hetero_tau": hetero_tau}


# ------------------------------------------------------------------------------ the lines
def _fmt(x: float | None, nd: int = 3) -> str:
    return "n/a" if x is None or (isinstance(x, float) and not math.isfinite(x)) else f"{x:.{nd}g}"


def effect_words(family: str, res: MetaResult, a: str, b: str) -> str:
    """The estimate and its interval in plain words (log ratios as percentages)."""
    if family in LOG_RATIO:
        def pct(x: float) -> str:
            r = math.exp(x) - 1
            return f"{abs(r) * 100:.1f}% {'lower' if r < 0 else 'higher'}"
        return (f"{FAMILY_WORDS[family]} {pct(res.estimate)} for {a} than {b} (95% CI {pct(res.ci_low)} to "
                f"{pct(res.ci_high)}; a new cell: {pct(res.pi_low)} to {pct(res.pi_high)})")
    return (f"{FAMILY_WORDS[family]} {a} - {b} = {res.estimate:+.4g} (95% CI {res.ci_low:+.4g} to {res.ci_high:+.4g}; "
            f"a new cell: {res.pi_low:+.4g} to {res.pi_high:+.4g})")


def mde_words(family: str, res: MetaResult) -> str:
    if family in LOG_RATIO:
        return f"{(1 - math.exp(-res.mde)) * 100:.1f}% relative change"
    return f"{res.mde:.3g}"


ROW_WORDS = {"darts": "DARTS", "surgery": "Surgery", "darts_ew_only": "entropy weighting alone",
             "darts_pos_only": "the position table alone", "none": "the plain merge",
             "emr": "EMR-Merging (task's mask and rescaler)", "emr@routed": "EMR-Merging, routed",
             "darts@routed": "DARTS, routed", "surgery@routed": "Surgery, routed"}


def row_words(c: Contrast, side: str) -> str:
    kind = c.a if side == "a" else c.b
    w = ROW_WORDS.get(kind, kind)
    return f"the matched {w}" if side == "b" and c.b_control else w


def sentence(line: dict[str, Any]) -> str:
    """One sentence per line: what was compared, on which signal, the estimate with its interval, how sure."""
    c: Contrast = line["contrast"]
    res: MetaResult | None = line["meta"]
    a, b = row_words(c, "a"), row_words(c, "b")
    where = f"over {line['n_cells']} (merge, task) cells, {line['split']} split"
    if res is None:
        return f"{a} vs {b} ({where}): {line['verdict']}: too few cells to decide."
    sure = {"supported": f"{a} is better", "not supported": f"{b} is better",
            "inconclusive": "no difference can be claimed"}[line["verdict"]]
    cov = line.get("coverage") or {}
    low = [f"{s} {cov[s]['mean']:.0%} on average (least {cov[s]['min']:.0%})" for s in ("gen", "reference")
           if s in cov and cov[s]["min"] < COVERAGE_WARN]
    warn = (f" Warning: the position tables were trained on less than {COVERAGE_WARN:.0%} of the evaluated positions "
            f"in some cells ({'; '.join(low)}): there the position-table rows are zero-initialised, untrained."
            if low else "")
    variants = sweep_variant_groups([cell.merge for cell in line["cells"]])
    if variants:
        warn += (" Warning: cells of sweep variants of one merge (" + "; ".join(
            f"{m}: {len(v)} variants" for m, v in variants.items()) + ") are not independent merges: the interval "
            "treats them as such and is narrower than over independent merges.")
    return (f"{c.statement[0].upper() + c.statement[1:]}? **{line['verdict']}** ({sure}): {effect_words(line['family'], res, a, b)}, "
            f"{where}; HKSJ p = {_fmt(res.p, 2)}, I² = {res.i2:.2f}; detectable at 80% power: "
            f"{mde_words(line['family'], res)}.{warn}")


def sweep_variant_groups(merges: Iterable[str]) -> dict[str, list[str]]:
    """Merge -> its sweep variants (``NAME[KEY=v]``, ``sweep.merges``) among ``merges``, for every merge with
    more than one: a line over them counts settings of one merge as independent cells."""
    groups: dict[str, set[str]] = {}
    for m in merges:
        if m.endswith("]") and "[" in m:
            groups.setdefault(m[:m.index("[")], set()).add(m)
    return {m: sorted(v) for m, v in sorted(groups.items()) if len(v) > 1}


def decide(sequences: list[dict], examples: list[dict], meta: dict[str, dict[str, Any]], task_names: list[str],
           primary_metrics: dict[str, str], claims_cfg: dict[str, Any], splits: list[str], run_seed: int,
           merge_methods: dict[str, str] | None = None, planted: Iterable[str] = (),
           runs: dict[tuple, dict] | None = None) -> list[dict[str, Any]]:
    """Every claim line of :data:`CONTRASTS` the run has rows for, per calibration split.

    Args:
        sequences, examples: the evidence records (:mod:`darts_bench.report.evidence`).
        meta: row name -> {merge, correction, calibration, variant, seed, routing?}.
        task_names: tasks with heads; primary_metrics: task -> primary column.
        claims_cfg: the pre-registered ``claims`` section (:class:`darts_bench.config.ClaimsConfig` as a dict).
        splits: calibration splits; run_seed: seeds every null control.
        merge_methods: merge -> method (claim 7's strong merges); planted: merges with a planted drift (only
            the positive control reads them; every other line leaves them out).
        runs: (merge, task, split, variant, seed) -> diagnostics (DARTS table coverage).
    Returns:
        one dict per line: ``contrast``, ``split``, ``family``, ``n_cells``, ``cells`` (primary family),
        ``meta`` (:class:`MetaResult` or None), ``verdict``, ``sign``, ``stratified``, ``null`` and
        ``null_hetero``, ``secondary`` ({family: {meta, p_holm, n_cells}}), ``coverage``, ``sentence``.
    """
    from statsmodels.stats.multitest import multipletests

    from darts_bench.stages import derive_seed

    all_merges = {m["merge"] for m in meta.values() if m.get("merge")} | {s["merge"] for s in sequences}
    pick = merge_sets(merge_methods or {}, planted, all_merges)
    alpha = float(claims_cfg["alpha"])
    fam0, secondary = claims_cfg["primary"], list(claims_cfg["secondary"])
    kinds = {s_rows for s in sequences for s_rows in s["rows"]} | {m["correction"] for m in meta.values()
                                                                  if m.get("merge")}

    def cells_of(family: str, c: Contrast) -> dict[str, list[Cell]]:
        bm = next(iter(pick[c.b_merge]), None) if c.b_merge else None  # merge_sets: at most one
        if family in BEHAVIOUR_FAMILIES:
            return behaviour_cells(family, c, sequences, merges=pick[c.merges], b_merge=bm)
        return task_cells(family, c, examples, meta, task_names, primary_metrics, splits, merges=pick[c.merges],
                          b_merge=bm)

    lines = []
    for c in CONTRASTS:
        if not pick[c.merges] or c.a not in kinds or c.b not in kinds or (c.b_merge and not pick[c.b_merge]):
            continue
        favours = -1 if fam0 in LOWER_IS_BETTER else 1
        prim = cells_of(fam0, c)
        sec = {f: cells_of(f, c) for f in secondary}
        for split in splits:
            cells = prim.get(split, [])
            if not cells:
                continue
            res = meta_or_none(cells, alpha)
            line = {"contrast": c, "split": split, "family": fam0, "n_cells": len(cells), "cells": cells,
                    "meta": res, "verdict": verdict(res, favours, sum(c_.v > 0 for c_ in cells)),
                    "sign": sign_over_cells(cells, favours), "stratified": stratified_test(cells)}
            if c.merges != "planted" and claims_cfg.get("null_replicates", 0):
                n_rep = int(claims_cfg["null_replicates"])
                line["null"] = null_control(cells, fam0, alpha, n_rep, derive_seed(run_seed, "null", c.key, split))
                line["null_hetero"] = (null_control(cells, fam0, alpha, n_rep,
                                                    derive_seed(run_seed, "null-tau", c.key, split), res.tau)
                                       if res is not None and res.tau > 0 else None)
            s_out, ps = {}, []
            for f in secondary:
                r = meta_or_none(sec[f].get(split, []), alpha)
                s_out[f] = {"meta": r, "n_cells": len(sec[f].get(split, []))}
                if r is not None:
                    ps.append((f, r.p))
            if ps:
                adj = multipletests([p for _, p in ps], alpha=alpha, method="holm")[1]
                for (f, _), p in zip(ps, adj):
                    s_out[f]["p_holm"] = float(p)
            line["secondary"] = s_out
            line["coverage"] = coverage(runs or {}, c, split, pick[c.merges]) if c.a != "none" else None
            line["sentence"] = sentence(line)
            lines.append(line)
    return lines


def coverage(runs: dict[tuple, dict], c: Contrast, split: str, merges: set[str]) -> dict[str, Any] | None:
    """Of the line's position-table heads (DARTS, the position table alone) on this split: the mean and
    least share of their evaluated positions (held-out continuation ``gen``, ``reference`` answers) on trained
    table rows (:func:`darts_bench.stages.train.table_coverage`), and the cells below :data:`COVERAGE_WARN`."""
    shares: dict[str, list[float]] = {"gen": [], "reference": []}
    low = set()
    for (m, t, sp, variant, seed), d in runs.items():
        if sp != split or m not in merges or variant not in ("", None):
            continue
        for kind in (c.a, c.b):
            cov = (d.get(kind) or {}).get("table_coverage") if isinstance(d.get(kind), dict) else None
            if not cov:
                continue
            for s in shares:
                share = (cov.get(s) or {}).get("share")
                if share is not None:
                    shares[s].append(share)
                    if share < COVERAGE_WARN:
                        low.add((m, t, kind, s))
    if not any(shares.values()):
        return None
    return {s: {"mean": float(np.mean(v)), "min": float(np.min(v)), "n": len(v)} for s, v in shares.items() if v} | {
        "below_warn": sorted(f"{m}/{t} {k} {s}" for m, t, k, s in low)}


# ------------------------------------------------------------------------------ claims.md
def rule_text(alpha: float, primary: str) -> str:
    """The decision rule, as claims.md's header states it (from :data:`RULE`, the same dict :func:`verdict`
    implements)."""
    level = f"{1 - alpha:.0%}"
    parts = "; ".join(f"`{k}` when {v.format(level=level, min_cells=MIN_CELLS)}" for k, v in RULE.items())
    return (f"**Decision rule (pre-registered primary family: `{primary}`, {FAMILY_WORDS.get(primary, primary)}"
            f"{', log ratio' if primary in LOG_RATIO else ''}).** The unit is the (merge, task) cell; head seeds are "
            "averaged inside a cell and their spread is part of its variance. Per line and split, the cells' estimates "
            "(delta-method variances from the per-sequence or per-example sums in `evidence/`) are pooled by a "
            "DerSimonian-Laird random-effects meta-analysis with the Hartung-Knapp-Sidik-Jonkman interval "
            f"(statsmodels; its modified form, scale max(1, q), never narrower than the plain random-effects "
            f"interval); the line is {parts}. Each line states I² and tau (how much cells disagree), the 95% "
            "prediction interval for a new cell and the minimum detectable effect at 80% power. Beside it, "
            "descriptive only: the exact sign test over cells (ties within 64 float32 epsilons dropped) and the "
            "stratified paired test within the measured cells (inverse-variance weights, clusters = units several "
            "merges share). Secondary families are exploratory: Holm-adjusted among themselves, never a verdict. "
            "The A/A null control swaps the two rows per unit at random inside each cell (true difference 0) and "
            "reruns the rule; its flag rate is stated with a Clopper-Pearson interval (`null`), and again with cell "
            "effects drawn around 0 with the observed tau (`null, tau`).\n\n")


def lines_table(lines: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """claims.md's decision table, one record per line."""
    out = []
    for ln in lines:
        c, r = ln["contrast"], ln["meta"]
        sg, st = ln["sign"], ln["stratified"]
        nul, nh = ln.get("null"), ln.get("null_hetero")
        cov = ln.get("coverage")
        sec = "; ".join(f"{f}: " + ("n/a" if s["meta"] is None else
                                    f"{s['meta'].estimate:+.3g} [{s['meta'].ci_low:+.3g}, {s['meta'].ci_high:+.3g}], "
                                    f"Holm p = {_fmt(s.get('p_holm'), 2)}") + f" ({s['n_cells']} cells)"
                        for f, s in ln["secondary"].items())
        out.append({
            "claim": c.claim, "line": c.key, "statement": c.statement, "split": ln["split"],
            "primary": f"{ln['family']}{' (log ratio)' if ln['family'] in LOG_RATIO else ''}",
            "cells": ln["n_cells"], "verdict": ln["verdict"],
            "estimate [95% HKSJ CI]": "n/a" if r is None else f"{r.estimate:+.4g} [{r.ci_low:+.4g}, {r.ci_high:+.4g}]",
            "p": "n/a" if r is None else _fmt(r.p, 2),
            "I²": "n/a" if r is None else f"{r.i2:.2f}", "tau": "n/a" if r is None else _fmt(r.tau),
            "95% PI": "n/a" if r is None else f"[{r.pi_low:+.4g}, {r.pi_high:+.4g}]",
            "MDE (80%)": "n/a" if r is None else f"{r.mde:.3g}",
            "sign test": f"{sg['wins']}/{sg['ties']}/{sg['losses']}, p = {_fmt(sg['p'], 2)}",
            "stratified": "n/a" if st is None else f"{st['estimate']:+.4g} ± {_fmt(st['se'])}, p = {_fmt(st['p'], 2)}",
            "null": "n/a" if nul is None else f"{nul['flagged']}/{nul['replicates']} = {nul['rate']:.3f} "
                                              f"[{nul['ci_low']:.3f}, {nul['ci_high']:.3f}]",
            "null, tau": "n/a" if nh is None else f"{nh['flagged']}/{nh['replicates']} = {nh['rate']:.3f} "
                                                  f"[{nh['ci_low']:.3f}, {nh['ci_high']:.3f}]",
            "table coverage": "n/a" if not cov else ", ".join(
                f"{s} {cov[s]['mean']:.0%} (min {cov[s]['min']:.0%})" for s in ("gen", "reference") if s in cov)
                + (f"; below {COVERAGE_WARN:.0%}: {len(cov['below_warn'])}" if cov.get("below_warn") else ""),
            "secondary (exploratory)": sec,
        })
    return out


def cell_records(lines: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (line, cell): the primary family's estimate and within-cell SE (claims.md's evidence)."""
    return [{"line": ln["contrast"].key, "split": ln["split"], "merge": c.merge, "task": c.task,
             "family": ln["family"], "estimate": c.y, "se": math.sqrt(c.v) if c.v > 0 else 0.0,
             "seeds": c.n_seeds, "units": c.n_units} for ln in lines for c in ln["cells"]]


def lines_json(lines: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The decided lines as plain data (``results.json`` ``decisions``): the numbers behind claims.md's table."""
    out = []
    for ln in lines:
        c = ln["contrast"]
        out.append({"claim": c.claim, "line": c.key, "statement": c.statement, "split": ln["split"],
                    "family": ln["family"], "cells": ln["n_cells"], "verdict": ln["verdict"],
                    "sentence": ln["sentence"], "meta": None if ln["meta"] is None else ln["meta"].as_dict(),
                    "sign": ln["sign"], "stratified": ln["stratified"], "null": ln.get("null"),
                    "null_hetero": ln.get("null_hetero"), "coverage": ln.get("coverage"),
                    "secondary": {f: {"meta": None if v["meta"] is None else v["meta"].as_dict(),
                                      "cells": v["n_cells"], "p_holm": v.get("p_holm")}
                                  for f, v in ln["secondary"].items()}})
    return out


#: the files a reader opens after the verdicts (table.md, the CLI's last lines, the page)
NEXT_FILES = ("index.html (the page: verdicts, figures, every table)", "claims.md (every line, its cells, the rule)",
              "table.md / table.csv (every row and column)")


def verdict_block(sentences: list[str]) -> str:
    """The verdicts first (markdown): one sentence per decided line, then the files to open next."""
    if not sentences:
        return ("## Verdicts\n\nNo claim line could be decided on this run (no corrected rows with held-out "
                "signals). Open next: " + "; ".join(NEXT_FILES) + ".\n")
    return ("## Verdicts\n\n" + "".join(f"- {s}\n" for s in sentences) + "\nOpen next: " + "; ".join(NEXT_FILES)
            + ".\n")
