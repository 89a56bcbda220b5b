"""The train stage: Surgery / DARTS heads per (merge, task, split, sweep variant, head seed), each
trained on the cached features, with diagnostics on held-out calibration sequences and on the
reference answers.

One artifact per (merge, task, split, variant, seed) — ``heads/<merge>-<task>-<split>-<key>/`` —
holds one head per method (``<method>/``) and ``diagnostics.json``: representation L1 (plain and
entropy-weighted), KL to the expert and top-1 agreement per row (``none`` = the uncorrected merge,
then each method), per-position L1 slope, entropy contrast, gap closed, and sequence-bootstrap CIs of
the behaviour signals (:mod:`darts_bench.surgery.intervals`), each also on the expert-continuation
(``gen``) and prompt positions with a shared chat template left out (:func:`diagnose_rows`), and the
per-sequence sums those intervals are computed from (``per_sequence``). Methods and losses:
:mod:`darts_bench.surgery`.
"""

from __future__ import annotations

import collections
import copy
import functools
import itertools
import json
import logging
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

from darts_bench.api import resolve_suite
from darts_bench.artifacts import cached, stable_hash, verify
from darts_bench.collect.features import FeatureSet
from darts_bench.evidence import RUN_N_BOOT
from darts_bench.pool.checkpoint import lm_head_weight
from darts_bench.rows import seed_tag, surgery_variants
from darts_bench.stages import KNOWN_STREAMS_MAX, derive_seed
from darts_bench.surgery.diagnostics import entropy_contrast, gap_closed, position_slope
from darts_bench.surgery.heads import METHODS, save_head
from darts_bench.surgery.train import split_by_sequence, train_head

log = logging.getLogger("darts_bench")


def resolve_surgery(cfg, surgery, base_dir: Path):
    """``surgery`` (``cfg.surgery`` or a sweep variant's section) with ``max_len`` resolved: derived
    from the longest calibration and evaluation sequence of every enabled task when unset
    (:mod:`darts_bench.positions`; not per suite, so every suite trains the same heads), capped by
    the base's ``max_position_embeddings``. Logs a warning when an explicit table is shorter than the
    sequences."""
    from darts_bench.positions import clamp_warning, resolve_max_len

    cfg = cfg if surgery is cfg.surgery else cfg.model_copy(update={"surgery": surgery})
    max_pos = json.loads((Path(base_dir) / "config.json").read_text()).get("max_position_embeddings")
    enabled = resolve_suite("all", cfg.tasks)
    warn = clamp_warning(cfg, enabled, max_pos)
    if warn:
        log.warning(warn)
    return surgery.model_copy(update={"max_len": resolve_max_len(cfg, enabled, max_pos)})


#: version of what ``diagnostics.json`` holds (in the head key: the heads artifact contains it).
#: 2: ``gen`` / ``prompt`` position sets, shared-template exclusion, ``per_sequence`` evidence,
#: ``kl_by_position``. 3: ``table_coverage`` of each position-table head (:func:`table_coverage`).
DIAGNOSTICS_VERSION = 3
#: how a position-bias head's gradient is summed, in the key of heads whose methods have a bias table:
#: 2: in token order (``nn.functional.embedding``'s backward, :class:`darts_bench.surgery.heads.CorrectionHead`),
#: the same bits at any thread count; before, a thread race at ``torch_threads`` > 1 (the 1-thread
#: heads of ``micro`` and ``tiny`` are bitwise the same either way).
POSITION_BIAS_GRAD_VERSION = 2
#: resamples of every diagnostics interval (recorded in ``diagnostics.json`` under ``bootstrap``)
N_BOOT = RUN_N_BOOT


def resolve_controls(variants: list[tuple[str, Any]], base_dir: Path) -> list[tuple[str, Any]]:
    """``[(tag, SurgeryConfig)]`` of the matched controls (:mod:`darts_bench.controls`) of each sweep
    variant in ``variants`` (``max_len`` resolved), in variant order: tag ``[rank=matched]`` (or the
    variant's tag with ``rank=matched``), methods ``[surgery]``, rank from the base's ``hidden_size``.
    The train stage trains them like any variant.

    Raises:
        ValueError: a control is configured but the base's ``config.json`` has no ``hidden_size``.
    """
    from darts_bench.controls import control_surgery, control_tag

    out = []
    for tag, scfg in variants:
        if not scfg.controls:
            continue
        conf = json.loads((Path(base_dir) / "config.json").read_text())
        d = conf.get("hidden_size") or (conf.get("text_config") or {}).get("hidden_size")
        if not d:
            raise ValueError(f"surgery.controls {scfg.controls}: no hidden_size in {Path(base_dir) / 'config.json'} "
                             "to size the matched head")
        out += [(control_tag(tag, c), control_surgery(scfg, int(d), c)) for c in scfg.controls]
    return out


#: surgery settings that add rows but change no method head (left out of :func:`head_key`)
NOT_IN_HEAD_KEY = ("controls", "task_agnostic", "routing")


def head_key(cfg, features_key: str, reference_key: str, scfg, seed: int | None = None) -> str:
    """Cache key of one (merge, task, split)'s heads: features, resolved surgery config ``scfg``,
    held-out fraction, head seed (``seed``, default ``cfg.seed``), :data:`DIAGNOSTICS_VERSION`,
    :data:`POSITION_BIAS_GRAD_VERSION` when a method has a position bias and,
    when DeepSpeed trains them, the
    DeepSpeed settings and accelerator (DeepSpeed heads differ from in-process ones by float summation
    order; see README)."""
    # surgery.controls is left out: a control's heads are their own artifact (their own methods and
    # rank, :func:`resolve_controls`), so switching controls on leaves the methods' heads' keys as they were
    parts = {"features": features_key, "reference": reference_key,
             "surgery": {k: v for k, v in scfg.model_dump(mode="json").items() if k not in NOT_IN_HEAD_KEY},
             "held_out": cfg.calibration.held_out_fraction,
             "seed": cfg.seed if seed is None else seed, "diagnostics": DIAGNOSTICS_VERSION}
    if any(METHODS[m][0] for m in scfg.methods):
        parts["position_bias_grad"] = POSITION_BIAS_GRAD_VERSION
    if cfg.deepspeed.enabled:
        from darts_bench.surgery.train_deepspeed import deepspeed_key

        parts["deepspeed"] = deepspeed_key(cfg.deepspeed)
    return stable_hash(parts)


