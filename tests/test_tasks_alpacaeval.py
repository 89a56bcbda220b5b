"""AlpacaEval task: data loading, reference alignment, both-order judging through alpaca_eval with
stand-in models (no real LM, no hub, no OpenAI)."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import yaml
from conftest import DATA_DIR as DATA  # $DARTS_BENCH_DATA, else ../shared/data

from darts_bench.api import EvalContext, ScoreContinuation, _import_task_folder, get_task
from darts_bench.config import AlpacaEvalConfig, JudgeConfig
from darts_bench.data import DataError

REPO = Path(__file__).resolve().parent.parent
GPT4 = "alpaca_eval/gpt4_1106_preview_model_outputs.json"
DAVINCI = "alpaca_eval/text_davinci_003_model_outputs.json"

pytestmark = pytest.mark.skipif(not (DATA / GPT4).is_file(), reason="shared AlpacaEval data not available")

_import_task_folder(REPO / "tasks" / "alpacaeval")
from darts_bench_tasks.alpacaeval import AlpacaEvalTask, judge_consistency  # noqa: E402
from darts_bench_tasks.alpacaeval.judge import ANNOTATOR_DIR  # noqa: E402


# ------------------------------------------------------------------------------ stand-ins
class StubModel:
    """Chat format ``<user>...<assistant>``; outputs looked up by instruction; NLL = 0.1 per char."""

    name = "stub"

    def __init__(self, outputs: dict[str, str]):
        self.outputs = outputs
        self.generate_calls = 0

    def format_chat(self, msg: str) -> str:
        return f"<user>{msg}<assistant>"

    def generate(self, prompts, *, max_new_tokens, stop=(), num_samples=1, temperature=0.0, seed=0):
        self.generate_calls += 1
        assert temperature == 0.0
        return [[" " + self.outputs[p[len("<user>"):-len("<assistant>")]] + "\n"] for p in prompts]

    def score(self, contexts, continuations):
        return [ScoreContinuation(nll=0.1 * len(c), n_tokens=len(c), greedy=False) for c in continuations]


def _pair(prompt: str) -> tuple[str, str]:
    """(output a, output b) of the real task in an alpaca_eval basic prompt (after the few-shot example)."""
    a0 = prompt.rindex("### Output (a):\n") + len("### Output (a):\n")
    b_mark = prompt.rindex("\n\n### Output (b):\n")
    end = prompt.rindex("\n\n### Which is best")
    return prompt[a0:b_mark], prompt[b_mark + len("\n\n### Output (b):\n"):end]


class LengthJudge:
    """Prefers the longer output, whichever position it is in (a position-consistent judge)."""

    name = "length-judge"

    def __init__(self):
        self.calls = 0

    def format_chat(self, msg: str) -> str:
        return msg

    def _b_wins(self, prompt: str) -> bool:
        a, b = _pair(prompt)
        return len(b) > len(a)

    def generate(self, prompts, *, max_new_tokens, stop=(), num_samples=1, temperature=0.0, seed=0):
        self.calls += 1
        return [["Output (b)" if self._b_wins(p) else "Output (a)"] for p in prompts]

    def score(self, contexts, continuations):
        self.calls += 1
        out = []
        for ctx, cont in zip(contexts, continuations):
            says_b = cont.endswith("(b)")
            right = says_b == self._b_wins(ctx)
            out.append(ScoreContinuation(nll=1.0 if right else 3.0, n_tokens=4, greedy=right))
        return out


class AlwaysAJudge(LengthJudge):
    """Answers "Output (a)" whatever it is shown (fully position-biased)."""

    name = "always-a"

    def _b_wins(self, prompt: str) -> bool:
        return False


def _ctx(cfg, judge, data_dir=DATA, get_outputs=None, tmp=Path("/tmp")):
    return EvalContext(config=cfg, data_dir=data_dir, seed=0, work_dir=tmp,
                       get_model=lambda name: judge, get_outputs=get_outputs)


@pytest.fixture(scope="module")
def task() -> AlpacaEvalTask:
    return get_task("alpacaeval")


@pytest.fixture(scope="module")
def three(task):
    model0 = StubModel({})
    examples = task.examples(DATA, model0, limit=3)
    refs = [e.reference for e in examples]
    instr = [e.meta["instruction"] for e in examples]
    # model longer than the reference on #0 only -> the length judge gives the model 1 win of 3
    outputs = {instr[0]: refs[0] + " And one more sentence.", instr[1]: "Short answer.", instr[2]: "Short."}
    return examples, StubModel(outputs), refs, instr


# ---------------------------------------------------------------------------------- tests
def test_registered_and_examples(task, three):
    examples, model, refs, instr = three
    assert (task.name, task.expert, task.version) == ("alpacaeval", "instruction", "5")
    records = json.loads((DATA / GPT4).read_text())
    assert len(examples) == 3
    for i, e in enumerate(examples):
        assert e.prompt == f"<user>{records[i]['instruction']}<assistant>"
        assert e.reference == records[i]["output"]
        assert e.meta["instruction"] == records[i]["instruction"]
        assert e.meta["dataset"] == records[i]["dataset"]
    assert task.examples(DATA, None, limit=1)[0].prompt == records[0]["instruction"]
    assert len(task.examples(DATA, None, limit=None)) == 805


def test_examples_data_errors(task, tmp_path):
    with pytest.raises(DataError, match="missing"):
        task.examples(tmp_path, None, limit=3)
    (tmp_path / "alpaca_eval").mkdir()
    (tmp_path / GPT4).write_text(json.dumps([{"instruction": "x", "output": "y", "dataset": "d"}]))
    with pytest.raises(DataError, match=r"record 0.*generator"):
        task.examples(tmp_path, None, limit=3)
    (tmp_path / GPT4).write_text("[{not json")
    with pytest.raises(DataError, match="bad JSON"):
        task.examples(tmp_path, None, limit=3)


def test_training_prompts(task):
    model = StubModel({})
    a = task.training_prompts(DATA, model, n=5, seed=3)
    assert a == task.training_prompts(DATA, model, n=5, seed=3) and len(a) == 5
    assert all(p.startswith("<user>") and p.endswith("<assistant>") for p in a)
    assert a != task.training_prompts(DATA, model, n=5, seed=4)


def test_judge_consistency_pure():
    # ab frame: 1 = reference wins, 2 = model wins; ba frame: 1 = model wins
    cons, prefs = judge_consistency([2, 1, 1, 2, None, 1.5], [1, 2, 1, 2, 1, 1.5])
    assert prefs == [2.0, 1.0, 1.5, 1.5, None, 1.5]  # a missing verdict: no debiased verdict (dropped)
    assert cons == pytest.approx(3 / 6)
    assert judge_consistency([], []) == (None, [])
    with pytest.raises(ValueError):
        judge_consistency([1], [])


def _check_length_judge_result(res, n=3):
    assert res.metrics["alpacaeval_win_rate"] == pytest.approx(100 / 3)
    assert res.metrics["alpacaeval_win_rate_raw"] == pytest.approx(100 / 3)
    assert res.metrics["alpacaeval_judge_consistency"] == 1.0
    assert res.metrics["alpacaeval_win_rate_flag"] is None
    assert res.metrics["n_alpacaeval"] == n
    assert res.per_example["win"] == [1.0, 0.0, 0.0]
    assert res.meta["win_rate_kind"] == "raw"
    assert res.meta["win_rate_model_first"] == pytest.approx(100 / 3)
    assert res.meta["win_rate_model_second"] == pytest.approx(100 / 3)
    s = res.samples[0]
    assert s["verdict_model_second"] == 2.0 and s["verdict_model_first"] == 1.0 and s["preference"] == 2.0
    assert s["judge_completion_model_second"] == "Output (b)"
    assert res.samples[1]["verdict_model_second"] == 1.0 and res.samples[1]["verdict_model_first"] == 2.0


def test_length_judge_score_mode(task, three):
    examples, model, refs, instr = three
    judge = LengthJudge()
    res = task.evaluate(model, examples, _ctx(AlpacaEvalConfig(limit=3), judge))
    _check_length_judge_result(res)
    assert res.meta["judge_mode"] == "score" and res.meta["reference_generator"] == "gpt4_1106_preview"
    assert res.samples[0]["output"] == refs[0] + " And one more sentence."  # stripped
    assert res.samples[0]["reference_output"] == refs[0]
    # reference NLL of the gpt4_turbo outputs under the stub: 0.1 nats per char-token
    assert res.metrics["alpacaeval_ref_nll"] == pytest.approx(0.1)
    assert res.per_example["ref_nll"] == pytest.approx([0.1] * 3)


class CappedStub(StubModel):
    """StubModel whose outputs are Completions; the output for instruction #1 hit the token cap."""

    def generate(self, prompts, **kw):
        from darts_bench.api import Completion

        out = super().generate(prompts, **kw)
        return [[Completion(o[0], "length" if i == 1 else "stop", 9)] for i, o in enumerate(out)]


