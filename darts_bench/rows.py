"""The rows of a run: the one definition of which models are evaluated.

A row is one evaluated model: ``base``, ``expert:<e>``, each merge, and each corrected row of a
merge, one per (calibration split, method, sweep variant, head seed). :func:`row_specs` lists them
from the config alone (no artifact is built), in table order; :func:`bind_rows` attaches the model
dirs and head dirs the pipeline built. The pipeline, the planner (:mod:`darts_bench.plan`) and the
report all read rows from here, so a new row kind is one edit.

Row names: ``<merge>+<method>[@split][<variant tag>][#s<seed>]``; the variant tag ``[w_max=2,...]``
appears only when a sweep is configured (``sweep.surgery``) and ``#s<seed>`` only when ``seeds`` is
set, so the default (no sweep, ``seeds: null``) keeps single-seed row names and cache keys. A
*variant* is one combination of the ``sweep.surgery`` values (:func:`darts_bench.config.surgery_grid`);
a *head seed* sets head init, batch order and held-out split. Features do not depend on either, so a
sweep or extra seeds only add head training and evaluation. A merge sweep (``sweep.merges``) is not a
variant tag of the corrected rows: it replaces the merge in ``cfg.merges`` by merges named
``<merge>[density=0.4]`` (:func:`darts_bench.config.expand_merge_sweep`), so its rows read
``ties[density=0.4]+darts[w_max=2]`` and everything here treats each variant as a merge of its own.

Task-agnostic rows (``surgery.task_agnostic``, :mod:`darts_bench.surgery.routing`) follow each split's
rows (after its controls), per method of ``surgery.methods`` (not the controls), sweep variant and head
seed: ``<merge>+<method>[@split]@routed[tag][#s<seed>]`` (the head of the task a router picks per prompt
from the merged model's own hidden state) and ``<merge>+<method>[@split]@shared[tag][#s<seed>]`` (one head
trained on the union of every task's calibration set). Their ``correction`` is ``<method>@routed`` /
``<method>@shared`` (so the DARTS vs Surgery pairings, which pair ``darts`` with ``surgery``, leave them
out) and ``routing`` is ``routed`` / ``shared``.

Task-aware merges (``emr``, :mod:`darts_bench.merge.emr`: a model per task, no single merged model) get
no corrected rows; their rows are ``<merge>`` (the *oracle*: on task t, t's expert's model; ``correction``
``emr``, ``routing`` ``oracle``) and, per calibration split, ``<merge>[@split]@routed`` (a router picks the
task per prompt from the base model's prompt state; ``correction`` ``emr@routed``, ``routing`` ``routed``,
``calibration`` the split the router was fitted on). Neither carries a seed or a sweep tag.

Controls (``surgery.controls``, :mod:`darts_bench.controls`) add, after each split's method rows, a
Surgery row per variant and seed whose variant tag names the control: ``<merge>+surgery[rank=matched]``
(parameter-matched to DARTS), ``ties+surgery@inductive[w_max=2,rank=matched]#s1``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any

from darts_bench.artifacts import stable_hash


def head_seeds(cfg) -> list[int]:
    """The head seeds of a run: ``cfg.seeds``, or ``[cfg.seed]`` when ``seeds`` is not set."""
    return list(cfg.seeds) if cfg.seeds else [cfg.seed]


def seed_tag(cfg, seed: int) -> str:
    """``#s<seed>`` when the run has a ``seeds`` list, else ``""`` (single-seed rows keep their name)."""
    return f"#s{seed}" if cfg.seeds else ""


def surgery_variants(cfg) -> list[tuple[str, Any]]:
    """``[(tag, SurgeryConfig)]``: one entry per combination of ``cfg.sweep.surgery`` values, in the
    order the keys and values are listed (the last key varies fastest). Without a sweep:
    ``[("", cfg.surgery)]``. ``max_len`` is not resolved here (the train stage resolves it).

    Raises:
        ValueError: a combination is not a valid surgery section (the message names it).
    """
    from darts_bench.config import surgery_grid

    return surgery_grid(cfg.surgery, cfg.sweep)


def merged_entropy_needed(cfg) -> bool:
    """Whether a run reads the merged model's next-token entropy: only a surgery variant (the
    section or a sweep combination) with ``entropy_source: merged`` does (``expert``, the default,
    reads the expert's; ``kl`` both models' hidden states). Otherwise the merged features skip the
    ``lm_head`` and softmax over the vocabulary for every token (~22% of their forward on
    SmolLM2-135M, whose vocabulary is a fifth of its weights)."""
    return any(scfg.entropy_source == "merged" for _, scfg in surgery_variants(cfg))


