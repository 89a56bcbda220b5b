"""The pipeline: pool -> merge -> collect -> train -> evaluate -> report.

Each stage is a method of :class:`Pipeline` that returns its artifacts and caches them under
``cfg.work_dir`` (content-addressed, atomic); running a later stage runs the earlier ones, reusing
what is cached, so a killed run resumes where it stopped.
"""

from __future__ import annotations

import itertools
import json
import logging
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from darts_bench.api import EvalContext, Example, Task, TaskResult, get_task, resolve_suite
from darts_bench.artifacts import cached, clean_stale_temps, stable_hash
from darts_bench.collect.features import (CalibrationSet, FeatureSet, calibration_prompts, collect_calibration,
                                          collect_merged)
from darts_bench.config import Config
from darts_bench.evaluate.engines import backend_key, check_backends, open_models
from darts_bench.executors.local import make_executor
from darts_bench.pool.checkpoint import lm_head_weight
from darts_bench.progress import overall_bar
from darts_bench.surgery.data import answer_prediction_mask  # noqa: F401 - public here since the rehearsal issue
from darts_bench.surgery.diagnostics import entropy_contrast, gap_closed, position_slope
from darts_bench.surgery.heads import save_head
from darts_bench.surgery.intervals import behaviour_intervals
from darts_bench.surgery.train import split_by_sequence, train_head
from darts_bench.sweeps import head_seeds, needs_merges, row_names, row_selected, seed_tag, surgery_variants

log = logging.getLogger("darts_bench")
STAGES = ("pool", "merge", "collect", "train", "evaluate", "report")


def derive_seed(run_seed: int, *parts: Any) -> int:
    """A 31-bit seed derived from the run seed and a name (never from global RNG order)."""
    return int(stable_hash([run_seed, *parts], n=8), 16) & 0x7FFFFFFF


@dataclass
class Row:
    """One evaluated model: its row name and where it comes from."""

    model: str  # base | expert:code | ties | ties+darts | ties+darts@inductive
    merge: str = ""
    correction: str = "none"
    calibration: str = ""
    model_dir: Path | None = None
    model_key: str = ""
    heads: dict[str, Path] = field(default_factory=dict)  # task -> head dir
    variant: str = ""  # sweep tag, e.g. "[w_max=2]" ("" without a sweep)
    seed: int | None = None  # head seed of a corrected row


def pool_expert_names(cfg: Config) -> list[str]:
    """The experts every pool kind builds or loads (``EXPERT_NAMES``), the names a task's
    ``expert`` may take."""
    from darts_bench.config import EXPERT_NAMES

    return list(EXPERT_NAMES)


