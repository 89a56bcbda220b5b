"""The local pairwise judge behind AlpacaEval: alpaca_eval's annotator machinery (prompt template,
regex parser, preference encoding) with completions from a darts-bench :class:`TextModel`.

* :func:`judge_completions` is the ``fn_completions`` handed to ``alpaca_eval``: one completion per
  prompt, either a forced choice by likelihood (``mode="score"``) or greedy generation
  (``mode="generate"``).
* :func:`judge_pairs` runs ``alpaca_eval.annotators.PairwiseAnnotator`` (no cache, no output-order
  randomisation, no hub, no OpenAI) on a list of ``(instruction, output_1, output_2)`` pairs.
* :func:`judge_consistency` turns verdicts in both orders into a position-consistency rate and
  debiased preferences.

Preferences follow alpaca_eval: 1 = ``output_1`` wins, 2 = ``output_2`` wins, 1.5 = draw.
"""

from __future__ import annotations

import logging
import math
import re
import time
from collections import Counter
from pathlib import Path
from typing import Any, Sequence

import yaml

ANNOTATOR_DIR = Path(__file__).resolve().parent / "local_judge"
VERDICT_TEXT = {1: "Output (a)", 2: "Output (b)"}
NO_VERDICT_TEXT = "(no verdict)"  # what the regex parser cannot read -> a missing annotation
JUDGE_MODES = ("score", "generate")


def _import_alpaca_eval():
    """Import alpaca_eval's annotators and metrics. Importing ``alpaca_eval.annotators.base`` sets the
    root logger to INFO as a side effect; the previous level is restored."""
    root = logging.getLogger()
    level = root.level
    try:
        from alpaca_eval import metrics
        from alpaca_eval.annotators import PairwiseAnnotator
    finally:
        root.setLevel(level)
    return PairwiseAnnotator, metrics


def alpaca_eval_version() -> str:
    from importlib.metadata import version

    return version("alpaca_eval")


# ------------------------------------------------------------------------------ completions
def judge_completions(prompts: Sequence[str], *, judge: Any, max_new_tokens: int = 8, mode: str = "score",
                      use_chat_template: bool = True, **unused: Any) -> dict[str, list]:
    """alpaca_eval ``fn_completions``: one judge completion per formatted annotator prompt.

    Args:
        prompts: prompts formatted by alpaca_eval from the annotator's template.
        judge: a :class:`darts_bench.api.TextModel`.
        max_new_tokens: generation budget (``mode="generate"`` only).
        mode: ``"score"``: the completion is whichever of ``"Output (a)"`` / ``"Output (b)"`` has the
            lower NLL as a continuation of the prompt (an exact tie gives no verdict);
            ``"generate"``: the judge's greedy continuation, left-stripped.
        use_chat_template: wrap each prompt with ``judge.format_chat`` first.
    Returns:
        alpaca_eval's decoder result: ``completions``, ``price_per_example``, ``time_per_example``.
    Raises:
        ValueError: unknown ``mode``.
    """
    if mode not in JUDGE_MODES:
        raise ValueError(f"judge mode {mode!r} unknown; use one of {JUDGE_MODES} (local_judge/configs.yaml)")
    t0 = time.perf_counter()
    texts = [judge.format_chat(p) for p in prompts] if use_chat_template else list(prompts)
    completions: list[str] = []
    if texts and mode == "score":
        contexts = [t for t in texts for _ in (1, 2)]
        continuations = [VERDICT_TEXT[1], VERDICT_TEXT[2]] * len(texts)
        scores = judge.score(contexts, continuations)
        for i in range(len(texts)):
            nll_a, nll_b = scores[2 * i].nll, scores[2 * i + 1].nll
            completions.append(VERDICT_TEXT[1] if nll_a < nll_b else VERDICT_TEXT[2] if nll_b < nll_a
                               else NO_VERDICT_TEXT)
    elif texts:
        outs = judge.generate(texts, max_new_tokens=max_new_tokens, temperature=0.0)
        # alpaca_eval's regex parser raises (and logs a traceback) on "", so an empty answer is spelt out
        completions = [o[0].lstrip() or NO_VERDICT_TEXT for o in outs]
    dt = (time.perf_counter() - t0) / max(len(texts), 1)
    return {"completions": completions, "price_per_example": [0.0] * len(texts),
            "time_per_example": [dt] * len(texts)}


