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
