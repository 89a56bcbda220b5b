"""Failure modes of generated outputs (issue 57): a repetition loop at the end of an output, and the
per-example summaries that become the ``<task>_repeat_rate`` / ``<task>_len_tokens`` columns.

Merged models are known to loop, ramble or drop the answer format; these columns make that visible
beside the task metric (``<task>_extract_rate``: an answer could be read; ``<task>_truncated_rate``:
generation hit ``max_new_tokens``).
"""

from __future__ import annotations

import re
from typing import Any, Sequence

__all__ = ["repetition_loop", "LOOP_MIN_REPEATS", "LOOP_MIN_TOKENS", "output_modes", "failure_columns", "FAILURE_SUFFIXES"]

#: A loop repeats its span at least this many times (the last copy may be cut short)...
LOOP_MIN_REPEATS = 3
#: ... and covers at least this many word / punctuation tokens of the output's end.
LOOP_MIN_TOKENS = 32

_TOKEN = re.compile(r"\w+|[^\w\s]")


def repetition_loop(text: str, min_repeats: int = LOOP_MIN_REPEATS, min_tokens: int = LOOP_MIN_TOKENS) -> bool:
    """Whether ``text`` ends in a loop: a span of ``p`` tokens repeated back to back, covering the
    last ``max(min_repeats * p, min_tokens)`` tokens or more (the last copy may be partial, as
    generation stops mid-span at the token cap). Tokens are runs of word characters and single
    punctuation marks (whitespace ignored); digits read as ``0``, so a numbered list that repeats its
    items (``2. X\\n3. X\\n4. X``) loops. An output shorter than ``min_tokens`` tokens never loops.

    Raises:
        ValueError: ``min_repeats < 2`` or ``min_tokens < 2``.
    """
    if min_repeats < 2 or min_tokens < 2:
        raise ValueError(f"repetition_loop: min_repeats and min_tokens must be >= 2, got {min_repeats}, {min_tokens}")
    toks = _TOKEN.findall(re.sub(r"\d", "0", text))
    n = len(toks)
    if n < min_tokens:
        return False
    for p in range(1, n // min_repeats + 1):
        i = n - 1 - p  # the suffix is p-periodic while toks[i] == toks[i + p]
        while i >= 0 and toks[i] == toks[i + p]:
            i -= 1
        covered = n - 1 - i
        if covered >= max(min_repeats * p, min_tokens):
            return True
    return False


def output_modes(outputs: Sequence[Sequence[Any]]) -> dict[str, list[float] | None]:
    """Per example (``outputs[example][sample]``: generated texts, :class:`darts_bench.api.Completion`
    where the model gives token counts), over its samples: ``repeat`` (share of samples ending in a
    :func:`repetition_loop`) and ``len_tokens`` (mean generated tokens, eos excluded; ``None`` when
    some output carries no token count: a model returning plain strings)."""
    repeat = [sum(repetition_loop(str(o)) for o in outs) / len(outs) for outs in outputs]
    have_len = all(isinstance(getattr(o, "n_tokens", None), int) for outs in outputs for o in outs)
    lens = [sum(o.n_tokens for o in outs) / len(outs) for outs in outputs] if have_len else None
    return {"repeat": repeat, "len_tokens": lens}


#: The failure-mode columns a task adds, ``<task><suffix>`` (the truncation column,
#: ``<task>_truncated_rate``, predates them).
FAILURE_SUFFIXES = ("_extract_rate", "_repeat_rate", "_len_tokens")


def failure_columns(task: str, outputs: Sequence[Sequence[Any]], extracted: Sequence[float]
                    ) -> tuple[dict[str, float | None], dict[str, list[float]]]:
    """``(metrics, per_example)`` of the failure-mode columns of one evaluation: ``<task>_extract_rate``
    (mean of ``extracted``, per example the share of its samples from which the task's protocol read
    an answer, in [0, 1]), ``<task>_repeat_rate`` (share of outputs ending in a loop) and
    ``<task>_len_tokens`` (mean generated tokens per output; ``None`` without token counts);
    ``per_example`` holds ``extracted``, ``repeat`` and, where known, ``len_tokens``.

    Raises:
        ValueError: ``extracted`` and ``outputs`` differ in length, or no outputs.
    """
    if not outputs or len(extracted) != len(outputs):
        raise ValueError(f"failure_columns: {len(outputs)} examples of outputs, {len(extracted)} extraction flags")
    modes = output_modes(outputs)
    n = len(outputs)
    lens = modes["len_tokens"]
    metrics = {f"{task}_extract_rate": sum(extracted) / n, f"{task}_repeat_rate": sum(modes["repeat"]) / n,
               f"{task}_len_tokens": None if lens is None else sum(lens) / n}
    per = {"extracted": [float(x) for x in extracted], "repeat": modes["repeat"]}
    if lens is not None:
        per["len_tokens"] = lens
    return metrics, per
