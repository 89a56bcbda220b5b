"""Memory and time of each stage for the plan (:mod:`darts_bench.plan`), as the code really runs.

Memory (bytes, 1e9 = 1 GB):

* ``memory_bytes``: peak RSS of the process doing the stage's work (the driver, or for Ray one
  actor): a measured per-stage process baseline (:data:`PROCESS_BASELINE`: interpreter + the
  libraries the stage imports) plus the stage's working set.
* ``gpu_bytes`` (device ``cuda``): GPU memory per actor / process, flagged (``gpu_fits``) against
  ``ray.gpu_memory_gb`` when the config declares it.
* train: the lm_heads in float32 (``2 V d 4``), one ``[N, d]`` buffer per model of the largest
  calibration split in the stored dtype (:func:`darts_bench.surgery.data.load_split`), the
  held-out tokens' float32 copy, one reference-answer shard of each model
  (:func:`~darts_bench.surgery.data.reference_answer_batches`), the diagnostics' logits temporaries
  (``DIAG_BATCH x V`` float32, :data:`DIAG_TEMPS` of them; on the GPU when the device is ``cuda``),
  and the head with its gradient and Adam state; with DeepSpeed, the split's float32 copy handed
  to the launcher.

vLLM (``evaluate.backend: vllm``, ``calibration.backend: vllm``; :func:`vllm_engine`): per
evaluation process or actor one engine (:meth:`darts_bench.evaluate.engines.vllm.VLLMBackend.engine_for`
keeps one alive at a time, and on the CPU the judge's beside it; on a GPU the judge swaps it). On the CPU the engine's processes (the driver's
``LLM``, engine-core, worker) hold the weights in the engine dtype, the KV cache
(``evaluate.vllm.kv_cache_gb`` GiB, ``VLLM_CPU_KVCACHE_SPACE``, allocated at start-up) and a fixed
:data:`VLLM_ENGINE_OVERHEAD`; on the GPU vLLM takes ``gpu_memory_utilization`` x the declared GPU
memory (``ray.gpu_memory_gb``) for weights (split over ``tensor_parallel_size`` GPUs), activations
and the KV cache, flagged when the weights leave no room for one ``max_model_len`` request's KV.
Each engine start costs :data:`VLLM_START_S` plus reading the weights.

Time: work in FLOPs (``2 x params`` per forwarded token, ``6 x params`` per trained token, ``2 d V``
per lm_head matmul token) over a stated throughput (:data:`THROUGHPUT`): on the CPU the rates
measured with SmolLM2-135M on 2 cores (``LAB-NOTES.md``) taken as FLOP/s and assumed to scale
with FLOPs; on ``cuda`` an assumed A100/H100-class GPU (bf16 forward at 40% of 312 TFLOP/s;
a decoding step bound by reading the weights once at 1.5 TB/s, and by 25 ms per 32 layers of HF
``generate`` overhead; fp32 diagnostics at 10 TFLOP/s).
``device_hours`` are GPU-hours on ``cuda`` (all actors together), else CPU-hours (2-core units
counted as 2); ``wall_seconds`` divides by the actors working at once. Expect a factor of 2 either
way: these are budgets, not measurements.
"""

from __future__ import annotations

from typing import Any

# Peak RSS of a process that runs the stage on a negligible model: imports + allocator pools.
# Measured with ``python -m darts_bench.measure`` on the micro pool (tests/conftest.py, suite gsm8k;
# 2-core x86 CPU, torch 2.13 CPU, transformers 5.24): 477 / 445 / 440 / 439 / 557 MB for pool / merge /
# collect / train / evaluate, less the working set this module estimates for that pool. Bytes.
PROCESS_BASELINE = {"pool": 0.455e9, "merge": 0.445e9, "collect": 0.41e9, "train": 0.44e9, "evaluate": 0.55e9,
                    "report": 0.45e9}
