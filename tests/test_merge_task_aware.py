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


def test_emr_refuses_a_weight_naming_that_it_takes_no_setting():
    """EMR has no hyper-parameter: a ``weight`` (as a merge sweep over it makes) is refused with a message that
    says so, not an empty list of the settings it takes."""
    from darts_bench.config import MergeSpec

    with pytest.raises(ValueError, match=r"weight is a mergekit option; method emr takes no setting \(drop them\)"):
        MergeSpec(name="e", method="emr", weight=0.5)


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
    # the svc line names every method MergeSpec refuses svc_alpha on (it named adamerging / regmean only)
    from darts_bench.config import DATA_MERGE_METHODS, TASK_AWARE_METHODS, MergeSpec

    for m in (*DATA_MERGE_METHODS, *TASK_AWARE_METHODS):
        assert m in by["svc"]["code"].split("svc_alpha on any merge but ")[1].split(" / ")
        with pytest.raises(ValueError, match="svc_alpha calibrates a training-free merge"):
            MergeSpec(name="m", method=m, svc_alpha=0.1)


@pytest.mark.micro
def test_emr_and_expert_merging_in_a_micro_run(micro_cfg_path, micro_pipeline, tmp_path):
    from safetensors.torch import load_file

    from darts_bench.merge.emr import load_record, reconstruct, task_dir
    from darts_bench.pipeline import Pipeline

    micro_pipeline.pool()
    # the routed head rows (surgery.task_agnostic: [routed]): claim line 3-emr-routed's same-budget DARTS side
    cfg = load_config(str(micro_cfg_path), [f"merges={json.dumps([EMR, EM])}", f"out_dir={tmp_path / 'results'}",
                                            "surgery.task_agnostic=[routed]"])
    pipe = Pipeline(cfg)
    from darts_bench.export import export_row

    try:
        pipe.report()
        rows = {r.model: r for r in pipe.rows()}
        merges = pipe.merge()
        col, tr = pipe.collect(), pipe.train()
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
    _check_emr_evidence(cfg, pipe, col, tr, merges["emr"], tmp_path / "results")