def train(cfg, collected: dict, merges: dict[str, Path], pool, tasks: dict, variants: list[tuple[str, Any]],
          seeds: list[int], work_dir: Path, release_executor: Callable[[], None] = lambda: None) -> dict:
    """Train (or reuse) every head of the run, in three steps: the heads of every (merge, task, split,
    variant, seed) artifact that is not cached (:func:`train_heads`, held in memory); the routers and
    shared heads of the task-agnostic rows; then per (merge, task, split, seed) one diagnostics pass over
    its held-out tokens for all its missing rows, and per (merge, task, split) one over the reference answers
    for the rows of every seed, after which each artifact is written (:func:`diagnose_streams`). An
    artifact's files are those one pass per artifact would write, byte for byte; a run killed before step 3
    retrains the heads it held.

    Args:
        collected: the collect stage's ``{"calibration", "features"}``.
        variants: ``[(tag, resolved SurgeryConfig)]`` (:func:`resolve_surgery` of each sweep variant).
        seeds: the head seeds (:func:`darts_bench.rows.head_seeds`).
        release_executor: frees the executor's actors before DeepSpeed runs through Ray Train.

    Returns:
        ``{"heads": {(merge, task, method, split): dir}, "diagnostics": {(merge, task, split): dict}}``
        of the first variant and seed, ``"runs": {(merge, task, split, variant, seed): diagnostics}`` and
        ``"run_heads": {(merge, task, method, split, variant, seed): dir}`` of every variant and seed.
        With ``surgery.task_agnostic``: ``"routers": {(merge, split, seed): dir}`` (:func:`train_routers`)
        and the shared heads in ``run_heads`` under task :data:`darts_bench.rows.SHARED_TASK`
        (:func:`train_shared`; the methods' variants, not the controls), and ``"agnostic_runs":
        {(merge, task, split, variant, seed): {"routed"?, "shared"?: diagnostics}}``
        (:func:`agnostic_artifact`). With a task-aware merge (EMR) among ``merges``: ``"task_aware_runs":
        {(merge, task, split, "", seed): diagnostics}`` of its rows (:func:`task_aware_runs`; no heads).
    """
    feats = collected["features"]
    heads: dict[tuple[str, str, str, str], Path] = {}
    diags: dict[tuple[str, str, str], dict] = {}
    runs: dict[tuple[str, str, str, str, int], dict] = {}
    run_heads: dict[tuple[str, str, str, str, str, int], Path] = {}
    first = (variants[0][0], seeds[0])
    # 1. the heads of every (merge, task, split, variant, seed) whose artifact is not cached, trained now and
    #    held until step 3 writes them with their diagnostics
    pending: dict[tuple, dict] = {}
    finals: dict[tuple, tuple[Path, str]] = {}
    for (m, name, split), fs in feats.items():
        if split == "reference":
            continue
        task = tasks[name][0]
        ref_fs = feats[(m, name, "reference")]
        for (tag, scfg), seed in itertools.product(variants, seeds):
            key = head_key(cfg, fs.key, ref_fs.key, scfg=scfg, seed=seed)
            final = work_dir / "heads" / f"{m}-{name}-{split}-{key}"
            what = f"train heads {m}/{name}/{split}{tag}{seed_tag(cfg, seed)}"
            finals[(m, name, split, tag, seed)] = (final, what)
            if not reused(final, what):
                t0 = time.perf_counter()
                x = diagnosis_inputs(cfg, fs, merges[m], pool.path(task.expert), ref_fs, name, split, scfg, seed)
                trained = train_heads(cfg, x, m, name, split, scfg, seed, work_dir, release_executor)
                pending[(m, name, split, tag, seed)] = {
                    "scfg": scfg, "x": _training_record(x, trained, fs.calib.meta), "trained": trained}
                log.info("%s: heads trained in %.1f s (%s; diagnosed in one pass with the other rows of its "
                         "token streams below)", what, time.perf_counter() - t0, final)
            for method in scfg.methods:
                run_heads[(m, name, method, split, tag, seed)] = final / method
    out = {"heads": heads, "diagnostics": diags, "runs": runs, "run_heads": run_heads}
    # 2. the task-agnostic rows' routers and shared heads (the methods' variants only: controls get no
    #    task-agnostic rows, darts_bench/rows.py)
    agnostic = cfg.surgery.task_agnostic
    own = {tag for tag, _ in surgery_variants(cfg)}
    method_variants = [(tag, scfg) for tag, scfg in variants if tag in own] if agnostic else []
    if "routed" in agnostic:
        out["routers"] = train_routers(cfg, feats, seeds, work_dir)
    if "shared" in agnostic:
        run_heads.update(train_shared(cfg, feats, merges, pool, tasks, method_variants, seeds, work_dir))
    # 3. per (merge, task, split, seed): one diagnostics pass over its token streams for every row whose
    #    artifact is missing (the methods' heads of each variant, the matched controls, the task-agnostic
    #    rows; the reference answers once for every seed's rows), then each artifact written
    agnostic_runs = diagnose_streams(cfg, feats, merges, pool, tasks, variants, method_variants, seeds,
                                     out.get("routers", {}), run_heads, pending, finals, work_dir)
    for (m, name, split, tag, seed), (final, _) in finals.items():
        runs[(m, name, split, tag, seed)] = json.loads((final / "diagnostics.json").read_text())
        if (tag, seed) == first:
            diags[(m, name, split)] = runs[(m, name, split, tag, seed)]
            for method in dict(variants)[tag].methods:
                heads[(m, name, method, split)] = final / method
    if agnostic:
        out["agnostic_runs"] = agnostic_runs
    aware = task_aware_runs(cfg, collected, merges, pool, tasks, variants[0][1], seeds, work_dir)
    if aware:
        out["task_aware_runs"] = aware
    return out


def reused(final: Path, what: str) -> bool:
    """Whether a complete artifact is at ``final`` (:func:`~darts_bench.artifacts.verify`), logged as
    :func:`~darts_bench.artifacts.cached` logs a reuse: the train stage trains and diagnoses the others."""
    if final.exists() and verify(final) is None:
        log.info("%s: cached (%s)", what, final)
        return True
    return False


def _training_record(x: dict, trained: dict[str, tuple[Any, dict]], meta: dict) -> dict:
    """What a pending heads artifact keeps of :func:`diagnosis_inputs` (and of its ``trained`` heads:
    :func:`table_coverage` per method with a position table) for its ``diagnostics.json``."""
    from darts_bench.surgery.data import position_sets

    gen = position_sets(x["val"].positions, x["val"].seq_index, meta, x["template"])["gen"]
    sets = {"gen": x["val"].positions[gen], "reference": x["ref_positions"]}
    coverage = {method: table_coverage(head, x["train"].positions, sets) for method, (head, _) in trained.items()
                if head.pos_bias is not None}
    return {"n_train_tokens": len(x["train"]), "tr_seq": x["tr_seq"], "va_seq": x["va_seq"],
            "table_coverage": coverage}


#: below this share of its evaluated positions on trained rows, a DARTS head is flagged (table, claims, page):
#: the rest of its position table is the zero initialisation, so there the row is a rank-r head
COVERAGE_WARN = 0.5


def table_coverage(head, train_positions: torch.Tensor, sets: dict[str, torch.Tensor]) -> dict[str, Any]:
    """How much of a position-bias head's table is trained where it is evaluated. A table row is
    *trained* when a training token indexes it (:meth:`~darts_bench.surgery.heads.CorrectionHead.bias_index`,
    overflow policy included); the rows no training token reaches stay at their zero initialisation.

    Args:
        head: a head with a position table (``pos_bias`` not None).
        train_positions: ``[N]`` int64 absolute positions of the training tokens.
        sets: evaluated token sets, name -> ``[n]`` int64 positions (the train stage: ``gen``, the held-out
            continuation tokens; ``reference``, the reference-answer tokens).
    Returns:
        ``{"trained_rows": int, "max_trained_position": int, <set>: {"share": float in [0, 1] or None (empty
        set), "n_tokens": int, "max_position": int or None}}``: ``share`` is the fraction of the set's tokens
        whose row is trained (and not switched off by ``overflow: zero``).
    """
    import torch

    rows = head.pos_bias.shape[0]
    idx, keep = head.bias_index(train_positions)
    trained = torch.zeros(rows, dtype=torch.bool)
    trained[idx[keep > 0]] = True
    out: dict[str, Any] = {"trained_rows": int(trained.sum()),
                           "max_trained_position": int(train_positions.max()) if len(train_positions) else -1}
    for name, pos in sets.items():
        if not len(pos):
            out[name] = {"share": None, "n_tokens": 0, "max_position": None}
            continue
        i, k = head.bias_index(pos)
        out[name] = {"share": float((trained[i] & (k > 0)).double().mean()), "n_tokens": int(len(pos)),
                     "max_position": int(pos.max())}
    return out


def train_heads(cfg, x: dict, m: str, name: str, split: str, scfg, run_seed: int, work_dir: Path,
                release_executor: Callable[[], None] = lambda: None) -> dict[str, tuple[Any, dict]]:
    """Train one head per method of ``scfg`` on ``x`` (:func:`diagnosis_inputs`: the train tokens, validated
    on the held-out ones), on DeepSpeed when ``cfg.deepspeed.enabled``. Returns ``{method: (head, the extra
    fields save_head writes: merge, task, split, training history)}``."""
    train_, val = x["train"], x["val"]
    trained = {}
    for method in scfg.methods:
        hseed = derive_seed(run_seed, m, name, split, method)
        if cfg.deepspeed.enabled:
            from darts_bench.surgery.train_deepspeed import train_head_deepspeed

            if cfg.executor == "ray" and cfg.deepspeed.launcher == "ray":
                release_executor()  # free the collection actors' CPUs/GPUs for Ray Train's workers
            res = train_head_deepspeed(method, train_.materialize(), val.materialize(), scfg, hseed, cfg.deepspeed,
                                       work_dir / "deepspeed", ray_address=cfg.ray.address)
        else:
            res = train_head(method, train_, val, scfg, hseed)
        trained[method] = (res.head, {"merge": m, "task": name, "split": split, "history": res.history})
    return trained


