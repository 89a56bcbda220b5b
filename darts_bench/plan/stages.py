"""One estimate per stage: what it runs, where, its memory, disk, tokens and time, each written once.

:func:`plan_inputs` derives from the config what several stages read (architecture, tasks and
their :meth:`~darts_bench.api.Task.plan` needs, evaluated rows, calibration sets, the vLLM
engine); :func:`pool`, :func:`merge`, :func:`collect`, :func:`train`, :func:`evaluate` and
:func:`report` each return one stage's dict. Sizes are bytes, token counts tokens, times seconds;
the rates and constants are in :mod:`darts_bench.plan.resources`, the architecture helpers in
:mod:`darts_bench.plan.architecture`. No stage estimate knows a task by name: per-task costs come
from ``Task.typical_tokens``, ``Task.official_size``, ``Task.expert`` and ``Task.plan()``.

A stage dict has ``what``, ``where``, ``memory_bytes`` (peak RSS of the working process: a
measured process baseline plus the working set; None when the architecture is unknown),
``memory_note``, ``disk_bytes``, ``process_baseline_bytes`` and, where it applies, ``gpu_bytes``
(per actor / process on ``cuda``), token counts, ``model_loads``, ``load_seconds``, ``seconds``
(device work, all workers together), ``wall_seconds`` and ``device_hours`` (GPU-hours on
``cuda``, else CPU-core-hours).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from darts_bench.api import get_task, resolve_suite
from darts_bench.config import MERGE_COPY_MODES, SVD_MERGE_METHODS, Config, scoring_mode
from darts_bench.plan.architecture import (DTYPE_BYTES, activations, architecture, kv_cache, kv_dim, out_shard_bytes,
                                          param_count)
from darts_bench.plan.resources import (ACTOR_START_S, DIAG_BATCH, DIAG_TEMPS, FEATURE_COLUMNS_BYTES,
                                        LOAD_BYTES_PER_S, PROCESS_BASELINE, RECOMBINE_BACKWARD, THROUGHPUT,
                                        decode_seconds, device_kind, engine_loads, forward_seconds, plans_reloads, vllm_engine,
                                        vllm_generation_seconds)
from darts_bench.plan.units import gb, num
from darts_bench.controls import CONTROL_METHOD, head_param_count, param_matched_rank
from darts_bench.positions import clamp_warning, resolve_max_len
from darts_bench.rows import (RowSpec, head_seeds, merged_entropy_needed, needed_merges, needs_merges, row_selected, row_specs,
                               surgery_variants)

STAGE_ORDER = ("pool", "merge", "collect", "train", "evaluate", "report")
# Typical token lengths (Llama-style BPE) shared by all tasks; per-task ones are Task.typical_tokens.
TYPICAL_TOKENS = {
    "training_prompt": 120,  # inductive calibration prompts from the experts' training data
}
# Which methods carry a position-bias table (as darts_bench.surgery.heads.METHODS; kept here so the
# dry run does not import torch).
POSITION_BIAS = {"surgery": False, "darts": True, "darts_ew_only": False, "darts_pos_only": True}
_PLAN_KEYS = {"judge", "what", "where"}
_JUDGE_KEYS = {"label", "model", "prompt_tokens_per_row", "new_tokens_per_row"}
_JUDGE_OPTIONAL = {"scored_tokens_per_row", "scored_per_prompt", "shared_tokens_per_row"}


@dataclass(frozen=True)
class PlanInputs:
    """What the stage estimates read, derived once from the config (:func:`plan_inputs`).

    ``arch`` / ``params`` / ``largest_tensor`` / ``weights`` (bytes of one model in ``pool.dtype``)
    are None when the architecture is unknown. ``tasks``: the plan's per-task entries (examples,
    token lengths, protocol); ``needs``: each task's checked ``Task.plan()``; ``head_tasks``: the
    tasks with an expert (they get calibration sets and heads); ``specs``: every row
    (:func:`darts_bench.rows.row_specs`), ``evaluated`` the ones ``evaluate.rows`` selects;
    ``calib``: per ``<task>/<split>`` and ``<task>/reference`` the sequences and tokens of a
    calibration set; ``engine``: the vLLM engine (:func:`~darts_bench.plan.resources.vllm_engine`)
    when a vLLM backend is configured and the architecture is known; ``max_len``: the position
    table's rows (:func:`darts_bench.positions.resolve_max_len`).
    """

    cfg: Config
    arch: dict[str, Any] | None
    arch_source: str
    params: int | None
    largest_tensor: int | None
    weights: int | None
    tasks: dict[str, dict[str, Any]]
    needs: dict[str, dict[str, Any]]
    head_tasks: list[str]
    specs: list[RowSpec]
    evaluated: list[RowSpec]
    calib: dict[str, dict[str, Any]]
    engine: dict[str, Any] | None
    max_len: int

    @property
    def kind(self) -> str:
        return device_kind(self.cfg.device)

    @property
    def pool_bytes(self) -> int:
        return DTYPE_BYTES[self.cfg.pool.dtype]

    @property
    def workers(self) -> int:
        """Processes working at once in collect (and in evaluate unless vLLM runs in the driver)."""
        return self.cfg.ray.num_actors if self.cfg.executor == "ray" else 1

    @property
    def checkpoint_load_seconds(self) -> float:
        """One checkpoint load: the weights read, plus an actor group's start with Ray."""
        return self.weights / LOAD_BYTES_PER_S + (ACTOR_START_S if self.cfg.executor == "ray" else 0.0)

    @property
    def local_judges(self) -> dict[str, str]:
        """Task -> the judge model it loads in the evaluating process (tasks without one absent)."""
        return {t: n["judge"]["model"] for t, n in self.needs.items() if n.get("judge", {}).get("model")}

    @property
    def splits(self) -> dict[str, dict[str, Any]]:
        """The calibration sets heads train on (``calib`` less the reference answers)."""
        return {k: v for k, v in self.calib.items() if not k.endswith("/reference")}


def _checked_plan(name: str, got: Any) -> dict[str, Any]:
    """``Task.plan()`` of task ``name``, checked against the contract in :meth:`darts_bench.api.Task.plan`.

    Raises:
        ValueError: not a dict, an unknown key, ``what`` / ``where`` not a str, or a ``judge`` that is
            not a dict of its four keys (and the optional ``scored_tokens_per_row``,
            ``scored_per_prompt``) with the types the contract gives.
    """
    where = f"task {name}: Task.plan()"
    if not isinstance(got, dict):
        raise ValueError(f"{where} returned {type(got).__name__}, expected a dict")
    if set(got) - _PLAN_KEYS:
        raise ValueError(f"{where}: unknown key(s) {sorted(set(got) - _PLAN_KEYS)}; known: {sorted(_PLAN_KEYS)}")
    for k in ("what", "where"):
        if k in got and not isinstance(got[k], str):
            raise ValueError(f"{where}: {k!r} must be a str, got {got[k]!r}")
    if "judge" in got:
        j = got["judge"]
        if not isinstance(j, dict) or not _JUDGE_KEYS <= set(j) <= _JUDGE_KEYS | _JUDGE_OPTIONAL:
            raise ValueError(f"{where}: 'judge' must be a dict with the keys {sorted(_JUDGE_KEYS)} (optional: "
                             f"{sorted(_JUDGE_OPTIONAL)}), got {j!r}")
        if not isinstance(j["label"], str) or not (j["model"] is None or isinstance(j["model"], str)):
            raise ValueError(f"{where}: judge 'label' must be a str and 'model' a str or None, got {j!r}")
        for k in ("prompt_tokens_per_row", "new_tokens_per_row", *(_JUDGE_OPTIONAL & set(j))):
            if not isinstance(j[k], int) or j[k] < (1 if k == "scored_per_prompt" else 0):
                raise ValueError(f"{where}: judge {k!r} must be an int >= {1 if k == 'scored_per_prompt' else 0}, "
                                 f"got {j[k]!r}")
    return got


def _task_entries(cfg: Config, names: list[str], limit: int | None
                  ) -> tuple[dict[str, dict[str, Any]], dict[str, dict[str, Any]]]:
    tasks: dict[str, dict[str, Any]] = {}
    needs: dict[str, dict[str, Any]] = {}
    for t in names:
        tc = getattr(cfg.tasks, t)
        task = get_task(t, tc)  # the protocol and expert of the section (e.g. the judge is expert:<expert>)
        size = task.official_size
        lim = limit if limit is not None else tc.limit
        if size is None and lim is None:
            raise ValueError(f"task {t} declares no official_size: give --limit or tasks.{t}.limit to plan it")
        n = min(lim, size) if lim is not None and size is not None else (lim if lim is not None else size)
        typ = task.typical_tokens
        prompt = typ["prompt"] + (typ.get("per_shot", 0) * getattr(tc, "num_fewshot", 0))
        tasks[t] = {"n_examples": n, "of": size, "max_new_tokens": getattr(tc, "max_new_tokens", 0),
                    "n_samples": getattr(tc, "n_samples", 1), "prompt_tokens_est": prompt,
                    "reference_tokens_est": typ["reference"], "expert": cfg.tasks.expert(t),
                    "protocol": getattr(tc, "protocol", None)}
        per_row_gen = n * tasks[t]["n_samples"] * (prompt + tasks[t]["max_new_tokens"])
        tasks[t]["eval_forward_tokens_per_row"] = per_row_gen + n * (prompt + typ["reference"])
        needs[t] = _checked_plan(t, task.plan(tc, n))
        if "judge" in needs[t]:
            tasks[t]["annotator"] = needs[t]["judge"]["label"]
    return tasks, needs