# ------------------------------------------------------------------------ annotator config
def load_annotator_config(annotators_config: str | Path = ANNOTATOR_DIR) -> tuple[Path, str, dict[str, Any]]:
    """``(configs.yaml path, annotator name, its config)``, validated for local use.

    Raises:
        FileNotFoundError: no config file or no prompt template (alpaca_eval would silently use the
            template's *path* as the prompt).
        ValueError: not exactly one annotator; it names ``fn_completions`` (ours is passed at run
            time); it randomises the output order; its batch size is not 1; unknown judge mode.
    """
    path = Path(annotators_config)
    if path.is_dir():
        path = path / "configs.yaml"
    if not path.is_file():
        raise FileNotFoundError(f"annotator config not found: {path}")
    configs = yaml.safe_load(path.read_text(encoding="utf-8"))
    if not isinstance(configs, dict) or len(configs) != 1:
        raise ValueError(f"{path}: expected exactly one annotator (a pool would mix judges at random)")
    (name, cfg), = configs.items()
    if "fn_completions" in cfg:
        raise ValueError(f"{path}: remove fn_completions; the local judge's function is passed at run time")
    if cfg.get("is_randomize_output_order", True):
        raise ValueError(f"{path}: set is_randomize_output_order: false (both orders are judged explicitly)")
    if cfg.get("batch_size", 1) != 1:
        raise ValueError(f"{path}: batch_size must be 1")
    mode = (cfg.get("completions_kwargs") or {}).get("mode", "score")
    if mode not in JUDGE_MODES:
        raise ValueError(f"{path}: completions_kwargs.mode {mode!r} unknown; use one of {JUDGE_MODES}")
    template = path.parent.parent / cfg["prompt_template"]
    if not template.is_file():
        raise FileNotFoundError(f"{path}: prompt template not found: {template}")
    return path, name, cfg


def _format_prompt(template: str, instruction: str, output_1: str, output_2: str) -> str:
    """The annotator prompt for one pair, formatted the way alpaca_eval does (first occurrence of each
    placeholder replaced in turn); used only to label raw completions that failed to parse."""
    fields = {"instruction": instruction, "output_1": output_1, "output_2": output_2}
    out = template
    for key in Counter(re.findall(r"{([^ \s]+?)}", template)):
        out = out.replace("{" + key + "}", str(fields.get(key, "{" + key + "}")), 1)
    return out


def _is_verdict(v: Any) -> bool:
    try:
        return v is not None and not math.isnan(float(v)) and 1.0 <= float(v) <= 2.0
    except (TypeError, ValueError):
        return False


# -------------------------------------------------------------------------------- judging
def judge_pairs(judge: Any, pairs: Sequence[tuple[str, str, str]], *, max_new_tokens: int = 8,
                annotators_config: str | Path = ANNOTATOR_DIR, seed: int = 0
                ) -> list[tuple[float | None, str | None]]:
    """Judge ``(instruction, output_1, output_2)`` pairs with alpaca_eval's ``PairwiseAnnotator``.

    No cache (``caching_path=None``), no output-order randomisation, completions from
    :func:`judge_completions` bound to ``judge``. Identical outputs get 1.5 from alpaca_eval without
    a judge call.

    Returns:
        per pair, in input order: ``(preference, raw judge completion)``; ``preference`` is 1, 2
        (or 1.5 for identical outputs), or ``None`` when the completion could not be parsed.
    """
    if not pairs:
        return []
    PairwiseAnnotator, _ = _import_alpaca_eval()
    import pandas as pd

    path, name, cfg = load_annotator_config(annotators_config)
    template = (path.parent.parent / cfg["prompt_template"]).read_text(encoding="utf-8")
    raw_by_prompt: dict[str, str] = {}

    def fn_completions(prompts: Sequence[str], **kwargs: Any) -> dict[str, list]:
        out = judge_completions(prompts, judge=judge, max_new_tokens=max_new_tokens, **kwargs)
        raw_by_prompt.update(zip(prompts, out["completions"]))
        return out

    root = logging.getLogger()
    level = root.level
    try:
        annotator = PairwiseAnnotator(annotators_config=str(path), caching_path=None, seed=seed,
                                      fn_completions=fn_completions)
        df = pd.DataFrame([{"instruction": i, "output_1": a, "output_2": b} for i, a, b in pairs])
        annotated = annotator.annotate_pairs(df)
    finally:
        root.setLevel(level)
    by_key = {(r["instruction"], r["output_1"], r["output_2"]): r for r in annotated}
    results: list[tuple[float | None, str | None]] = []
    for key in pairs:
        row = by_key.get(tuple(key), {})
        pref = row.get("preference")
        raw = row.get("preference_raw_completion")
        if not isinstance(raw, str):
            raw = raw_by_prompt.get(_format_prompt(template, *key))
        results.append((float(pref) if _is_verdict(pref) else None, raw))
    return results


