"""GSM8K protocols (tasks/gsm8k/protocols.py and the task YAMLs): known answers.

Fixed responses in; the strict / flexible extraction and the exact-match verdict out. The
extraction is checked against lm-eval's own ``RegexFilter`` run with each protocol YAML's
filters, ``alpaca-cot``'s strict verdict against MergeLM's ``extract_answer_number`` (transcribed below
from ``yule-BUAA/MergeLM`` ``utils/evaluate_llms_utils.py`` @6d49ad96, as the source protocol's
reference) and ``chat-cot``'s against lm-eval's chat variant ``gsm8k-cot-llama.yaml``.
"""

from __future__ import annotations

import json
import re
import sys
from fractions import Fraction
from pathlib import Path

import pytest
import yaml
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
    ("#### 18", None, "18", False),   # alpaca-cot; chat-cot version 3 reads it (CHAT_COT_READS)
]
#: chat-cot's strict filter also reads GSM8K's training format (issue 57)
CHAT_COT_READS = {"#### 18": ("18", True)}


@pytest.mark.parametrize("name", ["alpaca-cot", "chat-cot"])
def test_cot_filters_are_lm_evals(name):
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
        if name == "chat-cot" and resp in CHAT_COT_READS:
            want, verdict = CHAT_COT_READS[resp]
        assert proto.extract_strict(resp) == want and (want or "[invalid]") == ls
        assert (proto.extract_flexible(resp) or "[invalid]") == lf
        assert proto.is_correct(proto.extract_strict(resp), "x\n#### " + gold) is verdict
        assert proto.score_strict(resp, "x\n#### " + gold)[1] is verdict  # one marker: every source agrees


# (response, gold, MergeLM's verdict = alpaca-cot strict, lm-eval first match = alpaca-cot
#  gsm8k_em_strict_lmeval, lm-eval chat variant's last match with '$' = chat-cot strict)
SOURCE_CASES = [
    ("The answer is: 5.\n...\nThe answer is: 18.", "18", True, False, True),
    ("The answer is: $18", "18", True, False, True),
    ("The answer is: 18.0", "18", True, False, False),
    ("The answer is: 17.5", "18", True, False, False),
    ("The answer is: 36/2", "18", True, False, False),
    ("The answer is: **18**", "18", True, False, False),
    ("The answer is: \\boxed{18}", "18", True, False, False),
    ("The answer is: x = 18", "18", True, False, False),
    ("The answer is: 1,018", "1018", True, True, True),
    ("The answer is: $1,018.", "1018", True, False, True),
    ("The answer is: 1,234,567", "1234567", False, True, True),
    ("The answer is: 70,000.", "70000", True, True, True),
    ("The answer is: -7", "-7", True, True, True),
    ("The answer is: 18\nThe answer is: 20", "18", False, True, False),
    ("So the total is 18.", "18", False, False, False),
    # issue 57: GSM8K's training format, which the math expert writes; chat-cot version 3 reads it
    ("She sells 9 eggs, so 9 * 2 = 18.\n#### 18", "18", False, False, True),
    ("The answer is: 5\n#### 18", "18", False, False, True),   # the last of either marker
    ("#### 5\nThe answer is: 18", "18", True, True, True),
]


@pytest.mark.parametrize("resp,gold,mergelm,lmeval_first,lmeval_chat", SOURCE_CASES)
def test_each_protocol_scores_as_its_source(resp, gold, mergelm, lmeval_first, lmeval_chat):
    from lm_eval.filters.extraction import RegexFilter

    sol = "x\n#### " + gold
    alp, chat = protocols.get_protocol("alpaca-cot"), protocols.get_protocol("chat-cot")
    # alpaca-cot strict: MergeLM's extract_answer_number and comparison (the transcription above)
    ref = mergelm_extract_answer_number(resp)
    assert (ref is not None and float(ref) == float(gold)) is mergelm
    assert alp.score_strict(resp, sol) == ((None if ref is None else str(ref)), mergelm)
    # alpaca-cot's lm-eval column: the YAML's first-match strict-match filter
    assert alp.is_correct(alp.extract_strict(resp), sol) is lmeval_first
    # chat-cot: lm-eval's RegexFilter with gsm8k-cot-llama.yaml's number pattern and group_select -1
    llama = RegexFilter(regex_pattern="(?:The answer is: |#### )((-?[$0-9.,]{2,})|(-?[0-9]+))", group_select=-1)
    got = llama.apply([[resp]], [{}])[0][0]
    assert (chat.extract_strict(resp) or "[invalid]") == got
    assert chat.score_strict(resp, sol)[1] is lmeval_chat is chat.is_correct(got, sol)