def calibration_sets(cfg: Config, tasks: dict[str, dict[str, Any]]) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """``(calib, notes)``: per ``<task>/<split>`` of each task with an expert the calibration
    sequences, the held-out ones among them (``held_out``: what the behaviour signals' intervals
    resample) and their tokens (prompt, capped at ``calibration.max_prompt_tokens``, +
    ``calibration.max_new_tokens``; ``train_tokens`` less the held-out share), and per
    ``<task>/reference`` the evaluated examples with their reference answers (never trained on).
    Transductive prompts are the benchmark's first ``n_prompts`` inputs (``transductive_inputs =
    benchmark``: capped by its size) or its evaluated ones (``evaluated``: capped by the limit).
    Notes: where a set is capped, and where fewer than
    :data:`darts_bench.evidence.MIN_SEQUENCES` sequences are held out (intervals are then descriptive)."""
    from darts_bench.evidence import MIN_SEQUENCES, held_out_count

    cal = cfg.calibration
    calib: dict[str, dict[str, Any]] = {}
    notes: list[str] = []
    for t, ti in tasks.items():
        if ti["expert"] is None:
            continue
        for split in cal.splits:
            n = cal.n_prompts
            if split == "transductive":
                avail = ti["n_examples"] if cal.transductive_inputs == "evaluated" else (ti["of"] or ti["n_examples"])
                n = min(cal.n_prompts, avail)
                if cal.n_prompts > avail:
                    notes.append(
                        f"calibration.n_prompts {cal.n_prompts} > {t} evaluated examples {avail}: the transductive "
                        f"calibration set of {t} is its {n} evaluated inputs (raise tasks.{t}.limit or set "
                        "calibration.transductive_inputs=benchmark)" if cal.transductive_inputs == "evaluated" else
                        f"calibration.n_prompts {cal.n_prompts} > {t} benchmark inputs {avail}: the transductive "
                        f"calibration set of {t} is all {n} of them")
            held = held_out_count(n, cal.held_out_fraction) if n >= 2 else 0
            if held < MIN_SEQUENCES:
                notes.append(f"{t}/{split}: {held} held-out calibration sequences < {MIN_SEQUENCES}: its behaviour "
                             "intervals are descriptive, not verdicts (raise calibration.n_prompts or "
                             "calibration.held_out_fraction)")
            p = min(ti["prompt_tokens_est"] if split == "transductive" else TYPICAL_TOKENS["training_prompt"],
                    cal.max_prompt_tokens)
            seq = n * (p + cal.max_new_tokens)
            calib[f"{t}/{split}"] = {"sequences": n, "held_out": held, "tokens": seq,
                                     "train_tokens": round(seq * (1 - cal.held_out_fraction))}
        ref = ti["n_examples"] * (min(ti["prompt_tokens_est"], cal.max_prompt_tokens)
                                  + min(ti["reference_tokens_est"], cal.max_prompt_tokens))
        calib[f"{t}/reference"] = {"sequences": ti["n_examples"], "held_out": ti["n_examples"], "tokens": ref,
                                   "train_tokens": 0}
    return calib, notes


def plan_inputs(cfg: Config, suite: str = "all", limit: int | None = None) -> tuple[PlanInputs, list[str]]:
    """``(inputs, notes)`` for the stage estimates of ``cfg`` run on ``suite`` with ``limit``.

    Raises:
        ValueError: unknown suite, no enabled task in it, a task with neither ``official_size`` nor
            a limit, or a ``Task.plan()`` outside its contract.
    """
    names = resolve_suite(suite, cfg.tasks)
    arch, arch_src = architecture(cfg)
    pc = param_count(arch) if arch else None
    weights = pc["total"] * DTYPE_BYTES[cfg.pool.dtype] if pc else None
    tasks, needs = _task_entries(cfg, names, limit)
    notes: list[str] = []
    specs = row_specs(cfg)  # the one definition of rows
    evaluated = [s for s in specs if row_selected(cfg, s.model)]
    if cfg.evaluate.rows is not None:  # --rows: only the selected rows are evaluated
        notes.append(f"evaluate.rows {cfg.evaluate.rows}: {len(evaluated)} of {len(specs)} "
                     "rows evaluated" + ("" if needs_merges(cfg) else
                                         "; no merge or corrected row, so merge, collect and train are skipped "
                                         "(their lines above do not apply)"))
        keep = needed_merges(cfg, names)  # the run builds only the merges the selected rows need
        if keep and len(keep) < len(cfg.merges):
            cfg = cfg.model_copy(update={"merges": [m for m in cfg.merges if m.name in keep]})
    calib, cal_notes = calibration_sets(cfg, tasks)
    notes += cal_notes
    max_pos = arch.get("max_position_embeddings") if arch else None
    enabled = resolve_suite("all", cfg.tasks)  # as the pipeline: not per suite
    clamp = clamp_warning(cfg, enabled, max_pos)
    if clamp:
        notes.append(f"WARNING: {clamp}")
    use_vllm = "vllm" in (cfg.evaluate.backend, cfg.calibration.backend)
    x = PlanInputs(cfg=cfg, arch=arch, arch_source=arch_src, params=pc["total"] if pc else None,
                   largest_tensor=pc["largest_tensor"] if pc else None, weights=weights, tasks=tasks, needs=needs,
                   head_tasks=[t for t in names if tasks[t]["expert"] is not None], specs=specs, evaluated=evaluated,
                   calib=calib, engine=vllm_engine(cfg, arch, pc["total"]) if use_vllm and arch else None,
                   max_len=resolve_max_len(cfg, enabled, max_pos))
    return x, notes


# ------------------------------------------------------------------------------ helpers
def where_executor(cfg: Config) -> str:
    """Where collect and evaluate run: the Ray actors (count, resources, shard size) or in-process."""
    if cfg.executor == "ray":
        r = cfg.ray
        res = f"CPU {r.num_cpus_per_actor:g}" + (f", GPU {r.num_gpus_per_actor:g}" if r.num_gpus_per_actor else "")
        return (f"Ray ({r.address or 'local instance'}): {r.num_actors} actors x {{{res}}}, "
                f"shards of {r.shard_size} prompts, device {cfg.device}")
    return f"local, in-process (device {cfg.device}, {cfg.torch_threads or 'default'} torch threads)"


def head_params(method: str, d: int, rank: int, max_len: int, overflow: str) -> int:
    """Parameters of one head: ``W_down [r, d]`` + ``W_up [d, r]``, plus for a method with a
    position bias (:data:`POSITION_BIAS`) the table ``b [max_len (+16 overflow buckets), d]``
    (:func:`darts_bench.controls.head_param_count`)."""
    return head_param_count(method, d, rank, max_len if POSITION_BIAS[method] else None, overflow)


def _finish(s: dict[str, Any], kind: str, workers: int = 1) -> dict[str, Any]:
    """Wall time and device-hours of a stage with ``seconds`` (and ``load_seconds`` when it loads
    models): work spread over ``workers``, loads on all of them at once."""
    if "seconds" not in s:
        return s
    if "load_seconds" in s:
        s["wall_seconds"] = s["seconds"] / workers + s["load_seconds"]
        s["seconds"] += s["load_seconds"] * workers
    else:
        s["wall_seconds"] = s["seconds"]
    s["device_hours"] = s["seconds"] * (1 if kind == "cuda" else 2) / 3600  # measured CPU rates are 2-core rates
    return s


def _max_dtype_bytes(x: PlanInputs) -> int:
    """Bytes per element of the widest model dtype (the pool's and the merges')."""
    return max(x.pool_bytes, max([DTYPE_BYTES[m.dtype] for m in x.cfg.merges] or [x.pool_bytes]))


# ------------------------------------------------------------------------------ stages
def pool(x: PlanInputs) -> dict[str, Any]:
    """Building or checking the pool: the tiny tier trains a tokenizer and its models (fp32 weights,
    gradients and Adam state + activations), a GGUF pool dequantizes and fine-tunes, a hub or local
    pool is checked (one model's weights)."""
    cfg, p, E, P = x.cfg, x.cfg.pool, len(x.cfg.pool.expert_names), x.params
    if p.kind == "tiny":
        t = p.tiny
        train_tok = t.pretrain_steps * t.batch_size * t.seq_len + E * t.finetune_steps * t.batch_size * t.seq_len
        what = (f"train a BPE tokenizer (vocab {t.vocab_size}), pretrain a {num(P)}-param Llama "
                f"({t.pretrain_steps} steps of {t.batch_size}x{t.seq_len}), fine-tune {E} experts "
                f"({t.finetune_steps} steps each)")
        mem = P * 16 + activations(x.arch, t.batch_size, t.seq_len, 4) * 3  # fp32 w, grad, Adam m, v
    elif p.kind == "gguf":
        ft = p.finetune
        train_tok = E * ft.steps * ft.batch_size * ft.seq_len
        what = (f"dequantize the base from {p.gguf_file} in the wheel {p.gguf_wheel}, fine-tune {E} experts "
                f"({ft.mode}, {ft.steps} steps of {ft.batch_size}x{ft.seq_len})")
        mem = (P * (16 if ft.mode == "full" else 4) + activations(x.arch, ft.batch_size, ft.seq_len, 4) * 3
               if P else None)
    else:
        train_tok = 0
        srcs = [p.base, *p.experts.values()]
        local = [s for s in srcs if s and Path(s).expanduser().is_dir()]
        what = (f"use base {p.base} and experts " + ", ".join(f"{e}={ref}" for e, ref in p.experts.items())
                + f" ({len(local)} local dirs, {len(srcs) - len(local)} from the hub); check architectures and tokenizers")
        mem = x.weights
    s = {"what": what, "where": "local" + (f" (device {cfg.device})" if train_tok else ""),
         "memory_bytes": None if mem is None else mem + PROCESS_BASELINE["pool"],
         "disk_bytes": (1 + E) * x.weights if x.weights else None, "train_tokens": train_tok,
         "process_baseline_bytes": PROCESS_BASELINE["pool"]}
    if train_tok and P:
        s["seconds"] = train_tok * 6 * P / THROUGHPUT[x.kind]["train"]
    return _finish(s, x.kind)



