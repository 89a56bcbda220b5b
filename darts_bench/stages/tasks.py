"""The tasks stage: each selected task with its evaluated examples, formatted for the pool's tokenizer."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from darts_bench.api import Example, Task, get_task


@dataclass
class LoadedTasks:
    """``tasks``: task name -> (task, examples in evaluation order); ``tokenizer`` the base's
    tokenizer and ``formatter`` the :class:`~darts_bench.evaluate.hf_model.PromptFormatter` over it
    (both reused by collection)."""

    tasks: dict[str, tuple[Task, list[Example]]]
    tokenizer: Any
    formatter: Any


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
    out = {}
    for name in task_names:
        tcfg = getattr(cfg.tasks, name, None)
        task = get_task(name, tcfg)  # task.protocol from tcfg: every row gets this protocol's prompts
        if callable(getattr(task, "preflight", None)):
            task.preflight(tcfg)  # e.g. a named AlpacaEval annotator's API key, before any generation
        ex = task.examples(cfg.resolved_data_dir(), fmt, limits[name])
        if not ex:
            raise ValueError(f"task {name}: no examples")
        out[name] = (task, ex)
    return LoadedTasks(out, tok, fmt)
