"""Device check for the CUDA path (run on a GPU machine; needs torch, transformers, tokenizers,
safetensors only). Checks on a random Llama on the GPU that a DARTS head attached by hooks keeps
``generate()`` exact (KV-cached == uncached, left-padded batch == single prompts), that feature
collection on the GPU matches the CPU, and measures the DARTS head's per-token overhead in
batched generation. Prints JSON and writes it to ``$OUT/gpu_check.json`` when ``OUT`` is set.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM  # noqa: E402

from darts_bench.evaluate.hf_model import HFTextModel  # noqa: E402
from darts_bench.executors.worker import hidden_state_features  # noqa: E402
from darts_bench.surgery.corrected import corrected  # noqa: E402
from darts_bench.surgery.heads import build_head  # noqa: E402

PROMPTS = ["def fib(n):", "Question: Tom has 3 apples and buys 5 more. How many?\nAnswer:", "Hi",
           "Write a short story about a robot who learns to paint, in three sentences."]


def train_tokenizer(texts, vocab_size):
    """Byte-level BPE as the tiny pool's (inlined: darts_bench.pool needs pydantic)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    t = Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    t.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>", "<|pad|>"],
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                      show_progress=False))
    return PreTrainedTokenizerFast(tokenizer_object=t, eos_token="<|endoftext|>", pad_token="<|pad|>")


def model_and_tok(hidden: int, layers: int, device: str, dtype=torch.float32):
    tok = train_tokenizer(PROMPTS * 50 + ["the quick brown fox jumps over the lazy dog " * 5] * 50, 2048)
    tok.padding_side = "left"
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=hidden, intermediate_size=hidden * 2, num_hidden_layers=layers,
                      num_attention_heads=max(1, hidden // 64), num_key_value_heads=max(1, hidden // 128),
                      tie_word_embeddings=False, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                      bos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    m = LlamaForCausalLM(cfg).to(device=device, dtype=dtype).eval()
    return m, tok


def head_for(d: int, device: str, dtype=torch.float32):
    head = build_head("darts", d, rank=16, max_len=64, seed=1)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        head.up.weight.copy_(torch.randn(head.up.weight.shape, generator=g) * 0.5)
        head.pos_bias.copy_(torch.randn(head.pos_bias.shape, generator=g))
    return head.to(device=device, dtype=dtype)


def gen(m, tok, prompts, n=24, use_cache=True):
    enc = tok(prompts, return_tensors="pt", padding=True).to(m.device)
    cfg = GenerationConfig(max_new_tokens=n, do_sample=False, use_cache=use_cache, pad_token_id=tok.pad_token_id,
                           eos_token_id=None)
    return m.generate(**enc, generation_config=cfg)[:, enc["input_ids"].shape[1]:].tolist()


def main() -> None:
    dev = "cuda"
    out: dict = {"torch": torch.__version__, "device": torch.cuda.get_device_name(0)}
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    m, tok = model_and_tok(256, 4, dev)
    head = head_for(256, dev)
    with corrected(m, head):
        cached = gen(m, tok, PROMPTS)
        uncached = gen(m, tok, PROMPTS, use_cache=False)
        singles = [gen(m, tok, [p])[0] for p in PROMPTS]
    plain = gen(m, tok, PROMPTS)
    out["cached_equals_uncached"] = cached == uncached
    out["batched_equals_single"] = cached == singles
    out["head_changes_output"] = cached != plain
    # features on GPU vs CPU
    seqs = [tok(p)["input_ids"] + s for p, s in zip(PROMPTS, cached)]
    fg = hidden_state_features(m, seqs, tok.pad_token_id, batch_size=4)
    mc = m.to("cpu")
    fc = hidden_state_features(mc, seqs, tok.pad_token_id, batch_size=4)
    out["features_max_abs_diff_gpu_vs_cpu"] = float((fg["h"] - fc["h"]).abs().max())
    out["entropy_max_abs_diff_gpu_vs_cpu"] = float((fg["entropy"] - fc["entropy"]).abs().max())
    out["positions_equal"] = bool(torch.equal(fg["positions"], fc["positions"]))
    del mc
    # overhead of a DARTS head in batched generation, bf16, a 0.5B-ish model
    big, btok = model_and_tok(1024, 16, dev, torch.bfloat16)
    bhead = head_for(1024, dev, torch.bfloat16)
    prompts = [PROMPTS[i % 4] for i in range(32)]
    big.generation_config.eos_token_id = None  # always 128 new tokens: equal work in both arms
    plain_tm = HFTextModel("plain", big, btok, batch_size=32)
    times = {"plain": [], "darts": []}
    gen_kw = dict(max_new_tokens=128)
    for _ in range(2):  # warm-up
        plain_tm.generate_ids(prompts, **gen_kw)
    for r in range(5):
        for name in ("plain", "darts") if r % 2 == 0 else ("darts", "plain"):
            ctx = corrected(big, bhead if name == "darts" else None)
            with ctx:
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                plain_tm.generate_ids(prompts, **gen_kw)
                torch.cuda.synchronize()
                times[name].append(time.perf_counter() - t0)
    ntok = 32 * 128
    tp, td = statistics.median(times["plain"]), statistics.median(times["darts"])
    out["gen_bf16_params"] = sum(p.numel() for p in big.parameters())
    out["gen_tokens_per_s_plain"] = ntok / tp
    out["gen_tokens_per_s_darts"] = ntok / td
    out["darts_overhead_ratio"] = td / tp
    print(json.dumps(out, indent=1))
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "gpu_check.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