def test_truncated_rate_from_finish_reasons(task, three):
    """alpacaeval_truncated_rate: the share of outputs whose generation hit max_new_tokens, from the
    model's Completion finish reasons; None (unknown) for a model returning plain strings."""
    examples, model, refs, instr = three
    res = task.evaluate(CappedStub(model.outputs), examples, _ctx(AlpacaEvalConfig(limit=3), LengthJudge()))
    assert res.metrics["alpacaeval_truncated_rate"] == pytest.approx(1 / 3)
    assert res.per_example["truncated"] == [0.0, 1.0, 0.0]
    assert [s["finish_reason"] for s in res.samples] == ["stop", "length", "stop"]
    _check_length_judge_result(res)  # the same verdicts as the plain model's
    plain = task.evaluate(model, examples, _ctx(AlpacaEvalConfig(limit=3), LengthJudge()))
    assert plain.metrics["alpacaeval_truncated_rate"] is None and "truncated" not in plain.per_example


def _task_in_generate_mode(tmp_path):
    """An AlpacaEvalTask whose annotator config (a copy of the repo's) uses the generate judge mode."""
    cfg_dir = tmp_path / "local_judge"
    shutil.copytree(ANNOTATOR_DIR, cfg_dir)
    conf = yaml.safe_load((cfg_dir / "configs.yaml").read_text())
    next(iter(conf.values()))["completions_kwargs"]["mode"] = "generate"
    (cfg_dir / "configs.yaml").write_text(yaml.safe_dump(conf))
    t = AlpacaEvalTask()
    t.annotators_config = cfg_dir
    return t


