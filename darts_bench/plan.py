"""The run plan behind ``darts-bench run --dry-run``: what each stage runs, where, and rough sizes.

Everything comes from the config alone: no model is loaded and the hub is never contacted. The
architecture comes from ``config.json`` of a local model dir, or of a hub id whose snapshot is in
the local hub cache (``HF_HOME`` / ``HF_HUB_CACHE``; looked up, never fetched), when there is one, from
``pool.tiny`` for the tiny tier, else from a table of known architectures (SmolLM2-135M,
Llama-2-7B) matched on the model id. Prompt and reference lengths are not known before the
tokenizer runs, so token counts use per-task typical lengths (Llama-style BPE, each task's
``Task.typical_tokens``; :data:`TYPICAL_TOKENS` for the shared parts) and example counts
(``Task.official_size``) capped by the configured limits; treat them as order-of-magnitude
estimates. Tasks come from the registry (``--suite``), so an added task is planned like a built-in one.

``make_plan(cfg, suite, limit) -> dict`` returns the plan; ``print_plan`` prints it as a table.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any, TextIO

from darts_bench.api import get_task, resolve_suite
from darts_bench.config import EXPERT_NAMES, Config
from darts_bench.positions import clamp_warning, resolve_max_len

# Typical token lengths (Llama-style BPE) shared by all tasks; per-task ones are Task.typical_tokens.
TYPICAL_TOKENS = {
    "training_prompt": 120,  # inductive calibration prompts from the experts' training data
}
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# Architectures of the packaged tiers' models when no local config.json is there.
KNOWN_ARCHITECTURES: dict[str, dict[str, Any]] = {
    "smollm2-135m": {"hidden_size": 576, "num_hidden_layers": 30, "vocab_size": 49152, "intermediate_size": 1536,
                     "num_attention_heads": 9, "num_key_value_heads": 3, "tie_word_embeddings": True,
                     "max_position_embeddings": 8192},
    "llama-2-7b": {"hidden_size": 4096, "num_hidden_layers": 32, "vocab_size": 32000, "intermediate_size": 11008,
                   "num_attention_heads": 32, "num_key_value_heads": 32, "tie_word_embeddings": False,
                   "max_position_embeddings": 4096},
}
_ARCH_KEYS = ("hidden_size", "num_hidden_layers", "vocab_size", "intermediate_size", "num_attention_heads",
              "num_key_value_heads", "tie_word_embeddings")
# Which methods carry a position-bias table (as darts_bench.surgery.heads.METHODS; kept here so the
# dry run does not import torch).
POSITION_BIAS = {"surgery": False, "darts": True, "darts_ew_only": False, "darts_pos_only": True}
STAGE_ORDER = ("pool", "merge", "collect", "train", "evaluate", "report")


# ------------------------------------------------------------------------------ architecture
def _known(name: str | None) -> str | None:
    n = (name or "").lower().replace("_", "-")
    if "smollm2" in n and "135m" in n:
        return "smollm2-135m"
    if "llama-2-7b" in n or "llama2-7b" in n:
        return "llama-2-7b"
    return None


def _cached_config(ref: str) -> Path | None:
    """``config.json`` of the hub id ``ref`` (``org/name[@revision]``) when the local hub cache
    holds it (``huggingface_hub.try_to_load_from_cache``: a file lookup, the hub is never
    contacted), else None."""
    from huggingface_hub import try_to_load_from_cache
    from huggingface_hub.errors import HFValidationError

    from darts_bench.pool.hub import hub_cache_dir, split_revision

    repo, rev = split_revision(ref)
    try:
        got = try_to_load_from_cache(repo, "config.json", cache_dir=hub_cache_dir(), revision=rev)
    except (HFValidationError, ValueError):  # not a hub id
        return None
    return Path(got) if isinstance(got, str) else None


def _config_file(path: str | None) -> Path | None:
    """``config.json`` of a local checkpoint dir or of a hub id in the local hub cache."""
    if not path:
        return None
    p = Path(path).expanduser()
    if p.exists():
        return p / "config.json" if (p / "config.json").is_file() else None
    return _cached_config(str(path))


def _from_dir(path: str | None) -> dict[str, Any] | None:
    f = _config_file(path)
    if f is None:
        return None
    raw = json.loads(f.read_text())
    raw = raw.get("text_config", raw)
    if not all(k in raw for k in _ARCH_KEYS[:5]):
        return None
    arch = {k: raw.get(k) for k in _ARCH_KEYS}
    arch["num_key_value_heads"] = arch["num_key_value_heads"] or arch["num_attention_heads"]
    arch["tie_word_embeddings"] = bool(arch["tie_word_embeddings"])
    arch["max_position_embeddings"] = raw.get("max_position_embeddings")
    return arch


def architecture(cfg: Config) -> tuple[dict[str, Any] | None, str]:
    """``(arch, source)``: the pool's architecture and where it came from (None if unknown)."""
    pool = cfg.pool
    if pool.kind == "tiny":
        t = pool.tiny
        return ({"hidden_size": t.hidden_size, "num_hidden_layers": t.num_hidden_layers, "vocab_size": t.vocab_size,
                 "intermediate_size": t.intermediate_size, "num_attention_heads": t.num_attention_heads,
                 "num_key_value_heads": t.num_key_value_heads, "tie_word_embeddings": False,
                 "max_position_embeddings": t.max_position_embeddings}, "pool.tiny")
    arch = _from_dir(pool.base)
    if arch:
        return arch, str(_config_file(pool.base))
    for cand in (pool.base, pool.gguf_file if pool.kind == "gguf" else None,
                 pool.gguf_wheel if pool.kind == "gguf" else None, cfg.name):
        k = _known(cand)
        if k:
            return dict(KNOWN_ARCHITECTURES[k]), f"known architecture {k} (from {cand!r})"
    return None, "unknown (no local config.json and not a known model id)"


