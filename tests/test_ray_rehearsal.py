"""The llama2-7b path end to end on the 7B-shaped rehearsal pool (darts_bench/pool/rehearsal.py):
hub ids resolved offline from an HF cache, sharded bf16 checkpoints with an untied lm_head, an
expert that appends [PAD] (vocab_alignment: base), sequences past 1,024 positions, the Ray executor
and DeepSpeed head training through Ray Train, pool -> report; the table is checked for values.

GSM8K only (5-shot prompts are the long ones) and 2 examples, to keep it to a few minutes: every
Ray call starts actors that load a model, which dominates on two shared cores.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

pytest.importorskip("ray")
pytest.importorskip("deepspeed")
pytestmark = [pytest.mark.micro, pytest.mark.ray, pytest.mark.deepspeed, pytest.mark.slow, pytest.mark.timeout(1500)]

from darts_bench.pool.checkpoint import read_tensor  # noqa: E402
from darts_bench.pool.rehearsal import REPO_IDS  # noqa: E402
from darts_bench.surgery.losses import kl_divergence  # noqa: E402

ROWS = ["base", "expert:code", "expert:math", "expert:instruction", "dare_ties", "dare_ties+darts"]


@pytest.fixture(scope="module")
def rehearsal_run(rehearsal_hub, ray_instance, data_dir, tmp_path_factory):
    from darts_bench.config import load_config
    from darts_bench.pipeline import Pipeline

    mp = pytest.MonkeyPatch()
    mp.setenv("HF_HOME", str(rehearsal_hub))
    mp.delenv("HF_HUB_CACHE", raising=False)
    mp.setenv("HF_HUB_OFFLINE", "1")
    tmp = tmp_path_factory.mktemp("rehearsal-run")
    cfg = load_config("llama2-7b-rehearsal", [
        f"work_dir={tmp / 'work'}", f"out_dir={tmp / 'results'}", f"data_dir={data_dir}",
        "calibration.n_prompts=2", "tasks.gsm8k.limit=2", "surgery.methods=[darts]"])
    pipe = Pipeline(cfg, suite="gsm8k")
    try:
        df = pipe.report()
        yield pipe, df, json.loads((tmp / "results" / "results.json").read_text())
    finally:
        pipe.close()
        mp.undo()


def test_rehearsal_pool_runs_pool_to_report(rehearsal_run, rehearsal_hub):
    pipe, df, res = rehearsal_run
    pool = pipe.pool()
    # hub ids -> snapshots in the cache, revisions in the manifest
    cache = rehearsal_hub / "hub"
    sources = res["manifest"]["pool"]["build_report"]["sources"]
    for name, repo in REPO_IDS.items():
        repo_dir = cache / ("models--" + repo.replace("/", "--"))
        rev = (repo_dir / "refs" / "main").read_text()
        assert sources[name] == {"id": repo, "path": str(repo_dir / "snapshots" / rev), "revision": rev}
        assert pool.path(name) == repo_dir / "snapshots" / rev
    assert list(df["model"]) == ROWS
    # every row has a finite reference NLL; the math expert is the best expert on GSM8K answers
    nll = dict(zip(df["model"], df["gsm8k_ref_nll"]))
    assert all(math.isfinite(v) and v > 0 for v in nll.values())
    assert nll["expert:math"] < min(nll["expert:code"], nll["expert:instruction"], nll["base"])
    # evaluated 5-shot prompts fill the 1,024-token window, so generation runs at positions >= 1,024
    # (calibration prompts are the zero-shot questions: short)
    tok = pipe.loaded_tasks().tokenizer
    prompts = [s["prompt"] for s in pipe.evaluate()["dare_ties+darts"]["gsm8k"].samples]
    assert len(prompts) == 2 and min(len(tok(p)["input_ids"]) for p in prompts) > 1024


def test_rehearsal_heads_are_deepspeed_trained_and_sized_exactly(rehearsal_run):
    pipe, df, _ = rehearsal_run
    d = 48  # the micro pool's hidden size
    L = pipe.surgery_config().max_len
    assert L == 2048  # derived: prompt + reference answer, 2 x 1024 (calibration.max_prompt_tokens)
    rank = pipe.cfg.surgery.rank
    added = dict(zip(df["model"], df["params_added"]))
    assert added["dare_ties+darts"] == 2 * rank * d + L * d  # W_down, W_up, the position table
    assert added["dare_ties"] == 0 and added["base"] == 0
    for method in ("darts",):
        head = pipe.train()["heads"][("dare_ties", "gsm8k", method, "transductive")]
        hist = json.loads((head / "head_config.json").read_text())["history"]
        assert hist["world_size"] == 2 and hist["zero_stage"] == 2  # two DeepSpeed ranks via Ray Train
        assert json.loads((head / "head_config.json").read_text())["max_len"] == L


def test_rehearsal_kl_columns_use_the_real_lm_heads(rehearsal_run):
    """Recompute the merged row's held-out KL from the cached features with the lm_head tensors read
    from the shards the index names: the table's value; the embeddings would give another one."""
    pipe, df, _ = rehearsal_run
    fs = pipe.collect()["features"][("dare_ties", "gsm8k", "transductive")]
    exp, mer = fs.calib.expert_features(), fs.merged_features()
    diag = pipe.train()["diagnostics"][("dare_ties", "gsm8k", "transductive")]
    val = torch.isin(exp["seq_index"], torch.tensor(diag["held_out_sequences"]))
    expert_dir, merge_dir = pipe.pool().path("math"), pipe.merge()["dare_ties"]

    def kl(name: str) -> float:
        W_e = read_tensor(expert_dir, name).float()
        W_m = read_tensor(merge_dir, name).float()
        W_e = W_e[: W_m.shape[0]]  # the expert's appended [PAD] row
        return float(kl_divergence(exp["h"][val].float() @ W_e.T, mer["h"][val].float() @ W_m.T).mean())

    assert read_tensor(expert_dir, "lm_head.weight").shape[0] == read_tensor(merge_dir, "lm_head.weight").shape[0] + 1
    table = float(df.set_index("model").loc["dare_ties", "gsm8k_kl_expert"])
    assert table == pytest.approx(kl("lm_head.weight"), rel=1e-5)
    assert table != pytest.approx(kl("model.embed_tokens.weight"), rel=1e-2)