def test_length_judge_generate_mode(task, three, tmp_path):
    examples, model, refs, instr = three
    t = _task_in_generate_mode(tmp_path)
    judge = LengthJudge()
    res = t.evaluate(model, examples, _ctx(AlpacaEvalConfig(limit=3), judge))
    _check_length_judge_result(res)
    assert res.meta["judge_mode"] == "generate"


def test_always_a_judge_fails_the_known_answer_check_and_is_excluded(task, three, tmp_path):
    """Issue 57: a position-only judge scores 0.5 on the known-answer set (right in one order, wrong in
    the other) with order consistency 0, fails the check (pass mark 0.75): the win rate is no number,
    flagged "uninformative", and alpacaeval_judge_passed = False tells claims to leave it out."""
    examples, model, refs, instr = three
    judge = AlwaysAJudge()
    ctx = _ctx(AlpacaEvalConfig(limit=3), judge)
    ctx.shared_dir = tmp_path
    res = task.evaluate(model, examples, ctx)
    assert res.metrics["alpacaeval_judge_passed"] is False
    assert res.metrics["alpacaeval_judge_check_accuracy"] == 0.5
    assert res.metrics["alpacaeval_judge_check_consistency"] == 0.0
    assert res.metrics["alpacaeval_win_rate"] is None and res.metrics["alpacaeval_win_rate_flag"] == "uninformative"
    assert res.metrics["alpacaeval_win_rate_unchecked"] == pytest.approx(50.0)
    assert all(math.isnan(w) for w in res.per_example["win"]) and res.per_example["win_unchecked"] == [0.5] * 3
    check = res.meta["judge_check"]
    assert check["n_pairs"] == 16 and check["n_verdicts"] == 32 and check["passed"] is False
    assert sorted({p["damage"] for p in check["pairs"]}) == sorted(["truncated_third", "shuffled_sentences",
                                                                    "unrelated_reference", "empty"])
    assert [(p["verdict_reference_first"], p["verdict_reference_second"]) for p in check["pairs"]] == [(1.0, 1.0)] * 16
    # cached under the shared dir, keyed by hash: a second row reuses it without asking the judge
    (cache,) = (tmp_path / "judge_check").iterdir()
    assert json.loads((cache / "judge_check.json").read_text())["accuracy"] == 0.5
    calls = judge.calls
    res2 = task.evaluate(model, examples, ctx)
    cached_calls, calls = judge.calls - calls, judge.calls
    ctx.shared_dir = tmp_path / "other"
    task.evaluate(model, examples, ctx)
    assert res2.meta["judge_check"] == check and cached_calls < judge.calls - calls
    # a quality-reading judge (prefers the longer output, either order) passes
    res3 = task.evaluate(model, examples, _ctx(AlpacaEvalConfig(limit=3), LengthJudge()))
    assert res3.metrics["alpacaeval_judge_passed"] is True and res3.metrics["alpacaeval_win_rate"] is not None
    assert res3.metrics["alpacaeval_judge_check_accuracy"] >= 0.75


def test_always_a_judge_is_flagged(task, three):
    examples, model, refs, instr = three
    judge = AlwaysAJudge()
    cfg = AlpacaEvalConfig(limit=3, judge=JudgeConfig(check_pairs=0))  # no known-answer check: consistency flag
    res = task.evaluate(model, examples, _ctx(cfg, judge))
    assert res.metrics["alpacaeval_judge_passed"] is None and res.meta["judge_check"] is None
    assert res.metrics["alpacaeval_judge_consistency"] == 0.0
    assert res.metrics["alpacaeval_win_rate_flag"] == "uninformative_judge"
    assert res.meta["judge_flag"] == "uninformative_judge"
    assert res.metrics["alpacaeval_win_rate"] == pytest.approx(50.0)
    assert res.per_example["win"] == [0.5, 0.5, 0.5]
    assert res.meta["win_rate_model_second"] == pytest.approx(0.0)  # a always = reference
    assert res.meta["win_rate_model_first"] == pytest.approx(100.0)