def param_count(arch: dict[str, Any]) -> dict[str, int]:
    """Parameters of a Llama-style decoder: total and the largest single tensor."""
    d, L, V, I = arch["hidden_size"], arch["num_hidden_layers"], arch["vocab_size"], arch["intermediate_size"]
    kv = d // arch["num_attention_heads"] * arch["num_key_value_heads"]
    layer = 2 * d * d + 2 * d * kv + 3 * d * I + 2 * d  # q, o; k, v; gate, up, down; two norms
    embed = V * d
    total = embed * (1 if arch["tie_word_embeddings"] else 2) + L * layer + d
    return {"total": total, "largest_tensor": max(embed, d * I, d * d)}


# ------------------------------------------------------------------------------ helpers
def _gb(n: float | None) -> str:
    if n is None:
        return "-"
    for unit, f in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= f:
            return f"{n / f:.1f} {unit}"
    return f"{int(n)} B"


def _num(n: float | None) -> str:
    if n is None:
        return "-"
    for unit, f in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= f:
            return f"{n / f:.1f}{unit}"
    return str(int(n))


def _where_executor(cfg: Config) -> str:
    if cfg.executor == "ray":
        r = cfg.ray
        res = f"CPU {r.num_cpus_per_actor:g}" + (f", GPU {r.num_gpus_per_actor:g}" if r.num_gpus_per_actor else "")
        return (f"Ray ({r.address or 'local instance'}): {r.num_actors} actors x {{{res}}}, "
                f"shards of {r.shard_size} prompts, device {cfg.device}")
    return f"local, in-process (device {cfg.device}, {cfg.torch_threads or 'default'} torch threads)"


def _head_params(method: str, d: int, rank: int, max_len: int, overflow: str) -> int:
    n = 2 * d * rank  # W_down [r, d] + W_up [d, r]
    if POSITION_BIAS[method]:  # b [max_len (+16 buckets), d]
        n += (max_len + (16 if overflow == "bucket" else 0)) * d
    return n


