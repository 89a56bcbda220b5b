"""The train stage: Surgery / DARTS heads per (merge, task, split, sweep variant, head seed), each
trained on the cached features, with diagnostics on held-out calibration sequences and on the
reference answers.

One artifact per (merge, task, split, variant, seed) — ``heads/<merge>-<task>-<split>-<key>/`` —
holds one head per method (``<method>/``) and ``diagnostics.json``: representation L1 (plain and
entropy-weighted), KL to the expert and top-1 agreement per row (``none`` = the uncorrected merge,
then each method), per-position L1 slope, entropy contrast, gap closed, and sequence-bootstrap CIs of
the behaviour signals (:func:`darts_bench.surgery.intervals.behaviour_intervals`). Methods and losses:
:mod:`darts_bench.surgery`.
"""

from __future__ import annotations

import itertools
import json
import logging
from pathlib import Path
from typing import Any, Callable

import numpy as np

from darts_bench.api import resolve_suite
from darts_bench.artifacts import cached, stable_hash
from darts_bench.collect.features import FeatureSet
from darts_bench.pool.checkpoint import lm_head_weight
from darts_bench.rows import seed_tag
from darts_bench.stages import derive_seed
from darts_bench.surgery.diagnostics import entropy_contrast, gap_closed, position_slope
from darts_bench.surgery.heads import save_head
from darts_bench.surgery.intervals import behaviour_intervals
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


def head_key(cfg, features_key: str, reference_key: str, scfg, seed: int | None = None) -> str:
    """Cache key of one (merge, task, split)'s heads: features, resolved surgery config ``scfg``,
    held-out fraction, head seed (``seed``, default ``cfg.seed``) and, when DeepSpeed trains them, the
    DeepSpeed settings and accelerator (DeepSpeed heads differ from in-process ones by float summation
    order; see README)."""
    # surgery.controls is left out: a control's heads are their own artifact (their own methods and
    # rank, :func:`resolve_controls`), so switching controls on leaves the methods' heads' keys as they were
    parts = {"features": features_key, "reference": reference_key,
             "surgery": {k: v for k, v in scfg.model_dump(mode="json").items() if k != "controls"},
             "held_out": cfg.calibration.held_out_fraction,
             "seed": cfg.seed if seed is None else seed}
    if cfg.deepspeed.enabled:
        from darts_bench.surgery.train_deepspeed import deepspeed_key

        parts["deepspeed"] = deepspeed_key(cfg.deepspeed)
    return stable_hash(parts)


def train(cfg, collected: dict, merges: dict[str, Path], pool, tasks: dict, variants: list[tuple[str, Any]],
          seeds: list[int], work_dir: Path, release_executor: Callable[[], None] = lambda: None) -> dict:
    """Train (or reuse) every head of the run.

    Args:
        collected: the collect stage's ``{"calibration", "features"}``.
        variants: ``[(tag, resolved SurgeryConfig)]`` (:func:`resolve_surgery` of each sweep variant).
        seeds: the head seeds (:func:`darts_bench.rows.head_seeds`).
        release_executor: frees the executor's actors before DeepSpeed runs through Ray Train.

    Returns:
        ``{"heads": {(merge, task, method, split): dir}, "diagnostics": {(merge, task, split): dict}}``
        of the first variant and seed, ``"runs": {(merge, task, split, variant, seed): diagnostics}`` and
        ``"run_heads": {(merge, task, method, split, variant, seed): dir}`` of every variant and seed.
    """
    feats = collected["features"]
    heads: dict[tuple[str, str, str, str], Path] = {}
    diags: dict[tuple[str, str, str], dict] = {}
    runs: dict[tuple[str, str, str, str, int], dict] = {}
    run_heads: dict[tuple[str, str, str, str, str, int], Path] = {}
    first = (variants[0][0], seeds[0])
    for (m, name, split), fs in feats.items():
        if split == "reference":
            continue
        task = tasks[name][0]
        ref_fs = feats[(m, name, "reference")]
        for (tag, scfg), seed in itertools.product(variants, seeds):
            key = head_key(cfg, fs.key, ref_fs.key, scfg=scfg, seed=seed)
            final = work_dir / "heads" / f"{m}-{name}-{split}-{key}"

            def build(tmp: Path, fs=fs, ref_fs=ref_fs, m=m, name=name, split=split, task=task, scfg=scfg,
                      seed=seed) -> None:
                train_and_diagnose(cfg, tmp, fs, merges[m], pool.path(task.expert), ref_fs, m, name,
                                   split, scfg=scfg, run_seed=seed, work_dir=work_dir,
                                   release_executor=release_executor)

            cached(final, build, what=f"train heads {m}/{name}/{split}{tag}{seed_tag(cfg, seed)}",
                   meta={"kind": "heads", "merge": m, "task": name, "split": split, "variant": tag, "seed": seed})
            runs[(m, name, split, tag, seed)] = json.loads((final / "diagnostics.json").read_text())
            for method in scfg.methods:
                run_heads[(m, name, method, split, tag, seed)] = final / method
                if (tag, seed) == first:
                    heads[(m, name, method, split)] = final / method
            if (tag, seed) == first:
                diags[(m, name, split)] = runs[(m, name, split, tag, seed)]
    return {"heads": heads, "diagnostics": diags, "runs": runs, "run_heads": run_heads}