def _data_merge_prompt_tokens(x: PlanInputs, split: str) -> dict[str, int]:
    """Per task with an expert: the prompt tokens of its ``split`` calibration prompts (no continuation)."""
    cal = x.cfg.calibration
    out = {}
    for t in x.head_tasks:
        ti = x.tasks[t]
        p = min(ti["prompt_tokens_est"] if split == "transductive" else TYPICAL_TOKENS["training_prompt"],
                cal.max_prompt_tokens)
        out[t] = x.calib[f"{t}/{split}"]["sequences"] * p
    return out


def _linear_inputs(arch: dict[str, Any]) -> list[tuple[int, int]]:
    """``(d_in, d_out)`` of every linear layer RegMean solves (:func:`darts_bench.merge.regmean.linear_modules`):
    per decoder layer q, k, v, o, gate, up, down, and an output layer not tied to the input embeddings."""
    h, f, kv = arch["hidden_size"], arch["intermediate_size"], kv_dim(arch)
    layer = [(h, h), (h, kv), (h, kv), (h, h), (h, f), (h, f), (f, h)]
    return layer * arch["num_hidden_layers"] + ([] if arch["tie_word_embeddings"] else [(h, arch["vocab_size"])])


def _gram_inputs(arch: dict[str, Any]) -> list[int]:
    """``d_in`` of every Gram product RegMean computes (:func:`darts_bench.merge.regmean.input_grams`): per
    decoder layer one for the attention input (q, k, v share it), o's, one for the MLP input (gate, up) and
    down's; and an output layer's not tied to the input embeddings."""
    h, f = arch["hidden_size"], arch["intermediate_size"]
    return [h, h, h, f] * arch["num_hidden_layers"] + ([] if arch["tie_word_embeddings"] else [h])


def _svd_matrices(arch: dict[str, Any]) -> list[tuple[int, int]]:
    """``(m, n)`` of every 2-D tensor the SVD merges and SVC decompose (:mod:`darts_bench.merge.svd`): per decoder
    layer q, k, v, o, gate, up, down; the input embedding [V, d]; an untied ``lm_head`` [V, d] (a tied one is the
    embedding)."""
    h, f, kv, V = arch["hidden_size"], arch["intermediate_size"], kv_dim(arch), arch["vocab_size"]
    layer = [(h, h), (kv, h), (kv, h), (h, h), (f, h), (f, h), (h, f)]
    return layer * arch["num_hidden_layers"] + [(V, h)] + ([] if arch["tie_word_embeddings"] else [(V, h)])


#: SVDs per 2-D matrix (each of the matrix's size; the whitening SVDs of the stacked [m, r] / [r, n] factors
#: count as one each), from the code (darts_bench/merge/svd.py): TSV-M one per task vector + 2 whitenings;
#: Iso-C one of the sum; Iso-CTS the sum's, one per task residual, 2 whitenings; SVC one of the merge's task vector
def svd_count(method: str, K: int) -> int:
    """SVDs per 2-D matrix of an SVD merge (``tsv_m``: K + 2, ``iso_c``: 1, ``iso_cts``: K + 3) or of SVC (``svc``: 1)."""
    return {"tsv_m": K + 2, "iso_c": 1, "iso_cts": K + 3, "svc": 1}[method]


def _svd_merge(x: PlanInputs, m) -> dict[str, Any]:
    """One SVD merge or merge with SVC: ``{"what", "seconds"}``; ``seconds`` =
    ``n_svd * sum over 2-D matrices of m * n * min(m, n) / THROUGHPUT[kind]["svd"]`` (:func:`svd_count`; the GEMMs
    around the SVDs, SVC's K projections and reading / writing the checkpoints are not counted; the mergekit merge
    under an SVC is not timed, as mergekit merges are not), None when the architecture is unknown."""
    K = len(x.cfg.pool.expert_names)
    n = (svd_count(m.method, K) if m.method in SVD_MERGE_METHODS else 0) + \
        (svd_count("svc", K) if m.svc_alpha is not None else 0)
    mats = _svd_matrices(x.arch) if x.arch else None
    mnr = sum(a * b * min(a, b) for a, b in mats) if mats else None
    what = (f"{m.name}: {m.method}" + (" + SVC" if m.svc_alpha is not None else "")
            + f", {n} SVD(s) per 2-D matrix ({len(mats) if mats else '?'} matrices)")
    return {"what": what, "seconds": None if mnr is None else n * mnr / THROUGHPUT[x.kind]["svd"]}


def _data_merge(x: PlanInputs, m) -> dict[str, Any]:
    """One data merge (AdaMerging, RegMean or Expert Merging, on the ``m.calibration_split`` prompts of the tasks
    with an expert): ``{"what", "seconds", "memory_bytes", "flops"}``; ``seconds`` (device seconds) is None when
    the architecture is unknown. What it counts, each at its :data:`THROUGHPUT` rate:

    * AdaMerging (:func:`darts_bench.merge.adamerging.build_adamerging`): ``steps`` Adam steps, each a
      forward + backward of the merged model over one batch of ``batch_size`` prompts (6 P FLOPs per
      token at ``train``) and the lambda-weighted recombination of the K task vectors with its backward
      (K x P elements at ``recombine``, x :data:`RECOMBINE_BACKWARD`); then the entropy before and after,
      each a pass over every prompt batch (a forward per batch, 2 P FLOPs per token at ``forward``) with
      one recombination (no backward), and the final merged weights' recombination.
    * RegMean (:func:`darts_bench.merge.regmean.build_regmean`): each expert's forward over its own
      task's prompts (2 P FLOPs per token), and in fp64 (``fp64``): the Gram products of the linear
      layers' distinct inputs (2 d_in^2 FLOPs per token and input: q / k / v share one, gate / up one;
      :func:`_gram_inputs`), each expert's ``G W^T`` (2 d_in^2 d_out per layer), and per layer one LU
      solve (2/3 d_in^3 + 2 d_in^2 d_out).
    * Expert Merging (:func:`darts_bench.merge.expert_merging.build_expert_merging`): the experts' greedy
      continuations of the ``steps * batch_size`` prompts used (``calibration.max_new_tokens`` each, at
      ``decode``), then ``steps`` AdamW steps, each a forward + backward of the merge over its sequences (6 P
      per token at ``train``), each sequence's expert forward (2 P per token at ``forward``) and the
      recombination of the K task vectors with its backward (``recombine``); memory: base, K experts, K task
      vectors, merged tensors and their gradients, and the logits' activations.
    * all: reading the base and the K experts in float32 and writing the merged checkpoint in
      ``m.dtype`` at :data:`LOAD_BYTES_PER_S`.

    ``flops`` is the model FLOPs (forwards, backwards and fp64 work; the recombination is elements, not
    counted there). Token counts are the plan's typical prompt lengths (:func:`_data_merge_prompt_tokens`).
    """
    P, arch, kind = x.params, x.arch, x.kind
    t = THROUGHPUT[kind]
    K = len(x.cfg.pool.expert_names)
    toks = _data_merge_prompt_tokens(x, m.calibration_split)
    total = sum(toks.values())
    n_prompts = sum(x.calib[f"{t_}/{m.calibration_split}"]["sequences"] for t_ in x.head_tasks) or 1
    io_s = ((1 + K) * P * 4 + P * DTYPE_BYTES[m.dtype]) / LOAD_BYTES_PER_S if P else None
    if m.method == "expert_merging":
        n_seq = m.steps * m.batch_size  # sequences used: prompts + their expert's greedy continuation
        new_tok = n_seq * x.cfg.calibration.max_new_tokens
        seq_tok = n_seq * total / n_prompts + new_tok
        step_tok = seq_tok / m.steps
        # per step: the merge's forward + backward (6 P per token) and each sequence's expert forward (2 P), and
        # the recombination of K task vectors with its backward; first the experts' greedy continuations
        flops = (seq_tok * (6 + 2) + new_tok * 2) * P if P else None
        what = (f"{m.name}: Expert Merging, {m.steps} AdamW steps of {m.batch_size} sequences (~{num(step_tok)} tokens: "
                f"{m.calibration_split} prompt + its expert's greedy continuation of {x.cfg.calibration.max_new_tokens} "
                f"tokens), each a forward + backward of the merge, the experts' forwards (logits and middle-layer "
                f"hidden states) and the recombination of {K} task vectors; {num(new_tok)} generated tokens first")
        secs = None if not P else (seq_tok * 6 * P / t["train"] + seq_tok * 2 * P / t["forward"]
                                   + new_tok * 2 * P / t["decode"]
                                   + m.steps * (1 + RECOMBINE_BACKWARD) * K * P / t["recombine"] + io_s)
        seq_len = x.cfg.calibration.max_prompt_tokens + x.cfg.calibration.max_new_tokens
        mem = (2 * K + 4) * P * 4 + activations(arch, m.batch_size, seq_len, 4) * 4 if P and arch else None
    elif m.method == "adamerging":
        step_tok = min(m.batch_size, n_prompts) * total / n_prompts
        n_batches = math.ceil(n_prompts / m.batch_size)
        recombinations = 3 + m.steps * RECOMBINE_BACKWARD  # in no-grad recombinations
        flops = (m.steps * step_tok * 6 + 2 * total * 2) * P if P else None
        what = (f"{m.name}: AdaMerging, {m.steps} Adam steps of {m.batch_size} prompts (~{num(step_tok)} tokens, "
                f"forward + backward, and the recombination of {K} task vectors) on the entropy of {num(total)} "
                f"{m.calibration_split} prompt tokens; the entropy before and after over its {n_batches} batches")
        secs = None if not P else (m.steps * step_tok * 6 * P / t["train"] + 2 * total * 2 * P / t["forward"]
                                   + recombinations * K * P / t["recombine"] + io_s)
        mem = (K + 4) * P * 4 + activations(arch, m.batch_size, x.cfg.calibration.max_prompt_tokens, 4) * 3 \
            if P and arch else None
    else:
        lin = _linear_inputs(arch) if arch else []
        gram_flops_tok = sum(2 * i * i for i in _gram_inputs(arch)) if arch else 0
        gw = sum(2 * i * i * o for i, o in lin)  # one expert's G W^T (and the solve's substitutions)
        lu = sum(2 * i ** 3 / 3 for i, _ in lin)
        fp64 = total * gram_flops_tok + (K + 1) * gw + lu
        flops = total * 2 * P + fp64 if P and arch else None
        secs = None if flops is None else total * 2 * P / t["forward"] + fp64 / t["fp64"] + io_s
        what = (f"{m.name}: RegMean (alpha {m.alpha}), each expert's forward over its own task's "
                f"{m.calibration_split} prompts ({num(total)} tokens in all), Gram matrices of every linear layer's "
                "inputs (fp64), one solve per layer")
        h, f, L = (arch["hidden_size"], arch["intermediate_size"], arch["num_hidden_layers"]) if arch else (0, 0, 0)
        mem = (P * 4 * 2 + 2 * L * (6 * h * h + f * f) * 8 + 2 * L * (4 * h * h + 3 * h * f) * 8) if P and arch else None
    return {"what": what, "seconds": secs, "memory_bytes": mem, "flops": flops}


