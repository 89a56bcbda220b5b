"""lm-eval both ways: a ``kind: lm_eval`` task folder runs local lm-eval tasks on every row of a
micro run, and lm-eval (Python API and its own CLI through ``darts-bench lm-eval``) evaluating the
row ``darts-bench export`` wrote gets the same per-example outputs, for a ``generate_until`` and a
``multiple_choice`` (loglikelihood) task, on a ``+darts`` row whose heads change the outputs.
"""

from __future__ import annotations

import argparse
import os
import json
import textwrap
from pathlib import Path

import pytest

from darts_bench.api import available_tasks, get_task, task_class
from darts_bench.cli import main
from conftest import micro_config_file


def metric_column(task: str, metric: str) -> str:
    """tasks/lm_eval's column name (the folder is imported as darts_bench_tasks.lm_eval by discovery)."""
    available_tasks()
    from darts_bench_tasks.lm_eval import metric_column as column

    return column(task, metric)


def _write_lm_eval_tasks(root: Path, data_dir: Path) -> Path:
    """Two local lm-eval tasks over JSONL made from GSM8K (test: 4 docs; train: 6 docs for the
    inductive calibration split) and the darts-bench task folders declaring them. Returns the folder
    for DARTS_BENCH_TASKS_PATH."""
    yd = root / "lm_eval_yaml"
    yd.mkdir(parents=True)
    recs = [json.loads(line) for line in (data_dir / "gsm8k" / "test.jsonl").read_text().splitlines()[:10]]

    def qa(r):
        return {"question": r["question"], "answer": r["answer"].split("####")[-1].strip()}

    def mc(i, r):
        a = int(qa(r)["answer"])
        return {"question": r["question"], "choices": [str(a), str(a + 1), str(2 * a)], "label": i % 3}

    for name, rows in (("qa_test", [qa(r) for r in recs[:4]]), ("qa_train", [qa(r) for r in recs[4:]]),
                       ("mc_test", [mc(i, r) for i, r in enumerate(recs[:4])]),
                       ("mc_train", [mc(i, r) for i, r in enumerate(recs[4:])])):
        (yd / f"{name}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in rows))
    # data_files absolute: lm-eval resolves relative ones against the working directory
    (yd / "tinyqa_gen.yaml").write_text(textwrap.dedent(f"""\
        task: tinyqa_gen
        dataset_path: json
        dataset_kwargs:
          data_files: {{test: {yd / 'qa_test.jsonl'}, train: {yd / 'qa_train.jsonl'}}}
        output_type: generate_until
        test_split: test
        training_split: train
        doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
        doc_to_target: "{{{{answer}}}}"
        generation_kwargs: {{until: ["Question:"], do_sample: false, temperature: 0.0, max_gen_toks: 10}}
        metric_list:
          - {{metric: exact_match, aggregation: mean, higher_is_better: true}}
        metadata: {{version: 1.0}}
        """))
    (yd / "tinyqa_mc.yaml").write_text(textwrap.dedent(f"""\
        task: tinyqa_mc
        dataset_path: json
        dataset_kwargs:
          data_files: {{test: {yd / 'mc_test.jsonl'}, train: {yd / 'mc_train.jsonl'}}}
        output_type: multiple_choice
        test_split: test
        training_split: train
        doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
        doc_to_choice: "{{{{choices}}}}"
        doc_to_target: label
        metric_list:
          - {{metric: acc, aggregation: mean, higher_is_better: true}}
        metadata: {{version: 1.0}}
        """))
    tasks = root / "tasks"
    for folder, lm_task, metric in (("tinyqa", "tinyqa_gen", "exact_match"), ("tinymc", "tinyqa_mc", "acc")):
        (tasks / folder).mkdir(parents=True)
        (tasks / folder / "task.yaml").write_text(
            f"kind: lm_eval\ntask: {lm_task}\ninclude_path: ../../lm_eval_yaml\nmetrics: [{metric}]\nexpert: math\n")
    return tasks


def _lm_eval_samples(out: dict, task: str) -> dict[int, dict]:
    return {int(s["doc_id"]): json.loads(json.dumps(s, default=str)) for s in out["samples"][task]}


def _run_samples(work: Path, row: str, task: str) -> list[dict]:
    found = list((work / "eval").glob(f"{row}-{task}-*/result.json"))
    assert len(found) == 1, found
    return json.loads(found[0].read_text())["samples"]


@pytest.mark.micro
def test_lm_eval_sees_the_row_darts_bench_ran(tmp_path, monkeypatch, micro_dir, data_dir, capsys):
    import lm_eval
    from lm_eval.tasks import TaskManager

    tasks_dir = _write_lm_eval_tasks(tmp_path, data_dir)
    monkeypatch.setenv("DARTS_BENCH_TASKS_PATH", str(tasks_dir))
    work = micro_dir / "work"  # the session's micro pool and merge are reused from there
    cfg = micro_config_file(tmp_path, work_dir=str(work),
                            merges=[{"name": "ties", "method": "ties", "density": 0.5, "normalize": True}])
    suite = ["--config", str(cfg), "--suite", "tinyqa,tinymc"]

    # ls tasks lists both folders
    assert main(["ls", "tasks", "--json"]) == 0
    listed = {t["task"]: t for t in json.loads(capsys.readouterr().out)}
    assert listed["tinyqa"]["metrics"] == "tinyqa_exact_match" and listed["tinymc"]["expert"] == "math"
    assert listed["tinyqa"]["folder"] == str((tasks_dir / "tinyqa").resolve())

    # darts-bench run: kind: lm_eval on the merge and its +darts row, metrics in our tables
    assert main(["run", *suite, "--rows", "ties,ties+darts"]) == 0
    capsys.readouterr()
    res = json.loads((tmp_path / "results" / "results.json").read_text())
    rows = {r["model"]: r for r in res["rows"]}
    for col in ("tinyqa_exact_match", "tinymc_acc", "tinyqa_ref_nll", "tinymc_ref_nll", "n_tinyqa"):
        assert col in rows["ties+darts"], col
    assert rows["ties+darts"]["n_tinymc"] == 4
    run_qa = _run_samples(work, "ties+darts", "tinyqa")
    run_mc = _run_samples(work, "ties+darts", "tinymc")
    merge_mc = _run_samples(work, "ties", "tinymc")
    # the heads act: the +darts row's loglikelihoods are not the merge's
    assert [s["resps"] for s in run_mc] != [s["resps"] for s in merge_mc]
    assert rows["ties+darts"]["tinymc_acc"] == sum(s["metrics"]["tinymc_acc"] for s in run_mc) / 4

    # darts-bench export: the model dir and each task's head dir
    to = tmp_path / "export"
    assert main(["export", "ties+darts", "--to", str(to), *suite]) == 0
    printed = capsys.readouterr().out
    rec = json.loads((to / "export.json").read_text())
    assert set(rec["heads"]) == {"tinyqa", "tinymc"} and rec["tasks_without_heads"] == {}
    assert "tinymc: head" in printed and "math expert's tinymc features" in printed
    assert (to / "model" / "config.json").is_file() and (to / "heads" / "tinyqa" / "head.safetensors").is_file()
    assert rec["heads"]["tinyqa"]["source"] != rec["heads"]["tinymc"]["source"]  # heads are per task
    assert not (to / "model" / "_manifest.json").exists()

    # lm-eval's Python API by model name: the same per-example outputs and metrics as the run
    tm = TaskManager(include_path=str(tmp_path / "lm_eval_yaml"), include_defaults=False)
    for task, lm_task, run_samples in (("tinyqa", "tinyqa_gen", run_qa), ("tinymc", "tinyqa_mc", run_mc)):
        out = lm_eval.simple_evaluate(model="darts-bench", model_args=rec["lm_eval_model_args"][task]["darts-bench"],
                                      batch_size=rec["batch_size"], tasks=[lm_task], task_manager=tm, limit=4,
                                      log_samples=True, device="cpu", bootstrap_iters=0)
        got = _lm_eval_samples(out, lm_task)
        assert sorted(got) == [0, 1, 2, 3]
        for i, s in enumerate(run_samples):
            assert got[i]["resps"] == s["resps"], (task, i)
            assert got[i]["arguments"] == s["arguments"]
            assert got[i]["doc_hash"] == s["doc_hash"]
            metric = "exact_match" if task == "tinyqa" else "acc"
            assert got[i][metric] == s["metrics"][metric_column(task, metric)]
    # generate_until: generated text was compared, not empty strings (the micro model writes newlines)
    assert all(s["output"] for s in run_qa)

    # lm-eval's own CLI through darts-bench lm-eval (the model registered), output in lm-eval's layout
    out_dir = tmp_path / "lm_eval_out"
    assert main(["lm-eval", "run", "--model", "darts-bench", "--model_args",
                 rec["lm_eval_model_args"]["tinyqa"]["darts-bench"], "--batch_size", str(rec["batch_size"]),
                 "--tasks", "tinyqa_gen", "--include_path", str(tmp_path / "lm_eval_yaml"), "--device", "cpu",
                 "--limit", "4", "--log_samples", "--output_path", str(out_dir)]) == 0
    (samples_file,) = out_dir.rglob("samples_tinyqa_gen_*.jsonl")
    cli = {int(s["doc_id"]): s for s in map(json.loads, samples_file.read_text().splitlines())}
    assert [cli[i]["resps"] for i in range(4)] == [s["resps"] for s in run_qa]

    # the vLLM line parses with lm-eval's own --model_args parser into the head class's overrides
    ns = argparse.Namespace()
    from lm_eval._cli.utils import MergeDictAction  # the action lm-eval's --model_args uses

    MergeDictAction(["--model_args"], "model_args")(argparse.ArgumentParser(), ns,
                                                    [json.dumps(rec["lm_eval_model_args"]["tinyqa"]["vllm"])])
    assert ns.model_args == {"pretrained": str(to / "model"), "dtype": "float32",
                             "hf_overrides": {"architectures": ["DartsLlamaForCausalLM"],
                                              "darts_head_dir": str(to / "heads" / "tinyqa")}}


# ------------------------------------------------------------------ fast checks (no micro pool)
def _spec_folder(tmp_path: Path, monkeypatch, text: str, name: str = "badtask") -> Path:
    d = tmp_path / "tasks" / name
    d.mkdir(parents=True)
    (d / "task.yaml").write_text(text)
    monkeypatch.setenv("DARTS_BENCH_TASKS_PATH", str(tmp_path / "tasks"))
    return d


@pytest.mark.parametrize("text, msg", [
    ("kind: lm_eval\ntask: x\nmetrics: [acc]\nmetrix: 1\n", "metrix: Extra inputs are not permitted"),
    ("kind: lm_eval\ntask: x\n", "metrics: Field required"),
    ("kind: lm_eval\ntask: x\nmetrics: [acc]\ninclude_path: nowhere\n", "include_path 'nowhere' is not a folder"),
    ("kind: lm_eval\ntask: x\nmetrics: ['acc,a,b']\n", "expected 'metric' or 'metric,filter'"),
    ("kind: hub_magic\ntask: x\n", "unknown task kind 'hub_magic'; known kinds: ['lm_eval']"),
    ("- just a list\n", "expected a mapping with a `kind`"),
])
def test_bad_task_yaml_names_the_file_and_key(tmp_path, monkeypatch, text, msg):
    d = _spec_folder(tmp_path, monkeypatch, text)
    with pytest.raises(ValueError) as e:
        available_tasks()
    assert str(d / "task.yaml") in str(e.value) and msg in str(e.value)


def test_unknown_lm_eval_task_and_metric_are_named(tmp_path, monkeypatch):
    yd = tmp_path / "yaml"
    yd.mkdir()
    (yd / "t.jsonl").write_text('{"q": "a", "a": "b"}\n')
    (yd / "t.yaml").write_text(f"task: t1\ndataset_path: json\ndataset_kwargs: {{data_files: {{test: {yd / 't.jsonl'}}}}}\n"
                               "output_type: loglikelihood_rolling\ntest_split: test\ndoc_to_text: '{{q}}'\n"
                               "doc_to_target: '{{a}}'\n")
    _spec_folder(tmp_path, monkeypatch, "kind: lm_eval\ntask: t2\ninclude_path: ../../yaml\nmetrics: [acc]\n", "nosuch")
    _spec_folder(tmp_path, monkeypatch, "kind: lm_eval\ntask: t1\ninclude_path: ../../yaml\nmetrics: [acc]\n", "rolling")
    assert {"nosuch", "rolling"} <= set(available_tasks())
    assert task_class("rolling").primary_metrics == ("rolling_acc",)
    with pytest.raises(ValueError, match=r"no lm-eval task 't2' in include_path .*yaml"):
        get_task("nosuch").examples(None, None, 2)
    with pytest.raises(ValueError, match="output_type 'loglikelihood_rolling'; supported"):
        get_task("rolling").examples(None, None, 2)


def test_version_hashes_the_include_folder(tmp_path, monkeypatch):
    yd = tmp_path / "yaml"
    yd.mkdir()
    (yd / "a.yaml").write_text("task: a\n")
    _spec_folder(tmp_path, monkeypatch, "kind: lm_eval\ntask: a\ninclude_path: ../../yaml\nmetrics: [acc]\n"
                 "version: '3'\n", "vers")
    v1 = get_task("vers").version
    assert v1.startswith("3+") and get_task("vers").version == v1
    (yd / "a.yaml").write_text("task: a\nnum_fewshot: 1\n")
    assert get_task("vers").version != v1


def test_metric_columns():
    assert metric_column("tinyqa", "exact_match") == "tinyqa_exact_match"
    assert metric_column("g", "exact_match,strict-match") == "g_exact_match_strict_match"
    assert metric_column("g", "pass@1,create_test") == "g_pass@1_create_test"


def test_adapter_head_needs_pretrained():
    from darts_bench.evaluate.lm_eval_adapter import DartsBenchLM

    with pytest.raises(ValueError, match="apply to `pretrained` only"):
        DartsBenchLM(object(), head="/x")
    with pytest.raises(ValueError, match="dtype 'int8' not one of"):
        DartsBenchLM(pretrained="/nonexistent", dtype="int8")
    with pytest.raises(FileNotFoundError):
        DartsBenchLM(pretrained=str(Path("/nonexistent/model")))


def test_export_refuses_a_nonempty_dir_and_names_rows(tmp_path):
    from darts_bench.export import export_row, lm_eval_model_args

    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "f").write_text("")
    with pytest.raises(FileExistsError, match="not empty"):
        export_row(None, "ties", tmp_path / "x")
    with pytest.raises(ValueError, match="contains a comma"):
        lm_eval_model_args(Path("/a,b"), None, "float32")
    assert lm_eval_model_args(Path("/m"), Path("/h"), "float32")["hf"] == "pretrained=/m,head=/h,dtype=float32"



