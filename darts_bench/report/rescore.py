"""``darts-bench report --rescore``: re-score a finished run from its results samples
(``<out>/samples/<row>/<task>.jsonl[.gz]``, :mod:`darts_bench.report.samples`) with the scorers
installed now, without generating again (cf. OpenCompass ``--reuse --mode eval``).

Each (row, task) whose task has an offline scorer (``Task.score_samples``, the one behind
``darts-bench score``) and a samples view for it (:meth:`darts_bench.api.Task.score_input`) is scored
under the run's protocol and task settings (the run's config, from ``results.json``'s manifest);
tasks that need a judge model (AlpacaEval) are listed as not re-scored. The run's own files are left
as they are: ``rescore.csv`` / ``rescore.md`` beside them give, per (row, task, metric), the value on
record, the value now, their difference and how many examples changed verdict.
"""

from __future__ import annotations

import inspect
import json
import logging
import math
import tempfile
from pathlib import Path
from typing import Any

import pandas as pd

from darts_bench.api import get_task
from darts_bench.artifacts import atomic_write_text
from darts_bench.config import Config
from darts_bench.data import jsonl_bytes, read_jsonl

log = logging.getLogger("darts_bench")
NO_SCORER = "not re-scored: the task has no offline scorer (Task.score_samples / score_input; e.g. it needs a judge)"


def _load(out_dir: Path) -> dict[str, Any]:
    f = out_dir / "results.json"
    try:
        res = json.loads(f.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{f}: cannot read a darts-bench results.json ({type(e).__name__}: {e})") from None
    if "artifacts" not in res or "rows" not in res.get("artifacts", {}):
        raise ValueError(f"{f}: no 'artifacts' (results written before samples were kept); run `darts-bench "
                         "report` once to write samples/ from the cached evaluations")
    return res


def rescore(out_dir: str | Path, data_dir: Path | None = None) -> pd.DataFrame:
    """Re-score every (row, task) of the results dir ``out_dir``; write ``rescore.csv`` and
    ``rescore.md`` there and return the table (columns ``model, task, metric, recorded, rescored,
    delta, n_changed, note``; ``n_changed`` None where the scorer gives no per-example list).
    ``data_dir``: the data dir (None: the run's).

    Raises:
        ValueError: no readable ``results.json`` or one without sample pointers.
        DataError: a samples file that cannot be read or that the scorer rejects (file and line).
    """
    out_dir = Path(out_dir)
    res = _load(out_dir)
    cfg = Config.model_validate(res["manifest"]["config"])
    data_dir = data_dir if data_dir is not None else cfg.resolved_data_dir()
    table = {r["model"]: r for r in res["rows"]}
    recs = []
    for row, by_task in res["artifacts"]["rows"].items():
        for tname, entry in by_task.items():
            tcfg = getattr(cfg.tasks, tname)
            task = get_task(tname, tcfg)
            if entry["samples"] is None:
                recs.append({"model": row, "task": tname, "note": "no samples in the results"})
                continue
            samples = read_jsonl(out_dir / entry["samples"], allow_empty=True)
            lines = task.score_input(samples)
            if lines is None or task.score_samples is None:
                recs.append({"model": row, "task": tname, "note": NO_SCORER})
                continue
            with tempfile.TemporaryDirectory(prefix="darts-rescore-") as tmp:
                path = Path(tmp) / f"{tname}.jsonl"
                path.write_bytes(jsonl_bytes(lines, ensure_ascii=False))
                opts = {"protocol": task.protocol} if "protocol" in inspect.signature(task.score_samples).parameters \
                    and task.protocol is not None else {}
                now = task.score_samples(path, tcfg, data_dir, **opts)
            for m in task.primary_metrics:
                key = task.per_example_key(m)
                new = now.get(m, now.get(key))
                old = table.get(row, {}).get(m)
                per_new, n_changed = now.get(key), None
                if isinstance(per_new, list) and len(per_new) == len(samples) and all(key in s for s in samples):
                    n_changed = sum(float(a) != float(s[key]) for a, s in zip(per_new, samples))
                delta = None if new is None or old is None else float(new) - float(old)
                recs.append({"model": row, "task": tname, "metric": m, "recorded": old, "rescored": new,
                             "delta": delta, "n_changed": n_changed,
                             "note": f"protocol {now.get('protocol', task.protocol)}"})
    df = pd.DataFrame(recs, columns=["model", "task", "metric", "recorded", "rescored", "delta", "n_changed", "note"])
    atomic_write_text(out_dir / "rescore.csv", df.to_csv(index=False))
    from darts_bench.report.tables import to_markdown

    moved = df[df["delta"].map(lambda d: d is not None and not (isinstance(d, float) and math.isnan(d)) and d != 0)]
    atomic_write_text(out_dir / "rescore.md", f"# darts-bench rescore: `{cfg.name}`\n\nThe run's samples "
                      f"(samples/) scored with the scorers installed now; {len(moved)} of "
                      f"{int(df['metric'].notna().sum())} re-scored cells moved. The run's tables are unchanged.\n\n"
                      + to_markdown(df))
    log.info("rescore: %d cells re-scored, %d moved; %s", int(df["metric"].notna().sum()), len(moved),
             out_dir / "rescore.md")
    return df
