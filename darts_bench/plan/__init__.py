"""The run plan behind ``darts-bench run --dry-run``: what each stage runs, where, and rough sizes.

Everything comes from the config alone: no model is loaded, the hub is never contacted and neither
torch nor vllm is imported. The architecture comes from the pool (:mod:`.architecture`: ``pool.tiny``,
a local or hub-cached ``config.json``, or a table of known models). Prompt and reference lengths
are not known before the tokenizer runs, so token counts use per-task typical lengths (Llama-style
BPE, each task's ``Task.typical_tokens``; :data:`TYPICAL_TOKENS` for the shared parts) and example
counts (``Task.official_size``) capped by the configured limits; what a task's protocol adds (a
judge) comes from ``Task.plan()``; rows come from :mod:`darts_bench.rows`. Treat the numbers as
order-of-magnitude estimates: the rates behind the times are stated in :mod:`.resources`.

* :func:`make_plan` ``(cfg, suite, limit) -> dict``: the plan; :func:`print_plan` prints it
  (:func:`~.text.format_plan`) after the checks a real run makes first.
* :mod:`.stages`: one function per stage, each estimate written once.
* :mod:`.resources`: measured and assumed rates, the vLLM engine model, engine starts.
* :mod:`.measure`: measured peak memory per stage, to hold the estimates against
  (``python -m darts_bench.plan.measure --config C``).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, TextIO

from darts_bench.config import Config
from darts_bench.plan.architecture import DTYPE_BYTES, KNOWN_ARCHITECTURES, architecture, param_count
from darts_bench.plan.resources import THROUGHPUT, VLLM_CPU_SPEEDUP, VLLM_START_RANGE
from darts_bench.plan.stages import POSITION_BIAS, STAGE_ORDER, STAGES, TYPICAL_TOKENS, PlanInputs, plan_inputs
from darts_bench.plan.text import format_plan
from darts_bench.plan.units import dur, gb


def _resource_notes(x: PlanInputs, st: dict[str, dict[str, Any]]) -> list[str]:
    """Notes on the vLLM engine and GPU memory; sets ``gpu_fits`` on the stages with ``gpu_bytes``
    when the config declares ``ray.gpu_memory_gb``."""
    cfg, kind, engine, notes = x.cfg, x.kind, x.engine, []
    if engine is not None and engine["fits"] is False:
        notes.append(f"vLLM: the KV cache budget holds {engine['kv_tokens']} tokens, less than one "
                     f"{engine['max_model_len']}-token request (evaluate.vllm.max_model_len): the engine will not "
                     "start; raise " + ("evaluate.vllm.kv_cache_gb" if kind == "cpu" else
                                        "evaluate.vllm.gpu_memory_utilization or tensor_parallel_size")
                     + " or lower max_model_len")
    e, c = st["evaluate"], st["collect"]
    if cfg.evaluate.backend == "vllm":
        reloads = e.get("engine_reloads", 0) + c.get("engine_reloads", 0)
        notes.append(f"vLLM start-up: {e['engine_starts']} engine start{'' if e['engine_starts'] == 1 else 's'} in evaluate"
                     + (f" (+{c['engine_starts']} in collect)" if c.get("engine_starts") else "")
                     + f", {VLLM_START_RANGE[kind]}; budgeted at {dur(engine['start_s'])} each "
                       "(start-up + reading the weights) in the time column"
                     + (f"; {reloads} checkpoints loaded into a running engine in place (evaluate.vllm.reload_weights: "
                        f"{e.get('engine_reloads', 0)} in evaluate, {c.get('engine_reloads', 0)} in collect) at "
                        f"{dur(engine['reload_s'])} each" if reloads else ""))
    cap = cfg.ray.gpu_memory_gb * 1e9 if cfg.ray.gpu_memory_gb else None
    for name, s in st.items():
        if "gpu_bytes" in s and cap:
            s["gpu_fits"] = s["gpu_bytes"] <= cap
            if s.get("vllm_engine") and s["vllm_engine"]["fits"] is False:  # noted above (KV budget)
                s["gpu_fits"] = False
            if s["gpu_bytes"] > cap:
                notes.append(f"{name}: needs {gb(s['gpu_bytes'])} of GPU memory per actor; the config declares "
                             f"{cfg.ray.gpu_memory_gb:g} GB (ray.gpu_memory_gb)")
    if kind == "cuda" and not cap:
        notes.append("ray.gpu_memory_gb not set: GPU memory per actor is not checked")
    return notes


def make_plan(cfg: Config, suite: str = "all", limit: int | None = None) -> dict[str, Any]:
    """The run plan of ``cfg`` on ``suite`` (``--suite``) with ``limit`` (``--limit``) as a dict.

    Keys: ``config``, ``suite``, ``limit``, ``device``, ``executor``; ``model`` (``architecture``,
    ``source``, ``params``, ``dtype``, ``weights_bytes``: bytes of one model in ``pool.dtype``);
    ``tasks`` (per task: ``n_examples`` of ``of``, token lengths, ``expert``, ``protocol``,
    ``annotator`` when ``Task.plan()`` names a judge); ``rows`` (evaluated rows); ``stages`` (one
    dict per stage in :data:`STAGE_ORDER`, see :mod:`darts_bench.plan.stages`); ``totals``
    (token counts, disk bytes, and with a known architecture ``device_hours`` in
    ``device_hours_unit`` and ``wall_seconds``); ``notes`` (list of str); ``throughput`` (the
    rates behind the times, with a known architecture).

    Raises:
        ValueError: unknown suite, no enabled task in it, a task with neither ``official_size`` nor
            a limit, or a ``Task.plan()`` outside its contract (naming the task).
    """
    x, notes = plan_inputs(cfg, suite, limit)
    st = {name: STAGES[name](x) for name in STAGE_ORDER}
    if x.arch is None:
        notes.append("architecture unknown: memory and disk estimates are missing")
    notes.append("token counts use typical prompt/reference lengths (Task.typical_tokens) and max_new_tokens as upper bounds")
    if x.arch is not None:
        notes += _resource_notes(x, st)
    c, e = st["collect"], st["evaluate"]
    totals: dict[str, Any] = {
        "forward_tokens": (c["generation_tokens"] + c["feature_forward_tokens"] + e["generation_tokens"]
                           + e["nll_tokens"] + e["judge_tokens"]),
        "calibration_generation_tokens": c["generation_tokens"], "feature_forward_tokens": c["feature_forward_tokens"],
        "evaluation_generation_tokens": e["generation_tokens"], "evaluation_nll_tokens": e["nll_tokens"],
        "judge_tokens": e["judge_tokens"], "train_tokens": st["pool"]["train_tokens"],
        "disk_bytes": sum(s.get("disk_bytes") or 0 for s in st.values()) if x.weights else None}
    plan = {
        "config": cfg.name, "suite": suite, "limit": limit, "device": cfg.device, "executor": cfg.executor,
        "model": {"architecture": x.arch, "source": x.arch_source, "params": x.params, "dtype": cfg.pool.dtype,
                  "weights_bytes": x.weights},
        "tasks": x.tasks, "rows": len(x.evaluated), "stages": st, "totals": totals, "notes": notes}
    if x.arch is not None:
        totals["device_hours"] = sum(s.get("device_hours", 0) for s in st.values())
        totals["device_hours_unit"] = "GPU-hours" if x.kind == "cuda" else "CPU-core-hours"
        totals["wall_seconds"] = sum(s.get("wall_seconds", 0) for s in st.values())
        plan["throughput"] = THROUGHPUT[x.kind]["source"]
        if x.engine is not None:
            plan["throughput"] += ("; vLLM decoding at 1/%g of the HF CPU time (measured vLLM/HF tokens/s)"
                                   % VLLM_CPU_SPEEDUP if x.kind == "cpu" else "; vLLM decoding steps of max_num_seqs "
                                   "requests, each reading the weights once (no HF per-step overhead)")
    return plan


def print_plan(cfg: Config, suite: str = "all", limit: int | None = None, file: TextIO | None = None,
               out_dir: str | None = None, power_from: str | None = None) -> dict[str, Any]:
    """Print the plan of ``cfg`` (``darts-bench run --dry-run``) and return it as a dict, after the
    checks a real run makes first (:mod:`darts_bench.checks`; nothing is created; the rows' checks of
    :func:`darts_bench.preflight.row_problems`, on which ``run`` refuses, as notes): the stages' costs,
    then the claims' cells per line and the effect they can detect (:mod:`darts_bench.plan.power`;
    ``power_from``: a previous run's results dir to take the variances from).

    Raises:
        DataError: a given data dir, or a selected task's folder in it, is missing.
        PermissionError: the output dir (``out_dir`` or the config's) or the work dir cannot be written.
        ValueError: as :func:`make_plan`; a task mapped to an expert the pool does not have, or
            merges from fewer than two experts (:mod:`darts_bench.checks`).
    """
    from darts_bench.api import resolve_suite
    from darts_bench.checks import check_data_dir, check_output_dir, check_pool_experts, check_task_experts

    names = resolve_suite(suite, cfg.tasks)
    check_pool_experts(cfg)
    check_task_experts(cfg, names)
    check_data_dir(cfg.resolved_data_dir(), names)
    check_output_dir(Path(out_dir) if out_dir else cfg.resolved_out_dir(), "output dir", create=False)
    check_output_dir(Path(cfg.work_dir), "work dir", create=False)
    if out_dir:  # the report line names where the run writes: --out wins over the config's out_dir
        cfg = cfg.model_copy(update={"out_dir": str(out_dir)})
    plan = make_plan(cfg, suite, limit)
    from darts_bench.preflight import row_problems

    # the rows' checks `run` refuses a config on before any stage: notes here, the plan still printed
    plan["notes"] += [f"run refuses this config: {str(p).replace(chr(10), ';')}" for p in row_problems(cfg, names)]
    from darts_bench.plan.power import claims_plan, format_claims_plan

    plan["claims"] = claims_plan(cfg, names, Path(power_from) if power_from else None)
    print(format_plan(plan) + "\n" + format_claims_plan(plan["claims"]), file=file or sys.stdout)
    return plan


__all__ = ["DTYPE_BYTES", "KNOWN_ARCHITECTURES", "POSITION_BIAS", "STAGE_ORDER", "TYPICAL_TOKENS", "architecture",
           "format_plan", "make_plan", "param_count", "print_plan"]
