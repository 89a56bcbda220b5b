"""`darts-bench run --dry-run`: the plan from the config alone (no model, no hub, no torch)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from darts_bench.config import Config, load_config
from darts_bench.plan import POSITION_BIAS, STAGE_ORDER, make_plan, print_plan
from darts_bench.plan.units import gb
from conftest import SMOLLM2_2026_12_05  # the smollm2 preset as these tests were written against

pytestmark = [pytest.mark.subprocess]  # tests/README.md: markers


def smollm2(overrides=()):
    """The smollm2-135m preset at :data:`SMOLLM2_2026_12_05`, then ``overrides``."""
    return load_config("smollm2-135m", [*SMOLLM2_2026_12_05, *overrides])


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
    # base, 3 experts, 5 merges, and per merge x 2 splits: surgery, darts, surgery[rank=matched], and
    # surgery and darts @routed and @shared
    assert plan["rows"] == 1 + 3 + 5 + 5 * 2 * (3 + 4)
    assert {t: v["n_examples"] for t, v in plan["tasks"].items()} == {t: getattr(cfg.tasks, t).limit for t in ("humaneval", "gsm8k", "alpacaeval")}
    assert plan["totals"]["forward_tokens"] > 0 and plan["stages"]["pool"]["train_tokens"] > 0
    assert "local" in plan["stages"]["train"]["where"]


def test_smollm2_params_match_the_checkpoint():
    plan = make_plan(smollm2())
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
    # the report line names the --out dir, not the config's default runs/tiny (it did before 2026-12-06)
    assert f"[report] results.json, table.csv, table.md, plots in {out}\n" in capsys.readouterr().out


def test_dry_run_notes_the_rows_run_refuses(capsys):
    """A config ``run`` refuses on its rows (preflight.row_problems: here routed rows with one task of the suite)
    got a plan with no word of it before 2026-12-06; the plan now ends its notes with each refusal and its fix."""
    plan = print_plan(load_config("tiny", ['merges=[{"name": "emr", "method": "emr"}, '
                                           '{"name": "ties", "method": "ties", "density": 0.2}]']), suite="humaneval")
    refused = [n for n in plan["notes"] if n.startswith("run refuses this config: rows: ")]
    assert len(refused) == 2
    assert "task-aware routed row(s) ['emr@routed', 'emr@inductive@routed'] route between" in refused[0]
    assert "task-agnostic row(s) (routed / shared, e.g. ties+surgery@routed)" in refused[1]
    assert "fix: add a task with an expert to --suite" in refused[1]
    assert "\nnote: run refuses this config: rows: " in capsys.readouterr().out
    assert not any(n.startswith("run refuses") for n in print_plan(load_config("tiny"))["notes"])


def test_dry_run_reports_time_and_gpu_memory():
    plan = make_plan(load_config("llama2-7b"))
    st, t = plan["stages"], plan["totals"]
    assert t["device_hours_unit"] == "GPU-hours" and t["device_hours"] > 1
    for s in ("collect", "train", "evaluate"):
        assert st[s]["seconds"] > 0 and st[s]["gpu_bytes"] > 0 and st[s]["gpu_fits"] is True
    # one actor group per model dir under Ray (kept across its rows and tasks; the judge's pinned)
    assert st["evaluate"]["model_loads"] == len(load_config("llama2-7b").merges) + 4
    small_gpu = load_config("llama2-7b", ["ray.gpu_memory_gb=24"])
    flagged = make_plan(small_gpu)
    assert flagged["stages"]["evaluate"]["gpu_fits"] is False
    assert any("evaluate: needs" in n and "24 GB" in n for n in flagged["notes"])
    # the training RAM peak counts the stored-dtype split buffers, not float32 copies of everything
    assert "bfloat16" in st["train"]["memory_note"] and st["train"]["memory_bytes"] < 40e9


def test_hub_id_architecture_comes_from_the_cached_config(tmp_path, monkeypatch):
    """A hub id whose snapshot is in the local hub cache is planned from its ``config.json``
    (dbd6029 took Llama-2-7B's known architecture for any id containing 'llama-2-7b', so the
    7B-shaped rehearsal pool was planned at 13.5 GB per model); an id not in the cache still falls
    back to the table."""
    from darts_bench.plan import param_count
    from darts_bench.pool.rehearsal import REPO_IDS, layout_hub_cache

    arch = {"hidden_size": 48, "num_hidden_layers": 2, "vocab_size": 768, "intermediate_size": 96,
            "num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": False,
            "max_position_embeddings": 4096}
    snap = tmp_path / "snap"
    snap.mkdir()
    (snap / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], **arch}))
    _, rev = layout_hub_cache(snap, tmp_path / "hf" / "hub", REPO_IDS["base"])
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    plan = make_plan(load_config("llama2-7b-rehearsal"), "gsm8k")
    # 2 x 768 x 48 (untied) + 2 layers x (2 x 48^2 + 2 x 48 x 24 + 3 x 48 x 96 + 2 x 48) + 48
    assert param_count(arch)["total"] == 73728 + 2 * (4608 + 2304 + 13824 + 96) + 48 == 115440
    assert plan["model"]["params"] == 115440 and plan["model"]["weights_bytes"] == 2 * 115440
    assert plan["model"]["source"].endswith(f"snapshots/{rev}/config.json")
    pinned = make_plan(load_config("llama2-7b-rehearsal", [f"pool.base={REPO_IDS['base']}@{rev}"]), "gsm8k")
    assert pinned["model"]["params"] == 115440
    missing = make_plan(load_config("llama2-7b-rehearsal", ["pool.base=darts-rehearsal/Llama-2-7b-chat"]), "gsm8k")
    assert missing["model"]["params"] == 6738415616 and "known architecture" in missing["model"]["source"]


# ------------------------------------------------------------------------------ vLLM engine memory
SMOL_PARAMS = 134_515_008  # SmolLM2-135M (test_smollm2_params_match_the_checkpoint)
LLAMA7B_PARAMS = 6_738_415_616
GIB = 2**30


def test_vllm_engine_memory_on_cpu_is_weights_kv_and_overhead():
    """``evaluate.backend: vllm`` on CPU: per evaluation process the engine's weights in the engine
    dtype + ``kv_cache_gb`` GiB + the fixed engine overhead, instead of the HF model; numbers by hand."""
    from darts_bench.plan.resources import PROCESS_BASELINE, VLLM_ENGINE_OVERHEAD

    # the overhead is the LAB-NOTES measurement (3.4 GB, SmolLM2-135M fp32, kv_cache_gb 2) less weights and KV
    assert VLLM_ENGINE_OVERHEAD == 3.4e9 - 538_060_032 - 2_147_483_648 == 714_456_320
    # the engine's own scoring (the preset scores on an HF copy beside it: +weights, below)
    cfg = smollm2(["evaluate.backend=vllm", "evaluate.vllm.dtype=float32",
                                       "evaluate.vllm.scoring=engine"])
    e = make_plan(cfg)["stages"]["evaluate"]
    eng = e["vllm_engine"]
    assert eng["weights"] == SMOL_PARAMS * 4 == 538_060_032 and eng["kv"] == 2 * GIB
    # K and V of 30 layers x 3 kv heads x 64 dims in fp32 per token; 2 GiB holds ~46k (LAB-NOTES)
    assert eng["kv_token_bytes"] == 2 * 30 * 192 * 4 == 46080 and eng["kv_tokens"] == 2 * GIB // 46080 == 46603
    assert eng["max_model_len"] == 8193 and eng["fits"] is True and eng["gpu"] is None
    # the local judge's engine (expert:instruction) is kept beside the row's on the CPU: two engines
    assert e["memory_bytes"] == PROCESS_BASELINE["evaluate"] + 2 * 3.4e9 == 7.35e9
    no_judge = make_plan(cfg, "humaneval,gsm8k")["stages"]["evaluate"]
    assert no_judge["memory_bytes"] == PROCESS_BASELINE["evaluate"] + 3.4e9 == 3.95e9
    assert "gpu_bytes" not in e
    # bf16 engine, 4 GiB of KV cache: 0.55 + 0.269 + 4.295 + 0.714 GB
    bf = make_plan(smollm2(["evaluate.backend=vllm", "evaluate.vllm.dtype=bfloat16",
                                                "evaluate.vllm.kv_cache_gb=4", "evaluate.vllm.scoring=engine"])
                   )["stages"]["evaluate"]
    assert bf["memory_bytes"] == 550_000_000 + 2 * (269_030_016 + 4 * GIB + 714_456_320) == 11_106_907_264
    # the HF backend plans the HF model instead (weights x 2 with the judge + KV + prefill)
    hf = make_plan(smollm2())["stages"]["evaluate"]
    assert "vllm_engine" not in hf and hf["memory_bytes"] != e["memory_bytes"]


def test_vllm_engine_starts_and_start_up_time_in_the_plan(capsys):
    """One engine per model dir in row order, the AlpacaEval judge's (expert:instruction) kept
    alive beside it; the start-up (19-26 s measured on 2 idle CPU cores) is in the time."""
    from darts_bench.plan.resources import VLLM_RELOAD_S, VLLM_START_S

    on = ["evaluate.backend=vllm", "evaluate.vllm.dtype=float32", "surgery.task_agnostic=[]", "evaluate.rows=null",
          "evaluate.vllm.scoring=engine"]
    cfg = smollm2([*on, "evaluate.vllm.reload_weights=false"])
    plan = print_plan(cfg)
    out = capsys.readouterr().out
    e = plan["stages"]["evaluate"]
    # base, code, math, 2 merges (adamerging, regmean; their corrected rows share the engine) + the
    # judge's, which also serves the expert:instruction row: 6 (34 when the judge swapped in and out for
    # every row); rows: base, 3 experts, 2 merges x (1 + 2 splits x (surgery, darts, surgery[rank=matched]))
    # (no task-agnostic rows)
    assert plan["rows"] == 4 + 2 * 7 and e["engine_starts"] == e["model_loads"] == 6
    from darts_bench.plan.resources import engine_starts
    from darts_bench.rows import row_specs

    dirs = [s.merge or s.model for s in row_specs(cfg)]
    assert engine_starts(dirs, list(plan["tasks"]), {"alpacaeval": "expert:instruction"}, held=False) == 34
    assert e["load_seconds"] == 6 * (VLLM_START_S["cpu"]["eager"] + 538_060_032 / 1e9)
    # one engine in the driver: the starts add to the wall time; decoding at 1/3 of HF's CPU time
    assert e["wall_seconds"] == pytest.approx(e["seconds"]) and e["wall_seconds"] > e["load_seconds"]
    # like for like: the hf backend's judge also forwards each verdict's whole prompt (not the preset's share_prefix)
    hf = make_plan(smollm2(["surgery.task_agnostic=[]", "evaluate.rows=null",
                                                "evaluate.share_prefix=false"]))["stages"]["evaluate"]
    assert e["seconds"] - e["load_seconds"] < hf["seconds"] - hf["load_seconds"]
    assert "vLLM engine (float32): weights 538.1 MB + KV cache 2 GiB" in out
    assert "6 engine starts in evaluate, 19-26 s per engine measured on 2 idle CPU cores" in out
    # without the judge task: one start per model dir, in row order (base, 3 experts, 2 merges)
    gsm = make_plan(cfg, "gsm8k")["stages"]["evaluate"]
    assert gsm["engine_starts"] == 6
    # calibration generation through vLLM: the engine beside the HF model in collect, one start per expert
    cal = make_plan(smollm2(["calibration.backend=vllm", "evaluate.vllm.dtype=float32"]))
    c, c_hf = cal["stages"]["collect"], make_plan(smollm2())["stages"]["collect"]
    assert c["memory_bytes"] == c_hf["memory_bytes"] + 3.4e9
    assert c["load_seconds"] == c_hf["load_seconds"] + VLLM_START_S["cpu"]["eager"] + 538_060_032 / 1e9 + 2 * (
        VLLM_RELOAD_S + 538_060_032 / 1e9)  # one engine, given the next two experts' weights in place
    assert c["engine_starts"] == 1 and c["engine_reloads"] == 2
    off = make_plan(smollm2(["calibration.backend=vllm", "evaluate.vllm.dtype=float32",
                                                 "evaluate.vllm.reload_weights=false"]))["stages"]["collect"]
    assert off["engine_starts"] == 3 and off["engine_reloads"] == 0
    assert off["load_seconds"] == c_hf["load_seconds"] + 3 * (VLLM_START_S["cpu"]["eager"] + 538_060_032 / 1e9)
    # evaluate.vllm.reload_weights (the default): the row engine starts once and takes each next model dir's
    # weights in place (4: code, math, 2 merges), the judge's own engine starts once
    plan = print_plan(smollm2(on))
    out = capsys.readouterr().out
    r = plan["stages"]["evaluate"]
    assert r["engine_starts"] == r["model_loads"] == 2 and r["engine_reloads"] == 4
    assert r["load_seconds"] == pytest.approx(2 * (VLLM_START_S["cpu"]["eager"] + 538_060_032 / 1e9)
                                              + 4 * (VLLM_RELOAD_S + 538_060_032 / 1e9))
    assert r["seconds"] == pytest.approx(e["seconds"] - e["load_seconds"] + r["load_seconds"])
    assert ("4 checkpoints loaded into a running engine in place (evaluate.vllm.reload_weights: 4 in evaluate, 0 in "
            "collect)") in out


def test_vllm_engine_on_gpu_is_flagged_against_the_declared_gpu_memory():
    """GPU: the engine takes gpu_memory_utilization x ray.gpu_memory_gb per GPU; the plan flags a
    GPU whose budget leaves no KV cache for one max_model_len request after the weights."""
    from darts_bench.plan.resources import VLLM_GPU_RESERVE

    assert VLLM_GPU_RESERVE == 2e9
    w = LLAMA7B_PARAMS * 2  # bf16
    plan = make_plan(load_config("llama2-7b", ["evaluate.backend=vllm"]))
    e = plan["stages"]["evaluate"]
    eng = e["vllm_engine"]
    assert eng["weights"] == w == 13_476_831_232 and eng["kv_token_bytes"] == 2 * 32 * 4096 * 2 == 524_288
    assert e["gpu_bytes"] == 0.9 * 80e9 and e["gpu_fits"] is True
    assert eng["kv"] == 72e9 - w - 2e9 and eng["kv_tokens"] == 56_523_168_768 // 524_288 == 107_809
    small = make_plan(load_config("llama2-7b", ["evaluate.backend=vllm", "ray.gpu_memory_gb=16"]))
    assert small["stages"]["evaluate"]["gpu_fits"] is False
    assert any("the engine will not start" in n and "gpu_memory_utilization or tensor_parallel_size" in n
               for n in small["notes"])
    # two GPUs per engine: half the weights per GPU, 14.4 - 6.74 - 2 GB of KV per GPU
    tp = make_plan(load_config("llama2-7b", ["evaluate.backend=vllm", "ray.gpu_memory_gb=16",
                                             "evaluate.vllm.tensor_parallel_size=2",
                                             "ray.num_gpus_per_actor=2"]))["stages"]["evaluate"]
    assert tp["gpu_fits"] is True and tp["vllm_engine"]["kv"] == 14.4e9 - w / 2 - 2e9
    # CPU: 1 GiB of bf16 KV holds 2048 Llama-2-7B tokens, less than one 4097-token request
    cpu = make_plan(load_config("llama2-7b", ["evaluate.backend=vllm", "device=cpu", "executor=local",
                                              "evaluate.vllm.kv_cache_gb=1"]))
    assert cpu["stages"]["evaluate"]["vllm_engine"]["kv_tokens"] == 2048
    assert any("holds 2048 tokens, less than one 4097-token request" in n for n in cpu["notes"])


def test_vllm_dry_run_needs_no_vllm():
    """``--dry-run`` with ``evaluate.backend=vllm`` plans the engine without vllm (nor torch) imported."""
    code = ("import sys; from darts_bench.cli import main; rc = main(['run', '--dry-run', '--config', 'llama2-7b', "
            "'--set', 'evaluate.backend=vllm']); assert rc == 0; "
            "assert 'torch' not in sys.modules and 'vllm' not in sys.modules, 'dry run imported torch/vllm'")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "vLLM engine (bfloat16, 1 GPU): per GPU gpu_memory_utilization 0.9 x 80 GB = 72.0 GB" in res.stdout
    assert "engine starts in evaluate" in res.stdout


def test_vllm_engines_in_ray_actors_are_planned_per_actor():
    """With the Ray executor each actor holds an engine: the memory per actor is the in-process
    engine's, starts are counted per actor (``ray.num_actors`` per group), the judge's group is held
    beside the row's, and the generation is spread over the actors; in collect, one engine group per
    expert for the calibration continuations."""
    cfg = load_config("llama2-7b", ["evaluate.backend=vllm"])
    actors = make_plan(cfg)["stages"]["evaluate"]
    local = make_plan(load_config("llama2-7b", ["evaluate.backend=vllm", "executor=local",
                                                "evaluate.vllm.reload_weights=false"]))["stages"]["evaluate"]
    assert actors["memory_bytes"] == local["memory_bytes"]
    # groups: base, code, math, 3 merges (their corrected rows share the group) + the judge's (instruction)
    assert actors["model_loads"] == 7 and actors["engine_starts"] == 7 * cfg.ray.num_actors
    # in-process on a GPU two engines cannot share the device: the judge swaps in for every other row
    assert local["model_loads"] == local["engine_starts"] == 2 * (31 - 1)
    # ... and with reload_weights (the default) too: a hub pool's checkpoints are compared at run time (they may
    # differ in config or tokenizer files), so the plan counts starts, an upper bound; Ray actors start a group
    # per model dir either way
    inplace = make_plan(load_config("llama2-7b", ["evaluate.backend=vllm", "executor=local"]))["stages"]["evaluate"]
    assert inplace == local and actors["engine_reloads"] == 0
    assert actors["wall_seconds"] < local["wall_seconds"] / 4
    # the experts' calibration continuations (calibration.backend: vllm): one engine group per expert
    cal = make_plan(load_config("llama2-7b", ["calibration.backend=vllm"]))["stages"]["collect"]
    cal_local = make_plan(load_config("llama2-7b", ["calibration.backend=vllm", "executor=local",
                                                    "evaluate.vllm.reload_weights=false"]))["stages"]["collect"]
    assert cal_local["engine_starts"] > 0 and cal["engine_starts"] == cal_local["engine_starts"] * cfg.ray.num_actors


# ------------------------------------------------------------------------------ Task.plan() contributions
def test_alpacaeval_plan_declares_its_local_judge_and_its_tokens(monkeypatch, tmp_path):
    """AlpacaEval's ``plan()``: one judge call per example and order; a call reads the template (300),
    the instruction (50), the model's output (max_new_tokens) and the reference (350) tokens. In the
    local judge's default ``score`` mode it scores both verdicts (4 tokens each) after the whole prompt:
    two teacher-forced sequences per call, nothing generated, and each row's prompts share the template and
    instruction (both orders) and the reference (reference first) with every other row's: 805 x (2 x 350 +
    350) tokens; in ``generate`` mode it writes judge.max_new_tokens (8). The judge is the local
    expert:instruction."""
    import shutil

    from darts_bench.api import get_task

    task, cfg = get_task("alpacaeval"), load_config("llama2-7b")
    got = task.plan(cfg.tasks.alpacaeval, 805)
    assert got == {"judge": {"label": "local judge expert:instruction", "model": "expert:instruction",
                             "prompt_tokens_per_row": 0, "new_tokens_per_row": 0,
                             "scored_tokens_per_row": 8_861_440, "scored_per_prompt": 2,
                             "shared_tokens_per_row": 845_250},
                   "what": "AlpacaEval judge expert:instruction"}
    assert 805 * 2 * 2 * (300 + 50 + 2048 + 350 + 4) == 8_861_440  # 2048: MergeLM's cap
    plan = make_plan(cfg)
    assert plan["totals"]["judge_tokens"] == 31 * 8_861_440
    assert plan["tasks"]["alpacaeval"]["annotator"] == "local judge expert:instruction"
    # one order: half the calls
    one = task.plan(load_config("llama2-7b", ["tasks.alpacaeval.judge.both_orders=false"]).tasks.alpacaeval, 805)
    assert one["judge"]["scored_tokens_per_row"] == 8_861_440 // 2
    # generate mode (an annotator config of its own): reads the prompt once per call, writes the verdict
    ann = tmp_path / "ann" / "local_judge"
    shutil.copytree(task.annotators_config, ann)
    conf = ann / "configs.yaml"
    assert 'mode: "score"' in conf.read_text()
    conf.write_text(conf.read_text().replace('mode: "score"', 'mode: "generate"'))
    monkeypatch.setattr(type(task), "annotators_config", ann)
    gen = task.plan(cfg.tasks.alpacaeval, 805)["judge"]
    assert gen["prompt_tokens_per_row"] == 805 * 2 * (300 + 50 + 2048 + 350) == 4_424_280
    assert gen["new_tokens_per_row"] == 805 * 2 * 8 and "scored_tokens_per_row" not in gen


def test_named_annotator_judges_outside_the_process():
    """A named alpaca_eval annotator runs one pass outside the evaluating process (as ``evaluate``
    runs it): single-order judge tokens, no judge weights beside the row's model, no local judge time."""
    from darts_bench.api import get_task

    sets = ["tasks.alpacaeval.judge.annotator=alpaca_eval_gpt4"]
    cfg = load_config("micro", sets)
    got = get_task("alpacaeval").plan(cfg.tasks.alpacaeval, 4)
    # micro: alpacaeval max_new_tokens 12
    assert got["judge"] == {"label": "alpaca_eval_gpt4", "model": None,
                            "prompt_tokens_per_row": 4 * (300 + 50 + 12 + 350), "new_tokens_per_row": 4 * 8}
    named, local = make_plan(cfg)["stages"]["evaluate"], make_plan(load_config("micro"))["stages"]["evaluate"]
    # named: one order, read once, 8 tokens written; local (score mode): two orders x two scored verdicts
    assert named["judge_tokens"] == 14 * 4 * (712 + 8) == 40_320
    assert local["judge_tokens"] == 14 * 4 * 2 * 2 * (712 + 4) == 160_384
    assert "weights x 1 +" in named["memory_note"] and "weights x 2 (model + judge)" in local["memory_note"]
    weights = make_plan(cfg)["model"]["weights_bytes"]
    assert local["memory_bytes"] - named["memory_bytes"] == weights
    assert named["seconds"] < local["seconds"]
    assert "AlpacaEval annotator alpaca_eval_gpt4 (alpaca_eval, outside this process)" in named["what"]


