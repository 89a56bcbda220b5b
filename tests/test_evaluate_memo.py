"""A task's other models (the AlpacaEval judge) answer a request once per evaluate stage
(darts_bench/evaluate/memo.py): unit behaviour, and the micro stage with and without it."""

from __future__ import annotations

import json

import pytest

from darts_bench.api import Completion, ScoreContinuation
from darts_bench.evaluate.memo import CallMemo, MemoModel


class Recording:
    """A judge stand-in: the NLL of a pair is a function of its text; every call is recorded."""

    name = "judge"
    tokenizer = "tok"

    def __init__(self):
        self.calls: list[tuple[str, list]] = []

    def format_chat(self, m: str) -> str:
        return f"<chat>{m}"

    def score(self, contexts, continuations):
        self.calls.append(("score", list(zip(contexts, continuations))))
        return [ScoreContinuation(nll=float(len(c) + 10 * len(x)), n_tokens=len(x), greedy=False)
                for c, x in zip(contexts, continuations)]

    def generate(self, prompts, *, max_new_tokens, stop=(), temperature=0.0, **kw):
        self.calls.append(("generate", list(prompts)))
        return [[Completion(f"{p}|{max_new_tokens}|{temperature}", "stop", 1)] for p in prompts]


def test_score_asks_each_pair_once_in_order():
    m, memo = Recording(), CallMemo()
    a = MemoModel(m, memo)
    got = a.score(["c1", "c2", "c1"], ["x", "y", "x"])
    assert [s.nll for s in got] == [12.0, 12.0, 12.0] and got[0] is got[2]
    assert m.calls == [("score", [("c1", "x"), ("c2", "y")])]  # deduplicated within the call, first order
    # a second row (another wrapper on the same memo) asks one new pair and two known ones
    b = MemoModel(m, memo)
    got = b.score(["c2", "c3", "c1"], ["y", "zz", "x"])
    assert [s.nll for s in got] == [12.0, 22.0, 12.0]
    assert m.calls[1:] == [("score", [("c3", "zz")])]
    assert memo.computed == {"score": 3, "generate": 0} and memo.reused == {"score": 3, "generate": 0}
    assert memo.summary() == "score 3 computed, 3 reused; generate 0 computed, 0 reused"
    # a context and continuation are not one string: ("c", "1x") is not ("c1", "x")
    assert b.score(["c"], ["1x"])[0].nll == 21.0 and len(m.calls) == 3


def test_generate_is_remembered_per_prompt_and_arguments():
    m, memo = Recording(), CallMemo()
    a = MemoModel(m, memo)
    first = a.generate(["p", "q"], max_new_tokens=4, stop=["\n"], temperature=0.0)
    assert [o[0] for o in first] == ["p|4|0.0", "q|4|0.0"]
    again = MemoModel(m, memo).generate(["q", "p"], max_new_tokens=4, stop=("\n",), temperature=0.0)
    assert [o[0] for o in again] == ["q|4|0.0", "p|4|0.0"] and len(m.calls) == 1  # a tuple stop is the list
    for kw in ({"max_new_tokens": 5, "stop": ["\n"], "temperature": 0.0},
               {"max_new_tokens": 4, "stop": ["\n", "."], "temperature": 0.0},
               {"max_new_tokens": 4, "stop": ["\n"], "temperature": 0.7, "seed": 1}):
        a.generate(["p"], **kw)
    assert len(m.calls) == 4 and memo.computed["generate"] == 5 and memo.reused["generate"] == 2
    # an argument JSON cannot spell is passed through, not remembered
    a.generate(["p"], max_new_tokens=4, stop=["\n"], temperature=0.0, seed=object())
    a.generate(["p"], max_new_tokens=4, stop=["\n"], temperature=0.0, seed=object())
    assert len(m.calls) == 6


def test_other_attributes_are_the_models_and_a_short_answer_raises():
    m = Recording()
    a = MemoModel(m, CallMemo())
    assert a.tokenizer == "tok" and a.format_chat("hi") == "<chat>hi" and a.name == "judge"
    m.score = lambda c, x: []
    with pytest.raises(RuntimeError, match="'judge': score returned 0 results for 1 requests"):
        a.score(["c"], ["x"])
    with pytest.raises(ValueError, match="2 contexts for 1 continuations"):
        a.score(["c", "d"], ["x"])


@pytest.mark.micro
def test_micro_judge_answers_each_prompt_once_and_results_are_unchanged(micro_pipeline, micro_cfg_path, tmp_path,
                                                                       monkeypatch):
    """AlpacaEval on the micro pool's ``base`` and ``ties`` rows (plain, Surgery, DARTS on both
    splits), one pass: with the stage's memo the judge (``expert:instruction``) scores each distinct
    (instruction, reference, output) pair's two orders x two verdicts once, and every row's result
    (metrics, per-example values, samples with the judge's completions) equals the one each row's
    own judge calls give."""
    from darts_bench.stages import evaluate as stage

    from darts_bench.config import load_config

    pipe = micro_pipeline
    # the rows' own judge calls only: the known-answer check (tests/test_tasks_alpacaeval*.py) asks its own pairs
    cfg = load_config(str(micro_cfg_path), ["tasks.alpacaeval.judge.check_pairs=0"])
    rows = [r for r in pipe.all_rows() if r.model == "base" or r.merge == "ties"]
    tasks = {"alpacaeval": pipe.tasks()["alpacaeval"]}
    memos: list[CallMemo] = []

    class Kept(CallMemo):
        def __init__(self):
            super().__init__()
            memos.append(self)

    with monkeypatch.context() as mp:
        mp.setattr(stage, "CallMemo", Kept)
        kept = stage.evaluate(cfg, rows, pipe.all_rows(), tasks, pipe.executor, tmp_path / "memo")
    with monkeypatch.context() as mp:
        mp.setattr(stage, "MemoModel", lambda model, memo: model)
        fresh = stage.evaluate(cfg, rows, pipe.all_rows(), tasks, pipe.executor, tmp_path / "fresh")
    for r in rows:
        a, b = kept[r.model]["alpacaeval"], fresh[r.model]["alpacaeval"]
        for part in ("metrics", "per_example", "samples"):  # as JSON: a NaN equals a NaN
            assert json.dumps(getattr(a, part), sort_keys=True) == json.dumps(getattr(b, part), sort_keys=True), \
                (r.model, part)
    # the judge is asked about pairs whose output differs from the reference; each in 2 orders x 2 verdicts
    judged = [(s["instruction"], s["reference_output"], s["output"]) for r in rows
              for s in kept[r.model]["alpacaeval"].samples if s["output"] != s["reference_output"]]
    assert len(memos) == 1 and len(judged) == len(rows) * 4
    m = memos[0]
    assert m.computed["score"] == 4 * len(set(judged)) and m.reused["score"] == 4 * (len(judged) - len(set(judged)))
    assert m.reused["score"] > 0, "no two micro rows gave the same output: the memo is untested here"
