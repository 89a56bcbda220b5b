"""One-off timing of the SVD merges on a pool (read-only), written into /tmp."""
import json, sys, time, shutil, logging
from pathlib import Path
import torch
torch.set_num_threads(int(sys.argv[2]))
from darts_bench.config import MergeSpec
from darts_bench.merge.svd import build_svd_merge
from darts_bench.merge.build import _svd_or_svc
from darts_bench.merge.mergekit_merge import merge_config_dict
from darts_bench.pool.build import Pool
root = Path(sys.argv[1])
pool = Pool(base=root / "base", experts={e: root / e for e in ("code", "math", "instruction")}, key="t")
out = {}
for spec in [MergeSpec(name="tsv", method="tsv_m"), MergeSpec(name="isoc", method="iso_c"),
             MergeSpec(name="isocts", method="iso_cts"),
             MergeSpec(name="ties-svc", method="ties", density=0.2, normalize=True, svc_alpha=0.1)][: int(sys.argv[3])]:
    d = Path(f"/tmp/h59a/m-{spec.name}")
    shutil.rmtree(d, ignore_errors=True); d.mkdir()
    t = time.perf_counter()
    if spec.method in ("tsv_m", "iso_c", "iso_cts"):
        s = build_svd_merge(spec, pool.base, dict(pool.experts), d)
    else:
        _svd_or_svc(spec, merge_config_dict(spec, pool), pool, d, 0)
        s = json.loads((d / "svd_merge.json").read_text())
    out[spec.name] = {"wall_s": round(time.perf_counter() - t, 2), **{k: v for k, v in s.items() if "seconds" in k or k == "svc"}}
    shutil.rmtree(d, ignore_errors=True)
    print(json.dumps(out[spec.name]), flush=True)
print(json.dumps(out))
