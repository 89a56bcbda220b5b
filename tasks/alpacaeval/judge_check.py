"""A known-answer check a local AlpacaEval judge must pass before its verdicts count (issue 57).

The known answers are built from the AlpacaEval references themselves: each reference against a
damaged copy of itself, which a judge that reads quality must find worse. Four damages, in turn:
``truncated_third`` (the first third of its words), ``shuffled_sentences`` (its sentences, or words
when it has one sentence, in a seeded random order), ``unrelated_reference`` (another instruction's
reference) and ``empty`` (an empty reply). Each pair is judged in both orders (reference as
``output_1``, then as ``output_2``) through the same alpaca_eval annotator as the run's win rate
(:func:`tasks.alpacaeval.judge.judge_pairs`).

* **accuracy**: the share of the ``2 * n_pairs`` verdicts that prefer the intact reference (a missing
  verdict or a draw counts as wrong); a judge that answers by position alone scores exactly 0.5.
* **order consistency**: :func:`tasks.alpacaeval.judge.judge_consistency` over the pairs (a
  position-only judge: 0).
* **passed**: ``accuracy >= min_accuracy`` (``tasks.alpacaeval.judge.check_min_accuracy``, default
  0.75: above what a position-only judge, 0.5, or a coin can reach on 16 pairs x 2 orders with
  any regularity).
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path
from typing import Any, Callable, Sequence

from darts_bench.artifacts import cached, stable_hash

from .judge import judge_consistency, judge_pairs

__all__ = ["CHECK_VERSION", "DAMAGES", "damage", "known_answer_pairs", "score_check", "run_judge_check"]

#: Bumped when the set or the scoring changes (part of the cache key).
CHECK_VERSION = "1"
DAMAGES = ("truncated_third", "shuffled_sentences", "unrelated_reference", "empty")
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+|\n+")


def damage(kind: str, reference: str, other: str, seed: int) -> str:
    """``reference`` damaged by ``kind`` (:data:`DAMAGES`); ``other``: the unrelated reference.
    The result always differs from ``reference`` when ``reference`` has two words or more.

    Raises:
        ValueError: unknown ``kind``.
    """
    if kind == "truncated_third":
        words = list(re.finditer(r"\S+", reference))
        if len(words) < 3:
            return ""
        return reference[:words[len(words) // 3 - 1].end()]
    if kind == "shuffled_sentences":
        parts = [p for p in _SENTENCE_END.split(reference.strip()) if p.strip()]
        sep = "\n" if len(parts) > 1 else " "
        if len(parts) < 2:
            parts = reference.split()
        shuffled = list(parts)
        random.Random(seed).shuffle(shuffled)
        if shuffled == parts:
            shuffled = parts[::-1]
        return sep.join(shuffled)
    if kind == "unrelated_reference":
        return other
    if kind == "empty":
        return ""
    raise ValueError(f"damage: unknown kind {kind!r}; known: {DAMAGES}")


def known_answer_pairs(instructions: Sequence[str], references: Sequence[str], n_pairs: int, seed: int
                       ) -> list[dict[str, Any]]:
    """``n_pairs`` known-answer pairs: pair ``k`` takes reference ``k % m`` (``m`` references) and
    damage ``DAMAGES[k % 4]``; the unrelated reference is reference ``(k + m // 2) % m``.

    Returns:
        per pair ``{"instruction", "reference", "damaged", "damage"}``.
    Raises:
        ValueError: fewer than 2 references, lists of different lengths, or ``n_pairs < 1``.
    """
    m = len(references)
    if m < 2 or len(instructions) != m or n_pairs < 1:
        raise ValueError(f"known_answer_pairs: need >= 2 instructions with references and n_pairs >= 1 "
                         f"(got {len(instructions)} instructions, {m} references, n_pairs={n_pairs})")
    pairs = []
    for k in range(n_pairs):
        i, kind = k % m, DAMAGES[k % len(DAMAGES)]
        other = references[(i + max(1, m // 2)) % m]
        pairs.append({"instruction": instructions[i], "reference": references[i],
                      "damaged": damage(kind, references[i], other, seed + k), "damage": kind})
    return pairs


def score_check(v_ref_first: Sequence[float | None], v_ref_second: Sequence[float | None],
                min_accuracy: float) -> dict[str, Any]:
    """Accuracy, order consistency and the verdict of the check from alpaca_eval preferences:
    ``v_ref_first[k]`` with the reference as ``output_1`` (1 = reference preferred),
    ``v_ref_second[k]`` with it as ``output_2`` (2 = reference preferred).

    Returns:
        ``{"accuracy", "order_consistency", "n_pairs", "n_verdicts", "passed", "min_accuracy"}``
        (``accuracy`` in [0, 1], over ``2 * n_pairs`` verdicts).
    Raises:
        ValueError: the lists differ in length or are empty.
    """
    if not v_ref_first or len(v_ref_first) != len(v_ref_second):
        raise ValueError(f"score_check: {len(v_ref_first)} and {len(v_ref_second)} verdicts")
    right = sum(v is not None and float(v) < 1.5 for v in v_ref_first) + \
        sum(v is not None and float(v) > 1.5 for v in v_ref_second)
    n = 2 * len(v_ref_first)
    consistency, _ = judge_consistency(v_ref_first, v_ref_second)
    accuracy = right / n
    return {"accuracy": accuracy, "order_consistency": consistency, "n_pairs": len(v_ref_first),
            "n_verdicts": n, "passed": accuracy >= min_accuracy, "min_accuracy": min_accuracy}


def run_judge_check(judge: Any, instructions: Sequence[str], references: Sequence[str], *, n_pairs: int,
                    min_accuracy: float, seed: int, max_new_tokens: int, annotators_config: Any,
                    cache_root: Path | None = None, judge_key: str | None = None,
                    load_judge: Callable[[], Any] | None = None) -> dict[str, Any]:
    """Judge the known-answer set (:func:`known_answer_pairs`) in both orders and score it
    (:func:`score_check`). ``judge``: the judge model, or None with ``load_judge`` (and ``judge_key``), which
    loads it only when the check is not cached (a per-request backend then loads it once per run, not once
    per row). With ``cache_root``, the result is an artifact
    ``<cache_root>/judge_check/<hash>/judge_check.json`` keyed by (check version, ``judge_key`` or the
    judge's name, the annotator config file's text, the pairs, ``min_accuracy``, ``max_new_tokens``)
    and reused by every row of a run.

    Returns:
        :func:`score_check`'s dict plus ``"version"``, ``"key"``, ``"pairs"`` (per pair its damage
        and both verdicts) and ``"damages"``.
    """
    pairs = known_answer_pairs(instructions, references, n_pairs, seed)
    cfg_path = Path(annotators_config)
    cfg_text = (cfg_path / "configs.yaml" if cfg_path.is_dir() else cfg_path).read_text(encoding="utf-8")
    if judge is None and (load_judge is None or judge_key is None):
        raise ValueError("run_judge_check: give the judge, or load_judge with judge_key")
    key = stable_hash({"version": CHECK_VERSION, "judge": judge_key or getattr(judge, "name", repr(judge)),
                       "annotator": cfg_text, "pairs": pairs, "min_accuracy": min_accuracy,
                       "max_new_tokens": max_new_tokens})

    def compute() -> dict[str, Any]:
        asked = [(p["instruction"], p["reference"], p["damaged"]) for p in pairs] + \
                [(p["instruction"], p["damaged"], p["reference"]) for p in pairs]
        judged = judge_pairs(judge if judge is not None else load_judge(), asked, max_new_tokens=max_new_tokens,
                             annotators_config=annotators_config, seed=seed)
        first, second = [v for v, _ in judged[:len(pairs)]], [v for v, _ in judged[len(pairs):]]
        out = score_check(first, second, min_accuracy)
        out.update(version=CHECK_VERSION, key=key, damages=list(DAMAGES),
                   pairs=[{"damage": p["damage"], "verdict_reference_first": a, "verdict_reference_second": b}
                          for p, a, b in zip(pairs, first, second)])
        return out

    if cache_root is None:
        return compute()
    final = Path(cache_root) / "judge_check" / key
    cached(final, lambda tmp: (tmp / "judge_check.json").write_text(json.dumps(compute(), indent=1)),
           "alpacaeval judge check")
    return json.loads((final / "judge_check.json").read_text(encoding="utf-8"))
