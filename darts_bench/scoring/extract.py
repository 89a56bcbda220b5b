"""Answer extraction from model outputs: regex filters the way lm-eval's ``RegexFilter`` applies
them, the last number in a text, and number normalisation for exact match."""

from __future__ import annotations

import re
from typing import Sequence

__all__ = ["regex_extract", "last_number", "normalize_number", "NUMBER_PATTERN"]

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