def control_tags(cfg) -> list[str]:
    """The variant tags of the control rows (:func:`darts_bench.controls.control_tag`), one per
    (sweep variant, ``surgery.controls`` entry), in that order; [] without controls. Controls cannot
    be swept, so every variant has ``cfg.surgery.controls``."""
    from darts_bench.controls import control_tag

    return [control_tag(tag, c) for tag, _ in surgery_variants(cfg) for c in cfg.surgery.controls]


@dataclass(frozen=True)
class RowSpec:
    """One evaluated model as the config defines it (nothing built yet).

    ``model`` is the row name (``base`` | ``expert:code`` | ``ties`` | ``ties+darts`` |
    ``ties+darts@inductive[w_max=2]#s1``); ``merge`` the merge it belongs to ("" for base and
    experts); ``expert`` the pool model of a base or expert row (``base`` | ``code`` | ...);
    ``correction`` ``none`` or the method; ``calibration`` the split of its heads ("" when none);
    ``variant`` the sweep tag ("" without a sweep); ``seed`` the head seed of a corrected row.
    """

    model: str
    merge: str = ""
    expert: str = ""
    correction: str = "none"
    calibration: str = ""
    variant: str = ""
    seed: int | None = None
    routing: str = ""

    @property
    def method(self) -> str:
        """The correction method of the row's heads (``correction`` without ``@routed`` / ``@shared``)."""
        return self.correction.split("@")[0]

    @property
    def task_aware(self) -> bool:
        """A row of a task-aware merge (``emr``): it runs a model per task (:attr:`Row.task_models`), no head."""
        from darts_bench.config import TASK_AWARE_METHODS

        return self.method in TASK_AWARE_METHODS

    @property
    def head_key(self) -> tuple[str, str, str, int | None]:
        """``(method, split, variant, seed)``: with (merge, task) in front, the key of the row's head
        in the train stage's ``run_heads`` (a shared row's task is :data:`SHARED_TASK`)."""
        return (self.method, self.calibration, self.variant, self.seed)


@dataclass(frozen=True)
class Row(RowSpec):
    """A :class:`RowSpec` bound to the artifacts of a run: ``model_dir`` (the checkpoint it runs),
    ``model_key`` (its identity in evaluation cache keys: the model's key, plus a hash of the head
    dirs for a corrected row) and ``heads`` (task -> head dir; tasks without an expert have none)."""

    model_dir: Path | None = None
    model_key: str = ""
    heads: dict[str, Path] = field(default_factory=dict)
    router: Path | None = None
    #: a task-aware row: task -> the checkpoint that runs it (its expert's EMR model); ``states_dir``: the model
    #: whose prompt states a routed one reads (the base)
    task_models: dict[str, Path] = field(default_factory=dict)
    states_dir: Path | None = None


def corrected_suffix(cfg, split: str, method: str, tag: str, seed: int) -> str:
    """``+<method>[@split][tag][#s<seed>]``, the part of a corrected row's name after its merge."""
    return f"+{method}{'' if split == 'transductive' else f'@{split}'}{tag}{seed_tag(cfg, seed)}"


#: the task slot of a shared head in the train stage's ``run_heads`` (no task folder can be named so)
SHARED_TASK = "*shared*"
#: the ``surgery.task_agnostic`` kinds, in row order
ROUTING_KINDS = ("routed", "shared")


def agnostic_suffix(cfg, split: str, method: str, kind: str, tag: str, seed: int) -> str:
    """``+<method>[@split]@<kind>[tag][#s<seed>]``: a task-agnostic row's name after its merge."""
    return f"+{method}{'' if split == 'transductive' else f'@{split}'}@{kind}{tag}{seed_tag(cfg, seed)}"


def row_specs(cfg) -> list[RowSpec]:
    """Every row of ``cfg`` in table order: base, ``expert:<e>`` for each pool expert (``pool.experts``
    in order, or the built pools' three), then each
    merge followed by its corrected rows (split, then method, then sweep variant, then head seed),
    each split's control rows after its method rows (:func:`control_tags`, then head seed), then its
    task-agnostic rows (``surgery.task_agnostic`` kind in :data:`ROUTING_KINDS` order, then method,
    variant, head seed)."""
    from darts_bench.controls import CONTROL_METHOD

    specs = [RowSpec("base", expert="base"), *(RowSpec(f"expert:{e}", expert=e) for e in cfg.pool.expert_names)]
    tags = [tag for tag, _ in surgery_variants(cfg)]
    heads = [(method, tag) for method in cfg.surgery.methods for tag in tags]
    heads += [(CONTROL_METHOD, tag) for tag in control_tags(cfg)]
    for spec in cfg.merges:
        m = spec.name
        if spec.task_aware:
            specs.append(RowSpec(m, merge=m, correction=spec.method, routing="oracle"))
            specs += [RowSpec(f"{m}{'' if split == 'transductive' else f'@{split}'}@routed", merge=m,
                              correction=f"{spec.method}@routed", calibration=split, routing="routed")
                      for split in cfg.calibration.splits]
            continue
        specs.append(RowSpec(m, merge=m))
        for split in cfg.calibration.splits:
            for method, tag in heads:
                for seed in head_seeds(cfg):
                    specs.append(RowSpec(m + corrected_suffix(cfg, split, method, tag, seed), merge=m,
                                         correction=method, calibration=split, variant=tag, seed=seed))
            for kind in (k for k in ROUTING_KINDS if k in cfg.surgery.task_agnostic):
                for method in cfg.surgery.methods:
                    for tag in tags:
                        for seed in head_seeds(cfg):
                            specs.append(RowSpec(m + agnostic_suffix(cfg, split, method, kind, tag, seed), merge=m,
                                                 correction=f"{method}@{kind}", calibration=split, variant=tag,
                                                 seed=seed, routing=kind))
    return specs


