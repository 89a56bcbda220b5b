"""The ``tiny`` pool, built on this machine and deterministic from a seed.

1. A byte-level BPE tokenizer (``tokenizers``) trained on the experts' training data.
2. A small ``LlamaForCausalLM`` base (``tiny.architecture: qwen2``: a ``Qwen2ForCausalLM`` with
   q/k/v biases and tied input/output embeddings, the shape of Qwen2/2.5's small models) pretrained
   on an even mix of that data.
3. Three experts fully fine-tuned from the base: ``code`` (Code Alpaca), ``math`` (GSM8K train),
   ``instruction`` (Alpaca subset).
All saved as ordinary HF checkpoints (safetensors, tokenizer, generation_config).
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, Qwen2Config,
                          Qwen2ForCausalLM)

from darts_bench.config import EXPERT_NAMES, PoolConfig
from darts_bench.data import EXPERT_DATA, load_expert_records
from darts_bench.pool.training import alpaca_chat, expert_texts, pack, sample_records, train_causal_lm

log = logging.getLogger("darts_bench")

EOS, PAD = "<|endoftext|>", "<|pad|>"
CHAT_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'user' %}### Instruction:\n{{ m['content'] }}\n\n"
    "### Response:\n{% elif m['role'] == 'assistant' %}{{ m['content'] }}" + EOS + "{% endif %}{% endfor %}"
)


def train_tokenizer(texts: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """Byte-level BPE with ``<|endoftext|>`` (eos/bos) and ``<|pad|>``, no BOS added, the tiny
    chat template (Alpaca ``### Instruction / ### Response`` format)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS, PAD], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, bos_token=EOS, pad_token=PAD,
                                   unk_token=None, padding_side="left", model_max_length=4096)
    fast.chat_template = CHAT_TEMPLATE
    return fast


# tiny.architecture -> (config class, model class, architecture-specific config fields)
ARCHITECTURES = {
    "llama": (LlamaConfig, LlamaForCausalLM, {"tie_word_embeddings": False}),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, {"tie_word_embeddings": True, "use_sliding_window": False}),
}


def _generation_config(tok) -> GenerationConfig:
    return GenerationConfig(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                            bos_token_id=tok.eos_token_id, do_sample=False)


def _save(model, tok, out: Path) -> None:
    model.generation_config = _generation_config(tok)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)


def build_tiny_pool(cfg: PoolConfig, data_dir: Path | None, out: Path) -> dict:
    """Build tokenizer, base and experts into ``out/{base,code,math,instruction}``.

    Returns:
        build report: seconds per stage, parameter count, final training losses.
    Raises:
        DataError: expert data missing or malformed.
    """
    t = cfg.tiny
    report: dict = {"seconds": {}}
    t0 = time.perf_counter()
    docs: dict[str, list[str]] = {}
    for e in EXPERT_NAMES:
        recs = sample_records(load_expert_records(data_dir, e), t.max_train_examples, cfg.seed)
        docs[e] = expert_texts(recs, EXPERT_DATA[e][1], EOS, alpaca_chat)
    tok_texts = [d for e in EXPERT_NAMES for d in docs[e][: t.tokenizer_train_examples]]
    tok = train_tokenizer(tok_texts, t.vocab_size)
    report["seconds"]["tokenizer"] = time.perf_counter() - t0

    config_cls, model_cls, arch_kw = ARCHITECTURES[t.architecture]
    mcfg = config_cls(
        vocab_size=len(tok), hidden_size=t.hidden_size, intermediate_size=t.intermediate_size,
        num_hidden_layers=t.num_hidden_layers, num_attention_heads=t.num_attention_heads,
        num_key_value_heads=t.num_key_value_heads, max_position_embeddings=t.max_position_embeddings,
        rms_norm_eps=1e-5, bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id, **arch_kw)
    torch.manual_seed(cfg.seed)
    base = model_cls(mcfg)
    report["n_params"] = sum(p.numel() for p in base.parameters())  # tied embeddings counted once

    enc = {e: [tok(d, add_special_tokens=False)["input_ids"] for d in docs[e]] for e in EXPERT_NAMES}
    chunks = {e: pack(enc[e], t.seq_len) for e in EXPERT_NAMES}
    n_min = min(c.shape[0] for c in chunks.values())
    mix = torch.cat([c[:n_min] for c in chunks.values()])  # an even mix of the three domains
    t1 = time.perf_counter()
    losses = train_causal_lm(base, mix, steps=t.pretrain_steps, batch_size=t.batch_size,
                             lr=t.pretrain_lr, seed=cfg.seed, desc="pretrain base")
    report["seconds"]["pretrain"] = time.perf_counter() - t1
    report["loss"] = {"base": losses[-1]}
    _save(base, tok, out / "base")
    for i, e in enumerate(EXPERT_NAMES):
        t2 = time.perf_counter()
        expert = model_cls.from_pretrained(out / "base", dtype=torch.float32)
        losses = train_causal_lm(expert, chunks[e], steps=t.finetune_steps, batch_size=t.batch_size,
                                 lr=t.finetune_lr, seed=cfg.seed + 1 + i, desc=f"fine-tune {e}", warmup=10)
        report["loss"][e] = losses[-1]
        _save(expert, tok, out / e)
        report["seconds"][f"finetune_{e}"] = time.perf_counter() - t2
    report["seconds"]["total"] = time.perf_counter() - t0
    (out / "build_report.json").write_text(json.dumps(report, indent=1))
    log.info("tiny pool: %d params, built in %.0f s", report["n_params"], report["seconds"]["total"])
    return report