def heads_diagnostics(d: dict, methods: list[str], record: dict) -> dict:
    """A heads artifact's ``diagnostics.json`` from :func:`diagnose_rows`' result ``d`` for its rows
    (``none`` and ``methods``) and its :func:`_training_record`."""
    d = dict(d)
    diags = {"none": d.pop("none"), "n_train_tokens": record["n_train_tokens"], "train_sequences": record["tr_seq"],
             "held_out_sequences": record["va_seq"], "n_heldout": len(record["va_seq"])}
    for method in methods:
        diags[method] = d.pop(method)
        if method in record.get("table_coverage", {}):
            diags[method]["table_coverage"] = record["table_coverage"][method]
    diags.update(d)
    return diags


def _signature(scfg) -> tuple:
    """What a diagnostics pass's rows must share (the entropy weights' source and cap): rows of variants that
    differ there are diagnosed in separate passes."""
    return (scfg.entropy_source, scfg.w_max)


def diagnose_streams(cfg, feats: dict, merges: dict[str, Path], pool, tasks: dict, variants: list[tuple[str, Any]],
                     method_variants: list[tuple[str, Any]], seeds: list[int], routers: dict, run_heads: dict,
                     pending: dict, finals: dict, work_dir: Path) -> dict[tuple, dict]:
    """Write the train stage's diagnostics: per (merge, task, split, head seed), the heads artifacts of
    ``pending`` (their heads and ``diagnostics.json``: :func:`heads_diagnostics`) and, for each of
    ``method_variants`` with ``surgery.task_agnostic``, the task-agnostic rows' artifact
    (:func:`agnostic_artifact`), whichever are not cached, from one :func:`diagnose_seeds` call per (merge,
    task, split): a pass over each head seed's held-out tokens with all that seed's rows (``groups``: each
    artifact's rows) and one pass over the reference answers with the rows of every seed; the same values
    as one pass per artifact, bitwise (``tests/test_surgery_routing.py``). The tokens, the expert's
    distribution, the plain merge's logits and row and the KL floor are computed once per stream for all of
    them (three passes per stream before 2026-12-04: the methods' heads, the matched control, the
    task-agnostic rows; the reference answers once per seed before 2026-12-05). Variants whose entropy weights
    differ (:func:`_signature`) get a pass each.

    Returns:
        ``{(merge, task, split, variant, seed): {"routed"?, "shared"?: diagnostics}}`` of the task-agnostic rows.
    Raises:
        RuntimeError: a stream's reference-answer features and tokens disagree in length (named by merge and task).
    """
    from darts_bench.rows import SHARED_TASK
    from darts_bench.surgery.heads import load_head
    from darts_bench.surgery.routing import Router, sequence_routed_head
    from darts_bench.surgery.train import TokenData

    kinds = [k for k in ("routed", "shared") if k in cfg.surgery.task_agnostic]
    out: dict[tuple, dict] = {}

    def head_of(m, t, meth, split, tag, seed):  # a task's head: held by ``pending`` or on disk
        p = pending.get((m, t, split, tag, seed))
        return p["trained"][meth][0] if p is not None else load_head(run_heads[(m, t, meth, split, tag, seed)])

    for (m, name, split), fs in feats.items():
        if split == "reference":
            continue
        ref_fs = feats[(m, name, "reference")]
        expert_dir = pool.path(tasks[name][0].expert)
        # what this (merge, task, split) needs: [(signature, scfg, kind, tag, final, what, seed)]
        todo = []
        for seed in seeds:
            for tag, scfg in variants:
                if (m, name, split, tag, seed) in pending:
                    final, what = finals[(m, name, split, tag, seed)]
                    todo.append((_signature(scfg), scfg, "heads", tag, final, what, seed))
            for tag, scfg in method_variants:
                final = agnostic_artifact(cfg, fs, ref_fs, m, split, tag, scfg, seed, kinds, routers, run_heads,
                                          work_dir / "heads", name)
                what = f"diagnose task-agnostic rows {m}/{name}/{split}{tag}{seed_tag(cfg, seed)}"
                if not reused(final, what):
                    todo.append((_signature(scfg), scfg, "agnostic", tag, final, what, seed))
                out[(m, name, split, tag, seed)] = final
        # one pass per entropy-weight signature: every seed's held-out tokens their own, the reference answers one
        for sig in dict.fromkeys(t[0] for t in todo):
            items = [t for t in todo if t[0] == sig]
            t0 = time.perf_counter()
            runs, xs = [], []
            ref_stream = None
            for seed in dict.fromkeys(t[6] for t in items):
                mine = [t for t in items if t[6] == seed]
                x = diagnosis_inputs(cfg, fs, merges[m], expert_dir, ref_fs, name, split, mine[0][1], seed)
                heads: dict[str, Any] = {"none": None}
                groups: dict[str, dict[str, str]] = {}
                for _, scfg, kind, tag, final, _, _ in mine:
                    if kind == "heads":
                        trained = pending[(m, name, split, tag, seed)]["trained"]
                        heads.update({f"{tag}|{meth}": h for meth, (h, _) in trained.items()})
                        groups[f"heads{tag}"] = {"none": "none", **{meth: f"{tag}|{meth}" for meth in trained}}
                        continue
                    for kind_ in kinds:
                        if kind_ == "routed":
                            rdir = routers[(m, split, seed)]
                            router = Router.load(rdir / "router.json")
                            held = json.loads((rdir / "routing.json").read_text())["tasks"][name]
                            seq_task = dict(zip(held["held_out_sequences"], held["held_out_routed"]))
                            # reference sequences are looked up past the calibration set's indices (only the
                            # routed heads read sequence indices; the other rows ignore them, so every seed's
                            # rows share this stream)
                            off = len(fs.calib.meta["sequences"])
                            ref_routed = router.predict(calibration_prompt_features(ref_fs))
                            seq_task.update({off + i: t for i, t in enumerate(ref_routed)})
                            base_stream = x["ref_stream"]

                            def routed_stream(base_stream=base_stream, off=off):
                                for b in base_stream():
                                    yield TokenData(b.h_merged, b.h_expert, b.positions, b.seq_index + off,
                                                    b.weight_source)

                            ref_stream = routed_stream

                            kind_heads = {meth: sequence_routed_head(
                                {t: head_of(m, t, meth, split, tag, seed) for t in router.classes}, seq_task)
                                for meth in scfg.methods}
                        else:
                            kind_heads = {meth: load_head(run_heads[(m, SHARED_TASK, meth, split, tag, seed)])
                                          for meth in scfg.methods}
                        heads.update({f"{tag}|{kind_}/{meth}": h for meth, h in kind_heads.items()})
                        groups[f"agnostic{tag}|{kind_}"] = {"none": "none",
                                                            **{meth: f"{tag}|{kind_}/{meth}" for meth in kind_heads}}
                runs.append({"heads": heads, "val": x["val"], "mean_h": x["mean_h"], "seed": x["seed"],
                             "groups": groups, "known": known_streams(fs, ref_fs, merges[m], expert_dir, x["va_seq"],
                                                                      x["template"], cfg.device)})
                xs.append((seed, mine, x))
            ref_stream = ref_stream or x["ref_stream"]
            try:
                results = diagnose_seeds(runs, fs.calib.meta, x["template"], ref_stream, x["ref_groups"],
                                         x["n_ref_excluded"], items[0][1].w_max, x["W_e"], x["W_m"],
                                         device=cfg.device)
            except RuntimeError as e:
                raise RuntimeError(f"{m}/{name}: {e}") from e
            log.info("diagnose %s/%s/%s%s: %d rows of %d artifacts, held-out passes over %s tokens and one "
                     "reference-answer pass over %d tokens, in %.1f s (%s)", m, name, split,
                     "".join(seed_tag(cfg, seed) for seed, _, _ in xs) or "",
                     sum(len(r["heads"]) for r in runs), len(items), "/".join(str(len(x_["val"])) for _, _, x_ in xs),
                     len(x["ref_groups"]), time.perf_counter() - t0, ", ".join(str(t[4]) for t in items))
            for (seed, mine, x), res in zip(xs, results):
                for _, scfg, kind, tag, final, what, _ in mine:
                    if kind == "heads":
                        p = pending[(m, name, split, tag, seed)]
                        d = heads_diagnostics(res[f"heads{tag}"], list(p["trained"]), p["x"])

                        def build(tmp: Path, p=p, d=d) -> None:
                            for method, (head, extra) in p["trained"].items():
                                save_head(head, tmp / method, extra=extra)
                            (tmp / "diagnostics.json").write_text(json.dumps(d))

                        cached(final, build, what=what, meta={"kind": "heads", "merge": m, "task": name,
                                                              "split": split, "variant": tag, "seed": seed})
                    else:
                        agn = {kind_: res[f"agnostic{tag}|{kind_}"] for kind_ in kinds}
                        for d in agn.values():
                            d.update({"n_heldout": len(x["va_seq"]), "held_out_sequences": x["va_seq"]})
                        cached(final, lambda tmp, agn=agn: (tmp / "diagnostics.json").write_text(json.dumps(agn)),
                               what=what, meta={"kind": "agnostic-diagnostics", "merge": m, "task": name,
                                                "split": split, "variant": tag, "seed": seed})
    return {k: json.loads((final / "diagnostics.json").read_text()) for k, final in out.items()}


