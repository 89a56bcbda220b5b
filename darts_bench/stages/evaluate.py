"""The evaluate stage: every selected row on every selected task, cached per (row, task).

A row's text model comes from the ``evaluate.backend`` the stage opens
(:func:`darts_bench.evaluate.engines.open_models`: each checkpoint loaded once, a corrected row is its
merge's model with the task's head; the backend's engines end with the stage). A task may use
other models (an AlpacaEval judge, by row name or checkpoint dir) and other rows' outputs (a
reference row evaluated before it); their identities are part of the cache key.

With ``evaluate.one_pass`` (the default) the rows of one model dir (a merge and its corrected rows)
run each task together (:func:`evaluate_group`): their calls are gathered into calls of the
backend's multi-head model (``Backend.multi_head_model``), so on the in-process HF backend one
batched ``generate`` and one transformer forward serve every row of the merge.
"""

from __future__ import annotations

import functools
import json
import logging
import re
import shutil
import threading
from pathlib import Path
from typing import Sequence

from darts_bench.api import EvalContext, Example, ScoreContinuation, Task, TaskResult
from darts_bench.artifacts import cached, stable_hash
from darts_bench.config import MERGE_COPY_MODES
from darts_bench.evaluate.engines import backend_key, open_models
from darts_bench.evaluate.memo import CallMemo, MemoModel
from darts_bench.progress import overall_bar
from darts_bench.rows import Row
from darts_bench.stages import derive_seed

log = logging.getLogger("darts_bench")


def plain_merge_on_copy(cfg) -> bool:
    """Whether a merge's plain row (and a corrected row on a task without its head, which is its merge there)
    takes its scores from the HF copy: the vLLM backend with ``evaluate.vllm.scoring`` ``heads`` or ``shared``
    (:func:`~darts_bench.evaluate.engines.vllm.scoring_mode`). Such rows' keys say so (:func:`eval_key`): their
    scores differ from the engine's ``prompt_logprobs`` at rounding level."""
    return cfg.evaluate.backend == "vllm" and cfg.evaluate.vllm.scoring in MERGE_COPY_MODES


def merge_dirs_of(rows) -> set[str]:
    """The checkpoints of ``rows`` that are merges (their rows' ``model_dir``), as strings: what the vLLM backend
    scores on its HF copy under :func:`plain_merge_on_copy` (``open_models(merge_dirs=...)``), and what a judge given
    as a checkpoint path is checked against in the key."""
    return {str(r.model_dir) for r in rows if r.merge and r.model_dir is not None}


#: how the HF paths (``HFTextModel.score``, the one-pass ``HFMultiHeadModel.score``, the vLLM backend's HF copy) compute
#: a head's teacher-forced scores, in the key of every (row, task) that runs a head (:func:`eval_key`). "factored": a
#: low-rank float32 head's logits from the plain merge's (``head_continuation_scores``), float32-rounding apart
#: from the head-then-``lm_head`` values that earlier keys hold (what the plain merge's rows score is unchanged)
HEAD_SCORES = "factored"