# ------------------------------------------------------------------------------ the plan
def make_plan(cfg: Config, suite: str = "all", limit: int | None = None) -> dict[str, Any]:
    """The run plan of ``cfg`` as a dict (see the module docstring; sizes in bytes, counts in tokens).

    Raises:
        ValueError: unknown suite or no enabled task in it.
    """
    names = resolve_suite(suite, cfg.tasks)
    arch, arch_src = architecture(cfg)
    pc = param_count(arch) if arch else None
    d = arch["hidden_size"] if arch else None
    pool_bytes = DTYPE_BYTES[cfg.pool.dtype]
    weights = pc["total"] * pool_bytes if pc else None
    E, M = len(EXPERT_NAMES), len(cfg.merges)
    cal, scfg, ds = cfg.calibration, cfg.surgery, cfg.deepspeed
    notes: list[str] = []

    # ---------------------------------------------------------------- tasks
    tasks: dict[str, dict[str, Any]] = {}
    hints: dict[str, dict[str, Any]] = {}
    for t in names:
        tc = getattr(cfg.tasks, t)
        task = get_task(t)
        size = task.official_size
        lim = limit if limit is not None else tc.limit
        if size is None and lim is None:
            raise ValueError(f"task {t} declares no official_size: give --limit or tasks.{t}.limit to plan it")
        n = min(lim, size) if lim is not None and size is not None else (lim if lim is not None else size)
        typ = task.typical_tokens
        prompt = typ["prompt"] + (typ.get("per_shot", 0) * getattr(tc, "num_fewshot", 0))
        tasks[t] = {"n_examples": n, "of": size, "max_new_tokens": getattr(tc, "max_new_tokens", 0),
                    "n_samples": getattr(tc, "n_samples", 1), "prompt_tokens_est": prompt,
                    "reference_tokens_est": typ["reference"], "expert": task.expert,
                    "protocol": getattr(tc, "protocol", None)}
        if getattr(tc, "judge", None) is not None:
            tasks[t]["annotator"] = tc.judge.annotator or f"local judge {tc.judge.model}"
        hints[t] = task.plan(tc, n)
    head_tasks = [t for t in names if tasks[t]["expert"] is not None]  # tasks without an expert get no heads

    # ---------------------------------------------------------------- rows
    from darts_bench.rows import head_seeds, needs_merges, row_selected, row_specs, surgery_variants

    runs = len(head_seeds(cfg)) * len(surgery_variants(cfg))  # heads per (merge, task, split, method)
    specs = row_specs(cfg)  # the one definition of rows
    n_corrected = sum(s.correction != "none" for s in specs)
    n_rows = all_rows = len(specs)
    if cfg.evaluate.rows is not None:  # --rows: only the selected rows are evaluated
        n_rows = sum(row_selected(cfg, s.model) for s in specs)
        notes.append(f"evaluate.rows {cfg.evaluate.rows}: {n_rows} of {all_rows} "
                     "rows evaluated" + ("" if needs_merges(cfg) else
                                         "; no merge or corrected row, so merge, collect and train are skipped "
                                         "(their lines above do not apply)"))

    # ---------------------------------------------------------------- calibration + features
    calib: dict[str, dict[str, Any]] = {}
    gen_tokens = feat_seq_tokens = 0  # expert generation; tokens per feature set (one forward each)
    for t, ti in tasks.items():
        if ti["expert"] is None:
            continue
        for split in cal.splits:
            n = min(cal.n_prompts, ti["n_examples"]) if split == "transductive" else cal.n_prompts
            if split == "transductive" and cal.n_prompts > ti["n_examples"]:
                notes.append(f"calibration.n_prompts {cal.n_prompts} > {t} evaluated examples {ti['n_examples']}: "
                             f"the transductive calibration set of {t} is its {n} evaluated inputs (raise "
                             f"tasks.{t}.limit for more)")
            p = min(ti["prompt_tokens_est"] if split == "transductive" else TYPICAL_TOKENS["training_prompt"],
                    cal.max_prompt_tokens)
            seq = n * (p + cal.max_new_tokens)
            calib[f"{t}/{split}"] = {"sequences": n, "tokens": seq, "train_tokens": round(seq * (1 - cal.held_out_fraction))}
            gen_tokens += seq
            feat_seq_tokens += seq
        ref = ti["n_examples"] * (min(ti["prompt_tokens_est"], cal.max_prompt_tokens)
                                  + min(ti["reference_tokens_est"], cal.max_prompt_tokens))
        calib[f"{t}/reference"] = {"sequences": ti["n_examples"], "tokens": ref, "train_tokens": 0}
        feat_seq_tokens += ref
    feature_forward_tokens = feat_seq_tokens * (1 + M)  # expert once, every merge once
    feat_b = pool_bytes  # features are stored in the dtype the workers load every model in (pool.dtype)
    for c in calib.values():
        c["disk_bytes_per_merge"] = c["tokens"] * d * feat_b * 2 if d else None  # expert + merged h
    feature_disk = feat_seq_tokens * d * feat_b * (1 + M) if d else None  # expert features shared by merges

    # ---------------------------------------------------------------- evaluation
    eval_gen = eval_nll = judge = 0
    for t, ti in tasks.items():
        per_row_gen = ti["n_examples"] * ti["n_samples"] * (ti["prompt_tokens_est"] + ti["max_new_tokens"])
        per_row_nll = ti["n_examples"] * (ti["prompt_tokens_est"] + ti["reference_tokens_est"])
        eval_gen += n_rows * per_row_gen
        eval_nll += n_rows * per_row_nll
        ti["eval_forward_tokens_per_row"] = per_row_gen + per_row_nll
        judge += n_rows * hints[t].get("judge_tokens_per_row", 0)
    forward_tokens = gen_tokens + feature_forward_tokens + eval_gen + eval_nll + judge

    # ---------------------------------------------------------------- memory
    def activations(batch: int, seq: int, dtype_b: int) -> int | None:
        if not arch:
            return None
        V, I, H = arch["vocab_size"], arch["intermediate_size"], arch["num_attention_heads"]
        logits = batch * seq * V * (dtype_b + 8)  # logits + fp32 log-softmax and probs for the entropy
        attn = batch * H * seq * seq * dtype_b  # eager attention scores of one layer
        mlp = batch * seq * (3 * I + 4 * d) * dtype_b  # one layer's working set (no grad kept)
        return logits + attn + mlp

    def kv_cache(batch: int, seq: int, dtype_b: int) -> int | None:
        if not arch:
            return None
        kv = d // arch["num_attention_heads"] * arch["num_key_value_heads"]
        return 2 * arch["num_hidden_layers"] * batch * seq * kv * dtype_b

    cal_seq = cal.max_prompt_tokens + cal.max_new_tokens
    max_merge_b = max([DTYPE_BYTES[m.dtype] for m in cfg.merges] or [pool_bytes])
    collect_act = activations(cal.batch_size, cal_seq, max(pool_bytes, max_merge_b))
    collect_kv = kv_cache(cal.batch_size, cal_seq, pool_bytes)
    eval_seq = max((ti["prompt_tokens_est"] + ti["max_new_tokens"] for ti in tasks.values()), default=0)
    eval_kv = kv_cache(cfg.tasks.batch_size, eval_seq, max(pool_bytes, max_merge_b))
    eval_act = activations(cfg.tasks.batch_size, max((ti["prompt_tokens_est"] for ti in tasks.values()), default=0),
                           max(pool_bytes, max_merge_b))

    # ---------------------------------------------------------------- stages
    stages: dict[str, dict[str, Any]] = {}
    pool = cfg.pool
    if pool.kind == "tiny":
        t = pool.tiny
        train_tok = t.pretrain_steps * t.batch_size * t.seq_len + E * t.finetune_steps * t.batch_size * t.seq_len
        what = (f"train a BPE tokenizer (vocab {t.vocab_size}), pretrain a {_num(pc['total'])}-param Llama "
                f"({t.pretrain_steps} steps of {t.batch_size}x{t.seq_len}), fine-tune {E} experts "
                f"({t.finetune_steps} steps each)")
        pool_mem = pc["total"] * 16 + activations(t.batch_size, t.seq_len, 4) * 3  # fp32 w, grad, Adam m, v
    elif pool.kind == "gguf":
        ft = pool.finetune
        train_tok = E * ft.steps * ft.batch_size * ft.seq_len
        what = (f"dequantize the base from {pool.gguf_file} in the wheel {pool.gguf_wheel}, fine-tune {E} experts "
                f"({ft.mode}, {ft.steps} steps of {ft.batch_size}x{ft.seq_len})")
        pool_mem = (pc["total"] * (16 if ft.mode == "full" else 4) + activations(ft.batch_size, ft.seq_len, 4) * 3
                    if pc else None)
    else:
        train_tok = 0
        srcs = [pool.base, *[pool.experts[e] for e in EXPERT_NAMES]]
        local = [s for s in srcs if s and Path(s).expanduser().is_dir()]
        what = (f"use base {pool.base} and experts " + ", ".join(f"{e}={pool.experts[e]}" for e in EXPERT_NAMES)
                + f" ({len(local)} local dirs, {len(srcs) - len(local)} from the hub); check architectures and tokenizers")
        pool_mem = weights
    stages["pool"] = {"what": what, "where": "local" + (f" (device {cfg.device})" if train_tok else ""),
                      "memory_bytes": pool_mem, "disk_bytes": (1 + E) * weights if weights else None,
                      "train_tokens": train_tok}

    merge_peak = ((E + 2) * pc["largest_tensor"] * 4 + pool_bytes * pc["largest_tensor"]) if pc else None
    stages["merge"] = {"what": f"{M} mergekit merges: " + ", ".join(f"{m.name} ({m.method}, {m.dtype})" for m in cfg.merges),
                       "where": "local, mergekit (tensor by tensor)",
                       "memory_bytes": merge_peak,
                       "memory_note": "peak: base + experts + output of the largest tensor in fp32",
                       "disk_bytes": sum(pc["total"] * DTYPE_BYTES[m.dtype] for m in cfg.merges) if pc else None}

    stages["collect"] = {
        "what": (f"{len(head_tasks)} tasks x {len(cal.splits)} splits ({', '.join(cal.splits)}) + reference answers: "
                 f"expert greedy continuations ({cal.max_new_tokens} new tokens), then final hidden states and "
                 f"entropies of the expert and {M} merges"),
        "where": _where_executor(cfg),
        "memory_bytes": (weights + collect_act + collect_kv) if weights else None,
        "memory_note": (f"per worker: weights {_gb(weights)} + activations {_gb(collect_act)} "
                        f"(batch {cal.batch_size} x {cal_seq} tokens, logits dominate) + KV cache {_gb(collect_kv)}"),
        "disk_bytes": feature_disk,
        "calibration": calib,
        "generation_tokens": gen_tokens, "feature_forward_tokens": feature_forward_tokens}

    n_heads = M * len(head_tasks) * len(cal.splits) * len(scfg.methods) * runs
    max_pos = arch.get("max_position_embeddings") if arch else None
    enabled = resolve_suite("all", cfg.tasks)  # as the pipeline: not per suite
    max_len = resolve_max_len(cfg, enabled, max_pos)
    clamp = clamp_warning(cfg, enabled, max_pos)
    if clamp:
        notes.append(f"WARNING: {clamp}")
    head_params = {m: _head_params(m, d, scfg.rank, max_len, scfg.overflow) for m in scfg.methods} if d else {}
    max_hp = max(head_params.values(), default=0)
    nprocs = ds.num_procs if ds.enabled else 1
    stage_ = ds.zero_stage if ds.enabled else 0
    # fp32 params + grads + Adam (m, v); ZeRO 1 shards optimizer state, 2 also grads, 3 also params
    opt_b = max_hp * 8 / (nprocs if stage_ >= 1 else 1)
    grad_b = max_hp * 4 / (nprocs if stage_ >= 2 else 1)
    par_b = max_hp * 4 / (nprocs if stage_ >= 3 else 1)
    max_train_tok = max((c["tokens"] for k, c in calib.items() if not k.endswith("/reference")), default=0)
    data_b = max_train_tok * d * 4 * 2 if d else None
    steps = sum(scfg.epochs * math.ceil(max(c["train_tokens"], 1) / scfg.batch_size)
                for k, c in calib.items() if not k.endswith("/reference")) * M * len(scfg.methods) * runs
    if ds.enabled:
        where_train = (f"DeepSpeed, {ds.num_procs} procs via {ds.launcher}, ZeRO stage {ds.zero_stage}, "
                       f"{'nccl' if cfg.device.startswith('cuda') else 'gloo'}; micro batch "
                       f"{max(1, scfg.batch_size // ds.num_procs)} tokens per proc")
    else:
        where_train = "local, in-process (torch Adam on cached features)"
    stages["train"] = {
        "what": (f"{n_heads} heads ({M} merges x {len(head_tasks)} tasks x {len(cal.splits)} splits x methods "
                 f"{', '.join(scfg.methods)}" + (f" x {runs} seeds/sweep variants" if runs > 1 else "")
                 + f"), rank {scfg.rank}, position table {max_len} rows, {scfg.epochs} epochs of "
                 f"{scfg.batch_size}-token "
                 f"batches ({steps} steps in all)"),
        "where": where_train,
        "head_params": head_params,
        "params_overhead": {m: p / pc["total"] for m, p in head_params.items()} if pc else {},
        "optimizer_state_bytes_per_proc": opt_b,
        "head_train_tokens": steps * scfg.batch_size,
        "disk_bytes": (M * len(head_tasks) * len(cal.splits) * sum(head_params.values()) * 4 * runs) if d else None,
        "memory_bytes": (par_b + grad_b + opt_b + data_b) if data_b is not None else None,
        "memory_note": (f"per proc: head {_gb(par_b)} + grads {_gb(grad_b)} + Adam state {_gb(opt_b)} "
                        f"+ features {_gb(data_b)}"),
        "steps": steps}

    n_loaded = max([h.get("models_loaded", 1) for h in hints.values()] or [1])  # e.g. a judge beside the model
    extra_what = "".join(f"; {h['what']}" for h in hints.values() if h.get("what"))
    extra_where = "".join(f"; {h['where']}" for h in hints.values() if h.get("where"))
    stages["evaluate"] = {
        "what": ((f"{n_rows} rows (base, {E} experts, {M} merges, {n_corrected} corrected) x "
                  if cfg.evaluate.rows is None else f"{n_rows} rows ({', '.join(cfg.evaluate.rows)}) x ")
                 + ", ".join(f"{t} ({ti['n_examples']}/{ti['of'] or '?'}, {ti['max_new_tokens']} new tokens)"
                             for t, ti in tasks.items())
                 + "; reference-answer NLL" + extra_what),
        "where": _where_executor(cfg) + extra_where,
        "memory_bytes": (weights * n_loaded + eval_kv + eval_act) if weights else None,
        "memory_note": (f"per worker: weights x {n_loaded}{' (model + judge)' if n_loaded > 1 else ''} + KV cache "
                        f"{_gb(eval_kv)} (batch {cfg.tasks.batch_size}) + prefill {_gb(eval_act)}"),
        "generation_tokens": eval_gen, "nll_tokens": eval_nll, "judge_tokens": judge}

    stages["report"] = {"what": f"results.json, table.csv, table.md, plots in {cfg.resolved_out_dir()}",
                        "where": "local", "memory_bytes": None, "disk_bytes": None}

    if arch is None:
        notes.append("architecture unknown: memory and disk estimates are missing")
    notes.append("token counts use typical prompt/reference lengths (Task.typical_tokens) and max_new_tokens as upper bounds")
    plan = {
        "config": cfg.name, "suite": suite, "limit": limit, "device": cfg.device, "executor": cfg.executor,
        "model": {"architecture": arch, "source": arch_src, "params": pc["total"] if pc else None,
                  "dtype": cfg.pool.dtype, "weights_bytes": weights},
        "tasks": tasks, "rows": n_rows, "stages": stages,
        "totals": {"forward_tokens": forward_tokens, "calibration_generation_tokens": gen_tokens,
                   "feature_forward_tokens": feature_forward_tokens, "evaluation_generation_tokens": eval_gen,
                   "evaluation_nll_tokens": eval_nll, "judge_tokens": judge, "train_tokens": train_tok,
                   "disk_bytes": sum(s.get("disk_bytes") or 0 for s in stages.values()) if weights else None},
        "notes": notes,
    }
    from darts_bench.plan_resources import refine

    refine(plan, cfg, {"arch": arch, "params": pc["total"] if pc else None, "weights": weights, "calib": calib,
                       "tasks": tasks, "feature_bytes": feat_b, "feature_dtype": cfg.pool.dtype,
                       "feature_forward_tokens": feature_forward_tokens, "collect_act": collect_act,
                       "collect_kv": collect_kv, "eval_kv": eval_kv, "eval_act": eval_act,
                       "head_params": head_params, "experts": EXPERT_NAMES})
    return plan


