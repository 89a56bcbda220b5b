"""A pool of one's own for the tests: a tiny random Llama base and experts of any names, saved the way
users bring them (bfloat16, several safetensors shards with their index, tokenizer beside)."""

from __future__ import annotations

from pathlib import Path

TEXTS = ["def add(a, b):\n    return a + b", "Natalia sold 48 clips. How many? #### 72",
         "Write a poem about the sea.", "### Instruction:\nSay hi.\n\n### Response:\nHi!"]


def tiny_model(vocab: int, seed: int, hidden: int = 32):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                      max_position_embeddings=1024)
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg).eval()


def save(model, tok, out: Path, shard: str = "40KB") -> Path:
    """``model`` in bfloat16 as several shards (``max_shard_size``) with ``tok`` beside it."""
    import torch
    from transformers import GenerationConfig

    model = model.to(torch.bfloat16)
    model.config.eos_token_id = model.config.bos_token_id = tok.eos_token_id
    model.config.pad_token_id = tok.pad_token_id
    model.generation_config = GenerationConfig(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                                               bos_token_id=tok.eos_token_id, do_sample=False)
    model.save_pretrained(out, safe_serialization=True, max_shard_size=shard)
    tok.save_pretrained(out)
    return out


def build_own_pool(root: Path, names=("coder", "mathy", "chatty", "extra"), texts=TEXTS) -> dict[str, Path]:
    """``{"base": dir, name: dir ...}``: a random base and one expert per name (the base plus small noise,
    its own seed), each bfloat16 in several shards."""
    import torch

    from darts_bench.pool.tiny import train_tokenizer

    tok = train_tokenizer(list(texts) * 20, 300)
    base = tiny_model(len(tok), 0)
    out = {"base": save(base, tok, root / "base")}
    for i, name in enumerate(names):
        expert = tiny_model(len(tok), 0)
        g = torch.Generator().manual_seed(i + 1)
        with torch.no_grad():
            for p in expert.parameters():
                p.add_(0.02 * torch.randn(p.shape, generator=g))
        out[name] = save(expert, tok, root / name)
    return out