def _tmp_data(tmp_path: Path, davinci_records) -> Path:
    (tmp_path / "alpaca_eval").mkdir(parents=True)
    (tmp_path / GPT4).symlink_to(DATA / GPT4)
    (tmp_path / DAVINCI).write_text(json.dumps(davinci_records))
    return tmp_path


@pytest.mark.parametrize("how", ["reordered", "shorter", "longer", "edited"])
def test_misaligned_reference_fails_before_judging(task, three, tmp_path, how):
    examples, model, refs, instr = three
    recs = json.loads((DATA / DAVINCI).read_text())
    if how == "reordered":
        recs[1], recs[2] = recs[2], recs[1]
        pattern = "first mismatch at index 1"
    elif how == "shorter":
        recs = recs[:-1]
        pattern = "has 804 records but the evaluation set has 805"
    elif how == "longer":
        recs = recs + [recs[0]]
        pattern = "has 806 records but the evaluation set has 805"
    else:
        recs[0] = dict(recs[0], instruction=recs[0]["instruction"] + " ")
        pattern = "first mismatch at index 0"
    data_dir = _tmp_data(tmp_path, recs)
    exs = task.examples(data_dir, model, limit=3)
    judge = LengthJudge()
    m = StubModel(model.outputs)
    cfg = AlpacaEvalConfig(limit=3, reference="text_davinci_003")
    with pytest.raises(ValueError, match=pattern):
        task.evaluate(m, exs, _ctx(cfg, judge, data_dir=data_dir))
    assert judge.calls == 0 and m.generate_calls == 0


def test_davinci_reference_aligned(task, three):
    examples, model, refs, instr = three
    davinci = json.loads((DATA / DAVINCI).read_text())
    res = task.evaluate(model, examples, _ctx(AlpacaEvalConfig(limit=3, reference="text_davinci_003"), LengthJudge()))
    assert [s["reference_output"] for s in res.samples] == [r["output"] for r in davinci[:3]]
    assert res.meta["reference_generator"] == "text_davinci_003"
    expected = [1.0 if len(s["output"]) > len(s["reference_output"]) else 0.0 for s in res.samples]
    assert res.per_example["win"] == expected
    assert res.metrics["alpacaeval_win_rate"] == pytest.approx(100 * sum(expected) / 3)


def test_model_reference_via_get_outputs(task, three):
    examples, model, refs, instr = three
    asked = []
    # expert row outputs: shorter than the model on #0, longer on #1, identical on #2
    expert = ["Tiny.", "A much longer expert answer than the model gave.", "Short."]

    def get_outputs(row):
        asked.append(row)
        return expert

    cfg = AlpacaEvalConfig(limit=3, reference="model:expert:instruction")
    judge = LengthJudge()
    res = task.evaluate(model, examples, _ctx(cfg, judge, get_outputs=get_outputs))
    assert asked == ["expert:instruction"]
    assert res.per_example["win"] == [1.0, 0.0, 0.5]  # identical outputs: a draw without asking the judge
    assert res.metrics["alpacaeval_win_rate"] == pytest.approx(50.0)
    assert res.metrics["alpacaeval_judge_consistency"] == 1.0  # over the 2 judged pairs
    assert res.meta["n_judged_pairs"] == 2 and res.meta["n_identical_outputs"] == 1
    assert res.meta["reference_source"] == "row:expert:instruction"
    assert res.samples[2]["verdict_model_second"] == 1.5
    assert res.per_example["ref_nll"] == pytest.approx([0.1] * 3)

    # a model reference of the wrong length fails before judging
    judge2 = LengthJudge()
    with pytest.raises(ValueError, match="2 outputs for 3 examples"):
        task.evaluate(model, examples, _ctx(cfg, judge2, get_outputs=lambda row: expert[:2]))
    assert judge2.calls == 0


def test_single_order(task, three):
    examples, model, refs, instr = three
    cfg = AlpacaEvalConfig(limit=3, judge=JudgeConfig(both_orders=False, check_pairs=0))
    judge = AlwaysAJudge()
    res = task.evaluate(model, examples, _ctx(cfg, judge))
    assert res.metrics["alpacaeval_judge_consistency"] is None
    assert res.metrics["alpacaeval_win_rate_flag"] is None
    assert res.metrics["alpacaeval_win_rate"] == pytest.approx(0.0)
    assert all(s["verdict_model_first"] is None for s in res.samples)
    assert not any(isinstance(v, float) and math.isnan(v) for v in res.metrics.values() if v is not None)


