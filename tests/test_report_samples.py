"""Samples in the results (darts_bench/report/samples.py): lm-eval's sample fields and hashes (checked
against lm-eval's own samples of the same GSM8K evaluation), deterministic gzip, file/line errors, and
the files a micro run writes (samples/, index.html, results.json's pointers)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pandas as pd

import pytest
from conftest import DATA_DIR
from test_tasks_gsm8k import StandIn, needs_data

from darts_bench.api import EvalContext, Example, Task, TaskResult, get_task
from darts_bench.config import GSM8KConfig
from darts_bench.data import DataError, read_jsonl
from darts_bench.report import rescore as rescore_mod
from darts_bench.report import samples as S

LM_EVAL_FIELDS = ("doc_id", "doc", "target", "arguments", "resps", "filtered_resps", "filter", "metrics",
                  "doc_hash", "prompt_hash", "target_hash")


@needs_data
def test_gsm8k_records_match_lm_evals_own_samples(tmp_path, monkeypatch):
    """The same evaluation's samples as lm-eval logs them (``lm_eval.evaluate(log_samples=True)``, which
    ``simple_evaluate`` runs too; strict-match filter): doc, target, prompt and the three hashes are equal, field
    by field."""
    import lm_eval

    seen = {}
    real = lm_eval.evaluate

    def capture(*a, **kw):
        out = real(*a, **kw)
        seen.update(out["samples"])
        return out

    monkeypatch.setattr(lm_eval, "evaluate", capture)
    task = get_task("gsm8k")
    model = StandIn()
    ex = task.examples(DATA_DIR, model, 5)
    res = task.evaluate(model, ex, EvalContext(config=GSM8KConfig(max_new_tokens=77), data_dir=DATA_DIR, seed=1,
                                               work_dir=tmp_path))
    res.example_ids = [e.id for e in ex]
    recs = S.sample_records("ties+darts", task, ex, res)
    theirs = sorted((s for s in seen["darts_gsm8k"] if s["filter"] == "strict-match"), key=lambda s: s["doc_id"])
    assert len(recs) == len(theirs) == 5
    for mine, lm in zip(recs, theirs):
        assert list(mine)[:len(LM_EVAL_FIELDS)] == list(LM_EVAL_FIELDS)
        for k in ("doc_id", "doc", "target", "doc_hash", "prompt_hash", "target_hash"):
            assert mine[k] == lm[k], k
        assert mine["arguments"]["gen_args_0"]["arg_0"] == lm["arguments"][0][0]
        assert mine["resps"] == [[lm["resps"][0][0]]]
        assert mine["arguments"]["gen_args_0"]["arg_1"] == {"until": ["Question:", "</s>", "<|im_end|>", "\n\n"],
                                                           "max_gen_toks": 77, "do_sample": False,
                                                           "temperature": 0.0}
    assert recs[0]["metrics"] == list(res.per_example) and recs[0]["em_strict"] == 1.0
    # ours: the strict answer, the verdict and the per-example metrics, as the task scored them
    assert [r["extracted"] for r in recs] == [["18"], ["4"], [None], ["540"], [None]]
    assert [r["verdict"] for r in recs] == [[True], [False], [False], [True], [False]]
    assert [r["em_flexible"] for r in recs] == [1.0, 0.0, 1.0, 0.0, 1.0]
    assert [r["ref_nll"] for r in recs] == [0.5] * 5
    assert recs[0]["filter"] == "lm-eval" and recs[4]["sample"]["response"] == "The total is 20 cups"
    assert recs[2]["example_id"] == "gsm8k/2" and recs[2]["row"] == "ties+darts" and recs[2]["task"] == "gsm8k"


class Plain(Task):
    """A task with the base class's samples view (no override)."""

    name, expert, version = "plain", None, "1"

    def examples(self, data_dir, model, limit):
        return []

    def training_prompts(self, data_dir, model, n, seed):
        return []

    def evaluate(self, model, examples, ctx):
        raise NotImplementedError


def _result(n, text="x"):
    ex = [Example(id=f"t/{i}", prompt=f"p{i}", reference=f"r{i}", meta={"k": i}) for i in range(n)]
    res = TaskResult(metrics={}, per_example={"em": [float(i % 2) for i in range(n)]},
                     samples=[{"output": f"{text}{i}", "passed": bool(i % 2)} for i in range(n)],
                     example_ids=[e.id for e in ex])
    return ex, res


def test_default_fields_gzip_over_threshold_and_deterministic_bytes(tmp_path, monkeypatch):
    ex, res = _result(3)
    f = Plain().sample_fields(ex[1], res.samples[1])
    assert f == {"doc": {"k": 1}, "target": "r1", "prompt": "p1", "responses": ["x1"], "extracted": ["x1"],
                 "verdict": [True]}
    recs = [{"doc_id": i, "text": "é" * 10} for i in range(3)]
    data, suffix = S.encode(recs)
    assert suffix == ".jsonl" and data.decode("utf-8").splitlines()[0] == '{"doc_id": 0, "text": "éééééééééé"}'
    monkeypatch.setattr(S, "GZIP_OVER_BYTES", 10)
    gz, suffix = S.encode(recs)
    assert suffix == ".jsonl.gz" and gzip.decompress(gz) == data
    assert gz[4:8] == b"\0\0\0\0"  # gzip header mtime 0: the same records give the same bytes
    assert S.encode(recs) == (gz, suffix)
    p = tmp_path / "a.jsonl.gz"
    p.write_bytes(gz)
    assert read_jsonl(p) == recs


