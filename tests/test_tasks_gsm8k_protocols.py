"""GSM8K protocols (tasks/gsm8k/protocols.py and the task YAMLs): known answers.

Fixed responses in; the strict / flexible extraction and the exact-match verdict out. The
extraction is checked against lm-eval's own ``RegexFilter`` run with each protocol YAML's
filters, and for ``alpaca-cot`` against MergeLM's ``extract_answer_number`` (transcribed below from
``yule-BUAA/MergeLM`` ``utils/evaluate_llms_utils.py``, as the source protocol's reference).
"""

from __future__ import annotations

import json
import re
import sys
from fractions import Fraction

import pytest
from conftest import DATA_DIR as DATA

from darts_bench.api import EvalContext, ScoreContinuation, get_task
from darts_bench.config import GSM8KConfig

needs_data = pytest.mark.skipif(not (DATA / "gsm8k" / "test.jsonl").is_file(), reason="shared GSM8K data not present")

gsm8k = get_task("gsm8k")
mod = sys.modules[type(gsm8k).__module__]
protocols = sys.modules[mod.__name__ + ".protocols"]


def _is_number(s):
    try:
        float(s)
        return True
    except ValueError:
        pass
    try:
        import unicodedata
        unicodedata.numeric(s)
        return True
    except (TypeError, ValueError):
        pass
    return False


def mergelm_extract_answer_number(completion):
    """MergeLM utils/evaluate_llms_utils.py extract_answer_number (``fraction.Fraction`` -> stdlib)."""
    text = completion.split('The answer is: ')
    if len(text) > 1:
        extract_ans = text[-1].strip()
        match = re.search(r'[\-+]?\d*[\.,/]?\d+', extract_ans)
        if match:
            if '/' in match.group():
                denominator = match.group().split('/')[1]
                numerator = match.group().split('/')[0]
                if _is_number(denominator) and _is_number(numerator):
                    if denominator == '0':
                        return round(float(numerator.replace(',', '')))
                    frac = Fraction(match.group().replace(',', ''))
                    return round(float(frac.numerator / frac.denominator))
                return None
            if float(match.group().replace(',', '')) == float('inf'):
                return None
            return round(float(match.group().replace(',', '')))
    return None


COT_RESPONSES = [
    # (response, strict raw, gold, verdict strict)
    ("Janet has 16 - 3 - 4 = 9 eggs. 9 * 2 = 18.\nThe answer is: 18", "18", "18", True),
    ("9 * 2 = 18 dollars.\nThe answer is: 18.", "18.", "18", True),
    ("The answer is: 1,018\n\nsome trailing text", "1,018", "1,018", True),
    ("The answer is: -7", "-7", "-7", True),
    ("So the total is 18.", None, "18", False),   # no "The answer is:" -> no answer (strict)
    ("The answer is: 20", "20", "18", False),
    ("#### 18", None, "18", False),
]


@pytest.mark.parametrize("name", ["alpaca-cot", "chat-cot"])
def test_cot_filters_are_lm_evals_and_agree_with_mergelm(name):
    from lm_eval.filters.extraction import RegexFilter

    proto = protocols.get_protocol(name)
    filters = {f["name"]: f["filter"][0] for f in proto.config["filter_list"]}
    strict = RegexFilter(regex_pattern=filters["strict-match"]["regex_pattern"],
                         group_select=filters["strict-match"].get("group_select", 0))
    flex = RegexFilter(regex_pattern=filters["flexible-extract"]["regex_pattern"],
                       group_select=filters["flexible-extract"].get("group_select", 0))
    resps = [r for r, *_ in COT_RESPONSES]
    got_strict = [r[0] for r in strict.apply([[r] for r in resps], [{}] * len(resps))]
    got_flex = [r[0] for r in flex.apply([[r] for r in resps], [{}] * len(resps))]
    for (resp, want, gold, verdict), ls, lf in zip(COT_RESPONSES, got_strict, got_flex):
        assert proto.extract_strict(resp) == want and (want or "[invalid]") == ls
        assert (proto.extract_flexible(resp) or "[invalid]") == lf
        assert proto.is_correct(proto.extract_strict(resp), "x\n#### " + gold) is verdict
        ref = mergelm_extract_answer_number(resp)
        # MergeLM: rounded int of the number after the last "The answer is: "; same verdict on integers
        assert (ref is not None and float(ref) == float(gold.replace(",", ""))) is verdict


def test_della_regex_quirk_is_not_copied():
    """DELLA's strict regex ends in an unescaped '.', which reads '1' from 'The answer is: 18\\n'."""
    della = re.compile(r"The answer is: (\-?[0-9\.\,]+).")
    assert della.findall("The answer is: 18\n") == ["1"]
    assert protocols.get_protocol("alpaca-cot").extract_strict("The answer is: 18\n") == "18"
    assert mergelm_extract_answer_number("The answer is: 18\n") == 18


def test_lm_eval_protocol_unchanged():
    proto = protocols.get_protocol("lm-eval")
    assert proto.config["task"] == mod.LM_EVAL_TASK and proto.sha256 == mod.TEMPLATE_SHA256
    assert proto.extract_strict("so\n#### 42") == "42" == mod.extract_strict("so\n#### 42")
    assert proto.extract_strict("The answer is: 42") is None