def _check_emr_evidence(cfg, pipe, col, tr, emr_dir, out):
    """The EMR rows' behaviour evidence: the oracle's held-out KL / agreement sums on gsm8k's held-out continuation
    tokens equal those computed here directly from the reconstructed task checkpoint and the expert (a forward of
    each full sequence; the stage's features come from left-padded batches, so the KL agrees to float32 rounding,
    rel 1e-4, and the top-1 agreement count exactly); the routed row's sums equal the oracle's on every sequence
    routed to its own task and another checkpoint's elsewhere; the routed DARTS / Surgery rows' sums in the evidence
    file equal the oracle rows' exactly on every held-out sequence routed to its own task (the same head, the same
    diagnostics pass) and differ elsewhere; the EMR claim lines (oracle, and routed DARTS vs routed EMR) reach
    claims.md with cells."""
    import numpy as np
    from transformers import AutoModelForCausalLM

    from darts_bench.data import read_jsonl
    from darts_bench.merge.emr import task_dir
    from darts_bench.surgery.data import shared_template

    split, seed = cfg.calibration.splits[0], cfg.seed
    d = tr["task_aware_runs"][("emr", "gsm8k", split, "", seed)]
    ps = d["per_sequence"]["gen"]
    meta = col["calibration"][("gsm8k", split)].meta
    template = shared_template(meta)
    models = [AutoModelForCausalLM.from_pretrained(p, torch_dtype=torch.float32).eval()
              for p in (pipe.pool().path("math"), task_dir(emr_dir, "math"))]
    assert ps["sequence"] == sorted(d["held_out_sequences"])
    for j, i in enumerate(ps["sequence"]):
        ids = meta["sequences"][i]
        with torch.no_grad():
            le, lm = (mod(torch.tensor([ids])).logits[0].float() for mod in models)
        pos = [p for p in range(meta["prompt_len"][i] - 1, len(ids) - 1) if p not in template]
        lpe, lpm = torch.log_softmax(le[pos], -1), torch.log_softmax(lm[pos], -1)
        kl = float((lpe.exp() * (lpe - lpm)).sum(-1).double().sum())
        agree = int((le[pos].argmax(-1) == lm[pos].argmax(-1)).sum())
        assert ps["n_tokens"][j] == len(pos)
        assert ps["emr"]["kl_sum"][j] == pytest.approx(kl, rel=1e-4, abs=1e-6)
        assert ps["emr"]["agree_sum"][j] == agree
    # routed: the oracle's sums wherever the base-state router picks gsm8k, the picked task's checkpoint elsewhere
    routing = json.loads((col["task_aware_routers"][("emr", split, None)] / "routing.json").read_text())
    picks = routing["tasks"]["gsm8k"]["sequences_routed"]
    assert len(picks) == len(meta["sequences"])
    own = [j for j, i in enumerate(ps["sequence"]) if picks[i] == "gsm8k"]
    assert own and all(ps["emr@routed"][q][j] == ps["emr"][q][j] for j in own for q in ps["emr"])
    for j, i in enumerate(ps["sequence"]):
        if picks[i] != "gsm8k":  # that checkpoint's features were collected on gsm8k's set
            assert (("emr", "gsm8k", split, {"humaneval": "code", "alpacaeval": "instruction"}[picks[i]])
                    in col["task_aware"])
    # the records reach the evidence file, on the same sequence ids as the merges' rows
    recs = [r for r in read_jsonl(out / "evidence" / "sequences.jsonl.gz") if r["set"] == "gen"]
    emr_ids = {r["sequence"] for r in recs if r["merge"] == "emr" and r["task"] == "gsm8k" and r["split"] == split}
    em_ids = {r["sequence"] for r in recs if r["merge"] == "em" and r["task"] == "gsm8k" and r["split"] == split}
    assert emr_ids == em_ids == set(ps["sequence"])
    rec = next(r for r in recs if r["merge"] == "emr" and r["task"] == "gsm8k" and r["split"] == split)
    assert set(rec["rows"]) == {"emr", "emr@routed"}
    # the routed head rows: beside the oracle rows of the same (merge, task, split, seed) records, every task and set
    n_own = n_other = 0
    all_recs = read_jsonl(out / "evidence" / "sequences.jsonl.gz")
    for t in ("humaneval", "gsm8k", "alpacaeval"):
        info = json.loads((tr["routers"][("em", split, seed)] / "routing.json").read_text())["tasks"][t]
        picked = dict(zip(info["held_out_sequences"], info["held_out_routed"]))
        mine = [r for r in all_recs if (r["merge"], r["task"], r["split"], r["variant"], r["seed"]) ==
                ("em", t, split, "", seed)]
        assert {r["set"] for r in mine} >= {"gen", "reference"}
        assert all(set(r["rows"]) == {"none", "surgery", "darts", "surgery@routed", "darts@routed"} for r in mine)
        gen = [r for r in mine if r["set"] == "gen"]
        assert sorted(r["sequence"] for r in gen) == sorted(picked)
        for r in gen:
            same = [r["rows"][f"{k}@routed"] == r["rows"][k] for k in ("darts", "surgery")]
            if picked[r["sequence"]] == t:
                assert all(same), (t, r["sequence"])
                n_own += 1
            else:
                assert not any(same), (t, r["sequence"])
                n_other += 1
    assert n_own and n_other
    # the claim lines: one cell per (real merge, task): em x 3 tasks; the routed line pairs the routed rows
    claims = (out / "claims.md").read_text()
    res = json.loads((out / "results.json").read_text())
    dec = {(x["line"], x["split"]): x for x in res["decisions"]}
    for key, words in (("3-emr", "DARTS beats EMR-Merging"), ("3-emr-routed", "DARTS routed beats EMR-Merging routed")):
        assert dec[(key, split)]["cells"] == 3, dec.get((key, split))
        assert f"| 3 | {key} | {words}" in claims
        assert all(f"| {key} | {split} | em | {t} | kl_expert_gen |" in claims
                   for t in ("humaneval", "gsm8k", "alpacaeval"))


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
    """EMR: K per-task checkpoints and the record on disk; no heads; each task's checkpoint's features on its task's
    calibration sets (the oracle row's evidence: every set's tokens once more, K loads) and its plain-row diagnostics
    (three matmuls per held-out and reference token); the evaluate stage loads each task's model (K) and, for a
    routed row, the base. The claim lines 3-emr / 3-emr-routed count (merge with heads, task) cells, the routed one
    only with the routed head rows."""
    from darts_bench.plan import make_plan

    plan = make_plan(_smollm2(["merges=[{name: emr, method: emr}]", "evaluate.rows=null"]))
    P = plan["model"]["params"]
    st = plan["stages"]
    assert st["merge"]["disk_bytes"] == pytest.approx(3 * P * 4 + P * 4 + 3 * P / 8)
    assert "emr: EMR-Merging" in st["merge"]["what"] and "emr" in st["merge"]["data_merge_seconds"]
    assert "of 0 merges" in st["collect"]["what"] and "1 task-aware merge(s) (EMR)" in st["collect"]["what"]
    seq_tokens = sum(c["tokens"] for c in st["collect"]["calibration"].values())
    assert st["collect"]["feature_forward_tokens"] == 2 * seq_tokens and st["collect"]["model_loads"] == 3 + 3
    assert st["train"]["diagnostics_matmuls"] == 3 * st["train"]["diagnostics_tokens"] > 0
    from darts_bench.plan.power import claims_plan

    names = ["humaneval", "gsm8k", "alpacaeval"]
    cfg1 = _smollm2(["merges=[{name: emr, method: emr}]", "evaluate.rows=null"])
    assert not any(ln["line"].startswith("3-emr") for ln in claims_plan(cfg1, names)["lines"])  # no merge with heads
    assert "3 task-aware (EMR: oracle and routed)" in st["evaluate"]["what"]
    # the row breakdown adds up: the EMR merge is not also counted as a plain merge (it said "1 merges" here)
    assert st["evaluate"]["what"].startswith("7 rows (base, 3 experts, 0 merges, 0 corrected, 3 task-aware")
    cfg2 = _smollm2(["merges=[{name: emr, method: emr}, {name: ta, method: task_arithmetic}]", "evaluate.rows=null"])
    both = make_plan(cfg2)
    assert both["stages"]["evaluate"]["model_loads"] == 1 + 3 + 1 + 3  # base, experts, ta, EMR's 3 task models
    assert cfg2.surgery.task_agnostic == ["routed", "shared"]  # the routed head rows: the routed line's DARTS side
    lines = {ln["line"]: ln for ln in claims_plan(cfg2, names)["lines"]}
    assert lines["3-emr"]["cells"] == lines["3-emr-routed"]["cells"] == lines["3"]["cells"] == 3  # ta x 3 tasks
    # without routed head rows (shared only), no routed DARTS row: no routed line
    cfg3 = _smollm2(["merges=[{name: emr, method: emr}, {name: ta, method: task_arithmetic}]", "evaluate.rows=null",
                     "surgery.task_agnostic=[shared]"])
    lines = {ln["line"]: ln for ln in claims_plan(cfg3, names)["lines"]}
    assert lines["3-emr"]["cells"] == lines["3"]["cells"] == 3 and "3-emr-routed" not in lines


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