def test_mismatched_lists_and_bad_files_are_named(tmp_path):
    task = Plain()
    ex, res = _result(3)
    res.per_example["em"] = [1.0]
    with pytest.raises(ValueError, match=r"samples of ties on plain: per_example\['em'\] has 1 values for 3 examples"):
        S.sample_records("ties", task, ex, res)
    ex, res = _result(3)
    res.samples = res.samples[:2]
    with pytest.raises(ValueError, match="2 sample records for 3 examples"):
        S.sample_records("ties", task, ex, res)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"doc_id": 0}\n[1]\n')
    with pytest.raises(DataError, match=r"bad.jsonl:2: expected a JSON object, got list"):
        read_jsonl(bad)
    with pytest.raises(DataError, match=r"cannot read .*missing\.jsonl: FileNotFoundError"):
        read_jsonl(tmp_path / "missing.jsonl")


def test_write_samples_dir_names_rows_and_removes_stale_files(tmp_path):
    task = Plain()
    ex, res = _result(2)
    stale = tmp_path / "samples" / "gone" / "gsm8k.jsonl"
    stale.parent.mkdir(parents=True)
    stale.write_text("{}\n")
    index = S.write_samples_dir(tmp_path, ["ties+darts#s1"], {"plain": (task, ex)}, {"ties+darts#s1": {"plain": res}})
    assert index == {"ties+darts#s1": {"plain": {"samples": "samples/ties+darts_s1/plain.jsonl", "n": 2,
                                                   "eval_artifact": None}}}
    assert not stale.exists() and not stale.parent.exists()
    assert [r["resps"] for r in read_jsonl(tmp_path / index["ties+darts#s1"]["plain"]["samples"])] == \
        [[["x0"]], [["x1"]]]


@pytest.mark.micro
@pytest.mark.subprocess  # the HumanEval sandbox (rescore) and headless Chromium (page)
def test_micro_run_writes_samples_page_and_rescores(micro_pipeline, micro_dir):
    """A micro run writes samples/ (one file per row x task, every example) and index.html, and
    results.json points to both; the page renders the samples' completions; `report --rescore`
    re-scores edited samples without generating (an answer made right moves the cell by 1/4)."""
    import sys

    from test_report_page import Rendered, dump_dom

    from darts_bench.cli import main

    out = micro_dir / "samples-run"
    assert main(["run", "--config", str(micro_dir / "micro.yaml"), "--out", str(out)]) == 0
    res = json.loads((out / "results.json").read_text())
    arts = res["artifacts"]["rows"]
    assert list(arts) == [r["model"] for r in res["rows"]]
    for row, by_task in arts.items():
        assert sorted(by_task) == ["alpacaeval", "gsm8k", "humaneval"]
        for t, e in by_task.items():
            recs = read_jsonl(out / e["samples"])
            assert len(recs) == e["n"] == 4 and [r["doc_id"] for r in recs] == [0, 1, 2, 3]
            assert all(r["row"] == row and r["task"] == t for r in recs)
            assert (Path(e["eval_artifact"]) / "result.json").is_file()
    assert arts["ties+darts"]["humaneval"]["samples"] == "samples/ties+darts/humaneval.jsonl"
    # the page: the ties group's completions of example 2 are the samples files' responses
    r = Rendered()
    r.feed(dump_dom(out / "index.html", "task=humaneval&merge=ties&ex=2"))
    want = {row: read_jsonl(out / arts[row]["humaneval"]["samples"])[2]["resps"][0][0]
            for row in ("ties", "ties+surgery", "ties+darts")}
    assert r.completions == {k: (v if v else "(empty)") for k, v in want.items()}
    assert r.text["example-id"] == "HumanEval/2" and len(r.verdicts) == 3
    # rescore: unedited samples reproduce the table; an edited answer moves exactly its cell
    assert main(["report", "--rescore", "--config", str(micro_dir / "micro.yaml"), "--out", str(out)]) == 0
    df = pd.read_csv(out / "rescore.csv")
    scored = df[df["metric"].notna()]
    assert len(scored) == 14 * 3 and (scored["delta"] == 0).all() and (scored["n_changed"].fillna(0) == 0).all()
    assert set(df[df["task"] == "alpacaeval"]["note"]) == {rescore_mod.NO_SCORER}
    he = out / arts["ties+darts"]["humaneval"]["samples"]
    recs = read_jsonl(he)
    problems = sys.modules[type(get_task("humaneval")).__module__].load_problems(DATA_DIR)
    recs[0]["resps"] = [[problems[recs[0]["doc"]["task_id"]]["canonical_solution"]]]
    he.write_text("".join(json.dumps(x) + "\n" for x in recs))
    gs = out / arts["ties"]["gsm8k"]["samples"]
    recs = read_jsonl(gs)
    recs[0]["resps"] = [["She makes #### 18"]]
    gs.write_text("".join(json.dumps(x) + "\n" for x in recs))
    assert main(["report", "--rescore", "--config", str(micro_dir / "micro.yaml"), "--out", str(out)]) == 0
    df = pd.read_csv(out / "rescore.csv").set_index(["model", "metric"])
    assert df.loc[("ties+darts", "humaneval_pass@1"), "rescored"] == 0.25
    assert df.loc[("ties+darts", "humaneval_pass@1"), "delta"] == 0.25
    assert df.loc[("ties", "gsm8k_em_strict"), "rescored"] == 0.25 and df.loc[("ties", "gsm8k_em_strict"), "n_changed"] == 1
    assert df.loc[("ties", "gsm8k_em_flexible"), "n_changed"] == 1
    moved = df[df["delta"].fillna(0) != 0]
    assert sorted(moved.index) == [("ties", "gsm8k_em_flexible"), ("ties", "gsm8k_em_strict"),
                                   ("ties+darts", "humaneval_pass@1")]
    assert "3 of 42 re-scored cells moved" in (out / "rescore.md").read_text()