# Measured (CPU) / assumed (GPU) throughput, FLOP/s or B/s; see the module docstring.
_SMOL = 134_515_008
THROUGHPUT = {
    "cpu": {"forward": 600 * 2 * _SMOL, "decode": 68 * 2 * _SMOL, "train": 180 * 6 * _SMOL, "matmul": 600 * 2 * _SMOL,
            "source": "SmolLM2-135M on 2 CPU cores (LAB-NOTES): forward 600 tok/s, generation 68 tok/s at batch 8, "
                      "training 180 tok/s; taken as FLOP/s"},
    "cuda": {"forward": 0.4 * 312e12, "decode_bw": 1.5e12, "step_s_per_layer": 0.025 / 32, "train": 0.4 * 312e12,
             "matmul": 10e12,
             "source": "assumed GPU: bf16 at 40% of 312 TFLOP/s; a decoding step reads the weights once at "
                       "1.5 TB/s but takes at least 25 ms per 32 layers (HF generate, eager); fp32 diagnostics "
                       "at 10 TFLOP/s"},
}
# Loading a checkpoint: weights read at LOAD_BYTES_PER_S (assumed: local NVMe / cold page cache);
# with Ray every artifact starts its own actors (ACTOR_START_S each, assumed for a GPU node; 33-82 s
# per artifact were measured on a 2-core head with a tiny model, see ray_configs/README.md).
LOAD_BYTES_PER_S = 1e9
ACTOR_START_S = 10.0
# vLLM engine on CPU beyond its weights and KV cache (bytes): the engine-core and worker processes
# (interpreter, torch, vllm) and the worker's activations. From LAB-NOTES "vLLM on CPU": ~3.4 GB RAM
# per engine for SmolLM2-135M (134.5M params) in float32 with kv_cache_gb 2, less its weights
# (0.54 GB) and KV cache (2 GiB = 2.15 GB); not re-measured per model size (the worker's activations
# grow with max_num_batched_tokens, so expect more for 7B-sized vocabularies and hidden sizes).
VLLM_ENGINE_OVERHEAD = 3.4e9 - 134_515_008 * 4 - 2 * 2**30
# GPU: what vLLM's gpu_memory_utilization budget holds besides weights and KV cache (activations
# of the profiling run, CUDA graphs, the sampler), per GPU; assumed.
VLLM_GPU_RESERVE = 2e9
# Start-up of one engine (seconds, besides reading the weights at LOAD_BYTES_PER_S): CPU measured
# 25-120 s with enforce_eager (LAB-NOTES, README "vLLM backend": 63 s tiny Llama, 104 s SmolLM2-135M
# on a loaded 2-core box), 327 s the first time with compilation; GPU assumed.
VLLM_START_S = {"cpu": {"eager": 120.0, "compiled": 330.0}, "cuda": {"eager": 60.0, "compiled": 180.0}}
VLLM_START_RANGE = {"cpu": "25-120 s per engine measured on CPU with enforce_eager (327 s compiled)",
                    "cuda": "60 s per engine assumed on GPU with enforce_eager (180 s with CUDA graphs)"}
# vLLM / HF generation tokens/s on CPU, measured (README "vLLM backend": SmolLM2-135M, batch 8,
# fp32, 3.04x; LAB-NOTES 4.9x on an idler box): the CPU generation time is divided by it.
VLLM_CPU_SPEEDUP = 3.0
# With ``executor: ray`` each Ray actor holds one vLLM engine, ``ray.num_actors`` of them per model dir,
# data-parallel over prompts (``RayExecutor.vllm_text_model``; the vLLM backend holds one group per
# current and pinned model dir). In-process, one engine per model dir and the pinned judge's beside it
# (:meth:`darts_bench.evaluate.engines.vllm.VLLMBackend.engine_for`).
DIAG_BATCH = 2048  # tokens per diagnostics matmul (darts_bench.surgery.diagnostics.Diagnostics)
DIAG_TEMPS = 8  # [DIAG_BATCH, V] float32 tensors alive at once (logits, log-softmaxes, products)
FEATURE_COLUMNS_BYTES = 4 + 8 + 8  # entropy fp32, positions and seq_index int64 per token


def _kind(device: str) -> str:
    return "cuda" if str(device).startswith("cuda") else "cpu"


def _fwd_seconds(tokens: float, params: int, kind: str) -> float:
    return tokens * 2 * params / THROUGHPUT[kind]["forward"]


def _decode_seconds(tokens: float, params: int, kind: str, batch: int, weights: float, layers: int) -> float:
    t = THROUGHPUT[kind]
    if kind == "cpu":  # measured at batch 8; decoding per token assumed batch-independent
        return tokens * 2 * params / t["decode"]
    steps = tokens / max(batch, 1)
    step = max(weights / t["decode_bw"], layers * t["step_s_per_layer"])
    return max(steps * step, tokens * 2 * params / t["forward"])


