"""The ``lm_eval`` task kind: any lm-eval task, by name, as a darts-bench benchmark.

This folder registers no task itself: it registers the kind. A folder in ``tasks/`` or in
``DARTS_BENCH_TASKS_PATH`` holding a ``task.yaml`` (and no ``__init__.py``) declares the task;
:func:`register_folder` (registered here as ``lm_eval`` in :data:`darts_bench.api.TASK_KINDS`)
turns it into a registered :class:`~darts_bench.api.Task`::

    kind: lm_eval
    task: tinyqa_gen              # the lm-eval task name (one task, not a group)
    include_path: lm_eval_yaml    # folder of lm-eval task YAMLs, relative to this file; omit for a
                                  # task shipped with lm-eval (then lm-eval's own index is searched)
    metrics: [exact_match]        # lm-eval's "metric" or "metric,filter" keys; the first is the headline
    expert: math                  # the pool expert whose heads correct this task (omit: no heads)
    version: "1"                  # bump on a protocol change (the cache key also hashes the files)
    num_fewshot: 0                # optional: as lm-eval's --num_fewshot
    max_gen_toks: 64              # optional: as lm-eval's --gen_kwargs max_gen_toks=64
    name: tinyqa                  # optional: the darts-bench name (default: the folder's name)

Every row is evaluated by ``lm_eval.simple_evaluate`` through the ``darts-bench`` lm-eval model
(:class:`~darts_bench.evaluate.lm_eval_adapter.DartsBenchLM`: greedy; a corrected row is its merge
with the head of this task), on the first ``limit`` documents of the task's evaluation split, with
lm-eval's default seeds, so ``lm_eval`` on the exported row (``darts-bench export``) gives the same
per-example outputs. Columns: ``<name>_<metric>`` (filter ``none``) or ``<name>_<metric>_<filter>``
(characters other than letters, digits, ``_``, ``@`` and ``.`` become ``_``), each lm-eval's
aggregate; a metric's per-example values (for the bootstrap CIs and paired differences) are kept
when they are numbers whose mean is lm-eval's aggregate (``acc``, ``exact_match``, ...; not corpus
metrics such as BLEU); ``<name>_ref_nll`` (nats/token) is the NLL of ``target_delimiter`` + the
gold target (the gold choice for ``multiple_choice``) after the example's prompt, as lm-eval
writes a solved few-shot example.

Examples (the calibration prompts of the transductive split) are the contexts lm-eval builds for
each document (few-shot included). The inductive split takes ``n`` documents of the task's training
split (``training_split`` in its YAML), zero-shot. Output types ``generate_until``,
``multiple_choice`` and ``loglikelihood`` are supported (not ``loglikelihood_rolling``).
"""

from __future__ import annotations

import hashlib
import inspect
import json
import random
import re
from importlib import metadata as importlib_metadata
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model, field_validator

from darts_bench.api import (TASK_KINDS, EvalContext, Example, Task, TaskConfig, TaskResult, TextModel,
                              register_task)

SUPPORTED_OUTPUT_TYPES = ("generate_until", "multiple_choice", "loglikelihood")