def test_prompts_are_the_sources():
    q = "How many?"
    alp = protocols.get_protocol("alpaca-cot")
    # MergeLM get_math_task_prompt, verbatim
    mergelm = ("Below is an instruction that describes a task. Write a response that appropriately completes the "
               "request.\n\n### Instruction:\n{instruction}\n\n### Response: Let's think step by step.")
    assert alp.prompt(q, None) == mergelm.format(instruction=q)
    assert alp.template.replace("{{question}}", "{instruction}") == mergelm  # the YAML's doc_to_text
    assert alp.stop[:4] == ["Instruction:", "Instruction", "Response:", "Response"]  # MergeLM test_gsm8k
    chat = protocols.get_protocol("chat-cot")
    assert chat.prompt(q, StandIn()).startswith("<user>How many?\n\nLet's think step by step.")
    with pytest.raises(ValueError, match="chat template"):
        chat.prompt(q, None)
    with pytest.raises(ValueError, match="unknown gsm8k protocol"):
        protocols.get_protocol("8-shot")


GOLD5 = ["18", "3", "70000", "540", "20"]


class StandIn:
    """Answers question i of the test split with a fixed chain of thought (``The answer is: ...``)."""

    name = "stand-in"

    def __init__(self, answers=None):
        self.calls, self.answers = [], answers or {}

    def generate(self, prompts, *, max_new_tokens, stop=(), num_samples=1, temperature=0.0, seed=0):
        self.calls.append({"prompts": list(prompts), "stop": list(stop)})
        return [[self.answers[next(k for k in self.answers if k in p)]] for p in prompts]

    def score(self, contexts, continuations):
        return [ScoreContinuation(nll=0.5 * len(c), n_tokens=len(c), greedy=False) for c in continuations]

    def format_chat(self, m):
        return f"<user>{m}</user>\n"


ANSWERS = {"Janet": "9 * 2 = 18.\nThe answer is: 18", "A robe": "2 + 1 = 3 bolts.\nThe answer is: 3.",
           "Josh": "He made $70,000.", "James": "The answer is: 541", "Wendi": "The answer is: 20\n\nResponse: x"}


@needs_data
@pytest.mark.parametrize("name", ["alpaca-cot", "chat-cot"])
def test_evaluate_under_cot_protocol(tmp_path, name):
    task = type(gsm8k)()
    task.protocol = name
    model = StandIn(ANSWERS)
    ex = task.examples(DATA, model, 5)
    res = task.evaluate(model, ex, EvalContext(config=GSM8KConfig(protocol=name), data_dir=DATA, seed=0,
                                               work_dir=tmp_path))
    assert res.per_example["em_strict"] == [1.0, 1.0, 0.0, 0.0, 1.0]
    assert res.per_example["em_flexible"] == [1.0, 1.0, 1.0, 0.0, 1.0]
    assert res.per_example["no_answer"] == [0.0, 0.0, 1.0, 0.0, 0.0]
    assert res.metrics["gsm8k_no_answer_rate"] == pytest.approx(0.2)
    assert [s["strict"] for s in res.samples] == ["18", "3.", None, "541", "20"]
    (call,) = model.calls
    assert sorted(call["prompts"]) == sorted(e.prompt for e in ex)  # lm-eval's prompt == examples()
    assert call["stop"] == protocols.get_protocol(name).stop
    assert res.meta["protocol"] == name and res.meta["template"] == protocols.get_protocol(name).template
    assert res.meta["lm_eval_task"] == protocols.get_protocol(name).lm_eval_task
    with pytest.raises(ValueError, match="zero-shot"):
        task.evaluate(model, ex, EvalContext(config=GSM8KConfig(protocol=name, num_fewshot=2), data_dir=DATA,
                                             seed=0, work_dir=tmp_path))
    with pytest.raises(ValueError, match="built under protocol"):  # a task of another protocol
        type(gsm8k)().evaluate(model, ex, EvalContext(config=GSM8KConfig(), data_dir=DATA, seed=0, work_dir=tmp_path))


@needs_data
def test_score_cli_protocol_and_per_example_lists(tmp_path, capsys):
    from darts_bench.cli import main

    lines = [{"doc_id": 0, "response": "The answer is: 18"}, {"doc_id": 1, "response": "#### 3"},
             {"doc_id": 2, "response": "The answer is: 70,000."}]
    f = tmp_path / "s.jsonl"
    f.write_text("".join(json.dumps(x) + "\n" for x in lines))
    out = tmp_path / "m.json"
    assert main(["score", "gsm8k", str(f), "--data-dir", str(DATA), "--protocol", "alpaca-cot", "--out", str(out)]) == 0
    m = json.loads(out.read_text())
    assert m["protocol"] == "alpaca-cot" and m["em_strict"] == [1.0, 0.0, 1.0] and m["em_flexible"] == [1.0, 1.0, 1.0]
    assert m["no_answer"] == [0.0, 1.0, 0.0] and m["gsm8k_no_answer_rate"] == pytest.approx(1 / 3)
    assert main(["score", "gsm8k", str(f), "--data-dir", str(DATA), "--out", str(out)]) == 0
    assert json.loads(out.read_text())["em_strict"] == [0.0, 1.0, 0.0]  # lm-eval: #### N