def test_humaneval_and_gsm8k_plans():
    from darts_bench.api import get_task

    cfg = load_config("llama2-7b")
    assert get_task("humaneval").plan(cfg.tasks.humaneval, 164) == {"where": "HumanEval in a sandbox, 2 workers"}
    assert get_task("gsm8k").plan(cfg.tasks.gsm8k, 1319) == {}


def test_any_task_can_declare_a_judge(monkeypatch):
    """The planner reads the judge from ``Task.plan()`` alone: a GSM8K with a (made-up) local judge
    gets its tokens, a second model beside the row's and a pinned judge load."""
    from darts_bench.api import task_class

    monkeypatch.setattr(task_class("gsm8k"), "plan", lambda self, config, n: {
        "judge": {"label": "local judge base", "model": "base", "prompt_tokens_per_row": 100 * n,
                  "new_tokens_per_row": 10 * n}})
    cfg = load_config("micro")
    plan = make_plan(cfg, "gsm8k")
    e = plan["stages"]["evaluate"]
    assert e["judge_tokens"] == plan["rows"] * 110 * 4 == 14 * 440
    assert "weights x 2 (model + judge)" in e["memory_note"]
    assert plan["tasks"]["gsm8k"]["annotator"] == "local judge base"
    monkeypatch.undo()
    plain = make_plan(cfg, "gsm8k")["stages"]["evaluate"]
    assert plain["judge_tokens"] == 0 and "weights x 1 +" in plain["memory_note"]
    assert plain["generation_tokens"] == e["generation_tokens"] and plain["seconds"] < e["seconds"]


