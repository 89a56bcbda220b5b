"""darts_bench.scoring: the shared helpers at their public path agree with the built-in tasks."""

import pytest

from darts_bench.api import get_task
from darts_bench.scoring import last_number, normalize_number, pass_at_k, regex_extract
from darts_bench.scoring.extract import NUMBER_PATTERN


def test_pass_at_k_exact_values():
    # n=5 samples, c=2 correct: pass@1 = 2/5, pass@2 = 1 - C(3,2)/C(5,2) = 0.7
    assert pass_at_k([5], [2], 1) == (pytest.approx(0.4), [pytest.approx(0.4)])
    assert pass_at_k([5, 5], [2, 0], 2)[1] == [pytest.approx(0.7), 0.0]
    with pytest.raises(ValueError, match="k=3"):
        pass_at_k([2], [1], 3)


def test_extraction_matches_gsm8k_filters():
    gsm8k = get_task("gsm8k")
    mod = __import__(type(gsm8k).__module__, fromlist=["x"])
    assert NUMBER_PATTERN.pattern == mod.FLEXIBLE_PATTERN.pattern  # the same regex lm-eval's YAML has
    for text in ["so 3 + 4 = 7 apples, costs $3,000.", "#### 42", "no number here", "-5 then 12.5."]:
        assert last_number(text) == mod.extract_flexible(text), text
    assert last_number("costs $3,000.") == "$3,000." and normalize_number("$3,000.") == "3000"
    assert normalize_number("The answer is #### 1,234") == mod.normalize_number("The answer is #### 1,234") == "1234"
    assert regex_extract(r"#### (\-?[0-9\.\,]+)", "x #### 12 y #### 13") == "12"
    assert regex_extract(r"(\d+)", "none") is None


# ------------------------------------------------------------------ MergeLM's GSM8K extraction
from darts_bench.scoring.extract import mergelm_answer_number, mergelm_is_correct  # noqa: E402

MERGELM_CASES = [
    # (completion, MergeLM's extract_answer_number) -- worked through its code by hand
    ("The answer is: 5.\n...\nThe answer is: 18.", 18),    # the LAST marker
    ("The answer is: $18", 18),                            # '$' skipped by re.search
    ("The answer is: +18", 18),
    ("The answer is: -7", -7),
    ("The answer is: **18**", 18),
    ("The answer is: \\boxed{18}", 18),
    ("The answer is: x = 18", 18),
    ("The answer is: 36/2", 18),                           # fraction
    ("The answer is: 5/0", 5),                             # denominator '0': round(numerator)
    ("The answer is: 18.0", 18),
    ("The answer is: 17.5", 18),                           # Python round: half to even
    ("The answer is: 16.5", 16),
    ("The answer is: 1,018 dollars", 1018),                # thousands separator
    ("The answer is: 1,234,567", 1234),                    # one separator only, as in MergeLM
    ("The answer is: eighteen, that is 18 apples", 18),    # first number anywhere after the marker
    ("The answer is: /2", None),                           # numerator '' is not a number
    ("The answer is: 5/00", None),                         # MergeLM's Fraction raises; no answer here
    ("The answer is: eighteen", None),
    ("The answer is:18", None),                            # the marker has a space after the colon
    ("the answer is: 18", None),                           # case-sensitive
    ("So the total is 18.", None),
    ("#### 18", None),
]


@pytest.mark.parametrize("completion,want", MERGELM_CASES)
def test_mergelm_answer_number(completion, want):
    assert mergelm_answer_number(completion) == want


def test_mergelm_is_correct_compares_numbers():
    assert mergelm_is_correct(18, "so 9 * 2 = 18\n#### 18") is True
    assert mergelm_is_correct(1018, "#### 1,018") is True
    assert mergelm_is_correct(None, "#### 18") is False
    assert mergelm_is_correct(17, "18") is False
    with pytest.raises(ValueError, match="'18.5' is not an integer"):
        mergelm_is_correct(18, "#### 18.5")