def eval_key(cfg, row: Row, task: Task, examples: list[Example], judge_key: str = "",
             model_key: str | None = None, plain_merge: bool | None = None) -> str:
    """Cache key of one (row, task) evaluation: the row's model key (``model_key`` overrides it, e.g.
    a corrected row on a task without heads is its merge), task name/version/config, examples, seed,
    judge, and the device and ``tasks.batch_size`` (both change generations: left padding and
    kernels; samples are seeded per prompt and sample, not per batch), and the generation engine
    (empty for ``hf``).

    ``evaluate.one_pass`` is not in the key where the one pass is exact (:func:`one_pass_exact`: a
    float32 engine, not vLLM on a GPU): there it gives the row-by-row path's greedy and sampled
    completions token for token (each head's prompts in the same ``batch_size`` chunks, the same
    left padding, samples drawn one head at a time with the same seeds) and the same scores bitwise
    (one body forward, ``lm_head`` and each head's logits through the same ``head_continuation_scores``), tested in ``tests/test_evaluate_one_pass.py`` on the CPU and measured
    with the HF engine on an H200 (224/224 completions, ``results/device/eval-heads-h200``), so a
    result cached by either path serves the other. Elsewhere (bfloat16 or float16; vLLM on a GPU,
    whose steps batch the rows' requests differently, unmeasured) the batches the one pass forms
    round differently from row by row's (the H200 in bfloat16: 194 and 217 of 224 greedy
    completions equal at chunks of 8 and 32; a CPU: 27 of 28, ``cpu_smoke_*.log`` there), so
    ``numerics`` names the path (:func:`one_pass_numerics`). A one-pass result there also depends
    on which rows shared its batches (rows selected, rows already cached, ``one_pass_max_batch``):
    a valid greedy output of the merge's head, reproducible bit for bit only in float32 or row by
    row (README "One pass per merge").

    ``plain_merge``: the row runs its merge without a head on this task (None: :func:`runs_plain_merge`); where such
    rows score on the HF copy (:func:`plain_merge_on_copy`) the key records ``"plain_scores": "copy"`` (other
    rows' keys are unchanged). A row that runs a head records :data:`HEAD_SCORES`, the version of how the HF paths
    compute a head's teacher-forced scores."""
    tcfg = getattr(cfg.tasks, task.name)
    if plain_merge is None:
        plain_merge = runs_plain_merge(row, task.name)
    scores = {"plain_scores": "copy"} if plain_merge and plain_merge_on_copy(cfg) else {}
    if row.merge and not plain_merge:  # a head's scores: the HF paths' current arithmetic (HEAD_SCORES)
        scores["head_scores"] = HEAD_SCORES
    return stable_hash({"model": model_key if model_key is not None else row.model_key, "task": task.name,
                        "version": task.version, "cfg": tcfg.model_dump(mode="json"), "n": len(examples),
                        "seed": cfg.seed, "judge": judge_key,
                        "ex": stable_hash([(e.id, e.prompt, e.reference) for e in examples]),
                        "numerics": {"device": cfg.device, "batch_size": cfg.tasks.batch_size,
                                     **one_pass_numerics(cfg)},
                        **backend_key(cfg, "evaluate"), **scores})


def engine_dtype(cfg) -> str:
    """The dtype the evaluate stage's engine computes in: ``evaluate.vllm.dtype`` on the vLLM backend
    unless ``auto``, else ``pool.dtype``."""
    if cfg.evaluate.backend == "vllm" and cfg.evaluate.vllm.dtype != "auto":
        return cfg.evaluate.vllm.dtype
    return cfg.pool.dtype


def one_pass_exact(cfg) -> bool:
    """Whether the one pass gives the row-by-row path's outputs bit for bit: a float32 engine
    (:func:`engine_dtype`), HF anywhere (tested on the CPU, measured on an H200), vLLM only where its
    engines run on the CPU (tested; on a GPU unmeasured: :func:`vllm_engines_on_cpu`). See
    :func:`eval_key`."""
    if engine_dtype(cfg) != "float32":
        return False
    return cfg.evaluate.backend != "vllm" or vllm_engines_on_cpu(cfg)


def vllm_engines_on_cpu(cfg) -> bool:
    """Whether the vLLM backend's engines run on the CPU: ``device`` is ``cpu``, Ray actors reserve no
    GPU (``ray.num_gpus_per_actor``), and this environment's vLLM is a CPU build (a GPU build puts
    its engines on the GPU whatever ``device`` says; checked once per process, ~3 s to import
    ``vllm.platforms``; without vLLM here, by the config alone)."""
    if not str(cfg.device).startswith("cpu"):
        return False
    if cfg.executor == "ray" and cfg.ray.num_gpus_per_actor > 0:
        return False
    return _vllm_platform_is_cpu()


@functools.lru_cache(maxsize=1)
def _vllm_platform_is_cpu() -> bool:
    from darts_bench.evaluate.engines.vllm import on_cpu, vllm_available

    return on_cpu() if vllm_available() else True