@pytest.mark.parametrize("bad, match", [
    ({"judge_tokens_per_row": 5}, r"task gsm8k: Task\.plan\(\): unknown key\(s\) \['judge_tokens_per_row'\]"),
    ({"judge": {"label": "j", "model": "base", "prompt_tokens_per_row": 1}}, r"task gsm8k: .*must be a dict with the keys"),
    ({"judge": {"label": "j", "model": "base", "prompt_tokens_per_row": 1, "new_tokens_per_row": 0,
                "scored_tokens_per_row": 2.5}}, r"task gsm8k: .*'scored_tokens_per_row' must be an int >= 0"),
    ({"judge": {"label": "j", "model": "base", "prompt_tokens_per_row": -1, "new_tokens_per_row": 0}},
     r"task gsm8k: .*'prompt_tokens_per_row' must be an int >= 0"),
    (["where"], r"task gsm8k: Task\.plan\(\) returned list"),
    ({"what": 3}, r"task gsm8k: .*'what' must be a str"),
    ({"judge": None}, r"task gsm8k: .*'judge' must be a dict"),
])
def test_task_plan_outside_the_contract_fails_naming_the_task(monkeypatch, bad, match):
    from darts_bench.api import task_class

    monkeypatch.setattr(task_class("gsm8k"), "plan", lambda self, config, n: bad)
    with pytest.raises(ValueError, match=match):
        make_plan(load_config("micro"), "gsm8k")