def test_chat_cot_filter_is_lm_eval_chat_variants():
    """chat-cot's strict number pattern and group are those of lm-eval's gsm8k-cot-llama.yaml (its
    marker 'The final answer is' replaced by the one chat-cot's prompt asks for, or GSM8K's own '#### ')."""
    import lm_eval

    path = Path(lm_eval.__file__).parent / "tasks" / "gsm8k" / "gsm8k-cot-llama.yaml"
    llama = {f["name"]: f["filter"][0] for f in yaml.safe_load(path.read_text())["filter_list"]}["strict-match"]
    ours = {f["name"]: f["filter"][0] for f in protocols.get_protocol("chat-cot").config["filter_list"]}["strict-match"]
    assert ours["regex_pattern"] == llama["regex_pattern"].replace("The final answer is ", "(?:The answer is: |#### )")
    assert ours["group_select"] == llama["group_select"] == -1


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
    # alpaca-cot: MergeLM's rounded integer; chat-cot: lm-eval's filter (raw)
    assert [s["strict"] for s in res.samples] == ["18", "3" if name == "alpaca-cot" else "3.", None, "541", "20"]
    tv, pv = ("6", "3") if name == "chat-cot" else ("5", "2")
    assert task.version == tv and res.meta["task_version"] == tv and res.meta["protocol_version"] == pv
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


DIVERGING = {"Janet": "The answer is: 5.\nSo 9 * 2 = 18.\nThe answer is: 18.", "A robe": "The answer is: $3",
             "Josh": "The answer is: 70,000.0", "James": "The answer is: \\boxed{540}", "Wendi": "The answer is: 20"}


@needs_data
def test_evaluate_alpaca_cot_scores_as_mergelm(tmp_path):
    """A run under alpaca-cot: gsm8k_em_strict is MergeLM's verdict, gsm8k_em_strict_lmeval lm-eval's
    first-match filter (the lm-eval run's own strict-match), chat-cot lm-eval's chat variant."""
    model = StandIn(DIVERGING)
    got = {}
    for name in ("alpaca-cot", "chat-cot"):
        task = type(gsm8k)()
        task.protocol = name
        ex = task.examples(DATA, model, 5)
        got[name] = task.evaluate(model, ex, EvalContext(config=GSM8KConfig(protocol=name), data_dir=DATA, seed=0,
                                                         work_dir=tmp_path / name))
    alp, chat = got["alpaca-cot"], got["chat-cot"]
    assert alp.per_example["em_strict"] == [1.0, 1.0, 1.0, 1.0, 1.0]
    assert [s["strict"] for s in alp.samples] == ["18", "3", "70000", "540", "20"]
    assert alp.per_example["em_strict_lmeval"] == [0.0, 0.0, 0.0, 0.0, 1.0]
    assert [s["strict_lmeval"] for s in alp.samples] == ["5.", None, "70,000.0", None, "20"]
    assert alp.metrics["gsm8k_em_strict"] == 1.0 and alp.metrics["gsm8k_em_strict_lmeval"] == pytest.approx(0.2)
    assert alp.per_example["no_answer"] == [0.0] * 5 and alp.meta["strict_scoring"] == "mergelm"
    assert chat.per_example["em_strict"] == [1.0, 1.0, 0.0, 0.0, 1.0]
    assert [s["strict"] for s in chat.samples] == ["18.", "$3", "70,000.0", None, "20"]
    assert "gsm8k_em_strict_lmeval" not in chat.metrics and "strict_scoring" not in chat.meta


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
    assert "gsm8k_em_strict_lmeval" not in json.loads(out.read_text())  # lm-eval: one strict column


@needs_data
@pytest.mark.parametrize("resp,gold,mergelm,lmeval_first,lmeval_chat", [c for c in SOURCE_CASES if c[1] == "18"])
def test_score_cli_gives_each_sources_verdict(tmp_path, resp, gold, mergelm, lmeval_first, lmeval_chat):
    """``darts-bench score gsm8k --protocol P`` on test question 0 (gold 18)."""
    from darts_bench.cli import main

    f = tmp_path / "s.jsonl"
    f.write_text(json.dumps({"doc_id": 0, "response": resp}) + "\n")
    out = tmp_path / "m.json"
    assert main(["score", "gsm8k", str(f), "--data-dir", str(DATA), "--protocol", "alpaca-cot", "--out", str(out)]) == 0
    m = json.loads(out.read_text())
    assert (m["em_strict"], m["em_strict_lmeval"]) == ([float(mergelm)], [float(lmeval_first)])
    assert m["gsm8k_em_strict"] == float(mergelm) and m["gsm8k_em_strict_lmeval"] == float(lmeval_first)
    assert m["no_answer"] == [float(mergelm_extract_answer_number(resp) is None)]
    assert main(["score", "gsm8k", str(f), "--data-dir", str(DATA), "--protocol", "chat-cot", "--out", str(out)]) == 0
    assert json.loads(out.read_text())["em_strict"] == [float(lmeval_chat)]