class Pipeline:
    """Runs the stages for one config. ``suite``: ``all`` (every enabled installed task), one task
    name or a comma-separated list (:func:`darts_bench.api.resolve_suite`); ``limit`` caps examples
    per benchmark (overrides each task's configured limit).

    Raises:
        ValueError: unknown or empty suite, or a task mapped to an expert the pool does not have.
    """

    def __init__(self, cfg: Config, suite: str = "all", limit: int | None = None, out_dir: str | None = None):
        self.cfg, self.suite, self.limit = cfg, suite, limit
        self.out_dir = Path(out_dir) if out_dir else cfg.resolved_out_dir()
        self.work_dir = Path(cfg.work_dir)
        self.task_names = resolve_suite(suite, cfg.tasks)
        experts = pool_expert_names(cfg)
        for t in self.task_names:
            e = get_task(t).expert
            if e is not None and e not in experts:
                raise ValueError(f"task {t} maps to expert {e!r}, which the pool does not have (experts: "
                                 f"{experts}); set the task's `expert` to one of them or to None (no heads)")
        self._cache: dict[str, Any] = {}
        self.timings: dict[str, float] = {}
        self._executor = None
        check_backends(cfg)  # evaluate/calibration backend vllm without vllm: fail before any stage
        if cfg.torch_threads:
            torch.set_num_threads(cfg.torch_threads)

    # ------------------------------------------------------------------ helpers
    @property
    def executor(self):
        if self._executor is None:
            self._executor = make_executor(self.cfg)
        return self._executor

    def close(self) -> None:
        if self._executor is not None:
            self._executor.close()
            self._executor = None

    def _stage(self, name: str, fn):
        """Run a stage once (cached in memory). ``timings[name]``: its exclusive wall time (s): the
        time of stages it triggers lazily (``evaluate`` -> ``train`` -> ...) is subtracted."""
        if name in self._cache:
            return self._cache[name]
        stack = self.__dict__.setdefault("_stage_stack", [])
        t0 = time.perf_counter()
        log.info("stage %s: start", name)
        stack.append(0.0)  # seconds spent in nested stages
        try:
            res = fn()
        finally:
            nested = stack.pop()
            total = time.perf_counter() - t0
            if stack:
                stack[-1] += total
        self.timings[name] = total - nested
        log.info("stage %s: done in %.1f s (%.1f s in earlier stages it triggered)", name, self.timings[name], nested)
        self._cache[name] = res
        return res

    def check_writable(self) -> None:
        """Fail before any work if the output or work dir cannot be written, a given data dir lacks
        a selected task's data (the same checks as ``--dry-run``: :mod:`darts_bench.checks`), or the
        output dir is a committed regression baseline."""
        from darts_bench.checks import check_data_dir, check_output_dir
        from darts_bench.report.compare import check_not_baseline

        check_data_dir(self.cfg.resolved_data_dir(), self.task_names)
        check_output_dir(self.out_dir, "output dir")
        check_output_dir(self.work_dir, "work dir")
        check_not_baseline(self.out_dir)  # a committed baseline is refreshed on purpose only
        n = clean_stale_temps(self.work_dir)
        if n:
            log.info("removed %d temp dirs left by an interrupted run", n)

    def task_limit(self, name: str) -> int | None:
        return self.limit if self.limit is not None else getattr(self.cfg.tasks, name).limit

    def surgery_config(self, surgery=None):
        """``surgery`` (default ``cfg.surgery``; a sweep variant's section) with ``max_len`` resolved
        (derived from the longest calibration and evaluation sequence when unset:
        :mod:`darts_bench.positions`); warns when an explicit table is shorter than the sequences."""
        surgery = self.cfg.surgery if surgery is None else surgery
        ck = ("surgery_config", stable_hash(surgery.model_dump(mode="json")))
        if ck not in self._cache:
            from darts_bench.positions import clamp_warning, resolve_max_len

            cfg = self.cfg if surgery is self.cfg.surgery else self.cfg.model_copy(update={"surgery": surgery})
            max_pos = json.loads((Path(self.pool().base) / "config.json").read_text()).get("max_position_embeddings")
            enabled = resolve_suite("all", self.cfg.tasks)  # not per suite: the same heads for every suite
            warn = clamp_warning(cfg, enabled, max_pos)
            if warn:
                log.warning(warn)
            self._cache[ck] = surgery.model_copy(update={"max_len": resolve_max_len(cfg, enabled, max_pos)})
        return self._cache[ck]

    def surgery_variants(self) -> list[tuple[str, Any]]:
        """``[(tag, SurgeryConfig)]`` of the sweep (:func:`darts_bench.sweeps.surgery_variants`), each
        with ``max_len`` resolved by :meth:`surgery_config` (a swept ``max_len`` is kept)."""
        return [(tag, self.surgery_config(v)) for tag, v in surgery_variants(self.cfg)]

    # ------------------------------------------------------------------ stages
    def pool(self):
        from darts_bench.pool import build_pool

        def run():
            self.check_writable()
            return build_pool(self.cfg, self.work_dir)

        return self._stage("pool", run)

    def merge(self) -> dict[str, Path]:
        from darts_bench.merge import build_merges

        pool = self.pool()
        if not self.needs_merges:
            if "merge-skipped" not in self._cache:
                self._cache["merge-skipped"] = True
                log.info("stage merge: skipped (evaluate.rows %s selects no merge or corrected row)", self.cfg.evaluate.rows)
            return {}
        return self._stage("merge", lambda: build_merges(self.cfg, pool, self.work_dir))

    def tasks(self) -> dict[str, tuple[Task, list[Example]]]:
        """Each selected task with its evaluated examples (prompts formatted for the pool's tokenizer)."""
        if "tasks" not in self._cache:
            from transformers import AutoTokenizer

            from darts_bench.evaluate.hf_model import PromptFormatter

            tok = AutoTokenizer.from_pretrained(str(self.pool().base))
            fmt = PromptFormatter(tok)
            out = {}
            for name in self.task_names:
                task = get_task(name)
                tcfg = getattr(self.cfg.tasks, name, None)
                proto = getattr(tcfg, "protocol", None)
                if proto is not None:
                    task.protocol = proto  # every row gets the prompts of this one protocol
                if callable(getattr(task, "preflight", None)):
                    task.preflight(tcfg)  # e.g. a named AlpacaEval annotator's API key, before any generation
                ex = task.examples(self.cfg.resolved_data_dir(), fmt, self.task_limit(name))
                if not ex:
                    raise ValueError(f"task {name}: no examples")
                out[name] = (task, ex)
            self._cache["tasks"] = out
            self._cache["tokenizer"] = tok
            self._cache["formatter"] = fmt
        return self._cache["tasks"]

    def collect(self) -> dict:
        """Calibration sets per (task, split) and merged features per (merge, task, split), plus
        reference-answer features (never trained on) per (task) and (merge, task)."""
        merges, pool, tasks = self.merge(), self.pool(), self.tasks()

        def run():
            n_sets = len(self.cfg.calibration.splits) + 1  # + the reference answers
            n_tasks = sum(t.expert is not None for t, _ in tasks.values())
            with overall_bar(n_tasks * n_sets * (1 + len(merges)), "collect", unit="feature set") as bar, \
                    open_models(self.cfg, self.executor, role="calibration") as backend:
                return collect_all(bar, backend)

        def collect_all(bar, backend):
            tok, fmt = self._cache["tokenizer"], self._cache["formatter"]
            calib: dict[tuple[str, str], CalibrationSet] = {}
            feats: dict[tuple[str, str, str], FeatureSet] = {}
            # model-major order: every artifact of one model in a row, so an executor that keeps
            # the latest model loaded loads each expert and each merge once
            for name, (task, examples) in tasks.items():
                if task.expert is None:
                    continue  # no expert, no calibration: the task gets no heads
                bar.set_postfix_str(name)
                expert_dir = pool.path(task.expert)
                expert_key = pool.model_key(task.expert)
                for split in self.cfg.calibration.splits:
                    prompts = calibration_prompts(task, split, self.cfg, fmt, examples)
                    calib[(name, split)] = collect_calibration(self.cfg, task, split, prompts, expert_dir,
                                                               self.executor, tok, self.work_dir, expert_key,
                                                               backend=backend)
                    bar.update(1)
                calib[(name, "reference")] = collect_calibration(
                    self.cfg, task, "reference", [e.prompt for e in examples], expert_dir, self.executor, tok,
                    self.work_dir, expert_key, references=[e.reference for e in examples], backend=backend)
                bar.update(1)
            for m, mdir in merges.items():
                mkey = mdir.name
                for name in tasks:
                    if (name, "reference") not in calib:
                        continue  # a task without an expert has no calibration sets
                    for split in (*self.cfg.calibration.splits, "reference"):
                        feats[(m, name, split)] = collect_merged(self.cfg, m, mdir, mkey, calib[(name, split)],
                                                                 self.executor, self.work_dir)
                        bar.update(1)
            if hasattr(self.executor, "release_idle"):
                self.executor.release_idle()  # no model stays loaded into train / evaluate
            return {"calibration": calib, "features": feats}

        return self._stage("collect", run)

    def train(self) -> dict:
        """Heads per (merge, task, method, split) + diagnostics per (merge, task, split) of the first
        sweep variant and head seed, and ``runs``: diagnostics per (merge, task, split, variant, seed)
        and ``run_heads``: head dirs per (merge, task, method, split, variant, seed) for every variant
        and seed (:mod:`darts_bench.sweeps`). Empty when ``evaluate.rows`` selects no merge or
        corrected row (collection and training are skipped)."""
        if not self.needs_merges:
            if "train-skipped" not in self._cache:
                self._cache["train-skipped"] = True
                log.info("stage train: skipped (evaluate.rows %s selects no merge or corrected row)", self.cfg.evaluate.rows)
            return {"heads": {}, "diagnostics": {}, "runs": {}, "run_heads": {}}
        col, merges, pool = self.collect(), self.merge(), self.pool()
        variants, seeds = self.surgery_variants(), head_seeds(self.cfg)

        def run():
            heads: dict[tuple[str, str, str, str], Path] = {}
            diags: dict[tuple[str, str, str], dict] = {}
            runs: dict[tuple[str, str, str, str, int], dict] = {}
            run_heads: dict[tuple[str, str, str, str, str, int], Path] = {}
            for (m, name, split), fs in col["features"].items():
                if split == "reference":
                    continue
                task = self.tasks()[name][0]
                calib = fs.calib
                for (tag, scfg), seed in itertools.product(variants, seeds):
                    key = self.head_key(fs.key, col["features"][(m, name, "reference")].key, scfg=scfg, seed=seed)
                    final = self.work_dir / "heads" / f"{m}-{name}-{split}-{key}"

                    def build(tmp: Path, fs=fs, calib=calib, m=m, name=name, split=split, task=task, scfg=scfg,
                              seed=seed) -> None:
                        self._train_and_diagnose(tmp, fs, calib, merges[m], pool.path(task.expert),
                                                 col["features"][(m, name, "reference")], m, name, split,
                                                 scfg=scfg, run_seed=seed)

                    cached(final, build, what=f"train heads {m}/{name}/{split}{tag}{seed_tag(self.cfg, seed)}",
                           meta={"kind": "heads", "merge": m, "task": name, "split": split, "variant": tag,
                                 "seed": seed})
                    runs[(m, name, split, tag, seed)] = json.loads((final / "diagnostics.json").read_text())
                    for method in scfg.methods:
                        run_heads[(m, name, method, split, tag, seed)] = final / method
                        if (tag, seed) == (variants[0][0], seeds[0]):
                            heads[(m, name, method, split)] = final / method
                    if (tag, seed) == (variants[0][0], seeds[0]):
                        diags[(m, name, split)] = runs[(m, name, split, tag, seed)]
            return {"heads": heads, "diagnostics": diags, "runs": runs, "run_heads": run_heads}

        return self._stage("train", run)

    def head_key(self, features_key: str, reference_key: str, scfg=None, seed: int | None = None) -> str:
        """Cache key of one (merge, task, split)'s heads: features, resolved surgery config (``scfg``:
        a sweep variant's, default :meth:`surgery_config`), held-out fraction, head seed (``seed``,
        default ``cfg.seed``) and, when DeepSpeed trains them, the DeepSpeed settings and accelerator
        (DeepSpeed heads differ from in-process ones by float summation order; see README). The
        defaults give the key of a run without sweep or ``seeds``."""
        scfg = self.surgery_config() if scfg is None else scfg
        parts = {"features": features_key, "reference": reference_key,
                 "surgery": scfg.model_dump(mode="json"),
                 "held_out": self.cfg.calibration.held_out_fraction,
                 "seed": self.cfg.seed if seed is None else seed}
        if self.cfg.deepspeed.enabled:
            from darts_bench.surgery.train_deepspeed import deepspeed_key

            parts["deepspeed"] = deepspeed_key(self.cfg.deepspeed)
        return stable_hash(parts)

    def _train_and_diagnose(self, out: Path, fs: FeatureSet, calib: CalibrationSet, merge_dir: Path,
                            expert_dir: Path, ref_fs: FeatureSet, m: str, name: str, split: str,
                            scfg=None, run_seed: int | None = None) -> None:
        from darts_bench.surgery.data import load_split, reference_answer_batches
        from darts_bench.surgery.diagnostics import Diagnostics

        scfg = scfg if scfg is not None else self.surgery_config()
        run_seed = self.cfg.seed if run_seed is None else run_seed
        W_e, W_m = lm_head_weight(expert_dir), lm_head_weight(merge_dir)
        W_e = W_e[: W_m.shape[0]]  # pool.vocab_alignment=base: the expert's appended tokens are dropped
        n_seq = len(calib.meta["sequences"])
        seed = derive_seed(run_seed, "split", name, split)
        tr_seq, va_seq = split_by_sequence(n_seq, self.cfg.calibration.held_out_fraction, seed)
        # one [N, d] buffer per model in the stored dtype; train / val are index views of it
        train, val = load_split(calib.expert_shards(), fs.merged_shards(), tr_seq, scfg.entropy_source, W_e, W_m)
        mean_h = float(train.weight_source.mean())
        # reference-answer tokens (only the answer part of prompt + reference): streamed per shard
        ref_stream = reference_answer_batches(ref_fs.calib.expert_shards(), ref_fs.merged_shards(),
                                              ref_fs.calib.meta, scfg.entropy_source, W_e, W_m)
        val_pos, val_seq = val.positions, val.seq_index
        diag_val = Diagnostics(lambda: val.batches(8192), mean_h, scfg.w_max, W_e, W_m, device=self.cfg.device)
        diag_ref = Diagnostics(ref_stream, mean_h, scfg.w_max, W_e, W_m, device=self.cfg.device)

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
            if self.cfg.deepspeed.enabled:
                from darts_bench.surgery.train_deepspeed import train_head_deepspeed

                if self.cfg.executor == "ray" and self.cfg.deepspeed.launcher == "ray":
                    self.close()  # free the collection actors' CPUs/GPUs for Ray Train's workers
                res = train_head_deepspeed(method, train.materialize(), val.materialize(), scfg, hseed, self.cfg.deepspeed,
                                           self.work_dir / "deepspeed", ray_address=self.cfg.ray.address)
            else:
                res = train_head(method, train, val, scfg, hseed)
            save_head(res.head, out / method, extra={"merge": m, "task": name, "split": split,
                                                     "history": res.history})
            trained[method] = res.head
        rows = diag_all({"none": None, **trained})
        diags = {"none": rows["none"], "n_train_tokens": len(train), "n_val_tokens": len(val),
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
        from darts_bench.surgery.data import reference_answer_groups

        ref_groups = reference_answer_groups(ref_fs.calib.expert_shards(), ref_fs.calib.meta).numpy()
        if len(ref_groups) and len(ref_groups) == len(per_token_ref["none"]["kl"]):
            diags["intervals_reference"] = behaviour_intervals(per_token_ref, ref_groups, n_boot=200, seed=seed)
        elif len(ref_groups):
            raise RuntimeError(f"{m}/{name}: {len(ref_groups)} reference-answer tokens in the features, "
                               f"{len(per_token_ref['none']['kl'])} in the diagnostics stream")
        (out / "diagnostics.json").write_text(json.dumps(diags))

    # -------------------------------------------------------------- evaluation
    def row_names(self) -> list[str]:
        """Every row name of this config (:func:`darts_bench.sweeps.row_names`)."""
        return row_names(self.cfg)

    def selected(self, name: str) -> bool:
        """Whether row ``name`` is evaluated (``evaluate.rows`` patterns; every row when unset)."""
        return row_selected(self.cfg, name)

    @property
    def needs_merges(self) -> bool:
        """False when ``evaluate.rows`` selects no merge or corrected row: the merge, collect and
        train stages are then skipped (base and experts only)."""
        return needs_merges(self.cfg)

    def check_row_filter(self) -> None:
        """Raises ValueError when an ``evaluate.rows`` pattern matches no row of this config (a typo
        would otherwise silently evaluate nothing)."""
        from fnmatch import fnmatchcase

        pats, names = self.cfg.evaluate.rows, self.row_names()
        for p in pats or []:
            if not any(fnmatchcase(n, p) for n in names):
                raise ValueError(f"evaluate.rows: pattern {p!r} matches no row; rows of this config: {names}")

    def rows(self) -> list[Row]:
        """The evaluated rows (``evaluate.rows`` applied); see :meth:`all_rows`."""
        self.check_row_filter()
        return [r for r in self.all_rows() if self.selected(r.model)]

    def all_rows(self) -> list[Row]:
        """Every row; merges and heads are built only when :attr:`needs_merges`."""
        pool = self.pool()
        rows = [Row("base", model_dir=pool.base, model_key=pool.model_key("base"))]
        for e in pool.experts:
            rows.append(Row(f"expert:{e}", model_dir=pool.experts[e], model_key=pool.model_key(e)))
        if not self.needs_merges:
            return rows
        merges = self.merge()
        heads = self.train()["run_heads"]
        splits = self.cfg.calibration.splits
        for m, mdir in merges.items():
            rows.append(Row(m, merge=m, model_dir=mdir, model_key=mdir.name))
            for split in splits:
                for method in self.cfg.surgery.methods:
                    for tag, _ in surgery_variants(self.cfg):
                        for seed in head_seeds(self.cfg):
                            suffix = "" if split == "transductive" else f"@{split}"
                            k = (method, split, tag, seed)
                            hd = {t: heads[(m, t, *k)] for t in self.task_names
                                  if (m, t, *k) in heads}  # tasks with no expert get no head
                            rows.append(Row(f"{m}+{method}{suffix}{tag}{seed_tag(self.cfg, seed)}", merge=m,
                                            correction=method, calibration=split, model_dir=mdir,
                                            model_key=mdir.name + "+" + stable_hash([str(p) for p in hd.values()]),
                                            heads=hd, variant=tag, seed=seed))
        return rows

    def evaluate(self) -> dict[str, dict[str, TaskResult]]:
        def run():
            results: dict[str, dict[str, TaskResult]] = {}
            rows = self.rows()
            # every row stays reachable by name (e.g. the AlpacaEval judge `expert:instruction`)
            by_name = {r.model: r for r in self.all_rows()}
            # each checkpoint loaded once (rows of one model dir share it; the judge stays loaded)
            self._models = open_models(self.cfg, self.executor)
            try:
                with overall_bar(len(rows) * len(self.tasks()), "evaluate", unit="row x task") as bar:
                    for row in rows:
                        results[row.model] = {}
                        for name, (task, examples) in self.tasks().items():
                            bar.set_postfix_str(f"{row.model} / {name}")
                            results[row.model][name] = self._evaluate_one(row, task, examples, by_name, results)
                            bar.update(1)
            finally:
                self._models.close()
                self._models = None
            return results

        return self._stage("evaluate", run)

    def _text_model(self, row: Row, task_name: str | None, pin: bool = False):
        head_dir = row.heads.get(task_name) if task_name else None
        return self._models.get(row.model, row.model_dir, head_dir, pin=pin)  # the evaluate stage's backend

    def eval_key(self, row: Row, task: Task, examples: list[Example], judge_key: str = "",
                 model_key: str | None = None) -> str:
        """Cache key of one (row, task) evaluation: the row's model key (``model_key`` overrides it,
        e.g. a corrected row on a task without heads is its merge), task name/version/config,
        examples, seed, judge, and the device and ``tasks.batch_size`` (both change generations:
        left padding and kernels; sampled generations draw per batch)."""
        tcfg = getattr(self.cfg.tasks, task.name)
        return stable_hash({"model": model_key if model_key is not None else row.model_key, "task": task.name, "version": task.version,
                            "cfg": tcfg.model_dump(mode="json"), "n": len(examples), "seed": self.cfg.seed,
                            "judge": judge_key, "ex": stable_hash([(e.id, e.prompt, e.reference) for e in examples]),
                            "numerics": {"device": self.cfg.device, "batch_size": self.cfg.tasks.batch_size},
                            # the generation engine (empty for hf: HF keys unchanged)
                            **backend_key(self.cfg, "evaluate")})

    def _evaluate_one(self, row: Row, task: Task, examples: list[Example], by_name: dict[str, Row],
                      results: dict) -> TaskResult:
        tcfg = getattr(self.cfg.tasks, task.name)
        # other models the protocol uses (e.g. a judge): their identity is part of the cache key
        judge_key = "|".join(by_name[d].model_key if d in by_name else d for d in task.models_used(tcfg))
        model_key = row.model_key
        if row.correction != "none" and task.name not in row.heads:
            model_key = by_name[row.merge].model_key  # no head for this task: the row is its merge here
        key = self.eval_key(row, task, examples, judge_key, model_key=model_key)
        # row names of seeds / sweeps carry [ ] # , (glob and URL characters in data-file paths): not in paths
        safe = re.sub(r"[^A-Za-z0-9_.+@=-]", "_", row.model)
        final = self.work_dir / "eval" / f"{safe}-{task.name}-{key}"

        def build(tmp: Path) -> None:
            opened = []

            def get_model(name: str):
                if name not in by_name:
                    if Path(name).is_dir():
                        tm = self._models.get(name, name, None, pin=True)
                        opened.append(tm)
                        return tm
                    raise KeyError(f"no model row {name!r} (rows: {sorted(by_name)})")
                tm = self._text_model(by_name[name], task.name, pin=True)
                opened.append(tm)
                return tm

            def get_outputs(name: str) -> list[str]:
                if name not in results or task.name not in results[name]:
                    raise KeyError(f"reference model {name!r} has no {task.name} outputs yet; it must be a row "
                                   "evaluated before this one (base or an expert)")
                return [s["output"] for s in results[name][task.name].samples]

            tm = self._text_model(row, task.name)
            try:
                ctx = EvalContext(config=tcfg, data_dir=self.cfg.resolved_data_dir(),
                                  seed=derive_seed(self.cfg.seed, "eval", task.name), work_dir=tmp / "scratch",
                                  get_model=get_model, get_outputs=get_outputs, out_dir=tmp)
                (tmp / "scratch").mkdir()
                res = task.evaluate(tm, examples, ctx)
            finally:
                for m in [tm, *opened]:
                    if hasattr(m, "close"):
                        m.close()
            import shutil

            shutil.rmtree(tmp / "scratch", ignore_errors=True)
            # per_example lists are in example order (the Task contract): record which example each is
            (tmp / "result.json").write_text(json.dumps({"metrics": res.metrics, "per_example": res.per_example,
                                                         "samples": res.samples, "meta": res.meta,
                                                         "example_ids": [e.id for e in examples]}, default=str))

        cached(final, build, what=f"evaluate {row.model} on {task.name}",
               meta={"kind": "eval", "row": row.model, "task": task.name})
        d = json.loads((final / "result.json").read_text())
        return TaskResult(metrics=d["metrics"], per_example=d["per_example"], samples=d["samples"], meta=d["meta"],
                          example_ids=d.get("example_ids", []))

    def report(self):
        from darts_bench.report.tables import write_report

        def run():
            results = self.evaluate()
            return write_report(self, results)

        return self._stage("report", run)

    def run_until(self, stage: str):
        if stage not in STAGES:
            raise ValueError(f"unknown stage {stage!r}; stages: {STAGES}")
        return getattr(self, stage)()
