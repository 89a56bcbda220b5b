"""EMR-Merging and Expert Merging in a micro run: the rows they make (names and meta), the oracle row evaluating
task t with t's own EMR model, the routed row routing by the base's prompt states, Expert Merging as a data
merge with heads, caching, and the report."""

import json

import pytest
import torch

from darts_bench.config import load_config

EMR = {"name": "emr", "method": "emr"}
EM = {"name": "em", "method": "expert_merging", "steps": 2, "batch_size": 4}


def test_rows_of_a_task_aware_merge():
    """``emr`` (oracle), one ``@routed`` row per calibration split, no corrected rows; Expert Merging gets the
    usual corrected rows; row meta carries merge, correction, calibration and routing."""
    from darts_bench.rows import row_meta, row_specs

    cfg = load_config("tiny", [f"merges={json.dumps([EMR, EM])}", 'calibration.splits=["transductive","inductive"]'])
    specs = row_specs(cfg)
    names = [s.model for s in specs]
    assert [n for n in names if n.startswith("emr")] == ["emr", "emr@routed", "emr@inductive@routed"]
    assert "em+darts" in names and "em+surgery@inductive" in names and not any(n.startswith("emr+") for n in names)
    meta = row_meta(cfg, specs)
    assert meta["emr"] == {"merge": "emr", "correction": "emr", "calibration": "", "variant": "", "seed": None,
                           "group": None, "routing": "oracle"}
    assert meta["emr@inductive@routed"] == {"merge": "emr", "correction": "emr@routed", "calibration": "inductive",
                                            "variant": "", "seed": None, "group": None, "routing": "routed"}
    assert all(s.task_aware == s.model.startswith("emr") for s in specs)


def test_ls_merges_lists_both_with_their_sources():
    from darts_bench.listing import list_merges

    by = {m["method"]: m for m in list_merges()}
    assert by["emr"]["kind"] == "task-aware" and by["emr"]["task_label"].startswith("yes")
    assert "fusion-bench 0.2.33 emr_merging" in by["emr"]["code"] and "NeurIPS 2024" in by["emr"]["paper"]
    assert by["expert_merging"]["kind"] == "data" and by["expert_merging"]["task_label"] == "no"
    assert "Littleor/ExpertMerging" in by["expert_merging"]["code"] and "2509.25712" in by["expert_merging"]["paper"]
    assert by["expert_merging"]["settings"].split(",") == ["steps", "lr", "init", "batch_size", "temperature",
                                                           "sparsity_weight", "hidden_weight", "calibration_split"]
    assert by["ties"]["task_label"] == "no"


@pytest.mark.micro
def test_emr_and_expert_merging_in_a_micro_run(micro_cfg_path, micro_pipeline, tmp_path):
    from safetensors.torch import load_file

    from darts_bench.merge.emr import load_record, reconstruct, task_dir
    from darts_bench.pipeline import Pipeline

    micro_pipeline.pool()
    cfg = load_config(str(micro_cfg_path), [f"merges={json.dumps([EMR, EM])}", f"out_dir={tmp_path / 'results'}"])
    pipe = Pipeline(cfg)
    from darts_bench.export import export_row

    try:
        pipe.report()
        rows = {r.model: r for r in pipe.rows()}
        merges = pipe.merge()
        exported = export_row(pipe, "emr", tmp_path / "export")
        with pytest.raises(ValueError, match="export the oracle row 'emr'"):
            export_row(pipe, "emr@routed", tmp_path / "export2")
    finally:
        pipe.close()
    # export: one checkpoint per task (the task's EMR model) and the record
    assert set(exported["task_models"]) == {"humaneval", "gsm8k", "alpacaeval"}
    assert exported["lm_eval_model_args"]["gsm8k"]["darts-bench"].startswith(f"pretrained={tmp_path / 'export'}/models/gsm8k")
    assert (tmp_path / "export" / "models" / "gsm8k" / "model.safetensors").read_bytes() == \
        (task_dir(merges["emr"], "math") / "model.safetensors").read_bytes()
    assert (tmp_path / "export" / "emr" / "emr.safetensors").is_file()
    res = json.loads((tmp_path / "results" / "results.json").read_text())
    table = {r["model"]: r for r in res["rows"]}
    assert {"emr", "emr@routed", "emr@inductive@routed", "em", "em+darts", "em+surgery@inductive"} <= set(table)
    for name in ("emr", "emr@routed", "em", "em+darts"):
        assert all(isinstance(table[name][f"{t}_ref_nll"], float) for t in ("humaneval", "gsm8k", "alpacaeval"))
    # the oracle row runs task t on t's expert's EMR model: the checkpoint is the reconstruction, and its NLL of
    # the reference answers is that model's (evaluated again here as the expert rows are: a plain checkpoint)
    experts, u, masks, r = load_record(merges["emr"])
    base = load_file(str(pipe.pool().base / "model.safetensors"))
    for t, e in (("humaneval", "code"), ("gsm8k", "math"), ("alpacaeval", "instruction")):
        assert rows["emr"].task_models[t] == task_dir(merges["emr"], e)
        k = experts.index(e)
        got = load_file(str(task_dir(merges["emr"], e) / "model.safetensors"))
        want = reconstruct({n: base[n] for n in u}, u, {n: masks[n][k] for n in u}, r[k])
        assert all(torch.equal(got[n], want[n]) for n in u)
    # a routed row whose router sends every prompt to its own task scores as the oracle; its routing accuracy is
    # reported on the benchmark and on the held-out calibration prompts
    routed = table["emr@routed"]
    assert 0.0 <= routed["gsm8k_routing_acc"] <= 1.0 and routed["gsm8k_n_routed"] > 0
    assert "gsm8k_routing_acc_heldout" in routed
    rj = json.loads((rows["emr@routed"].router / "routing.json").read_text())
    assert rj["states"] == "base" and set(rj["tasks"]) == {"humaneval", "gsm8k", "alpacaeval"}
    for t in ("humaneval", "gsm8k", "alpacaeval"):
        if routed[f"{t}_routing_acc"] == 1.0:
            assert routed[f"{t}_ref_nll"] == table["emr"][f"{t}_ref_nll"]
    # Expert Merging: a data merge with its coefficients in the manifest, cached on a second build
    det = res["manifest"]["merge_details"]
    assert det["em"]["method"] == "expert_merging" and set(det["em"]["coefficients"]) == {"code", "math",
                                                                                          "instruction"}
    assert det["emr"]["method"] == "emr" and set(det["emr"]["rescalers"]) == {"code", "math", "instruction"}