def test_export_refuses_a_routed_or_unknown_row_before_building_anything(tmp_path, monkeypatch):
    """A ``@routed`` row (heads or EMR) and a name that is no row are refused from the config's row specs,
    before ``Pipeline.all_rows`` builds the pool, merges and heads (before 2026-12-06 it built them all, an
    hour on the smollm2 tier, and then refused)."""
    from darts_bench.config import load_config
    from darts_bench.export import export_row
    from darts_bench.pipeline import Pipeline

    cfg = load_config("micro", ['merges=[{"name": "ties", "method": "ties", "density": 0.5}, '
                                '{"name": "emr", "method": "emr"}]', "surgery.task_agnostic=[routed]",
                                f"work_dir={tmp_path / 'work'}"])
    pipe = Pipeline(cfg)

    def built(*_a, **_k):
        raise AssertionError("export built the run's artifacts before checking the row")

    monkeypatch.setattr(Pipeline, "all_rows", built)
    with pytest.raises(ValueError, match="export the oracle row 'emr'"):
        export_row(pipe, "emr@routed", tmp_path / "e1")
    with pytest.raises(ValueError, match="export its oracle row ties\\+darts or the ties\\+darts@shared row"):
        export_row(pipe, "ties+darts@routed", tmp_path / "e2")
    with pytest.raises(KeyError, match="no row 'ties\\+dart'.*'ties\\+darts'"):
        export_row(pipe, "ties+dart", tmp_path / "e3")
    assert not (tmp_path / "work").exists() and not any(tmp_path.glob("e*"))