# ------------------------------------------------------------------ gsm8k-cot-8shot (lm-eval gsm8k_cot)
# (response, gold, strict answer as lm-eval's gsm8k-cot.yaml strict-match extracts it, strict verdict,
#  flexible verdict): several markers (the first is taken), '$' (no strict match), decimals, and the
#  YAML's unescaped final '.' (a number at the very end loses its last digit)
COT8_CASES = [
    ("9 - 4 = 5. The answer is 5. No: 9 * 2 = 18. The answer is 18.", "18", "5.", False, True),
    ("She makes 9 * $2 = $18. The answer is $18.", "18", None, False, True),
    ("The answer is 18.0.", "18", "18.0", False, False),
    ("The answer is 18.", "18", "18", True, True),
    ("The answer is 18", "18", "1", False, True),
    ("The answer is 17.5.", "18", "17.5", False, False),
    ("The answer is 1,018.", "1018", "1,018", True, True),
    ("The answer is -7.", "-7", "-7", True, True),
    ("So she makes 18 dollars.", "18", None, False, True),
]


def _lm_eval_verdicts(proto, responses, golds):
    """lm-eval's own filters (RegexFilter, take_first) and exact_match metric, run with the protocol's
    YAML (the included gsm8k-cot.yaml's filter_list and metric_list)."""
    from lm_eval.api.metrics import exact_match_hf_evaluate
    from lm_eval.filters.extraction import RegexFilter

    em = {k: v for k, v in proto.config["metric_list"][0].items() if k in ("regexes_to_ignore", "ignore_case",
                                                                           "ignore_punctuation")}
    out = {}
    for f in proto.config["filter_list"]:
        (rx, take), = [f["filter"]]
        assert take["function"] == "take_first" and rx["function"] == "regex"
        got = RegexFilter(regex_pattern=rx["regex_pattern"], group_select=rx.get("group_select", 0)).apply(
            [[r] for r in responses], [{}] * len(responses))
        picked = [g[0] for g in got]
        verdicts = [bool(exact_match_hf_evaluate(predictions=[p], references=[g], **em)["exact_match"])
                    for p, g in zip(picked, golds)]
        out[f["name"]] = (picked, verdicts)
    return out


def test_cot_8shot_is_lm_evals_gsm8k_cot_yaml():
    from importlib.util import find_spec

    proto = protocols.get_protocol("gsm8k-cot-8shot")
    installed = Path(find_spec("lm_eval").origin).parent / "tasks" / "gsm8k" / "gsm8k-cot.yaml"
    lm = yaml.safe_load(installed.read_text(encoding="utf-8"))
    assert proto.included_path() == installed and lm["task"] == "gsm8k_cot"
    for key in ("doc_to_text", "doc_to_target", "fewshot_config", "filter_list", "metric_list", "generation_kwargs",
                "num_fewshot", "output_type", "test_split"):
        assert proto.config[key] == lm[key], key
    assert proto.stop == ["Q:", "</s>", "<|im_end|>"] and proto.fixed_fewshot == 8 == len(lm["fewshot_config"]["samples"])
    assert proto.config["filter_list"][0]["filter"][0]["regex_pattern"] == r"The answer is (\-?[0-9\.\,]+)."
    assert proto.config["dataset_path"] == "json" and proto.lm_eval_task == "darts_gsm8k_cot_8shot"
    assert mod.TASK_VERSIONS["gsm8k-cot-8shot"] == "5"
    first = proto.prompt("How many?", None).split("\n\n")
    assert len(first) == 9 and first[0].startswith("Q: There are 15 trees in the grove.")
    assert first[0].endswith("A: There are 15 trees originally. Then there were 21 trees after some more were "
                             "planted. So there must have been 21 - 15 = 6. The answer is 6.")
    assert first[-1] == "Q: How many?\nA:"


@pytest.mark.parametrize("resp,gold,strict,strict_ok,flex_ok", COT8_CASES)
def test_cot_8shot_filters_give_lm_evals_verdicts(resp, gold, strict, strict_ok, flex_ok):
    proto = protocols.get_protocol("gsm8k-cot-8shot")
    lm = _lm_eval_verdicts(proto, [resp], [gold])
    assert lm["strict-match"] == ([strict or "[invalid]"], [strict_ok])
    assert lm["flexible-extract"][1] == [flex_ok]
    answer, ok = proto.score_strict(resp, "x\n#### " + gold)
    assert (answer, ok) == (strict, strict_ok)
    assert proto.is_correct(proto.extract_flexible(resp), "x\n#### " + gold) is flex_ok


