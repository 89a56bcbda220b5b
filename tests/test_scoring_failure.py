"""Failure-mode columns (darts_bench/scoring/failure.py, issue 57): loops at the end of an output,
extraction, length. Known answers, including real SmolLM2-135M outputs from the committed samples."""

from __future__ import annotations

import pytest

from darts_bench.api import Completion
from darts_bench.scoring.failure import failure_columns, output_modes, repetition_loop

# results/smollm2-135m/samples/base/alpacaeval.jsonl.gz, alpaca_eval/0 (truncated at the token cap)
REILLY = ("Some of the most iconic and beloved actors who started their careers on Broadway include:\n\n"
          "1. John C. Reilly (1920-2012)\n2. John C. Reilly (1920-2012)\n3. John C. Reilly (1920-2012)\n"
          "4. John C. Reilly (1920-2012)\n5. John")
# a HumanEval reply of adamerging+darts (HumanEval/13), truncated: the same two branches over and over
GCD = ("    if a == 0 and b == 0:\n        return 0\n    if a > 0 and b > 0:\n        return a / b\n"
       "    if a == 0 and b == 0:\n        return 0\n    if a == 0 and b == 0:\n        return 0\n"
       "    if a == 0 and b == 0:\n        return 0\n    if a == 0 and b == ")


def test_loops_are_found_at_the_end():
    assert repetition_loop(REILLY)  # a numbered list repeating its item: digits read as 0
    assert repetition_loop(GCD)
    assert repetition_loop("ok " * 40)
    assert repetition_loop(".replace('o|', '|')" * 8)  # no whitespace at all


def test_no_loop_in_plain_text_short_text_or_a_loop_that_ended():
    assert not repetition_loop("def f(x):\n    return [i * i for i in range(x)]\n")
    assert not repetition_loop("ok " * 10)  # under LOOP_MIN_TOKENS
    assert not repetition_loop("ok " * 40 + "\nAnd then the answer is 18, because 9 * 2 = 18 dollars a day.")
    assert not repetition_loop("x = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]")
    with pytest.raises(ValueError):
        repetition_loop("x", min_repeats=1)


def test_failure_columns_values():
    outs = [[Completion(REILLY, "length", 64)], [Completion("Fine.", "stop", 3)]]
    m, per = failure_columns("alpacaeval", outs, [1.0, 0.0])
    assert m == {"alpacaeval_extract_rate": 0.5, "alpacaeval_repeat_rate": 0.5, "alpacaeval_len_tokens": 33.5}
    assert per == {"extracted": [1.0, 0.0], "repeat": [1.0, 0.0], "len_tokens": [64, 3]}
    # plain strings: no token counts -> length unknown, not 0
    assert output_modes([["a"], ["b"]])["len_tokens"] is None
    m, per = failure_columns("gsm8k", [["a"], ["b"]], [1.0, 1.0])
    assert m["gsm8k_len_tokens"] is None and "len_tokens" not in per
    with pytest.raises(ValueError):
        failure_columns("gsm8k", [["a"]], [1.0, 0.0])
