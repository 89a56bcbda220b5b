"""The ``mergebench-llama3.2-3b`` path end to end on the 3B-shaped rehearsal pool
(darts_bench/pool/rehearsal_llama3.py): MergeBench's hub ids resolved offline from an HF cache, the
Llama-3 shape (tied embeddings, grouped-query attention, rope_scaling llama3, a 128,256-entry
vocabulary at 96 wide), sharded bf16 checkpoints, experts named as MergeBench names them
(``instruction``, ``math``, ``coding``: ``tasks.humaneval.expert: coding``), the preset's protocols
(HumanEval ``mergebench`` sampled, GSM8K ``gsm8k-cot-8shot``) shrunk by overrides, pool -> report on the
HF backend, in-process. The pool: ``tests/conftest.py`` ``llama3_hub``. The vLLM variant is in
``tests/test_evaluate_vllm_parity.py`` (``test_llama3_rehearsal_metrics_equal_hf``, CI's vLLM venv), which
imports :func:`rehearsal_run` from here.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

# tests/README.md: markers (a pool built here, a pipeline run of ~80 s on the shared 2-core machine)
pytestmark = [pytest.mark.micro, pytest.mark.slow, pytest.mark.timeout(1500)]

ROWS = ["base", "expert:instruction", "expert:math", "expert:coding", "task_arithmetic", "task_arithmetic+darts"]
TASK_EXPERTS = {"humaneval": "coding", "gsm8k": "math", "alpacaeval": "instruction"}
#: the preset's protocols shrunk: 2 examples a task, a few tokens, 2 HumanEval samples, one merge;
#: float32 compute (the bf16 checkpoints read exactly): engines and recomputations compare exactly, as the parity tests
SHRINK = ["device=cpu", "torch_threads=1", "executor=local", "deepspeed.enabled=false", "pool.dtype=float32",
          'merges=[{"name": "task_arithmetic", "method": "task_arithmetic", "weight": 0.3}]',
          "calibration.splits=[transductive]", "calibration.n_prompts=4", "calibration.max_new_tokens=4",
          "calibration.max_prompt_tokens=256", "calibration.batch_size=2", "surgery.methods=[darts]", "surgery.epochs=2",
          "surgery.batch_size=256",
          "tasks.batch_size=2", "tasks.bootstrap=10",
          "tasks.humaneval.limit=2", "tasks.humaneval.max_new_tokens=6", "tasks.humaneval.n_samples=2",
          "tasks.humaneval.k=[1, 2]", "tasks.humaneval.workers=1",
          "tasks.gsm8k.limit=2", "tasks.gsm8k.max_new_tokens=6",
          "tasks.alpacaeval.limit=2", "tasks.alpacaeval.max_new_tokens=6", "tasks.alpacaeval.judge.max_new_tokens=2"]


def rehearsal_run(home: Path, data_dir: Path, tmp: Path, extra: list[str] = ()):
    """Run the shrunk ``mergebench-llama3.2-3b`` preset on the rehearsal hub ``home`` into ``tmp``:
    ``(pipeline, table, results.json)``; the pipeline is closed, its artifacts stay readable."""
    from darts_bench.config import load_config
    from darts_bench.pipeline import Pipeline

    mp = pytest.MonkeyPatch()
    mp.setenv("HF_HOME", str(home))
    mp.delenv("HF_HUB_CACHE", raising=False)
    mp.setenv("HF_HUB_OFFLINE", "1")
    try:
        cfg = load_config("mergebench-llama3.2-3b", [f"work_dir={tmp / 'work'}", f"out_dir={tmp / 'results'}",
                                                      f"data_dir={data_dir}", *SHRINK, *extra])
        pipe = Pipeline(cfg)
        try:
            df = pipe.report()
            pipe.pool()  # cached: for the caller
        finally:
            pipe.close()
        return pipe, df, json.loads((tmp / "results" / "results.json").read_text())
    finally:
        mp.undo()


@pytest.fixture(scope="module")
def hf_run(llama3_hub, data_dir, tmp_path_factory):
    return rehearsal_run(llama3_hub, data_dir, tmp_path_factory.mktemp("llama3-run"))


def test_rehearsal_pool_has_the_llama3_shape(llama3_hub):
    from safetensors import safe_open
    from transformers import AutoConfig, AutoTokenizer

    from darts_bench.pool.rehearsal_llama3 import REPO_IDS, SHAPE

    cache = llama3_hub / "hub"
    for name, repo in REPO_IDS.items():
        repo_dir = cache / ("models--" + repo.replace("/", "--"))
        snap = repo_dir / "snapshots" / (repo_dir / "refs" / "main").read_text()
        raw = json.loads((snap / "config.json").read_text())
        assert raw["rope_scaling"]["rope_type"] == "llama3" and raw["rope_theta"] == 500000.0
        assert raw["tie_word_embeddings"] is True and raw["torch_dtype" if "torch_dtype" in raw else "dtype"] == "bfloat16"
        cfg = AutoConfig.from_pretrained(snap)
        assert (cfg.vocab_size, cfg.num_attention_heads, cfg.num_key_value_heads) == (128256, 3, 1)
        assert len(AutoTokenizer.from_pretrained(snap)) == SHAPE["vocab_size"]
        wm = json.loads((snap / "model.safetensors.index.json").read_text())["weight_map"]
        assert "lm_head.weight" not in wm and len(set(wm.values())) >= 3
        with safe_open(str(snap / wm["model.embed_tokens.weight"]), "pt") as f:
            assert tuple(f.get_slice("model.embed_tokens.weight").get_shape()) == (128256, 96)


def test_mergebench_rehearsal_runs_pool_to_report(hf_run, llama3_hub):
    from darts_bench.pool.rehearsal_llama3 import REPO_IDS

    pipe, df, res = hf_run
    assert list(df["model"]) == ROWS
    man = res["manifest"]
    # hub ids -> snapshots, MergeBench's names as the pool's expert names
    sources = man["pool"]["build_report"]["sources"]
    assert {n: s["id"] for n, s in sources.items()} == REPO_IDS
    assert list(pipe.pool().experts) == ["instruction", "math", "coding"]
    assert man["task_experts"] == TASK_EXPERTS
    assert man["config"]["pool"]["experts"] == {n: r for n, r in REPO_IDS.items() if n != "base"}
    # every row has numbers: finite reference NLLs, pass@1 and pass@2 of the two samples
    for t in TASK_EXPERTS:
        assert all(math.isfinite(v) and v > 0 for v in df[f"{t}_ref_nll"]), t
    assert df["humaneval_pass@1"].between(0, 100).all() and df["humaneval_truncated_rate"].between(0, 1).all()
    assert man["protocols"]["humaneval"]["protocol"] == "mergebench"
    assert man["protocols"]["gsm8k"]["protocol"] == "gsm8k-cot-8shot"
    assert df["n_humaneval"].eq(2).all() and df["n_gsm8k"].eq(2).all() and df["n_alpacaeval"].eq(2).all()


def test_heads_train_toward_each_tasks_expert(hf_run):
    """The calibration set each task's heads train on holds its expert's features (``tasks.<t>.expert``:
    HumanEval's is MergeBench's ``coding``): the stored final hidden states are the named expert's,
    recomputed here (float32, one unpadded forward per sequence), and not another expert's; the stored
    continuation is the named expert's greedy one."""
    import torch

    from darts_bench.evaluate.hf_model import load_causal_lm

    pipe, df, _ = hf_run
    pool = pipe.pool()
    calib = pipe.collect()["calibration"]
    torch.set_num_threads(1)
    models = {name: load_causal_lm(pool.path(name))[0] for name in pool.experts}
    for task, expert in TASK_EXPERTS.items():
        cs = calib[(task, "transductive")]
        feats = cs.expert_features()
        err = {name: 0.0 for name in models}
        for i, (seq, n_prompt) in enumerate(zip(cs.meta["sequences"], cs.meta["prompt_len"])):
            assert len(seq) > n_prompt, task  # a continuation was generated
            stored = feats["h"][feats["seq_index"] == i]
            assert stored.shape == (len(seq), 96)
            with torch.no_grad():
                for name, model in models.items():
                    out = model(torch.tensor([seq]), output_hidden_states=True)
                    err[name] = max(err[name], (out.hidden_states[-1][0] - stored).abs().max().item())
                    if name == expert:
                        assert out.logits[0, n_prompt - 1: len(seq) - 1].argmax(-1).tolist() == seq[n_prompt:]
        assert err[expert] < 1e-4 and all(e > 1e-2 for n, e in err.items() if n != expert), (task, err)
    # the corrected rows' heads: one per (task, method), trained on those sets
    run_heads = pipe.train()["run_heads"]
    assert {(k[1], k[2]) for k in run_heads if k[0] == "task_arithmetic"} == {
        (t, "darts") for t in TASK_EXPERTS}