# ------------------------------------------------------------------ the lm_eval.models entry point
# lm-eval's main branch discovers external models through the `lm_eval.models` entry-point group
# (docs/plugins.md): each entry point is recorded as a lazy placeholder under its name (an alias that is
# already registered is skipped) and imported on first lookup, where the module's @register_model upgrades
# the placeholder. The child process below does exactly that with lm-eval's own registry, in a fresh
# interpreter that has not imported darts-bench's adapter, on the metadata an install of this checkout
# writes (entry_points.txt made from pyproject.toml's table, the file pip writes into *.dist-info).
DISCOVER = r"""
import importlib.metadata as md, json, sys
from lm_eval.api.registry import get_model, model_registry
before = "darts_bench.evaluate.lm_eval_adapter" in sys.modules
eps = [ep for ep in md.entry_points(group="lm_eval.models") if ep.name == "darts-bench"]
for ep in eps:
    if ep.name not in model_registry:
        model_registry.register(ep.name, target=ep.value)
cls = get_model("darts-bench")
from lm_eval.api.model import LM
print(json.dumps({"before": before, "values": sorted({ep.value for ep in eps}),
                  "cls": f"{cls.__module__}:{cls.__qualname__}", "lm": issubclass(cls, LM),
                  "same": cls is sys.modules["darts_bench.evaluate.lm_eval_adapter"].DartsBenchLM}))
"""


def test_lm_eval_finds_the_model_through_its_entry_point(tmp_path):
    import subprocess
    import sys
    import tomllib

    pyproject = tomllib.loads((Path(__file__).resolve().parent.parent / "pyproject.toml").read_text())
    group = pyproject["project"]["entry-points"]["lm_eval.models"]
    assert group == {"darts-bench": "darts_bench.evaluate.lm_eval_adapter:DartsBenchLM"}
    dist = tmp_path / "darts_bench_plugin_check-0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: darts-bench-plugin-check\nVersion: 0\n")
    (dist / "entry_points.txt").write_text("[lm_eval.models]\n" + "".join(f"{k} = {v}\n" for k, v in group.items()))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}
    r = subprocess.run([sys.executable, "-c", DISCOVER], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got == {"before": False, "values": ["darts_bench.evaluate.lm_eval_adapter:DartsBenchLM"],
                   "cls": "darts_bench.evaluate.lm_eval_adapter:DartsBenchLM", "lm": True, "same": True}