def _winner(v: float) -> float:
    return 1.0 if v < 1.5 else 2.0 if v > 1.5 else 1.5


def judge_consistency(verdicts_ab: Sequence[float | None], verdicts_ba: Sequence[float | None]
                      ) -> tuple[float | None, list[float | None]]:
    """Position consistency and debiased preferences from verdicts in both orders.

    Args:
        verdicts_ab: alpaca_eval preferences with the reference as ``output_1`` and the model as
            ``output_2`` (1 = reference wins, 2 = model wins, 1.5 = draw, None/NaN = no verdict).
        verdicts_ba: the same pairs judged with the outputs swapped (model as ``output_1``), in that
            order's own frame (1 = model wins).
    Returns:
        ``(consistency, preferences)``: the fraction of pairs whose two verdicts name the same winner
        (a draw both ways agrees; a missing verdict never agrees), ``None`` for no pairs; and per
        pair a preference in the first frame (1 = reference wins, 2 = model wins): the agreed winner,
        1.5 (a tie) when the orders disagree, ``None`` when a verdict is missing in either order (the
        pair has no debiased verdict; :func:`win_rate` drops it, as alpaca_eval's ``get_winrate``
        drops an annotation it could not parse).
    Raises:
        ValueError: the two lists differ in length.
    """
    if len(verdicts_ab) != len(verdicts_ba):
        raise ValueError(f"judge_consistency: {len(verdicts_ab)} verdicts in one order, {len(verdicts_ba)} in the other")
    prefs: list[float] = []
    n_consistent = 0
    for ab, ba in zip(verdicts_ab, verdicts_ba):
        if not (_is_verdict(ab) and _is_verdict(ba)):
            prefs.append(None)
        elif _winner(float(ab)) == _winner(3.0 - float(ba)):
            n_consistent += 1
            prefs.append(_winner(float(ab)))
        else:
            prefs.append(1.5)
    return (n_consistent / len(prefs) if prefs else None), prefs


def _is_preference(v: Any) -> bool:
    """alpaca_eval's preference encoding: 1 = output_1 wins, 2 = output_2 wins, 0 or 1.5 = draw,
    values in between from weighted annotators; ``None``/NaN = missing."""
    try:
        return v is not None and not math.isnan(float(v)) and (float(v) == 0.0 or 1.0 <= float(v) <= 2.0)
    except (TypeError, ValueError):
        return False


def win_rate(preferences: Sequence[float | None]) -> dict[str, float] | None:
    """alpaca_eval's ``metrics.get_winrate`` on preferences in alpaca_eval's encoding (1 = reference
    wins, 2 = model wins, 0 or 1.5 = draw): ``win_rate([2, 0, 0, 1, 2])`` is 60.0 over 5. Missing
    ones (``None``/NaN) are dropped as alpaca_eval does. ``None`` if none is left.

    Raises:
        ValueError: a value outside alpaca_eval's encoding (e.g. 3 or -1).
    """
    bad = [p for p in preferences if p is not None and not (isinstance(p, float) and math.isnan(p))
           and not _is_preference(p)]
    if bad:
        raise ValueError(f"win_rate: preferences must be 0, 1.5 (draws) or in [1, 2]; got {bad[:5]}")
    prefs = [float(p) for p in preferences if _is_preference(p)]
    if not prefs:
        return None
    _, metrics = _import_alpaca_eval()
    out = metrics.get_winrate([{"preference": p} for p in prefs])
    return {k: float(v) for k, v in out.items()}


__all__ = ["ANNOTATOR_DIR", "judge_completions", "judge_pairs", "judge_consistency", "load_annotator_config",
           "win_rate", "alpaca_eval_version"]