# --------------------------------------------------------------------------- task-agnostic rows
def _by_merge_split(feats: dict) -> dict[tuple[str, str], dict[str, FeatureSet]]:
    """``{(merge, split): {task: FeatureSet}}`` of the training splits (not ``reference``), tasks in
    feature order."""
    out: dict[tuple[str, str], dict[str, FeatureSet]] = {}
    for (m, name, split), fs in feats.items():
        if split != "reference":
            out.setdefault((m, split), {})[name] = fs
    return out


def task_split(cfg, fs: FeatureSet, name: str, split: str, seed: int) -> tuple[list[int], list[int]]:
    """``(train, held-out)`` sequence indices of one task's calibration set under head seed ``seed``:
    the split the task's heads train and validate on (:func:`train_heads`)."""
    n_seq = len(fs.calib.meta["sequences"])
    return split_by_sequence(n_seq, cfg.calibration.held_out_fraction, split_seed(seed, name, split))


def split_seed(seed: int, name: str, split: str) -> int:
    """The seed of one task's train / held-out split under head seed ``seed`` (:func:`task_split`)."""
    return derive_seed(seed, "split", name, split)


def router_key(cfg, fss: dict[str, FeatureSet], seed: int) -> str:
    """Cache key of one (merge, split, seed)'s router: every task's merged-features key, the held-out
    fraction and head seed (they fix the train / held-out prompts), ``surgery.routing`` and
    :data:`~darts_bench.surgery.routing.ROUTER_VERSION`."""
    from darts_bench.surgery.routing import ROUTER_VERSION

    return stable_hash({"features": {t: fs.key for t, fs in fss.items()}, "held_out": cfg.calibration.held_out_fraction,
                        "seed": seed, "routing": cfg.surgery.routing.model_dump(mode="json"),
                        "version": ROUTER_VERSION})


def calibration_prompt_features(fs: FeatureSet) -> np.ndarray:
    """``[n_sequences, d_model]`` float64: the merged model's final hidden state mean-pooled over each
    calibration prompt (:func:`darts_bench.surgery.routing.prompt_features` on ``fs``'s shards)."""
    from darts_bench.surgery.routing import prompt_features

    sf = fs.merged_shards()
    meta = fs.calib.meta
    return prompt_features(sf.read_h().float().numpy(), sf.column("positions").numpy(),
                           sf.column("seq_index").numpy(), meta["prompt_len"], len(meta["sequences"]))


def train_routers(cfg, feats: dict, seeds: list[int], work_dir: Path) -> dict[tuple[str, str, int], Path]:
    """One router per (merge, split, head seed) (or reuse it), fitted on the training prompts of every
    task's calibration set (the sequences its heads train on under that seed) and scored on the held-out
    prompts. Artifact ``routers/<merge>-<split>-<key>/``: ``router.json``
    (:class:`~darts_bench.surgery.routing.Router`) and ``routing.json``: per task ``train_sequences``,
    ``held_out_sequences``, ``held_out_routed`` (the routed task of each held-out prompt),
    ``held_out_acc`` and ``train_acc``.

    Returns:
        ``{(merge, split, seed): router dir}``.
    Raises:
        ValueError: fewer than two tasks with calibration features (nothing to route between).
    """
    out: dict[tuple[str, str, int], Path] = {}
    for (m, split), fss in _by_merge_split(feats).items():
        for seed in seeds:
            final = work_dir / "routers" / f"{m}-{split}-{router_key(cfg, fss, seed)}"

            def build(tmp: Path, split=split, fss=fss, seed=seed) -> None:
                write_router(tmp, {name: (calibration_prompt_features(fs), *task_split(cfg, fs, name, split, seed))
                                   for name, fs in fss.items()}, cfg.surgery.routing)

            cached(final, build, what=f"fit router {m}/{split}{seed_tag(cfg, seed)}",
                   meta={"kind": "router", "merge": m, "split": split, "seed": seed})
            out[(m, split, seed)] = final
    return out


def write_router(tmp: Path, by_task: dict[str, tuple[np.ndarray, list[int], list[int]]], rc,
                 every_prompt: bool = False, extra: dict[str, Any] | None = None) -> None:
    """Fit ``rc``'s router (``surgery.routing``) on each task's training prompts and write a router artifact
    into ``tmp``: ``router.json`` (:class:`~darts_bench.surgery.routing.Router`) and ``routing.json``, per task
    ``train_sequences``, ``held_out_sequences``, ``held_out_routed`` (the routed task of each held-out prompt),
    ``held_out_acc``, ``n_heldout``, ``train_acc`` and, with ``every_prompt``, ``sequences_routed`` (every
    prompt's routed task, in sequence order); ``extra`` adds top-level entries before ``tasks``.

    Args:
        by_task: task -> (``F`` [N, d] the prompts' states, float; ``tr`` / ``va`` the training and held-out
            sequence indices into ``F``)."""
    from darts_bench.surgery.routing import fit_router, routing_accuracy

    X = {name: F[tr] for name, (F, tr, _) in by_task.items()}
    router, _ = fit_router(X, rc.router, rc.C)
    router.save(tmp / "router.json")
    tasks_ = {}
    for name, (F, tr, va) in by_task.items():
        routed = router.predict(F[va])
        tasks_[name] = {"train_sequences": tr, "held_out_sequences": va, "held_out_routed": routed,
                        "held_out_acc": routing_accuracy(routed, name), "n_heldout": len(va),
                        "train_acc": routing_accuracy(router.predict(X[name]), name)}
        if every_prompt:
            tasks_[name]["sequences_routed"] = router.predict(F)
    (tmp / "routing.json").write_text(json.dumps({"router": rc.router, "classes": router.classes, **(extra or {}),
                                                  "tasks": tasks_}))


#: what an agnostic diagnostics artifact holds (in its key)
AGNOSTIC_DIAGNOSTICS_VERSION = 1


def agnostic_artifact(cfg, fs: FeatureSet, ref_fs: FeatureSet, m: str, split: str, tag: str, scfg, seed: int,
                      kinds: list[str], routers: dict, run_heads: dict, heads_dir: Path, name: str) -> Path:
    """Where the task-agnostic rows' diagnostics of (merge ``m``, task ``name``, ``split``, variant ``tag``,
    ``seed``) live: ``heads/<merge>-<task>-<split>-agnostic-<key>/diagnostics.json``, ``{"routed": {...},
    "shared": {...}}``, each shaped as a task's ``diagnostics.json`` (rows ``none`` and each method) of
    :func:`diagnose_rows` on the task's held-out calibration tokens and reference answers (the oracle heads'
    token sets) with, per method, the ``@routed`` row's head chosen per sequence (the router's decision on
    that sequence's prompt: the held-out prompts' from ``routing.json``, the reference prompts' from their
    merged features; :func:`darts_bench.surgery.routing.sequence_routed_head`) and the ``@shared`` row's
    head (written by :func:`diagnose_streams`). The key: the oracle heads' key, the router and the heads it
    routes between, the shared heads, :data:`AGNOSTIC_DIAGNOSTICS_VERSION`."""
    from darts_bench.rows import SHARED_TASK

    parts = {"oracle": head_key(cfg, fs.key, ref_fs.key, scfg, seed), "version": AGNOSTIC_DIAGNOSTICS_VERSION}
    if "routed" in kinds:
        classes = json.loads((routers[(m, split, seed)] / "routing.json").read_text())["classes"]
        parts["router"] = routers[(m, split, seed)].name
        parts["heads"] = {t: str(run_heads[(m, t, meth, split, tag, seed)]) for t in classes for meth in scfg.methods}
    if "shared" in kinds:
        parts["shared"] = str(run_heads[(m, SHARED_TASK, scfg.methods[0], split, tag, seed)].parent)
    return heads_dir / f"{m}-{name}-{split}-agnostic-{stable_hash(parts)}"