def one_pass_numerics(cfg) -> dict:
    """The evaluate key's record of the path: ``{}`` where the one pass is exact
    (:func:`one_pass_exact`: the keys stay as they were, a result of either path serves the other),
    else ``{"one_pass": evaluate.one_pass}``, with ``one_pass_max_batch`` for an HF one pass (it
    sets the stacked batches' size). Both paths are named, so a row-by-row run is never served a
    one-pass result cached before this rule."""
    if one_pass_exact(cfg):
        return {}
    out = {"one_pass": bool(cfg.evaluate.one_pass)}
    if cfg.evaluate.one_pass and cfg.evaluate.backend == "hf":
        out["one_pass_max_batch"] = cfg.evaluate.one_pass_max_batch
    return out


def evaluate(cfg, rows: list[Row], all_rows: list[Row], tasks: dict, executor, work_dir: Path) -> dict[str, dict[str, TaskResult]]:
    """``{row name: {task: TaskResult}}`` for ``rows`` x ``tasks``, in row order (a reference row,
    e.g. ``base``, comes before the rows that compare against it). ``all_rows`` keeps every row
    reachable by name (the AlpacaEval judge ``expert:instruction`` is a row even when not selected).

    ``evaluate.one_pass`` (default): rows that share a model dir (a merge and its corrected rows)
    form a group, taken in the order of their first row; for each task the group's rows run
    together (:func:`evaluate_group`), every generate / score call of theirs served by one
    multi-head model. False: row by row, each row on each task in turn.

    The other models a task asks for (a judge: ``ctx.get_model``) answer through a
    :class:`~darts_bench.evaluate.memo.MemoModel` over one :class:`~darts_bench.evaluate.memo.CallMemo`
    per (task, model, head) for the whole stage: a request an earlier row made (the judge prompt of an
    output two rows share) is answered from it; the counts are logged at the end of the stage."""
    results: dict[str, dict[str, TaskResult]] = {r.model: {} for r in rows}
    by_name = {r.model: r for r in all_rows}
    memos: dict[tuple[str, str, str, str], CallMemo] = {}
    try:
        _evaluate_rows(cfg, rows, tasks, executor, work_dir, results, by_name, memos)
    finally:
        for (task_name, name, _, _), m in memos.items():
            log.info("%s's calls to %s (remembered across rows): %s", task_name, name, m.summary())
    return results


def _evaluate_rows(cfg, rows, tasks, executor, work_dir, results, by_name, memos) -> None:
    """The body of :func:`evaluate`: fills ``results``."""
    # each checkpoint loaded once (rows of one model dir share it; the judge stays loaded)
    # a merge's checkpoint: with vLLM scoring heads / shared its plain rows score on the HF copy too (scoring_mode)
    with open_models(cfg, executor, merge_dirs=merge_dirs_of(by_name.values())) as models, \
            overall_bar(len(rows) * len(tasks), "evaluate", unit="row x task") as bar:
        def row_by_row(rows_):
            for row in rows_:
                for name, (task, examples) in tasks.items():
                    bar.set_postfix_str(f"{row.model} / {name}")
                    results[row.model][name] = evaluate_one(cfg, row, task, examples, by_name, results, models,
                                                            work_dir, memos=memos)
                    bar.update(1)

        if not cfg.evaluate.one_pass:
            row_by_row(rows)
            return
        for group in model_groups(rows):
            if group[0].task_aware:  # a model per task (EMR): no multi-head model of one merge; row by row
                row_by_row(group)
                continue
            for name, (task, examples) in tasks.items():
                for row, res in zip(group, evaluate_group(cfg, group, task, examples, by_name, results, models,
                                                          work_dir, bar, memos=memos)):
                    results[row.model][name] = res


def model_groups(rows: list[Row]) -> list[list[Row]]:
    """``rows`` grouped by model dir (a merge with its corrected rows; base and each expert alone),
    groups in the order of their first row, rows in row order within a group."""
    groups: dict[str, list[Row]] = {}
    for r in rows:
        groups.setdefault(str(r.model_dir), []).append(r)
    return list(groups.values())


def runs_plain_merge(row: Row, task: str) -> bool:
    """Whether ``row`` runs its merge without a head on ``task``: a merge's plain row, or a corrected row (not routed)
    without a head for the task (it is its merge there: its evaluation is keyed by the merge's model key). Never for
    a task-aware row (EMR)."""
    if row.task_aware:  # a task-aware row (EMR) runs its task's model (or a routed one), never a merged model
        return False
    return bool(row.merge) and (row.correction == "none" or (row.routing != "routed" and task not in row.heads))


