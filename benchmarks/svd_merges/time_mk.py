import json, sys, time, shutil
from pathlib import Path
import torch
torch.set_num_threads(1)
from darts_bench.config import MergeSpec
from darts_bench.merge.mergekit_merge import merge_config_dict, run_one_merge
from darts_bench.merge.svd import build_svd_merge
from darts_bench.pool.build import Pool
root = Path(sys.argv[1])
pool = Pool(base=root / "base", experts={e: root / e for e in ("code", "math", "instruction")}, key="t")
specs = [MergeSpec(name="ties", method="ties", density=0.2, normalize=True), MergeSpec(name="della", method="della", density=0.2),
         MergeSpec(name="della_linear", method="della_linear", density=0.2, weight=0.3),
         MergeSpec(name="breadcrumbs", method="breadcrumbs", density=0.2, weight=0.3),
         MergeSpec(name="breadcrumbs_ties", method="breadcrumbs_ties", density=0.2, normalize=True),
         MergeSpec(name="model_stock", method="model_stock"), MergeSpec(name="tsv_m", method="tsv_m")]
for spec in specs:
    d = Path(f"/tmp/h59a/mk-{spec.name}"); shutil.rmtree(d, ignore_errors=True)
    t = time.perf_counter()
    if spec.method == "tsv_m":
        d.mkdir(); build_svd_merge(spec, pool.base, dict(pool.experts), d)
    else:
        run_one_merge(merge_config_dict(spec, pool), d, 0, pool.base)
    print(json.dumps({spec.name: round(time.perf_counter() - t, 2)}), flush=True)
    shutil.rmtree(d, ignore_errors=True)