def _tokens(s: dict[str, Any]) -> int | None:
    keys = ("train_tokens", "head_train_tokens", "generation_tokens", "feature_forward_tokens", "nll_tokens", "judge_tokens")
    vals = [s[k] for k in keys if s.get(k)]
    return sum(vals) if vals else None


def format_plan(plan: dict[str, Any]) -> str:
    """The plan as plain text: a header, one table row per stage, and the details under it."""
    m = plan["model"]
    lines = [f"darts-bench plan: config {plan['config']}, suite {plan['suite']}, limit {plan['limit']}, "
             f"device {plan['device']}, executor {plan['executor']}",
             f"model: {_num(m['params'])} params, {m['dtype']}, {_gb(m['weights_bytes'])} per model "
             f"(architecture: {m['source']})",
             "tasks: " + ", ".join(f"{t} {ti['n_examples']}/{ti['of']}" for t, ti in plan["tasks"].items())
             + f"; {plan['rows']} evaluated rows",
             "protocols: " + ", ".join(f"{t} {ti.get('protocol')}" + (f" (annotator {ti['annotator']})"
                                                                      if ti.get("annotator") else "")
                                       for t, ti in plan["tasks"].items()), ""]
    header = ("stage", "memory (peak)", "GPU/actor", "disk", "tokens", "time (wall)", "device-h", "where")
    rows = [(name, _gb(s.get("memory_bytes")),
             _gb(s.get("gpu_bytes")) + ("" if s.get("gpu_fits", True) else " (!)"), _gb(s.get("disk_bytes")),
             _num(_tokens(s)), _dur(s.get("wall_seconds")),
             f"{s['device_hours']:.2f}" if s.get("device_hours") is not None else "-", s["where"])
            for name, s in ((n, plan["stages"][n]) for n in STAGE_ORDER)]
    widths = [max(len(str(r[i])) for r in (header, *rows)) for i in range(7)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths) + "  {}"
    lines.append(fmt.format(*header))
    lines.append("  ".join("-" * w for w in widths) + "  " + "-" * 5)
    lines += [fmt.format(*r) for r in rows]
    lines.append("")
    for name in STAGE_ORDER:
        s = plan["stages"][name]
        lines.append(f"[{name}] {s['what']}")
        if s.get("memory_note"):
            lines.append(f"    memory: {s['memory_note']}")
        if name == "collect":
            for k, c in s["calibration"].items():
                lines.append(f"    {k}: {c['sequences']} sequences, ~{_num(c['tokens'])} tokens, "
                             f"features {_gb(c['disk_bytes_per_merge'])} per merge (expert + merged, "
                             f"{plan['model']['dtype']})")
        if name == "train" and s["head_params"]:
            lines.append("    head params: " + ", ".join(
                f"{k} {_num(v)} ({100 * s['params_overhead'].get(k, 0):.3f}% of the model)" for k, v in s["head_params"].items()))
    t = plan["totals"]
    lines += ["", f"forward tokens: {_num(t['forward_tokens'])} in all (calibration generation "
              f"{_num(t['calibration_generation_tokens'])}, feature forwards {_num(t['feature_forward_tokens'])}, "
              f"evaluation generation {_num(t['evaluation_generation_tokens'])}, reference NLL "
              f"{_num(t['evaluation_nll_tokens'])}, judge {_num(t['judge_tokens'])}); "
              f"pool training tokens {_num(t['train_tokens'])}; disk {_gb(t['disk_bytes'])}"]
    if t.get("device_hours") is not None:
        lines.append(f"time: {t['device_hours']:.1f} {t['device_hours_unit']}, ~{_dur(t['wall_seconds'])} wall "
                     f"(throughput: {plan.get('throughput')}); evaluate loads {plan['stages']['evaluate'].get('model_loads')} "
                     f"checkpoints{_loads_how(plan)}"
                     f", collect {plan['stages']['collect'].get('model_loads')}")
    lines += [f"note: {n}" for n in plan["notes"]]
    return "\n".join(lines)