def model_identity(cfg, by_name: dict[str, Row], task_name: str, d: str) -> str:
    """The cache identity of a model a task uses besides the row's (e.g. a judge): a row's
    ``model_key`` (with its head-score version when it runs under a head, ``+copy`` when a merge runs
    on its HF copy), or the checkpoint dir as given."""
    # a merge scored without a head (a row, or a checkpoint path that is a merge's) says so where that is
    # on the HF copy (plain_merge_on_copy)
    copy = plain_merge_on_copy(cfg)
    if d in by_name:
        j = by_name[d]
        if not runs_plain_merge(j, task_name):
            # a judge under a head records its scores' version; any other row than a merge's is keyed by itself
            return j.model_key + (f"+head_scores={HEAD_SCORES}" if j.merge else "")
        return j.model_key + ("+copy" if copy else "")
    return d + ("+copy" if copy and d in merge_dirs_of(by_name.values()) else "")


def _target(cfg, row: Row, task: Task, examples: list[Example], by_name: dict[str, Row], work_dir: Path) -> Path:
    """The artifact dir of one (row, task) evaluation: ``eval/<row>-<task>-<key>``."""
    tcfg = getattr(cfg.tasks, task.name)
    judge_key = "|".join(model_identity(cfg, by_name, task.name, d) for d in task.models_used(tcfg))
    model_key = row.model_key
    plain = runs_plain_merge(row, task.name)
    if plain and row.correction != "none":
        model_key = by_name[row.merge].model_key  # no head for this task: the row is its merge here
    key = eval_key(cfg, row, task, examples, judge_key, model_key=model_key, plain_merge=plain)
    # row names of seeds / sweeps carry [ ] # , (glob and URL characters in data-file paths): not in paths
    safe = re.sub(r"[^A-Za-z0-9_.+@=-]", "_", row.model)
    return work_dir / "eval" / f"{safe}-{task.name}-{key}"


def evaluate_one(cfg, row: Row, task: Task, examples: list[Example], by_name: dict[str, Row], results: dict,
                 models, work_dir: Path, text_model=None,
                 memos: dict[tuple[str, str, str, str], CallMemo] | None = None) -> TaskResult:
    """One (row, task) evaluation, cached under ``eval/<row>-<task>-<key>/result.json``.

    Args:
        text_model: the row's model as the task sees it (None: ``models.get`` of the row, closed
            afterwards; the one-pass path passes its per-row view).
        memos: the stage's :class:`~darts_bench.evaluate.memo.CallMemo` per (task, model name,
            model dir, head dir), filled as rows go: the models ``ctx.get_model`` gives the task
            answer through them (None: not remembered).
    Raises:
        KeyError: the task asks for a model that is no row and no checkpoint dir, or for the outputs of
            a row not evaluated before this one.
    """
    tcfg = getattr(cfg.tasks, task.name)
    final = _target(cfg, row, task, examples, by_name, work_dir)

    def build(tmp: Path) -> None:
        opened = []

        def get_model(name: str):
            if name in by_name:
                model_dir, head_dir = by_name[name].model_dir, by_name[name].heads.get(task.name)
            elif Path(name).is_dir():
                model_dir, head_dir = name, None
            else:
                raise KeyError(f"no model row {name!r} (rows: {sorted(by_name)})")
            tm = models.get(name, model_dir, head_dir, pin=True)
            opened.append(tm)
            if memos is None:
                return tm
            key = (task.name, name, str(model_dir), str(head_dir))
            if key not in memos:
                memos[key] = CallMemo()
            return MemoModel(tm, memos[key])

        def get_outputs(name: str) -> list[str]:
            if name not in results or task.name not in results[name]:
                raise KeyError(f"reference model {name!r} has no {task.name} outputs yet; it must be a row "
                               "evaluated before this one (base or an expert; with evaluate.one_pass, a row of "
                               "another model dir)")
            return [s["output"] for s in results[name][task.name].samples]

        tm = text_model if text_model is not None else row_model(row, task.name, models, cfg)
        try:
            ctx = EvalContext(config=tcfg, data_dir=cfg.resolved_data_dir(),
                              seed=derive_seed(cfg.seed, "eval", task.name), work_dir=tmp / "scratch",
                              get_model=get_model, get_outputs=get_outputs, out_dir=tmp,
                              shared_dir=work_dir / "eval" / "shared",
                              model_key=lambda name: model_identity(cfg, by_name, task.name, name))
            (tmp / "scratch").mkdir()
            res = task.evaluate(tm, examples, ctx)
            routing = getattr(tm, "routing", None)
            if routing is not None:  # a routed row: routing accuracy on this benchmark's prompts
                res.metrics.update(routing.metrics(task.name))
                res.meta["routing"] = routing.summary()
        finally:
            for m in [tm, *opened]:
                if hasattr(m, "close"):
                    m.close()
        shutil.rmtree(tmp / "scratch", ignore_errors=True)
        # per_example lists are in example order (the Task contract): record which example each is
        (tmp / "result.json").write_text(json.dumps({"metrics": res.metrics, "per_example": res.per_example,
                                                     "samples": res.samples, "meta": res.meta,
                                                     "example_ids": [e.id for e in examples]}, default=str))

    cached(final, build, what=f"evaluate {row.model} on {task.name}",
           meta={"kind": "eval", "row": row.model, "task": task.name})
    d = json.loads((final / "result.json").read_text())
    return TaskResult(metrics=d["metrics"], per_example=d["per_example"], samples=d["samples"], meta=d["meta"],
                      example_ids=d.get("example_ids", []), artifact_dir=str(final))


