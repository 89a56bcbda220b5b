"""`darts-bench run --dry-run`: the plan from the config alone (no model, no hub, no torch)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from darts_bench.config import Config, load_config
from darts_bench.plan import POSITION_BIAS, STAGE_ORDER, make_plan, print_plan


def test_llama2_7b_plan_is_7b_scale():
    plan = make_plan(load_config("llama2-7b"))
    m = plan["model"]
    assert m["architecture"]["hidden_size"] == 4096 and m["dtype"] == "bfloat16"
    assert 6.6e9 < m["params"] < 6.8e9
    assert 13.0e9 < m["weights_bytes"] < 14.0e9  # ~13.5 GB per model in bf16
    assert plan["totals"]["forward_tokens"] > 0
    assert {t: v["n_examples"] for t, v in plan["tasks"].items()} == {"humaneval": 164, "gsm8k": 1319, "alpacaeval": 805}
    st = plan["stages"]
    assert list(st) == list(STAGE_ORDER)
    assert "ZeRO stage 2" in st["train"]["where"] and "8 procs" in st["train"]["where"]
    assert "8 actors" in st["collect"]["where"] and "GPU 1" in st["collect"]["where"]
    assert st["collect"]["memory_bytes"] > m["weights_bytes"]
    assert st["merge"]["disk_bytes"] == pytest.approx(3 * m["weights_bytes"], rel=1e-6)
    # feature cache in the model's dtype (bf16): tokens x d x 2 bytes x 2 (expert + merged) per split
    for c in st["collect"]["calibration"].values():
        assert c["disk_bytes_per_merge"] == c["tokens"] * 4096 * 2 * 2
    # ZeRO 2 over 8 procs shards the Adam state
    darts = st["train"]["head_params"]["darts"]
    assert st["train"]["optimizer_state_bytes_per_proc"] == pytest.approx(darts * 8 / 8)


def test_tiny_plan_is_fast_and_printed(capsys):
    cfg = load_config("tiny")
    plan = print_plan(cfg)
    out = capsys.readouterr().out
    for stage in STAGE_ORDER:
        assert f"\n{stage} " in out and f"[{stage}]" in out
    assert plan["model"]["source"] == "pool.tiny"
    assert plan["model"]["weights_bytes"] == plan["model"]["params"] * 4
    assert plan["rows"] == 1 + 3 + 5 + 5 * 2 * 2
    assert {t: v["n_examples"] for t, v in plan["tasks"].items()} == {t: getattr(cfg.tasks, t).limit for t in ("humaneval", "gsm8k", "alpacaeval")}
    assert plan["totals"]["forward_tokens"] > 0 and plan["stages"]["pool"]["train_tokens"] > 0
    assert "local" in plan["stages"]["train"]["where"]


def test_smollm2_params_match_the_checkpoint():
    plan = make_plan(load_config("smollm2-135m"))
    assert plan["model"]["params"] == 134_515_008  # the dequantized GGUF checkpoint's count (lab notes)


def test_suite_limit_and_local_config_json(tmp_path):
    base = tmp_path / "base"
    base.mkdir()
    (base / "config.json").write_text(json.dumps({
        "hidden_size": 64, "num_hidden_layers": 2, "vocab_size": 1000, "intermediate_size": 128,
        "num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": True}))
    cfg = Config.model_validate({"name": "custom", "pool": {"kind": "hf", "base": str(base), "experts": {
        "code": str(base), "math": "someone/math-7b", "instruction": str(base)}}})
    plan = make_plan(cfg, suite="gsm8k", limit=5)
    assert plan["model"]["source"].endswith("config.json")
    assert plan["model"]["params"] == 1000 * 64 + 2 * (2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128 + 2 * 64) + 64
    assert list(plan["tasks"]) == ["gsm8k"] and plan["tasks"]["gsm8k"]["n_examples"] == 5
    assert "3 local dirs, 1 from the hub" in plan["stages"]["pool"]["what"]
    deep = make_plan(cfg.model_copy(update={"deepspeed": cfg.deepspeed.model_copy(
        update={"enabled": True, "num_procs": 2, "zero_stage": 3})}), suite="gsm8k", limit=5)
    assert "DeepSpeed, 2 procs via torchrun, ZeRO stage 3, gloo" in deep["stages"]["train"]["where"]
    with pytest.raises(ValueError):
        make_plan(cfg, suite="mmlu")


def test_unknown_architecture_still_plans():
    cfg = Config.model_validate({"name": "custom", "pool": {"kind": "hf", "base": "someone/model", "experts": {
        "code": "a/b", "math": "c/d", "instruction": "e/f"}}})
    plan = make_plan(cfg)
    assert plan["model"]["params"] is None and plan["totals"]["forward_tokens"] > 0
    assert any("unknown" in n for n in plan["notes"])


def test_position_bias_table_matches_heads():
    from darts_bench.surgery.heads import METHODS

    assert POSITION_BIAS == {m: v[0] for m, v in METHODS.items()}


def test_cli_dry_run_loads_no_torch():
    code = ("import sys; from darts_bench.cli import main; rc = main(['run', '--dry-run', '--config', 'llama2-7b', "
            "'--suite', 'humaneval', '--limit', '3']); assert rc == 0; assert 'torch' not in sys.modules, 'dry run imported torch'")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert "13.5 GB per model" in res.stdout and "[evaluate]" in res.stdout and "humaneval 3/164" in res.stdout



def test_dry_run_checks_data_and_output_dirs_like_a_run(tmp_path, capsys):
    """``--dry-run`` refuses a data dir that does not exist and an ``--out`` that cannot be written
    (dcca732 printed a plan for both), and creates nothing."""
    from darts_bench.cli import main

    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    assert main(["run", "--dry-run", "--config", "tiny", "--data-dir", str(tmp_path / "no-data")]) == 2
    assert main(["run", "--dry-run", "--config", "tiny", "--out", str(blocker / "out")]) == 2
    assert capsys.readouterr().out == ""  # no plan printed
    out = tmp_path / "new" / "results"
    assert main(["run", "--dry-run", "--config", "tiny", "--out", str(out)]) == 0
    assert not (tmp_path / "new").exists()


def test_dry_run_reports_time_and_gpu_memory():
    plan = make_plan(load_config("llama2-7b"))
    st, t = plan["stages"], plan["totals"]
    assert t["device_hours_unit"] == "GPU-hours" and t["device_hours"] > 1
    for s in ("collect", "train", "evaluate"):
        assert st[s]["seconds"] > 0 and st[s]["gpu_bytes"] > 0 and st[s]["gpu_fits"] is True
    # one actor group per (row, task) under Ray, plus a judge group per row for AlpacaEval
    assert st["evaluate"]["model_loads"] == plan["rows"] * 3 + plan["rows"]
    small_gpu = load_config("llama2-7b", ["ray.gpu_memory_gb=24"])
    flagged = make_plan(small_gpu)
    assert flagged["stages"]["evaluate"]["gpu_fits"] is False
    assert any("evaluate: needs" in n and "24 GB" in n for n in flagged["notes"])
    # the training RAM peak counts the stored-dtype split buffers, not float32 copies of everything
    assert "bfloat16" in st["train"]["memory_note"] and st["train"]["memory_bytes"] < 40e9