class GarbageJudge(LengthJudge):
    """Generates text the regex parser cannot read (a tiny model's usual answer)."""

    name = "garbage"

    def generate(self, prompts, *, max_new_tokens, stop=(), num_samples=1, temperature=0.0, seed=0):
        self.calls += 1
        return [["the the the"] for _ in prompts]


def test_unparseable_verdicts_are_dropped(three, tmp_path):
    """Version 3: a pair without a verdict is left out of the win rate and counted, as alpaca_eval's
    ``get_winrate`` drops an annotation it could not parse (version 2 made it a draw)."""
    examples, model, refs, instr = three
    t = _task_in_generate_mode(tmp_path)
    res = t.evaluate(model, examples, _ctx(AlpacaEvalConfig(limit=3), GarbageJudge()))
    assert res.meta["n_no_verdict"] == 6
    assert res.metrics["alpacaeval_judge_consistency"] == 0.0
    assert res.metrics["alpacaeval_win_rate"] is None and res.metrics["alpacaeval_win_rate_raw"] is None
    assert res.metrics["alpacaeval_n_scored"] == 0 and res.meta["n_dropped_no_verdict"] == 3
    assert all(math.isnan(w) for w in res.per_example["win"]) and res.samples[0]["preference"] is None
    # every answer unparsable: flagged as such
    assert res.metrics["alpacaeval_win_rate_flag"] == "unparsed_verdicts"
    assert res.metrics["alpacaeval_unparsed"] == 6 and res.meta["unparsed_share"] == 1.0
    assert res.samples[0]["verdict_model_second"] is None
    assert res.samples[0]["judge_completion_model_second"] == "the the the"  # kept for inspection


class PartlyGarbageJudge(LengthJudge):
    """:class:`LengthJudge`, but unparsable text on any pair with the output ``Short.``."""

    name = "partly-garbage"

    def generate(self, prompts, *, max_new_tokens, stop=(), num_samples=1, temperature=0.0, seed=0):
        self.calls += 1
        return [["the the the"] if "Short." in _pair(p) else ["Output (b)" if self._b_wins(p) else "Output (a)"]
                for p in prompts]


@pytest.mark.parametrize("both_orders", [True, False])
def test_some_unparseable_verdicts_dropped_as_alpaca_eval(three, tmp_path, both_orders):
    from alpaca_eval.metrics import get_winrate

    examples, model, refs, instr = three
    t = _task_in_generate_mode(tmp_path)
    res = t.evaluate(model, examples, _ctx(AlpacaEvalConfig(limit=3, judge=JudgeConfig(both_orders=both_orders)),
                                           PartlyGarbageJudge()))
    prefs = [s["preference"] for s in res.samples]
    assert prefs == [2.0, 1.0, None]  # model longer on #0, reference on #1, #2 unparsable
    want = get_winrate([{"preference": p} for p in prefs])  # alpaca_eval on the same annotations
    assert int(want["n_total"]) == 2
    assert res.metrics["alpacaeval_win_rate"] == pytest.approx(float(want["win_rate"])) == pytest.approx(50.0)
    assert res.metrics["alpacaeval_unparsed"] == (2 if both_orders else 1)
    assert res.metrics["alpacaeval_n_scored"] == 2 and res.meta["n_dropped_no_verdict"] == 1
    assert res.per_example["win"][:2] == [1.0, 0.0] and math.isnan(res.per_example["win"][2])


def test_annotator_config_guards(tmp_path):
    from darts_bench_tasks.alpacaeval.judge import load_annotator_config

    path, name, cfg = load_annotator_config(ANNOTATOR_DIR)
    assert name == "darts_local_judge" and cfg["is_randomize_output_order"] is False
    cfg_dir = tmp_path / "local_judge"
    shutil.copytree(ANNOTATOR_DIR, cfg_dir)
    conf = yaml.safe_load((cfg_dir / "configs.yaml").read_text())
    next(iter(conf.values()))["is_randomize_output_order"] = True
    (cfg_dir / "configs.yaml").write_text(yaml.safe_dump(conf))
    with pytest.raises(ValueError, match="is_randomize_output_order"):
        load_annotator_config(cfg_dir)
    (cfg_dir / "basic_prompt.txt").unlink()
    next(iter(conf.values()))["is_randomize_output_order"] = False
    (cfg_dir / "configs.yaml").write_text(yaml.safe_dump(conf))
    with pytest.raises(FileNotFoundError, match="prompt template"):
        load_annotator_config(cfg_dir)