def _merge_disk_bytes(x: PlanInputs, m) -> float:
    """Disk of one merge: a checkpoint in its dtype; a task-aware merge (EMR) K float32 checkpoints (one per
    expert) and its record (the unified vector in float32, K bit-packed masks)."""
    if not m.task_aware:
        return x.params * DTYPE_BYTES[m.dtype]
    K = len(x.cfg.pool.expert_names)
    return K * x.params * 4 + x.params * 4 + K * x.params / 8


def _task_aware_merge(x: PlanInputs, m) -> dict[str, Any]:
    """EMR-Merging (:func:`darts_bench.merge.emr.build_emr`): read the base and K experts (float32), elect,
    mask and rescale (a few elementwise passes over K x P entries, at ``recombine``), write the record and K
    checkpoints (:func:`_merge_disk_bytes`). Memory: base, K task vectors, the unified vector, a model, and K
    bool masks (one byte per entry). ``{"what", "seconds", "memory_bytes", "flops"}``."""
    P, K = x.params, len(x.cfg.pool.expert_names)
    what = (f"{m.name}: EMR-Merging (elect, mask, rescale) of {K} experts; {K} per-task checkpoints written "
            "(the rows run each task on its own)")
    if not P:
        return {"what": what, "seconds": None, "memory_bytes": None, "flops": None}
    io_s = ((1 + K) * P * 4 + _merge_disk_bytes(x, m)) / LOAD_BYTES_PER_S
    secs = 6 * K * P / THROUGHPUT[x.kind]["recombine"] + io_s
    return {"what": what, "seconds": secs, "memory_bytes": (K + 3) * P * 4 + K * P, "flops": 0}


def merge(x: PlanInputs) -> dict[str, Any]:
    """The mergekit merges, tensor by tensor (inputs streamed: ``run_one_merge``): peak memory is
    the output shard mergekit's writer holds (``darts_bench.config.out_shard_bytes`` of the merge: an eighth of it, 64 MiB to 5e9 bytes)
    plus base + experts + output of the largest tensor in fp32 (+ its copy in the pool dtype); disk
    one checkpoint per merge in its dtype. The data merges (AdaMerging, RegMean) add their peak (all
    experts' task vectors and the graph for AdaMerging; the fp64 Gram sums for RegMean) and their time:
    ``seconds`` (device seconds) and ``data_merge_seconds`` (per data merge) are what :func:`_data_merge`
    counts (AdaMerging's steps, recombinations and entropy passes; RegMean's forwards and fp64 work;
    their loads), ``data_merge_flops`` their model FLOPs. The SVD merges and SVC add ``svd_merge_seconds``
    (:func:`_svd_merge`: SVDs per 2-D matrix x sum of m n min(m, n) at the ``svd`` rate) to ``seconds``. The
    mergekit merges are not timed (seconds of streamed tensor arithmetic; a stage of them alone has no ``seconds``)."""
    cfg, lt = x.cfg, x.largest_tensor
    mk = [m for m in cfg.merges if not m.uses_data and not m.task_aware and m.method not in SVD_MERGE_METHODS]
    data = [_data_merge(x, m) for m in cfg.merges if m.uses_data] + [_task_aware_merge(x, m) for m in cfg.merges
                                                                     if m.task_aware]
    svd = [_svd_merge(x, m) for m in cfg.merges if m.uses_svd]
    merged = [x.params * DTYPE_BYTES[m.dtype] for m in mk] if x.params else []
    shard = max((min(b, out_shard_bytes(b)) for b in merged), default=0)
    peak = ((len(cfg.pool.expert_names) + 2) * lt * 4 + x.pool_bytes * lt + shard) if lt else None
    what = [f"{len(mk)} mergekit merges: " + ", ".join(f"{m.name} ({m.method}, {m.dtype})" for m in mk)] if mk else []
    s = {"what": "; ".join(what + [d["what"] for d in data] + [d["what"] for d in svd]),
         "where": "local, mergekit (tensor by tensor, inputs streamed)"
                  + ("; data merges on device " + cfg.device if data else ""),
         "memory_bytes": None if peak is None else peak + PROCESS_BASELINE["merge"],
         "memory_note": (f"peak: one output shard {gb(shard)} + base + experts + output of the largest tensor "
                         "in fp32"),
         "disk_bytes": sum(_merge_disk_bytes(x, m) for m in cfg.merges) if x.params else None,
         "process_baseline_bytes": PROCESS_BASELINE["merge"]}
    if svd and all(d["seconds"] is not None for d in svd):
        names = [m.name for m in cfg.merges if m.uses_svd]
        s["svd_merge_seconds"] = {n: d["seconds"] for n, d in zip(names, svd)}
        if not data:
            s["seconds"] = sum(s["svd_merge_seconds"].values())
            return _finish(s, x.kind)
    if data:
        mems = [d["memory_bytes"] for d in data]
        if s["memory_bytes"] is not None and all(v is not None for v in mems):
            s["memory_bytes"] = max(s["memory_bytes"], max(mems) + PROCESS_BASELINE["merge"])
            s["memory_note"] += "; the data merges: experts' task vectors + merged graph (AdaMerging), fp64 Grams (RegMean)"
        if all(d["seconds"] is not None for d in data):
            names = [m.name for m in cfg.merges if m.uses_data] + [m.name for m in cfg.merges if m.task_aware]
            s["data_merge_seconds"] = {n: d["seconds"] for n, d in zip(names, data)}
            s["data_merge_flops"] = {n: d["flops"] for n, d in zip(names, data)}
            s["seconds"] = sum(d["seconds"] for d in data) + sum(s.get("svd_merge_seconds", {}).values())
            return _finish(s, x.kind)
    return s