def row_model(row: Row, task: str, models, cfg):
    """The row's model on ``task`` for the row-by-row path: ``models.get`` of its model dir with the
    task's head, or for a routed row a :class:`~darts_bench.evaluate.routed.RoutedTextModel` over the
    plain merge and each task's head (prompt states: :func:`~darts_bench.evaluate.routed.prompt_state_source`)."""
    if row.task_aware:
        return task_aware_model(row, task, models, cfg)
    if row.routing != "routed":
        return models.get(row.model, row.model_dir, row.heads.get(task))
    from darts_bench.evaluate.routed import RoutedTextModel, prompt_state_source
    from darts_bench.surgery.routing import Router

    plain = models.get(row.merge, row.model_dir, None)
    heads = {t: models.get(f"{row.model}/{t}", row.model_dir, hd) for t, hd in row.heads.items()}
    return RoutedTextModel(row.model, Router.load(row.router / "router.json"), plain, heads, cfg.tasks.batch_size,
                           states=prompt_state_source(plain, row.model_dir, cfg))


def task_aware_model(row: Row, task: str, models, cfg):
    """A task-aware (EMR) row's model on ``task``: the oracle row runs ``task``'s own checkpoint
    (``row.task_models[task]``: its expert's mask and rescaler); the routed row a
    :class:`~darts_bench.evaluate.routed.RoutedTextModel` whose "heads" are every task's checkpoint, routed by the
    prompt states of ``row.states_dir`` (the base; :mod:`darts_bench.stages.emr`), every model pinned.

    Raises:
        ValueError: the oracle row on a task without an expert (no task model to choose)."""
    if row.routing != "routed":
        if task not in row.task_models:
            raise ValueError(f"row {row.model!r}: task {task!r} has no expert, so the task-aware merge has no model "
                             f"for it (task models: {sorted(row.task_models)}); set tasks.{task}.expert or leave "
                             f"the row out (evaluate.rows)")
        return models.get(row.model, row.task_models[task], None)
    from darts_bench.evaluate.routed import RoutedTextModel, prompt_state_source
    from darts_bench.surgery.routing import Router

    # pinned: the routed row holds every task's model at once (a Ray backend releases an unpinned model dir's
    # actors when the next one opens); they stay loaded until the stage ends (HF in process: K + 1 models)
    plain = models.get("base", row.states_dir, None, pin=True)
    heads = {t: models.get(f"{row.model}/{t}", d, None, pin=True) for t, d in row.task_models.items()}
    return RoutedTextModel(row.model, Router.load(row.router / "router.json"), plain, heads, cfg.tasks.batch_size,
                           states=prompt_state_source(plain, row.states_dir, cfg))


