"""Answer extraction from model outputs: regex filters the way lm-eval's ``RegexFilter`` applies
them, the last number in a text, number normalisation for exact match, and MergeLM's (WizardMath's)
GSM8K answer extraction and verdict."""

from __future__ import annotations

import re
import unicodedata
from fractions import Fraction
from typing import Sequence

__all__ = ["regex_extract", "last_number", "normalize_number", "NUMBER_PATTERN", "mergelm_answer_number",
           "mergelm_is_correct", "MERGELM_ANSWER_MARKER", "MERGELM_NUMBER_PATTERN"]

#: A signed number with optional ``$``, thousands commas and decimals (lm-eval's GSM8K
#: ``flexible-extract`` pattern).
NUMBER_PATTERN = re.compile(r"(-?[$0-9.,]{2,})|(-?[0-9]+)")


def regex_extract(pattern: re.Pattern[str] | str, text: str, group_select: int = 0) -> str | None:
    """What lm-eval's ``RegexFilter`` returns: the ``group_select``-th match of ``pattern`` in
    ``text`` (negative counts from the end), the first non-empty group of a multi-group pattern,
    stripped; ``None`` where lm-eval returns its ``[invalid]`` fallback (no match)."""
    pattern = re.compile(pattern) if isinstance(pattern, str) else pattern
    matches = pattern.findall(text if isinstance(text, str) else "")
    if not matches:
        return None
    m = matches[group_select]
    if isinstance(m, tuple):
        m = next((g for g in m if g), None)
        if m is None:
            return None
    return m.strip()


def last_number(text: str) -> str | None:
    """The last number-like token of ``text`` (raw: ``$``, commas, a trailing period kept)."""
    return regex_extract(NUMBER_PATTERN, text, -1)


def normalize_number(text: str, ignore: Sequence[str] = (",", r"\$", r"(?s).*#### ", r"\.$"),
                     lower: bool = True) -> str:
    """``text`` with each regex in ``ignore`` removed (lm-eval's ``regexes_to_ignore``; by
    default GSM8K's: commas, ``$``, everything up to ``#### ``, a trailing period), lower-cased.
    ``"$3,000."`` -> ``"3000"``."""
    for pat in ignore:
        text = re.sub(pat, "", text)
    return text.lower() if lower else text


# ------------------------------------------------------------------ MergeLM / WizardMath GSM8K scoring
#: The marker MergeLM's ``extract_answer_number`` splits on (case and the trailing space matter).
MERGELM_ANSWER_MARKER = "The answer is: "
#: MergeLM's number pattern: optional sign, digits, at most one ``.``, ``,`` or ``/``, digits.
MERGELM_NUMBER_PATTERN = re.compile(r"[\-+]?\d*[\.,/]?\d+")


def _mergelm_is_number(s: str) -> bool:
    """MergeLM's ``is_number``: ``float(s)`` parses, or ``s`` is one Unicode numeric character."""
    try:
        float(s)
        return True
    except ValueError:
        pass
    try:
        unicodedata.numeric(s)
        return True
    except (TypeError, ValueError):
        return False


def mergelm_answer_number(completion: str) -> int | None:
    """The answer MergeLM reads from a GSM8K completion: its ``extract_answer_number``
    (``yule-BUAA/MergeLM`` ``utils/evaluate_llms_utils.py`` at commit 6d49ad96, the same function
    as WizardMath's ``inference/gsm8k_inference.py``), re-implemented step by step.

    The text after the *last* ``"The answer is: "`` is stripped and searched for the first match of
    :data:`MERGELM_NUMBER_PATTERN` (so ``$18``, ``+18``, ``**18**``, ``\\boxed{18}`` and ``x = 18``
    all read 18, and so does ``eighteen, 18 apples``); a ``a/b`` match is a fraction (``36/2`` -> 18;
    a denominator ``"0"`` gives ``round(a)``); ``1,234`` drops its comma (the pattern takes one
    separator only: ``1,234,567`` reads 1234, as in MergeLM); the value is rounded with Python's
    ``round`` (``17.5`` -> 18, ``16.5`` -> 16, ``18.0`` -> 18).

    Returns ``None`` (MergeLM's invalid output) for no marker, no number after it, a fraction whose
    parts are not numbers (``/2``), or ``inf``. Where MergeLM's own code raises (a denominator of
    several zeros such as ``5/00``, or a number too large for a float) this returns ``None`` too.
    MergeLM imports ``Fraction`` from the PyPI package ``fraction``; the standard library's
    :class:`fractions.Fraction` is used here: both give the same rational, so the same rounded value.
    """
    parts = completion.split(MERGELM_ANSWER_MARKER)
    if len(parts) < 2:
        return None
    match = MERGELM_NUMBER_PATTERN.search(parts[-1].strip())
    if match is None:
        return None
    s = match.group()
    try:
        if "/" in s:
            numerator, denominator = s.split("/")[0], s.split("/")[1]
            if not (_mergelm_is_number(denominator) and _mergelm_is_number(numerator)):
                return None
            if denominator == "0":
                return round(float(numerator.replace(",", "")))
            frac = Fraction(s.replace(",", ""))
            return round(float(frac.numerator / frac.denominator))
        value = float(s.replace(",", ""))
        if value == float("inf"):
            return None
        return round(value)
    except (ZeroDivisionError, OverflowError, ValueError):
        return None


def mergelm_is_correct(answer: int | None, gold: str) -> bool:
    """MergeLM's GSM8K verdict: ``float(answer) == float(gold)``, ``gold`` being the integer after
    ``"#### "`` of a GSM8K solution (or that number alone) with commas removed; ``answer`` from
    :func:`mergelm_answer_number` (``None``: wrong).

    Raises:
        ValueError: ``gold`` is not an integer (after ``#### `` if present), naming it.
    """
    number = gold.split("#### ")[1] if "#### " in gold else gold
    try:
        gold_value = int(number.replace(",", "").strip())
    except ValueError:
        raise ValueError(f"mergelm_is_correct: gold answer {number!r} is not an integer (MergeLM's GSM8K "
                         "gold is int(answer.split('#### ')[1]))") from None
    return answer is not None and float(answer) == float(gold_value)