def collect(x: PlanInputs) -> dict[str, Any]:
    """Calibration: each task expert's greedy continuations (HF, or a vLLM engine beside the HF
    model with ``calibration.backend: vllm``: in the driver, or with Ray one engine per actor of the
    expert's engine group, beside its HF group), then the final hidden states of the expert and every
    merge, stored in ``pool.dtype``, with the expert's next-token entropies (the ``logits`` rate) and the
    merges' only when a surgery variant reads them (:func:`~darts_bench.rows.merged_entropy_needed`;
    else the ``forward`` rate). One load per task expert and per merge
    (model-major, the latest model kept loaded; with Ray one actor group each).

    A task-aware merge (EMR, :func:`darts_bench.stages.collect.collect_task_aware`) has no merged model: each task's
    checkpoint on its task's sets (the oracle row's evidence: the tokens of every set once, K loads); the routed
    row's other checkpoints on a task's split only where the router sends a prompt there (not counted: up to
    K - 1 times each split's tokens, none when every prompt is routed to its own task)."""
    cfg, cal, W, P, kind = x.cfg, x.cfg.calibration, x.weights, x.params, x.kind
    M, T = sum(not m.task_aware for m in cfg.merges), len(x.head_tasks)
    A = sum(m.task_aware for m in cfg.merges)  # EMR: its task checkpoints' features, no merged model
    seq_tokens = sum(c["tokens"] for c in x.calib.values())  # tokens per feature set (one forward each)
    feature_forward_tokens = seq_tokens * (1 + M + A)  # expert once, every merge once, each EMR task model its sets
    d = x.arch["hidden_size"] if x.arch else None
    calib = {k: {**c, "disk_bytes_per_merge": c["tokens"] * d * x.pool_bytes * 2 if d else None}  # expert + merged h
             for k, c in x.calib.items()}
    cal_seq = cal.max_prompt_tokens + cal.max_new_tokens
    act = activations(x.arch, cal.batch_size, cal_seq, _max_dtype_bytes(x)) if x.arch else None
    kv = kv_cache(x.arch, cal.batch_size, cal_seq, x.pool_bytes) if x.arch else None
    s: dict[str, Any] = {
        "what": (f"{T} tasks x {len(cal.splits)} splits ({', '.join(cal.splits)}) + reference answers: "
                 f"expert greedy continuations ({cal.max_new_tokens} new tokens), then final hidden states of the "
                 f"expert (and its entropies) and of {M} merges"
                 + (" (and theirs: surgery.entropy_source merged)" if merged_entropy_needed(cfg) else "")
                 + (f"; {A} task-aware merge(s) (EMR): each task's checkpoint on its task's sets (+ the routed "
                    "row's other checkpoints where its router sends a prompt, not counted)" if A else "")),
        "where": where_executor(cfg),
        "memory_bytes": None,
        "memory_note": (f"per worker: weights {gb(W)} + activations {gb(act)} "
                        f"(batch {cal.batch_size} x {cal_seq} tokens, logits dominate) + KV cache {gb(kv)}"),
        "disk_bytes": seq_tokens * d * x.pool_bytes * (1 + M + A) if d else None,  # expert features shared by merges
        "calibration": calib,
        "generation_tokens": sum(c["tokens"] for c in x.splits.values()),
        "feature_forward_tokens": feature_forward_tokens,
        "model_loads": T + M + A * T,
        "process_baseline_bytes": PROCESS_BASELINE["collect"]}
    if x.arch is None:
        return s
    L = x.arch["num_hidden_layers"]
    if kind == "cuda":
        s["gpu_bytes"] = W + (act + kv)
        s["memory_bytes"] = PROCESS_BASELINE["collect"] + W  # weights pass through host memory on load
    else:
        s["memory_bytes"] = PROCESS_BASELINE["collect"] + W + (act + kv)
    gen = s["generation_tokens"]  # prompt + new tokens
    new = sum(c["sequences"] * cal.max_new_tokens for c in x.splits.values())
    s["load_seconds"] = s["model_loads"] * x.checkpoint_load_seconds
    if cal.backend == "vllm":  # the experts' continuations from a vLLM engine beside the HF model (per worker)
        e = x.engine
        gen_s = vllm_generation_seconds(gen - new, new, P, kind, cfg, e)
        s["memory_bytes"] += e["ram"]
        if e["gpu"] is not None:
            s["gpu_bytes"] = s.get("gpu_bytes", 0) + e["gpu"]
        s["memory_note"] += f"; calibration generation: {e['note']}"
        s["vllm_engine"] = e
        # one per task expert (model-major collection); with Ray a group of x.workers engines, held across
        # the expert's sets (restarted per set when the instance cannot hold it beside the HF group); in-process
        # with reload_weights one engine, given each next expert's weights in place
        if plans_reloads(cfg):
            s["engine_starts"], s["engine_reloads"] = min(T, 1), max(T - 1, 0)
        else:
            s["engine_starts"], s["engine_reloads"] = T * (x.workers if cfg.executor == "ray" else 1), 0
        s["load_seconds"] += s["engine_starts"] * e["start_s"] + s["engine_reloads"] * e["reload_s"]
    else:
        gen_s = forward_seconds(gen - new, P, kind) + decode_seconds(new, P, kind, cal.batch_size, W, L)
    # the features: hidden states and the full-vocabulary entropy at every position; a merge's without the entropy
    # (the lm_head and softmax skipped) unless a surgery variant reads it (entropy_source: merged)
    merged_rate = "logits" if merged_entropy_needed(cfg) else "forward"
    s["seconds"] = (gen_s + forward_seconds(seq_tokens, P, kind, rate="logits")
                    + forward_seconds(seq_tokens * (M + A), P, kind, rate=merged_rate))
    return _finish(s, kind, x.workers)


def diagnostics_call(factored: int, full: int, first: bool = True) -> tuple[int, int, int]:
    """``(matmuls, passes, factored heads)`` per token of one :meth:`~darts_bench.surgery.diagnostics.Diagnostics.many`
    call scoring ``factored`` heads whose logits come from the plain merge's (:class:`~darts_bench.surgery.
    diagnostics.HeadLogits`: ``2 r V`` FLOPs each) and ``full`` heads with an lm_head matmul each (besides the
    plain row): the expert's logits (one matmul, one pass); on the ``first`` call over a token stream the plain
    merge's row and the KL floor (two matmuls, two passes; the plain logits are the factored heads' base too),
    on a later one the plain logits only when factored heads need them; each head one pass. Used by
    :func:`diagnostics_work` and ``scripts/fit_train_rates.py``."""
    mm = 1 + (2 if first else int(factored > 0)) + full
    return mm, 1 + (2 if first else 0) + factored + full, factored


def diagnostics_work(x: PlanInputs) -> dict[str, Any]:
    """The train stage's diagnostics: lm_head matmuls (``[d] x [d, V]`` per token, 2 d V FLOPs, at
    ``THROUGHPUT[kind]["vocab"]``) and passes over the vocabulary (the expert's log-softmax, each scored
    row's log-softmax, KL and argmax: V elements per token, at ``THROUGHPUT[kind]["vocab_pass"]``).

    :func:`darts_bench.stages.train.diagnose_streams` runs, per (merge, task, split), one
    :func:`~darts_bench.stages.train.diagnose_seeds` call: a pass
    (:meth:`darts_bench.surgery.diagnostics.Diagnostics.many`) over each head seed's held-out tokens with every
    row of every sweep variant (the methods' heads, the matched controls' and, with ``surgery.task_agnostic``,
    each kind's (``routed``, ``shared``) heads), and one over its task's reference-answer tokens with the rows of
    every seed. Per token: the expert's logits, the plain merge's row and the KL floor (three matmuls,
    three passes) and each head's row (one pass; one matmul unless its logits are factored,
    :func:`darts_bench.controls.factored_logits_pay`: the methods' heads at rank below ``d / 4``, and the routed
    and shared heads of them; a factored head adds ``2 r V`` FLOPs; the matched controls are never factored).
    With ``surgery.entropy_source: kl`` the pass adds two matmuls per token of its split (per seed) and of its
    references (once: the KL weight source). Held-out tokens are ``calibration.held_out_fraction`` of a set's
    tokens, reference tokens ``n_examples x reference_tokens_est`` of the task.

    A task-aware merge (EMR, :func:`darts_bench.stages.train.task_aware_runs`) adds per (task, split, seed) one
    pass of its task checkpoint's plain row over the held-out and reference tokens (three matmuls and passes per
    token, no head); the routed row's other checkpoints' held-out passes are not counted (router-dependent).

    Returns ``{"diagnostics_tokens"`` (tokens scored, summed over the passes), ``"diagnostics_matmuls"`` (token x
    matmul products), ``"diagnostics_flops"`` (FLOPs: 2 d V per token and matmul, plus the factored heads'
    2 r V), ``"diagnostics_passes"`` (token x pass products)``}``; zeros without an architecture or heads.
    """
    from darts_bench.controls import factored_logits_pay

    cfg, cal, scfg = x.cfg, x.cfg.calibration, x.cfg.surgery
    M, seeds, n_var = sum(not m.task_aware for m in cfg.merges), len(head_seeds(cfg)), len(surgery_variants(cfg))
    d = x.arch["hidden_size"] if x.arch else 0
    n_meth = len(scfg.methods)
    kinds = sum(k in scfg.task_agnostic for k in ("routed", "shared"))
    fac = bool(d) and factored_logits_pay(scfg.rank, d)
    low_rank = n_var * n_meth * (1 + kinds)  # the methods' heads and the task-agnostic rows' heads made of them
    fac_n, full_n = low_rank if fac else 0, (0 if fac else low_rank) + n_var * len(scfg.controls)
    held_call = diagnostics_call(fac_n, full_n)  # per seed over its held-out tokens
    ref_call = diagnostics_call(seeds * fac_n, seeds * full_n)  # once over the references, every seed's rows
    tokens = matmuls = passes = fac_heads = 0
    for key, c in x.splits.items():
        task = key.split("/", 1)[0]
        ti = x.tasks[task]
        held, ref = round(c["tokens"] * cal.held_out_fraction), ti["n_examples"] * ti["reference_tokens_est"]
        tokens += M * (seeds * held + ref)
        for n_tok, (mm, ps, fh) in ((seeds * held, held_call), (ref, ref_call)):
            matmuls += M * n_tok * mm
            passes += M * n_tok * ps
            fac_heads += M * n_tok * fh
        if scfg.entropy_source == "kl":  # each seed loads its split, the references are streamed once, with KL weights
            matmuls += M * 2 * (seeds * c["tokens"] + ref)
        A = sum(m.task_aware for m in cfg.merges)  # EMR: a plain-row pass per seed over held-out and reference tokens
        if A:
            mm, ps, _ = diagnostics_call(0, 0)
            tokens += A * seeds * (held + ref)
            matmuls += A * seeds * (held + ref) * mm
            passes += A * seeds * (held + ref) * ps
    V = x.arch["vocab_size"] if x.arch else 0
    flops = (matmuls * 2 * d + fac_heads * 2 * scfg.rank) * V
    return {"diagnostics_tokens": tokens, "diagnostics_matmuls": matmuls, "diagnostics_flops": flops,
            "diagnostics_passes": passes}