def shared_head_key(cfg, fss: dict[str, FeatureSet], ref_keys: dict[str, str], scfg, seed: int) -> str:
    """Cache key of one (merge, split, variant, seed)'s shared heads: :func:`head_key` over every task's
    features (and reference features), marked ``shared``."""
    return stable_hash({"shared": {t: head_key(cfg, fs.key, ref_keys[t], scfg, seed) for t, fs in fss.items()}})


def train_shared(cfg, feats: dict, merges: dict[str, Path], pool, tasks: dict, variants: list[tuple[str, Any]],
                 seeds: list[int], work_dir: Path) -> dict[tuple, Path]:
    """One shared head per (merge, split, variant, seed, method) (or reuse it): trained like a task's
    head (:func:`~darts_bench.surgery.train.train_head`) on the union of every task's training
    sequences (the train split of each calibration set under that seed; DARTS's mean entropy over the
    union), validated on the union of the held-out sequences. Artifact
    ``heads/<merge>-shared-<split>-<key>/<method>/`` and ``diagnostics.json``: per task its
    ``train_sequences``, ``held_out_sequences``, ``n_train_tokens`` and the held-out L1 / entropy-weighted
    L1 to the expert's hidden state (:func:`~darts_bench.surgery.train.evaluate_losses`, hidden-state
    units) of each method and of the plain merge (``none``); ``n_train_tokens`` of the union.

    Returns:
        ``{(merge, SHARED_TASK, method, split, variant, seed): head dir}`` (the ``run_heads`` entries).
    """
    import torch

    from darts_bench.rows import SHARED_TASK
    from darts_bench.surgery.data import load_split
    from darts_bench.surgery.train import TokenData, evaluate_losses

    out: dict[tuple, Path] = {}
    for (m, split), fss in _by_merge_split(feats).items():
        ref_keys = {t: feats[(m, t, "reference")].key for t in fss}
        for (tag, scfg), seed in itertools.product(variants, seeds):
            final = work_dir / "heads" / f"{m}-shared-{split}-{shared_head_key(cfg, fss, ref_keys, scfg, seed)}"

            def build(tmp: Path, m=m, split=split, fss=fss, scfg=scfg, seed=seed) -> None:
                W_m = lm_head_weight(merges[m])
                parts_tr, parts_va, per_task, offset = [], [], {}, 0
                for name, fs in fss.items():
                    tr, va = task_split(cfg, fs, name, split, seed)
                    W_e = lm_head_weight(pool.path(tasks[name][0].expert))[: W_m.shape[0]]
                    t_tr, t_va = load_split(fs.calib.expert_shards(), fs.merged_shards(), tr, scfg.entropy_source,
                                            W_e, W_m)
                    t_tr, t_va = t_tr.materialize(), t_va.materialize()
                    for part, dst in ((t_tr, parts_tr), (t_va, parts_va)):  # sequences renumbered past the last task's
                        dst.append(TokenData(part.h_merged, part.h_expert, part.positions, part.seq_index + offset,
                                             part.weight_source))
                    per_task[name] = {"train_sequences": tr, "held_out_sequences": va, "n_train_tokens": len(t_tr),
                                      "n_heldout_tokens": len(t_va), "val": t_va}
                    offset += len(fs.calib.meta["sequences"])
                cat = lambda ps: TokenData(*(torch.cat([getattr(p, f) for p in ps]) for f in  # noqa: E731
                                             ("h_merged", "h_expert", "positions", "seq_index", "weight_source")))
                train_, val = cat(parts_tr), cat(parts_va)
                mean_h = float(train_.weight_source.float().mean())
                trained = {}
                for method in scfg.methods:
                    res = train_head(method, train_, val, scfg, derive_seed(seed, m, SHARED_TASK, split, method))
                    save_head(res.head, tmp / method, extra={"merge": m, "task": SHARED_TASK, "split": split,
                                                             "tasks": list(fss), "history": res.history})
                    trained[method] = res.head
                diag = {"n_train_tokens": len(train_), "tasks": {}}
                for name, d in per_task.items():
                    v = d.pop("val")
                    d["held_out"] = {row: evaluate_losses(hd, v, mean_h, scfg.w_max)
                                     for row, hd in {"none": None, **trained}.items()}
                    diag["tasks"][name] = d
                (tmp / "diagnostics.json").write_text(json.dumps(diag))

            cached(final, build, what=f"train shared heads {m}/{split}{tag}{seed_tag(cfg, seed)}",
                   meta={"kind": "heads", "merge": m, "task": SHARED_TASK, "split": split, "variant": tag,
                         "seed": seed})
            for method in scfg.methods:
                out[(m, SHARED_TASK, method, split, tag, seed)] = final / method
    return out


_known_streams: "collections.OrderedDict[str, dict]" = collections.OrderedDict()


def known_streams(fs: FeatureSet, ref_fs: FeatureSet, merge_dir: Path, expert_dir: Path, held_out: list[int],
                  template: dict[int, int], device: str) -> "KnownStreams":
    """The ``known`` of :func:`diagnose_rows` for one (merge, task, split, head seed)'s held-out and
    reference tokens, kept in this process across the train stage's passes that diagnose them (the
    methods' heads, the matched control, the task-agnostic rows, and the other splits of the same (merge,
    task): each would otherwise recompute the plain merge's row and the KL floor, three
    ``[tokens, d] x [d, V]`` matmuls per block between them).
    The held-out stream is keyed by its feature set's key (which fixes the merge, the expert and the
    calibration sequences), the two model dirs, the held-out sequences and the device; the
    reference-answer stream by the reference feature set's key, the two model dirs, the template left out
    of it (:func:`~darts_bench.surgery.data.shared_template` of the split's calibration set) and the
    device, so the splits of a (merge, task) with the same template share it. At most
    :data:`~darts_bench.stages.KNOWN_STREAMS_MAX` streams are kept, the least recently used dropped first
    (per-token float32 values only: four per token and stream)."""
    common = {"merge": str(merge_dir), "expert": str(expert_dir), "device": str(device)}
    return KnownStreams({
        "val": _known_entry(stable_hash({**common, "features": fs.key, "held_out": list(held_out)})),
        "reference": _known_entry(stable_hash({**common, "reference": ref_fs.key,
                                               "template": sorted(template.items())}))})


class KnownStreams:
    """:func:`diagnose_rows`' ``known`` for a held-out and a reference stream, each entry of the process's cache
    (:func:`known_streams`): ``get(name)`` / ``[name] = value`` with ``name`` ``val`` | ``reference``."""

    def __init__(self, entries: dict[str, dict]):
        self._entries = entries

    def get(self, name: str):
        return self._entries[name].get("known")

    def __setitem__(self, name: str, value) -> None:
        self._entries[name]["known"] = value


def _known_entry(key: str) -> dict:
    """The cache entry of one stream (made empty when new; the least recently used dropped beyond the cap)."""
    entry = _known_streams.pop(key, None)
    _known_streams[key] = entry = {} if entry is None else entry
    while len(_known_streams) > KNOWN_STREAMS_MAX:
        _known_streams.popitem(last=False)
    return entry


def _trends(pos: np.ndarray, l1: np.ndarray, entropy: np.ndarray, groups: np.ndarray, seed: int) -> dict:
    """Position slope (with ``n_sequences``) and entropy-quartile contrast of per-token L1 on one
    token set (all ``[n]``), sequence-bootstrap CIs; None for both on an empty set."""
    if not len(pos):
        return {"slope": None, "entropy_contrast": None}
    slope = position_slope(pos, l1, n_boot=N_BOOT, seed=seed, groups=groups)
    slope["n_sequences"] = int(len(np.unique(groups)))
    return {"slope": slope, "entropy_contrast": entropy_contrast(entropy, l1, groups, n_boot=N_BOOT, seed=seed)}


