"""The stage loops of the pipeline, one module per stage (pool -> merge -> collect -> train -> evaluate).

Each stage is a plain function over the config, the artifacts of the stages before it and the run's
executor; it owns its loop, its cache keys (:func:`darts_bench.artifacts.stable_hash` of its config and
its inputs' keys) and its diagnostics calls, and writes each artifact atomically under the work dir
(:func:`darts_bench.artifacts.cached`). :class:`darts_bench.pipeline.Pipeline` only wires them: it runs
each stage once, in order, owns the executor's lifecycle and the stage timings, and hands the report a
plain :class:`~darts_bench.report.record.RunRecord`.

* :mod:`.tasks` — the selected tasks and their evaluated examples.
* :mod:`.collect` — calibration sets (expert continuations) and merged features.
* :mod:`.train` — Surgery / DARTS heads per (merge, task, split, variant, seed) and their diagnostics.
* :mod:`.evaluate` — every row on every task (cached per (row, task)).
* :mod:`.emr` — the routers of the task-aware merges' ``@routed`` rows (EMR-Merging).
The pool and merge stages are single calls (:func:`darts_bench.pool.build_pool`,
:func:`darts_bench.merge.build_merges`).
"""

from __future__ import annotations

from typing import Any

from darts_bench.artifacts import stable_hash


#: token streams (one (merge, task, split, head seed)'s held-out and reference tokens) whose plain-merge row
#: and KL floor the train stage keeps for a later pass over them in the same process
#: (:func:`darts_bench.stages.train.known_streams`: rows added to a run whose other artifacts are cached; a
#: fresh train stage makes one pass per stream, :func:`darts_bench.stages.train.diagnose_streams`)
KNOWN_STREAMS_MAX = 64


def derive_seed(run_seed: int, *parts: Any) -> int:
    """A 31-bit seed derived from the run seed and a name (never from global RNG order)."""
    return int(stable_hash([run_seed, *parts], n=8), 16) & 0x7FFFFFFF
