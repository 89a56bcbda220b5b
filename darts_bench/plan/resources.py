"""The resource model of the plan: measured and assumed rates, and what one vLLM engine holds.

The stage estimates (:mod:`darts_bench.plan.stages`) read these constants and helpers; what each
stage counts is written there once.

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
per lm_head matmul token) or in elements (AdaMerging's recombination of the task vectors) over a
stated throughput (:data:`THROUGHPUT`), plus a fixed time per head optimiser step: on the CPU the
rates measured with SmolLM2-135M on 2 cores (``LAB-NOTES.md``) taken as FLOP/s and assumed to scale
with FLOPs, and the data merges' and the train stage's rates fitted to the logged stage times of
the committed reference run (``results/smollm2-135m/TIMINGS.md``; each constant says which lines);
on ``cuda`` an assumed A100/H100-class GPU (bf16 forward at 40% of 312 TFLOP/s; a decoding step
bound by reading the weights once at 1.5 TB/s, and by 25 ms per 32 layers of HF ``generate``
overhead; fp32 diagnostics and fp64 Grams at 10 TFLOP/s).
``device_hours`` are GPU-hours on ``cuda`` (all actors together), else CPU-hours (2-core units
counted as 2); ``wall_seconds`` divides by the actors working at once. Expect a factor of 2 either
way: these are budgets, not measurements.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from darts_bench.plan.architecture import DTYPE_BYTES, kv_dim
from darts_bench.plan.units import gb

# Peak RSS of a process that runs the stage on a negligible model: imports + allocator pools.
# Measured with ``python -m darts_bench.plan.measure`` on the micro pool (tests/conftest.py, suite gsm8k;
# 2-core x86 CPU, torch 2.13 CPU, transformers 5.24): 477 / 445 / 440 / 439 / 557 MB for pool / merge /
# collect / train / evaluate, less the working set this module estimates for that pool. Bytes.
PROCESS_BASELINE = {"pool": 0.455e9, "merge": 0.445e9, "collect": 0.41e9, "train": 0.44e9, "evaluate": 0.55e9,
                    "report": 0.45e9}
# Measured (CPU) / assumed (GPU) throughput, FLOP/s or B/s; see the module docstring. The keys:
# forward / decode / train: FLOP/s of a model's forward, HF generation and training (2 / 2 / 6 x params per token).
# vocab: FLOP/s of the diagnostics' vocabulary-sized work (darts_bench.surgery.diagnostics.Diagnostics.many),
#   counted as its lm_head matmuls (2 d V FLOPs per token and matmul); the rate carries the log-softmaxes, KL and
#   argmax passes over V that go with each matmul, so re-set it (not the count) when those get cheaper.
# fp64: FLOP/s of RegMean's fp64 Gram products, G W^T products and solves (darts_bench.merge.regmean).
# recombine: task-vector elements per second through AdaMerging's theta_base + sum_k lambda_k tau_k (one
#   recombination touches K x params elements; darts_bench.merge.adamerging.LayerWiseMerge.params).
# head_step_s: seconds per head optimiser step beyond its FLOPs (batch gather, Python, Adam over the head).
# logits: FLOP/s (2 x params per token) of a forward that also takes the full-vocabulary logits at every position
#   with their log-softmax or entropy: collection's feature forwards (darts_bench.collect: hidden states and
#   next-token entropies) and vLLM's teacher-forced scoring (prompt_logprobs: the reference NLL and a forced-choice
#   judge), where forward is generation's prefill (logits at the last position only) and the HF scoring path
#   (lm_head at the continuation positions only).
_SMOL = 134_515_008
LOGITS_TOK_S = 405  # SmolLM2-135M tokens/s of a full-logits forward on the 2 cores (see "logits" below)
THROUGHPUT = {
    "cpu": {"forward": 600 * 2 * _SMOL, "decode": 68 * 2 * _SMOL, "train": 180 * 6 * _SMOL,
            # vocab: the fp32 rate of the diagnostics' [512, 576] x [576, 49152] lm_head product on an Intel Xeon's 2
            # cores, 212-279 GFLOP/s over 2026-12-05 (the machine's speed drifted; the constant before, 95, was
            # benchmarks/bench_collect.py's matmul rate); vocab_pass, head_step_s: least squares over the 24
            # train-stage lines of the reference settings' run with the reference answers diagnosed once per (merge,
            # task, split) and DARTS tables trained over the rows in use (results/smollm2-135m-2026-12-05-train at ff57251
            # TIMINGS.md, Intel Xeon; `python scripts/fit_train_rates.py LOG --vocab 250e9`, the per-line table
            # there): 357 M elements/s and 1.67 ms per step (Surgery and DARTS steps together). (Run 16, the code
            # before: 937 M at 95 GFLOP/s and 2.69 ms; run 4's three calls per stream on an AMD EPYC: 250 M
            # elements/s and 2.16 ms.)
            "vocab": 250e9, "vocab_pass": 3.57e8, "head_step_s": 1.67e-3,
            # logits: run 4's 18 merged feature sets, 125,570 tokens in 310.4 s (405 tok/s, with the stores), and the
            # AlpacaEval judge's prompt_logprobs scoring in runs 5-6 (TIMINGS.md); LOGITS_TOK_S tokens/s
            "logits": LOGITS_TOK_S * 2 * _SMOL,
            # fp64: RegMean 138.8 s (TIMINGS.md; 19,379 prompt tokens) less its forwards at the forward rate and
            # its loads = 103.8 s for 5.85 TFLOP of fp64 work: 56 GFLOP/s (the 2026-12-02 rerun, 26,906
            # tokens, 201.5 s: 51 GFLOP/s)
            "fp64": 55e9,
            # recombine: AdaMerging 305.8 s (TIMINGS.md: 30 steps, 45 batches of 4 prompts, 19,379 tokens) and
            # 515.4 s (the 2026-12-02 rerun, results/smollm2-135m-rerun-2026-12-02/TIMINGS.md at 9943363: 60 steps, 60
            # batches, 26,906 tokens), less their forwards, backwards and loads: 166.7 s and 273.5 s for 90 + 30
            # and 120 + 60 (no-grad + with-backward) recombinations of 3 x 134.5M elements: 1.0 s each, x
            # RECOMBINE_BACKWARD with the backward
            "recombine": 4.0e8,
            # svd: m * n * min(m, n) per second of torch.linalg.svd (thin) on one SmolLM2-135M layer's matrices, one
            # torch thread (the presets' torch_threads), 2 AMD EPYC cores shared with other jobs, 2026-12-06
            # (benchmarks/svd_merges/svd_layer.log): [1536, 576] fp32 0.154 s (3.3e9), fp64 0.200 s
            # (2.6e9), [576, 576] 0.100 s (1.9e9), the [49152, 576] embedding 2.25 s (7.3e9): 2.5e9 for the layers
            # (the embedding is faster per element); TSV-M of the SmolLM2-135M pool then plans 150 s, measured 141 s
            "svd": 2.5e9,
            "source": "SmolLM2-135M on 2 CPU cores (LAB-NOTES): forward 600 tok/s, generation 68 tok/s at batch 8, "
                      "training 180 tok/s; taken as FLOP/s; diagnostics 250 GFLOP/s of lm_head matmuls and 357 M "
                      "elements/s of passes over the vocabulary, RegMean fp64 55 GFLOP/s, AdaMerging recombination "
                      "4e8 elements/s, 1.67 ms per head step (fitted to results/smollm2-135m/TIMINGS.md and, the "
                      "train stage, to results/smollm2-135m-2026-12-05-train/TIMINGS.md at ff57251)"},
    "cuda": {"forward": 0.4 * 312e12, "logits": 0.4 * 312e12, "decode_bw": 1.5e12, "step_s_per_layer": 0.025 / 32, "train": 0.4 * 312e12,
             # assumed: the passes over V are small beside the d x V matmul at 7B widths; fp64 Grams as fp32
             # diagnostics (A100 fp64 tensor cores: 19.5 TFLOP/s peak); recombination bound by reading and writing
             # ~20 B per task-vector element at 1.5 TB/s; 1 ms per eager Adam step of a small head
             "vocab": 10e12, "vocab_pass": 1e11, "fp64": 10e12, "recombine": 1.5e12 / 20, "head_step_s": 1e-3,
             # svd: assumed (not measured here: no GPU was lent), m * n * min(m, n) per second of cuSOLVER's thin SVD
             "svd": 1e11,
             "source": "assumed GPU: bf16 at 40% of 312 TFLOP/s; a decoding step reads the weights once at "
                       "1.5 TB/s but takes at least 25 ms per 32 layers (HF generate, eager); fp32 diagnostics "
                       "at 10 TFLOP/s"},
}
# An AdaMerging step's recombination with its backward (gradients to lambda: one reduction per task vector
# and parameter tensor, autograd's temporaries), in no-grad recombinations: fitted with "recombine" to the
# 30- and 60-step runs above (2.56).
RECOMBINE_BACKWARD = 2.5
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
# Start-up of one engine (seconds, besides reading the weights at LOAD_BYTES_PER_S): on the CPU with
# enforce_eager, SmolLM2-135M alone on 2 cores, from the request to the engine's first call (the previous engine's
# shutdown and vLLM's own "up in" time). Since an engine's shutdown stopped waiting 10 s for Python's resource
# tracker (2026-12-04): "up in" 18.8-25.1 s for the 9 engines of run 19 (results/smollm2-135m-2026-12-05-run19 at 34443d6,
# AMD EPYC), 19.9-25.6 s in run 17 (36.8 s the first), plus 5-6 s shutting the previous one down. Before: 63, 38,
# 39 s for the calibration engines of run 4 and 39, 43, 47 s in run 5's evaluation (results/smollm2-135m/TIMINGS.md);
# 104 s was seen on a loaded box (README "vLLM backend"), 327 s the first time with compilation; GPU assumed.
VLLM_START_S = {"cpu": {"eager": 25.0, "compiled": 330.0}, "cuda": {"eager": 60.0, "compiled": 180.0}}
# Loading another checkpoint into a running engine in place (evaluate.vllm.reload_weights, VLLMEngine.reload;
# seconds besides reading the weights at LOAD_BYTES_PER_S): the RPC, vLLM's layerwise reload, the tied lm_head's
# packing, emptying the prefix cache. Measured 0.44-0.73 s in all for SmolLM2-135M float32 (0.54 GB read from the
# page cache) against 23.9-26.5 s for shutting an engine down and starting the next (AMD EPYC, 2 cores;
# benchmarks/bench_vllm_engine_switch.py, results/bench-2026-12-05/vllm_engine_switch_smollm2.log at 41a2363).
VLLM_RELOAD_S = 0.1
VLLM_START_RANGE = {"cpu": "19-26 s per engine measured on 2 idle CPU cores with enforce_eager (2026-12-05; 104 s "
                           "seen on a loaded box, 327 s compiled)",
                    "cuda": "60 s per engine assumed on GPU with enforce_eager (180 s with CUDA graphs)"}
# vLLM / HF generation tokens/s on CPU, measured (README "vLLM backend": SmolLM2-135M, batch 8,
# fp32, 3.04x; LAB-NOTES 4.9x on an idler box): the CPU decoding time is divided by it (prefill at the forward rate).
VLLM_CPU_SPEEDUP = 3.0
# With ``executor: ray`` each Ray actor holds one vLLM engine, ``ray.num_actors`` of them per model dir,
# data-parallel over prompts (``RayExecutor.vllm_text_model``; the vLLM backend holds one group per
# current and pinned model dir). In-process, one engine per model dir and the pinned judge's beside it
# (:meth:`darts_bench.evaluate.engines.vllm.VLLMBackend.engine_for`).
DIAG_BATCH = 2048  # tokens per diagnostics matmul (darts_bench.surgery.diagnostics.Diagnostics)
DIAG_TEMPS = 8  # [DIAG_BATCH, V] float32 tensors alive at once (logits, log-softmaxes, products)
FEATURE_COLUMNS_BYTES = 4 + 8 + 8  # entropy fp32, positions and seq_index int64 per token


def device_kind(device: str) -> str:
    """``"cuda"`` for a ``cuda[:N]`` device, else ``"cpu"`` (the key of :data:`THROUGHPUT`)."""
    return "cuda" if str(device).startswith("cuda") else "cpu"


def forward_seconds(tokens: float, params: int, kind: str, rate: str = "forward") -> float:
    """Seconds to forward ``tokens`` through a ``params``-parameter model (2 FLOPs per parameter) at
    ``THROUGHPUT[kind][rate]``: ``"forward"`` (prefill, HF scoring) or ``"logits"`` (full-vocabulary
    logits at every position: collection's features, vLLM's ``prompt_logprobs``)."""
    return tokens * 2 * params / THROUGHPUT[kind][rate]


def decode_seconds(tokens: float, params: int, kind: str, batch: int, weights: float, layers: int) -> float:
    """Seconds to generate ``tokens`` with HF ``generate`` at ``batch`` sequences a step: on the CPU
    at the measured decoding rate; on the GPU each step bound by reading ``weights`` bytes once or
    by the per-layer step overhead, and never faster than the forward rate."""
    t = THROUGHPUT[kind]
    if kind == "cpu":  # measured at batch 8; decoding per token assumed batch-independent
        return tokens * 2 * params / t["decode"]
    steps = tokens / max(batch, 1)
    step = max(weights / t["decode_bw"], layers * t["step_s_per_layer"])
    return max(steps * step, tokens * 2 * params / t["forward"])


def vllm_generation_seconds(prompt_tokens: float, new_tokens: float, params: int, kind: str, cfg,
                            engine: dict[str, Any], requests: float | None = None) -> float:
    """Generation time on a vLLM engine (seconds): on the CPU prefill at the forward rate and the HF
    decoding estimate over the measured :data:`VLLM_CPU_SPEEDUP`; on the GPU prefill at the forward rate and decoding steps of
    ``min(max_num_seqs, requests)`` requests (``requests``: those one ``generate`` call holds;
    None: enough to fill ``max_num_seqs``), each bound by reading the weights once (no HF
    per-step overhead)."""
    if kind == "cpu":
        return (forward_seconds(prompt_tokens, params, kind)
                + decode_seconds(new_tokens, params, kind, 1, 0, 0) / VLLM_CPU_SPEEDUP)
    t = THROUGHPUT[kind]
    seqs = cfg.evaluate.vllm.max_num_seqs
    steps = new_tokens / (seqs if requests is None else max(1.0, min(seqs, requests)))
    step = engine["weights"] / engine["tp"] / t["decode_bw"]
    return forward_seconds(prompt_tokens, params, kind) + max(steps * step, new_tokens * 2 * params / t["forward"])


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
    :data:`VLLM_START_S` + weights at :data:`LOAD_BYTES_PER_S`), ``reload_s`` (another checkpoint's weights
    loaded into the running engine: :data:`VLLM_RELOAD_S` + weights at :data:`LOAD_BYTES_PER_S`) and ``note``.
    """
    v, kind = cfg.evaluate.vllm, device_kind(cfg.device)
    dtype = v.engine_dtype(cfg.pool.dtype)
    b = DTYPE_BYTES[dtype]
    weights = params * b
    kv_token = 2 * arch["num_hidden_layers"] * kv_dim(arch) * b
    max_len = v.max_model_len or (arch.get("max_position_embeddings") or 1024) + 1
    tp = v.tensor_parallel_size
    start = VLLM_START_S[kind]["eager" if v.enforce_eager else "compiled"] + weights / tp / LOAD_BYTES_PER_S
    e = {"dtype": dtype, "weights": weights, "kv_token_bytes": kv_token, "max_model_len": max_len, "tp": tp,
         "start_s": start, "reload_s": VLLM_RELOAD_S + weights / tp / LOAD_BYTES_PER_S}
    if kind == "cpu":
        kv = v.kv_cache_gb * 2**30
        e.update(kv=kv, kv_tokens=kv // kv_token, ram=weights + kv + VLLM_ENGINE_OVERHEAD, gpu=None)
        e["fits"] = e["kv_tokens"] >= max_len
        e["note"] = (f"vLLM engine ({dtype}): weights {gb(weights)} + KV cache {v.kv_cache_gb} GiB "
                     f"(VLLM_CPU_KVCACHE_SPACE; {e['kv_tokens']} tokens) + engine processes "
                     f"{gb(VLLM_ENGINE_OVERHEAD)}")
        return e
    cap = cfg.ray.gpu_memory_gb * 1e9 if cfg.ray.gpu_memory_gb else None
    need = weights / tp + VLLM_GPU_RESERVE + max_len * kv_token / tp  # least: one full-length request
    e["ram"] = weights + VLLM_ENGINE_OVERHEAD  # every TP worker of the actor reads its part on load
    if cap:
        budget = v.gpu_memory_utilization * cap
        kv = max(budget - weights / tp - VLLM_GPU_RESERVE, 0.0)
        e.update(kv=kv, kv_tokens=int(kv * tp // kv_token), gpu=budget, fits=budget >= need)
        e["note"] = (f"vLLM engine ({dtype}, {tp} GPU{'s' if tp > 1 else ''}): per GPU gpu_memory_utilization "
                     f"{v.gpu_memory_utilization:g} x {cfg.ray.gpu_memory_gb:g} GB = {gb(budget)}: weights "
                     f"{gb(weights / tp)} + reserve {gb(VLLM_GPU_RESERVE)} + KV cache {gb(kv)} "
                     f"({e['kv_tokens']} tokens); host {gb(e['ram'])}")
    else:
        e.update(kv=None, kv_tokens=None, gpu=need, fits=None)
        e["note"] = (f"vLLM engine ({dtype}, {tp} GPU{'s' if tp > 1 else ''}): takes gpu_memory_utilization "
                     f"{v.gpu_memory_utilization:g} of each GPU; needs at least {gb(need)} per GPU (weights "
                     f"{gb(weights / tp)} + reserve + one {max_len}-token request's KV); host {gb(e['ram'])}")
    return e


def plans_reloads(cfg) -> bool:
    """Whether the plan counts model-dir switches of the in-process engine as in-place loads
    (``evaluate.vllm.reload_weights``, not with Ray actors): only for a pool built here (``pool.kind``
    ``tiny`` or ``gguf``: one tokenizer and config for the base, the experts and the merges). A hub pool's
    checkpoints are compared at run time (``VLLMEngine.reload_blocker``: config.json, tokenizer files,
    tensor names); they often differ (a vocabulary padded by one token, another publisher's tokenizer
    files), so the plan counts a start per switch there, an upper bound."""
    return (cfg.executor != "ray" and cfg.evaluate.vllm.reload_weights
            and getattr(cfg.pool, "kind", "hf") in ("tiny", "gguf"))


def engine_loads(row_dirs: Sequence[str], tasks: Sequence[str], judges: Mapping[str, str],
                 held: bool = False, reload: bool = False) -> tuple[int, int]:
    """``(starts, reloads)``: vLLM engines (groups, with Ray actors) started in ``evaluate``, and
    checkpoints loaded into a running engine in place (``evaluate.vllm.reload_weights``,
    in-process only): every model dir the unpinned engine moves to after its first, as for a pool
    built here (:func:`plans_reloads`). ``row_dirs``, ``tasks``,
    ``judges`` and ``held`` as in :func:`engine_starts`."""
    switches = engine_starts(row_dirs, tasks, judges, held=held)
    if not reload:
        return switches, 0
    pinned = len({j.split("+", 1)[0] for j in judges.values()}) if held else 0
    moves = switches - pinned  # the unpinned engine's: its first start, then one per model dir it moves to
    return pinned + min(moves, 1), max(moves - 1, 0)


def engine_starts(row_dirs: Sequence[str], tasks: Sequence[str], judges: Mapping[str, str],
                  held: bool = False) -> int:
    """vLLM engines (groups, with Ray actors) started in ``evaluate`` when every other model dir
    starts a new one (``evaluate.vllm.reload_weights: false``, or Ray actors; :func:`engine_loads`
    counts the in-place loads instead).

    Args:
        row_dirs: the model dir of each evaluated row in the pipeline's order, as the row name of
            the model it runs (``base``, ``expert:code``, a merge name for a merge and each of its
            corrected rows).
        tasks: the evaluated tasks, in order (every task runs on a row before the next row).
        judges: task -> the local judge model it loads through ``EvalContext.get_model`` (a row
            name; a corrected row ``<merge>+...`` runs on its merge's engine); tasks without one absent.
        held: True (what both executors do): each judge's engine stays beside the current row's
            (in-process ``engine_for(pin=True)``; Ray: the pinned group); False: one engine alive
            at a time (a row of another model dir, or a judge, replaces it), kept to show what
            pinning saves.
    """
    judge_dir = {t: j.split("+", 1)[0] for t, j in judges.items()}
    pinned = set(judge_dir.values())
    if held:
        return (sum(1 for i, d in enumerate(row_dirs) if d not in pinned and (i == 0 or row_dirs[i - 1] != d))
                + len(pinned))
    starts, live = 0, None
    for d in row_dirs:
        for t in tasks:
            for want in ((d, judge_dir[t]) if t in judge_dir else (d,)):
                if want != live:
                    starts, live = starts + 1, want
    return starts