def _leading_run(positions: list[int]) -> int:
    """Length of the run ``0, 1, ..., k - 1`` at the start of sorted ``positions`` (the shared prefix)."""
    k = 0
    while k < len(positions) and positions[k] == k:
        k += 1
    return k


def diagnose_rows(heads: dict[str, Any], val, meta: dict, template: dict[int, int], ref_stream,
                  ref_groups: np.ndarray, n_ref_excluded: int, mean_h: float, w_max: float, W_e, W_m, seed: int,
                  device: str = "cpu", groups: dict[str, dict[str, str]] | None = None,
                  known: dict | None = None) -> dict:
    """The diagnostics of ``heads`` (row -> head, ``none`` -> None first) on one calibration set's
    held-out tokens and on the reference answers, each head run once over each token stream.

    Args:
        val: the held-out tokens (:class:`~darts_bench.surgery.data.TokenView`: ``positions`` /
            ``seq_index`` ``[N]`` int64, ``weight_source`` ``[N]`` nats, ``batches(n)``).
        meta: the calibration set's ``sequences.json``; template: its
            :func:`~darts_bench.surgery.data.shared_template`.
        ref_stream / ref_groups: the reference-answer tokens with the template left out
            (:func:`~darts_bench.surgery.data.reference_answer_batches` / ``_groups`` with
            ``template``) and ``n_ref_excluded``, the answer tokens that left out.
        mean_h, w_max: entropy-weight normaliser (nats) and cap; W_e, W_m: ``[V, d]`` lm_heads.
        seed: of every bootstrap (``N_BOOT`` resamples).
        groups: several diagnostics from one pass: ``{group: {row name: key of heads}}``, each group
            with ``"none": "none"``; the result is then ``{group: <the dict below for those rows>}``,
            the same values as one call per group (each row's signals are its own; the pass over the
            tokens, the expert's distribution and the KL floor are shared by all groups).
        known: a dict the caller keeps for these two token streams (one (merge, task, split, head
            seed): :func:`known_streams`), read and filled under ``"val"`` / ``"reference"`` with
            :attr:`~darts_bench.surgery.diagnostics.Diagnostics.known`: a later call over the same
            streams does not compute the plain merge's row and the KL floor again (same values).
    Returns:
        per row the signals on all held-out tokens, ``gen`` / ``prompt`` (the
        :func:`~darts_bench.surgery.data.position_sets`) and ``reference`` (per-position
        ``l1_by_position`` / ``kl_by_position`` on all held-out tokens and ``gen`` only); ``template``,
        ``per_sequence`` (set -> :func:`~darts_bench.surgery.intervals.sequence_sums`), ``intervals``
        (all held-out tokens), ``intervals_gen``, ``intervals_prompt``, ``intervals_reference``,
        ``bootstrap``, ``n_val_tokens``, ``n_reference_tokens``.
    Raises:
        RuntimeError: ``ref_groups`` and the reference stream disagree in length.
    """
    return diagnose_seeds([{"heads": heads, "val": val, "mean_h": mean_h, "seed": seed, "groups": groups,
                            "known": known}], meta, template, ref_stream, ref_groups, n_ref_excluded, w_max, W_e, W_m,
                          device=device)[0]


def diagnose_seeds(runs: list[dict], meta: dict, template: dict[int, int], ref_stream, ref_groups: np.ndarray,
                   n_ref_excluded: int, w_max: float, W_e, W_m, device: str = "cpu") -> list[dict]:
    """:func:`diagnose_rows` of several head seeds of one (merge, task, split): each run's held-out tokens get
    their own pass, the reference answers (the same tokens for every head seed) one pass with the heads of
    every run, so the expert's distribution, the plain merge's logits and row and the KL floor on them are
    computed once, not once per seed. Each run's result holds the values its own :func:`diagnose_rows` call
    gives, bitwise: a head's per-token values do not depend on the other heads of a pass
    (:meth:`~darts_bench.surgery.diagnostics.Diagnostics.per_token`), and each run's summaries use its own
    ``mean_h`` and bootstrap ``seed``.

    Args:
        runs: per head seed ``{"heads", "val", "mean_h", "seed", "groups"?, "known"?}`` as :func:`diagnose_rows`'
            arguments of those names (``known``: that seed's :func:`known_streams`; its ``reference`` entry is
            read from the first run that has one and written to every run's).
        meta, template, ref_stream, ref_groups, n_ref_excluded, w_max, W_e, W_m, device: as :func:`diagnose_rows`
            (one reference-answer stream for all runs; a routed head's stream, whose sequence indices are
            offset, serves the other heads alike: they ignore them).
    Returns:
        per run, :func:`diagnose_rows`' result.
    Raises:
        RuntimeError: ``ref_groups`` and the reference stream disagree in length.
    """
    from darts_bench.surgery.data import POSITION_SETS, position_sets
    from darts_bench.surgery.diagnostics import Diagnostics

    keys = ("l1", "kl", "agree", "floor")
    knowns = [{} if r.get("known") is None else r["known"] for r in runs]
    # the reference answers: one pass with every run's heads, the plain merge's row (None) once
    ref_known = next((k.get("reference") for k in knowns if k.get("reference") is not None), None)
    diag_ref = Diagnostics(ref_stream, runs[0]["mean_h"], w_max, W_e, W_m, device=device, known=ref_known)
    ref_heads: list = [None]
    where: list[list[int]] = []  # per run, the index in ref_heads of each of its rows
    for r in runs:
        where.append([])
        for h in r["heads"].values():
            if h is not None:
                ref_heads.append(h)
            where[-1].append(0 if h is None else len(ref_heads) - 1)
    ref_rows = diag_ref.per_token(ref_heads)
    if diag_ref.known is not None:
        for k in knowns:
            k["reference"] = diag_ref.known
    if len(ref_groups) != diag_ref.n_tokens:
        raise RuntimeError(f"{len(ref_groups)} reference-answer tokens in the features, "
                           f"{diag_ref.n_tokens} in the diagnostics stream")
    out = []
    for r, idx, known in zip(runs, where, knowns):
        heads, val, seed, groups = r["heads"], r["val"], r["seed"], r.get("groups")
        val_pos, val_seq = val.positions, val.seq_index
        masks = position_sets(val_pos, val_seq, meta, template)  # [N] bool per set over the held-out tokens
        pos_np, seq_np, ent_np = val_pos.numpy(), val_seq.numpy(), val.weight_source.float().numpy()
        diag_val = Diagnostics(lambda val=val: val.batches(8192), r["mean_h"], w_max, W_e, W_m, device=device,
                               known=known.get("val"))
        per_token: dict[str, dict] = {}  # row -> per-token L1 / KL / agreement / floor on the held-out tokens
        per_token_ref: dict[str, dict] = {}  # the same on the reference-answer tokens
        rows: dict[str, dict] = {}
        refs = diag_ref.summaries([ref_rows[i] for i in idx], mean_h=r["mean_h"])
        for row, d, rr in zip(heads, diag_val.many(list(heads.values()), masks), refs):
            per_token[row] = {k: np.asarray(d.pop(f"per_token_{k}")) for k in keys}
            d.update(_trends(pos_np, per_token[row]["l1"], ent_np, seq_np, seed))
            for s_name in POSITION_SETS:
                mk = masks[s_name].numpy()
                d[s_name].update(_trends(pos_np[mk], per_token[row]["l1"][mk], ent_np[mk], seq_np[mk], seed))
            for k in ("l1_by_position", "kl_by_position"):  # per-position curves: all positions and gen only (size)
                d["prompt"].pop(k)
            d["reference"] = {k: rr[k] for k in ("rep_l1", "rep_l1_ew", "kl_expert", "agree_top1", "kl_floor",
                                                 "n_tokens")}
            per_token_ref[row] = {k: np.asarray(rr[f"per_token_{k}"]) for k in keys}
            rows[row] = d
        if diag_val.known is not None:
            known["val"] = diag_val.known
        finish = functools.partial(_finish_rows, masks=masks, seq_np=seq_np, ref_groups=ref_groups, val=val,
                                   meta=meta, template=template, n_ref_excluded=n_ref_excluded,
                                   n_ref_tokens=diag_ref.n_tokens, seed=seed)
        if groups is None:
            out.append(finish(rows, per_token, per_token_ref))
            continue
        res = {}
        for group, sel in groups.items():
            if sel.get("none") != "none":
                raise ValueError(f"diagnostics group {group!r} needs the row 'none': 'none', got {sel}")
            res[group] = finish({rw: copy.deepcopy(rows[k]) for rw, k in sel.items()},
                                {rw: per_token[k] for rw, k in sel.items()},
                                {rw: per_token_ref[k] for rw, k in sel.items()})
        out.append(res)
    return out