def test_single_order_unparsable_judge_is_counted_and_flagged(three, tmp_path):
    """dcca732: both_orders false + a judge that never parses gave 50.0 with no flag."""
    examples, model, refs, instr = three
    t = _task_in_generate_mode(tmp_path)
    cfg = AlpacaEvalConfig(limit=3, judge=JudgeConfig(both_orders=False))
    res = t.evaluate(model, examples, _ctx(cfg, GarbageJudge()))
    assert res.metrics["alpacaeval_unparsed"] == 3
    assert res.metrics["alpacaeval_win_rate_flag"] == "unparsed_verdicts"
    assert res.meta["unparsed_share"] == 1.0


def test_win_rate_uses_alpaca_eval_encoding():
    from alpaca_eval.metrics import get_winrate

    from darts_bench_tasks.alpacaeval.judge import win_rate

    got = win_rate([2, 0, 0, 1, 2])
    assert got["win_rate"] == pytest.approx(60.0) and got["n_total"] == 5 and got["n_draws"] == 2
    assert got["win_rate"] == pytest.approx(float(get_winrate([{"preference": p} for p in [2, 0, 0, 1, 2]])["win_rate"]))
    assert win_rate([2, 1.5, None, 1])["win_rate"] == pytest.approx(50.0)  # None dropped, 1.5 a draw
    with pytest.raises(ValueError, match="preferences"):
        win_rate([3, 1])


class VicunaStub(StubModel):
    """Answers by instruction for any prompt format that ends in the instruction's protocol suffix."""

    def generate(self, prompts, *, max_new_tokens, stop=(), num_samples=1, temperature=0.0, seed=0):
        self.prompts = list(prompts)
        return [[" " + next(v for k, v in self.outputs.items() if k in p)] for p in prompts]


@pytest.mark.parametrize("protocol, head, tail", [
    ("vicuna", "A chat between a curious user and an artificial intelligence assistant. The assistant gives helpful, "
               "detailed, and polite answers to the user's questions. USER: ", " ASSISTANT:"),
    ("alpaca", "Below is an instruction that describes a task. Write a response that appropriately completes the "
               "request.\n\n### Instruction:\n", "\n\n### Response:"),
    ("chat_template", "<user>", "<assistant>"),
])
def test_formatting_protocols(three, protocol, head, tail):
    examples, model, refs, instr = three
    t = AlpacaEvalTask()
    t.protocol = protocol
    ex = t.examples(DATA, StubModel({}), limit=3)
    assert [e.prompt for e in ex] == [head + i + tail for i in instr]
    stub = VicunaStub(model.outputs)
    cfg = AlpacaEvalConfig(limit=3, protocol=protocol)
    res = t.evaluate(stub, ex, _ctx(cfg, LengthJudge()))
    assert stub.prompts == [e.prompt for e in ex]
    assert res.meta["protocol"] == protocol and res.meta["example_prompt"] == ex[0].prompt
    assert res.metrics["alpacaeval_win_rate"] == pytest.approx(100 / 3)
    other = AlpacaEvalTask()  # a task of another protocol
    other.protocol = "vicuna" if protocol != "vicuna" else "alpaca"
    with pytest.raises(ValueError, match="built under protocol"):
        other.evaluate(stub, ex, _ctx(AlpacaEvalConfig(limit=3, protocol=other.protocol), LengthJudge()))


@pytest.mark.parametrize("name, var", [("weighted_alpaca_eval_gpt4_turbo", "OPENAI_API_KEY"),
                                       ("chatgpt_fn", "OPENAI_API_KEY"), ("alpaca_eval_gpt4", "OPENAI_API_KEY"),
                                       ("claude", "ANTHROPIC_API_KEY")])
def test_named_annotator_without_key_fails_before_generation(three, monkeypatch, name, var):
    for v in ("OPENAI_API_KEY", "OPENAI_API_KEYS", "OPENAI_CLIENT_CONFIG_PATH", "ANTHROPIC_API_KEY"):
        monkeypatch.delenv(v, raising=False)
    examples, model, refs, instr = three
    stub = StubModel(model.outputs)
    cfg = AlpacaEvalConfig(limit=3, judge=JudgeConfig(annotator=name))
    with pytest.raises(ValueError, match=var):
        AlpacaEvalTask().evaluate(stub, examples, _ctx(cfg, LengthJudge()))
    assert stub.generate_calls == 0
    with pytest.raises(ValueError, match=var):
        AlpacaEvalTask().preflight(cfg)  # what the runner calls before any stage generates
    with pytest.raises(ValueError, match="no alpaca_eval annotator config"):
        AlpacaEvalTask().preflight(AlpacaEvalConfig(judge=JudgeConfig(annotator="no_such_annotator")))


