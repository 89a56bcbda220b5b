import json, os, sys, collections
from pathlib import Path
ev = Path("/work/smol-work/eval"); cut = float(sys.argv[1])
groups = collections.defaultdict(list)
for d in ev.iterdir():
    if d.name.startswith(".") or not (d / "result.json").exists():
        continue
    m = json.loads((d / "_manifest.json").read_text())["meta"]
    groups[(m["row"], m["task"])].append(d)
tot = same = 0; cells = []
for k, ds in sorted(groups.items()):
    hf = [d for d in ds if (d / "result.json").stat().st_mtime < cut]
    vl = [d for d in ds if (d / "result.json").stat().st_mtime >= cut]
    if len(hf) != 1 or len(vl) != 1:
        continue
    a, b = (json.loads((x[0] / "result.json").read_text()) for x in (hf, vl))
    def outs(r):
        return [s.get("response", s.get("output", s.get("completion"))) for s in r["samples"]]
    oa, ob = outs(a), outs(b)
    n = sum(x == y for x, y in zip(oa, ob)); tot += len(oa); same += n
    mk = {kk: (a["metrics"].get(kk), b["metrics"].get(kk)) for kk in a["metrics"] if a["metrics"].get(kk) != b["metrics"].get(kk)}
    cells.append((k, n, len(oa), mk))
for c in cells:
    print(c[0], f"{c[1]}/{c[2]} identical", "metrics differing:", {k: v for k, v in c[3].items()})
print(f"TOTAL completions identical {same}/{tot} over {len(cells)} (row, task) cells")