def row_names(cfg) -> list[str]:
    """Every row name of ``cfg``, in table order (:func:`row_specs`)."""
    return [s.model for s in row_specs(cfg)]


def row_matches(name: str, pattern: str) -> bool:
    """Whether ``pattern`` (an ``evaluate.rows`` entry) selects row ``name``: its exact name, or an fnmatch
    glob over names. The exact name first: a sweep variant's or control's name holds ``[...]``
    (``ties[density=0.4]``, ``ties+surgery[rank=matched]``), which fnmatch reads as a character class, so the
    row's own name did not select it."""
    return name == pattern or fnmatchcase(name, pattern)


def row_selected(cfg, name: str) -> bool:
    """Whether row ``name`` is evaluated (``evaluate.rows`` patterns, :func:`row_matches`; every row when
    unset)."""
    pats = cfg.evaluate.rows
    return pats is None or any(row_matches(name, p) for p in pats)


def check_row_filter(cfg) -> None:
    """Raises ValueError when an ``evaluate.rows`` pattern matches no row of ``cfg`` (a typo would
    otherwise silently evaluate nothing); the message names the nearest row names (difflib), not all."""
    import difflib

    names = row_names(cfg)
    for p in cfg.evaluate.rows or []:
        if not any(row_matches(n, p) for n in names):
            near = difflib.get_close_matches(p, names, n=3, cutoff=0.4)
            hint = f"did you mean {', '.join(near)}? " if near else ""
            raise ValueError(f"evaluate.rows: pattern {p!r} matches no row; {hint}(`darts-bench ls rows` lists the "
                             f"{len(names)} rows of this config; an entry is a row's exact name or an fnmatch "
                             "glob, e.g. 'ties+*')")


def selected_specs(cfg) -> list[RowSpec]:
    """The rows ``evaluate.rows`` selects, in table order (:func:`check_row_filter` first). The rows of a
    merge with a planted drift (``merges[*].planted_drift``, the positive control) are never evaluated on the
    benchmarks: the drift lives in their cached features, not in their weights; they are behaviour-only."""
    check_row_filter(cfg)
    planted = {m.name for m in cfg.merges if m.planted_drift}
    return [s for s in row_specs(cfg) if row_selected(cfg, s.model) and s.merge not in planted]


def needed_specs(cfg, task_names: list[str] | None = None) -> list[RowSpec]:
    """The rows a run must build, in table order: those ``evaluate.rows`` selects, the rows the selected
    tasks call by name (``Task.models_used``: the AlpacaEval judge, a ``model:<row>`` reference), and the
    plain merge row of each selected corrected row (a task without a head runs it as its merge). Every
    row when ``evaluate.rows`` is unset. The merges, features and heads of the other rows are not built."""
    specs = row_specs(cfg)
    if cfg.evaluate.rows is None:
        return specs
    want = {s.model for s in specs if row_selected(cfg, s.model)}
    if task_names:
        from darts_bench.api import get_task

        for t in task_names:
            tcfg = getattr(cfg.tasks, t)
            want |= set(get_task(t, tcfg).models_used(tcfg))
            ref = getattr(tcfg, "reference", None)
            if isinstance(ref, str) and ref.startswith("model:"):
                want.add(ref[len("model:"):])
    want |= {s.merge for s in specs if s.model in want and s.merge}
    return [s for s in specs if s.model in want]


def needed_merges(cfg, task_names: list[str] | None = None) -> list[str]:
    """The merges the run builds (:func:`needed_specs`, and every merge with a planted drift: the positive
    control is behaviour-only, no row of it is ever selected), in ``cfg.merges`` order."""
    need = {s.merge for s in needed_specs(cfg, task_names) if s.merge} | {m.name for m in cfg.merges
                                                                            if m.planted_drift}
    return [m.name for m in cfg.merges if m.name in need]


