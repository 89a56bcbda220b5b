"""The tasks stage: each selected task with its evaluated examples, formatted for the pool's tokenizer."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from darts_bench.api import Example, Task, get_task


@dataclass
class LoadedTasks:
    """``tasks``: task name -> (task, examples in evaluation order); ``tokenizer`` the base's
    tokenizer and ``formatter`` the :class:`~darts_bench.evaluate.hf_model.PromptFormatter` over it
    (both reused by collection); ``calibration_inputs``: task name -> the benchmark prompts the
    transductive calibration set draws from (:func:`calibration_inputs`)."""

    tasks: dict[str, tuple[Task, list[Example]]]
    tokenizer: Any
    formatter: Any
    calibration_inputs: dict[str, list[str]] = field(default_factory=dict)


def calibration_inputs(cfg, task: Task, examples: list[Example], fmt) -> list[str]:
    """The prompts a task's transductive calibration set is drawn from: with
    ``calibration.transductive_inputs = benchmark`` the benchmark's first ``calibration.n_prompts``
    inputs (its evaluated examples are the first ``limit`` of them, so they come first; formatted as
    at evaluation; inputs only, the references are never read into calibration), else (``evaluated``)
    the evaluated examples' prompts. Empty for a task without an expert or a run without the
    transductive split."""
    cal = cfg.calibration
    if task.expert is None or "transductive" not in cal.splits:
        return []
    if cal.transductive_inputs == "evaluated" or len(examples) >= cal.n_prompts:
        return [e.prompt for e in examples]
    return [e.prompt for e in task.examples(cfg.resolved_data_dir(), fmt, cal.n_prompts)]


def load_tasks(cfg, task_names: list[str], base_dir: Path, limits: dict[str, int | None]) -> LoadedTasks:
    """Instantiate each task in ``task_names`` with its config section (:func:`darts_bench.api.get_task`
    sets its protocol from ``tasks.<task>.protocol``: one per run, every row gets the same prompts), run its preflight check (e.g. a named AlpacaEval annotator's
    API key, before any generation) and build its examples (at most ``limits[task]``).

    Raises:
        ValueError: a task yields no examples (the message names it).
    """
    from transformers import AutoTokenizer

    from darts_bench.evaluate.hf_model import PromptFormatter

    tok = AutoTokenizer.from_pretrained(str(base_dir))
    fmt = PromptFormatter(tok)
    out, calib_inputs = {}, {}
    for name in task_names:
        tcfg = getattr(cfg.tasks, name, None)
        task = get_task(name, tcfg)  # task.protocol from tcfg: every row gets this protocol's prompts
        if callable(getattr(task, "preflight", None)):
            task.preflight(tcfg)  # e.g. a named AlpacaEval annotator's API key, before any generation
        ex = task.examples(cfg.resolved_data_dir(), fmt, limits[name])
        if not ex:
            raise ValueError(f"task {name}: no examples")
        out[name] = (task, ex)
        calib_inputs[name] = calibration_inputs(cfg, task, ex, fmt)
    return LoadedTasks(out, tok, fmt, calib_inputs)
