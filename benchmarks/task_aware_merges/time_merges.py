"""Time EMR-Merging and Expert Merging (their defaults) on a pool: ``micro`` (the tests' micro pool, built under
/tmp/h59b/micro) or ``smollm2 POOL_DIR`` (a built smollm2-135m pool dir with base/, code/, math/, instruction/, read
only). One torch thread; each merge written to a temp dir and removed. Prints ``RESULT <pool> {json}``:
``emr`` and ``expert_merging`` seconds (build_emr / build_expert_merging, loads and writes included),
Expert Merging's per-step losses and mean coefficients.

    PYTHONPATH=. python benchmarks/task_aware_merges/time_merges.py micro
    PYTHONPATH=. python benchmarks/task_aware_merges/time_merges.py smollm2 work/pool/gguf-<key>
"""
import json, logging, sys, time, shutil
from pathlib import Path
logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
import torch
torch.set_num_threads(1)
sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent / "tests"))
from darts_bench.config import MergeSpec, load_config
from darts_bench.merge.emr import build_emr
from darts_bench.merge.expert_merging import build_expert_merging
from darts_bench.merge.data import prompts_by_task
from darts_bench.stages.tasks import load_tasks

which = sys.argv[1]
import tempfile
out_root = Path(tempfile.mkdtemp(prefix="bench-task-aware-")); out_root.mkdir(exist_ok=True)
if which == "smollm2":
    from conftest import SMOLLM2_2026_12_05
    cfg = load_config("smollm2-135m", [*SMOLLM2_2026_12_05, "torch_threads=1"])
    root = Path(sys.argv[2])
    base, experts = root / "base", {e: root / e for e in ("code", "math", "instruction")}
else:
    from conftest import micro_config_file
    from darts_bench.pipeline import Pipeline
    d = out_root / "micro"; d.mkdir(exist_ok=True)
    cfg = load_config(str(micro_config_file(d)))
    pipe = Pipeline(cfg); pool = pipe.pool()
    base, experts = pool.base, dict(pool.experts)
names = ["humaneval", "gsm8k", "alpacaeval"]
res = {}
for spec in (MergeSpec(name="emr", method="emr"), MergeSpec(name="em", method="expert_merging")):
    out = out_root / f"{which}-{spec.name}"
    shutil.rmtree(out, ignore_errors=True); out.mkdir()
    if spec.method == "emr":
        t0 = time.perf_counter(); build_emr(spec, base, experts, cfg, out); res["emr"] = time.perf_counter() - t0
    else:
        loaded = load_tasks(cfg, names, base, {t: getattr(cfg.tasks, t).limit for t in names})
        prompts = prompts_by_task(cfg, loaded, spec.calibration_split)
        t0 = time.perf_counter()
        rec = build_expert_merging(spec, base, experts, prompts, loaded.tokenizer, cfg, out)
        res["expert_merging"] = time.perf_counter() - t0
        res["em_loss"] = [h["loss"] for h in rec["loss"]["per_step"]]
        res["em_mean_coefficient"] = rec["mean_coefficient"]
    print(which, res, flush=True)
    shutil.rmtree(out, ignore_errors=True)
print("RESULT", which, json.dumps(res), flush=True)
