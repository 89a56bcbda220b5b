"""A benchmark added by folder (DARTS_BENCH_TASKS_PATH, outside the repository) runs like a built-in
one: config section, planner, `run --suite`, heads, report, `score` — with no edit to darts_bench/.

The two example tasks below are the README's "Adding a benchmark" walk-through: ``tinycode`` (a
code benchmark reusing ``darts_bench.scoring``, mapped to the ``code`` expert, so it gets heads) and
``tinyplain`` (no expert: evaluated on every row, no heads).
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pandas as pd
import pytest

from darts_bench.api import available_tasks, resolve_suite
from darts_bench.cli import main
from darts_bench.config import ConfigError, load_config

pytestmark = [pytest.mark.subprocess]  # tests/README.md: markers

TINYCODE = '''
"""tinycode: four one-line Python functions, pass@1 in the sandbox (a worked example)."""
from pydantic import Field

from darts_bench.api import Example, Task, TaskConfig, TaskResult, register_task
from darts_bench.data import alpaca_text, load_expert_records
from darts_bench.scoring import (build_program, check_programs, pass_at_k, reference_nll, score_code_samples,
                                 write_code_samples)

PROBLEMS = {p["task_id"]: p for p in [
    {"task_id": "tinycode/0", "prompt": "def add(a, b):\\n", "solution": "    return a + b\\n",
     "test": "def check(f):\\n    assert f(2, 3) == 5\\n", "entry_point": "add"},
    {"task_id": "tinycode/1", "prompt": "def neg(x):\\n", "solution": "    return -x\\n",
     "test": "def check(f):\\n    assert f(4) == -4\\n", "entry_point": "neg"},
    {"task_id": "tinycode/2", "prompt": "def first(xs):\\n", "solution": "    return xs[0]\\n",
     "test": "def check(f):\\n    assert f([7, 8]) == 7\\n", "entry_point": "first"},
    {"task_id": "tinycode/3", "prompt": "def twice(s):\\n", "solution": "    return s + s\\n",
     "test": "def check(f):\\n    assert f('ab') == 'abab'\\n", "entry_point": "twice"},
]}


class TinyCodeConfig(TaskConfig):
    max_new_tokens: int = Field(16, ge=1)
    timeout_s: float = Field(5.0, gt=0)


@register_task
class TinyCode(Task):
    name = "tinycode"
    expert = "code"  # calibrated on the code expert: gets Surgery / DARTS heads
    version = "1"
    primary_metrics = ("tinycode_pass@1",)
    config_model = TinyCodeConfig
    official_size = len(PROBLEMS)
    typical_tokens = {"prompt": 12, "reference": 8}

    def examples(self, data_dir, model, limit):
        ps = list(PROBLEMS.values())[:limit]
        return [Example(id=p["task_id"], prompt=p["prompt"], reference=p["solution"], meta=p) for p in ps]

    def training_prompts(self, data_dir, model, n, seed):
        return [alpaca_text(r) for r in load_expert_records(data_dir, "code")[:n]]

    def evaluate(self, model, examples, ctx):
        cfg = ctx.config
        outs = model.generate([e.prompt for e in examples], max_new_tokens=cfg.max_new_tokens, stop=["\\ndef "])
        programs = [build_program(e.prompt, o[0], e.meta["test"], e.meta["entry_point"])
                    for e, o in zip(examples, outs)]
        results = check_programs(programs, timeout_s=cfg.timeout_s, memory_mb=512, workers=1)
        mean, per = pass_at_k([1] * len(examples), [int(r.passed) for r in results], 1)
        nll, per_nll = reference_nll(model, examples)
        path = write_code_samples(ctx.artifact_dir(), self.name, [e.id for e in examples], outs,
                                  [[r] for r in results])
        return TaskResult(metrics={"tinycode_pass@1": mean, "tinycode_ref_nll": nll, "n_tinycode": len(examples)},
                          per_example={"pass@1": per, "ref_nll": per_nll},
                          samples=[{"task_id": e.id, "output": o[0], "passed": r.passed}
                                   for e, o, r in zip(examples, outs, results)],
                          meta={"samples_file": path.name if path else None})

    def score_samples(self, samples_path, config, data_dir):
        return score_code_samples(samples_path, PROBLEMS, timeout_s=config.timeout_s, memory_mb=512, workers=1)
'''

TINYPLAIN = '''
"""tinyplain: does the model start its answer with the expected word? (no expert, no heads)"""
from darts_bench.api import Example, Task, TaskConfig, TaskResult, register_task
from darts_bench.scoring import reference_nll

ITEMS = [("The capital of France is", " Paris"), ("Two plus two is", " four"), ("The sky is", " blue")]


@register_task
class TinyPlain(Task):
    name = "tinyplain"
    expert = None  # evaluated on every row, never calibrated
    version = "1"
    primary_metrics = ("tinyplain_em",)
    official_size = len(ITEMS)

    def examples(self, data_dir, model, limit):
        return [Example(id=f"tinyplain/{i}", prompt=p, reference=r) for i, (p, r) in enumerate(ITEMS[:limit])]

    def training_prompts(self, data_dir, model, n, seed):
        raise NotImplementedError("tinyplain has no expert")

    def evaluate(self, model, examples, ctx):
        outs = model.generate([e.prompt for e in examples], max_new_tokens=3)
        em = [float(o[0].strip().startswith(e.reference.strip())) for e, o in zip(examples, outs)]
        nll, per_nll = reference_nll(model, examples)
        return TaskResult(metrics={"tinyplain_em": sum(em) / len(em), "tinyplain_ref_nll": nll,
                                   "n_tinyplain": len(examples)},
                          per_example={"em": em, "ref_nll": per_nll},
                          samples=[{"output": o[0]} for o in outs])
'''


@pytest.fixture
def extra_tasks(tmp_path, monkeypatch) -> Path:
    """A task folder outside the repository, put on DARTS_BENCH_TASKS_PATH for this test only."""
    root = tmp_path / "my_benchmarks"
    for name, src in (("tinycode", TINYCODE), ("tinyplain", TINYPLAIN)):
        (root / name).mkdir(parents=True)
        (root / name / "__init__.py").write_text(textwrap.dedent(src))
    monkeypatch.setenv("DARTS_BENCH_TASKS_PATH", str(root))
    return root


def test_added_task_is_registered_configured_and_planned(extra_tasks, micro_cfg_path):
    from darts_bench.plan import make_plan

    assert available_tasks() == ["humaneval", "gsm8k", "alpacaeval", "tinycode", "tinyplain"]
    cfg = load_config(str(micro_cfg_path), ["tasks.tinycode.limit=2"])
    assert cfg.tasks.tinycode.limit == 2 and cfg.tasks.tinycode.max_new_tokens == 16
    assert resolve_suite("all", cfg.tasks)[-2:] == ["tinycode", "tinyplain"]
    assert resolve_suite("tinyplain,tinycode") == ["tinycode", "tinyplain"]
    with pytest.raises(ConfigError, match=r"tasks\.tinycode\.limt: unknown key"):
        load_config(str(micro_cfg_path), ["tasks.tinycode.limt=2"])
    with pytest.raises(ConfigError, match=r"tasks\.tinycode\.timeout_s: Input should be greater than 0"):
        load_config(str(micro_cfg_path), ["tasks.tinycode.timeout_s=0"])
    plan = make_plan(cfg, suite="tinycode,tinyplain")
    assert {t: v["n_examples"] for t, v in plan["tasks"].items()} == {"tinycode": 2, "tinyplain": 3}
    # heads only for the task with an expert: 2 merges x 1 task x 2 splits x 2 methods
    assert plan["stages"]["train"]["what"].startswith("8 heads (2 merges x 1 tasks")
    assert list(plan["stages"]["collect"]["calibration"]) == ["tinycode/transductive", "tinycode/inductive",
                                                              "tinycode/reference"]


def test_task_named_in_config_but_not_installed(micro_cfg_path, monkeypatch):
    monkeypatch.delenv("DARTS_BENCH_TASKS_PATH", raising=False)
    assert "tinycode" not in available_tasks()  # not left behind by another test
    with pytest.raises(ConfigError) as e:
        load_config(str(micro_cfg_path), ["tasks.tinycode.limit=2"])
    assert "tasks.tinycode: unknown key" in str(e.value) and "DARTS_BENCH_TASKS_PATH" in str(e.value)
    with pytest.raises(SystemExit):
        main(["run", "--dry-run", "--suite", "tinycode"])


@pytest.mark.micro
def test_added_tasks_run_get_heads_report_and_score(extra_tasks, micro_dir, micro_pipeline, tmp_path, capsys):
    out = tmp_path / "results"
    rc = main(["run", "--config", str(micro_dir / "micro.yaml"), "--suite", "tinycode,tinyplain",
               "--set", "tasks.tinycode.limit=2", "--out", str(out)])
    assert rc == 0
    df = pd.read_csv(out / "table.csv")
    for c in ("tinycode_pass@1", "tinycode_ref_nll", "tinycode_rep_l1", "tinycode_gap_closed", "n_tinycode",
              "tinyplain_em", "tinyplain_ref_nll", "n_tinyplain"):
        assert c in df.columns, c
    assert not any(c.startswith(("humaneval", "gsm8k", "alpacaeval")) for c in df.columns)
    assert (df["n_tinycode"] == 2).all() and (df["n_tinyplain"] == 3).all()
    by = df.set_index("model")
    for m in ("ties", "task_arithmetic"):
        for corr in ("surgery", "darts"):
            r = by.loc[f"{m}+{corr}"]
            assert r["params_added"] > 0 and pd.notna(r["tinycode_gap_closed"])  # tinycode got heads
            # tinyplain has none: the corrected row is its merge on it (same cached evaluation)
            assert r["tinyplain_ref_nll"] == by.loc[m, "tinyplain_ref_nll"]
        assert pd.notna(by.loc[m, "tinycode_rep_l1"]) and pd.isna(by.loc[m, "tinyplain_rep_l1"])
    assert df["tinycode_ref_nll"].notna().all() and df["tinyplain_ref_nll"].notna().all()
    res = json.loads((out / "results.json").read_text())
    assert res["manifest"]["task_experts"] == {"tinycode": "code", "tinyplain": None}
    assert list(res["manifest"]["tasks_without_heads"]) == ["tinyplain"]
    assert {"tinycode_pass@1", "tinyplain_em"} <= set(res["rows"][0])
    md = (out / "table.md").read_text()
    assert "## tinycode" in md and "ties+darts - ties+surgery" in md
    assert "tinyplain: no expert" in md
    assert (out / "plots" / "tinycode_l1_by_position.png").is_file()
    assert not (out / "plots" / "tinyplain_l1_by_position.png").exists()

    # the samples file is kept in the evaluation artifact and `score` re-scores it to the table's value
    work = Path(load_config(str(micro_dir / "micro.yaml")).work_dir)
    (art,) = [p for p in (work / "eval").glob("ties+darts-tinycode-*") if (p / "result.json").is_file()]
    samples = art / "tinycode_samples.jsonl"
    assert len(samples.read_text().splitlines()) == 2
    capsys.readouterr()
    assert main(["score", "tinycode", str(samples), "--config", str(micro_dir / "micro.yaml"),
                 "--out", str(tmp_path / "s.json")]) == 0
    scored = json.loads((tmp_path / "s.json").read_text())
    assert scored["pass@1"] == pytest.approx(by.loc["ties+darts", "tinycode_pass@1"])
    assert scored["n_problems"] == 2


def test_score_added_task_values_and_errors(extra_tasks, tmp_path, capsys):
    good = tmp_path / "good.jsonl"
    good.write_text(json.dumps({"task_id": "tinycode/0", "completion": "    return a + b\n"}) + "\n"
                    + json.dumps({"task_id": "tinycode/1", "completion": "    return x\n"}) + "\n")
    out = tmp_path / "m.json"
    assert main(["score", "tinycode", str(good), "--out", str(out)]) == 0
    m = json.loads(out.read_text())
    assert m["pass@1"] == 0.5 and m["per_problem"]["tinycode/0"]["n_correct"] == 1
    assert m["per_problem"]["tinycode/1"]["results"][0]["status"] == "failed"
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"task_id": "tinycode/0", "completion": "x"}) + "\n"
                   + json.dumps({"task_id": "tinycode/9", "completion": "x"}) + "\n")
    capsys.readouterr()
    assert main(["score", "tinycode", str(bad)]) == 2
    assert f"{bad}:2: unknown task_id 'tinycode/9'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:  # no offline scorer: not a choice of `score` (issue 63)
        main(["score", "tinyplain", str(good)])
    assert e.value.code == 2 and "invalid choice: 'tinyplain'" in capsys.readouterr().err