# --------------------------------------------------------------------------- one pass
def evaluate_group(cfg, group: list[Row], task: Task, examples: list[Example], by_name: dict[str, Row],
                   results: dict, models, work_dir: Path, bar=None,
                   memos: dict[tuple[str, str, str, str], CallMemo] | None = None) -> list[TaskResult]:
    """``task`` on every row of ``group`` (rows of one model dir) at once, results in row order.

    Each row's :func:`evaluate_one` (cache check, ``task.evaluate``, ``result.json``) runs in its
    own thread on a :class:`RowView` of the group's multi-head model
    (``models.multi_head_model(name, model_dir, [each row's head dir for the task])``, opened on
    the first model call, so a fully cached group loads nothing). The threads take turns (one runs
    at a time, in row order: a task's own code, its judge calls and its RNG use are never
    interleaved with another row's); a thread's turn ends when it calls its view's ``generate`` /
    ``score`` or finishes, and once every unfinished row waits on a call the calls are executed
    together: calls with equal generation arguments as one multi-head call, one entry per row.
    Tasks stay unchanged (they see a TextModel); other models a task asks for through
    ``ctx.get_model`` (a judge) are ordinary models used during its turn.

    Raises:
        Exception: the first failing row's exception (row order), with a note naming the row and
            the task; the other rows still finish (their results are cached).
    """
    n = len(group)
    holder: dict[str, object] = {}
    # one slot per row (its head for the task), then for each routed row one slot per task head
    slots = [r.heads.get(task.name) for r in group]
    route_slots: dict[int, dict[str, int]] = {}
    for i, r in enumerate(group):
        if r.routing == "routed":
            route_slots[i] = {}
            for t, hd in r.heads.items():
                route_slots[i][t] = len(slots)
                slots.append(hd)

    def model():
        if "m" not in holder:
            holder["m"] = models.multi_head_model(group[0].merge or group[0].model, group[0].model_dir, slots)
        return holder["m"]

    gather = _Gather(n, model)
    out: list[TaskResult | None] = [None] * n
    errors: list[BaseException | None] = [None] * n

    def run(i: int) -> None:
        gather.enter(i)
        try:
            if i in route_slots:
                from darts_bench.surgery.routing import Router

                view = RoutedRowView(group[i].model, i, gather, Router.load(group[i].router / "router.json"),
                                     route_slots[i], cfg, group[i].model_dir)
            else:
                view = RowView(group[i].model, i, gather)
            out[i] = evaluate_one(cfg, group[i], task, examples, by_name, results, models, work_dir, text_model=view,
                                  memos=memos)
        except BaseException as e:  # noqa: BLE001 - re-raised in the calling thread below
            errors[i] = e
        finally:
            if bar is not None:
                bar.set_postfix_str(f"{group[i].model} / {task.name}")
                bar.update(1)
            gather.finish(i)

    threads = [threading.Thread(target=run, args=(i,), name=f"eval-{group[i].model}-{task.name}", daemon=True)
               for i in range(n)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        if "m" in holder and hasattr(holder["m"], "close"):
            holder["m"].close()
    for row, e in zip(group, errors):
        if e is not None:
            e.add_note(f"while evaluating row {row.model!r} on task {task.name!r} "
                       f"(one-pass evaluation of the rows of {row.model_dir})")
            raise e
    return out  # type: ignore[return-value]


def _generate_kw(max_new_tokens, stop, num_samples, temperature, top_p, seed) -> dict:
    """The gathered ``generate`` call's keyword arguments, normalised (one group per equal set);
    ``top_p`` only below 1, so a multi-head model without it serves the other calls."""
    kw = {"max_new_tokens": int(max_new_tokens), "stop": tuple(stop), "num_samples": int(num_samples),
          "temperature": float(temperature), "seed": int(seed)}
    if top_p != 1.0:
        kw["top_p"] = float(top_p)
    return kw


class RowView:
    """One row's model as its task sees it in the one-pass path (a
    :class:`~darts_bench.api.TextModel`): ``generate`` and ``score`` are gathered with the other
    rows' calls and served by the group's multi-head model on this row's head slot; ``format_chat``,
    ``tokenizer``, ``max_length`` and ``device`` are the shared model's. A shared model without one
    of these attributes gives an AttributeError naming it (so a task's ``getattr(model, "device",
    "cpu")`` sees what it would see on that model, and direct use says what is missing), never a
    default of the view's own."""

    def __init__(self, name: str, slot: int, gather: "_Gather"):
        self.name, self._slot, self._gather = name, slot, gather

    def _shared(self, attr: str):
        model = self._gather.model()
        try:
            return getattr(model, attr)
        except AttributeError:
            raise AttributeError(f"row {self.name!r}: the group's multi-head model ({type(model).__name__} "
                                 f"{getattr(model, 'name', '')!r}) has no attribute {attr!r}") from None

    @property
    def tokenizer(self):
        return self._shared("tokenizer")

    @property
    def max_length(self):
        return self._shared("max_length")

    @property
    def device(self):
        return self._shared("device")

    def format_chat(self, user_message: str) -> str:
        return self._gather.model().format_chat(user_message)

    def generate(self, prompts: Sequence[str], *, max_new_tokens: int, stop: Sequence[str] = (),
                 num_samples: int = 1, temperature: float = 0.0, top_p: float = 1.0,
                 seed: int = 0) -> list[list[str]]:
        """See :meth:`darts_bench.api.TextModel.generate`; waits for the gathered call (``top_p``
        is passed on only below 1, so a multi-head model without it serves the other calls)."""
        kw = _generate_kw(max_new_tokens, stop, num_samples, temperature, top_p, seed)
        return self._gather.call(self._slot, "generate", kw, [(self._slot, p) for p in prompts])

    def score(self, contexts: Sequence[str], continuations: Sequence[str]) -> list[ScoreContinuation]:
        """See :meth:`darts_bench.api.TextModel.score`; waits for the gathered call."""
        if len(contexts) != len(continuations):
            raise ValueError(f"{len(contexts)} contexts vs {len(continuations)} continuations")
        return self._gather.call(self._slot, "score", {}, [(self._slot, c, x) for c, x in zip(contexts, continuations)])

    def close(self) -> None:
        """Nothing: the multi-head model is closed with the group."""


class RoutedRowView(RowView):
    """A routed row's view in the one-pass path: each prompt goes to the slot of the head its router
    picks (``slots``: task -> slot of the group's multi-head model), in the chunks the row-by-row
    :class:`~darts_bench.evaluate.routed.RoutedTextModel` runs
    (:func:`~darts_bench.surgery.routing.chunk_plan`), so its outputs equal that path's and the chunks
    it shares with an oracle row are generated once. Routing reads the plain merge's prompt states
    (:func:`~darts_bench.evaluate.routed.prompt_state_source`) during the row's turn."""

    def __init__(self, name: str, slot: int, gather: "_Gather", router, slots: dict[str, int], cfg, model_dir):
        super().__init__(name, slot, gather)
        from darts_bench.evaluate.routed import Routing, check_router_heads, prompt_state_source

        check_router_heads(name, router, slots)

        def states(texts):
            # the group's routed rows share one router per merge and make the same calls in turn: a call's states
            # are computed once for all of them (the same prompt list in the same chunks: the same values)
            key = tuple(texts)
            if key not in gather.prompt_states:
                gather.prompt_states[key] = prompt_state_source(gather.model(), model_dir, cfg)(texts)
            return gather.prompt_states[key]

        self._slots, self._bs = slots, cfg.tasks.batch_size
        self.routing = Routing(router, states)

    def generate(self, prompts: Sequence[str], *, max_new_tokens: int, stop: Sequence[str] = (),
                 num_samples: int = 1, temperature: float = 0.0, top_p: float = 1.0,
                 seed: int = 0) -> list[list[str]]:
        """See :meth:`darts_bench.api.TextModel.generate`: each prompt under its routed head (``top_p``
        passed on only below 1, as :meth:`RowView.generate`)."""
        from darts_bench.surgery.routing import chunk_plan, pick

        prompts = list(prompts)
        choices = self.routing.route(prompts)
        plan = chunk_plan(choices, self._bs, whole=temperature > 0)
        kw = _generate_kw(max_new_tokens, stop, num_samples, temperature, top_p, seed)
        res = self._gather.call(self._slot, "generate", kw,
                                [(self._slots[t], prompts[j]) for t, idx in plan.items() for j in idx])
        outs, o = {}, 0
        for t, idx in plan.items():
            outs[t], o = res[o:o + len(idx)], o + len(idx)
        return pick(choices, plan, outs)

    def score(self, contexts: Sequence[str], continuations: Sequence[str]) -> list[ScoreContinuation]:
        """See :meth:`darts_bench.api.TextModel.score`: each pair under the head its context is routed to
        (requests in pair order, so the multi-head model chunks the pairs as a single-head row does)."""
        if len(contexts) != len(continuations):
            raise ValueError(f"{len(contexts)} contexts vs {len(continuations)} continuations")
        choices = self.routing.route(list(contexts))
        return self._gather.call(self._slot, "score", {},
                                 [(self._slots[t], c, x) for t, c, x in zip(choices, contexts, continuations)])


class _Gather:
    """The turn-taking of :func:`evaluate_group`'s row threads and the batching of their calls.

    Thread ``i`` runs only while ``current == i``. When the running thread calls (``call``) or ends
    (``finish``), the next ready thread in row order gets the turn; when none is ready, the
    waiting calls are executed (grouped by kind and arguments, one multi-head call per group) by
    the thread giving up its turn, and every waiting thread becomes ready again.
    """

    def __init__(self, n: int, model):
        self.model = model
        self.prompt_states: dict[tuple[str, ...], object] = {}  # routed rows' prompt states by call (RoutedRowView)
        self._cond = threading.Condition()
        self._state = ["ready"] * n  # ready | waiting | done
        self._current: int | None = 0 if n else None
        self._pending: dict[int, tuple[str, dict, list]] = {}
        self._answers: dict[int, tuple[bool, object]] = {}

    def enter(self, i: int) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self._current == i)

    def call(self, i: int, kind: str, kwargs: dict, payload: list):
        with self._cond:
            if self._current != i:
                raise RuntimeError(f"row thread {i} called its model outside its turn")
            self._pending[i] = (kind, kwargs, payload)
            self._state[i] = "waiting"
            self._next()
            self._cond.wait_for(lambda: self._current == i)
            ok, value = self._answers.pop(i)
        if not ok:
            raise value  # type: ignore[misc]
        return value

    def finish(self, i: int) -> None:
        with self._cond:
            self._state[i] = "done"
            self._next()

    def _next(self) -> None:
        ready = [j for j, s in enumerate(self._state) if s == "ready"]
        if not ready and self._pending:
            self._flush()
            ready = [j for j, s in enumerate(self._state) if s == "ready"]
        self._current = ready[0] if ready else None
        self._cond.notify_all()

    def _flush(self) -> None:
        calls: dict[tuple, list[int]] = {}
        for i, (kind, kw, _) in sorted(self._pending.items()):
            calls.setdefault((kind, tuple(sorted(kw.items()))), []).append(i)
        for (kind, kw), rows in calls.items():
            try:
                m = self.model()
                # each thread's requests name their slot: (slot, prompt) or (slot, context, continuation)
                reqs = [req for i in rows for req in self._pending[i][2]]
                res = m.generate(reqs, **dict(kw)) if kind == "generate" else m.score(reqs)
                if len(res) != len(reqs):
                    raise RuntimeError(f"multi-head {kind} returned {len(res)} results for {len(reqs)} requests")
                o = 0
                for i in rows:
                    k = len(self._pending[i][2])
                    self._answers[i] = (True, list(res[o:o + k]))
                    o += k
            except Exception as e:  # noqa: BLE001 - handed to every row of the call
                for i in rows:
                    self._answers[i] = (False, e)
        for i in self._pending:
            self._state[i] = "ready"
        self._pending.clear()
