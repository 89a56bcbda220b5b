"""Causal-LM training on packed token streams (pretraining and expert fine-tuning)."""

from __future__ import annotations

import logging
import math
import random
import time

import torch
from tqdm.auto import tqdm

from darts_bench.data import strip_calculator
from darts_bench.evaluate.hf_model import DEFAULT_TEMPLATE

log = logging.getLogger(__name__)

# a log line every this many steps: the tqdm bar is off in a non-tty log (a long pool build was silent for 77 min)
LOG_EVERY = 10


def expert_texts(records: list[dict], fmt: str, eos: str, chat) -> list[str]:
    """Training documents of one expert, each ending with ``eos``.

    ``fmt`` ``gsm8k``: ``"Question: {q}\\nAnswer: {a}"`` (lm-eval's GSM8K format);
    ``alpaca``: ``chat(user message) + output``.
    """
    from darts_bench.data import alpaca_text

    out = []
    for r in records:
        if fmt == "gsm8k":
            out.append(f"Question: {r['question']}\nAnswer: {strip_calculator(r['answer'])}{eos}")
        else:
            if not str(r.get("output", "")).strip():
                continue
            out.append(chat(alpaca_text(r)) + r["output"] + eos)
    return out


def alpaca_chat(user: str) -> str:
    return DEFAULT_TEMPLATE.format(instruction=user)


def pack(token_lists: list[list[int]], seq_len: int) -> torch.Tensor:
    """Concatenate documents and cut into ``[n_chunks, seq_len]`` int64 (last partial chunk dropped)."""
    flat = [t for ids in token_lists for t in ids]
    n = len(flat) // seq_len
    if n == 0:
        raise ValueError(f"not enough tokens ({len(flat)}) for one sequence of {seq_len}")
    return torch.tensor(flat[: n * seq_len], dtype=torch.long).view(n, seq_len)


def train_causal_lm(model, chunks: torch.Tensor, *, steps: int, batch_size: int, lr: float, seed: int,
                    desc: str, warmup: int | None = None) -> list[float]:
    """AdamW (betas 0.9/0.95, wd 0.1), linear warmup then cosine decay, grad clip 1.0.

    Args:
        chunks: ``[n, seq_len]`` int64 token ids; batches are drawn with a generator seeded by ``seed``.
    Returns:
        per-step training loss (nats/token).
    Raises:
        FloatingPointError: the loss became NaN/inf.
    """
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    warmup = warmup if warmup is not None else max(1, steps // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps)))
    model.train()
    losses = []
    bar = tqdm(range(steps), desc=desc, leave=False, mininterval=2.0)
    t0 = time.perf_counter()
    for step in bar:
        idx = torch.randint(0, chunks.shape[0], (batch_size,), generator=g)
        x = chunks[idx]
        loss = model(input_ids=x, labels=x).loss
        if not torch.isfinite(loss):
            raise FloatingPointError(f"{desc}: training loss is {loss.item()} at step {step}")
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
        if step % 20 == 0:
            bar.set_postfix(loss=f"{loss.item():.3f}")
        if (step + 1) % LOG_EVERY == 0 or step + 1 == steps:
            el = time.perf_counter() - t0
            log.info("%s: step %d/%d, loss %.4f nats/token, %.1f s/step, %.0f s elapsed", desc, step + 1, steps,
                     losses[-1], el / (step + 1), el)
    model.eval()
    return losses


def sample_records(records: list, n: int, seed: int) -> list:
    rng = random.Random(seed)
    idx = list(range(len(records)))
    rng.shuffle(idx)
    return [records[i] for i in idx[:n]]