def test_evaluate_loads_count_the_selected_rows_and_the_judge():
    """``evaluate.rows``: one load per model dir among the evaluated rows, plus the local judge's
    (expert:instruction is loaded for AlpacaEval even when its row is not evaluated)."""
    cfg = load_config("tiny", ["evaluate.rows=[base,expert:code]"])
    assert make_plan(cfg)["stages"]["evaluate"]["model_loads"] == 3
    assert make_plan(cfg, "humaneval,gsm8k")["stages"]["evaluate"]["model_loads"] == 2
    assert make_plan(load_config("tiny"))["stages"]["evaluate"]["model_loads"] == 1 + 3 + 5


def test_planner_code_names_no_task():
    """No task name in the planner's code (docstrings and comments aside): per-task costs come from
    the registry (``Task.plan()``, ``typical_tokens``, ``official_size``, ``expert``)."""
    import ast
    from pathlib import Path

    import darts_bench.plan
    from darts_bench.api import available_tasks

    names = available_tasks()
    files = sorted(Path(darts_bench.plan.__file__).parent.glob("*.py"))
    assert {f.name for f in files} >= {"__init__.py", "stages.py", "resources.py", "measure.py"}
    for f in files:
        tree = ast.parse(f.read_text())
        docs = {id(n.body[0].value) for n in ast.walk(tree)
                if isinstance(n, (ast.Module, ast.FunctionDef, ast.ClassDef)) and n.body
                and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
        words = [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)
                 and id(n) not in docs]
        words += [n.id for n in ast.walk(tree) if isinstance(n, ast.Name)]
        words += [n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)]
        hits = [(w, t) for w in words for t in names if t in w.lower()]
        assert not hits, (f.name, hits)


def test_old_planner_modules_are_gone():
    """``darts_bench.plan_resources`` and ``darts_bench.measure`` moved into ``darts_bench/plan/``."""
    from pathlib import Path

    import darts_bench

    pkg = Path(darts_bench.__file__).parent
    assert (pkg / "plan" / "measure.py").is_file()
    assert not (pkg / "plan.py").exists() and not (pkg / "plan_resources.py").exists()
    assert not (pkg / "measure.py").exists()


def test_evaluate_counts_engine_passes_per_model_dir_with_one_pass():
    """``evaluate.one_pass`` on the in-process HF backend: one engine pass per (model dir, task),
    the reference NLL's transformer tokens once per model dir; row by row: one pass per (row, task);
    the Ray layout (llama2-7b) serves a merge's heads on its actors in one pass too."""
    # without the task-agnostic rows (a routed row's prompt-state forward is counted per row: test below)
    one = make_plan(smollm2(["surgery.task_agnostic=[]", "evaluate.rows=null"]))
    rbr = make_plan(smollm2(["evaluate.one_pass=false", "surgery.task_agnostic=[]", "evaluate.rows=null"]))
    e1, e0 = one["stages"]["evaluate"], rbr["stages"]["evaluate"]
    # 18 rows: base, 3 experts, 2 merges, 12 corrected (Surgery, DARTS, matched control x 2 splits per merge)
    assert one["rows"] == 18 and e1["one_pass"] and not e0["one_pass"]
    assert e1["engine_passes"] == 6 * 3 and e0["engine_passes"] == 18 * 3
    assert "6 model dirs x 3 tasks = 18 engine passes for 54 row x task evaluations" in e1["what"]
    assert e1["generation_tokens"] == e0["generation_tokens"]
    assert e1["nll_tokens"] * 18 == e0["nll_tokens"] * 6
    assert e1["seconds"] < e0["seconds"]
    ray = make_plan(load_config("llama2-7b"))["stages"]["evaluate"]  # executor ray: each actor's multi-head model
    assert ray["one_pass"] and ray["engine_passes"] == 7 * 3


def test_engine_passes_per_merge_for_each_layout():
    """The llama2-7b dry run counts engine passes per merge for every layout: one pass per model dir,
    7 x 3 = 21, a merge's 9 rows in 3, in the Ray layout (each actor's multi-head model:
    ``RayMultiHeadModel``) as in-process, on HF and vLLM; row by row (``evaluate.one_pass: false``)
    31 rows x 3 tasks = 93, a merge's rows in 27. vLLM one pass: every row's requests in one call per
    (model dir, task) but the reference NLL still once per row (prompt_logprobs), so its NLL tokens
    equal row by row's while HF's are per model dir."""
    def ev(*sets):
        return make_plan(load_config("llama2-7b", list(sets)))["stages"]["evaluate"]

    for backend in ("hf", "vllm"):
        ray = ev(f"evaluate.backend={backend}")
        assert (ray["one_pass_layout"], ray["engine_passes"], ray["engine_passes_per_merge"]) == (backend, 21, 3)
        assert (f"one pass per model dir ({backend}: 7 model dirs x 3 tasks = 21 engine passes for 93 row x task "
                "evaluations; a merge's 9 rows in 3)") in ray["what"]
        local = ev(f"evaluate.backend={backend}", "executor=local")
        assert (local["one_pass_layout"], local["engine_passes"], local["engine_passes_per_merge"]) == (backend, 21, 3)
        assert (f"one pass per model dir ({backend}: 7 model dirs x 3 tasks = 21 engine passes for 93 row x task "
                "evaluations; a merge's 9 rows in 3)") in local["what"]
        off = ev(f"evaluate.backend={backend}", "executor=local", "evaluate.one_pass=false")
        assert (off["one_pass_layout"], off["engine_passes"], off["engine_passes_per_merge"]) == (None, 93, 27)
        assert "row by row (evaluate.one_pass: false: 93 engine passes" in off["what"]
        assert local["generation_tokens"] == off["generation_tokens"] == ray["generation_tokens"]
        assert ray["nll_tokens"] == local["nll_tokens"]
        if backend == "vllm":
            assert local["nll_tokens"] == off["nll_tokens"]
        else:
            assert local["nll_tokens"] * 31 == off["nll_tokens"] * 7
        assert local["seconds"] <= off["seconds"]