def needs_merges(cfg) -> bool:
    """False when ``evaluate.rows`` selects no merge or corrected row (merge, collect and train are
    then skipped: base and experts only), unless a merge has a planted drift (the positive control)."""
    return any(m.planted_drift for m in cfg.merges) or any(row_selected(cfg, s.model) for s in row_specs(cfg)
                                                          if s.merge)


def bind_rows(specs: list[RowSpec], pool, merges: dict[str, Path], run_heads: dict, task_names: list[str],
              routers: dict | None = None, task_experts: dict[str, str | None] | None = None) -> list[Row]:
    """``specs`` bound to a run's artifacts.

    Args:
        specs: rows from :func:`row_specs` (or a subset).
        pool: the built pool (``path(name)``, ``model_key(name)``).
        merges: merge name -> merged checkpoint dir (the merge stage).
        run_heads: ``(merge, task, method, split, variant, seed)`` -> head dir (the train stage).
        task_names: the run's tasks; a corrected row gets the head of each task that has one (a
            shared row: the shared head for each of those tasks; a routed row: every task's head).
        routers: ``(merge, split, seed)`` -> router dir (the train stage; routed rows only); a task-aware
            merge's routers under ``(merge, split, None)`` (:func:`darts_bench.stages.emr.emr_routers`).
        task_experts: task -> its expert (None: none), for the task-aware rows (task t runs its expert's model).

    Raises:
        KeyError: a merge row whose merge, shared head or router was not built.
    """
    rows = []
    for s in specs:
        if not s.merge:
            rows.append(Row(**vars(s), model_dir=pool.path(s.expert), model_key=pool.model_key(s.expert)))
            continue
        mdir = merges[s.merge]
        if s.task_aware:
            from darts_bench.config import TASK_MODELS_DIR

            # each task's expert's checkpoint (darts_bench.merge.emr.task_dir; not imported: merge -> collect -> rows)
            tm = {t: mdir / TASK_MODELS_DIR / e for t, e in (task_experts or {}).items()
                  if e is not None and t in task_names}
            router = routers[(s.merge, s.calibration, None)] if s.routing == "routed" else None
            key = mdir.name + ("+oracle" if router is None else "+" + stable_hash([f"router={router}",
                                                                                   pool.model_key("base")]))
            rows.append(Row(**vars(s), model_dir=mdir, model_key=key, router=router, task_models=tm,
                            states_dir=pool.path("base") if router is not None else None))
            continue
        if s.correction == "none":
            rows.append(Row(**vars(s), model_dir=mdir, model_key=mdir.name))
            continue
        hd = {t: run_heads[(s.merge, t, *s.head_key)] for t in task_names
              if (s.merge, t, *s.head_key) in run_heads}  # tasks with no expert get no head
        parts = [str(p) for p in hd.values()]
        router = None
        if s.routing == "shared":
            shared = run_heads[(s.merge, SHARED_TASK, *s.head_key)]
            hd = {t: shared for t in hd}
            parts = [str(shared)]
        elif s.routing == "routed":
            router = routers[(s.merge, s.calibration, s.seed)]
            # the router picks among every task's head: all of them (and the router) are the row's identity
            parts = [f"{t}={p}" for t, p in hd.items()] + [f"router={router}"]
        rows.append(Row(**vars(s), model_dir=mdir, model_key=mdir.name + "+" + stable_hash(parts), heads=hd,
                        router=router))
    return rows


def row_meta(cfg, rows: list[RowSpec]) -> dict[str, dict[str, Any]]:
    """Row name -> {"merge", "correction", "calibration", "variant", "seed", "group"}; ``group`` is
    the row name without its ``#s<seed>`` tag (None for a row without one)."""
    out = {}
    for r in rows:
        tag = seed_tag(cfg, r.seed) if r.seed is not None else ""
        group = r.model[: len(r.model) - len(tag)] if tag and r.model.endswith(tag) else None
        out[r.model] = {"merge": r.merge, "correction": r.correction, "calibration": r.calibration,
                        "variant": r.variant, "seed": r.seed, "group": group}
        if r.routing:  # only on task-agnostic and task-aware rows: existing results keep their row_meta bytes
            out[r.model]["routing"] = r.routing
    return out


__all__ = ["ROUTING_KINDS", "Row", "RowSpec", "SHARED_TASK", "agnostic_suffix", "bind_rows", "check_row_filter",
           "control_tags", "corrected_suffix", "head_seeds", "needed_merges", "needed_specs", "needs_merges",
           "row_meta", "row_names", "row_selected", "row_specs", "seed_tag", "selected_specs",
           "surgery_variants"]