@needs_data
def test_cot_8shot_prompt_is_lm_evals_rendering(tmp_path):
    """The prompt of a doc equals lm-eval's own ``Task.fewshot_context`` of the runtime task (lm-eval's
    gsm8k-cot.yaml included, loaded by lm-eval's TaskManager)."""
    from lm_eval.tasks import TaskManager

    task = get_task("gsm8k", GSM8KConfig(protocol="gsm8k-cot-8shot"))
    proto = protocols.get_protocol("gsm8k-cot-8shot")
    ex = task.examples(DATA, None, 3)
    task.write_lm_eval_task(ex, tmp_path, data_dir=DATA, num_fewshot=8, max_new_tokens=77, protocol=proto.name)
    lm_task = TaskManager(include_path=str(tmp_path), include_defaults=False).load([proto.lm_eval_task])
    lm_task = lm_task["tasks"][proto.lm_eval_task]
    docs = list(lm_task.test_docs())
    assert [lm_task.fewshot_context(d, num_fewshot=8) for d in docs] == [e.prompt for e in ex]
    assert lm_task.config.generation_kwargs == {"do_sample": False, "until": ["Q:", "</s>", "<|im_end|>"],
                                                "max_gen_toks": 77}
    assert [lm_task.doc_to_target(d) for d in docs] == [e.meta["gold"] for e in ex] == ["18", "3", "70000"]


class LastQuestionStandIn(StandIn):
    """:class:`StandIn` that looks for its keyword in the last question of an 8-shot prompt only."""

    def generate(self, prompts, *, max_new_tokens, stop=(), num_samples=1, temperature=0.0, seed=0):
        self.calls.append({"prompts": list(prompts), "stop": list(stop)})
        return [[self.answers[next(k for k in self.answers if k in p.split("\n\n")[-1])]] for p in prompts]


COT8_ANSWERS = {"Janet": " 16 - 3 - 4 = 9. 9 * 2 = 18. The answer is 18.", "A robe": " 2 + 1 = 3. The answer is $3.",
                "Josh": " The answer is 5. No, he made 70,000. The answer is 70,000.", "James": " 3 * 3 * 60 = 540",
                "Wendi": " The answer is 20"}


@needs_data
def test_evaluate_under_cot_8shot(tmp_path):
    task = get_task("gsm8k", GSM8KConfig(protocol="gsm8k-cot-8shot"))
    model = LastQuestionStandIn(COT8_ANSWERS)
    ex = task.examples(DATA, None, 5)
    res = task.evaluate(model, ex, EvalContext(config=GSM8KConfig(protocol="gsm8k-cot-8shot"), data_dir=DATA,
                                               seed=0, work_dir=tmp_path))
    assert res.per_example["em_strict"] == [1.0, 0.0, 0.0, 0.0, 0.0]  # first match; '$'; no marker; '20' -> '2'
    assert [s["strict"] for s in res.samples] == ["18", None, "5.", None, "2"]
    assert res.per_example["em_flexible"] == [1.0, 1.0, 1.0, 1.0, 1.0]
    assert res.per_example["no_answer"] == [0.0, 1.0, 0.0, 1.0, 0.0]
    (call,) = model.calls
    assert sorted(call["prompts"]) == sorted(e.prompt for e in ex) and call["stop"] == ["Q:", "</s>", "<|im_end|>"]
    assert res.meta["num_fewshot"] == 8 and res.meta["protocol"] == "gsm8k-cot-8shot"
    assert res.meta["task_version"] == "5" and res.meta["lm_eval_task"] == "darts_gsm8k_cot_8shot"
    assert res.meta["example_prompt"] in [e.prompt for e in ex]
    assert res.meta["task_yaml_sha256"] == protocols.get_protocol("gsm8k-cot-8shot").sha256
    with pytest.raises(ValueError, match="8 exemplars"):
        task.evaluate(model, ex, EvalContext(config=GSM8KConfig(protocol="gsm8k-cot-8shot", num_fewshot=5),
                                             data_dir=DATA, seed=0, work_dir=tmp_path))


@needs_data
def test_score_cli_cot_8shot(tmp_path):
    from darts_bench.cli import main

    f = tmp_path / "s.jsonl"
    f.write_text("".join(json.dumps({"doc_id": 0, "response": r}) + "\n" for r in
                         ["The answer is 18."]) + json.dumps({"doc_id": 1, "response": "The answer is 3"}) + "\n")
    out = tmp_path / "m.json"
    assert main(["score", "gsm8k", str(f), "--data-dir", str(DATA), "--protocol", "gsm8k-cot-8shot",
                 "--out", str(out)]) == 0
    m = json.loads(out.read_text())
    assert m["em_strict"] == [1.0, 0.0] and m["em_flexible"] == [1.0, 1.0] and m["protocol"] == "gsm8k-cot-8shot"