def test_vllm_one_pass_fills_decoding_steps_from_every_row():
    """With fewer examples than ``max_num_seqs``, a row-by-row vLLM call cannot fill a decoding step;
    one pass per model dir holds all of a merge's rows' requests, so its generation estimate is lower.
    ``requests`` caps the step batch at what one call holds."""
    from darts_bench.plan.resources import vllm_generation_seconds

    cfg = load_config("llama2-7b", ["evaluate.backend=vllm"])
    e = {"weights": 13.5e9, "tp": 1}
    full = vllm_generation_seconds(0, 32 * 256, 6.7e9, "cuda", cfg, e)
    assert vllm_generation_seconds(0, 32 * 256, 6.7e9, "cuda", cfg, e, requests=64) == full
    assert vllm_generation_seconds(0, 32 * 256, 6.7e9, "cuda", cfg, e, requests=8) == pytest.approx(4 * full)
    sets = ["evaluate.backend=vllm", "executor=local", "tasks.gsm8k.limit=8", "tasks.humaneval.limit=8",
            "tasks.alpacaeval.limit=8"]
    one = make_plan(load_config("llama2-7b", sets))["stages"]["evaluate"]
    rbr = make_plan(load_config("llama2-7b", [*sets, "evaluate.one_pass=false"]))["stages"]["evaluate"]
    assert one["seconds"] < rbr["seconds"]


def test_vllm_hf_scoring_counts_one_forward_per_model_dir_and_the_copy():
    """``evaluate.vllm.scoring: hf``: the reference NLL counted as the HF one pass counts it (one
    transformer forward per model dir, a further head its ``lm_head``: the hf backend's token count)
    instead of a ``prompt_logprobs`` forward per row; the HF copy's weights beside each engine and one checkpoint
    load per engine start (the hf backend's load time), and on the CPU the judge, which only scores, on a copy of
    its own without an engine (``CopyScoredModel``: one engine's memory less, its copy loaded once);
    the stage cheaper; ``engine``, the default (not the smollm2 preset's: ``shared``), plans exactly what it
    planned before."""
    sets = ["evaluate.backend=vllm", "evaluate.vllm.dtype=float32", "evaluate.vllm.reload_weights=false"]
    plan_e = make_plan(smollm2([*sets, "evaluate.vllm.scoring=engine"]))
    e = plan_e["stages"]["evaluate"]
    h = make_plan(smollm2([*sets, "evaluate.vllm.scoring=hf"]))["stages"]["evaluate"]
    hf = make_plan(smollm2())["stages"]["evaluate"]
    W = plan_e["model"]["weights_bytes"]
    ram = e["vllm_engine"]["ram"]  # the judge's engine beside the rows' (scoring: engine and heads only)
    assert h["memory_bytes"] == e["memory_bytes"] - ram + 2 * W and "HF scorer's weights" in h["memory_note"]
    assert "judge's engine" in e["memory_note"] and "judge's engine" not in h["memory_note"]
    assert h["nll_tokens"] == hf["nll_tokens"] == 86_400 and e["nll_tokens"] == 291_600
    assert h["judge_tokens"] == e["judge_tokens"] and h["engine_starts"] == e["engine_starts"] == 6
    # 6 engine starts either way (engine: 5 row dirs + the judge's pinned one serving its own row; hf: the 6 row
    # dirs, the judge engine-less), each with its copy, and the judge's own copy
    assert h["load_seconds"] == pytest.approx(e["load_seconds"] + 7 * hf["load_seconds"] / hf["model_loads"])
    assert h["seconds"] < 0.75 * e["seconds"]
    assert make_plan(load_config("tiny", sets))["stages"]["evaluate"] == \
        make_plan(load_config("tiny", [*sets, "evaluate.vllm.scoring=engine"]))["stages"]["evaluate"]
    # heads: the 4 plain rows of the pool (base, 3 experts) on the engine, each merge's rows (its plain row with its
    # heads) from one HF forward (6 model dirs' worth of reference tokens, as hf), one copy beside the rows' engine
    # (never the judge's), loaded once per merge; the judge on the engine
    k = make_plan(smollm2([*sets, "evaluate.vllm.scoring=heads"]))["stages"]["evaluate"]
    # per row 11,400 reference tokens (291,600 = 24 rows x 11,400 + 18,000 routed prompt states); hf: 6 model dirs
    assert (e["nll_tokens"] - h["nll_tokens"]) == (24 - 6) * 11_400
    assert k["nll_tokens"] == (4 + 2) * 11_400 + 18_000 == 86_400
    assert k["memory_bytes"] == e["memory_bytes"] + W
    assert k["load_seconds"] == pytest.approx(e["load_seconds"] + 2 * hf["load_seconds"] / hf["model_loads"])
    assert h["seconds"] < k["seconds"] < e["seconds"]
    # shared: as heads, and the judge's two verdicts per prompt from a copy (on the CPU engine-less), each prompt
    # forwarded once at the forward rate (the judge's scored tokens / 2), and with the preset's prefix cache
    # (evaluate.vllm.prefix_cache_mib) the 10 x (2 x 350 + 350) tokens every row's prompts share once for the
    # stage, not once for each of the 24 rows; a second copy, loaded once
    from darts_bench.plan.resources import forward_seconds

    sh = make_plan(smollm2([*sets, "evaluate.vllm.scoring=shared"]))
    r = sh["stages"]["evaluate"]
    assert make_plan(smollm2(sets))["stages"]["evaluate"] == r  # the preset's setting
    assert (r["nll_tokens"], r["judge_tokens"]) == (k["nll_tokens"], k["judge_tokens"])
    assert r["memory_bytes"] == e["memory_bytes"] - ram + 2 * W
    assert r["load_seconds"] == pytest.approx(e["load_seconds"] + 3 * hf["load_seconds"] / hf["model_loads"])
    P, kind = sh["model"]["params"], "cpu"
    judged = e["judge_tokens"]  # all scored: the judge's default score mode generates nothing
    assert (r["seconds"] - r["load_seconds"]) - (k["seconds"] - k["load_seconds"]) == pytest.approx(
        forward_seconds(judged / 2 - (24 - 1) * 10_500, P, kind) - forward_seconds(judged, P, kind, rate="logits"))
    assert r["seconds"] < k["seconds"]