def vllm_engine(cfg, arch: dict[str, Any], params: int) -> dict[str, Any]:
    """Memory of one vLLM engine of ``cfg.evaluate.vllm`` over a model of ``arch`` / ``params``.

    Returns a dict (bytes; 1 GB = 1e9, the KV budget on CPU is whole GiB as vLLM reads it):
    ``dtype`` (engine dtype: ``evaluate.vllm.dtype``, ``auto`` = ``pool.dtype``), ``weights``
    (params x dtype bytes, all GPUs together), ``kv`` (KV cache budget: CPU ``kv_cache_gb`` GiB;
    GPU per GPU what ``gpu_memory_utilization`` x ``ray.gpu_memory_gb`` leaves after weights and
    :data:`VLLM_GPU_RESERVE`, None when no GPU memory is declared), ``kv_token_bytes`` (K and V of
    one token, all layers), ``kv_tokens`` (tokens the budget holds), ``max_model_len``, ``fits``
    (the budget holds one ``max_model_len`` request: vLLM refuses to start otherwise; None
    unknown), ``ram`` (host RSS of the engine's processes: CPU weights + KV + overhead; GPU the
    weights read on load + overhead), ``gpu`` (per GPU: the whole utilization budget; without a
    declared GPU memory the least it needs), ``tp`` (GPUs per engine), ``start_s`` (one start-up:
    :data:`VLLM_START_S` + weights at :data:`LOAD_BYTES_PER_S`) and ``note``.
    """
    from darts_bench.plan import DTYPE_BYTES

    v, kind = cfg.evaluate.vllm, _kind(cfg.device)
    dtype = cfg.pool.dtype if v.dtype == "auto" else v.dtype
    b = DTYPE_BYTES[dtype]
    weights = params * b
    kv_dim = arch["hidden_size"] // arch["num_attention_heads"] * arch["num_key_value_heads"]
    kv_token = 2 * arch["num_hidden_layers"] * kv_dim * b
    max_len = v.max_model_len or (arch.get("max_position_embeddings") or 1024) + 1
    tp = v.tensor_parallel_size
    start = VLLM_START_S[kind]["eager" if v.enforce_eager else "compiled"] + weights / tp / LOAD_BYTES_PER_S
    e = {"dtype": dtype, "weights": weights, "kv_token_bytes": kv_token, "max_model_len": max_len, "tp": tp,
         "start_s": start}
    if kind == "cpu":
        kv = v.kv_cache_gb * 2**30
        e.update(kv=kv, kv_tokens=kv // kv_token, ram=weights + kv + VLLM_ENGINE_OVERHEAD, gpu=None)
        e["fits"] = e["kv_tokens"] >= max_len
        e["note"] = (f"vLLM engine ({dtype}): weights {_gb(weights)} + KV cache {v.kv_cache_gb} GiB "
                     f"(VLLM_CPU_KVCACHE_SPACE; {e['kv_tokens']} tokens) + engine processes "
                     f"{_gb(VLLM_ENGINE_OVERHEAD)}")
        return e
    cap = cfg.ray.gpu_memory_gb * 1e9 if cfg.ray.gpu_memory_gb else None
    need = weights / tp + VLLM_GPU_RESERVE + max_len * kv_token / tp  # least: one full-length request
    e["ram"] = weights + VLLM_ENGINE_OVERHEAD  # every TP worker of the actor reads its part on load
    if cap:
        budget = v.gpu_memory_utilization * cap
        kv = max(budget - weights / tp - VLLM_GPU_RESERVE, 0.0)
        e.update(kv=kv, kv_tokens=int(kv * tp // kv_token), gpu=budget, fits=budget >= need)
        e["note"] = (f"vLLM engine ({dtype}, {tp} GPU{'s' if tp > 1 else ''}): per GPU gpu_memory_utilization "
                     f"{v.gpu_memory_utilization:g} x {cfg.ray.gpu_memory_gb:g} GB = {_gb(budget)}: weights "
                     f"{_gb(weights / tp)} + reserve {_gb(VLLM_GPU_RESERVE)} + KV cache {_gb(kv)} "
                     f"({e['kv_tokens']} tokens); host {_gb(e['ram'])}")
    else:
        e.update(kv=None, kv_tokens=None, gpu=need, fits=None)
        e["note"] = (f"vLLM engine ({dtype}, {tp} GPU{'s' if tp > 1 else ''}): takes gpu_memory_utilization "
                     f"{v.gpu_memory_utilization:g} of each GPU; needs at least {_gb(need)} per GPU (weights "
                     f"{_gb(weights / tp)} + reserve + one {max_len}-token request's KV); host {_gb(e['ram'])}")
    return e


def _engine_starts(cfg, ctx: dict[str, Any], held: bool = False) -> int:
    """vLLM engines (groups, with Ray actors) started in ``evaluate``: rows in the pipeline's
    order, every task per row. ``held=True`` (what both executors do): the judge's engine stays
    beside the current row's (in-process: ``engine_for(pin=True)``; Ray: the pinned group);
    ``held=False``: one engine alive at a time (a row of another model dir, or the AlpacaEval
    judge, replaces it), kept to show what pinning saves."""
    from darts_bench.sweeps import head_seeds, surgery_variants

    runs = len(head_seeds(cfg)) * len(surgery_variants(cfg))
    corrected = len(cfg.calibration.splits) * len(cfg.surgery.methods) * runs
    dirs = ["base", *[f"expert:{e}" for e in ctx["experts"]]]
    for m in cfg.merges:
        dirs += [m.name] * (1 + corrected)
    judge = None
    if "alpacaeval" in ctx["tasks"] and getattr(cfg.tasks.alpacaeval.judge, "annotator", None) is None:
        judge = cfg.tasks.alpacaeval.judge.model
        judge = judge.split("+", 1)[0] if "+" in judge else judge  # a corrected row runs on its merge's engine
    starts, live = 0, None
    if held:
        return sum(1 for i, d in enumerate(dirs) if d != judge and (i == 0 or dirs[i - 1] != d)) + (judge is not None)
    for d in dirs:
        for t in ctx["tasks"]:
            for want in ((d, judge) if t == "alpacaeval" and judge else (d,)):
                if want != live:
                    starts, live = starts + 1, want
    return starts


def _vllm_gen_seconds(prompt_tokens: float, new_tokens: float, params: int, kind: str, cfg,
                      engine: dict[str, Any]) -> float:
    """Generation time on a vLLM engine (seconds): on the CPU the HF estimate over the measured
    :data:`VLLM_CPU_SPEEDUP`; on the GPU prefill at the forward rate and decoding steps of
    ``max_num_seqs`` requests, each bound by reading the weights once (no HF per-step overhead)."""
    if kind == "cpu":
        return (_fwd_seconds(prompt_tokens, params, kind)
                + _decode_seconds(new_tokens, params, kind, 1, 0, 0)) / VLLM_CPU_SPEEDUP
    t = THROUGHPUT[kind]
    steps = new_tokens / cfg.evaluate.vllm.max_num_seqs
    step = engine["weights"] / engine["tp"] / t["decode_bw"]
    return _fwd_seconds(prompt_tokens, params, kind) + max(steps * step, new_tokens * 2 * params / t["forward"])


def refine(plan: dict[str, Any], cfg, ctx: dict[str, Any]) -> None:
    """Add per-stage ``memory_bytes`` (process peak), ``gpu_bytes``, ``gpu_fits``, ``seconds``,
    ``wall_seconds``, ``device_hours`` and notes to ``plan["stages"]`` in place.

    ``ctx``: what :func:`darts_bench.plan.make_plan` computed (arch, params, weights, calib,
    tasks, activations and KV-cache sizes, head params)."""
    st, arch, P, W = plan["stages"], ctx["arch"], ctx["params"], ctx["weights"]
    kind = _kind(cfg.device)
    cal, scfg, ds, rcfg = cfg.calibration, cfg.surgery, cfg.deepspeed, cfg.ray
    feat_b = ctx["feature_bytes"]
    workers = rcfg.num_actors if cfg.executor == "ray" else 1
    engine_actors = cfg.executor == "ray"
    eval_workers = workers if cfg.evaluate.backend != "vllm" or engine_actors else 1  # vLLM in the driver: one
    notes = plan["notes"]
    for name, s in st.items():
        s["process_baseline_bytes"] = PROCESS_BASELINE[name]
    if arch is None:
        return
    d, V, L = arch["hidden_size"], arch["vocab_size"], arch["num_hidden_layers"]

    # ------------------------------------------------------------------ collect
    c = st["collect"]
    work = ctx["collect_act"] + ctx["collect_kv"]
    if kind == "cuda":
        c["gpu_bytes"] = W + work
        c["memory_bytes"] = PROCESS_BASELINE["collect"] + W  # weights pass through host memory on load
    else:
        c["memory_bytes"] = PROCESS_BASELINE["collect"] + W + work
    seq = sum(v["tokens"] for k, v in ctx["calib"].items() if not k.endswith("/reference"))  # prompt + new
    decode = sum(v["sequences"] * cal.max_new_tokens for k, v in ctx["calib"].items() if not k.endswith("/reference"))
    T, M = len(ctx["tasks"]), len(cfg.merges)
    # both executors keep the latest model loaded between calls and collection runs model-major:
    # one load (Ray: one actor group) per task expert and per merge
    c["model_loads"] = T + M
    load_s = W / LOAD_BYTES_PER_S + (ACTOR_START_S if cfg.executor == "ray" else 0.0)
    c["load_seconds"] = c["model_loads"] * load_s
    c["seconds"] = (_fwd_seconds(seq - decode, P, kind) + _decode_seconds(decode, P, kind, cal.batch_size, W, L)
                    + _fwd_seconds(ctx["feature_forward_tokens"], P, kind))
    engine = vllm_engine(cfg, arch, P) if "vllm" in (cfg.evaluate.backend, cal.backend) else None
    if cal.backend == "vllm":  # the experts' continuations from a vLLM engine in the driver, beside the HF model
        c["memory_bytes"] += engine["ram"]
        if engine["gpu"] is not None:
            c["gpu_bytes"] = c.get("gpu_bytes", 0) + engine["gpu"]
        c["memory_note"] = (c.get("memory_note") or "") + f"; calibration generation: {engine['note']}"
        c["vllm_engine"] = engine
        c["engine_starts"] = T  # one per task expert (model-major collection)
        c["load_seconds"] += T * engine["start_s"]
        c["seconds"] -= _decode_seconds(decode, P, kind, cal.batch_size, W, L) + _fwd_seconds(seq - decode, P, kind)
        c["seconds"] += _vllm_gen_seconds(seq - decode, decode, P, kind, cfg, engine)

    # ------------------------------------------------------------------ train
    t = st["train"]
    splits = {k: v for k, v in ctx["calib"].items() if not k.endswith("/reference")}
    n_split = max((v["tokens"] for v in splits.values()), default=0)
    n_val = round(n_split * cal.held_out_fraction)
    ref_seq_tokens = max((ti["prompt_tokens_est"] + ti["reference_tokens_est"] for ti in ctx["tasks"].values()),
                         default=0)
    ref_seq_tokens = min(ref_seq_tokens, 2 * cal.max_prompt_tokens)
    ref_shard = rcfg.shard_size * ref_seq_tokens
    lm_heads = 2 * V * d * 4
    buffers = 2 * n_split * (d * feat_b + FEATURE_COLUMNS_BYTES)
    val_copy = 2 * n_val * d * 4
    ref_b = 2 * ref_shard * (d * feat_b + FEATURE_COLUMNS_BYTES) + 2 * min(ref_shard, DIAG_BATCH) * d * 4
    diag_tmp = DIAG_TEMPS * min(DIAG_BATCH, max(n_val, ref_shard)) * V * 4
    kl_tmp = DIAG_TEMPS * 4096 * V * 4 if scfg.entropy_source == "kl" else 0
    head_b = 16 * max(ctx["head_params"].values(), default=0)
    ds_copy = 2 * round(n_split * (1 - cal.held_out_fraction)) * d * 4 + val_copy if ds.enabled else 0
    host = PROCESS_BASELINE["train"] + lm_heads + buffers + val_copy + ref_b + head_b + ds_copy + kl_tmp
    if kind == "cuda":
        t["gpu_bytes"] = lm_heads + diag_tmp + head_b
    else:
        host += diag_tmp
    t["memory_bytes"] = host
    t["memory_note"] = (f"driver: lm_heads {_gb(lm_heads)} + split buffers {_gb(buffers)} ({n_split} tokens, "
                        f"{ctx['feature_dtype']}) + held-out float32 copy {_gb(val_copy)} + reference shard "
                        f"{_gb(ref_b)} + diagnostics logits {_gb(diag_tmp)}{' (GPU)' if kind == 'cuda' else ''}"
                        + (f" + DeepSpeed float32 copy {_gb(ds_copy)}" if ds_copy else "")
                        + f" + head/Adam {_gb(head_b)} + process {_gb(PROCESS_BASELINE['train'])}")
    ref_ans = sum(ti["n_examples"] * ti["reference_tokens_est"] for ti in ctx["tasks"].values())
    diag_tokens = sum(round(v["tokens"] * cal.held_out_fraction) for v in splits.values()) * len(cfg.merges)
    diag_tokens += ref_ans * len(cfg.merges) * len(cal.splits)
    diag_flops = diag_tokens * 2 * d * V * (2 * (1 + len(scfg.methods)) + 1)  # le, lm per call; floor once
    head_flops = t["head_train_tokens"] * 6 * 2 * d * scfg.rank
    t["seconds"] = diag_flops / THROUGHPUT[kind]["matmul"] + head_flops / THROUGHPUT[kind]["train"]
    t["diagnostics_flops"] = diag_flops

    # ------------------------------------------------------------------ evaluate
    e = st["evaluate"]
    judge_here = "alpacaeval" in ctx["tasks"] and cfg.executor != "ray"  # Ray: the judge has its own actors
    n_models = 2 if judge_here else 1
    work = ctx["eval_kv"] + ctx["eval_act"]
    if kind == "cuda":
        e["gpu_bytes"] = W * n_models + work
        e["memory_bytes"] = PROCESS_BASELINE["evaluate"] + W * n_models
    else:
        e["memory_bytes"] = PROCESS_BASELINE["evaluate"] + W * n_models + work
    e["memory_note"] = (f"per worker: weights x {n_models}{' (model + judge)' if n_models > 1 else ''} + KV cache "
                        f"{_gb(ctx['eval_kv'])} (batch {cfg.tasks.batch_size}) + prefill {_gb(ctx['eval_act'])}"
                        f" + process {_gb(PROCESS_BASELINE['evaluate'])}")
    vllm_eval = cfg.evaluate.backend == "vllm"
    # in-process on the CPU the local judge's engine is kept beside the row's (engine_for(pin=True))
    judge_beside = (vllm_eval and not engine_actors and kind == "cpu" and "alpacaeval" in ctx["tasks"]
                    and getattr(cfg.tasks.alpacaeval.judge, "annotator", None) is None)
    if vllm_eval:  # one engine per evaluation process/actor, no HF model loaded
        e["memory_bytes"] = PROCESS_BASELINE["evaluate"] + engine["ram"] * (2 if judge_beside else 1)
        e.pop("gpu_bytes", None)
        if engine["gpu"] is not None:
            e["gpu_bytes"] = engine["gpu"]
        e["memory_note"] = (f"per evaluation process/actor: {engine['note']}"
                            + (" (x 2: the judge's engine beside the row's)" if judge_beside else "") + " + process "
                            f"{_gb(PROCESS_BASELINE['evaluate'])}")
        e["vllm_engine"] = engine
    if engine is not None and engine["fits"] is False:
        notes.append(f"vLLM: the KV cache budget holds {engine['kv_tokens']} tokens, less than one "
                     f"{engine['max_model_len']}-token request (evaluate.vllm.max_model_len): the engine will not "
                     "start; raise " + ("evaluate.vllm.kv_cache_gb" if kind == "cpu" else
                                        "evaluate.vllm.gpu_memory_utilization or tensor_parallel_size")
                     + " or lower max_model_len")
    secs = 0.0
    rows = plan["rows"]
    def gen(prompt_tokens: float, new_tokens: float) -> float:
        if vllm_eval:
            return _vllm_gen_seconds(prompt_tokens, new_tokens, P, kind, cfg, engine)
        return (_fwd_seconds(prompt_tokens, P, kind)
                + _decode_seconds(new_tokens, P, kind, cfg.tasks.batch_size, W, L))

    for name, ti in ctx["tasks"].items():
        n = ti["n_examples"] * ti["n_samples"]
        secs += rows * (gen(n * ti["prompt_tokens_est"], n * ti["max_new_tokens"])
                        + _fwd_seconds(ti["n_examples"] * (ti["prompt_tokens_est"] + ti["reference_tokens_est"]), P, kind))
        if name == "alpacaeval":
            j = cfg.tasks.alpacaeval.judge
            pairs = rows * ti["n_examples"] * (2 if j.both_orders else 1)
            secs += gen(e["judge_tokens"] - pairs * j.max_new_tokens, pairs * j.max_new_tokens)
    # one load per model dir (the backend's model cache; with Ray an actor group per model dir, kept across its rows
    # and tasks, the judge's group pinned), whatever the executor
    e["model_loads"] = len(cfg.merges) + 1 + len(ctx["experts"])
    e["load_seconds"] = e["model_loads"] * load_s
    if vllm_eval:  # engine starts instead of HF loads (the engine runs in the evaluating process)
        # one after the other; the judge's held (Ray: its pinned group; in-process on the CPU: pinned)
        e["model_loads"] = _engine_starts(cfg, ctx, held=engine_actors or kind == "cpu")
        e["engine_starts"] = e["model_loads"] * eval_workers  # with Ray actors: a group each time
        e["load_seconds"] = e["model_loads"] * engine["start_s"]
        e["where"] = (f"vLLM: one engine per Ray actor, {workers} actors per model dir" if engine_actors else
                      "vLLM: one engine in the driver process" + (" (not in the Ray actors)" if workers > 1 else "")
                      ) + "; " + e["where"]
        notes.append(f"vLLM start-up: {e['engine_starts']} engine starts in evaluate"
                     + (f" (+{c['engine_starts']} in collect)" if c.get("engine_starts") else "")
                     + f", {VLLM_START_RANGE[kind]}; budgeted at {_dur(engine['start_s'])} each "
                       "(start-up + reading the weights) in the time column")
    e["seconds"] = secs

    # ------------------------------------------------------------------ pool
    p = st["pool"]
    if p.get("train_tokens"):
        p["seconds"] = p["train_tokens"] * 6 * P / THROUGHPUT[kind]["train"]
    if p.get("memory_bytes") is not None:
        p["memory_bytes"] = p["memory_bytes"] + PROCESS_BASELINE["pool"]
    m = st["merge"]
    if m.get("memory_bytes") is not None:
        m["memory_bytes"] = m["memory_bytes"] + PROCESS_BASELINE["merge"]

    # ------------------------------------------------------------------ totals and flags
    for name, n in (("collect", workers), ("evaluate", eval_workers)):  # loads on all actors at once; work spread
        st[name]["wall_seconds"] = st[name]["seconds"] / n + st[name]["load_seconds"]
        st[name]["seconds"] += st[name]["load_seconds"] * n
    for name in ("pool", "train"):
        if "seconds" in st[name]:
            st[name]["wall_seconds"] = st[name]["seconds"]
    per_hour = 1 if kind == "cuda" else 2  # measured CPU rates are 2-core rates
    for s in st.values():
        if "seconds" in s:
            s["device_hours"] = s["seconds"] * per_hour / 3600
    plan["totals"]["device_hours"] = sum(s.get("device_hours", 0) for s in st.values())
    plan["totals"]["device_hours_unit"] = "GPU-hours" if kind == "cuda" else "CPU-core-hours"
    plan["totals"]["wall_seconds"] = sum(s.get("wall_seconds", 0) for s in st.values())
    plan["throughput"] = THROUGHPUT[kind]["source"]
    if engine is not None:
        plan["throughput"] += ("; vLLM generation at 1/%g of the HF CPU time (measured vLLM/HF tokens/s)" % VLLM_CPU_SPEEDUP
                               if kind == "cpu" else "; vLLM decoding steps of max_num_seqs requests, each "
                               "reading the weights once (no HF per-step overhead)")
    cap = rcfg.gpu_memory_gb * 1e9 if rcfg.gpu_memory_gb else None
    for name, s in st.items():
        if "gpu_bytes" in s and cap:
            s["gpu_fits"] = s["gpu_bytes"] <= cap
            if s.get("vllm_engine") and s["vllm_engine"]["fits"] is False:  # noted above (KV budget)
                s["gpu_fits"] = False
            if s["gpu_bytes"] > cap:
                notes.append(f"{name}: needs {_gb(s['gpu_bytes'])} of GPU memory per actor; the config declares "
                             f"{rcfg.gpu_memory_gb:g} GB (ray.gpu_memory_gb)")
    if kind == "cuda" and not cap:
        notes.append("ray.gpu_memory_gb not set: GPU memory per actor is not checked")


def _gb(n: float | None) -> str:
    from darts_bench.plan import _gb as gb

    return gb(n)


def _dur(sec: float) -> str:
    from darts_bench.plan import _dur as dur

    return dur(sec)
