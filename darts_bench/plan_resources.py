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
    secs = 0.0
    rows = plan["rows"]
    for name, ti in ctx["tasks"].items():
        n = ti["n_examples"] * ti["n_samples"]
        secs += rows * (_fwd_seconds(n * ti["prompt_tokens_est"], P, kind)
                        + _decode_seconds(n * ti["max_new_tokens"], P, kind, cfg.tasks.batch_size, W, L)
                        + _fwd_seconds(ti["n_examples"] * (ti["prompt_tokens_est"] + ti["reference_tokens_est"]), P, kind))
        if name == "alpacaeval":
            j = cfg.tasks.alpacaeval.judge
            pairs = rows * ti["n_examples"] * (2 if j.both_orders else 1)
            secs += (_fwd_seconds(e["judge_tokens"] - pairs * j.max_new_tokens, P, kind)
                     + _decode_seconds(pairs * j.max_new_tokens, P, kind, cfg.tasks.batch_size, W, L))
    if cfg.executor == "ray":  # one actor group per (row, task) and one for the judge per judged row
        e["model_loads"] = rows * len(ctx["tasks"]) + (rows if "alpacaeval" in ctx["tasks"] else 0)
    else:
        e["model_loads"] = len(cfg.merges) + 1 + len(ctx["experts"])  # one per model dir (ModelCache)
    e["load_seconds"] = e["model_loads"] * load_s
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
    for name in ("collect", "evaluate"):  # loads happen on all actors at once; work is spread over them
        st[name]["wall_seconds"] = st[name]["seconds"] / workers + st[name]["load_seconds"]
        st[name]["seconds"] += st[name]["load_seconds"] * workers
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
    cap = rcfg.gpu_memory_gb * 1e9 if rcfg.gpu_memory_gb else None
    for name, s in st.items():
        if "gpu_bytes" in s and cap:
            s["gpu_fits"] = s["gpu_bytes"] <= cap
            if not s["gpu_fits"]:
                notes.append(f"{name}: needs {_gb(s['gpu_bytes'])} of GPU memory per actor; the config declares "
                             f"{rcfg.gpu_memory_gb:g} GB (ray.gpu_memory_gb)")
    if kind == "cuda" and not cap:
        notes.append("ray.gpu_memory_gb not set: GPU memory per actor is not checked")


def _gb(n: float | None) -> str:
    from darts_bench.plan import _gb as gb

    return gb(n)
