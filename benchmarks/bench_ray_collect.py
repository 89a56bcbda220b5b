"""Feature collection throughput: local executor vs Ray with 1 and 2 actors, in one run.

A random tiny Llama (hidden 128, 4 layers, vocab 4096; built in a temp dir, no hub) computes final
hidden states + next-token entropy (the ``features`` op of ``collect``) for 64 sequences of 256
tokens in shards of 8 sequences (batch 8). Every configuration uses one torch thread per worker
(``num_cpus_per_actor`` 1 for Ray), so the 1-actor figure against the local one is the price of Ray
itself (scheduling, serialization, the object store) and the 2-actor one shows the scaling.

For each: ``cold`` = the first ``map`` call (workers start and load the model), ``warm`` = a second
call on the same workers (``RayExecutor(keep_idle=True)`` keeps the actors and their models; the
local executor reloads its in-process model, about 0.1 s here). Ray's own start-up (``ray.init``) is timed separately. All results are checked to be
bitwise equal to the local ones.

    .venv/bin/python benchmarks/bench_ray_collect.py [--n-seqs 64] [--seq-len 256]

About a minute on two cores.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from darts_bench.config import CalibrationConfig, Config, RayConfig  # noqa: E402
from darts_bench.executors.local import LocalExecutor  # noqa: E402


def build_checkpoint(out: Path, vocab: int = 4096, hidden: int = 128, layers: int = 4, seed: int = 0) -> int:
    """A random Llama + byte-level BPE tokenizer (trained on random words); returns the tokenizer size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    rng = random.Random(seed)
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9)))
             for _ in range(6000)]
    texts = [" ".join(rng.choices(words, k=40)) for _ in range(800)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainer=trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=["<|endoftext|>", "<|pad|>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", bos_token="<|endoftext|>",
                                   pad_token="<|pad|>", padding_side="left")
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=344, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=512,
                      bos_token_id=fast.eos_token_id, eos_token_id=fast.eos_token_id, pad_token_id=fast.pad_token_id)
    model = LlamaForCausalLM(cfg).eval()
    model.generation_config = GenerationConfig(eos_token_id=fast.eos_token_id, pad_token_id=fast.pad_token_id)
    model.save_pretrained(out, safe_serialization=True)
    fast.save_pretrained(out)
    return len(fast)


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def same(a: list[dict], b: list[dict]) -> bool:
    return all(np.array_equal(x[k], y[k]) for x, y in zip(a, b) for k in y)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n-seqs", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--shard-size", type=int, default=8)
    ap.add_argument("--batch-size", type=int, default=8)
    args = ap.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    tmp = Path(tempfile.mkdtemp(prefix="bench-ray-"))
    try:
        run(args, tmp / "model")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def run(args, ckpt: Path) -> None:
    n_tok = build_checkpoint(ckpt)
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(2, n_tok, (args.seq_len,), generator=g).tolist() for _ in range(args.n_seqs)]
    payloads = [{"sequences": seqs[i:i + args.shard_size]} for i in range(0, len(seqs), args.shard_size)]
    tokens = args.n_seqs * args.seq_len
    rows: list[tuple[str, float, float]] = []

    threads = torch.get_num_threads()
    local = LocalExecutor(batch_size=args.batch_size, torch_threads=1)
    t_cold, ref = timed(lambda: local.map(str(ckpt), "features", payloads))
    t_warm, _ = timed(lambda: local.map(str(ckpt), "features", payloads))
    rows.append(("local (1 thread)", t_cold, t_warm))
    torch.set_num_threads(threads)

    import ray

    from darts_bench.executors.ray_executor import RayExecutor
    from darts_bench.ray_instance import init_ray

    t_init, _ = timed(lambda: init_ray(None, num_cpus=2))
    identical = True
    try:
        for n in (1, 2):
            cfg = Config(calibration=CalibrationConfig(batch_size=args.batch_size), torch_threads=1,
                         ray=RayConfig(num_actors=n, num_cpus_per_actor=1, shard_size=args.shard_size))
            ex = RayExecutor(cfg, keep_idle=True)  # warm = the same actors, models loaded
            try:
                t_cold, got = timed(lambda: ex.map(str(ckpt), "features", payloads))
                t_warm, got2 = timed(lambda: ex.map(str(ckpt), "features", payloads))
                identical &= same(got, ref) and same(got2, ref)
            finally:
                ex.close()
            rows.append((f"ray, {n} actor{'s' if n > 1 else ''}", t_cold, t_warm))
    finally:
        ray.shutdown()

    print(f"features of {args.n_seqs} x {args.seq_len} tokens ({tokens} tokens), shards of {args.shard_size}, "
          f"batch {args.batch_size}, hidden 128, 4 layers, vocab 4096; {os.cpu_count()} CPUs")
    print(f"ray.init (local, loopback): {t_init:.1f} s")
    print(f"{'executor':<18} {'cold s':>8} {'cold tok/s':>11} {'warm s':>8} {'warm tok/s':>11}")
    for name, c, w in rows:
        print(f"{name:<18} {c:>8.2f} {tokens / c:>11.0f} {w:>8.2f} {tokens / w:>11.0f}")
    loc, r1, r2 = rows
    print(f"ray overhead ratio (ray_1_actor_time / local_time): cold {r1[1] / loc[1]:.2f}, warm {r1[2] / loc[2]:.2f}")
    print(f"2-actor speed-up over 1 actor (warm): {r1[2] / r2[2]:.2f}x")
    print(f"outputs bitwise identical to local: {identical}")


if __name__ == "__main__":
    main()