def test_vllm_heads_scoring_plans_a_merge_judge_without_an_engine():
    """``evaluate.vllm.scoring: heads`` with a merge (or a merge's row) as the AlpacaEval judge: every score it asks
    for is the copy's (``vllm.scoring_mode``: ``hf`` for a merge), so on the CPU it starts no engine
    (``vllm.judge_on_copy``: ``CopyScoredModel``): one engine's memory less and a copy of its own more, its load
    counted once, its scored sequences at the forward rate, each verdict forwarded (no shared prefix under heads);
    the rows, their reference NLL and every count but the judge's engine as with an expert as the judge."""
    from darts_bench.plan.resources import forward_seconds

    sets = ["evaluate.backend=vllm", "evaluate.vllm.dtype=float32", "evaluate.vllm.reload_weights=false",
            "evaluate.vllm.scoring=heads"]
    plan_x = make_plan(smollm2(sets))
    x = plan_x["stages"]["evaluate"]
    W, P = plan_x["model"]["weights_bytes"], plan_x["model"]["params"]
    ram, load = x["vllm_engine"]["ram"], x["load_seconds"]
    hf = make_plan(smollm2())["stages"]["evaluate"]
    one_load = hf["load_seconds"] / hf["model_loads"]  # one checkpoint read
    for judge in ("adamerging", "adamerging+darts"):
        m = make_plan(smollm2([*sets, f"tasks.alpacaeval.judge.model={judge}"]))
        m = m["stages"]["evaluate"]
        assert "judge's engine" in x["memory_note"] and "judge's engine" not in m["memory_note"], judge
        assert m["memory_bytes"] == x["memory_bytes"] - ram + W, judge
        assert (m["nll_tokens"], m["judge_tokens"]) == (x["nll_tokens"], x["judge_tokens"]), judge
        judged = x["judge_tokens"]  # all scored: the judge's default score mode generates nothing
        # the judge's scored tokens at the forward rate (the copy) instead of the logits rate (the engine)
        assert (m["seconds"] - m["load_seconds"]) - (x["seconds"] - x["load_seconds"]) == pytest.approx(
            forward_seconds(judged, P, "cpu") - forward_seconds(judged, P, "cpu", rate="logits")), judge
        # the same engine starts (expert:instruction's pinned engine served its own row; now the rows' engine does),
        # and the judge's copy loaded once
        assert m["engine_starts"] == x["engine_starts"] == 6, judge
        assert m["load_seconds"] == pytest.approx(load + one_load), judge
        assert m["seconds"] < x["seconds"], judge
    # with Ray the judge keeps its engine group (the same starts, loads and memory), its verdicts still on the copy
    # (its engine's): only their rate changes
    ray = [*sets, "executor=ray"]
    plan_r = make_plan(smollm2(ray))
    r = plan_r["stages"]["evaluate"]
    mr = make_plan(smollm2([*ray, "tasks.alpacaeval.judge.model=adamerging"]))["stages"]["evaluate"]
    assert (mr["engine_starts"], mr["load_seconds"], mr["memory_bytes"]) == \
        (r["engine_starts"], r["load_seconds"], r["memory_bytes"])
    judged = r["judge_tokens"]
    assert (mr["seconds"] - mr["load_seconds"]) - (r["seconds"] - r["load_seconds"]) == pytest.approx(
        forward_seconds(judged, P, "cpu") - forward_seconds(judged, P, "cpu", rate="logits"))


def test_hf_share_prefix_counts_each_judge_prompt_once():
    """``evaluate.share_prefix`` on the hf backend: the AlpacaEval judge's scored sequences forwarded once per
    prompt for its two verdicts (``scored_per_prompt``), nothing else of the stage changes; the vLLM backend
    ignores it (its counterpart is ``evaluate.vllm.scoring: shared``)."""
    from darts_bench.plan.resources import forward_seconds

    off = make_plan(smollm2(["evaluate.share_prefix=false"]))
    # the preset's setting, without its prefix cache (test_the_judge_prefix_cache_forwards_the_shared_prompt_tokens_once)
    b = make_plan(smollm2(["evaluate.prefix_cache_mib=0"]))["stages"]["evaluate"]
    a = off["stages"]["evaluate"]
    judged = a["judge_tokens"]  # all scored: the judge's default score mode generates nothing
    timed = ("seconds", "wall_seconds", "device_hours")
    assert judged > 0 and {k: v for k, v in a.items() if k not in timed} == {k: v for k, v in b.items() if k not in timed}
    assert b["seconds"] - a["seconds"] == pytest.approx(
        forward_seconds(judged / 2, off["model"]["params"], "cpu") - forward_seconds(judged, off["model"]["params"], "cpu"))
    sets = ["evaluate.backend=vllm", "evaluate.vllm.dtype=float32"]
    assert make_plan(smollm2([*sets, "evaluate.share_prefix=false"]))["stages"]["evaluate"] == \
        make_plan(smollm2(sets))["stages"]["evaluate"]


