"""`darts-bench ls tasks|protocols|configs|annotators|rows` and `darts-bench validate`, in process.

Each listing is checked against the source a run reads (the task registry, the config models'
protocol fields, the packaged config files, alpaca_eval's evaluator configs, ``rows.row_names``),
and ``validate`` against the failures ``run`` raises before any stage.
"""

from __future__ import annotations

import importlib.util
import json
import textwrap
import typing
from fnmatch import fnmatchcase
from pathlib import Path

import pytest

from darts_bench.api import available_tasks, task_class
from darts_bench.cli import main
from darts_bench.config import CONFIG_DIR, load_config
from darts_bench.rows import row_names

from conftest import DATA_DIR

# a task with its own protocol registry, added by folder (README "Adding a benchmark")
LSDEMO = '''
"""lsdemo: a folder task with two protocols, for `darts-bench ls`."""
from typing import Literal

from pydantic import Field

from darts_bench.api import Example, Task, TaskConfig, TaskResult, register_task

PROTOCOLS = {
    "plain": {"version": "3", "source": "the prompt as it is"},
    "shout": {"version": "1", "source": "the prompt in capitals"},
}


class LsDemoConfig(TaskConfig):
    protocol: Literal["plain", "shout"] = Field("plain")


@register_task
class LsDemo(Task):
    name = "lsdemo"
    expert = None
    version = "7"
    primary_metrics = ("lsdemo_em",)
    config_model = LsDemoConfig
    protocol = "plain"

    def examples(self, data_dir, model, limit):
        return [Example(id="lsdemo/0", prompt="Say hi", reference=" hi")][:limit]

    def training_prompts(self, data_dir, model, n, seed):
        raise NotImplementedError("lsdemo has no expert")

    def evaluate(self, model, examples, ctx):
        return TaskResult(metrics={"lsdemo_em": 0.0}, per_example={"em": [0.0] * len(examples)})
'''