def _loads_how(plan: dict[str, Any]) -> str:
    if plan["stages"]["evaluate"].get("vllm_engine"):
        return (" (vLLM engine starts: one per model dir in row order, the judge's kept alive"
                + (", each a group of Ray actors)" if plan["executor"] == "ray" else ")"))
    return " (one per model dir)" if plan["executor"] != "ray" else " (Ray: one actor group per model dir)"


def _dur(sec: float | None) -> str:
    if sec is None:
        return "-"
    if sec >= 3600:
        return f"{sec / 3600:.1f} h"
    if sec >= 60:
        return f"{sec / 60:.1f} min"
    return f"{sec:.0f} s"


def print_plan(cfg: Config, suite: str = "all", limit: int | None = None, file: TextIO | None = None,
               out_dir: str | None = None) -> dict[str, Any]:
    """Print the plan of ``cfg`` (``darts-bench run --dry-run``) and return it as a dict, after the
    checks a real run makes first (:mod:`darts_bench.checks`; nothing is created).

    Raises:
        DataError: a given data dir, or a selected task's folder in it, is missing.
        PermissionError: the output dir (``out_dir`` or the config's) or the work dir cannot be written.
    """
    from darts_bench.checks import check_data_dir, check_output_dir

    names = resolve_suite(suite, cfg.tasks)
    check_data_dir(cfg.resolved_data_dir(), names)
    check_output_dir(Path(out_dir) if out_dir else cfg.resolved_out_dir(), "output dir", create=False)
    check_output_dir(Path(cfg.work_dir), "work dir", create=False)
    plan = make_plan(cfg, suite, limit)
    print(format_plan(plan), file=file or sys.stdout)
    return plan