# ------------------------------------------------------------------ set-ups by name (issue 28)
@pytest.mark.parametrize("setup, protocol, cap, reference, annotator, model", [
    ("dare", "vicuna", 2048, "text_davinci_003", "chatgpt_fn", "gpt-3.5-turbo-16k-0613"),
    ("della", "della", 512, "text_davinci_003", "alpaca_eval_gpt4", "gpt-4"),
    ("alpaca_eval_2", "chat_template", 2048, "gpt4_turbo", "weighted_alpaca_eval_gpt4_turbo", "gpt-4-1106-preview"),
])
def test_setups_resolve_to_their_sources(setup, protocol, cap, reference, annotator, model):
    from darts_bench_tasks.alpacaeval.annotators import resolve_annotator
    from darts_bench_tasks.alpacaeval.setups import annotator_model_note

    cfg = AlpacaEvalConfig(setup=setup)
    assert (cfg.protocol, cfg.max_new_tokens, cfg.reference, cfg.judge.annotator) == (protocol, cap, reference, annotator)
    assert cfg.setup_departures() == {}
    _, _, ann = resolve_annotator(annotator)  # alpaca_eval's own config names the (retired) model
    assert ann["completions_kwargs"]["model_name"] == model and annotator_model_note(model)
    # an explicit value wins over the set-up and is recorded as a departure; the rest still follows it
    mine = AlpacaEvalConfig(setup=setup, max_new_tokens=64, judge={"model": "base", "annotator": None})
    assert (mine.max_new_tokens, mine.judge.annotator, mine.judge.model, mine.protocol) == (64, None, "base", protocol)
    assert mine.setup_departures() == {"max_new_tokens": {"setup": cap, "config": 64},
                                       "judge.annotator": {"setup": annotator, "config": None}}
    assert AlpacaEvalConfig.model_validate(mine.model_dump()) == mine  # a dumped config reloads unchanged
    with pytest.raises(ValueError, match="setup"):
        AlpacaEvalConfig(setup="no_such_setup")


def test_setup_prompts_and_stops_are_the_sources():
    from darts_bench_tasks.alpacaeval.protocols import format_instruction, protocol_stop

    # DELLA utils/evaluate_llms_utils.py generate_instruction_following_task_prompt(is_chat_model=False)
    assert format_instruction("della", "Name a color.", None) == "Name a color.\n\n### Response:\n"
    assert protocol_stop("della") == ["</s>", "USER:", "USER", "ASSISTANT:", "ASSISTANT"]  # batch_response_gen_stop
    # MergeLM generate_instruction_following_task_prompt(is_chat_model=True)
    assert format_instruction("vicuna", "Name a color.", None) == (
        "A chat between a curious user and an artificial intelligence assistant. The assistant gives helpful, "
        "detailed, and polite answers to the user's questions. USER: Name a color. ASSISTANT:")
    assert protocol_stop("vicuna") == [] == protocol_stop("chat_template")


class StopStub(StubModel):
    def generate(self, prompts, *, max_new_tokens, stop=(), num_samples=1, temperature=0.0, seed=0):
        self.calls = getattr(self, "calls", []) + [{"max_new_tokens": max_new_tokens, "stop": list(stop)}]
        return [[" " + next(v for k, v in self.outputs.items() if k in p)] for p in prompts]


def test_della_setup_generates_with_its_prompt_stops_and_cap(three):
    examples, model, refs, instr = three
    t = AlpacaEvalTask()
    t.protocol = "della"
    cfg = AlpacaEvalConfig(setup="della", limit=3, judge={"annotator": None})  # the local judge (offline)
    ex = t.examples(DATA, None, limit=3)
    assert [e.prompt for e in ex] == [i + "\n\n### Response:\n" for i in instr]
    stub = StopStub(model.outputs)
    res = t.evaluate(stub, ex, _ctx(cfg, LengthJudge()))
    assert stub.calls == [{"max_new_tokens": 512, "stop": ["</s>", "USER:", "USER", "ASSISTANT:", "ASSISTANT"]}]
    assert res.meta["setup"] == "della" and res.meta["stop"] == stub.calls[0]["stop"]
    assert res.meta["setup_departures"] == {"judge.annotator": {"setup": "alpaca_eval_gpt4", "config": None}}
    assert res.meta["reference"] == "text_davinci_003" and "declare-lab/della" in res.meta["setup_source"]
    assert res.meta["win_rate_kind"] == "raw" and "gpt4_turbo reference" in res.meta["length_controlled_note"]