class LMEvalTaskSpec(BaseModel):
    """The ``task.yaml`` of a ``kind: lm_eval`` folder (see the module docstring); unknown keys are errors."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["lm_eval"]
    task: str = Field(min_length=1, description="lm-eval task name")
    include_path: str | None = Field(None, description="folder of lm-eval YAMLs, relative to task.yaml")
    metrics: list[str] = Field(min_length=1, description="lm-eval 'metric' or 'metric,filter' keys")
    expert: str | None = Field(None, description="pool expert whose features train this task's heads")
    version: str = "1"
    num_fewshot: int | None = Field(None, ge=0)
    max_gen_toks: int | None = Field(None, ge=1)
    name: str | None = Field(None, pattern=r"^[A-Za-z][A-Za-z0-9_]*$")
    official_size: int | None = Field(None, ge=1, description="documents without a limit (for --dry-run)")
    order: int = 100

    @field_validator("metrics")
    @classmethod
    def _metric_keys(cls, v: list[str]) -> list[str]:
        for m in v:
            parts = m.split(",")
            if len(parts) > 2 or not all(p.strip() for p in parts):
                raise ValueError(f"metric {m!r}: expected 'metric' or 'metric,filter' (lm-eval's result key)")
        if len(set(v)) != len(v):
            raise ValueError(f"metrics listed twice: {v}")
        return v


def metric_key(metric: str) -> tuple[str, str]:
    """``"exact_match"`` -> ``("exact_match", "none")``; ``"acc,strict-match"`` -> ``("acc", "strict-match")``."""
    m, _, f = metric.partition(",")
    return m.strip(), (f.strip() or "none")


def metric_column(task_name: str, metric: str) -> str:
    """The darts-bench column of an lm-eval metric key (``tinyqa`` + ``exact_match,strict-match`` ->
    ``tinyqa_exact_match_strict_match``; filter ``none`` adds nothing)."""
    m, f = metric_key(metric)
    col = f"{task_name}_{m}" if f == "none" else f"{task_name}_{m}_{f}"
    return re.sub(r"[^A-Za-z0-9_@.]", "_", col)


def _jsonable(x: Any) -> Any:
    return json.loads(json.dumps(x, default=str))


class LMEvalTask(Task):
    """Base of the task classes :func:`register_folder` makes (one per folder; never registered itself).

    Class attributes set per folder: ``spec`` (:class:`LMEvalTaskSpec`), ``spec_path`` (the
    ``task.yaml``), ``include_dir`` (resolved ``include_path`` or None) and ``metric_keys`` (column ->
    lm-eval metric key).
    """

    spec: ClassVar[LMEvalTaskSpec]
    spec_path: ClassVar[Path]
    include_dir: ClassVar[Path | None]
    metric_keys: ClassVar[dict[str, str]]
    typical_tokens = {"prompt": 100, "reference": 20}

    def __init__(self) -> None:
        self._content_sha: str | None = None

    # ------------------------------------------------------------------ identity
    @property
    def version(self) -> str:  # type: ignore[override]
        """``<spec version>+<12 hex>``: the hex is a sha256 of ``task.yaml``, every file under
        ``include_path`` and lm-eval's version, so an edited task YAML or data file in the include
        folder (or another lm-eval) changes every cache key of this task."""
        if self._content_sha is None:
            h = hashlib.sha256(self.spec_path.read_bytes())
            if self.include_dir is not None:
                for p in sorted(self.include_dir.rglob("*")):
                    if p.is_file() and "__pycache__" not in p.parts:
                        h.update(str(p.relative_to(self.include_dir)).encode() + b"\0" + p.read_bytes())
            h.update(_lm_eval_version().encode())
            self._content_sha = h.hexdigest()
        return f"{self.spec.version}+{self._content_sha[:12]}"

    def _where(self) -> str:
        return f"{self.name} ({self.spec_path})"

    def task_manager(self):
        """lm-eval's ``TaskManager`` over ``include_path`` only (fast), or over lm-eval's own tasks
        when the spec has no ``include_path``."""
        from lm_eval.tasks import TaskManager

        if self.include_dir is None:
            return TaskManager()
        return TaskManager(include_path=str(self.include_dir), include_defaults=False)

    def lm_eval_task(self, task_manager=None):
        """The lm-eval ``Task`` object of ``spec.task``, with the overrides ``simple_evaluate`` applies
        by default (``num_fewshot``, its default few-shot seed), so its requests are the ones
        :meth:`evaluate` sends.

        Raises:
            ValueError: the name is not an lm-eval task here, is a group of several tasks, or its
                output type is not supported (each naming the task.yaml).
        """
        tm = task_manager or self.task_manager()
        where = (f"include_path {self.include_dir}" if self.include_dir is not None
                 else "lm-eval's built-in tasks")
        if self.spec.task not in tm.all_tasks:
            near = [t for t in tm.all_tasks if self.spec.task.split("_")[0] in t][:10]
            raise ValueError(f"{self._where()}: no lm-eval task {self.spec.task!r} in {where}"
                             + (f" (similar: {near})" if near else f" (found: {sorted(tm.all_tasks)[:20]})"))
        loaded = tm.load(self.spec.task)["tasks"]
        if len(loaded) != 1:
            raise ValueError(f"{self._where()}: lm-eval name {self.spec.task!r} is a group of {len(loaded)} tasks "
                             f"({sorted(loaded)[:10]}...); kind: lm_eval runs one task: declare one folder per subtask")
        (t,) = loaded.values()
        out_type = t.get_config("output_type")
        if out_type not in SUPPORTED_OUTPUT_TYPES:
            raise ValueError(f"{self._where()}: lm-eval task {self.spec.task!r} has output_type {out_type!r}; "
                             f"supported: {SUPPORTED_OUTPUT_TYPES}")
        if self.spec.num_fewshot is not None:
            if t.get_config("num_fewshot") != 0:  # lm-eval never overrides a YAML's explicit 0
                t.set_config(key="num_fewshot", value=self.spec.num_fewshot)
        elif t.get_config("num_fewshot") is None:
            t.set_config(key="num_fewshot", value=0)
        t.set_fewshot_seed(seed=_simple_evaluate_default("fewshot_random_seed"))
        return t

    # ------------------------------------------------------------------ the Task contract
    def examples(self, data_dir: Path | None, model: TextModel | None, limit: int | None) -> list[Example]:
        """One example per document of the task's evaluation split, the first ``limit``: ``prompt``
        = the context lm-eval sends for it (few-shot examples included), ``reference`` =
        ``target_delimiter`` + gold target. ``data_dir`` and ``model`` are unused (the lm-eval task
        names its data; no chat template).

        Raises:
            ValueError: see :meth:`lm_eval_task`; a document whose gold target is empty.
        """
        t = self.lm_eval_task()
        t.build_all_requests(limit=limit, rank=0, world_size=1)
        first: dict[int, Any] = {}
        for inst in t.instances:
            first.setdefault(int(inst.doc_id), inst)
        out = []
        for doc_id in sorted(first):
            inst = first[doc_id]
            ref = self._reference(t, inst.doc)
            if not ref.strip():
                raise ValueError(f"{self._where()}: document {doc_id} has an empty gold target")
            out.append(Example(id=f"{self.name}/{doc_id}", prompt=inst.arguments[0], reference=ref,
                               meta={"doc_id": doc_id, "lm_eval_task": self.spec.task,
                                     "output_type": t.get_config("output_type")}))
        return out

    @staticmethod
    def _reference(t, doc: dict) -> str:
        target = t.doc_to_target(doc)
        if t.get_config("output_type") == "multiple_choice":
            choices = t.doc_to_choice(doc)
            if isinstance(target, list):
                target = target[0]
            target = choices[target] if isinstance(target, int) else target
        elif isinstance(target, list):
            target = target[0]
        return f"{t.get_config('target_delimiter') or ''}{target}"

    def training_prompts(self, data_dir: Path | None, model: TextModel | None, n: int, seed: int) -> list[str]:
        """``n`` documents of the task's training split drawn with ``random.Random(seed)``, each as
        its zero-shot context (description + ``doc_to_text``).

        Raises:
            ValueError: the task has no training split, or fewer than ``n`` documents in it.
        """
        t = self.lm_eval_task()
        if not t.has_training_docs():
            raise ValueError(f"{self._where()}: lm-eval task {self.spec.task!r} has no training split, which the "
                             "inductive calibration split needs: give its YAML a training_split, or set "
                             "calibration.splits: [transductive]")
        docs = list(t.training_docs())
        if n > len(docs):
            raise ValueError(f"{self._where()}: asked for {n} training prompts, the training split has {len(docs)}")
        idx = random.Random(seed).sample(range(len(docs)), n)
        return [t.fewshot_context(docs[i], 0) for i in idx]

    def evaluate(self, model: TextModel, examples: list[Example], ctx: EvalContext) -> TaskResult:
        """``lm_eval.simple_evaluate`` of the task on the first ``len(examples)`` documents with
        ``model`` behind :class:`DartsBenchLM`, lm-eval's default seeds, ``bootstrap_iters=0``; the
        declared metrics as columns, the reference NLL, and lm-eval's per-document samples (kept as
        ``<name>_samples.jsonl`` in the evaluation artifact).

        Raises:
            ValueError: ``examples`` are not the task's first documents in order, or a declared
                metric is not among lm-eval's results (the message lists those).
        """
        import lm_eval

        from darts_bench.evaluate.lm_eval_adapter import DartsBenchLM
        from darts_bench.evaluate.nll import reference_nll_detail
        from darts_bench.scoring import write_samples

        self.check_protocol(examples)
        n = len(examples)
        if not n:
            raise ValueError(f"{self.name}.evaluate: no examples")
        want = [f"{self.name}/{i}" for i in range(n)]
        if [e.id for e in examples] != want:
            raise ValueError(f"{self._where()}: evaluate runs lm-eval on the first {n} documents; got examples "
                             f"{[e.id for e in examples][:5]}..., expected {want[:5]}...")
        spec = self.spec
        lm = DartsBenchLM(model, max_gen_toks=spec.max_gen_toks or 256)
        kw: dict[str, Any] = {}
        if spec.num_fewshot is not None:
            kw["num_fewshot"] = spec.num_fewshot
        if spec.max_gen_toks is not None:
            kw["gen_kwargs"] = {"max_gen_toks": spec.max_gen_toks}
        out = lm_eval.simple_evaluate(model=lm, tasks=[spec.task], task_manager=self.task_manager(), limit=n,
                                      log_samples=True, bootstrap_iters=0,
                                      device=str(getattr(model, "device", "cpu")), **kw)
        res = out["results"][spec.task]
        by_filter: dict[str, dict[int, dict[str, Any]]] = {}
        for s in out["samples"][spec.task]:
            by_filter.setdefault(s["filter"], {})[int(s["doc_id"])] = s
        available = sorted(k for k in res if "," in k and not k.split(",")[0].endswith("_stderr"))
        metrics: dict[str, float | None] = {}
        per_example: dict[str, list[float]] = {}
        no_per_example = []
        for col, key in self.metric_keys.items():
            m, f = metric_key(key)
            if f"{m},{f}" not in res:
                raise ValueError(f"{self._where()}: metric {key!r} is not in lm-eval's results for "
                                 f"{spec.task!r}; available: {available} (write them as 'metric' or 'metric,filter')")
            agg = res[f"{m},{f}"]
            metrics[col] = None if agg is None else float(agg)
            docs = by_filter.get(f, {})
            if sorted(docs) != list(range(n)):
                raise RuntimeError(f"{self._where()}: lm-eval returned samples for docs {sorted(docs)[:10]} under "
                                   f"filter {f!r}, expected 0..{n - 1}")
            vals = [docs[i].get(m) for i in range(n)]
            if (all(isinstance(v, (int, float)) for v in vals) and metrics[col] is not None
                    and abs(sum(float(v) for v in vals) / n - metrics[col]) <= 1e-9 * max(1.0, abs(metrics[col]))):
                per_example[col[len(self.name) + 1:]] = [float(v) for v in vals]
            else:
                no_per_example.append(col)  # a corpus-level metric: no per-example values, no CI
        ref = reference_nll_detail(model, examples)
        metrics[f"{self.name}_ref_nll"] = ref.overall
        metrics[f"n_{self.name}"] = n
        per_example.update({"ref_nll": ref.per_example, "ref_nll_sum": ref.nll_sum,
                            "ref_nll_tokens": [float(t) for t in ref.n_tokens]})
        filters = sorted(by_filter)
        samples = []
        for i, e in enumerate(examples):
            s0 = by_filter[filters[0]][i]
            rec = {"id": e.id, "doc_id": i, "doc": _jsonable(s0["doc"]), "target": _jsonable(s0["target"]),
                   "arguments": _jsonable(s0["arguments"]), "resps": _jsonable(s0["resps"]),
                   "filtered_resps": {f: _jsonable(by_filter[f][i]["filtered_resps"]) for f in filters},
                   "metrics": {col: _jsonable(by_filter[metric_key(k)[1]][i].get(metric_key(k)[0]))
                               for col, k in self.metric_keys.items()},
                   "doc_hash": s0.get("doc_hash"), "prompt_hash": s0.get("prompt_hash"),
                   "target_hash": s0.get("target_hash")}
            if e.meta.get("output_type") == "generate_until":
                rec["output"] = s0["resps"][0][0]
            samples.append(rec)
        path = write_samples(ctx.artifact_dir(), self.name, samples)
        config = out.get("configs", {}).get(spec.task, {})
        meta = {"task_version": self.version, "kind": "lm_eval", "lm_eval_task": spec.task,
                "protocol": f"lm-eval:{spec.task}",
                "protocol_source": str(self.include_dir) if self.include_dir else f"lm-eval {_lm_eval_version()}",
                "example_prompt": examples[0].prompt,
                "lm_eval_version": _lm_eval_version(), "output_type": config.get("output_type"),
                "include_path": str(self.include_dir) if self.include_dir else None,
                "num_fewshot": out.get("n-shot", {}).get(spec.task), "decoding": "greedy",
                "lm_eval_seeds": {k: _simple_evaluate_default(k) for k in
                                  ("random_seed", "numpy_random_seed", "torch_random_seed", "fewshot_random_seed")},
                "metric_keys": dict(self.metric_keys), "metrics_without_per_example": no_per_example,
                "lm_eval_config": _jsonable(config), "samples_file": path.name if path else None}
        return TaskResult(metrics=metrics, per_example=per_example, samples=samples, meta=meta)


def _lm_eval_version() -> str:
    try:
        return importlib_metadata.version("lm_eval")
    except importlib_metadata.PackageNotFoundError:
        return "unknown"


def _simple_evaluate_default(param: str) -> Any:
    """The default of ``lm_eval.simple_evaluate``'s parameter ``param`` (its seeds): what a user's
    ``lm_eval`` run gets unless told otherwise."""
    import lm_eval

    return inspect.signature(lm_eval.simple_evaluate).parameters[param].default


def register_folder(folder: Path, raw: dict[str, Any], module) -> type[LMEvalTask]:
    """Define and register the task of a ``kind: lm_eval`` folder (``folder/task.yaml`` parsed as
    ``raw``) as a class of ``module`` (``darts_bench_tasks.<folder>``). Reads no lm-eval index:
    the lm-eval task is looked up when examples are built.

    Raises:
        ValueError: the spec is invalid (each error with its key and the file), ``include_path`` is
            not a folder, or two metrics map to one column.
    """
    path = Path(folder) / "task.yaml"
    try:
        spec = LMEvalTaskSpec.model_validate(raw)
    except ValidationError as e:
        lines = [f"  {'.'.join(str(x) for x in err['loc']) or '(top)'}: {err['msg']}" for err in e.errors()]
        raise ValueError(f"{path}: invalid kind: lm_eval task spec:\n" + "\n".join(lines)) from None
    include = None
    if spec.include_path is not None:
        include = (Path(folder) / spec.include_path).resolve()
        if not include.is_dir():
            raise ValueError(f"{path}: include_path {spec.include_path!r} is not a folder ({include})")
    name = spec.name or Path(folder).name
    if not re.fullmatch(r"[A-Za-z][A-Za-z0-9_]*", name):
        raise ValueError(f"{path}: task name {name!r} (the folder's name unless `name` is given) must be letters, "
                         "digits and _ (it prefixes the columns)")
    keys: dict[str, str] = {}
    for m in spec.metrics:
        col = metric_column(name, m)
        if col in keys:
            raise ValueError(f"{path}: metrics {keys[col]!r} and {m!r} both map to column {col!r}")
        keys[col] = m
    config_model = create_model(f"{name}_Config", __base__=TaskConfig, __module__=module.__name__)
    config_model.__doc__ = f"``tasks.{name}`` of the kind: lm_eval task in {path} (enabled, limit)."
    cls = type(f"LMEvalTask_{name}", (LMEvalTask,), {
        "__module__": module.__name__, "__doc__": f"lm-eval task {spec.task!r} as darts-bench task {name!r} ({path}).",
        "name": name, "expert": spec.expert, "spec": spec, "spec_path": path.resolve(), "include_dir": include,
        "metric_keys": keys, "primary_metrics": tuple(keys), "config_model": config_model,
        "official_size": spec.official_size, "order": spec.order})
    module.SPEC = spec
    setattr(module, cls.__name__, cls)
    setattr(module, config_model.__name__, config_model)
    return register_task(cls)


TASK_KINDS.register("lm_eval", register_folder)

__all__ = ["LMEvalTask", "LMEvalTaskSpec", "SUPPORTED_OUTPUT_TYPES", "metric_column", "metric_key", "register_folder"]
