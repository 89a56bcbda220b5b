"""The tiny pool: determinism, experts that are experts, compatibility checks."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from darts_bench.api import get_task
from darts_bench.evaluate.hf_model import HFTextModel, load_causal_lm
from darts_bench.evaluate.nll import reference_nll
from darts_bench.pool.build import PoolMismatchError, check_compatible
from darts_bench.pool.tiny import train_tokenizer

pytestmark = [pytest.mark.micro]  # tests/README.md: markers


def test_tokenizer_deterministic():
    texts = ["def add(a, b):\n    return a + b\n", "Question: 2+2?\nAnswer: 4", "Write a poem."] * 20
    a, b = train_tokenizer(texts, 300), train_tokenizer(texts, 300)
    assert a.get_vocab() == b.get_vocab()
    assert a("def add(x)")["input_ids"] == b("def add(x)")["input_ids"]


def test_pool_deterministic(micro_pipeline, tmp_path):
    """Rebuilding the pool from the same config and seed gives bitwise-identical weights."""
    from darts_bench.pool.tiny import build_tiny_pool

    pool = micro_pipeline.pool()
    cfg = micro_pipeline.cfg.pool.model_copy(update={
        "tiny": micro_pipeline.cfg.pool.tiny.model_copy(update={"pretrain_steps": 60, "finetune_steps": 40})})
    build_tiny_pool(cfg, micro_pipeline.cfg.resolved_data_dir(), tmp_path)
    for name in ("base", "math"):
        a = load_file(str(pool.path(name) / "model.safetensors"))
        b = load_file(str(tmp_path / name / "model.safetensors"))
        assert a.keys() == b.keys()
        for k in a:
            assert torch.equal(a[k], b[k]), f"{name}:{k}"
    assert json.loads((pool.base / "tokenizer.json").read_text()) == json.loads((tmp_path / "base" / "tokenizer.json").read_text())


def test_experts_beat_base_and_each_other_on_own_task(micro_pipeline):
    """Each expert has the lowest reference NLL on its own task's held-out benchmark data."""
    pool = micro_pipeline.pool()
    data_dir = micro_pipeline.cfg.resolved_data_dir()
    names = ["base", "code", "math", "instruction"]
    models = {n: HFTextModel(n, *load_causal_lm(pool.path(n)), batch_size=8) for n in names}
    for task_name in ("humaneval", "gsm8k", "alpacaeval"):
        task = get_task(task_name)
        ex = task.examples(data_dir, models["base"], 24)
        nll = {n: reference_nll(m, ex)[0] for n, m in models.items()}
        own = nll[task.expert]
        others = {n: v for n, v in nll.items() if n != task.expert}
        assert all(own < v for v in others.values()), (task_name, nll)


def _expert_copy_with_config(pool, name, tmp_path, **changes):
    """A copy of expert ``name`` whose config.json fields are mapped by ``changes`` (key -> fn)."""
    bad = tmp_path / "bad_expert"
    shutil.copytree(pool.path(name), bad)
    cfg = json.loads((bad / "config.json").read_text())
    for k, fn in changes.items():
        cfg[k] = fn(cfg[k])
    (bad / "config.json").write_text(json.dumps(cfg))
    return bad


def test_mismatched_vocab_is_a_clear_error(micro_pipeline, tmp_path):
    pool = micro_pipeline.pool()
    bad = _expert_copy_with_config(pool, "math", tmp_path, vocab_size=lambda v: v + 8)
    with pytest.raises(PoolMismatchError, match=r"expert 'math'.*vocab_size = \d+ vs base"):
        check_compatible(pool.base, {"math": bad})


def test_mismatched_hidden_size_is_a_clear_error(micro_pipeline, tmp_path):
    pool = micro_pipeline.pool()
    bad = _expert_copy_with_config(pool, "code", tmp_path, hidden_size=lambda v: v * 2)
    with pytest.raises(PoolMismatchError, match="hidden_size"):
        check_compatible(pool.base, {"code": bad})


def test_different_tokenizer_is_a_clear_error(micro_pipeline, tmp_path):
    pool = micro_pipeline.pool()
    bad = tmp_path / "bad_expert"
    shutil.copytree(pool.path("code"), bad)
    tok = json.loads((bad / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = list(vocab)[300:302]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (bad / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(PoolMismatchError, match="different tokenizer vocabulary"):
        check_compatible(pool.base, {"code": bad})


def test_qwen2_pool_tied_gqa_and_merges(tmp_path):
    """``tiny.architecture: qwen2``: Qwen2ForCausalLM base and experts with q/k/v biases, tied
    embeddings (no ``lm_head`` tensor saved) and grouped-query attention; mergekit merges them into a
    Qwen2 checkpoint that loads with its embeddings still tied. The Llama default's pool key is the
    one from before the field existed."""
    from conftest import QWEN2_MICRO_TINY, micro_config_file

    from darts_bench.artifacts import stable_hash
    from darts_bench.config import PoolConfig, load_config
    from darts_bench.merge import build_merges
    from darts_bench.pool import build_pool
    from darts_bench.pool.build import pool_config_key

    cfg = load_config(str(micro_config_file(tmp_path, pool={"tiny": QWEN2_MICRO_TINY})))
    pool = build_pool(cfg, tmp_path / "work")
    for name in ("base", "math"):
        c = json.loads((pool.path(name) / "config.json").read_text())
        assert c["architectures"] == ["Qwen2ForCausalLM"] and c["tie_word_embeddings"] is True
        assert (c["num_attention_heads"], c["num_key_value_heads"]) == (2, 1)
        w = load_file(str(pool.path(name) / "model.safetensors"))
        assert "lm_head.weight" not in w and w["model.layers.0.self_attn.q_proj.bias"].shape == (64,)
        assert w["model.layers.0.self_attn.k_proj.weight"].shape == (32, 64)  # one key/value head
    ties = build_merges(cfg, pool, tmp_path / "work")["ties"]
    model, _ = load_causal_lm(ties)
    assert type(model).__name__ == "Qwen2ForCausalLM"
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    base_w = load_file(str(pool.base / "model.safetensors"))["model.embed_tokens.weight"]
    assert not torch.equal(model.model.embed_tokens.weight, base_w)  # merged, not copied
    assert "architecture" not in pool_config_key(PoolConfig())["tiny"]
    # PoolConfig()'s dump hashed before the field existed (git b9025f2)
    assert stable_hash(pool_config_key(PoolConfig())) == "8a0d2e29b1de16c7"
