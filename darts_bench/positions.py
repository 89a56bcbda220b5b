"""How many absolute positions a run's sequences reach, and so how long a DARTS bias table must be.

A DARTS head indexes a ``[max_len, d_model]`` table by absolute position; positions past the table
follow ``surgery.overflow`` (``clamp`` reuses the last row), so a table shorter than the sequences
turns the "per-position" bias into one constant vector over the tail. The longest sequences of a
config, in tokens (positions ``0 .. n - 1``):

* calibration: a prompt of at most ``calibration.max_prompt_tokens`` plus the expert's continuation
  of at most ``calibration.max_new_tokens``;
* reference answers (diagnostics only): prompt and reference answer, each at most
  ``calibration.max_prompt_tokens``;
* evaluation: a prompt truncated to :data:`EVAL_MAX_PROMPT_TOKENS` (or the model's
  ``max_position_embeddings`` when smaller, as :class:`~darts_bench.evaluate.hf_model.HFTextModel`
  does) plus the task's ``max_new_tokens``.

``surgery.max_len: null`` (the default) derives the table length from these; an explicit value
shorter than them is allowed (a smaller head) but is reported by the planner and logged at training.
No torch import here: the dry-run planner uses this module.
"""

from __future__ import annotations

EVAL_MAX_PROMPT_TOKENS = 1024  # HFTextModel's default max_length cap (tokens)
POSITION_BIAS_METHODS = ("darts", "darts_pos_only")  # as darts_bench.surgery.heads.METHODS (no torch here)


def sequence_lengths(cfg, task_names, max_position_embeddings: int | None = None) -> dict[str, int]:
    """Upper bounds (tokens) of the calibration, reference and evaluation sequences of ``cfg`` for
    the tasks ``task_names``; ``max_position_embeddings`` (the model's, when known) caps prompts
    at evaluation."""
    cal = cfg.calibration
    eval_prompt = EVAL_MAX_PROMPT_TOKENS
    if max_position_embeddings:
        eval_prompt = min(eval_prompt, int(max_position_embeddings))
    new = [getattr(getattr(cfg.tasks, t), "max_new_tokens", 0) for t in task_names]
    return {"calibration": cal.max_prompt_tokens + cal.max_new_tokens,
            "reference": 2 * cal.max_prompt_tokens,
            "evaluation": eval_prompt + max(new, default=0)}


def required_max_len(cfg, task_names, max_position_embeddings: int | None = None) -> int:
    """Bias-table rows needed so that no calibration or evaluated position is clamped."""
    return max(sequence_lengths(cfg, task_names, max_position_embeddings).values())


def resolve_max_len(cfg, task_names, max_position_embeddings: int | None = None) -> int:
    """``surgery.max_len`` when set, else :func:`required_max_len`."""
    if cfg.surgery.max_len is not None:
        return int(cfg.surgery.max_len)
    return required_max_len(cfg, task_names, max_position_embeddings)


def clamp_warning(cfg, task_names, max_position_embeddings: int | None = None) -> str | None:
    """A message when a DARTS method's table (``surgery.max_len``) is shorter than the run's
    sequences (positions past it share one row or get no bias), else None."""
    if not any(m in POSITION_BIAS_METHODS for m in cfg.surgery.methods):
        return None
    L = resolve_max_len(cfg, task_names, max_position_embeddings)
    lens = sequence_lengths(cfg, task_names, max_position_embeddings)
    over = {k: v for k, v in lens.items() if v > L}
    if not over:
        return None
    what = ", ".join(f"{k} up to {v}" for k, v in over.items())
    return (f"surgery.max_len {L} is shorter than the sequences ({what} tokens): positions >= {L} get "
            f"{'row ' + str(L - 1) if cfg.surgery.overflow == 'clamp' else cfg.surgery.overflow + ' overflow'} "
            f"of the DARTS bias table; leave surgery.max_len unset (derived: {max(lens.values())}) or raise it")
