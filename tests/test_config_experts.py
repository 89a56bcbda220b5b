"""Experts by any name and number (issue 28): ``pool.experts``, ``tasks.<task>.expert``, the rows, the merges'
expert lists, the checks' errors, the ``hf`` pool key's expert order, ``pool.architecture`` and the
``mergebench-llama3.2-3b`` preset's offline dry run. No model is built (the end-to-end runs are in
``tests/test_pipeline_llama3_rehearsal.py``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from darts_bench.config import EXPERT_NAMES, KNOWN_ARCHITECTURES, Config, ConfigError, load_config

pytestmark = [pytest.mark.subprocess]  # one test runs the CLI's dry run in a child process

MB = {"instruction": "MergeBench/Llama-3.2-3B_instruction", "math": "MergeBench/Llama-3.2-3B_math",
      "coding": "MergeBench/Llama-3.2-3B_coding"}


def _hf(experts: dict, **extra) -> Config:
    return Config.model_validate({"name": "custom", "pool": {"kind": "hf", "base": "org/base", "experts": experts},
                                  **extra})


def test_hf_pool_takes_any_names_in_order_and_rows_follow():
    five = {**MB, "multilingual": "MergeBench/Llama-3.2-3B_multilingual", "safety": "MergeBench/Llama-3.2-3B_safety"}
    cfg = _hf(five, merges=[{"name": "ta", "method": "task_arithmetic", "weight": 0.3}],
              surgery={"methods": ["darts"]}, tasks={"humaneval": {"expert": "coding"}})
    assert cfg.pool.expert_names == ("instruction", "math", "coding", "multilingual", "safety")
    from darts_bench.rows import row_names

    assert row_names(cfg) == ["base", "expert:instruction", "expert:math", "expert:coding", "expert:multilingual",
                              "expert:safety", "ta", "ta+darts"]
    # built pools keep their three experts
    assert load_config("tiny").pool.expert_names == EXPERT_NAMES == ("code", "math", "instruction")


def test_task_expert_from_config_else_the_task_class():
    from darts_bench.api import get_task

    cfg = _hf(MB, tasks={"humaneval": {"expert": "coding"}})
    assert cfg.tasks.expert("humaneval") == "coding"
    assert cfg.tasks.expert("gsm8k") == "math" and cfg.tasks.expert("alpacaeval") == "instruction"
    task = get_task("humaneval", cfg.tasks.humaneval)
    assert task.expert == "coding" and type(task).expert == "code"  # the class keeps its default (its training data)
    assert get_task("humaneval").expert == "code"
    # not in the section's dump: the expert enters keys through its checkpoint's content key
    assert "expert" not in cfg.tasks.humaneval.model_dump(mode="json")
    assert cfg.tasks.humaneval.model_dump(mode="json") == _hf(MB).tasks.humaneval.model_dump(mode="json")


@pytest.mark.parametrize("name", ["bad/name", "base", "-x", "a b", ""])
def test_invalid_expert_names_are_named(name):
    with pytest.raises(ConfigError, match=r"pool: Value error, pool.experts: invalid expert name\(s\)") as e:
        load_config("llama2-7b", [f"pool.experts={json.dumps({name: 'org/m', 'math': 'org/n'})}"])
    assert repr(name) in str(e.value)


def test_hf_needs_an_expert_and_built_pools_take_none():
    with pytest.raises(ConfigError, match="pool.kind=hf needs pool.experts: at least one expert"):
        load_config("llama2-7b", ["pool.experts={}"])
    with pytest.raises(ConfigError, match=r"pool.experts is read by pool.kind=hf only; the tiny pool builds its own "
                                          r"experts \['code', 'math', 'instruction'\]"):
        load_config("tiny", ["pool.experts.coding=org/m"])


def test_checks_name_a_missing_expert_and_a_one_expert_merge(tmp_path):
    from darts_bench.checks import check_data_merges, check_pool_experts, check_task_experts

    cfg = _hf(MB)  # humaneval's default expert is `code`, which this pool calls `coding`
    with pytest.raises(ValueError, match=r"task humaneval maps to expert 'code', which the pool does not have "
                                         r"\(experts: \['instruction', 'math', 'coding'\]\); set tasks.humaneval.expert"):
        check_task_experts(cfg, ["gsm8k", "humaneval"])
    check_task_experts(_hf(MB, tasks={"humaneval": {"expert": "coding"}}), ["gsm8k", "humaneval", "alpacaeval"])
    with pytest.raises(ValueError, match=r"task gsm8k maps to expert 'algebra'"):
        check_task_experts(_hf(MB, tasks={"gsm8k": {"expert": "algebra"}}), ["gsm8k"])

    one = _hf({"math": "org/m"})
    with pytest.raises(ValueError, match=r"a merge combines two or more experts, but the pool has \['math'\]"):
        check_pool_experts(one)
    check_pool_experts(one.model_copy(update={"evaluate": one.evaluate.model_copy(update={"rows": ["base", "expert:*"]})}))
    check_pool_experts(_hf(MB))

    # regmean needs a task per pool expert, under the pool's names
    rm = _hf(MB, merges=[{"name": "rm", "method": "regmean"}], tasks={"humaneval": {"expert": "coding"}})
    check_data_merges(rm, ["humaneval", "gsm8k", "alpacaeval"])
    with pytest.raises(ValueError, match=r"expert\(s\) \['instruction', 'coding'\] have no task"):
        check_data_merges(rm, ["gsm8k"])


def test_run_stops_before_any_stage_on_a_missing_expert(tmp_path):
    from darts_bench.pipeline import Pipeline

    cfg = _hf(MB, work_dir=str(tmp_path / "w"))
    with pytest.raises(ValueError, match="task humaneval maps to expert 'code'"):
        Pipeline(cfg, suite="humaneval")
    assert not (tmp_path / "w").exists()


def test_mergekit_config_and_hf_pool_key_take_every_expert_in_order(tmp_path):
    from darts_bench.config import MergeSpec
    from darts_bench.merge.mergekit_merge import merge_config_dict
    from darts_bench.pool.build import Pool, hf_pool_key

    experts = {n: tmp_path / n for n in ("instruction", "math", "coding", "safety")}
    pool = Pool(base=tmp_path / "base", experts=experts, key="k")
    cd = merge_config_dict(MergeSpec(name="ta", method="task_arithmetic", weight=0.3), pool)
    assert [m["model"] for m in cd["models"]] == [str(p) for p in experts.values()]
    members = {"base": "b", "code": "c", "math": "m", "instruction": "i"}
    # the legacy names in their order hash as before the order entered the key; any other order or names differ
    from darts_bench.artifacts import stable_hash

    assert hf_pool_key(members, EXPERT_NAMES, "error") == stable_hash({"members": members, "vocab_alignment": "error"})
    assert hf_pool_key(members, ("math", "code", "instruction"), "error") != hf_pool_key(members, EXPERT_NAMES, "error")


def test_pool_architecture_by_name_or_numbers_and_out_of_keys(tmp_path, monkeypatch):
    from darts_bench.plan import make_plan
    from darts_bench.pool.build import pool_config_key

    monkeypatch.setenv("HF_HOME", str(tmp_path / "empty-hf"))  # no cached config.json
    given = {"hidden_size": 64, "num_hidden_layers": 2, "vocab_size": 1000, "intermediate_size": 128,
             "num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": True}
    cfg = _hf({"a": "org/a", "b": "org/b"}, pool={"kind": "hf", "base": "someone/model",
                                                    "experts": {"a": "org/a", "b": "org/b"}, "architecture": given})
    plan = make_plan(cfg, suite="gsm8k", limit=5)
    assert plan["model"]["source"] == "pool.architecture (given in the config)"
    assert plan["model"]["params"] == 1000 * 64 + 2 * (2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128 + 2 * 64) + 64
    assert "2 experts" not in plan["stages"]["pool"]["what"] and "a=org/a, b=org/b" in plan["stages"]["pool"]["what"]
    named = cfg.model_copy(update={"pool": cfg.pool.model_copy(update={"architecture": "llama-3.2-3b"})})
    assert make_plan(named, suite="gsm8k", limit=5)["model"]["architecture"]["vocab_size"] == 128256
    # a config.json at hand wins over the given architecture
    base = tmp_path / "base"
    base.mkdir()
    (base / "config.json").write_text(json.dumps({**given, "hidden_size": 32}))
    local = cfg.model_copy(update={"pool": cfg.pool.model_copy(update={"base": str(base)})})
    assert make_plan(local, suite="gsm8k", limit=5)["model"]["architecture"]["hidden_size"] == 32
    # planner-only: dumped when given (results.json shows it), never in a built pool's key
    assert cfg.pool.model_dump(mode="json")["architecture"]["hidden_size"] == 64
    assert "architecture" not in load_config("tiny").pool.model_dump(mode="json")
    tiny = load_config("tiny", ["pool.architecture=llama-3.2-3b"])
    assert pool_config_key(tiny.pool) == pool_config_key(load_config("tiny").pool)
    with pytest.raises(ConfigError, match=r"pool.architecture: unknown architecture 'llama-9b'"):
        load_config("llama2-7b", ["pool.architecture=llama-9b"])
    with pytest.raises(ConfigError, match="not divisible by num_attention_heads"):
        load_config("llama2-7b", [f"pool.architecture={json.dumps({**given, 'num_attention_heads': 5})}"])


def test_known_llama_3_2_3b_is_its_config_json():
    # meta-llama/Llama-3.2-3B config.json: hidden 3072, 28 layers, 24 / 8 heads, intermediate 8192, tied
    a = KNOWN_ARCHITECTURES["llama-3.2-3b"]
    assert (a["hidden_size"], a["num_hidden_layers"], a["num_attention_heads"], a["num_key_value_heads"],
            a["intermediate_size"], a["vocab_size"], a["tie_word_embeddings"]) == (3072, 28, 24, 8, 8192, 128256, True)
    from darts_bench.plan.architecture import param_count

    assert 3.20e9 < param_count(a)["total"] < 3.22e9  # Llama-3.2-3B: 3.21B parameters


def test_mergebench_preset_names_mergebench_experts_and_protocols():
    cfg = load_config("mergebench-llama3.2-3b")
    assert cfg.pool.base == "meta-llama/Llama-3.2-3B"
    assert dict(cfg.pool.experts) == MB and cfg.pool.expert_names == ("instruction", "math", "coding")
    assert {t: cfg.tasks.expert(t) for t in ("humaneval", "gsm8k", "alpacaeval")} == {
        "humaneval": "coding", "gsm8k": "math", "alpacaeval": "instruction"}
    h, g = cfg.tasks.humaneval, cfg.tasks.gsm8k
    assert (h.protocol, h.n_samples, h.temperature, h.top_p, h.k) == ("mergebench", 10, 0.2, 0.95, [1, 10])
    assert h.sampling_departures() == {}
    assert g.protocol == "gsm8k-cot-8shot"


def test_mergebench_dry_run_plans_every_stage_offline(tmp_path):
    """The issue's done-when: ``run --config mergebench-llama3.2-3b --dry-run`` plans the pool and every
    stage with numbers, with no hub access and nothing of the pool in the hub cache."""
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"}
    env.pop("HF_HUB_CACHE", None)
    code = ("import sys; from darts_bench.cli import main; rc = main(['run', '--dry-run', '--config', "
            f"'mergebench-llama3.2-3b', '--out', {str(tmp_path / 'o')!r}, '--set', 'work_dir={tmp_path / 'w'}']); "
            "assert rc == 0; assert 'torch' not in sys.modules")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env,
                         cwd=Path(__file__).resolve().parent.parent)
    assert res.returncode == 0, res.stderr
    out = res.stdout
    assert "architecture: pool.architecture llama-3.2-3b (known architecture)" in out
    assert "3.2G params, bfloat16, 6.4 GB per model" in out
    assert ("experts instruction=MergeBench/Llama-3.2-3B_instruction, math=MergeBench/Llama-3.2-3B_math, "
            "coding=MergeBench/Llama-3.2-3B_coding (0 local dirs, 4 from the hub)") in out
    rows = {ln.split()[0]: ln.split() for ln in out.splitlines() if ln.split()[:1] and ln.split()[0] in
            ("pool", "merge", "collect", "train", "evaluate")}
    assert set(rows) == {"pool", "merge", "collect", "train", "evaluate"}
    for stage, cells in rows.items():  # a memory figure on every stage, a time on the stages that compute
        assert cells[1] != "-", (stage, cells)
    for stage in ("collect", "train", "evaluate"):
        assert "min" in " ".join(rows[stage]) or " h " in " ".join(rows[stage]), rows[stage]
    assert "19 evaluated rows" in out and "protocols: humaneval mergebench, gsm8k gsm8k-cot-8shot" in out
    assert not (tmp_path / "w").exists() and not (tmp_path / "o").exists()