def _smollm2(overrides=()):
    from conftest import SMOLLM2_2026_12_05

    return load_config("smollm2-135m", [*SMOLLM2_2026_12_05, *overrides])


@pytest.mark.parametrize("steps", [2, 6])
def test_plan_counts_expert_merging_steps(steps):
    """Expert Merging's merge time: the experts' continuations of steps x batch_size prompts (2 P per generated
    token at the decoding rate), then per sequence token a forward + backward of the merge (6 P, training rate) and
    its expert's forward (2 P, forward rate), a recombination with its backward per step, and the model reads."""
    from darts_bench.plan import make_plan
    from darts_bench.plan.resources import LOAD_BYTES_PER_S, RECOMBINE_BACKWARD, THROUGHPUT

    cfg = _smollm2([f"merges=[{{name: em, method: expert_merging, steps: {steps}, batch_size: 4}}]"])
    plan = make_plan(cfg)
    m, t = plan["stages"]["merge"], THROUGHPUT["cpu"]
    P, K = plan["model"]["params"], 3
    cal = plan["stages"]["collect"]["calibration"]
    tasks = [n for n, ti in plan["tasks"].items() if ti["expert"]]
    n = sum(cal[f"{x}/transductive"]["sequences"] for x in tasks)
    total = sum(cal[f"{x}/transductive"]["sequences"] * min(plan["tasks"][x]["prompt_tokens_est"],
                                                            cfg.calibration.max_prompt_tokens) for x in tasks)
    new = steps * 4 * cfg.calibration.max_new_tokens
    seq = steps * 4 * total / n + new
    want = (seq * 6 * P / t["train"] + seq * 2 * P / t["forward"] + new * 2 * P / t["decode"]
            + steps * (1 + RECOMBINE_BACKWARD) * K * P / t["recombine"] + (1 + K) * P * 4 / LOAD_BYTES_PER_S
            + P * 4 / LOAD_BYTES_PER_S)
    assert m["data_merge_seconds"]["em"] == pytest.approx(want)
    assert f"{steps} AdamW steps of 4 sequences" in m["what"]


def test_plan_counts_emr_models_and_disk():
    """EMR: K per-task checkpoints and the record on disk; no features or heads; the evaluate stage loads each
    task's model (K) and, for a routed row, the base."""
    from darts_bench.plan import make_plan

    plan = make_plan(_smollm2(["merges=[{name: emr, method: emr}]", "evaluate.rows=null"]))
    P = plan["model"]["params"]
    st = plan["stages"]
    assert st["merge"]["disk_bytes"] == pytest.approx(3 * P * 4 + P * 4 + 3 * P / 8)
    assert "emr: EMR-Merging" in st["merge"]["what"] and "emr" in st["merge"]["data_merge_seconds"]
    assert "of 0 merges" in st["collect"]["what"]
    assert "3 task-aware (EMR: oracle and routed)" in st["evaluate"]["what"]
    both = make_plan(_smollm2(["merges=[{name: emr, method: emr}, {name: ta, method: task_arithmetic}]",
                               "evaluate.rows=null"]))
    assert both["stages"]["evaluate"]["model_loads"] == 1 + 3 + 1 + 3  # base, experts, ta, EMR's 3 task models


def test_preflight_names_emr_rows_that_cannot_run():
    """A suite with one expert task cannot route (emr@routed); a task without an expert has no EMR model (emr)."""
    from darts_bench.preflight import row_problems

    cfg = load_config("tiny", [f"merges={json.dumps([EMR])}"])
    msgs = [str(p) for p in row_problems(cfg, ["gsm8k"])]
    assert any("task-aware routed row(s) ['emr@routed', 'emr@inductive@routed']" in m for m in msgs), msgs
    assert not any("task-agnostic" in m for m in msgs)
    cfg2 = load_config("tiny", [f"merges={json.dumps([EMR])}", "tasks.alpacaeval.expert=null"])
    msgs2 = [str(p) for p in row_problems(cfg2, ["humaneval", "gsm8k", "alpacaeval"])]
    assert any("task-aware row(s) ['emr']" in m and "['alpacaeval'] have no expert" in m for m in msgs2), msgs2
    assert row_problems(cfg, ["humaneval", "gsm8k", "alpacaeval"]) == []