def train(x: PlanInputs) -> dict[str, Any]:
    """Head training on the cached features and the diagnostics: one head per (merge, task with an
    expert, split, method, sweep variant, head seed). Memory is the driver's: the lm_heads, the
    largest split's buffers, the held-out copy, a reference shard, the diagnostics' logits (on the
    GPU on ``cuda``), the head with its Adam state and, with DeepSpeed, the split's float32 copy.

    Time (device seconds, ``seconds`` = ``diagnostics_seconds`` + ``head_seconds``): the diagnostics'
    lm_head matmuls and passes over the vocabulary (:func:`diagnostics_work`: ``diagnostics_flops`` FLOPs at
    ``THROUGHPUT[kind]["vocab"]``, ``diagnostics_passes`` x V elements at ``THROUGHPUT[kind]["vocab_pass"]``)
    and the heads' training: ``head_flops`` (6 x 2 d r FLOPs
    per trained token, the matched controls at their rank) at the ``train`` rate plus ``head_step_s`` per
    optimiser step (``steps``, the shared heads' included). The routers' fits (one least-squares-sized fit
    per (merge, split, seed), under a second each) are not counted."""
    cfg, cal, scfg, ds, kind = x.cfg, x.cfg.calibration, x.cfg.surgery, x.cfg.deepspeed, x.kind
    M, n_tasks, n_splits = sum(not m.task_aware for m in cfg.merges), len(x.head_tasks), len(cal.splits)
    runs = len(head_seeds(cfg)) * len(surgery_variants(cfg))  # heads per (merge, task, split, method)
    d = x.arch["hidden_size"] if x.arch else None
    hp = {m: head_params(m, d, scfg.rank, x.max_len, scfg.overflow) for m in scfg.methods} if d else {}
    # matched controls (darts_bench/controls.py): one more Surgery head per variant and control
    n_heads = len(scfg.methods) + len(scfg.controls)  # heads per (merge, task, split, variant, seed)
    rank_c = param_matched_rank(d, scfg.rank, x.max_len, scfg.overflow) if d and scfg.controls else None
    if rank_c:
        hp.update({f"{CONTROL_METHOD}[{c}]": head_params(CONTROL_METHOD, d, rank_c, x.max_len, scfg.overflow)
                   for c in scfg.controls})
    max_hp = max(hp.values(), default=0)
    nprocs = ds.num_procs if ds.enabled else 1
    # fp32 Adam (m, v) per proc; ZeRO 1 and above shard the optimizer state
    opt_b = max_hp * 8 / (nprocs if ds.enabled and ds.zero_stage >= 1 else 1)
    steps = sum(scfg.epochs * math.ceil(max(c["train_tokens"], 1) / scfg.batch_size)
                for c in x.splits.values()) * M * n_heads * runs
    # task-agnostic rows (darts_bench/surgery/routing.py): per (merge, split, variant, seed) one shared head per
    # method on the union of the tasks' training tokens; a router per (merge, split, seed) (a least-squares-sized
    # fit on one pooled vector per prompt: no steps counted)
    shared = "shared" in scfg.task_agnostic
    n_shared = M * n_splits * len(scfg.methods) * runs if shared else 0
    shared_steps = sum(scfg.epochs * math.ceil(max(sum(c["train_tokens"] for k, c in x.splits.items()
                                                       if k.endswith(f"/{sp}")), 1) / scfg.batch_size)
                       for sp in cal.splits) * M * len(scfg.methods) * runs if shared else 0
    steps += shared_steps
    diag = diagnostics_work(x)
    if ds.enabled:
        where = (f"DeepSpeed, {ds.num_procs} procs via {ds.launcher}, ZeRO stage {ds.zero_stage}, "
                 f"{'nccl' if cfg.device.startswith('cuda') else 'gloo'}; micro batch "
                 f"{max(1, scfg.batch_size // ds.num_procs)} tokens per proc")
    else:
        where = "local, in-process (torch Adam on cached features)"
    s: dict[str, Any] = {
        "what": (f"{M * n_tasks * n_splits * n_heads * runs} heads ({M} merges x {n_tasks} tasks x "
                 f"{n_splits} splits x methods {', '.join(scfg.methods)}"
                 + (f" + controls {', '.join(scfg.controls)}" if scfg.controls else "")
                 + (f" x {runs} seeds/sweep variants" if runs > 1 else "")
                 + (f"; + {n_shared} shared heads on the union of the tasks' calibration sets" if shared else "")
                 + (f"; + {M * n_splits * len(head_seeds(cfg))} routers" if "routed" in scfg.task_agnostic else "")
                 + f"), rank {scfg.rank}" + (f" (matched Surgery: rank {rank_c})" if rank_c else "")
                 + f", position table {x.max_len} rows, {scfg.epochs} epochs of "
                 f"{scfg.batch_size}-token batches ({steps} steps in all); diagnostics: every scored row's lm_head and KL "
                 f"over the vocabulary, {num(diag['diagnostics_tokens'])} held-out and reference-answer tokens "
                 "over all calls"),
        "where": where,
        "head_params": hp,
        "params_overhead": {m: p / x.params for m, p in hp.items()} if x.params else {},
        "optimizer_state_bytes_per_proc": opt_b,
        "head_train_tokens": steps * scfg.batch_size,
        "disk_bytes": ((M * n_tasks * n_splits * sum(hp.values()) * 4 * runs)
                       + n_shared // max(len(scfg.methods), 1) * sum(hp.get(m, 0) for m in scfg.methods) * 4) if d else None,
        "shared_heads": n_shared,
        "memory_bytes": None,
        "steps": steps,
        "process_baseline_bytes": PROCESS_BASELINE["train"]}
    if x.arch is None:
        return s
    V = x.arch["vocab_size"]
    feat_b = x.pool_bytes  # features are stored in the dtype the workers load every model in (pool.dtype)
    n_split = max((c["tokens"] for c in x.splits.values()), default=0)
    n_val = round(n_split * cal.held_out_fraction)
    ref_seq_tokens = max((ti["prompt_tokens_est"] + ti["reference_tokens_est"] for ti in x.tasks.values()),
                         default=0)
    ref_shard = cfg.ray.shard_size * min(ref_seq_tokens, 2 * cal.max_prompt_tokens)
    lm_heads = 2 * V * d * 4
    buffers = 2 * n_split * (d * feat_b + FEATURE_COLUMNS_BYTES)
    val_copy = 2 * n_val * d * 4
    ref_b = 2 * ref_shard * (d * feat_b + FEATURE_COLUMNS_BYTES) + 2 * min(ref_shard, DIAG_BATCH) * d * 4
    diag_tmp = DIAG_TEMPS * min(DIAG_BATCH, max(n_val, ref_shard)) * V * 4
    kl_tmp = DIAG_TEMPS * 4096 * V * 4 if scfg.entropy_source == "kl" else 0
    head_b = 16 * max_hp  # fp32 head, gradient, Adam m and v
    ds_copy = 2 * round(n_split * (1 - cal.held_out_fraction)) * d * 4 + val_copy if ds.enabled else 0
    host = PROCESS_BASELINE["train"] + lm_heads + buffers + val_copy + ref_b + head_b + ds_copy + kl_tmp
    if kind == "cuda":
        s["gpu_bytes"] = lm_heads + diag_tmp + head_b
    else:
        host += diag_tmp
    s["memory_bytes"] = host
    s["memory_note"] = (f"driver: lm_heads {gb(lm_heads)} + split buffers {gb(buffers)} ({n_split} tokens, "
                        f"{cfg.pool.dtype}) + held-out float32 copy {gb(val_copy)} + reference shard "
                        f"{gb(ref_b)} + diagnostics logits {gb(diag_tmp)}{' (GPU)' if kind == 'cuda' else ''}"
                        + (f" + DeepSpeed float32 copy {gb(ds_copy)}" if ds_copy else "")
                        + f" + head/Adam {gb(head_b)} + process {gb(PROCESS_BASELINE['train'])}")
    s.update(diag)
    head_flops = s["head_train_tokens"] * 6 * 2 * d * scfg.rank
    if rank_c:  # the matched heads' share of the steps runs at their rank
        head_flops += s["head_train_tokens"] * len(scfg.controls) / n_heads * 6 * 2 * d * (rank_c - scfg.rank)
    t = THROUGHPUT[kind]
    s["head_flops"] = head_flops
    s["diagnostics_seconds"] = diag["diagnostics_flops"] / t["vocab"] + diag["diagnostics_passes"] * V / t["vocab_pass"]
    s["head_seconds"] = head_flops / t["train"] + steps * t["head_step_s"]
    s["seconds"] = s["diagnostics_seconds"] + s["head_seconds"]
    return _finish(s, kind)


def one_pass_layout(cfg) -> str | None:
    """How the evaluate stage serves the rows of one model dir (a merge and its corrected rows):
    ``"hf"`` or ``"vllm"`` with ``evaluate.one_pass``, the backend's native multi-head model
    (``HFMultiHeadModel``: the heads chosen per sequence in one batched ``generate``, one transformer
    forward for every head's teacher-forced scores; ``VLLMMultiHeadModel``: each request names its
    head, one ``generate`` call for all rows), in-process or on each Ray actor of the model dir's
    group (``RayMultiHeadModel``: every head's chunk of the actor's share in one call), so a model
    dir costs one engine pass per task; None: row by row, one pass per (row, task)
    (``evaluate.one_pass: false``)."""
    if not cfg.evaluate.one_pass:
        return None
    return cfg.evaluate.backend


def one_pass_batch(cfg, rows: int) -> int:
    """Sequences per HF one-pass ``generate`` for a model dir with ``rows`` rows: a chunk of
    ``tasks.batch_size`` prompts per row, stacked, at most ``evaluate.one_pass_max_batch`` (at least
    one chunk)."""
    bs, cap = cfg.tasks.batch_size, cfg.evaluate.one_pass_max_batch
    return bs * rows if cap is None else max(bs, min(bs * rows, cap // bs * bs))


def one_pass_native(cfg) -> bool:
    """Whether :func:`one_pass_layout` serves a model dir's rows in one engine pass per task."""
    return one_pass_layout(cfg) is not None


def evaluate(x: PlanInputs) -> dict[str, Any]:
    """Every evaluated row on every task (a task-aware (EMR) row row by row on its K per-task checkpoints: K loads,
    K + 1 models held at once, pinned, for a routed one): generation (HF, or one vLLM engine per evaluation
    process / Ray actor), the reference-answer NLL, and each task's judge (``Task.plan()``). A
    local judge is held beside the row's model in-process (Ray gives it its own actors); one load
    (or engine start) per model dir in row order, the judges' kept.

    ``engine_passes`` counts (model dir, task) passes when :func:`one_pass_layout` is native, else
    (row, task) passes; ``engine_passes_per_merge`` those of one merge's rows. HF one pass: a merge's
    rows share one batched ``generate`` per task, greedy decoding at ``batch_size`` x its rows
    sequences a step, and one transformer forward over the reference answers with each further head
    costing only its logits (a low-rank head's in factored form from the plain ``lm_head``'s: a rank-``r``
    product and its log-softmax; counted as free); sampled generation still runs per row. vLLM one pass: one
    ``generate`` call per (model dir, task) whose requests name their heads, so decoding fills
    ``max_num_seqs`` from all rows' requests; the reference NLL still runs the transformer per row
    (``prompt_logprobs`` requests recompute their prompts, with the full-vocabulary logits at every
    position: the ``logits`` rate), unless ``evaluate.vllm.scoring`` is ``hf`` (every score from an HF copy
    beside each engine: the HF one pass's scores, one forward per model dir, a further head its
    logits, the ``forward`` rate; the copy's weights and load counted per engine) or ``heads`` (a merge's
    rows' scores from the copy, its plain row's too: one forward per merge, each further row its logits; the
    base, the experts and a judge that is no merge on the engine; the copy counted once, beside the rows' engine;
    a merge as the judge scores on a copy: its own in-process on the CPU, else its engine's) or ``shared``
    (as ``heads``, and a judge's scored sequences on a copy beside its engine, the ``forward`` rate, each prompt
    forwarded once for its ``scored_per_prompt`` verdicts; the hf backend's judges likewise with
    ``evaluate.share_prefix``). In-process
    on the CPU a judge that only scores, with ``hf``, with ``shared`` and two or more verdicts per prompt, or a merge
    (named as a merge or its row) with ``heads`` or ``shared``, starts no engine (the backend's copy scores it:
    ``CopyScoredModel``; its own row runs on the rows' engine); with
    ``evaluate.vllm.enable_prefix_caching`` (the default) a prompt's
    prefill is counted once per model dir, shared by its rows' requests (the KV cache does not depend on
    the head), else once per row. A judge's ``scored_tokens_per_row`` (forced-choice verdicts) are
    teacher-forced like the reference NLL; every judge request is counted, although the stage answers a
    request an earlier row made from its memo (:mod:`darts_bench.evaluate.memo`; how many repeat depends
    on the outputs)."""
    cfg, W, P, kind = x.cfg, x.weights, x.params, x.kind
    rows, E = len(x.evaluated), len(cfg.pool.expert_names)
    M = sum(not m.task_aware for m in cfg.merges)  # plain merges; an EMR merge's rows are its task-aware ones
    ray = cfg.executor == "ray"
    vllm = cfg.evaluate.backend == "vllm"
    scoring = cfg.evaluate.vllm.scoring if vllm else "engine"
    hf_scores = scoring == "hf"  # every score from an HF copy beside each engine
    head_scores = scoring in ("hf", "heads", "shared")  # the corrected rows' scores from the copy
    # the local judges that score teacher-forced sequences (forced-choice verdicts)
    scoring_judges = {t for t in x.local_judges if x.needs[t]["judge"].get("scored_tokens_per_row")}
    # shared: they score on a copy beside their engine, the prompt once
    copy_judges = scoring_judges if scoring == "shared" else set()
    # ... and the hf backend's with evaluate.share_prefix: each prompt forwarded once for its verdicts
    once_judges = scoring_judges if copy_judges or (not vllm and cfg.evaluate.share_prefix) else set()
    # ... and with the prefix cache the prompts' shared tokens (template, instruction, reference) once for the stage
    cached_prefix = bool(cfg.evaluate.vllm.prefix_cache_mib if vllm else cfg.evaluate.prefix_cache_mib)
    judges = x.local_judges
    merge_names = {m.name for m in cfg.merges}

    def judge_mode(t: str) -> str:  # scoring_mode of task t's judge by its name: hf for a merge (or a merge's row)
        # under heads / shared (a merge given by its checkpoint path is not recognised here)
        return scoring_mode(scoring, judges[t].split("+", 1)[0], merge_names)

    # in-process on the CPU a judge that only scores, each prompt with two or more verdicts (all the copy's under
    # shared; every score under hf, so a merge's under heads too), starts no engine: the backend's copy scores it
    # (vllm.CopyScoredModel, vllm.judge_on_copy)
    copy_only = {t for t in scoring_judges
                 if vllm and not ray and kind == "cpu" and judge_mode(t) in ("hf", "shared")
                 and not x.needs[t]["judge"].get("prompt_tokens_per_row")
                 and not x.needs[t]["judge"].get("new_tokens_per_row")
                 and (judge_mode(t) == "hf" or x.needs[t]["judge"].get("scored_per_prompt", 1) >= 2)}
    engine_judges = {t: j for t, j in judges.items() if t not in copy_only}
    layout = one_pass_layout(cfg)
    native = layout is not None
    # rows per model dir; a task-aware (EMR) row runs row by row on its per-task models: a group of its own
    groups = Counter(s.model if s.task_aware else (s.merge or s.model) for s in x.evaluated)
    group_sizes = list(groups.values())
    # a routed row (darts_bench/evaluate/routed.py) runs one forward of its merge over each prompt to route it, and
    # generates each routed head's whole chunks: one row row by row (more when a chunk's prompts split across heads)
    n_routed = sum(s.routing == "routed" for s in x.evaluated)
    n_routed_heads = sum(s.routing == "routed" and not s.task_aware for s in x.evaluated)  # share their oracle's chunks
    emr_routed = any(s.task_aware and s.routing == "routed" for s in x.evaluated)
    n_groups = len(group_sizes)
    merge_rows = max((groups[m.name] for m in cfg.merges if m.name in groups), default=0)  # rows of one merge
    T = len(x.tasks)
    passes, per_merge = (n_groups * T, T if merge_rows else 0) if native else (rows * T, merge_rows * T)
    nll_once = layout == "hf" or (layout == "vllm" and hf_scores)  # one forward per model dir for every head
    # scoring heads / shared: a merge's rows (its plain row too: vllm.scoring_mode) and any corrected rows' model dir
    # run the copy once; the other plain rows (base, experts) run the engine, one each
    copy_merges = {s.merge for s in x.evaluated if s.merge} if scoring in MERGE_COPY_MODES else set()
    headed_dirs = len({s.merge or s.model for s in x.evaluated if s.correction != "none"} | copy_merges)
    plain_rows = sum(s.correction == "none" and s.merge not in copy_merges for s in x.evaluated)
    eval_gen = eval_nll = judge_tokens = 0
    for t, ti in x.tasks.items():
        per_row_gen = ti["n_examples"] * ti["n_samples"] * (ti["prompt_tokens_est"] + ti["max_new_tokens"])
        per_row_nll = ti["n_examples"] * (ti["prompt_tokens_est"] + ti["reference_tokens_est"])
        # one pass on in-process HF: a routed row's chunks are its oracle rows' chunks (generated once) while its
        # prompts route to their own task's head; counted as free (misrouted chunks cost one row's share each)
        eval_gen += (rows - (n_routed_heads if layout == "hf" else 0)) * per_row_gen
        eval_nll += ((n_groups if nll_once else (plain_rows + headed_dirs) if head_scores and layout == "vllm"
                      else rows) * per_row_nll)  # transformer tokens
        eval_nll += n_routed * ti["n_examples"] * ti["prompt_tokens_est"]  # a routed row's prompt states
        j = x.needs[t].get("judge")
        if j:
            judge_tokens += rows * (j["prompt_tokens_per_row"] + j["new_tokens_per_row"]
                                    + j.get("scored_tokens_per_row", 0))
    n_aware = sum(s.task_aware for s in x.specs)
    what = ((f"{rows} rows (base, {E} experts, {M} merges, "
             f"{sum(s.correction != 'none' and not s.task_aware for s in x.specs)} corrected"
             + (f", {n_aware} task-aware (EMR: oracle and routed)" if n_aware else "") + ") x "
             if cfg.evaluate.rows is None else f"{rows} rows ({', '.join(cfg.evaluate.rows)}) x ")
            + ", ".join(f"{t} ({ti['n_examples']}/{ti['of'] or '?'}, {ti['max_new_tokens']} new tokens)"
                        for t, ti in x.tasks.items())
            + "; reference-answer NLL" + "".join(f"; {n['what']}" for n in x.needs.values() if n.get("what"))
            + (f"; one pass per model dir ({layout}: {n_groups} model dirs x {T} tasks = "
               f"{passes} engine passes for {rows * T} row x task evaluations"
               + (f"; a merge's {merge_rows} rows in {per_merge}" if merge_rows else "") + ")"
               if native else
               f"; row by row (evaluate.one_pass: false: {passes} engine passes for {rows * T} row x task evaluations"
               + (f"; a merge's {merge_rows} rows in {per_merge}" if merge_rows else "") + ")"))
    where = where_executor(cfg) + "".join(f"; {n['where']}" for n in x.needs.values() if n.get("where"))
    row_dirs = [s.merge or s.model for s in x.evaluated if not s.task_aware]  # a corrected row: its merge's checkpoint
    for s_ in x.evaluated:  # a task-aware row: each task's own checkpoint; a routed one the base's too (its router)
        if s_.task_aware:
            row_dirs += [f"{s_.merge}/tasks/{e}" for e in cfg.pool.expert_names] + (["base"] if s_.routing == "routed"
                                                                                 else [])
    pinned = {j.split("+", 1)[0] for j in judges.values()}
    s: dict[str, Any] = {
        "what": what, "where": where, "memory_bytes": None,
        "generation_tokens": eval_gen, "nll_tokens": eval_nll, "judge_tokens": judge_tokens,
        # one load per model dir (the backend's model cache; with Ray an actor group per model dir, kept across its
        # rows and tasks, the judges' pinned), whatever the executor
        "model_loads": len(set(row_dirs) | pinned),
        "engine_passes": passes, "engine_passes_per_merge": per_merge, "one_pass": native,
        "one_pass_layout": layout,
        "process_baseline_bytes": PROCESS_BASELINE["evaluate"]}
    if vllm:  # engine starts instead of HF loads (the engine runs in the evaluating process)
        workers = x.workers if ray else 1  # vLLM in the driver: one
        # one after the other; the judge's held (Ray: its pinned group; in-process on the CPU: pinned)
        s["model_loads"], s["engine_reloads"] = engine_loads(
            row_dirs, list(x.tasks), engine_judges, held=ray or kind == "cpu",
            reload=plans_reloads(cfg))
        s["engine_starts"] = s["model_loads"] * workers  # with Ray actors: a group each time
        s["where"] = (f"vLLM: one engine per Ray actor, {x.workers} actors per model dir" if ray else
                      "vLLM: one engine in the driver process" + (" (not in the Ray actors)" if x.workers > 1 else "")
                      ) + "; " + s["where"]
    else:
        workers = x.workers
    if x.arch is None:
        return s
    L = x.arch["num_hidden_layers"]
    if vllm:
        e = x.engine
        # in-process on the CPU each local judge's engine is kept beside the row's (engine_for(pin=True))
        beside = len({j.split("+", 1)[0] for j in engine_judges.values()}) if not ray and kind == "cpu" else 0
        s["memory_bytes"] = PROCESS_BASELINE["evaluate"] + e["ram"] * (1 + beside)
        if e["gpu"] is not None:
            s["gpu_bytes"] = e["gpu"]
        s["memory_note"] = (f"per evaluation process/actor: {e['note']}"
                            + (f" (x {1 + beside}: the judge's engine beside the row's)" if beside else "")
                            + f" + process {gb(PROCESS_BASELINE['evaluate'])}")
        s["vllm_engine"] = e
        s["load_seconds"] = s["model_loads"] * e["start_s"] + s["engine_reloads"] * e["reload_s"]
        if head_scores:  # the HF scorer: a copy of the weights beside each engine that scores with it
            judge_copies = len({judges[t] for t in copy_judges})
            own = len({judges[t].split("+", 1)[0] for t in copy_only})  # the backend's copies of engine-less judges
            # heads: only an engine-less (merge) judge's own; shared: the judges' that score (beside their engine, or
            # engine-less)
            copies = 1 + (beside if hf_scores else max(0, min(beside, judge_copies - own))) + own
            s["memory_bytes"] += W * copies
            if e["gpu"] is not None:
                s["gpu_bytes"] = e["gpu"] + W
            s["memory_note"] += (f" + the HF scorer's weights {gb(W)} x {copies} "
                                 f"(evaluate.vllm.scoring: {scoring})")
            s["load_seconds"] += ((s["model_loads"] + s["engine_reloads"] + own if hf_scores
                                   else headed_dirs + max(judge_copies, own)) * x.checkpoint_load_seconds)

        def gen(prompt_tokens: float, new_tokens: float, requests: float | None = None) -> float:
            return vllm_generation_seconds(prompt_tokens, new_tokens, P, kind, cfg, e, requests=requests)
    else:
        n_models = 1 if ray else 1 + len(pinned)  # Ray: a judge has its own actors
        if emr_routed and not ray:  # an EMR routed row pins every task's model and the base (evaluate.task_aware_model)
            n_models += E + 1
        bs = cfg.tasks.batch_size
        dtype_b = _max_dtype_bytes(x)
        gen_batch = one_pass_batch(cfg, max(group_sizes, default=1)) if native else bs
        kv = kv_cache(x.arch, gen_batch, max((ti["prompt_tokens_est"] + ti["max_new_tokens"]
                                              for ti in x.tasks.values()), default=0), dtype_b)
        act = activations(x.arch, gen_batch, max((ti["prompt_tokens_est"] for ti in x.tasks.values()), default=0),
                          dtype_b)
        if kind == "cuda":
            s["gpu_bytes"] = W * n_models + (kv + act)
            s["memory_bytes"] = PROCESS_BASELINE["evaluate"] + W * n_models
        else:
            s["memory_bytes"] = PROCESS_BASELINE["evaluate"] + W * n_models + (kv + act)
        s["memory_note"] = (f"per worker: weights x {n_models}{' (model + judge)' if n_models > 1 else ''} + KV cache "
                            f"{gb(kv)} (batch {gen_batch}) + prefill {gb(act)} + process "
                            f"{gb(PROCESS_BASELINE['evaluate'])}")
        s["load_seconds"] = s["model_loads"] * x.checkpoint_load_seconds

        def gen(prompt_tokens: float, new_tokens: float, batch: int = bs) -> float:
            return forward_seconds(prompt_tokens, P, kind) + decode_seconds(new_tokens, P, kind, batch, W, L)
    secs = 0.0
    # vLLM's prompt_logprobs vs HF's continuation-only lm_head (the HF backend, or vLLM's HF scorer)
    score_rate = "logits" if vllm and not hf_scores else "forward"
    lm_head = x.arch["hidden_size"] * x.arch["vocab_size"]  # a further head's cost on cached hidden states
    for t, ti in x.tasks.items():
        n = ti["n_examples"] * ti["n_samples"]
        nll_tokens = ti["n_examples"] * (ti["prompt_tokens_est"] + ti["reference_tokens_est"])
        if layout == "vllm":  # one generate call per model dir: decoding steps hold every row's requests
            shared = cfg.evaluate.vllm.enable_prefix_caching  # one prefill per prompt for every row of the dir
            secs += sum(gen((1 if shared else g) * n * ti["prompt_tokens_est"], g * n * ti["max_new_tokens"],
                            requests=g * n) for g in group_sizes)
            if hf_scores:  # the HF one pass's scores (below)
                secs += n_groups * forward_seconds(nll_tokens, P, kind) + (rows - n_groups) * forward_seconds(
                    ti["n_examples"] * ti["reference_tokens_est"], lm_head, kind)
            elif head_scores:  # the base's and experts' rows on the engine; a merge's rows from one HF forward
                secs += plain_rows * forward_seconds(nll_tokens, P, kind, rate="logits")
                secs += headed_dirs * forward_seconds(nll_tokens, P, kind) + (
                    rows - plain_rows - headed_dirs) * forward_seconds(
                    ti["n_examples"] * ti["reference_tokens_est"], lm_head, kind)
            else:
                secs += rows * forward_seconds(nll_tokens, P, kind, rate=score_rate)
        elif native:
            if ti["n_samples"] == 1:  # greedy: a model dir's rows in one generate, batch x its rows a step
                secs += sum(gen(g * n * ti["prompt_tokens_est"], g * n * ti["max_new_tokens"],
                                batch=one_pass_batch(cfg, g)) for g in group_sizes)
            else:  # sampled: one head at a time (the row-by-row samples)
                secs += rows * gen(n * ti["prompt_tokens_est"], n * ti["max_new_tokens"])
            secs += n_groups * forward_seconds(nll_tokens, P, kind) + (rows - n_groups) * forward_seconds(
                ti["n_examples"] * ti["reference_tokens_est"], lm_head, kind)
        else:  # row by row; vLLM in-process: a call holds one row's requests (Ray: shards, as before)
            kw = {"requests": n} if vllm and not ray else {}
            secs += rows * (gen(n * ti["prompt_tokens_est"], n * ti["max_new_tokens"], **kw)
                            + forward_seconds(nll_tokens, P, kind, rate=score_rate))
        if t in judges:  # a judge outside the process (an API annotator) costs no local time
            j = x.needs[t]["judge"]
            secs += gen(rows * j["prompt_tokens_per_row"], rows * j["new_tokens_per_row"])
            if t in once_judges:  # each prompt forwarded once for its scored_per_prompt verdicts
                per_row = j["scored_tokens_per_row"] / j.get("scored_per_prompt", 1)
                shared = min(j.get("shared_tokens_per_row", 0), per_row) if cached_prefix else 0
                secs += forward_seconds(rows * (per_row - shared) + shared, P, kind)
            else:
                # a merge judge under heads scores on a copy (its own, or its engine's on a GPU / with Ray)
                secs += forward_seconds(rows * j.get("scored_tokens_per_row", 0), P, kind,
                                        rate="forward" if judge_mode(t) == "hf" else score_rate)
    s["seconds"] = secs
    return _finish(s, kind, workers)


def report(x: PlanInputs) -> dict[str, Any]:
    """The report: results, tables and plots in the output dir (no model)."""
    return {"what": f"results.json, table.csv, table.md, plots in {x.cfg.resolved_out_dir()}",
            "where": "local", "memory_bytes": None, "disk_bytes": None,
            "process_baseline_bytes": PROCESS_BASELINE["report"]}


STAGES = {"pool": pool, "merge": merge, "collect": collect, "train": train, "evaluate": evaluate, "report": report}