def train_and_diagnose(cfg, out: Path, fs: FeatureSet, merge_dir: Path, expert_dir: Path,
                       ref_fs: FeatureSet, m: str, name: str, split: str, scfg, run_seed: int, work_dir: Path,
                       release_executor: Callable[[], None] = lambda: None) -> None:
    """Train one head per method of ``scfg`` for (merge ``m``, task ``name``, ``split``) and write
    them with ``diagnostics.json`` into ``out``. Held-out sequences (``calibration.held_out_fraction``,
    split by sequence with a seed derived from ``run_seed``) validate; the reference-answer tokens
    (``ref_fs``) are scored, never trained on.

    Raises:
        RuntimeError: the reference-answer features and the diagnostics stream disagree in length.
    """
    from darts_bench.surgery.data import load_split, reference_answer_batches, reference_answer_groups
    from darts_bench.surgery.diagnostics import Diagnostics

    W_e, W_m = lm_head_weight(expert_dir), lm_head_weight(merge_dir)
    W_e = W_e[: W_m.shape[0]]  # pool.vocab_alignment=base: the expert's appended tokens are dropped
    calib = fs.calib  # the calibration set the merged features were collected on
    n_seq = len(calib.meta["sequences"])
    seed = derive_seed(run_seed, "split", name, split)
    tr_seq, va_seq = split_by_sequence(n_seq, cfg.calibration.held_out_fraction, seed)
    # one [N, d] buffer per model in the stored dtype; train / val are index views of it
    train_, val = load_split(calib.expert_shards(), fs.merged_shards(), tr_seq, scfg.entropy_source, W_e, W_m)
    mean_h = float(train_.weight_source.mean())
    # reference-answer tokens (only the answer part of prompt + reference): streamed per shard
    ref_stream = reference_answer_batches(ref_fs.calib.expert_shards(), ref_fs.merged_shards(),
                                          ref_fs.calib.meta, scfg.entropy_source, W_e, W_m)
    val_pos, val_seq = val.positions, val.seq_index
    diag_val = Diagnostics(lambda: val.batches(8192), mean_h, scfg.w_max, W_e, W_m, device=cfg.device)
    diag_ref = Diagnostics(ref_stream, mean_h, scfg.w_max, W_e, W_m, device=cfg.device)

    per_token: dict[str, dict] = {}  # row -> per-token KL / agreement / floor on the held-out tokens
    per_token_ref: dict[str, dict] = {}  # the same on the reference-answer tokens

    def diag_all(heads: dict) -> dict[str, dict]:  # one pass over the held-out / reference tokens for all heads
        res = {}
        for row, d, r in zip(heads, diag_val.many(list(heads.values())), diag_ref.many(list(heads.values()))):
            tok_l1 = d.pop("per_token_l1")
            per_token[row] = {k: np.asarray(d.pop(f"per_token_{k}")) for k in ("kl", "agree", "floor")}
            d["slope"] = position_slope(val_pos.numpy(), tok_l1, n_boot=200, seed=seed, groups=val_seq.numpy())
            d["slope"]["n_sequences"] = len(va_seq)
            d["entropy_contrast"] = entropy_contrast(val.weight_source.float().numpy(), tok_l1, val_seq.numpy(),
                                                     n_boot=200, seed=seed)
            d["reference"] = {k: r[k] for k in ("rep_l1", "rep_l1_ew", "kl_expert", "agree_top1", "kl_floor")}
            per_token_ref[row] = {k: np.asarray(r[f"per_token_{k}"]) for k in ("kl", "agree", "floor")}
            res[row] = d
        return res

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
        save_head(res.head, out / method, extra={"merge": m, "task": name, "split": split, "history": res.history})
        trained[method] = res.head
    rows = diag_all({"none": None, **trained})
    diags = {"none": rows["none"], "n_train_tokens": len(train_), "n_val_tokens": len(val),
             "n_reference_tokens": diag_ref.n_tokens, "train_sequences": tr_seq, "held_out_sequences": va_seq}
    for method in trained:
        diags[method] = rows[method]
        for k in ("", "reference"):
            src = diags[method] if not k else diags[method][k]
            base_ = diags["none"] if not k else diags["none"][k]
            src["gap_closed"] = gap_closed(base_["kl_expert"], src["kl_expert"], base_["kl_floor"])
    # sequence-level 95% CIs of kl_expert / agree_top1 / gap_closed and DARTS - Surgery differences
    diags["intervals"] = behaviour_intervals(per_token, val.seq_index.numpy(), n_boot=200, seed=seed)
    # the same on the reference answers (resampling reference sequences)
    ref_groups = reference_answer_groups(ref_fs.calib.expert_shards(), ref_fs.calib.meta).numpy()
    if len(ref_groups) and len(ref_groups) == len(per_token_ref["none"]["kl"]):
        diags["intervals_reference"] = behaviour_intervals(per_token_ref, ref_groups, n_boot=200, seed=seed)
    elif len(ref_groups):
        raise RuntimeError(f"{m}/{name}: {len(ref_groups)} reference-answer tokens in the features, "
                           f"{len(per_token_ref['none']['kl'])} in the diagnostics stream")
    (out / "diagnostics.json").write_text(json.dumps(diags))