def test_merge_memory_counts_mergekit_output_shard():
    """The merge stage holds one output shard (``out_shard_bytes``, what ``run_one_merge`` gives mergekit)
    beside the tensors in flight: an eighth of a 7B bf16 merge, 64 MiB of a SmolLM2-135M fp32 one (an eighth of it
    is 64.1 MiB), all of a merge below 64 MiB. The cap is mergekit's own default."""
    from mergekit.options import MergeOptions

    from darts_bench.config import MERGEKIT_OUT_SHARD_BYTES, out_shard_bytes

    assert MergeOptions().out_shard_size == MERGEKIT_OUT_SHARD_BYTES
    big = make_plan(load_config("llama2-7b"))
    w = big["model"]["weights_bytes"]
    assert f"one output shard {gb(-(-w // 8))}" in big["stages"]["merge"]["memory_note"]
    # the smollm2-135m tier with one mergekit merge (its preset has the data merges only, which write no mergekit shard)
    small = make_plan(smollm2(["merges=[{name: task_arithmetic, method: task_arithmetic, weight: 0.3}]"]))
    w = small["model"]["weights_bytes"]
    assert f"one output shard {gb(out_shard_bytes(w))}" in small["stages"]["merge"]["memory_note"]
    assert out_shard_bytes(w) == -(-w // 8)
    micro = make_plan(load_config("micro", ["merges=[{name: ties, method: ties, weight: 1.0, density: 0.5}]"]))
    w = micro["model"]["weights_bytes"]
    assert w < 64 * 2**20 and f"one output shard {gb(w)}" in micro["stages"]["merge"]["memory_note"]


def test_plan_counts_task_agnostic_rows_shared_heads_and_routing_forwards():
    off = make_plan(load_config("tiny", ["surgery.task_agnostic=[]"]))
    on = make_plan(load_config("tiny", ["surgery.task_agnostic=[routed,shared]"]))
    # per merge x split: surgery and darts, each @routed and @shared (the control gets none)
    assert on["rows"] == off["rows"] + 5 * 2 * 2 * 2
    tr_on, tr_off = on["stages"]["train"], off["stages"]["train"]
    assert (tr_on["shared_heads"], tr_off["shared_heads"]) == (5 * 2 * 2, 0)
    assert tr_on["steps"] > tr_off["steps"] and "20 shared heads" in tr_on["what"] and "10 routers" in tr_on["what"]
    ev_on, ev_off = on["stages"]["evaluate"], off["stages"]["evaluate"]
    # each routed row forwards its merge over every evaluated prompt once to route it
    cfg = load_config("tiny")
    prompts = sum(v["n_examples"] * v["prompt_tokens_est"] for v in on["tasks"].values())
    per_row = sum(v["n_examples"] * (v["prompt_tokens_est"] + v["reference_tokens_est"]) for v in on["tasks"].values())
    assert cfg.evaluate.one_pass  # one pass: the shared rows generate, the routed rows reuse their oracle's chunks
    assert ev_on["nll_tokens"] - ev_off["nll_tokens"] == 5 * 2 * 2 * prompts
    per_gen = sum(v["n_examples"] * v["n_samples"] * (v["prompt_tokens_est"] + v["max_new_tokens"])
                  for v in on["tasks"].values())
    assert ev_on["generation_tokens"] - ev_off["generation_tokens"] == 5 * 2 * 2 * per_gen
    rbr = make_plan(load_config("tiny", ["surgery.task_agnostic=[routed,shared]", "evaluate.one_pass=false"]))
    rbr_off = make_plan(load_config("tiny", ["surgery.task_agnostic=[]", "evaluate.one_pass=false"]))
    assert rbr["stages"]["evaluate"]["generation_tokens"] - rbr_off["stages"]["evaluate"]["generation_tokens"] \
        == 2 * 5 * 2 * 2 * per_gen
    assert rbr["stages"]["evaluate"]["nll_tokens"] - rbr_off["stages"]["evaluate"]["nll_tokens"] \
        == 5 * 2 * 2 * prompts + 2 * 5 * 2 * 2 * per_row


def _transductive_prompt_tokens(plan, cfg):
    """Prompts and prompt tokens of the transductive calibration sets (what a data merge reads)."""
    cal = plan["stages"]["collect"]["calibration"]
    n = sum(cal[f"{t}/transductive"]["sequences"] for t, ti in plan["tasks"].items() if ti["expert"])
    toks = sum(cal[f"{t}/transductive"]["sequences"] * min(ti["prompt_tokens_est"], cfg.calibration.max_prompt_tokens)
               for t, ti in plan["tasks"].items() if ti["expert"])
    return n, toks


def test_merge_line_grows_with_adamerging_steps():
    """AdaMerging's time (seconds) grows by one Adam step per step: a forward + backward of the merged
    model over one batch of prompts (6 P FLOPs per token at the training rate) and the recombination of
    the K task vectors with its backward (K x P elements, x RECOMBINE_BACKWARD); the fixed part is the
    two entropy passes (a forward per batch, one recombination per pass), the final weights' recombination
    and reading 1 + K models, writing one."""
    from darts_bench.plan.resources import LOAD_BYTES_PER_S, RECOMBINE_BACKWARD, THROUGHPUT

    def merge(steps):
        return make_plan(smollm2([
            f"merges=[{{name: ada, method: adamerging, steps: {steps}, batch_size: 4}}]"]))
    p30, p60 = merge(30), merge(60)
    from darts_bench.plan.architecture import DTYPE_BYTES

    cfg, t = smollm2(), THROUGHPUT["cpu"]
    out_b = DTYPE_BYTES[smollm2(["merges=[{name: ada, method: adamerging}]"]).merges[0].dtype]
    P, K = p30["model"]["params"], len(cfg.pool.expert_names)
    n_prompts, total = _transductive_prompt_tokens(p30, cfg)
    step = 4 * total / n_prompts * 6 * P / t["train"] + RECOMBINE_BACKWARD * K * P / t["recombine"]
    m30, m60 = p30["stages"]["merge"], p60["stages"]["merge"]
    assert m60["seconds"] - m30["seconds"] == pytest.approx(30 * step)
    fixed = (2 * total * 2 * P / t["forward"] + 3 * K * P / t["recombine"]
             + ((1 + K) * P * 4 + P * out_b) / LOAD_BYTES_PER_S)
    assert m30["seconds"] == pytest.approx(fixed + 30 * step)
    assert m30["data_merge_seconds"] == {"ada": m30["seconds"]} and m30["wall_seconds"] == m30["seconds"]
    assert "30 Adam steps of 4 prompts" in m30["what"] and "recombination of 3 task vectors" in m30["what"]
    # the recombination, not the forwards, is most of a SmolLM2 step on the CPU (measured: 1.0 s per
    # recombination, results/smollm2-135m/TIMINGS.md)
    assert RECOMBINE_BACKWARD * K * P / t["recombine"] > 4 * total / n_prompts * 6 * P / t["train"]


def test_merge_line_counts_regmean_forwards_and_fp64_work():
    """RegMean's time (seconds): each expert's forward over its task's prompts (2 P FLOPs per token),
    the fp64 Grams of the linear layers' distinct inputs (2 d_in^2 per token and input: per layer the
    attention input q / k / v share, o's, the MLP input gate / up share, down's), K + 1 ``G W^T``-sized
    products (each expert's, and the solve's substitutions) and one LU per layer, and the model reads."""
    from darts_bench.plan.resources import LOAD_BYTES_PER_S, THROUGHPUT

    from darts_bench.plan.architecture import DTYPE_BYTES

    rm_cfg = smollm2(["merges=[{name: rm, method: regmean, alpha: 0.9}]"])
    plan = make_plan(rm_cfg)
    cfg, t, out_b = smollm2(), THROUGHPUT["cpu"], DTYPE_BYTES[rm_cfg.merges[0].dtype]
    a, P, K = plan["model"]["architecture"], plan["model"]["params"], 3
    h, f, L, kv = a["hidden_size"], a["intermediate_size"], a["num_hidden_layers"], 192  # SmolLM2: 3 KV heads x 64
    assert a["tie_word_embeddings"]  # no output layer to solve
    _, total = _transductive_prompt_tokens(plan, cfg)
    gram = total * 2 * L * (3 * h * h + f * f)
    gw = L * 2 * (h * h * (2 * h + 2 * kv + 2 * f) + f * f * h)
    lu = L * 2 / 3 * (6 * h ** 3 + f ** 3)
    m = plan["stages"]["merge"]
    assert m["data_merge_flops"]["rm"] == pytest.approx(total * 2 * P + gram + (K + 1) * gw + lu)
    assert m["seconds"] == pytest.approx(total * 2 * P / t["forward"] + (gram + (K + 1) * gw + lu) / t["fp64"]
                                         + ((1 + K) * P * 4 + P * out_b) / LOAD_BYTES_PER_S)
    # an untied output layer is a linear layer RegMean solves too: the 7B-shaped plan counts it
    from darts_bench.plan.stages import _linear_inputs
    llama = make_plan(load_config("llama2-7b"))["model"]["architecture"]
    assert _linear_inputs(llama)[-1] == (4096, 32000) and len(_linear_inputs(llama)) == 7 * 32 + 1


def test_train_line_counts_the_diagnostics():
    """The train stage's time counts the diagnostics as lm_head matmuls ([d] x [d, V], 2 d V FLOPs per token)
    at the vocabulary rate and passes over the vocabulary (V elements per token) at the pass rate, one
    pass per (merge, task, split, seed) over its held-out tokens and one per (merge, task, split) over the
    reference-answer tokens with every seed's rows (diagnose_seeds), each with every row:
    the expert's logits, the plain merge's (also the base of the factored rank-16 heads) and the KL floor (3
    matmuls, 3 passes), the methods' factored heads (a pass each), the matched control (its own rank-608
    logits: a matmul and a pass), and each task-agnostic kind's factored heads (a pass each); a rank that is
    not factored pays a matmul per head made of it."""
    from darts_bench.plan import resources

    def train(*sets):
        return make_plan(smollm2(list(sets)))["stages"]["train"]
    cfg = smollm2()
    plan = make_plan(cfg)
    d, V, r = 576, 49152, cfg.surgery.rank
    M, meth = len(cfg.merges), len(cfg.surgery.methods)
    n = sum(round(c["tokens"] * cfg.calibration.held_out_fraction)
            + plan["tasks"][k.split("/")[0]]["n_examples"] * plan["tasks"][k.split("/")[0]]["reference_tokens_est"]
            for k, c in plan["stages"]["collect"]["calibration"].items() if not k.endswith("/reference"))
    off, shared, both = (train("surgery.task_agnostic=[]"), train("surgery.task_agnostic=[shared]"),
                         train("surgery.task_agnostic=[routed,shared]"))
    assert off["diagnostics_matmuls"] == M * n * (3 + 1)  # expert, plain, floor + the control's
    assert off["diagnostics_passes"] == M * n * (3 + meth + 1)
    assert off["diagnostics_flops"] == M * n * ((3 + 1) * 2 * d + meth * 2 * r) * V
    assert shared["diagnostics_matmuls"] == off["diagnostics_matmuls"]  # in the same pass, factored on the plain logits
    assert shared["diagnostics_passes"] - off["diagnostics_passes"] == M * n * meth
    assert both["diagnostics_passes"] - off["diagnostics_passes"] == M * n * 2 * meth
    assert both["diagnostics_flops"] - off["diagnostics_flops"] == M * n * 2 * meth * 2 * r * V
    assert both["diagnostics_tokens"] == off["diagnostics_tokens"] == M * n  # one pass per stream
    assert off["seconds"] < shared["seconds"] < both["seconds"]
    assert both["seconds"] == pytest.approx(both["diagnostics_seconds"] + both["head_seconds"])
    t = resources.THROUGHPUT["cpu"]
    assert both["diagnostics_seconds"] == pytest.approx(both["diagnostics_flops"] / t["vocab"]
                                                        + both["diagnostics_passes"] * V / t["vocab_pass"])
    # the rates are the constants to re-set from a new measurement
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(resources.THROUGHPUT, "cpu", {**t, "vocab": 2 * t["vocab"], "vocab_pass": 2 * t["vocab_pass"]})
        faster = train()
    assert faster["diagnostics_seconds"] == pytest.approx(both["diagnostics_seconds"] / 2)
    assert faster["head_seconds"] == pytest.approx(both["head_seconds"])
    # rank 200 on d 576 is not factored: a matmul per head made of the methods' (their own, routed, shared)
    wide = train("surgery.rank=200")
    assert wide["diagnostics_matmuls"] - both["diagnostics_matmuls"] == M * n * 3 * meth
    assert train("surgery.entropy_source=kl")["diagnostics_flops"] > both["diagnostics_flops"]
    # head seeds: each seed's held-out tokens get their own pass, the reference answers one pass with every seed's
    # rows (diagnose_seeds): 3 seeds cost 3 x the held-out work but the references' expert, plain and floor once
    held = sum(round(c["tokens"] * cfg.calibration.held_out_fraction)
               for k, c in plan["stages"]["collect"]["calibration"].items() if not k.endswith("/reference"))
    ref = n - held
    three = train("surgery.task_agnostic=[]", "seeds=[0,1,2]")
    assert three["diagnostics_tokens"] == M * (3 * held + ref)
    assert three["diagnostics_matmuls"] == M * (3 * held * (3 + 1) + ref * (3 + 3 * 1))
    assert three["diagnostics_passes"] == M * (3 * held * (3 + meth + 1) + ref * (3 + 3 * (meth + 1)))


def test_the_judge_prefix_cache_forwards_the_shared_prompt_tokens_once():
    """With the judge's prefix cache (vLLM: scoring shared + evaluate.vllm.prefix_cache_mib; hf: share_prefix +
    evaluate.prefix_cache_mib) the evaluate stage's seconds drop by exactly the forward of the shared prompt
    tokens (AlpacaEval's ``shared_tokens_per_row``) of every evaluated row but one; with heads scoring no judge
    prompt reaches the copy and the cache changes nothing."""
    from darts_bench.plan.resources import forward_seconds
    from darts_bench.plan.stages import plan_inputs

    def evaluate(*sets):
        cfg = smollm2(list(sets))
        return make_plan(cfg)["stages"]["evaluate"]["seconds"], plan_inputs(cfg)[0]

    for backend, key, extra in (("vllm", "evaluate.vllm.prefix_cache_mib", ["evaluate.vllm.scoring=shared"]),
                                ("hf", "evaluate.prefix_cache_mib", ["evaluate.share_prefix=true"])):
        cached, x = evaluate(f"evaluate.backend={backend}", *extra, f"{key}=512")
        plain, _ = evaluate(f"evaluate.backend={backend}", *extra, f"{key}=0")
        shared = x.needs["alpacaeval"]["judge"]["shared_tokens_per_row"]
        assert shared == 10 * (2 * 350 + 350)  # the preset's 10 instructions
        assert plain - cached == pytest.approx(forward_seconds((len(x.evaluated) - 1) * shared, x.params, "cpu"),
                                               rel=1e-9), backend
    a, _ = evaluate("evaluate.backend=vllm", "evaluate.vllm.scoring=heads", "evaluate.vllm.prefix_cache_mib=512")
    b, _ = evaluate("evaluate.backend=vllm", "evaluate.vllm.scoring=heads", "evaluate.vllm.prefix_cache_mib=0")
    assert a == b


def test_plan_counts_svd_merges_by_hand():
    """The SVD merges' cost: SVDs per 2-D matrix (TSV-M K + 2, Iso-C 1, Iso-CTS K + 3, SVC 1) x the sum of
    m n min(m, n) over the tiny tier's matrices at the ``svd`` rate (2.5e9/s on CPU). Tiny: d 128, MLP 344,
    4 layers, vocab 4096, untied: per layer 4 x 128^3 (q, k, v, o) + 3 x 344 x 128^2 = 25,296,896; x 4 layers
    + 2 x 4096 x 128^2 (embedding, lm_head) = 235,405,312."""
    from darts_bench.plan import make_plan

    cfg = load_config("tiny", ["merges=[{name: tsv, method: tsv_m}, {name: isoc, method: iso_c}, "
                               "{name: cts, method: iso_cts}, {name: ta-svc, method: task_arithmetic, weight: 0.3, "
                               "svc_alpha: 0.1}]"])
    st = make_plan(cfg)["stages"]["merge"]
    mnr = 235_405_312
    assert st["svd_merge_seconds"] == pytest.approx({"tsv": 5 * mnr / 2.5e9, "isoc": mnr / 2.5e9,
                                                     "cts": 6 * mnr / 2.5e9, "ta-svc": mnr / 2.5e9}, rel=1e-12)
    assert st["seconds"] == pytest.approx(13 * mnr / 2.5e9, rel=1e-12)
    assert "tsv: tsv_m, 5 SVD(s) per 2-D matrix (30 matrices)" in st["what"]
    assert "1 mergekit merges: ta-svc" in st["what"]


def test_smollm2_merges_preset_holds_every_new_method_and_its_claim_lines():
    """The issue-59 preset (smollm2-135m-merges): each newer method is a merge of it, on smollm2-135m's pool (so
    that preset's cached pool is reused), and its claim lines have the cells the plan promises: 11 merges with
    heads x 3 tasks for DARTS vs Surgery and vs EMR (oracle, and routed: the preset's routed head rows, without
    which 3-emr-routed is not counted), 5 fixes (TSV-M, Iso-C, Iso-CTS, two SVC merges) x 3 tasks for the heads on
    a strong fix, Expert Merging's 3 cells for claim 7; the routed head rows are behaviour-only (not evaluated)."""
    from darts_bench.plan.power import claims_plan
    from darts_bench.report.decide import merge_labels

    cfg = load_config("smollm2-135m-merges")
    assert cfg.pool == load_config("smollm2-135m").pool
    labels = set(merge_labels(cfg.merges).values())
    for method in ("tsv_m", "iso_c", "iso_cts", "task_arithmetic+svc", "ties+svc", "della", "breadcrumbs_ties",
                   "model_stock", "expert_merging", "emr"):
        assert method in labels, method
    cells = {ln["line"]: ln["cells"] for ln in claims_plan(cfg, ["humaneval", "gsm8k", "alpacaeval"])["lines"]}
    assert cfg.surgery.task_agnostic == ["routed"]
    assert cells == {"3": 33, "7-darts": 3, "7-surgery": 3, "7-darts-fix": 15, "7-surgery-fix": 15, "3-emr": 33,
                     "3-emr-routed": 33}
    no_routed = load_config("smollm2-135m-merges", ["surgery.task_agnostic=[]"])
    cells = {ln["line"]: ln["cells"] for ln in claims_plan(no_routed, ["humaneval", "gsm8k", "alpacaeval"])["lines"]}
    assert cells == {"3": 33, "7-darts": 3, "7-surgery": 3, "7-darts-fix": 15, "7-surgery-fix": 15, "3-emr": 33}
    # 11 merges x 2 methods routed head rows, none of them evaluated (evaluate.rows names only plain and EMR rows)
    from darts_bench.rows import row_specs, row_selected

    routed = [s for s in row_specs(cfg) if s.routing == "routed" and s.correction != "emr@routed"]
    assert len(routed) == 22 and {s.correction for s in routed} == {"darts@routed", "surgery@routed"}
    assert not any(row_selected(cfg, s.model) for s in routed)