def _ls(capsys, *args) -> list[dict]:
    assert main(["ls", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.fixture
def folder_task(tmp_path, monkeypatch) -> Path:
    d = tmp_path / "extra_tasks" / "lsdemo"
    d.mkdir(parents=True)
    (d / "__init__.py").write_text(textwrap.dedent(LSDEMO))
    monkeypatch.setenv("DARTS_BENCH_TASKS_PATH", str(d.parent))
    return d


def test_ls_tasks_lists_a_task_added_by_folder(folder_task, capsys):
    assert main(["ls", "tasks"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["task", "expert", "version", "protocols", "metrics", "folder"]
    by_name = {ln.split()[0]: ln.split() for ln in lines[1:]}
    assert list(by_name) == available_tasks()  # registry order, built-in and added alike
    assert {"humaneval", "gsm8k", "alpacaeval", "lsdemo"} <= set(by_name)
    assert by_name["lsdemo"] == ["lsdemo", "-", "7", "plain,shout", "lsdemo_em", str(folder_task.resolve())]
    he = task_class("humaneval")()
    he.protocol = "codex"  # the config default: the version listed is that protocol's
    assert by_name["humaneval"][:4] == ["humaneval", "code", str(he.version), "codex,instruct,chat,mergebench"]

    protos = _ls(capsys, "protocols", "--task", "lsdemo")
    assert protos == [
        {"task": "lsdemo", "protocol": "plain", "default": "yes", "version": "3", "source": "the prompt as it is"},
        {"task": "lsdemo", "protocol": "shout", "default": "", "version": "1", "source": "the prompt in capitals"}]


def test_ls_tasks_without_the_folder_drops_it(capsys, monkeypatch):
    monkeypatch.delenv("DARTS_BENCH_TASKS_PATH", raising=False)
    assert "lsdemo" not in [t["task"] for t in _ls(capsys, "tasks")]


def test_ls_protocols_are_what_the_config_accepts(capsys):
    """Each built-in task's listed protocols equal the values its `tasks.<task>.protocol` field
    accepts (the Literal of the config model), with the field's default marked."""
    rows = _ls(capsys, "protocols")
    for name in ("humaneval", "gsm8k", "alpacaeval"):
        field = task_class(name).config_model.model_fields["protocol"]
        listed = [r for r in rows if r["task"] == name]
        assert sorted(r["protocol"] for r in listed) == sorted(typing.get_args(field.annotation))
        assert [r["protocol"] for r in listed if r["default"] == "yes"] == [field.default]
        assert all(r["version"] != "-" and r["source"] != "-" for r in listed)


def test_ls_configs_are_the_packaged_files_and_load(capsys):
    rows = _ls(capsys, "configs")
    assert [r["config"] for r in rows] == sorted(p.stem for p in CONFIG_DIR.glob("*.yaml"))
    for r in rows:
        assert load_config(r["config"]).name  # each listed name is a valid --config
        assert r["description"] and r["description"] != "-"
    assert {r["config"]: r["description"] for r in rows}["micro"] == "The CI regression tier"


def test_ls_rows_are_the_configs_rows_with_the_filter(capsys):
    pats = ["base", "ties*"]
    rows = _ls(capsys, "rows", "--config", "micro", "--set", "evaluate.rows=" + json.dumps(pats))
    cfg = load_config("micro")
    assert [r["row"] for r in rows] == row_names(cfg)
    assert [r["row"] for r in rows if r["selected"] == "yes"] == \
        [n for n in row_names(cfg) if any(fnmatchcase(n, p) for p in pats)]
    darts = {r["row"]: r for r in rows}["ties+darts@inductive"]
    assert (darts["merge"], darts["correction"], darts["calibration"]) == ("ties", "darts", "inductive")


def test_ls_options_of_another_listing_are_refused(capsys):
    assert main(["ls", "tasks", "--config", "micro"]) == 2
    assert "apply to `ls rows` only" in capsys.readouterr().err


def test_ls_annotators_are_alpaca_evals_configs_and_say_what_is_missing(capsys, monkeypatch):
    from alpaca_eval import constants

    for v in ("OPENAI_API_KEY", "OPENAI_API_KEYS", "OPENAI_CLIENT_CONFIG_PATH"):
        monkeypatch.delenv(v, raising=False)
    rows = _ls(capsys, "annotators")
    root = Path(constants.EVALUATORS_CONFIG_DIR)
    assert [r["annotator"] for r in rows] == sorted(d.name for d in root.iterdir() if (d / "configs.yaml").is_file())
    gpt4 = {r["annotator"]: r for r in rows}["weighted_alpaca_eval_gpt4_turbo"]
    assert (gpt4["decoder"], gpt4["model"]) == ("openai_completions", "gpt-4-1106-preview")
    assert gpt4["ready"] == "no: set OPENAI_API_KEY or OPENAI_API_KEYS or OPENAI_CLIENT_CONFIG_PATH"
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test")
    assert {r["annotator"]: r for r in _ls(capsys, "annotators")}["weighted_alpaca_eval_gpt4_turbo"]["ready"] == "yes"


@pytest.mark.subprocess  # the sandbox isolation probe (HumanEval runs code) starts bubblewrap / unshare
def test_validate_ok_is_one_line_and_creates_nothing(tmp_path, capsys):
    out, work = tmp_path / "out", tmp_path / "work"
    rc = main(["validate", "--config", "micro", "--data-dir", str(DATA_DIR), "--out", str(out),
               "--set", f"work_dir={work}"])
    res = capsys.readouterr()
    assert rc == 0, res.err
    assert res.out.startswith("OK: config micro: tasks humaneval,gsm8k,alpacaeval; 14 of 14 rows evaluated")
    assert len(res.out.splitlines()) == 1
    assert not out.exists() and not work.exists()


def test_validate_reports_every_failed_check(tmp_path, capsys, monkeypatch):
    for v in ("OPENAI_API_KEY", "OPENAI_API_KEYS", "OPENAI_CLIENT_CONFIG_PATH"):
        monkeypatch.delenv(v, raising=False)
    baseline = tmp_path / "baseline"
    baseline.mkdir()
    (baseline / "BASELINE.md").write_text("committed baseline\n")
    rc = main(["validate", "--config", "micro", "--suite", "gsm8k,alpacaeval", "--data-dir", str(tmp_path / "nodata"),
               "--rows", "base,nope*", "--out", str(baseline), "--set", "evaluate.backend=vllm",
               "--set", "tasks.alpacaeval.judge.annotator=alpaca_eval_gpt4"])
    res = capsys.readouterr()
    assert rc == 2 and res.out == ""
    errors = [ln for ln in res.err.splitlines() if ln.startswith("error: ")]
    assert errors[0].startswith("error: evaluate.rows: ValueError: evaluate.rows: pattern 'nope*' matches no row")
    assert any(e.startswith(f"error: data dir: DataError: data dir {tmp_path / 'nodata'} does not exist")
               for e in errors)
    assert any(e.startswith(f"error: output dir: PermissionError: {baseline} is a committed regression baseline")
               for e in errors)
    assert any(e.startswith("error: tasks.alpacaeval: ValueError: AlpacaEval annotator 'alpaca_eval_gpt4'")
               and "OPENAI_API_KEY" in e for e in errors)
    if importlib.util.find_spec("vllm") is None:
        assert any(e.startswith("error: backends: ImportError: evaluate.backend=vllm: vllm is not installed")
                   for e in errors)
    assert f"validate micro: {len(errors)} check(s) failed" in res.err


def test_validate_a_bad_config_names_the_key(capsys):
    assert main(["validate", "--config", "micro", "--set", "surgery.rnak=2"]) == 2
    assert "surgery.rnak: unknown key (typo?)" in capsys.readouterr().err


def test_validate_names_a_task_mapped_to_an_expert_the_pool_lacks(tmp_path, monkeypatch, capsys):
    """The expert check `run` makes when the pipeline starts (checks.check_task_experts), on a
    folder task whose `expert` is not a pool expert."""
    d = tmp_path / "extra_tasks" / "lsbadexpert"
    d.mkdir(parents=True)
    (d / "__init__.py").write_text(textwrap.dedent(LSDEMO).replace('"lsdemo', '"lsbadexpert')
                                   .replace("expert = None", 'expert = "law"'))
    monkeypatch.setenv("DARTS_BENCH_TASKS_PATH", str(d.parent))
    assert main(["validate", "--config", "micro", "--suite", "lsbadexpert", "--out", str(tmp_path / "o"),
                 "--set", f"work_dir={tmp_path / 'w'}"]) == 2
    err = capsys.readouterr().err
    assert "error: tasks: task lsbadexpert maps to expert 'law', which the pool does not have" in err
    assert "  where: tasks.lsbadexpert.expert" in err and "  fix: set tasks.lsbadexpert.expert to one of" in err


def test_a_stage_alone_makes_no_output_dir_and_an_unusable_one_fails_first(micro_pipeline, micro_cfg_path, tmp_path,
                                                                           capsys):
    """`darts-bench pool` writes nothing to the output dir, so it does not create it (run 12 left an empty
    results/smollm2-135m beside its work dir); a run whose output dir cannot be made fails before any stage."""
    out = tmp_path / "out"
    assert main(["pool", "--config", str(micro_cfg_path), "--out", str(out)]) == 0
    assert not out.exists()
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    rc = main(["run", "--config", str(micro_cfg_path), "--out", str(blocker / "out")])
    err = capsys.readouterr().err
    assert rc != 0
    assert f"output dir {blocker / 'out'} cannot be created: {blocker} is a file" in err


def test_ls_merges_lists_every_method_with_its_source(capsys):
    from typing import get_args

    from darts_bench.config import MergeMethod

    assert main(["ls", "merges", "--json"]) == 0
    items = {r["method"]: r for r in json.loads(capsys.readouterr().out)}
    assert list(items) == [*get_args(MergeMethod), "svc"]
    for m in ("tsv_m", "iso_c", "iso_cts", "svc", "della", "della_linear", "breadcrumbs", "breadcrumbs_ties",
              "model_stock"):
        assert items[m]["paper"] and items[m]["code"] and items[m]["task_label"] == "no"
    assert items["tsv_m"]["paper"].startswith("Gargiulo et al., CVPR 2025") and items["tsv_m"]["kind"] == "svd"
    assert items["iso_cts"]["settings"] == "weight,common_space_fraction,svc_alpha"
    assert items["della"]["settings"] == "weight,density,lambda,epsilon,normalize,svc_alpha"
    assert items["model_stock"]["settings"] == "filter_wise,svc_alpha"
    assert items["svc"]["kind"] == "post-merge" and "2602.05536" in items["svc"]["paper"]
    assert items["regmean"]["calibration_data"] == "prompts" and items["tsv_m"]["calibration_data"] == "none"
