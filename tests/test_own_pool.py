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