# ------------------------------------------------------------------ length-controlled win rate
def _fake_hub_cache(root: Path, n_index: int) -> Path:
    """A Hugging Face hub cache holding a synthetic ``tatsu-lab/alpaca_eval`` ``df_gamed.csv`` (two
    gamed baselines on indices 0..n_index-1), laid out as ``huggingface_hub`` stores downloads."""
    import numpy as np
    import pandas as pd

    rev = "0" * 40
    repo = root / "datasets--tatsu-lab--alpaca_eval"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(rev)
    snap = repo / "snapshots" / rev
    snap.mkdir(parents=True)
    rng = np.random.default_rng(0)
    rows = []
    for model, shift in (("gamed_verbose", 1.0), ("gamed_concise", -1.0)):
        for i in range(n_index):
            rows.append({"model": model, "index": i, "preference": float(rng.uniform(0.05, 0.95)),
                         "std_delta_len": shift + float(rng.normal(0, 0.3)),
                         "instruction_difficulty": float(np.linspace(-1, 1, n_index)[i]), "not_gamed_baseline": False})
    pd.DataFrame(rows).to_csv(snap / "df_gamed.csv", index=False)
    return root


def test_length_controlled_equals_alpaca_evals_function(task, tmp_path, monkeypatch):
    import huggingface_hub.constants as hub_constants
    import pandas as pd
    from alpaca_eval import constants as ae_constants
    from alpaca_eval.metrics import get_length_controlled_winrate

    from darts_bench_tasks.alpacaeval import length_controlled_win_rate

    n = 12
    examples = task.examples(DATA, StubModel({}), limit=n)
    instr = [e.meta["instruction"] for e in examples]
    outputs = {i: (e.reference + " More." * (k % 3)) if k % 2 else "Short." for k, (i, e) in enumerate(zip(instr, examples))}
    model = StubModel(outputs)
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(ae_constants, "DEFAULT_CACHE_DIR", str(tmp_path / "empty_cache"))
    res = task.evaluate(model, examples, _ctx(AlpacaEvalConfig(limit=n), LengthJudge()))
    assert res.meta["win_rate_kind"] == "raw" and res.meta["length_controlled_win_rate"] is None
    assert "df_gamed.csv" in res.meta["length_controlled_note"] and "HF_HUB_OFFLINE" in res.meta["length_controlled_note"]

    monkeypatch.setattr(ae_constants, "DEFAULT_CACHE_DIR", str(_fake_hub_cache(tmp_path / "hub", n)))
    res = task.evaluate(model, examples, _ctx(AlpacaEvalConfig(limit=n), LengthJudge()))
    assert res.meta["win_rate_kind"] == "length_controlled" and res.meta["length_controlled_note"] is None
    # alpaca_eval's function on the annotations frame, built here from the result's samples
    frame = pd.DataFrame({"instruction": [s["instruction"] for s in res.samples],
                          "output_1": [s["reference_output"] for s in res.samples],
                          "output_2": [s["output"] for s in res.samples],
                          "preference": [s["preference"] for s in res.samples],
                          "generator_1": "gpt4_1106_preview", "generator_2": "stub", "annotator": "darts_local_judge"})
    want = get_length_controlled_winrate(frame, save_weights_dir=None, is_add_glm_preference_inplace=False)
    assert res.metrics["alpacaeval_win_rate"] == pytest.approx(float(want["length_controlled_winrate"]), abs=1e-12)
    assert res.meta["length_controlled_standard_error"] == pytest.approx(float(want["lc_standard_error"]), abs=1e-12)
    assert res.metrics["alpacaeval_win_rate_raw"] == pytest.approx(float(want["win_rate"]))
    assert res.metrics["alpacaeval_win_rate"] != res.metrics["alpacaeval_win_rate_raw"]
    # a synthetic frame with a pair without a verdict (NaN: out of the fit, still predicted) and
    # non-contiguous official indices (the GLM reads the instruction difficulty by index)
    prefs = [2.0, 1.0, None, 1.5, 2.0, 1.0, 1.0, 2.0]
    idx = [0, 2, 3, 5, 7, 8, 10, 11]
    refs, outs = [f"ref {i} " * (i + 1) for i in idx], [f"out {i} " * (12 - i) for i in idx]
    got, se = length_controlled_win_rate([f"q{i}" for i in idx], refs, outs, prefs, idx, model_name="m",
                                         annotator="a")
    want = get_length_controlled_winrate(pd.DataFrame(
        {"instruction": [f"q{i}" for i in idx], "output_1": refs, "output_2": outs,
         "preference": [float("nan") if p is None else p for p in prefs], "generator_1": "gpt4_1106_preview",
         "generator_2": "m", "annotator": "a"}, index=idx), save_weights_dir=None, is_add_glm_preference_inplace=False)
    assert (got, se) == (pytest.approx(float(want["length_controlled_winrate"]), abs=1e-12),
                         pytest.approx(float(want["lc_standard_error"]), abs=1e-12))