def _finish_rows(rows: dict, per_token: dict, per_token_ref: dict, *, masks, seq_np, ref_groups, val, meta, template,
                 n_ref_excluded: int, n_ref_tokens: int, seed: int) -> dict:
    """The rest of :func:`diagnose_rows` for one set of rows (``none`` among them): gap closed, the
    template record, per-sequence sums and every interval."""
    from darts_bench.surgery.data import POSITION_SETS, template_mask
    from darts_bench.surgery.intervals import intervals_from_sums, sequence_sums

    val_pos, val_seq = val.positions, val.seq_index
    for row in rows:
        if row == "none":
            continue
        for k in ("", "reference", *POSITION_SETS):
            src = rows[row] if not k else rows[row][k]
            base_ = rows["none"] if not k else rows["none"][k]
            src["gap_closed"] = gap_closed(base_["kl_expert"], src["kl_expert"], base_["kl_floor"])
    in_template = template_mask(val_pos, val_seq, meta, template)
    out = {**rows, "n_val_tokens": len(val), "n_reference_tokens": n_ref_tokens,
           "template": {"positions": sorted(template), "n_positions": len(template),
                        "prefix_len": _leading_run(sorted(template)),
                        "rule": "positions whose token id is the same in every sequence of the calibration set "
                                "(the hidden state there is memorisable by position); left out of gen, prompt "
                                "and reference",
                        "n_excluded_tokens": {"held_out": int(in_template.sum()), "reference": int(n_ref_excluded)}},
           "bootstrap": {"n_boot": N_BOOT, "seed": seed}}
    # per-sequence sums (float64) of every set; every sequence-level 95% CI below is computed from them
    sets = {"all": (per_token, seq_np), "reference": (per_token_ref, np.asarray(ref_groups))}
    for s_name in POSITION_SETS:
        mk = masks[s_name].numpy()
        sets[s_name] = ({row: {k: v[mk] for k, v in pt.items()} for row, pt in per_token.items()}, seq_np[mk])
    out["per_sequence"] = {s_name: sequence_sums(pt, g) for s_name, (pt, g) in sets.items() if len(g)}
    for s_name, iv_key in (("all", "intervals"), ("gen", "intervals_gen"), ("prompt", "intervals_prompt"),
                           ("reference", "intervals_reference")):
        if s_name in out["per_sequence"]:  # kl_expert / agree_top1 / gap_closed and DARTS - Surgery differences
            out[iv_key] = intervals_from_sums(out["per_sequence"][s_name], n_boot=N_BOOT, seed=seed)
    return out


def diagnosis_inputs(cfg, fs: FeatureSet, merge_dir: Path, expert_dir: Path, ref_fs: FeatureSet, name: str,
                     split: str, scfg, run_seed: int) -> dict[str, Any]:
    """What training and :func:`diagnose_rows` read for one (merge, task, split, head seed): the
    lm_heads ``W_e`` / ``W_m`` ``[V, d]``, the split's ``seed`` and ``tr_seq`` / ``va_seq`` sequence
    indices, the ``train`` / ``val`` token views, ``mean_h`` (nats, over the train tokens), the shared
    ``template``, the reference-answer ``ref_stream`` / ``ref_groups`` / ``n_ref_excluded``."""
    from darts_bench.surgery.data import load_split, reference_answer_batches, reference_answer_groups, shared_template

    W_e, W_m = lm_head_weight(expert_dir), lm_head_weight(merge_dir)
    W_e = W_e[: W_m.shape[0]]  # pool.vocab_alignment=base: the expert's appended tokens are dropped
    calib = fs.calib  # the calibration set the merged features were collected on
    seed = split_seed(run_seed, name, split)
    tr_seq, va_seq = task_split(cfg, fs, name, split, run_seed)  # the split routers and shared heads read too
    # one [N, d] buffer per model in the stored dtype; train / val are index views of it
    train_, val = load_split(calib.expert_shards(), fs.merged_shards(), tr_seq, scfg.entropy_source, W_e, W_m)
    template = shared_template(calib.meta)  # once per calibration set; every mask is over it
    # reference-answer tokens (the answer part of prompt + reference, template tokens left out): streamed
    ref_exp = ref_fs.calib.expert_shards()
    ref_stream = reference_answer_batches(ref_exp, ref_fs.merged_shards(), ref_fs.calib.meta, scfg.entropy_source,
                                          W_e, W_m, template=template)
    ref_groups = reference_answer_groups(ref_exp, ref_fs.calib.meta, template).numpy()
    ref_positions = reference_answer_groups(ref_exp, ref_fs.calib.meta, template, column="positions")
    n_ref_excluded = len(reference_answer_groups(ref_exp, ref_fs.calib.meta)) - len(ref_groups)
    return {"W_e": W_e, "W_m": W_m, "seed": seed, "tr_seq": tr_seq, "va_seq": va_seq, "train": train_, "val": val,
            "mean_h": float(train_.weight_source.mean()), "template": template, "ref_stream": ref_stream,
            "ref_groups": ref_groups, "ref_positions": ref_positions, "n_ref_excluded": n_ref_excluded}


# --------------------------------------------------------------------------- task-aware merges (EMR)
#: what a task-aware merge's diagnostics artifact holds (in its key)
TASK_AWARE_DIAGNOSTICS_VERSION = 1


