"""The merge stage: every configured merge, cached (mergekit's methods, the SVD merges and SVC, the data merges)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from darts_bench.artifacts import cached, stable_hash
from darts_bench.config import SVD_MERGE_METHODS, Config
from darts_bench.merge.mergekit_merge import merge_config_dict, run_one_merge, write_mergekit_config
from darts_bench.pool.build import Pool

log = logging.getLogger("darts_bench")
#: data merge method -> (module, builder, file beside the weights with what it learned / used)
DATA_MERGES = {"adamerging": ("darts_bench.merge.adamerging", "build_adamerging", "adamerging.json"),
               "regmean": ("darts_bench.merge.regmean", "build_regmean", "regmean.json"),
               "expert_merging": ("darts_bench.merge.expert_merging", "build_expert_merging", "expert_merging.json")}
#: task-aware merge method -> (module, builder, summary file): a model per expert under ``tasks/`` (merge/emr.py)
TASK_AWARE_MERGES = {"emr": ("darts_bench.merge.emr", "build_emr", "emr.json")}


def data_merge_key(cfg: Config, pool: Pool, spec, prompts: dict) -> str:
    """Cache key of a data merge: pool key (every expert's and the base's content), the spec (method,
    hyper-parameters, split, dtype), the run seed (AdaMerging's batch order) and the data
    (:func:`darts_bench.merge.data.data_key`: the prompts, their token cap, the device)."""
    from darts_bench.merge.data import data_key

    return stable_hash({"pool": pool.key, "spec": spec.model_dump(mode="json"), "seed": cfg.seed,
                        "data": data_key(prompts, cfg)})


def spec_key(cfg: Config, pool: Pool, spec) -> str:
    """Cache key of a merge that reads no data (mergekit, SVD, SVC, task-aware): the pool key (every expert's and the
    base's content), the spec and the run seed (DARE's and DELLA's drop masks)."""
    return stable_hash({"pool": pool.key, "spec": spec.model_dump(mode="json"), "seed": cfg.seed})


def merge_details(merge_dir: Path) -> dict | None:
    """What a data, SVD or task-aware merge dir records beside its weights (the AdaMerging / Expert Merging
    coefficients, the RegMean data, the SVD merge's settings and SVC, the EMR rescalers), or None for a plain
    mergekit merge."""
    from darts_bench.merge.svd import SUMMARY as SVD_SUMMARY

    for fname in (*(f for _, _, f in DATA_MERGES.values()), *(f for _, _, f in TASK_AWARE_MERGES.values()),
                  SVD_SUMMARY):
        if (merge_dir / fname).is_file():
            return json.loads((merge_dir / fname).read_text())
    return None


def merge_dir_name(name: str, key: str) -> str:
    """``<name>-<key>``, the merge's dir under ``work/merges``; a merge sweep variant's tag characters
    (``[ ] = ,``: glob and shell characters) become ``_`` (names without them are unchanged, so are their dirs)."""
    import re

    return f"{re.sub(r'[^A-Za-z0-9_.-]', '_', name)}-{key}"


def _svd_or_svc(spec, cd: dict | None, pool: Pool, tmp: Path, seed: int) -> None:
    """Build an SVD merge (``cd`` None) or a mergekit merge ``cd`` followed by SVC into ``tmp``
    (:func:`darts_bench.merge.svd.build_svd_merge`; the mergekit merge is built in ``tmp/_premerge`` and
    removed)."""
    import shutil

    from darts_bench.merge.svd import build_svd_merge

    pre = None
    if cd is not None:
        pre = tmp / "_premerge"
        _mergekit(spec.name, cd, pre, seed, pool.base)
    try:
        build_svd_merge(spec, pool.base, dict(pool.experts), tmp, pre_merged=pre)
    finally:
        if pre is not None:
            shutil.rmtree(pre, ignore_errors=True)


class MergeError(ValueError):
    """mergekit failed on a merge: restated with the merge's name and the likely fix (``-v``: mergekit's traceback)."""


def _mergekit(name: str, cd: dict, tmp: Path, seed: int, base: Path) -> None:
    """:func:`run_one_merge`, its failures (mergekit's, transformers', safetensors') restated as :class:`MergeError`."""
    try:
        run_one_merge(cd, tmp, seed, base)
    except Exception as e:  # noqa: BLE001 - the boundary: whatever mergekit raises, said once in our words
        first = (str(e).strip().splitlines() or [""])[0][:300]
        models = [m.get("model") for m in cd.get("models", [])]
        raise MergeError(f"merge {name!r} ({cd.get('merge_method')}): mergekit failed: {type(e).__name__}: {first}; "
                         f"inputs: base {cd.get('base_model')}, experts {models}. Check them with `darts-bench "
                         "validate` (shard index, shapes, vocabulary, NaN weights); -v shows mergekit's traceback") from e


def build_merges(cfg: Config, pool: Pool, work_dir: Path, loaded=None, only: list[str] | None = None) -> dict[str, Path]:
    """Every configured merge: name -> checkpoint dir (a task-aware merge, ``emr``: its dir, with one
    checkpoint per expert under ``tasks/``, :func:`darts_bench.merge.emr.task_dir`). mergekit merges are cached by (pool key, merge
    spec, seed), each with its ``mergekit_config.yml`` (:func:`~darts_bench.merge.mergekit_merge.write_mergekit_config`);
    the SVD merges (``tsv_m``, ``iso_c``, ``iso_cts``) and every merge with ``svc_alpha`` (the mergekit merge,
    then SVC) by the same key, built by :mod:`darts_bench.merge.svd`;
    data merges (``adamerging``, ``regmean``, ``expert_merging``) by :func:`data_merge_key`, from the calibration prompts of
    ``loaded`` (the tasks stage's :class:`~darts_bench.stages.tasks.LoadedTasks`).

    ``only``: build these merges only (the ones the selected rows need: :func:`darts_bench.rows.needed_merges`).

    Raises:
        ValueError: a data merge is configured but ``loaded`` is None."""
    import importlib

    out: dict[str, Path] = {}
    for spec in cfg.merges:
        if only is not None and spec.name not in only:
            continue
        if spec.task_aware:
            mod, fn, _ = TASK_AWARE_MERGES[spec.method]
            builder = getattr(importlib.import_module(mod), fn)
            key = spec_key(cfg, pool, spec)
            final = work_dir / "merges" / merge_dir_name(spec.name, key)
            experts = dict(pool.experts)
            cached(final, lambda tmp, b=builder, s=spec: b(s, pool.base, experts, cfg, tmp),
                   what=f"merge {spec.name} ({spec.method})",
                   meta={"kind": "merge", "method": spec.method, "spec": spec.model_dump(mode="json")})
        elif spec.uses_data:
            if loaded is None:
                raise ValueError(f"merge {spec.name!r} ({spec.method}) needs the run's calibration prompts: pass the "
                                 "loaded tasks (darts_bench.stages.tasks.load_tasks)")
            from darts_bench.merge.data import prompts_by_task

            prompts = prompts_by_task(cfg, loaded, spec.calibration_split)
            key = data_merge_key(cfg, pool, spec, prompts)
            final = work_dir / "merges" / merge_dir_name(spec.name, key)
            mod, fn, _ = DATA_MERGES[spec.method]
            builder = getattr(importlib.import_module(mod), fn)
            experts = dict(pool.experts)  # every expert of the pool, in its order
            cached(final, lambda tmp, b=builder, s=spec, p=prompts: b(s, pool.base, experts, p, loaded.tokenizer,
                                                                       cfg, tmp),
                   what=f"merge {spec.name} ({spec.method})",
                   meta={"kind": "merge", "method": spec.method, "spec": spec.model_dump(mode="json"),
                         "seed": cfg.seed, "prompts": {t: {"expert": e, "n": len(ps)} for t, (e, ps) in prompts.items()}})
        elif spec.uses_svd:  # TSV-M / Iso-C / Iso-CTS, or any training-free merge with SVC on top
            cd = None if spec.method in SVD_MERGE_METHODS else merge_config_dict(spec, pool, cfg.pool.vocab_alignment)
            key = spec_key(cfg, pool, spec)
            final = work_dir / "merges" / merge_dir_name(spec.name, key)
            cached(final, lambda tmp, s=spec, cd=cd: _svd_or_svc(s, cd, pool, tmp, cfg.seed),
                   what=f"merge {spec.name} ({spec.method}{' + SVC' if spec.svc_alpha is not None else ''})",
                   meta={"kind": "merge", "method": spec.method, "spec": spec.model_dump(mode="json"),
                         **({"mergekit": cd} if cd else {})})
        else:
            cd = merge_config_dict(spec, pool, cfg.pool.vocab_alignment)
            key = spec_key(cfg, pool, spec)
            final = work_dir / "merges" / merge_dir_name(spec.name, key)
            cached(final, lambda tmp, cd=cd, s=spec: _mergekit(s.name, cd, tmp, cfg.seed, pool.base),
                   what=f"merge {spec.name} ({spec.method})", meta={"kind": "merge", "mergekit": cd})
            write_mergekit_config(final, cd, cfg.seed)  # after the cached build: also for merges cached before it
        out[spec.name] = final
    return out