def task_aware_runs(cfg, collected: dict, merges: dict[str, Path], pool, tasks: dict, scfg, seeds: list[int],
                    work_dir: Path) -> dict[tuple, dict]:
    """The behaviour evidence of a task-aware merge's rows (EMR-Merging: a checkpoint per task, no merged model,
    no heads), per (merge, task with an expert, split, head seed), on the held-out sequences of the task's
    calibration set under that seed (:func:`task_split`: the sequences every other merge's rows of that (task,
    split, seed) are diagnosed on, so the claim lines pair them by sequence id):

    * ``<method>`` (``emr``, the oracle row): task t's checkpoint (``<merge dir>/tasks/<expert of t>/``) diagnosed
      exactly as a merge's plain row ``none`` (:func:`diagnosis_inputs`, :func:`diagnose_seeds` with no head:
      lm_head ``W_m`` of that checkpoint, held-out and reference-answer tokens);
    * ``<method>@routed`` (with the split's router, :func:`darts_bench.stages.emr.emr_routers`): per held-out
      sequence, the checkpoint of the task the router picks for its prompt (``routing.json``
      ``sequences_routed``; under a head seed other than the run seed some held-out prompts were the router's
      training prompts): the oracle's per-sequence sums where it picks t, else that checkpoint's
      (:func:`held_out_sums`). Held-out sets only (``all``, ``gen``, ``prompt``): the reference answers' prompts
      have no routing decision here (the evaluate stage routes the benchmark prompts).

    ``scfg``: the first sweep variant's surgery config (entropy source and weight cap, as that variant's ``none``
    row). Artifact ``heads/<merge>-<task>-<split>-<method>-<key>/diagnostics.json`` (key: the oracle's
    :func:`head_key` of its features, the router's dir and the routed feature sets' keys,
    :data:`TASK_AWARE_DIAGNOSTICS_VERSION`)::

        {"<method>": {...the oracle's signals, as a ``none`` row...}, "<method>@routed": {<set>: {"kl_expert",
         "agree_top1", "n_tokens", "n_sequences"}, "routed_to": {task: n held-out sequences}},
         "per_sequence": {<set>: {"sequence", "n_tokens", "<method>": sums, "<method>@routed": sums}},
         "intervals*", "template", "bootstrap", "held_out_sequences", "n_heldout", "n_val_tokens", ...}

    Returns:
        ``{(merge, task, split, "", seed): diagnostics}`` (keys as :func:`train`'s ``runs``).
    Raises:
        RuntimeError: a router's ``sequences_routed`` and the calibration set differ in length, or two
            checkpoints' per-sequence sums on one held-out set hold different sequences (named).
    """
    from darts_bench.config import TASK_MODELS_DIR

    feats = collected.get("task_aware") or {}
    routers = collected.get("task_aware_routers") or {}
    method_of = {spec.name: spec.method for spec in cfg.merges}
    out: dict[tuple, dict] = {}
    for (m, name, split, e), fs in feats.items():
        expert = tasks[name][0].expert
        if split == "reference" or e != expert:
            continue
        method, ref_fs, mdir = method_of[m], feats[(m, name, "reference", e)], merges[m]
        rdir = routers.get((m, split, None))
        seq_task: list[str] | None = None
        if rdir is not None:
            seq_task = json.loads((rdir / "routing.json").read_text())["tasks"][name]["sequences_routed"]
            if len(seq_task) != len(fs.calib.meta["sequences"]):
                raise RuntimeError(f"{m}/{name}/{split}: the router {rdir} routed {len(seq_task)} prompts, the "
                                   f"calibration set has {len(fs.calib.meta['sequences'])}: refit the router")
        routed_feats = {e_: feats[(m, name, split, e_)] for e_ in
                        dict.fromkeys(tasks[t][0].expert for t in (seq_task or [])) if e_ != e}
        for seed in seeds:
            parts = {"oracle": head_key(cfg, fs.key, ref_fs.key, scfg, seed), "version": TASK_AWARE_DIAGNOSTICS_VERSION}
            if rdir is not None:
                parts.update({"router": rdir.name, "routed": {e_: f.key for e_, f in routed_feats.items()}})
            final = work_dir / "heads" / f"{m}-{name}-{split}-{method}-{stable_hash(parts)}"
            what = f"diagnose task-aware rows {m}/{name}/{split}{seed_tag(cfg, seed)}"
            if not reused(final, what):
                t0 = time.perf_counter()
                x = diagnosis_inputs(cfg, fs, mdir / TASK_MODELS_DIR / e, pool.path(expert), ref_fs, name, split, scfg,
                                     seed)
                res = diagnose_seeds([{"heads": {"none": None}, "val": x["val"], "mean_h": x["mean_h"],
                                       "seed": x["seed"]}], fs.calib.meta, x["template"], x["ref_stream"],
                                     x["ref_groups"], x["n_ref_excluded"], scfg.w_max, x["W_e"], x["W_m"],
                                     device=cfg.device)[0]
                d = _rename_row(res, "none", method)
                d.update({"held_out_sequences": x["va_seq"], "n_heldout": len(x["va_seq"])})
                if seq_task is not None:
                    others = {e_: held_out_sums(cfg, f, mdir / TASK_MODELS_DIR / e_, pool.path(expert), name, split,
                                                scfg, seed) for e_, f in routed_feats.items()}
                    experts_of = [tasks[t][0].expert for t in seq_task]
                    d[f"{method}@routed"] = _routed_row(d["per_sequence"], method, experts_of, e, others,
                                                        f"{m}/{name}/{split}")
                    d[f"{method}@routed"]["routed_to"] = {t: sum(seq_task[i] == t for i in x["va_seq"])
                                                         for t in dict.fromkeys(seq_task)}
                cached(final, lambda tmp, d=d: (tmp / "diagnostics.json").write_text(json.dumps(d)), what=what,
                       meta={"kind": "task-aware-diagnostics", "merge": m, "task": name, "split": split, "seed": seed})
                log.info("%s: %.1f s (%s)", what, time.perf_counter() - t0, final)
            out[(m, name, split, "", seed)] = json.loads((final / "diagnostics.json").read_text())
    return out


def _rename_row(d: dict, old: str, new: str) -> dict:
    """:func:`diagnose_rows`' result with row ``old`` named ``new`` (the row itself, its ``per_sequence`` sums and its
    intervals)."""
    d = dict(d)
    d[new] = d.pop(old)
    d["per_sequence"] = {s: {(new if k == old else k): v for k, v in ps.items()} for s, ps in d["per_sequence"].items()}
    for k in [k for k in d if k.startswith("intervals")]:
        d[k] = {(new if r == old else r): v for r, v in d[k].items()}
    return d


def held_out_sums(cfg, fs: FeatureSet, model_dir: Path, expert_dir: Path, name: str, split: str, scfg,
                  seed: int) -> dict[str, dict]:
    """One checkpoint's per-sequence sums on the held-out tokens of ``fs``'s calibration set under head seed
    ``seed`` (:func:`task_split`): the ``none`` row of :func:`diagnose_rows` on those tokens alone (the same
    :class:`~darts_bench.surgery.diagnostics.Diagnostics` pass, lm_head ``W_m`` of ``model_dir``), no reference
    answers.

    Returns:
        ``{set: sequence_sums}`` for ``all``, ``gen`` and ``prompt`` (:func:`~darts_bench.surgery.intervals.
        sequence_sums` with the row ``none``: ``kl_sum`` nats, ``agree_sum`` counts, ``floor_sum`` nats,
        ``l1_sum``; sets without tokens left out)."""
    from darts_bench.surgery.data import POSITION_SETS, load_split, position_sets, shared_template
    from darts_bench.surgery.diagnostics import Diagnostics
    from darts_bench.surgery.intervals import sequence_sums

    W_e, W_m = lm_head_weight(expert_dir), lm_head_weight(model_dir)
    W_e = W_e[: W_m.shape[0]]
    tr, _ = task_split(cfg, fs, name, split, seed)
    train_, val = load_split(fs.calib.expert_shards(), fs.merged_shards(), tr, scfg.entropy_source, W_e, W_m)
    masks = position_sets(val.positions, val.seq_index, fs.calib.meta, shared_template(fs.calib.meta))
    diag = Diagnostics(lambda: val.batches(8192), float(train_.weight_source.mean()), scfg.w_max, W_e, W_m,
                       device=cfg.device)
    d = diag.many([None])[0]
    pt = {k: np.asarray(d[f"per_token_{k}"]) for k in ("l1", "kl", "agree", "floor")}
    seq = val.seq_index.numpy()
    out = {"all": sequence_sums({"none": pt}, seq)}
    for s_name in POSITION_SETS:
        mk = masks[s_name].numpy()
        if mk.any():
            out[s_name] = sequence_sums({"none": {k: v[mk] for k, v in pt.items()}}, seq[mk])
    return out


def _routed_row(per_sequence: dict, method: str, experts_of: list[str], own: str, others: dict[str, dict],
                where: str) -> dict:
    """Add the routed row ``<method>@routed`` to ``per_sequence`` (the oracle's held-out sets; in place): per
    sequence ``i``, the oracle's sums where the router's pick ``experts_of[i]`` is ``own``, else ``others[pick]``'s
    (:func:`held_out_sums`). Returns the routed row's token-mean ``kl_expert`` (nats) / ``agree_top1`` per set."""
    row = f"{method}@routed"
    summary = {}
    for s_name in ("all", "gen", "prompt"):
        ps = per_sequence.get(s_name)
        if ps is None:
            continue
        for e_, o in others.items():
            if o[s_name]["sequence"] != ps["sequence"] or o[s_name]["n_tokens"] != ps["n_tokens"]:
                raise RuntimeError(f"{where} {s_name}: {e_}'s checkpoint's held-out sums hold other sequences than "
                                   "the oracle's (features of another calibration set?)")
        src = {own: ps[method], **{e_: o[s_name]["none"] for e_, o in others.items()}}
        ps[row] = {q: [src[experts_of[sq]][q][j] for j, sq in enumerate(ps["sequence"])] for q in ps[method]}
        n = float(sum(ps["n_tokens"]))
        summary[s_name] = {"kl_expert": sum(ps[row]["kl_sum"]) / n, "agree_top1": sum(ps[row]["agree_sum"]) / n,
                           "n_tokens": int(n), "n_sequences": len(ps["sequence"])}
    return summary
